"""Eager steps' layer tails as CUDA graphs ("piecewise" graphs): the Python launch cost of a prompt's short chunk
(and of a mixed step: a chunk beside other agents' decode rows) is about half in each layer's tail, the part after
its token mixer. That part's shapes depend on the step's row count alone, unlike the attention and DeltaNet
cores, whose plans follow the batch's sequences. So each tail (`QwenModel.block_tail`: the output projection,
the residual add and post-attention norm, the MLP, its residual add, the next layer's input norm and its input
products) is captured once per (layer, row bucket) over static buffers and replayed; the cores stay eager.

Per bucket of B rows (BUCKETS; steps of FUSED_ROWS + 1 to B rows) the static buffers are: two residual streams
h [B, H] float32 (layer i reads h[i % 2] and writes h[(i + 1) % 2], so a tail never reads what it writes and its
replay is idempotent), the next layer's input products [B, width] per (position in `layer_inputs`, dtype, width),
shared by the layers whose products have those (a layer's core reads them before the next tail writes them, in
stream order), and a mixer output buffer [B, width] per (dtype, width) that the step's core output is copied into
(`cudaMemcpyAsync`, device to device). A step of T rows uses the first T rows; the others are left from earlier steps (finite values, and every op of a tail works row
by row, so they never reach a real row). The tail runs over all B rows, so its products' launch plans are the B-row
ones: within float32 summation order of the eager step's T-row products, not byte-equal to them.

First use of a (layer, bucket, mixer buffer): the tail runs eagerly over the static buffers (the warm-up that
fills kernel and launch caches; its outputs are the step's), then is captured (`capture_graph`, without a second
warm-up) with its allocations served by one `_Arena` shared by all tails: graphs run one after another on one
stream, so their intermediates may share blocks (within a graph, only blocks of one stream's branch), and the
arena never hands a block back to CUDA (a CuPy pool frees its free blocks when the device runs out of memory, and
those are what earlier graphs still address). The
capture stream's split-K counters (`cupy_ops_extra._counters`) are made and zeroed before its first capture.

A capture that fails (or a warm-up, or a bucket's buffers) marks that bucket eager for the process, with the
reason in `stats["failures"]`; the warm-up's outputs stand. The tails' cuBLAS GEMMs (products past KEPT_ROWS over
weights that keep bf16 values, past DENSE_ROWS over others) run on the capture stream's own cuBLAS handle, bound
before its first capture (`blas`: CuPy's wrappers refuse cuBLAS calls during a capture). The last layer (its tail
adds into h with no norm after it) runs eagerly, and so does an MoE layer whose experts' `moe` reads its routing
on the host (`Backend.moe_captures`: the fp32 mode's float32 experts); the device `moe` of packed or bf16 experts
captures (padding rows route to experts too, row by row, and reach no real row). Each captured tail keeps the
output projection it was captured with and runs eagerly for another one; its norm,
MLP and next-layer input weights are the model's, fixed for the runner's life. A DeltaNet layer's two input
products fork to the backend's side stream and join inside the graph (`linear_pair`), as in decode graphs; the
side stream's split-K counters exist by then (the warm-up ran the same products eagerly).

`PiecewiseTails.start(model, h)` gives a `TailRun` for one forward, or None where the step's rows are not covered
(`QwenModel.forward(..., tails=...)`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import cupy as cp

from decapybara.backend import blas, cupy_ops, cupy_ops_extra
from decapybara.backend.cupy_ops_extra import FUSED_ROWS
from decapybara.model.qwen import Projection, QwenModel

# row counts of the captured tails (steps of FUSED_ROWS + 1 to 256 rows; a step pads its rows to the next bucket:
# at most a third more rows, a quarter from 64 on, where the products are cuBLAS GEMMs and the steps mostly bound
# by their GPU work)
BUCKETS = (16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256)
_D2D = 3  # cudaMemcpyDeviceToDevice


class _Arena:
    """Device memory for captured graphs: an allocator (`cupy.cuda.using_allocator`) whose blocks come from the
    default pool and are never given back; a freed block goes to a free list by (stream, size) and serves the
    next request of that size on that stream (the tails of one bucket ask for the same sizes in the same order).
    By stream, as CuPy's pool: inside a tail's graph a DeltaNet layer's second input product runs on a side
    stream beside the first (`linear_pair`), so a block the first frees must not serve the second."""

    def __init__(self) -> None:
        self.free: dict[tuple[int, int], list[Any]] = {}
        self.blocks = 0  # blocks held (taken from the default pool)
        self.bytes = 0

    def malloc(self, size: int) -> Any:
        size = -(-max(size, 1) // 512) * 512
        spare = self.free.setdefault((int(cp.cuda.get_current_stream().ptr), size), [])
        if spare:
            base = spare.pop()
        else:
            base = cp.get_default_memory_pool().malloc(size)
            self.blocks, self.bytes = self.blocks + 1, self.bytes + size
        # the lease is the memory's owner: when the last array using the memory goes, so does the lease, and
        # the block is free again
        mem = cp.cuda.memory.UnownedMemory(base.ptr, size, _Lease(spare, base), base.device_id)
        return cp.cuda.MemoryPointer(mem, 0)


class _Lease:
    """A block of an `_Arena` in use: back on its free list when this goes."""

    __slots__ = ("base", "spare")

    def __init__(self, spare: list[Any], base: Any) -> None:
        self.spare, self.base = spare, base

    def __del__(self) -> None:
        self.spare.append(self.base)


def _copy(dst: Any, src: Any) -> None:
    """dst[:] = src (both C-contiguous, same dtype and size) on the current stream, as one memcpy node in a capture."""
    assert dst.dtype == src.dtype and dst.size == src.size and dst.flags.c_contiguous and src.flags.c_contiguous
    if dst.nbytes:
        cp.cuda.runtime.memcpyAsync(cupy_ops.dev_ptr(dst), cupy_ops.dev_ptr(src), dst.nbytes, _D2D,
                                    cp.cuda.get_current_stream().ptr)


@dataclass
class _Bucket:
    """Static buffers of one row bucket (see the module docstring)."""

    rows: int
    h: list[Any]  # two float32 [rows, H]
    inputs: dict[tuple[int, Any, int], Any] = field(default_factory=dict)  # (position, dtype, width) -> [rows, width]
    core: dict[tuple[Any, int], Any] = field(default_factory=dict)  # (dtype, width) -> [rows, width]


@dataclass
class _Tail:
    """One captured tail: its graph and the output projection it was captured with."""

    graph: Any
    weight: Any
    bias: Any
    inputs: list[Any]  # the bucket's input buffers it writes (the next layer's `layer_inputs`)


@dataclass
class PiecewiseTails:
    """Layer tails of eager steps as CUDA graphs, per (layer, row bucket); see the module docstring."""

    buckets: tuple[int, ...] = BUCKETS
    stats: dict[str, Any] = field(default_factory=lambda: {"tail_replays": 0, "eager_tails": 0, "captures": 0,
                                                           "failures": {}})
    _buckets: dict[int, _Bucket] = field(default_factory=dict)
    _tails: dict[tuple[int, int, Any, int], _Tail] = field(default_factory=dict)
    _stream: Any = None
    _arena: Any = None

    def bucket(self, rows: int) -> int | None:
        """The bucket a step of `rows` rows replays in (None: not covered)."""
        if rows <= FUSED_ROWS or rows > max(self.buckets):
            return None
        return min(b for b in self.buckets if b >= rows)

    def start(self, model: QwenModel, h: Any) -> TailRun | None:
        """A run over one forward whose residual stream starts as h [T, H] float32, or None (not covered: T
        outside the buckets, a bucket whose capture failed)."""
        rows = self.bucket(h.shape[0])
        if rows is None or rows in self.stats["failures"]:
            return None
        b = self._buckets.get(rows)
        if b is None:
            try:
                b = _Bucket(rows, [cp.zeros((rows, h.shape[1]), cp.float32) for _ in range(2)])
            except Exception as e:  # noqa: BLE001 - e.g. out of memory: this bucket runs eagerly
                self.stats["failures"][rows] = f"buffers: {type(e).__name__}: {e}"
                return None
            self._buckets[rows] = b
        return TailRun(self, model, b, h)

    def moe_captures(self, model: QwenModel, i: int) -> bool:
        """Whether layer i's tail may be captured as far as its MLP goes: a dense MLP, or MoE experts whose
        `moe` the backend runs without host synchronisation (`Backend.moe_captures`)."""
        if not model.cfg.layer_is_moe(i):
            return True
        m = f"model.layers.{i}.mlp.experts"
        return model.backend.moe_captures(*(model.w[f"{m}.{p}"] for p in ("gate_proj", "up_proj", "down_proj")))

    def memory_bytes(self) -> int:
        """Device memory the tails hold: the buckets' static buffers and the captures' arena."""
        static = sum(a.nbytes for b in self._buckets.values() for a in (*b.h, *b.inputs.values(), *b.core.values()))
        return static + (self._arena.bytes if self._arena is not None else 0)

    def _capture(self, fn: Any) -> Any:
        from decapybara.backend.cuda_graph import capture_graph

        if self._stream is None:
            stream = cp.cuda.Stream(non_blocking=True)
            with stream:  # the capture stream's split-K counters, zeroed now, not by a memset inside one graph,
                cupy_ops_extra._counters()
                blas.bind(stream)  # and its cuBLAS handle, bound now (binding allocates)
            stream.synchronize()
            self._stream, self._arena = stream, _Arena()
        main = cp.cuda.get_current_stream()  # capture_graph orders the capture stream after it; joined back here
        try:
            graph, _ = capture_graph(fn, self._stream, self._arena, warmup=0)
        finally:
            main.wait_event(self._stream.record())
        self.stats["captures"] += 1
        return graph


class TailRun:
    """One forward's tails (`QwenModel.decoder_layers`): `tail(i, out, h)` for `QwenModel.block_tail`."""

    def __init__(self, tails: PiecewiseTails, model: QwenModel, b: _Bucket, h: Any):
        self.tails, self.model, self.b, self.t = tails, model, b, h.shape[0]
        self.static_h: Any = None  # the view of a static h this run last returned (what `tail` gets back)

    def tail(self, i: int, out: Any, h: Any) -> tuple[Any, Any]:
        model, cfg, b, t = self.model, self.model.cfg, self.b, self.t
        tails = self.tails
        if (i + 1 == cfg.num_hidden_layers or not tails.moe_captures(model, i) or not isinstance(out, Projection)
                or b.rows in tails.stats["failures"] or not isinstance(out.x, cp.ndarray) or out.x.ndim != 2):
            return self._eager(i, out, h)
        width = out.x.shape[1]
        cap = tails._tails.get((i, b.rows, out.x.dtype, width))
        if cap is not None and (cap.weight is not out.weight or cap.bias is not out.bias):
            return self._eager(i, out, h)  # another projection than the captured one (not expected)
        h_in, h_out = b.h[i % 2], b.h[(i + 1) % 2]
        if h is not self.static_h:  # the embedding's rows, or an eager tail's
            _copy(h_in[:t], cp.ascontiguousarray(h, dtype=cp.float32))
        core = b.core.get((out.x.dtype, width))
        if core is None:
            core = b.core[(out.x.dtype, width)] = cp.zeros((b.rows, width), out.x.dtype)
        _copy(core[:t], cp.ascontiguousarray(out.x))
        if cap is None:
            try:
                bufs = self._warm_up(i, out, core, h_in, h_out)
            except Exception as e:  # noqa: BLE001 - a tail these buffers cannot hold, out of memory: the bucket
                # runs eagerly (the warm-up wrote only static buffers)
                tails.stats["failures"][b.rows] = f"layer {i}: {type(e).__name__}: {e}"
                return self._eager(i, out, h)
            proj = Projection(core, out.weight, out.bias)

            def fn() -> None:
                inputs, h = model.block_tail(i, proj, h_in)
                _copy(h_out, cp.ascontiguousarray(h))
                for buf, a in zip(bufs, inputs, strict=True):
                    _copy(buf, cp.ascontiguousarray(a))

            try:
                graph = tails._capture(fn)
            except Exception as e:  # noqa: BLE001 - an uncapturable tail runs eagerly; the warm-up's outputs stand
                tails.stats["failures"][b.rows] = f"layer {i}: {type(e).__name__}: {e}"
            else:
                tails._tails[(i, b.rows, out.x.dtype, width)] = _Tail(graph, out.weight, out.bias, bufs)
        else:
            cap.graph.launch(cp.cuda.get_current_stream())
            tails.stats["tail_replays"] += 1
            bufs = cap.inputs
        self.static_h = h_out[:t]
        return [buf[:t] for buf in bufs], self.static_h

    def _eager(self, i: int, out: Any, h: Any) -> tuple[Any, Any]:
        """Layer i's tail run plainly (`QwenModel.block_tail`) on the step's own arrays."""
        self.tails.stats["eager_tails"] += 1
        self.static_h = None
        return self.model.block_tail(i, out, h)

    def _warm_up(self, i: int, out: Projection, core: Any, h_in: Any, h_out: Any) -> list[Any]:
        """The tail run eagerly over the static buffers (its outputs this step's); the bucket's input buffers of
        the next layer's input products it gives."""
        b = self.b
        inputs, h = self.model.block_tail(i, Projection(core, out.weight, out.bias), h_in)
        if not inputs or not all(isinstance(a, cp.ndarray) and a.ndim == 2 and a.shape[0] == b.rows for a in inputs):
            raise TypeError(f"layer {i}'s tail gave inputs of types {[type(a).__name__ for a in inputs or ()]}")
        _copy(h_out, cp.ascontiguousarray(h))
        bufs = []
        for j, a in enumerate(inputs):
            key = (j, a.dtype, a.shape[1])
            buf = b.inputs.get(key)
            if buf is None:
                buf = b.inputs[key] = cp.zeros(a.shape, a.dtype)
            _copy(buf, cp.ascontiguousarray(a))
            bufs.append(buf)
        self.tails.stats["eager_tails"] += 1
        return bufs

    def finish(self, h: Any) -> Any:
        """The residual stream after the last layer (a copy where it is a static buffer's rows)."""
        return h.copy() if h is self.static_h else h
