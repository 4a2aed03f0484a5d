"""The .mcapy tensor container: a 144-byte header, an aligned data section, JSON metadata and directory.

Layout written by `McapyWriter` (docs/mcapy.md has the byte table)::

    [header 144 B][zero padding to `alignment`][data: tensors, each at an aligned offset][metadata][directory]

Every section and every tensor carries a crc32. `McapyFile.open` checks the header, the section bounds, the
metadata/directory checksums and every directory entry with integer arithmetic before reading anything the
header sizes, so a corrupt file raises one `McapyError` (with a `.problem` from `PROBLEMS`) instead of
allocating, hanging or returning wrong data; tensor checksums are checked on access and by `verify()`.
"""

from __future__ import annotations

import itertools
import json
import math
import mmap
import os
import secrets
import struct
import threading
import weakref
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import numpy as np

from decapybara.dtypes import DTYPES, FLOAT_DTYPES, f32_to_bf16, storage_name
from decapybara.errors import DecapybaraError

MAGIC = b"\x89MCAPY\r\n"
VERSION = 1
HEADER_FORMAT = "<8sIIIIQQQQQQQQIII40sI"
HEADER_SIZE = 144
assert struct.calcsize(HEADER_FORMAT) == HEADER_SIZE
MIN_ALIGNMENT, MAX_ALIGNMENT = 8, 1 << 20
MAX_NDIM = 32  # NOTE: also bounds the cost of prod(shape) on a crafted directory
_CHUNK = 16 << 20  # bytes per step when checksumming or reading a whole section

PROBLEMS = frozenset({"bad_magic", "unknown_version", "truncated", "out_of_range", "overlap", "misaligned",
                      "bad_checksum", "bad_json", "shape_mismatch"})


class McapyError(DecapybaraError):
    """A .mcapy file is malformed or corrupt; `.problem` names the kind (one of `PROBLEMS`)."""

    def __init__(self, problem: str, message: str) -> None:
        assert problem in PROBLEMS, problem
        super().__init__(f"{problem}: {message}")
        self.problem = problem


@dataclass(slots=True, frozen=True)
class McapyHeader:
    """The decoded fixed header. Offsets are absolute file offsets; `*_crc32` are zlib crc32 values."""

    version: int
    flags: int
    header_size: int
    alignment: int
    tensor_count: int
    metadata_offset: int
    metadata_size: int
    directory_offset: int
    directory_size: int
    data_offset: int
    data_size: int
    file_size: int
    metadata_crc32: int
    directory_crc32: int
    data_crc32: int
    header_crc32: int = 0

    def pack(self) -> bytes:
        """The 144 header bytes, with `header_crc32` computed over the first 140."""
        body = struct.pack(HEADER_FORMAT, MAGIC, self.version, self.flags, self.header_size, self.alignment,
                           self.tensor_count, self.metadata_offset, self.metadata_size, self.directory_offset,
                           self.directory_size, self.data_offset, self.data_size, self.file_size,
                           self.metadata_crc32, self.directory_crc32, self.data_crc32, bytes(40), 0)
        return body[:-4] + struct.pack("<I", zlib.crc32(body[:-4]))

    @classmethod
    def unpack(cls, raw: bytes) -> McapyHeader:
        """Decode and check magic, version, header crc and flags (raises McapyError)."""
        if len(raw) < HEADER_SIZE:
            raise McapyError("truncated", f"file has {len(raw)} bytes, shorter than the {HEADER_SIZE}-byte header")
        v = struct.unpack(HEADER_FORMAT, raw[:HEADER_SIZE])
        if v[0] != MAGIC:
            raise McapyError("bad_magic", f"magic is {v[0]!r}, expected {MAGIC!r}: not a .mcapy file")
        if v[1] != VERSION:
            raise McapyError("unknown_version", f"format version {v[1]} (this reader knows {VERSION})")
        crc = zlib.crc32(raw[:HEADER_SIZE - 4])
        if crc != v[-1]:
            raise McapyError("bad_checksum", f"header crc32 is {v[-1]:#010x}, computed {crc:#010x}")
        if v[2] != 0:
            raise McapyError("unknown_version", f"unknown header flags {v[2]:#x} (version {VERSION} defines none)")
        return cls(*v[1:16], header_crc32=v[-1])


@dataclass(slots=True, frozen=True)
class TensorInfo:
    """A directory entry. `offset` is relative to the data section; `quant` is opaque to the container."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    crc32: int
    quant: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "dtype": self.dtype, "shape": list(self.shape),
                             "offset": self.offset, "nbytes": self.nbytes, "crc32": self.crc32}
        if self.quant is not None:
            d["quant"] = self.quant
        return d


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _check_alignment(alignment: int) -> None:
    if not (MIN_ALIGNMENT <= alignment <= MAX_ALIGNMENT and alignment & (alignment - 1) == 0):
        raise McapyError("misaligned", f"alignment {alignment} is not a power of two in "
                                       f"[{MIN_ALIGNMENT}, {MAX_ALIGNMENT}]")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _parse_json(raw: bytes, what: str) -> Any:
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise McapyError("bad_json", f"{what} is not valid UTF-8 JSON ({type(e).__name__}: {e})") from None


def _parse_entry(e: Any, index: int, data_size: int, alignment: int) -> TensorInfo:
    if not isinstance(e, dict) or not isinstance(e.get("name"), str):
        raise McapyError("bad_json", f"directory entry {index} is not an object with a string name")
    name = e["name"]
    for key in ("offset", "nbytes", "crc32"):
        if not _is_int(e.get(key)):
            raise McapyError("bad_json", f"tensor {name!r}: {key} is {e.get(key)!r}, not an integer")
    shape, dtype, quant = e.get("shape"), e.get("dtype"), e.get("quant")
    if not isinstance(shape, list) or not all(_is_int(d) for d in shape):
        raise McapyError("bad_json", f"tensor {name!r}: shape {shape!r} is not a list of integers")
    if quant is not None and not isinstance(quant, dict):
        raise McapyError("bad_json", f"tensor {name!r}: quant must be an object, got {type(quant).__name__}")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise McapyError("shape_mismatch", f"tensor {name!r}: unknown dtype {dtype!r}")
    if len(shape) > MAX_NDIM or any(not 0 <= d < 1 << 63 for d in shape):
        raise McapyError("shape_mismatch", f"tensor {name!r}: shape {shape[:MAX_NDIM + 1]} has a negative or "
                                           f"huge dimension or more than {MAX_NDIM} dimensions")
    offset, nbytes, crc = e["offset"], e["nbytes"], e["crc32"]
    if nbytes != math.prod(shape) * DTYPES[dtype].itemsize:
        raise McapyError("shape_mismatch", f"tensor {name!r}: nbytes {nbytes} != {shape} x {dtype} "
                                           f"({math.prod(shape) * DTYPES[dtype].itemsize} bytes)")
    if not 0 <= crc < 1 << 32:
        raise McapyError("bad_json", f"tensor {name!r}: crc32 {crc} is not a 32-bit value")
    if offset < 0 or offset + nbytes > data_size:
        raise McapyError("out_of_range", f"tensor {name!r}: bytes [{offset}, {offset + nbytes}) lie outside "
                                         f"the {data_size}-byte data section")
    if offset % alignment:
        raise McapyError("misaligned", f"tensor {name!r}: offset {offset} is not a multiple of {alignment}")
    return TensorInfo(name, dtype, tuple(shape), offset, nbytes, crc, quant)


class _LocalSource:
    """A local file mapped read-only; `view` is zero-copy."""

    def __init__(self, path: Path) -> None:
        with path.open("rb") as fh:  # NOTE: the map keeps its own handle on the file.
            self.size = os.fstat(fh.fileno()).st_size
            self._mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if self.size else None

    def read(self, offset: int, size: int) -> bytes:
        return self._mm[offset:offset + size] if self._mm is not None else b""

    def view(self, offset: int, size: int) -> memoryview | bytes:
        return memoryview(self._mm)[offset:offset + size] if self._mm is not None else b""

    def close(self) -> None:
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # NOTE: arrays still view the map; it is unmapped when the last one goes.
                pass


class _FsspecSource:
    """Any fsspec URL; each read is a ranged read under a lock (the file object has one position)."""

    def __init__(self, url: str) -> None:
        import fsspec

        try:
            fs, path = fsspec.core.url_to_fs(url)
        except (ImportError, ValueError) as e:  # an unknown protocol, or its package not installed
            raise OSError(f"cannot open {url}: {e}") from None
        self.size = int(fs.size(path))
        self._file = fs.open(path, "rb")
        self._lock = threading.Lock()

    def read(self, offset: int, size: int) -> bytes:
        with self._lock:
            self._file.seek(offset)
            data = self._file.read(size)
        if len(data) != size:
            raise McapyError("truncated", f"read {len(data)} of {size} bytes at offset {offset}")
        return data

    view = read

    def close(self) -> None:
        self._file.close()


class McapyFile:
    """A validated, read-only .mcapy file. Open with `McapyFile.open(path_or_url)`."""

    def __init__(self, source: _LocalSource | _FsspecSource, name: str) -> None:
        self._src = source
        self.name = name
        self._verified: set[str] = set()
        try:
            self.header = self._check_header()
            self.metadata: dict[str, Any] = self._read_metadata()
            self.tensors: dict[str, TensorInfo] = self._read_directory()
        except BaseException:
            source.close()
            raise

    @classmethod
    def open(cls, path_or_url: str | os.PathLike[str]) -> McapyFile:
        """Local paths are memory-mapped; any other fsspec URL (``memory://``, ``file://``, ``s3://``...) is
        read with ranged reads. Raises McapyError for a malformed file, OSError when it cannot be read."""
        url = os.fspath(path_or_url)
        if "://" in url:
            return cls(_FsspecSource(url), url)
        return cls(_LocalSource(Path(url)), url)

    # ---- validation on open --------------------------------------------------------------------------
    def _check_header(self) -> McapyHeader:
        size = self._src.size
        h = McapyHeader.unpack(self._src.read(0, min(size, HEADER_SIZE)))
        if h.header_size != HEADER_SIZE:
            raise McapyError("out_of_range", f"header_size {h.header_size} != {HEADER_SIZE}")
        _check_alignment(h.alignment)
        if size < h.file_size:
            raise McapyError("truncated", f"file has {size} bytes, header says {h.file_size}")
        if size > h.file_size:
            raise McapyError("out_of_range", f"file has {size - h.file_size} bytes beyond file_size {h.file_size}")
        if h.data_offset % h.alignment:
            raise McapyError("misaligned", f"data_offset {h.data_offset} is not a multiple of {h.alignment}")
        sections = [("metadata", h.metadata_offset, h.metadata_size),
                    ("directory", h.directory_offset, h.directory_size), ("data", h.data_offset, h.data_size)]
        for what, off, n in sections:
            if off < h.header_size or off + n > h.file_size:
                raise McapyError("out_of_range", f"{what} section [{off}, {off + n}) lies outside "
                                                 f"[{h.header_size}, {h.file_size})")
        # an empty section takes no bytes: the writer puts an empty data section (no tensors, or only
        # empty ones) at the metadata's offset, so the metadata must not count as overlapping it.
        sections = sorted((s for s in sections if s[2]), key=lambda s: s[1])
        for (a, a_off, a_n), (b, b_off, _) in itertools.pairwise(sections):
            if a_off + a_n > b_off:
                raise McapyError("overlap", f"{a} section [{a_off}, {a_off + a_n}) overlaps {b} at {b_off}")
        return h

    def _section(self, what: str, offset: int, size: int, crc: int) -> bytes:
        raw = self._src.read(offset, size)
        got = zlib.crc32(raw)
        if got != crc:
            raise McapyError("bad_checksum", f"{what} crc32 is {got:#010x}, header says {crc:#010x}")
        return raw

    def _read_metadata(self) -> dict[str, Any]:
        h = self.header
        meta = _parse_json(self._section("metadata", h.metadata_offset, h.metadata_size, h.metadata_crc32),
                           "metadata")
        if not isinstance(meta, dict):
            raise McapyError("bad_json", f"metadata is a JSON {type(meta).__name__}, not an object")
        return meta

    def _read_directory(self) -> dict[str, TensorInfo]:
        h = self.header
        entries = _parse_json(self._section("directory", h.directory_offset, h.directory_size,
                                            h.directory_crc32), "directory")
        if not isinstance(entries, list):
            raise McapyError("bad_json", f"directory is a JSON {type(entries).__name__}, not a list")
        if len(entries) != h.tensor_count:
            raise McapyError("bad_json", f"directory lists {len(entries)} tensors, header says {h.tensor_count}")
        tensors: dict[str, TensorInfo] = {}
        for i, e in enumerate(entries):
            info = _parse_entry(e, i, h.data_size, h.alignment)
            if info.name in tensors:
                raise McapyError("bad_json", f"tensor {info.name!r} is listed twice")
            tensors[info.name] = info
        spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in tensors.values() if t.nbytes)
        for (_, a_end, a), (b_off, _, b) in itertools.pairwise(spans):
            if a_end > b_off:
                raise McapyError("overlap", f"tensor {a!r} (ends at {a_end}) overlaps {b!r} (starts at {b_off})")
        return tensors

    # ---- access ----------------------------------------------------------------------------------------
    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def names(self) -> list[str]:
        """Tensor names in directory (write) order."""
        return list(self.tensors)

    def tensor(self, name: str, verify: bool = True) -> np.ndarray:
        """The tensor as a read-only numpy array (bf16 as uint16 bits); a zero-copy view for local files.
        With `verify`, its crc32 is checked on first access (McapyError bad_checksum on mismatch)."""
        try:
            t = self.tensors[name]
        except KeyError:
            raise KeyError(f"{self.name} has no tensor {name!r}") from None
        buf = self._src.view(self.header.data_offset + t.offset, t.nbytes)
        if verify and name not in self._verified:
            got = zlib.crc32(buf)
            if got != t.crc32:
                raise McapyError("bad_checksum", f"tensor {name!r} crc32 is {got:#010x}, directory says "
                                                 f"{t.crc32:#010x}")
            self._verified.add(name)
        return np.frombuffer(buf, dtype=DTYPES[t.dtype]).reshape(t.shape)

    def verify(self) -> None:
        """Check every section checksum, every tensor checksum and that uncovered gaps are zero bytes."""
        h = self.header
        self._section("metadata", h.metadata_offset, h.metadata_size, h.metadata_crc32)
        self._section("directory", h.directory_offset, h.directory_size, h.directory_crc32)
        crc = 0
        for off in range(h.data_offset, h.data_offset + h.data_size, _CHUNK):
            crc = zlib.crc32(self._src.view(off, min(_CHUNK, h.data_offset + h.data_size - off)), crc)
        if crc != h.data_crc32:
            raise McapyError("bad_checksum", f"data section crc32 is {crc:#010x}, header says {h.data_crc32:#010x}")
        for name in self.tensors:
            self._verified.discard(name)
            self.tensor(name, verify=True)
        covered = sorted([(0, HEADER_SIZE), (h.metadata_offset, h.metadata_size),
                          (h.directory_offset, h.directory_size), (h.data_offset, h.data_size)])
        pos = 0
        for off, n in [*covered, (h.file_size, 0)]:
            for g in range(pos, off, _CHUNK):
                if any(self._src.read(g, min(_CHUNK, off - g))):
                    raise McapyError("bad_checksum", f"padding bytes in [{pos}, {off}) are not zero")
            pos = max(pos, off + n)

    def close(self) -> None:
        self._src.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


@dataclass(slots=True)
class _Pending:
    """The tensor being streamed by `add_tensor_chunks`."""

    start: int
    nbytes: int = 0
    crc: int = 0


class McapyWriter:
    """Streams tensors into a temp file beside `path`; `close()` finalises and renames it atomically.

    Used as a context manager, an exception inside the block (or `abort()`) removes the temp file and leaves
    nothing at `path`. Misuse (duplicate name, unsupported dtype, writing after close) raises ValueError.
    """

    def __init__(self, path: str | os.PathLike[str], metadata: dict[str, Any] | None = None,
                 alignment: int = 256) -> None:
        _check_alignment(alignment)
        self.path = Path(path)
        self.alignment = alignment
        self.metadata: dict[str, Any] = dict(metadata or {})
        self._entries: dict[str, TensorInfo] = {}
        self._tmp = str(self.path.parent / f".{self.path.name}.{secrets.token_hex(6)}.tmp")
        fd = os.open(self._tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o666)
        self._finalizer = weakref.finalize(self, _remove, self._tmp)
        self._file = os.fdopen(fd, "w+b")
        self._data_offset = _round_up(HEADER_SIZE, alignment)
        self._file.write(bytes(self._data_offset))
        self._pos = self._data_offset
        self._data_crc = 0
        self._closed = False

    def set_metadata(self, key: str, value: Any) -> None:
        self.metadata[key] = value

    def _write(self, buf: Any) -> None:
        self._file.write(buf)
        self._data_crc = zlib.crc32(buf, self._data_crc)

    def add_tensor(self, name: str, array: Any, dtype: str | None = None,
                   quant: dict[str, Any] | None = None) -> TensorInfo:
        """Append one tensor. `dtype` defaults to the array's; a float array may be stored as another float
        dtype ("bf16" rounds to nearest even); a uint16 array with dtype="bf16" is taken as raw bf16 bits."""
        arr = np.asarray(array)
        src = storage_name(arr.dtype)
        dtype = dtype or src
        if dtype not in DTYPES:
            raise ValueError(f"tensor {name!r}: unknown dtype {dtype!r}")
        if dtype == "bf16" and src in ("f32", "f16", "f64"):
            arr = f32_to_bf16(arr)
        elif dtype != src and not (dtype == "bf16" and src == "u16"):
            if dtype not in FLOAT_DTYPES or src not in FLOAT_DTYPES:
                raise ValueError(f"tensor {name!r}: will not convert {arr.dtype} to {dtype}")
            arr = arr.astype(DTYPES[dtype])
        return self.add_tensor_chunks(name, dtype, arr.shape, [arr], quant)

    def add_tensor_chunks(self, name: str, dtype: str, shape: Iterable[int], chunks: Iterable[np.ndarray],
                          quant: dict[str, Any] | None = None) -> TensorInfo:
        """Append one tensor from C-order pieces already in the storage dtype (bf16 as uint16), so a tensor
        never has to sit whole in RAM. The pieces must add up to exactly prod(shape) elements."""
        if self._closed:
            raise ValueError("the writer is closed")
        if name in self._entries:
            raise ValueError(f"duplicate tensor name {name!r}")
        shape = tuple(int(d) for d in shape)
        if dtype not in DTYPES or any(d < 0 for d in shape):
            raise ValueError(f"tensor {name!r}: bad dtype {dtype!r} or shape {shape}")
        want = DTYPES[dtype]
        self._write(bytes(_round_up(self._pos, self.alignment) - self._pos))
        p = _Pending(start=_round_up(self._pos, self.alignment))
        try:
            for chunk in chunks:
                c = np.ascontiguousarray(chunk)
                if c.dtype.kind != want.kind or c.dtype.itemsize != want.itemsize:
                    raise ValueError(f"tensor {name!r}: chunk dtype {c.dtype} is not {dtype}")
                raw = c.astype(want, copy=False).reshape(-1).view(np.uint8)
                self._write(raw)
                p.crc = zlib.crc32(raw, p.crc)
                p.nbytes += raw.size
            if p.nbytes != math.prod(shape) * want.itemsize:
                raise ValueError(f"tensor {name!r}: got {p.nbytes} bytes for shape {shape} x {dtype}")
        except BaseException:
            self.abort()
            raise
        self._pos = p.start + p.nbytes
        info = TensorInfo(name, dtype, shape, p.start - self._data_offset, p.nbytes, p.crc, quant)
        self._entries[name] = info
        return info

    def close(self) -> None:
        """Write metadata, directory and header; fsync; rename to `path`. Aborts (and re-raises) on failure."""
        if self._closed:
            return
        try:
            meta = json.dumps(self.metadata, ensure_ascii=False, allow_nan=False).encode()
            dirs = json.dumps([e.to_json() for e in self._entries.values()], allow_nan=False).encode()
            self._file.write(meta)
            self._file.write(dirs)
            data_size = self._pos - self._data_offset
            h = McapyHeader(VERSION, 0, HEADER_SIZE, self.alignment, len(self._entries),
                            self._pos, len(meta), self._pos + len(meta), len(dirs), self._data_offset, data_size,
                            self._pos + len(meta) + len(dirs), zlib.crc32(meta), zlib.crc32(dirs),
                            self._data_crc)
            self._file.seek(0)
            self._file.write(h.pack())
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            os.replace(self._tmp, self.path)
        except BaseException:
            self.abort()
            raise
        self._closed = True
        self._finalizer.detach()
        _fsync_dir(self.path.parent)

    def abort(self) -> None:
        """Discard everything written: the temp file is removed and `path` is left untouched."""
        self._closed = True
        self._file.close()
        self._finalizer()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


__all__ = ["HEADER_SIZE", "MAGIC", "PROBLEMS", "VERSION", "McapyError", "McapyFile", "McapyHeader",
           "McapyWriter", "TensorInfo"]
