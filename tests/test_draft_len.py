"""Several drafts a step (EngineConfig.draft_len, DRAFT_LEN): the MTP head's guesses chained (each paired with the
head's own state for the next) and prompt lookup's tokens after a match, verified as 1 + k rows of a decode. The
outputs are those without speculation, token for token and draw for draw (greedy, seeded sampling, penalties,
logprobs, the LoopGuard, stop strings, JSON answers, pauses and resumes, prefix reuse), with drafts accepted and
rejected at every depth (a hybrid model's state rolled back to the snapshot before the first rejected one)."""

from __future__ import annotations

import numpy as np
import pytest

from decapybara.config import EngineConfig
from decapybara.engine.engine import Engine
from decapybara.engine.planner import plan_step
from decapybara.engine.sampling import SamplingParams
from decapybara.engine.sequence import Request
from decapybara.errors import ConfigError
from tests.test_speculation import CODE, _demo_engine, demo, prompts_of, run


def same(speculator: str, prompts, params, **cfg) -> Engine:
    ref, plain = run("off", prompts, params, **cfg)
    got, e = run(speculator, prompts, params, **cfg)
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        assert a == b, f"prompt {i}: first difference at {first}"
    return e


def test_chained_head_drafts_keep_the_tokens_and_take_fewer_steps():
    prompt = prompts_of(["class Stack:\n    def __init__(self):\n"])
    greedy = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    steps = {}
    for k in (1, 3, 7):
        e = same("mtp", prompt, greedy, draft_len=k)
        steps[k] = (e.stats.steps, e.stats.drafted_tokens, e.stats.accepted_tokens)
    print("draft_len -> (steps, drafted, accepted):", steps)
    assert steps[3][0] < steps[1][0] and steps[7][0] <= steps[3][0]  # more tokens a step
    assert steps[7][2] > steps[3][2] > steps[1][2]  # chained guesses are accepted too
    sampled = [SamplingParams(temperature=0.8, top_p=0.95, top_k=40, seed=11, max_tokens=40, ignore_eos=True),
               SamplingParams(temperature=1.0, seed=5, max_tokens=36, presence_penalty=0.5, frequency_penalty=0.3,
                              ignore_eos=True),
               SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=45, ignore_eos=True),
               SamplingParams(temperature=0.6, min_p=0.05, seed=3, max_tokens=30, ignore_eos=True, logprobs=3,
                              min_tokens=20)]
    e = same("mtp", prompts_of(CODE[:4]), sampled, draft_len=4, spec_min_confidence=0.0)
    assert e.stats.accepted_tokens > 0


def test_the_head_guesses_among_the_first_draft_vocab_ids_and_the_tokens_stay():
    """draft_vocab: every guess of the head, first and chained, is an id below it (rounded up to 16), the outputs
    are those without speculation, and drafts are still made and accepted; the whole vocabulary (0) guesses past
    it."""
    prompt = prompts_of(CODE[1:4])
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    ref = run("off", prompt, greedy)[0]
    seen = {}
    for vocab in (0, 500):
        loaded = demo()
        e = Engine(loaded.model, EngineConfig(speculator="mtp", draft_len=3, draft_vocab=vocab, page_size=16,
                                              num_pages=256, max_batch_tokens=256, loop_guard="off",
                                              spec_adaptive=False, spec_min_confidence=0.0),
                   tokenizer=loaded.tokenizer)
        guesses = seen[vocab] = []
        for name in ("mtp", "mtp_chain"):
            def record(*a, _f=getattr(e.runner, name), **k):
                got = _f(*a, **k)
                guesses.extend(int(g) for g in got[0])
                return got
            setattr(e.runner, name, record)
        assert e.generate(prompt, greedy) == ref
        assert e.stats.accepted_tokens > 0, vocab
    assert seen[500] and max(seen[500]) < 512 and max(seen[0]) >= 512
    with pytest.raises(ConfigError, match="draft_vocab"):
        EngineConfig(draft_vocab=-1)


def test_logprobs_of_a_chained_step_are_those_of_single_steps():
    loaded = demo()
    prompt = prompts_of(CODE[2:3])[0]
    params = SamplingParams(temperature=0.6, min_p=0.05, seed=3, max_tokens=40, ignore_eos=True, logprobs=3)
    got = {}
    for spec, k in (("off", 1), ("mtp", 5)):
        e = Engine(loaded.model, EngineConfig(speculator=spec, draft_len=k, page_size=16, num_pages=64,
                                              loop_guard="off", spec_adaptive=False), tokenizer=loaded.tokenizer)
        e.add_request(Request(tuple(prompt), params))
        got[spec] = []
        while e.has_work():
            for ev in e.step():
                got[spec] += list(zip(ev.token_ids, ev.logprobs, ev.top_logprobs))
    a, b = got["mtp"], got["off"]
    assert [t for t, _, _ in a] == [t for t, _, _ in b]
    assert np.allclose([x for _, x, _ in a], [x for _, x, _ in b], atol=1e-5)
    assert [[i for i, _ in top] for _, _, top in a] == [[i for i, _ in top] for _, _, top in b]


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_5_moe_text"])
def test_a_random_heads_chains_are_rejected_at_every_depth_and_roll_back(family):
    """With every guess drafted, a random head's chains are mostly rejected, at the first draft or later: each
    rejection sets the hybrid state back to the snapshot after the tokens before it."""
    from tests.test_mtp import with_mtp_head

    model, _, _ = with_mtp_head(family)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 512, n).tolist() for n in (5, 23, 41, 12)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (30, 24, 28, 20)]
    cfg = EngineConfig(page_size=8, num_pages=64, max_batch_tokens=48, max_slots=4, loop_guard="off")
    ref = Engine(model, cfg).generate(prompts, params)
    spec = Engine(model, cfg.replace(speculator="mtp", spec_min_confidence=0.0, spec_adaptive=False, draft_len=4))
    depths = []
    postprocess = spec._postprocess

    def seen(plan, out):
        depths.extend(len(c.drafts) for c in plan.chunks if c.drafts)
        return postprocess(plan, out)

    spec._postprocess = seen
    assert spec.generate(prompts, params) == ref
    assert spec.stats.drafted_tokens > 100 and max(depths) == 4


def test_prompt_lookup_drafts_the_run_after_the_match():
    """A reply that copies its prompt (a file read back): prompt lookup drafts the tokens after the match, up to
    draft_len; most are accepted, and where the reply parts from the prompt the rest are rejected (the demo
    model is hybrid: its state rolled back)."""
    text = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
    prompt = prompts_of([text * 3])
    greedy = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    stats = {}
    for k in (1, 6):
        e = same("ngram", prompt, greedy, draft_len=k)
        stats[k] = (e.stats.steps, e.stats.drafted_tokens, e.stats.accepted_tokens)
    print("draft_len -> (steps, drafted, accepted):", stats)
    assert stats[6][0] < stats[1][0] and stats[6][2] > stats[1][2]
    assert 0 < stats[6][2] < stats[6][1]


def test_pauses_resumes_prefix_reuse_loop_guard_and_stops_hold():
    shared = prompts_of(["# utilities shared by the tools below\nimport re\nimport json\n\n"])[0]
    prompts = [shared + p for p in prompts_of(CODE)] + [shared + prompts_of(["def parse(text):\n"])[0]]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True) for _ in prompts]
    e = same("mtp", prompts, params, page_size=8, num_pages=24, max_batch_tokens=64, max_slots=6, draft_len=4)
    assert e.stats.pauses > 0 and e.stats.resumes > 0 and e.stats.accepted_tokens > 0
    loops = prompts_of(["def show_compilers():\n    ", "x = 1\nx = 1\nx = 1\n"])
    for spec, mode in (("mtp", "stop"), ("mtp", "end_thinking"), ("ngram", "escape")):
        same(spec, loops, [SamplingParams(temperature=0, max_tokens=300), SamplingParams(temperature=0, max_tokens=200)],
             loop_guard=mode, draft_len=5)
    for m in (1, 2, 3, 5, 17):  # drafts never take a sequence past max_tokens
        out, _ = run("mtp", prompts_of(CODE[:2]), SamplingParams(temperature=0, max_tokens=m, ignore_eos=True),
                     draft_len=7, spec_min_confidence=0.0)
        assert [len(o) for o in out] == [m, m]
    stops = [SamplingParams(temperature=0, max_tokens=60, stop=["\n"]),
             SamplingParams(temperature=0, max_tokens=60, stop=["("])]
    same("mtp", prompts_of(CODE[:2]), stops, draft_len=6)


def test_json_answers_with_chained_drafts():
    tok = demo().tokenizer
    prompt = tok.apply_chat([{"role": "user", "content": "Describe is_even(n) as a JSON object."}],
                            enable_thinking=False)
    params = [SamplingParams(temperature=0, max_tokens=80, json_object=True),
              SamplingParams(temperature=0.7, seed=5, max_tokens=80, json_object=True)]
    for spec in ("mtp", "ngram"):
        e = same(spec, [prompt, prompt], params, draft_len=4, spec_min_confidence=0.0)
        assert e.stats.drafted_tokens > 0


def test_the_plan_gives_drafts_the_rows_the_budget_leaves_and_rollback_points():
    e = _demo_engine(max_batch_tokens=8, max_slots=4, num_pages=64, draft_len=7)
    for p in prompts_of(CODE[:3]):
        e.add_request(Request(tuple(p), SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)))
    while any(s.in_prefill for s in e.running) or len(e.running) < 3:
        e.step()
    a, b, c = e.running
    a.drafts, b.drafts, c.drafts = (1, 2, 3, 4), (5, 6, 7), ()
    plan = plan_step(e.running, e.cfg, snapshots=False)
    # 8 tokens: a keeps one for each decode after it (b, c), so 4 of its drafts fit after its real token: 1 + 4;
    # b's real token and one draft; c's real token
    assert [(ch.num_tokens, ch.drafts) for ch in plan.chunks] == [(5, (1, 2, 3, 4)), (2, (5,)), (1, ())]
    n = a.num_computed
    assert plan.chunks[0].rollback == (n + 1, n + 2, n + 3, n + 4)  # the states after the real token and each draft
    assert plan.chunks[0].snapshot_at == (n + 1, n + 2, n + 3, n + 4)  # but the last
    # with decode graphs (`graph_drafts`: the drafts a sequence that a graph of n sequences takes): a step of
    # decodes alone verifies at most that many a sequence, a step beside a prompt's chunk every draft the budget
    # leaves room for
    widths = []

    def takes(k):
        return lambda n: widths.append(n) or k
    assert [ch.drafts for ch in plan_step(e.running, e.cfg, False, graph_drafts=takes(1)).chunks] == [(1,), (5,), ()]
    assert widths == [3]
    # spare rows filled (`fill_rows`): a graph of 1 + 2 rows a sequence computes c's second row anyway: its guess
    c.guess = 9
    filled = plan_step(e.running, e.cfg.replace(max_batch_tokens=16), False, fill_rows=12, graph_drafts=takes(2))
    assert [ch.drafts for ch in filled.chunks] == [(1, 2), (5, 6), (9,)]
    c.guess = None
    assert [ch.drafts for ch in plan_step(e.running, e.cfg, False, graph_drafts=takes(2)).chunks] == \
        [(1, 2), (5, 6), ()]
    # 0 (no graph of that many sequences): the step runs eagerly, every draft the budget leaves room for
    assert [ch.drafts for ch in plan_step(e.running, e.cfg, False, graph_drafts=takes(0)).chunks] == \
        [(1, 2, 3, 4), (5,), ()]
    late = Request(tuple(prompts_of(["# notes\n" * 20])[0]), SamplingParams(temperature=0, max_tokens=4))
    e.add_request(late)
    e.admission(e)
    # under decode-priority the prompt's chunk takes what the decodes' own tokens leave, as with no draft (5 of
    # 8), and the drafts what it leaves (none); before, eagerly the drafts left it nothing, step after step
    priority = e.cfg.replace(prefill_policy="decode-priority")
    for graphs in (None, takes(1)):
        starved = plan_step(e.running, priority, False, graph_drafts=graphs)
        assert [ch.drafts for ch in starved.chunks if not ch.seq.in_prefill] == [(), (), ()]
        assert [ch.num_tokens for ch in starved.chunks if ch.seq.in_prefill] == [5]
    # ... where that leaves it one token (no chunk of two beside the decodes), a graph takes the step's drafts: its
    # width counts the prompt's sequence
    one = plan_step(e.running, priority.replace(max_batch_tokens=4), False, graph_drafts=takes(1))
    assert [ch.num_tokens for ch in one.chunks if ch.seq.in_prefill] == [1]
    assert widths[-1] == 4
    e.cfg = e.cfg.replace(max_batch_tokens=32)
    assert any(s.in_prefill for s in e.running)
    mixed = plan_step(e.running, e.cfg, False, graph_drafts=takes(1))
    assert [ch.drafts for ch in mixed.chunks if not ch.seq.in_prefill] == [(1, 2, 3, 4), (5, 6, 7), ()]


def test_a_chain_takes_no_page_and_drafts_lacking_pages_go_from_the_last():
    """A draft's row needs a page, and so does the pair of the head's chained pass before it (its keys and values,
    past the computed positions): a chain stays within the pages its sequence holds, so that it never takes a page
    that another sequence's real token needs (no pause for a draft); drafts lacking pages at planning go from the
    last."""
    for k in (1, 3):  # A holds 15 tokens in 2 pages, B 16 in 2 (full), one page free: B's next token takes it
        e = _demo_engine(page_size=8, num_pages=40, max_batch_tokens=64, draft_len=k)
        rng = np.random.default_rng(2)
        for n in (15, 16):
            e.add_request(Request(tuple(int(t) for t in rng.integers(3, 500, n)),
                                  SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)))
        e.admission(e)
        while len(e.blocks.free) > 1:
            e.blocks.append()
        e.step()
        a, b = e.running
        assert (len(a.pages), len(b.pages), len(e.blocks.free)) == (2, 2, 1)
        e.step()
        assert e.stats.pauses == 0
    e = _demo_engine(page_size=8, num_pages=64, draft_len=7)
    e.add_request(Request(tuple(prompts_of(["def main():\n    print("])[0]),
                          SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)))
    s, edge = None, 0
    for _ in range(40):
        e.step()
        s = e.running[0]
        room = len(s.pages) * 8 - s.num_computed - 1  # rows past the real token's within the pages held
        assert len(s.drafts) <= max(1, room)  # the head's first guess: checked at planning
        edge += 1 < len(s.drafts) == room < 7  # a chain the page's end stopped
    assert edge and e.stats.accepted_tokens > 0 and e.stats.pauses == 0
    taken = []
    while (page := e.blocks.append()) is not None:  # other conversations hold every free page
        taken.append(page)
    if len(s.pages) * 8 - s.num_computed - 1 < 2:  # a page with room for two drafts at least
        e.blocks.release([taken.pop()])
        assert e._give_pages(s, len(s.pages) * 8 + 1)
    room = len(s.pages) * 8 - s.num_computed - 1
    s.drafts = tuple(range(1, room + 3))  # two more than the pages hold
    assert [c.drafts for c in e._plan_with_pages().chunks] == [s.drafts[:room]] and e.stats.pauses == 0


def test_drafts_never_take_a_page_a_later_plan_gives_a_prompt():
    """Decode-priority: a draft takes the last free page and a later decode's drafts lack one and are cut; the
    prompt's chunk beside them keeps the tokens the policy gives it with no draft (`planner._prefill_reserve`: a
    cut draft never hands it budget whose pages it lacks) and its pages, so nobody is paused for a draft."""
    e = _demo_engine(page_size=8, num_pages=64, max_batch_tokens=24, draft_len=7, prefill_policy="decode-priority")
    for p in prompts_of(CODE[:2]):
        e.add_request(Request(tuple(p), SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)))
    while any(s.in_prefill for s in e.running) or len(e.running) < 2 or any(s.num_computed % 8 < 1
                                                                           for s in e.running):
        assert e.stats.steps < 150
        e.step()
    e.add_request(Request(tuple(prompts_of(["# notes\n" * 2])[0]), SamplingParams(temperature=0, max_tokens=4)))
    e.admission(e)
    a, b, c = e.running
    assert c.in_prefill

    def hold(s, tokens):  # s holds exactly the pages of its first `tokens` tokens
        while len(s.pages) > e.blocks.pages_for(tokens):
            e.blocks.release([s.pages.pop()])
        assert e._give_pages(s, tokens)

    hold(a, a.num_computed + 1)
    hold(b, b.num_computed + 1)
    a.drafts = b.drafts = tuple(range(1, 8))  # each needs a page more than it holds
    assert c.num_uncomputed <= 24 - 2 - 14  # a short prompt: room for both decodes' drafts beside its chunk
    hold(c, c.num_tokens)  # the prompt's chunk beside both, in full: within its pages
    taken = []
    while (page := e.blocks.append()) is not None:
        taken.append(page)
    e.blocks.release([taken.pop()])  # one page free
    plan = e._plan_with_pages()
    assert e.stats.pauses == 0
    assert [(x.seq, x.num_tokens) for x in plan.chunks if x.seq is c] == [(c, c.num_uncomputed)]
    assert sum(x.num_tokens for x in plan.chunks) <= 24 and plan.chunks[0].drafts == a.drafts
    assert len(b.pages) == e.blocks.pages_for(b.num_computed + 1 + len(plan.chunks[1].drafts))  # b's cut to its page


def test_a_chain_stops_where_its_whole_run_is_no_longer_likely():
    """Confidence scheduling over a chain: a draft is added while the product of the head's probabilities along the
    chain (the chance, as far as the head knows, that every draft up to it is accepted) stays at
    spec_min_confidence, so an agent drafts as many tokens as are likely to be accepted."""
    e = _demo_engine(page_size=64, num_pages=16, draft_len=7, spec_min_confidence=0.6)
    e.add_request(Request(tuple(prompts_of(["def main():\n    print("])[0]),
                          SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)))
    e.step()
    s = e.running[0]
    ops = e.model.backend
    calls = []

    def chain(entries, hidden):  # each link's guess 40 + its depth, at probability 0.8
        calls.append(len(entries))
        n = len(entries)
        return (np.full(n, 40 + len(s.drafts)), np.full(n, 0.8, np.float32),
                ops.from_host(np.zeros((n, e.model.cfg.hidden_size), np.float32)))

    e.runner.mtp_chain = chain
    for first, expect in ((0.9, (7, 41)), (0.7, (7,)), (1.0, (7, 41, 42))):
        s.drafts = (7,)  # 0.9 x 0.8 = 0.72 kept, x 0.8 = 0.576 not; 0.7 x 0.8 = 0.56 not; 1 x 0.8 x 0.8 = 0.64 kept
        e._chain([s], ops.from_host(np.zeros((1, e.model.cfg.hidden_size), np.float32)), [first], 7)
        assert s.drafts == expect, (first, s.drafts)


def test_draft_len_setting():
    with pytest.raises(Exception, match="draft_len"):
        EngineConfig(draft_len=8)
    loaded = demo()
    assert not Engine(loaded.model, EngineConfig(speculator="mtp", draft_len=0)).speculate  # 0: nothing drafted
    from decapybara.server.config import AppConfig

    assert AppConfig().engine_config(cuda=False).draft_len == EngineConfig().draft_len == 1
    assert AppConfig(draft_len="5").engine_config(cuda=False).draft_len == 5
    with pytest.raises(Exception, match="draft_len"):
        AppConfig(draft_len=9)
    import argparse

    from decapybara.server.cli_serve import add_parser, app_args

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    assert app_args(parser.parse_args(["serve", "--speculator", "ngram", "--draft-len", "4"])) == {
        "speculator": "ngram", "draft_len": 4}
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--draft-len", "8"])
