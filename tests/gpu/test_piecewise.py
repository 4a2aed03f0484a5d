"""Eager steps' layer tails replayed as CUDA graphs (`decapybara/backend/piecewise.py`; GPU only).

A forward with `PiecewiseTails` gives the eager forward's logits within float32 summation order (its tails run
their products over the bucket's rows) and the same greedy tokens, over steps that capture, steps that replay
with other inputs, chunks of other lengths in one bucket, mixed steps (a chunk beside decode rows), and steps the
buckets do not cover; a capture that fails leaves the bucket eager with the right results.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
from decapybara import kernels

if not kernels.has_cuda():
    pytest.skip("no CUDA device", allow_module_level=True)

from test_kernels_extra import assert_close

from decapybara.backend import piecewise
from decapybara.backend.cuda_factory import cuda_backend
from decapybara.backend.cupy_backend import CupyBackend
from decapybara.model import quant
from decapybara.model.batch import ForwardBatch
from decapybara.model.qwen import QwenModel
from decapybara.testing import quantized_matrices, tiny_checkpoint

pytestmark = pytest.mark.gpu
PAGE, PAGES = 8, 128


def checkpoint_of(family: str, fmt: str) -> tuple[Any, dict[str, Any]]:
    """(config, tensors) of `model_of`'s model: the tiny checkpoint, every matrix and expert stack quantised to
    `fmt` unless bf16."""
    family, _, variant = family.partition("/")
    cfg, tensors = tiny_checkpoint(family)
    if variant == "slot":
        inter = cfg.moe_intermediate_size
        cfg = dataclasses.replace(cfg, shared_expert_intermediate_size=inter)
        tensors = {k: (v[:inter] if k.endswith(("shared_expert.gate_proj.weight", "shared_expert.up_proj.weight"))
                       else v[:, :inter] if k.endswith("shared_expert.down_proj.weight") else v)
                   for k, v in tensors.items()}
    if fmt != "bf16":
        tensors = {k: quant.quantize(v, fmt) if v.ndim in (2, 3) and not k.endswith("conv1d.weight") else v
                   for k, v in tensors.items()}
    return cfg, tensors


def model_of(family: str, fmt: str) -> QwenModel:
    """bf16 weights (MoE experts: bf16 stacks) on the bf16 backend, or every matrix and expert stack in `fmt` on
    the packed backend. "qwen3_5_moe_text/slot": that model with its shared expert cut to the routed experts'
    width, so that its MoE layers run it as one expert more of their stacks (`FusedMoE.shared_slot`)."""
    cfg, tensors = checkpoint_of(family, fmt)
    return QwenModel.from_tensors(cfg, CupyBackend("bf16") if fmt == "bf16" else cuda_backend("bf16"), tensors)


def test_slot_variant_runs_the_shared_expert_in_the_stacks():
    """The "/slot" model's MoE layers stack the shared expert with the routed ones; the plain tiny model's (a
    shared expert wider than the routed ones) cannot."""
    for fmt in ("bf16", "mxfp4"):
        assert all(f.shared_slot for f in model_of("qwen3_5_moe_text/slot", fmt).fused_moe.values()), fmt
        assert not any(f.shared_slot for f in model_of("qwen3_5_moe_text", fmt).fused_moe.values()), fmt


class Pools:
    """KV pages and DeltaNet states of two sequences (slots 0 and 1, pages 0-63 and 64-127)."""

    def __init__(self, model: QwenModel):
        self.kv = model.new_kv_cache(PAGES, PAGE)
        self.states = model.new_state_pool(3) if model.cfg.linear_layers else None
        if self.states is not None:
            self.states.reset(0)
            self.states.reset(1)


def step(model: QwenModel, pools: Pools, entries: list[tuple[np.ndarray, int, int]], tails=None) -> np.ndarray:
    """One forward of (new tokens, tokens already cached, sequence 0 / 1); logits of every row (host)."""
    tables = [np.arange(64, dtype=np.int32), np.arange(64, 128, dtype=np.int32)]
    b = ForwardBatch.build([(ids, start, tables[s], s) for ids, start, s in entries], PAGE, logits="all")
    return cp.asnumpy(model.forward(b, pools.kv, pools.states, tails=tails).logits)


# (sequence 0's new tokens, sequence 1's new tokens) of each step: 20 rows (bucket 24, captured), 22 rows (the
# same bucket, replayed on new inputs), a mixed step of 30 + 1 rows (bucket 32), a 5-token chunk (eager: below
# the buckets), 12 + 1 rows (bucket 16), 18 + 1 (bucket 24, replayed after other buckets ran), 70 + 1 (bucket 80:
# cuBLAS products, captured), 13 + 1 (bucket 16) and 30 + 1 (bucket 32): buckets replayed after others were
# captured, the last-captured one first; 130 + 130 (eager: above the buckets), 60 + 10 (bucket 80 replayed)
STEPS = [(20, 0), (0, 22), (30, 1), (5, 0), (12, 1), (18, 1), (70, 1), (13, 1), (30, 1), (130, 130), (60, 10)]


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3", "qwen3_5_moe_text", "qwen3_5_moe_text/slot"])
@pytest.mark.parametrize("fmt", ["mxfp4", "bf16"])
def test_tails_give_the_eager_logits(family, fmt):
    """MoE layers' tails capture too (the device `moe` over packed or bf16 expert stacks; /slot: the shared expert
    as one expert more of them)."""
    model = model_of(family, fmt)
    rng = np.random.default_rng(zlib.crc32(f"piecewise-{family}-{fmt}".encode()))
    eager, graphs = Pools(model), Pools(model)
    tails = piecewise.PiecewiseTails()
    done = [0, 0]
    for n0, n1 in STEPS:
        entries = []
        for s, n in ((0, n0), (1, n1)):
            if n:
                entries.append((rng.integers(0, 512, n), done[s], s))
                done[s] += n
        ref = step(model, eager, entries)
        got = step(model, graphs, entries, tails)
        rows = sum(len(e[0]) for e in entries)
        assert_close(got, ref, 2e-3, f"{family} {fmt}: {rows} rows")
        assert (got.argmax(-1) == ref.argmax(-1)).all(), f"{family} {fmt}: greedy tokens at {rows} rows"
    s = tails.stats
    tail_layers = model.cfg.num_hidden_layers - 1  # the last layer's tail runs eagerly
    assert s["failures"] == {}, s["failures"]
    assert s["captures"] == 4 * tail_layers  # buckets 24, 32, 16, 80
    assert s["tail_replays"] == 5 * tail_layers  # steps 2 and 6 (bucket 24), 8 (16), 9 (32) and 11 (80)
    assert s["eager_tails"] == 4 * tail_layers + 9  # the warm-ups, the last layer of the nine covered steps
    static = sum(2 * b * model.cfg.hidden_size * 4 for b in (16, 24, 32, 80))  # each bucket's two residual streams
    assert tails.memory_bytes() > static + tails._arena.bytes  # and the next layer's rows, the mixers' outputs


def test_tails_over_kept_bf16_weights():
    """Over weights that keep bf16 values (`prefill_weights=bf16`), a bucket past KEPT_ROWS has its products on
    cuBLAS over those values: captured on the capture stream's own handle (`blas`) and replayed like the skinny
    kernels' buckets, with the eager forward's logits."""
    cfg, tensors = tiny_checkpoint("qwen3_5_text")
    tensors = quantized_matrices(tensors, "mxfp4")
    model = QwenModel.from_tensors(cfg, cuda_backend("bf16", prefill_weights="bf16"), tensors)
    tails = piecewise.PiecewiseTails()
    rng = np.random.default_rng(9)
    eager, graphs = Pools(model), Pools(model)
    done = 0
    for n in (40, 20, 44, 22):  # buckets 48 (cuBLAS), 24 (skinny), then each again
        ids = rng.integers(0, 512, n)
        ref = step(model, eager, [(ids, done, 0)])
        got = step(model, graphs, [(ids, done, 0)], tails)
        done += n
        assert_close(got, ref, 2e-3, f"{n} rows over kept bf16 weights")
        assert (got.argmax(-1) == ref.argmax(-1)).all(), f"greedy tokens at {n} rows"
    assert tails.stats["failures"] == {}, tails.stats["failures"]
    assert tails.stats["captures"] == 2 * (cfg.num_hidden_layers - 1), tails.stats  # buckets 48 and 24
    assert tails.stats["tail_replays"] == 2 * (cfg.num_hidden_layers - 1), tails.stats  # the 44- and 22-row steps


def test_arena_reuses_blocks_and_never_gives_them_back():
    """The captures' allocator: a freed block serves the next request of its (rounded) size, blocks of other sizes
    are new, and a block in use is never handed out twice."""
    arena = piecewise._Arena()
    a = arena.malloc(1000)
    first = a.ptr
    b = arena.malloc(1000)
    assert b.ptr != first and arena.blocks == 2 and arena.bytes == 2 * 1024
    del a
    c = arena.malloc(1020)  # the same 1,024-byte block, free again
    assert c.ptr == first and arena.blocks == 2
    d = arena.malloc(4096)
    assert d.ptr not in (b.ptr, c.ptr) and arena.blocks == 3
    del b, c, d
    assert sorted(len(v) for v in arena.free.values()) == [1, 2] and arena.blocks == 3


def test_arena_keeps_each_streams_blocks_to_that_stream():
    """A block freed by one stream's work never serves another stream's request (inside a tail's graph, the side
    stream's product runs beside the main stream's)."""
    arena = piecewise._Arena()
    side = cp.cuda.Stream(non_blocking=True)
    a = arena.malloc(2048)
    first = a.ptr
    del a  # freed on the current stream
    with side:
        b = arena.malloc(2048)
    assert b.ptr != first and arena.blocks == 2
    c = arena.malloc(2048)  # the current stream's own block again
    assert c.ptr == first and arena.blocks == 2


def test_rows_outside_the_buckets_run_eagerly():
    tails = piecewise.PiecewiseTails()
    assert [tails.bucket(n) for n in (1, 8, 9, 16, 17, 33, 64, 65, 129, 256, 257)] == \
        [None, None, 16, 16, 24, 48, 64, 80, 160, 256, None]


@pytest.mark.parametrize("family", ["qwen3_5_text"])
def test_a_failed_capture_leaves_the_bucket_eager(family, monkeypatch):
    model = model_of(family, "mxfp4")
    tails = piecewise.PiecewiseTails()

    def refuse(fn):
        raise RuntimeError("capture refused")

    monkeypatch.setattr(tails, "_capture", refuse)
    rng = np.random.default_rng(5)
    eager, graphs = Pools(model), Pools(model)
    done = 0
    for n in (20, 23):
        ids = rng.integers(0, 512, n)
        ref = step(model, eager, [(ids, done, 0)])
        got = step(model, graphs, [(ids, done, 0)], tails)
        done += n
        assert_close(got, ref, 2e-3, f"{n} rows after a failed capture")
    assert list(tails.stats["failures"]) == [24] and "capture refused" in tails.stats["failures"][24]
    assert tails.stats["captures"] == tails.stats["tail_replays"] == 0
