"""Launch wrappers of decapybara/kernels/{mx_gemv, act_quant, moe, sample, checksum, probe}.cu.

Conventions (as `cupy_ops`): device arrays are checked for dtype and contiguity before a launch, scalars go as
typed numpy values, fresh outputs come from `cupy_ops.empty` (NaN-poisoned under `cupy_ops.POISON`). bf16
tensors are uint16 arrays of bfloat16 bits; activations may be float32, bf16 bits or float16.

Weights for `mx_linear` are `PackedWeight`s: the bytes of a `QuantTensor` (docs/quant.md) uploaded unchanged
(MXFP4 / NVFP4 codes repacked into the split-field layout, `gemv_plan.e2m1_split_words`, see `pack_weight`),
or bf16 bits. Kernel layout requirements (else `mx_linear` dequantises and multiplies densely): every row
16-byte aligned, i.e. bf16 K % 8 == 0, MXFP6 Kp % 64 == 0, NVFP4 Kp % 32 == 0 (MXFP8 / MXFP4 always).
The sampler is `cuda_sample` (same tokens as `decapybara.engine.sampling.sample`, see decapybara/kernels/sample.cu).
"""

from __future__ import annotations

import functools
import json
import os
import threading
from dataclasses import dataclass, field, fields, replace
from typing import Any

import cupy as cp
import cupyx
import numpy as np

from decapybara.backend import cupy_ops, pdl
from decapybara.backend.cupy_ops import (
    F32,
    I32,
    I64,
    MX_NO_GEMM,
    allow_dynamic_smem,
    check,
    dev_ptr,
    empty,
    gemm_bf16,
    null,
    sm_count,
    smem_per_block,
    smem_per_sm,
    to_bf16_bits,
)
from decapybara.backend.gemv_plan import (
    CHUNK_CODES,
    GemmPlan,
    TuneDict,
    band_tiles,
    band_tiles_ok,
    e2m1_split_words,
    merge_tune,
    plan_gemm,
)
from decapybara.backend.gemv_plan import tune_for as _tune_for
from decapybara.engine.sample_edits import edit_lists, needs_edits
from decapybara.kernels import KERNEL_DIR, get_kernel
from decapybara.model.weights import keeps_prefill_copy

FMT_IDS = {"bf16": 0, "mxfp8": 1, "mxfp6": 2, "mxfp4": 3, "nvfp4": 4}
BITS = {"bf16": 16, "mxfp8": 8, "mxfp6": 6, "mxfp4": 4, "nvfp4": 4}
BLOCK = {"bf16": 1, "mxfp8": 32, "mxfp6": 32, "mxfp4": 32, "nvfp4": 16}
LANE_K = {"bf16": 16, "mxfp8": 32, "mxfp6": 64, "mxfp4": 64, "nvfp4": 64}  # codes per lane per chunk
E2M1_FMTS = ("mxfp4", "nvfp4")  # formats of E2M1 codes: plain nibbles or the split-field layout
U64 = np.uint64


_KINDS = {np.dtype(np.float32): 0, np.dtype(np.uint16): 1, np.dtype(np.float16): 2}


def kind(dtype: Any) -> int:
    """Activation dtype code of the kernels: 0 float32, 1 bf16 bits (uint16), 2 float16."""
    k = _KINDS.get(dtype if isinstance(dtype, np.dtype) else np.dtype(dtype))
    if k is None:
        raise TypeError(f"activations must be float32, bf16 bits (uint16) or float16, got {dtype}")
    return k


# ---- packed weights --------------------------------------------------------------------------------------
@dataclass(slots=True)
class PackedWeight:
    """A weight [N, K] (or stacked experts [E, N, K]) on the device in a kernel-ready format.

    `codes`: uint8 [..., N, Kp * bits / 8] packed as `QuantTensor.codes` (MXFP4 / NVFP4: or in the split-field
    layout, `e2m1_split` below), or uint16 [..., N, K] bf16 bits;
    `scales`: uint8 [..., N, Kp / block] (E8M0, NVFP4: E4M3), None for bf16; `tensor_scale`: NVFP4's float32.
    `persistent`: a model weight, written before any forward that reads it (load time): only then may a product
    launched overlapped (`pdl.launch`) load it before waiting for the kernel before it.
    `e2m1_split`: MXFP4 / NVFP4 codes in the split-field layout (`gemv_plan.e2m1_split_words` of the
    QuantTensor's codes; decapybara/kernels/mx_gemv.cu decodes it under MX_E2M1 = 1), else plain nibbles; False
    otherwise. `tiled`: MXFP4 / NVFP4 codes (either field layout) and scales in 16-row bands of chunk tiles
    (`gemv_plan.band_tiles`, pieces of 128 code bytes and 256 / block scale bytes; decapybara/kernels/mx_gemv.cu reads
    them under MX_TILED = 1), else row-major: needs N % 16 == 0 and whole 256-code chunks (`tile_layout`). Row slices
    of whole bands keep the layout.
    A weight may keep its values as bf16 bits besides (`dense_of`, `attach_dense`; the server's
    `prefill_weights=bf16`), in its cache, so that they go with the arrays they were made from.
    """

    fmt: str
    shape: tuple[int, ...]
    codes: Any
    scales: Any = None
    tensor_scale: float = 1.0
    persistent: bool = False
    e2m1_split: bool = False
    tiled: bool = False
    # what eager launches derive from this weight (`_cache`: `_launch_of`'s recipes, the layout checks, the bf16
    # values), valid for the arrays and layout fields it was made for; never copied (`dataclasses.replace`, copy,
    # pickle)
    launches: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __getstate__(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.init}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            object.__setattr__(self, k, v)
        self.launches = {}

    def __copy__(self) -> PackedWeight:
        return replace(self)

    @property
    def K(self) -> int:
        return self.shape[-1]

    @property
    def N(self) -> int:
        return self.shape[-2]

    @property
    def Kp(self) -> int:
        b = BLOCK[self.fmt]
        return -(-self.K // b) * b

    @property
    def nbytes(self) -> int:
        return int(self.codes.nbytes + (self.scales.nbytes if self.scales is not None else 0))

    def kernel_ok(self) -> bool:
        """Whether the rows meet the kernel's 16-byte alignment (see the module docstring) and the arrays the
        layout it addresses: rows contiguous and one after another; stacked experts [E, N, ...] any 16-byte
        multiple apart (so that a row range of a stack, `CupyBackend.fuse_moe`'s views, is a kernel operand too)."""
        row = self.codes.shape[-1] * self.codes.itemsize
        return (row % 16 == 0 and dev_ptr(self.codes) % 16 == 0 and _rows_packed(self.codes)
                and (self.scales is None or _rows_packed(self.scales)))


def _rows_packed(a: Any) -> bool:
    """Whether array a [..., N, B] has contiguous rows one after another, and (3-D) its matrices 16-byte multiples
    apart: what the kernels address from its row bytes and its first stride."""
    if a.ndim < 2 or a.strides[-1] != a.itemsize or a.strides[-2] != a.shape[-1] * a.itemsize:
        return a.flags.c_contiguous
    return a.ndim == 2 or (a.ndim == 3 and a.strides[0] % 16 == 0 and a.strides[0] >= a.shape[1] * a.strides[1])


def e2m1_layout(fmt: str, split: bool | None = None) -> bool:
    """Whether weights of format `fmt` get E2M1 codes in the split-field layout: `split` if given, else TUNE's
    `e2m1_split`; False for formats without E2M1 codes."""
    return fmt in E2M1_FMTS and bool(tune_for(fmt).get("e2m1_split", 0) if split is None else split)


def tile_layout(fmt: str, codes_shape: tuple[int, ...], tiled: bool | None = None) -> bool:
    """Whether E2M1 codes of shape `codes_shape` get the band-tile layout: `tiled` if given, else TUNE's `tiled`,
    and only where whole tiles cover the matrix (`band_tiles_ok`); False for formats without E2M1 codes."""
    want = bool(tune_for(fmt).get("tiled", 0) if tiled is None else tiled)
    return fmt in E2M1_FMTS and want and band_tiles_ok(tuple(codes_shape))


def scale_piece(fmt: str) -> int:
    """Scale bytes of one weight row per 256-code chunk (a band tile's row piece of scales)."""
    return CHUNK_CODES // BLOCK[fmt]


SPLIT_SLICE = 1 << 26  # bytes of codes repacked at a time (bounds the temporaries of a large tensor)


def repack_codes(codes: Any, split: bool, tiled: bool) -> Any:
    """Device E2M1 codes, row-major plain nibbles (C-contiguous uint8 [..., N, B], rows of whole 32-bit words)
    -> a new array of the same shape in the split-field layout (`split`) and / or in band tiles (`tiled`),
    repacked about SPLIT_SLICE bytes at a time. Bands never straddle two matrices of a stack (N % 16 == 0), so
    the rows of every matrix are tiled together as one [rows, B] array."""
    out = cp.empty_like(codes)
    src, dst = codes.reshape(-1, codes.shape[-1]), out.reshape(-1, codes.shape[-1])
    step = max(16, SPLIT_SLICE // max(1, src.shape[1]) // 16 * 16)
    for r in range(0, src.shape[0], step):
        part = e2m1_split_words(src[r:r + step]) if split else src[r:r + step]
        dst[r:r + step] = band_tiles(part) if tiled else part
    return out


def pack_weight(value: Any, e2m1_split: bool | None = None, tiled: bool | None = None) -> PackedWeight:
    """A `QuantTensor` (host), a float array (host or device; rounded to bf16) or bf16 bits -> PackedWeight.
    MXFP4 / NVFP4 codes are repacked into the split-field layout when `e2m1_layout(fmt, e2m1_split)` and into
    band tiles when `tile_layout(fmt, shape, tiled)` (by default TUNE's `e2m1_split` and `tiled`), else
    uploaded as they are."""
    if hasattr(value, "to_parts"):
        ts = value.tensor_scale
        codes = cp.asarray(np.ascontiguousarray(value.codes))
        split, tile = e2m1_layout(value.fmt, e2m1_split), tile_layout(value.fmt, codes.shape, tiled)
        scales = cp.asarray(np.ascontiguousarray(value.scales))
        return PackedWeight(value.fmt, tuple(value.shape), repack_codes(codes, split, tile) if split or tile else codes,
                            band_tiles(scales, scale_piece(value.fmt)) if tile else scales,
                            float(ts) if ts is not None else 1.0, e2m1_split=split, tiled=tile)
    a = value if isinstance(value, cp.ndarray) else cp.asarray(np.asarray(value))
    bits = a if a.dtype == cp.uint16 else to_bf16_bits(cp.ascontiguousarray(a, dtype=cp.float32))
    return PackedWeight("bf16", tuple(a.shape), cp.ascontiguousarray(bits))


def _cache(w: PackedWeight) -> dict:
    """`w.launches`, emptied first where `w`'s arrays or layout fields are not those its entries were made for
    (the pinned "arrays" entry)."""
    d = w.launches
    pin = d.get("arrays")
    layout = (w.fmt, w.shape, w.tiled, w.e2m1_split, w.tensor_scale)
    if pin is None or pin[0] is not w.codes or pin[1] is not w.scales or pin[2] != layout:
        d.clear()
        d["arrays"] = (w.codes, w.scales, layout)
    return d


def _check_packed(w: PackedWeight) -> None:
    """Asserts that `w`'s codes and scales are what its format and shape call for (once while they stay: `_cache`)."""
    d = _cache(w)
    if "checked" not in d:
        _check_packed_now(w)
        d["checked"] = True


def _check_rows(a: Any, dtype: Any, name: str) -> None:
    """Asserts that `a` is a device array of `dtype` laid out as the kernels address it (`_rows_packed`: C-
    contiguous but for a stack's strided row range)."""
    assert isinstance(a, cp.ndarray), f"{name}: expected a cupy array, got {type(a).__name__}"
    assert a.dtype == dtype, f"{name}: dtype {a.dtype}, expected {np.dtype(dtype)}"
    assert _rows_packed(a), f"{name}: rows not contiguous (shape {a.shape}, strides {a.strides})"


def _check_packed_now(w: PackedWeight) -> None:
    assert w.fmt in FMT_IDS, f"unknown format {w.fmt!r}"
    assert not w.e2m1_split or w.fmt in E2M1_FMTS, f"{w.fmt} has no E2M1 codes to split"
    assert not w.tiled or (w.fmt in E2M1_FMTS and band_tiles_ok(w.codes.shape)
                           and band_tiles_ok(w.scales.shape, scale_piece(w.fmt))), \
        f"{w.fmt} codes {w.codes.shape} / scales {w.scales.shape} cannot be band tiles"
    lead = w.shape[:-1]
    if w.fmt == "bf16":
        _check_rows(w.codes, np.uint16, "codes")
        assert w.codes.shape == w.shape, f"bf16 codes {w.codes.shape} for shape {w.shape}"
        return
    _check_rows(w.codes, np.uint8, "codes")
    _check_rows(w.scales, np.uint8, "scales")
    assert w.codes.shape == (*lead, w.Kp * BITS[w.fmt] // 8), f"{w.fmt} codes {w.codes.shape} for {w.shape}"
    assert w.scales.shape == (*lead, w.Kp // BLOCK[w.fmt]), f"{w.fmt} scales {w.scales.shape} for {w.shape}"


def gemm_ready(w: PackedWeight) -> bool:
    """Whether the skinny kernels stream `w` (the module docstring's layout rules; remembered while its arrays
    stay: `_cache`)."""
    d = _cache(w)
    ready = d.get("ready")
    if ready is None:
        lane_ok = w.fmt != "mxfp6" or w.Kp % 64 == 0
        ready = d["ready"] = (lane_ok and (w.fmt != "nvfp4" or w.Kp % 32 == 0) and (w.fmt != "bf16" or w.K % 8 == 0)
                              and w.kernel_ok())
    return ready


@functools.cache
def kernel_knows(source: str, define: str) -> bool:
    """Whether kernel file `source` (TUNE's; an older one in bench/gemv_sweep.py) knows layout define `define`
    (MX_E2M1, MX_TILED); read once per file and define."""
    return define in (KERNEL_DIR / f"{source}.cu").read_text()


def _counters() -> Any:
    """Split-K tile counters (zero at rest, reset by each tile's last block) of the current device and stream:
    products on two streams may run at once (`CupyBackend.linear_pair`), one stream's run one after another.
    From the default memory pool, not a decode graph's own (`cuda_graph.capture_graph`, whose warm-up run
    creates them for its streams before the capture)."""
    return _stream_counters(cp.cuda.Device().id, cp.cuda.get_current_stream().ptr)


@functools.cache
def _stream_counters(device: int, stream: int) -> Any:
    with cp.cuda.using_allocator(cp.get_default_memory_pool().malloc):
        return cp.zeros(1 << 16, cp.int32)


# Launch tuning of mx_gemm (bench/gpu.py and bench/gemv_sweep.py sweep it): `stages` chunks in flight per lane
# (kernel define MX_STAGES); `warps` per block (MX_WARPS, 16 weight rows each); `acc` independent accumulator
# chains (MX_ACC); `blocks_per_sm` resident blocks per SM, counted by the split policy and, for one-n-tile
# kernels, built in through their launch bounds (MX_MINB; two-n-tile kernels, 9 <= M <= 16: `wide_blocks_per_sm`
# (MX_MINB2) with `wide_stages` (MX_STAGES2, 0: max(2, stages)) and `wide_warps` warps a block (MX_WARPS2); wider
# tiles stay at <= 2; the blocks-per-SM counts are of 8-warp blocks, a block of W warps taking W / 8 of them
# (B of them: B x 8 // W blocks, at least 1): wide_warps 12 at 3 (MXFP8's; the 4-bit formats' until the
# twentieth session) is two blocks of 12 warps an SM, which stage x once for 192 rows of output rather than 128:
# the twelve-row products 4% (MXFP4), 10% (NVFP4) and 8% (MXFP8, also from 2 to 3 blocks' registers and 1 stage)
# faster (`gemv_sweep`), 27B steps at 10 and 12 streams 1.7-3% faster (interleaved captures; one-row products
# were 2% slower at 12 warps, so `warps` stays 8); MXFP4's and NVFP4's 10 (twentieth session; two blocks of 10
# warps, 160-row tiles): ptxas gives the plain two-n-tile kernels (`_2`) 92 registers where 12 warps held them to
# 80, the build Nsight Compute found recomputing its shared-memory addresses every chunk (the 24-warp SwiGLU
# launch, also at 80: 321 instructions a chunk, 28.8 per 256 weights in all; the plain twelve-row `down` at 12
# warps 31.0), and 27B steps ran 5-6% faster at 10 and 12 streams (MXFP4, three interleaved captures), 3.2-3.6%
# (NVFP4, 12 streams, two); the SwiGLU launch keeps `swiglu_wide_warps` 24 (20: no faster); the split policy
# and its knobs are described in decapybara/backend/gemv_plan.py; `source` is the
# kernel file (measurement only: bench/gemv_sweep.py times an older one in the same run); `e2m1_split` is the layout `pack_weight` gives
# MXFP4 / NVFP4 codes (1: split fields; the kernel define MX_E2M1 follows each weight's own flag, not TUNE,
# and a `source` older than MX_E2M1 reads plain codes only); `tiled` likewise puts them in 16-row bands of 2 KB
# chunk tiles where whole tiles cover the matrix (MX_TILED; the ninth session: step-weighted one-row products
# 6.02 -> 5.71 ms, a one-stream 27B step ~7%, docs/perf.md). A value is one setting for every format or a dict
# by format ("*": the others); a plain value set over it (tests, sweeps) applies to every format, a dict in
# DECAPYBARA_MX_TUNE is merged into the default's. `small_bytes` (0: off): dense one-n-tile products of fewer
# code bytes run the `small_stages` / `small_blocks_per_sm` build instead (a few chunks per warp: more of them
# in flight): at 24 MB it gave the 27B "out" product (16 MB) 28 -> 34% of copy bandwidth, a one-stream step ~2%
# (ninth session); since the `_1r` kernels it is off: 27B steps at 1 to 8 streams 1.2-2.2% faster without it
# (one-row products where `row1_warps` is set take that build instead).
# `auto_fill` 0.7 (was 0.85): tile grids down to 70% of a wave rather than stream-K; the 27B q|k|v (one and
# twelve rows) and twelve-row "out" products take a tile grid then (twelve-row "out" 17 -> 22% of copy
# bandwidth), twelve-stream steps ~3% faster (three interleaved captures each, docs/perf.md). `fuse_norms` (0:
# off) lets a block's output projection add the residual, apply the next norm's weight and sum its rows'
# squares, and the next products divide by each row's RMS (`mx_linear_add_norm`, `NormedRows`; up to 8 rows):
# no norm kernel between them, one-stream 27B steps ~6% faster (interleaved captures, docs/perf.md).
# `bf16_rows` (0: off): products of at least this many rows get x in bf16 bits where x only feeds products,
# which round it to bf16 anyway (the same results, but for x below 2^-126: the float32 staging scales before
# it rounds): the fused norms' xg (`mx_linear_add_norm`), where those do not apply the norm after an output
# projection, and the MLP activation (CupyBackend, bf16 backend): half the bytes staged, and the kernels'
# staging then takes two groups of x per L2 round trip (decapybara/kernels/mx_gemv.cu). 8 and 12-stream 27B steps 4% and
# 3% faster (interleaved captures, docs/perf.md); from one row up since the `_1r` kernels (a one-row block's x
# staging then takes half the passes): one-stream 27B steps ~1% faster (eight interleaved rounds; before the
# `_1r` kernels it measured no better).
# `swiglu_rows` (0: off): MLPs of this many rows up to 64 (SWIGLU_ROWS) run their fused gate|up product and
# silu(gate) * up as one launch (`mx_swiglu`, decapybara/kernels/mx_gemv.cu `_1s` to `_8s`; past 16 rows since the
# twenty-eighth session, for eager mixed steps' launch count, not yet timed on the GPU): 27B steps at 1 to 12 streams
# 1-3% faster (interleaved captures, docs/perf.md).
# `row1` (0: off): dense one-row MXFP4 / NVFP4 products run the `_1r` / `_1rs` kernels (decapybara/kernels/mx_gemv.cu,
# header: partial sums by block, the block scales applied to float32 sums once a block instead of a bf16x2 FMA
# per code pair; the same products within float32 rounding, for MXFP4 block scales from 2^-61 up, more exact
# below). `wide_segk`: codes a row of the two-n-tile kernels' x staging buffer holds (decapybara/kernels/mx_gemv.cu
# MX_SEGK2; past 1440 the buffer is dynamic shared memory, `staging_bytes`): at 2688 (87 KB a block, two blocks
# an SM as before) twelve rows take 14 chunks a staging segment rather than 5, so a block stages x (and waits at
# its barriers) once or twice rather than three or four times: MXFP4 twelve-row products 3% faster (`gemv_sweep`), 27B
# steps at 10 and 12 streams 2% (MXFP4) and 3% (NVFP4, 12x1k) faster (interleaved, docs/perf.md); the same
# bytes (a segment's length does not change the summation order). The other formats keep 1024 (not measured).
# `part_batch`: split-K partial sums a thread of a one-row (`_1r` / `_1rs`) tile's last block loads at once
# before adding them in order (decapybara/kernels/mx_gemv.cu `sum_parts`, MX_PART_BATCH; 1: one load and add at a time,
# as the other kernels do): the same bytes; one-row products 1.7% faster (`gemv_sweep`), one-stream steps within
# their spread (docs/perf.md).
# `swiglu_wide_warps` (0: `wide_warps`): warps of a two-n-tile (9-16 rows) SwiGLU launch's blocks (`_2s`; its
# own build of MX_WARPS2). MXFP4 / NVFP4 24 (one block an SM, 384-row tiles): the twelve-row gate|up product
# stages x for twice the rows of weights, and 27B steps ~1.2% faster (interleaved: MXFP4 at 10 and 12 streams,
# NVFP4 at 12, docs/perf.md); the plain two-n-tile products stay at 12 (24 made them slower). Other tiles
# than the plain product's, so other K split points: the same products within float32 rounding.
# `small_n` (0: off): bf16 products of at most this many weight rows and 1-16 rows of x run on
# decapybara/kernels/gemv_small.cu (`small_product`: a block a 16-row tile, its warps splitting K, tensor-core sums met
# in shared memory; no K splits across blocks, no x staging). 1024: the 35B-A3B's router|gate (257 x 2,048) and b|a (64
# x 2,048) after their norm 2.4x the skinny GEMM's speed at one row, 3.4x at twelve, the 27B's b|a (96 x 5,120) 1.1x /
# 2.3x (bench/small_product.py); 35B-A3B steps 1.08x at one sequence, 1.04x at twelve; the 27B's, whose b|a runs on a
# side stream, within their spread (docs/perf.md, thirty-fifth session). `small_warps` / `small_pre` (0:
# SMALL_WARPS / SMALL_PRE): its blocks' warps and the 32-code steps of codes a warp holds at once; 16 / 4 the
# fastest of 8 / 8, 16 / 4, 4 / 8, 8 / 4 on every shape.
# `swiglu_warps` (0: `warps`): the same for one-n-tile SwiGLU launches of 2-8 rows (one row keeps the plain
# width, `_1rs` / `_1s`): off; 16 and 24 warps measured within the spread at 8x1k and slower at 4x1k (docs/perf.md).
# `group_rows` (0: off): grouped launches (an MoE block's experts) of at most this many rows take the one-n-tile
# kernels (`tile_rows`), a group's rows past 8 in more M tiles, each reading the expert's weights again. 16: a
# twelve-row step's ~90 expert groups mostly hold one or two rows (the shared expert's twelve take two M tiles, its
# weights read twice): 35B-A3B steps at 10 and 12 rows 1.03-1.04x (two interleaved rounds, docs/perf.md,
# thirty-seventh session); past 16 rows (prefill) a group's many rows would read its weights once per 8.
# `early` (0: off; kernel define MX_EARLY, bits by kernel: 1 the one-row `_1r` / `_1rs`, 2 the other one-n-tile
# ones (2-8 rows; bf16's and MXFP8's one-row products too), 4 the two-n-tile ones (9-16 rows), 8 those of 4 and 8
# n-tiles (17-64 rows)):
# the loop over whole chunks issues each register stage's next chunk inside the current chunk's MMAs, each 16-byte
# piece of codes once its words are decoded and the scales once read (mx_gemv.cu `Refill`), rather than after
# them, so that a warp's next loads are in flight while it computes; the same loads and sums, so the same bytes
# (BF16, MXFP8 and the E2M1 formats; MXFP6's wider lane-rows keep the plain loop). 4 (forty-first session, docs/perf.md): step-weighted twelve-row products
# (`gemv_sweep`) MXFP4 7.60 -> 7.25 ms, NVFP4 8.80 -> 8.61, MXFP8 10.21 -> 9.95, bf16 unchanged; 27B MXFP4 steps
# at 12x1k 1.047x and 12x32k 1.024x (four interleaved rounds); bit 1 measured no faster (ptxas puts the one-row
# kernels' loads late in the chunk and spills 8-16 bytes at 80 registers; NVFP4's one-row products 3.6% slower).
# Bit 8 (forty-second session, `SWEEP_MW`): step-weighted products at 24 / 48 rows MXFP4 -0.5% / -2.7%, NVFP4
# -2.6% / -1.4%, MXFP8 -3.7% / -5.3%, bf16 +0.2% / -10%. Bit 2 by format: MXFP8 at 4 / 8 rows -0.8% / -2.7% (its
# one-row products, on `_1`, -0.7 to -1.6%), MXFP4 -0.7% / -0.6%; NVFP4 +1.7% / +1.0% and bf16 +2.1% / +2.0% (one
# row +1.4%), so off for those two.
# The kernels of 4 and 8 n-tiles (17-64 rows: a prompt's short chunk beside decoding agents) have their own block
# width `many_warps` (0: `warps`; MX_WARPS4), x staging row `many_segk` (0: the nominal 2048 / n-tiles codes, in
# static shared memory: one chunk a segment at 8 n-tiles, so a staging pass and its barriers every chunk; longer
# in dynamic shared memory, `many_segk` below; MX_SEGK4) and register stages `many_stages` (0: 2; MX_STAGES4).
# 16 warps (one block an SM), 1024 codes, one stage (forty-third session, `SWEEP_MW`, step-weighted products
# against 8 warps, nominal rows, two stages): at 24 rows MXFP4 12.45 -> 10.96 ms, NVFP4 13.67 -> 12.14, MXFP8
# 14.09 -> 12.59, bf16 17.84 -> 17.07; at 48 rows 26.17 -> 19.08, 28.44 -> 20.06, 27.87 -> 19.93, 30.93 -> 22.16
# (1.37-1.42x). The same bytes at any staging row and stage count; at any width where a block sums a tile's whole
# K range (`test_many_row_kernels_keep_the_bytes`).
# `row1_warps` (0: `warps`): warps of a dense one-row `_1r` / `_1rs` launch's blocks, in a build of its own with the
# early refill (`early` bit 1). MXFP4 10: two blocks an SM at 96 registers, where the refill builds without spills
# (at 8 warps, three an SM, ptxas spills and puts the loads after the 12th of 16 MMAs; without it, after all 16).
# Forty-sixth session (docs/perf.md): one-row gate|up +5% and down +3% of copy bandwidth, qkv|z and q|k|v 10-16%
# slower; 27B 1x1k steps 0.8-2.8% faster (three interleaved rounds), 4x1k and the 35B-A3B's 1x1k level. The 2-8-row
# kernels keep `warps`; NVFP4 (whose one-row products the early refill made 3.6% slower at 8 warps) stays at 0.
# `row1_fill` (0: always): the one-row build only where its plan is a tile grid of at least this fraction of the
# resident blocks (`row1_fills`), else the plain build. Its 2 blocks an SM of 160 columns fit some products worse
# than 3 of 128: the 27B's qkv|z took 206 of 264 slots (0.78; 384 of 396 plain) and its q|k|v stream-K, the two
# that lost; gate|up (0.83), down and out (0.97) gained. At 0.8 (forty-seventh session, docs/perf.md) the 27B's
# step-weighted one-row products 5.26 -> 5.10 ms (each product at its better build's speed), its 1x1k steps 0.8%
# faster (eight interleaved rounds); the 35B-A3B's stream-K products (attention out, shared expert, lm_head) keep
# the plain build, its 1x1k steps within their ~2% spread (three rounds, medians 1.3% slower than with every
# one-row product on the build: not measured by product). A cut between 0.78 and 0.83 chosen from five products.
# `row1_vs_plain` (0: off): past `row1_fill`, only where the plain build's plan is stream-K or fills no more of its
# own slots. The 35B-A3B's qkv|z [12288 x 2048] fills 0.875 of the one-row build's slots, 0.97 of the plain one's,
# and ran 34.1% of copy bandwidth on the plain build against 30.7% on its own (forty-eighth session, `gemv_sweep`:
# its step-weighted one-row products 0.75 -> 0.72 ms; 1x1k steps, eight interleaved rounds, medians 2.29 against
# 2.30 ms, within their spread). The 27B's products each take the build they took before.
# `pdl_prefetch` (0: none; MX_PDL_PF): chunks of weights past its register stages that an overlapped product's
# block asks of the L2 (a line a row and chunk) before it waits for the kernel before it, as a chain's block does
# (MX_CHAIN_PF); a cache hint, the same bytes. MXFP4 4 (sixtieth session, docs/perf.md: 27B 1x1k graph steps
# 1.011-1.013x in three interleaved rounds on an H100, 12x1k level; the one-row products' blocks are resident
# early behind the latency-bound kernels before them; sixty-first session: 8 and 16 0.95-1.00x / 0.96-0.97x of 4).
# MXFP8 4 (sixty-first session, three interleaved rounds on an H100: 1x1k 1.009-1.015x, 12x1k 1.041-1.045x; 8
# within 1% of 4). NVFP4 0: 4 and 2 made its steps 2-8% slower (the same registers and spills in its builds).
# MXFP4 0 since the sixty-fourth session: on the H200 (the seed's device) 0 beat 4 in every interleaved round, 1x1k
# 1.015-1.022x (five rounds but one outlier) and 12x1k 1.018-1.027x (three rounds); the H100's ~1% the other way
# is smaller. MXFP8 keeps 4 (H200 level within 1%, its H100 twelve-stream 4%).
TUNE: dict[str, Any] = TuneDict({
    "stages": {"*": 2, "mxfp4": 1, "nvfp4": 1, "mxfp8": 1}, "blocks_per_sm": {"*": 2, "mxfp4": 3, "nvfp4": 3, "mxfp8": 3},
    "wide_blocks_per_sm": {"*": 2, "mxfp4": 3, "nvfp4": 3, "mxfp8": 3}, "wide_stages": {"*": 0, "mxfp4": 1, "nvfp4": 1, "mxfp8": 1},
    "wide_warps": {"*": 8, "mxfp4": 10, "nvfp4": 10, "mxfp8": 12},
    "policy": "auto",
    "min_chunks": 2, "e2m1_split": 1, "tiled": 1, "small_bytes": 0, "small_stages": 2, "small_blocks_per_sm": 2,
    "warps": 8, "acc": 2, "fill_chunks": 2, "ksplit": 0, "auto_fill": 0.7, "source": "mx_gemv", "fuse_norms": 1,
    "bf16_rows": 1, "swiglu_rows": 1, "row1": 1, "wide_segk": {"*": 1024, "mxfp4": 2688, "nvfp4": 2688},
    "part_batch": 8, "swiglu_wide_warps": {"*": 0, "mxfp4": 24, "nvfp4": 24},
    "swiglu_warps": 0, "small_n": 1024, "small_warps": 0, "small_pre": 0, "group_rows": 16,
    "early": {"*": 12, "mxfp4": 14, "mxfp8": 14}, "many_warps": 16, "many_segk": 1024, "many_stages": 1,
    "row1_warps": {"*": 0, "mxfp4": 10}, "row1_fill": 0.8, "row1_vs_plain": 1,
    "pdl_prefetch": {"*": 0, "mxfp8": 4},
})  # the H200 sweeps' best (docs/perf.md)
TUNE.update(merge_tune(TUNE, json.loads(os.environ.get("DECAPYBARA_MX_TUNE") or "{}")))  # e.g. '{"warps": 4}'
TUNE_DEFINES: tuple[tuple[str, int], ...] = ()  # extra kernel defines (bench/gemv_sweep.py: MX_DIAG)


def tune_state() -> tuple[Any, ...] | None:
    """What TUNE's derived values depend on, as a cache key (TUNE's identity and version, TUNE_DEFINES), or None
    where TUNE is not a `TuneDict` (then nothing derived from it is cached)."""
    t = TUNE
    return (id(t), t.version, TUNE_DEFINES) if type(t) is TuneDict else None


_TUNED: dict[tuple[Any, ...], dict[str, Any]] = {}


def tune_for(fmt: str, tune: dict | None = None) -> dict[str, Any]:
    """`tune` (default TUNE) with every by-format value resolved for weight format `fmt`. TUNE's is cached by its
    `tune_state` (one dict shared by the callers: read it, do not edit it)."""
    if tune is not None:
        return _tune_for(fmt, tune)
    state = tune_state()
    if state is None:
        return _tune_for(fmt, TUNE)
    key = (fmt, *state)
    out = _TUNED.get(key)
    if out is None:
        if len(_TUNED) > 256:
            _TUNED.clear()
        out = _TUNED[key] = _tune_for(fmt, TUNE)
    return out


def small_tune(tune: dict) -> dict:
    """A resolved tuning with its `small_stages` / `small_blocks_per_sm` build in place of the default's (what
    dense one-n-tile products under `small_bytes` of codes run, but for one-row products in `row1_tune`'s build
    where `row1_fills`)."""
    return {**tune, "stages": tune["small_stages"], "blocks_per_sm": tune["small_blocks_per_sm"]}


def row1_tune(tune: dict) -> dict:
    """A resolved tuning with the one-row build in place of the default's (what dense one-row products on the `_1r` /
    `_1rs` kernels run where `row1_warps` is set): blocks of `row1_warps` warps and the early refill (`early` bit 1)."""
    return {**tune, "warps": tune["row1_warps"], "early": tune["early"] | 1}


def block_warps(tune: dict, nt: int) -> int:
    """Warps of a block of the `nt`-n-tile kernels under a resolved tuning: `wide_warps` for two n-tiles, else
    `many_warps` (where set) for four and eight, else `warps` (decapybara/kernels/mx_gemv.cu MX_WARPS2 / MX_WARPS4 /
    MX_WARPS; 16 output rows each; a kernel file older than a define builds those kernels with `warps`)."""
    if nt == 2 and kernel_knows(tune["source"], "MX_WARPS2"):
        return tune["wide_warps"]
    if nt >= 4 and tune.get("many_warps") and kernel_knows(tune["source"], "MX_WARPS4"):
        return tune["many_warps"]
    return tune["warps"]


def n_tiles(rows: int) -> int:
    """n-tiles of 8 rows a mx_gemm kernel takes for a product of `rows` rows (its `_1` / `_2` / `_4` / `_8` build)."""
    return 1 if rows <= 8 else 2 if rows <= 16 else 4 if rows <= 32 else 8


def tile_rows(w: PackedWeight, rows: int, groups: int | None) -> int:
    """The rows whose n-tiles (`n_tiles`) a launch of `rows` rows over `w` takes: `rows`, but 8 (the one-n-tile
    kernels) for a grouped launch (`groups` not None: an MoE block's experts, whose groups of a decode step hold
    a few of its rows each) of at most TUNE `group_rows` rows (0: none); its groups' rows past 8 go in more M
    tiles, each streaming the expert's weights again (so not for prefill-sized steps, whose groups hold many)."""
    most = tune_for(w.fmt).get("group_rows", 0) if groups is not None else 0
    return min(rows, 8) if rows <= most else rows


def gemm_plan(w: PackedWeight, rows: int, x_rows: int | None = None, groups: int | None = None,
              tune: dict | None = None, swiglu: bool = False) -> GemmPlan:
    """The launch plan (gemv_plan.plan_gemm) of a product of `rows` rows over `w`: dense (`groups` None) or
    over `groups` expert groups; `x_rows` rows of x (the partial sums' size; default `rows`); `tune` resolved
    (default `launch_tune`'s of its `tile_rows`, of a SwiGLU launch where `swiglu`)."""
    dense = groups is None
    trows = tile_rows(w, rows, groups)
    tune = launch_tune(w, trows, dense=dense, swiglu=swiglu) if tune is None else tune
    nt = n_tiles(trows)
    warps = block_warps(tune, nt)
    mtiles = -(-rows // (8 * nt))
    return plan_gemm(tiles=-(-w.N // (16 * warps)), nchunks=-(-w.Kp // (4 * LANE_K[w.fmt])),
                     mtiles=mtiles, groups=1 if dense else groups, slots=plan_slots(tune, nt),
                     weight_bytes=mtiles * w.codes.nbytes, partial_bytes=8 * (rows if x_rows is None else x_rows) * w.N,
                     tune=tune, dense=dense, max_counters=_counters().size,
                     grouped_split=kernel_knows(tune["source"], "g_ids"))


def plan_slots(tune: dict, nt: int) -> int:
    """Blocks of the `nt`-n-tile kernels resident on the device at once under a resolved tuning (a launch
    plan's `slots`): their build's blocks an SM in slots of 8 warps (`blocks_per_sm`, `wide_blocks_per_sm`; at
    most 2 at four n-tiles, 1 at eight), no more than the SM's shared memory holds with a dynamic x staging
    buffer, times the SMs."""
    per_sm = (tune["blocks_per_sm"] if nt == 1 else tune["wide_blocks_per_sm"] if nt == 2
              else min(2, tune["blocks_per_sm"]) if nt <= 4 else 1) * 8 // block_warps(tune, nt) or 1
    smem, per_sm_smem = staging_bytes(tune, nt), smem_per_sm()
    if smem and per_sm_smem:  # a dynamic x staging buffer: no more blocks than the SM's shared memory holds
        per_sm = max(1, min(per_sm, per_sm_smem // (smem + 2048)))
    return per_sm * sm_count()


def plan_fill(w: PackedWeight, tune: dict) -> float | None:
    """The fraction of the resident blocks a dense one-row product over `w` fills under the resolved tuning `tune`:
    its tile grid's blocks over the slots of the waves they take (`plan_slots` each; one wave under the "auto"
    policy), or None where its plan is stream-K (a wave of its own)."""
    plan = gemm_plan(w, 1, tune=tune)
    if plan.stream:
        return None
    blocks, slots = plan.grid[0] * plan.grid[1], plan_slots(tune, 1)
    return blocks / (-(-blocks // slots) * slots)


def row1_fills(w: PackedWeight, tune: dict, plain: dict) -> bool:
    """Whether a dense one-row product over `w` takes the one-row build `tune` (`row1_tune`'s) rather than `plain`
    (the resolved tuning it takes otherwise) under TUNE `row1_fill` (0: always): where its plan is a tile grid
    whose blocks fill at least that fraction of the resident blocks, not stream-K nor a grid that leaves more of
    the SMs' slots empty; and, under TUNE `row1_vs_plain`, where the plain build's plan is stream-K or fills no
    more of its own slots."""
    fill = tune.get("row1_fill", 0)
    if not fill:
        return True
    own = plan_fill(w, tune)
    if own is None or own < fill:
        return False
    other = plan_fill(w, plain) if tune.get("row1_vs_plain", 0) else None
    return other is None or other <= own


def product_rows(x: Any) -> Any:
    """x as the skinny kernels take it from a backend: C-contiguous, bf16 bits (uint16) as they are, anything
    else as float32."""
    return cp.ascontiguousarray(x, dtype=cp.uint16 if x.dtype == cp.uint16 else cp.float32)


def launch_tune(w: PackedWeight, rows: int, dense: bool = True, swiglu: bool = False) -> dict:
    """The resolved tuning a product of `rows` rows over `w` launches with: TUNE for its format, or its small
    build where a dense one-n-tile product has fewer than `small_bytes` of codes (and, at 4 and 8 n-tiles, its
    `many_segk` rows fitted to the device, `fit_many_segk`); a SwiGLU launch (`swiglu`)
    takes blocks of `swiglu_wide_warps` at 9-16 rows and of `swiglu_warps` at 2-8 rows where set (not the small
    build then); a dense one-row product on the `_1r` / `_1rs` kernels (`one_row`) blocks of `row1_warps` where
    set, with the early refill (TUNE `early` bit 1): a build of its own, where its plan fills the device and,
    under `row1_vs_plain`, no less of it than the plain build's plan fills (`row1_fills`)."""
    tune = tune_for(w.fmt)
    if n_tiles(rows) >= 4 and tune.get("many_segk"):
        tune = fit_many_segk(tune, n_tiles(rows))
    if swiglu and 1 < rows and n_tiles(rows) <= 2:
        key = "wide_warps" if n_tiles(rows) == 2 else "warps"
        if tune.get(f"swiglu_{key}"):
            return {**tune, key: tune[f"swiglu_{key}"]}
    plain = small_tune(tune) if dense and n_tiles(rows) == 1 and w.codes.nbytes < tune["small_bytes"] else tune
    if dense and tune.get("row1_warps") and one_row(w, rows, tune):
        row1 = row1_tune(tune)
        if row1_fills(w, row1, plain):
            return row1
    return plain


# TUNE keys of the kernels of 4 and 8 n-tiles (17-64 rows) and the kernel defines they set where not 0
MANY_DEFINES = (("many_warps", "MX_WARPS4"), ("many_segk", "MX_SEGK4"), ("many_stages", "MX_STAGES4"))


def gemm_defines(tune: dict, fmt: str, e2m1_split: bool = False, tiled: bool = False) -> tuple[tuple[str, int], ...]:
    """The kernel defines of mx_gemv.cu that a resolved TUNE setting (`tune_for(fmt)`) builds in for weights of
    format `fmt` (MX_ONLY: a module holds that format's kernels alone) whose E2M1 codes are split
    (`PackedWeight.e2m1_split`, MX_E2M1) or not, in band tiles (`PackedWeight.tiled`, MX_TILED; only named when
    set, so that kernel files older than the layout still build) or not (plus TUNE_DEFINES)."""
    return (("MX_ONLY", FMT_IDS[fmt]), ("MX_STAGES", tune["stages"]), ("MX_WARPS", tune["warps"]),
            ("MX_WARPS2", tune["wide_warps"]),
            ("MX_ACC", tune["acc"]), ("MX_MINB", tune["blocks_per_sm"]), ("MX_MINB2", tune["wide_blocks_per_sm"]),
            ("MX_STAGES2", tune["wide_stages"]), ("MX_E2M1", int(e2m1_split)), *((("MX_TILED", 1),) if tiled else ()),
            *((("MX_SEGK2", tune["wide_segk"]),) if tune.get("wide_segk", 1024) != 1024 else ()),
            *((("MX_PART_BATCH", tune["part_batch"]),) if tune.get("part_batch", 8) != 8 else ()),
            *((d, tune[k]) for k, d in MANY_DEFINES if tune.get(k) and kernel_knows(tune["source"], d)),
            *((("MX_EARLY", tune["early"]),) if tune.get("early", 0) and kernel_knows(tune["source"], "MX_EARLY")
              else ()),
            *((("MX_PDL_PF", tune["pdl_prefetch"]),) if tune.get("pdl_prefetch", 0)
              and kernel_knows(tune["source"], "MX_PDL_PF") else ()), *TUNE_DEFINES)


@dataclass
class NormedRows:
    """rms_norm(h) = h / denom * (offset + weight) not yet computed, as `mx_linear_add_norm` leaves it: h
    float32 [T, H] (contiguous), xg = h * (offset + weight) [T, H] in bf16 bits (as the product rounds any x; the
    producer writes it so) or float32, sq float32 [T, tiles] the sums of squares of h's rows by tile of the
    product's columns, the norm's weight float32 [H], eps and offset.
    `mx_linear` takes the product over xg and divides each row's outputs by its denom = sqrt(sum(sq) / H +
    eps) (one launch, no norm kernel; on the skinny kernels or gemv_small), and so does `moe` (its router product
    and its experts' grouped SwiGLU launch, `moe_fuses_norm`); anything else takes `materialize()`."""

    h: Any
    xg: Any
    sq: Any
    weight: Any
    eps: float
    offset: float

    @property
    def shape(self) -> tuple[int, ...]:
        return self.h.shape

    def materialize(self) -> Any:
        """The normalised rows as a float32 array (the norm kernel: its own sums of squares)."""
        from decapybara.backend.cupy_ops import rms_norm

        return rms_norm(self.h, self.weight, self.eps, self.offset)


def one_row(w: PackedWeight, rows: int, tune: dict, groups: Any = None) -> bool:
    """Whether a product launches the one-row block-sum kernels (`_1r` / `_1rs`, decapybara/kernels/mx_gemv.cu header):
    dense, one row, MXFP4 or NVFP4 (NVFP4 where the kernel file has its `R1Cols`), TUNE `row1` (resolved
    `tune`) and a kernel file that has them."""
    src = tune["source"]
    return (groups is None and rows == 1 and bool(tune.get("row1", 0)) and kernel_knows(src, "NAME##_1r")
            and (w.fmt == "mxfp4" or (w.fmt == "nvfp4" and kernel_knows(src, "R1Cols"))))


STATIC_SEGK = 1440  # the longest x staging row of the two-n-tile kernels in static shared memory (MX_SEGK2)


def staging_bytes(tune: dict, nt: int) -> int:
    """Dynamic shared memory of an `nt`-n-tile product's launch (decapybara/kernels/mx_gemv.cu XBuf): the two-n-tile
    kernels' x staging buffer where its rows (`wide_segk` codes) are longer than static shared memory holds, the
    4- and 8-n-tile kernels' where their rows (`many_segk`) are longer than the nominal 2048 / nt; else 0."""
    if nt == 2:
        segk = tune.get("wide_segk", 1024)
        return 16 * (segk + 32) * 2 if segk > STATIC_SEGK and kernel_knows(tune["source"], "MX_SEGK2") else 0
    segk = many_segk(tune)
    return 16 * nt * (segk + 32) if nt >= 4 and segk > 2048 // nt and kernel_knows(tune["source"], "MX_SEGK4") else 0


def many_segk(tune: dict) -> int:
    """TUNE `many_segk` as the 4- and 8-n-tile kernels build it (mx_gemv.cu XBuf): rounded down to a multiple of
    256. Up to their nominal 2048 / n-tiles codes (0 where unset) they keep the nominal row in static shared memory."""
    return tune.get("many_segk", 0) // 256 * 256


def fit_many_segk(tune: dict, nt: int) -> dict:
    """`tune` with `many_segk` lowered in steps of 256 codes (to 0, the nominal row in static shared memory, where
    no longer row fits) until an `nt`-n-tile block's x staging buffer (`staging_bytes`) and 4 KB of the kernel's
    other shared memory fit the current device's opt-in shared memory a block (H200: 1536 codes at most at 8
    n-tiles; about 99 KB a block on GPUs below the data-centre parts, where 1024 codes at 8 n-tiles take 132 KB);
    `tune` itself where its rows fit as given."""
    fit = _fitted_segk(smem_per_block() - 4096, tune["source"], tune["many_segk"], nt)
    return tune if fit == tune["many_segk"] else {**tune, "many_segk": fit}


@functools.cache
def _fitted_segk(limit: int, source: str, segk: int, nt: int) -> int:
    """`fit_many_segk`'s `many_segk` for a shared-memory `limit` a block (past the kernel's other 4 KB): `segk`
    where its rows fit, else the longest that does (0 below the nominal row); once per device limit, kernel file,
    rows and n-tiles, so that a launch's tuning costs a lookup (eager steps resolve it at every product)."""
    fit = many_segk({"many_segk": segk})
    while staging_bytes({"source": source, "many_segk": fit}, nt) > limit:
        fit -= 256
    return segk if fit == segk else fit if fit > 2048 // nt else 0


def _gemm(x: Any, w: PackedWeight, y: Any, *, bias: Any = None, gather: Any = None, groups: Any = None,
          max_rows: int | None = None, res: Any = None, norm: NormedRows | None = None, swiglu: bool = False) -> Any:
    """Launch mx_gemm: y[rows] = x[rows] @ w^T. Dense (groups None) or grouped: groups = (offsets, counts[, ids])
    of G groups (`moe_dispatch`'s: group j's rows of y from offsets[j], counts[j] of them, over expert ids[j]; group j
    over expert j without ids), y's rows every group's.
    A persistent weight's launch may overlap the kernel before it (`pdl.launch`): the kernel loads its first
    weights, then waits for that kernel before reading x; other weights (packed during a step), or an older
    kernel file (`tune["source"]`, no wait in it), launch plainly.
    Dense launches may fuse the residual add and RMSNorm across two products (decapybara/kernels/mx_gemv.cu, header):
    `res` = (residual, xg, gw, offset) (residual float32, xg bf16 bits or float32, y's shape; y float32
    contiguous; gw [N] float32) makes y = x @ w^T + residual, xg = y * (offset + gw) and returns y's rows'
    sums of squares by output tile, float32 [M, tiles];
    `norm` (x = norm.xg) divides each output row by its denominator from norm.sq (by x row; in a grouped
    SwiGLU launch over gathered rows, by y row: `moe_route_dispatch`'s copy of the gathered rows' sums);
    `swiglu`: w is [gate; up] stacked, y [M, N / 2] = silu(x @ gate^T) * (x @ up^T) (the `_1s` to `_8s` kernels, up
    to SWIGLU_ROWS rows); grouped too (w [E, N, K]: each expert's [gate; up], y [y rows, N / 2])."""
    m = x.shape[0] if groups is None else int(max_rows)
    n = w.N
    fused = res is not None or norm is not None or swiglu
    most = FUSED_ROWS if res is not None or norm is not None else SWIGLU_ROWS
    dense = groups is None and gather is None
    grouped_norm = norm is not None and swiglu and groups is not None and gather is not None
    assert not fused or ((dense or (swiglu and (norm is None or grouped_norm))) and m <= most), \
        f"fused norms: dense or a gathered SwiGLU, M <= {most}; swiglu: dense or grouped, M <= {most}"
    assert not swiglu or (n % 16 == 0 and bias is None and res is None
                          and y.shape == ((m if groups is None else y.shape[0]), n // 2)), \
        f"swiglu: N {n} (a multiple of 16), no bias or residual, y {y.shape}"
    if not (m and n):  # nothing to compute (and the kernel's loop over whole chunks reads row N - 1: needs N >= 1)
        return empty((m, 0), cp.float32) if res is not None else None
    ngroups = 1 if groups is None else groups[0].shape[0]
    rows = x.shape[0] if groups is None else y.shape[0]  # the kernel's M: partial sums go by y row
    r = _launch_of(w, m, rows, None if groups is None else ngroups, swiglu)
    plan, nrb = r.plan, r.nrb
    partial = empty((plan.partial_rows, rows, n), cp.float32) if plan.partial_rows > 1 else null()
    x_vec = int(dev_ptr(x) % 16 == 0 and x.shape[1] % 8 == 0)  # 8-element groups of x in 16- / 32-byte loads
    g_off, g_cnt = groups[:2] if groups is not None else (null(), null())
    g_ids = groups[2] if groups is not None and len(groups) > 2 else null()
    assert r.gids or groups is None or len(groups) == 2, "this kernel file takes no group ids"
    sq = None
    fuse_args: tuple[Any, ...] = ()
    xg_args = r.xg_args
    if r.fuses:  # older kernel files (bench/gemv_sweep.py) take no fused norms
        residual, xg, gw, gw_off = res if res is not None else (null(), null(), null(), 0.0)
        if res is not None:
            for a, name, dt in ((residual, "residual", np.float32), (xg, "xg", xg.dtype)):
                check(a, dt, name, 2)
                assert a.shape == y.shape, f"{name} {a.shape} vs y {y.shape}"
            assert xg.dtype == np.float32 or (xg.dtype == np.uint16 and xg_args), f"xg {xg.dtype}"
            check(gw, np.float32, "gw", 1)
            assert y.dtype == np.float32 and y.flags.c_contiguous and gw.shape[0] == n
            sq = empty((m, nrb), cp.float32)
        fuse_args = (residual, sq if sq is not None else null(), xg, gw, F32(gw_off),
                     *_consumer_args(norm, x, y.shape[0] if grouped_norm else m))
        if xg_args:
            fuse_args += (I32(kind(xg.dtype) if res is not None else 0),)
    else:
        assert not fused, "this kernel file fuses no norms"
    r.launch(r.func, plan.grid, r.block,
             (*r.weight_args, bias if bias is not None else null(), x, I32(kind(x.dtype)), I64(x.shape[1]),
              gather if gather is not None else null(), y, I32(kind(y.dtype)), I64(y.shape[1]), partial,
              _counters(), I32(rows), *r.shape_args, g_off, g_cnt, *r.tile_args, I32(x_vec), r.stream_arg,
              *fuse_args, *((g_ids,) if r.gids else ())), shared_mem=r.smem)
    return sq


@dataclass(slots=True, frozen=True)
class _Launch:
    """What a product's launch derives from its weight, its row counts and the tuning alone (`_launch_of`)."""

    plan: GemmPlan
    func: Any        # the kernel
    launch: Any      # pdl.launch or pdl.plain
    warps: int       # a block's
    nrb: int         # blocks of 16 * warps output columns (the fused norms' sums of squares a row)
    smem: int        # dynamic shared memory (staging_bytes)
    fuses: bool      # the kernel file takes the fused norms' arguments (nsq_tiles)
    xg_args: bool    # and the xg kind (xg_kind)
    gids: bool       # and grouped launches' expert ids (g_ids; its split sums by y row)
    block: tuple[int]
    # the kernel arguments that depend on the weight and the plan alone, in `_gemm`'s argument order:
    weight_args: tuple[Any, ...]  # codes, scales, tensor scale
    shape_args: tuple[Any, ...]   # N, K, Kp, row bytes of codes and scales, expert strides of codes and scales
    tile_args: tuple[Any, ...]    # row tiles, chunks a split
    stream_arg: Any               # stream-K or tile grid


def launch_kernel(w: PackedWeight, m: int, groups: int | None = None, swiglu: bool = False,
                  tune: dict | None = None) -> tuple[str, str, tuple[tuple[str, int], ...]]:
    """(kernel file, function, defines): the `get_kernel` arguments of the skinny kernel a product of `m` rows
    over `w` launches (`groups` and `swiglu` as `_launch_of` takes them; `tune` resolved, default its
    `launch_tune`), so that a caller can build kernels ahead of their launches (tests, side by side)."""
    trows = tile_rows(w, m, groups)
    tune = launch_tune(w, trows, dense=groups is None, swiglu=swiglu) if tune is None else tune
    name = f"mx_gemm_{w.fmt}_{'1r' if one_row(w, m, tune, groups) else n_tiles(trows)}{'s' if swiglu else ''}"
    return tune["source"], name, gemm_defines(tune, w.fmt, w.e2m1_split, w.tiled)


def _launch_of(w: PackedWeight, m: int, x_rows: int, groups: int | None, swiglu: bool) -> _Launch:
    """The launch recipe of a product of `m` rows (`x_rows` rows of x; `groups` expert groups, None dense, of a
    SwiGLU launch where `swiglu`) over `w`: its tuning (`launch_tune`), plan (`gemm_plan`), kernel and launch
    function. Every eager product asks; a weight keeps its recipes (`PackedWeight.launches`) by those and
    `tune_state()` (none while TUNE is not a TuneDict) and the device."""
    state = tune_state()
    key = (m, x_rows, groups, swiglu, w.persistent, cp.cuda.runtime.getDevice(), state)
    cache = _cache(w).setdefault("recipes", {})  # apart from the weight's other entries (its bf16 values)
    if state is not None:
        got = cache.get(key)
        if got is not None:
            return got
    trows = tile_rows(w, m, groups)
    tune = launch_tune(w, trows, dense=groups is None, swiglu=swiglu)
    nt = n_tiles(trows)
    warps = block_warps(tune, nt)
    # the kernel addresses one group's rows by 32-bit byte offsets
    if w.codes.nbytes // (w.shape[0] if groups is not None else 1) >= 1 << 32:  # one expert's matrix
        raise ValueError(f"{w.shape}: over 4 GB of codes per matrix")
    src = tune["source"]
    assert not w.tiled or kernel_knows(src, "MX_TILED"), f"decapybara/kernels/{src}.cu reads no band tiles"
    func = get_kernel(*launch_kernel(w, m, groups, swiglu, tune))
    smem = staging_bytes(tune, nt)
    allow_dynamic_smem(func, smem)
    plan, mtiles = gemm_plan(w, m, x_rows, groups, tune), -(-m // (8 * nt))
    sc = w.scales

    def stride(a: Any) -> int:
        return a.strides[0] if a.ndim == 3 else 0

    out = _Launch(plan=plan, func=func,
                  launch=pdl.launch if w.persistent and kernel_knows(src, "pdl_wait") else pdl.plain,
                  warps=warps, nrb=-(-w.N // (16 * warps)), smem=smem,
                  fuses=kernel_knows(src, "nsq_tiles"), xg_args=kernel_knows(src, "xg_kind"),
                  gids=kernel_knows(src, "g_ids"), block=(32 * warps,),
                  weight_args=(w.codes, sc if sc is not None else null(), F32(w.tensor_scale)),
                  shape_args=(I32(w.N), I32(w.K), I32(w.Kp), I64(w.codes.shape[-1] * w.codes.itemsize),
                              I64(sc.shape[-1] if sc is not None else 0), I64(stride(w.codes)),
                              I64(stride(sc) if sc is not None else 0)),
                  tile_args=(I32(mtiles), I32(plan.cps)), stream_arg=I32(int(plan.stream)))
    if state is not None:
        if len(cache) > 64:
            cache.clear()
        cache[key] = out
    return out


DENSE_ROWS = 64  # products with more rows dequantise the weights to bf16 once and run a cuBLAS GEMM
# products with more rows over a weight that keeps its bf16 values (`attach_dense`, prefill_weights=bf16) run a
# cuBLAS GEMM on them (docs/perf.md, thirtieth session: bench/dense_rows.py); at most DENSE_ROWS (`skinny_product`)
KEPT_ROWS = 32
FUSED_ROWS = 8  # products of at most this many rows (the one-n-tile kernels) may fuse norms (mx_linear_add_norm)
SWIGLU_ROWS = 64  # and of at most this many (the `_1s` to `_8s` kernels) the MLP activation (mx_swiglu)
BF16_EXACT = ("bf16", "mxfp8", "mxfp6", "mxfp4")  # formats whose values bf16 holds exactly (not NVFP4)
# formats whose values bf16 holds exactly but for one float32 factor a matrix: NVFP4's codes times their E4M3
# block scales have at most 6 significant bits (of bf16's 8); its tensor scale multiplies a product's float32 sums instead
BF16_EXACT_SCALED = ("nvfp4",)


def skinny_product(w: PackedWeight, rows: int) -> bool:
    """Whether `mx_linear` runs a product of `rows` rows over `w` on the skinny kernels rather than cuBLAS: at most
    DENSE_ROWS rows, and at most KEPT_ROWS where `w` keeps its bf16 values (`dense_of`). (Weights in a format
    bf16 cannot hold, or not 2-D, take the skinny kernels at any row count.)"""
    if rows <= KEPT_ROWS or w.fmt not in BF16_EXACT + BF16_EXACT_SCALED or not (w.N and w.K):
        return True
    return rows <= DENSE_ROWS and dense_of(w) is None


def fuses_norms(w: PackedWeight, rows: int) -> bool:
    """Whether a product of `rows` rows over `w` can take part in fused norms (decapybara/kernels/mx_gemv.cu, header): a
    weight the kernels stream, at most FUSED_ROWS rows (the one-n-tile kernels) that `skinny_product` leaves to
    them, a kernel file that fuses."""
    return gemm_ready(w) and rows <= FUSED_ROWS and skinny_product(w, rows) and kernel_knows(tune_for(w.fmt)["source"], "nsq_tiles")


def fuses_swiglu(w: PackedWeight, rows: int) -> bool:
    """Whether `mx_swiglu` can take a product of `rows` rows over `w` ([gate; up] stacked): 1 to SWIGLU_ROWS
    rows, a weight the kernels stream, N a multiple of 16 and a kernel file that has the `_1s` to `_8s` kernels
    (its entry macro). (The backend uses it from TUNE `swiglu_rows` rows up: `CupyBackend.swiglu`.)"""
    return (0 < rows <= SWIGLU_ROWS and w.N % 16 == 0 and gemm_ready(w) and skinny_product(w, rows)
            and kernel_knows(tune_for(w.fmt)["source"], f"NAME##_{n_tiles(rows)}s"))


def fuses_grouped_swiglu(w: PackedWeight, rows: int) -> bool:
    """Whether `moe` runs its experts' gate and up products and activation as one grouped SwiGLU launch over `w`
    (the [E, 2 I, H] stack of both, groups of up to `rows` rows): from TUNE `swiglu_rows` rows (0: never, as for
    dense MLPs) up to SWIGLU_ROWS, N a multiple of 16, a weight the kernels stream, a kernel file with the SwiGLU
    kernels and group ids."""
    tune = tune_for(w.fmt)
    src = tune["source"]
    return (len(w.shape) == 3 and 0 < tune["swiglu_rows"] <= rows <= SWIGLU_ROWS and w.N % 16 == 0 and gemm_ready(w)
            and kernel_knows(src, f"NAME##_{n_tiles(tile_rows(w, rows, w.shape[0]))}s") and kernel_knows(src, "g_ids"))


def mx_swiglu(x: Any, w: PackedWeight, out_dtype: Any = np.float32) -> Any:
    """silu(x @ gate^T) * (x @ up^T) [M, N / 2] for w = [gate; up] stacked along rows (N rows, N % 16 == 0), in
    one launch (decapybara/kernels/mx_gemv.cu `_1s` to `_8s` kernels, header): `silu_mul_halves(mx_linear(x, w))`, its
    bytes under tile-grid plans (within float32 rounding of the sums under stream-K, whose split points follow the
    kernel's own row order), float32 or (out_dtype uint16) in bf16 bits. x float32 / bf16 bits, or (up to
    FUSED_ROWS rows) `NormedRows`, fused; at most SWIGLU_ROWS rows (the caller checks `fuses_swiglu`)."""
    assert isinstance(w, PackedWeight) and len(w.shape) == 2, f"expected a 2-D PackedWeight, got {w!r:.80}"
    _check_packed(w)  # the rest of `fuses_swiglu`: _gemm's asserts and the kernel lookup
    norm = None
    if isinstance(x, NormedRows):
        assert fuses_norms(w, x.shape[0]), f"NormedRows of {x.shape[0]} rows"
        norm, x = x, x.xg
    check(x, x.dtype, "x", 2)
    kind(x.dtype)
    assert x.shape[1] == w.K, f"x {x.shape} @ w {w.shape}^T"
    y = empty((x.shape[0], w.N // 2), np.dtype(out_dtype))
    _gemm(x, w, y, norm=norm, swiglu=True)
    return y


def mx_linear(x: Any, w: PackedWeight, bias: Any = None, out_dtype: Any = None) -> Any:
    """y [M, N] = x [M, K] @ w^T (+ bias float32 [N]); x float32 / bf16 bits / float16, y in `out_dtype`
    (default x's; float32 for NormedRows). Weights dequantised in registers; x is rounded to bf16; float32
    accumulation.
    x may be `NormedRows`: a product of at most FUSED_ROWS rows takes them as they are (one launch), others
    materialise them. Past DENSE_ROWS rows the weight is dequantised to bf16 for a cuBLAS GEMM (the skinny
    kernels on slices of 64 rows took 1.2-3.1x the GPU time at 75-256 rows, docs/perf.md); past KEPT_ROWS rows
    a weight that keeps its bf16 values (`attach_dense`) hands those to cuBLAS (`skinny_product`)."""
    assert isinstance(w, PackedWeight) and len(w.shape) == 2, f"expected a 2-D PackedWeight, got {w!r:.80}"
    _check_packed(w)
    norm = None
    if isinstance(x, NormedRows):  # fused: the kernel path below (gemm_ready, at most FUSED_ROWS rows)
        norm, x = (x, x.xg) if fuses_norms(w, x.shape[0]) else (None, x.materialize())
    check(x, x.dtype, "x", 2)
    kind(x.dtype)
    assert x.shape[1] == w.K, f"x {x.shape} @ w {w.shape}^T"
    if bias is not None:
        check(bias, np.float32, "bias", 1)
        assert bias.shape[0] == w.N
    out_dtype = np.dtype(out_dtype or (np.float32 if norm is not None else x.dtype))
    if not gemm_ready(w):  # layout the kernel cannot stream: dequantise once, dense product
        y = cp.matmul(cp.asarray(x if x.dtype == cp.float32 else _to_f32(x)), mx_dequant(w).T)
        y = y + bias if bias is not None else y
        return y if out_dtype == np.float32 else _from_f32(y, out_dtype)
    m = x.shape[0]
    if not skinny_product(w, m):
        # prefill-sized: the weights' exact bf16 values once, then a tensor-core cuBLAS GEMM (bf16 operands,
        # float32 accumulation: the numbers of the skinny kernel, which also rounds x to bf16); NVFP4's tensor
        # scale is the GEMM's alpha (on each float32 sum, where the reference rounds each weight times it)
        scaled = w.fmt in BF16_EXACT_SCALED
        dense = dense_of(w)
        wb = (w.codes if w.fmt == "bf16" else dense if dense is not None
              else mx_dequant(_unscaled(w) if scaled else w, out_dtype=cp.uint16))
        xb = x if x.dtype == cp.uint16 else to_bf16_bits(cp.ascontiguousarray(x, dtype=cp.float32))
        y = gemm_bf16(xb, wb, alpha=w.tensor_scale if scaled else 1.0)
        y = y + bias if bias is not None else y
        return y if out_dtype == np.float32 else _from_f32(y, out_dtype)
    y = empty((x.shape[0], w.N), out_dtype)
    if bias is None and small_product(w, m):
        _small(x, w, y, norm)
    elif x.shape[0] and w.N:
        _gemm(x, w, y, bias=bias, norm=norm)
    return y


SMALL_ROWS = 16  # decapybara/kernels/gemv_small.cu: rows of x at most (two n-tiles)
SMALL_SPLIT_ROWS = 2 * SMALL_ROWS  # `small_product`'s rows at most: past SMALL_ROWS, a launch a SMALL_ROWS rows
# its blocks' warps (SG_WARPS: the K split of a 16-row tile) and 32-code steps of codes a warp holds at once
# (SG_PRE: the first before the wait); TUNE `small_warps` / `small_pre` (0: these)
SMALL_WARPS, SMALL_PRE = 16, 4


def small_product(w: PackedWeight, m: int) -> bool:
    """Whether a product of `m` rows over `w` runs on decapybara/kernels/gemv_small.cu (`_small`) instead of the skinny
    GEMM: bf16 weights of at most TUNE `small_n` rows (0: never), 1-SMALL_SPLIT_ROWS rows of x (past SMALL_ROWS
    in launches of SMALL_ROWS rows), rows the skinny kernels stream (`gemm_ready`: 16-byte aligned, K % 8 == 0).
    For products whose tiles and K splits cost more than their bytes: an MoE router (stacked with its shared
    expert's gate, 257 rows), the DeltaNet b|a (96 rows: at 24 rows, twelve agents' verification steps, the
    skinny GEMM's 4-n-tile kernel took ~7x the 12-row launch of gemv_small, docs/perf.md)."""
    if w.fmt != "bf16" or len(w.shape) != 2 or not 0 < m <= SMALL_SPLIT_ROWS:
        return False
    return 0 < w.N <= tune_for(w.fmt).get("small_n", 0) and gemm_ready(w)


def _consumer_args(norm: NormedRows | None, x: Any, rows: int) -> tuple[Any, Any, Any]:
    """A fused norm consumer's kernel arguments (nsq, nsq_tiles, n_eps: mx_gemv.cu's and gemv_small.cu's) for a
    launch over x = norm.xg whose sums of squares have `rows` rows; null ones where `norm` is None."""
    if norm is None:
        return null(), I32(0), F32(0.0)
    check(norm.sq, np.float32, "norm.sq", 2)
    assert x is norm.xg and norm.sq.shape[0] == rows, f"norm.sq {norm.sq.shape} for {rows} rows"
    return norm.sq, I32(norm.sq.shape[1]), F32(norm.eps)


def _small(x: Any, w: PackedWeight, y: Any, norm: NormedRows | None = None) -> None:
    """y = x @ w^T on decapybara/kernels/gemv_small.cu (`small_product`'s products; rows past SMALL_ROWS in launches
    of SMALL_ROWS rows each): one block a 16-row tile, overlapped
    (`pdl.launch`) over a load-time weight, whose first codes it loads before waiting for x. x's 8-element groups
    load 16 bytes at a time where its rows start 16-byte aligned. `norm` (x = norm.xg): each output row divided
    by its denominator from norm.sq, as the skinny kernels' fused consumer divides it (the same bits of it)."""
    m, k = x.shape
    if m > SMALL_ROWS:  # a launch a SMALL_ROWS rows (no fused norm past FUSED_ROWS rows)
        assert norm is None, "a fused norm's rows take one launch"
        for r0 in range(0, m, SMALL_ROWS):
            _small(x[r0:r0 + SMALL_ROWS], w, y[r0:r0 + SMALL_ROWS])
        return
    t = tune_for("bf16")
    warps, pre = t.get("small_warps") or SMALL_WARPS, t.get("small_pre") or SMALL_PRE
    defines = () if (warps, pre) == (SMALL_WARPS, SMALL_PRE) else (("SG_WARPS", warps), ("SG_PRE", pre))
    fn = get_kernel("gemv_small", "gemv_bf16_small_1" if m <= 8 else "gemv_bf16_small_2", defines)
    step = x.strides[0] if m > 1 else 0
    vec = int(dev_ptr(x) % 16 == 0 and step % 16 == 0)
    args = (w.codes, I64(w.codes.strides[0] // 2), x, I32(kind(x.dtype)), I64(x.strides[0] // x.itemsize), I32(vec),
            I32(m), I32(w.N), I32(k), y, I32(kind(y.dtype)), I64(y.strides[0] // y.itemsize))
    args += _consumer_args(norm, x, m)
    (pdl.launch if w.persistent else pdl.plain)(fn, (-(-w.N // 16),), (32 * warps,), args)


def dense_of(w: PackedWeight) -> Any:
    """`w`'s kept bf16 values (uint16 [N, K]; NVFP4: without its tensor scale), or None: none kept, or kept for
    arrays `w` no longer has (`_cache`)."""
    return _cache(w).get("dense")


def set_dense(w: PackedWeight, values: Any) -> None:
    """Keeps `values` (uint16 [N, K], the bits `mx_dequant` gives `w`, NVFP4 unscaled) as `w`'s bf16 values; None
    drops them."""
    d = _cache(w)
    if values is None:
        d.pop("dense", None)
        return
    check(values, np.uint16, "dense", 2)
    assert values.shape == (w.N, w.K), f"dense values {values.shape} for {w.shape}"
    d["dense"] = values


def attach_dense(w: PackedWeight) -> bool:
    """Keeps `w`'s bf16 values with it (`dense_of`: what the large-M path of `mx_linear` would dequantise at every
    product, the same bits) where that path dequantises it (a 2-D MX / NVFP4 weight the kernels stream); whether
    it did. Costs 2 bytes a weight of device memory."""
    if len(w.shape) != 2 or w.fmt not in BF16_EXACT + BF16_EXACT_SCALED or w.fmt == "bf16" or not gemm_ready(w):
        return False
    set_dense(w, mx_dequant(_unscaled(w) if w.fmt in BF16_EXACT_SCALED else w, out_dtype=cp.uint16))
    return True


def _unscaled(w: PackedWeight) -> PackedWeight:
    """`w` with tensor scale 1 (NVFP4's large-M path applies it as the GEMM's alpha), kept in `w`'s cache so that
    its own cache (the dequantisation's recipe) lives as long."""
    d = _cache(w)
    u = d.get("unscaled")
    if u is None:
        u = d["unscaled"] = replace(w, tensor_scale=1.0)
    return u


def mx_linear_add_norm(x: Any, w: PackedWeight, bias: Any, residual: Any, norm_weight: Any, eps: float,
                       offset: float) -> tuple[NormedRows, Any] | None:
    """(rms_norm(h), h) with h = x @ w^T (+ bias) + residual in one skinny product: h, h * (offset +
    norm_weight) and h's sums of squares by column tile come out of the product's epilogue, the division by
    each row's RMS is left to the consumer (`NormedRows`, `mx_linear`). None where this does not apply, and the
    caller then runs the plain ops: more than FUSED_ROWS rows (the kernels that fuse are the one-n-tile ones),
    no rows or columns, a weight the kernels cannot stream (`gemm_ready`), a kernel file (TUNE `source`)
    without the fusion, or TUNE's `fuse_norms` 0. x float32 or bf16 bits [M, K], residual float32 [M, N],
    norm_weight float32 [N]."""
    assert isinstance(w, PackedWeight) and len(w.shape) == 2, f"expected a 2-D PackedWeight, got {w!r:.80}"
    _check_packed(w)
    if not (tune_for(w.fmt)["fuse_norms"] and x.shape[0] and w.N and fuses_norms(w, x.shape[0])):
        return None
    check(x, np.uint16 if x.dtype == np.uint16 else np.float32, "x", 2)
    check(residual, np.float32, "residual", 2)
    assert x.shape[1] == w.K and residual.shape == (x.shape[0], w.N), f"x {x.shape} @ w {w.shape}^T + {residual.shape}"
    if bias is not None:
        check(bias, np.float32, "bias", 1)
        assert bias.shape[0] == w.N
    check(norm_weight, np.float32, "norm_weight", 1)
    # xg in bf16 bits from TUNE `bf16_rows` rows up (0: off; a kernel file that predates them: float32)
    tune = tune_for(w.fmt)
    bf16 = 0 < tune["bf16_rows"] <= x.shape[0] and kernel_knows(tune["source"], "xg_kind")
    h, xg = empty((x.shape[0], w.N), np.float32), empty((x.shape[0], w.N), np.uint16 if bf16 else np.float32)
    sq = _gemm(x, w, h, bias=bias, res=(residual, xg, norm_weight, float(offset)))
    return NormedRows(h, xg, sq, norm_weight, float(eps), float(offset)), h


def mx_dequant(w: PackedWeight, rows: Any = None, out_dtype: Any = np.float32) -> Any:
    """Rows `rows` (int64 device array, default all) of a 2-D PackedWeight as a dense [R, K] array of
    `out_dtype` (float32, bf16 bits as uint16 or float16): docs/quant.md's float32 values (NVFP4:
    fl32(fl32(elem * block scale) * tensor scale)) rounded to out_dtype, nearest even. All rows as bf16 bits
    where `dequant_bf16_ok` (the large-M path of `mx_linear`) come from decapybara/kernels/mx_gemv.cu `mx_dequant_bf16`,
    anything else from `mx_dequant_rows`: the same bits either way."""
    _check_packed(w)
    assert len(w.shape) == 2
    if rows is None and out_dtype is cp.uint16:  # the large-M path of mx_linear, once a product: its recipe
        d = _cache(w)
        key = ("dequant_bf16", cp.cuda.runtime.getDevice())
        launch = d.get(key)
        if launch is None:
            launch = d[key] = _dequant_launch(w) if dequant_bf16_ok(w) and w.N * w.K else ()
        if launch:
            out = empty((w.N, w.K), np.uint16)
            func, grid, args = launch
            func(grid, (DQ_THREADS,), (*args, out))
            return out
    if rows is not None:
        check(rows, np.int64, "rows", 1)
    r = w.N if rows is None else rows.shape[0]
    out = empty((r, w.K), out_dtype)
    if out.size:
        if rows is None and out.dtype == np.uint16 and dequant_bf16_ok(w):
            dequant_bf16(w, out)
        else:
            dequant_rows(w, rows, out)
    return out


DQ_THREADS, DQ_OCTETS = 256, 4  # decapybara/kernels/mx_gemv.cu DQ_THREADS, MX_DQ_OCTETS: 8-element octets
                                # a block, a thread


def dequant_bf16_ok(w: PackedWeight) -> bool:
    """Whether `mx_dequant_bf16` takes all of 2-D weight `w`'s rows: a block-scaled format (not bf16), K a
    multiple of its block (no padding codes; output rows of whole 16-byte octet stores), fewer than 2^31
    elements / 8 (its 32-bit octet index), codes 8-byte aligned (its 4 / 8 / 2-byte code loads)."""
    return (w.fmt != "bf16" and w.K % BLOCK[w.fmt] == 0 and w.N * (w.K // 8) < 2**31
            and dev_ptr(w.codes) % 8 == 0)


def dequant_bf16(w: PackedWeight, out: Any, defines: Any = MX_NO_GEMM, octets: int = DQ_OCTETS) -> None:
    """out uint16 [N, K] = all rows of `w` (`dequant_bf16_ok`) as bf16 bits by decapybara/kernels/mx_gemv.cu
    `mx_dequant_bf16`. `defines` / `octets`: another build of it (bench/small_kernels.py: MX_DQ_OCTETS)."""
    assert dequant_bf16_ok(w), f"{w.fmt} {w.shape}: not for mx_dequant_bf16"
    check(out, np.uint16, "out", 2)
    assert out.shape == (w.N, w.K), f"out {out.shape} for {w.shape}"
    if w.N * w.K:
        func, grid, args = _dequant_launch(w, defines, octets)
        func(grid, (DQ_THREADS,), (*args, out))


def _dequant_launch(w: PackedWeight, defines: Any = MX_NO_GEMM, octets: int = DQ_OCTETS) -> tuple[Any, tuple, tuple]:
    """(kernel, grid, the arguments before `out`) of `mx_dequant_bf16` over all of `w` (`dequant_bf16_ok`)."""
    octs = w.N * (w.K // 8)
    return (get_kernel("mx_gemv", "mx_dequant_bf16", defines), (-(-octs // (DQ_THREADS * octets)),),
            (w.codes, w.scales, F32(w.tensor_scale), I32(FMT_IDS[w.fmt]), I32(int(w.e2m1_split)),
             I32(int(w.tiled)), I32(w.N), I32(w.K), I64(w.codes.shape[-1]), I64(w.scales.shape[-1])))


def dequant_rows(w: PackedWeight, rows: Any, out: Any) -> None:
    """out [R, K] (float32 / bf16 bits / float16) = rows `rows` (int64 device, None: all) of `w` by
    decapybara/kernels/mx_gemv.cu `mx_dequant_rows`, one thread an element."""
    r = w.N if rows is None else rows.shape[0]
    check(out, out.dtype, "out", 2)
    assert out.shape == (r, w.K), f"out {out.shape} for {r} rows of {w.shape}"
    if out.size:
        get_kernel("mx_gemv", "mx_dequant_rows", MX_NO_GEMM)(
            (-(-out.size // 256),), (256,),
            (w.codes, w.scales if w.scales is not None else null(), F32(w.tensor_scale), I32(FMT_IDS[w.fmt]),
             I32(int(w.e2m1_split)), I32(int(w.tiled)), rows if rows is not None else null(), I32(r), I32(w.K),
             I64(w.codes.shape[-1] * w.codes.itemsize), I64(w.scales.shape[-1] if w.scales is not None else 0),
             out, I32(kind(out.dtype))))


def embedding_rows(table: Any, ids: Any) -> Any:
    """float32 [T, H] rows `ids` (int64 device) of a PackedWeight, bf16-bits or float32 table."""
    check(ids, np.int64, "ids", 1)
    if isinstance(table, PackedWeight):
        return mx_dequant(table, ids)
    if table.dtype == cp.uint16:
        from decapybara.backend.cupy_ops import embed_bf16

        return embed_bf16(table, ids)
    return table[ids]


def _to_f32(x: Any) -> Any:
    return mx_dequant(PackedWeight("bf16", x.shape, x)) if x.dtype == cp.uint16 else x.astype(cp.float32)


def _from_f32(y: Any, dtype: Any) -> Any:
    return to_bf16_bits(y) if np.dtype(dtype) == np.uint16 else y.astype(dtype)


class PackedWeightsMixin:
    """Backend mixin: kernel-ready QuantTensors stay packed and `linear` / `embedding` / `moe` send
    PackedWeights to the kernels above; anything else goes to the base backend. `class B(PackedWeightsMixin,
    CupyBackend)`. Activations stay float32 between ops, as CupyBackend keeps them, but for rows that only feed
    skinny products (bf16 bits: CupyBackend `_reads_bf16`).
    `dense_prefill` (the server's `prefill_weights=bf16`): the products' quantised weights (`keeps_prefill_copy`:
    not the embedding, the LM head or the MTP layers) also keep their bf16 values (`attach_dense`; their stacks,
    `concat_rows`, stack those), so that products of more than KEPT_ROWS rows run cuBLAS on them (`skinny_product`):
    2 bytes a weight of device memory for ~38% of a 256-token chunk's GPU work and ~34% of a 43-row mixed step's
    (docs/perf.md, twenty-ninth and thirtieth sessions)."""

    dense_prefill = False

    def prepare_weight(self, name: str, value: Any) -> Any:
        if hasattr(value, "to_parts") and value.fmt in FMT_IDS and len(value.shape) >= 2:
            w = pack_weight(value)
            w.persistent = True  # a model weight, uploaded at load
            if gemm_ready(w):
                if self.dense_prefill and keeps_prefill_copy(name):
                    attach_dense(w)
                return w
        return super().prepare_weight(name, value)  # type: ignore[misc]

    def linear(self, x: Any, weight: Any, bias: Any = None) -> Any:
        if isinstance(weight, PackedWeight):  # x float32, bf16 bits (CupyBackend.linear_add_rms_norm) or NormedRows
            return mx_linear(x if isinstance(x, NormedRows) else product_rows(x), weight, bias, out_dtype=cp.float32)
        return super().linear(x, weight, bias)  # type: ignore[misc]

    def row_slice(self, weight: Any, rows: int) -> Any:
        """A PackedWeight's first `rows` output rows (a multiple of 16: band tiles stay whole) over the same
        memory, in its layout; anything else as the base backend slices it."""
        if isinstance(weight, PackedWeight) and len(weight.shape) == 2:
            assert rows % 16 == 0 and 0 < rows <= weight.shape[0], (rows, weight.shape)
            return replace(weight, shape=(rows, weight.K), codes=weight.codes[:rows],
                           scales=None if weight.scales is None else weight.scales[:rows])
        return super().row_slice(weight, rows)  # type: ignore[misc]

    def embedding(self, table: Any, ids: Any) -> Any:
        if isinstance(table, PackedWeight):
            idx = ids if isinstance(ids, cp.ndarray) else cp.asarray(np.ascontiguousarray(ids, np.int64))
            return mx_dequant(table, idx)
        return super().embedding(table, ids)  # type: ignore[misc]

    def moe_captures(self, gate_w: Any, up_w: Any, down_w: Any) -> bool:
        if any(isinstance(w, PackedWeight) for w in (gate_w, up_w, down_w)):
            return True
        return super().moe_captures(gate_w, up_w, down_w)  # type: ignore[misc]

    def _device_moe(self, x: Any, router: Any, gate_w: Any, up_w: Any, down_w: Any, top_k: int, normalize: bool,
                    shared: Any = None, shared_gate: Any = None, fused: Any = None, *, norm: Any = None) -> Any:
        """Packed expert stacks: the device `moe` (`CupyBackend.moe` / `moe_add_rms_norm` call this)."""
        if any(isinstance(w, PackedWeight) for w in (gate_w, up_w, down_w)):
            return moe(x if isinstance(x, NormedRows) else product_rows(x), router, gate_w, up_w, down_w, top_k,
                       normalize, shared, shared_gate, fused, norm)
        return super()._device_moe(x, router, gate_w, up_w, down_w, top_k, normalize,  # type: ignore[misc]
                                   shared, shared_gate, fused, norm=norm)


# ---- activation quantiser ----------------------------------------------------------------------------
def act_quant_mxfp8(x: Any, soft: bool = False) -> tuple[Any, Any]:
    """x [R, K] -> (E4M3 codes uint8 [R, Kp], E8M0 scales uint8 [R, Kp / 32]), bytes as `quantize(x, 'mxfp8')`.
    `soft`: the kernel's software E4M3 rounding (what devices before sm_89 run) on any device."""
    check(x, x.dtype, "x", 2)
    r, k = x.shape
    kp = -(-k // 32) * 32
    codes, scales = empty((r, kp), cp.uint8), empty((r, kp // 32), cp.uint8)
    if r and k:
        warps = r * (kp // 32)
        quantise = get_kernel("act_quant", "act_quant_mxfp8", (("AQ_SOFT", 1),) if soft else ())
        quantise((-(-warps * 32 // 256),), (256,),
                 (x, I32(kind(x.dtype)), I64(k), I32(r), I32(k), I32(kp), codes, scales))
    return codes, scales


# ---- mixture of experts --------------------------------------------------------------------------------
ROUTE_DISPATCH_ROWS = 32  # steps of up to this many rows route and dispatch in one launch (one block's warps)
MOE_EXPERTS, MOE_TOP_K = 1024, 32  # the routing kernels' limits (decapybara/kernels/moe.cu): a lane's logits,
                                   # a warp's picks


@dataclass(slots=True)
class FusedMoE:
    """One MoE layer's weights stacked for `moe` at load (`CupyBackend.fuse_moe`): `router_gate` the router and the
    shared expert's gate [E + 1, H] (bf16 bits or a PackedWeight; None without a shared expert or where they do not
    stack); `gate_up` the experts' gate and up stacks [E', 2 I, H] (each expert's gate rows, then its up rows) and
    `down` their down stack [E', H, I] (PackedWeights; None where not stacked), with E' = E + 1 where the shared
    expert is their expert E (`shared_slot`: its MLP of the routed experts' width and format), else E."""

    router_gate: Any = None
    gate_up: PackedWeight | None = None
    down: PackedWeight | None = None
    shared_slot: bool = False


def moe(x: Any, router: Any, gate_w: Any, up_w: Any, down_w: Any, top_k: int, normalize: bool,
        shared: Any = None, shared_gate: Any = None, fused: FusedMoE | None = None,
        norm: tuple[Any, Any, float, float] | None = None) -> Any:
    """`Backend.moe` on the device with no host synchronisation: router softmax + top-k and dispatch grouped by
    expert (one launch up to ROUTE_DISPATCH_ROWS rows, `moe_route_dispatch`; two past that), SwiGLU experts as
    grouped skinny GEMMs over the experts hit (G = min(E', T k') groups, `moe_dispatch`; E' = E + 1 and k' = k + 1
    with the shared expert in the stacks, below), weighted combine. x [T, H] -> [T, H] (x's dtype; float32 for
    bf16 bits and NormedRows). The router may be float32 (exact cuBLAS float32 logits) or bf16 / PackedWeight;
    experts PackedWeights [E, I, H] / [E, H, I] or float32 / bf16 arrays (packed to bf16 on each call).
    A shared expert: `shared` (its output [T, H] float32, or a function of no arguments that computes it) and
    `shared_gate` [1, H] (its gate's weight): the result is the routed sum + sigmoid(x @ shared_gate^T) * shared,
    added in the combine.
    `fused` (`FusedMoE`, stacked by the model at load; gate_w, up_w, down_w are row ranges of its stacks):
    - `router_gate`: one product (logits [T, E + 1]) for the router and the shared gate, the same sums as each
      product's alone (an output row's dot product does not depend on the rows beside it) but for the launch
      plan's K split, which follows N (float32 summation order); a float32 stack is not used (the router's exact
      cuBLAS float32 logits);
    - `gate_up`: up to SWIGLU_ROWS rows, one grouped launch of the SwiGLU kernels computes both products and
      silu(gate) * up (`fuses_grouped_swiglu`);
    - `shared_slot` (with router_gate and gate_up, up to SWIGLU_ROWS rows): the shared expert runs as the
      stacks' expert E, a slot k + 1 of every token weighing sigmoid(its gate's logit), in the grouped launches
      (no launches of its own; `shared` is not called).
    `norm` = (residual [T, H] float32, weight [H] float32, eps, offset): the result's residual add and RMSNorm
    (`Backend.add_rms_norm`'s) in the combine's launch (`moe_combine_norm`); returns (normed rows, residual +
    result), float32.
    x may be bf16 bits (the bf16 backend's rows, whose products round x to bf16 anyway) or `NormedRows` (the
    output projection before the block left its norm to the products, `mx_linear_add_norm`): where
    `moe_fuses_norm`, the router's product and the experts' grouped SwiGLU launch divide by the rows'
    denominators (the routing kernel copies each gathered row's sums of squares by y row), so no norm kernel runs
    before the block; otherwise x is materialised first."""
    normed = x if isinstance(x, NormedRows) else None
    xc = normed.xg if normed is not None else x
    check(xc, xc.dtype, "x", 2)
    t, h = x.shape
    gate_w, up_w, down_w = (w if isinstance(w, PackedWeight) else pack_weight(w) for w in (gate_w, up_w, down_w))
    for w in (gate_w, up_w, down_w):
        _check_packed(w)
        assert gemm_ready(w) and len(w.shape) == 3, f"experts {w.fmt} {w.shape}: need a kernel-ready [E, N, K]"
    e, inter = gate_w.shape[0], gate_w.shape[1]
    assert up_w.shape == gate_w.shape == (e, inter, h) and down_w.shape == (e, h, inter)
    assert 0 < top_k <= min(e, MOE_TOP_K) and e <= MOE_EXPERTS
    assert (shared is None) == (shared_gate is None), "a shared expert needs its output and its gate"
    fused = fused if fused is not None else FusedMoE()
    stacked = _streamed_stack(fused.router_gate) if shared_gate is not None else None
    gate_up = fused.gate_up if fused.gate_up is not None and fuses_grouped_swiglu(fused.gate_up, t) else None
    # the shared expert in the stacks: one slot more (the routing kernels' warp picks MOE_TOP_K slots at most)
    slot = (fused.shared_slot and stacked is not None and gate_up is not None and fused.down is not None
            and top_k < MOE_TOP_K and e < MOE_EXPERTS and gemm_ready(fused.down))
    ne, kk = e + slot, top_k + slot  # experts and slots a token of the launches below
    # the router's product: the stack with the shared gate, or the router alone where no shared gate needs one
    router_product = stacked if stacked is not None else _streamed_stack(router) if shared_gate is None else None
    if normed is not None and not moe_fuses_norm(t, router_product, gate_up):
        x, normed = normed.materialize(), None
    xa = normed.xg if normed is not None else x  # what the products stage
    if stacked is not None:
        assert stacked.shape == (e + 1, h), f"router|gate {stacked.shape}: need [{e + 1}, {h}]"
        logits = mx_linear(x, stacked, out_dtype=cp.float32)  # [T, E + 1]: the router's, then the shared gate's
        gate_logit = logits[:, e:]
    else:
        logits = _logits(x, router)
        gate_logit = _logits(x, shared_gate) if shared_gate is not None else None
    logits = logits if logits.dtype == cp.float32 and logits.strides[1] == 4 else cp.ascontiguousarray(logits, cp.float32)
    assert logits.shape[0] == t and logits.shape[1] in (e, e + 1)
    ids, wts = empty((t, kk), cp.int32), empty((t, kk), cp.float32)
    out = empty((t, h), x.dtype if norm is None and normed is None and xa.dtype != cp.uint16 else cp.float32)
    if norm is not None:
        residual, norm_w, eps, offset = norm
        check(residual, np.float32, "residual", 2)
        check(norm_w, np.float32, "norm weight", 1)
        assert residual.shape == (t, h) and norm_w.shape == (h,), f"residual {residual.shape}, weight {norm_w.shape}"
        res_out = empty((t, h), cp.float32)
    if t == 0:
        return out if norm is None else (out, res_out)
    p = t * kk
    ng = min(ne, p)  # the launches' groups: at most every expert, at most one a (token, slot)
    counts, offsets, gids = empty(ng, cp.int32), empty(ng, cp.int32), empty(ng, cp.int32)
    gather, slot_pos = empty(p, cp.int32), empty(p, cp.int32)
    ldl = I64(logits.strides[0] // 4)
    jpl = (("MOE_JPL", next(j for j in (8, 16, 32) if 32 * j >= e)),)  # router logits a lane holds
    route = (logits, ldl, I32(t), I32(e), I32(top_k), I32(int(normalize)), I32(int(slot)), ids, wts)
    # NormedRows of the gathered rows: their sums of squares by y row
    g_norm = replace(normed, sq=empty((p, normed.sq.shape[1]), cp.float32)) if normed is not None else None
    if t <= ROUTE_DISPATCH_ROWS:
        nsq_args = ((normed.sq, I32(normed.sq.shape[1]), g_norm.sq) if g_norm is not None
                    else (null(), I32(0), null()))
        pdl.launch(get_kernel("moe", "moe_route_dispatch", jpl), (1,), (512,),
                   (*route, I32(ng), counts, offsets, gids, gather, slot_pos, *nsq_args), shared_mem=8 * ne + 4 * p)
    else:
        assert g_norm is None, "fused norms: at most ROUTE_DISPATCH_ROWS rows"
        pdl.launch(get_kernel("moe", "moe_route", jpl), (-(-t * 32 // 256),), (256,), route)
        pdl.launch(get_kernel("moe", "moe_dispatch"), (1,), (1024,),
                   (ids, I32(p), I32(ne), I32(ng), counts, offsets, gids, gather, slot_pos, I32(kk)), shared_mem=8 * ne)
    grouped = (offsets, counts, gids)
    hid = empty((p, inter), cp.uint16)
    if gate_up is not None:
        assert gate_up.shape[1:] == (2 * inter, h) and gate_up.shape[0] >= ne, \
            f"gate|up {gate_up.shape}: need [{ne}, {2 * inter}, {h}]"
        _gemm(xa, gate_up, hid, gather=gather, groups=grouped, max_rows=t, swiglu=True, norm=g_norm)
    else:
        g, u = empty((p, inter), cp.float32), empty((p, inter), cp.float32)
        _gemm(x, gate_w, g, gather=gather, groups=grouped, max_rows=t)
        _gemm(x, up_w, u, gather=gather, groups=grouped, max_rows=t)
        pdl.launch(get_kernel("moe", "moe_silu_mul"), (-(-g.size // 256),), (256,),
                   (g, u, I32(0), hid, I32(1), I64(g.size)))
    d = empty((p, h), cp.float32)
    if slot:
        assert fused.down.shape == (ne, h, inter), f"down {fused.down.shape}: need [{ne}, {h}, {inter}]"
    _gemm(hid, fused.down if slot else down_w, d, groups=grouped, max_rows=t)
    if shared is not None and not slot:
        shared = shared() if callable(shared) else shared
        check(shared, np.float32, "shared", 2)
        assert shared.shape == (t, h) and gate_logit.dtype == cp.float32 and gate_logit.shape == (t, 1)
        sh_args = (shared, gate_logit, I64(gate_logit.strides[0] // 4))
    else:
        sh_args = (null(), null(), I64(0))
    if norm is not None:
        assert kk <= 33, f"{kk} slots: moe_combine_norm holds 33 (MC_SLOTS)"
        cols = (("MC_J", next(j for j in (1, 2, 4, 8, 16) if 512 * j >= h or j == 16)),)  # a thread's columns
        pdl.launch(get_kernel("moe", "moe_combine_norm", cols), (t,), (512,),
                   (d, I32(0), wts, slot_pos, I32(kk), I32(h), *sh_args, I32(int(slot)), residual, norm_w, F32(eps),
                    F32(offset), out, I32(0), res_out))
        return out, res_out
    pdl.launch(get_kernel("moe", "moe_combine"), (-(-h // 256), t), (256,),
               (d, I32(0), wts, slot_pos, I32(kk), I32(h), out, I32(kind(out.dtype)), *sh_args, I32(int(slot))))
    return out


def moe_fuses_norm(rows: int, router: PackedWeight | None, gate_up: PackedWeight | None) -> bool:
    """Whether `moe` takes `NormedRows` of `rows` rows as they are: at most FUSED_ROWS rows, a router product
    (its stack with the shared gate, or the router alone) that fuses norms (`mx_linear` then runs it on the skinny
    kernels or gemv_small), and the experts' gate and up in one grouped SwiGLU launch (`fuses_grouped_swiglu`) of
    a kernel file whose grouped consumers read the sums by y row (MX_GROUPED_NORM; an older file's read them by
    the launch's row)."""
    if router is None or gate_up is None or not 0 < rows <= min(FUSED_ROWS, ROUTE_DISPATCH_ROWS):
        return False
    return fuses_norms(router, rows) and kernel_knows(tune_for(gate_up.fmt)["source"], "MX_GROUPED_NORM")


def _logits(x: Any, w: Any) -> Any:
    """x @ w^T as float32: packed or bf16 w through the skinny kernels, float32 w through cuBLAS."""
    if isinstance(w, PackedWeight) or w.dtype == cp.uint16:
        return mx_linear(x, w if isinstance(w, PackedWeight) else pack_weight(w), out_dtype=cp.float32)
    return cp.matmul(x if x.dtype == cp.float32 else _to_f32(x), w.T)


def _streamed_stack(w: Any) -> PackedWeight | None:
    """A stacked router|gate as the skinny kernels' PackedWeight (bf16 bits wrapped: a model weight), else None."""
    if isinstance(w, PackedWeight):
        return w
    if isinstance(w, cp.ndarray) and w.dtype == cp.uint16 and w.ndim == 2:
        return PackedWeight("bf16", w.shape, w, persistent=True)
    return None


# ---- integrity scan and bandwidth probe -----------------------------------------------------------------
def checksum(buf: Any, chunk_bytes: int = 1 << 16) -> Any:
    """Per-chunk Fletcher-64 checksums (uint64 [ceil(nbytes / chunk_bytes)]) of a contiguous device array."""
    assert isinstance(buf, cp.ndarray) and buf.flags.c_contiguous, "checksum needs a contiguous device array"
    assert chunk_bytes % 4 == 0 and 4 <= chunk_bytes <= 1 << 18, f"chunk_bytes {chunk_bytes}"
    n = max(1, -(-buf.nbytes // chunk_bytes))
    out = empty(n, cp.uint64)
    raw = buf.view(cp.uint8).reshape(-1) if buf.nbytes else cp.zeros(1, cp.uint8)
    get_kernel("checksum", "checksum_fletcher64")((n,), (256,), (raw, U64(buf.nbytes), I32(chunk_bytes // 4), out))
    return out


def locate_corruption(buf: Any, reference: Any, chunk_bytes: int = 1 << 16) -> np.ndarray:
    """Indices of the chunks whose checksum differs from `reference` (an earlier `checksum` of `buf`)."""
    return np.flatnonzero(cp.asnumpy(checksum(buf, chunk_bytes) != reference))


def bandwidth_probe(nbytes: int = 1 << 31, repeats: int = 10) -> dict[str, float]:
    """Median GB/s of 128-bit streaming read, write and copy (copy counts bytes read + written) over
    `nbytes` buffers, plus CuPy's own device-to-device copy, timed with CUDA events after a warm-up."""
    n16 = nbytes // 16
    src, dst = cp.empty(n16 * 16, cp.uint8), cp.empty(n16 * 16, cp.uint8)
    src.view(cp.uint32)[:] = cp.arange(n16 * 4, dtype=cp.uint32)
    sink = cp.zeros(1, cp.uint32)
    blocks = sm_count() * 8
    runs = {
        "read": (get_kernel("probe", "probe_read"), (src, U64(n16), sink), n16 * 16),
        "write": (get_kernel("probe", "probe_write"), (dst, U64(n16), np.uint32(0x12345678)), n16 * 16),
        "copy": (get_kernel("probe", "probe_copy"), (src, dst, U64(n16)), 2 * n16 * 16),
    }
    res: dict[str, float] = {}
    for name, (fn, args, moved) in [*runs.items(), ("cupy_copy", (None, None, 2 * n16 * 16))]:
        times = []
        for i in range(repeats + 1):
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record()
            if fn is None:
                dst[...] = src
            else:
                fn((blocks,), (256,), args)
            b.record()
            b.synchronize()
            if i:  # the first run is the warm-up
                times.append(cp.cuda.get_elapsed_time(a, b) * 1e-3)
        res[f"{name}_GBps"] = moved / float(np.median(times)) / 1e9
    return res


# ---- sampler ------------------------------------------------------------------------------------------
SAMPLE_TILE, NTOP = 2048, 20
SAMPLE_MAX_VOCAB = 128 * SAMPLE_TILE  # the widest row `cuda_sample` takes (a block's tiles of one row)
SAMPLE_SCAN_SPAN = 8 * SAMPLE_TILE // 2  # tokens a sample_scan_parts block (sample.cu SCAN_SPAN)


def philox_uniforms(seeds: Any, positions: Any, stream: int = 0) -> np.ndarray:
    """`decapybara.engine.philox.uniforms` computed on the device (float64 [N], bit-identical)."""
    from decapybara.engine.philox import _as_u64

    s, p = np.broadcast_arrays(_as_u64(seeds), _as_u64(positions))
    s_d, p_d = cp.asarray(np.ascontiguousarray(s)), cp.asarray(np.ascontiguousarray(p))
    out = empty(s.size, cp.float64)
    if s.size:
        get_kernel("sample", "philox_uniforms")((-(-s.size // 256),), (256,),
                                                (s_d, p_d, np.uint32(stream), out, I32(s.size)))
    return cp.asnumpy(out).reshape(s.shape)


def guesses_take(logits: Any) -> bool:
    """Whether `guesses` takes these logits: float32 [R, V], rows of unit stride."""
    return logits.dtype == cp.float32 and logits.ndim == 2 and logits.strides[1] == 4


def guesses(logits: Any) -> tuple[Any, Any]:
    """(the lowest id of each row's maximum [R] int64, its softmax probability [R] float32) of float32 logits
    [R, V] (rows of unit stride), in two launches: a block per (row, SAMPLE_TILE tokens), then a warp per row.
    The probability is 1 / sum(exp(x - max)) in float32, summed by chunks; NaN logits read as -inf."""
    if not guesses_take(logits):
        raise ValueError(f"logits must be float32 [R, V] rows of unit stride, got {logits.dtype} {logits.shape}")
    r, v = logits.shape
    nchunk = max(1, -(-v // SAMPLE_TILE))
    pmax, pidx, psum = empty((r, nchunk), cp.float32), empty((r, nchunk), cp.int32), empty((r, nchunk), cp.float32)
    guess, prob = empty(r, cp.int64), empty(r, cp.float32)
    if r:
        k = functools.partial(get_kernel, "sample")
        k("guess_partial")((nchunk, r), (256,), (logits, I64(logits.strides[0] // 4), I32(v), I32(SAMPLE_TILE), pmax,
                                                pidx, psum))
        k("guess_finish")((-(-r // 8),), (256,), (pmax, pidx, psum, I32(nchunk), I32(r), guess, prob))
    return guess, prob


def _views(buf: Any, layout: Any) -> dict[str, Any]:
    """Named views of a uint8 buffer (device or host) holding arrays back to back: `layout` lists (name, dtype,
    shape) in buffer order (8-byte types first keeps every view aligned)."""
    out, o = {}, 0
    for name, dtype, shape in layout:
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        out[name] = buf[o:o + n].view(dtype).reshape(shape)
        o += n
    return out


# cuda_sample's per-call inputs and results, one buffer so that they go over in one copy and come back in one:
# (name, dtype), 8-byte types first. rowmax goes over as 0 (sample_prep's atomicMax), the results as 0 (`finite`).
SAMPLE_IO = (("temp", np.float64), ("top_p", np.float64), ("min_p", np.float64), ("rep", np.float64),
             ("pres", np.float64), ("freq", np.float64), ("seed", np.uint64), ("pos", np.uint64),
             ("rowmax", np.uint64), ("token", np.int64), ("logprob", np.float32), ("status", np.int32),
             ("finite", np.int32), ("argmin", np.int32), ("greedy", np.int32), ("want", np.int32),
             ("top_k", np.int32), ("keep", np.int32))
SAMPLE_RESULTS = ("token", "logprob", "status", "finite", "argmin")  # a contiguous run of SAMPLE_IO


class _SampleWork:
    """One (thread, device, rows, vocabulary)'s sampler buffers, kept between calls: the device scratch (y and
    the tiles' partial results) and the per-call inputs / results as one host array and its device twin, with
    their views made once. A call returns only after its results are on the host, so its scratch is free again
    by then; a thread's calls never overlap. (A call that fails between its copy over and its results may leave
    that copy queued: the next call of the thread, on the same stream, copies the whole buffer again after it.)"""

    def __init__(self, b: int, v: int):
        nblk = -(-v // SAMPLE_TILE)
        lc = SAMPLE_TILE // nblk
        scratch = [("y", np.float64, (b, v)), ("bz", np.float64, (b, nblk)), ("bzm", np.float64, (b, nblk)),
                   ("cz", np.float64, (b, nblk, lc)), ("tz", np.float64, (b, nblk)), ("info", np.float64, (b, 4)),
                   ("bnm", np.int32, (b, nblk)), ("cid", np.int32, (b, nblk, lc)), ("tzid", np.int32, (b, nblk)),
                   ("skipped", np.int32, (b, nblk)), ("nm", np.int32, (b,)), ("top_id", np.int32, (b, NTOP)),
                   ("top_lp", np.float32, (b, NTOP))]
        size = sum(int(np.prod(sh)) * np.dtype(dt).itemsize for _, dt, sh in scratch)
        self.dev = _views(cp.empty(size, cp.uint8), scratch)
        self.nbytes = size
        io = [(name, dt, (b,)) for name, dt in SAMPLE_IO]
        sizes = np.array([b * np.dtype(dt).itemsize for _, dt in SAMPLE_IO])
        ends = np.cumsum(sizes)  # each array's end in the buffer
        self.host_buf = cupyx.empty_pinned(int(ends[-1]), np.uint8)  # pinned: the copy over is asynchronous
        self.host_buf[:] = 0
        self.dev_buf = cp.zeros(int(ends[-1]), cp.uint8)
        self.host, self.io = _views(self.host_buf, io), _views(self.dev_buf, io)
        names = [name for name, _ in SAMPLE_IO]
        first, last = names.index(SAMPLE_RESULTS[0]), names.index(SAMPLE_RESULTS[-1])
        self.results_dev = self.dev_buf[int(ends[first] - sizes[first]):int(ends[last])]
        self.results_layout = io[first:last + 1]
        self.nblk, self.lc = nblk, lc

    def send(self) -> None:
        """The host inputs over to the device, one copy on the current stream, with rowmax and the results as 0
        (never written on the host); the host array is written again by the thread's next call, after this
        one's results came back (or, where this one failed, ahead of its copy on the same stream)."""
        self.dev_buf.set(self.host_buf, stream=cp.cuda.get_current_stream())
        if cupy_ops.POISON:  # tests: what a kernel fails to write shows up, not what the call before wrote
            for a in self.dev.values():
                a.fill(np.nan if a.dtype.kind == "f" else np.iinfo(a.dtype).max)

    def results(self) -> dict[str, np.ndarray]:
        """The results back on the host (one copy; waits for the call's kernels), with the rows' finite check."""
        host = _views(cp.asnumpy(self.results_dev), self.results_layout)
        if not host["finite"].all():
            raise ValueError("every row of logits needs at least one finite value")
        return host


_SAMPLE_WORK: dict[tuple[int, int, int, int], _SampleWork] = {}
_SAMPLE_WORK_LOCK = threading.Lock()
SAMPLE_WORK_BYTES = 256 << 20  # device bytes the kept buffers may hold together (the most recent shape always kept)


def _sample_work(b: int, v: int) -> _SampleWork:
    """The calling thread's buffers for b rows of v logits on the current device: kept for the shapes asked most
    recently, at most SAMPLE_WORK_BYTES of device memory among them (an engine's rows vary from step to step)."""
    key = (threading.get_ident(), cp.cuda.runtime.getDevice(), b, v)
    with _SAMPLE_WORK_LOCK:
        work = _SAMPLE_WORK.pop(key, None)
    work = work or _SampleWork(b, v)
    with _SAMPLE_WORK_LOCK:
        _SAMPLE_WORK[key] = work  # most recent last
        while len(_SAMPLE_WORK) > 1 and sum(w.nbytes for w in _SAMPLE_WORK.values()) > SAMPLE_WORK_BYTES:
            del _SAMPLE_WORK[next(iter(_SAMPLE_WORK))]
    return work


def cuda_sample(logits: Any, rows: Any, *, eos_token_ids: Any = ()) -> Any:
    """`decapybara.engine.sampling.sample` on the device: logits [B, V] (device float32 / bf16 bits /
    float16, or host) -> SampleOutput with the same tokens for the same seeds (decapybara/kernels/sample.cu has the
    rounding caveat). The rows' parameters go over in one copy and the results come back in one (a second
    only for rows whose draw lies past the certified prefix, which take a full stable sort, and for logprob
    alternatives). A batch of greedy rows with no edits and no logprobs stops at the row maxima."""
    from decapybara.engine.sampling import GREEDY_TEMPERATURE, MASK64, SampleOutput

    if not isinstance(logits, cp.ndarray):
        logits = cp.asarray(np.ascontiguousarray(logits, np.float32))
    check(logits, logits.dtype, "logits", 2)
    b, v = logits.shape
    if b != len(rows):
        raise ValueError(f"logits must be [len(rows)={len(rows)}, V], got {logits.shape}")
    if v > SAMPLE_MAX_VOCAB:
        raise ValueError(f"vocabulary {v} above the sampler's {SAMPLE_MAX_VOCAB}")
    if b == 0:
        return SampleOutput(np.zeros(0, np.int64), np.zeros(0, np.float32), [])
    ps = [r.params for r in rows]
    work = _sample_work(b, v)
    h, io, d = work.host, work.io, work.dev
    temp = h["temp"]
    temp[:] = [p.temperature for p in ps]
    want = h["want"]
    want[:] = [p.logprobs or 0 for p in ps]
    greedy = h["greedy"]
    greedy[:] = temp < GREEDY_TEMPERATURE
    edits = any(needs_edits(r) for r in rows)
    short = bool(greedy.all()) and not edits and not any(p.logprobs is not None for p in ps)
    k = functools.partial(get_kernel, "sample")
    y, rowmax, argmin, finite = d["y"], io["rowmax"], io["argmin"], io["finite"]
    grid = ((-(-v // 256), b), (256,))
    if short:
        work.send()
        k("sample_prep")(*grid, (logits, I32(kind(logits.dtype)), I64(logits.shape[1]), I32(v), y, rowmax, argmin,
                                 finite, I32(1)))
        k("sample_greedy_pick")(*grid, (y, I32(v), rowmax, argmin))
        return SampleOutput(work.results()["argmin"].astype(np.int64), np.full(b, np.nan, np.float32),
                            [[] for _ in rows])
    top_k = h["top_k"]
    top_k[:] = [p.top_k for p in ps]
    # tokens a row keeps at most (top-k, its logprob alternatives; 0: all of them): tiles that cannot hold any
    # of them skip their sort (sample_stats)
    h["keep"][:] = np.where(greedy > 0, want, np.where(top_k > 0, np.maximum(top_k, want), 0))
    h["top_p"][:] = [p.top_p for p in ps]
    h["min_p"][:] = [p.min_p for p in ps]
    h["rep"][:] = [max(p.repetition_penalty, r.extra_repetition_penalty) for p, r in zip(ps, rows)]
    h["pres"][:] = [p.presence_penalty for p in ps]
    h["freq"][:] = [p.frequency_penalty for p in ps]
    h["seed"][:] = [r.seed & MASK64 for r in rows]
    h["pos"][:] = [r.position for r in rows]
    n_e = 0
    if edits:
        lists = edit_lists(rows, np.asarray(eos_token_ids, np.int64))
        n_e = int(lists[1].shape[0])
        if n_e and int(lists[2].max()) >= v:  # checked on the host, before anything is launched
            raise ValueError("a token id of logit_bias / penalties / masks is outside the vocabulary")
    work.send()
    k("sample_prep")(*grid, (logits, I32(kind(logits.dtype)), I64(logits.shape[1]), I32(v), y, rowmax, argmin,
                             finite, I32(0 if n_e else 1)))
    if n_e:
        e_ptr, e_row, e_tok, e_bias, e_flags, e_count = _one_copy_list(lists)
        scratch = empty(n_e, cp.float64)
        k("sample_edits")((-(-n_e // 256),), (256,), (e_row, e_tok, e_bias, e_flags, e_count, I32(n_e), io["rep"],
                                                     io["pres"], io["freq"], y, I32(v), scratch))
        k("sample_rowmax")(*grid, (y, I32(v), rowmax))
        k("sample_restore")((-(-b // 32),), (32,), (e_ptr, e_tok, e_flags, scratch, y, I32(v), rowmax, I32(b)))
    nblk, lc = work.nblk, work.lc
    bz, bzm, bnm, cz, cid = d["bz"], d["bzm"], d["bnm"], d["cz"], d["cid"]
    tz, tzid, skipped = d["tz"], d["tzid"], d["skipped"]
    if h["keep"].any():
        k("sample_tilemax")((nblk, b), (SAMPLE_TILE // 2,), (y, I32(v), io["temp"], io["greedy"], tz, tzid))
    k("sample_stats")((nblk, b), (SAMPLE_TILE // 2,), (y, I32(v), io["temp"], io["greedy"], io["want"],
                                                     io["min_p"], rowmax, I32(lc), io["keep"], tz, tzid, bz, bzm,
                                                     bnm, argmin, cz, cid, skipped))
    info, nm, top_id, top_lp = d["info"], d["nm"], d["top_id"], d["top_lp"]
    token, logprob, status = io["token"], io["logprob"], io["status"]
    k("sample_final")((b,), (SAMPLE_TILE // 2,),
                      (I32(v), I32(nblk), I32(lc), io["temp"], io["greedy"], io["want"], io["top_k"],
                       io["top_p"], io["min_p"], io["seed"], io["pos"], rowmax, bz, bzm, bnm, argmin, cz, cid,
                       io["keep"], skipped, token, logprob, status, info, nm, top_id, top_lp))
    host = work.results()
    redo = np.flatnonzero(host["status"])
    if redo.size:  # the decision lies past the certified prefix: a full canonical order per such row
        t_eff = cp.asarray(np.where(greedy[redo] > 0, 1.0, temp[redo]))[:, None]
        order = canonical_orders(y[cp.asarray(redo)] / t_eff + 0.0)
        wbuf, pbuf = empty((redo.size, v), cp.float64), empty((redo.size, v), cp.float64)
        redo_d = cp.asarray(redo.astype(np.int32))
        k("sample_scan_parts")((-(-v // SAMPLE_SCAN_SPAN), redo.size), (SAMPLE_TILE // 2,),
                               (redo_d, order, I32(v), y, io["temp"], io["greedy"], info, wbuf, pbuf))
        k("sample_scan_pick")((redo.size,), (32,),
                              (redo_d, order, I32(v), y, io["temp"], io["greedy"], io["top_k"], io["top_p"],
                               io["min_p"], info, nm, wbuf, pbuf, token, logprob, status, top_id, top_lp))
        host = work.results()
    tokens, lps = host["token"], host["logprob"]
    out_lp = np.where([p.logprobs is not None for p in ps], lps, np.nan).astype(np.float32)
    top: list[list[tuple[int, float]]] = [[] for _ in rows]
    if want.any():
        tids, tlps = cp.asnumpy(top_id), cp.asnumpy(top_lp)
        top = [[(int(tids[i, j]), float(tlps[i, j])) for j in range(min(p.logprobs or 0, v))
                if tids[i, j] >= 0 and np.isfinite(tlps[i, j])] for i, p in enumerate(ps)]
    return SampleOutput(tokens.astype(np.int64), out_lp, top)


def canonical_orders(z: Any) -> Any:
    """Each row's canonical order of z [R, V] float64, int32 [R, V]: token ids by z descending, ties (zeros of
    either sign too) by ascending id (`sampling.canonical_order`'s, as a stable argsort of -z along the rows).
    Several rows take two 1-D stable sorts, every row's values at once and then the rows by row index (each row's
    tokens keep their order), where an argsort along the rows sorts (row, value) pairs by comparison: 12 rows of
    248,320 in 0.76 ms against 1.15 on an H100, level at 1 and 4 rows (docs/perf.md, fifty-sixth session)."""
    r, v = z.shape
    neg = -z + 0.0  # -0.0 -> +0.0: zeros tie, as they compare
    if r == 1:
        return cp.argsort(neg[0]).astype(cp.int32).reshape(1, v)
    flat = cp.argsort(neg.ravel())  # stable: equal values by ascending flat index, i.e. by row, then by id
    row = (flat // v).astype(cp.uint8 if r <= 256 else cp.int32)
    return (flat[cp.argsort(row)] % v).astype(cp.int32).reshape(r, v)


def _one_copy_list(arrays: Any) -> list[Any]:
    """Host arrays -> device arrays of the same dtypes and shapes, from one buffer: one host-to-device copy."""
    arrays = [np.ascontiguousarray(a) for a in arrays]
    order = sorted(range(len(arrays)), key=lambda i: -arrays[i].dtype.itemsize)  # 8-byte types first: aligned
    host = np.concatenate([arrays[i].view(np.uint8).ravel() for i in order])
    views = _views(cp.asarray(host), [(i, arrays[i].dtype, arrays[i].shape) for i in order])
    return [views[i] for i in range(len(arrays))]
