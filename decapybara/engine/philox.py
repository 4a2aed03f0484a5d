"""Philox4x32-10 counter-based RNG and the sampler's uniform draw.

Philox4x32-R is the Random123 generator (Salmon et al., SC'11): a pure function of a 128-bit counter and a
64-bit key, so any draw can be computed independently, in any order, on the host or on the device.

The uniform draw contract (the CUDA sampler ``decapybara/kernels/sample.cu`` must reproduce it bit for bit):

- key     = (seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF), the seed taken modulo 2**64
  (a negative Python seed wraps as two's complement);
- counter = (position & 0xFFFFFFFF, position >> 32, stream, 0), position in [0, 2**64), stream in [0, 2**32);
- x = philox4x32_10(counter, key); only the first word x0 is used;
- u = ((x0 >> 8) + 0.5) * 2**-24, computed in float64 (in CUDA: ``((double)(x0 >> 8) + 0.5) * 0x1p-24``).

u = (2k + 1) / 2**25 for k = x0 >> 8 in [0, 2**24), which float64 holds exactly, so u lies in the open
interval (0, 1): 2**-25 <= u <= 1 - 2**-25, and never rounds to 0 or 1.

``position`` is the index of the output token being sampled (0 for the first generated token), so a
request's draws depend only on (seed, position, stream) and never on the batch it was sampled in.
Stream 0 is the token draw; other streams are free for other per-position decisions (e.g. speculative
acceptance) without correlating with it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# Random123 constants for Philox4x32 (include/Random123/philox.h).
PHILOX_M4X32_0 = 0xD2511F53
PHILOX_M4X32_1 = 0xCD9E8D57
PHILOX_W32_0 = 0x9E3779B9  # golden ratio
PHILOX_W32_1 = 0xBB67AE85  # sqrt(3) - 1

MASK32 = 0xFFFFFFFF
MASK64 = 0xFFFFFFFFFFFFFFFF

_M0 = np.uint64(PHILOX_M4X32_0)
_M1 = np.uint64(PHILOX_M4X32_1)
_W0 = np.uint64(PHILOX_W32_0)
_W1 = np.uint64(PHILOX_W32_1)
_LO = np.uint64(MASK32)
_SHIFT32 = np.uint64(32)


def philox4x32(counter: np.ndarray, key: np.ndarray, rounds: int = 10) -> np.ndarray:
    """Philox4x32-R of uint32 ``counter [..., 4]`` under ``key [..., 2]`` (broadcast) -> uint32 [..., 4].

    Round: (hi0, lo0) = M0 * c0, (hi1, lo1) = M1 * c2; c = (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0);
    the key is bumped by the Weyl constants before every round but the first.
    """
    ctr = np.asarray(counter, dtype=np.uint32)
    k = np.asarray(key, dtype=np.uint32)
    if ctr.shape[-1:] != (4,) or k.shape[-1:] != (2,):
        raise ValueError(f"counter must be [..., 4] and key [..., 2], got {ctr.shape} and {k.shape}")
    # NOTE: uint64 lanes hold the full 32x32-bit product, so mulhi/mullo are a shift and a mask.
    c0, c1, c2, c3 = (ctr[..., i].astype(np.uint64) for i in range(4))
    k0, k1 = (k[..., i].astype(np.uint64) for i in range(2))
    for r in range(rounds):
        if r:
            k0 = (k0 + _W0) & _LO
            k1 = (k1 + _W1) & _LO
        p0 = c0 * _M0
        p1 = c2 * _M1
        c0, c1, c2, c3 = (p1 >> _SHIFT32) ^ c1 ^ k0, p1 & _LO, (p0 >> _SHIFT32) ^ c3 ^ k1, p0 & _LO
    return np.stack(np.broadcast_arrays(c0, c1, c2, c3), axis=-1).astype(np.uint32)


def philox4x32_10(counter: np.ndarray, key: np.ndarray) -> np.ndarray:
    """Philox4x32-10, the Random123 default: ``philox4x32(counter, key, rounds=10)``."""
    return philox4x32(counter, key, rounds=10)


def bits_to_uniform(x0: np.ndarray | int) -> np.ndarray:
    """Map uint32 words to float64 u = ((x0 >> 8) + 0.5) * 2**-24, in the open interval (0, 1)."""
    bits = np.asarray(x0, dtype=np.uint32) >> np.uint32(8)
    return (bits.astype(np.float64) + 0.5) * 2.0**-24


def _as_u64(values: Sequence[int] | np.ndarray | int) -> np.ndarray:
    """Integers modulo 2**64 as uint64 (two's complement for negative values)."""
    if isinstance(values, np.ndarray) and values.dtype.kind in "iu":
        return values.astype(np.uint64)  # wraps int64 as two's complement
    return np.asarray([int(v) & MASK64 for v in np.ravel(np.asarray(values, dtype=object))],
                      dtype=np.uint64).reshape(np.shape(values))


def uniforms(seeds: Sequence[int] | np.ndarray, positions: Sequence[int] | np.ndarray,
             stream: int = 0) -> np.ndarray:
    """Vectorised `uniform`: float64 [N] for ``seeds [N]`` and ``positions [N]`` (broadcast)."""
    if not 0 <= stream <= MASK32:
        raise ValueError(f"stream must be in [0, 2**32), got {stream}")
    pos = np.asarray(positions)
    if pos.dtype.kind == "i" and pos.size and pos.min() < 0:
        raise ValueError("positions must be >= 0")
    s, p = np.broadcast_arrays(_as_u64(seeds), _as_u64(positions))
    counter = np.stack([p & _LO, p >> _SHIFT32, np.full_like(p, stream), np.zeros_like(p)], axis=-1)
    key = np.stack([s & _LO, s >> _SHIFT32], axis=-1)
    return bits_to_uniform(philox4x32_10(counter.astype(np.uint32), key.astype(np.uint32))[..., 0])


def uniform(seed: int, position: int, stream: int = 0) -> float:
    """The sampler's uniform draw in (0, 1) for (seed, position, stream); see the module docstring."""
    if not 0 <= position <= MASK64:
        raise ValueError(f"position must be in [0, 2**64), got {position}")
    return float(uniforms(np.asarray([seed & MASK64], dtype=np.uint64),
                          np.asarray([position], dtype=np.uint64), stream)[0])
