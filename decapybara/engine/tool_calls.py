"""A reply's tool calls held to the tools' schemas, on automata of groups of tools (`call_groups`: the whole set
where its call automaton fits `MAX_DFA` states, else halves, and so on), so that a tool set of any size is enforced.

`ToolCallReply` is a reply's state (the interface of `json_schema.SchemaState`), in one of three forms:
- forced (tool_choice required or named): calls only: at most `TOP_WS` whitespace bytes, then a call, and where
  parallel calls are allowed, after each call a newline and another call, or the end; `think` (the model's
  `<think>`) allowed first;
- forced with an answer (a JSON Schema's answer beside tools under tool_choice auto): such calls, or instead the
  answer; both automata read the reply side by side until one of them is left;
- lazy (tool_choice auto, `SamplingParams.lazy_tool_calls`): the model's own text (`free`: neither masked nor read)
  until its `<tool_call>` token; from there to the call's close, one call; then free again where parallel calls
  are allowed, else the reply is whole.
A call is read by every group's automaton at once while more than one still reads it (`CallState`: its name tells
them apart): a token is allowed where one of them reads it whole, so the mask is the union of theirs
(`ToolSetVocab.allowed`, kept by their states). The tags are single tokens read as reserved bytes (`OPEN_TAG`,
`CLOSE_TAG`), so no token crosses a call's ends; what lies between calls in the forced form is an automaton of its
own (`_glue`). The masks of a group's automaton are kept by its tools' text in a cache an engine shares between
its tool sets.
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any

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
    compile_calls,
    compile_schema,
    schema_text,
)


def call_groups(tools: list[dict[str, Any]]) -> list[tuple[list[dict[str, Any]], SchemaDfa]]:
    """`tools` in groups whose one-call automaton (`compile_calls`) fits `MAX_DFA` states: the whole set where it
    fits, else each half's groups (the automata cached, refusals too, so a set is split once). Raises SchemaError
    where a tool's call alone does not fit."""
    try:
        return [(tools, compile_calls(tools))]
    except SchemaError:
        if len(tools) == 1:
            raise
    half = len(tools) // 2
    return call_groups(tools[:half]) + call_groups(tools[half:])


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
    """A tool set (`json_schema.tool_call_spec`'s text) read over a vocabulary: its groups' call automata
    (`call_groups`), the forced form's glue and any answer schema's automaton as `SchemaVocab`s on one mask cache
    (`cache`, which an engine shares between its tool sets: a group's masks are kept by its tools' text, found
    again in any set made of the same group), and the union masks of several groups' states, kept by those states.
    Raises SchemaError where the spec offers no tool or cannot be built."""

    CACHE = 1024  # masks kept, every automaton's together (a cache of the set's own)
    UNIONS = 256  # union masks kept

    def __init__(self, vocab: JsonVocab, spec: str, cache: MaskCache | None = None) -> None:
        obj = json.loads(spec)
        if not isinstance(obj, dict) or not isinstance(obj.get("tools"), list) or not obj["tools"]:
            raise SchemaError("no tool to call")
        self.vocab = vocab
        self.parallel = bool(obj.get("parallel", True))
        cache_ = cache if cache is not None else MaskCache(vocab.vocab_size, self.CACHE)
        self.groups = [SchemaVocab(vocab, dfa, markup=True, cache=cache_, tag="calls:" + schema_text(tools))
                       for tools, dfa in call_groups(obj["tools"])]
        self.lead, self.sep = (SchemaVocab(vocab, _glue(first), markup=True, cache=cache_, tag=tag)
                               for first, tag in ((True, "lead"), (False, "sep")))
        answer = obj.get("answer")
        self.answer = (None if answer is None else
                       SchemaVocab(vocab, compile_schema(answer), cache=cache_, tag="answer:" + schema_text(answer)))
        self.unions = MaskCache(vocab.vocab_size, self.UNIONS)

    def allowed(self, alive: tuple[tuple[int, int, int], ...]) -> np.ndarray:
        """The tokens one of the `alive` (group, state, whitespace run) automata reads whole: bool [vocab_size]."""
        if len(alive) == 1:
            g, s, w = alive[0]
            return self.groups[g].allowed(s, w)
        got = self.unions.get(alive)
        if got is None:
            got = np.zeros(self.unions.vocab_size, bool)
            for g, s, w in alive:
                got |= self.groups[g].allowed(s, w)
            self.unions.put(alive, got)
        return got


class CallState:
    """One call being written: the (group, state, whitespace run) of every group whose call automaton has read
    it all so far. Starts before the opening tag."""

    def __init__(self, tools: ToolSetVocab) -> None:
        self.tools = tools
        self.alive = tuple((g, v.dfa.start, 0) for g, v in enumerate(tools.groups))

    def advance(self, data: bytes) -> None:
        alive = []
        for g, s, w in self.alive:
            dfa = self.tools.groups[g].dfa
            for b in data:
                s, w = dfa.step(s, w, b)
                if s < 0:
                    break
            if s >= 0:
                alive.append((g, s, w))
        self.alive = tuple(alive)

    @property
    def done(self) -> bool:
        """The call closed (every automaton still alive is past its closing tag)."""
        return bool(self.alive) and all(bool(self.tools.groups[g].dfa.terminal[s]) for g, s, _ in self.alive)

    @property
    def dead(self) -> bool:
        return not self.alive

    def allowed(self) -> np.ndarray:
        return self.tools.allowed(self.alive)


class ToolCallReply:
    """A reply's tool calls (module docstring): `advance` with each answer token (its bytes and id), `allowed` for
    the next one where not `free`; `done` where a call closed and no other may follow, or the answer is whole;
    `dead` where a token left the automata (one the constraint did not choose, e.g. the LoopGuard's). `trigger`:
    the `<tool_call>` token's id."""

    def __init__(self, tools: ToolSetVocab, trigger: int, lazy: bool, think: int | None = None) -> None:
        self.tools, self.trigger, self.lazy = tools, trigger, lazy
        self.think = None if lazy else think  # `<think>` allowed first (forced form; the engine clears it)
        self.started = False  # a byte of the answer read
        self.calls = 0  # calls closed
        self.call: CallState | None = None  # the open call
        self.glue: SchemaState | None = None if lazy else SchemaState(tools.lead)  # forced: what leads to a call
        # a JSON answer the reply may be instead of calls, read beside the glue until one of them is left
        self.answer: SchemaState | None = None if lazy or tools.answer is None else SchemaState(tools.answer)

    @property
    def free(self) -> bool:
        """The model's own text (lazy, no call open): nothing to mask or read."""
        return self.lazy and self.call is None

    @property
    def done(self) -> bool:
        if self.answer is not None and self.glue is None and self.call is None:
            return self.answer.done
        return self.calls > 0 and not self.tools.parallel and self.call is None

    @property
    def dead(self) -> bool:
        if self.call is not None:
            return self.call.dead
        if self.answer is not None and self.glue is None:
            return self.answer.dead
        return self.glue is not None and self.glue.dead and (self.answer is None or self.answer.dead)

    def advance(self, token_bytes: bytes, token: int = -1) -> None:
        self.started |= bool(token_bytes)
        if self.done or self.dead:
            return
        if self.answer is not None and self.glue is not None and self.call is None:  # answer or calls: both read
            self.answer.advance(token_bytes, token)
            self.glue.advance(token_bytes, token)
            if self.glue.dead and not self.answer.dead:  # the answer's, from here on
                self.glue = None
                return
            self.answer = None if self.answer.dead and not self.glue.dead else self.answer
            if token != self.trigger or self.glue.dead:
                return
            self.answer, self.glue, self.call = None, None, CallState(self.tools)  # the tag: a call, not the answer
        elif self.call is None:
            if self.answer is not None:  # the answer alone
                self.answer.advance(token_bytes, token)
                return
            if not self.lazy:
                self.glue.advance(token_bytes, token)
            if token != self.trigger or self.dead:
                return
            self.glue, self.call = None, CallState(self.tools)
        self.call.advance(self.tools.vocab.markup_bytes.get(token, token_bytes))
        if self.call.done:
            self.call, self.calls = None, self.calls + 1
            if not self.lazy and self.tools.parallel:
                self.glue = SchemaState(self.tools.sep)

    def allowed(self) -> np.ndarray:
        if self.call is not None:
            return self.call.allowed()
        if self.answer is not None and self.glue is not None:  # not yet told apart: the union
            mask = self.answer.allowed() | self.glue.allowed()
        elif self.answer is not None:
            mask = self.answer.allowed()
        elif self.glue is not None:
            mask = self.glue.allowed()
        else:
            raise RuntimeError("no call is open: the reply is free")
        if self.think is not None and not self.started and self.think < len(mask):
            mask[self.think] = True
        return mask
