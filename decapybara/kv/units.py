"""Units: what moves between the KV tiers, and their checksummed binary form.

A `Unit` is either a paused conversation (`UnitKind.CONV`: all its KV pages, its hybrid state, the facts
needed to resume exactly) or one prefix-cache page (`UnitKind.PAGE`: one page's KV arrays and optional hybrid
snapshot, keyed by its content hash). Arrays travel in their storage format (float32, bf16 bits, microscaled
codes + scales): the tiers never convert, so a round trip is bit-exact.

Layout (all integers little-endian, every array at a multiple of `ALIGN` from the start of the buffer)::

    [fixed 32 B: magic 8s | version u16 | kind u16 | num_arrays u32 | json_len u32 | total_size u64 |
                 header_crc32 u32]
    [header JSON, UTF-8][zero padding][array 0][zero padding][array 1]...   (total_size bytes, no trailer)

`header_crc32` covers the fixed header's first 28 bytes and the JSON; the JSON lists every array (group, name,
dtype, shape, offset, nbytes, crc32) and the metadata. Padding must be zero, so every byte of a unit is checked.
NOTE: zlib.crc32 (~4 GB/s here) rather than blake2b (~0.7 GB/s, slower than the copy it guards): the threat
is bit rot and torn writes, not an adversary, and crc32 detects every burst error of up to 32 bits.

`decode_unit` raises `UnitCorrupt` (with a `.problem` from `PROBLEMS`) for any malformed input and nothing
else; its arrays are zero-copy views of the buffer (read-only when the buffer is `bytes`).
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
import re
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from decapybara.backend.base import HybridState, KVPageData
from decapybara.errors import DecapybaraError

MAGIC = b"\x89DKVU\r\n\x1a"
VERSION = 1
FIXED_FORMAT = "<8sHHIIQI"
FIXED_SIZE = 32
assert struct.calcsize(FIXED_FORMAT) == FIXED_SIZE
ALIGN = 64
MAX_NDIM = 32
MAX_JSON = 64 << 20  # NOTE: bounds what a corrupt length field can make us parse

PROBLEMS = frozenset({"bad_magic", "unknown_version", "truncated", "bad_size", "bad_checksum", "bad_json",
                      "bad_layout"})

# Array dtypes a unit may hold (numpy `dtype.str`, little-endian): no objects, no big-endian, no structs.
DTYPES = frozenset(np.dtype(t).newbyteorder("<").str for t in (
    np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64,
    np.float16, np.float32, np.float64))
_GROUPS = ("kv", "conv", "rec", "x")  # KV pages, hybrid conv state, hybrid recurrent state, extras


class UnitCorrupt(DecapybaraError):
    """An encoded unit is malformed or damaged; `.problem` names the kind (one of `PROBLEMS`)."""

    def __init__(self, problem: str, message: str) -> None:
        assert problem in PROBLEMS, problem
        super().__init__(f"{problem}: {message}")
        self.problem = problem


class UnitKind(enum.IntEnum):
    CONV = 1  # a paused conversation's bundle
    PAGE = 2  # one prefix-cache page (content-addressed)


# ---- keys ------------------------------------------------------------------------------------------------
_COMPONENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.=-]*|~[0-9a-f]{1,64}")
MAX_KEY = 200


def key_component(text: str) -> str:
    """`text` itself when it is a short safe name, else a stable hash of it (`~` + 24 hex digits)."""
    if len(text) <= 64 and _COMPONENT.fullmatch(text) and not text.startswith("~"):
        return text
    return "~" + hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=12).hexdigest()


def conv_key(conversation: str, pause_counter: int) -> str:
    """Key of a conversation's bundle at its `pause_counter`-th pause: "conv/<id>/<n>"."""
    return f"conv/{key_component(conversation)}/{int(pause_counter)}"


def page_key(salt: bytes, page_hash: bytes) -> str:
    """Key of a prefix page: "page/<salt hash>/<page hash hex>" (the engine's salt: its model's config, KV mode, page size)."""
    return f"page/{hashlib.blake2b(salt, digest_size=8).hexdigest()}/{page_hash.hex()}"


def page_prefix(salt: bytes) -> str:
    """The start of every page key of engines with this salt ("page/<salt hash>/")."""
    return page_key(salt, b"")


def is_valid_key(key: str) -> bool:
    """Keys are '/'-joined safe components (see `key_component`), at most `MAX_KEY` characters."""
    return (isinstance(key, str) and 0 < len(key) <= MAX_KEY
            and all(_COMPONENT.fullmatch(c) for c in key.split("/")))


# ---- the unit --------------------------------------------------------------------------------------------
@dataclass(slots=True)
class Unit:
    """One movable unit. `meta` is opaque JSON-able data (sampler / LoopGuard state, ...) and comes back as
    `json.loads` gives it (tuples become lists, dict keys strings); `extras` carry bulky per-unit arrays
    (token ids, page hashes). `buffer` is the encoded buffer the arrays view after `decode_unit`."""

    key: str
    kind: UnitKind
    kv: KVPageData
    state: HybridState | None = None
    num_tokens: int = 0
    meta: dict[str, Any] = field(default_factory=dict)
    extras: dict[str, np.ndarray] = field(default_factory=dict)
    page_hash: bytes | None = None  # PAGE units: the content hash of the page
    buffer: Any = None

    @classmethod
    def conversation(cls, key: str, kv: KVPageData, state: HybridState | None, num_tokens: int,
                     meta: dict[str, Any] | None = None, extras: dict[str, np.ndarray] | None = None) -> Unit:
        return cls(key, UnitKind.CONV, kv, state, num_tokens, dict(meta or {}), dict(extras or {}))

    @classmethod
    def from_bundle(cls, key: str, bundle: Any, meta: dict[str, Any] | None = None,
                    extras: dict[str, np.ndarray] | None = None) -> Unit:
        """From an engine `SequenceBundle` (kv, state, num_tokens)."""
        return cls.conversation(key, bundle.kv, bundle.state, bundle.num_tokens, meta, extras)

    @classmethod
    def page(cls, salt: bytes, page_hash: bytes, kv: KVPageData, snapshot: HybridState | None = None,
             num_tokens: int = 0, meta: dict[str, Any] | None = None) -> Unit:
        return cls(page_key(salt, page_hash), UnitKind.PAGE, kv, snapshot, num_tokens, dict(meta or {}),
                   page_hash=bytes(page_hash))

    def to_bundle(self) -> Any:
        """The engine's `SequenceBundle` (imported lazily: the engine pulls in the model)."""
        from decapybara.engine.runner import SequenceBundle

        return SequenceBundle(self.kv, self.state, self.num_tokens)

    @property
    def nbytes(self) -> int:
        """Bytes of array data (the encoded size adds a header and alignment padding)."""
        state = self.state.nbytes if self.state is not None else 0
        return self.kv.nbytes + state + sum(a.nbytes for a in self.extras.values())


def _round_up(n: int, a: int = ALIGN) -> int:
    return -(-n // a) * a


def _named_arrays(unit: Unit) -> list[tuple[str, str, np.ndarray]]:
    out = [("kv", name, a) for name, a in unit.kv.arrays.items()]
    if unit.state is not None:
        out += [("conv", str(i), a) for i, a in enumerate(unit.state.conv)]
        out += [("rec", str(i), a) for i, a in enumerate(unit.state.recurrent)]
    out += [("x", name, a) for name, a in unit.extras.items()]
    return out


@dataclass(slots=True)
class _Plan:
    header: dict[str, Any]
    arrays: list[tuple[np.ndarray, np.dtype]]
    json_len: int
    total: int


def _plan(unit: Unit) -> _Plan:
    if not is_valid_key(unit.key):
        raise ValueError(f"bad unit key {unit.key!r}")
    if unit.state is not None and len(unit.state.conv) != len(unit.state.recurrent):
        raise ValueError("hybrid state has different numbers of conv and recurrent layers")
    arrays, entries = [], []
    for group, name, a in _named_arrays(unit):
        a = np.asarray(a)
        dt = a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype
        if dt.str not in DTYPES:
            raise ValueError(f"array {group}:{name} has dtype {a.dtype}, not one of {sorted(DTYPES)}")
        arrays.append((a, dt))
        # NOTE: offset and crc32 get placeholders of their widest values: the JSON's length is fixed before
        # the offsets (which depend on it) and the checksums are known; the final JSON is space-padded.
        entries.append({"group": group, "name": name, "dtype": dt.str, "shape": list(a.shape),
                        "nbytes": a.size * dt.itemsize, "offset": 10 ** 15, "crc32": 10 ** 9})
    header: dict[str, Any] = {
        "key": unit.key, "num_tokens": int(unit.num_tokens),
        "state_layers": None if unit.state is None else len(unit.state.conv),
        "page_hash": None if unit.page_hash is None else unit.page_hash.hex(), "meta": unit.meta,
        "arrays": entries,
    }
    try:
        json_len = len(json.dumps(header, separators=(",", ":")).encode())
    except (TypeError, ValueError) as e:
        raise ValueError(f"unit metadata is not JSON-able: {e}") from None
    pos = end = FIXED_SIZE + json_len
    for e in entries:
        e["offset"] = pos = _round_up(pos)
        pos = end = pos + e["nbytes"]
    return _Plan(header, arrays, json_len, end)


def encoded_size(unit: Unit) -> int:
    """Bytes `encode_unit` produces for `unit`."""
    return _plan(unit).total


def encode_unit(unit: Unit, out: Any = None) -> memoryview:
    """The unit's bytes: one buffer, one copy of the arrays. `out` (optional, writable, at least
    `encoded_size(unit)` bytes) receives them instead of a fresh allocation: reused staging memory avoids the
    page faults of touching new memory. Raises ValueError for an unencodable unit (bad key, an array dtype
    outside `DTYPES`, metadata that is not JSON-able) or a too small `out`."""
    plan = _plan(unit)
    header, entries, total = plan.header, plan.header["arrays"], plan.total
    if out is None:
        buf = np.empty(total, np.uint8)
    else:
        buf = np.frombuffer(out, np.uint8)
        if len(buf) < total or not buf.flags.writeable:
            raise ValueError(f"out must be a writable buffer of at least {total} bytes")
        buf = buf[:total]
    body = memoryview(buf)
    gap = FIXED_SIZE + plan.json_len
    for e, (a, dt) in zip(entries, plan.arrays):
        off, n = e["offset"], e["nbytes"]
        buf[gap:off] = 0  # padding is zero, so that every byte of the unit is checked
        np.copyto(buf[off:off + n].view(dt).reshape(a.shape), a, casting="equiv")
        e["crc32"] = zlib.crc32(body[off:off + n])
        gap = off + n
    final = json.dumps(header, separators=(",", ":")).encode()
    assert len(final) <= plan.json_len
    final = final.ljust(plan.json_len)  # NOTE: JSON allows trailing whitespace
    buf[FIXED_SIZE:FIXED_SIZE + len(final)] = np.frombuffer(final, np.uint8)
    fixed = struct.pack(FIXED_FORMAT, MAGIC, VERSION, int(unit.kind), len(entries), len(final), total, 0)
    crc = zlib.crc32(final, zlib.crc32(fixed[:FIXED_SIZE - 4]))
    buf[:FIXED_SIZE] = np.frombuffer(fixed[:FIXED_SIZE - 4] + struct.pack("<I", crc), np.uint8)
    return body


# ---- decoding --------------------------------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class ArrayEntry:
    group: str
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    crc32: int


@dataclass(slots=True)
class UnitHeader:
    """A unit's checked header: everything but the array bytes."""

    kind: UnitKind
    key: str
    num_tokens: int
    state_layers: int | None
    page_hash: bytes | None
    meta: dict[str, Any]
    arrays: list[ArrayEntry]
    total_size: int
    json_end: int


def byte_view(buf: Any) -> memoryview:
    """A flat unsigned-byte view of any C-contiguous buffer (bytes, bytearray, memoryview, numpy array)."""
    mv = memoryview(buf)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _entry(e: Any, index: int) -> ArrayEntry:
    if not isinstance(e, dict):
        raise UnitCorrupt("bad_json", f"array entry {index} is not an object")
    group, name, dtype, shape = e.get("group"), e.get("name"), e.get("dtype"), e.get("shape")
    if group not in _GROUPS or not isinstance(name, str):
        raise UnitCorrupt("bad_json", f"array entry {index}: bad group {group!r} or name {name!r}")
    if dtype not in DTYPES:
        raise UnitCorrupt("bad_json", f"array {group}:{name}: dtype {dtype!r} is not allowed")
    if (not isinstance(shape, list) or len(shape) > MAX_NDIM
            or not all(_is_int(d) and d >= 0 for d in shape)):
        raise UnitCorrupt("bad_json", f"array {group}:{name}: bad shape {str(shape)[:80]}")
    for k in ("offset", "nbytes", "crc32"):
        if not _is_int(e.get(k)) or e[k] < 0:
            raise UnitCorrupt("bad_json", f"array {group}:{name}: {k} is {e.get(k)!r}")
    dt = np.dtype(dtype)
    if e["nbytes"] != math.prod(shape) * dt.itemsize:
        raise UnitCorrupt("bad_layout", f"array {group}:{name}: nbytes {e['nbytes']} != {shape} x {dtype}")
    if e["crc32"] >= 1 << 32 or e["offset"] % ALIGN:
        raise UnitCorrupt("bad_layout", f"array {group}:{name}: crc32 or offset {e['offset']} out of form")
    return ArrayEntry(group, name, dt, tuple(shape), e["offset"], e["nbytes"], e["crc32"])


def _fixed(mv: memoryview) -> tuple[int, int, int, int, int]:
    """The fixed header's (kind, num_arrays, json_len, total_size, header_crc32), magic and version checked."""
    if len(mv) < FIXED_SIZE:
        raise UnitCorrupt("truncated", f"{len(mv)} bytes, shorter than the {FIXED_SIZE}-byte header")
    magic, version, kind, num_arrays, json_len, total, crc = struct.unpack_from(FIXED_FORMAT, mv)
    if magic != MAGIC:
        raise UnitCorrupt("bad_magic", f"magic {magic!r} is not {MAGIC!r}: not a KV unit")
    if version != VERSION:
        raise UnitCorrupt("unknown_version", f"format version {version} (this reader knows {VERSION})")
    return kind, num_arrays, json_len, total, crc


def header_length(start: Any) -> int:
    """Bytes from a unit's start through its header JSON, from its first `FIXED_SIZE` bytes: what `read_header`
    needs of a unit read only in part (raises UnitCorrupt)."""
    json_len = _fixed(byte_view(start))[2]
    if json_len > MAX_JSON:
        raise UnitCorrupt("bad_layout", f"header JSON of {json_len} bytes")
    return FIXED_SIZE + json_len


def read_header(buf: Any, size: int | None = None) -> UnitHeader:
    """Check the fixed header, the sizes, the header checksum and the JSON/layout (not the array bytes).
    `size`: the whole unit's length where `buf` is only its first `header_length` bytes or more (a file's start,
    read without its arrays)."""
    mv = byte_view(buf)
    kind, num_arrays, json_len, total, crc = _fixed(mv)
    size = len(mv) if size is None else size
    if size < total:
        raise UnitCorrupt("truncated", f"{size} bytes, header says {total}")
    if size > total:
        raise UnitCorrupt("bad_size", f"{size} bytes, header says {total}")
    json_end = FIXED_SIZE + json_len
    if json_len > MAX_JSON or json_end > total:
        raise UnitCorrupt("bad_layout", f"header JSON of {json_len} bytes does not fit a {total}-byte unit")
    if json_end > len(mv):
        raise UnitCorrupt("truncated", f"{len(mv)} bytes read, the header ends at {json_end}")
    got = zlib.crc32(mv[FIXED_SIZE:json_end], zlib.crc32(mv[:FIXED_SIZE - 4]))
    if got != crc:
        raise UnitCorrupt("bad_checksum", f"header crc32 is {crc:#010x}, computed {got:#010x}")
    if kind not in UnitKind._value2member_map_:
        raise UnitCorrupt("bad_layout", f"unknown unit kind {kind}")
    try:
        h = json.loads(bytes(mv[FIXED_SIZE:json_end]).decode())
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise UnitCorrupt("bad_json", f"header is not UTF-8 JSON ({type(e).__name__})") from None
    if not isinstance(h, dict) or not isinstance(h.get("arrays"), list) or not isinstance(h.get("meta"), dict):
        raise UnitCorrupt("bad_json", "header is not an object with 'arrays' and 'meta'")
    key, num_tokens, layers, page_hash = h.get("key"), h.get("num_tokens"), h.get("state_layers"), h.get("page_hash")
    if not is_valid_key(key) or not _is_int(num_tokens) or num_tokens < 0:
        raise UnitCorrupt("bad_json", f"bad key {str(key)[:80]!r} or num_tokens {num_tokens!r}")
    if layers is not None and not (_is_int(layers) and layers >= 0):
        raise UnitCorrupt("bad_json", f"bad state_layers {layers!r}")
    try:
        ph = None if page_hash is None else bytes.fromhex(page_hash)
    except (TypeError, ValueError):
        raise UnitCorrupt("bad_json", f"bad page_hash {str(page_hash)[:80]!r}") from None
    if (kind == UnitKind.PAGE) != (ph is not None):
        raise UnitCorrupt("bad_json", "a page unit needs a page_hash and only a page unit has one")
    if len(h["arrays"]) != num_arrays:
        raise UnitCorrupt("bad_layout", f"{len(h['arrays'])} array entries, fixed header says {num_arrays}")
    entries = [_entry(e, i) for i, e in enumerate(h["arrays"])]
    end = json_end
    for a in entries:
        if a.offset < end or a.offset + a.nbytes > total:
            raise UnitCorrupt("bad_layout", f"array {a.group}:{a.name} at [{a.offset}, {a.offset + a.nbytes}) "
                                            f"overlaps the previous part or leaves the {total}-byte unit")
        end = a.offset + a.nbytes
    if end != total:
        raise UnitCorrupt("bad_layout", f"the parts end at {end}, the unit at {total}")
    _check_names(entries, layers)
    return UnitHeader(UnitKind(kind), key, num_tokens, layers, ph, h["meta"], entries, total, json_end)


def _check_names(entries: list[ArrayEntry], layers: int | None) -> None:
    for g in ("kv", "x"):
        names = [a.name for a in entries if a.group == g]
        if len(set(names)) != len(names):
            raise UnitCorrupt("bad_layout", f"duplicate {g} array names")
    want = [str(i) for i in range(layers or 0)]
    for g in ("conv", "rec"):
        if [a.name for a in entries if a.group == g] != want:
            raise UnitCorrupt("bad_layout", f"{g} arrays do not match state_layers={layers}")


def decode_unit(buf: Any, verify: bool = True) -> Unit:
    """Decode (and, with `verify`, check every array's crc32 and the zero padding) an encoded unit.
    The arrays view `buf` without copying. Raises `UnitCorrupt` and nothing else for bad input."""
    mv = byte_view(buf)
    h = read_header(mv)
    arrays: dict[str, dict[str, np.ndarray]] = {g: {} for g in _GROUPS}
    gap = h.json_end
    for a in h.arrays:
        part = mv[a.offset:a.offset + a.nbytes]
        if verify:
            if any(mv[gap:a.offset]):  # at most ALIGN - 1 bytes
                raise UnitCorrupt("bad_layout", f"non-zero padding before array {a.group}:{a.name}")
            got = zlib.crc32(part)
            if got != a.crc32:
                raise UnitCorrupt("bad_checksum", f"array {a.group}:{a.name}: crc32 {a.crc32:#010x}, "
                                                  f"computed {got:#010x}")
        gap = a.offset + a.nbytes
        arr = np.frombuffer(mv, a.dtype, a.nbytes // a.dtype.itemsize, a.offset)
        arrays[a.group][a.name] = arr.reshape(a.shape)
    state = None
    if h.state_layers is not None:
        n = h.state_layers
        state = HybridState([arrays["conv"][str(i)] for i in range(n)], [arrays["rec"][str(i)] for i in range(n)])
    return Unit(h.key, h.kind, KVPageData(arrays["kv"]), state, h.num_tokens, h.meta, arrays["x"], h.page_hash,
                buffer=buf)
