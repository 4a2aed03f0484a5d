"""A reply's tool calls held to the tools' schemas, on automata of groups of tools (`json_schema.call_groups`: the
whole set where its call automaton fits `MAX_DFA` states, else halves, and so on), so that a tool set of any size
is enforced. Calls are in the form the spec names (`json_schema.compile_calls`: the JSON body of Qwen2.5 / Qwen3
templates, or the XML one of Qwen3.5 / Qwen3.6), the same machinery either way.

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
    _calls_key,
    _Nfa,
    call_groups,
    compile_schema,
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
        fmt = obj.get("format", "json")  # the form calls are written in (`json_schema.compile_calls`)
        self.groups = [SchemaVocab(vocab, dfa, markup=True, cache=cache_, tag=_calls_key(fmt) + schema_text(tools))
                       for tools, dfa in call_groups(obj["tools"], fmt)]
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
        # what reads the reply while no call is open (forced form): the glue to a call, and a JSON answer the reply
        # may be instead, side by side until one is left; none while a lazy reply is free
        self.lead: list[SchemaState] = [] if lazy else [SchemaState(v) for v in (tools.lead, tools.answer) if v]
        self.lost = False  # a token left every automaton

    @property
    def free(self) -> bool:
        """The model's own text (lazy, no call open): nothing to mask or read."""
        return self.lazy and self.call is None

    @property
    def answering(self) -> bool:
        """The reply is the JSON answer's (only the answer's automaton reads it on)."""
        return len(self.lead) == 1 and self.lead[0].masks is self.tools.answer

    @property
    def done(self) -> bool:
        if self.call is not None:
            return False
        if self.answering:
            return self.lead[0].done
        return self.calls > 0 and not self.tools.parallel

    @property
    def dead(self) -> bool:
        return self.call.dead if self.call is not None else self.lost

    def advance(self, token_bytes: bytes, token: int = -1) -> None:
        self.started |= bool(token_bytes)
        if self.done or self.dead:
            return
        if self.call is None:
            for st in self.lead:
                st.advance(token_bytes, token)
            if self.lead:
                self.lead = [st for st in self.lead if not st.dead]
                self.lost = not self.lead
            if token != self.trigger or self.lost or self.answering:
                return
            self.lead, self.call = [], CallState(self.tools)  # the tag: a call opens
        self.call.advance(self.tools.vocab.markup_bytes.get(token, token_bytes))
        if self.call.done:
            self.call, self.calls = None, self.calls + 1
            if not self.lazy and self.tools.parallel:
                self.lead = [SchemaState(self.tools.sep)]

    def allowed(self) -> np.ndarray:
        if self.call is not None:
            return self.call.allowed()
        if not self.lead:
            raise RuntimeError("no call is open: the reply is free")
        mask = self.lead[0].allowed()
        for st in self.lead[1:]:  # not yet told apart: the union
            mask |= st.allowed()
        if self.think is not None and not self.started and self.think < len(mask):
            mask[self.think] = True
        return mask
