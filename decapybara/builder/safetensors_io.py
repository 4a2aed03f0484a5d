"""A torch-free safetensors reader and the tensor store of a (possibly sharded) HF checkpoint folder.

A safetensors file is an 8-byte little-endian header length, a JSON header (name -> dtype, shape,
data_offsets relative to the end of the header) and the raw bytes. We map it read-only and hand out numpy
views, bf16 as raw uint16 bits, so neither torch nor a whole shard ever has to be in memory.
"""

from __future__ import annotations

import json
import math
import mmap
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from decapybara.dtypes import DTYPES
from decapybara.errors import WeightError

# safetensors dtype -> our storage dtype name (others, e.g. BOOL or F8_E4M3, are listed but not readable).
ST_DTYPES = {"F64": "f64", "F32": "f32", "F16": "f16", "BF16": "bf16", "I64": "i64", "I32": "i32",
             "I16": "i16", "I8": "i8", "U8": "u8", "U16": "u16", "U32": "u32"}
_MAX_HEADER = 1 << 28  # a header over 256 MiB is corruption, not a checkpoint
INDEX_NAME = "model.safetensors.index.json"


@dataclass(slots=True, frozen=True)
class StEntry:
    """One tensor of a safetensors file: `dtype` is the file's own name (F32, BF16...), offsets absolute."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


class SafetensorsFile:
    """Header parsed and checked on open; the data is mapped on first `array` call."""

    def __init__(self, path: Path) -> None:
        self.path = path
        size = path.stat().st_size
        with path.open("rb") as fh:
            n = int.from_bytes(fh.read(8), "little") if size >= 8 else -1
            if not 0 < n <= min(size - 8, _MAX_HEADER):
                raise WeightError(f"{path.name}: not a safetensors file (header length {n}, file {size} bytes)")
            raw = fh.read(n)
        try:
            header = json.loads(raw)
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise WeightError(f"{path.name}: safetensors header is not JSON ({e})") from None
        if not isinstance(header, dict):
            raise WeightError(f"{path.name}: safetensors header is not a JSON object")
        header.pop("__metadata__", None)
        data_start, data_len = 8 + n, size - 8 - n
        self.entries: dict[str, StEntry] = {}
        for name, e in header.items():
            self.entries[name] = _entry(path, name, e, data_start, data_len)
        self._mm: mmap.mmap | None = None

    def array(self, name: str) -> np.ndarray:
        """The tensor's raw data as a read-only view (bf16 as uint16); WeightError for unreadable dtypes."""
        e = self.entries[name]
        if e.dtype not in ST_DTYPES:
            raise WeightError(f"{self.path.name}: tensor {name} has dtype {e.dtype}, which the builder cannot read")
        if e.begin == e.end:
            return np.zeros(e.shape, DTYPES[ST_DTYPES[e.dtype]])
        if self._mm is None:
            with self.path.open("rb") as fh:
                self._mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        buf = memoryview(self._mm)[e.begin:e.end]
        return np.frombuffer(buf, DTYPES[ST_DTYPES[e.dtype]]).reshape(e.shape)

    def close(self) -> None:
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # NOTE: views still alive; the map goes when they do.
                pass
            self._mm = None


def _entry(path: Path, name: str, e: object, data_start: int, data_len: int) -> StEntry:
    bad = WeightError(f"{path.name}: malformed safetensors entry for {name}: {e!r}"[:300])
    if not isinstance(e, dict):
        raise bad
    dtype, shape, offs = e.get("dtype"), e.get("shape"), e.get("data_offsets")
    if not (isinstance(dtype, str) and isinstance(shape, list) and isinstance(offs, list) and len(offs) == 2):
        raise bad
    if len(shape) > 32 or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in [*shape, *offs]):
        raise bad
    begin, end = offs
    if not begin <= end <= data_len:
        raise WeightError(f"{path.name}: tensor {name} bytes [{begin}, {end}) lie outside the "
                          f"{data_len}-byte data area (truncated file?)")
    if dtype in ST_DTYPES and end - begin != math.prod(shape) * DTYPES[ST_DTYPES[dtype]].itemsize:
        raise WeightError(f"{path.name}: tensor {name} has {end - begin} bytes for shape {shape} {dtype}")
    return StEntry(name, dtype, tuple(shape), data_start + begin, data_start + end)


class TensorStore:
    """Every tensor of a checkpoint folder: name -> (file, entry), across shards."""

    def __init__(self, files: list[SafetensorsFile]) -> None:
        self.files = files
        self.where: dict[str, SafetensorsFile] = {}
        for f in files:
            for name in f.entries:
                if name in self.where:
                    raise WeightError(f"tensor {name} appears in both {self.where[name].path.name} and "
                                      f"{f.path.name}")
                self.where[name] = f

    def entry(self, name: str) -> StEntry:
        return self.where[name].entries[name]

    def close(self) -> None:
        for f in self.files:
            f.close()


def open_store(folder: Path) -> TensorStore:
    """Open `model.safetensors`, or the shards named by `model.safetensors.index.json` (checked against the
    shard headers), or failing both every `model*.safetensors` in the folder."""
    index = folder / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (ValueError, KeyError, TypeError) as e:
            raise WeightError(f"{index.name} is malformed: {e}") from None
        names = sorted(set(weight_map.values()))
        for n in names:
            if not isinstance(n, str) or Path(n).name != n or not (folder / n).is_file():
                raise WeightError(f"{index.name} names shard {n!r}, which is not a file in {folder}")
        store = TensorStore([SafetensorsFile(folder / n) for n in names])
        for name, shard in weight_map.items():
            if name not in store.where or store.where[name].path.name != shard:
                store.close()
                raise WeightError(f"{index.name} puts {name} in {shard}, but that shard has no such tensor")
        return store
    paths = [folder / "model.safetensors"] if (folder / "model.safetensors").is_file() else \
        sorted(folder.glob("model*.safetensors"))
    if not paths:
        raise WeightError(f"{folder} has no model.safetensors or {INDEX_NAME} "
                          "(only safetensors checkpoints are supported)")
    return TensorStore([SafetensorsFile(p) for p in paths])
