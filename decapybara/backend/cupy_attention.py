"""Paged causal attention on the device (kernels/attn_prefill.cu): work planning and launches.

`plan_attention(batch, ...)` turns a `ForwardBatch` into device metadata once per forward: per-sequence
(start, length, context), padded block tables, and work items. A work item is a tile of BLOCK_M query rows
(row = token * g + head in group, g = nq / nkv) of one sequence over a key range; long key ranges are split
(split-K, "flash decoding") so that 1..12 decoding sequences still fill the GPU, and `attention_reduce` merges
the parts. `attention(...)` launches both kernels for one layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import cupy as cp
import numpy as np

from decapybara.backend.cupy_ops import F32, I32, check, empty, empty_like, f32, sm_count
from decapybara.model.batch import ForwardBatch
from kernels import get_kernel

BLOCK_N = 32  # keys per tile (one per lane)
NTHREADS = 128
MIN_KEYS_PER_SPLIT = 64  # short decode contexts still spread over many CTAs


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


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

    @property
    def block_m(self) -> int:
        return 4 * self.rows_per_warp


def rows_per_warp(head_dim: int, max_rows: int) -> int:
    """Smallest of 1, 2, 4, 8 rows per warp covering `max_rows` rows in one CTA, capped so that a lane holds
    at most 32 accumulators (rows x head_dim / 32)."""
    cap = max(1, min(8, 32 // -(-head_dim // 32)))
    rpw = 1
    while rpw < cap and 4 * rpw < max_rows:
        rpw *= 2
    return rpw


def plan_work(lengths: list[int], contexts: list[int], g: int, nkv: int, block_m: int,
              splits: int | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """(work [nwork, 5], reduce [nreduce, 4], number of parts) for sequences of `lengths` new tokens on top of
    `contexts`. `splits` forces the number of key splits per tile (tests); else about 2 CTAs per SM."""
    tiles = []
    for si, (n, ctx) in enumerate(zip(lengths, contexts)):
        rows = n * g
        for row0 in range(0, rows, block_m):
            last_token = (min(rows, row0 + block_m) - 1) // g
            tiles.append((si, row0, ctx + last_token + 1))
    target = 2 * sm_count()
    work, reduce, parts = [], [], 0
    for si, row0, kend in tiles:
        if splits is not None:
            n = splits
        else:
            n = min(cdiv(target, len(tiles) * nkv), max(1, kend // MIN_KEYS_PER_SPLIT))
        n = max(1, min(n, cdiv(kend, BLOCK_N)))
        chunk = cdiv(cdiv(kend, n), BLOCK_N) * BLOCK_N
        n = cdiv(kend, chunk)
        if n == 1:
            work.append((si, row0, 0, kend, -1))
            continue
        reduce.append((si, row0, parts, n))
        for b in range(0, kend, chunk):
            work.append((si, row0, b, min(b + chunk, kend), parts))
            parts += 1
    return (np.asarray(work, np.int32).reshape(-1, 5), np.asarray(reduce, np.int32).reshape(-1, 4), parts)


def plan_attention(batch: ForwardBatch, nq: int, nkv: int, head_dim: int,
                   splits: int | None = None) -> AttentionPlan:
    g = nq // nkv
    seqs = batch.seqs
    rpw = rows_per_warp(head_dim, max((s.length for s in seqs), default=1) * g)
    work, reduce, parts = plan_work([s.length for s in seqs], [s.context for s in seqs], g, nkv, 4 * rpw, splits)
    max_pages = max((len(s.block_table) for s in seqs), default=1) or 1
    tables = np.zeros((max(len(seqs), 1), max_pages), np.int32)
    for i, s in enumerate(seqs):
        tables[i, :len(s.block_table)] = s.block_table
    info = np.asarray([(s.start, s.length, s.context) for s in seqs], np.int32).reshape(-1, 3)
    return AttentionPlan(cp.asarray(info), cp.asarray(tables), max_pages, cp.asarray(work), cp.asarray(reduce),
                         len(work), len(reduce), parts, rpw,
                         cp.asarray(np.ascontiguousarray(batch.slot_mapping, np.int64)))


_SMEM_SET: set[tuple] = set()


def attention(q: Any, k_parts: tuple[Any, Any, int], v_parts: tuple[Any, Any, int], plan: AttentionPlan,
              nkv: int, page_size: int, scale: float) -> Any:
    """Causal attention of q [T, nq, D] over the paged keys / values (codes, scales, bits) -> [T, nq, D]."""
    q = f32(q)
    t, nq, d = q.shape
    assert d % 4 == 0 and d <= 256, f"head_dim {d}: the kernel needs a multiple of 4, at most 256"
    assert nq % nkv == 0, f"{nq} query heads for {nkv} KV heads"
    (kc, ks, kb), (vc, vs, vb) = k_parts, v_parts
    for name, a in (("k codes", kc), ("v codes", vc), ("k scales", ks), ("v scales", vs)):
        check(a, a.dtype, name)  # device array, C-contiguous
    out = empty_like(q)
    if t == 0 or plan.num_work == 0:
        return out
    bm = plan.block_m
    defines = (("HEAD_DIM", d), ("KBITS", kb), ("VBITS", vb), ("ROWS_PER_WARP", plan.rows_per_warp))
    fwd = get_kernel("attn_prefill", "paged_attention_fwd", defines)
    smem = 4 * (bm * d + BLOCK_N * (d + 4) + BLOCK_N * d)
    if smem > 48 * 1024 and defines not in _SMEM_SET:
        fwd.max_dynamic_shared_size_bytes = smem
        _SMEM_SET.add(defines)
    parts = max(plan.num_parts, 1)
    part_o = empty(parts * nkv * bm * d, cp.float32)
    part_ml = empty(parts * nkv * bm * 2, cp.float32)
    fwd((plan.num_work, nkv), (NTHREADS,),
        (q, kc, ks, vc, vs, plan.block_tables, plan.seq_info, plan.work, out, part_o, part_ml, I32(nq), I32(nkv),
         I32(plan.max_pages), I32(page_size), F32(scale)), shared_mem=smem)
    if plan.num_reduce:
        red = get_kernel("attn_prefill", "attention_reduce", defines)
        red((plan.num_reduce, nkv, bm), (NTHREADS,),
            (part_o, part_ml, plan.reduce, plan.seq_info, out, I32(nq), I32(nkv)))
    return out
