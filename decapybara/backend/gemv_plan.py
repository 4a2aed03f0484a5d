"""Launch plan of the skinny GEMM (decapybara/kernels/mx_gemv.cu `mx_gemm_*`): grid shape, K split and partial-sum rows.

Pure arithmetic (no CuPy), so the split logic is tested on any machine. The kernel's two modes:

- tile grid: grid (tiles, ksplit, mtiles); block (x, y) computes output tile x over chunks [y cps, (y+1) cps);
  ksplit > 1 writes float32 partial sums [ksplit, M, N] that the tile's last block reduces in order.
- stream-K: grid (blocks, 1, mtiles); block b takes units [b U / B, (b+1) U / B) of the U = tiles x chunks
  units, tile-major, and a tile's contributors are the blocks whose ranges meet its units
  (`stream_segments` below is the kernel's index arithmetic, line for line; unsigned 32-bit: stream-K only
  where units x blocks < 2^32).

Policies (`tune["policy"]`): "cost" (K splits minimising bytes / wave occupancy), "wave" (one wave of blocks,
each streaming at least `min_chunks` chunks), "balance" (K splits minimising waves x (chunks per block +
`fill_chunks`), the pipeline fill counted as chunks), "stream" (stream-K, blocks of at least `min_chunks`
units) and "auto" ("balance" where its blocks fill between `auto_fill` and all of one wave, else "stream").
`ksplit` > 0 forces a tile-grid split (measurement).

A tuning value may be one setting or a dict by weight format ("*": every other format): `tune_for` resolves
it for one format, `merge_tune` lays overrides over a tuning (a dict over a dict merges, anything else
replaces).

Also the device layouts of E2M1 (MXFP4 / NVFP4) weight codes: split fields, which the kernel decodes in fewer
instructions (`e2m1_split_words`, inverse `e2m1_plain_words`), and 16-row bands of chunk tiles (codes and scales), which it
reads as contiguous blocks (`band_tiles`, inverse `band_rows`); pure array arithmetic on numpy or cupy arrays.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Any, Self

import numpy as np


@dataclass(frozen=True)
class GemmPlan:
    grid: tuple[int, int, int]
    cps: int            # chunks per K split (tile grid); all chunks (stream-K)
    partial_rows: int   # leading dim of the float32 partial-sum buffer; 1 = none needed
    stream: bool


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def pick_ksplit(tiles: int, nchunks: int, slots: int, weight_bytes: int, partial_bytes: int, policy: str,
                tune: dict) -> int:
    """K splits for `tiles` output tiles of `nchunks` K chunks on `slots` resident blocks."""
    if tune["ksplit"] > 0:
        return min(tune["ksplit"], nchunks)
    if policy == "balance":
        top = max(1, min(nchunks // max(1, tune["min_chunks"]), 32))
        return min(range(1, top + 1),
                   key=lambda ks: (_ceil(tiles * ks, slots) * (_ceil(nchunks, ks) + tune["fill_chunks"]), ks))
    if policy == "wave":
        if tiles >= slots:
            return 1
        return max(1, min(slots // tiles, nchunks // max(1, tune["min_chunks"])))
    best, best_cost = 1, float("inf")
    for ks in range(1, max(1, min(nchunks // 2, 32)) + 1):
        blocks = tiles * ks
        occupancy = blocks / (_ceil(blocks, slots) * slots)
        cost = (weight_bytes + (partial_bytes * ks if ks > 1 else 0)) / occupancy
        if cost < 0.98 * best_cost:
            best, best_cost = ks, cost
    return best


def plan_gemm(*, tiles: int, nchunks: int, mtiles: int, groups: int, slots: int, weight_bytes: int,
              partial_bytes: int, tune: dict, dense: bool = True, max_counters: int = 1 << 16,
              grouped_split: bool = False) -> GemmPlan:
    """The launch of one product: `tiles` output tiles of `nchunks` K chunks, `mtiles` M tiles, `groups`
    expert groups, `slots` resident blocks on the device. Grouped products split K (tile grids, the "balance"
    policy over all groups' tiles) where `grouped_split` (a kernel file whose split sums go by y row and whose
    counters go by group), else never. Cached: eager decode plans every product of every step."""
    return _plan(tiles, nchunks, mtiles, groups, slots, weight_bytes, partial_bytes, tuple(sorted(tune.items())),
                 dense, max_counters, grouped_split)


@functools.lru_cache(maxsize=4096)
def _plan(tiles: int, nchunks: int, mtiles: int, groups: int, slots: int, weight_bytes: int, partial_bytes: int,
          tune_items: tuple, dense: bool, max_counters: int, grouped_split: bool = False) -> GemmPlan:
    tune = dict(tune_items)
    ksplit, stream = 1, 0
    if not dense and grouped_split and tiles * mtiles * groups <= max_counters:
        ksplit = pick_ksplit(tiles * mtiles * groups, nchunks, slots, 0, 0, "balance", tune)
    if dense and tiles * mtiles <= max_counters:
        policy = tune["policy"]
        if policy == "auto":
            ksplit = pick_ksplit(tiles * mtiles, nchunks, slots, 0, 0, "balance", tune)
            policy = "balance" if tune["auto_fill"] * slots <= tiles * mtiles * ksplit <= slots else "stream"
        elif policy != "stream" or tune["ksplit"] > 0:
            ksplit = pick_ksplit(tiles * mtiles, nchunks, slots, weight_bytes, partial_bytes, policy, tune)
        if policy == "stream" and tune["ksplit"] <= 0:
            units = tiles * nchunks
            stream = max(1, min(max(1, slots // mtiles), units // max(1, tune["min_chunks"])))
            if units * stream >= 1 << 32:  # the kernel's unit arithmetic is 32-bit: a tile grid instead
                stream, ksplit = 0, 1
            else:  # a tile meets at most ceil(nchunks / (units // blocks)) + 1 blocks' ranges
                ksplit = min(stream, _ceil(nchunks, units // stream) + 1)
    if stream:
        return GemmPlan((stream, 1, mtiles * groups), nchunks, ksplit, True)
    cps = _ceil(nchunks, ksplit)
    ksplit = _ceil(nchunks, cps)
    return GemmPlan((tiles, ksplit, mtiles * groups), cps, ksplit, False)


def stream_segments(block: int, blocks: int, tiles: int, nchunks: int) -> list[tuple[int, int, int, int, int]]:
    """(tile, c0, c1, part, nparts) of each segment block `block` runs in stream-K mode (mx_gemm_impl's loop)."""
    units = tiles * nchunks

    def block_of(u: int) -> int:
        return ((u + 1) * blocks - 1) // units

    out = []
    u, u_end = block * units // blocks, (block + 1) * units // blocks
    while u < u_end:
        tile, c0 = u // nchunks, u % nchunks
        c1 = min(nchunks, c0 + (u_end - u))
        first = block_of(tile * nchunks)
        out.append((tile, c0, c1, block - first, block_of(tile * nchunks + nchunks - 1) - first + 1))
        u += c1 - c0
    return out


class TuneDict(dict):
    """`cupy_ops_extra.TUNE`'s type: a dict that counts its changes (`version`: item sets and deletes, update,
    clear, pop, popitem, setdefault, |=), so that what is derived from it and cached (`cupy_ops_extra.tune_for`'s
    resolved tunings, `_launch_of`'s launch recipes) sees every change. Its by-format entries are replaced, never
    edited in place. A plain dict put in TUNE's place (tests' monkeypatch.setattr) works too, uncached."""

    # Versions come from one counter for all TuneDicts, so that (id, version) never repeats: a new TuneDict at a
    # freed one's address does not meet the old one's cache entries.
    version = 0

    def _changed(self) -> None:
        self.version = next(_TUNE_VERSIONS)

    def __reduce__(self) -> tuple[Any, ...]:  # copies and pickles: a new TuneDict (a version of its own)
        return (TuneDict, (dict(self),))

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._changed()

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        self._changed()

    def __delitem__(self, key: str) -> None:
        super().__delitem__(key)
        self._changed()

    def __ior__(self, other: Any) -> Self:
        self.update(other)
        return self

    def update(self, *args: Any, **kw: Any) -> None:
        super().update(*args, **kw)
        self._changed()

    def clear(self) -> None:
        super().clear()
        self._changed()

    def pop(self, *args: Any) -> Any:
        self._changed()
        return super().pop(*args)

    def popitem(self) -> Any:
        self._changed()
        return super().popitem()

    def setdefault(self, key: str, default: Any = None) -> Any:
        self._changed()
        return super().setdefault(key, default)


_TUNE_VERSIONS = itertools.count(1)


def tune_for(fmt: str, tune: dict[str, Any]) -> dict[str, Any]:
    """`tune` with every by-format value resolved for weight format `fmt` (its entry, else "*")."""
    return {k: ((v[fmt] if fmt in v else v["*"]) if isinstance(v, dict) else v) for k, v in tune.items()}


def merge_tune(tune: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`tune` with `overrides` laid over it: a by-format dict over a by-format dict merges (so '{"stages":
    {"bf16": 1}}' changes bf16 alone), a plain value replaces the entry for every format."""
    out = dict(tune)
    for k, v in overrides.items():
        out[k] = {**out[k], **v} if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


# ---- E2M1 split-field code layout (decapybara/kernels/mx_pairs.cuh `e2m1_pairs_split`) -------------------------------
E2M1_SIGN_BIT = (13, 12, 15, 14)  # bit of code r's sign within its 16-bit half (its magnitude: bits 3r..3r+2)


def _words(codes: Any) -> Any:
    """uint8 [..., B] (numpy or cupy, B % 4 == 0) -> uint32 [..., B / 4], the little-endian words of the bytes."""
    assert codes.dtype == np.uint8 and codes.ndim >= 1 and codes.shape[-1] % 4 == 0, \
        f"E2M1 codes must be uint8 rows of whole 32-bit words, got {codes.dtype} {codes.shape}"
    return (codes if codes.flags.c_contiguous else codes.copy()).view(np.uint32)


def e2m1_split_words(codes: Any) -> Any:
    """Plain E2M1 codes (`QuantTensor.codes` of MXFP4 / NVFP4: code 2j in the low nibble of byte j) -> the
    split-field layout, word by word: uint8 [..., B] -> a new uint8 [..., B] (B % 4 == 0), numpy or cupy as given.

    In each little-endian 32-bit word (codes c0..c7, nibble i = c_i) half h (bits 16h..16h+15) holds c_{4h+r},
    r = 0..3: magnitude (code bits 0-2) at bits 3r..3r+2 of the half, sign (code bit 3) at E2M1_SIGN_BIT[r].
    Zero codes stay zero bytes, so padding is unchanged."""
    v = _words(codes)
    out = v & np.uint32(0)
    for i in range(8):
        h, r = divmod(i, 4)
        c = v >> np.uint32(4 * i)
        out |= (c & np.uint32(7)) << np.uint32(16 * h + 3 * r)
        out |= ((c >> np.uint32(3)) & np.uint32(1)) << np.uint32(16 * h + E2M1_SIGN_BIT[r])
    return out.view(np.uint8)


def e2m1_plain_words(words: Any) -> Any:
    """The inverse of `e2m1_split_words`: split-field uint8 [..., B] -> plain nibble codes uint8 [..., B]."""
    v = _words(words)
    out = v & np.uint32(0)
    for i in range(8):
        h, r = divmod(i, 4)
        mag = (v >> np.uint32(16 * h + 3 * r)) & np.uint32(7)
        sign = (v >> np.uint32(16 * h + E2M1_SIGN_BIT[r])) & np.uint32(1)
        out |= (mag | (sign << np.uint32(3))) << np.uint32(4 * i)
    return out.view(np.uint8)


BAND_ROWS, PIECE = 16, 128  # a tile: 16 weight rows x one 128-byte piece of each (one chunk of E2M1 codes)
CHUNK_CODES = 256  # codes of one E2M1 chunk: its scales are 256 / block bytes a row (MXFP4 8, NVFP4 16)


def band_tiles_ok(shape: tuple[int, ...], piece: int = PIECE) -> bool:
    """Whether an array [..., N, B] can take the band-tile layout with `piece`-byte row pieces: N % 16 == 0 and
    B % piece == 0 (whole tiles)."""
    return len(shape) >= 2 and shape[-2] % BAND_ROWS == 0 and shape[-1] % piece == 0


def band_tiles(rows: Any, piece: int = PIECE) -> Any:
    """Row-major uint8 [..., N, B] (E2M1 codes, piece 128; or their scales, piece 256 / block) -> the band-tile
    layout, a new array of the same shape and type (numpy or cupy as given; `band_tiles_ok` must hold).

    The rows of each band of 16 are stored chunk by chunk: byte j of row r goes to flat offset (within its
    matrix) (r // 16) * 16 B + (j // piece) * 16 piece + (r % 16) * piece + j % piece. One warp of
    decapybara/kernels/mx_gemv.cu streams one band, so each of its chunks is one contiguous block (MX_TILED): 2 KB of
    codes, 128 / 256 bytes of scales."""
    assert band_tiles_ok(rows.shape, piece), f"band tiles need [..., N % 16, B % {piece}], got {rows.shape}"
    *lead, n, b = rows.shape
    t = rows.reshape(*lead, n // BAND_ROWS, BAND_ROWS, b // piece, piece).swapaxes(-3, -2)
    return t.copy().reshape(rows.shape)


def band_rows(tiles: Any, piece: int = PIECE) -> Any:
    """The inverse of `band_tiles`: band tiles [..., N, B] -> row-major, a new array."""
    assert band_tiles_ok(tiles.shape, piece), f"band tiles need [..., N % 16, B % {piece}], got {tiles.shape}"
    *lead, n, b = tiles.shape
    t = tiles.reshape(*lead, n // BAND_ROWS, b // piece, BAND_ROWS, piece).swapaxes(-3, -2)
    return t.copy().reshape(tiles.shape)
