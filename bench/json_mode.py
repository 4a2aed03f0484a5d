"""What JSON mode, JSON schemas and tool calls cost: the demo model's engine steps with every agent in JSON mode,
under a schema, or offered tools under tool_choice auto (writing free text; or opening calls, which a bias on
`<tool_call>` makes it do at once and after each close) against the same agents without any (ms a step), and at a
Qwen-sized vocabulary (151,644 synthetic byte-level tokens) a state's mask computed afresh, found again, a token's
advance, and a step's masks set on the logits; for schemas and a coding agent's tool set, their compile time and
automaton size, their masks afresh along an answer (a first request's cost) and found again.

    python3 bench/json_mode.py            # CPU (numpy backend)
    BENCH_DEVICE=cuda python3 bench/json_mode.py
"""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import numpy as np

from decapybara.config import DEMO_MODEL, EngineConfig
from decapybara.engine.engine import Engine
from decapybara.engine.json_mode import JsonState, JsonVocab
from decapybara.engine.json_schema import (
    CLOSE_TAG,
    OPEN_TAG,
    SchemaState,
    SchemaVocab,
    compile_schema,
    forget,
    schema_text,
    tags_as_bytes,
    tool_call_spec,
)
from decapybara.engine.sampling import SamplingParams
from decapybara.engine.sequence import Request
from decapybara.engine.tool_calls import ToolCallReply, ToolSetVocab
from decapybara.model.load import load_model

PROMPTS = ["Describe is_even(n) as a JSON object.", "Give the fields of a User record as JSON.",
           "List three HTTP methods in a JSON object.", "A JSON object with a name and an age, please."]


STEP_SCHEMA = schema_text({"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}, "age": {
    "type": "integer", "minimum": 0, "maximum": 150}, "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age"], "additionalProperties": False})


def _fn(name: str, props: dict, required: list) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": props,
                                                                         "required": required}}}


_S, _I, _B = {"type": "string"}, {"type": "integer"}, {"type": "boolean"}
CODING_TOOLS = [  # a coding agent's twelve tools
    _fn("read_file", {"path": _S, "offset": _I, "limit": _I}, ["path"]),
    _fn("write_file", {"path": _S, "content": _S}, ["path", "content"]),
    _fn("edit_file", {"path": _S, "old_string": _S, "new_string": _S, "replace_all": _B},
        ["path", "old_string", "new_string"]),
    _fn("bash", {"command": _S, "timeout": {"type": "integer", "minimum": 1, "maximum": 600000}, "description": _S,
                 "run_in_background": _B}, ["command"]),
    _fn("grep", {"pattern": _S, "path": _S, "glob": _S, "output_mode": {"enum": ["content", "files_with_matches",
                                                                                 "count"]},
                 "-i": _B, "-n": _B, "head_limit": _I, "multiline": _B}, ["pattern"]),
    _fn("glob", {"pattern": _S, "path": _S}, ["pattern"]),
    _fn("list_dir", {"path": _S, "ignore": {"type": "array", "items": _S}}, ["path"]),
    _fn("web_fetch", {"url": {"type": "string", "format": "uri"}, "prompt": _S}, ["url", "prompt"]),
    _fn("todo_write", {"todos": {"type": "array", "items": {"type": "object", "properties": {
        "content": _S, "status": {"enum": ["pending", "in_progress", "completed"]}, "id": _S},
        "required": ["content", "status", "id"]}}}, ["todos"]),
    _fn("multi_edit", {"path": _S, "edits": {"type": "array", "items": {"type": "object", "properties": {
        "old_string": _S, "new_string": _S, "replace_all": _B}, "required": ["old_string", "new_string"]},
        "minItems": 1}}, ["path", "edits"]),
    _fn("task", {"description": _S, "prompt": _S, "subagent_type": _S}, ["description", "prompt", "subagent_type"]),
    _fn("notebook_edit", {"notebook_path": _S, "cell_id": _S, "new_source": _S, "cell_type": {"enum": [
        "code", "markdown"]}, "edit_mode": {"enum": ["replace", "insert", "delete"]}}, ["notebook_path", "new_source"]),
]
CALL_TEXT = ('<tool_call>\n{"name": "edit_file", "arguments": {"path": "src/app.py", "old_string": "return x", '
             '"new_string": "return x + 1"}}\n</tool_call>')


def engine_steps(model, tok, agents: int, mode: str, tokens: int = 48) -> tuple[float, int]:
    """(ms a step, steps) of `agents` requests decoding (prefill off the clock) in `mode`: plain, json (JSON mode),
    schema (`STEP_SCHEMA`), tools (`CODING_TOOLS` offered under tool_choice auto: the demo model writes text, free)
    or calls (the same, a bias on `<tool_call>` opening a call at once and after each close); constrained answers
    end where their value closes, so the steps hold fewer agents towards the end: a rough measure, not a
    like-for-like one."""
    engine = Engine(model, EngineConfig(loop_guard="off", max_slots=max(agents, 1)), tokenizer=tok)
    lazy = mode in ("tools", "calls")
    spec = tool_call_spec(CODING_TOOLS, None, True) if lazy else None
    for i in range(agents):
        prompt = tok.apply_chat([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], enable_thinking=False)
        params = SamplingParams(temperature=0.8, seed=i, max_tokens=tokens, json_object=mode == "json",
                                json_schema=STEP_SCHEMA if mode == "schema" else None,
                                ignore_eos=mode in ("plain", "tools", "calls"), tool_calls=spec, lazy_tool_calls=lazy,
                                logit_bias={tok.special_ids.tool_call: 30.0} if mode == "calls" else {})
        engine.add_request(Request(tuple(prompt), params, f"a{i}"))
    while any(s.num_computed < s.num_prompt for s in engine.seqs.values()):  # prefill off the clock
        engine.step()
    steps, t0 = 0, time.perf_counter()
    while engine.has_work():
        engine.step()
        steps += 1
    return (time.perf_counter() - t0) * 1e3 / max(steps, 1), steps


def masking_ms(vocab: JsonVocab, rows: int, repeats: int = 20) -> float:
    """ms of `Engine._json_masked` for `rows` JSON rows whose states' masks are cached (host logits)."""
    states = []
    for i in range(rows):
        st = JsonState(vocab)
        st.advance([b'{"k": "ab', b'{"k": [1, ', b'{"k": '][i % 3])
        st.allowed()
        states.append(SimpleNamespace(json=st, in_thinking=False))
    this = SimpleNamespace(model=SimpleNamespace(cfg=SimpleNamespace(vocab_size=vocab.vocab_size),
                                                 backend=SimpleNamespace(xp=np)), eos_token_ids=tuple(vocab.eos))
    this._json_active = lambda s: Engine._json_active(this, s)
    logits = np.random.default_rng(0).standard_normal((rows, vocab.vocab_size)).astype(np.float32)
    t0 = time.perf_counter()
    for _ in range(repeats):
        Engine._json_masked(this, logits, states, np)
    return (time.perf_counter() - t0) * 1e3 / repeats


def synthetic_vocab(n: int = 151_641) -> JsonVocab:
    rng = np.random.default_rng(0)
    alpha = np.frombuffer(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ", np.uint8)
    punct = np.frombuffer(b'{}[]":,.-_()/\\=+*#<>;!?\'` \n', np.uint8)
    digits = np.frombuffer(b"0123456789", np.uint8)
    toks = [bytes([b]) for b in range(256)]
    while len(toks) < n:
        r, k = rng.random(), int(rng.integers(2, 12))
        if r < 0.6:
            toks.append((b" " if rng.random() < 0.5 else b"") + rng.choice(alpha, k).tobytes())
        elif r < 0.7:
            toks.append(rng.choice(digits, k).tobytes())
        elif r < 0.85:
            toks.append(rng.choice(punct, k).tobytes())
        else:
            toks.append(rng.integers(0x80, 0x100, k).astype(np.uint8).tobytes())

    class Tok:
        eos_token_ids = (n,)
        added_ids = frozenset([n, n + 1, n + 2])

        @staticmethod
        def _byte_table():
            return toks + [b"<|im_end|>", b"<tool_call>", b"</tool_call>"]

    return JsonVocab(Tok(), n + 3, markup={n + 1: OPEN_TAG, n + 2: CLOSE_TAG})


def main() -> None:
    device = os.environ.get("BENCH_DEVICE", "cpu")
    backend = None
    if device == "cuda":
        from decapybara.backend.cupy_backend import CupyBackend

        backend = CupyBackend("bf16")
    loaded = load_model(str(DEMO_MODEL), backend) if backend is not None else load_model(str(DEMO_MODEL))
    print(f"== demo model engine steps ({device}) ==")
    print("agents  plain ms/step  json ms/step  ratio   json steps  schema ms/step  ratio   schema steps  "
          "tools ms/step  ratio  calls ms/step  ratio")
    for agents in (1, 4, 12):
        plain, _ = engine_steps(loaded.model, loaded.tokenizer, agents, "plain")
        js, steps = engine_steps(loaded.model, loaded.tokenizer, agents, "json")
        sc, sc_steps = engine_steps(loaded.model, loaded.tokenizer, agents, "schema")
        tl, _ = engine_steps(loaded.model, loaded.tokenizer, agents, "tools")
        ca, _ = engine_steps(loaded.model, loaded.tokenizer, agents, "calls")
        print(f"{agents:6d}  {plain:13.2f}  {js:12.2f}  {js / plain:5.2f}x  {steps:10d}  {sc:14.2f}  "
              f"{sc / plain:5.2f}x  {sc_steps:12d}  {tl:13.2f}  {tl / plain:4.2f}x  {ca:13.2f}  {ca / plain:4.2f}x")
    t0 = time.perf_counter()
    vocab = synthetic_vocab()
    print(f"\n== 151,644-token vocabulary (tables {time.perf_counter() - t0:.2f} s) ==")
    print("state                          allowed   afresh ms   found again us")
    for text in (b"", b"{", b'{"', b'{"key":', b'{"key": 12', b'{"key": [', b'{"key": "abc'):
        st = JsonState(vocab)
        st.advance(text)
        t0 = time.perf_counter()
        n = int(st.allowed().sum())
        t1 = time.perf_counter()
        st.allowed()
        t2 = time.perf_counter()
        print(f"{text!r:30} {n:8d}   {1e3 * (t1 - t0):9.1f}   {1e6 * (t2 - t1):14.1f}")
    st = JsonState(vocab)
    st.advance(b'{"k": [')
    t0 = time.perf_counter()
    for _ in range(2000):
        st.advance(b" 12,")
    print(f"a 4-byte token's advance (steps seen before): {1e6 * (time.perf_counter() - t0) / 2000:.1f} us")
    print("JSON rows  masks set on host logits, ms a step")
    for rows in (1, 12):
        print(f"{rows:9d}  {masking_ms(vocab, rows):.2f}")
    schema_costs(vocab)


SCHEMAS = {
    "tool args (3 fields)": ({"type": "object", "properties": {"path": {"type": "string"}, "line": {
        "type": "integer", "minimum": 1}, "mode": {"enum": ["read", "write"]}}, "required": ["path", "line", "mode"],
        "additionalProperties": False}, {"path": "src/main.py", "line": 42, "mode": "read"}),
    "order (pydantic, $defs)": (None, None),
    "object, members free": ({"type": "object"}, {"a": [1, {"b": "x"}], "c": None}),
    "any value": ({}, {"a": [1, 2.5, "s"]}),
}


def order_schema():
    from typing import Literal

    from pydantic import BaseModel, Field

    class Line(BaseModel):
        sku: str = Field(min_length=3, max_length=16)
        count: int = Field(ge=0, le=1000)
        cost: float = Field(ge=0)

    class Order(BaseModel):
        id: int
        lines: list[Line] = Field(max_length=8)
        note: str | None = None
        kind: Literal["a", "b"]
        ratio: float = Field(ge=0, le=1)

    doc = {"id": 7, "lines": [{"sku": "nut-3", "count": 3, "cost": 0.25}], "note": None, "kind": "a", "ratio": 0.5}
    return Order.model_json_schema(), doc


def schema_costs(vocab: JsonVocab) -> None:
    """Each schema's automaton size and compile time, and its masks along an answer afresh and found again; the
    last row a call of `CODING_TOOLS` opened under tool_choice auto (`ToolCallReply`, lazy: the twelve tools' one
    call automaton)."""
    import json

    print("\n== JSON schemas at the 151,644-token vocabulary ==")
    print("schema                     states  compile ms  answer bytes  masks afresh ms (max)  found again ms")
    for name, (schema, doc) in [*SCHEMAS.items(), ("a call of 12 coding tools", (CODING_TOOLS, CALL_TEXT))]:
        for prefix in ("calls:", "args:"):  # the tools compiled afresh
            forget(prefix)
        t0 = time.perf_counter()
        if schema is CODING_TOOLS:
            tools = ToolSetVocab(vocab, tool_call_spec(CODING_TOOLS, None, True))
            states = sum(g.dfa.num_states for g in tools.groups)
            data = tags_as_bytes(doc.encode())
            tag = int(vocab.markup[0])  # the synthetic vocabulary's `<tool_call>`

            def start(tools=tools, tag=tag, data=data):
                st = ToolCallReply(tools, tag, lazy=True)
                st.advance(data[:1], tag)
                return st, data[1:]
        else:
            if schema is None:
                schema, doc = order_schema()
            masks = SchemaVocab(vocab, compile_schema(schema_text(schema)))
            states = masks.dfa.num_states
            data = json.dumps(doc).encode()

            def start(masks=masks, data=data):
                return SchemaState(masks), data
        compile_ms = (time.perf_counter() - t0) * 1e3
        costs = []
        for rounds in range(2):  # afresh, then found again
            st, rest = start()
            t_all = 0.0
            for b in rest:
                t0 = time.perf_counter()
                st.allowed()
                dt = time.perf_counter() - t0
                t_all += dt
                if rounds == 0:
                    costs.append(dt)
                st.advance(bytes([b]))
            assert st.done or (schema is CODING_TOOLS and st.free)
            if rounds == 0:
                fresh = t_all
            else:
                again = t_all
        print(f"{name:26} {states:6d}  {compile_ms:10.1f}  {len(data):12d}  {fresh * 1e3:10.1f} "
              f"({max(costs) * 1e3:5.1f})  {again * 1e3:14.2f}")


if __name__ == "__main__":
    main()
