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
    MIN_KEYS_PER_SPLIT,
    decode_splits,
    graph_split_cap,
    rows_per_warp,
)
from decapybara.backend.base import DeltaNetSegment, KVCache, StatePool
from decapybara.backend.cupy_attention import decode_launch, decode_per_sm
from decapybara.backend.cupy_ops import sm_count
from decapybara.backend.cupy_ops_extra import embedding_rows
from decapybara.model.batch import ForwardBatch, SeqChunk
from decapybara.model.qwen import ForwardOutput, QwenModel

log = logging.getLogger(__name__)
_D2H = 2  # cudaMemcpyDeviceToHost


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
    The warm-up calls execute (mind side effects); the captured call does not until `graph.launch`."""
    with stream, cp.cuda.using_allocator(pool.malloc):
        for _ in range(warmup):
            fn()
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
    tiles: int  # attention tiles per sequence
    block_m: int  # query rows per tile
    host64: np.ndarray  # pinned int64 [3, bucket]: ids, positions, slots
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
    flag: Any = None  # pinned uint32 [1]: the chains' timeout flag, copied there at the end of each replay

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
    stats: dict[str, Any] = field(default_factory=lambda: {"graph_steps": 0, "eager_steps": 0, "captures": 0,
                                                           "failures": {}, "chain_timeouts": 0})
    _graphs: dict[tuple[int, int], _Static] = field(default_factory=dict)
    _stream: Any = None
    _inv_freq: Any = None

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
        reason = self.ineligible(batch)
        key = None if reason else (self._bucket(len(batch.seqs)), self._splits(batch, kv))
        if key is not None and key not in self.stats["failures"]:
            try:
                out = self._replay(key, batch, kv, states)
            except Exception as e:  # noqa: BLE001 - any capture failure means: this key runs eagerly
                self.stats["failures"][key] = f"{type(e).__name__}: {e}"
                self._graphs.pop(key, None)
            else:  # outside the try: once the graph ran, a failure here must not run the step a second time
                # a decode row's snapshot point is its one token's end: the state its slot holds after this step
                out.snapshots.update({(i, q): states.get(s.state_slot)
                                      for i, s in enumerate(batch.seqs) for q in s.snapshot_at})
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

    def ineligible(self, batch: ForwardBatch) -> str | None:
        """Why `batch` cannot replay a decode graph (None when it can)."""
        seqs = batch.seqs
        if not seqs or len(seqs) > max(self.buckets):
            return f"{len(seqs)} sequences (buckets {self.buckets})"
        if any(s.length != 1 or any(q != s.total for q in s.snapshot_at) for s in seqs):
            return "not a pure decode batch (prefill chunk)"
        if not np.array_equal(batch.logits_rows, np.arange(len(seqs))):
            return "logits not requested for exactly every row"
        if any(len(s.block_table) > self.max_pages
               or self.pad_page in s.block_table[:-(-s.total // batch.page_size)] for s in seqs):
            return "block table longer than max_pages or using the pad page"
        if self.model.cfg.linear_layers and any(s.state_slot in (None, self.pad_slot) for s in seqs):
            return "state slot missing or equal to pad_slot"
        return None

    # ---- graphs -----------------------------------------------------------------------------------------
    def _bucket(self, n: int) -> int:
        return min(b for b in self.buckets if b >= n)

    def _splits(self, batch: ForwardBatch, kv: KVCache) -> int:
        """Key splits per tile (a graph per value): the tensor-core decode kernel's by attn_plan.decode_splits
        for the bucket's launch (a power of two up to attn_plan.graph_split_cap), the general kernel's enough
        for short contexts too (64+ keys)."""
        longest = max(s.total for s in batch.seqs)
        shape = self._decode_launch(kv)
        if shape is not None:
            cfg = self.model.cfg
            per_split = self._bucket(len(batch.seqs)) * self._row_tiles()[1] * cfg.num_key_value_heads  # CTAs
            sms, per_sm = sm_count(), decode_per_sm(cfg.head_dim, _kv_bits(kv), shape)
            return decode_splits(per_split, longest, sms, pow2=True, cap=graph_split_cap(per_split, sms, per_sm),
                                 per_sm=per_sm)
        return 1 if longest < MIN_KEYS_PER_SPLIT else 4 if longest < 256 else 16 if longest < 16384 else 32

    def _row_tiles(self) -> tuple[int, int]:
        """(rows per warp, row tiles a sequence) of a decode step's attention: its g query heads per KV head."""
        cfg = self.model.cfg
        g = cfg.num_attention_heads // cfg.num_key_value_heads
        rpw = rows_per_warp(cfg.head_dim, g)
        return rpw, -(-g // (4 * rpw))

    def _decode_launch(self, kv: KVCache) -> tuple[int, int] | None:
        """The tensor-core decode kernel's launch shape on `kv` (cupy_attention.decode_launch); None: the
        general kernel."""
        cfg = self.model.cfg
        return decode_launch(cfg.num_attention_heads // cfg.num_key_value_heads, cfg.head_dim, _kv_bits(kv))

    def _replay(self, key: tuple[int, int], batch: ForwardBatch, kv: KVCache, states: StatePool | None) -> Any:
        st = self._graphs.get(key)
        if st is None:
            st = self._graphs[key] = self._build(*key, page_size=batch.page_size, kv=kv)
        self._stream.wait_event(cp.cuda.get_current_stream().record())  # KV / state writes of earlier steps
        if st.graph is None:  # warm up on padding rows only, then capture (capturing executes nothing)
            self._upload(st, None)
            st.pool = cp.cuda.MemoryPool()
            if self.chains:
                from decapybara.backend.chain_tails import ChainTails

                st.chains = ChainTails()
            st.graph, st.outputs = capture_graph(lambda: self._step(st, kv, states), self._stream, st.pool,
                                                 warmup=1)
            if st.chains is not None:
                st.chains.commit()  # its chains' items to the capture's arrays, before the first replay
            self.stats["captures"] += 1
        self._upload(st, batch)
        st.graph.launch(self._stream)
        st.done = self._stream.record()
        cp.cuda.get_current_stream().wait_event(st.done)
        self.stats["graph_steps"] += 1
        n = len(batch.seqs)
        logits, h, normed = st.outputs  # h: the residual stream before the final norm; normed: after it
        return ForwardOutput(logits[:n], h[:n], {}, normed[:n] if batch.normed_rows else None)

    def _upload(self, st: _Static, batch: ForwardBatch | None) -> None:
        if st.done is not None:
            st.done.synchronize()  # the previous replay's copies have read the staging buffers
        self._fill(st, batch)
        st.dev64.set(st.host64, stream=self._stream)
        st.dev32.set(st.host32, stream=self._stream)
        st.done = self._stream.record()

    def _build(self, bucket: int, splits: int, page_size: int, kv: KVCache) -> _Static:
        from decapybara.backend.cupy_attention import AttentionPlan
        from decapybara.backend.cupy_deltanet import RunPlan

        rpw, tiles = self._row_tiles()
        nwork = bucket * tiles * splits
        shapes = {"seq_info": (bucket, 3), "tables": (bucket, self.max_pages), "work": (nwork, 5),
                  "reduce": (bucket * tiles if splits > 1 else 0, 4), "runs": (bucket, 5), "segs": (bucket, 2)}
        views, off = {}, 0
        for name, shape in shapes.items():
            views[name] = (off, shape)
            off += int(np.prod(shape))
        host64, host32 = cupyx.empty_pinned((3, bucket), np.int64), cupyx.empty_pinned(off, np.int32)
        dev64, dev32 = cp.zeros((3, bucket), cp.int64), cp.zeros(off, cp.int32)
        chunks = [SeqChunk(i, 1, 0, np.zeros(0, np.int32), i) for i in range(bucket)]
        placeholder = ForwardBatch(np.zeros(bucket, np.int64), np.zeros(bucket, np.int64), chunks,
                                   np.arange(bucket), page_size)
        segments = [DeltaNetSegment(i, 1, i) for i in range(bucket)]
        st = _Static(bucket, splits, tiles, 4 * rpw, host64, host32, dev64, dev32, views, placeholder, segments)
        # decode batches: the decode kernel or the general one
        st.attn_plan = _plan(AttentionPlan, seq_info=st.d32("seq_info"), block_tables=st.d32("tables"),
                             max_pages=self.max_pages, work=st.d32("work"), reduce=st.d32("reduce"),
                             num_work=nwork, num_reduce=shapes["reduce"][0], num_parts=nwork if splits > 1 else 0,
                             rows_per_warp=rpw, slots=dev64[2], decode=self._decode_launch(kv),
                             prefill=None, dequant=None, rows=None)
        st.kv_bits = _kv_bits(kv)
        st.run_plan = _plan(RunPlan, runs=st.d32("runs"), segs=st.d32("segs"), num_runs=bucket, max_len=1,
                            snapshot_keys=[], chunk_src=None, chunk_work=None)  # decode: no chunked work
        return st

    def _fill(self, st: _Static, batch: ForwardBatch | None) -> None:
        """This step's metadata into the pinned staging buffers (padding rows after the real ones; every row
        is padding when `batch` is None: the capture's warm-up touches only the pad page and slot)."""
        seqs = batch.seqs if batch is not None else []
        n, b, ps = len(seqs), st.bucket, st.batch.page_size
        pad_slot_kv = self.pad_page * ps
        ids, pos, slots = st.host64
        ids[:], pos[:], slots[:] = 0, 0, pad_slot_kv
        ctx = np.zeros(b, np.int64)
        if batch is not None:
            ids[:n], pos[:n], slots[:n] = batch.token_ids, batch.positions, batch.slot_mapping
            ctx[:n] = [s.context for s in seqs]
        info = st.h32("seq_info")
        info[:, 0], info[:, 1], info[:, 2] = np.arange(b), 1, ctx
        tables = st.h32("tables")
        tables[:] = self.pad_page
        for i, s in enumerate(seqs):
            tables[i, :len(s.block_table)] = s.block_table
        tiles, block_m, sp = st.tiles, st.block_m, st.splits
        kend = np.repeat(ctx + 1, tiles * sp)  # [b * tiles * sp]
        per_split = -(-kend // sp)
        chunk = -(-per_split // BLOCK_N) * BLOCK_N
        part = np.tile(np.arange(sp), b * tiles)
        work = st.h32("work")
        work[:, 0] = np.repeat(np.arange(b), tiles * sp)
        work[:, 1] = np.tile(np.repeat(np.arange(tiles) * block_m, sp), b)
        work[:, 2] = np.minimum(part * chunk, kend)
        work[:, 3] = np.minimum((part + 1) * chunk, kend)
        work[:, 4] = np.arange(b * tiles * sp) if sp > 1 else -1
        if sp > 1:
            red = st.h32("reduce")
            red[:, 0] = np.repeat(np.arange(b), tiles)
            red[:, 1] = np.tile(np.arange(tiles) * block_m, b)
            red[:, 2] = np.arange(b * tiles) * sp
            red[:, 3] = sp
        runs = st.h32("runs")
        runs[:, 0], runs[:, 1], runs[:, 3], runs[:, 4] = np.arange(b), 1, np.arange(b), 1
        runs[:, 2] = self.pad_slot if self.pad_slot is not None else 0
        if self.model.cfg.linear_layers and n:
            runs[:n, 2] = [s.state_slot for s in seqs]
        segs = st.h32("segs")
        segs[:, 0], segs[:, 1] = 1, -1

    def _seed_plans(self, st: _Static) -> None:
        backend, cfg = self.model.backend, self.model.cfg
        if not (hasattr(backend, "_attn") and hasattr(backend, "_runs")):
            raise GraphUnsupported(f"backend {type(backend).__name__} has no attention / DeltaNet plan caches")
        backend._attn = (st.batch, (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, *st.kv_bits),
                         st.attn_plan)
        backend._runs = (st.segments, st.run_plan)

    def _step(self, st: _Static, kv: KVCache, states: StatePool | None) -> tuple[Any, Any]:
        """The decode forward over the static buffers (QwenModel.forward's loop, graph-safe inputs)."""
        model, cfg, ops, w = self.model, self.model.cfg, self.model.backend, self.model.w
        self._seed_plans(st)
        ids, positions = st.dev64[0], st.dev64[1]
        freqs = positions.astype(cp.float32)[:, None] * self._inv_freq[None, :]  # [B, rot/2]
        cos, sin = cp.cos(freqs), cp.sin(freqs)
        if model.rotary.attention_factor != 1.0:
            fac = np.float32(model.rotary.attention_factor)
            cos, sin = cos * fac, sin * fac
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
