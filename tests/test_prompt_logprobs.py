"""Prompt logprobs (`SamplingParams.prompt_logprobs`, the legacy completions' `echo`): each prompt token's logprob
under the model given the tokens before it, and its best alternatives, against HF transformers' log-softmax over
the same prompt; computed over prompts split into chunks beside other requests, never read from the prefix cache."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from decapybara.config import EngineConfig
from decapybara.engine.engine import Engine
from decapybara.engine.sampling import SamplingParams
from decapybara.engine.sequence import Request
from decapybara.testing import tiny_qwen


@functools.cache
def models(family: str):
    return tiny_qwen(family, seed=3)


def hf_logprobs(hf, prompt: list[int]) -> np.ndarray:
    """[P - 1, V] float64: the log-softmax at positions 0 .. P - 2 (each predicting the next prompt token)."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0, :-1].double()
    return torch.log_softmax(logits, -1).numpy()


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3"])
def test_prompt_logprobs_are_the_models_over_chunks_beside_others_and_never_cached(family):
    model, hf = models(family)
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, 512, 70).tolist()
    other = rng.integers(0, 512, 40).tolist()
    cfg = EngineConfig(page_size=8, num_pages=128, max_batch_tokens=24, loop_guard="off", snapshot_interval=8)
    e = Engine(model, cfg)
    # the same prompt first without prompt logprobs: its pages (and snapshots) go to the prefix cache
    e.generate([prompt], [SamplingParams(temperature=0, max_tokens=2)])
    want = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=3)
    e.add_request(Request(tuple(prompt), want, "scored"))
    e.add_request(Request(tuple(other), SamplingParams(temperature=0, max_tokens=6), "beside"))
    events = {}
    steps = 0
    while e.has_work():
        steps += 1
        for ev in e.step():
            events.setdefault(ev.request_id, []).append(ev)
    assert steps > 3  # the 70-token prompt took several chunks of 24 beside the other request
    scored = events["scored"]
    assert scored[0].num_cached_tokens == 0  # computed whole, not read from the cache
    got = scored[0].prompt_logprobs
    assert got is not None and len(got) == len(prompt) - 1
    assert all(ev.prompt_logprobs is None for ev in scored[1:] + events["beside"])
    ref = hf_logprobs(hf, prompt)
    lp = np.array([g[0] for g in got])
    want_lp = ref[np.arange(len(prompt) - 1), prompt[1:]]
    assert np.max(np.abs(lp - want_lp)) < 1e-4, np.max(np.abs(lp - want_lp))
    for p, (_, top) in enumerate(got):
        assert len(top) == 3
        ids = [t for t, _ in top]
        best = np.argsort(-ref[p], kind="stable")[:3]
        vals = ref[p][best]
        if vals[2] - ref[p][np.argsort(-ref[p])[3]] > 1e-3 and np.all(np.diff(vals) < -1e-3):
            assert ids == best.tolist(), (p, ids, best)
        assert all(abs(v - ref[p][t]) < 1e-4 for t, v in top)
    # the output is the one without prompt logprobs (greedy)
    plain = Engine(model, cfg).generate([prompt], [SamplingParams(temperature=0, max_tokens=3)])
    assert [t for ev in scored for t in ev.token_ids] == plain[0]


def test_a_scored_prompt_may_fill_the_served_context():
    """A request that scores its prompt and asks for one token (the legacy API's echo with max_tokens 0) may hold
    exactly the served context: its prompt logprobs are the model's, its one token ends it ("length"); a prompt of the
    context that asks for more, or for no prompt logprobs, is refused as before."""
    from decapybara.engine.sequence import FinishReason
    from decapybara.errors import ContextOverflowError

    model, hf = models("qwen3_5_text")
    e = Engine(model, EngineConfig(page_size=8, num_pages=8, max_batch_tokens=16, loop_guard="off"))
    n = e.max_model_len
    assert n == 56  # (the pool's 8 pages, less one with the prefix cache)
    prompt = np.random.default_rng(9).integers(0, 512, n).tolist()
    for params in (SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1),
                   SamplingParams(temperature=0, max_tokens=1)):
        with pytest.raises(ContextOverflowError):
            e.add_request(Request(tuple(prompt), params))
    e.add_request(Request(tuple(prompt), SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), "full"))
    events = []
    while e.has_work():
        events += e.step()
    assert events[-1].finish_reason == FinishReason.LENGTH and len(events[0].prompt_logprobs) == n - 1
    ref = hf_logprobs(hf, prompt)
    assert np.allclose([v for v, _ in events[0].prompt_logprobs], ref[np.arange(n - 1), prompt[1:]], atol=1e-4)
    # the server's admission policy takes it too where the context is the whole pool (no prefix cache): its one
    # sampled token needs no page
    from decapybara.scheduler.policy import AgePolicy

    e = Engine(model, EngineConfig(page_size=8, num_pages=8, max_batch_tokens=16, loop_guard="off",
                                   enable_prefix_cache=False), admission=AgePolicy())
    whole = np.random.default_rng(10).integers(0, 512, e.max_model_len).tolist()
    e.add_request(Request(tuple(whole), SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), "all"))
    ends = [ev for _ in range(40) for ev in e.step() if ev.finish_reason is not None]
    assert len(ends) == 1 and ends[0].finish_reason == FinishReason.LENGTH


def test_prompt_logprobs_of_zero_alternatives_and_a_one_token_prompt():
    model, hf = models("qwen3_5_text")
    e = Engine(model, EngineConfig(page_size=8, num_pages=64, max_batch_tokens=64, loop_guard="off"))
    rng = np.random.default_rng(2)
    prompt = rng.integers(0, 512, 20).tolist()
    e.add_request(Request(tuple(prompt), SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), "a"))
    e.add_request(Request((7,), SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2), "b"))
    got = {}
    while e.has_work():
        for ev in e.step():
            got.setdefault(ev.request_id, ev.prompt_logprobs)
    ref = hf_logprobs(hf, prompt)
    assert [t for _, t in got["a"]] == [[]] * 19
    assert np.allclose([v for v, _ in got["a"]], ref[np.arange(19), prompt[1:]], atol=1e-4)
    assert got["b"] == []  # one prompt token: nothing before it to predict it
    with pytest.raises(Exception, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21).validate(512)


def test_a_prompt_logprob_chunk_runs_eagerly_in_chunks_of_its_own_size(monkeypatch):
    """With decode graphs, a step holding a prompt's chunk whose rows all have logits (prompt logprobs beside
    decodes: the rows' logits in order, as a verification graph's) runs eagerly, never through the graph runner;
    a prompt for prompt logprobs goes in chunks of at most PROMPT_LOGPROB_ROWS tokens (each row's logits kept)."""
    from decapybara.engine import planner
    from decapybara.engine import runner as runner_mod
    from tests.test_engine_graphs import PoisoningGraphRunner

    monkeypatch.setattr(planner, "PROMPT_LOGPROB_ROWS", 5)
    monkeypatch.setattr(runner_mod, "GRAPH_BACKENDS", ("cupy", "numpy"))
    monkeypatch.setattr(runner_mod, "make_graph_runner", lambda model, plan, *a, **kw: PoisoningGraphRunner(model, plan))
    model, hf = models("qwen3_5_text")
    e = Engine(model, EngineConfig(page_size=8, num_pages=64, max_batch_tokens=12, loop_guard="off"))
    seen = []
    graphs_forward = e.runner.graphs.forward

    def spy(batch, kv, states=None):
        seen.append([s.length for s in batch.seqs])
        return graphs_forward(batch, kv, states)
    e.runner.graphs.forward = spy
    rng = np.random.default_rng(8)
    for i in range(3):
        e.add_request(Request(tuple(rng.integers(0, 512, 4).tolist()), SamplingParams(temperature=0, max_tokens=20),
                              f"d{i}"))
    for _ in range(3):
        e.step()
    prompt = rng.integers(0, 512, 23).tolist()
    seen.clear()
    e.add_request(Request(tuple(prompt), SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1), "p"))
    chunks, got = [], None
    run = e.runner.run

    def logged(plan, normed=False):
        chunks.extend(c.num_tokens for c in plan.chunks if c.seq.request_id == "p")
        return run(plan, normed)
    e.runner.run = logged
    while e.has_work():
        for ev in e.step():
            got = ev.prompt_logprobs if ev.prompt_logprobs is not None else got
    assert chunks[:5] == [5, 5, 5, 5, 3] and max(chunks) <= 5, chunks
    assert seen and all(max(lengths) == 1 for lengths in seen), seen  # the graph runner saw decodes alone
    ref = hf_logprobs(hf, prompt)
    assert np.allclose([v for v, _ in got], ref[np.arange(22), prompt[1:]], atol=1e-4)
