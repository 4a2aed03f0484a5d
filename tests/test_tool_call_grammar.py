"""Tool calls under tool_choice auto (`lazy_tool_calls`, `json_schema.ToolCallsOnce`): the reply is free text
until the model opens a call with its `<tool_call>` token; from there to the call's close its tokens are held to
the tools' names and parameters; after it the reply is free again (parallel calls) or whole (one call). Scripted
replies on the demo model (a script's token the automaton refuses leaves the model's own choice under the
masks), exactness against the unconstrained run where nothing is refused, drafts, and adoption after a pause."""

from __future__ import annotations

import dataclasses
import json

import jsonschema
import numpy as np
import pytest
from test_json_mode import adopt_midway, demo, run

from decapybara.chat import parse_assistant_output
from decapybara.config import EngineConfig
from decapybara.engine.engine import Engine
from decapybara.engine.json_schema import ToolCallsOnce, compile_tool_calls, tags_as_bytes, tool_call_spec
from decapybara.engine.sampling import SamplingParams
from decapybara.engine.sequence import Request

TOOLS = [
    {"type": "function", "function": {"name": "read_file", "parameters": {"type": "object", "properties": {
        "path": {"type": "string", "minLength": 1}, "line": {"type": "integer", "minimum": 1}},
        "required": ["path"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "run", "parameters": {"type": "object", "properties": {
        "command": {"type": "string"}, "timeout": {"type": "integer", "minimum": 1, "maximum": 600}},
        "required": ["command"], "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
CALL = '<tool_call>\n{"name": "read_file", "arguments": {"path": "main.py", "line": 3}}\n</tool_call>'
CALL2 = '<tool_call>\n{"name": "run", "arguments": {"command": "ls -l"}}\n</tool_call>'
SCRIPTS = {
    "good": "I will read it.\n" + CALL + "\n" + CALL2,
    "text-after": "Before.\n" + CALL + "\nAfter that, done.",
    "nan": 'Reading.\n<tool_call>\n{"name": "read_file", "arguments": {"path": NaN}}\n</tool_call>',
    "no-such-tool": 'Hm.\n<tool_call>\n{"name": "delete_all", "arguments": {}}\n</tool_call>',
    "bad-bound": '<tool_call>\n{"name": "run", "arguments": {"command": "x", "timeout": 0}}\n</tool_call>',
    "prose": "Nothing to call here, <tool_call> is a tag I mention in prose.",
}


class Script:
    """Logits processor: force the script's next token while the reply so far is the script's prefix, then leave
    the model's own logits (so a script's token the masks refuse hands the rest of the reply to the model)."""

    def __init__(self, tok, text: str) -> None:
        self.ids = tok.encode(text)

    def __call__(self, seq, logits: np.ndarray) -> np.ndarray:
        out = seq.tokens[seq.num_prompt:]
        if len(out) < len(self.ids) and out == self.ids[:len(out)]:
            forced = np.full_like(logits, -1e9)
            forced[self.ids[len(out)]] = 0.0
            return forced
        return logits


def _prompt(tok) -> tuple[int, ...]:
    return tuple(tok.apply_chat([{"role": "user", "content": "Read main.py and list the folder."}], TOOLS,
                                enable_thinking=False))


def _reply(script: str, parallel: bool = True, lazy: bool = True, max_tokens: int = 120, **cfg) -> tuple[str, str]:
    m = demo()
    tok = m.tokenizer
    spec = tool_call_spec(TOOLS, None, parallel)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, tool_calls=spec if lazy else None,
                            lazy_tool_calls=lazy)
    engine = Engine(m.model, EngineConfig(loop_guard="off", **cfg), tokenizer=tok,
                    logits_processor=Script(tok, SCRIPTS[script]))
    outs, ends = run(engine, [Request(_prompt(tok), params, "r")])
    return tok.decode(outs["r"], skip_special_tokens=False).replace("<|im_end|>", ""), ends["r"]


def _valid_calls(text: str) -> list:
    out = parse_assistant_output(text)
    for call in out.tool_calls:
        jsonschema.validate(call.arguments, SCHEMAS[call.name])
    return out.tool_calls


def _call_prefix_ok(text: str) -> bool:
    """Every call the text opens reads as a prefix of the one-call automaton's language."""
    dfa = compile_tool_calls(tool_call_spec(TOOLS, None, True), single=True)
    for piece in text.split("<tool_call>")[1:]:
        s, w = dfa.start, 0
        call = "<tool_call>" + piece.split("</tool_call>")[0] + ("</tool_call>" if "</tool_call>" in piece else "")
        for b in tags_as_bytes(call.encode()):
            s, w = dfa.step(s, w, b)
            if s < 0:
                return False
    return True


def test_valid_calls_and_the_text_around_them_are_the_models_own():
    """Where the model writes valid calls, the constrained reply is token for token the unconstrained one: its
    text before, between and after the calls free, each call read through."""
    for script in ("good", "text-after"):
        free, end_free = _reply(script, lazy=False)
        lazy, end_lazy = _reply(script)
        assert lazy == free and end_lazy == end_free, script
    text, _ = _reply("good")
    assert text.startswith(SCRIPTS["good"])
    assert [c.name for c in _valid_calls(text)] == ["read_file", "run"]
    text, _ = _reply("text-after")
    assert text.startswith(SCRIPTS["text-after"])  # free again after the call: the model's words stand


def test_the_tag_token_opens_a_call_whatever_the_model_meant():
    """The `<tool_call>` token is a call's opening even amid prose: what follows it is held to a call."""
    text, _ = _reply("prose")
    assert text.startswith("Nothing to call here, <tool_call>") and _call_prefix_ok(text), text
    assert "is a tag I mention" not in text


@pytest.mark.parametrize("script", ["nan", "no-such-tool", "bad-bound"])
def test_a_call_the_schemas_refuse_is_held_to_them(script):
    """NaN, a tool that does not exist and a number past its bound are refused as they are written: the call's
    bytes stay a prefix of a valid call, and a call that closes parses, valid against its tool's schema."""
    free, _ = _reply(script, lazy=False)
    text, end = _reply(script)
    assert text != free
    before = SCRIPTS[script].split("<tool_call>")[0]
    assert text.startswith(before + "<tool_call>")
    assert _call_prefix_ok(text), text
    if "</tool_call>" in text:
        assert _valid_calls(text), text
    assert "NaN" not in text and "delete_all" not in text and '"timeout": 0' not in text
    assert end in ("stop", "length")


def test_one_call_where_parallel_calls_are_off():
    """parallel off: the reply ends where its first call closes (the script's second call is never written)."""
    text, end = _reply("good", parallel=False)
    assert text == "I will read it.\n" + CALL and end == "stop"
    assert [c.name for c in _valid_calls(text)] == ["read_file"]


def test_drafts_never_open_a_call_and_leave_the_tokens_as_they_are():
    """Prompt-lookup drafts beside a free reply: never the `<tool_call>` token (the token after an accepted draft
    is sampled without the masks it would turn on); the reply the same token for token as without drafts."""
    m = demo()
    tok = m.tokenizer
    want, _ = _reply("good")
    got, _ = _reply("good", speculator="ngram", spec_adaptive=False)
    assert got == want
    engine = Engine(m.model, EngineConfig(loop_guard="off"), tokenizer=tok)
    params = SamplingParams(max_tokens=8, tool_calls=tool_call_spec(TOOLS, None, True), lazy_tool_calls=True)
    seq = engine.add_request(Request(_prompt(tok), params, "d"))
    assert isinstance(seq.json, ToolCallsOnce) and seq.json.free
    trigger = tok.special_ids.tool_call
    assert engine._opens_constraint(seq, trigger) and not engine._opens_constraint(seq, trigger + 1)
    seq.json.advance(tok.token_bytes(trigger), trigger)
    assert not seq.json.free and not engine._opens_constraint(seq, trigger)  # a call open: no drafts at all


def test_the_free_reply_costs_no_masks_and_the_open_call_its_own():
    """A free reply is neither masked nor kept from drafting; once its call is open, only the tokens its
    automaton reads whole are allowed (the tool names' first bytes after the call's opening)."""
    m = demo()
    tok = m.tokenizer
    engine = Engine(m.model, EngineConfig(loop_guard="off"), tokenizer=tok)
    params = SamplingParams(max_tokens=8, tool_calls=tool_call_spec(TOOLS, None, True), lazy_tool_calls=True)
    seq = engine.add_request(Request(_prompt(tok), params, "f"))
    assert not engine._json_active(seq)
    logits = np.zeros((1, m.model.cfg.vocab_size), np.float32)
    assert engine._json_masked(logits, [seq], np) is logits  # nothing to mask
    with pytest.raises(RuntimeError):
        seq.json.allowed()
    trigger = tok.special_ids.tool_call
    for t in tok.encode('<tool_call>\n{"name": "'):
        seq.json.advance(tok.token_bytes(t), t)
    assert engine._json_active(seq)
    allowed = np.flatnonzero(seq.json.allowed())
    firsts = {tok.token_bytes(int(t))[:1] for t in allowed}
    assert firsts == {b"r"}, firsts  # read_file and run
    assert trigger not in allowed and tok.eos_token_ids[0] not in allowed


def test_without_the_tag_token_nothing_is_constrained():
    """A tokenizer without a `<tool_call>` token: the reply is left free (no automaton at all)."""
    m = demo()
    tok = m.tokenizer
    engine = Engine(m.model, EngineConfig(loop_guard="off"), tokenizer=tok)
    engine.tokenizer = type("NoTag", (), {"special_ids": dataclasses.replace(tok.special_ids, tool_call=None),
                                           "__getattr__": lambda self, k: getattr(tok, k)})()
    params = SamplingParams(max_tokens=8, tool_calls=tool_call_spec(TOOLS, None, True), lazy_tool_calls=True)
    assert engine._json_state(params, _prompt(tok)) is None


def test_a_reply_paused_inside_its_call_and_adopted_goes_on_as_it_would_have(tmp_path):
    """Paused to the disk tier inside an open call and adopted by a new engine (a restart): the call is open there
    as the reply's tokens replay it, and the reply's tokens are the uninterrupted run's (the model's own after
    the scripted call, sampled)."""
    tok = demo().tokenizer
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=40, tool_calls=tool_call_spec(TOOLS, None, True),
                            lazy_tool_calls=True)
    script = Script(tok, "ok\n" + CALL)
    assert tok.special_ids.tool_call in script.ids[:6]

    def check(seq) -> None:
        assert isinstance(seq.json, ToolCallsOnce) and not seq.json.free
        out = seq.tokens[seq.num_prompt:]
        text = tok.decode(out[out.index(tok.special_ids.tool_call):], skip_special_tokens=False)
        replay = compile_tool_calls(params.tool_calls, single=True)
        s, w = replay.start, 0
        for b in tags_as_bytes(text.encode()):
            s, w = replay.step(s, w, b)
        assert (seq.json.call.state, seq.json.call.ws) == (s, w)

    adopt_midway(_prompt(tok), params, tmp_path, check, processor=script)


def test_sampling_params_check_the_flag():
    from decapybara.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError):
        SamplingParams(lazy_tool_calls=True).validate(100)
    with pytest.raises(InvalidRequestError):
        SamplingParams(tool_calls=json.dumps({"tools": []}), lazy_tool_calls=1).validate(100)
    SamplingParams(tool_calls=json.dumps({"tools": []}), lazy_tool_calls=True).validate(100)
