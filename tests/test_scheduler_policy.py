"""The multi-agent policy: throughput first, bounded waits, victims, hysteresis, exactness, idle expiry."""

from __future__ import annotations

import functools
import itertools
import json
from dataclasses import dataclass, field

import numpy as np
import pytest

from decapybara.config import EngineConfig
from decapybara.engine.engine import Engine
from decapybara.engine.sampling import SamplingParams
from decapybara.engine.sequence import Request, SeqStatus
from decapybara.errors import ConfigError
from decapybara.scheduler import AgePolicy, PolicyConfig, candidate_score, victim_score, wait_bound_s
from decapybara.testing import tiny_qwen

DT = 0.1  # fake seconds per engine step
FAST = PolicyConfig(age_weight=32.0, work_cap=64.0, margin=8.0, quantum_s=0.5)  # horizon (C + m) / a = 2.25 s


@functools.cache
def model(family: str = "qwen3"):
    return tiny_qwen(family)[0]


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def tokens(n: int, seed: int) -> tuple[int, ...]:
    return tuple(np.random.default_rng(seed).integers(0, 512, n).tolist())


@dataclass
class Sim:
    """Drives an engine on a fake clock (DT per step) and observes, from the outside, every wait episode:
    (request, entered, started or None, candidates that entered no later)."""

    engine: Engine
    clock: FakeClock
    outs: dict[str, list[int]] = field(default_factory=dict)
    finished: dict[str, float] = field(default_factory=dict)
    first_token: dict[str, float] = field(default_factory=dict)
    episodes: list[list] = field(default_factory=list)
    open: dict[str, list] = field(default_factory=dict)
    steps: int = 0

    @classmethod
    def make(cls, policy=None, family: str = "qwen3", **kw) -> Sim:
        base = {"page_size": 8, "num_pages": 256, "max_batch_tokens": 48, "loop_guard": "off", "max_slots": 2}
        base.update(kw)
        clock = FakeClock()
        return cls(Engine(model(family), EngineConfig(**base), clock=clock, admission=policy), clock)

    def candidates(self) -> int:
        return len(self.engine.waiting) + len(self.engine.paused)

    def add(self, rid: str, prompt: tuple[int, ...], max_tokens: int, conversation: str | None = None,
            prompt_logprobs: int | None = None):
        ahead = self.candidates()
        self.engine.add_request(Request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                               prompt_logprobs=prompt_logprobs), rid, conversation))
        self.outs[rid] = []
        self._open(rid, ahead)

    def _open(self, rid: str, ahead: int) -> None:
        ep = [rid, self.clock.t, None, ahead]
        self.episodes.append(ep)
        self.open[rid] = ep

    def step(self) -> None:
        before = {rid: (s.status, s.num_pauses, s.num_resumes) for rid, s in self.engine.seqs.items()}
        for ev in self.engine.step():
            self.outs[ev.request_id] += ev.token_ids
            self.first_token.setdefault(ev.request_id, self.clock.t)
            if ev.finish_reason is not None:
                self.finished[ev.request_id] = self.clock.t
        t = self.clock.t
        for rid, (status, pauses, resumes) in before.items():
            s = self.engine.seqs.get(rid)
            started = s is None or (status is SeqStatus.WAITING and s.status is not SeqStatus.WAITING) \
                or s.num_resumes > resumes
            if rid in self.open and started:
                self.open.pop(rid)[2] = t
            if s is not None and s.num_pauses > pauses:
                self._open(rid, self.candidates() - 1)
        self.clock.t += DT
        self.steps += 1

    def run(self, max_steps: int = 2000) -> None:
        while self.engine.has_work() and self.steps < max_steps:
            self.step()

    def waits(self) -> list[tuple[str, float, int]]:
        now = self.clock.t
        return [(rid, (start if start is not None else now) - entered, ahead)
                for rid, entered, start, ahead in self.episodes]


def reference(prompts: dict[str, tuple[int, ...]], max_tokens: dict[str, int], family: str = "qwen3"):
    """Every request's greedy output with a big pool, all slots and FCFS."""
    e = Engine(model(family), EngineConfig(page_size=8, num_pages=512, max_batch_tokens=48, loop_guard="off"))
    ids = list(prompts)
    outs = e.generate([list(prompts[i]) for i in ids],
                      [SamplingParams(temperature=0, max_tokens=max_tokens[i]) for i in ids])
    return dict(zip(ids, outs, strict=True))


# ---- pure scores -------------------------------------------------------------------------------------------
def test_scores_are_throughput_first_then_fifo():
    cfg = PolicyConfig(age_weight=10.0, work_cap=100.0, margin=5.0)
    assert candidate_score(cfg, 0.0, 30.0) == -30.0 > candidate_score(cfg, 0.0, 80.0)  # least work first
    assert candidate_score(cfg, 0.0, 500.0) == candidate_score(cfg, 0.0, 100.0)  # clamped at the cap
    waits = np.linspace(0, 30, 301)
    s = [candidate_score(cfg, w, 80.0) for w in waits]
    assert all(b > a for a, b in itertools.pairwise(s))  # strictly growing with the wait
    # From C / a = 10 s on, the score is the credit alone: a longer wait ranks first, whatever the work.
    assert candidate_score(cfg, 10.0, 100.0) == 100.0
    assert candidate_score(cfg, 10.5, 100.0) > candidate_score(cfg, 10.4, 0.0)
    assert victim_score(cfg, 1e9, 0.0) == cfg.work_cap  # V never exceeds C
    assert victim_score(cfg, 1.0, 90.0) < victim_score(cfg, 5.0, 90.0) < victim_score(cfg, 5.0, 20.0)
    assert wait_bound_s(cfg, 4, 9, 0.1) == pytest.approx(10.5 + 3 * 2.1)
    assert wait_bound_s(cfg.replace(age_weight=0.0), 4, 9, 0.1) == float("inf")


@pytest.mark.parametrize("bad", [{"age_weight": -1.0}, {"work_cap": 0.0}, {"margin": float("nan")},
                                 {"output_ema": 0.0}, {"reserve_pages_per_seq": -1}, {"idle_timeout_s": 0},
                                 {"quantum_s": True},
                                 {"default_output_tokens": 0}])
def test_bad_config_is_refused(bad):
    with pytest.raises(ConfigError):
        AgePolicy(PolicyConfig(**bad))


# ---- throughput first --------------------------------------------------------------------------------------
def test_five_short_jobs_go_first_and_the_long_one_still_progresses():
    prompts = {"long": tokens(12, 0), **{f"s{i}": tokens(12, 1 + i) for i in range(5)}}
    max_tokens = {"long": 60, **{f"s{i}": 8 for i in range(5)}}

    def play(policy) -> Sim:
        sim = Sim.make(policy, max_slots=2)
        for rid, prompt in prompts.items():  # the long job is first in line
            sim.add(rid, prompt, max_tokens[rid])
        sim.run()
        return sim

    fcfs, ours = play(None), play(AgePolicy(FAST))
    assert ours.outs == fcfs.outs == reference(prompts, max_tokens)
    shorts = [f"s{i}" for i in range(5)]
    last_short = max(ours.finished[s] for s in shorts)
    assert np.mean([ours.finished[s] for s in shorts]) < np.mean([fcfs.finished[s] for s in shorts])
    assert last_short < ours.finished["long"]  # the five are served first ...
    assert ours.first_token["long"] < last_short  # ... the long one advances meanwhile
    assert len(ours.outs["long"]) == 60  # ... and finishes


def test_cached_prompts_rank_first_and_peeking_has_no_side_effect():
    policy = AgePolicy(PolicyConfig(preemption=False))
    sim = Sim.make(policy, max_slots=1)
    e, first = sim.engine, tokens(32, 11)
    sim.add("a1", first, 8, "A")
    sim.run()
    sim.add("blocker", tokens(6, 12), 30)
    sim.step()
    sim.add("fresh", tokens(44, 13), 6)  # arrives first, nothing cached
    sim.add("cont", first + tuple(sim.outs["a1"]) + tokens(4, 14), 6, "A")  # 44 tokens, 32 in cached pages
    stats, lru = (e.blocks.stats.prefix_queries_tokens, e.blocks.stats.prefix_hits_tokens), list(e.blocks.lru)
    sim.step()  # ranks both (slot busy): peeks only
    assert (e.blocks.stats.prefix_queries_tokens, e.blocks.stats.prefix_hits_tokens) == stats
    assert list(e.blocks.lru) == lru
    queue = {q["request_id"]: q for q in policy.snapshot()["queue"]}
    assert queue["cont"]["work"] == pytest.approx(0.1 * (44 - 32) + 6)
    assert queue["fresh"]["work"] == pytest.approx(0.1 * 44 + 6)
    assert queue["cont"]["score"] > queue["fresh"]["score"]
    # the same continuation asking for prompt logprobs computes its whole prompt: no cached share in its work
    sim.add("scored", first + tuple(sim.outs["a1"]) + tokens(4, 14), 6, "A", prompt_logprobs=1)
    sim.step()
    assert {q["request_id"]: q for q in policy.snapshot()["queue"]}["scored"]["work"] == pytest.approx(0.1 * 44 + 6)
    sim.run()
    assert sim.first_token["cont"] < sim.first_token["fresh"]


# ---- bounded waits -----------------------------------------------------------------------------------------
def adversarial_stream(policy: AgePolicy, steps: int) -> Sim:
    """Short jobs arrive for ever, keeping three always queued; one long job arrives at step 5."""
    sim = Sim.make(policy, max_slots=2)
    n = 0
    for step in range(steps):
        if step == 5:
            sim.add("long", tokens(6, 999), 24)
        while sum(s.request_id != "long" for s in sim.engine.waiting) < 3:
            sim.add(f"short{n}", tokens(6, n), 4)
            n += 1
        sim.step()
    return sim


def test_age_score_bounds_every_wait_under_an_endless_stream():
    policy = AgePolicy(FAST)
    sim = adversarial_stream(policy, 220)
    waits = sim.waits()
    assert len(waits) > 60 and policy.stats.memory_pauses == 0  # the bound's premise: no memory pressure
    for rid, wait, ahead in waits:
        assert wait <= wait_bound_s(FAST, 2, ahead, DT) + 1e-9, (rid, wait, ahead)
    assert "long" in sim.finished and len(sim.outs["long"]) == 24
    long_wait, long_ahead = next((w, a) for r, w, a in waits if r == "long")
    print(f"\nmax wait {max(w for _, w, _ in waits):.2f} s; the long job waited {long_wait:.2f} s, "
          f"bound {wait_bound_s(FAST, 2, long_ahead, DT):.2f} s")


def test_pure_throughput_starves_the_long_job():
    sim = adversarial_stream(AgePolicy(FAST.replace(age_weight=0.0)), 220)
    (ahead,) = [a for r, _, a in sim.waits() if r == "long"]
    assert "long" in sim.open and sim.outs["long"] == []  # never admitted ...
    assert sim.clock.t - 0.5 > wait_bound_s(FAST, 2, ahead, DT) * 4  # ... long past the aged policy's bound
    assert len(sim.finished) > 60  # while short jobs kept finishing


# ---- victims -----------------------------------------------------------------------------------------------
def running_three(cfg: PolicyConfig) -> tuple[Sim, AgePolicy]:
    """A (arrived 0 s, 50 tokens to go), B (1 s, 50), C (2 s, 5), all admitted at 2 s, nothing computed."""
    policy = AgePolicy(cfg)
    sim = Sim.make(policy, max_slots=3)
    for rid, t, n in (("A", 0.0, 50), ("B", 1.0, 50), ("C", 2.0, 5)):
        sim.clock.t = t
        sim.engine.add_request(Request(tokens(9, ord(rid)), SamplingParams(temperature=0, max_tokens=n), rid))
    policy(sim.engine)
    assert [s.request_id for s in sim.engine.running] == ["C", "A", "B"]  # least work first, then FIFO
    return sim, policy


def test_memory_victim_is_the_lowest_victim_score_then_the_youngest():
    cfg = PolicyConfig(age_weight=1.0, work_cap=1000.0, prefill_weight=0.0)
    sim, policy = running_three(cfg)
    e = sim.engine
    # V = min(a * age, C) - W: A = 2 - 50, B = 1 - 50, C = 0 - 5. Not the youngest (C): B has the most to do.
    assert policy.choose_victim(e, e.seqs["A"]).request_id == "B"
    sim, policy = running_three(cfg.replace(age_weight=0.0))  # V = -W: A and B tie; the younger goes
    assert policy.choose_victim(sim.engine, sim.engine.seqs["C"]).request_id == "B"
    assert policy.stats.memory_pauses == 1 and policy.snapshot()["recent"][-1]["kind"] == "memory_pause"


def test_preemption_pauses_the_weakest_past_its_quantum_and_only_by_a_margin():
    cfg = PolicyConfig(age_weight=1.0, work_cap=1000.0, prefill_weight=0.0, margin=10.0, quantum_s=1.0)
    sim, policy = running_three(cfg)
    e = sim.engine
    sim.clock.t = 2.5
    e.add_request(Request(tokens(9, 7), SamplingParams(temperature=0, max_tokens=30), "D"))  # W = 30
    policy(e)  # quantum not over (ran 0.5 s): nobody is paused
    assert not e.paused and [s.request_id for s in e.waiting] == ["D"]
    # At 3.0 s: S_D = a*0.5*(1 + 30/1000) - 30 = -29.485; V_B = 2 - 50 = -48 (A: -47, C: +1 - 5).
    sim.clock.t = 3.0
    policy(e)
    assert [s.request_id for s in e.paused] == ["B"] and e.seqs["D"].status is SeqStatus.RUNNING
    assert policy.snapshot()["recent"][-2] == {"time": 3.0, "kind": "preempt", "request_id": "B",
                                               "conversation": None, "score": -48.0, "by": "D"}
    # A margin of 20 would have kept B: -29.485 <= -48 + 20.
    sim2, policy2 = running_three(cfg.replace(margin=20.0))
    sim2.clock.t = 2.5
    sim2.engine.add_request(Request(tokens(9, 7), SamplingParams(temperature=0, max_tokens=30), "D"))
    sim2.clock.t = 3.0
    policy2(sim2.engine)
    assert not sim2.engine.paused and policy2.stats.preemptions == 0


def test_hysteresis_prevents_thrash():
    """Aging so fast (C / a = one step) that every waiting job is overdue at once: without margin and quantum
    the two slots change hands at nearly every step; the quantum caps it at one pause per slot per q."""
    prompts = {f"j{i}": tokens(10, 50 + i) for i in range(4)}
    max_tokens = dict.fromkeys(prompts, 40)
    hasty = FAST.replace(age_weight=640.0)
    counts, seconds = {}, {}
    for name, cfg in (("none", hasty.replace(margin=0.0, quantum_s=0.0)), ("hysteresis", hasty)):
        policy = AgePolicy(cfg)
        sim = Sim.make(policy, max_slots=2)
        for rid, p in prompts.items():
            sim.add(rid, p, 40)
        sim.run()
        assert sim.outs == reference(prompts, max_tokens)
        counts[name], seconds[name] = policy.stats.preemptions, sim.clock.t
        assert sim.engine.stats.pauses == sim.engine.stats.resumes == policy.stats.preemptions
    print(f"\npreemptions without hysteresis {counts['none']}, with margin + quantum {counts['hysteresis']}")
    assert counts["none"] >= 0.75 * 2 * seconds["none"] / DT  # thrash: both slots swap at most steps
    assert counts["hysteresis"] <= 2 * (seconds["hysteresis"] / hasty.quantum_s + 1)
    assert counts["none"] >= 4 * counts["hysteresis"]


def test_a_job_that_does_not_fit_is_not_overtaken_by_smaller_ones():
    """Head-of-line by score: the best candidate waits for pages; a smaller later one that would fit must not
    jump ahead (else a stream of small jobs could starve a large one on memory instead of on slots)."""
    prompts = {"hog": tokens(40, 21), "big": tokens(40, 22), "small": tokens(6, 23)}
    max_tokens = {"hog": 40, "big": 8, "small": 8}
    policy = AgePolicy(FAST.replace(reserve_pages_per_seq=0))
    sim = Sim.make(policy, max_slots=2, num_pages=12)  # 96 tokens
    sim.add("hog", prompts["hog"], 40)  # grows to 10 pages
    while sim.engine.blocks.num_free >= 6:
        sim.step()
    sim.add("big", prompts["big"], 8)  # needs 6 pages: does not fit now
    for _ in range(5):
        sim.step()
    sim.add("small", prompts["small"], 8)  # needs 1 page: fits, and has less work
    sim.step()
    assert sim.engine.seqs["small"].status is SeqStatus.WAITING and len(sim.engine.running) == 1
    sim.run()
    assert sim.first_token["big"] < sim.first_token["small"]
    assert sim.outs == reference(prompts, max_tokens)


@pytest.mark.parametrize("reserve", [0, 1])
def test_admission_keeps_a_growth_reserve(reserve):
    policy = AgePolicy(FAST.replace(reserve_pages_per_seq=reserve, preemption=False))
    sim = Sim.make(policy, max_slots=2, num_pages=12)
    sim.add("a", tokens(40, 31), 8)
    sim.step()
    sim.step()  # "a" has computed 41 tokens: 6 pages held, 6 free
    assert sim.engine.blocks.num_free == 6
    sim.add("b", tokens(40, 32), 8)  # needs pages_for(41) = 6
    sim.step()
    admitted = sim.engine.seqs["b"].status is SeqStatus.RUNNING
    assert admitted == (reserve == 0)  # 6 + 1 page per running sequence (2) > 6 free


# ---- exactness under pauses --------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["qwen3", "qwen3_5_text"])
def test_pauses_and_resumes_are_exact_and_never_reprefill(family):
    prompts = {f"r{i}": tokens(14 + 3 * i, 100 + i) for i in range(6)}
    max_tokens = {f"r{i}": 12 + 7 * (i % 3) for i in range(6)}
    # Fast aging and a short quantum force preemptions; no reserve and a pool of 10 pages (80 tokens) for
    # three slots force the engine to ask for memory victims.
    policy = AgePolicy(FAST.replace(age_weight=160.0, quantum_s=0.3, reserve_pages_per_seq=0))
    sim = Sim.make(policy, family, max_slots=3, num_pages=10, enable_prefix_cache=False)
    arrivals = {rid: 4 * i for i, rid in enumerate(prompts)}  # staggered: later ones preempt aged ones
    while sim.engine.has_work() or len(sim.outs) < len(prompts):
        for rid, at in arrivals.items():
            if at == sim.steps:
                sim.add(rid, prompts[rid], max_tokens[rid])
        sim.step()
    st = sim.engine.stats
    assert policy.stats.preemptions > 0 and policy.stats.memory_pauses > 0
    assert st.pauses == policy.stats.preemptions + policy.stats.memory_pauses == st.resumes
    assert sim.outs == reference(prompts, max_tokens, family)
    assert st.computed_prompt_tokens == sum(len(p) for p in prompts.values())  # no prompt computed twice


# ---- conversations -----------------------------------------------------------------------------------------
def test_idle_conversation_is_forgotten_and_its_pages_evicted_first():
    policy = AgePolicy(PolicyConfig())
    sim = Sim.make(policy, max_slots=2, num_pages=64)
    e, system = sim.engine, tokens(8, 7)  # one shared page

    def turn(rid: str, conv: str, prompt: tuple[int, ...], at: float) -> None:
        sim.clock.t = at
        sim.add(rid, prompt, 6, conv)
        sim.run()
        e.step()  # the policy sees the finish

    turn("y1", "Y", system + tokens(12, 1), 0.0)
    turn("x1", "X", system + tokens(13, 2), 60.0)
    turn("y2", "Y", system + tokens(20, 3), 600.0)  # Y moves on; its first turn's pages are orphans
    x1 = policy.conversations["X"].last_seq
    x_pages = [e.blocks.page_of_hash[h] for h in x1.page_hashes[1:]]
    shared = e.blocks.page_of_hash[x1.page_hashes[0]]
    sim.clock.t = 60.0 + 1199.0
    e.step()
    assert set(policy.conversations) == {"X", "Y"} and policy.stats.expired_conversations == 0
    lru = list(e.blocks.lru)
    assert not set(lru[:len(x_pages) + 1]) & set(x_pages)  # Y's orphans are evicted before X's pages
    sim.clock.t = 60.0 + 1203.0
    e.step()
    assert set(policy.conversations) == {"Y"} and set(policy.snapshot()["conversations"]) == {"Y"}
    lru = list(e.blocks.lru)
    n = len(x_pages) + 1  # its full pages after the shared one, and its partial tail
    assert policy.stats.demoted_pages == n and set(x_pages) < set(lru[:n])
    assert lru.index(x_pages[-1]) == 1 and lru.index(x_pages[0]) == n - 1  # tail first, opening last
    assert shared not in lru[:n]  # Y still uses the shared system page
    sim.clock.t = 600.0 + 1210.0
    e.step()
    assert policy.conversations == {} and policy.stats.expired_conversations == 2


# ---- cost --------------------------------------------------------------------------------------------------
def test_decision_cost_per_step_with_thirty_agents():
    policy = AgePolicy(FAST.replace(quantum_s=0.3))
    sim = Sim.make(policy, max_slots=12, num_pages=512, max_batch_tokens=96)
    contexts = {f"agent{i}": tokens(24, 300 + i) for i in range(30)}
    turns = dict.fromkeys(contexts, 0)
    while min(turns.values()) < 3:
        for conv, ctx in contexts.items():  # an agent sends its next turn once its last one finished
            rid = f"{conv}-t{turns[conv]}"
            if turns[conv] < 3 and rid not in sim.outs:
                sim.add(rid, ctx, 4 + (int(conv[5:]) % 5), conv)
            elif rid in sim.finished:
                contexts[conv] = ctx + tuple(sim.outs[rid]) + tokens(5, turns[conv])
                turns[conv] += 1
        sim.step()
    snap = policy.snapshot()
    mean_us, max_us, act_us = snap["decision_us_mean"], snap["decision_us_max"], snap["action_us_mean"]
    print(f"\npolicy decision cost: mean {mean_us:.0f} us, max {max_us:.0f} us per step over "
          f"{snap['decisions']} steps (30 agents, 12 slots); engine admit/pause/resume: {act_us:.0f} us/step")
    assert snap["decisions"] == sim.steps and len(sim.finished) == 90
    assert sim.engine.stats.reused_prompt_tokens > 0  # later turns reuse their conversation's pages
    assert all(c["turns"] == 3 for c in snap["conversations"].values())
    assert json.loads(json.dumps(sim.engine.snapshot_stats()))["policy"]["admitted"] == 90


def test_admission_counts_the_prompt_pages_running_prefills_still_need():
    """A prompt is admitted with its first chunk's pages only: what running prefills still need is spoken for.
    Four 200-token prompts (26 pages each with their first token) in a 39-page pool fit one at a time; admitting
    them together makes the pool run dry mid-prefill and pauses sequences that then resume to be paused again."""
    policy = AgePolicy(PolicyConfig())
    sim = Sim.make(policy, max_slots=4, num_pages=40, max_batch_tokens=16)
    for i in range(4):
        sim.add(f"j{i}", tokens(200, 70 + i), 60)
    sim.step()
    assert [s.request_id for s in sim.engine.running] == ["j0"]  # the others' prompts do not fit beside j0's
    sim.run()
    assert all(len(sim.outs[f"j{i}"]) == 60 for i in range(4))
    assert sim.engine.stats.pauses == policy.stats.memory_pauses == 0


def test_a_page_only_a_leaving_job_holds_makes_no_room_for_the_candidate_reusing_it():
    """A waiting prompt whose cached pages a running job holds needs none of them while that job stays; where the
    job is to be paused for it, the pause frees them and the prompt takes them back: they count as needed then,
    not twice as room."""
    engine = Engine(model(), EngineConfig(max_slots=2, page_size=8, num_pages=64, loop_guard="off"))
    prompt = tokens(45, 3)  # five full pages
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.admission = lambda e: None
    holder = engine.add_request(Request(prompt, params, "a"))
    assert engine.admit(holder)
    while holder.in_prefill:
        engine.step()
    waiting = engine.add_request(Request(prompt + (7, 7, 7), params, "b"))
    policy = AgePolicy()
    tr = policy._track(waiting, 0.0)
    whole = engine.blocks.pages_for(waiting.num_tokens + 1)
    assert policy._need_pages(engine, tr) == whole - 5  # held by "a", which stays
    assert policy._need_pages(engine, tr, (holder,)) == whole  # freed by a's pause and taken back


def test_fixed_context_mode_pauses_only_for_a_candidate_whose_whole_context_fits():
    """In fixed context mode an admission reserves its whole context (prompt and max_tokens) at once, so the
    policy counts that, not its prompt: B's 178-token context (23 pages) needs both running jobs paused, and once
    they are it starts at once. Counting its prompt alone, A2 alone was paused, the engine refused B, and a slot
    stood empty while B stayed first in line."""
    policy = AgePolicy(FAST)
    sim = Sim.make(policy, max_slots=3, num_pages=40, context_mode="fixed")
    sim.add("A1", tokens(8, 1), 150)  # 20 pages reserved
    sim.clock.t = 1.0
    sim.add("A2", tokens(8, 2), 100)  # 14 pages
    sim.step()
    sim.add("B", tokens(8, 3), 170)
    while sim.engine.has_work() and sim.steps < 600:
        sim.step()
        if any(d.kind == "preempt" and d.by == "B" for d in policy.recent):  # a pause for B started it
            assert sim.engine.seqs.get("B") is None or sim.engine.seqs["B"].status is not SeqStatus.WAITING
    assert {rid: len(o) for rid, o in sim.outs.items()} == {"A1": 150, "A2": 100, "B": 170}
    for_b = [d for d in policy.recent if d.by == "B"]
    assert {d.request_id for d in for_b[:2]} == {"A1", "A2"} and for_b[0].time == for_b[1].time  # one decision


def test_an_idle_spell_counts_toward_a_finished_conversations_expiry():
    """The in-process policy sees a request finished at its next call, which an idle server makes late: the
    conversation's idle time runs from the request's last step, not from that call."""
    policy = AgePolicy(PolicyConfig())
    sim = Sim.make(policy, max_slots=2, num_pages=64)
    sim.add("x1", tokens(20, 1), 6, "X")
    sim.run()
    finished = sim.clock.t
    assert policy.conversations["X"].in_flight == 1  # not yet seen finished
    sim.clock.t += 1300.0  # nothing runs meanwhile
    sim.add("y1", tokens(20, 2), 6, "Y")
    sim.step()
    assert "X" not in policy.conversations and policy.stats.expired_conversations == 1
    assert finished < policy.cfg.idle_timeout_s
