"""The LoopGuard inside the engine: a model pushed into a loop by a logits processor is first nudged out by
the ramping repetition penalty; one that cannot escape is stopped with the loop finish reason and a note."""

from __future__ import annotations

import functools

import numpy as np

from decapybara.config import EngineConfig
from decapybara.engine.engine import Engine
from decapybara.engine.sampling import SamplingParams
from decapybara.engine.sequence import FinishReason, Request
from decapybara.testing import make_tokenizer_json, tiny_qwen
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
