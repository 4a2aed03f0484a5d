"""Speculative decoding with the MTP head (EngineConfig.speculator="mtp"): each decoding sequence verifies the
head's draft as a second row of its decode. Its outputs are the outputs without speculation, token for token and
draw for draw: greedy and seeded sampling, penalties and logprobs, batching, pauses and resumes in a tight pool,
prefix reuse, the LoopGuard, max_tokens and stop strings; drafts are accepted (the demo model's trained head) and
rejected (its misses, and tiny models' random heads: a hybrid model's state rolled back, a MoE model's too)."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from decapybara.backend.numpy_backend import NumpyBackend
from decapybara.config import DEMO_MODEL, EngineConfig
from decapybara.engine.engine import Engine
from decapybara.engine.sampling import SamplingParams
from decapybara.engine.sequence import Request
from decapybara.model.load import load_model


@functools.cache
def demo():
    return load_model(str(DEMO_MODEL), NumpyBackend())


def prompts_of(texts: list[str]) -> list[list[int]]:
    tok = demo().tokenizer
    return [tok.encode(t) for t in texts]


CODE = ["def main():\n    print(", "import os\nimport sys\n\n\ndef ", "class Stack:\n    def __init__(self):\n",
        "    for i in range(10):\n        if i % 2", "# Return the JSON document at path\ndef read_json(path):\n"]


def run(speculator: str, prompts, params, **cfg) -> tuple[list[list[int]], Engine]:
    loaded = demo()
    settings = {"page_size": 16, "num_pages": 256, "max_batch_tokens": 256, "loop_guard": "off",
                "spec_adaptive": False, **cfg}  # every draft verified (the governor: test_spec_governor.py)
    e = Engine(loaded.model, EngineConfig(speculator=speculator, **settings), tokenizer=loaded.tokenizer)
    return e.generate(prompts, params), e


def same_with_and_without(prompts, params, **cfg) -> Engine:
    ref, plain = run("off", prompts, params, **cfg)
    got, spec = run("mtp", prompts, params, **cfg)
    assert plain.stats.drafted_tokens == 0
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        assert a == b, f"prompt {i}: first difference at {first}"
    return spec


def test_greedy_tokens_are_the_same_and_drafts_are_accepted():
    prompts = prompts_of(CODE)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (40, 33, 48, 21, 64)]
    e = same_with_and_without(prompts, params)
    s = e.stats
    print(f"drafted {s.drafted_tokens}, accepted {s.accepted_tokens}, steps {s.steps}")
    assert 0 < s.accepted_tokens < s.drafted_tokens  # both sides of the verification ran
    assert s.accepted_tokens / s.drafted_tokens > 0.3  # the trained head guesses well
    _, plain = run("off", prompts, params)
    assert s.steps < plain.stats.steps  # accepted drafts are tokens without steps of their own


def test_seeded_sampling_penalties_and_logprobs_are_the_same():
    prompts = prompts_of(CODE[:4])
    params = [SamplingParams(temperature=0.8, top_p=0.95, top_k=40, seed=11, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=5, max_tokens=36, presence_penalty=0.5, frequency_penalty=0.3,
                             ignore_eos=True),
              SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=45, ignore_eos=True),
              SamplingParams(temperature=0.6, min_p=0.05, seed=3, max_tokens=30, ignore_eos=True, logprobs=3)]
    e = same_with_and_without(prompts, params)
    assert e.stats.accepted_tokens > 0

    a, b = (events_of(spec, [prompts[3]], params[3], spec_adaptive=True) for spec in ("mtp", "off"))
    assert [t for t, _, _ in a] == [t for t, _, _ in b]
    assert np.allclose([lp for _, lp, _ in a], [lp for _, lp, _ in b], atol=1e-5)
    assert [[i for i, _ in top] for _, _, top in a] == [[i for i, _ in top] for _, _, top in b]


def test_pauses_resumes_and_prefix_reuse_keep_the_tokens():
    shared = prompts_of(["# utilities shared by the tools below\nimport re\nimport json\n\n"])[0]
    prompts = [shared + p for p in prompts_of(CODE)] + [shared + prompts_of(["def parse(text):\n"])[0]]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True) for _ in prompts]
    # 14 pages of 8 tokens for six sequences of ~70 tokens each: pauses and resumes throughout
    e = same_with_and_without(prompts, params, page_size=8, num_pages=40, max_batch_tokens=64, max_slots=6)
    assert e.stats.pauses > 0 and e.stats.resumes > 0 and e.stats.accepted_tokens > 0
    assert e.stats.reused_prompt_tokens > 0 or e.stats.pauses > 0


def test_the_loop_guard_stops_and_max_tokens_and_stop_strings_hold():
    # the demo model loops under greedy decoding: the LoopGuard's verdicts are the same with drafts
    prompts = prompts_of(["def show_compilers():\n    ", "x = 1\nx = 1\nx = 1\n"])
    params = [SamplingParams(temperature=0, max_tokens=300), SamplingParams(temperature=0, max_tokens=200)]
    for mode in ("stop", "end_thinking", "escape"):
        same_with_and_without(prompts, params, loop_guard=mode)
    for m in (1, 2, 3, 17):  # a draft never takes a sequence past max_tokens
        out, _ = run("mtp", prompts_of(CODE[:2]), SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
        assert [len(o) for o in out] == [m, m]
    params = [SamplingParams(temperature=0, max_tokens=60, stop=["\n"]), SamplingParams(temperature=0, max_tokens=60,
                                                                                        stop=["("])]
    same_with_and_without(prompts_of(CODE[:2]), params)


def test_confidence_scheduling_drafts_what_the_head_is_sure_of():
    prompts = prompts_of(CODE)
    params = [SamplingParams(temperature=0.7, seed=i, max_tokens=48, ignore_eos=True) for i in range(len(CODE))]
    every = same_with_and_without(prompts, params, spec_min_confidence=0.0).stats
    sure = same_with_and_without(prompts, params, spec_min_confidence=0.6).stats
    print(f"every guess: {every.accepted_tokens}/{every.drafted_tokens}; p >= 0.6: {sure.accepted_tokens}/"
          f"{sure.drafted_tokens}")
    assert 0 < sure.drafted_tokens < every.drafted_tokens
    assert sure.accepted_tokens / sure.drafted_tokens > every.accepted_tokens / every.drafted_tokens
    with pytest.raises(Exception, match="spec_min_confidence"):
        EngineConfig(spec_min_confidence=1.5)


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_5_moe_text"])
def test_rejected_drafts_of_a_random_head_roll_back(family):
    """A random head's drafts are nearly all rejected: every rejection sets the hybrid state back."""
    from tests.test_mtp import with_mtp_head

    model, _, _ = with_mtp_head(family)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 512, n).tolist() for n in (5, 23, 41, 12)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (30, 24, 28, 20)]
    cfg = EngineConfig(page_size=8, num_pages=64, max_batch_tokens=32, max_slots=4, loop_guard="off")
    ref = Engine(model, cfg).generate(prompts, params)
    spec = Engine(model, cfg.replace(speculator="mtp", spec_min_confidence=0.0,  # every guess, however doubted
                                     spec_adaptive=False))
    assert spec.speculate
    assert spec.generate(prompts, params) == ref
    assert spec.stats.drafted_tokens > 50


def test_speculator_setting(caplog):
    with pytest.raises(Exception, match="speculator"):
        EngineConfig(speculator="eagle")
    from decapybara.testing import tiny_qwen

    plain, _ = tiny_qwen("qwen3")
    with caplog.at_level("WARNING", logger="decapybara.engine.engine"):
        assert not Engine(plain, EngineConfig(speculator="mtp")).speculate  # no head: nothing to draft with
    assert "the model has no MTP layers" in caplog.text  # said, not silently ignored
    import argparse

    from decapybara.server.cli_serve import add_parser, app_args
    from decapybara.server.config import AppConfig
    from decapybara.server.engine_setup import build_engine

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    assert app_args(parser.parse_args(["serve", "--speculator", "mtp"])) == {"speculator": "mtp"}
    assert AppConfig().engine_config(cuda=False).speculator == "off"
    assert AppConfig().engine_config(cuda=False).spec_min_confidence == EngineConfig().spec_min_confidence == 0.3
    assert AppConfig(spec_min_confidence="0.4").engine_config(cuda=False).spec_min_confidence == 0.4
    assert AppConfig().engine_config(cuda=True).spec_fill and EngineConfig().spec_fill
    assert not AppConfig(spec_fill="false").engine_config(cuda=True).spec_fill
    served = build_engine(AppConfig(device="cpu", speculator="mtp", slots=1, kv_memory_gb=0.001))
    assert served.engine.speculate  # the demo model has a head


def _demo_engine(**cfg) -> Engine:
    loaded = demo()
    settings = {"page_size": 8, "num_pages": 64, "max_batch_tokens": 64, "loop_guard": "off", "speculator": "mtp",
                "spec_min_confidence": 0.0, "spec_adaptive": False, **cfg}
    return Engine(loaded.model, EngineConfig(**settings), tokenizer=loaded.tokenizer)


def test_a_request_finished_in_its_last_chunk_leaves_the_heads_kv_in_its_pages():
    """A request that ends in the step that computes its last chunk (one token asked: the prompt's step samples it)
    still gets the MTP head's keys and values for that chunk, as one that goes on does: its pages go to the prefix
    cache, where a later request's head attends over them."""
    prompt = prompts_of(["# The helpers below\nimport os\n\n\ndef walk(root):\n    for name in os.listdir(root):\n"])[0]
    pages = {}
    for n in (1, 2):
        e = _demo_engine()
        e.generate([prompt], SamplingParams(temperature=0, max_tokens=n))
        used = np.arange(-(-len(prompt) // 8))  # a fresh engine's first pages, in order
        data = e.runner.kv.export_pages(used).arrays
        pages[n] = {k: a for k, a in data.items() if k.startswith("('mtp'")}
    assert pages[1] and pages[1].keys() == pages[2].keys()
    for key, a in pages[2].items():
        flat1, flat2 = pages[1][key].reshape(-1, *a.shape[2:])[:len(prompt)], a.reshape(-1, *a.shape[2:])[:len(prompt)]
        assert np.abs(flat2).max() > 0 and np.array_equal(flat1, flat2), key


def test_accepted_drafts_keep_the_prefix_caches_snapshots():
    """A draft's chunk asks for the snapshot points of both its rows, so that an accepted draft ending a page leaves
    its state for the prefix cache as a decode would; a rollback point off those stays out of the cache."""
    prompt = prompts_of(["# The helpers below\nimport os\n\n\ndef walk(root):\n"])[0]
    counts = {}
    for spec in ("off", "mtp"):
        e = _demo_engine(speculator=spec, snapshot_interval=8)
        out = e.generate([prompt], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))[0]
        # the next turn: the whole conversation again, but its last few tokens
        follow = prompt + out[:-3]
        e.generate([follow], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        counts[spec] = (e.stats.reused_prompt_tokens, len(e.blocks.snapshots))
        if spec == "mtp":
            assert e.stats.accepted_tokens > 10
    assert counts["mtp"] == counts["off"], counts


def test_a_draft_without_a_page_is_dropped_not_paid_for_with_a_pause():
    e = _demo_engine(page_size=8, num_pages=40)
    e.add_request(__import__("decapybara.engine.sequence", fromlist=["Request"]).Request(
        tuple(prompts_of(["def main():\n    print("])[0]), SamplingParams(temperature=0, max_tokens=200,
                                                                       ignore_eos=True)))
    s = None
    for _ in range(100):  # decode until the draft's row would open a new page
        e.step()
        s = e.running[0]
        if s.drafts and s.num_computed % 8 == 7 and len(s.pages) * 8 == s.num_computed + 1:
            break
    else:
        pytest.fail("no step left a draft at a page's end")
    taken = []
    while (page := e.blocks.append()) is not None:  # other conversations hold every free page
        taken.append(page)
    plan = e._plan_with_pages()
    assert [(c.num_tokens, c.drafts) for c in plan.chunks] == [(1, ())]  # the draft went, nobody was paused
    assert e.stats.pauses == 0 and s.status.value == "running"


def test_drafts_leave_the_balanced_prefill_share():
    """Ten agents decode with drafts when a long prompt arrives: its chunk gets the tokens it would get if no agent
    held a draft (the balanced share), and the drafts take only what is left."""
    from decapybara.engine.planner import plan_step
    from decapybara.engine.sequence import Request

    e = _demo_engine(max_batch_tokens=32, balanced_prefill_share=0.5, max_slots=12, num_pages=256)
    short = prompts_of(CODE) * 2
    for p in short:
        e.add_request(Request(tuple(p), SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)))
    while any(s.in_prefill or not s.drafts for s in e.running) or len(e.running) < 10:
        e.step()
    long = prompts_of(["# notes\n" * 40])[0]
    e.add_request(Request(tuple(long), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)))
    e.admission(e)
    assert any(s.in_prefill for s in e.running)
    plan = plan_step(e.running, e.cfg, snapshots=False)
    drafts = {s: s.drafts for s in e.running}
    for s in e.running:
        s.drafts = ()
    bare = plan_step(e.running, e.cfg, snapshots=False)
    for s, d in drafts.items():
        s.drafts = d

    def prefill(p) -> int:
        return sum(c.num_tokens for c in p.chunks if c.seq.in_prefill)

    assert any(c.drafts for c in plan.chunks) and plan.num_tokens <= 32
    assert prefill(plan) == prefill(bare) == 16


def test_drafts_never_starve_a_prompt_under_decode_priority():
    """Under decode-priority a prompt's chunk takes what the decodes' own tokens leave; the drafts take only what
    that chunk leaves then (a prompt gets the tokens it would get with no draft). Before, agents' drafts took the
    whole budget: the prompt computed nothing, step after step, while they kept drafting."""
    from decapybara.engine.planner import plan_step
    from decapybara.engine.sequence import Request

    e = _demo_engine(max_batch_tokens=16, prefill_policy="decode-priority", max_slots=4, num_pages=256, draft_len=7)
    for p in prompts_of(CODE[:3]):
        e.add_request(Request(tuple(p), SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)))
    while any(s.in_prefill for s in e.running) or len(e.running) < 3:
        e.step()
    long = prompts_of(["# notes\n" * 40])[0]
    e.add_request(Request(tuple(long), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)))
    e.admission(e)
    for s in e.running:
        s.drafts = () if s.in_prefill else (5,) * 7
    plan = plan_step(e.running, e.cfg, snapshots=False)
    assert sum(c.num_tokens for c in plan.chunks if c.seq.in_prefill) == 16 - 3  # what the three decodes leave
    assert plan.num_tokens <= 16 and not any(c.drafts for c in plan.chunks)
    # a short prompt leaves room: the drafts take what it does not
    e.running[-1].tokens[e.running[-1].num_computed + 2:] = []
    plan = plan_step(e.running, e.cfg, snapshots=False)
    assert [c.num_tokens for c in plan.chunks if c.seq.in_prefill] == [2]
    assert sum(len(c.drafts) for c in plan.chunks) == 16 - 3 - 2


def test_verification_steps_fill_their_spare_rows_with_guesses():
    """With verification graphs (`Engine.fill_rows`), a decode step that verifies some draft also verifies the
    other decodes' doubtful guesses (their second rows are computed anyway): the plan gives them their guesses
    only then (not in a step with a prompt chunk, nor beyond the largest graph, nor with no sure draft), and the
    outputs stay those of decoding without speculation while more drafts are verified."""
    from decapybara.engine.planner import plan_step
    from decapybara.engine.sequence import Request

    prompts = prompts_of(CODE)
    params = [SamplingParams(temperature=0.7, seed=i, max_tokens=40, ignore_eos=True) for i in range(len(CODE))]
    ref, _ = run("off", prompts, params)
    stats = {}
    for rows in (0, 12):
        loaded = demo()
        e = Engine(loaded.model, EngineConfig(speculator="mtp", spec_min_confidence=0.9, page_size=16,
                                              num_pages=256, max_batch_tokens=256, loop_guard="off",
                                              spec_adaptive=False),
                   tokenizer=loaded.tokenizer)
        assert e.fill_rows == 0  # no graphs on numpy
        e.fill_rows = rows
        assert e.generate(prompts, params) == ref
        stats[rows] = (e.stats.drafted_tokens, e.stats.accepted_tokens)
    print("drafted, accepted without / with the spare rows filled:", stats)
    assert stats[12][0] > stats[0][0] > 0 and stats[12][1] >= stats[0][1]
    # the plan's rule
    e = _demo_engine(max_batch_tokens=64, max_slots=12, num_pages=256)
    for p in prompts:
        e.add_request(Request(tuple(p), SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)))
    while any(s.in_prefill for s in e.running) or len(e.running) < len(prompts):
        e.step()
    for k, s in enumerate(e.running):
        s.drafts, s.guess = ((100 + k,), None) if k == 0 else ((), 200 + k)
    drafts = [c.drafts for c in plan_step(e.running, e.cfg, False, fill_rows=12).chunks]
    assert drafts == [(100 + k,) for k in range(1)] + [(200 + k,) for k in range(1, len(prompts))]
    assert [c.drafts for c in plan_step(e.running, e.cfg, False).chunks] == [(100,)] + [()] * (len(prompts) - 1)
    assert [c.drafts for c in plan_step(e.running, e.cfg, False, fill_rows=len(prompts) - 1).chunks][1:] == \
        [()] * (len(prompts) - 1)
    e.running[0].drafts = (100, 101)  # two drafts where no graph takes them (eager): no graph's spare rows to fill
    assert [c.drafts for c in plan_step(e.running, e.cfg, False, fill_rows=12).chunks] == \
        [(100, 101)] + [()] * (len(prompts) - 1)
    # ... where a graph takes two drafts a sequence (`graph_drafts`), its spare rows take the guesses; where it takes
    # one, the step keeps one draft and fills too
    for takes, first in ((2, (100, 101)), (1, (100,))):
        assert [c.drafts for c in plan_step(e.running, e.cfg, False, fill_rows=12,
                                            graph_drafts=lambda n, k=takes: k).chunks] == \
            [first] + [(200 + k,) for k in range(1, len(prompts))]
    e.running[0].drafts = ()  # no sure draft: no verification step to fill
    assert all(not c.drafts for c in plan_step(e.running, e.cfg, False, fill_rows=12).chunks)
    e.running[0].drafts = (100,)
    long = prompts_of(["# notes\n" * 40])[0]
    e.add_request(Request(tuple(long), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)))
    e.admission(e)
    assert any(s.in_prefill for s in e.running)
    plan = plan_step(e.running, e.cfg, False, fill_rows=12)
    assert [c.drafts for c in plan.chunks if not c.seq.in_prefill][1:] == [()] * (len(prompts) - 1)


def test_a_draft_never_takes_the_page_of_another_sequences_token():
    """Pages go to every chunk's real token first, then to the drafts' rows: with one free page, a draft whose row
    opens a page and another sequence whose real token does, the token gets it and the draft goes; nobody is
    paused (before, the draft's row took the page and the other sequence was paused)."""
    from decapybara.engine.sequence import Request

    e = _demo_engine(page_size=8, num_pages=40, max_batch_tokens=64)
    rng = np.random.default_rng(2)
    for n in (15, 16):  # after the prompt: A holds 15 tokens in 2 pages, B 16 in 2 (full)
        e.add_request(Request(tuple(int(t) for t in rng.integers(3, 500, n)),
                              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)))
    e.step()
    a, b = e.running
    assert (a.num_computed, len(a.pages), b.num_computed, len(b.pages)) == (15, 2, 16, 2)
    a.drafts, a.guess, b.drafts, b.guess = (7,), None, (), None  # A's draft row (token 16) would open a page
    taken = []
    while len(e.blocks.free) > 1:
        taken.append(e.blocks.append())
    plan = e._plan_with_pages()
    assert [(c.seq, c.num_tokens, c.drafts) for c in plan.chunks] == [(a, 1, ()), (b, 1, ())]
    assert e.stats.pauses == 0 and len(b.pages) == 3 and len(a.pages) == 2


def events_of(speculator: str, prompts, params, spec_adaptive: bool = False) -> list:
    """(token, logprob, top logprobs) of each request's events, one request at a time."""
    loaded, got = demo(), []
    for i, p in enumerate(prompts):
        eng = Engine(loaded.model, EngineConfig(speculator=speculator, page_size=16, num_pages=64, loop_guard="off",
                                                spec_adaptive=spec_adaptive), tokenizer=loaded.tokenizer)
        eng.add_request(Request(tuple(p), params, request_id=f"r{i}"))
        while eng.has_work():
            for ev in eng.step():
                got += list(zip(ev.token_ids, ev.logprobs, ev.top_logprobs))
    return got


def test_the_token_after_an_accepted_draft_is_sampled_in_the_same_call(monkeypatch):
    """The draft's own row (the token after it, kept only where the draft is accepted) is sampled in the same
    sampler call as the real token's where its sampler row is known before the real token is appended (no
    penalty that reads token ids, no host hook): one call a step, the same tokens, draws and logprobs, min_tokens'
    masks at the rows' own positions. Where it is not (a presence penalty), the second call after the first token,
    as before; and where the first call fails (the sampler refusing a row), the real tokens' rows alone: tokens the
    same either way."""
    calls = []
    sample = Engine._sample

    def counted(self, logits, idx, seqs, rows):
        calls.append(len(idx))
        return sample(self, logits, idx, seqs, rows)

    monkeypatch.setattr(Engine, "_sample", counted)
    prompts = prompts_of(CODE[:3])
    for params, one_call in ((SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), True),
                             (SamplingParams(temperature=0.7, seed=4, max_tokens=40, ignore_eos=True), True),
                             (SamplingParams(temperature=0.9, seed=2, max_tokens=40, min_tokens=24), True),
                             (SamplingParams(temperature=0, presence_penalty=0.4, max_tokens=40, ignore_eos=True),
                              False)):
        calls.clear()
        ref, _ = run("off", prompts, params)
        calls.clear()
        got, e = run("mtp", prompts, params)
        assert got == ref and e.stats.accepted_tokens > 0
        # every step samples (the prompts fit the first step): one call a step, or more where drafts were accepted
        if one_call:
            assert len(calls) == e.stats.steps, (params, len(calls), e.stats.steps)
        else:
            assert len(calls) > e.stats.steps, (params, len(calls), e.stats.steps)
    lp = SamplingParams(temperature=0.6, min_p=0.05, seed=3, max_tokens=30, ignore_eos=True, logprobs=3)
    a, b = events_of("mtp", prompts[:2], lp), events_of("off", prompts[:2], lp)
    assert [t for t, _, _ in a] == [t for t, _, _ in b]
    assert np.allclose([x for _, x, _ in a], [x for _, x, _ in b], atol=1e-5)
    assert [[i for i, _ in top] for _, _, top in a] == [[i for i, _ in top] for _, _, top in b]

    def refusing(self, logits, idx, seqs, rows):  # a call holding a draft's row ahead fails, as for NaN logits
        calls.append(len(idx))
        if len({id(q) for q in seqs}) < len(seqs):
            raise ValueError("every row of logits needs at least one finite value")
        return sample(self, logits, idx, seqs, rows)

    monkeypatch.setattr(Engine, "_sample", refusing)
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref, _ = run("off", prompts, greedy)
    got, e = run("mtp", prompts, greedy)
    assert got == ref and e.stats.accepted_tokens > 0
