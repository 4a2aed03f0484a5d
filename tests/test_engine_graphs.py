"""CUDA-graph decode in the engine, on the CPU: the pool reservation (`graph_plan`) and the engine's routing.

The real graphs need a GPU (tests/gpu/test_engine_graphs.py). Here the numpy backend is admitted to
GRAPH_BACKENDS and `make_graph_runner` returns a stand-in that behaves like DecodeGraphRunner towards the
pools: it runs the model eagerly and then, as padding rows would, scribbles NaN over the pad KV page and the
pad state slot. Any sequence that owned either would produce different tokens; the stand-in also asserts
that no batch names them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import types

import numpy as np
import pytest

from decapybara.config import EngineConfig
from decapybara.engine import runner as runner_mod
from decapybara.engine.block_manager import BlockManager
from decapybara.engine.engine import Engine
from decapybara.engine.runner import GraphPlan, graph_plan
from decapybara.engine.sampling import SamplingParams
from decapybara.testing import tiny_qwen

BASE = {"page_size": 8, "num_pages": 256, "max_batch_tokens": 48, "loop_guard": "off", "snapshot_interval": 8}


@functools.cache
def model(family: str):
    return tiny_qwen(family)[0]


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 70) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 512, int(k)).tolist() for k in rng.integers(lo, hi, n)]


@dataclasses.dataclass
class PoisoningGraphRunner:
    """DecodeGraphRunner's contract towards the pools, without a GPU (see the module docstring)."""

    model: object
    plan: GraphPlan
    stats: dict = dataclasses.field(default_factory=lambda: {"graph_steps": 0, "eager_steps": 0, "captures": 0,
                                                             "failures": {}, "verify_steps": 0, "mtp_steps": 0,
                                                             "mtp_kv_steps": 0})
    batches: int = 0
    buckets: tuple = (1, 2, 4, 8, 12)
    draft_head: object = None  # the ids the MTP head guesses among, as DecodeGraphRunner's

    def forward(self, batch, kv, states=None):
        pad_page, pad_slot = self.plan.pad_page, self.plan.pad_slot
        for s in batch.seqs:
            assert pad_page not in s.block_table.tolist(), f"a sequence holds the pad page {pad_page}"
            assert len(s.block_table) <= kv.num_pages - 1
            if states is not None:
                assert s.state_slot is not None and s.state_slot != pad_slot, f"a sequence holds slot {pad_slot}"
                assert 0 <= s.state_slot < states.num_slots - 1
        decode = all(s.length == 1 and not s.snapshot_at for s in batch.seqs)
        verify = max(s.length for s in batch.seqs) - 1 <= self.max_drafts(len(batch.seqs)) and not decode
        self.stats["graph_steps" if decode or verify else "eager_steps"] += 1
        self.stats["verify_steps"] += verify
        self.batches += 1
        out = self.model.forward(batch, kv, states)
        self._poison(kv, states)
        return out

    def mtp(self, batch, normed, kv, own=False):
        """The MTP pass's contract: the head's KV for every pair, its guess and probability at each sequence's
        last pair (and with `own` the head's final-normed states there); then the pad page poisoned."""
        assert all(s.state_slot is None for s in batch.seqs)
        if any(s.length > 8 for s in batch.seqs):  # as the graph runner (MAX_ROWS): the caller runs it eagerly
            return None
        last = dataclasses.replace(batch, logits_rows=np.asarray([s.end - 1 for s in batch.seqs], np.int64))
        logits, hn = self.model.mtp_forward(last, normed, kv, own=True, head=self.draft_head)
        out = self.model.draft_guesses(logits, self.draft_head)
        self.stats["mtp_steps"] += 1
        self._poison(kv, None)
        return (*out, hn) if own else out

    def mtp_kv(self, batch, normed, kv):
        """The KV-only pass's contract: the head's KV for every pair; then the pad page poisoned."""
        assert all(s.state_slot is None for s in batch.seqs)
        self.model.mtp_kv(batch, normed, kv)
        self.stats["mtp_kv_steps"] += 1
        self._poison(kv, None)
        return True

    def max_drafts(self, n, kv=None):
        """DecodeGraphRunner.max_drafts's rule: up to 7 drafts a sequence, on a hybrid model no more than its
        checkpoints (one a row of the largest bucket) hold for `n` sequences."""
        if not 0 < n <= max(self.buckets):
            return 0
        return min(7, max(self.buckets) // n) if self.model.cfg.linear_layers else 7

    def _poison(self, kv, states) -> None:
        page = np.asarray([self.plan.pad_page], np.int64)
        data = kv.export_pages(page)
        for a in data.arrays.values():
            if np.issubdtype(a.dtype, np.floating):
                a[...] = np.nan
            else:
                a[...] = np.random.default_rng(self.batches).integers(0, 256, a.shape).astype(a.dtype)
        kv.import_pages(page, data)
        if states is not None and self.plan.pad_slot is not None:
            st = states.get(self.plan.pad_slot)
            for a in (*st.conv, *st.recurrent):
                a[...] = np.nan
            states.set(self.plan.pad_slot, st)


@pytest.fixture
def fake_graphs(monkeypatch):
    """Graphs "on" for the numpy backend; yields the stand-in runners made."""
    made: list[PoisoningGraphRunner] = []

    def make(model, plan, piecewise=False, chains=False, draft_head=None):
        made.append(PoisoningGraphRunner(model, plan, draft_head=draft_head))
        return made[-1]

    monkeypatch.setattr(runner_mod, "GRAPH_BACKENDS", ("cupy", "numpy"))
    monkeypatch.setattr(runner_mod, "make_graph_runner", make)
    yield made


# ---- the plan ---------------------------------------------------------------------------------------------
def test_plan_reserves_last_page_and_an_extra_slot_on_graph_backends():
    cfg = EngineConfig(num_pages=100, page_size=16, max_slots=6)
    p = graph_plan(cfg, "cupy", max_model_len=4096, hybrid=True)
    assert p == GraphPlan(True, kv_pages=100, usable_pages=99, state_slots=7, pad_page=99, pad_slot=6,
                          max_pages=99, buckets=(1, 2, 4, 8))  # 4096 tokens = 256 pages, bounded by the pool
    assert graph_plan(cfg.replace(max_slots=12), "cupy", 4096, True).buckets == (1, 2, 4, 8, 12)
    assert graph_plan(cfg.replace(max_slots=1), "cupy", 4096, True).buckets == (1,)
    p = graph_plan(cfg, "cupy", max_model_len=200, hybrid=False)
    assert (p.usable_pages, p.pad_page, p.pad_slot, p.state_slots, p.max_pages) == (99, 99, None, 6, 13)
    assert graph_plan(cfg.replace(num_pages=2), "cupy", 10**6, True).usable_pages == 1


@pytest.mark.parametrize("backend,on", [("numpy", True), ("cupy", False)])
def test_plan_reserves_nothing_without_graphs(backend, on):
    cfg = EngineConfig(num_pages=100, max_slots=6, cuda_graphs=on)
    assert graph_plan(cfg, backend, 4096, True) == GraphPlan(False, 100, 100, 6)


def test_numpy_engine_keeps_its_whole_pool():
    e = Engine(model("qwen3_5_text"), EngineConfig(**BASE))  # cuda_graphs defaults on: ignored on numpy
    assert not e.runner.plan.enabled and e.runner.graphs is None
    assert e.blocks.num_pages == e.runner.kv.num_pages == 256
    assert e.runner.states.num_slots == e.cfg.max_slots
    stats = e.snapshot_stats()
    assert stats["total_pages"] == 256
    assert stats["graphs"] == {"enabled": False, "graph_steps": 0, "verify_steps": 0, "mtp_steps": 0,
                               "mtp_kv_steps": 0, "mtp_eager": 0, "checkpoint_bytes": 0,
                               "eager_steps": 0, "captures": 0, "failures": 0,
                               "piecewise": False, "tail_replays": 0, "tail_captures": 0, "tail_failures": 0,
                               "tail_memory_bytes": 0, "product_chains": False, "chains": 0,
                               "chained_products": 0, "launched_tails": 0, "recut_tails": 0,
                               "chain_timeouts": 0}


def test_block_manager_over_the_plan_never_hands_out_the_pad_page():
    p = graph_plan(EngineConfig(num_pages=20, page_size=8), "cupy", 4096, True)
    b = BlockManager(p.usable_pages, 8)
    got = b.allocate(5) + [b.append() for _ in range(p.usable_pages - 5)]
    assert sorted(got) == list(range(p.usable_pages)) and p.pad_page not in got
    assert b.append() is None and b.allocate(1) is None
    b.release(got)
    assert p.pad_page not in b.allocate(p.usable_pages)


# ---- the engine with (stand-in) graphs -----------------------------------------------------------------------
@pytest.mark.parametrize("family", ["qwen3", "qwen3_5_text"])
def test_engine_with_graphs_reserves_pad_page_and_slot(family, fake_graphs):
    e = Engine(model(family), EngineConfig(**BASE, max_slots=4))
    plan = e.runner.plan
    hybrid = family != "qwen3"
    assert plan.enabled and e.runner.graphs is fake_graphs[0]
    assert e.runner.kv.num_pages == 256 and e.blocks.num_pages == 255 and plan.pad_page == 255
    if hybrid:
        assert e.runner.states.num_slots == 5 and plan.pad_slot == 4
    assert 4 not in e.free_slots and 255 not in e.blocks.free
    stats = e.snapshot_stats()
    assert stats["total_pages"] == 255 and stats["free_pages"] == 255
    info = e.runner.info()
    assert (info["pages"], info["kv_pages"], info["pad_page"]) == (255, 256, 255)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5_text"])
def test_generation_under_pool_pressure_never_touches_pad_page_or_slot(family, fake_graphs):
    """A pool that runs dry (pauses, resumes, prefix pages evicted and reused) with padding scribbling over
    the reserved page and slot after every step: the same tokens as an engine without graphs."""
    ps = prompts(6, seed=8, lo=20, hi=40)
    params = SamplingParams(temperature=0, max_tokens=40)
    cfg = EngineConfig(**{**BASE, "num_pages": 23, "max_slots": 4})
    ref = Engine(model(family), cfg.replace(cuda_graphs=False)).generate(ps, params)
    e = Engine(model(family), cfg)
    got = e.generate(ps, params)
    assert got == ref
    assert e.blocks.num_pages == 22 and e.stats.pauses > 0 and e.stats.resumes == e.stats.pauses
    stats = e.snapshot_stats()
    assert stats["graphs"]["enabled"] and stats["graphs"]["graph_steps"] > 0
    assert stats["graphs"]["graph_steps"] + stats["graphs"]["eager_steps"] == e.stats.steps
    json.dumps(stats)


def test_context_check_uses_the_usable_pool(fake_graphs):
    from decapybara.engine.sequence import Request
    from decapybara.errors import ContextOverflowError

    e = Engine(model("qwen3"), EngineConfig(**{**BASE, "num_pages": 9}))  # 8 usable pages, 7 for one sequence
    assert e.max_model_len == 56  # the graphs' padding page is not the context's (nor the prefix cache's spare)
    e.add_request(Request((1,) * 55, SamplingParams(max_tokens=1000)))
    with pytest.raises(ContextOverflowError, match="context of 56"):
        e.add_request(Request((1,) * 56, SamplingParams(max_tokens=1)))


def test_graph_setup_failure_leaves_the_engine_eager(monkeypatch):
    def broken(model, plan, piecewise=False, chains=False, draft_head=None):
        raise RuntimeError("no stream for you")

    monkeypatch.setattr(runner_mod, "GRAPH_BACKENDS", ("numpy",))
    monkeypatch.setattr(runner_mod, "make_graph_runner", broken)
    ps = prompts(3, seed=4)
    params = SamplingParams(temperature=0, max_tokens=12)
    cfg = EngineConfig(**BASE)
    ref = Engine(model("qwen3_5_text"), cfg.replace(cuda_graphs=False)).generate(ps, params)
    e = Engine(model("qwen3_5_text"), cfg)
    assert e.runner.graphs is None and "no stream for you" in e.runner.graph_error
    assert e.generate(ps, params) == ref
    stats = e.snapshot_stats()
    assert not stats["graphs"]["enabled"] and "no stream for you" in stats["graph_failures"]["setup"]


def test_graph_failures_are_reported_per_key(fake_graphs):
    e = Engine(model("qwen3"), EngineConfig(**BASE))
    e.runner.graphs.stats["failures"][(4, 1, 1)] = "CUDARuntimeError: capture invalidated"
    e.runner.graphs.stats["failures"][(2, 8, 2)] = "CUDARuntimeError: out of memory"
    stats = json.loads(json.dumps(e.snapshot_stats()))
    assert stats["graphs"]["failures"] == 2
    assert stats["graph_failures"] == {"bucket=4 splits=1": "CUDARuntimeError: capture invalidated",
                                       "bucket=2 splits=8 verify rows=2": "CUDARuntimeError: out of memory"}


def test_app_config_passes_the_prefill_share_through():
    from pydantic import ValidationError

    from decapybara.server.config import AppConfig

    assert AppConfig().engine_config(cuda=True).balanced_prefill_share == 0.5
    assert AppConfig(balanced_prefill_share="0.125").engine_config(cuda=True).balanced_prefill_share == 0.125
    for bad in ("0", "1.5", "x"):
        with pytest.raises(ValidationError):
            AppConfig(balanced_prefill_share=bad)


def test_app_config_passes_the_switch_through():
    from decapybara.server.config import AppConfig

    assert AppConfig().engine_config(cuda=True).cuda_graphs
    assert not AppConfig(cuda_graphs="false").engine_config(cuda=True).cuda_graphs
    assert AppConfig().engine_config(cuda=True).piecewise_graphs
    assert not AppConfig(piecewise_graphs="false").engine_config(cuda=True).piecewise_graphs
    assert not AppConfig().engine_config(cuda=True).product_chains
    assert AppConfig(product_chains="true").engine_config(cuda=True).product_chains


def test_graph_runner_is_made_with_piecewise_tails(monkeypatch):
    """`piecewise_graphs` reaches make_graph_runner, which gives the DecodeGraphRunner a PiecewiseTails for its
    eager steps, and `product_chains` its `chains`; graph_stats and graph_failures report the tails' and the
    chains' numbers (here a stand-in runner's)."""
    seen = []

    def make(model, plan, piecewise=False, chains=False, draft_head=None):
        seen.append((piecewise, chains))
        r = PoisoningGraphRunner(model, plan)
        r.tails = types.SimpleNamespace(stats={"tail_replays": 3, "captures": 2, "failures": {48: "cuBLAS"}},
                                        memory_bytes=lambda: 4096)
        r.chains = chains
        r.chain_stats = lambda: {"chains": 6, "chained_products": 17, "launched_tails": 1, "recut_tails": 0}
        return r

    monkeypatch.setattr(runner_mod, "GRAPH_BACKENDS", ("cupy", "numpy"))
    monkeypatch.setattr(runner_mod, "make_graph_runner", make)
    e = Engine(model("qwen3_5_text"), EngineConfig(**BASE, piecewise_graphs=True, product_chains=True))
    assert seen == [(True, True)]
    g = e.runner.graph_stats()
    assert g["piecewise"] and (g["tail_replays"], g["tail_captures"], g["tail_failures"]) == (3, 2, 1)
    assert g["tail_memory_bytes"] == 4096
    assert g["product_chains"] and (g["chains"], g["chained_products"], g["launched_tails"]) == (6, 17, 1)
    assert e.runner.graph_failures() == {"tails rows=48": "cuBLAS"}


def test_speculation_through_graphs_keeps_the_tokens(fake_graphs):
    """With graphs, a speculating engine fills its verification steps' spare rows with the head's doubtful
    guesses (`fill_rows`) and hands the head's pass to the graph runner (`mtp`): the tokens stay those without
    speculation, while the pad page and slot are poisoned after every forward and pass."""
    from decapybara.backend.numpy_backend import NumpyBackend
    from decapybara.config import DEMO_MODEL
    from decapybara.model.load import load_model

    loaded = load_model(str(DEMO_MODEL), NumpyBackend())
    tok = loaded.tokenizer
    ps = [tok.encode(t) for t in ("def main():\n    print(", "import os\nimport sys\n\n\ndef ",
                                  "class Stack:\n    def __init__(self):\n")]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (40, 33, 48)]
    cfg = EngineConfig(page_size=16, num_pages=96, max_batch_tokens=128, loop_guard="off", spec_min_confidence=0.9)
    ref = Engine(loaded.model, cfg.replace(cuda_graphs=False), tokenizer=tok).generate(ps, params)
    e = Engine(loaded.model, cfg.replace(speculator="mtp", spec_adaptive=False), tokenizer=tok)
    assert e.runner.graphs is fake_graphs[0] and e.fill_rows == 12
    assert e.generate(ps, params) == ref
    g = e.snapshot_stats()["graphs"]
    assert g["verify_steps"] > 0 and g["mtp_steps"] > 0, g
    assert 0 < e.stats.accepted_tokens < e.stats.drafted_tokens


def test_withheld_steps_hand_the_heads_kv_pass_to_the_graphs(fake_graphs):
    """With the governor on and verified rows made to cost five steps by a fake timer, most steps withhold their
    drafts; their MTP head's KV-only pass goes to the graph runner (`mtp_kv`), which poisons the pad page after
    it; the tokens stay those without speculation."""
    from decapybara.backend.numpy_backend import NumpyBackend
    from decapybara.config import DEMO_MODEL
    from decapybara.model.load import load_model

    loaded = load_model(str(DEMO_MODEL), NumpyBackend())
    tok = loaded.tokenizer
    ps = [tok.encode(t) for t in ("def main():\n    print(", "import os\nimport sys\n\n\ndef ")]
    params = [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=7, max_tokens=32, ignore_eos=True)]
    cfg = EngineConfig(page_size=16, num_pages=96, max_batch_tokens=128, loop_guard="off")
    ref = Engine(loaded.model, cfg.replace(cuda_graphs=False), tokenizer=tok).generate(ps, params)
    e = Engine(loaded.model, cfg.replace(speculator="mtp", spec_min_confidence=0.0), tokenizer=tok)
    assert e.runner.graphs is fake_graphs[-1]
    now = [0.0]
    e.timer = lambda: now[0]
    run = e.runner.run

    def costed(plan, normed=False):
        now[0] += 0.010 + 0.050 * sum(bool(c.drafts) for c in plan.chunks)
        return run(plan, normed=normed)

    e.runner.run = costed
    assert e.generate(ps, params) == ref
    g = e.snapshot_stats()["graphs"]
    assert e.stats.withheld_steps > 10 and g["mtp_kv_steps"] >= e.stats.withheld_steps - 2, (e.stats.withheld_steps, g)
    assert g["mtp_steps"] > 0, g
@pytest.mark.parametrize("policy,budget", [("balanced", 24), ("decode-priority", 12)])
def test_with_graphs_agents_verify_as_many_drafts_as_a_graph_takes(fake_graphs, policy, budget):
    """draft_len above 1 with decode graphs: a step of decodes alone verifies as many drafts a sequence as a
    verification graph of its sequences takes (`max_drafts`: on this hybrid model, the checkpoints of the largest
    bucket shared among them), a step beside a prompt's chunk of two tokens or more (eager
    anyway) every draft; under decode-priority, drafts that would leave a waiting prompt no token are cut; the
    tokens stay those without speculation."""
    from decapybara.backend.numpy_backend import NumpyBackend
    from decapybara.config import DEMO_MODEL
    from decapybara.engine.sequence import Request
    from decapybara.model.load import load_model

    loaded = load_model(str(DEMO_MODEL), NumpyBackend())
    tok = loaded.tokenizer
    ps = [tok.encode(t) for t in ("class Stack:\n    def __init__(self):\n", "def main():\n    print(")]
    late = tok.encode("# notes on the parser\n" * 12)  # a prompt of several chunks, arriving after a few steps
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    cfg = EngineConfig(page_size=16, num_pages=96, max_batch_tokens=budget, loop_guard="off", speculator="mtp",
                       spec_adaptive=False, draft_len=5, balanced_prefill_share=0.5, prefill_policy=policy,
                       spec_min_confidence=0.0)

    def generate(engine: Engine) -> tuple[dict[str, list[int]], list[tuple[bool, int]]]:
        for i, p in enumerate(ps):
            engine.add_request(Request(tuple(p), params, f"r{i}"))
        steps, out, k = [], {}, 0
        run = engine.runner.run

        def logged(plan, normed=False):
            steps.append((any(c.num_tokens - len(c.drafts) > 1 for c in plan.chunks),  # a prompt's chunk
                          max((len(c.drafts) for c in plan.chunks), default=0), len(plan.chunks)))
            return run(plan, normed)
        engine.runner.run = logged
        while engine.has_work():
            k += 1
            if k == 6:
                engine.add_request(Request(tuple(late), params, "late"))
            for ev in engine.step():
                out.setdefault(ev.request_id, []).extend(ev.token_ids)
        return out, steps

    ref, _ = generate(Engine(loaded.model, cfg.replace(cuda_graphs=False, speculator="off"), tokenizer=tok))
    e = Engine(loaded.model, cfg, tokenizer=tok)
    graphs = e.runner.graphs
    assert e.graph_drafts is not None and [graphs.max_drafts(n) for n in (1, 2, 3, 5, 12, 13)] == [7, 6, 4, 2, 1, 0]
    got, steps = generate(e)
    assert got == ref
    alone = [(d, n) for mixed, d, n in steps if not mixed]
    assert all(d <= graphs.max_drafts(n) for d, n in alone), alone  # decodes alone: what their graph takes
    assert any(d > 1 for d, n in alone), alone  # ... several a sequence
    assert any(d > graphs.max_drafts(n) for mixed, d, n in steps if mixed), steps  # beside a prompt's chunks: all
    assert graphs.stats["verify_steps"] > 0 and graphs.stats["eager_steps"] > 0
