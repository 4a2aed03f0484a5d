"""Adversarial checks of the KV tiers' stores: budgets, accounting, shared folders, damage."""

from __future__ import annotations

import random
import threading
import uuid

import fsspec
import numpy as np
import pytest

from decapybara.backend.base import HybridState, KVPageData
from decapybara.kv.disk_tier import DiskTierStore
from decapybara.kv.policy import BudgetedIndex
from decapybara.kv.ram_tier import RamTierStore
from decapybara.kv.tiers import KVTiers
from decapybara.kv.units import Unit, encode_unit


def unit_of(key: str, n: int, v: int = 1, state: bool = False) -> Unit:
    st = HybridState([np.full((2,), v, np.float32)], [np.full((3,), v, np.float32)]) if state else None
    return Unit.conversation(key, KVPageData({"x": np.full((n,), v % 251, np.uint8)}), st, n, {"v": v})


def files_of(store: DiskTierStore) -> dict[str, int]:
    out = {}
    for info in store.fs.ls(store.root, detail=True):
        out[info["name"].rsplit("/", 1)[-1]] = int(info.get("size") or 0)
    return out


@pytest.fixture(params=["memory", "file"])
def url(request, tmp_path):
    u = f"memory://kvadv-{uuid.uuid4().hex}" if request.param == "memory" else f"file://{tmp_path}/kv"
    yield u
    if request.param == "memory":
        fs, root = fsspec.core.url_to_fs(u)
        fs.rm(root, recursive=True)


def test_index_random_ops_keep_accounting():
    rng = random.Random(1)
    for budget in (0, 1, 7, 64, 100):
        ix = BudgetedIndex(budget)
        for _ in range(3000):
            op = rng.random()
            k = f"k{rng.randrange(12)}"
            if op < 0.5:
                dropped = ix.admit(k, rng.randrange(0, 40), rng.choice([None, rng.random() * 10]))
                assert len({d.key for d in dropped}) == len(dropped)
            elif op < 0.6:
                ix.remove(k)
            elif op < 0.7:
                ix.touch(k)
            elif op < 0.85:
                ix.update_next_use(k, rng.choice([None, rng.random() * 10]))
            else:
                ix.set_budget(rng.choice([budget, budget // 2, budget * 2]))
            assert ix.used_bytes == sum(ix.nbytes(k) for k in ix.keys()) <= ix.budget_bytes


def test_ram_random_ops_keep_accounting():
    rng = random.Random(2)
    ram = RamTierStore(100)
    for _ in range(3000):
        k = f"k{rng.randrange(12)}"
        op = rng.random()
        if op < 0.6:
            spilled = ram.put(k, object(), rng.randrange(0, 60), rng.choice([None, rng.random()]))
            assert all(s.key not in ram for s in spilled)
        elif op < 0.7:
            ram.pop(k)
        elif op < 0.8:
            ram.get(k)
        else:
            ram.set_budget(rng.choice([0, 50, 100, 150]))
        assert ram.used_bytes == sum(ram.nbytes(k) for k in ram.keys()) <= ram.budget_bytes
        assert sorted(ram.keys()) == sorted(ram._index.keys())


def test_disk_random_ops_match_files(url):
    rng = random.Random(3)
    store = DiskTierStore(url, 2000)
    for step in range(300):
        k = f"conv/k{rng.randrange(10)}/0"
        op = rng.random()
        if op < 0.6:
            u = unit_of(k, rng.randrange(0, 900), step)
            buf = encode_unit(u)
            store.put(k, buf, rng.choice([None, rng.random()]))
        elif op < 0.7:
            store.delete(k)
        elif op < 0.85:
            got = store.get(k)
            assert got is None or got.key == k
        else:
            store.set_budget(rng.choice([500, 1000, 2000, 3000]))
        files = {n: s for n, s in files_of(store).items() if n.endswith(".dkv")}
        keys = sorted(n[:-4].replace("+", "/") for n in files)
        assert keys == sorted(store.keys()), step
        assert store.used_bytes == sum(files.values()) <= store.budget_bytes
        assert not [n for n in files_of(store) if n.endswith(".tmp")]
    again = DiskTierStore(url, 3000)
    assert sorted(again.keys()) == sorted(store.keys()) and again.used_bytes == store.used_bytes


def test_tiers_random_ops_keep_budgets(url):
    rng = random.Random(4)
    tiers = KVTiers(RamTierStore(1500), DiskTierStore(url, 2500))
    live = {}
    for step in range(400):
        k = f"conv/k{rng.randrange(14)}/0"
        op = rng.random()
        if op < 0.5:
            u = unit_of(k, rng.randrange(0, 1200), step)
            tiers.put(u, rng.choice([None, rng.random()]))
            live[k] = step
        elif op < 0.75:
            got = tiers.get(k, promote=rng.random() < 0.7)
            if got is not None:
                assert got.meta["v"] == live[k]
        elif op < 0.85:
            got = tiers.take(k)
            if got is not None:
                assert got.meta["v"] == live[k]
            live.pop(k, None)
        else:
            tiers.discard(k)
            live.pop(k, None)
        assert tiers.ram.used_bytes <= tiers.ram.budget_bytes
        assert tiers.disk.used_bytes <= tiers.disk.budget_bytes
        files = {n: s for n, s in files_of(tiers.disk).items() if n.endswith(".dkv")}
        assert sum(files.values()) == tiers.disk.used_bytes
    assert tiers.stats.corrupt == 0


def test_two_stores_concurrent_writers_same_keys(url):
    a, b = DiskTierStore(url, 1 << 20), DiskTierStore(url, 1 << 20)
    a.resync_s = b.resync_s = 0.0
    errors = []

    def writer(store, seed):
        rng = random.Random(seed)
        try:
            for i in range(60):
                k = f"conv/k{rng.randrange(4)}/0"
                store.put(k, encode_unit(unit_of(k, 3000, 7)))  # same content per key: content addressed
                got = store.get(f"conv/k{rng.randrange(4)}/0")
                if got is not None:
                    assert got.meta["v"] == 7 and np.all(got.kv.arrays["x"] == 7)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=writer, args=(s, i)) for i, s in enumerate((a, b))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors
    assert a.stats["corrupt"] == 0 and b.stats["corrupt"] == 0


def test_a_unit_another_server_replaced_with_a_larger_one_is_counted_at_its_size(url):
    """Two servers on one folder write one content-addressed key at different sizes (a page with and without its
    state snapshot): the listing updates the size, so the folder stays within the budget."""
    small, big = unit_of("page/aa/01", 1000, 1), unit_of("page/aa/01", 1000, 1, state=True)
    sb, bb = encode_unit(small), encode_unit(big)
    extra = len(encode_unit(unit_of("conv/f0/0", 1000)))
    budget = len(sb) + 2 * extra
    a, b = DiskTierStore(url, budget), DiskTierStore(url, 1 << 30)
    a.resync_s = 0.0
    assert a.put("page/aa/01", sb) == []
    b.resync()
    b.put("page/aa/01", bb)  # replaces a's file with a larger unit of the same key
    for i in range(2):
        k = f"conv/f{i}/0"
        a.put(k, encode_unit(unit_of(k, 1000)))
    a.resync()
    files = {n: s for n, s in files_of(a).items() if n.endswith(".dkv")}
    on_disk = sum(files.values())
    assert on_disk <= budget, (on_disk, budget, a.used_bytes)
    assert a.used_bytes == sum(files.get(k.replace("/", "+") + ".dkv", 0) for k in a.keys())
    if "page/aa/01" in a:  # the flag is read again from the file: b's unit holds a snapshot
        assert a.snapshot_flags("page/") == {"page/aa/01": True}


def test_a_damaged_ram_copy_spilled_to_disk_is_dropped_not_raised(url):
    """A RAM copy whose header was damaged is spilled: it is counted corrupt and lost, the put goes on, and the
    other units spilled with it reach the disk."""
    units = [unit_of(f"conv/d{i}/0", 1000, i) for i in range(3)]
    size = len(encode_unit(units[0]))
    tiers = KVTiers(RamTierStore(2 * size), DiskTierStore(url, 10 * size))
    bufs = [bytearray(encode_unit(u)) for u in units[:2]]
    tiers.put(bufs[0], next_use=5.0)
    tiers.put(bufs[1], next_use=4.0)
    bufs[0][40] ^= 0xFF  # bit rot in the header JSON of the unit needed last (the first to spill)
    big = unit_of("conv/big/0", size, 9)
    tiers.put(big, next_use=0.0)  # spills both
    assert tiers.where("conv/d1/0") == "disk" and tiers.get("conv/d1/0").meta["v"] == 1
    assert tiers.where("conv/d0/0") is None and tiers.stats.corrupt == 1 and tiers.stats.lost == 1
    assert tiers.get("conv/big/0").meta["v"] == 9


@pytest.mark.parametrize("commit", ["rename", "marker"])
def test_damage_at_random_offsets_is_a_miss_after_a_restart(url, commit):
    rng = random.Random(5)
    store = DiskTierStore(url, 1 << 30, commit=commit)
    keys = [f"conv/r{i}/0" for i in range(30)]
    for i, k in enumerate(keys):
        store.put(k, encode_unit(unit_of(k, rng.randrange(1, 3000), i, state=i % 2 == 0)))
    for i, k in enumerate(keys):
        path = store.path_of(k)
        raw = bytearray(store.fs.cat_file(path))
        how = i % 4
        if how == 0:
            raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        elif how == 1:
            raw = raw[:rng.randrange(len(raw))]
        elif how == 2:
            raw += bytes(rng.randrange(1, 100))
        else:
            off = rng.randrange(len(raw) - 8)
            raw[off:off + 8] = bytes(8)
            if bytes(raw) == store.fs.cat_file(path):
                continue
        store.fs.pipe_file(path, bytes(raw))
    again = DiskTierStore(url, 1 << 30, commit=commit)
    flags = again.snapshot_flags("conv/")
    for i, k in enumerate(keys):
        got = again.get(k)
        assert got is None or (i % 4 == 3 and got.meta["v"] == i), k
        assert k not in again or got is not None
        if got is None:
            assert not again.fs.exists(again.path_of(k))
        assert flags.get(k) in (None, i % 2 == 0, False)
    assert again.used_bytes == sum(again.fs.size(again.path_of(k)) for k in again.keys())


def test_a_refused_replacement_leaves_no_stale_snapshot_flag(url):
    """A unit replaced by one the budget refuses is gone; when another server writes the key again (without a
    state snapshot), its flag is read from the new file, not remembered from the old one."""
    with_state = encode_unit(unit_of("page/aa/01", 100, 1, state=True))
    a, b = DiskTierStore(url, 2 * len(with_state)), DiskTierStore(url, 1 << 30)
    a.resync_s = 0.0
    assert a.put("page/aa/01", with_state) == []
    refused = a.put("page/aa/01", encode_unit(unit_of("page/aa/01", 3 * len(with_state), 1, state=True)))
    assert [d.key for d in refused] == ["page/aa/01"] and "page/aa/01" not in a
    b.put("page/aa/01", encode_unit(unit_of("page/aa/01", 100, 1)))  # no state snapshot
    a.resync()
    assert "page/aa/01" in a
    assert a.snapshot_flags("page/") == {"page/aa/01": False}
    assert a.news("page/", 0)[1] == {"page/aa/01": False}


def test_a_unit_deleted_as_corrupt_during_a_listing_does_not_come_back(url):
    """A reader deletes a damaged unit while another thread lists the folder: the listing, taken before the
    deletion, does not bring the unit back into the index (a unit counted in the budget with no file)."""
    a = DiskTierStore(url, 1 << 30)
    a.put("conv/x/0", encode_unit(unit_of("conv/x/0", 500)))
    a.fs.pipe_file(a.path_of("conv/x/0"), b"garbage")
    real = a._listing

    def listing():
        out = real()
        assert a.get("conv/x/0") is None  # found corrupt and deleted meanwhile
        return out
    a._listing = listing
    a.resync()
    assert "conv/x/0" not in a and a.used_bytes == 0
