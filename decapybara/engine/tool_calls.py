"""A reply's tool calls held to the tools' schemas, one automaton a tool (`json_schema.compile_call`), so that a
tool set of any size is enforced and a tool's automaton is built once, whatever set it is offered in.

`ToolCallReply` is a reply's state (the interface of `json_schema.SchemaState`), in one of two forms:
- forced (tool_choice required or named): calls only: at most `TOP_WS` whitespace bytes, then a call, and where
  parallel calls are allowed, after each call a newline and another call, or the end; `think` (the model's
  `<think>`) allowed first;
- lazy (tool_choice auto, `SamplingParams.lazy_tool_calls`): the model's own text (`free`: neither masked nor read)
  until its `<tool_call>` token; from there to the call's close, one call; then free again where parallel calls
  are allowed, else the reply is whole.
While a call's name is still being read, several tools' automata are alive (`CallState`): a token is allowed where
one of them reads it whole, so the mask is the union of theirs (`ToolSetVocab.allowed`, kept by their states).
Once the name tells them apart, one automaton reads on. The tags are single tokens read as reserved bytes
(`OPEN_TAG`, `CLOSE_TAG`), so no token crosses a call's ends; what lies between calls in the forced form is an
automaton of its own (`_glue`).
"""

from __future__ import annotations

import json
from functools import cache

import numpy as np

from decapybara.engine.json_mode import TOP_WS, JsonVocab, MaskCache
from decapybara.engine.json_schema import (
    OPEN_TAG,
    WS,
    SchemaDfa,
    SchemaError,
    SchemaState,
    SchemaVocab,
    _build,
    _Nfa,
    compile_call,
    schema_text,
)


@cache
def _glue(first: bool) -> SchemaDfa:
    """What leads to a forced reply's call: before the first (`first`), at most `TOP_WS` whitespace bytes and the
    opening tag; after a call, the end (an accepting start: the end-of-sequence allowed), or a newline and the tag."""
    n = _Nfa()
    if first:
        frag = n.seq(n.repeat(lambda: n.cls(WS), 0, TOP_WS), n.lit(OPEN_TAG))
    else:
        frag = n.opt(n.lit(b"\n" + OPEN_TAG))
    return _build(n, *frag)


class ToolSetVocab:
    """A tool set (`json_schema.tool_call_spec`'s text, without an answer) read over a vocabulary: each tool's call
    automaton (`compile_call`) and the forced form's glue as `SchemaVocab`s on one mask cache (`cache`, which an
    engine shares between its tool sets: a tool's masks are kept by the tool's text, found again in any set that
    offers it), and the union masks of several tools' states, kept by those states. Raises SchemaError where the
    spec offers no tool."""

    CACHE = 1024  # masks kept, every tool's and the glue's together (a cache of the set's own)
    UNIONS = 256  # union masks kept

    def __init__(self, vocab: JsonVocab, spec: str, cache: MaskCache | None = None) -> None:
        obj = json.loads(spec)
        if obj.get("answer") is not None:
            raise SchemaError("a tool set with an answer schema is one automaton (compile_tool_calls)")
        self.parallel = bool(obj.get("parallel", True))
        cache_ = cache if cache is not None else MaskCache(vocab.vocab_size, self.CACHE)
        self.tools = [SchemaVocab(vocab, compile_call(t), markup=True, cache=cache_, tag="call:" + schema_text(t))
                      for t in obj["tools"]]
        if not self.tools:
            raise SchemaError("no tool to call")
        self.lead, self.sep = (SchemaVocab(vocab, _glue(first), markup=True, cache=cache_, tag=tag)
                               for first, tag in ((True, "lead"), (False, "sep")))
        self.unions = MaskCache(vocab.vocab_size, self.UNIONS)

    def allowed(self, alive: tuple[tuple[int, int, int], ...]) -> np.ndarray:
        """The tokens one of the `alive` (tool, state, whitespace run) automata reads whole: bool [vocab_size]."""
        if len(alive) == 1:
            i, s, w = alive[0]
            return self.tools[i].allowed(s, w)
        got = self.unions.get(alive)
        if got is None:
            got = np.zeros(self.unions.vocab_size, bool)
            for i, s, w in alive:
                got |= self.tools[i].allowed(s, w)
            self.unions.put(alive, got)
        return got


class CallState:
    """One call being written: the (tool, state, whitespace run) of every tool whose call automaton has read it
    all so far. Starts before the opening tag."""

    def __init__(self, tools: ToolSetVocab) -> None:
        self.tools = tools
        self.alive = tuple((i, t.dfa.start, 0) for i, t in enumerate(tools.tools))

    def advance(self, data: bytes) -> None:
        alive = []
        for i, s, w in self.alive:
            dfa = self.tools.tools[i].dfa
            for b in data:
                s, w = dfa.step(s, w, b)
                if s < 0:
                    break
            if s >= 0:
                alive.append((i, s, w))
        self.alive = tuple(alive)

    @property
    def done(self) -> bool:
        """The call closed (every automaton still alive is past its closing tag)."""
        return bool(self.alive) and all(bool(self.tools.tools[i].dfa.terminal[s]) for i, s, _ in self.alive)

    @property
    def dead(self) -> bool:
        return not self.alive

    @property
    def tool(self) -> int | None:
        """The tool the call is of, once its name tells (None before)."""
        return self.alive[0][0] if len({i for i, _, _ in self.alive}) == 1 else None

    def allowed(self) -> np.ndarray:
        return self.tools.allowed(self.alive)


class ToolCallReply:
    """A reply's tool calls (module docstring): `advance` with each answer token (its bytes and id), `allowed` for
    the next one where not `free`; `done` where a call closed and no other may follow; `dead` where a token left the
    automata (one the constraint did not choose, e.g. the LoopGuard's). `trigger`: the `<tool_call>` token's id."""

    def __init__(self, tools: ToolSetVocab, trigger: int, lazy: bool, think: int | None = None) -> None:
        self.tools, self.trigger, self.lazy = tools, trigger, lazy
        self.think = None if lazy else think  # `<think>` allowed first (forced form; the engine clears it)
        self.started = False  # a byte of the answer read
        self.calls = 0  # calls closed
        self.call: CallState | None = None  # the open call
        self.glue: SchemaState | None = None if lazy else SchemaState(tools.lead)  # forced: what leads to a call

    @property
    def free(self) -> bool:
        """The model's own text (lazy, no call open): nothing to mask or read."""
        return self.lazy and self.call is None

    @property
    def done(self) -> bool:
        return self.calls > 0 and not self.tools.parallel and self.call is None

    @property
    def dead(self) -> bool:
        return (self.call is not None and self.call.dead) or (self.glue is not None and self.glue.dead)

    def advance(self, token_bytes: bytes, token: int = -1) -> None:
        self.started |= bool(token_bytes)
        if self.done or self.dead:
            return
        if self.call is None:
            if not self.lazy:
                self.glue.advance(token_bytes, token)
            if token != self.trigger or self.dead:
                return
            self.glue, self.call = None, CallState(self.tools)
        self.call.advance(self.tools.tools[0].vocab.markup_bytes.get(token, token_bytes))
        if self.call.done:
            self.call, self.calls = None, self.calls + 1
            if not self.lazy and self.tools.parallel:
                self.glue = SchemaState(self.tools.sep)

    def allowed(self) -> np.ndarray:
        if self.call is not None:
            return self.call.allowed()
        if self.glue is None:
            raise RuntimeError("no call is open: the reply is free")
        mask = self.glue.allowed()
        if self.think is not None and not self.started and self.think < len(mask):
            mask[self.think] = True
        return mask

