"""KV tiers: unit format (bit-exact round trips, every corruption refused), queue-aware RAM and disk stores
(eviction order, budgets, atomic writes, restart, corruption), the RAM-over-disk facade, and an engine whose
paused conversations live only in the tiers. Run with -s to see the measured throughput."""

from __future__ import annotations

import json
import math
import struct
import threading
import time
import uuid
import zlib

import fsspec
import numpy as np
import pytest

from decapybara.backend.base import HybridState, KVPageData
from decapybara.backend.kv_codec import codec_for
from decapybara.engine.loopguard import LoopGuard, LoopGuardConfig, LoopGuardState
from decapybara.kv import disk_tier
from decapybara.kv.disk_tier import DiskTierStore
from decapybara.kv.ram_tier import RamTierStore
from decapybara.kv.tiers import KVTiers
from decapybara.kv.units import (
    FIXED_FORMAT,
    FIXED_SIZE,
    MAGIC,
    Unit,
    UnitCorrupt,
    UnitKind,
    conv_key,
    decode_unit,
    encode_unit,
    encoded_size,
    is_valid_key,
    page_key,
    read_header,
)


# ---- helpers ---------------------------------------------------------------------------------------------
def kv_arrays(rng: np.random.Generator, n_pages: int, kv_mode: str | None, page_size: int = 8,
              heads: int = 2, head_dim: int = 32) -> dict[str, np.ndarray]:
    """KV pages of two attention layers in a KV mode's real storage parts (via the codecs)."""
    codec = codec_for(kv_mode)
    out = {}
    for layer in (3, ("mtp", 0)):
        for kv in ("k", "v"):
            x = rng.standard_normal((n_pages, page_size, heads, head_dim)).astype(np.float32)
            for part, a in codec.encode(x, kv).items():
                out[f"{layer}|{kv}.{part}"] = np.ascontiguousarray(a)
    return out


def hybrid_state(rng: np.random.Generator, layers: int = 3) -> HybridState:
    return HybridState([rng.standard_normal((24, 3)).astype(np.float32) for _ in range(layers)],
                       [rng.standard_normal((4, 16, 16)).astype(np.float32) for _ in range(layers)])


def small_unit(key: str = "conv/agent-1/0", seed: int = 0, n_pages: int = 2, meta: dict | None = None) -> Unit:
    rng = np.random.default_rng(seed)
    return Unit.conversation(key, KVPageData(kv_arrays(rng, n_pages, "6/4")), hybrid_state(rng, 2),
                             n_pages * 8 - 3, meta if meta is not None else {"seed": seed},
                             {"tokens": rng.integers(0, 512, n_pages * 8 - 3).astype(np.int32)})


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def assert_same_unit(a: Unit, b: Unit) -> None:
    assert (a.key, a.kind, a.num_tokens, a.page_hash) == (b.key, b.kind, b.num_tokens, b.page_hash)
    assert json.loads(json.dumps(a.meta)) == b.meta
    assert a.kv.arrays.keys() == b.kv.arrays.keys() and a.extras.keys() == b.extras.keys()
    assert all(same_bits(a.kv.arrays[k], b.kv.arrays[k]) for k in a.kv.arrays)
    assert all(same_bits(a.extras[k], b.extras[k]) for k in a.extras)
    assert (a.state is None) == (b.state is None)
    if a.state is not None:
        assert len(a.state.conv) == len(b.state.conv) and len(a.state.recurrent) == len(b.state.recurrent)
        assert all(same_bits(x, y) for x, y in zip(a.state.conv + a.state.recurrent, b.state.conv + b.state.recurrent))


def reseal(buf: bytes, edit) -> bytes:
    """Apply `edit` to the header JSON of an encoded unit (it may return raw bytes instead) and fix the header
    checksum: a consistent unit whose content is wrong. The JSON may grow into the padding after it."""
    _, version, kind, n, json_len, total, _ = struct.unpack_from(FIXED_FORMAT, buf)
    header = json.loads(buf[FIXED_SIZE:FIXED_SIZE + json_len])
    first = min(e["offset"] for e in header["arrays"])
    new = edit(header)
    raw = new if isinstance(new, bytes) else json.dumps(header, separators=(",", ":")).encode()
    raw = raw.ljust(json_len)
    assert FIXED_SIZE + len(raw) <= first, "edited header does not fit"
    if isinstance(header, dict) and isinstance(header.get("arrays"), list):
        n = len(header["arrays"])
    fixed = struct.pack(FIXED_FORMAT, MAGIC, version, kind, n, len(raw), total, 0)[:FIXED_SIZE - 4]
    body = bytes(fixed + struct.pack("<I", zlib.crc32(raw, zlib.crc32(fixed))) + raw)
    return body + buf[len(body):]


# ---- units -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kv_mode", [None, "16/16", "8/8", "6/4", "4/4"])
def test_unit_round_trip_is_bit_exact_in_every_kv_mode(kv_mode):
    rng = np.random.default_rng(1)
    kv = kv_arrays(rng, 3, kv_mode)
    if kv_mode is None:  # special float bit patterns survive too
        kv["3|k.x"].reshape(-1)[:5] = [np.nan, -0.0, np.inf, -np.inf, 1e-45]
    guard = LoopGuard(LoopGuardConfig().validate())
    for t in [5, 6, 7] * 20:
        guard.observe(t, "ab", False)
    meta = {"loopguard": guard.state.to_dict(), "seed": 2**62 + 1, "sampler": {"penalty": 1.25, "banned": (1, 2)},
            "text": "naïve 🦫"}
    unit = Unit.conversation("conv/agent/3", KVPageData(kv), hybrid_state(rng), 21, meta,
                             {"tokens": np.arange(21, dtype=np.int32), "hashes": rng.integers(0, 256, (2, 16), np.uint8)})
    back = decode_unit(encode_unit(unit))
    assert_same_unit(unit, back)
    assert back.kind == UnitKind.CONV and back.to_bundle().num_tokens == 21
    assert LoopGuardState.from_dict(back.meta["loopguard"]) == guard.state
    assert back.meta["sampler"]["banned"] == [1, 2]  # JSON: tuples come back as lists


def test_zero_length_odd_shapes_and_empty_states_round_trip():
    rng = np.random.default_rng(2)
    kv = {"a": np.zeros((0, 8, 2, 16), np.float32), "b": rng.integers(0, 7, (3, 5, 7), np.uint8),
          "c": np.array(7, np.int64), "d": rng.standard_normal((1, 1, 1, 3)).astype(">f4"),  # big-endian input
          "e": np.zeros((0,), np.uint16), "f": rng.integers(0, 2, 13).astype(bool),
          "g": rng.standard_normal((5, 3)).astype(np.float64)[:, ::2]}  # non-contiguous input
    for state in (None, HybridState([], []), hybrid_state(rng, 1)):
        unit = Unit.conversation("conv/x/0", KVPageData(dict(kv)), state, 0)
        back = decode_unit(bytes(encode_unit(unit)))
        assert back.state is None if state is None else len(back.state.conv) == len(state.conv)
        for k, a in kv.items():
            b = back.kv.arrays[k]
            assert b.shape == a.shape and b.dtype == a.dtype.newbyteorder("<") and np.array_equal(a, b)
    empty = Unit.conversation("conv/x/1", KVPageData(), None, 0)
    assert_same_unit(empty, decode_unit(encode_unit(empty)))


def test_page_unit_is_keyed_by_salt_and_content_hash():
    rng = np.random.default_rng(3)
    h = bytes(range(16))
    unit = Unit.page(b"qwen3_5_text|6/4|512", h, KVPageData(kv_arrays(rng, 1, "6/4")), hybrid_state(rng), 512)
    assert unit.key == page_key(b"qwen3_5_text|6/4|512", h) and unit.key.endswith("/" + h.hex())
    assert unit.key != page_key(b"qwen3_5_text|8/8|512", h)
    back = decode_unit(encode_unit(unit))
    assert_same_unit(unit, back)
    assert back.kind == UnitKind.PAGE and back.page_hash == h


def test_decoded_arrays_are_views_of_the_buffer():
    buf = bytes(encode_unit(small_unit()))
    unit = decode_unit(buf)
    whole = np.frombuffer(buf, np.uint8)
    arrays = list(unit.kv.arrays.values()) + unit.state.conv + unit.state.recurrent + list(unit.extras.values())
    assert all(np.shares_memory(a, whole) and not a.flags.writeable for a in arrays)
    assert unit.buffer is buf


def test_encoding_into_a_reused_buffer_gives_the_same_bytes():
    unit = small_unit()
    fresh = bytes(encode_unit(unit))
    assert encoded_size(unit) == len(fresh)
    staging = np.full(len(fresh) + 100, 0xAB, np.uint8)  # dirty memory: padding must still come out zero
    view = encode_unit(unit, out=staging)
    assert bytes(view) == fresh and np.shares_memory(np.frombuffer(view, np.uint8), staging)
    with pytest.raises(ValueError):
        encode_unit(unit, out=bytearray(len(fresh) - 1))
    with pytest.raises(ValueError):
        encode_unit(unit, out=bytes(len(fresh)))  # read-only


def test_keys_are_stable_safe_names():
    assert conv_key("agent-7", 3) == "conv/agent-7/3"
    weird = conv_key("../../etc/passwd \u00e9" + "x" * 300, 1)
    assert weird == conv_key("../../etc/passwd \u00e9" + "x" * 300, 1) and is_valid_key(weird)
    assert "/.." not in weird and conv_key("~abc", 0) != "conv/~abc/0"
    assert not is_valid_key("conv/../x") and not is_valid_key("") and not is_valid_key("a//b")


def test_encode_refuses_what_it_cannot_represent():
    for bad in (Unit.conversation("conv/a/0", KVPageData({"o": np.array([object()])}), None, 0),
                Unit.conversation("conv/a/0", KVPageData(), None, 0, {"x": object()}),
                Unit.conversation("bad key/0", KVPageData(), None, 0),
                Unit.conversation("conv/a/0", KVPageData(), HybridState([np.zeros(2)], []), 0)):
        with pytest.raises(ValueError):
            encode_unit(bad)


def test_every_single_byte_flip_and_every_truncation_is_detected():
    buf = bytes(encode_unit(small_unit(n_pages=1)))
    rng = np.random.default_rng(4)
    for i in range(len(buf)):  # crc32 catches every error burst of <= 32 bits; padding must be zero
        damaged = bytearray(buf)
        damaged[i] ^= int(rng.integers(1, 256))
        with pytest.raises(UnitCorrupt):
            decode_unit(damaged)
    problems = set()
    for n in range(len(buf)):
        with pytest.raises(UnitCorrupt) as e:
            decode_unit(buf[:n])
        problems.add(e.value.problem)
    assert problems == {"truncated"}
    with pytest.raises(UnitCorrupt, match="bad_size"):
        decode_unit(buf + b"\0")


def test_random_damage_raises_unit_corrupt_or_returns_identical_data():
    unit = small_unit(n_pages=2)
    buf = bytes(encode_unit(unit))
    rng = np.random.default_rng(5)
    outcomes = {"corrupt": 0, "identical": 0}
    for trial in range(600):
        damaged = bytearray(buf)
        how = trial % 4
        if how == 0:  # scattered byte flips
            for i in rng.integers(0, len(buf), int(rng.integers(1, 9))):
                damaged[i] ^= int(rng.integers(1, 256))
        elif how == 1:  # a random run overwritten
            i = int(rng.integers(0, len(buf)))
            n = int(rng.integers(1, 200))
            damaged[i:i + n] = rng.integers(0, 256, len(damaged[i:i + n]), np.uint8).tobytes()
        elif how == 2:  # truncated, then garbage appended
            damaged = damaged[:int(rng.integers(0, len(buf)))] + rng.bytes(int(rng.integers(0, 64)))
        else:  # pure garbage, sometimes with our magic
            damaged = bytearray((MAGIC if trial % 8 == 3 else b"") + rng.bytes(int(rng.integers(0, 400))))
        try:
            back = decode_unit(bytes(damaged))
        except UnitCorrupt:
            outcomes["corrupt"] += 1
        else:  # only possible if the damage left the bytes unchanged
            assert_same_unit(unit, back)
            outcomes["identical"] += 1
    assert outcomes["corrupt"] >= 590


@pytest.mark.parametrize("edit, problem", [
    (lambda h: b"[1, 2", "bad_json"),
    (lambda h: b"[" * 1700, "bad_json"),  # nested past Python's recursion limit
    (lambda h: b"\xff\xfe", "bad_json"),
    (lambda h: b"[]", "bad_json"),
    (lambda h: h.pop("meta"), "bad_json"),
    (lambda h: h.update(key="../escape"), "bad_json"),
    (lambda h: h.update(num_tokens=-1), "bad_json"),
    (lambda h: h.update(page_hash="zz"), "bad_json"),
    (lambda h: h.update(state_layers=5), "bad_layout"),
    (lambda h: h["arrays"][0].update(dtype="|O"), "bad_json"),
    (lambda h: h["arrays"][0].update(dtype=">f4"), "bad_json"),
    (lambda h: h["arrays"][0].update(shape=[-1, 2]), "bad_json"),
    (lambda h: h["arrays"][0].update(shape=[1] * 33), "bad_json"),
    (lambda h: h["arrays"][0].update(shape=[10 ** 12, 10 ** 12]), "bad_layout"),
    (lambda h: h["arrays"][0].update(group="evil"), "bad_json"),
    (lambda h: h["arrays"][0].update(offset=True), "bad_json"),
    (lambda h: h["arrays"][1].update(offset=h["arrays"][0]["offset"]), "bad_layout"),
    (lambda h: h["arrays"][-1].update(offset=h["arrays"][-1]["offset"] + 64), "bad_layout"),
    (lambda h: h["arrays"][0].update(offset=h["arrays"][0]["offset"] + 1), "bad_layout"),
    (lambda h: h["arrays"][0].update(crc32=h["arrays"][0]["crc32"] ^ 1), "bad_checksum"),
    (lambda h: h["arrays"][1].update(name=h["arrays"][0]["name"]), "bad_layout"),
    (lambda h: h["arrays"].pop(), "bad_layout"),
])
def test_consistent_but_wrong_headers_are_refused(edit, problem):
    buf = bytes(encode_unit(small_unit(n_pages=1)))
    with pytest.raises(UnitCorrupt) as e:
        decode_unit(reseal(buf, edit))
    assert e.value.problem == problem


def test_fixed_header_fields_are_checked():
    buf = bytearray(encode_unit(small_unit(n_pages=1)))
    for offset, value, problem in [(0, b"X", "bad_magic"), (8, b"\x07", "unknown_version"),
                                   (10, b"\x09", "bad_checksum"), (20, b"\xff", "truncated")]:
        damaged = bytearray(buf)
        damaged[offset:offset + len(value)] = value
        with pytest.raises(UnitCorrupt) as e:
            decode_unit(damaged)
        assert e.value.problem == problem


# ---- queue-aware RAM tier ----------------------------------------------------------------------------------
def keys_of(spilled) -> list[str]:
    return [s.key for s in spilled]


def test_ram_evicts_the_unit_needed_last_then_the_least_recently_used():
    ram = RamTierStore(100)
    assert keys_of(ram.put("a", "A", 30, 5)) == []
    assert keys_of(ram.put("b", "B", 30, 50)) == []
    assert keys_of(ram.put("c", "C", 30, None)) == []
    spilled = ram.put("d", "D", 30, 10)
    assert keys_of(spilled) == ["c"] and spilled[0].handle == "C" and spilled[0].next_use is None  # unknown = never
    assert keys_of(ram.put("e", "E", 30, 20)) == ["b"]
    assert keys_of(ram.put("f", "F", 30, 20)) == ["e"]  # tie on next_use: least recently used
    assert keys_of(ram.put("g", "G", 30, None)) == ["g"]  # needed last itself: straight down a tier
    assert sorted(ram.keys()) == ["a", "d", "f"] and ram.used_bytes == 90
    assert ram.update_next_use("a", 100) and keys_of(ram.put("h", "H", 30, 1)) == ["a"]
    assert ram.update_next_use("d", 20)  # d and f tie at 20; d is older ...
    assert ram.eviction_order() == ["d", "f", "h"]
    assert ram.get("d") == "D"  # ... until it is used
    assert ram.eviction_order() == ["f", "d", "h"]
    assert keys_of(ram.put("i", "I", 30, 0)) == ["f"]
    # d(20) + h(1) + i(0) hold 90 bytes; a 60-byte unit needed at 2 would displace d, then be the next victim
    # itself: it is refused and d stays.
    assert keys_of(ram.put("big", "BIG", 60, 2)) == ["big"] and sorted(ram.keys()) == ["d", "h", "i"]
    assert keys_of(ram.put("huge", "HUGE", 101, 0)) == ["huge"] and ram.used_bytes == 90  # over budget alone
    assert ram.pop("h") == "H" and ram.get("h") is None and ram.used_bytes == 60
    assert keys_of(ram.set_budget(35)) == ["d"] and ram.keys() == ["i"] and ram.used_bytes == 30


class ReferenceRam:
    """The eviction rule written the obvious way (O(n) scans)."""

    def __init__(self, budget: int) -> None:
        self.budget, self.items, self.clock = budget, {}, 0

    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def put(self, key, size, nu):
        self.items.pop(key, None)
        if size > self.budget:
            return [key]
        self.items[key] = [size, math.inf if nu is None else nu, self._tick()]
        victims = []
        while sum(v[0] for v in self.items.values()) > self.budget:
            k = max(self.items, key=lambda k: (self.items[k][1], -self.items[k][2]))
            if k == key:
                self.items.pop(k)
                self.items.update(victims)
                return [key]
            victims.append((k, self.items.pop(k)))
        return [k for k, _ in victims]

    def get(self, key):
        if key in self.items:
            self.items[key][2] = self._tick()


def test_a_refused_ram_put_leaves_the_store_as_it_was():
    ram = RamTierStore(100)
    ram.put("a", "A", 30, 5)
    for key in ("a", "new"):
        with pytest.raises(ValueError):
            ram.put(key, "X", 10, float("nan"))
        with pytest.raises(ValueError):
            ram.put(key, "X", -1, 1.0)
    assert ram.keys() == ["a"] and ram.get("a") == "A" and ram.get("new") is None and ram.used_bytes == 30


def test_ram_budget_holds_and_matches_the_reference_rule_on_random_sequences():
    rng = np.random.default_rng(6)
    for budget in (0, 50, 200):
        ram, ref = RamTierStore(budget), ReferenceRam(budget)
        for _ in range(1500):
            key = f"k{int(rng.integers(0, 25))}"
            op = rng.random()
            nu = None if rng.random() < 0.2 else float(rng.integers(0, 8))  # many ties
            if op < 0.5:
                size = int(rng.integers(0, 60))
                assert keys_of(ram.put(key, key.upper(), size, nu)) == ref.put(key, size, nu)
            elif op < 0.7:
                ram.get(key)
                ref.get(key)
            elif op < 0.8:
                ram.pop(key)
                ref.items.pop(key, None)
            else:
                ram.update_next_use(key, nu)
                if key in ref.items:
                    ref.items[key][1] = math.inf if nu is None else nu
            assert sorted(ram.keys()) == sorted(ref.items)
            assert ram.used_bytes == sum(v[0] for v in ref.items.values()) <= budget


# ---- disk tier ---------------------------------------------------------------------------------------------
@pytest.fixture(params=[("memory", "marker"), ("memory", "rename"), ("file", "rename"), ("file", "marker")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def disk(request, tmp_path):
    """A factory of DiskTierStores on one fresh URL (restarts = new stores on the same URL)."""
    kind, commit = request.param
    url = f"memory://kvtest-{uuid.uuid4().hex}" if kind == "memory" else f"file://{tmp_path}/kv"
    yield lambda budget=1 << 30: DiskTierStore(url, budget, commit=commit)
    if kind == "memory":
        fs, root = fsspec.core.url_to_fs(url)
        fs.rm(root, recursive=True)


def test_disk_round_trip_and_restart_finds_the_units(disk):
    store = disk()
    units = [small_unit(conv_key(f"agent-{i}", i), seed=i) for i in range(4)]
    for i, u in enumerate(units):  # any buffer: memoryview, bytes, a read-only numpy array (what ray.get gives)
        buf = encode_unit(u)
        buf = [buf, bytes(buf), np.frombuffer(bytes(buf), np.uint8), np.frombuffer(bytes(buf), np.int32)][i]
        assert store.put(u.key, buf, next_use=float(u.num_tokens)) == []
    assert store.get("conv/nobody/0") is None and store.stats["misses"] == 1
    for u in units:
        assert_same_unit(u, store.get(u.key))
    again = disk()  # a server restart
    assert sorted(again.keys()) == sorted(u.key for u in units) and again.used_bytes == store.used_bytes
    for u in units:
        assert_same_unit(u, again.get(u.key))
    assert again.delete(units[0].key) and not again.delete(units[0].key)
    assert units[0].key not in disk()
    assert_same_unit(units[1], again.pop(units[1].key))
    assert sorted(disk().keys()) == sorted(u.key for u in units[2:])


class SimulatedCrash(BaseException):
    """The process dies here: no cleanup runs."""


def test_a_crash_before_the_commit_leaves_no_visible_unit(disk, monkeypatch):
    store = disk()
    old, new = small_unit("conv/a/0", seed=1), small_unit("conv/a/0", seed=2)
    store.put("conv/a/0", encode_unit(old))
    fs = store.fs
    for key, unit in (("conv/b/0", small_unit("conv/b/0")), ("conv/a/0", new)):
        with monkeypatch.context() as m:
            if store.commit == "rename":
                m.setattr(fs, "mv", lambda *a, **k: (_ for _ in ()).throw(SimulatedCrash()))
            else:
                real = fs.pipe_file

                def pipe(path, value, *a, _real=real, **k):
                    if path.endswith(".ok"):
                        raise SimulatedCrash()
                    return _real(path, value, *a, **k)
                m.setattr(fs, "pipe_file", pipe)
            with pytest.raises(SimulatedCrash):
                store.put(key, encode_unit(unit))
        assert key not in store
    young = disk()  # the leftovers may be another live server's writes in flight: kept while young
    assert "conv/b/0" not in young and young.stats["orphans"] == 0
    monkeypatch.setattr(disk_tier, "STALE_WRITE_S", 0.0)  # seen unchanged at the next listing: interrupted
    restarted = disk()
    assert restarted.stats["orphans"] == 0  # the first listing only notes them
    restarted.resync()
    assert "conv/b/0" not in restarted and restarted.get("conv/b/0") is None
    got = restarted.get("conv/a/0")  # the old version (rename) or nothing (marker): never the torn new one
    if store.commit == "rename":
        assert_same_unit(old, got)
    else:
        assert got is None
    assert restarted.stats["orphans"] >= 1 and restarted.stats["corrupt"] == 0
    names = [p.rsplit("/", 1)[-1] for p in restarted.fs.ls(restarted.root, detail=False)]
    assert not any(n.startswith((".", "conv+b")) for n in names)  # leftovers deleted


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"), NotImplementedError("read-only backend"),
                                   RuntimeError("an SDK's own error")])
def test_a_failed_write_is_a_refusal_not_an_error(disk, monkeypatch, error):
    store = disk()
    old = small_unit("conv/a/0", seed=1)
    store.put(old.key, encode_unit(old))

    def full(*a, **k):
        raise error

    monkeypatch.setattr(store.fs, "pipe_file", full)
    dropped = store.put(old.key, encode_unit(small_unit("conv/a/0", seed=2)))
    monkeypatch.undo()
    assert [d.key for d in dropped] == [old.key] and store.stats["write_errors"] == 1
    assert old.key not in store and store.used_bytes == 0 and len(disk()) == 0  # no stale version either


@pytest.mark.parametrize("damage", ["flip_data", "flip_header", "truncate", "empty", "misfiled"])
def test_a_corrupt_unit_is_detected_deleted_and_counted(disk, damage):
    store = disk()
    unit = small_unit("conv/a/0")
    store.put(unit.key, encode_unit(unit))
    path, fs = store.path_of(unit.key), store.fs
    raw = bytearray(fs.cat_file(path))
    if damage == "flip_data":
        raw[len(raw) // 2] ^= 0x10
    elif damage == "flip_header":
        raw[FIXED_SIZE + 5] ^= 0x01
    elif damage == "truncate":
        raw = raw[:len(raw) - 100]
    elif damage == "empty":
        raw = bytearray()
    else:
        other = small_unit("conv/b/0")
        raw = bytearray(encode_unit(other))
    fs.pipe_file(path, bytes(raw))
    assert store.get(unit.key) is None
    assert store.stats["corrupt"] == 1 and unit.key not in store and not fs.exists(path)
    assert store.used_bytes == 0 and store.get(unit.key) is None and store.stats["corrupt"] == 1


def test_a_corrupt_read_does_not_delete_a_unit_replaced_meanwhile(disk, monkeypatch):
    store = disk()
    old, new = small_unit("conv/a/0", seed=1), small_unit("conv/a/0", seed=2)
    store.put(old.key, encode_unit(old))
    real = disk_tier.decode_unit

    def decode_racing_a_writer(raw, *a, **k):  # the bytes read were bad, and a writer replaced the unit since
        monkeypatch.setattr(disk_tier, "decode_unit", real)
        store.put(new.key, encode_unit(new))
        raise UnitCorrupt("bad_checksum", "simulated")

    monkeypatch.setattr(disk_tier, "decode_unit", decode_racing_a_writer)
    assert store.get(old.key) is None and store.stats["corrupt"] == 1
    assert_same_unit(new, store.get(new.key))


def test_disk_budget_holds_with_queue_aware_eviction(disk):
    units = [small_unit(f"conv/u{i}/0", seed=i) for i in range(5)]
    size = len(encode_unit(units[0]))
    assert all(len(encode_unit(u)) == size for u in units)
    store = disk(int(3.5 * size))
    dropped = [[d.key for d in store.put(u.key, encode_unit(u), nu)]
               for u, nu in zip(units, [5.0, 1.0, None, 3.0, 2.0])]
    assert dropped == [[], [], [], ["conv/u2/0"], ["conv/u0/0"]]
    refused = store.put("conv/u9/0", encode_unit(small_unit("conv/u9/0")), 9.0)  # needed last: not written
    assert [(d.key, d.nbytes, d.next_use) for d in refused] == [("conv/u9/0", size, 9.0)]
    assert sorted(store.keys()) == ["conv/u1/0", "conv/u3/0", "conv/u4/0"] and store.used_bytes == 3 * size
    files = sorted(p.rsplit("/", 1)[-1] for p in store.fs.ls(store.root, detail=False) if p.endswith(".dkv"))
    assert files == ["conv+u1+0.dkv", "conv+u3+0.dkv", "conv+u4+0.dkv"]
    assert store.stats["evicted"] == 2 and store.stats["rejected"] == 1
    smaller = disk(int(2.5 * size))  # restart with a smaller budget: evicts down to it
    assert len(smaller) == 2 and smaller.used_bytes <= smaller.budget_bytes
    assert len([p for p in smaller.fs.ls(smaller.root, detail=False) if p.endswith(".dkv")]) == 2
    with pytest.raises(ValueError):
        store.put("conv/other/0", encode_unit(units[1]))  # another key's unit
    with pytest.raises(UnitCorrupt):
        store.put("conv/u1/0", b"not a unit")


def test_servers_sharing_a_folder_share_its_budget(disk):
    """Two stores on one folder (two servers on one host): each put lists the folder again (resync_s 0 here), so
    the other's units count against the budget and are evicted in their turn; the folder holds the newest units
    within one budget, and a unit the other server evicted is a clean miss."""
    units = [small_unit(f"conv/s{i}/0", seed=i) for i in range(6)]
    size = len(encode_unit(units[0]))
    a, b = disk(int(3.5 * size)), disk(int(3.5 * size))
    a.resync_s = b.resync_s = 0.0
    for i, u in enumerate(units):
        (a if i % 2 == 0 else b).put(u.key, encode_unit(u))
    on_disk = sorted(p.rsplit("/", 1)[-1] for p in a.fs.ls(a.root, detail=False) if p.endswith(".dkv"))
    assert on_disk == ["conv+s3+0.dkv", "conv+s4+0.dkv", "conv+s5+0.dkv"]
    assert sorted(b.keys()) == ["conv/s3/0", "conv/s4/0", "conv/s5/0"] and b.used_bytes == 3 * size
    assert a.get("conv/s2/0") is None and a.get("conv/s0/0") is None  # b evicted them
    assert_same_unit(units[5], a.get("conv/s5/0"))  # b's unit, read by a
    a.resync()
    assert sorted(a.keys()) == sorted(b.keys()) and a.stats["foreign"] >= 2 and b.stats["evicted"] >= 2
    assert a.stats["corrupt"] == 0 and b.stats["corrupt"] == 0


def test_a_shared_folders_units_rank_as_written_and_vanish_where_deleted(disk, monkeypatch):
    """Another server's units join the index as just used (so this server's older ones go first), units it
    deletes leave it (and `holds` says so at once), the listing waits out its interval, and a listing taken
    between another server's steps of a write deletes nothing of it."""
    units = {k: small_unit(f"conv/{k}/0", seed=i) for i, k in enumerate(["u0", "u1", "u2", "f0", "f1", "x"])}
    size = len(encode_unit(units["u0"]))
    a, b = disk(int(3.5 * size)), disk(int(3.5 * size))
    a.resync_s = b.resync_s = 0.0
    put = lambda store, k: store.put(f"conv/{k}/0", encode_unit(units[k]))  # noqa: E731
    put(a, "u0"), put(a, "u1"), put(b, "f0")
    evicted = [d.key for d in put(a, "u2")]  # lists first: f0 is newer than u0 and u1
    assert evicted == ["conv/u0/0"] and sorted(a.keys()) == ["conv/f0/0", "conv/u1/0", "conv/u2/0"]
    assert a.shared and a.stats["foreign"] == 1
    assert b.delete("conv/f0/0")
    a.resync()
    assert "conv/f0/0" not in a.keys() and a.stats["vanished"] == 1 and a.used_bytes == 2 * size
    b.resync()
    assert b.delete("conv/u2/0")
    assert a.holds("conv/u1/0") and not a.holds("conv/u2/0") and a.stats["vanished"] == 2  # seen at once
    a.resync_s = 3600.0  # not due: a put does not list, so b's next unit stays unseen
    put(b, "f1"), put(a, "x")
    assert "conv/f1/0" not in a.keys()
    monkeypatch.setattr(disk_tier, "STALE_WRITE_S", 0.0)
    real = a.fs.pipe_file

    def pipe(path, value, *args, **kw):  # b lists the folder while a writes (a temp file, or data before its marker)
        out = real(path, value, *args, **kw)
        if "conv+u1+0" in path and not path.endswith(".ok"):
            b.resync()
        return out
    monkeypatch.setattr(a.fs, "pipe_file", pipe)
    put(a, "u1")  # a replacement: in marker mode the old data sits without its marker meanwhile
    assert b.stats["orphans"] == 0
    assert_same_unit(units["u1"], a.get("conv/u1/0"))


def test_foreign_files_are_left_alone(disk):
    store = disk()
    store.fs.pipe_file(f"{store.root}/README.txt", b"mine")
    again = disk()
    assert len(again) == 0 and again.fs.cat_file(f"{store.root}/README.txt") == b"mine"


def test_readers_see_whole_units_while_one_writer_replaces_them(disk):
    store = disk()
    keys = [f"conv/k{i}/0" for i in range(3)]
    errors: list[BaseException] = []
    stop = threading.Event()

    def unit_v(key: str, v: int) -> Unit:
        return Unit.conversation(key, KVPageData({"x": np.full((64, 256), v, np.int32)}), None, v, {"v": v})

    def reader() -> None:
        try:
            while not stop.is_set():
                for k in keys:
                    u = store.get(k)
                    if u is not None:
                        assert np.all(u.kv.arrays["x"] == u.meta["v"]) and u.num_tokens == u.meta["v"]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for v in range(40):
        store.put(keys[v % 3], encode_unit(unit_v(keys[v % 3], v)))
    stop.set()
    for t in threads:
        t.join()
    assert not errors and store.stats["corrupt"] == 0 and store.stats["hits"] > 0


# ---- RAM over disk -----------------------------------------------------------------------------------------
def test_tiers_spill_to_disk_promote_back_and_count_losses():
    url = f"memory://kvtest-{uuid.uuid4().hex}"
    units = [small_unit(f"conv/t{i}/0", seed=i) for i in range(7)]
    size = len(encode_unit(units[0]))
    tiers = KVTiers(RamTierStore(2 * size), DiskTierStore(url, 3 * size))
    for i, u in enumerate(units[:4]):
        tiers.put(u, next_use=float(i))
    assert sorted(tiers.ram.keys()) == ["conv/t0/0", "conv/t1/0"] and tiers.where("conv/t3/0") == "disk"
    assert tiers.stats.spills == 2 and tiers.stats.spilled_bytes == 2 * size
    tiers.update_next_use("conv/t3/0", -1.0)  # the scheduler will resume t3 first now
    assert_same_unit(units[3], tiers.get("conv/t3/0"))  # disk hit, promoted; t1 (needed last in RAM) spills
    assert tiers.stats.hits_disk == 1 and tiers.where("conv/t1/0") == "disk" and "conv/t3/0" in tiers.ram
    before = tiers.stats.spilled_bytes
    assert_same_unit(units[3], tiers.get("conv/t3/0"))
    assert tiers.stats.hits_ram == 1
    assert_same_unit(units[3], tiers.take("conv/t3/0"))
    assert tiers.where("conv/t3/0") is None
    for i, u in enumerate(units[4:]):  # more than RAM + disk hold: the one needed last is lost
        tiers.put(u, next_use=10.0 + i)
    assert tiers.stats.lost == 1 and tiers.where("conv/t6/0") is None
    assert tiers.stats.spilled_bytes == before + size  # t5 went down; t6 was refused by the disk too
    victim = tiers.disk.keys()[0]
    tiers.disk.fs.pipe_file(tiers.disk.path_of(victim), b"garbage")
    assert tiers.get(victim) is None and tiers.stats.corrupt == 1 and tiers.stats.lost == 2
    assert tiers.snapshot_stats()["disk"]["corrupt"] == 1


def test_engine_resumes_exactly_from_conversations_kept_only_in_the_tiers():
    from decapybara.config import EngineConfig
    from decapybara.engine.engine import Engine
    from decapybara.engine.sampling import SamplingParams
    from decapybara.testing import tiny_qwen

    model = tiny_qwen("qwen3_5_text")[0]
    base = {"page_size": 8, "num_pages": 256, "max_batch_tokens": 48, "kv_mode": "6/4"}
    rng = np.random.default_rng(8)
    prompts = [rng.integers(0, 512, int(n)).tolist() for n in rng.integers(20, 40, 5)]
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=32)
    ref = Engine(model, EngineConfig(**base)).generate(prompts, params)

    e = Engine(model, EngineConfig(**{**base, "num_pages": 22, "enable_prefix_cache": False}))
    tiers = KVTiers(RamTierStore(20_000), DiskTierStore(f"memory://kvtest-{uuid.uuid4().hex}", 1 << 30))
    pause, resume, guards = e.pause, e.resume, {}

    def pause_to_tiers(seq):
        bundle = pause(seq)
        guards[seq.request_id] = seq.loopguard.state
        meta = {"loopguard": seq.loopguard.state.to_dict(), "seed": seq.seed}
        tiers.put(Unit.from_bundle(conv_key(seq.request_id, seq.num_pauses), bundle, meta), next_use=seq.arrival)
        seq.paused_bundle = seq.loopguard = None  # only the tiers hold it now
        return bundle

    def resume_from_tiers(seq, bundle=None):
        key = conv_key(seq.request_id, seq.num_pauses)
        unit = tiers.get(key, promote=False)
        assert unit is not None and unit.meta["seed"] == seq.seed
        state = LoopGuardState.from_dict(unit.meta["loopguard"])
        assert state == guards[seq.request_id]
        if not resume(seq, unit.to_bundle()):
            return False
        seq.loopguard = LoopGuard(LoopGuardConfig(mode=e.cfg.loop_guard).validate(), state)
        tiers.discard(key)
        return True

    e.pause, e.resume = pause_to_tiers, resume_from_tiers
    assert e.generate(prompts, params) == ref
    assert e.stats.pauses > 0 and e.stats.resumes == e.stats.pauses
    assert tiers.stats.spills > 0 and tiers.stats.hits_disk > 0 and tiers.stats.lost == 0
    assert len(tiers.ram) == len(tiers.disk) == 0


# ---- throughput (printed, never asserted) ------------------------------------------------------------------
def test_measure_throughput_of_a_64mb_unit(tmp_path):
    rng = np.random.default_rng(9)
    kv = {f"{layer}|{kv}.codes": rng.integers(0, 256, (32, 512, 4, 256), np.uint8)  # 16 MiB each
          for layer in (3, 7) for kv in ("k", "v")}
    unit = Unit.conversation("conv/bench/0", KVPageData(kv), None, 32 * 512)
    mb = unit.nbytes / 1e6

    def timed(fn):
        t = time.perf_counter()
        out = fn()
        return out, mb / (time.perf_counter() - t)

    buf, enc = timed(lambda: encode_unit(unit))
    staging = np.empty(len(buf), np.uint8)
    staging.fill(0)  # touched once, as a reused staging buffer would be
    again, enc_reused = timed(lambda: encode_unit(unit, out=staging))
    assert again == buf
    back, dec = timed(lambda: decode_unit(buf))
    assert_same_unit(unit, back)
    lines = [f"{mb:.0f} MB unit: encode {enc:6.0f} MB/s (into a reused buffer {enc_reused:6.0f} MB/s)",
             f"decode+verify {dec:6.0f} MB/s"]
    for url in (f"memory://kvtest-{uuid.uuid4().hex}", f"file://{tmp_path}/kv"):
        store = DiskTierStore(url, 1 << 30)
        _, put = timed(lambda s=store: s.put(unit.key, buf))
        got, get = timed(lambda s=store: s.get(unit.key))
        assert_same_unit(unit, got)
        lines.append(f"disk {url.split(':')[0]:6s} ({store.commit}): put {put:8.0f} MB/s   get {get:8.0f} MB/s")
        store.delete(unit.key)
    print("\n" + "\n".join(lines))
    assert read_header(buf).total_size == len(buf)


def test_the_page_records_stay_bounded():
    """TierStores keeps a record of each offloaded page (whether it went with a snapshot); where the tiers do not
    say when a unit leaves (under Ray), the records are bounded, the least recently used dropped first."""
    from decapybara.kv.stores import ABSENT, PRESENT, PRESENT_WITH_SNAPSHOT, TierStores

    stores = TierStores(KVTiers(RamTierStore(1 << 30), None), b"salt")
    stores.MAX_PAGES = 4
    rng = np.random.default_rng(0)
    kv = KVPageData(kv_arrays(rng, 1, "6/4"))
    hashes = [bytes([i]) * 16 for i in range(6)]
    for i, h in enumerate(hashes[:4]):
        stores.offload(h, kv, hybrid_state(rng) if i == 0 else None)
    assert stores.lookup(hashes[0]) == PRESENT_WITH_SNAPSHOT  # a lookup is a use
    for h in hashes[4:]:
        stores.offload(h, kv, None)
    assert len(stores._pages) == 4
    assert [stores.lookup(h) for h in hashes] == [PRESENT_WITH_SNAPSHOT, ABSENT, ABSENT, PRESENT, PRESENT, PRESENT]


def test_a_restart_finds_which_pages_hold_a_state_snapshot(disk):
    """`snapshot_flags`: every unit under a prefix with whether it holds a hybrid state, known from its put and,
    after a restart, from its file's header alone; a header that cannot be read is not known (None), and a budget of
    no time reads none."""
    from decapybara.kv.units import header_length, page_prefix

    store = disk()
    rng = np.random.default_rng(5)
    kv = KVPageData(kv_arrays(rng, 1, "8/8"))
    salt, other = b"salt-a", b"salt-b"
    units = [Unit.page(salt, bytes([i]) * 16, kv, hybrid_state(rng) if i % 2 else None) for i in range(4)]
    units.append(Unit.page(other, b"\x09" * 16, kv, hybrid_state(rng)))
    for u in units:
        assert store.put(u.key, encode_unit(u)) == []
    want = {u.key: u.state is not None for u in units[:4]}
    assert store.snapshot_flags(page_prefix(salt)) == want
    again = disk()  # a restart: nothing known until the headers are read
    assert again.snapshot_flags(page_prefix(salt), budget_s=0) == dict.fromkeys(want)
    assert again.snapshot_flags(page_prefix(salt)) == want
    assert disk().snapshot_flags(page_prefix(other)) == {units[4].key: True}
    buf = bytes(encode_unit(units[1]))
    assert header_length(buf[:FIXED_SIZE]) < len(buf)
    assert read_header(buf[:header_length(buf)], len(buf)).state_layers == 3
    with pytest.raises(UnitCorrupt):  # the header's own bytes are checked
        read_header(buf[:header_length(buf) - 1], len(buf))
    damaged = bytearray(buf)
    damaged[FIXED_SIZE + 5] ^= 1
    store.fs.pipe_file(store.path_of(units[1].key), bytes(damaged))
    assert disk().snapshot_flags(page_prefix(salt))[units[1].key] is None


def test_durable_puts_go_to_disk_ranked_and_give_way_in_rank_order(tmp_path):
    """`KVTiers.put_durable` (a graceful stop's saved pages): to the disk only, dropping a RAM copy (which might lack
    the state the saved one has); where room runs out, units without a rank go first, then the highest ranks, and
    a unit ranked after everything kept is refused (False)."""
    rng = np.random.default_rng(6)
    kv = KVPageData(kv_arrays(rng, 1, "8/8"))
    units = [Unit.page(b"s", bytes([i]) * 16, kv) for i in range(5)]
    size = len(encode_unit(units[0]))
    tiers = KVTiers(RamTierStore(1 << 20), DiskTierStore(f"file://{tmp_path}/kv", 3 * size))
    tiers.put(units[0])  # an ordinary put: RAM
    assert tiers.where(units[0].key) == "ram"
    assert tiers.put_durable(units[0], next_use=0.0) and tiers.where(units[0].key) == "disk"
    tiers.disk.put(units[4].key, encode_unit(units[4]))  # no rank: needed last
    assert tiers.put_durable(units[1], next_use=1.0) and tiers.put_durable(units[2], next_use=2.0)
    assert units[4].key not in tiers.disk  # gave way first
    assert not tiers.put_durable(units[3], next_use=3.0)  # ranked after all three kept: refused
    assert sorted(tiers.disk.keys()) == sorted(u.key for u in units[:3])
    assert not KVTiers(RamTierStore(1 << 20), None).put_durable(units[0])  # no disk: nothing outlives the process


def test_listings_at_once_are_one_listing(tmp_path, monkeypatch):
    """Two threads asking a shared folder's store to list it again at once (a put's `resync` beside the GPU
    actor's `news`): one lists, the other goes on with the index as it stands, and nothing breaks."""
    import threading
    import time

    from decapybara.kv.disk_tier import DiskTierStore

    store = DiskTierStore(f"file://{tmp_path}/kv", 1 << 20)
    listing = store._listing
    started, slow = threading.Event(), threading.Event()

    def slow_listing():
        started.set()
        slow.wait(5)
        return listing()

    monkeypatch.setattr(store, "_listing", slow_listing)
    errors: list[BaseException] = []

    def first():
        try:
            store.resync()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=first)
    t.start()
    started.wait(5)
    t0 = time.monotonic()
    assert store.news("", 0)[1] == {} and time.monotonic() - t0 < 2  # did not wait for the other listing
    slow.set()
    t.join(10)
    assert not errors
