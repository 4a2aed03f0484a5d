"""Paged causal attention on the device (decapybara/kernels/attn_prefill.cu): device metadata and launches.

`plan_attention(batch, ...)` turns a `ForwardBatch` into device metadata once per forward: per-sequence
(start, length, context), padded block tables, and work items (decapybara/backend/attn_plan.py: a tile of
BLOCK_M query rows of one sequence over a key range; long key ranges are split, split-K or "flash decoding", so
that 1..12 decoding sequences still fill the GPU, and `attention_reduce` merges the parts), planned with this
device's SM count. `attention(...)` launches both kernels for one layer.

Any forward with more than one new token for some sequence (prefill chunks, mixed steps, verification rows)
over bf16 or microscaled pages runs the tensor-core prefill kernel (attn_prefill.cu built with PREFILL_TC:
FlashAttention-2 style, CTAs of 64 or 128 query rows, on Hopper with warpgroup MMAs; `PREFILL` in attn_plan
holds its switch, env DECAPYBARA_PREFILL_ATTN=0, and build); float32 pages keep the general float32 kernel, as
do pure decode forwards the decode kernel does not take (eager and graph plans alike).

A pure decode forward (one new token per sequence, g <= 8 query heads per KV head) runs
decapybara/kernels/attn_decode.cu instead, and so do the decode rows of a mixed step (planned apart, as a pure decode
batch of them: `rows`; DECODE "mixed"), when the pages are bf16 (head_dim 64 / 128 / 256) or microscaled 8 / 6 / 4-bit
keys and values (head_dim 128 / 256): tensor cores, a cp.async ring of 16-key tiles per warp, the same work items and
partial layout (so the same reduce). `DECODE` holds its switch and launch shapes (env DECAPYBARA_DECODE_ATTN=0
turns it off; bench/attn_decode.py times both).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import cupy as cp
import numpy as np

from decapybara import kernels
from decapybara.backend import pdl
from decapybara.backend.attn_plan import (
    BLOCK_N,
    DECODE,
    DECODE_WAVES,
    PREFILL,
    PREFILL_ROWS_PER_WARP,
    PREFILL_WG_HEAD_DIMS,
    cdiv,
    plan_work,
    rows_per_warp,
)
from decapybara.backend.cupy_ops import (
    F32,
    I32,
    I64,
    allow_dynamic_smem,
    check,
    empty,
    empty_like,
    f32,
    heads,
    null,
    sm_count,
    smem_per_block_of,
    smem_per_sm,
)
from decapybara.kernels import get_kernel
from decapybara.model.batch import ForwardBatch

NTHREADS = 128
DECODE_HEAD_DIMS = (64, 128, 256)  # bf16 pages
DECODE_MX_HEAD_DIMS = (128, 256)  # microscaled pages (a lane's value dims lie in one 32-element scale block)
DECODE_MX_BITS = (8, 6, 4)
DECODE_MAX_GROUP = 8  # query heads per KV head the decode kernel's 8-column tiles hold


class PrefillLaunch(NamedTuple):
    """The tensor-core prefill kernel's build and launch (decapybara/kernels/attn_prefill.cu PREFILL_TC)."""

    block_n: int  # keys a tile (TC_BLOCK_N)
    split: int  # 1: q and P as hi + lo bf16 terms (TC_SPLIT)
    wg: int  # 1: the warpgroup-MMA build (PREFILL_WG, sm_90a)
    warps: int  # warps a CTA, 4 or 8: 64 or 128 query rows (TC_WARPS)
    stages: int  # (K, V) tile pairs in shared memory, 1 to 3 (TC_STAGES)


@dataclass(slots=True)
class ScratchWindow:
    """One window of a plan's scratch pages: the pages its work items read, decoded together."""

    src: Any  # [npages] int32: the source page of every scratch page
    block_tables: Any  # [nseq, max_pages] int32: the plan's tables over scratch page numbers (this window's pages)
    begin: int  # its work items [begin, end) of the plan's
    end: int

    @property
    def npages(self) -> int:
        return int(self.src.size)


@dataclass(slots=True)
class DequantPages:
    """The microscaled pages that a prefill plan's chunks read, decoded once a layer into bf16 scratch pages
    (`kv_pages_bf16`) so that the tensor-core kernel's CTAs copy tiles instead of each decoding them again. The
    plan's first `num_work` work items (the chunks') run over the scratch, the rest (short runs; decode rows where
    the decode kernel does not take them) over the pages themselves, in a second launch. Where the chunks' pages
    pass the scratch's cap, their keys are taken in windows of `window` keys a sequence (0: one window), each
    decoded into the same scratch and read by a launch of its own items (`windows`; the plan cuts the chunks' key
    ranges at every multiple of `window`)."""

    chunks: np.ndarray  # [nseq] bool: the sequences read through the scratch
    direct: PrefillLaunch  # the launch over the pages themselves (the other items; all if no scratch is had)
    window: int = 0
    windows: list[ScratchWindow] = field(default_factory=list)

    @property
    def num_work(self) -> int:
        """The plan's work items that run over the scratch: its first, its windows' together."""
        return self.windows[-1].end if self.windows else 0

    @property
    def npages(self) -> int:
        """Pages of the scratch: its largest window's."""
        return max((w.npages for w in self.windows), default=0)


@dataclass(slots=True)
class AttentionPlan:
    """Device metadata of one forward's attention (shared by every attention layer)."""

    seq_info: Any  # [nseq, 3] int32: first row, new tokens, cached tokens
    block_tables: Any  # [nseq, max_pages] int32
    max_pages: int
    work: Any  # [nwork, 5] int32: seq, row0, key_begin, key_end, part (-1: final output)
    reduce: Any  # [nreduce, 4] int32: seq, row0, first part, number of parts
    num_work: int
    num_reduce: int
    num_parts: int
    rows_per_warp: int
    slots: Any  # [T] int64 flat KV slot of every row
    # (warps, stages) of the decode kernel (decode_launch) when it runs this plan: every sequence of its work items
    # has one new token and g <= DECODE_MAX_GROUP (one tile, row0 0); None: the general kernel
    decode: tuple[int, int] | None = None
    # the tensor-core prefill kernel's launch when it runs this plan (`prefill_launch`; rows_per_warp is then
    # 16); None: the decode kernel or the general one
    prefill: PrefillLaunch | None = None
    # set when the prefill kernel's chunks read bf16 copies of microscaled pages (`dequant_pages`); prefill is
    # then the bf16 pages' launch, and dequant.direct the launch of the other sequences' items over the pages
    dequant: DequantPages | None = None
    # a mixed step's decode rows (DECODE "mixed"): their work items, parts and reduce in a plan of their own for
    # the decode kernel (its `decode` set), over the same seq_info and block tables; this plan's work the rest
    rows: AttentionPlan | None = None

    @property
    def warps(self) -> int:
        """Warps of a work item's CTA (the tensor-core prefill kernel's `warps`, else 4)."""
        return self.prefill.warps if self.prefill is not None else 4

    @property
    def block_m(self) -> int:
        return self.warps * self.rows_per_warp


def plan_attention(batch: ForwardBatch, nq: int, nkv: int, head_dim: int, splits: int | None = None,
                   kv_bits: tuple[int, int] | None = None) -> AttentionPlan:
    """The attention plan of one forward; a pure decode batch that the decode kernel takes (`decode_launch`:
    g, head_dim and the pages' `kv_bits` (key, value; None: unknown, the general kernel's plan) permitting) gets
    its longer splits and the kernel's launch shape in `decode`. In a mixed step (DECODE "mixed") the sequences
    of one new token go to `rows`, a plan of their own for the decode kernel, and the rest to the prefill
    kernel."""
    g = nq // nkv
    seqs = batch.seqs
    ones = np.asarray([s.length == 1 for s in seqs], bool)
    pure = bool(seqs) and bool(ones.all())
    decode = decode_launch(g, head_dim, kv_bits) if pure else None
    prefill = prefill_launch(head_dim, kv_bits) if seqs and not pure else None  # decode rows alone: as graphs do
    shape = decode_launch(g, head_dim, kv_bits) if prefill is not None and DECODE["mixed"] and ones.any() else None
    own = ~ones if shape is not None else np.ones(len(seqs), bool)  # the sequences of this plan's own work
    max_pages = max((len(s.block_table) for s in seqs), default=1) or 1
    dequant = None
    if prefill is not None:
        bf16 = prefill_launch(head_dim, (16, 16)) if kv_bits != (16, 16) else None
        if bf16 is not None and bf16.warps == prefill.warps:
            dequant = dequant_pages(batch, nkv, head_dim, prefill, own)
            prefill = bf16 if dequant is not None else prefill
    tables = np.zeros((max(len(seqs), 1), max_pages), np.int32)
    for i, s in enumerate(seqs):
        tables[i, :len(s.block_table)] = s.block_table
    info = np.asarray([(s.start, s.length, s.context) for s in seqs], np.int32).reshape(-1, 3)
    seq_info, block_tables = cp.asarray(info), cp.asarray(tables)
    slots = cp.asarray(np.ascontiguousarray(batch.slot_mapping, np.int64))
    rows = None
    if shape is not None:  # the decode rows: planned as a pure decode batch of them, over the same metadata
        rpw = rows_per_warp(head_dim, g)
        work, reduce, parts = _plan_work(batch, ones, g, nkv, 4 * rpw, splits, head_dim, kv_bits, shape)
        rows = AttentionPlan(seq_info, block_tables, max_pages, cp.asarray(work), cp.asarray(reduce), len(work),
                             len(reduce), parts, rpw, slots, shape)
    rpw = PREFILL_ROWS_PER_WARP if prefill is not None else rows_per_warp(
        head_dim, max((s.length for s in seqs), default=1) * g)
    warps = prefill.warps if prefill is not None else 4
    windows = dequant.chunks * dequant.window if dequant is not None else None
    work, reduce, parts = _plan_work(batch, own, g, nkv, warps * rpw, splits, head_dim, kv_bits, decode, windows)
    if prefill is not None and len(work) > 1:  # the longest key ranges first: the launch's tail is the short ones
        work = work[np.argsort(work[:, 2] - work[:, 3], kind="stable")]
    if dequant is not None and len(work):  # the chunks' items first (the scratch launches: window by window,
        over = dequant.chunks[work[:, 0]]  # each longest first), then the rest
        chunk_items = work[over]
        if dequant.window:
            chunk_items = chunk_items[np.argsort(chunk_items[:, 2] // dequant.window, kind="stable")]
        work = np.concatenate([chunk_items, work[~over]])
        scratch_windows(dequant, chunk_items, batch, max_pages)
    return AttentionPlan(seq_info, block_tables, max_pages, cp.asarray(work), cp.asarray(reduce), len(work),
                         len(reduce), parts, rpw, slots, decode, prefill, dequant, rows)


def _plan_work(batch: ForwardBatch, which: np.ndarray, g: int, nkv: int, block_m: int, splits: int | None,
               head_dim: int, kv_bits: tuple[int, int] | None, decode: tuple[int, int] | None,
               windows: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """`attn_plan.plan_work` over the batch's sequences where `which` holds, their indices the batch's (decode:
    the decode kernel's launch shape, whose plans take its split rule; `windows`: every sequence's key window,
    0 for none)."""
    idx = np.flatnonzero(which).astype(np.int32)
    seqs = [batch.seqs[i] for i in idx]
    work, reduce, parts = plan_work([s.length for s in seqs], [s.context for s in seqs], g, nkv, block_m, splits,
                                    sms=sm_count(), windows=[int(w) for w in windows[idx]] if windows is not None
                                    else None, **({"waves": DECODE_WAVES,
                                                   "decode_per_sm": decode_per_sm(head_dim, kv_bits, decode)}
                                                  if decode is not None else {}))
    work[:, 0], reduce[:, 0] = idx[work[:, 0]], idx[reduce[:, 0]]
    return work, reduce, parts


def dequant_pages(batch: ForwardBatch, nkv: int, head_dim: int, direct: PrefillLaunch,
                  own: np.ndarray) -> DequantPages | None:
    """The scratch of a prefill plan over microscaled pages (`direct`: its launch over the pages themselves;
    `own`: [nseq] bool, the sequences the plan's prefill launches take) for those with at least PREFILL
    "dequant_tokens" new tokens (0: none; None where there are none): one window where their pages' K and V
    scratch take at most "dequant_mb" MiB, else the fewest windows that keep each window's under it, of equal
    keys a sequence (whole pages and 32-key tiles; None where not even one such unit a sequence fits). Pages
    shared by sequences (prefix reuse) are decoded once a window. Its windows' pages come from the plan's work
    items (`scratch_windows`)."""
    least = int(PREFILL["dequant_tokens"])
    chunks = np.asarray([least > 0 and s.length >= least for s in batch.seqs], bool) & own
    if not chunks.any():
        return None
    ps = batch.page_size
    cap = int(PREFILL["dequant_mb"] * 2 ** 20 // (4 * ps * nkv * head_dim))  # pages
    used = np.unique(np.concatenate([s.block_table[:cdiv(s.context + s.length, ps)]
                                     for s, c in zip(batch.seqs, chunks) if c]))
    if len(used) <= cap:
        return DequantPages(chunks, direct) if len(used) else None
    unit = math.lcm(ps, BLOCK_N)  # a window: whole pages and whole key tiles
    most = cap // int(chunks.sum()) * ps // unit * unit  # keys a sequence a window may have
    if not most:
        return None
    keys = max(s.context + s.length for s, c in zip(batch.seqs, chunks) if c)
    return DequantPages(chunks, direct, cdiv(cdiv(keys, cdiv(keys, most)), unit) * unit)


def scratch_windows(dq: DequantPages, items: np.ndarray, batch: ForwardBatch, max_pages: int) -> None:
    """Fills `dq.windows` from the chunks' work items, the plan's first, window by window: each window's item
    range, the unique pages its items read and its block tables over them."""
    ps, nseq = batch.page_size, len(batch.seqs)
    which = items[:, 2] // dq.window if dq.window else np.zeros(len(items), np.int64)
    bounds = np.flatnonzero(np.diff(which)) + 1
    for begin, end in zip([0, *bounds], [*bounds, len(items)]):
        part = items[begin:end]
        seqs = np.unique(part[:, 0])
        first = [int(part[part[:, 0] == s, 2].min()) // ps for s in seqs]  # each sequence's pages [first, last]
        used = [batch.seqs[s].block_table[a:(int(part[part[:, 0] == s, 3].max()) - 1) // ps + 1]
                for s, a in zip(seqs, first)]
        src, inverse = np.unique(np.concatenate(used).astype(np.int32), return_inverse=True)
        tables = np.zeros((max(nseq, 1), max_pages), np.int32)
        for s, a, row in zip(seqs, first, np.split(inverse, np.cumsum([len(u) for u in used])[:-1])):
            tables[s, a:a + len(row)] = row
        dq.windows.append(ScratchWindow(cp.asarray(src), cp.asarray(tables), int(begin), int(end)))


def gate_fuses(plan: AttentionPlan) -> bool:
    """Whether `attention` takes an output gate for this plan: a pure decode plan, whose every output row is
    written by the decode kernel's final items or by attention_reduce (both apply it), with DECODE "gate" on."""
    return plan.decode is not None and bool(DECODE["gate"])


def attention(q: Any, k_parts: tuple[Any, Any, int], v_parts: tuple[Any, Any, int], plan: AttentionPlan,
              nkv: int, page_size: int, scale: float, gate: Any = None, out_dtype: Any = cp.float32) -> Any:
    """Causal attention of q [T, nq, D] over the paged keys / values (codes, scales, bits) -> [T, nq, D] float32.
    With `gate` [T, nq, D] (rows of D contiguous are read in place, `heads`; `gate_fuses(plan)` must hold): the
    output times sigmoid(gate) in the kernels that finish it, float32 or (out_dtype uint16) bf16 bits, the bits
    of `cupy_ops.sigmoid_gate` over the float32 output."""
    q = f32(q)
    t, nq, d = q.shape
    assert d % 4 == 0 and d <= 256, f"head_dim {d}: the kernel needs a multiple of 4, at most 256"
    assert nq % nkv == 0, f"{nq} query heads for {nkv} KV heads"
    for name, a in (("k codes", k_parts[0]), ("v codes", v_parts[0]), ("k scales", k_parts[1]),
                    ("v scales", v_parts[1])):
        check(a, a.dtype, name)  # device array, C-contiguous
    if gate is None:
        out, og = empty_like(q), (null(), I64(0), I64(0), I32(0))
    else:
        assert gate_fuses(plan), "an output gate needs a pure decode plan"
        g, g_st, g_sh = heads(gate)
        assert g.shape == q.shape, f"gate {g.shape} vs q {q.shape}"
        bf16 = np.dtype(out_dtype) == np.uint16
        assert bf16 or np.dtype(out_dtype) == np.float32, out_dtype
        out = empty(q.shape, out_dtype)
        og = (g, I64(g_st), I64(g_sh), I32(bf16))
    if t == 0:
        return out
    for p in (plan, plan.rows):  # disjoint rows of `out`: the chunks', then the decode rows'
        if p is not None and p.num_work:
            _attend(q, k_parts, v_parts, p, out, og, nkv, page_size, scale)
    return out


def _attend(q: Any, k_parts: tuple[Any, Any, int], v_parts: tuple[Any, Any, int], plan: AttentionPlan, out: Any,
            og: tuple, nkv: int, page_size: int, scale: float) -> None:
    """The launches of one plan's work items (not empty) and their split-K reduce, into its rows of `out`; `og`:
    the output gate's kernel arguments (gate, token stride, head stride, bf16 out; a NULL gate: none)."""
    nq, d = q.shape[1], q.shape[2]
    (kc, ks, kb), (vc, vs, vb) = k_parts, v_parts
    bm = plan.block_m
    parts = max(plan.num_parts, 1)
    part_o = empty(parts * nkv * bm * d, cp.float32)
    part_ml = empty(parts * nkv * bm * 2, cp.float32)
    defines = (("HEAD_DIM", d), ("KBITS", kb), ("VBITS", vb), ("ROWS_PER_WARP", plan.rows_per_warp))
    if plan.decode is not None:
        assert nq // nkv <= bm <= DECODE_MAX_GROUP, f"decode plan with {nq // nkv} heads a KV head, tiles of {bm}"
        warps, stages = plan.decode
        mx = kb != 16
        ddef = (("HEAD_DIM", d), ("BLOCK_M", bm), ("DEC_WARPS", warps), ("DEC_STAGES", stages),
                ("DEC_CHAINS", int(DECODE["chains"])))
        ddef += (("KBITS", kb), ("VBITS", vb)) if mx else ()
        fwd = get_kernel("attn_decode", "paged_decode_attention_mx" if mx else "paged_decode_attention", ddef)
        smem = decode_smem(d, kb, vb, warps, stages)
        allow_dynamic_smem(fwd, smem)
        pages = (kc, ks, vc, vs) if mx else (kc, vc)
        pdl.launch(fwd, (plan.num_work, nkv), (32 * warps,),
                   (q, *pages, plan.block_tables, plan.seq_info, plan.work, out, part_o, part_ml, I32(nq),
                    I32(nkv), I32(plan.max_pages), I32(page_size), F32(scale), *og), shared_mem=smem)
    elif plan.prefill is not None:
        args = (plan, q, out, part_o, part_ml, nkv, page_size, scale)
        dq, at = plan.dequant, 0
        if dq is not None:  # the chunks' items over bf16 scratch pages (the bf16 build), then the rest
            try:
                kx, vx = scratch_kv(dq, nkv, page_size, d)
            except cp.cuda.memory.OutOfMemoryError:  # no room beside the pool: the kernel decodes every tile
                pass
            else:
                for win in dq.windows:  # each window's pages, then its items (the same stream: in order)
                    dequant_kv(win, k_parts, v_parts, nkv, page_size, d, (kx, vx))
                    defines = _prefill_tc(plan.prefill, (kx, ks, vx, vs), (16, 16), win.block_tables, win.begin,
                                          win.end, *args)
                at = dq.num_work
        if at < plan.num_work:  # (both launches' CTAs have the same rows: the reduce takes either's defines)
            defines = _prefill_tc(plan.prefill if dq is None else dq.direct, (kc, ks, vc, vs), (kb, vb),
                                  plan.block_tables, at, plan.num_work, *args)
    else:
        _attention_fwd(q, (kc, ks, kb), (vc, vs, vb), plan, defines, out, part_o, part_ml, nkv, page_size, scale)
    if plan.num_reduce:
        red = get_kernel("attn_prefill", "attention_reduce", defines)
        pdl.launch(red, (plan.num_reduce, nkv, bm), (NTHREADS,),
                   (part_o, part_ml, plan.reduce, plan.seq_info, out, I32(nq), I32(nkv), *og))


def _prefill_tc(pl: PrefillLaunch, pages: tuple[Any, Any, Any, Any], kv_bits: tuple[int, int], tables: Any,
                begin: int, end: int, plan: AttentionPlan, q: Any, out: Any, part_o: Any, part_ml: Any, nkv: int,
                page_size: int, scale: float) -> tuple:
    """One launch of the tensor-core prefill kernel (build `pl` over pages of `kv_bits`, block `tables`) over the
    plan's work items [begin, end) (not empty); returns its build's defines (BLOCK_M among them:
    `attention_reduce` needs the same)."""
    nq, d = q.shape[1], q.shape[2]
    defines = (("HEAD_DIM", d), ("KBITS", kv_bits[0]), ("VBITS", kv_bits[1]), ("ROWS_PER_WARP", plan.rows_per_warp),
               ("PREFILL_TC", 1), ("TC_BLOCK_N", pl.block_n), ("TC_SPLIT", pl.split))
    defines += (("PREFILL_WG", 1), ("SM90A", 1)) if pl.wg else ()
    defines += (("TC_WARPS", pl.warps),) if pl.warps != 4 else ()
    defines += (("TC_STAGES", pl.stages),) if pl.stages != 1 else ()
    defines += (("TC_OVERLAP", 1),) if prefill_overlap(pl) else ()
    defines += (("TC_DIAG", PREFILL["diag"]),) if PREFILL["diag"] else ()  # measurement only
    fwd = get_kernel("attn_prefill", "paged_prefill_attention_tc", defines)
    smem = prefill_smem(d, *pl)
    allow_dynamic_smem(fwd, smem)
    kc, ks, vc, vs = pages
    fwd((end - begin, nkv), (32 * pl.warps,),
        (q, kc, ks, vc, vs, tables, plan.seq_info, plan.work[begin:end], out, part_o, part_ml, I32(nq), I32(nkv),
         I32(plan.max_pages), I32(page_size), F32(scale)), shared_mem=smem)
    return defines


def scratch_kv(dq: DequantPages, nkv: int, page_size: int, head_dim: int) -> tuple[Any, Any]:
    """(keys, values) scratch of `dq`'s largest window: bf16 bits [npages * page_size * nkv * head_dim] uint16
    each (raises cupy's OutOfMemoryError where the pool cannot give them)."""
    n = dq.npages * page_size * nkv * head_dim
    return empty(n, cp.uint16), empty(n, cp.uint16)


def dequant_kv(win: ScratchWindow, k_parts: tuple[Any, Any, int], v_parts: tuple[Any, Any, int], nkv: int,
               page_size: int, head_dim: int, out: tuple[Any, Any]) -> None:
    """The pages `win` names decoded into its scratch pages of `out` (keys, values: `scratch_kv`), each element
    as the prefill kernel decodes it on load (decapybara/kernels/attn_prefill.cu kv_pages_bf16)."""
    (kc, ks, kb), (vc, vs, vb) = k_parts, v_parts
    n = win.npages * page_size * nkv * head_dim
    fn = get_kernel("attn_prefill", "kv_pages_bf16", (("HEAD_DIM", head_dim), ("KBITS", kb), ("VBITS", vb)))
    fn((max(1, min(cdiv(n // 8, 256), 16 * sm_count())),), (256,),
       (kc, ks, vc, vs, win.src, I32(win.npages), I32(page_size), I32(nkv), *out))


def decode_launch(g: int, head_dim: int, kv_bits: tuple[int, int] | None) -> tuple[int, int] | None:
    """(warps, stages) of the decode kernel for pure decode batches with `g` query heads per KV head over pages
    of `kv_bits` (key, value; None: unknown); None when the general kernel runs them."""
    if kv_bits is None or g > DECODE_MAX_GROUP:
        return None
    return decode_shape(head_dim, *kv_bits)


def prefill_launch(head_dim: int, kv_bits: tuple[int, int] | None, warps: int | None = None) -> PrefillLaunch | None:
    """The tensor-core prefill kernel's launch for pages of `kv_bits` (key, value; None: unknown) on this
    device; None where the general kernel runs: off, float32 or unknown pages, head_dim not a multiple of 16 or
    over 256, a device before sm_80, or its shared memory too small. wg 1: the warpgroup-MMA build
    (`prefill_wg`); warps and stages (microscaled pages: "mx_stages") as PREFILL says where they fit the shared
    memory, else fewer stages, then 4 warps; `warps` 4 or 8 asks for that many (a verification step's dozen rows
    a sequence fill a fraction of one 64-row CTA: 8 warps would double its idle tensor-core work)."""
    if not PREFILL["enabled"] or kv_bits is None or head_dim % 16 or head_dim > 256:
        return None
    if any(b not in (16, *DECODE_MX_BITS) for b in kv_bits):
        return None
    block_n, split = int(PREFILL["block_n" if head_dim <= 128 else "block_n_wide"]), int(PREFILL["split"])
    wg = int(prefill_wg(head_dim))
    for w in dict.fromkeys((warps or int(PREFILL["warps"]), 4)):
        for stages in range(int(PREFILL["stages" if kv_bits == (16, 16) else "mx_stages"]), 0, -1):
            launch = PrefillLaunch(block_n, split, wg, w, stages)
            if prefill_smem(head_dim, *launch) <= _smem_optin():
                return launch
    return None


def prefill_overlap(launch: PrefillLaunch) -> bool:
    """Whether a launch takes the kernel's overlapped loop (TC_OVERLAP: PREFILL "overlap", the wgmma build, a
    ring of three pairs) and no measurement variant (PREFILL "diag")."""
    return bool(PREFILL["overlap"]) and bool(launch.wg) and launch.stages == 3 and not PREFILL["diag"]


def prefill_wg(head_dim: int) -> bool:
    """Whether the prefill kernel takes its warpgroup-MMA build: PREFILL "wg", head_dim 64 / 128 / 256, and a
    device that takes sm_90a builds (`kernels.sm90a_ok`: Hopper, nvcc, a wgmma build that compiles)."""
    return bool(PREFILL["wg"]) and head_dim in PREFILL_WG_HEAD_DIMS and kernels.sm90a_ok()


def prefill_smem(head_dim: int, block_n: int, split: int, wg: int = 0, warps: int = 4, stages: int = 1) -> int:
    """Dynamic shared memory of a tensor-core prefill launch: the 16 `warps` query rows (twice when split),
    `stages` K and V tiles, rows of head_dim bf16, padded by 16 bytes in the mma.sync build (D = 256, 32 keys,
    split, 4 warps, 1 stage: 99 KB, two CTAs an SM; the wgmma build's unpadded tiles 96 KB, and 1 KB to align
    its swizzled tiles)."""
    return ((16 * warps * (2 if split else 1) + 2 * stages * block_n) * (2 * head_dim + (0 if wg else 16))
            + (1024 if wg else 0))


def decode_smem(head_dim: int, key_bits: int, value_bits: int, warps: int, stages: int) -> int:
    """Dynamic shared memory of a decode-kernel launch: `stages` tiles of 16 keys per warp (bf16: K and V rows of
    2 * head_dim bytes; microscaled: codes and E8M0 scale bytes as stored)."""
    if key_bits == 16:
        return warps * stages * 64 * head_dim
    tile = 16 * (head_dim * (key_bits + value_bits) // 8 + 2 * (head_dim // 32))
    return warps * stages * tile


def decode_shape(head_dim: int, key_bits: int = 16, value_bits: int = 16) -> tuple[int, int] | None:
    """(warps, stages) of the decode kernel for `head_dim` and the KV page bits on this device; None when it
    does not apply: off, pages other than bf16 (head_dim 64 / 128 / 256) or 8 / 6 / 4-bit keys and values
    (head_dim 128 / 256), or not even two stages of one warp fit the shared memory (the merge area, 32 * warps
    * (head_dim + 2) bytes, lives in the stage memory: microscaled shapes keep room for it).

    Range of the microscaled kernel: its bf16 block factors (decapybara/kernels/mx_pairs.cuh) hold E8M0 scale codes up
    to 198 (8-bit) / 192 (6 / 4-bit), i.e. blocks with |x| < 2^79 / 2^67; beyond that a block's products are
    inf / NaN where the general kernel stays finite (no real key or value comes near), and products below
    ~2^-62 lose bits to bf16 subnormals (absolute errors of that size)."""
    if not DECODE["enabled"]:
        return None
    if (key_bits, value_bits) == (16, 16) and head_dim in DECODE_HEAD_DIMS:
        warps, stages = int(DECODE["warps"]), int(DECODE["stages"])
    elif key_bits in DECODE_MX_BITS and value_bits in DECODE_MX_BITS and head_dim in DECODE_MX_HEAD_DIMS:
        warps, stages = int(DECODE["mx_warps"]), max(2, int(DECODE["mx_stages"]))  # the kernel needs two
    else:
        return None
    limit = _smem_optin()
    if limit <= 0:  # before sm_80: no cp.async / bf16 mma
        return None

    def fits(w: int, s: int) -> bool:
        smem = decode_smem(head_dim, key_bits, value_bits, w, s)
        return smem <= limit and 32 * w * (head_dim + 2) <= smem

    while not fits(warps, stages) and stages > 2:
        stages -= 1
    while not fits(warps, stages) and warps > 1:
        warps //= 2
    return (warps, stages) if fits(warps, stages) else None


def decode_per_sm(head_dim: int, kv_bits: tuple[int, int], shape: tuple[int, int]) -> int:
    """CTAs of a decode-kernel launch of `shape` (warps, stages) that one SM holds by its shared memory: 1 for
    bf16 pages of head_dim 256 at 4 x 3 (192 KB), 3 for 6/4-bit ones (63 KB)."""
    return max(1, smem_per_sm() // (decode_smem(head_dim, *kv_bits, *shape) + 1024))


def _smem_optin() -> int:
    return _smem_optin_of(cp.cuda.Device().id)


@functools.cache
def _smem_optin_of(device: int) -> int:
    """Opt-in shared memory per block of `device`; 0 before compute capability 8.0 (the kernel's floor)."""
    try:
        if int(cp.cuda.Device(device).compute_capability) < 80:
            return 0
    except (RuntimeError, AttributeError, ValueError):
        pass
    return smem_per_block_of(device)


def _attention_fwd(q: Any, k_parts: tuple[Any, Any, int], v_parts: tuple[Any, Any, int], plan: AttentionPlan,
                   defines: tuple, out: Any, part_o: Any, part_ml: Any, nkv: int, page_size: int,
                   scale: float) -> None:
    """decapybara/kernels/attn_prefill.cu's paged_attention_fwd: any rows, any KV format."""
    (kc, ks, _), (vc, vs, _) = k_parts, v_parts
    nq, d = q.shape[1], q.shape[2]
    bm = plan.block_m
    fwd = get_kernel("attn_prefill", "paged_attention_fwd", defines)
    smem = 4 * (bm * d + BLOCK_N * (d + 4) + BLOCK_N * d)
    allow_dynamic_smem(fwd, smem)
    fwd((plan.num_work, nkv), (NTHREADS,),
        (q, kc, ks, vc, vs, plan.block_tables, plan.seq_info, plan.work, out, part_o, part_ml, I32(nq), I32(nkv),
         I32(plan.max_pages), I32(page_size), F32(scale)), shared_mem=smem)
