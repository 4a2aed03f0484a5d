"""JSON mode (`response_format: {"type": "json_object"}`): the byte automaton against Python's JSON parser on
random documents and their damaged copies, the tokens it allows against a token-by-token reading of the whole
vocabulary, and the engine's constrained answers (the demo model): JSON objects where they end by themselves, the
same tokens alone or batched, and across a pause to the tiers and an adoption by a new engine."""

from __future__ import annotations

import dataclasses
import functools
import json

import numpy as np
import pytest
from conftest import DEMO

from decapybara.config import EngineConfig
from decapybara.engine.engine import Engine
from decapybara.engine.json_mode import DEAD, DONE, JsonState, JsonVocab, _States, _step
from decapybara.engine.sampling import SamplingParams
from decapybara.engine.sequence import Request


def read(text: bytes) -> int:
    """The automaton's mode after `text` (DEAD as soon as a byte cannot follow)."""
    s = _States.start()
    for b in text:
        s = _step(s, np.array([b], np.uint8))
        if s.mode[0] == DEAD:
            return DEAD
    return int(s.mode[0])


def random_value(rng: np.random.Generator, depth: int = 0):
    kind = rng.integers(0, 8 if depth < 4 else 5)
    if kind == 0:
        return int(rng.integers(-10**6, 10**6))
    if kind == 1:
        return float(rng.standard_normal() * 10.0 ** rng.integers(-8, 8))
    if kind == 2:
        return [None, True, False][rng.integers(0, 3)]
    if kind in (3, 4):
        chars = ["a", "Z", " ", "\"", "\\", "\n", "\t", "\u00e9", "\u6f22", "\U0001f600", "/", "\x01", "}", "]"]
        return "".join(chars[i] for i in rng.integers(0, len(chars), rng.integers(0, 8)))
    if kind == 5:
        return [random_value(rng, depth + 1) for _ in range(rng.integers(0, 4))]
    return {f"k{i}": random_value(rng, depth + 1) for i in range(rng.integers(0, 4))}


def random_object(rng: np.random.Generator) -> bytes:
    obj = {f"key{i}": random_value(rng, 1) for i in range(rng.integers(0, 5))}
    indent = [None, 0, 2, 4][rng.integers(0, 4)]
    return json.dumps(obj, indent=indent, ensure_ascii=bool(rng.integers(0, 2))).encode()


def is_json_object(text: bytes) -> bool:
    """Whether `text` is a JSON object as a client reads it: decoded as the server decodes a reply (a broken UTF-8
    sequence, which the automaton does not police, becomes U+FFFD)."""
    try:
        value = json.loads(text.decode("utf-8", "replace"))
    except ValueError:
        return False
    return isinstance(value, dict)


def test_the_automaton_reads_json_objects_and_every_prefix_of_them():
    rng = np.random.default_rng(0)
    for _ in range(300):
        doc = random_object(rng)
        s = _States.start()
        for i, b in enumerate(doc):
            s = _step(s, np.array([b], np.uint8))
            assert s.mode[0] != DEAD, (doc, i)
            assert (s.mode[0] == DONE) == (i == len(doc) - 1), (doc, i)


def test_the_automaton_agrees_with_the_json_parser_on_damaged_documents():
    """Random edits of valid documents: where the automaton reads the whole text to its end it must be a JSON
    object by Python's parser, and the other way round, except for what JSON mode refuses on purpose: whitespace
    after the object, more than `TOP_WS` bytes of it before, and runs of it past `MAX_WS`."""
    rng = np.random.default_rng(1)
    alphabet = b'{}[]":,.-+0123456789eEtrufalsn \n\\abcu'
    done = 0
    for _ in range(1200):
        doc = bytearray(random_object(rng))
        for _ in range(rng.integers(1, 3)):
            op, at = rng.integers(0, 3), int(rng.integers(0, len(doc) + 1))
            c = alphabet[rng.integers(0, len(alphabet))]
            if op == 0:
                doc.insert(at, c)
            elif op == 1 and at < len(doc):
                del doc[at]
            elif at < len(doc):
                doc[at] = c
        text = bytes(doc)
        ours = read(text) == DONE
        theirs = (is_json_object(text) and len(text) - len(text.lstrip()) <= 2 and text == text.rstrip()
                  and b" " * 33 not in text)
        assert ours == theirs, text
        done += ours
    assert done > 40  # some edits keep a valid object


@functools.cache
def demo():
    from decapybara.model.load import load_model

    return load_model(str(DEMO))


def brute_banned(tok, state) -> np.ndarray:
    """Every token read byte by byte from `state` (the added tokens never allowed; the end only after the close)."""
    allowed = np.zeros(tok.vocab_size, bool)
    done = int(state.mode[0]) == DONE
    for i in range(tok.vocab_size):
        data = tok.token_bytes(i)
        if done or i in tok.added_ids or not data:
            continue
        s = state
        for b in data:
            s = _step(s, np.array([b], np.uint8))
            if s.mode[0] == DEAD:
                break
        else:
            allowed[i] = True
    if done:
        allowed[list(tok.eos_token_ids)] = True
    return np.flatnonzero(~allowed)


def test_the_tokens_allowed_are_those_read_whole_one_by_one():
    """`JsonVocab.banned` (the whole vocabulary at once, states that no token tells apart sharing an entry) against
    reading each token alone, at states along a document with deep nesting, escapes, numbers and whitespace."""
    tok = demo().tokenizer
    vocab = JsonVocab(tok, tok.vocab_size)
    doc = (b'{"a": [[{"b": [[[{"c": {"d": [1, -2.5e-3, [true, {"e": "x\\"\\u00e9  "}]]}}]]]}]],   \n\n    '
           b'"z": {"n": null, "f": false}}')
    st = JsonState(vocab)
    rng = np.random.default_rng(2)
    checks = sorted(set(rng.integers(0, len(doc) + 1, 3).tolist()) | {0, 1, 2, len(doc)})
    for k in range(len(doc) + 1):
        if k in checks:
            assert np.array_equal(st.banned(), brute_banned(tok, st.state)), doc[:k]
        if k < len(doc):
            st.advance(doc[k:k + 1])
    assert st.done and np.array_equal(st.banned(), np.setdiff1d(np.arange(tok.vocab_size), tok.eos_token_ids))


def answer_text(tok, ids: list[int]) -> bytes:
    """The answer's bytes: after the reasoning, without the end token."""
    if tok.special_ids.end_think in ids:
        ids = ids[ids.index(tok.special_ids.end_think) + 1:]
    return b"".join(tok.token_bytes(t) for t in ids if t not in tok.eos_token_ids)


def run(engine: Engine, requests: list[Request]) -> tuple[dict[str, list[int]], dict[str, str]]:
    for r in requests:
        engine.add_request(r)
    outs: dict[str, list[int]] = {r.request_id: [] for r in requests}
    ends: dict[str, str] = {}
    while engine.has_work():
        for ev in engine.step():
            outs[ev.request_id] += ev.token_ids
            if ev.finish_reason is not None:
                ends[ev.request_id] = ev.finish_reason.value
    return outs, ends


@pytest.mark.parametrize("thinking", [False, True])
def test_the_engines_json_answers_are_json_objects_alone_or_batched(thinking):
    """Greedy and sampled JSON-mode requests of the demo model beside plain ones: an answer that ends by itself is
    a JSON object, one cut by max_tokens a prefix of one (with reasoning: after it); the tokens are the same alone
    and batched."""
    m = demo()
    tok = m.tokenizer
    prompt = tuple(tok.apply_chat([{"role": "user", "content": "Describe is_even(n) as a JSON object."}],
                                  enable_thinking=thinking))
    params = [SamplingParams(temperature=0, max_tokens=160, json_object=True),
              SamplingParams(temperature=1.0, seed=3, max_tokens=160, json_object=True),
              SamplingParams(temperature=0.7, seed=5, top_p=0.9, max_tokens=160, json_object=True)]
    cfg = EngineConfig(loop_guard="off", max_slots=6)
    alone = {}
    for i, p in enumerate(params):
        out, _ = run(Engine(m.model, cfg, tokenizer=tok), [Request(prompt, p, f"j{i}")])
        alone[f"j{i}"] = out[f"j{i}"]
    plain = SamplingParams(temperature=0, max_tokens=40)
    batch = [Request(prompt, p, f"j{i}") for i, p in enumerate(params)] + [Request(prompt, plain, "plain")]
    outs, ends = run(Engine(m.model, cfg, tokenizer=tok), batch)
    assert {k: outs[k] for k in alone} == alone
    stopped = 0
    for rid in alone:
        text = answer_text(tok, outs[rid])
        if ends[rid] == "stop":
            assert is_json_object(text), text
            stopped += 1
        else:
            assert read(text) not in (DEAD, DONE), text
    assert stopped >= 1
    assert not is_json_object(answer_text(tok, outs["plain"]))  # unconstrained, the demo writes code
    if thinking:  # the prompt leaves the reasoning to the model: it opens it as it does without JSON mode
        assert outs["j0"][0] == outs["plain"][0] == tok.special_ids.think


@pytest.mark.parametrize("extra", [{"min_tokens": 40}, {"ignore_eos": True}])
def test_a_json_answer_ends_where_its_object_closes(extra):
    """The answer ends (stop) with the token that closes the object, whatever min_tokens or ignore_eos ask: no
    token after it could keep it JSON."""
    m = demo()
    tok = m.tokenizer
    prompt = tuple(tok.apply_chat([{"role": "user", "content": "Describe the function is_even(n) as a JSON object."}],
                                  enable_thinking=False))
    base = SamplingParams(temperature=0, max_tokens=300, json_object=True)
    want, ends = run(Engine(m.model, EngineConfig(loop_guard="off"), tokenizer=tok), [Request(prompt, base, "j")])
    assert ends["j"] == "stop" and is_json_object(answer_text(tok, want["j"]))
    params = dataclasses.replace(base, **extra)
    got, ends = run(Engine(m.model, EngineConfig(loop_guard="off"), tokenizer=tok), [Request(prompt, params, "j")])
    text = answer_text(tok, got["j"])
    assert ends["j"] == "stop" and is_json_object(text), text
    assert got == want  # eos and the stop ids were never JSON's to take: masking them changes nothing


def adopt_midway(prompt: tuple, params: SamplingParams, tmp_path, check, processor=None) -> None:
    """Run `params` uninterrupted, then again paused after 8 tokens to the disk tier and adopted by a new engine
    (a restart): `check(seq)` on the adopted sequence, and the same tokens as the uninterrupted run (every engine
    with the logits `processor`, if any)."""
    from decapybara.kv.stores import TierStores
    from decapybara.testing import attach_tiers

    m = demo()
    tok = m.tokenizer
    cfg = EngineConfig(loop_guard="off")
    want, _ = run(Engine(m.model, cfg, tokenizer=tok, logits_processor=processor), [Request(prompt, params, "j")])

    def engine_over() -> tuple[Engine, TierStores]:
        engine = Engine(m.model, cfg, tokenizer=tok, logits_processor=processor)
        return engine, attach_tiers(engine, f"file://{tmp_path}/kv")

    engine, stores = engine_over()
    engine.add_request(Request(prompt, params, "j"))
    assert len(want["j"]) > 16
    got: list[int] = []
    while len(got) < 8 and engine.has_work():
        for ev in engine.step():
            got += ev.token_ids
    seq = engine.seqs["j"]
    engine.admission = lambda e: None
    engine.pause(seq)
    key = seq.paused_bundle
    engine, stores = engine_over()
    seq = engine.import_paused(stores.take_unit(key))
    check(seq)
    assert engine.resume(seq)
    while engine.has_work():
        for ev in engine.step():
            got += ev.token_ids
    assert got == want["j"]


def test_a_json_answer_paused_to_the_tiers_and_adopted_goes_on_as_it_would_have(tmp_path):
    """A JSON-mode conversation paused midway to the disk tier and adopted by a new engine (a restart) replays its
    automaton from its tokens: the same tokens as an uninterrupted run."""
    tok = demo().tokenizer
    prompt = tuple(tok.apply_chat([{"role": "user", "content": "A JSON object for is_even(n), please."}],
                                  enable_thinking=False))

    def check(seq):
        assert seq.json is not None and seq.json.state.key_of() == _replayed(tok, seq).key_of()

    adopt_midway(prompt, SamplingParams(temperature=0.8, seed=12, max_tokens=120, json_object=True), tmp_path, check)


def _replayed(tok, seq):
    st = JsonState(JsonVocab(tok, tok.vocab_size))
    st.advance(answer_text(tok, seq.tokens[seq.num_prompt:]))
    return st.state
