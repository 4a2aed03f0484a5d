"""Tool calls under tool_choice auto (`lazy_tool_calls`, `tool_calls.ToolCallReply`): the reply is free text
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
from decapybara.engine.json_schema import compile_calls, tags_as_bytes, tool_call_spec
from decapybara.engine.sampling import SamplingParams
from decapybara.engine.sequence import Request
from decapybara.engine.tool_calls import CallState, ToolCallReply, ToolSetVocab

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
    dfas = [compile_calls([{"name": t["function"]["name"], "parameters": t["function"]["parameters"]}]) for t in TOOLS]
    for piece in text.split("<tool_call>")[1:]:
        call = "<tool_call>" + piece.split("</tool_call>")[0] + ("</tool_call>" if "</tool_call>" in piece else "")
        alive = 0
        for dfa in dfas:
            s, w = dfa.start, 0
            for b in tags_as_bytes(call.encode()):
                s, w = dfa.step(s, w, b)
            alive += s >= 0
        if not alive:
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


@pytest.mark.parametrize("speculator", ["ngram", "mtp"])
def test_constrained_replies_draft_and_keep_their_tokens(speculator):
    """Drafts (prompt lookup, the MTP head) verified in JSON mode, under a schema, in forced calls and in the
    calls a free reply opens (the bias on `<tool_call>` opening them): the same tokens as without drafts, greedy
    and sampled, with drafts accepted; the token after an accepted draft is sampled under the masks of the state
    after it."""
    from decapybara.engine.json_schema import schema_text

    m = demo()
    tok = m.tokenizer
    prompt = _prompt(tok)
    spec = tool_call_spec(TOOLS, None, True)
    person = schema_text({"type": "object", "properties": {"name": {"type": "string"}, "tags": {
        "type": "array", "items": {"type": "string"}}}, "required": ["name", "tags"]})
    params = [SamplingParams(temperature=t, seed=3, max_tokens=64, **kw) for t in (0, 0.8) for kw in (
        {"json_object": True}, {"json_schema": person}, {"tool_calls": spec},
        {"tool_calls": spec, "lazy_tool_calls": True, "logit_bias": {tok.special_ids.tool_call: 30.0}})]
    want = Engine(m.model, EngineConfig(loop_guard="off"), tokenizer=tok).generate([prompt] * len(params), params)
    engine = Engine(m.model, EngineConfig(loop_guard="off", speculator=speculator, spec_adaptive=False,
                                          spec_min_confidence=0.0), tokenizer=tok)
    got = engine.generate([prompt] * len(params), params)
    assert got == want
    assert engine.stats.accepted_tokens > 0


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
    assert isinstance(seq.json, ToolCallReply) and seq.json.free
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


@pytest.mark.parametrize("missing", ["tool_call", "end_tool_call"])
def test_without_the_tag_tokens_calls_are_asked_for_not_constrained(missing):
    """A tokenizer without one of the tag tokens: no call could be written under the automata (the tags are read
    as their tokens' reserved bytes), so forced and lazy replies are left unconstrained (asked for in the prompt),
    and the engine runs them beside a plain request."""
    m = demo()
    tok = m.tokenizer
    engine = Engine(m.model, EngineConfig(loop_guard="off"), tokenizer=tok)
    no_tag = dataclasses.replace(tok.special_ids, **{missing: None})
    engine.tokenizer = type("NoTag", (), {"special_ids": no_tag, "__getattr__": lambda self, k: getattr(tok, k)})()
    spec = tool_call_spec(TOOLS, None, True)
    params = [SamplingParams(temperature=0, max_tokens=8, tool_calls=spec, lazy_tool_calls=lazy)
              for lazy in (False, True)]
    for p in params:
        assert engine._json_state(p, _prompt(tok)) is None
    outs = engine.generate([_prompt(tok)] * 3, [*params, SamplingParams(temperature=0, max_tokens=8)])
    assert outs[0] == outs[1] == outs[2] and outs[0]  # none constrained: the plain reply, thrice


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
        assert isinstance(seq.json, ToolCallReply) and not seq.json.free
        out = seq.tokens[seq.num_prompt:]
        text = tok.decode(out[out.index(tok.special_ids.tool_call):], skip_special_tokens=False)
        replay = CallState(seq.json.tools)
        replay.advance(tags_as_bytes(text.encode()))
        assert seq.json.call.alive == replay.alive and replay.alive

    adopt_midway(_prompt(tok), params, tmp_path, check, processor=script)


def test_sampling_params_check_the_flag():
    from decapybara.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError):
        SamplingParams(lazy_tool_calls=True).validate(100)
    with pytest.raises(InvalidRequestError):
        SamplingParams(tool_calls=json.dumps({"tools": []}), lazy_tool_calls=1).validate(100)
    SamplingParams(tool_calls=json.dumps({"tools": []}), lazy_tool_calls=True).validate(100)


def _vocab(tok):
    from decapybara.engine.json_mode import JsonVocab
    from decapybara.engine.json_schema import CLOSE_TAG, OPEN_TAG

    ids = tok.special_ids
    return JsonVocab(tok, tok.vocab_size, markup={ids.tool_call: OPEN_TAG, ids.end_tool_call: CLOSE_TAG})


def _step_token(rng, tok, allowed: np.ndarray) -> int:
    """A random allowed token, half the time one that closes something where there is one (so that strings
    close and calls end), a quarter of the time among the shortest."""
    choices = np.flatnonzero(allowed)
    r = rng.random()
    if r < 0.5:
        closing = [t for t in choices.tolist() if t == tok.special_ids.end_tool_call
                   or (tok.token_bytes(t)[:1] in (b'"', b"}", b"]") and len(tok.token_bytes(t)) <= 2)]
        if closing:
            return int(rng.choice(closing))
    if r < 0.75:
        lens = np.array([len(tok.token_bytes(int(t))) for t in choices])
        choices = choices[lens == lens.min()]
    return int(rng.choice(choices))


ANSWER = {"type": "object", "properties": {"ok": {"type": "boolean"}, "why": {"type": "string"}}, "required": ["ok"]}


@pytest.mark.parametrize("name, parallel, answer", [(None, True, None), (None, False, None), ("run", True, None),
                                                    (None, True, ANSWER), (None, False, ANSWER)])
@pytest.mark.parametrize("split", [False, True])
def test_the_forced_reply_by_groups_allows_what_the_sets_one_automaton_allows(name, parallel, answer, split,
                                                                              monkeypatch):
    """Forced calls (tool_choice required / named), and calls or a JSON answer (a schema beside tools under auto),
    run as `ToolCallReply` over `ToolSetVocab` (the calls by groups of tools: the whole set, or `split` one
    tool a group, the answer and the glue automata of their own): along random walks, the same tokens allowed at
    every step as the whole reply's one automaton (`compile_tool_calls`) allows, the same end; the calls written
    parse and follow their schemas."""
    from decapybara.engine import tool_calls
    from decapybara.engine.json_schema import SchemaState, SchemaVocab, compile_tool_calls

    if split:  # every group one tool, as a set past MAX_DFA would split at the end
        monkeypatch.setattr(tool_calls, "call_groups",
                            lambda tools, fmt="json": [([t], compile_calls([t], fmt)) for t in tools])
    tok = demo().tokenizer
    vocab = _vocab(tok)
    spec = tool_call_spec(TOOLS, name, parallel, answer)
    tools = ToolSetVocab(vocab, spec)
    assert len(tools.groups) == (len(TOOLS) if split and name is None else 1)
    rng = np.random.default_rng(len(str(name)) + parallel)
    calls, answers = 0, 0
    for walk in range(4 if answer else 3):
        one = SchemaState(SchemaVocab(vocab, compile_tool_calls(spec), markup=True))
        reply = ToolCallReply(tools, tok.special_ids.tool_call, lazy=False)
        out = []
        for _ in range(120):
            if reply.done:
                assert one.done
                break
            a = reply.allowed()
            assert np.array_equal(a, one.allowed())
            t = _step_token(rng, tok, a)
            if answer and not out:  # the calls' way and the answer's in turn
                t = tok.special_ids.tool_call if walk % 2 else tok.encode("{")[0]
                assert a[t]
            if t in tok.eos_token_ids:
                assert reply.calls >= 1 or reply.answering
                break
            out.append(t)
            for st in (one, reply):
                st.advance(tok.token_bytes(t), t)
            assert not reply.dead and not one.dead
        text = tok.decode(out, skip_special_tokens=False)
        if reply.answering:  # the answer's way: a JSON object, whole where done
            if reply.done:
                jsonschema.validate(json.loads(text), answer)
            answers += 1
            continue
        got = _valid_calls(text[:text.rfind("</tool_call>") + len("</tool_call>")])  # the calls closed
        assert len(got) == reply.calls and {c.name for c in got} <= ({name} if name else set(SCHEMAS))
        calls += len(got)
    assert calls >= 2 if not answer else (calls >= 1 and answers >= 1)  # the answer's way and the calls' taken


def test_a_tool_set_past_one_automatons_size_is_enforced_by_groups():
    """32 tools whose set is past `MAX_DFA` states as one automaton (refused: before, its calls were only asked
    for): forced and lazy replies run them in two groups of 16, the masks while the name is read the union of the
    groups still reading it, and the calls written parse, valid against their tools' schemas."""
    import jsonschema

    from decapybara.engine.json_schema import SchemaError, compile_tool_calls

    def tool(i: int) -> dict:
        return {"type": "function", "function": {"name": f"tool_{i}", "parameters": {
            "type": "object", "properties": {"mode": {"enum": ["alpha", "beta"]}, "count": {
                "type": "integer", "minimum": 1, "maximum": 1000}, "name": {"type": "string", "maxLength": 64}},
            "required": ["mode", "count"], "additionalProperties": False}}}

    many = [tool(i) for i in range(32)]
    spec = tool_call_spec(many, None, True)
    with pytest.raises(SchemaError):
        compile_tool_calls(spec)
    tok = demo().tokenizer
    tools = ToolSetVocab(_vocab(tok), spec)
    assert len(tools.groups) == 2 and sum(g.dfa.num_states for g in tools.groups) > 60_000
    rng = np.random.default_rng(3)
    for lazy in (False, True):
        reply = ToolCallReply(tools, tok.special_ids.tool_call, lazy=lazy)
        out = tok.encode("Let me see.") if lazy else []
        for t in out:
            reply.advance(tok.token_bytes(t), t)
        assert reply.free == lazy
        assert reply.allowed()[tok.special_ids.tool_call] if not lazy else True
        out.append(tok.special_ids.tool_call)
        reply.advance(b"<tool_call>", tok.special_ids.tool_call)
        for t in tok.encode('\n{"name": "tool_'):  # every tool alive: the union of their masks
            assert reply.allowed()[t]
            reply.advance(tok.token_bytes(t), t)
            out.append(t)
        assert len(reply.call.alive) == 2  # both halves' automata read the name so far
        for t in tok.encode("17"):
            reply.advance(tok.token_bytes(t), t)
            out.append(t)
        assert [g for g, _, _ in reply.call.alive] == [1]  # tool_17's half
        while reply.call is not None and len(out) < 400:
            t = _step_token(rng, tok, reply.allowed())
            assert t not in tok.eos_token_ids
            out.append(t)
            reply.advance(tok.token_bytes(t), t)
            assert not reply.dead
        (call,) = parse_assistant_output(tok.decode(out, skip_special_tokens=False)).tool_calls
        assert call.name == "tool_17"
        jsonschema.validate(call.arguments, many[17]["function"]["parameters"])
        assert reply.free == lazy and not reply.done  # parallel: free again, or (forced) another call or the end


def test_a_groups_masks_are_found_again_in_any_set_made_of_it():
    """An engine keeps every tool set's call masks in one cache, by the group of tools: a forced reply over the
    tools finds the masks a reply under tool_choice auto over the same tools computed (another spec: parallel
    calls off)."""
    m = demo()
    tok = m.tokenizer
    engine = Engine(m.model, EngineConfig(loop_guard="off"), tokenizer=tok)
    replies = [engine._json_state(SamplingParams(max_tokens=8, tool_calls=tool_call_spec(TOOLS, None, parallel),
                                                 lazy_tool_calls=parallel), _prompt(tok))
               for parallel in (True, False)]
    assert replies[0].tools is not replies[1].tools and replies[0].lazy and not replies[1].lazy
    masks = []
    for reply in replies:
        for t in [tok.special_ids.tool_call, *tok.encode('\n{"name": "run", "arguments": {"command": "ls')]:
            reply.advance(tok.token_bytes(t), t)
        before = engine._call_masks.misses
        masks.append(reply.allowed())
    assert engine._call_masks.misses == before  # the second set's: found again
    assert np.array_equal(*masks)


# ---------------------------------------------------------------------------------------------- XML calls


def _xml(name: str, *params: tuple[str, str]) -> str:
    """A call as the XML templates (Qwen3.5 / Qwen3.6) write it, each value's text as given."""
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


XML_SCHEMAS = {
    "edit": {"type": "object", "properties": {
        "path": {"type": "string", "description": "raw text"}, "line": {"type": "integer", "minimum": 1},
        "mode": {"enum": ["r", "w", 3]}, "force": {"type": "boolean"},
        "options": {"type": "object", "properties": {"depth": {"type": "integer"}}, "required": ["depth"],
                    "additionalProperties": False},
        "note": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
        "required": ["path", "force"], "additionalProperties": False},
    "env": {"type": "object", "additionalProperties": {"type": "integer"}},
    "odd": {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 3}}, "required": ["n"]},
    "ping": None,
}
XML_TOOLS = [{"type": "function", "function": {"name": k, "parameters": v}} for k, v in XML_SCHEMAS.items()]


def _xml_syntax():
    from decapybara.api.common import call_syntax

    return call_syntax("xml", XML_TOOLS)


@pytest.mark.parametrize("text, ok", [
    (_xml("edit", ("path", "src/a.py\nline two </parameter> x"), ("line", "3"), ("mode", "w"), ("force", "true"),
          ("options", '{"depth": 2}'), ("note", "null")), True),
    (_xml("edit", ("path", ""), ("mode", "3"), ("force", "false")), True),
    (_xml("edit", ("path", "a"), ("force", "false"), ("note", "any text {")), True),
    (_xml("edit", ("force", "true")), False),  # a required parameter left out
    (_xml("edit", ("force", "true"), ("path", "a")), False),  # not in the schema's order
    (_xml("edit", ("path", "a"), ("line", "0"), ("force", "true")), False),  # below its minimum
    (_xml("edit", ("path", "a"), ("line", '"3"'), ("force", "true")), False),  # an integer is no JSON string
    (_xml("edit", ("path", "a"), ("mode", "x"), ("force", "true")), False),  # not among the listed values
    (_xml("edit", ("path", "a"), ("force", "True")), True),  # a boolean as a template's |string writes it
    (_xml("edit", ("path", "a"), ("force", "TRUE")), False),  # as neither writes it
    (_xml("edit", ("path", "a"), ("force", "true"), ("options", '{"depth": 1, "x": 2}')), False),
    (_xml("edit", ("path", "a\n</parameter>"), ("force", "true")), True),  # the tag, no tag after it: text
    (_xml("edit", ("path", "a</parameter>\n<parameter=line>\nx"), ("force", "true")), False),  # a value's end
    (_xml("edit", ("path", "a"), ("force", "true"), ("color", "red")), False),  # undeclared
    (_xml("env", ("HOME", "1"), ("PATH", "22")), True), (_xml("env"), True),
    (_xml("env", ("HOME", "x")), False), (_xml("env", ("a>b", "1")), False),
    (_xml("odd", ("n", "4"), ("free", '{"any": "thing"}')), True),  # multipleOf: any parameters, as JSON calls
    (_xml("ping"), True), (_xml("ping", ("x", "1")), False), (_xml("nope"), False),
    ('<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>', False),  # the JSON form
])
def test_the_xml_call_automaton_reads_what_the_template_writes(text, ok):
    """A call in the XML form (tool_call_spec's "format": "xml"): the tool's name, then its parameters in the
    schema's order, the required ones all there, a string's value any raw text without the value's end, listed
    values as the template writes them, others JSON its schema accepts; a tool whose schema is not enforced takes
    any parameters (as the JSON form takes any object). What it reads parses back to arguments the schema accepts."""
    from decapybara.engine.json_schema import compile_tool_calls

    spec = tool_call_spec(XML_TOOLS, None, True, fmt="xml")
    assert json.loads(spec)["format"] == "xml"
    dfa = compile_tool_calls(spec)
    assert dfa.matches(tags_as_bytes(text.encode())) == ok
    assert compile_calls(json.loads(spec)["tools"], "xml").matches(tags_as_bytes(text.encode())) == ok
    if ok:
        (call,) = parse_assistant_output(text, tools=_xml_syntax()).tool_calls
        if call.name != "odd":
            jsonschema.validate(call.arguments, XML_SCHEMAS[call.name] or {"additionalProperties": False})


def test_the_xml_automaton_reads_a_value_as_the_parser_does():
    """A value written without the newline before ``</parameter>`` (``src/a.py</parameter>``, as models write
    it) is one the automaton reads too, and parses back to what was written (a string, an integer, a listed value,
    a ``|string`` boolean, an object); a listed string that ends in a newline only with the template's newline
    after it. A string's value, ended either way, is one it reads exactly where the parser reads it back whole:
    random texts of the markup's pieces, ``</parameter>`` on a line of its own or before the next tag."""
    import random

    from decapybara.chat import ToolCall
    from decapybara.engine.json_schema import CLOSE_TAG, OPEN_TAG

    dfa = compile_calls(json.loads(tool_call_spec(XML_TOOLS, None, True, fmt="xml"))["tools"], "xml")
    syntax = _xml_syntax()

    def read(body: str) -> tuple[bool, list]:
        text = f"<tool_call>\n<function=edit>\n{body}</function>\n</tool_call>"  # tags only at the ends
        return (dfa.matches(OPEN_TAG + text[11:-12].encode() + CLOSE_TAG),
                parse_assistant_output(text, tools=syntax).tool_calls)

    short = ("<parameter=path>\nsrc/a.py</parameter>\n<parameter=line>\n3</parameter>\n<parameter=mode>\nw</parameter>"
             '\n<parameter=force>\nTrue</parameter>\n<parameter=options>\n{"depth": 2}</parameter>\n')
    assert read(short) == (True, [ToolCall("edit", {"path": "src/a.py", "line": 3, "mode": "w", "force": True,
                                                    "options": {"depth": 2}})])
    rng = random.Random(0)
    pieces = ["</parameter>", "</parameter>\n", "\n", " ", "<parameter=x>", "<parameter=", "</function>", "</tool_call>",
              "a", "<", "\r", "\t", "\r\n", "</parameter> ", "</parameter>\t", "</parameter>\r\n", "</parameter></function>",
              "</parameter><parameter=x>", "</parameter> \t</tool_call>"]
    for _ in range(600):
        value = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 6)))
        for written in (value + "\n", value + "\r\n", value):
            ok, calls = read(f"<parameter=path>\n{written}</parameter>\n<parameter=force>\ntrue\n</parameter>\n")
            text = written[:-2] if written.endswith("\r\n") else written.removesuffix("\n")
            assert ok == (calls == [ToolCall("edit", {"path": text, "force": True})]), written
    tools = [{"type": "function", "function": {"name": "edit", "parameters": {
        "type": "object", "properties": {"path": {"enum": ["a\n", "b"]}}, "required": ["path"]}}}]
    listed = compile_calls(json.loads(tool_call_spec(tools, None, True, fmt="xml"))["tools"], "xml")
    for written, ok in (("a\n\n", True), ("a\n", False), ("b\n", True), ("b", True)):
        call = f"<tool_call>\n<function=edit>\n<parameter=path>\n{written}</parameter>\n</function>\n</tool_call>"
        assert listed.matches(tags_as_bytes(call.encode())) == ok, written


def test_the_xml_automaton_reads_a_json_value_as_the_parser_does():
    """A value written as JSON (an array of strings, a free object) may hold ``</parameter>`` in a string, and the
    spaces and tag after it that would end the value there (``</parameter> </function>``): the automaton reads
    such a value exactly where the parser reads it back whole, for random strings of the markup's pieces (raw
    tabs and line breaks, which JSON strings do not hold, among them)."""
    import random

    from decapybara.api.common import call_syntax
    from decapybara.chat import ToolCall
    from decapybara.engine.json_schema import CLOSE_TAG, OPEN_TAG

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string"}}, "cfg": {"type": "object"}}}}}]
    dfa, syntax = compile_calls(json.loads(tool_call_spec(tools, None, True, fmt="xml"))["tools"], "xml"), \
        call_syntax("xml", tools)
    rng = random.Random(1)
    pieces = ["</parameter>", " ", "\t", "\n", "<parameter=x>", "<parameter=", "</function>", "</tool_call>", "a", "<",
              "</parameter> ", "</parameter></function>", "</parameter>  <parameter=x>", "\\n"]
    seen = set()
    for i in range(400):
        s = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 5)))
        name, written = ("tags", f'["{s}"]') if i % 2 else ("cfg", f'{{"k": "{s}"}}')
        text = f"<tool_call>\n<function=f>\n<parameter={name}>\n{written}\n</parameter>\n</function>\n</tool_call>"
        ok = dfa.matches(OPEN_TAG + text[11:-12].encode() + CLOSE_TAG)
        calls = parse_assistant_output(text, tools=syntax).tool_calls
        # read back whole: its JSON value (none where a raw tab or line break is in the string)
        read = "\t" not in s and "\n" not in s and calls == [ToolCall("f", {name: json.loads(written)})]
        assert ok == read, written
        seen.add(ok)
    assert seen == {True, False}
    for tail, ok in (("</parameter> x", True), ("</parameter> </function>", False), ("</parameter></tool_call>", False),
                     ("</parameter>   <parameter=x>", False), ("<parameter=x>", True)):
        text = f'<tool_call>\n<function=f>\n<parameter=tags>\n["a{tail}"]\n</parameter>\n</function>\n</tool_call>'
        assert dfa.matches(tags_as_bytes(text.encode())) == ok, tail


def test_an_xml_value_of_a_string_or_a_bounded_number_is_a_number_only_within_its_bounds():
    """A parameter that takes a string or a number (written as raw text, any text the automaton reads) is read as
    a number only where its schema accepts that number (within its bounds, an integer where it asks for one); other
    texts, ``-5`` beside ``"minimum": 0`` among them, are the string the model wrote: every call the automaton
    reads parses back to arguments the schema accepts."""
    from decapybara.api.common import call_syntax
    from decapybara.engine.json_schema import compile_tool_calls

    schema = {"type": "object", "properties": {"x": {"type": ["string", "number"], "minimum": 0},
                                               "i": {"anyOf": [{"type": "string"}, {"type": "integer", "maximum": 9}]}},
              "required": ["x", "i"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    dfa, syntax = compile_tool_calls(tool_call_spec(tools, None, True, fmt="xml")), call_syntax("xml", tools)
    for x, i, args in (("-5", "5.5", {"x": "-5", "i": "5.5"}), ("2.5", "7", {"x": 2.5, "i": 7}),
                       ("0", "-3", {"x": 0, "i": -3}), ("-0.5", "10", {"x": "-0.5", "i": "10"}),
                       ("abc", "true", {"x": "abc", "i": "true"})):
        text = _xml("f", ("x", x), ("i", i))
        assert dfa.matches(tags_as_bytes(text.encode()))
        (call,) = parse_assistant_output(text, tools=syntax).tool_calls
        assert call.arguments == args
        jsonschema.validate(call.arguments, schema)


def test_an_xml_value_of_a_string_or_a_free_object_nested_deep_is_the_object():
    """A parameter that takes a string or a free object (or array) is read as its JSON where that nests deeper than
    the automaton reads a free value (`FREE_DEPTH`: a limit of the automaton, not of the schema), not as the
    string of it; within that depth a value its schema refuses (a required key left out) is still the string."""
    from decapybara.api.common import call_syntax
    from decapybara.engine.json_schema import FREE_DEPTH

    schema = {"type": "object", "properties": {
        "body": {"anyOf": [{"type": "string"}, {"type": "object"}]}, "xs": {"type": ["string", "array"]},
        "cfg": {"anyOf": [{"type": "string"}, {"type": "object", "required": ["a"]}]}}}
    syntax = call_syntax("xml", [{"type": "function", "function": {"name": "f", "parameters": schema}}])
    deep: object = 1
    for _ in range(FREE_DEPTH + 1):  # a level past the automaton's
        deep = {"k": deep}
    for key, value in (("body", deep), ("xs", [deep]), ("cfg", {"a": deep})):
        (call,) = parse_assistant_output(_xml("f", (key, json.dumps(value))), tools=syntax).tool_calls
        assert call.arguments == {key: value}
        jsonschema.validate(call.arguments, schema)
    (call,) = parse_assistant_output(_xml("f", ("cfg", '{"b": 1}')), tools=syntax).tool_calls
    assert call.arguments == {"cfg": '{"b": 1}'}


def test_the_template_writes_its_calls_as_the_automaton_reads_them():
    """A past call rendered by an XML template (Qwen3.6's: values that are no strings as JSON) is a call the
    automaton reads, whole."""
    from decapybara.chat import render_chat
    from decapybara.engine.json_schema import compile_tool_calls
    from decapybara.testing import XML_CHAT_TEMPLATE

    args = {"path": "a.py\nb", "line": 7, "mode": 3, "force": False, "options": {"depth": 1}, "note": None}
    msgs = [{"role": "user", "content": "u"},
            {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "edit", "arguments": args}}]}]
    text = render_chat(msgs, XML_TOOLS, add_generation_prompt=False, template=XML_CHAT_TEMPLATE)
    call = text[text.rfind("<tool_call>"):text.rfind("</tool_call>") + len("</tool_call>")]
    assert compile_tool_calls(tool_call_spec(XML_TOOLS, None, True, fmt="xml")).matches(tags_as_bytes(call.encode()))
    assert parse_assistant_output(call, tools=_xml_syntax()).tool_calls[0].arguments == args


def test_a_template_writing_values_with_string_writes_calls_the_automaton_reads():
    """Qwen3.5 / Qwen3-Coder templates write a value that is no mapping or list with ``|string`` (a boolean
    ``True`` / ``False``, null ``None``): such a past call, which the model learns to write, is one the automaton
    reads (a boolean or null parameter's JSON literal in either spelling, only those its schema accepts) and
    parses back to its arguments, so the model's call renders back as it wrote it."""
    from decapybara.api.common import call_syntax
    from decapybara.chat import render_chat
    from decapybara.engine.json_schema import compile_tool_calls
    from decapybara.testing import XML_CHAT_TEMPLATE

    template = XML_CHAT_TEMPLATE.replace(
        "args_value if args_value is string else args_value | tojson",
        "args_value | tojson if args_value is mapping or (args_value is sequence and args_value is not string) "
        "else args_value | string")
    assert template != XML_CHAT_TEMPLATE
    schema = {"type": "object", "properties": {
        "force": {"type": "boolean"}, "limit": {"type": ["integer", "null"]}, "pick": {"enum": [True, None, 2]},
        "on": {"anyOf": [{"const": True}, {"type": "integer"}]}, "tags": {"type": "array"}},
        "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "opt", "parameters": schema}}]
    spec = tool_call_spec(tools, None, True, fmt="xml")
    syntax = call_syntax("xml", tools)
    for args in ({"force": True, "limit": None, "pick": None, "on": True, "tags": [True, None]},
                 {"force": False, "limit": 3, "pick": True, "on": 5}):
        msgs = [{"role": "user", "content": "u"},
                {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "opt", "arguments": args}}]}]
        text = render_chat(msgs, tools, add_generation_prompt=False, template=template)
        call = text[text.rfind("<tool_call>"):text.rfind("</tool_call>") + len("</tool_call>")]
        assert any(f"\n{word}\n" in call for word in ("True", "False", "None")), call  # the |string spelling
        assert compile_tool_calls(spec).matches(tags_as_bytes(call.encode())), call
        assert parse_assistant_output(call, tools=syntax).tool_calls[0].arguments == args
    for name, value in (("on", "False"), ("force", "None"), ("limit", "True"), ("pick", "False")):  # not accepted
        bad = _xml("opt", (name, value))
        assert not compile_tool_calls(spec).matches(tags_as_bytes(bad.encode())), bad


def _toward_the_end(rng, tok, vocab, dfa, allowed: np.ndarray, state: int, dist: np.ndarray) -> int:
    """An allowed token: half the time the one of a sample that leaves the one automaton (`dfa`, at `state`)
    nearest an accepting state (so that values end and calls close), else any."""
    choices = np.flatnonzero(allowed)
    if rng.random() < 0.5:
        return int(rng.choice(choices))
    best, best_d = int(choices[0]), 1 << 30
    for t in rng.choice(choices, min(64, len(choices)), replace=False).tolist():
        if t in tok.eos_token_ids:
            return t
        s, w = state, 0
        for b in vocab.markup_bytes.get(t, tok.token_bytes(t)):
            s, w = dfa.step(s, w, b)
        if s >= 0 and dist[s] < best_d:
            best, best_d = t, int(dist[s])
    return best


def _distances(dfa) -> np.ndarray:
    """Bytes from each state to an accepting one."""
    dist = np.where(dfa.accept, 0, 1 << 30)
    while True:
        nxt = np.minimum(dist, np.where(dfa.table >= 0, dist[np.maximum(dfa.table, 0)] + 1, 1 << 30).min(axis=1))
        if np.array_equal(nxt, dist):
            return dist
        dist = nxt


@pytest.mark.parametrize("split", [False, True])
def test_forced_xml_calls_by_groups_allow_what_the_sets_one_automaton_allows(split, monkeypatch):
    """Forced XML calls run as `ToolCallReply` over `ToolSetVocab` (the whole set a group, or one tool a group):
    along random walks the same tokens allowed at every step as the reply's one automaton, and the calls written
    parse, valid against their tools' schemas."""
    from decapybara.engine import tool_calls
    from decapybara.engine.json_schema import SchemaState, SchemaVocab, compile_tool_calls

    if split:
        monkeypatch.setattr(tool_calls, "call_groups",
                            lambda tools, fmt="json": [([t], compile_calls([t], fmt)) for t in tools])
    tok = demo().tokenizer
    vocab = _vocab(tok)
    tools_ = [t for t in XML_TOOLS if t["function"]["name"] != "odd"]
    spec = tool_call_spec(tools_, None, True, fmt="xml")
    tools = ToolSetVocab(vocab, spec)
    assert len(tools.groups) == (len(tools_) if split else 1)
    whole = compile_tool_calls(spec)
    dist = _distances(whole)
    rng = np.random.default_rng(7 + split)
    names = []
    for _ in range(4):
        one = SchemaState(SchemaVocab(vocab, whole, markup=True))
        reply = ToolCallReply(tools, tok.special_ids.tool_call, lazy=False)
        out = []
        for _ in range(300):
            a = reply.allowed()
            assert np.array_equal(a, one.allowed())
            t = _toward_the_end(rng, tok, vocab, whole, a, one.state, dist)
            if t in tok.eos_token_ids:
                break
            out.append(t)
            for st in (one, reply):
                st.advance(tok.token_bytes(t), t)
            assert not reply.dead and not one.dead
        text = tok.decode(out, skip_special_tokens=False)
        got = parse_assistant_output(text[:text.rfind("</tool_call>") + len("</tool_call>")], tools=_xml_syntax())
        assert len(got.tool_calls) == reply.calls
        for call in got.tool_calls:
            jsonschema.validate(call.arguments, XML_SCHEMAS[call.name] or {"additionalProperties": False})
            names.append(call.name)
    assert len(names) >= 3


XML_SCRIPTS = {
    "good": "I will read it.\n\n" + _xml("read_file", ("path", "main.py"), ("line", "3")) + "\n"
            + _xml("run", ("command", "ls -l\nwc -l x")),
    "calls": _xml("read_file", ("path", "main.py"), ("line", "3")) + "\n" + _xml("run", ("command", "ls -l")),
    "bad-bound": "Running.\n\n" + _xml("run", ("command", "x"), ("timeout", "0")),
    "json-form": '<tool_call>\n{"name": "run", "arguments": {"command": "ls"}}\n</tool_call>',
}


def _xml_reply(script: str, lazy: bool | None, parallel: bool = True, max_tokens: int = 120) -> tuple[str, str]:
    """The demo model's reply under an XML template, scripted; `lazy` None: unconstrained, True: tool_choice auto,
    False: forced."""
    import copy

    from decapybara.testing import XML_CHAT_TEMPLATE

    m = demo()
    tok = copy.copy(m.tokenizer)
    tok.chat_template = XML_CHAT_TEMPLATE
    assert tok.tool_format == "xml"
    spec = tool_call_spec(TOOLS, None, parallel, fmt="xml")
    params = SamplingParams(temperature=0, max_tokens=max_tokens, tool_calls=None if lazy is None else spec,
                            lazy_tool_calls=bool(lazy))
    engine = Engine(m.model, EngineConfig(loop_guard="off"), tokenizer=tok,
                    logits_processor=Script(tok, XML_SCRIPTS[script]))
    outs, ends = run(engine, [Request(_prompt(tok), params, "r")])
    return tok.decode(outs["r"], skip_special_tokens=False).replace("<|im_end|>", ""), ends["r"]


def _xml_valid_calls(text: str) -> list:
    from decapybara.api.common import call_syntax

    out = parse_assistant_output(text, tools=call_syntax("xml", TOOLS))
    for call in out.tool_calls:
        jsonschema.validate(call.arguments, SCHEMAS[call.name])
    return out.tool_calls


def test_xml_calls_the_model_writes_are_its_own_and_parse():
    """Under an XML template, valid XML calls are token for token the unconstrained reply, lazy (auto: text and
    calls) or forced (calls only), and parse into their tools' arguments; parallel off ends the reply at the first
    call."""
    free, end_free = _xml_reply("good", None)
    assert _xml_reply("good", True) == (free, end_free)
    assert free.startswith(XML_SCRIPTS["good"])
    forced, _ = _xml_reply("calls", False)
    assert forced.startswith(XML_SCRIPTS["calls"])  # (then the model's own: more calls, or the end)
    assert [c.name for c in _xml_valid_calls(forced)][:2] == ["read_file", "run"]
    calls = _xml_valid_calls(free)
    assert [(c.name, c.arguments) for c in calls] == [("read_file", {"path": "main.py", "line": 3}),
                                                       ("run", {"command": "ls -l\nwc -l x"})]
    one, end = _xml_reply("good", True, parallel=False)
    assert one == "I will read it.\n\n" + _xml("read_file", ("path", "main.py"), ("line", "3")) and end == "stop"


@pytest.mark.parametrize("script, lazy", [("bad-bound", True), ("bad-bound", False), ("json-form", False)])
def test_an_xml_call_the_schemas_refuse_is_held_to_them(script, lazy):
    """A timeout below its minimum, or (forced) a call in the JSON form, is refused as it is written: what is
    written of the call stays a prefix of a valid XML call, and a call that closes parses, valid."""
    text, end = _xml_reply(script, lazy, max_tokens=200)
    free, _ = _xml_reply(script, None, max_tokens=200)
    assert text != free
    dfas = [compile_calls([{"name": t["function"]["name"], "parameters": t["function"]["parameters"]}], "xml")
            for t in TOOLS]
    call = text[text.index("<tool_call>"):]
    call = call[:call.index("</tool_call>") + len("</tool_call>")] if "</tool_call>" in call else call
    alive = 0
    for dfa in dfas:
        s, w = dfa.start, 0
        for b in tags_as_bytes(call.encode()):
            s, w = dfa.step(s, w, b)
        alive += s >= 0
    assert alive, text
    if "</tool_call>" in text:
        assert _xml_valid_calls(text), text
    assert "<parameter=timeout>\n0\n" not in text and '{"name"' not in text
    assert end in ("stop", "length")
