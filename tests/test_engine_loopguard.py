"""The LoopGuard inside the engine: a model pushed into a loop by a logits processor is first nudged out by
the ramping repetition penalty; one that cannot escape is stopped with the loop finish reason and a note."""

from __future__ import annotations

import functools

import numpy as np

from decapybara.config import EngineConfig
from decapybara.engine.engine import Engine
from decapybara.engine.sampling import SamplingParams
from decapybara.engine.sequence import FinishReason, Request
from decapybara.testing import attach_tiers, make_tokenizer_json, tiny_qwen
from decapybara.tokenizer import Tokenizer

LOOP = "def retry(self):\n    return self.retry()\n"


@functools.cache
def parts():
    return tiny_qwen("qwen3")[0], Tokenizer.from_json(make_tokenizer_json())


def loop_processor(tok: Tokenizer, loop_logit: float, escape_logit: float):
    """Logits that make the model spell LOOP forever (strength `loop_logit`); an escape token at
    `escape_logit` that the repetition penalty does not touch (it never appeared) competes with it."""
    cycle = tok.encode(LOOP)
    escape = tok.encode(" Ü")[-1]

    def proc(seq, logits: np.ndarray) -> np.ndarray:
        out = np.full_like(logits, -5.0)
        produced = seq.tokens[seq.num_prompt:]
        if escape in produced:  # once out of the loop, write something new every time
            out[(len(produced) * 37 + 11) % 500 + 9] = 10.0
            return out
        out[cycle[len(produced) % len(cycle)]] = loop_logit
        out[escape] = escape_logit
        return out

    return proc, escape


def run(loop_logit: float, escape_logit: float, mode: str = "stop"):
    model, tok = parts()
    proc, escape = loop_processor(tok, loop_logit, escape_logit)
    engine = Engine(model, EngineConfig(page_size=16, num_pages=128, loop_guard=mode), tokenizer=tok,
                    logits_processor=proc)
    engine.add_request(Request(tuple(tok.encode("# helper\n")), SamplingParams(temperature=0, max_tokens=400),
                               "r"))
    events = []
    while engine.has_work():
        events += engine.step()
    return engine, events, escape


def test_ramping_penalty_nudges_the_model_out_of_its_loop():
    # The loop token's positive logit 6.0 beats the fresh escape token (4.8) until the penalty divides it
    # below 4.8, i.e. above 1.25: the guard's ramp (1.1, 1.2, 1.3) gets there before its cap.
    engine, events, escape = run(6.0, 4.8)
    tokens = [t for ev in events for t in ev.token_ids]
    assert escape in tokens
    assert events[-1].finish_reason == FinishReason.LENGTH  # it ran to max_tokens: never stopped
    assert engine.stats.loopguard.get("ramp", 0) >= 3 and "stop" not in engine.stats.loopguard


def test_a_loop_that_cannot_escape_is_stopped_with_a_note():
    engine, events, escape = run(60.0, 4.8)
    last = events[-1]
    assert last.finish_reason == FinishReason.LOOP
    assert last.note and "LoopGuard" in last.note
    tokens = [t for ev in events for t in ev.token_ids]
    assert escape not in tokens and len(tokens) < 400
    assert engine.stats.loopguard.get("stop") == 1 and engine.stats.loopguard.get("ramp", 0) >= 4


def test_loop_guard_off_lets_the_loop_run():
    engine, events, _ = run(60.0, 4.8, mode="off")
    assert events[-1].finish_reason == FinishReason.LENGTH and not engine.stats.loopguard


def _end_thinking_engine(**kw):
    """An engine whose model loops inside its reasoning until end_thinking closes it: the guard fires when the
    sequence holds 241 tokens and forces the close (3 tokens)."""
    model, tok = parts()
    proc, _ = loop_processor(tok, 60.0, 4.8)
    e = Engine(model, EngineConfig(loop_guard="end_thinking", **kw), tokenizer=tok, logits_processor=proc)
    return e, tuple(tok.encode("# helper\n")) + (tok.special_ids.think,)


def _run(e: Engine, steps: int = 3000) -> None:
    for _ in range(steps):
        if not e.has_work():
            return
        e.step()


def test_forced_close_stays_inside_the_served_context_and_max_tokens():
    """Where the forced close and one answer token no longer fit the served context or max_tokens, the reply
    ends with the loop reason instead of running past them, counted and told as a stop."""
    e, prompt = _end_thinking_engine(page_size=8, num_pages=128, max_model_len=242)
    s = e.add_request(Request(prompt, SamplingParams(temperature=0, max_tokens=1000), "ctx"))
    _run(e)
    assert e.stats.loopguard.get("stop") == 1 and "end_thinking" not in e.stats.loopguard
    assert s.num_tokens <= e.max_model_len and s.finish_reason == FinishReason.LOOP
    e, prompt = _end_thinking_engine(page_size=8, num_pages=128)
    s = e.add_request(Request(prompt, SamplingParams(temperature=0, max_tokens=241 - len(prompt) + 1), "max"))
    events = []
    while e.has_work():
        events += e.step()
    assert e.stats.loopguard.get("stop") == 1 and "end_thinking" not in e.stats.loopguard
    assert s.num_output <= s.params.max_tokens and s.finish_reason == FinishReason.LOOP
    assert "generation stopped (the thinking block's close would not fit" in events[-1].note
    assert "thinking ended" not in events[-1].note


def test_forced_close_at_the_end_of_a_pool_sized_context_finishes():
    """Without the prefix cache the served context is the whole pool: a close forced past it would need a page
    more than there is, and the sequence would pause and resume itself for ever."""
    e, prompt = _end_thinking_engine(page_size=2, num_pages=121, enable_prefix_cache=False, max_batch_tokens=64)
    assert e.max_model_len == 242
    s = e.add_request(Request(prompt, SamplingParams(temperature=0, max_tokens=1000), "pool"))
    _run(e)
    assert not e.has_work() and s.finish_reason == FinishReason.LOOP and e.stats.pauses == 0


def test_forced_close_ends_its_event_whatever_the_stream_interval():
    """Tokens the LoopGuard forces have no logprobs and come after the sampled tokens of their event (what the API
    reads: an event's first len(logprobs) tokens are the sampled ones): with events of several tokens
    (stream_interval), the close still ends its event, never followed by a sampled token."""
    for interval in (1, 6, 8, 10):
        e, prompt = _end_thinking_engine(stream_interval=interval)
        e.add_request(Request(prompt, SamplingParams(temperature=0, max_tokens=400, logprobs=0), "r"))
        events = []
        while e.has_work():
            events += e.step()
        assert e.stats.loopguard.get("end_thinking") == 1
        forced = [ev.token_ids[len(ev.logprobs):] for ev in events if len(ev.token_ids) > len(ev.logprobs)]
        assert forced == [e._think_close], interval
        assert sum(len(ev.logprobs) for ev in events) + len(e._think_close) == sum(len(ev.token_ids) for ev in events)


def run_request(loop_guard: str | None, server_mode: str, tmp_path=None):
    """`run`'s unescapable loop (60.0 against 4.8) for one request asking its own mode; with `tmp_path`, paused
    to the disk tier after 8 tokens and adopted by a new engine (a restart) before it goes on."""
    model, tok = parts()
    proc, _ = loop_processor(tok, 60.0, 4.8)
    cfg = EngineConfig(page_size=16, num_pages=128, loop_guard=server_mode)

    def engine_over():
        engine = Engine(model, cfg, tokenizer=tok, logits_processor=proc)
        return engine, None if tmp_path is None else attach_tiers(engine, f"file://{tmp_path}/kv")

    engine, stores = engine_over()
    params = SamplingParams(temperature=0, max_tokens=400, loop_guard=loop_guard)
    engine.add_request(Request(tuple(tok.encode("# helper\n")), params, "r"))
    events = []
    if stores is not None:
        while sum(len(ev.token_ids) for ev in events) < 8:
            events += engine.step()
        seq = engine.seqs["r"]
        engine.admission = lambda e: None
        engine.pause(seq)
        key = seq.paused_bundle
        engine, stores = engine_over()
        assert engine.resume(engine.import_paused(stores.take_unit(key)))
    while engine.has_work():
        events += engine.step()
    return engine, events


def test_a_request_may_turn_the_guard_off_or_on_for_itself(tmp_path):
    """`SamplingParams.loop_guard` (the APIs' `loop_guard` extension) overrides the server's mode for one request:
    off under a stopping server lets the loop run to max_tokens (a table the agent wants written out), stop under
    a server with the guard off stops it; a request naming no mode takes the server's. The mode holds across a
    pause to the disk tier and an adoption by another engine."""
    engine, events = run_request("off", "stop")
    assert events[-1].finish_reason == FinishReason.LENGTH and not engine.stats.loopguard
    engine, events = run_request("stop", "off")
    assert events[-1].finish_reason == FinishReason.LOOP and engine.stats.loopguard.get("stop") == 1
    engine, events = run_request(None, "stop")
    assert events[-1].finish_reason == FinishReason.LOOP
    engine, events = run_request("off", "stop", tmp_path / "a")
    assert events[-1].finish_reason == FinishReason.LENGTH and not engine.stats.loopguard
    engine, events = run_request("stop", "off", tmp_path / "b")
    assert events[-1].finish_reason == FinishReason.LOOP and engine.stats.loopguard.get("stop") == 1


def test_a_mode_the_guard_lacks_is_refused():
    import pytest

    from decapybara.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="loop_guard must be one of stop, end_thinking, escape, off"):
        SamplingParams(loop_guard="sometimes").validate(512)


def test_a_conversation_adopted_where_the_guard_is_off_keeps_no_penalty(tmp_path):
    """Paused while the guard's penalty is up, then adopted by an engine whose guard is off: no guard goes on, so
    neither does its penalty (it would stay for good, nothing left to relax it)."""
    model, tok = parts()
    proc, _ = loop_processor(tok, 60.0, 4.8)
    engine = Engine(model, EngineConfig(page_size=16, num_pages=128, loop_guard="stop"), tokenizer=tok,
                    logits_processor=proc)
    stores = attach_tiers(engine, f"file://{tmp_path}/kv")
    engine.add_request(Request(tuple(tok.encode("# helper\n")), SamplingParams(temperature=0, max_tokens=400), "r"))
    seq = engine.seqs["r"]
    while seq.extra_penalty == 1.0:
        engine.step()
    engine.admission = lambda e: None
    engine.pause(seq)
    off = Engine(model, EngineConfig(page_size=16, num_pages=128, loop_guard="off"), tokenizer=tok,
                 logits_processor=proc)
    stores = attach_tiers(off, f"file://{tmp_path}/kv")
    adopted = off.import_paused(stores.take_unit(seq.paused_bundle))
    assert adopted.loopguard is None and adopted.extra_penalty == 1.0 and adopted.banned == ()


def test_saved_sampling_params_with_fields_this_version_lacks_still_restore():
    from decapybara.engine.persist import params_from_dict, params_to_dict

    params = SamplingParams(temperature=0.5, stop=("x",), logit_bias={3: 1.0}, loop_guard="off")
    assert params_from_dict({**params_to_dict(params), "a_later_field": 1}) == params
