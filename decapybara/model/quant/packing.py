"""Bit packing of element codes along the last axis.

- 8 bits: one code per byte.
- 4 bits: two codes per byte, element 2j in the low nibble, 2j+1 in the high nibble.
- 6 bits: four codes in three bytes, little-endian: the 24-bit word c0 | c1 << 6 | c2 << 12 | c3 << 18 is
  stored low byte first. So byte0 = c0 | (c1 & 3) << 6, byte1 = c1 >> 2 | (c2 & 15) << 4,
  byte2 = c2 >> 4 | c3 << 2.

The number of codes along the last axis must be a multiple of 2 (FP4) or 4 (FP6); block formats always are.
"""

from __future__ import annotations

import numpy as np

_GROUP = {8: 1, 4: 2, 6: 4}  # codes per packing group


def packed_width(n: int, bits: int) -> int:
    """Bytes that `n` codes of `bits` bits take along the last axis."""
    if bits not in _GROUP or n % _GROUP[bits]:
        raise ValueError(f"cannot pack {n} codes of {bits} bits")
    return n * bits // 8


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """[..., n] codes (each < 2**bits) -> [..., n * bits / 8] uint8."""
    codes = np.asarray(codes, np.uint8)
    *lead, n = codes.shape
    packed_width(n, bits)
    if bits == 8:
        return codes.copy()
    if bits == 4:
        c = codes.reshape(*lead, n // 2, 2)  # [..., pairs, 2]
        return (c[..., 0] | (c[..., 1] << np.uint8(4))).astype(np.uint8)
    c = codes.reshape(*lead, n // 4, 4).astype(np.uint32)  # [..., quads, 4]
    w = c[..., 0] | (c[..., 1] << 6) | (c[..., 2] << 12) | (c[..., 3] << 18)
    out = np.stack([w & 0xFF, (w >> 8) & 0xFF, w >> 16], axis=-1)  # [..., quads, 3]
    return out.astype(np.uint8).reshape(*lead, n // 4 * 3)


def unpack_codes(packed: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of `pack_codes`: [..., n * bits / 8] uint8 -> [..., n] codes."""
    packed = np.asarray(packed, np.uint8)
    *lead, nb = packed.shape
    if bits == 8:
        return packed.copy()
    if bits == 4:
        out = np.stack([packed & np.uint8(0xF), packed >> np.uint8(4)], axis=-1)  # [..., bytes, 2]
        return out.reshape(*lead, nb * 2)
    if bits != 6 or nb % 3:
        raise ValueError(f"cannot unpack {nb} bytes of {bits}-bit codes")
    b = packed.reshape(*lead, nb // 3, 3).astype(np.uint32)  # [..., quads, 3]
    w = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
    out = np.stack([(w >> s) & 0x3F for s in (0, 6, 12, 18)], axis=-1)  # [..., quads, 4]
    return out.astype(np.uint8).reshape(*lead, nb // 3 * 4)
