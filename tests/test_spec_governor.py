"""The speculation governor (EngineConfig.spec_adaptive, engine/spec_governor.py): drafts are verified only at the
step widths where steps that verify them are measured to emit more tokens a second. Pure arithmetic on synthetic
steps (the H200's measured 27B costs), then the engine on the demo model with a fake step timer: where verification
steps are made to cost more than their accepted drafts save, drafts are withheld; where they cost nothing, they stay;
the tokens are those without speculation either way."""

from __future__ import annotations

import functools

import pytest

from decapybara.backend.numpy_backend import NumpyBackend
from decapybara.config import DEMO_MODEL, EngineConfig
from decapybara.engine.engine import Engine
from decapybara.engine.sampling import SamplingParams
from decapybara.engine.spec_governor import SpecGovernor
from decapybara.model.load import load_model


def drive(g: SpecGovernor, width: int, steps: int, cost) -> list[bool]:
    """`steps` steps of `width` sequences; `cost(allowed, i)` -> (tokens, seconds) of step i. The choices made."""
    chosen = []
    for i in range(steps):
        allowed = g.allow(width)
        chosen.append(allowed)
        g.record(width, allowed, *cost(allowed, i))
    return chosen


def test_twelve_agents_whose_verification_costs_twice_withhold_drafts():
    # 27B MXFP4 on an H200: 12 agents decode in 9.69 ms, verify in 18.76 ms; 60% of drafts accepted
    g = SpecGovernor()
    chosen = drive(g, 12, 480, lambda on, i: (12 * 1.6, 0.01876) if on else (12, 0.00969))
    assert chosen[:4] == [True] * 4 and chosen[4:8] == [False] * 4  # each arm measured first (its first step not)
    on = sum(chosen)
    assert on <= 4 + 480 // g.explore_every + 1, on  # afterwards only the exploring steps verify
    assert g.summary()["12"]["verify"] == 0.0


def test_one_agent_whose_verification_pays_keeps_drafting():
    # one agent: decode 5.80 ms, verify 7.14 ms; 80% accepted: 1.8 tokens a verification step
    g = SpecGovernor()
    chosen = drive(g, 1, 480, lambda on, i: (1.8, 0.00714) if on else (1, 0.0058))
    off = len(chosen) - sum(chosen)
    assert off <= 4 + 480 // g.explore_every + 1, off
    assert g.summary()["1"]["verify"] == 1.0


def test_a_change_in_acceptance_is_followed_both_ways():
    g = SpecGovernor()

    def cost(on: bool, i: int) -> tuple[float, float]:
        accepted = 0.9 if i < 300 or i >= 700 else 0.05  # a stretch of text the drafts miss
        return (1 + accepted, 0.00714) if on else (1, 0.0058)

    chosen = drive(g, 1, 1000, cost)
    assert sum(chosen[200:300]) >= 95  # drafting while the drafts are accepted
    assert sum(chosen[400:700]) <= 300 // g.explore_every + 1  # the misses found by the exploring steps
    assert sum(chosen[850:1000]) >= 145  # and their end
    assert sum(chosen[300:300 + 2 * g.explore_every + 10]) < 2 * g.explore_every + 10  # switched within ~2 rounds


def test_widths_are_chosen_apart_and_bad_steps_are_ignored():
    g = SpecGovernor(warmup=2, explore_every=10)
    for _ in range(40):
        for width, (on, off) in {1: ((1.8, 0.007), (1, 0.006)), 12: ((19, 0.019), (12, 0.0097))}.items():
            allowed = g.allow(width)
            g.record(width, allowed, *(on if allowed else off))
    s = g.summary()
    assert s["1"]["verify"] == 1.0 and s["12"]["verify"] == 0.0, s
    assert s["1"]["on_steps"] + s["1"]["off_steps"] == 40 - 2  # each arm's first step not counted
    g.record(5, True, 3, 0.0)  # no time measured: nothing learnt
    assert "5" not in g.summary()
    g = SpecGovernor()
    for seconds in (0.5, 0.010, 0.011, 0.010, 0.009, 0.2, 0.010):  # a first step, then a host hiccup, clipped
        g.record(3, True, 3, seconds)
    assert g.summary()["3"]["on_tok_s"] == pytest.approx(300, rel=0.35), g.summary()
    assert g.allow(7)  # an unmeasured width drafts (speculation is what was asked for)
    g = SpecGovernor(explore_every=10)  # an exploration is handed out once, recorded or not (a mixed step)
    drive(g, 2, 30, lambda on, i: (2, 0.01) if on else (2, 0.02))
    for _ in range(12):  # verifying steps recorded without asking: an exploration is due
        g.record(2, True, 2, 0.01)
    asked = [g.allow(2) for _ in range(30)]
    assert asked.count(False) <= 1, asked
    for bad in ({"decay": 1.0}, {"warmup": 0}, {"explore_every": 1}, {"clip": 0.5}):
        with pytest.raises(ValueError):
            SpecGovernor(**bad)


@functools.cache
def demo():
    return load_model(str(DEMO_MODEL), NumpyBackend())


CODE = ["def main():\n    print(", "import os\nimport sys\n\n\ndef ", "class Stack:\n    def __init__(self):\n"]


def timed_engine(extra_per_draft_row: float, **cfg) -> Engine:
    """The demo engine with speculation whose steps cost, by a fake timer, 10 ms plus `extra_per_draft_row` a
    verified draft (the real time is not measured)."""
    loaded = demo()
    settings = {"page_size": 16, "num_pages": 256, "max_batch_tokens": 256, "loop_guard": "off",
                "speculator": "mtp", "spec_min_confidence": 0.0, **cfg}
    e = Engine(loaded.model, EngineConfig(**settings), tokenizer=loaded.tokenizer)
    now = [0.0]
    e.timer = lambda: now[0]
    run = e.runner.run

    def costed(plan, normed=False):
        now[0] += 0.010 + extra_per_draft_row * sum(bool(c.drafts) for c in plan.chunks)
        return run(plan, normed=normed)

    e.runner.run = costed
    return e


def test_the_engine_withholds_drafts_where_verification_is_made_slow_and_keeps_the_tokens():
    loaded = demo()
    prompts = [loaded.tokenizer.encode(t) for t in CODE]
    params = [SamplingParams(temperature=0.7, seed=i, max_tokens=120, ignore_eos=True) for i in range(3)]
    ref = Engine(loaded.model, EngineConfig(page_size=16, num_pages=256, max_batch_tokens=256, loop_guard="off"),
                 tokenizer=loaded.tokenizer).generate(prompts, params)
    slow = timed_engine(0.050)  # a draft's row costs 5 steps: no acceptance repays it
    assert slow.generate(prompts, params) == ref
    s = slow.stats
    w = slow.governor.summary()["3"]
    print("slow verification:", w, s.withheld_steps, s.drafted_tokens)
    assert w["verify"] == 0.0 and w["off_steps"] > 4 * w["on_steps"], w
    assert s.withheld_steps > 60
    free = timed_engine(0.0)  # verification costs nothing more: every accepted draft is a step saved
    assert free.generate(prompts, params) == ref
    w = free.governor.summary()["3"]
    print("free verification:", w, free.stats.withheld_steps, free.stats.drafted_tokens)
    assert w["verify"] == 1.0 and w["on_steps"] > 4 * w["off_steps"], w
    assert free.stats.accepted_tokens > slow.stats.accepted_tokens
    assert free.stats.steps < slow.stats.steps


def test_steps_that_capture_a_graph_or_hold_a_prompt_are_not_measured():
    loaded = demo()
    e = timed_engine(0.0)
    e.add_request(__import__("decapybara.engine.sequence", fromlist=["Request"]).Request(
        tuple(loaded.tokenizer.encode(CODE[0])), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)))
    e.step()  # the prompt's chunk
    assert not e.governor.widths
    count = [0]
    e.runner.captures = lambda: count.__setitem__(0, count[0] + 1) or count[0]  # every step captures
    e.step()
    assert not e.governor.widths
    del e.runner.captures
    e.step()
    e.step()  # (an arm's first step at a width is not counted: it pays one-time costs)
    assert e.governor.summary()["1"]["on_steps"] == 1
    assert e.snapshot_stats()["speculation"]["1"]["on_steps"] == 1  # /stats shows each width's two rates
    assert not Engine(loaded.model, EngineConfig(speculator="mtp", spec_adaptive=False)).governor
    assert Engine(loaded.model, EngineConfig(speculator="off")).governor is None
    from decapybara.server.config import AppConfig

    assert AppConfig().engine_config(cuda=True).spec_adaptive
    assert not AppConfig(spec_adaptive="false").engine_config(cuda=False).spec_adaptive


def test_the_heads_kv_only_pass_writes_what_its_whole_pass_writes():
    """`QwenModel.mtp_kv` (a step whose next drafts are withheld) writes the head's keys and values as
    `mtp_forward` does: the same cache, for prompt-long and decode-sized pair runs."""
    import numpy as np

    from decapybara.model.batch import ForwardBatch

    model = demo().model
    rng = np.random.default_rng(3)
    caches = [model.new_kv_cache(16, 16, "16/16") for _ in range(2)]
    for start, n in ((0, 21), (21, 1), (22, 2)):  # a prompt's pairs, then a decode's, then an accepted draft's
        batch = ForwardBatch.build([(rng.integers(0, 8000, n).tolist(), start, np.arange(4, dtype=np.int32), None)],
                                   16, logits="none")
        batch.logits_rows = np.asarray([n - 1], np.int64)
        normed = rng.standard_normal((n, model.cfg.hidden_size)).astype(np.float32)
        model.mtp_forward(batch, normed, caches[0])
        model.mtp_kv(batch, normed, caches[1])
    a, b = (c.export_pages(np.arange(4)).arrays for c in caches)
    keys = [k for k in a if k.startswith("('mtp'") or "mtp" in k]
    assert keys, list(a)
    for k in keys:
        assert np.array_equal(a[k], b[k]), k


def test_guesses_after_withheld_steps_are_those_of_a_head_that_never_stopped():
    """Steps withheld by the governor run the head's KV-only pass, so its cache stays whole: once drafting
    resumes, each guess is the one an engine that ran the whole head every step makes at that position."""
    loaded = demo()
    prompt = loaded.tokenizer.encode("import os\n\n\ndef walk(root):\n")
    params = SamplingParams(temperature=0, max_tokens=90, ignore_eos=True)
    guesses = {}
    for name, withhold in (("whole", range(0)), ("withheld", range(8, 40))):
        e = Engine(loaded.model, EngineConfig(page_size=16, num_pages=64, loop_guard="off", speculator="mtp",
                                              spec_min_confidence=0.0, spec_adaptive=name == "withheld"),
                   tokenizer=loaded.tokenizer)
        seen, mtp = {}, e.runner.mtp
        step = [0]

        def logged(entries, rows, draft_rows, normed, chain=False, mtp=mtp, seen=seen):
            g, p, own = mtp(entries, rows, draft_rows, normed, chain=chain)
            tokens, p0, _ = entries[0]
            if len(g):  # (none where the pass only writes a finished sequence's keys and values)
                seen[p0 + len(tokens)] = int(g[0])  # the guess at the sequence's last pair
            return g, p, own

        e.runner.mtp = logged
        if e.governor is not None:
            e.governor.allow = lambda width, step=step, withhold=withhold: step[0] not in withhold
        orig = e.step

        def counted(orig=orig, step=step):
            step[0] += 1
            return orig()

        e.step = counted
        out = e.generate([prompt], params)[0]
        guesses[name] = (out, seen, e.stats.withheld_steps)
    (out_a, whole, _), (out_b, withheld, n) = guesses["whole"], guesses["withheld"]
    assert out_a == out_b and n > 20
    later = [p for p in withheld if p > max(withheld) - 30]
    assert later and all(withheld[p] == whole[p] for p in later), [(p, withheld[p], whole.get(p)) for p in later]
    assert len(withheld) < len(whole)  # no guesses made on the withheld stretch


def test_each_head_pass_is_charged_to_the_step_it_drafts_for_and_a_resume_to_none():
    """The head's pass at the end of a step drafts for the next one (or, withheld, only keeps its cache), so its
    time goes to the next step's measure: with a fake timer (a forward 10 ms, a verified draft +5 ms, the head's
    whole pass 6 ms, its KV-only pass 0.2 ms) the measured rates are the true ones, withholding (faster) is
    chosen, and each exploring step is one step of the slower arm. Admission (a resume's page imports) is not
    timed."""
    loaded = demo()
    e = timed_engine(0.005, spec_min_confidence=0.0)
    clock = e.timer.__closure__[0].cell_contents  # the fake timer's list
    mtp, mtp_kv = e.runner.mtp, e.runner.mtp_kv

    def whole(*a, **kw):
        clock[0] += 0.006
        return mtp(*a, **kw)

    def kv_only(*a):
        clock[0] += 0.0002
        return mtp_kv(*a)

    e.runner.mtp, e.runner.mtp_kv = whole, kv_only
    arms = []
    record = e.governor.record
    e.governor.record = lambda w, allowed, t, s: (arms.append(allowed), record(w, allowed, t, s))
    admission = e.admission

    def slow_admission(engine):
        clock[0] += 0.3  # as a resume's page imports would
        admission(engine)

    e.admission = slow_admission
    e.generate([loaded.tokenizer.encode(CODE[0])], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    w = e.governor.summary()["1"]
    acc = e.stats.accepted_tokens / e.stats.drafted_tokens
    assert acc > 0.9
    assert abs(w["on_tok_s"] - (1 + acc) / 0.021) < 0.02 * w["on_tok_s"], w  # forward + draft row + whole head
    assert abs(w["off_tok_s"] - 1 / 0.0102) < 0.01 * w["off_tok_s"], w  # forward + KV-only head
    assert w["verify"] == 0.0
    runs = [(a, len(list(g))) for a, g in __import__("itertools").groupby(arms)]
    assert runs[0] == (True, 4) and all(n == 1 for a, n in runs[2:] if a), runs  # warm-up, then single explorations
    assert sum(a for a in arms[3:]) <= len(arms) // e.governor.explore_every + 1, runs


def test_the_governors_rates_are_prometheus_gauges():
    from prometheus_client.parser import text_string_to_metric_families

    from decapybara.api.metrics import prometheus_text

    g = SpecGovernor()
    drive(g, 12, 60, lambda on, i: (19.2, 0.01876) if on else (12, 0.00969))
    drive(g, 1, 60, lambda on, i: (1.8, 0.00714) if on else (1, 0.0058))
    text = prometheus_text({"speculation": g.summary(), "withheld_steps": 7, "steps": 120})
    families = {f.name: f for f in text_string_to_metric_families(text)}
    rates = {(s.labels["width"], s.labels["arm"]): s.value for s in families["decapybara_spec_tokens_per_second"].samples}
    assert rates[("12", "withhold")] == pytest.approx(12 / 0.00969, rel=1e-3)
    assert rates[("1", "verify")] == pytest.approx(1.8 / 0.00714, rel=1e-3)
    verify = {s.labels["width"]: s.value for s in families["decapybara_spec_verify"].samples}
    assert verify == {"1": 1.0, "12": 0.0}
    assert families["decapybara_withheld_steps"].type == "counter"
    assert families["decapybara_withheld_steps"].samples[0].value == 7


def test_a_head_pass_counts_only_for_the_sequences_it_drafted_for():
    """The head's pass at a step's end goes to the next step's measure only where that step decodes the same
    sequences and the pass was a decode's (not a prompt's, not an aborted agent's), and captured no graph."""
    from decapybara.engine.sequence import Request

    loaded = demo()
    e = timed_engine(0.0)
    clock = e.timer.__closure__[0].cell_contents
    mtp = e.runner.mtp
    e.runner.mtp = lambda *a, **kw: (clock.__setitem__(0, clock[0] + 0.2), mtp(*a, **kw))[1]  # a slow head: 0.2 s a pass
    seen = []
    record = e.governor.record
    e.governor.record = lambda w, allowed, t, s: (seen.append((allowed, s)), record(w, allowed, t, s))
    prompt = loaded.tokenizer.encode(CODE[0] * 8)[:33]  # two full pages and a token
    e.add_request(Request(tuple(prompt), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                          request_id="a"))
    for _ in range(20):
        e.step()
    # 10 ms a forward, plus the 0.2 s whole pass that drafted for a verifying step (a KV-only pass: nothing)
    assert seen and all(abs(s - (0.21 if on else 0.01)) < 1e-9 for on, s in seen), seen
    assert {on for on, _ in seen} == {True, False}
    n = len(seen)
    e.abort("a")
    reused = e.stats.reused_prompt_tokens
    e.add_request(Request(tuple(prompt), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                          request_id="b"))  # two pages cached: its first step is a one-token decode
    e.step()
    assert e.stats.reused_prompt_tokens - reused == 32
    assert len(seen) == n, seen[n:]  # "a"'s last pass is not "b"'s
