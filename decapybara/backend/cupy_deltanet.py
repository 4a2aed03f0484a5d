"""Gated DeltaNet core on the device (decapybara/kernels/deltanet_prefill.cu): run planning and launches.

`plan_runs(segments)` groups consecutive `DeltaNetSegment`s of one sequence (same slot, contiguous rows) into
runs, once per forward; `deltanet_core(...)` runs conv1d + SiLU, q / k normalisation and gates, and the gated
delta rule for every run in parallel (one fused launch when every run is one decode row), updating the state
pool in place and copying snapshots to pinned host memory asynchronously, layer by layer (`QwenModel.forward`
synchronises once at its end). Runs of a few rows (a verification step's token and draft) take the decode
launch's multi-row build (MULTI_DECODE).
With `gate` it returns the gated RMS norm of the core output (on the decode path from the launch that also
updates the conv state: `gdn_decode_finish`, no norm launch).
`acc` is the recurrence's arithmetic: "double" reproduces the numpy reference (float64 inside chunks,
float32 state at its store points), "float" is the fast variant.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

import cupy as cp
import cupyx
import numpy as np

from decapybara.backend import cupy_ops, pdl
from decapybara.backend.base import DeltaNetParams, DeltaNetSegment
from decapybara.backend.cupy_kv import CupyStatePool
from decapybara.backend.cupy_ops import F32, I32, I64, THREADS, empty, f32, f32_any, grid_for
from decapybara.backend.deltanet_plan import CHUNK, RunGroups, chunk_table, group_runs, split_runs
from decapybara.kernels import KERNEL_DIR, get_kernel
from decapybara.model.config import ModelConfig

CONV_TOKENS = 16  # tokens per thread of conv1d_silu_runs (decapybara/kernels/deltanet_prefill.cu)
# decode forwards (every run one row) take gdn_decode: the same arithmetic as the four kernels it replaces;
# "source" / "defines": the kernel file and extra compile-time defines of the decode's two launches, "vcols" the
# value columns of a gdn_decode CTA (its DEC_VCOLS; benchmarks compare variants: bench/gdn_decode.py,
# bench/overlap.py; None: `decode_vcols`); "runs" the runs a CTA takes one after another (None:
# `decode_runs_per_cta`); "smem_runs" the runs from which the delta step reads its state from shared memory
# (`decode_smem_state`; 0: never, the default)
FUSED_DECODE: dict[str, Any] = {"enabled": True, "source": "deltanet_prefill", "defines": {}, "vcols": None,
                                "runs": None, "smem_runs": 0}
DECODE_MAX_RUNS = 32  # gdn_decode's DEC_MAXRUNS: runs a CTA takes at most
# forwards whose runs have at most "max_rows" rows (speculative verification: a token and its draft), no more
# than `DECODE_MAX_RUNS` runs a CTA, take gdn_decode's DEC_MULTI build too: each run's rows one after another on
# the state held in registers, one read and one write of it a run (a snapshot's on top), and the same bits as the
# general path's three launches (conv1d_silu_gates, gdn_recurrent, gdn_finish), whose gdn_recurrent reads and
# writes the state in registers too but stages its inputs through two more launches; "vcols" / "runs" as
# FUSED_DECODE's (None: `decode_vcols` over the forward's rows, `decode_runs_per_cta` over its runs). 0 "max_rows":
# off. Measured (H100, 27B shape, us a layer; docs/perf.md, fifty-sixth session): 2 rows a run, 1 / 4 / 12 runs
# 11.9 / 24.7 / 63.0 against the three launches' 14.2 / 33.0 / 106.5.
MULTI_DECODE: dict[str, Any] = {"max_rows": int(os.environ.get("DECAPYBARA_DELTANET_MULTI_ROWS", "8")),
                                "vcols": None, "runs": None}
# other forwards' gdn_recurrent: "tokens" a block of inputs staged in shared memory at once (GDN_TOKENS)
RECURRENT: dict[str, Any] = {"tokens": 16}
# other forwards (prefill, mixed steps) in fewer launches, the same bits: the conv, the gates and (key head dim
# 128) the q / k norms in one (`conv1d_silu_gates`), the conv state update and `deltanet_core_gated`'s gated RMS
# norm in one (`gdn_finish`): three launches fewer a DeltaNet layer of an eager step, whose time is mostly its
# launches' host time (docs/perf.md, twenty-eighth session).
FUSED_PREFILL: dict[str, Any] = {"enabled": os.environ.get("DECAPYBARA_DELTANET_FUSED_PREFILL", "1") != "0"}
# other forwards at float arithmetic (the bf16 backend) whose head dims are multiples of 16 (dk + dv <= 256): the
# chunked form on tensor cores (decapybara/kernels/deltanet_chunk.cu) when the longest run has at least "min_len" rows,
# gdn_recurrent otherwise; "warps": value-column warps a gdn_chunk_scan CTA (None: the most of 4, 2, 1 that
# divides dv / 16); "wq_bufs": chunks of W | q fragments a scan CTA stages at once (SCAN_WQ_BUFS; 2: the next
# chunk's copies in flight from the start of the chunk before, 192 KB at dk 128, 1 where the device's shared
# memory a block does not hold that (`scan_wq_bufs`); the same bits; 27B layer at 2,048 rows 0.858 -> 0.705 ms,
# docs/perf.md twenty-seventh session); "min_len" 256 (was 512): 27B MXFP4 steps of a 256-token chunk 5.3% (at the
# start) and 8.7% (after 16k beside 11 decode rows) faster on the H200, whose eager steps of 64+ rows are bound by
# their GPU work, not their launches (docs/perf.md, twenty-ninth session);
# "defines": extra compile-time defines of both kernels (measurement: CHUNK_DIAG).
# DECAPYBARA_DELTANET_CHUNKED=0 turns it off; DECAPYBARA_DELTANET_CHUNKED_MIN sets "min_len".
CHUNKED: dict[str, Any] = {"enabled": os.environ.get("DECAPYBARA_DELTANET_CHUNKED", "1") != "0",
                           "min_len": int(os.environ.get("DECAPYBARA_DELTANET_CHUNKED_MIN", "256")),
                           "warps": None, "wq_bufs": 2, "defines": {}}


@functools.cache
def _has_multi(source: str) -> bool:
    """Whether kernel file `source` (decapybara/kernels/<source>.cu) has gdn_decode's multi-row build."""
    return "DEC_MULTI" in (KERNEL_DIR / f"{source}.cu").read_text()


def decode_ctas_per_sm(dk: int, vcols: int, acc: str) -> int:
    """Resident gdn_decode CTAs an SM, built into its launch bounds (GDN_MINB, unless FUSED_DECODE's defines
    set it): room for a float32 state's dk / 4 registers and 72 others a thread (the next run's conv state and
    inputs beside the current run's; dk = 128: 2 CTAs of 256 threads, where 3 held it to 80 registers with
    spills and ran up to 15% slower), 1 to 8; a float64 state, 1."""
    if acc == "double":
        return 1
    return min(8, max(1, 65536 // (4 * vcols * (dk // 4 + 72))))


def recurrent_smem_bytes(dk: int, vcols: int, tokens: int) -> int:
    """Dynamic shared memory of a gdn_recurrent CTA: two buffers of `tokens` tokens' inputs (q and k in 4 row
    slices of ceil4(dk / 4) + 4 floats, v of its `vcols` columns, g and beta)."""
    slice_ = -(-(dk // 4) // 4) * 4 + 4
    return 2 * 4 * tokens * (2 * 4 * slice_ + vcols + 2)


def chunk_prep_smem_bytes(dk: int, dv: int) -> int:
    """Dynamic shared memory of a gdn_chunk_prep CTA (decapybara/kernels/deltanet_chunk.cu: REGION0, A, P, the
    scalars): q^T and k^T (dk rows of CHUNK + 4 floats), later the U and W staging (CHUNK rows of dv + 4 and dk + 4),
    whichever is larger; A and P (CHUNK rows of CHUNK + 4); four per-token scalars."""
    region0 = max(2 * dk * (CHUNK + 4), CHUNK * (dv + dk + 8))
    return 4 * (region0 + 2 * CHUNK * (CHUNK + 4) + 4 * CHUNK)


def chunk_scan_smem_bytes(dk: int, warps: int, wq_bufs: int) -> int:
    """Dynamic shared memory of a gdn_chunk_scan CTA (decapybara/kernels/deltanet_chunk.cu SCAN_ITEMS, 16-byte items):
    `wq_bufs` chunks of W and q fragments (2 x CHUNK / 8 n-tiles x dk / 16 k-steps x 32 lanes), k (dk / 8 x
    CHUNK / 16 x 32), P (CHUNK / 8 x CHUNK / 16 x 32), U of each warp's 16 columns (CHUNK / 8 x 32)."""
    n8, k16 = CHUNK // 8, CHUNK // 16
    return 16 * (wq_bufs * 2 * n8 * (dk // 16) * 32 + (dk // 8) * k16 * 32 + n8 * k16 * 32 + warps * n8 * 32)


def chunked_ok(dk: int, dv: int) -> bool:
    """Head dims the chunked kernels take: multiples of 16, dk at most 64 or a multiple of 64, dk + dv <= 256."""
    return dk % 16 == 0 and dv % 16 == 0 and (dk <= 64 or dk % 64 == 0) and dk + dv <= 256


def decode_smem_bytes(dk: int, vcols: int, slices: int = 1) -> int:
    """Dynamic shared memory of a gdn_decode CTA: `slices` state slices (2 where the kernel's DEC_SMEM_S double-
    buffers them), each dk rows of vcols floats with 8 floats after each of the 4 parts' rows (the kernel's SPART)."""
    return 4 * slices * (dk * vcols + 4 * 8)


DECODE_NARROW_RUNS = 12  # `decode_vcols`: CTAs of 32 value columns up to this many runs, 64 past it
DECODE_SMEM_CTAS = 5  # gdn_decode CTAs an SM of its DEC_SMEM_S build (`decode_smem_state`): 96 registers at dk 128


def decode_smem_state(runs: int, vcols: int, acc: str, dk: int = 128) -> bool:
    """Whether a decode forward of `runs` runs takes gdn_decode's DEC_SMEM_S build (its delta step reads the state
    slice from shared memory, two slices double-buffered, so no state stays in registers: DECODE_SMEM_CTAS CTAs an
    SM): from FUSED_DECODE["smem_runs"] runs up (0: never), for CTAs of at most 32 value columns whose slices hold at
    most 128 x 32 floats (two larger slices would not leave room for 5 CTAs an SM), at float arithmetic. The same bits
    as the register build (delta_core's arithmetic is spelled out, no contraction left to the compiler). Off by
    default: measured (H200, us a layer, docs/perf.md, forty-sixth session) at the 27B shape 12 sequences 26.2
    against 27.4 and 11: 25.1 against 25.9, level at 8 and 10, 11% slower at 4; but 27B graph steps from 11 runs
    up only within their spread (-0.3 to -0.7%), and at the 35B-A3B's 32 value heads level at 11-12 and its steps
    2-5% slower."""
    n = FUSED_DECODE["smem_runs"]
    return bool(n) and runs >= n and vcols <= 32 and dk * vcols <= 128 * 32 and acc != "double"


def decode_vcols(runs: int, dv: int) -> int:
    """Value columns a gdn_decode CTA (DEC_VCOLS) where FUSED_DECODE names none: 32 for decode forwards of up to
    DECODE_NARROW_RUNS runs (twice the CTAs of half the state each, 4 an SM at dk 128), 64 past that where dv is a
    multiple of 64; at most dv.
    Measured (H200, 27B shape, us a layer, each width at its best runs a CTA; docs/perf.md, forty-fourth session,
    call 2): 32 columns 1-8% faster from 1 to 10 sequences (one: 5.1-5.2 against 5.5; five: 12.9 against 14.0), level
    at 2 and 12 (12: 27.6 against 27.3-27.4), 2-5% slower at 16-32 (32: 68.9 against 65.4)."""
    return 64 if runs > DECODE_NARROW_RUNS and dv % 64 == 0 else min(32, dv)


def decode_runs_per_cta(runs: int, heads: int, col_blocks: int, slots: int) -> int:
    """Runs per gdn_decode CTA, which takes them one after another (the next run's state copies, conv state and
    inputs in flight during the current one's work). `heads` x `col_blocks` CTAs take each group of runs, and
    `slots` CTAs are resident at once: the fewest runs a CTA that put every CTA in one wave where that is at most
    3, else 2 (at most the runs). Measured (H200, 27B shape, us a layer; docs/perf.md, forty-fourth session,
    call 2), 64 columns (96 CTAs a group, 264 slots): 6 sequences 14.5 three a CTA against 16.5-16.6 one; 12: 27.4-27.6
    two a CTA (2.2 waves) and 27.3-27.4 six (one wave) against 29.1-29.3 one; 16-32 two a CTA 9-10% faster than one,
    longer runs a CTA slower or at most 1% faster. 32 columns (192 a group, 528 slots): 3 sequences 8.9 two a CTA
    against 10.2 one, 5 and 6 three a CTA 12.9 / 14.2 against 13.9 / 16.4, 8 and 10 two a CTA 18.9-19.0 / 22.3-22.4
    against 20.2-20.3 / 24.6-24.7."""
    groups = slots // max(1, heads * col_blocks)  # run groups one wave of resident CTAs holds
    if groups >= 1 and -(-runs // groups) <= 3:
        return max(1, -(-runs // groups))
    return max(1, min(runs, 2))


@dataclass(slots=True)
class RunPlan:
    """Device metadata of one forward's DeltaNet segments (shared by every linear layer)."""

    runs: Any  # [R, 5] int32: first row, rows, slot, first segment, number of segments
    segs: Any  # [S, 2] int32: segment end (rows from the run start), snapshot index or -1
    num_runs: int
    max_len: int  # rows of the longest run
    snapshot_keys: list[tuple[int, int]]  # snapshot index -> key
    # where some run has more than one row: the segments and their host-side runs, from which `chunk_work` builds
    # the chunked kernels' work on first use (cached in chunk_work); else None
    chunk_src: tuple[list[DeltaNetSegment], RunGroups] | None = None
    chunk_work: ChunkWork | None = None
    # where given (verification graphs): per layer, the (conv, recurrent) device arrays that snapshot index i
    # writes (row i of each) in place of per-layer copies to the host; snapshot_keys is then empty
    snap_bufs: dict[int, tuple[Any, Any]] | None = None
    device_keys: frozenset = frozenset()  # snapshot keys kept as device copies (DeltaNetSegment.keep_on_device)


@dataclass(slots=True)
class ChunkWork:
    """The chunked kernels' share of a forward: runs of CHUNK rows or more, each segment cut into chunks of at
    most CHUNK rows from its start (as the reference chunks it); shorter runs (decode rows beside a prompt) take
    gdn_recurrent."""

    chunks: Any  # [NCH, 3] int32: first row, rows, snapshot index (its segment's, on its last chunk) or -1
    run_chunks: Any  # [RL, 2] int32: first chunk, chunks of each long run
    long_runs: Any  # [RL, 5] int32: the long runs' rows of RunPlan.runs
    num_long: int
    short_runs: Any  # [RS, 5] int32 or None
    num_short: int


def chunk_work(plan: RunPlan) -> ChunkWork:
    """`plan`'s ChunkWork, built (and copied to the device) once per plan."""
    if plan.chunk_work is None:
        assert plan.chunk_src is not None, "a forward of decode rows only has no chunked work"
        segments, groups = plan.chunk_src
        long, short = split_runs(groups.runs)
        chunks, run_chunks = chunk_table(segments, long, [snap for _, snap in groups.segs])
        rows = (lambda rs: cp.asarray(np.asarray(rs, np.int32).reshape(-1, 5)))
        plan.chunk_work = ChunkWork(cp.asarray(chunks), cp.asarray(run_chunks), rows(long), len(long),
                                    rows(short) if short else None, len(short))
    return plan.chunk_work


def plan_runs(segments: list[DeltaNetSegment]) -> RunPlan:
    """The device plan of `segments` (deltanet_plan.group_runs; ValueError as there)."""
    groups = group_runs(segments)
    return RunPlan(cp.asarray(np.asarray(groups.runs, np.int32).reshape(-1, 5)),
                   cp.asarray(np.asarray(groups.segs, np.int32).reshape(-1, 2)), len(groups.runs), groups.max_len,
                   groups.snapshot_keys, (list(segments), groups) if groups.max_len > 1 else None,
                   device_keys=frozenset(s.snapshot_key for s in segments if s.keep_on_device))


def _rows(a: Any) -> Any:
    """a [T, n] as is when its rows are contiguous (a column-range view of a fused product), else a copy."""
    if a.ndim == 2 and a.strides[1] == a.itemsize and a.strides[0] % a.itemsize == 0 and a.strides[0] > 0:
        return a
    return cp.ascontiguousarray(a)


def _head_rows(z: Any, t: int, hv: int, dv: int) -> tuple[Any, int]:
    """(z, ldz) for z [T, Hv, dv] whose heads are contiguous rows of dv floats, token t's at t * ldz (a column view
    of a fused product as is; any other layout copied)."""
    assert z.shape == (t, hv, dv), f"z {z.shape}, expected {(t, hv, dv)}"
    if not (z.strides[2] == 4 and z.strides[1] == 4 * dv and z.strides[0] % 4 == 0 and z.strides[0] >= 0):
        z = cp.ascontiguousarray(z)
    return z, z.strides[0] // 4


def deltanet_core(states: CupyStatePool, layer: int, mixed_qkv: Any, a: Any, b: Any, params: DeltaNetParams,
                  plan: RunPlan, cfg: ModelConfig,
                  snapshots: dict[tuple[int, int], dict[int, tuple[Any, Any]]],
                  acc: str = "double", gate: tuple[Any, Any, float] | None = None,
                  out_dtype: Any = np.float32) -> Any:
    """Returns the core output [T, Hv, dv] float32 (see `Backend.deltanet_core`), or with `gate` = (z, norm_weight,
    eps) its `gated_rms_norm(core, z, norm_weight, eps)` (see `Backend.deltanet_core_gated`), bit for bit: a
    decode forward computes it in gdn_decode_finish (gated_rms_norm_warp's arithmetic), in `out_dtype` (uint16:
    bf16 bits, rounded to nearest even), any other forward in gdn_finish beside its conv state update (float32, but
    `out_dtype` where MULTI_DECODE takes the runs; with FUSED_PREFILL off, `cupy_ops.gated_rms_norm` after the
    core)."""
    x, a, b = _rows(f32_any(mixed_qkv)), _rows(f32_any(a)), _rows(f32_any(b))
    if a.strides != b.strides:
        a, b = cp.ascontiguousarray(a), cp.ascontiguousarray(b)
    t, c = x.shape
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, ksz = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
    assert c == cfg.linear_conv_dim and a.shape == (t, hv) == b.shape, f"x {x.shape} a {a.shape} b {b.shape}"
    assert acc in ("double", "float"), acc
    w = f32(params.conv_weight).reshape(c, ksz)
    neg_a, dt_bias = f32(params.neg_A), f32(params.dt_bias)
    conv_state, rec = states.conv[layer], states.rec[layer]
    out = empty((t, hv, dv), cp.float32)
    if t == 0 or plan.num_runs == 0:
        return out if gate is None else cupy_ops.gated_rms_norm(out, *gate)
    defines = (("DK", dk), ("DV", dv), ("CONV_K", ksz), ("ACC", acc))
    if plan.snap_bufs is not None:  # the caller's buffers (checkpoints), written in place
        snap_conv, snap_rec = plan.snap_bufs[layer]
    else:
        nsnap = len(plan.snapshot_keys)
        snap_conv = empty((max(nsnap, 1), c, ksz - 1), cp.float32)
        snap_rec = empty((max(nsnap, 1), hv, dk, dv), cp.float32)

    cblocks = -(-c // 128)
    vcols = min(32, dv)  # value columns per CTA, 4 threads each (decapybara/kernels/deltanet_prefill.cu VCOLS, KSPLIT)
    assert dv % vcols == 0 and dv >= 8 and dk % 4 == 0, f"DeltaNet head dims dk={dk}, dv={dv}"
    ldx = I64(x.strides[0] // 4)
    decode = plan.max_len == 1 and FUSED_DECODE["enabled"]
    # (runs shorter than CHUNK: the reference's chunk store points never fall inside one; a kernel file that has
    # the build: a benchmark's older file may not)
    src = FUSED_DECODE["source"]
    multi = (FUSED_DECODE["enabled"] and 1 < plan.max_len <= min(MULTI_DECODE["max_rows"], CHUNK - 1)
             and _has_multi(src))
    # (the multi-row build keeps its state in registers: no DEC_SMEM_S, whatever FUSED_DECODE's defines say)
    fin_defines = defines + tuple((k, v) for k, v in FUSED_DECODE["defines"].items()
                                  if not (multi and k == "DEC_SMEM_S"))
    if decode or multi:  # conv, norms, gates and the steps in one launch
        knobs = MULTI_DECODE if multi else FUSED_DECODE
        work = t if multi else plan.num_runs  # rows, each a step of the recurrence
        dvcols = min(knobs["vcols"] or decode_vcols(work, dv), dv)  # the kernel's DVC
        assert dv % dvcols == 0, f"value head dim {dv} for {dvcols} columns a CTA"
        assert "DEC_VCOLS" not in FUSED_DECODE["defines"], "set FUSED_DECODE['vcols'] instead"
        dn_defines = fin_defines + (("DEC_VCOLS", dvcols), ("DEC_MAXRUNS", DECODE_MAX_RUNS))
        if multi:
            dn_defines += (("DEC_MULTI", 1),)
        smem_state = (not multi and "DEC_SMEM_S" not in FUSED_DECODE["defines"]
                      and decode_smem_state(plan.num_runs, dvcols, acc, dk))
        if smem_state:
            dn_defines += (("DEC_SMEM_S", 1),)
        if "GDN_MINB" not in FUSED_DECODE["defines"]:
            dn_defines += (("GDN_MINB", DECODE_SMEM_CTAS if smem_state else decode_ctas_per_sm(dk, dvcols, acc)),)
        minb = dict(dn_defines)["GDN_MINB"]
        # gdn_decode reads the conv weight, A and dt before its wait (overlapped launch): only where they are the
        # model's own float32 arrays, not copies this step makes
        persistent = all(isinstance(p, cp.ndarray) and p.dtype == cp.float32 and p.flags.c_contiguous
                         for p in (params.conv_weight, params.neg_A, params.dt_bias))
        launch = pdl.launch if persistent else pdl.plain
        per = knobs["runs"]
        if per is None:
            per = decode_runs_per_cta(plan.num_runs, hv, dv // dvcols, minb * cupy_ops.sm_count())
        assert 1 <= per <= DECODE_MAX_RUNS, f"{per} runs a gdn_decode CTA"
        kernel = get_kernel(src, "gdn_decode", dn_defines)
        smem = decode_smem_bytes(dk, dvcols, 2 if dict(dn_defines).get("DEC_SMEM_S") else 1)
        cupy_ops.allow_dynamic_smem(kernel, smem)
        launch(kernel, (-(-plan.num_runs // per), hv, dv // dvcols), (4 * dvcols,),
               (x, w, conv_state, a, b, neg_a, dt_bias, rec, plan.runs, plan.segs, out, snap_rec, I32(hk), I32(hv),
                I32(c), ldx, I64(a.strides[0] // 4), F32(dk ** -0.5), I32(plan.num_runs), I32(per)),
               shared_mem=smem)
    else:
        y = empty((t, c), cp.float32)  # silu(conv(x)), [T, q | k | v]
        g = empty((t, hv), cp.float32)
        beta = empty((t, hv), cp.float32)
        qn = empty((t, hk, dk), cp.float32)
        kn = empty((t, hk, dk), cp.float32)
        tiles = -(-plan.max_len // CONV_TOKENS)
        gate_args = (a, b, neg_a, dt_bias, g, beta, I32(t), I32(hv), I64(a.strides[0] // 4))
        fused = FUSED_PREFILL["enabled"]
        norms = fused and dk == 128  # the conv launch's blocks are then whole q / k heads
        if fused:
            get_kernel("deltanet_prefill", "conv1d_silu_gates", defines)(
                (cblocks * tiles * plan.num_runs + min(-(-(t * hv) // 128), 4 * cupy_ops.sm_count()),), (128,),
                (x, w, conv_state, plan.runs, y, I32(c), ldx, I32(tiles), I32(plan.num_runs), *gate_args,
                 I32(int(norms)), qn, kn, I32(hk), F32(dk ** -0.5)))
        else:
            get_kernel("deltanet_prefill", "conv1d_silu_runs", defines)(
                (cblocks, tiles, plan.num_runs), (128,), (x, w, conv_state, plan.runs, y, I32(c), ldx))
            get_kernel("deltanet_prefill", "gdn_gates", defines)((grid_for(t * hv),), (THREADS,), gate_args)
        if not norms:
            get_kernel("deltanet_prefill", "gdn_qk_norm", defines)(
                (-(-(t * hk * 32) // THREADS),), (THREADS,), (y, qn, kn, I32(t), I32(hk), I32(c), F32(dk ** -0.5)))
        rec_runs, num_rec = plan.runs, plan.num_runs  # gdn_recurrent's runs
        if (acc == "float" and CHUNKED["enabled"] and chunked_ok(dk, dv) and plan.chunk_src is not None
                and plan.max_len >= CHUNKED["min_len"]):
            work = chunk_work(plan)
            _chunked(qn, kn, y, g, beta, rec, plan, work, out, snap_rec, hk, hv, dk, dv, c)
            rec_runs, num_rec = work.short_runs, work.num_short
        if num_rec:
            tokens = int(RECURRENT["tokens"])
            rec_kernel = get_kernel("deltanet_prefill", "gdn_recurrent", defines + (("GDN_TOKENS", tokens),))
            smem = recurrent_smem_bytes(dk, vcols, tokens)
            cupy_ops.allow_dynamic_smem(rec_kernel, smem)
            rec_kernel((num_rec, hv, dv // vcols), (4 * vcols,),
                       (qn, kn, y, g, beta, rec, rec_runs, plan.segs, out, snap_rec, I32(hk), I32(hv), I32(c),
                        I32(CHUNK)), shared_mem=smem)
    # the conv state after the run, once every reader above has run (and, fused, the gated norm of `out`)
    state_args = (x, conv_state, plan.runs, plan.segs, snap_conv, I32(c), ldx)
    if gate is not None and (decode or multi or FUSED_PREFILL["enabled"]):  # conv state and gated norm, one launch
        z, norm_w, eps = gate
        z, ldz = _head_rows(f32_any(z), t, hv, dv)
        cupy_ops.check(norm_w, np.float32, "norm weight", 1)
        assert norm_w.shape == (dv,), f"norm weight {norm_w.shape} for value heads of {dv}"
        if decode:
            gated = empty((t, hv, dv), out_dtype)
            pdl.launch(get_kernel(src, "gdn_decode_finish", fin_defines),
                       (-(-hv // 4) + cblocks, plan.num_runs), (128,),
                       (*state_args, out, z, norm_w, gated, I32(hv), I64(ldz), F32(eps),
                        I32(cupy_ops._bf16_out(out_dtype))))
        else:  # multi: in `out_dtype`, as the decode's
            gated = empty((t, hv, dv), out_dtype if multi else cp.float32)
            get_kernel("deltanet_prefill", "gdn_finish", defines)(
                (-(-(t * hv) // 4) + cblocks * plan.num_runs,), (128,),
                (*state_args, out, z, norm_w, gated, I32(t), I32(hv), I64(ldz), F32(eps),
                 I32(cupy_ops._bf16_out(out_dtype) if multi else 0)))
    else:
        get_kernel("deltanet_prefill", "conv1d_state_update", defines)((cblocks, plan.num_runs), (128,), state_args)
        gated = None if gate is None else cupy_ops.gated_rms_norm(out, *gate)
    for i, key in enumerate(plan.snapshot_keys):
        snap = snapshots.setdefault(key, {})
        if key in plan.device_keys:  # a rollback point: a device copy (3 MB a 27B layer), not a host round trip
            snap[layer] = (snap_conv[i].copy(), snap_rec[i].copy())
        else:
            snap[layer] = _to_slab(snap, cfg, layer, snap_conv[i], snap_rec[i])
    return out if gated is None else gated


def _chunked(qn: Any, kn: Any, y: Any, g: Any, beta: Any, rec: Any, plan: RunPlan, work: ChunkWork, out: Any,
             snap_rec: Any, hk: int, hv: int, dk: int, dv: int, c: int) -> None:
    """The gated delta rule of `work`'s long runs by chunks (decapybara/kernels/deltanet_chunk.cu): gdn_chunk_prep over
    every (chunk, value head) at once, then gdn_chunk_scan along each run's chunks. Updates `rec`, writes `out` and
    `snap_rec` as gdn_recurrent does, for those runs only."""
    nch = int(work.chunks.shape[0])
    defines = (("DK", dk), ("DV", dv), *CHUNKED["defines"].items())
    n = nch * hv * (CHUNK // 8) * 32  # B-fragment items over a chunk's tokens, times k-steps below
    wf, qf = empty((n * dk // 16, 4), cp.uint32), empty((n * dk // 16, 4), cp.uint32)
    kf = empty((nch * hv * (dk // 8) * (CHUNK // 16) * 32, 4), cp.uint32)
    pf = empty((n * (CHUNK // 16), 4), cp.uint32)
    uf = empty((n * (dv // 16), 4), cp.float32)
    gl = empty((nch, hv), cp.float32)
    prep, smem = get_kernel("deltanet_chunk", "gdn_chunk_prep", defines), chunk_prep_smem_bytes(dk, dv)
    cupy_ops.allow_dynamic_smem(prep, smem)
    prep((nch, hv), (256,), (qn, kn, y, g, beta, work.chunks, wf, qf, kf, pf, uf, gl, I32(hk), I32(hv), I32(c)),
         shared_mem=smem)
    mtiles = dv // 16
    warps = CHUNKED["warps"] or next(w for w in (4, 2, 1) if mtiles % w == 0)
    bufs = scan_wq_bufs(dk, warps)
    scan = get_kernel("deltanet_chunk", "gdn_chunk_scan", defines + (("SCAN_WARPS", warps), ("SCAN_WQ_BUFS", bufs)))
    smem = chunk_scan_smem_bytes(dk, warps, bufs)
    cupy_ops.allow_dynamic_smem(scan, smem)
    scan((work.num_long, hv, -(-mtiles // warps)), (32 * warps,),
         (wf, qf, kf, pf, uf, gl, work.chunks, work.long_runs, work.run_chunks, rec, out, snap_rec, I32(hv)),
         shared_mem=smem)


def scan_wq_bufs(dk: int, warps: int) -> int:
    """W | q fragment buffers of a gdn_chunk_scan launch: CHUNKED "wq_bufs", or 1 where the shared memory of two
    does not fit a block of this device (on an H200: dk over 128)."""
    bufs = int(CHUNKED["wq_bufs"])
    return bufs if bufs == 1 or chunk_scan_smem_bytes(dk, warps, bufs) <= cupy_ops.smem_per_block() else 1


def _to_slab(snap: dict, cfg: ModelConfig, layer: int, conv: Any, rec: Any) -> tuple[np.ndarray, np.ndarray]:
    """One layer's snapshot copied asynchronously (current stream) into its key's pinned host slab, one state's
    size laid out as `cupy_kv.host_copies` lays out a slot's state (every layer's conv, then every layer's
    recurrent state) and taken from CuPy's pinned pool at the key's first layer (kept in `snap` under None).
    Returns the layer's two host views, valid once the stream has passed the copies: the forward synchronises
    once at its end (`CupyBackend.to_host_many`). The device copies can go at once (the pool reuses memory in
    stream order), so a forward never holds more than one layer's snapshots on the device."""
    lin = list(cfg.linear_layers)
    if None not in snap:
        snap[None] = cupyx.empty_pinned(len(lin) * (conv.size + rec.size), np.float32)
    slab, j = snap[None], lin.index(layer)
    cv = slab[j * conv.size:(j + 1) * conv.size].reshape(conv.shape)
    o = len(lin) * conv.size + j * rec.size
    rv = slab[o:o + rec.size].reshape(rec.shape)
    stream = cp.cuda.get_current_stream().ptr
    for host, dev in ((cv, conv), (rv, rec)):
        cp.cuda.runtime.memcpyAsync(host.ctypes.data, cupy_ops.dev_ptr(dev), host.nbytes,
                                    cp.cuda.runtime.memcpyDeviceToHost, stream)
    return cv, rv
