"""Storage dtypes of the .mcapy container and bfloat16 conversion in plain numpy.

numpy has no bfloat16, so bf16 data lives in numpy as raw ``uint16`` bit patterns (the top half of the
float32 bits). `f32_to_bf16` rounds to nearest, ties to even (what torch's ``.to(torch.bfloat16)`` does) and
keeps a NaN a NaN (its sign and top payload bits, with the quiet bit set); `bf16_to_f32` is exact.
"""

from __future__ import annotations

import numpy as np

# Storage dtype name -> little-endian numpy dtype (bf16 as raw uint16 bits).
DTYPES: dict[str, np.dtype] = {
    "f32": np.dtype("<f4"),
    "f16": np.dtype("<f2"),
    "bf16": np.dtype("<u2"),
    "f64": np.dtype("<f8"),
    "i8": np.dtype("i1"),
    "u8": np.dtype("u1"),
    "i16": np.dtype("<i2"),
    "u16": np.dtype("<u2"),
    "i32": np.dtype("<i4"),
    "u32": np.dtype("<u4"),
    "i64": np.dtype("<i8"),
}
FLOAT_DTYPES = ("f32", "f16", "bf16", "f64")

# numpy (kind, itemsize) -> storage name; uint16 maps to "u16" (bf16 must be asked for by name).
_FROM_NUMPY = {(d.kind, d.itemsize): name for name, d in DTYPES.items() if name != "bf16"}

# Elements converted per step, so the uint32 temporaries of a huge tensor stay small.
_BLOCK = 1 << 22


def itemsize(dtype: str) -> int:
    """Bytes per element of a storage dtype (KeyError for an unknown name)."""
    return DTYPES[dtype].itemsize


def storage_name(dtype: np.dtype) -> str:
    """The storage name of a numpy dtype; ValueError for dtypes the container cannot hold (bool, complex...)."""
    dtype = np.dtype(dtype)
    try:
        return _FROM_NUMPY[(dtype.kind, dtype.itemsize)]
    except KeyError:
        raise ValueError(f"numpy dtype {dtype} has no .mcapy storage dtype") from None


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 (or any float array, cast to float32 first) -> bf16 bits as uint16, same shape."""
    src = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    out = np.empty(src.shape, dtype=np.uint16)
    for start in range(0, src.size, _BLOCK):
        block = src[start:start + _BLOCK]
        bits = block.view(np.uint32)
        # NOTE: adding 0x7FFF plus the lowest kept bit rounds to nearest, ties to even. The sum only
        # overflows uint32 for negative NaNs, which are overwritten below.
        rounded = (bits + (((bits >> 16) & 1) + 0x7FFF).astype(np.uint32)) >> 16
        nan = np.isnan(block)
        if nan.any():
            rounded[nan] = (bits[nan] >> 16) | 0x0040
        out[start:start + block.size] = rounded
    return out.reshape(np.shape(x))


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bf16 bits (uint16) -> float32, exact, same shape."""
    u = np.asarray(bits)
    if u.dtype != np.uint16:
        raise ValueError(f"bf16 data must be uint16 bit patterns, got {u.dtype}")
    return (u.astype(np.uint32) << 16).view(np.float32)


def to_float32(data: np.ndarray, dtype: str) -> np.ndarray:
    """Stored data of a float storage dtype -> float32 (a no-copy view when it already is float32)."""
    if dtype == "f32":
        return data
    if dtype == "bf16":
        return bf16_to_f32(data)
    if dtype in ("f16", "f64"):
        return data.astype(np.float32)
    raise ValueError(f"dtype {dtype!r} is not a float storage dtype")
