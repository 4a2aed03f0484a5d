"""Block-scaled formats (MXFP8/6/4 and NVFP4) along the last axis, and the `QuantTensor` that holds them.

A tensor [..., K] is cut into blocks of `block` consecutive elements along K (K is zero-padded to a multiple
of the block; the logical shape is kept). Each block has one scale; element i decodes to

    x_i = elem(code_i) * scale_block (* tensor_scale for NVFP4)

MX scale selection (OCP MX v1.0, section 6.3): scale = 2^(floor(log2(amax)) - emax_elem), amax being the
block's largest magnitude and emax_elem the exponent of the element format's largest normal; the exponent is
clamped to E8M0's [-127, 127], an all-zero block gets the smallest scale (code 0) and a block holding NaN or
inf gets the NaN scale (0xFF). Elements are then x / scale rounded to nearest even and saturated to the max
normal, so the top binade may clip (e.g. MXFP4: amax / scale is in [4, 8) and anything above 6 becomes 6).

NVFP4 (NVIDIA): E2M1 elements, blocks of 16, an E4M3 block scale and one float32 tensor scale
ts = amax_tensor / (448 * 6); block scale = e4m3(amax_block / (6 * ts)) (round to nearest even, saturating);
elements = e2m1(x / (block scale * ts)). A block whose scale rounds to 0 decodes to zeros.

Dequantisation is exact up to one float32 rounding: elem * scale is exact (few mantissa bits), the tensor
scale multiply rounds once, as a GPU kernel computing fl32(fl32(elem * scale) * ts) does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from decapybara.errors import ConfigError, WeightError
from decapybara.model.quant.elements import (
    E2M1,
    E2M3,
    E3M2,
    E4M3,
    E5M2,
    E8M0_NAN,
    ElementFormat,
    decode_elements,
    e8m0_decode,
    e8m0_encode,
    encode_elements,
)
from decapybara.model.quant.packing import pack_codes, packed_width, unpack_codes

NVFP4_TENSOR_DIVISOR = 448.0 * 6.0  # E4M3 max * E2M1 max
# Rows are quantised in chunks of about this many elements, so float64 temporaries stay small.
_CHUNK_ELEMS = 1 << 22


@dataclass(slots=True, frozen=True)
class BlockFormat:
    """A block format: element type, block length, scale type (``e8m0`` or ``e4m3``), tensor scale or not."""

    name: str
    elem: ElementFormat
    block: int
    scale: str
    tensor_scale: bool = False

    @property
    def bits(self) -> int:
        return self.elem.bits

    @property
    def bits_per_weight(self) -> float:
        """Element bits plus the amortised block scale (the one tensor scale is not counted)."""
        return self.bits + 8 / self.block

    def padded(self, k: int) -> int:
        return -(-k // self.block) * self.block

    def code_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (*shape[:-1], packed_width(self.padded(shape[-1]), self.bits))

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (*shape[:-1], self.padded(shape[-1]) // self.block)

    def nbytes(self, shape: tuple[int, ...]) -> int:
        """Bytes of a tensor of logical `shape` in this format (codes + scales + tensor scale)."""
        return math.prod(self.code_shape(shape)) + math.prod(self.scale_shape(shape)) + 4 * self.tensor_scale


FORMATS: dict[str, BlockFormat] = {
    f.name: f
    for f in (
        BlockFormat("mxfp8", E4M3, 32, "e8m0"),
        BlockFormat("mxfp8_e5m2", E5M2, 32, "e8m0"),
        BlockFormat("mxfp6", E2M3, 32, "e8m0"),
        BlockFormat("mxfp6_e3m2", E3M2, 32, "e8m0"),
        BlockFormat("mxfp4", E2M1, 32, "e8m0"),
        BlockFormat("nvfp4", E2M1, 16, "e4m3", tensor_scale=True),
    )
}


def get_format(name: str) -> BlockFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ConfigError(f"unknown quant format {name!r}; known: {', '.join(FORMATS)}") from None


# ---- scales ------------------------------------------------------------------------------------------
def nvfp4_tensor_scale(x: np.ndarray) -> np.float32:
    """NVFP4's float32 tensor scale: amax / (448 * 6) over the finite values (1.0 for an all-zero tensor).

    Never 0: where amax / 2688 underflows float32 (amax below about 3.8e-42) it is float32's smallest
    subnormal, so the block scales stay finite (a zero tensor scale would divide every block by zero)."""
    a = np.abs(np.asarray(x, np.float32))
    amax = float(a[np.isfinite(a)].max(initial=0.0))
    if amax <= 0:
        return np.float32(1.0)
    return max(np.float32(amax / NVFP4_TENSOR_DIVISOR), np.finfo(np.float32).smallest_subnormal)


def select_scales(blocks: np.ndarray, fmt: BlockFormat, tensor_scale: float | None = None
                  ) -> tuple[np.ndarray, np.ndarray]:
    """[..., nblocks, block] values -> (scale codes uint8, effective scales float64), both [..., nblocks].

    The effective scale includes the tensor scale: elements are x / effective and decode to elem * effective.
    """
    amax = np.max(np.abs(np.asarray(blocks, np.float64)), axis=-1)  # NaN propagates
    if fmt.scale == "e8m0":
        finite = np.isfinite(amax)
        _, e = np.frexp(np.where(finite, amax, 0.0))  # amax = m * 2^e, m in [0.5, 1): floor(log2) = e - 1
        codes = e8m0_encode(np.where(amax > 0, e - 1 - fmt.elem.emax, -127))
        codes[~finite] = E8M0_NAN
        return codes, e8m0_decode(codes)
    if tensor_scale is None:
        raise ValueError(f"{fmt.name} scales need the tensor scale")
    ts = float(tensor_scale)
    target = amax / (fmt.elem.max_normal * ts)
    codes = encode_elements(E4M3, np.where(np.isinf(target), np.nan, target))
    return codes, E4M3.table[codes] * ts


def divide_by_scale(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """x / scale with a zero or NaN scale giving 0 (those blocks decode to 0 or NaN from the scale alone)."""
    ok = np.isfinite(scale) & (scale > 0)
    return np.where(ok, x / np.where(ok, scale, 1.0), 0.0)


def _quantize_rows(x: np.ndarray, fmt: BlockFormat, ts: float | None) -> tuple[np.ndarray, np.ndarray]:
    """[R, Kp] float values -> (packed codes [R, Kp * bits / 8], scale codes [R, Kp / block])."""
    r, kp = x.shape
    blocks = x.astype(np.float64).reshape(r, kp // fmt.block, fmt.block)  # [R, nblocks, block]
    scodes, svals = select_scales(blocks, fmt, ts)
    codes = encode_elements(fmt.elem, divide_by_scale(blocks, svals[..., None])).reshape(r, kp)
    return pack_codes(codes, fmt.bits), scodes


# ---- the tensor ---------------------------------------------------------------------------------------
PARTS = ("codes", "scales", "tensor_scale")


@dataclass(slots=True)
class QuantTensor:
    """A block-quantised tensor.

    `shape` is the logical shape; `codes` [..., Kp * bits / 8] uint8 packed per `packing`; `scales`
    [..., Kp / block] uint8 (E8M0, or E4M3 for NVFP4); `tensor_scale` float32 for NVFP4, else None.
    """

    fmt: str
    shape: tuple[int, ...]
    codes: np.ndarray
    scales: np.ndarray
    tensor_scale: np.float32 | None = None

    def __post_init__(self) -> None:
        f = get_format(self.fmt)
        self.shape = tuple(int(s) for s in self.shape)
        if not self.shape or min(self.shape) <= 0:
            raise WeightError(f"{self.fmt}: logical shape {self.shape} must be non-empty with positive sizes")
        for part, arr, want in (("codes", self.codes, f.code_shape(self.shape)),
                                ("scales", self.scales, f.scale_shape(self.shape))):
            if not isinstance(arr, np.ndarray) or arr.dtype != np.uint8 or arr.shape != want:
                got = (getattr(arr, "dtype", type(arr)), getattr(arr, "shape", None))
                raise WeightError(f"{self.fmt} {self.shape}: {part} must be uint8 {want}, got {got}")
        if f.tensor_scale != (self.tensor_scale is not None):
            raise WeightError(f"{self.fmt}: tensor_scale {'missing' if f.tensor_scale else 'not expected'}")
        if self.tensor_scale is not None:
            self.tensor_scale = np.float32(self.tensor_scale)

    @property
    def format(self) -> BlockFormat:
        return FORMATS[self.fmt]

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes + (4 if self.tensor_scale is not None else 0)

    @property
    def bits_per_weight(self) -> float:
        """Stored bits per logical element, padding and every scale included."""
        return self.nbytes * 8 / math.prod(self.shape)

    def dequantize(self) -> np.ndarray:
        """float32 array of the logical shape (see the module function `dequantize`)."""
        return dequantize(self)

    def to_parts(self) -> dict[str, np.ndarray]:
        """Raw arrays for the .mcapy container, stored as ``{name}:{part}`` for part in `PARTS`."""
        parts = {"codes": self.codes, "scales": self.scales}
        if self.tensor_scale is not None:
            parts["tensor_scale"] = np.array([self.tensor_scale], np.float32)
        return parts

    @classmethod
    def from_parts(cls, fmt: str, logical_shape: tuple[int, ...],
                   parts: dict[str, np.ndarray]) -> QuantTensor:
        """Inverse of `to_parts`; a missing, misshaped or mistyped part is a `WeightError`."""
        unknown = set(parts) - set(PARTS)
        missing = {"codes", "scales"} - set(parts)
        if unknown or missing:
            raise WeightError(f"{fmt} parts: missing {sorted(missing)}, unknown {sorted(unknown)}")
        ts = parts.get("tensor_scale")
        if ts is not None:
            ts = np.asarray(ts)
            if ts.dtype != np.float32 or ts.shape != (1,):
                raise WeightError(f"{fmt}: tensor_scale must be float32 (1,), got {ts.dtype} {ts.shape}")
            ts = ts[0]
        return cls(fmt, tuple(logical_shape), np.asarray(parts["codes"]), np.asarray(parts["scales"]), ts)


def quantize(x: np.ndarray, fmt: str) -> QuantTensor:
    """Round-to-nearest block quantisation of `x` (taken as float32) along its last axis."""
    f = get_format(fmt)
    x = np.asarray(x, np.float32)
    if x.ndim == 0 or x.size == 0:
        raise ValueError(f"cannot quantise an array of shape {x.shape}")
    shape, k = x.shape, x.shape[-1]
    kp = f.padded(k)
    rows = x.reshape(-1, k)  # [R, K]
    ts = nvfp4_tensor_scale(x) if f.tensor_scale else None
    codes = np.empty((rows.shape[0], packed_width(kp, f.bits)), np.uint8)
    scales = np.empty((rows.shape[0], kp // f.block), np.uint8)
    step = max(1, _CHUNK_ELEMS // kp)
    for r0 in range(0, rows.shape[0], step):  # chunks of rows: float64 temporaries stay small
        chunk = rows[r0:r0 + step]
        if kp != k:
            chunk = np.pad(chunk, ((0, 0), (0, kp - k)))
        codes[r0:r0 + step], scales[r0:r0 + step] = _quantize_rows(chunk, f, ts)
    codes, scales = codes.reshape(f.code_shape(shape)), scales.reshape(f.scale_shape(shape))
    return QuantTensor(fmt, shape, codes, scales, ts)


def dequantize(q: QuantTensor) -> np.ndarray:
    """QuantTensor -> float32 array of the logical shape."""
    f = q.format
    k = q.shape[-1]
    elems = decode_elements(f.elem, unpack_codes(q.codes, f.bits)).astype(np.float64)  # [..., Kp]
    if f.scale == "e8m0":
        svals = e8m0_decode(q.scales)
    else:
        svals = E4M3.table[q.scales] * float(q.tensor_scale)
    blocks = elems.reshape(*elems.shape[:-1], -1, f.block) * svals[..., None]  # [..., nblocks, block]
    return blocks.reshape(elems.shape)[..., :k].astype(np.float32)


def format_nbytes(fmt: str, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of `shape` stored as `fmt` (a block format name, ``bf16`` or ``f32``)."""
    if fmt == "bf16":
        return 2 * math.prod(shape)
    if fmt == "f32":
        return 4 * math.prod(shape)
    return get_format(fmt).nbytes(shape)
