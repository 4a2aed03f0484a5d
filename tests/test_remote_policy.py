"""The scheduler actor's view-based policy driving a real engine through the driver (no Ray): the same
exactness and throughput-first behaviour as in-process, with decisions applied one step late."""

from __future__ import annotations

import functools
from collections import Counter

import numpy as np

from decapybara.config import EngineConfig
from decapybara.engine.driver import Control, EngineDriver, EngineView, SeqView
from decapybara.engine.engine import Engine
from decapybara.engine.sampling import SamplingParams
from decapybara.engine.sequence import Request
from decapybara.scheduler.remote import AgeViewPolicy
from decapybara.scheduler.scoring import PolicyConfig
from decapybara.testing import tiny_qwen


@functools.cache
def model(family: str):
    return tiny_qwen(family)[0]


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def drive(engine: Engine, policy: AgeViewPolicy, requests: list[Request], clock: FakeClock, dt: float = 0.05):
    """Submit everything, then loop: report -> policy -> control, as the scheduler actor does."""
    driver = EngineDriver(engine, remote_policy=True, idle_wait_s=0.001)
    driver.submit(Control(add=list(requests)))
    outs: dict[str, list[int]] = {r.request_id: [] for r in requests}
    finish_order = []
    for report in driver.reports():
        clock.t += dt
        for ev in report.events:
            outs[ev.request_id] += ev.token_ids
            if ev.finish_reason is not None:
                finish_order.append(ev.request_id)
        decision = policy.decide(report.view)
        if decision is not None:
            driver.submit(decision)
        if len(finish_order) == len(requests):
            driver.stop()
    return outs, finish_order


def test_view_policy_is_exact_under_pressure_and_never_prefills_twice():
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 512, int(n)).tolist() for n in rng.integers(10, 40, 8)]
    params = SamplingParams(temperature=0, max_tokens=30)
    ref = Engine(model("qwen3_5_text"), EngineConfig(page_size=8, num_pages=256, loop_guard="off")).generate(
        prompts, params)
    clock = FakeClock()
    engine = Engine(model("qwen3_5_text"), EngineConfig(max_slots=3, page_size=8, num_pages=20, loop_guard="off",
                                                        enable_prefix_cache=False), clock=clock)
    policy = AgeViewPolicy(PolicyConfig(age_weight=400.0, quantum_s=0.2, margin=16.0))
    reqs = [Request(tuple(p), params, f"r{i}", conversation=f"agent-{i}") for i, p in enumerate(prompts)]
    outs, _ = drive(engine, policy, reqs, clock)
    assert [outs[f"r{i}"] for i in range(len(prompts))] == ref
    assert engine.stats.pauses > 0 and engine.stats.resumes == engine.stats.pauses
    assert engine.stats.computed_prompt_tokens == sum(map(len, prompts))
    snap = policy.snapshot()
    # counted as they happen, not as decided (a decision the pool could not carry out is sent again)
    assert snap["admitted"] == len(prompts) and snap["resumed"] == engine.stats.resumes >= 1
    assert all(c["resumes"] <= c["pauses"] for c in snap["conversations"].values())


def test_view_policy_serves_short_jobs_first_and_still_finishes_the_long_one():
    clock = FakeClock()
    engine = Engine(model("qwen3"), EngineConfig(max_slots=2, page_size=8, num_pages=256, loop_guard="off"),
                    clock=clock)
    policy = AgeViewPolicy(PolicyConfig(age_weight=8.0, default_output_tokens=64))
    rng = np.random.default_rng(4)
    long = Request(tuple(rng.integers(0, 512, 30).tolist()), SamplingParams(temperature=0, max_tokens=120,
                                                                           ignore_eos=True), "long")
    shorts = [Request(tuple(rng.integers(0, 512, 12).tolist()), SamplingParams(temperature=0, max_tokens=8,
                                                                              ignore_eos=True), f"s{i}")
              for i in range(5)]
    outs, order = drive(engine, policy, [long, *shorts], clock)
    assert order[-1] == "long" and len(outs["long"]) == 120
    assert all(len(outs[f"s{i}"]) == 8 for i in range(5))


def test_the_drivers_estimate_is_not_counted_as_a_prefix_query():
    """The driver estimates each request's cached tokens for the policy; only the admission's own match counts in
    the prefix statistics, so a request counts its prompt once."""
    rng = np.random.default_rng(5)
    opening = rng.integers(0, 512, 24).tolist()
    prompts = [opening + rng.integers(0, 512, 6).tolist() for _ in range(3)]
    engine = Engine(model("qwen3"), EngineConfig(page_size=8, num_pages=64, loop_guard="off"), clock=FakeClock())
    reqs = [Request(tuple(p), SamplingParams(temperature=0, max_tokens=4), f"r{i}") for i, p in enumerate(prompts)]
    drive(engine, AgeViewPolicy(PolicyConfig()), reqs[:1], FakeClock())
    drive(engine, AgeViewPolicy(PolicyConfig()), reqs[1:], FakeClock())
    stats = engine.blocks.stats
    assert stats.prefix_queries_tokens == sum(map(len, prompts))
    assert stats.prefix_hits_tokens == 2 * 24


def test_an_aborted_request_is_no_turn_of_its_conversation():
    """A request that ends by abort (its client left) neither counts as a turn nor feeds the conversation's
    expected output length; the one that finishes does."""
    from decapybara.engine.sequence import FinishReason

    clock = FakeClock()
    engine = Engine(model("qwen3"), EngineConfig(page_size=8, num_pages=64, loop_guard="off"), clock=clock)
    policy = AgeViewPolicy(PolicyConfig())
    driver = EngineDriver(engine, remote_policy=True, idle_wait_s=0.001)
    rng = np.random.default_rng(6)
    driver.submit(Control(add=[Request(tuple(rng.integers(0, 512, 12).tolist()),
                                       SamplingParams(temperature=0, max_tokens=200), "left", conversation="A")]))
    reasons = {}
    for reports, report in enumerate(driver.reports(), 1):
        clock.t += 0.05
        reasons.update({ev.request_id: ev.finish_reason for ev in report.events if ev.finish_reason is not None})
        decision = policy.decide(report.view)
        if decision is not None:
            driver.submit(decision)
        if reports == 6:
            driver.submit(Control(abort=["left"], add=[Request(tuple(rng.integers(0, 512, 12).tolist()),
                                                               SamplingParams(temperature=0, max_tokens=5), "done",
                                                               conversation="A")]))
        if "done" in reasons:
            policy.decide(report.view)
            driver.stop()
    assert reasons == {"left": FinishReason.ABORT, "done": FinishReason.LENGTH}
    conv = policy.convs["A"]
    assert conv.turns == 1 and conv.expected_output == 5


def test_admissions_are_counted_when_they_happen_not_when_decided():
    """An admission the engine cannot carry out is decided again after the decision's time to live; the policy's
    counts (and /stats) show admissions made, not decisions sent."""
    from decapybara.engine.driver import EngineView, SeqView

    policy = AgeViewPolicy(PolicyConfig(), decision_ttl_reports=2)

    def view(t: float, status: str) -> EngineView:
        seq = SeqView("a", "conv", status, 0.0, 20, 0 if status == "waiting" else 20, 0, 8, 3)
        return EngineView(t, [seq], 1 if status == "waiting" else 0, 1, 10, 10, 8)

    sent = 0
    for i in range(7):  # the engine keeps refusing: the admission is asked for again and again
        decision = policy.decide(view(0.1 * i, "waiting"))
        sent += bool(decision and "a" in decision.admit)
    assert sent >= 3 and policy.snapshot()["admitted"] == 0
    policy.decide(view(0.8, "running"))
    assert policy.snapshot()["admitted"] == 1


def test_an_expired_conversation_has_its_cached_pages_demoted():
    """Under the scheduler actor's policy, as in process: a conversation idle past `idle_timeout_s` has the pages
    its last request left made the next evicted (before older orphans), except a page another conversation
    still uses."""
    clock = FakeClock()
    engine = Engine(model("qwen3"), EngineConfig(page_size=8, num_pages=64, loop_guard="off"), clock=clock)
    policy = AgeViewPolicy(PolicyConfig(idle_timeout_s=100.0))
    driver = EngineDriver(engine, remote_policy=True, idle_wait_s=0.001)
    reports = driver.reports()
    rng = np.random.default_rng(7)
    system = rng.integers(0, 512, 8).tolist()  # one page both conversations share

    def step(control: Control | None = None) -> Control | None:
        driver.submit(control or Control(victims=[]))
        decision = policy.decide(next(reports).view)
        if decision is not None:
            driver.submit(decision)
        return decision

    def turn(rid: str, conv: str, n: int, at: float) -> None:
        clock.t = at
        req = Request(tuple(system + rng.integers(0, 512, n).tolist()), SamplingParams(temperature=0, max_tokens=6),
                      rid, conversation=conv)
        driver.submit(Control(add=[req]))
        for report in reports:
            clock.t += 0.01
            decision = policy.decide(report.view)
            if decision is not None:
                driver.submit(decision)
            if any(ev.request_id == rid and ev.finish_reason is not None for ev in report.events):
                return

    turn("y1", "Y", 12, 0.0)
    turn("x1", "X", 13, 60.0)
    x_trail = driver._trails["X"]
    gone = Request(tuple(system + [1, 2, 3]), SamplingParams(temperature=0, max_tokens=6), "x-gone", conversation="X")
    step(Control(add=[gone], abort=["x-gone"]))  # aborted before any of it ran: X's trail stays x1's
    assert driver._trails["X"] is x_trail
    turn("y2", "Y", 20, 90.0)  # Y moves on: its first turn's pages are orphans, older than X's
    x_pages = [engine.blocks.page_of_hash[h] for h in x_trail.page_hashes[1:]]
    shared = engine.blocks.page_of_hash[x_trail.page_hashes[0]]
    clock.t = 60.0 + 99.0
    assert step() is None and policy.counts["expired_conversations"] == 0
    lru = list(engine.blocks.lru)
    assert not set(lru[:len(x_pages) + 1]) & set(x_pages)  # Y's orphans are evicted before X's pages
    clock.t = 60.0 + 102.0
    assert step().expire == ["X"]
    step()  # the control that names X is applied at the next step boundary
    lru = list(engine.blocks.lru)
    n = len(x_pages) + 1  # its full pages after the shared one, and its partial tail
    assert engine.stats.demoted_pages == n and set(x_pages) < set(lru[:n])
    assert lru.index(x_pages[-1]) == 1 and lru.index(x_pages[0]) == n - 1  # tail first, opening last
    assert shared not in lru[:n]  # Y's last turn still uses the shared system page
    assert "X" not in driver._trails and "Y" in driver._trails
    held = [h for t in driver._trails.values() for h in t.page_hashes]
    assert driver._trail_pages == Counter(held)  # the trails' pages, counted as trails come and go
    driver.stop()


def test_a_call_runs_on_the_engines_thread_between_steps():
    """`EngineDriver.call`: a function of the engine run by the thread that steps it, between two steps, while
    requests decode (a graceful stop's `save_cached_pages`); its exception comes back to the caller; a loop that
    stopped, or ended, refuses calls, and one not yet run when its caller gives up never runs."""
    import threading
    import time

    import pytest

    engine = Engine(model("qwen3"), EngineConfig(page_size=8, num_pages=64, loop_guard="off"))
    driver = EngineDriver(engine, remote_policy=False, idle_wait_s=0.001)
    prompt = np.random.default_rng(8).integers(0, 512, 20).tolist()
    params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
    want = Engine(model("qwen3"), EngineConfig(page_size=8, num_pages=64, loop_guard="off")).generate([prompt],
                                                                                                      params)[0]
    driver.submit(Control(add=[Request(tuple(prompt), params, "r")]))
    outs: list[int] = []
    seen: list[tuple[int, int, str]] = []
    done = threading.Event()

    def loop():
        for report in driver.reports():
            for ev in report.events:
                outs.extend(ev.token_ids)
                if ev.finish_reason is not None:
                    done.set()

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    deadline = time.time() + 60
    while not outs and time.time() < deadline:
        time.sleep(0.001)
    steps = driver.call(lambda e: (seen.append((len(e.running), e.stats.steps, threading.current_thread().name)),
                                   e.stats.steps)[1], timeout_s=30)
    assert seen == [(1, steps, t.name)] and 0 < steps < 300  # mid-request, on the loop's thread
    with pytest.raises(ZeroDivisionError):
        driver.call(lambda e: 1 / 0, timeout_s=30)
    assert done.wait(60) and outs == want  # the calls between its steps changed nothing
    assert driver.call(lambda e: len(e.running), timeout_s=30) == 0  # an idle loop takes calls too
    ran = []
    with driver._cond:  # the loop cannot take the call before the caller gives up
        with pytest.raises(TimeoutError):
            driver.call(lambda e: ran.append(1), timeout_s=0.01)
    time.sleep(0.05)
    assert ran == []
    driver.stop()
    t.join(10)
    with pytest.raises(RuntimeError):
        driver.call(lambda e: None, timeout_s=1)


def test_view_policy_counts_the_prompt_pages_running_prefills_still_need():
    """As in-process: a prompt is admitted with its first chunk's pages only, so what running prefills still need
    is spoken for. Four 200-token prompts (26 pages each with their first token) in a 39-page pool fit one at a
    time; started together they run the pool dry mid-prefill and are paused, resumed, and paused again."""
    clock = FakeClock()
    engine = Engine(model("qwen3"), EngineConfig(max_slots=4, page_size=8, num_pages=40, max_batch_tokens=16,
                                                 loop_guard="off"), clock=clock)
    rng = np.random.default_rng(5)
    reqs = [Request(tuple(rng.integers(0, 512, 200).tolist()),
                    SamplingParams(temperature=0, max_tokens=60, ignore_eos=True), f"j{i}", conversation=f"c{i}")
            for i in range(4)]
    outs, _ = drive(engine, AgeViewPolicy(PolicyConfig()), reqs, clock)
    assert all(len(outs[f"j{i}"]) == 60 for i in range(4))
    assert engine.stats.pauses == 0


def _view(now: float, seqs: list, free_pages: int, slots: int = 0, total: int = 64) -> EngineView:
    return EngineView(now, seqs, slots, 3, free_pages, total, 8)


def test_view_policy_preempts_only_for_a_candidate_the_pauses_make_room_for():
    """As in-process: a candidate that beats running jobs by the margin takes a slot only where the pages the
    pauses free (the jobs' own, not those they share) let it start beside the jobs staying; otherwise nobody is
    paused for nothing. Where one pause is not room enough, the fewest lowest-V jobs that are room enough are
    paused together. r2 ran long (V high): it always stays."""
    cfg = PolicyConfig(age_weight=100.0, margin=10.0, quantum_s=0.0)

    def decide(cand_prompt: int, own: tuple[int, int], free: int):
        policy = AgeViewPolicy(cfg)
        run = [SeqView(f"r{i}", None, "running", 9.9, 8, 9, 1, 4000, 8, own_pages=own[i]) for i in range(2)]
        run.append(SeqView("r2", None, "running", -1000.0, 8, 9, 1, 4000, 8, own_pages=8))
        policy.decide(_view(0.0, run, free))  # seen running from t=0
        cand = SeqView("c", None, "waiting", 0.0, cand_prompt, 0, 0, 16, 0)
        return policy.decide(_view(10.0, run + [cand], free))  # waited 10 s: S ~ 980 beats r0's and r1's V

    one = decide(cand_prompt=60, own=(8, 8), free=2)  # needs 8 pages: 2 free + r0's 8, reserve 2 for r1, r2
    assert one is not None and one.pause == ["r0"] and one.admit == ["c"]
    shared = decide(cand_prompt=60, own=(0, 0), free=2)  # their pages are shared (with r2): pauses free none
    assert shared is None or (not shared.pause and not shared.admit)
    both = decide(cand_prompt=100, own=(8, 8), free=2)  # needs 13 pages: only both pauses free enough
    assert both is not None and sorted(both.pause) == ["r0", "r1"] and both.admit == ["c"]
    too_big = decide(cand_prompt=300, own=(8, 8), free=2)  # needs 38: no set of pauses frees that much
    assert too_big is None or (not too_big.pause and not too_big.admit)


def test_the_view_counts_the_pages_a_pause_would_free():
    """`own_pages` of a running sequence: its pages no other sequence holds. Two running requests with the same
    two-page prompt share its first full page (the prefix cache); each alone holds the rest."""
    from decapybara.engine.driver import engine_view
    engine = Engine(model("qwen3"), EngineConfig(max_slots=2, page_size=8, num_pages=64, loop_guard="off"))
    prompt = tuple(range(1, 13))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.add_request(Request(prompt, params, "a"))
    engine.step()
    engine.add_request(Request(prompt, params, "b"))
    engine.step()
    views = {s.request_id: s for s in engine_view(engine).seqs}
    assert all(v.status == "running" for v in views.values())
    shared = set(engine.seqs["a"].pages) & set(engine.seqs["b"].pages)
    assert len(shared) == 1
    for rid in "ab":
        assert views[rid].own_pages == views[rid].num_pages - 1 >= 1


def test_a_cached_prompt_needs_its_pages_and_is_not_overtaken(tmp_path):
    """A waiting prompt whose prefix the cache holds (evictable pages, counted free, or a tier's, restored into
    fresh pages) still takes every page of its prompt out of `free_pages`; only pages running sequences already
    hold come for free. So a long cached prompt that does not fit beside the running agents is not admitted
    (the engine would refuse it, the decision would hide it for its time to live, and the agents' next turns
    would take the slots again and again: starved far past the wait bound); nobody below it overtakes it, the
    running agents drain, and it starts. Here three agents keep the three slots busy with turns of 10 pages
    each in a 40-page pool; the long prompt (26 pages, its prefix in the RAM tier since its first run) must start
    within a few of their turns."""
    from decapybara.kv.disk_tier import DiskTierStore
    from decapybara.kv.ram_tier import RamTierStore
    from decapybara.kv.stores import TierStores
    from decapybara.kv.tiers import KVTiers

    clock = FakeClock()
    engine = Engine(model("qwen3"), EngineConfig(max_slots=3, page_size=8, num_pages=40, loop_guard="off"),
                    clock=clock)
    stores = TierStores(KVTiers(RamTierStore(64 << 20), DiskTierStore(f"file://{tmp_path}/kv", 64 << 20)),
                        engine.blocks.salt)
    engine.bundle_store = stores
    engine.set_page_store(stores)
    rng = np.random.default_rng(11)
    long_prompt = tuple(rng.integers(0, 512, 200).tolist())
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    filler = Request(tuple(rng.integers(0, 512, 300).tolist()), params, "filler")
    drive(engine, AgeViewPolicy(PolicyConfig()), [Request(long_prompt, params, "first")], clock)
    drive(engine, AgeViewPolicy(PolicyConfig()), [filler], clock)  # evicts the long prompt's pages to the tier
    assert engine.stats.offloaded_pages >= 20

    policy = AgeViewPolicy(PolicyConfig(age_weight=400.0, quantum_s=1e9))  # no preemption: admissions alone
    driver = EngineDriver(engine, remote_policy=True, idle_wait_s=0.001)
    turn = {f"a{i}": 0 for i in range(3)}

    def agent_turn(agent: str) -> Request:
        turn[agent] += 1
        prompt = tuple(rng.integers(0, 512, 48).tolist())
        out = 24 + 7 * int(agent[1:]) + turn[agent] % 3  # the agents' turns end at different steps
        return Request(prompt, SamplingParams(temperature=0, max_tokens=out, ignore_eos=True),
                       f"{agent}-{turn[agent]}", conversation=agent)

    driver.submit(Control(add=[agent_turn(agent) for agent in turn]))
    ran_before, ended = set(), set()  # the agents' turns that ran before the long prompt started
    for reports, report in enumerate(driver.reports(), 1):
        clock.t += 0.05
        if reports == 3:
            driver.submit(Control(add=[Request(long_prompt, params, "long", conversation="L")]))
        finished = [ev.request_id for ev in report.events if ev.finish_reason is not None]
        ended.update(finished)
        running = {s.request_id for s in report.view.seqs if s.status == "running"}
        if "long" not in ended and "long" not in running:
            ran_before |= running
        nxt = [agent_turn(rid.split("-")[0]) for rid in finished if rid.startswith("a") and sum(turn.values()) < 40]
        control = policy.decide(report.view) or Control()
        control.add += nxt
        if not control.empty():
            driver.submit(control)
        if "long" in ended or reports > 3000:
            driver.stop()
    assert "long" in ended
    overtaken = sorted(ran_before - {"a0-1", "a1-1", "a2-1"})  # turns admitted after it arrived
    assert not overtaken, f"the long prompt waited for {overtaken}"


def test_the_view_counts_the_cached_prompt_pages_running_sequences_hold():
    """`shared_pages` of a waiting sequence: the pages of its cached prompt prefix that running sequences hold
    (not counted in `free_pages`); a prefix left only in the cache (evictable, counted free) gives none."""
    from decapybara.engine.driver import engine_view
    engine = Engine(model("qwen3"), EngineConfig(max_slots=1, page_size=8, num_pages=64, loop_guard="off"))
    driver = EngineDriver(engine, remote_policy=True, idle_wait_s=0.001)
    prompt = tuple(range(1, 30))  # 3 full pages of 8 the next prompt can reuse
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    driver._apply(Control(add=[Request(prompt, params, "a")]))
    engine.admit(engine.seqs["a"])
    engine.step()
    driver._apply(Control(add=[Request(prompt + (40, 41), params, "b")]))
    view = {s.request_id: s for s in engine_view(engine).seqs}
    assert view["b"].status == "waiting" and view["b"].shared_pages == 3
    engine.abort("a")
    view = {s.request_id: s for s in engine_view(engine).seqs}
    assert view["b"].cached_estimate == 24 and view["b"].shared_pages == 0


def test_fixed_context_mode_admits_only_a_prompt_whose_whole_context_fits():
    """In fixed context mode an admission reserves the prompt's whole context (prompt and max_tokens) at once: a
    candidate whose prompt fits the free pages but whose context does not is not admitted (the engine would
    refuse it while the decision hid it from the ranking, and prompts below it overtook it); once the running job
    ends, it is."""
    from decapybara.engine.driver import apply_decisions, engine_view
    engine = Engine(model("qwen3"), EngineConfig(max_slots=2, page_size=8, num_pages=16, context_mode="fixed",
                                                 loop_guard="off"))
    driver = EngineDriver(engine, remote_policy=True, idle_wait_s=0.001)
    policy = AgeViewPolicy(PolicyConfig(quantum_s=1e9))
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)  # 9 pages of 8 each context
    driver._apply(Control(add=[Request(tuple(range(1, 9)), params, "r")]))
    apply_decisions(engine, policy.decide(engine_view(engine)))
    engine.step()
    assert engine.seqs["r"].status.value == "running" and engine.blocks.num_free == 7
    driver._apply(Control(add=[Request(tuple(range(20, 28)), params, "c")]))
    view = engine_view(engine)
    assert {s.request_id: s for s in view.seqs}["c"].context_tokens == 68
    control = policy.decide(view)
    assert control is None or "c" not in control.admit
    engine.abort("r")
    control = policy.decide(engine_view(engine))
    assert control is not None and control.admit == ["c"]
    apply_decisions(engine, control)
    assert engine.seqs["c"].status.value == "running"


def test_a_waiting_sequence_that_recomputes_its_output_needs_its_pages():
    """A sequence whose bundle was lost waits again to recompute its prompt and its output: its pages are those of
    both (as the in-process policy counts `num_tokens`), so it is not admitted beside running jobs into a pool
    that holds only its prompt's."""
    policy = AgeViewPolicy(PolicyConfig())
    run = [SeqView("r0", None, "running", 0.0, 8, 9, 1, 4000, 2, own_pages=2)]
    again = SeqView("w", None, "waiting", 0.0, 8, 0, 40, 100, 0)  # 48 tokens to recompute: 7 pages with the next
    decision = policy.decide(_view(1.0, run + [again], free_pages=4, slots=1))
    assert decision is None or "w" not in decision.admit
    fresh = SeqView("f", None, "waiting", 0.0, 8, 0, 0, 100, 0)  # its prompt alone: 2 pages
    decision = AgeViewPolicy(PolicyConfig()).decide(_view(1.0, run + [fresh], free_pages=4, slots=1))
    assert decision is not None and decision.admit == ["f"]


def test_a_page_the_victim_alone_holds_and_the_candidate_reuses_is_no_room():
    """A candidate whose cached prompt pages a running job holds (`shared_pages`) gains nothing from pausing that job
    for them: the pause frees them and the candidate takes them back. They are counted once, so the job is not
    paused for a candidate that still could not start; beside a job staying that holds other pages, it is."""
    cfg = PolicyConfig(age_weight=100.0, margin=10.0, quantum_s=0.0)

    def decide(own: int, shared: int, free: int):
        policy = AgeViewPolicy(cfg)
        run = [SeqView("r0", None, "running", 9.9, 40, 41, 1, 4000, 6, own_pages=own),
               SeqView("r2", None, "running", -1000.0, 8, 9, 1, 4000, 2, own_pages=2)]
        policy.decide(_view(0.0, run, free))
        cand = SeqView("c", None, "waiting", 0.0, 60, 0, 0, 16, 0, shared_pages=shared)
        return policy.decide(_view(10.0, run + [cand], free))  # S ~ 980 beats r0's V, not r2's

    # c's 8 pages, 5 of them r0's (its prompt's); 2 free: pausing r0 makes 8, and c with r2's reserve needs 9
    none = decide(own=6, shared=5, free=2)
    assert none is None or (not none.pause and not none.admit)
    # with one more free page the pause makes room (8 taken, 1 reserve, 9 free)
    some = decide(own=6, shared=5, free=3)
    assert some is not None and some.pause == ["r0"] and some.admit == ["c"]
