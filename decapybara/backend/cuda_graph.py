"""Decode steps as CUDA graphs: one graph per (batch-size bucket, attention split count), replayed with the
step's metadata copied into static device buffers, so Python launch overhead leaves the decode hot path.

`capture_graph(fn, stream, pool)` is the generic part: run `fn` eagerly (warm-up: kernel compilation, cuBLAS
handles), then capture it on a non-default stream with every allocation served by `pool`, a CuPy memory pool
owned by the graph and never shared: buffers freed during capture go back to that pool only, the arrays `fn`
returns stay alive with the graph, so a replay writes exactly where the capture wrote and allocates nothing.
CuPy captures in relaxed mode (cudaMalloc by the pool is legal); synchronous copies, `cupy.asnumpy` and
anything else that waits on the device fail the capture, and the caller falls back to eager.

`DecodeGraphRunner.forward(batch, kv, states)` is a drop-in for `QwenModel.forward` on decode batches (every
sequence adds one token, logits for every row): rows are padded to the bucket (padding rows write a reserved
KV page `pad_page` and state slot `pad_slot`, which no sequence may use), the metadata goes host -> pinned
staging -> two static device buffers, then `graph.launch`. A row that asks for a hybrid-state snapshot (a
decode row can only ask at its token's end) gets its slot's state copied out after the replay. Anything else
runs eagerly.

Speculative verification steps (some sequence adds its last real token and k drafts, 1 <= k < MAX_ROWS) replay
graphs of their own, keyed by R rows a sequence (R = 1 + the batch's most drafts): sequence i holds rows R i ..
R i + R - 1 whatever its length in the batch. A sequence of fewer tokens gets throwaway rows after its own,
whose KV goes to the pad page, whose DeltaNet steps run on the pad slot and whose outputs nobody reads; attention
takes every sequence as R tokens (a throwaway row attends over the sequence's own keys, never read back). Where
the decode kernel takes the pages the attention is one launch of it (and one reduce) over R x bucket one-token
sequences, (sequence i, token j) at plan index j x bucket + i over keys to its own (DECODE "verify_one_pass"; 0:
two launches, a token each, for R = 2 only: more rows a sequence then run eagerly), else the tensor-core prefill
kernel's (the general kernel's over float32 pages); the DeltaNet is the decode kernel's multi-row build over runs
of none to R rows (cupy_deltanet MULTI_DECODE). A draft's rollback point (the state after the real token and the
drafts before it, asked for as `snapshot_at` points inside the sequence's rows) is written by the DeltaNet kernels
into checkpoint buffers of the runner's (`_checkpoints`: max bucket states, allocated at the first verification
graph; sequence i's d-th point at state i (R - 1) + d, so a batch of n sequences takes n x (R - 1) <= max bucket:
`max_drafts`; padding sequences keep none) and handed back as device views (`ForwardBatch.device_snapshots`, valid until the next
verification replay) or host copies.

What the backend must guarantee for capture (CupyBackend does, through the plan caches seeded below):
no host synchronisation or host -> device copy in the decode forward (no `from_host`, `cupy.asnumpy`, `int()`
of a device value); launch grids that depend only on the static shapes; every per-step value read from the
static buffers: token ids, positions, slot mapping, block tables [bucket, max_pages], per-sequence
(start, 1, context), attention work items (key ranges; fixed count per split setting) and DeltaNet runs
(state slots). `CupyBackend.paged_attention` (and `paged_attention_gated`) / `deltanet_core` take their plans from `_attn` / `_runs`
(keyed by the batch / segment list objects), which `_seed_plans` fills with plans over the static buffers.
MoE layers run `cupy_ops_extra.moe` (packed or bf16 experts: no host synchronisation) and so capture; the fp32
mode's float32 experts read the hit-expert list on the host, so those models' decode steps fail the capture and
run eagerly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

import cupy as cp
import cupyx
import numpy as np

from decapybara.backend import cupy_ops, pdl
from decapybara.backend.attn_plan import (
    BLOCK_N,
    DECODE,
    MIN_KEYS_PER_SPLIT,
    PREFILL_ROWS_PER_WARP,
    cdiv,
    decode_splits,
    graph_split_cap,
    pow2_floor,
    rows_per_warp,
)
from decapybara.backend.base import DeltaNetSegment, HybridState, KVCache, StatePool
from decapybara.backend.cupy_attention import PrefillLaunch, decode_launch, decode_per_sm, prefill_launch
from decapybara.backend.cupy_kv import host_copies
from decapybara.backend.cupy_ops import sm_count
from decapybara.backend.cupy_ops_extra import embedding_rows
from decapybara.model.batch import ForwardBatch, SeqChunk
from decapybara.model.qwen import ForwardOutput, QwenModel

log = logging.getLogger(__name__)
_D2H = 2  # cudaMemcpyDeviceToHost
MAX_ROWS = 8  # rows a sequence of a verification graph: its real token and up to 7 drafts (the DeltaNet decode's
# multi-row build, cupy_deltanet MULTI_DECODE, takes runs of up to 8 rows)


class GraphUnsupported(RuntimeError):
    """This model / backend / batch cannot run as a captured decode graph."""


def _plan(cls: Any, **values: Any) -> Any:
    """A backend plan dataclass over static buffers; fields this module does not know make it unsupported."""
    names = {f.name for f in dataclasses.fields(cls)}
    if names - set(values):
        raise GraphUnsupported(f"{cls.__name__} has fields {sorted(names - set(values))} this module cannot fill")
    return cls(**{k: v for k, v in values.items() if k in names})


def _kv_bits(kv: KVCache) -> tuple[int, int]:
    return getattr(kv, "key_bits", 0), getattr(kv, "value_bits", 0)


def capture_graph(fn: Any, stream: Any, pool: Any, warmup: int = 1) -> tuple[Any, Any]:
    """(graph, outputs of the captured call) for `fn()`; allocations of warm-up and capture come from `pool`.
    The warm-up calls execute (mind side effects) on `stream`, after the work already queued on the caller's
    current stream (its inputs' writes: a non-blocking `stream` would not wait for the legacy default stream),
    and have finished when this returns or raises; the captured call does not execute until `graph.launch`."""
    stream.wait_event(cp.cuda.get_current_stream().record())
    with stream, cp.cuda.using_allocator(pool.malloc):
        try:
            for _ in range(warmup):
                fn()
        except BaseException:  # its queued kernels may still read buffers the caller frees and reuses on its
            with contextlib.suppress(Exception):  # own stream (not ordered after this one): let them finish
                stream.synchronize()
            raise
        stream.synchronize()
        stream.begin_capture()
        try:
            with pdl.capturing():  # overlapped launches under DECAPYBARA_PDL=1
                out = fn()
        except BaseException:
            with contextlib.suppress(Exception):  # an invalidated capture fails to end too; the first error wins
                stream.end_capture()
            raise
        graph = stream.end_capture()
    return graph, out


@dataclass(slots=True)
class _Static:
    """Pinned staging, static device buffers and the plans / batch objects built over them (one graph)."""

    bucket: int
    splits: int
    rows: int  # rows a sequence: 1 (decode) or 2..MAX_ROWS (verification: the real token and the drafts)
    tiles: int  # attention tiles per sequence
    block_m: int  # query rows per tile
    host64: np.ndarray  # pinned int64 [3, bucket * rows]: ids, positions, slots
    host32: np.ndarray  # pinned int32 [n32]
    dev64: Any
    dev32: Any
    views: dict[str, tuple[int, tuple[int, ...]]]  # name -> (offset in dev32, shape)
    batch: ForwardBatch
    segments: list[DeltaNetSegment]
    attn_plan: Any = None
    run_plan: Any = None
    kv_bits: tuple[int, int] = (0, 0)  # (key, value) bits of the KV cache the plans were built for
    graph: Any = None
    pool: Any = None
    outputs: Any = None
    done: Any = None  # event after the last replay: staging is reusable once it completed
    chains: Any = None  # its layer tails' product chains (decapybara/backend/chain_tails.py `ChainTails`)
    mtp: bool = False  # the MTP head's pass (`DecodeGraphRunner.mtp`), not a forward
    hidden: Any = None  # an MTP graph's input rows [bucket * rows, H] float32 (the main model's normed states)
    flag: Any = None  # pinned uint32 [1]: the chains' timeout flag, copied there at the end of each replay
    token_tables: Any = None  # a one-pass verification graph's block tables once a row of a sequence, [rows *
    # bucket, max_pages] int32 (its plan's one-token sequences j x bucket + i read row i), copied from "tables" in
    # the graph

    def d32(self, name: str) -> Any:
        off, shape = self.views[name]
        return self.dev32[off:off + int(np.prod(shape))].reshape(shape)

    def h32(self, name: str) -> np.ndarray:
        off, shape = self.views[name]
        return self.host32[off:off + int(np.prod(shape))].reshape(shape)


@dataclass(slots=True)
class DecodeGraphRunner:
    """Decode forward through captured graphs (see the module docstring). `max_pages` bounds block tables."""

    model: QwenModel
    max_pages: int
    pad_page: int
    pad_slot: int | None = None
    buckets: tuple[int, ...] = (1, 2, 4, 8, 12)
    tails: Any = None  # eager steps' layer tails as graphs (decapybara/backend/piecewise.py `PiecewiseTails`)
    chains: bool = False  # graphs' layer tails as persistent product chains (decapybara/backend/chain_tails.py)
    draft_head: Any = None  # the ids the MTP graphs guess among (`QwenModel.draft_head`; None: every id)
    stats: dict[str, Any] = field(default_factory=lambda: {"graph_steps": 0, "eager_steps": 0, "captures": 0,
                                                           "failures": {}, "chain_timeouts": 0,
                                                           "verify_steps": 0, "mtp_steps": 0, "mtp_kv_steps": 0,
                                                           "mtp_eager": 0})
    _graphs: dict[tuple, _Static] = field(default_factory=dict)  # (bucket, splits, rows); ("mtp" | "mtpkv",
    # bucket, splits, rows)
    _stream: Any = None
    _inv_freq: Any = None
    _ckpt: dict[int, tuple[Any, Any]] | None = None  # verification checkpoints: layer -> (conv, rec) [max bucket, ...]

    def __post_init__(self) -> None:
        cfg = self.model.cfg
        self._stream = cp.cuda.Stream(non_blocking=True)
        self._inv_freq = cp.asarray(self.model.rotary.inv_freq)
        if cfg.linear_layers and self.pad_slot is None:
            raise ValueError("a hybrid model needs a reserved pad_slot for graph padding rows")

    # ---- public ---------------------------------------------------------------------------------------
    def forward(self, batch: ForwardBatch, kv: KVCache, states: StatePool | None = None) -> ForwardOutput:
        if self.chains and self._chains_timed_out():
            self._drop_chains()
        reason = self.ineligible(batch, kv)
        key = None if reason else (self._bucket(len(batch.seqs)), self._splits(batch, kv), self._rows(batch))
        if key is not None and key not in self.stats["failures"]:
            try:
                st = self._replay(key, batch, kv, states)
            except Exception as e:  # noqa: BLE001 - any capture failure means: this key runs eagerly
                self.stats["failures"][key] = f"{type(e).__name__}: {e}"
                self._graphs.pop(key, None)
            else:  # outside the try: once the graph ran, a failure here must not run the step a second time
                out = self._outputs(st, batch)
                self._snapshots(out, batch, states, st.rows)
                return out
        self.stats["eager_steps"] += 1
        return self.model.forward(batch, kv, states, tails=self.tails)

    def _chains_timed_out(self) -> bool:
        """Whether a replay of a graph with chains found a chain's wait timed out (its flag, copied to the host at
        the replay's end; waits for replays still running)."""
        for st in self._graphs.values():
            if st.flag is not None and st.done is not None:
                st.done.synchronize()
                if st.flag[0]:
                    return True
        return False

    def _drop_chains(self) -> None:
        """A chain timed out (its blocks were not all resident: other work on the GPU): that step's outputs were
        wrong. Chains off from now on; the graphs with chains go, to be captured again without them."""
        self.stats["chain_timeouts"] += 1
        log.error("a product chain's wait timed out (blocks not all resident): its step's outputs were wrong; "
                  "product chains are off from now on")
        self.chains = False
        self._graphs = {k: st for k, st in self._graphs.items() if st.chains is None}

    def chain_stats(self) -> dict[str, Any]:
        """The graphs' product chains (`chains`): chains and the products they run, layers whose tails stayed
        launched (their check failed) or were launched in a capture (cut otherwise than in its warm-up)."""
        sts = [st.chains for st in self._graphs.values() if st.chains is not None]
        return {"chains": sum(c.stats["chains"] for c in sts),
                "chained_products": sum(c.stats["chained_products"] for c in sts),
                "launched_tails": sum(len(c.stats["launched"]) for c in sts),
                "recut_tails": sum(len(c.stats["recut"]) for c in sts)}

    def _snapshots(self, out: ForwardOutput, batch: ForwardBatch, states: StatePool | None, rows: int) -> None:
        """A replay's hybrid-state snapshots into `out` (a graph of `rows` rows a sequence): a point at a
        sequence's end is the state its slot holds after the step (a host copy); a verification point after its
        d-th row (d from 0, before its last) is checkpoint i (rows - 1) + d, as device views where
        `batch.device_snapshots` names it (valid until the next verification replay), else a host copy."""
        lin = list(self.model.cfg.linear_layers)
        if not lin:  # no hybrid state: nothing to snapshot
            return
        for i, s in enumerate(batch.seqs):
            for q in s.snapshot_at:
                if q == s.total:
                    out.snapshots[(i, q)] = states.get(s.state_slot)
                    continue
                at = i * (rows - 1) + q - (s.total - s.length) - 1
                conv = [self._ckpt[j][0][at] for j in lin]
                rec = [self._ckpt[j][1][at] for j in lin]
                if (i, q) not in batch.device_snapshots:
                    arrs = host_copies(conv + rec)
                    conv, rec = arrs[:len(lin)], arrs[len(lin):]
                out.snapshots[(i, q)] = HybridState(conv, rec)

    def ineligible(self, batch: ForwardBatch, kv: KVCache | None = None) -> str | None:
        """Why `batch` cannot replay a decode or verification graph (None when it can); `kv`: the cache it runs
        over (its pages decide whether more than one draft a sequence takes a graph, `max_drafts`)."""
        seqs = batch.seqs
        if not seqs or len(seqs) > max(self.buckets):
            return f"{len(seqs)} sequences (buckets {self.buckets})"
        if any(not 1 <= s.length <= MAX_ROWS or any(not s.total - s.length < q <= s.total for q in s.snapshot_at)
               for s in seqs):
            return "not a decode or verification batch (prefill chunk)"
        if not np.array_equal(batch.logits_rows, np.arange(batch.num_tokens)):
            return "logits not requested for exactly every row"
        rows = self._rows(batch)
        if rows - 1 > self.max_drafts(len(seqs), kv):
            return f"{rows - 1} drafts a sequence beside {len(seqs) - 1} others (max_drafts)"
        if not self._tables_fit(batch):
            return "block table longer than max_pages or using the pad page"
        if self.model.cfg.linear_layers and any(s.state_slot in (None, self.pad_slot) for s in seqs):
            return "state slot missing or equal to pad_slot"
        return None

    def _tables_fit(self, batch: ForwardBatch) -> bool:
        """Whether every sequence's block table fits a graph: at most max_pages pages, its own tokens' keys within
        them, the pad page not among its own. A sequence's throwaway rows (a graph of more rows than it has) need
        no page of its own: their keys go to the pad page and they attend to the sequence's keys only."""
        ps = batch.page_size
        return not any(len(s.block_table) > self.max_pages or cdiv(s.total, ps) > self.max_pages
                       or self.pad_page in s.block_table[:cdiv(s.total, ps)] for s in batch.seqs)

    def max_drafts(self, n: int, kv: KVCache | None = None) -> int:
        """Drafts a sequence that a verification graph of `n` sequences takes (0: none, more sequences than the
        largest bucket, or a two-row graph of its bucket failed to capture): up to MAX_ROWS - 1, fewer than the
        rows of any graph of its bucket that failed to capture, on a hybrid model no more than its checkpoints hold (n x drafts <=
        max bucket: each draft's rollback point a state; the bucket's padding sequences keep none), on `kv`'s
        pages one where the decode kernel takes a verification's tokens in a launch each (DECODE
        "verify_one_pass" 0: two passes, for two rows only)."""
        if not 0 < n <= max(self.buckets):
            return 0
        most = MAX_ROWS - 1
        if self.model.cfg.linear_layers:
            most = min(most, max(self.buckets) // n)
        if kv is not None and not self._takes_rows(kv, 3):
            most = 1
        bucket = self._bucket(n)  # fewer than the rows of a verification graph of this bucket whose capture failed
        failed = [k[2] for k in self.stats["failures"] if len(k) == 3 and k[0] == bucket and k[2] > 1]
        return min([most, *(r - 2 for r in failed)])

    # ---- graphs -----------------------------------------------------------------------------------------
    def _bucket(self, n: int) -> int:
        return min(b for b in self.buckets if b >= n)

    @staticmethod
    def _rows(batch: ForwardBatch) -> int:
        """Rows a sequence of the batch's graph: 1 + the most drafts a sequence verifies (1: a decode batch)."""
        return max(s.length for s in batch.seqs)

    def _splits(self, batch: ForwardBatch, kv: KVCache, rows: int | None = None) -> int:
        """Key splits per tile (a graph per value): the tensor-core decode kernel's by attn_plan.decode_splits
        for the bucket's launch (a power of two up to attn_plan.graph_split_cap), the general kernel's enough
        for short contexts too (64+ keys); a verification graph's decode passes as a decode graph's, its prefill
        kernel about two CTAs an SM, no split under MIN_KEYS_PER_SPLIT keys, at most 32 (a power of two).
        `rows`: a sequence's in the graph (default: the batch's, `_rows`)."""
        rows = rows or self._rows(batch)
        longest = max(s.context for s in batch.seqs) + rows
        shape = self._decode_launch(kv)
        cfg = self.model.cfg
        per_split = self._bucket(len(batch.seqs)) * self._row_tiles(kv, rows)[1] * cfg.num_key_value_heads  # CTAs
        if rows > 1 and self._one_pass(kv):  # every token's CTAs in the one launch
            per_split *= rows
        if shape is not None:
            sms, per_sm = sm_count(), decode_per_sm(cfg.head_dim, _kv_bits(kv), shape)
            return decode_splits(per_split, longest, sms, pow2=True, cap=graph_split_cap(per_split, sms, per_sm),
                                 per_sm=per_sm)
        if rows > 1 and self._verify_launch(kv) is not None:
            return min(32, pow2_floor(min(cdiv(2 * sm_count(), per_split), longest // MIN_KEYS_PER_SPLIT)))
        return 1 if longest < MIN_KEYS_PER_SPLIT else 4 if longest < 256 else 16 if longest < 16384 else 32

    def _row_tiles(self, kv: KVCache | None = None, rows: int = 1) -> tuple[int, int, int]:
        """(rows per warp, row tiles a sequence, query rows a tile) of a step's attention over `rows` tokens a
        sequence (row = token * g + head in group): the decode kernel's or general kernel's tiles of 4 warps
        (a verification graph's decode-kernel passes: a token's g rows each, in one launch, or two for two rows), a
        verification graph's prefill-kernel CTAs (`_verify_launch`)."""
        cfg = self.model.cfg
        g = cfg.num_attention_heads // cfg.num_key_value_heads
        if rows > 1 and self._token_passes(kv):
            rows = 1
        launch = self._verify_launch(kv) if rows > 1 else None
        if launch is not None:
            block_m = PREFILL_ROWS_PER_WARP * launch.warps
            return PREFILL_ROWS_PER_WARP, cdiv(rows * g, block_m), block_m
        rpw = rows_per_warp(cfg.head_dim, rows * g)
        return rpw, cdiv(rows * g, 4 * rpw), 4 * rpw

    def _token_passes(self, kv: KVCache | None) -> bool:
        """Whether a verification graph's attention runs on the decode kernel, a pass a token (row R i + j over
        keys to its own; all in one launch where `_one_pass`): where the decode
        kernel takes the model's decode steps. The prefill kernel would take a sequence's tokens in one CTA, but
        in CTAs of 64 rows for its R g, and it spent 0.18-0.21 ms a 27B layer on 16 new tokens after 16k keys
        where a decode pass takes ~0.03 (docs/perf.md)."""
        return kv is not None and self._decode_launch(kv) is not None

    def _one_pass(self, kv: KVCache | None) -> bool:
        """Whether a verification graph's decode-kernel passes are one launch (and one reduce): each (sequence,
        token) a one-token sequence of the plan (DECODE "verify_one_pass"), its CTAs beside the other tokens',
        so that the later reads of a sequence's keys can come from the L2. Read when a graph is built: a runner's
        graphs keep the form they were captured in."""
        return self._token_passes(kv) and bool(DECODE["verify_one_pass"])

    def _takes_rows(self, kv: KVCache, rows: int) -> bool:
        """Whether a graph over `kv`'s pages takes `rows` rows a sequence: two at most where the decode kernel's
        verification passes are a launch a token (DECODE "verify_one_pass" 0), else up to MAX_ROWS."""
        return rows <= (MAX_ROWS if self._one_pass(kv) or not self._token_passes(kv) else 2)

    def _verify_launch(self, kv: KVCache) -> PrefillLaunch | None:
        """The tensor-core prefill kernel's launch for verification graphs over `kv`'s pages (None: the general
        kernel): CTAs of 4 warps (64 query rows, of which a sequence's R tokens take R g), no scratch pages."""
        return prefill_launch(self.model.cfg.head_dim, _kv_bits(kv), warps=4)

    def _decode_launch(self, kv: KVCache) -> tuple[int, int] | None:
        """The tensor-core decode kernel's launch shape on `kv` (cupy_attention.decode_launch); None: the
        general kernel."""
        cfg = self.model.cfg
        return decode_launch(cfg.num_attention_heads // cfg.num_key_value_heads, cfg.head_dim, _kv_bits(kv))

    def _replay(self, key: tuple[int, int, int], batch: ForwardBatch, kv: KVCache,
                states: StatePool | None) -> _Static:
        """The graph of `key` (built and captured on first use) replayed over `batch`; returns it."""
        st = self._graphs.get(key)
        if st is None:
            st = self._graphs[key] = self._build(*key, page_size=batch.page_size, kv=kv)
        self._launch(st, batch, lambda: self._step(st, kv, states))
        self.stats["graph_steps"] += 1
        self.stats["verify_steps"] += st.rows > 1
        return st

    def _outputs(self, st: _Static, batch: ForwardBatch) -> ForwardOutput:
        """A replay's outputs for `batch`'s rows in its order (a verification graph's gathered from sequence i's
        rows R i ..; a decode graph's are views of the graph's own arrays, valid until its next replay)."""
        logits, h, normed = st.outputs  # h: the residual stream before the final norm; normed: after it
        if st.rows == 1:
            n = len(batch.seqs)
            return ForwardOutput(logits[:n], h[:n], {}, normed[:n] if batch.normed_rows else None)
        idx = cp.asarray(np.concatenate([st.rows * i + np.arange(s.length) for i, s in enumerate(batch.seqs)]))
        return ForwardOutput(logits[idx], h[idx], {}, normed[idx] if batch.normed_rows else None)

    def _launch(self, st: _Static, batch: ForwardBatch, step: Any) -> None:
        """Capture `st`'s graph of `step()` on first use, then replay it over `batch`'s metadata; the current
        stream waits for the replay."""
        self._stream.wait_event(cp.cuda.get_current_stream().record())  # KV / state writes of earlier steps
        if st.graph is None:  # warm up on padding rows only, then capture (capturing executes nothing)
            self._upload(st, None)
            st.pool = cp.cuda.MemoryPool()
            if self.chains and st.rows == 1:
                from decapybara.backend.chain_tails import ChainTails

                st.chains = ChainTails()
            st.graph, st.outputs = capture_graph(step, self._stream, st.pool, warmup=1)
            if st.chains is not None:
                st.chains.commit()  # its chains' items to the capture's arrays, before the first replay
            self.stats["captures"] += 1
        self._upload(st, batch)
        st.graph.launch(self._stream)
        st.done = self._stream.record()
        cp.cuda.get_current_stream().wait_event(st.done)

    # ---- the MTP head's pass ------------------------------------------------------------------------------
    def mtp(self, batch: ForwardBatch, normed: Any, kv: KVCache, own: bool = False) -> tuple[Any, ...] | None:
        """The MTP head's greedy guess and its probability at each sequence's last pair ([len(batch.seqs)] device
        arrays, int64 and float32; with `own` also the head's final-normed states there, [len(batch.seqs), H]:
        what a chained guess pairs with), the head's KV written for every pair, through a graph of R pair rows a
        sequence, R the most pairs a sequence has, at least 2 (`QwenModel.mtp_forward`'s batch: a sequence's rows
        pair the tokens at p + 1 with `normed` [T, H], the main model's normed states at p; a sequence's rows past
        its pairs thrown away as a verification graph's); None where the batch cannot replay one (the caller runs
        the head eagerly): a sequence of more than MAX_ROWS pairs (or more than two where the decode kernel's
        passes are a launch a token), more sequences than the largest bucket, pages past max_pages, or a capture
        that failed before."""
        st = self._mtp_replay(batch, normed, kv, kv_only=False)
        if st is None:
            return None
        n = len(batch.seqs)
        return tuple(a[:n] for a in (st.outputs if own else st.outputs[:2]))

    def mtp_kv(self, batch: ForwardBatch, normed: Any, kv: KVCache) -> bool:
        """The head's KV-only pass (`QwenModel.mtp_kv`: a step whose drafts are withheld keeps the head's cache
        whole) over `mtp`'s pairs through a graph of its own, the same KV pages written; False where the batch
        cannot replay one (as `mtp`'s None: the caller runs it eagerly)."""
        return self._mtp_replay(batch, normed, kv, kv_only=True) is not None

    def _mtp_replay(self, batch: ForwardBatch, normed: Any, kv: KVCache, kv_only: bool) -> _Static | None:
        """`mtp` / `mtp_kv`'s graph replayed over `batch`'s pairs (built and captured on first use), or None."""
        seqs = batch.seqs
        rows = max([2, *(s.length for s in seqs)])
        if not seqs or len(seqs) > max(self.buckets) or rows > MAX_ROWS or not self._tables_fit(batch) \
                or not self._takes_rows(kv, rows):
            self.stats["mtp_eager"] += 1
            return None
        key = ("mtpkv" if kv_only else "mtp", self._bucket(len(seqs)), self._splits(batch, kv, rows=rows), rows)
        if key in self.stats["failures"]:
            self.stats["mtp_eager"] += 1
            return None
        try:
            st = self._graphs.get(key)
            if st is None:
                st = self._graphs[key] = self._build(*key[1:], page_size=batch.page_size, kv=kv, mtp=True)
            # the pairs' hidden rows into the graph's input (the current stream: after the last replay read it)
            if st.done is not None:
                cp.cuda.get_current_stream().wait_event(st.done)
            st.hidden[cp.asarray(np.concatenate([rows * i + np.arange(s.length) for i, s in enumerate(seqs)]))] \
                = normed
            self._launch(st, batch, lambda: self._mtp_kv_step(st, kv) if kv_only else self._mtp_step(st, kv))
        except Exception as e:  # noqa: BLE001 - a failed capture: this key runs eagerly from now on
            self.stats["failures"][key] = f"{type(e).__name__}: {e}"
            self._graphs.pop(key, None)
            self.stats["mtp_eager"] += 1
            return None
        self.stats["mtp_kv_steps" if kv_only else "mtp_steps"] += 1
        return st

    def _mtp_head(self, st: _Static, kv: KVCache, layers: int | None = None) -> tuple[Any, Any, Any]:
        """(the head's residual stream after its first `layers` layers (default all) on every pair row, cos, sin)
        over the static buffers."""
        model = self.model
        self._seed_plans(st)
        cos, sin = self._cos_sin(st.dev64[1])
        h = model.mtp_layers(embedding_rows(model.w["model.embed_tokens.weight"], st.dev64[0]), st.hidden, st.batch,
                             kv, cos, sin, layers=layers)
        return h, cos, sin

    def _mtp_kv_step(self, st: _Static, kv: KVCache) -> tuple:
        """The head's KV-only pass over the static buffers: its layers before the last, then the last layer's keys
        and values at the rows' page slots (a throwaway row's on the pad page)."""
        h, cos, sin = self._mtp_head(st, kv, layers=self.model.cfg.mtp_num_hidden_layers - 1)
        self.model.mtp_kv_tail(h, st.batch, kv, cos, sin, st.dev64[2])
        return ()

    def _mtp_step(self, st: _Static, kv: KVCache) -> tuple[Any, Any, Any]:
        """The MTP head over the static buffers: its layers on every pair row, its logits at each sequence's last
        pair (`last`), their greedy guesses and probabilities (among `draft_head`'s ids), and the head's
        final-normed states there."""
        h, _, _ = self._mtp_head(st, kv)
        hn = self.model.mtp_normed(h[st.d32("last")])
        return (*self.model.draft_guesses(self.model.draft_logits(hn, self.draft_head), self.draft_head), hn)

    def _cos_sin(self, positions: Any) -> tuple[Any, Any]:
        """RoPE's cos and sin [R, rot / 2] at device positions [R] (QwenModel.rotary's, scaled alike)."""
        freqs = positions.astype(cp.float32)[:, None] * self._inv_freq[None, :]  # [R, rot/2]
        cos, sin = cp.cos(freqs), cp.sin(freqs)
        if self.model.rotary.attention_factor != 1.0:
            fac = np.float32(self.model.rotary.attention_factor)
            cos, sin = cos * fac, sin * fac
        return cos, sin

    def _upload(self, st: _Static, batch: ForwardBatch | None) -> None:
        if st.done is not None:
            st.done.synchronize()  # the previous replay's copies have read the staging buffers
        self._fill(st, batch)
        st.dev64.set(st.host64, stream=self._stream)
        st.dev32.set(st.host32, stream=self._stream)
        st.done = self._stream.record()

    def _build(self, bucket: int, splits: int, rows: int, page_size: int, kv: KVCache, mtp: bool = False) -> _Static:
        from decapybara.backend.cupy_attention import AttentionPlan
        from decapybara.backend.cupy_deltanet import RunPlan

        rpw, tiles, block_m = self._row_tiles(kv, rows)
        nrows = bucket * rows
        one = rows > 1 and self._one_pass(kv)  # every token's decode pass in one launch: rows x bucket sequences
        two = rows == 2 and self._token_passes(kv) and not one  # a second decode pass: the draft rows' metadata ("_b")
        if not self._takes_rows(kv, rows):
            raise GraphUnsupported(f"{rows} rows a sequence need the one-pass decode attention (verify_one_pass)")
        nseq = rows * bucket if one else bucket  # the attention plan's (one-token) sequences
        # runs: a sequence's, then (verification) its throwaway rows'; segments: up to `rows` a sequence (cut at
        # its checkpoints), one its throwaway rows'
        nruns, nsegs = (bucket, bucket) if rows == 1 else (2 * bucket, (rows + 1) * bucket)
        nwork = nseq * tiles * splits
        nred = nseq * tiles if splits > 1 else 0
        shapes = {"seq_info": (nseq, 3), "tables": (bucket, self.max_pages), "work": (nwork, 5),
                  "reduce": (nred, 4), "runs": (nruns, 5), "segs": (nsegs, 2),
                  "last": (bucket if mtp else 0,),  # an MTP graph: each sequence's last pair row
                  "seq_info_b": (bucket if two else 0, 3), "work_b": (nwork if two else 0, 5),
                  "reduce_b": (nred if two else 0, 4)}
        views, off = {}, 0
        for name, shape in shapes.items():
            views[name] = (off, shape)
            off += int(np.prod(shape))
        host64, host32 = cupyx.empty_pinned((3, nrows), np.int64), cupyx.empty_pinned(off, np.int32)
        dev64, dev32 = cp.zeros((3, nrows), cp.int64), cp.zeros(off, cp.int32)
        chunks = [SeqChunk(rows * i, rows, 0, np.zeros(0, np.int32), i) for i in range(bucket)]
        placeholder = ForwardBatch(np.zeros(nrows, np.int64), np.zeros(nrows, np.int64), chunks,
                                   np.arange(nrows), page_size)
        segments = [DeltaNetSegment(rows * i, rows, i) for i in range(bucket)]
        st = _Static(bucket, splits, rows, tiles, block_m, host64, host32, dev64, dev32, views, placeholder,
                     segments)
        # decode batches: the decode kernel or the general one; verification: the decode kernel once over every
        # token (`one`) or twice (two rows: its draft rows' pass the plan's `rows`, which `cupy_attention.attention`
        # runs after it), else the prefill kernel or the general one
        dec = self._decode_launch(kv) if rows == 1 or one or two else None
        if one:
            st.token_tables = cp.zeros((nseq, self.max_pages), cp.int32)

        def attn(suffix: str, sub: Any) -> Any:
            tables = st.token_tables if one else st.d32("tables")
            return _plan(AttentionPlan, seq_info=st.d32("seq_info" + suffix), block_tables=tables,
                         max_pages=self.max_pages, work=st.d32("work" + suffix), reduce=st.d32("reduce" + suffix),
                         num_work=nwork, num_reduce=nred, num_parts=nwork if splits > 1 else 0, rows_per_warp=rpw,
                         slots=dev64[2], decode=dec, prefill=self._verify_launch(kv) if rows > 1 and dec is None
                         else None, dequant=None, rows=sub)

        st.attn_plan = attn("", attn("_b", None) if two else None)
        st.kv_bits = _kv_bits(kv)
        if mtp:
            st.mtp, st.hidden = True, cp.zeros((nrows, self.model.cfg.hidden_size), cp.float32)
            return st
        ckpt = None
        if rows > 1 and self.model.cfg.linear_layers:  # every checkpoint: a batch's real sequences index them
            ckpt = self._checkpoints()
        st.run_plan = _plan(RunPlan, runs=st.d32("runs"), segs=st.d32("segs"), num_runs=nruns, max_len=rows,
                            snapshot_keys=[], chunk_src=None, chunk_work=None,  # no chunked work
                            snap_bufs=ckpt, device_keys=frozenset())
        return st

    def _checkpoints(self) -> dict[int, tuple[Any, Any]]:
        """The verification graphs' checkpoint buffers, allocated once (outside every graph's pool): per linear
        layer (conv [max bucket, conv_dim, k - 1], recurrent [max bucket, Hv, dk, dv]) float32; the state of
        sequence i after its d-th row (d from 0) of a graph of R rows a sequence goes to state i (R - 1) + d."""
        if self._ckpt is None:
            cfg, n = self.model.cfg, max(self.buckets)
            shape_c = (n, cfg.linear_conv_dim, cfg.linear_conv_kernel_dim - 1)
            shape_r = (n, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
            self._ckpt = {j: (cp.zeros(shape_c, cp.float32), cp.zeros(shape_r, cp.float32))
                          for j in cfg.linear_layers}
        return self._ckpt

    def checkpoint_bytes(self) -> int:
        """Device bytes of the verification checkpoints (0 until the first verification graph)."""
        return sum(c.nbytes + r.nbytes for c, r in (self._ckpt or {}).values())

    def _fill(self, st: _Static, batch: ForwardBatch | None) -> None:
        """This step's metadata into the pinned staging buffers (padding rows after the real ones; every row
        is padding when `batch` is None: the capture's warm-up touches only the pad page and slot)."""
        seqs = batch.seqs if batch is not None else []
        n, b, ps, rows = len(seqs), st.bucket, st.batch.page_size, st.rows
        pad_slot_kv = self.pad_page * ps
        ids, pos, slots = st.host64
        ids[:], slots[:] = 0, pad_slot_kv
        pos[:] = np.tile(np.arange(rows), b)  # padding sequences: tokens 0 .. rows - 1 of the pad page
        if rows > 1:
            slots[:] += pos % ps
        ctx = np.zeros(b, np.int64)
        if batch is not None:
            ctx[:n] = [s.context for s in seqs]
            if rows == 1:
                ids[:n], pos[:n], slots[:n] = batch.token_ids, batch.positions, batch.slot_mapping
            else:  # sequence i's rows from R i; throwaway rows: the next positions, their KV to the pad page
                for i, s in enumerate(seqs):
                    r, k = rows * i, s.length
                    ids[r:r + k] = batch.token_ids[s.start:s.end]
                    pos[r:r + k] = batch.positions[s.start:s.end]
                    slots[r:r + k] = batch.slot_mapping[s.start:s.end]
                    ids[r + k:r + rows] = 0
                    pos[r + k:r + rows] = s.total + np.arange(rows - k)
                    slots[r + k:r + rows] = pad_slot_kv + np.arange(rows - k) % ps
        tables = st.h32("tables")
        tables[:] = self.pad_page
        for i, s in enumerate(seqs):
            tables[i, :len(s.block_table)] = s.block_table
        # keys up to each tile's last real token: a throwaway row's own key (on the pad page where the sequence's
        # pages end at its last token) stays out of every tile, so a real row never multiplies pad values by its
        # zero weight (0 x NaN); the throwaway row sees the sequence's keys only
        length = np.full(b, rows)
        length[:n] = [s.length for s in seqs]
        if st.token_tables is not None or st.attn_plan.rows is not None:  # a decode pass a token
            # token j of sequence i: one token at row R i + j after ctx + j keys, over keys to its own (a throwaway
            # row's to the sequence's last); the plan's sequence j x b + i in one pass, else pass j's ("", "_b")
            j = np.arange(rows)[:, None]
            start = np.arange(b) * rows + j  # [R, b]
            before = ctx + j  # [R, b]
            kend = ctx + np.minimum(j + 1, length)  # [R, b]
            passes = [("", slice(None))] if st.token_tables is not None else [("", 0), ("_b", 1)]
            for suffix, j in passes:
                info = st.h32("seq_info" + suffix).reshape(-1, b, 3)
                info[..., 0], info[..., 1], info[..., 2] = start[j], 1, before[j]
                self._fill_work(st, np.repeat(kend[j].reshape(-1), st.tiles).reshape(-1, st.tiles), suffix)
        else:
            info = st.h32("seq_info")
            info[:, 0], info[:, 1], info[:, 2] = np.arange(b) * rows, rows, ctx
            g = self.model.cfg.num_attention_heads // self.model.cfg.num_key_value_heads
            last = (np.minimum(rows * g, (np.arange(st.tiles) + 1) * st.block_m) - 1) // g  # a tile's last token
            self._fill_work(st, ctx[:, None] + np.minimum(last[None, :] + 1, length[:, None]), "")
        if st.mtp:
            last = st.h32("last")
            last[:] = np.arange(b) * rows
            for i, s in enumerate(seqs):
                last[i] += s.length - 1
        elif rows == 1:
            runs = st.h32("runs")
            runs[:, 0], runs[:, 1], runs[:, 3], runs[:, 4] = np.arange(b), 1, np.arange(b), 1
            runs[:, 2] = self.pad_slot if self.pad_slot is not None else 0
            if self.model.cfg.linear_layers and n:
                runs[:n, 2] = [s.state_slot for s in seqs]
            segs = st.h32("segs")
            segs[:, 0], segs[:, 1] = 1, -1
        else:
            self._fill_verify_runs(st, seqs)

    @staticmethod
    def _fill_work(st: _Static, kend: np.ndarray, suffix: str) -> None:
        """Attention work items (and split-K reduce items) of every plan sequence's tiles over keys [0, kend[seq,
        tile]) into views "work" / "reduce" + `suffix`: `splits` ranges a tile, of whole BLOCK_N-key tiles.
        kend: [plan sequences (the bucket's, or R times that: `_one_pass`), tiles]."""
        b, tiles, block_m, sp = kend.shape[0], st.tiles, st.block_m, st.splits
        kend = np.repeat(kend.reshape(-1), sp)  # [b * tiles * sp]
        per_split = -(-kend // sp)
        chunk = -(-per_split // BLOCK_N) * BLOCK_N
        part = np.tile(np.arange(sp), b * tiles)
        work = st.h32("work" + suffix)
        work[:, 0] = np.repeat(np.arange(b), tiles * sp)
        work[:, 1] = np.tile(np.repeat(np.arange(tiles) * block_m, sp), b)
        work[:, 2] = np.minimum(part * chunk, kend)
        work[:, 3] = np.minimum((part + 1) * chunk, kend)
        work[:, 4] = np.arange(b * tiles * sp) if sp > 1 else -1
        if sp > 1:
            red = st.h32("reduce" + suffix)
            red[:, 0] = np.repeat(np.arange(b), tiles)
            red[:, 1] = np.tile(np.arange(tiles) * block_m, b)
            red[:, 2] = np.arange(b * tiles) * sp
            red[:, 3] = sp

    def _fill_verify_runs(self, st: _Static, seqs: list[SeqChunk]) -> None:
        """A verification graph's DeltaNet runs (R rows a sequence): runs [0, b) sequence i's rows from R i (a
        padding sequence's R on the pad slot), its segments from R i, cut after each row whose snapshot is asked
        for (the d-th row from 0 into checkpoint i (R - 1) + d); runs [b, 2b) the throwaway rows, each on the pad
        slot: rows R i + k .. where sequence i has k < R tokens, else none (no rows, one segment ending at 0: the
        kernels leave the state as it is), segment R b + i."""
        b, rows = st.bucket, st.rows
        pad = self.pad_slot if self.pad_slot is not None else 0
        runs, segs = st.h32("runs"), st.h32("segs")
        first = np.arange(b) * rows
        runs[:b, 0], runs[:b, 1], runs[:b, 2], runs[:b, 3], runs[:b, 4] = first, rows, pad, first, 1
        runs[b:, 0], runs[b:, 1], runs[b:, 2] = first + rows - 1, 0, pad
        runs[b:, 3], runs[b:, 4] = rows * b + np.arange(b), 1
        segs[:] = -1
        segs[first, 0] = rows
        segs[rows * b:, 0] = 0
        for i, s in enumerate(seqs):
            k, base = s.length, s.total - s.length
            runs[i, 1] = k
            if self.model.cfg.linear_layers:
                runs[i, 2] = s.state_slot
            cuts = sorted(q - base for q in s.snapshot_at if q < s.total)  # rows after which a checkpoint is taken
            for n, e in enumerate(cuts):
                segs[first[i] + n] = (e, i * (rows - 1) + e - 1)
            segs[first[i] + len(cuts)] = (k, -1)
            runs[i, 4] = len(cuts) + 1
            if k < rows:
                runs[b + i, 0], runs[b + i, 1], segs[rows * b + i, 0] = first[i] + k, rows - k, rows - k

    def _seed_plans(self, st: _Static) -> None:
        backend, cfg = self.model.backend, self.model.cfg
        if not (hasattr(backend, "_attn") and hasattr(backend, "_runs")):
            raise GraphUnsupported(f"backend {type(backend).__name__} has no attention / DeltaNet plan caches")
        backend._attn = (st.batch, (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, *st.kv_bits),
                         st.attn_plan)
        backend._runs = (st.segments, st.run_plan)
        if st.token_tables is not None:  # (inside the captured step: each replay copies this step's tables)
            st.token_tables.reshape(st.rows, st.bucket, -1)[...] = st.d32("tables")[None]

    def _step(self, st: _Static, kv: KVCache, states: StatePool | None) -> tuple[Any, Any]:
        """The decode forward over the static buffers (QwenModel.forward's loop, graph-safe inputs)."""
        model, cfg, ops, w = self.model, self.model.cfg, self.model.backend, self.model.w
        self._seed_plans(st)
        ids, positions = st.dev64[0], st.dev64[1]
        cos, sin = self._cos_sin(positions)
        h = embedding_rows(w["model.embed_tokens.weight"], ids)  # [B, H]
        h = model.decoder_layers(h, lambda p, i, inputs: model._attention(p, i, inputs, st.batch, kv, cos, sin),
                                 lambda p, i, inputs: model._deltanet(p, i, inputs, states, st.segments, {}),
                                 st.chains)
        hidden = ops.rms_norm(h, w["model.norm.weight"], cfg.rms_norm_eps, cfg.norm_offset)
        logits = ops.linear(hidden, w["lm_head.weight"])
        if st.chains is not None and st.chains.err is not None:  # the chains' timeout flag to the host, last
            if st.flag is None:
                st.flag = cupyx.empty_pinned(1, np.uint32)
                st.flag[0] = 0
            cp.cuda.runtime.memcpyAsync(st.flag.ctypes.data, cupy_ops.dev_ptr(st.chains.err), 4, _D2H,
                                        cp.cuda.get_current_stream().ptr)
        return logits, h, hidden
