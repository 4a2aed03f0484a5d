"""Scalar element codecs of the OCP MX v1.0 formats, the E8M0 scale and bfloat16.

An element format is sign | exponent | mantissa, most significant bit first. Exponent field 0 holds zero and
the subnormals (f * 2^(1 - bias - m)); any other field e holds (1 + f/2^m) * 2^(e - bias). Specials:

- FP8 E4M3 (OCP): only S.1111.111 is NaN, no infinities, max normal 448, min subnormal 2^-9.
- FP8 E5M2: IEEE-like, exponent field 31 holds +-inf (mantissa 0) and NaN; max normal 57344.
- FP6 E2M3 (max 7.5), FP6 E3M2 (max 28), FP4 E2M1 (+-{0, 0.5, 1, 1.5, 2, 3, 4, 6}): no inf, no NaN.

Encoding (float -> code) rounds to nearest, ties to the even code (= even mantissa), and saturates: anything
beyond the max normal, infinities included, becomes +-max normal (the MX spec's conversion). The sign of zero
is kept. NaN becomes the format's NaN code; a format without one rejects NaN (the block codecs never pass one:
a block holding NaN gets a NaN scale instead). Decoding is one table lookup.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from decapybara.dtypes import bf16_to_f32, f32_to_bf16


@dataclass(slots=True, frozen=True, eq=False)
class ElementFormat:
    """One minifloat element type and its lookup tables (built by `_make`, never by hand)."""

    name: str
    ebits: int
    mbits: int
    bias: int
    emax: int  # exponent of the largest normal (the MX spec's emax_elem)
    max_normal: float
    min_subnormal: float
    nan_code: int | None  # the positive NaN code, None where the format has no NaN
    table: np.ndarray  # float64 [2**bits]: code -> value (NaN / inf where the format says so)
    mids: np.ndarray  # float64: midpoints between consecutive non-negative finite values

    @property
    def bits(self) -> int:
        return 1 + self.ebits + self.mbits

    def ulp(self, magnitude: np.ndarray) -> np.ndarray:
        """Spacing of representable values in the binade of each |magnitude| (subnormal spacing below)."""
        m = np.abs(np.asarray(magnitude, np.float64))
        _, e = np.frexp(m)  # m = f * 2^e, f in [0.5, 1): the binade is 2^(e - 1)
        exp = np.where(m > 0, np.maximum(e - 1, 1 - self.bias), 1 - self.bias)
        return np.ldexp(1.0, exp - self.mbits)


def _make(name: str, ebits: int, mbits: int, special: str) -> ElementFormat:
    """A format from its bit definition; `special` is ``none``, ``e4m3`` (S.1111.111 NaN) or ``ieee``."""
    bits = 1 + ebits + mbits
    bias = (1 << (ebits - 1)) - 1
    code = np.arange(1 << bits)
    sign = np.where(code >> (bits - 1), -1.0, 1.0)
    e = (code >> mbits) & ((1 << ebits) - 1)
    f = code & ((1 << mbits) - 1)
    mag = np.where(e == 0, np.ldexp(f.astype(np.float64), 1 - bias - mbits),
                   np.ldexp(1.0 + f / (1 << mbits), e - bias))
    top = e == (1 << ebits) - 1
    nan_code: int | None = None
    if special == "e4m3":
        is_nan = top & (f == (1 << mbits) - 1)
        mag = np.where(is_nan, np.nan, mag)
        nan_code = (1 << (bits - 1)) - 1
    elif special == "ieee":
        mag = np.where(top & (f == 0), np.inf, np.where(top, np.nan, mag))
        nan_code = (1 << (bits - 1)) - 1
    table = sign * mag
    pos = table[: 1 << (bits - 1)]
    pos = pos[np.isfinite(pos)]  # codes 0.. ascend with value; drop the NaN / inf tail
    return ElementFormat(
        name=name, ebits=ebits, mbits=mbits, bias=bias,
        emax=int(np.frexp(pos[-1])[1]) - 1, max_normal=float(pos[-1]), min_subnormal=float(pos[1]),
        nan_code=nan_code, table=table, mids=(pos[:-1] + pos[1:]) / 2,
    )


E4M3 = _make("e4m3", 4, 3, "e4m3")
E5M2 = _make("e5m2", 5, 2, "ieee")
E2M3 = _make("e2m3", 2, 3, "none")
E3M2 = _make("e3m2", 3, 2, "none")
E2M1 = _make("e2m1", 2, 1, "none")
ELEMENT_FORMATS = {f.name: f for f in (E4M3, E5M2, E2M3, E3M2, E2M1)}


def encode_elements(fmt: ElementFormat, x: np.ndarray) -> np.ndarray:
    """float -> uint8 codes (one per element, unpacked): round to nearest even code, saturate to +-max."""
    x = np.asarray(x, np.float64)
    nan = np.isnan(x)
    any_nan = bool(nan.any())
    if any_nan and fmt.nan_code is None:
        raise ValueError(f"{fmt.name} has no NaN encoding")
    a = np.where(nan, 0.0, np.abs(x)) if any_nan else np.abs(x)
    # NOTE: exact: `a` is only compared with the float64 midpoints, no arithmetic on it. `lo` counts the
    # midpoints below `a`, i.e. the code of the nearer neighbour; on a tie (a == mids[lo]) the neighbours are
    # lo and lo + 1 and codes of one sign ascend with value, so the even code is the even mantissa. Anything
    # above the last midpoint, inf included, gets the max normal's code: that is the saturation.
    lo = np.searchsorted(fmt.mids, a, side="left")
    tie = fmt.mids[np.minimum(lo, len(fmt.mids) - 1)] == a
    code = (lo + (tie & (lo & 1).astype(bool))).astype(np.uint8)
    code |= np.signbit(x).astype(np.uint8) << np.uint8(fmt.bits - 1)
    if any_nan:
        code[nan] = fmt.nan_code
    return code


def decode_elements(fmt: ElementFormat, codes: np.ndarray) -> np.ndarray:
    """uint8 codes -> float32 values (table lookup)."""
    return fmt.table.astype(np.float32)[np.asarray(codes, np.uint8)]


# ---- E8M0: the MX shared scale, 2^(code - 127), code 0xFF = NaN ------------------------------------------
E8M0_BIAS = 127
E8M0_NAN = 0xFF
_E8M0_TABLE = np.append(np.ldexp(1.0, np.arange(255) - E8M0_BIAS), np.nan)


def e8m0_encode(exponent: np.ndarray) -> np.ndarray:
    """Unbiased integer exponents -> E8M0 codes, clamped to the representable [-127, 127]."""
    return (np.clip(np.asarray(exponent, np.int64), -E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS).astype(np.uint8)


def e8m0_decode(codes: np.ndarray) -> np.ndarray:
    """E8M0 codes -> float64 scales 2^(code - 127) (exact; NaN for 0xFF)."""
    return _E8M0_TABLE[np.asarray(codes, np.uint8)]


# ---- bfloat16 (the 16-bit KV mode and the bf16 weight preset) -----------------------------------------
def bf16_encode(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits as uint16, round to nearest even (overflow goes to inf, NaN stays NaN)."""
    return f32_to_bf16(x)


def bf16_decode(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) -> float32 (exact)."""
    return bf16_to_f32(np.asarray(bits, np.uint16))
