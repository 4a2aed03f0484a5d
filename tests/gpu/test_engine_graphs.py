"""The engine's decode steps as CUDA graphs (GPU only): greedy generation through the Engine on the cupy
backend with `cuda_graphs` on equals the same engine with graphs off and the numpy reference, token for token,
with most decode steps replayed as graphs.

Several prompts of different lengths and budgets batched (chunked prefill beside decodes, the batch shrinking
through the buckets as sequences finish, one context past 256 tokens for split attention), a tight pool
(pauses and resumes around graph steps), and the server's backend (`cuda_backend`: packed quantised weights).
"""

from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
from decapybara import kernels

if not kernels.has_cuda():
    pytest.skip("no CUDA device", allow_module_level=True)

from decapybara.backend.cuda_factory import cuda_backend
from decapybara.backend.cupy_backend import CupyBackend
from decapybara.backend.numpy_backend import NumpyBackend
from decapybara.config import EngineConfig
from decapybara.engine.engine import Engine
from decapybara.engine.sampling import SamplingParams
from decapybara.model import quant
from decapybara.model.qwen import QwenModel
from decapybara.testing import tiny_checkpoint

pytestmark = pytest.mark.gpu

CASES = {  # name -> (prompt lengths, max_tokens per prompt, engine settings)
    "roomy": ((5, 23, 41, 270, 12), (64, 48, 56, 64, 50), {"num_pages": 160}),
    "tight": ((5, 23, 41, 30, 12), (64, 48, 56, 64, 50), {"num_pages": 30, "enable_prefix_cache": False}),
}


def build(family: str, backend, tensors: dict | None = None) -> QwenModel:
    cfg, base = tiny_checkpoint(family)
    return QwenModel.from_tensors(cfg, backend, tensors or base)


def workload(case: str) -> tuple[list[list[int]], list[SamplingParams], EngineConfig]:
    lengths, budgets, extra = CASES[case]
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, 512, n).tolist() for n in lengths]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in budgets]
    cfg = EngineConfig(page_size=8, max_batch_tokens=32, max_slots=6, loop_guard="off", **extra)
    return prompts, params, cfg


def assert_same(got: list[list[int]], ref: list[list[int]], name: str) -> None:
    for i, (a, b) in enumerate(zip(got, ref)):
        first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        assert a == b, f"{name} prompt {i}: first difference at token {first}: {a[first:first + 4]} vs " \
                       f"{b[first:first + 4]}"


def assert_graphs_ran(e: Engine) -> None:
    stats = e.snapshot_stats()
    g = stats["graphs"]
    print(f"graphs {g}, failures {stats['graph_failures']}, steps {e.stats.steps}, pauses {e.stats.pauses}")
    assert g["enabled"] and g["graph_steps"] > 0 and g["captures"] > 0, g
    assert not stats["graph_failures"], stats["graph_failures"]
    assert g["graph_steps"] + g["eager_steps"] == e.stats.steps


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3"])
@pytest.mark.parametrize("case", list(CASES))
def test_graph_decode_generates_the_eager_tokens(family, case):
    prompts, params, cfg = workload(case)
    ref = Engine(build(family, NumpyBackend()), cfg).generate(prompts, params)
    assert [len(r) for r in ref] == [p.max_tokens for p in params]
    eager = Engine(build(family, CupyBackend("fp32")), cfg.replace(cuda_graphs=False))
    graphs = Engine(build(family, CupyBackend("fp32")), cfg)
    assert eager.runner.graphs is None and graphs.runner.graphs is not None, graphs.runner.graph_error
    assert graphs.blocks.num_pages == cfg.num_pages - 1
    out_eager, out_graphs = eager.generate(prompts, params), graphs.generate(prompts, params)
    assert_same(out_eager, ref, f"{family} {case} eager")
    assert_same(out_graphs, ref, f"{family} {case} graphs")
    assert_graphs_ran(graphs)
    if case == "tight":
        assert graphs.stats.pauses > 0 and graphs.stats.resumes == graphs.stats.pauses


def test_graph_decode_snapshots_serve_the_next_turn():
    """Decode steps that cross a snapshot boundary take the hybrid state from the graph path (no eager step):
    the snapshots equal those of an engine with graphs off, and a second turn whose prompt continues the first
    turn's prompt and output reuses that prefix and generates the tokens of a numpy engine that recomputes it."""
    cfg = EngineConfig(page_size=8, max_batch_tokens=32, max_slots=6, loop_guard="off", num_pages=160,
                       snapshot_interval=8)
    prompt = np.random.default_rng(5).integers(0, 512, 13).tolist()
    p1 = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engines = {g: Engine(build("qwen3_5_text", CupyBackend("fp32")), cfg.replace(cuda_graphs=g)) for g in (False, True)}
    first = {g: e.generate([prompt], p1)[0] for g, e in engines.items()}
    assert first[True] == first[False]
    g = engines[True].runner.graph_stats()
    assert g["eager_steps"] == 1 and g["graph_steps"] == 39, g  # the prefill alone ran eagerly
    snaps = {g: e.blocks.snapshots for g, e in engines.items()}
    assert len(snaps[True]) >= 6 and snaps[True].keys() == snaps[False].keys()
    for h, (s_graph, _) in snaps[True].items():
        s_eager = snaps[False][h][0]
        for a, b in zip(s_graph.conv + s_graph.recurrent, s_eager.conv + s_eager.recurrent):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    second = prompt + first[True] + [3, 1, 4, 1, 5]
    p2 = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = Engine(build("qwen3_5_text", NumpyBackend()), cfg.replace(enable_prefix_cache=False)).generate([second], p2)
    for g, e in engines.items():
        before = e.stats.reused_prompt_tokens
        assert e.generate([second], p2) == ref, f"graphs {g}"
        assert e.stats.reused_prompt_tokens - before >= 48, e.stats  # up to the first turn's last computed token


def test_server_backend_with_packed_weights_and_graphs():
    """`cuda_backend` (PackedWeightsMixin over CupyBackend) with quantised matrices: graphs on generate the
    tokens of graphs off on the same backend (the packed kernels round activations to bf16, so the float32
    numpy reference is only a loose check here: its first tokens)."""
    _, tensors = tiny_checkpoint("qwen3_5_text")
    fmts = ["mxfp8", "mxfp4", "nvfp4", "mxfp6"]
    q = {name: (quant.quantize(w, fmts[i % 4]) if w.ndim >= 2 and not name.endswith("conv1d.weight") else w)
         for i, (name, w) in enumerate(sorted(tensors.items()))}
    backend = cuda_backend("fp32")
    assert isinstance(backend, CupyBackend) and backend.name == "cupy"
    prompts, params, cfg = workload("roomy")
    ref = Engine(build("qwen3_5_text", NumpyBackend(), q), cfg).generate(prompts, params)
    eager = Engine(build("qwen3_5_text", cuda_backend("fp32"), q), cfg.replace(cuda_graphs=False))
    e = Engine(build("qwen3_5_text", backend, q), cfg)
    out_eager, out = eager.generate(prompts, params), e.generate(prompts, params)
    assert_same(out, out_eager, "packed weights, graphs vs eager")
    assert sum(a[:4] == b[:4] for a, b in zip(out, ref)) >= len(ref) - 1, (out, ref)
    assert_graphs_ran(e)


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3"])
def test_piecewise_tails_generate_the_eager_tokens(family):
    """`piecewise_graphs`: eager steps of 9-32 rows here (prompt chunks beside decode rows) replay their layers'
    tails as graphs (`PiecewiseTails`); fp32 greedy generation equals the numpy reference's, token for token."""
    prompts, params, cfg = workload("roomy")
    ref = Engine(build(family, NumpyBackend()), cfg).generate(prompts, params)
    e = Engine(build(family, CupyBackend("fp32")), cfg.replace(piecewise_graphs=True))
    assert_same(e.generate(prompts, params), ref, f"{family} piecewise tails")
    assert_graphs_ran(e)
    g = e.runner.graph_stats()
    assert g["piecewise"] and g["tail_captures"] > 0 and g["tail_replays"] > 0 and g["tail_failures"] == 0, g


def test_piecewise_tails_with_packed_weights():
    """The server's backend (bf16, MXFP4 weights) with piecewise tails: the tokens of the same engine without
    them (whose steps run their products over the step's rows, not the bucket's: float32 sums in another order,
    which these greedy tokens do not see)."""
    _, tensors = tiny_checkpoint("qwen3_5_text")
    q = {name: (quant.quantize(w, "mxfp4") if w.ndim >= 2 and not name.endswith("conv1d.weight") else w)
         for name, w in tensors.items()}
    prompts, params, cfg = workload("roomy")
    plain = Engine(build("qwen3_5_text", cuda_backend("bf16"), q), cfg)
    e = Engine(build("qwen3_5_text", cuda_backend("bf16"), q), cfg.replace(piecewise_graphs=True))
    assert_same(e.generate(prompts, params), plain.generate(prompts, params), "packed weights, piecewise tails")
    g = e.runner.graph_stats()
    assert g["tail_replays"] > 0 and g["tail_failures"] == 0, (g, e.runner.graph_failures())
