"""The engine: batch invariance, chunked prefill, prefix reuse (dense + hybrid), pause/resume, abort, bad input."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from decapybara.config import EngineConfig
from decapybara.engine.engine import Engine
from decapybara.engine.planner import plan_step
from decapybara.engine.sampling import SamplerRow, SamplingParams
from decapybara.engine.sequence import FinishReason, Request, SeqStatus
from decapybara.errors import ContextOverflowError, InvalidRequestError
from decapybara.testing import tiny_qwen

GREEDY = SamplingParams(temperature=0, max_tokens=24)


@functools.cache
def model(family: str):
    return tiny_qwen(family)[0]


def engine(family: str, **kw) -> Engine:
    base = {"page_size": 8, "num_pages": 256, "max_batch_tokens": 48, "loop_guard": "off", "snapshot_interval": 8}
    base.update(kw)
    return Engine(model(family), EngineConfig(**base))


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 70) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 512, int(k)).tolist() for k in rng.integers(lo, hi, n)]


def run(e: Engine, request: Request) -> tuple[list[int], object]:
    e.add_request(request)
    out, last = [], None
    while e.has_work():
        for ev in e.step():
            if ev.request_id == request.request_id:
                out += ev.token_ids
                last = ev
    return out, last


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5_text", "qwen3_5_moe_text"])
@pytest.mark.parametrize("policy", ["balanced", "decode-priority", "prefill-priority"])
def test_twelve_requests_together_equal_each_alone(family, policy):
    ps = prompts(12, seed=1)
    alone = [engine(family).generate([p], GREEDY)[0] for p in ps]
    e = engine(family, prefill_policy=policy, max_batch_tokens=40)
    together = e.generate(ps, GREEDY)
    assert together == alone
    assert e.stats.steps < sum(len(p) for p in ps)  # really batched and chunked
    assert e.blocks.num_used == 0


def test_plan_respects_budget_and_policy():
    e = engine("qwen3", max_batch_tokens=32, prefill_policy="balanced", balanced_prefill_share=0.5)
    for p in prompts(4, seed=2, lo=40, hi=60):
        e.add_request(Request(tuple(p), GREEDY))
    e.step()  # admits all four, prefills the first chunk(s)
    while all(s.in_prefill for s in e.running):
        e.step()
    plan = plan_step(e.running, e.cfg, snapshots=False)
    decodes = [c for c in plan.chunks if not c.seq.in_prefill]
    prefill_tokens = sum(c.num_tokens for c in plan.chunks if c.seq.in_prefill)
    assert decodes and plan.num_tokens <= 32
    assert prefill_tokens <= 16  # balanced: prefill takes at most half the budget while others decode
    pp = plan_step(e.running, e.cfg.replace(prefill_policy="prefill-priority"), snapshots=False)
    assert sum(c.num_tokens for c in pp.chunks if c.seq.in_prefill) > prefill_tokens


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5_text"])
@pytest.mark.parametrize("snapshot_interval", [8, 256])
def test_second_turn_computes_only_new_tokens(family, snapshot_interval):
    e = engine(family, snapshot_interval=snapshot_interval)  # the finished turn's tail carries its own state
    first = prompts(1, seed=3, lo=37, hi=38)[0]
    answer, _ = run(e, Request(tuple(first), GREEDY))
    new_message = prompts(1, seed=4, lo=9, hi=10)[0]
    turn2 = first + answer + new_message
    out, last = run(e, Request(tuple(turn2), GREEDY))
    # Everything but the new message and the last answer token (sampled, never fed back) is reused.
    assert last.num_cached_tokens == len(first) + len(answer) - 1
    assert e.stats.computed_prompt_tokens == len(first) + len(new_message) + 1
    ref = engine(family, enable_prefix_cache=False).generate([turn2], GREEDY)[0]
    assert out == ref


def test_snapshot_budget_fits_the_model():
    """The default budget keeps two snapshots a slot (a 27B model's 157 MB state: 3.8 GB at 12 slots), at least
    64 MiB. A hybrid model whose state exceeds an explicit budget takes no snapshots at all (each would cost a
    copy that the budget drops at once): the same tokens, and a second turn recomputes its whole prompt, where
    a budget that holds them reuses all but the new message."""
    assert EngineConfig().snapshot_budget(157_000_000) == 24 * 157_000_000
    assert EngineConfig(max_slots=2).snapshot_budget(1000) == 64 << 20
    assert EngineConfig(snapshot_budget_bytes=5).snapshot_budget(10**9) == 5
    roomy, tight = engine("qwen3_5_text"), engine("qwen3_5_text", snapshot_budget_bytes=1000)
    assert roomy.snapshots and not tight.snapshots and not engine("qwen3").snapshots
    first = prompts(1, seed=3, lo=37, hi=38)[0]
    turn2 = first + run(roomy, Request(tuple(first), GREEDY))[0] + [5, 6, 7]
    assert run(tight, Request(tuple(first), GREEDY))[0] == turn2[len(first):-3]
    assert not tight.blocks.snapshots and tight.blocks.snapshot_bytes == 0
    assert run(tight, Request(tuple(turn2), GREEDY))[1].num_cached_tokens == 0  # nothing to restart from
    assert run(roomy, Request(tuple(turn2), GREEDY))[1].num_cached_tokens == len(turn2) - 4


def test_sampler_rows_carry_token_ids_only_for_penalties():
    """A step hands the sampler a sequence's prompt and output ids only where a penalty reads them (a long
    context's list copied every step costs ~0.8 ms a sequence at 131k tokens); the tokens are those of rows
    that carry every id."""
    e = engine("qwen3")
    seen = []
    sample = e.model.backend.sample
    e.model.backend.sample = lambda logits, rows, eos=(): seen.extend(rows) or sample(logits, rows, eos)
    try:
        ps = prompts(2, seed=9)
        plain = SamplingParams(temperature=0, max_tokens=6)
        penal = SamplingParams(temperature=0, max_tokens=6, repetition_penalty=1.3, presence_penalty=0.5)
        out = e.generate(ps, [plain, penal])
        by_params = {id(r.params): r for r in seen if r.position == 3}
        assert len(by_params) == 2
        quiet, loud = by_params[id(plain)], by_params[id(penal)]
        assert len(quiet.prompt_token_ids) == 0 and len(quiet.output_token_ids) == 0
        assert list(loud.output_token_ids) == out[1][:3]  # the repetition set: prompt and output ids, unique
        assert list(loud.prompt_token_ids) == sorted(set(ps[1]) | set(out[1][:3]))
        full = Engine(model("qwen3"), e.cfg)  # every row with every id, as before
        full._sampler_row = lambda s: SamplerRow(s.params, s.tokens[:s.num_prompt], s.output_ids(), s.num_output,
                                                 s.seed, s.extra_penalty, s.banned)
        assert out == full.generate(ps, [plain, penal])
    finally:
        e.model.backend.sample = sample


def test_seen_ids_follow_appended_tokens():
    from decapybara.engine.sequence import Sequence

    rng = np.random.default_rng(2)
    s = Sequence(Request((1,)), seed=0, arrival=0.0, tokens=rng.integers(0, 50, 40).tolist(), num_prompt=40)
    for step in range(30):
        assert s.seen_ids().tolist() == sorted(set(s.tokens)), step
        s.tokens.extend(rng.integers(0, 80, int(rng.integers(0, 4))).tolist())  # new ids, repeats, none


def test_engine_samples_through_the_backend():
    """Logits stay the backend's arrays until `Backend.sample` draws from them (a GPU copies back only tokens);
    a host `logits_processor` takes them to the host and the numpy reference samples."""
    e = engine("qwen3")
    calls = []
    sample = e.model.backend.sample
    e.model.backend.sample = lambda logits, rows, eos=(): calls.append(logits.shape) or sample(logits, rows, eos)
    try:
        ps = prompts(3, seed=8)
        out = e.generate(ps, GREEDY)
        assert calls and all(c[0] <= 3 for c in calls) and sum(c[0] for c in calls) == 3 * GREEDY.max_tokens
        seen = []
        hooked = Engine(model("qwen3"), e.cfg, logits_processor=lambda seq, row: seen.append(1) or row)
        calls.clear()
        assert hooked.generate(ps, GREEDY) == out and not calls and len(seen) == 3 * GREEDY.max_tokens
    finally:
        e.model.backend.sample = sample


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5_text"])
def test_shared_system_prompt_is_stored_once(family):
    e = engine(family, page_size=8)
    system = prompts(1, seed=5, lo=16, hi=17)[0]  # exactly two pages
    a = system + prompts(1, seed=6, lo=11, hi=12)[0]
    b = system + prompts(1, seed=7, lo=13, hi=14)[0]
    outs: dict[str, list[int]] = {}

    def step():
        for ev in e.step():
            outs.setdefault(ev.request_id, []).extend(ev.token_ids)

    e.add_request(Request(tuple(a), SamplingParams(temperature=0, max_tokens=40), "agent-a"))
    while e.running == [] or e.seqs["agent-a"].in_prefill:
        step()
    e.add_request(Request(tuple(b), SamplingParams(temperature=0, max_tokens=40), "agent-b"))
    step()
    sa, sb = e.seqs["agent-a"], e.seqs["agent-b"]
    assert sa.pages[:2] == sb.pages[:2]  # the two system-prompt pages are shared ...
    assert all(e.blocks.ref[p] == 2 for p in sa.pages[:2])  # ... referenced by both
    assert set(sa.pages[2:]).isdisjoint(sb.pages[2:])
    assert sb.num_cached_prompt == 16
    while e.has_work():
        step()
    params = SamplingParams(temperature=0, max_tokens=40)
    assert outs["agent-b"] == engine(family, enable_prefix_cache=False).generate([b], params)[0]


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5_text"])
def test_pool_pressure_pauses_and_resumes_without_recompute(family):
    ps = prompts(6, seed=8, lo=20, hi=40)
    params = SamplingParams(temperature=0, max_tokens=40)
    ref = engine(family).generate(ps, params)
    e = engine(family, num_pages=22, enable_prefix_cache=False)  # far too small for all six at once
    got = e.generate(ps, params)
    assert got == ref
    assert e.stats.pauses > 0 and e.stats.resumes == e.stats.pauses
    assert e.stats.computed_prompt_tokens == sum(len(p) for p in ps)  # nothing prefilled twice


def test_abort_frees_every_page():
    e = engine("qwen3_5_text")
    free0 = len(e.blocks.free)
    reqs = [Request(tuple(p), GREEDY) for p in prompts(5, seed=9)]
    for r in reqs:
        e.add_request(r)
    for _ in range(4):
        e.step()
    for r in reqs:
        ev = e.abort(r.request_id)
        assert ev is not None and ev.finish_reason == FinishReason.ABORT
    assert not e.has_work()
    e.blocks.evict_all_cached()
    assert len(e.blocks.free) == free0 and e.blocks.num_used == 0
    assert sorted(e.free_slots) == list(range(e.cfg.max_slots))


def test_seeded_sampling_independent_of_batch():
    ps = prompts(6, seed=10)
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=16) for i in range(6)]
    alone = [engine("qwen3").generate([p], [sp])[0] for p, sp in zip(ps, params)]
    assert engine("qwen3").generate(ps, params) == alone


def test_bad_input_is_refused_before_any_work():
    e = engine("qwen3", num_pages=8)  # 64 tokens of KV, less a page for the prefix cache: a context of 56
    with pytest.raises(ContextOverflowError):
        e.add_request(Request((7,) * 1024, GREEDY))  # longer than the model's context
    with pytest.raises(ContextOverflowError, match="context of 56"):
        e.add_request(Request((7,) * 56, GREEDY))  # leaves no room in the pool
    with pytest.raises(InvalidRequestError):
        e.add_request(Request((1, 2, 3), SamplingParams(max_tokens=0)))
    with pytest.raises(InvalidRequestError):
        e.add_request(Request((1, 2, 3), SamplingParams(top_p=1.5)))
    with pytest.raises(InvalidRequestError):
        e.add_request(Request((1, 2, 3), SamplingParams(temperature=-1)))
    with pytest.raises(InvalidRequestError):
        e.add_request(Request((), GREEDY))
    with pytest.raises(InvalidRequestError):
        e.add_request(Request((1, 99999), GREEDY))
    assert not e.has_work() and e.stats.steps == 0


def test_max_tokens_and_stop_token_finish():
    e = engine("qwen3")
    p = prompts(1, seed=11)[0]
    out = e.generate([p], SamplingParams(temperature=0, max_tokens=5))[0]
    assert len(out) == 5
    stop_at = out[2]
    out2, last = run(e, Request(tuple(p), SamplingParams(temperature=0, max_tokens=5, stop_token_ids=(stop_at,))))
    assert out2 == out[:out.index(stop_at) + 1] and last.finish_reason == FinishReason.STOP


def test_repeated_prompt_reuses_up_to_its_last_page_boundary_on_hybrid_models():
    e = engine("qwen3_5_text", snapshot_interval=256)  # sparse periodic snapshots: the prompt edge still counts
    p = prompts(1, seed=12, lo=30, hi=31)[0]
    first, _ = run(e, Request(tuple(p), GREEDY))
    again, last = run(e, Request(tuple(p), GREEDY))
    assert last.num_cached_tokens == 24 and again == first  # 3 full pages of 8 reused, output unchanged


def test_a_pool_smaller_than_the_context_shortens_it():
    """A KV pool that cannot hold the model's context serves a context of the pool's tokens (less one page with
    the prefix cache: an admission holds a cached partial page while it copies it): a request whose max_tokens
    runs past it is taken (not refused) and ends with "length" where one sequence fills it, as a request past the
    model's own context would."""
    e = engine("qwen3", num_pages=8)
    assert e.max_model_len == 56 < e.model.cfg.max_position_embeddings
    e.eos_token_ids = ()
    seq = e.add_request(Request((1, 2, 3), SamplingParams(temperature=0, max_tokens=1000)))
    while e.has_work():
        e.step()
    assert seq.finish_reason == FinishReason.LENGTH and seq.num_tokens == 56
    assert engine("qwen3", num_pages=9).max_model_len == 64
    assert engine("qwen3", num_pages=8, enable_prefix_cache=False).max_model_len == 64
    assert engine("qwen3").max_model_len == e.model.cfg.max_position_embeddings  # a pool past the context


@pytest.mark.parametrize("mode", ["pool", "fixed"])
def test_a_follow_up_turn_at_the_end_of_a_pool_sized_context_is_admitted(mode):
    """A conversation's next turn that matches the cached partial last page of its previous one, with the rest
    of the served context as its max_tokens (the API's default), is admitted and runs, though the pool is the
    context's size: the admission's copy of that page has its page."""
    e = engine("qwen3", num_pages=8, context_mode=mode)
    e.eos_token_ids = ()
    rng = np.random.default_rng(5)
    first = e.add_request(Request(tuple(rng.integers(0, 512, 13).tolist()),
                                  SamplingParams(temperature=0, max_tokens=e.max_model_len - 5 - 13)))
    while e.has_work():
        e.step()
    # its tokens end inside a page (a cached partial tail); the next prompt ends 2 tokens short of the context
    prompt = tuple(first.tokens) + tuple(rng.integers(0, 512, 3).tolist())
    second = e.add_request(Request(prompt, SamplingParams(temperature=0, max_tokens=e.max_model_len - len(prompt))))
    for _ in range(200):
        if not e.has_work():
            break
        e.step()
    assert second.finish_reason == FinishReason.LENGTH and second.num_tokens == e.max_model_len, second.status
    assert second.num_cached_prompt > 0  # the previous turn's pages were reused


def test_a_failed_step_leaves_no_tail_in_the_prefix_cache():
    """A step whose sampling fails (a NaN row) after its forward advanced a prompt chunk's DeltaNet state: the
    driver aborts every request, and the aborted prompt's partial page must not be cached with that state, which
    is ahead of the page's tokens (the retry's greedy tokens would differ)."""
    model = tiny_qwen("qwen3_5_text")[0]
    cfg = EngineConfig(page_size=8, num_pages=256, max_batch_tokens=13, loop_guard="off", snapshot_interval=8)
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 512, 45).tolist(), rng.integers(0, 512, 5).tolist()
    greedy = SamplingParams(temperature=0, max_tokens=12)
    ref = Engine(model, cfg.replace(enable_prefix_cache=False)).generate([a], greedy)[0]
    fail = {"on": False}

    def nan_row(seq, logits):
        return np.full_like(logits, np.nan) if fail["on"] and seq.request_id == "b" else logits

    e = Engine(model, cfg, logits_processor=nan_row)
    e.add_request(Request(tuple(b), SamplingParams(temperature=0, max_tokens=100), "b"))
    e.step()
    e.step()  # b decodes from here on
    e.add_request(Request(tuple(a), greedy, "a"))
    sa = e.seqs["a"]
    while sa.num_computed < 9 or sa.num_computed % 8 == 0:
        e.step()
    fail["on"] = True
    with pytest.raises(ValueError):
        e.step()  # a's chunk ran (its state advanced), then b's row failed the sampler
    fail["on"] = False
    for rid in list(e.seqs):  # what the driver does after a failed step
        e.abort(rid)
    assert e.generate([a], greedy)[0] == ref


def test_a_shared_openings_snapshot_is_kept_by_its_use():
    """Hybrid-state snapshots are evicted least recently used: an opening every request reuses keeps its
    snapshot however many newer ones arrive."""
    model = tiny_qwen("qwen3_5_text")[0]
    e = Engine(model, EngineConfig(page_size=8, num_pages=256, max_batch_tokens=64, loop_guard="off",
                                   snapshot_interval=256,
                                   snapshot_budget_bytes=10 * model.cfg.state_bytes_per_sequence()))
    rng = np.random.default_rng(0)
    system = rng.integers(0, 512, 16).tolist()  # two pages
    cached = []
    for i in range(12):
        seq = e.add_request(Request(tuple(system + rng.integers(0, 512, 5).tolist()),
                                    SamplingParams(temperature=0, max_tokens=3), f"r{i}"))
        while e.has_work():
            e.step()
        cached.append(seq.num_cached_prompt)
    assert cached[1:] == [16] * 11, cached


def test_a_bundle_store_that_fails_a_pause_leaves_the_sequence_running():
    """A pause whose bundle store raises (a tier out of memory, say) takes nothing from the sequence: it stays
    running on its pages, their references untouched, and an abort finds it whole; before, its pages were freed and
    it was out of the running list while it still read as running, which broke the abort that followed."""
    from decapybara.kv.stores import HostBundleStore

    class FailsOnce(HostBundleStore):
        failed = False

        def put(self, seq, bundle):
            if not self.failed:
                self.failed = True
                raise MemoryError("the tier has no room")
            return super().put(seq, bundle)

    ps = prompts(6, seed=8, lo=20, hi=40)
    params = SamplingParams(temperature=0, max_tokens=40)
    e = engine("qwen3", num_pages=22, enable_prefix_cache=False)
    e.bundle_store = FailsOnce()
    for i, p in enumerate(ps):
        e.add_request(Request(tuple(p), params, f"r{i}"))
    while e.running == [] or len(e.running) < 2:
        e.step()
    victim = e.running[-1]
    pages, held = list(victim.pages), int(e.blocks.ref.sum())
    with pytest.raises(MemoryError):
        e.pause(victim)
    assert victim.status == SeqStatus.RUNNING and victim in e.running and victim.pages == pages
    assert int(e.blocks.ref.sum()) == held and victim.num_pauses == 0
    e.abort(victim.request_id)  # an abort finds it whole
    assert victim.pages == [] and int(e.blocks.ref.sum()) == held - len(pages)


def test_a_resume_short_of_pages_reads_no_bundle():
    """A paused sequence that the pool has no pages for yet is refused before its bundle is read from the bundle
    store (with the KV tiers, a conversation's whole KV read from RAM or disk and written back): under the default
    policy it is tried every step until the pool has room, and each try took a read and a write."""
    from decapybara.kv.stores import HostBundleStore

    class Counting(HostBundleStore):
        def __init__(self):
            self.gets = self.puts = 0

        def put(self, seq, bundle):
            self.puts += 1
            return super().put(seq, bundle)

        def get(self, seq, handle):
            self.gets += 1
            return super().get(seq, handle)

    ps = prompts(6, seed=8, lo=20, hi=40)
    params = SamplingParams(temperature=0, max_tokens=40)
    e = engine("qwen3", num_pages=22, enable_prefix_cache=False)
    e.bundle_store = store = Counting()
    assert e.generate(ps, params) == engine("qwen3").generate(ps, params)
    assert e.stats.pauses > 0 and e.stats.resumes == e.stats.pauses
    assert store.gets == e.stats.resumes and store.puts == e.stats.pauses
