"""Structured outputs (OpenAI `response_format: {"type": "json_schema", "json_schema": {"schema": ...}}`): the
answer is constrained token by token to JSON that the schema accepts.

The schema is compiled into a deterministic automaton over bytes (`compile_schema`, cached by the schema's text):
schema nodes become fragments of a byte NFA, which the subset construction makes a DFA over byte classes, trimmed
to the states from which the value can still be finished, so that a constrained answer never walks into a dead
end. The mask of a state is found as JSON mode finds its own (`json_mode.JsonVocab`'s token tables): every token
of the vocabulary read at once from the state, kept as a bitmap by state.

What an answer can be is a subset of what the schema accepts, valid against it (`oneOf`: branches no value
passes two of, by their types, listed values or a required key's, are any of them; branches whose automata read
each other's answers, alike but for `required` or strings by a pattern alone, are made exclusive by the product of
their automata; other oneOf lists are refused, since a branch may accept another's answer in a form its own
automaton does not read, such as `1.0` as an integer, keys in another order or one it does not declare):
- objects write their declared properties in the schema's order, each required one present; extra keys only in
  objects that declare no properties (a map: `additionalProperties` a schema, true or absent); `allOf` and
  `$ref` beside other keywords are merged key by key (refused where a member's `items` meets another's
  `prefixItems`, or two members differ in a keyword that does not merge);
- `enum` / `const` values are written as `json.dumps` writes them (UTF-8, members in their order);
- numbers: at most `INT_DIGITS` digits before the point, `FRAC_DIGITS` after, `EXP_DIGITS` of exponent (no
  number past a double's range); bounded numbers (`minimum`, `maximum`, `exclusive*`) without an exponent,
  compared as decimals with the bounds' shortest decimal forms, and with a fraction at most `FLOAT_DIGITS`
  digits in all (so the double a client parses keeps its order against the bound);
- strings: escapes `\\u` only where the length is not bounded (a character is then written as itself), and
  no lone surrogate; the formats `date`, `time`, `date-time` and `uuid` written as they are (pydantic's date,
  time, datetime and UUID fields parse them), any other `format` an annotation; a `pattern` (engine/regex.py:
  what it matches anywhere in the string unless anchored) with each character written as itself, or as its
  short escape where JSON needs one; beside a length or a format, the product of the two automata;
- values the schema leaves free (`{}`, `true`, an object or array without a schema for its members) nest at most
  `FREE_DEPTH` levels; a recursive `$ref` is expanded `REF_DEPTH` times, past which its branch is not taken;
- whitespace between tokens as JSON mode allows it (runs of at most `MAX_WS` bytes, `TOP_WS` before the value).
Keywords that assert what the automaton does not enforce (`multipleOf`, `uniqueItems`, `not`,
`if`, `minProperties`, ...) are refused (`SchemaError`, a 400 at the API), as is a schema whose automaton would
pass `MAX_DFA` states or that admits no value at all. Annotations (`title`, `description`, `format`, `default`,
...) and unknown keywords are ignored, as JSON Schema says.

`compile_calls` builds the automaton of one tool call of a group of tools, its arguments an object its tool's
parameters accept (`tool_calls.ToolCallReply` runs a reply's calls on them, group by group); `compile_tool_calls`,
the whole reply's as one automaton (what the tests hold the replies to). The tags are
read as bytes no UTF-8 text holds (`OPEN_TAG`, `CLOSE_TAG`: the vocabulary reads the tag tokens as them), so only
the tag tokens write a tag, and never inside a string. A call is in the form the chat template writes
(`tool_call_spec`'s "format", `chat.CallSyntax`): the JSON body, or the XML one of Qwen3.5 / Qwen3.6
(`_xml_arguments`: ``<parameter=KEY>`` tags in the schema's order, the required ones all there; a string value raw
text in which no ``</parameter>`` would end it (`chat.read_xml_value`; its length, pattern or format not
enforced), listed values as the template writes them, any other value JSON its sub-schema's automaton accepts
less the texts whose strings would end it, `_xml_json`, a boolean or null also as ``value|string`` writes it,
`_python_literals`; the newline before ``</parameter>`` optional; `xml_param_kinds`, the kinds the output parser
reads each value by).
"""

from __future__ import annotations

import itertools
import json
import math
import threading
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from functools import lru_cache, partial
from typing import Any

import numpy as np

from decapybara.chat import (
    CALL_FORMATS,
    END_FUNCTION,
    END_PARAMETER,
    FUNCTION,
    PARAMETER,
    PYTHON_LITERALS,
    VALUE_NEXT,
    XML_SPACE,
    ParamKinds,
    read_xml_value,
    value_form,
)
from decapybara.engine import regex
from decapybara.engine.json_mode import MAX_WS, RESERVED, TOP_WS, JsonVocab, MaskCache
from decapybara.engine.json_mode import WS as _WS_TABLE  # bool [256]: the whitespace bytes

FREE_DEPTH = 4  # levels of nesting inside a value the schema leaves free
REF_DEPTH = 4  # expansions of one recursive $ref along a path
INT_DIGITS, FRAC_DIGITS, EXP_DIGITS = 20, 20, 2  # exponents of two digits: no number past a double's range
FLOAT_DIGITS = 15  # digits in all of a bounded number with a fraction
MAX_WORK = 200_000  # schema nodes compiled and merged (`_Compiler.tick`): past it a schema is refused
MAX_NFA = 400_000
MAX_DFA = 60_000
PATTERN_FULL_DFA = 8_192  # a pattern's automaton with any text before it, at most (`pattern_content`)
MAX_SUBSET_WORK = 3_000_000  # NFA states summed over the DFA's states (the subset construction's memory and time)
MAX_CACHED = 4096  # compiled automata kept (`_cached`: schemas, tool calls, each tool's arguments and call) ...
MAX_CACHED_BYTES = 256 << 20  # ... and their tables' bytes at most

UNSUPPORTED = ("patternProperties", "propertyNames", "minProperties", "maxProperties",
               "dependentRequired", "dependentSchemas", "dependencies", "not", "if", "then", "else", "contains",
               "minContains", "maxContains", "multipleOf", "unevaluatedItems", "$dynamicRef", "$recursiveRef")
TYPES = ("object", "array", "string", "integer", "number", "boolean", "null")
BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
STRING_KEYWORDS = ("pattern", "minLength", "maxLength", "format")
KEYWORD_KINDS = {  # keywords that assert something of one kind of value only (JSON Schema: others pass them)
    **{k: "string" for k in STRING_KEYWORDS}, **{k: "number" for k in BOUNDS}, "multipleOf": "number",
    **{k: "array" for k in ("items", "prefixItems", "minItems", "maxItems", "uniqueItems", "contains")},
    **{k: "object" for k in ("properties", "required", "additionalProperties", "minProperties", "maxProperties",
                             "patternProperties", "propertyNames")}}
FORMATS = ("date", "time", "date-time", "uuid")  # string formats written as they are; others are annotations


class SchemaError(ValueError):
    """A schema the server cannot enforce or that is not a JSON Schema; the message names where."""


class EmptySchema(SchemaError):
    """A schema (or a part of one) that admits no value the automaton can write."""


def _bits(chars: bytes | range) -> int:
    m = 0
    for c in chars:
        m |= 1 << c
    return m


def _span(lo: int, hi: int) -> int:
    return _bits(range(lo, hi + 1))


WS = _bits(b" \t\n\r")
DIGIT, DIGIT19 = _span(0x30, 0x39), _span(0x31, 0x39)
HEX = DIGIT | _span(0x41, 0x46) | _span(0x61, 0x66)
ESCAPED = _bits(b'"\\/bfnrt')
PLAIN = _span(0x20, RESERVED - 1) & ~_bits(b'"\\')  # string content bytes that stand for themselves
OPEN_TAG, CLOSE_TAG = bytes([RESERVED]), bytes([RESERVED + 1])  # `<tool_call>`, `</tool_call>` as the automata read
TAGS = ((b"<tool_call>", OPEN_TAG), (b"</tool_call>", CLOSE_TAG))
ASCII_PLAIN = PLAIN & _span(0x20, 0x7F)
_JSON_ESCAPES = {0x22: b'\\"', 0x5C: b"\\\\", 0x08: b"\\b", 0x0C: b"\\f", 0x0A: b"\\n", 0x0D: b"\\r",
                 0x09: b"\\t"}  # a pattern's code points that JSON writes escaped (others under 0x20: \\u00xx)
CONT = _span(0x80, 0xBF)
UTF8 = ((_span(0xC2, 0xDF), CONT), (1 << 0xE0, _span(0xA0, 0xBF), CONT), (_span(0xE1, 0xEC), CONT, CONT),
        (1 << 0xED, _span(0x80, 0x9F), CONT), (_span(0xEE, 0xEF), CONT, CONT), (1 << 0xF0, _span(0x90, 0xBF), CONT, CONT),
        (_span(0xF1, 0xF3), CONT, CONT, CONT), (1 << 0xF4, _span(0x80, 0x8F), CONT, CONT))  # RFC 3629's sequences


class _Nfa:
    """A byte NFA built fragment by fragment: a fragment is (entry state, exit state). Edges carry byte sets as
    256-bit ints; `ws` states loop on whitespace that counts toward a run (`MAX_WS`)."""

    def __init__(self) -> None:
        self.eps: list[list[int]] = []
        self.edges: list[list[tuple[int, int]]] = []
        self.ws_states: set[int] = set()
        # states from which every continuation is accepted (a pattern's trailing "any text": `pattern_content`); a
        # set of states holding one is that state alone, in the subset construction
        self.absorbing: set[int] = set()

    def state(self) -> int:
        if len(self.eps) >= MAX_NFA:
            raise SchemaError(f"the schema is too large to enforce (over {MAX_NFA} automaton states)")
        self.eps.append([])
        self.edges.append([])
        return len(self.eps) - 1

    def link(self, a: int, b: int) -> None:
        self.eps[a].append(b)

    def cls(self, mask: int) -> tuple[int, int]:
        a, b = self.state(), self.state()
        self.edges[a].append((mask, b))
        return a, b

    def lit(self, data: bytes) -> tuple[int, int]:
        a = cur = self.state()
        for c in data:
            nxt = self.state()
            self.edges[cur].append((1 << c, nxt))
            cur = nxt
        return a, cur

    def seq(self, *frags: tuple[int, int]) -> tuple[int, int]:
        if not frags:
            s = self.state()
            return s, s
        for (_, e), (s, _) in itertools.pairwise(frags):
            self.link(e, s)
        return frags[0][0], frags[-1][1]

    def alt(self, *frags: tuple[int, int]) -> tuple[int, int]:
        a, b = self.state(), self.state()
        for s, e in frags:
            self.link(a, s)
            self.link(e, b)
        return a, b

    def opt(self, frag: tuple[int, int]) -> tuple[int, int]:
        a, b = self.alt(frag)
        self.link(a, b)
        return a, b

    def star(self, frag: tuple[int, int]) -> tuple[int, int]:
        a, b = self.state(), self.state()
        self.link(a, frag[0])
        self.link(frag[1], a)
        self.link(a, b)
        return a, b

    def repeat(self, make, lo: int, hi: int | None) -> tuple[int, int]:
        """`make()` (a fresh fragment) lo to hi times (hi None: unbounded)."""
        parts = [make() for _ in range(lo)]
        if hi is None:
            parts.append(self.star(make()))
        else:
            tail = None
            for _ in range(hi - lo):
                f = make()
                tail = self.opt(f if tail is None else self.seq(f, tail))
            if tail is not None:
                parts.append(tail)
        return self.seq(*parts)

    def ws(self) -> tuple[int, int]:
        s = self.state()
        self.edges[s].append((WS, s))
        self.ws_states.add(s)
        return s, s

    def comma(self) -> tuple[int, int]:
        """A separator between members or items: a comma, whitespace either side."""
        return self.seq(self.ws(), self.lit(b","), self.ws())

    def empty(self) -> tuple[int, int]:
        """No value at all (a branch the schema closes)."""
        return self.state(), self.state()


@dataclass(slots=True)
class SchemaDfa:
    """The compiled automaton: `table[state, byte class]` (-1: no way on), `byte_class[256]`, `accept` (the value
    may end here), `terminal` (it must: nothing can follow), `counted` (a whitespace byte into this state extends a
    run), `self_plain` (every plain string byte stays here and counts nothing: inside a free string)."""

    table: np.ndarray  # int32 [D, C]
    byte_class: np.ndarray  # int64 [256]
    accept: np.ndarray  # bool [D]
    terminal: np.ndarray  # bool [D]
    counted: np.ndarray  # bool [D]
    self_plain: np.ndarray  # bool [D]
    start: int = 0

    @property
    def num_states(self) -> int:
        return int(self.table.shape[0])

    def step(self, state: int, ws: int, b: int) -> tuple[int, int]:
        """(state, whitespace run) after byte `b`; state -1 where it cannot follow."""
        if state < 0:
            return -1, 0
        nxt = int(self.table[state, self.byte_class[b]])
        if nxt < 0:
            return -1, 0
        ws = ws + 1 if _WS_TABLE[b] and self.counted[nxt] else 0
        return (nxt, ws) if ws <= MAX_WS else (-1, 0)

    def matches(self, data: bytes) -> bool:
        """Whether `data` is a whole answer (an accepting state after its last byte)."""
        s, w = self.start, 0
        for b in data:
            s, w = self.step(s, w, b)
        return s >= 0 and bool(self.accept[s])


class _Compiler:
    """Schema nodes -> NFA fragments (`value`)."""

    def __init__(self, root: Any, nfa: _Nfa | None = None, exact: bool = False) -> None:
        self.root = root
        self.nfa = nfa or _Nfa()
        # the very language of each pattern (`pattern_content`'s exact form), where a narrower one would be wrong:
        # oneOf's branches (a string one accepts that its narrowed form does not would pass another branch) and the
        # checks of enum / const values against the keywords beside them
        self.exact = exact
        self.work = 0  # nodes compiled and merged (`tick`)
        self.refs: dict[str, int] = defaultdict(int)  # $ref -> expansions on the current path

    # ---- pieces
    def escape(self, unicode: bool = True) -> tuple[int, int]:
        """A backslash escape: a short one, or (`unicode`) `\\u` and four hex digits of a code point that is no
        surrogate, or of a high surrogate followed by its low one (a lone surrogate is no Unicode text: neither the
        server's tool-call parser nor UTF-8 replies can carry it)."""
        n = self.nfa
        if not unicode:
            return n.seq(n.lit(b"\\"), n.cls(ESCAPED))
        hex_ = lambda: n.cls(HEX)
        plain = n.alt(n.seq(n.cls(HEX & ~_bits(b"dD")), hex_(), hex_(), hex_()),
                      n.seq(n.cls(_bits(b"dD")), n.cls(_span(0x30, 0x37)), hex_(), hex_()))
        pair = n.seq(n.cls(_bits(b"dD")), n.cls(_bits(b"89abAB")), hex_(), hex_(), n.lit(b"\\u"), n.cls(_bits(b"dD")),
                     n.cls(_bits(b"cdefCDEF")), hex_(), hex_())
        return n.seq(n.lit(b"\\"), n.alt(n.cls(ESCAPED), n.seq(n.lit(b"u"), n.alt(plain, pair))))

    def string_char(self) -> tuple[int, int]:
        """One character of a string whose length is bounded: a code point in well-formed UTF-8 (so that a length
        counts what a client decodes), or a short escape (no `\\u`: its states, at each position of the string,
        would triple the automaton; a character it stands for is written as itself)."""
        n = self.nfa
        utf8 = [n.seq(n.cls(lead), *[n.cls(c) for c in rest]) for lead, *rest in UTF8]
        return n.alt(n.cls(ASCII_PLAIN), *utf8, self.escape(unicode=False))

    def free_string(self) -> tuple[int, int]:
        """Any string: plain bytes loop on one state (so a mask there needs no steps for plain tokens)."""
        n = self.nfa
        loop = n.state()
        n.edges[loop].append((PLAIN, loop))
        esc = self.escape()
        n.link(loop, esc[0])
        n.link(esc[1], loop)
        q0, q1 = n.lit(b'"'), n.lit(b'"')
        n.link(q0[1], loop)
        n.link(loop, q1[0])
        return q0[0], q1[1]

    def string(self, node: dict) -> tuple[int, int]:
        if "pattern" in node:
            rest = {k: v for k, v in node.items() if k != "pattern"}
            if not any(k in rest for k in ("minLength", "maxLength", "format")):
                return self.pattern(node["pattern"])
            # beside a length or a format: the strings both automata accept (their product)
            dfas = [self.alone({"type": "string", "pattern": node["pattern"]}), self.alone({**rest, "type": "string"})]
            return self.nfa.empty() if None in dfas else _embed(self.nfa, _product(dfas, all_of=True))
        lo = _count(node, "minLength", 0)
        hi = _count(node, "maxLength", None)
        if node.get("format") in FORMATS:
            if "minLength" in node or "maxLength" in node:
                raise SchemaError(f"format {node['format']!r} beside minLength / maxLength is not enforced here")
            n = self.nfa
            return n.seq(n.lit(b'"'), self.formatted(node["format"]), n.lit(b'"'))
        if hi is not None and hi < lo:
            return self.nfa.empty()
        if lo == 0 and hi is None:
            return self.free_string()
        n = self.nfa
        return n.seq(n.lit(b'"'), n.repeat(self.string_char, lo, hi), n.lit(b'"'))

    def pattern(self, pattern: Any) -> tuple[int, int]:
        """A string whose text `pattern` matches (JSON Schema: anywhere in it, unless anchored; engine/regex.py):
        its content automaton (`pattern_content`, built alone and cached) between the quotes."""
        n = self.nfa
        try:
            content = pattern_content(pattern, self.exact)
        except EmptySchema:  # a pattern nothing matches: a branch no value takes
            return n.empty()
        return n.seq(n.lit(b'"'), _embed(n, content), n.lit(b'"'))

    def formatted(self, fmt: str) -> tuple[int, int]:
        """A string's content in one of `FORMATS`, as RFC 3339 and RFC 4122 write them (dates of real days: the
        29th of February is not written; times with their offset)."""
        n, two = self.nfa, lambda a, b: self.fixed_range(f"{a:02d}", f"{b:02d}")
        if fmt == "uuid":
            parts = []
            for k, width in enumerate((8, 4, 4, 4, 12)):
                parts += ([n.lit(b"-")] if k else []) + [n.cls(HEX) for _ in range(width)]
            return n.seq(*parts)

        def date() -> tuple[int, int]:
            months = [(b"01 03 05 07 08 10 12", 31), (b"04 06 09 11", 30), (b"02", 28)]
            return n.seq(self.fixed_range("0001", "9999"), n.lit(b"-"), n.alt(*[
                n.seq(n.alt(*[n.lit(m) for m in ms.split()]), n.lit(b"-"), two(1, last)) for ms, last in months]))

        def time() -> tuple[int, int]:
            offset = n.alt(n.lit(b"Z"), n.seq(n.cls(_bits(b"+-")), two(0, 23), n.lit(b":"), two(0, 59)))
            return n.seq(two(0, 23), n.lit(b":"), two(0, 59), n.lit(b":"), two(0, 59),
                         n.opt(n.seq(n.lit(b"."), self.digits(1, 6))), offset)

        return date() if fmt == "date" else time() if fmt == "time" else n.seq(date(), n.lit(b"T"), time())

    def digits(self, lo: int, hi: int) -> tuple[int, int]:
        return self.nfa.repeat(lambda: self.nfa.cls(DIGIT), lo, hi)

    def natural(self) -> tuple[int, int]:
        """0, or digits without a leading zero."""
        n = self.nfa
        return n.alt(n.lit(b"0"), n.seq(n.cls(DIGIT19), self.digits(0, INT_DIGITS - 1)))

    def number(self, integer: bool) -> tuple[int, int]:
        n = self.nfa
        parts = [n.opt(n.lit(b"-")), self.natural()]
        if not integer:
            parts.append(n.opt(n.seq(n.lit(b"."), self.digits(1, FRAC_DIGITS))))
            parts.append(n.opt(n.seq(n.cls(_bits(b"eE")), n.opt(n.cls(_bits(b"+-"))), self.digits(1, EXP_DIGITS))))
        return n.seq(*parts)

    def fixed_range(self, lo: str, hi: str) -> tuple[int, int]:
        """Digit strings of len(lo) == len(hi) digits (leading zeros allowed) from lo to hi."""
        n = self.nfa
        if lo == "0" * len(lo) and hi == "9" * len(hi):  # every string of the width (and the empty one)
            return self.digits(len(lo), len(lo))
        a, b = int(lo[0]), int(hi[0])
        if a == b:
            return n.seq(n.lit(lo[:1].encode()), self.fixed_range(lo[1:], hi[1:]))
        k = len(lo) - 1
        parts = [n.seq(n.lit(lo[:1].encode()), self.fixed_range(lo[1:], "9" * k)),
                 n.seq(n.lit(hi[:1].encode()), self.fixed_range("0" * k, hi[1:]))]
        if b - a > 1:
            parts.append(n.seq(n.cls(_span(0x30 + a + 1, 0x30 + b - 1)), self.digits(k, k)))
        return n.alt(*parts)

    def natural_range(self, lo: int, hi: int | None) -> tuple[int, int]:
        """Naturals (no leading zeros) from lo to hi (None: no bound, within INT_DIGITS digits)."""
        n = self.nfa
        parts = [self.fixed_range(a, b) for a, b in _by_width(lo, hi, len(str(lo)))]
        if hi is None and len(str(lo)) < INT_DIGITS:  # every wider natural
            parts.append(n.seq(n.cls(DIGIT19), self.digits(len(str(lo)), INT_DIGITS - 1)))
        return n.alt(*parts) if parts else n.empty()

    def bounded(self, node: dict, integer: bool) -> tuple[int, int]:
        """A number within the node's bounds: integers as whole numbers, other numbers as a whole part and a
        fraction (no exponent), compared as decimals with the bounds' shortest decimal forms."""
        lo, lo_open = _bound(node, "minimum", "exclusiveMinimum", low=True)
        hi, hi_open = _bound(node, "maximum", "exclusiveMaximum", low=False)
        if integer:  # whole numbers: open ends move by one
            ilo = None if lo is None else (math.floor(lo) + 1 if lo_open and lo == math.floor(lo) else math.ceil(lo))
            ihi = None if hi is None else (math.ceil(hi) - 1 if hi_open and hi == math.ceil(hi) else math.floor(hi))
            return self.int_range(ilo, ihi)
        n = self.nfa
        dlo = None if lo is None else Decimal(repr(lo))
        dhi = None if hi is None else Decimal(repr(hi))
        parts = []
        if dlo is None or dlo < 0:  # the negative side: "-" then a magnitude in [max(0, -hi), -lo]
            if dhi is not None and dhi <= 0:
                m_lo, m_lo_open = -dhi, hi_open  # "-0" is 0: below an open bound at 0 only when it is not
            else:
                m_lo, m_lo_open = Decimal(0), False
            parts.append(n.seq(n.lit(b"-"), self.magnitude(m_lo, m_lo_open, None if dlo is None else -dlo, lo_open)))
        if dhi is None or dhi >= 0:
            p_lo, p_lo_open = (Decimal(0), False) if dlo is None or dlo < 0 else (dlo, lo_open)
            parts.append(self.magnitude(p_lo, p_lo_open, dhi, hi_open))
        return n.alt(*parts)

    def magnitude(self, lo: Decimal, lo_open: bool, hi: Decimal | None, hi_open: bool) -> tuple[int, int]:
        """Non-negative decimals (a whole part, an optional fraction) from lo to hi (None: no bound). A number
        with a fraction has at most `FLOAT_DIGITS` digits in all, so that the double a client parses it into keeps
        its order against the bound (two decimals of at most 15 significant digits are two doubles)."""
        n = self.nfa
        li, lf = _split(lo)
        parts: list[tuple[int, int]] = []

        def whole(a: int, b: int | None, f_lo: str, f_lo_open: bool, f_hi: str | None, f_hi_open: bool) -> None:
            for wa, wb in _by_width(a, b, INT_DIGITS):
                parts.append(n.seq(self.fixed_range(wa, wb),
                                   self.fraction(f_lo, f_lo_open, f_hi, f_hi_open, FLOAT_DIGITS - len(wa))))

        if hi is not None:
            hi_i, hf = _split(hi)
            if li > hi_i:
                return n.empty()
            if li == hi_i:
                whole(li, li, lf, lo_open, hf, hi_open)
                return n.alt(*parts) if parts else n.empty()
        whole(li, li, lf, lo_open, None, False)
        if hi is None or hi_i - li >= 2:  # whole parts strictly inside: any fraction
            whole(li + 1, None if hi is None else hi_i - 1, "", False, None, False)
        if hi is not None:
            whole(hi_i, hi_i, "", False, hf, hi_open)
        return n.alt(*parts) if parts else n.empty()

    def fraction(self, lo: str, lo_open: bool, hi: str | None, hi_open: bool, most: int) -> tuple[int, int]:
        """An optional fraction (a point, 1..`most` digits) whose value 0.F lies between 0.lo and 0.hi
        (digit strings; hi None: below 1), built deterministically: a state for each (digits read, still equal
        to lo's digits, still equal to hi's digits)."""
        n = self.nfa

        def digit(bound: str | None, i: int) -> int:
            return int(bound[i]) if bound is not None and i < len(bound) else 0

        def ok(i: int, lo_eq: bool, hi_eq: bool) -> bool:  # may the fraction end here (i digits read)?
            lo_zero = not lo[i:].strip("0")  # lo's digits left are zeros: equal to it
            hi_zero = hi is None or not hi[i:].strip("0")
            if lo_eq and (not lo_zero or lo_open):
                return False
            return not (hi is not None and hi_eq and hi_zero and hi_open)

        entry, end = n.state(), n.state()
        dot = n.state()
        n.edges[entry].append((1 << ord("."), dot))
        if ok(0, True, hi is not None):
            n.link(entry, end)  # no fraction
        states = {(True, hi is not None): dot}
        for i in range(min(most, FRAC_DIGITS)):
            nxt: dict[tuple[bool, bool], int] = {}
            for (lo_eq, hi_eq), s in states.items():
                for d in range(10):
                    if lo_eq and d < digit(lo, i) or hi_eq and d > digit(hi, i):
                        continue
                    key = (lo_eq and d == digit(lo, i), hi_eq and d == digit(hi, i))
                    t = nxt.get(key)
                    if t is None:
                        t = nxt[key] = n.state()
                        if ok(i + 1, *key):
                            n.link(t, end)
                    n.edges[s].append((1 << (0x30 + d), t))
            states = nxt
        return entry, end

    def int_range(self, lo: int | None, hi: int | None) -> tuple[int, int]:
        n = self.nfa
        if lo is not None and hi is not None and lo > hi:
            return n.empty()
        parts = []
        if lo is None or lo < 0:  # "-" then a magnitude in [max(1, -hi), -lo]
            parts.append(n.seq(n.lit(b"-"), self.natural_range(1 if hi is None or hi >= 0 else -hi,
                                                               None if lo is None else -lo)))
        if hi is None or hi >= 0:
            parts.append(self.natural_range(max(lo or 0, 0), hi))
        return n.alt(*parts)

    def literal(self, value: Any) -> tuple[int, int]:
        """One value as `json.dumps` writes its scalars, objects and arrays in its order with whitespace
        between tokens allowed."""
        n = self.nfa
        if isinstance(value, dict | list):
            items = list(value.items()) if isinstance(value, dict) else list(value)
            close = b"}" if isinstance(value, dict) else b"]"
            parts = [n.lit(b"{" if isinstance(value, dict) else b"[")]
            for k, item in enumerate(items):
                parts.append(n.ws() if k == 0 else n.comma())
                if isinstance(value, dict):
                    parts += [self.literal(item[0]), n.ws(), n.lit(b":"), n.ws()]
                    item = item[1]
                parts.append(self.literal(item))
            return n.seq(*parts, n.ws(), n.lit(close))
        return n.lit(json.dumps(value, ensure_ascii=False).encode())

    def free(self, depth: int) -> tuple[int, int]:
        """Any JSON value, nesting at most `depth` more levels."""
        n = self.nfa
        parts = [self.free_string(), self.number(False), n.lit(b"true"), n.lit(b"false"), n.lit(b"null")]
        if depth > 0:
            parts.append(self.map(lambda: self.free(depth - 1)))
            parts.append(self.array([], lambda: self.free(depth - 1), 0, None))
        return n.alt(*parts)

    # ---- containers
    def map(self, value) -> tuple[int, int]:
        """An object of any keys, each value `value()` (one fragment, looped)."""
        n = self.nfa
        pair = n.seq(self.free_string(), n.ws(), n.lit(b":"), n.ws(), value())  # one value fragment, looped
        sep = n.comma()
        open_, close = n.seq(n.lit(b"{"), n.ws()), n.seq(n.ws(), n.lit(b"}"))
        n.link(open_[1], pair[0])
        n.link(open_[1], close[0])
        n.link(pair[1], sep[0])
        n.link(sep[1], pair[0])
        n.link(pair[1], close[0])
        return open_[0], close[1]

    def array(self, prefix: list, item, lo: int, hi: int | None) -> tuple[int, int]:
        """`[` items `]`: the `prefix` makers first, then `item()` (None: no more), lo..hi items in all."""
        n = self.nfa
        limit = len(prefix) if item is None else hi
        if limit is not None and hi is not None:
            limit = min(limit, hi)
        if limit is not None and limit < lo:
            return n.empty()
        open_, close = n.seq(n.lit(b"["), n.ws()), n.seq(n.ws(), n.lit(b"]"))

        def maker(k: int):  # the k-th item (0-based)
            return prefix[k] if k < len(prefix) else item

        # items 0..fixed-1 one by one (each its own fragment), then the repeated item looped where unbounded
        fixed = max(lo, len(prefix)) if limit is None else limit
        end = n.state()  # after the last item written: the close
        n.link(end, close[0])
        cur = open_[1]
        for k in range(fixed):
            f = maker(k)()
            if k == 0:
                n.link(cur, f[0])
            else:
                s = n.comma()
                n.link(cur, s[0])
                n.link(s[1], f[0])
            if k + 1 >= lo:
                n.link(f[1], end)
            cur = f[1]
        if lo == 0:
            n.link(open_[1], end)
        if limit is None:  # unbounded: more of `item` after the fixed ones
            f = item()
            s = n.comma()
            if fixed == 0:
                n.link(open_[1], f[0])
            else:
                n.link(cur, s[0])
            n.link(s[1], f[0])
            n.link(f[1], end)
            n.link(f[1], s[0])
        return open_[0], close[1]

    def obj(self, node: dict) -> tuple[int, int]:
        n = self.nfa
        _check_keywords(node)
        props, required = node.get("properties", {}), node.get("required", [])
        extra = node.get("additionalProperties", node.get("unevaluatedProperties", True))
        names = list(props) + [r for r in dict.fromkeys(required) if r not in props]
        if not names:  # a map
            if extra is False:
                return n.lit(b"{}")
            if extra is True or extra == {}:
                return self.map(lambda: self.free(FREE_DEPTH - 1))
            return self.map(lambda: self.value(extra))
        req = [name in required for name in names]
        # E_j: key j, colon, value j; S0 after "{"; A_j after E_j; C_j after A_j's comma
        open_ = n.seq(n.lit(b"{"), n.ws())
        close = n.seq(n.ws(), n.lit(b"}"))
        entries = []
        for name in names:
            schema = props.get(name, extra)  # a required key not declared: what extra keys take
            entries.append(n.seq(n.lit(json.dumps(name, ensure_ascii=False).encode()), n.ws(), n.lit(b":"), n.ws(),
                                 self.value(schema)))
        count = len(names)
        # from S0 (before any) to entry j: no required entry before j
        for j in range(count):
            n.link(open_[1], entries[j][0])
            if req[j]:
                break
        if not any(req):
            n.link(open_[1], close[0])
        for i in range(count):
            after = entries[i][1]
            later = range(i + 1, count)
            if later:
                s = n.comma()
                n.link(after, s[0])
                for j in later:
                    n.link(s[1], entries[j][0])
                    if req[j]:
                        break
            if not any(req[i + 1:]):
                n.link(after, close[0])
        return open_[0], close[1]

    def tick(self) -> None:
        self.work += 1
        if self.work > MAX_WORK:
            raise SchemaError(f"the schema is too large to enforce (over {MAX_WORK} nodes compiled)")

    # ---- a schema node
    def value(self, node: Any) -> tuple[int, int]:
        self.tick()
        n = self.nfa
        if node is True:
            return self.free(FREE_DEPTH)
        if node is False:
            return n.empty()
        if not isinstance(node, dict):
            raise SchemaError(f"a schema must be an object or a boolean, got {json.dumps(node)[:80]}")
        for key in UNSUPPORTED:
            if key in node:
                raise SchemaError(f"the keyword {key!r} is not enforced here")
        if node.get("uniqueItems") is True:
            raise SchemaError("the keyword 'uniqueItems' is not enforced here")
        if "$ref" in node or "allOf" in node:
            return self.merged([node])
        for key in ("anyOf", "oneOf"):
            if key in node:
                subs = node[key]
                if not isinstance(subs, list) or not subs:
                    raise SchemaError(f"{key} must be a non-empty list")
                rest = {k: v for k, v in node.items() if k != key}
                if key == "oneOf" and len(subs) > 1:
                    return self.one_of([{"allOf": [rest, sub]} if _asserts(rest) else sub for sub in subs])
                if not _asserts(rest):
                    return n.alt(*[self.value(sub) for sub in subs])
                return n.alt(*[self.merged([rest, sub]) for sub in subs])
        if "const" in node or "enum" in node:
            values = [node["const"]] if "const" in node else node["enum"]
            if not isinstance(values, list) or not values:
                raise SchemaError("enum must be a non-empty list")
            if "enum" in node and "const" in node:
                if not isinstance(node["enum"], list):
                    raise SchemaError("enum must be a non-empty list")
                values = [v for v in values if any(_json_equal(v, e) for e in node["enum"])]
            rest = {k: v for k, v in node.items() if k not in ("const", "enum")}
            if _asserts(rest):  # the values the other keywords also accept, read by their own automaton
                # (a type's own keywords say nothing of other types' values), each check built once, where needed
                checks: dict[str, Any] = {}

                def check(v: Any) -> bool:
                    kind = _keyword_kind(v)
                    if kind not in checks:
                        own = {k: x for k, x in rest.items() if KEYWORD_KINDS.get(k, kind) == kind}
                        checks[kind] = self.alone(own, exact=True) if _asserts(own) else True
                    got = checks[kind]
                    return got is True or (got is not None and got.matches(
                        json.dumps(v, ensure_ascii=False).encode()))

                values = [v for v in values if check(v)]
            return n.alt(*[self.literal(v) for v in values]) if values else n.empty()
        kinds = _types(node)
        if kinds is None:
            if "properties" in node or "required" in node or "additionalProperties" in node:
                kinds = ["object"]
            elif "items" in node or "prefixItems" in node:
                kinds = ["array"]
            elif any(k in node for k in BOUNDS):
                kinds = ["number"]
            elif "minLength" in node or "maxLength" in node or "pattern" in node:
                kinds = ["string"]
            else:
                return self.free(FREE_DEPTH)
        parts = []
        for kind in kinds:
            if kind == "object":
                parts.append(self.obj(node))
            elif kind == "array":
                parts.append(self.arr(node))
            elif kind == "string":
                parts.append(self.string(node))
            elif kind in ("integer", "number"):
                if "number" in kinds and kind == "integer":
                    continue  # integers are numbers
                if any(k in node for k in BOUNDS):
                    parts.append(self.bounded(node, kind == "integer"))
                else:
                    parts.append(self.number(kind == "integer"))
            elif kind == "boolean":
                parts.append(n.alt(n.lit(b"true"), n.lit(b"false")))
            elif kind == "null":
                parts.append(n.lit(b"null"))
        return parts[0] if len(parts) == 1 else n.alt(*parts)

    def one_of(self, subs: list) -> tuple[int, int]:
        """What exactly one of `subs` accepts. Branches no value passes two of (`_disjoint`) are any of them.
        Otherwise a branch's automaton does not read every form of the values it accepts (`1.0` as an integer, keys
        in another order or undeclared, a `\\u` escape in a bounded string), so the product of the automata, whose
        states accept where one branch alone does, is exclusive only where each branch reads whatever the others
        write of its values: branches alike but for `required` (each key they require declared), or strings by a
        `pattern` alone. Other branches that may overlap are refused."""
        merged = [_merge([s], self, []) for s in subs]
        if all(_disjoint(a, b, self) for a, b in itertools.combinations(merged, 2)):
            return self.nfa.alt(*[self.value(s) for s in subs])
        live = [m for m in merged if m is not False]
        if not _same_but_required(live) and not all(_pattern_only(m) for m in live):
            raise SchemaError("oneOf whose branches may accept the same value (in a form one of them does not "
                              "write) is not enforced here: give each branch a required property of its own "
                              "constant, or types no other branch has")
        dfas = [d for d in (self.alone(s, exact=True) for s in subs) if d is not None]
        return _embed(self.nfa, _exactly_one(dfas)) if dfas else self.nfa.empty()

    def alone(self, node: Any, exact: bool = False) -> SchemaDfa | None:
        """`node`'s own automaton (None where it admits nothing), built beside this one's: the same root, `$ref`
        expansions and work budget; its patterns' exact languages where this one's are or `exact` asks."""
        comp = _Compiler(self.root, exact=self.exact or exact)
        comp.refs, comp.work = self.refs, self.work
        try:
            return _build(comp.nfa, *comp.value(node))
        except EmptySchema:
            return None
        finally:
            self.work = comp.work

    def arr(self, node: dict) -> tuple[int, int]:
        lo = _count(node, "minItems", 0)
        hi = _count(node, "maxItems", None)
        items = node.get("items", True)
        prefix = node.get("prefixItems", [])
        if isinstance(items, list):  # the older tuple form
            prefix, items = items, node.get("additionalItems", True)
        if not isinstance(prefix, list):
            raise SchemaError("prefixItems must be a list of schemas")
        makers = [(lambda s=s: self.value(s)) for s in prefix]
        if items is False:
            item = None
        elif items is True or items == {}:
            item = lambda: self.free(FREE_DEPTH - 1)
        else:
            item = lambda: self.value(items)
        return self.array(makers, item, lo, hi)

    def resolve(self, ref: Any) -> Any:
        """The schema a local `$ref` points at."""
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise SchemaError(f"only local $ref ('#/...') are resolved, got {ref!r}")
        target: Any = self.root
        for part in ref[2:].split("/") if ref != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and part in target:
                target = target[part]
            elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
            else:
                raise SchemaError(f"$ref {ref!r} does not resolve")
        return target

    def merged(self, nodes: list) -> tuple[int, int]:
        """The value all of `nodes` describe (`_merge`); the `$ref`s resolved on the way count as expansions
        while the merged node compiles, so that a recursive one stops at `REF_DEPTH`."""
        used: list[str] = []
        node = _merge(nodes, self, used)
        if node is False or any(self.refs[r] >= REF_DEPTH for r in used):
            return self.nfa.empty()  # admits nothing, or past the expansion limit: this branch is not taken
        for r in used:
            self.refs[r] += 1
        try:
            return self.value(node)
        finally:
            for r in used:
                self.refs[r] -= 1


ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment", "$defs", "definitions",
               "format", "deprecated", "readOnly", "writeOnly", "contentMediaType", "contentEncoding", "$anchor",
               "discriminator", "nullable", "strict", "additionalItems"}


def pattern_content(pattern: Any, exact: bool = False) -> SchemaDfa:
    """The content (between the quotes) of the JSON strings whose text `pattern` matches, as a DFA, cached by the
    pattern: each top-level alternative is its tree (`regex_fragment`), after any text where it is not anchored at
    its start and before any where it is not anchored at its end. That trailing "any text" is an absorbing state
    (`_Nfa.absorbing`): once a match is complete every continuation is, so the subset construction keeps one state
    for it, not one a set of partial matches beside it. An alternative not anchored at its start that matches the
    empty string matches every string.

    The leading "any text" has no such cut: beside it every partial match stays open, which for a pattern such as
    `[A-Z].{12}` is 2**12 states. Where that automaton passes `PATTERN_FULL_DFA` states, the alternatives not
    anchored at their start are matched at the first character that can begin one of them (text before it holds
    no such character: `[^A-Z]*[A-Z].{12}` then any text). That accepts fewer strings, each of which the pattern
    matches, so what is written still validates; its automaton is no larger than the alternatives' own. `exact`:
    never narrowed (up to `MAX_DFA` states), for uses where a narrower language would let wrong values through
    (oneOf) or drop right ones (enum checks). Raises SchemaError for a pattern not enforced here."""
    def build() -> SchemaDfa:
        try:
            branches = regex.parse(pattern)
        except regex.PatternError as e:
            raise SchemaError(str(e)) from None
        loose = [tree for tree, start, _ in branches if not start]
        if any(regex.nullable(tree) for tree in loose):  # an empty match anywhere: every string
            n = _Nfa()
            return _build(n, *n.star(code_point(n, regex.ANY)))
        if not loose or exact:
            return _pattern_dfa(branches, None, MAX_DFA)
        try:
            return _pattern_dfa(branches, None, PATTERN_FULL_DFA)
        except EmptySchema:
            raise
        except SchemaError:
            lead = regex.complement([r for tree in loose for r in regex.first_chars(tree)])
            return _pattern_dfa(branches, lead, MAX_DFA)

    return _cached(("pattern (exact):" if exact else "pattern:") + json.dumps(pattern), build)


def _pattern_dfa(branches: list[tuple[Any, bool, bool]], lead: regex.Ranges | None, limit: int) -> SchemaDfa:
    """`pattern_content`'s automaton of `regex.parse`'s alternatives: those not anchored at their start after any
    text (`lead` None), or after text of `lead`'s code points only, all of them behind one such run."""
    n = _Nfa()

    def body(tree: Any, end: bool) -> tuple[int, int]:
        parts = [regex_fragment(n, tree)]
        if not end:
            loop = n.star(code_point(n, regex.ANY))
            n.absorbing.add(loop[0])
            parts.append(loop)
        return n.seq(*parts)

    alts = [n.seq(*([] if start else [n.star(code_point(n, regex.ANY))]), body(tree, end))
            for tree, start, end in branches if start or lead is None]
    if lead is not None:
        run = n.star(code_point(n, lead)) if lead else n.seq()
        alts.append(n.seq(run, n.alt(*[body(tree, end) for tree, start, end in branches if not start])))
    return _build(n, *n.alt(*alts), limit)


def regex_fragment(n: _Nfa, node: Any) -> tuple[int, int]:
    """An engine/regex.py tree as a fragment of `n` over JSON string content (`code_point` a character)."""
    kind = node[0]
    if kind == "set":
        return code_point(n, node[1])
    if kind == "seq":
        return n.seq(*[regex_fragment(n, c) for c in node[1]])
    if kind == "alt":
        return n.alt(*[regex_fragment(n, c) for c in node[1]])
    _, child, lo, hi = node
    return n.repeat(lambda: regex_fragment(n, child), lo, hi)


def code_point(n: _Nfa, ranges: list[tuple[int, int]]) -> tuple[int, int]:
    """One code point of `ranges` as a JSON string holds it: printable ASCII as itself (`"` and `\\` escaped),
    controls by their short escape or as `\\u00xx` (by high digit: two branches at most), the rest as UTF-8."""
    plain, frags, controls = 0, [], [0, 0]
    for lo, hi in ranges:
        if lo < 0 or hi > regex.MAX_CP:
            raise SchemaError(f"code point out of range in a pattern: {lo:#x}-{hi:#x}")
        for cp in range(lo, min(hi, 0x7F) + 1):
            if cp < 0x20:
                controls[cp >> 4] |= 1 << (cp & 15)
                if cp in _JSON_ESCAPES:
                    frags.append(n.lit(_JSON_ESCAPES[cp]))
            elif cp in (0x22, 0x5C):
                frags.append(n.lit(_JSON_ESCAPES[cp]))
            else:
                plain |= 1 << cp
    for high, lows in enumerate(controls):
        if lows:
            digits = _bits(ord(c) for d in range(16) if lows >> d & 1 for c in {f"{d:x}", f"{d:X}"})
            frags.append(n.seq(n.lit(b"\\u00"), n.cls(_bits(b"%d" % high)), n.cls(digits)))
    if plain:
        frags.append(n.cls(plain))
    for seq in regex.utf8_sequences([(max(lo, 0x80), hi) for lo, hi in ranges if hi >= 0x80]):
        frags.append(n.seq(*[n.cls(_span(a, b)) for a, b in seq]))
    return n.alt(*frags) if frags else n.empty()


def _keyword_kind(v: Any) -> str:
    """The kind of value `KEYWORD_KINDS` sorts keywords by."""
    if isinstance(v, str):
        return "string"
    if isinstance(v, int | float) and not isinstance(v, bool):
        return "number"
    return "array" if isinstance(v, list) else "object" if isinstance(v, dict) else "other"


def _asserts(node: dict) -> bool:
    return any(k not in ANNOTATIONS for k in node)


def _merge(nodes: list, comp: _Compiler, used: list[str], budget: int = 16) -> Any:
    """The schema all of `nodes` describe, where they can be merged key by key (a node's own `$ref` and `allOf`
    resolved first, at most `budget` deep, each `$ref` resolved added to `used`): types intersected, properties
    merged (a member's `additionalProperties` applied to the others' properties it does not declare), required
    joined, bounds tightened; other keys must agree. False where they admit nothing."""
    if budget <= 0:
        return False
    out: dict = {}
    closed: list[tuple[set, Any]] = []  # (declared properties, what other keys take) of members that restrict keys
    items_all = prefixed = False  # a member's `items` over every position; a member's prefixItems
    for node in nodes:
        comp.tick()
        if node is True:
            continue
        if node is False:
            return False
        if not isinstance(node, dict):
            raise SchemaError("a schema must be an object or a boolean")
        if "$ref" in node:
            used.append(node["$ref"])
            node = _merge([comp.resolve(node["$ref"]), {k: v for k, v in node.items() if k != "$ref"}], comp,
                          used, budget - 1)
        elif "allOf" in node:
            subs = node["allOf"]
            if not isinstance(subs, list) or not subs:
                raise SchemaError("allOf must be a non-empty list")
            node = _merge([{k: v for k, v in node.items() if k != "allOf"}, *subs], comp, used, budget - 1)
        if node is False:
            return False
        if node is True:
            continue
        _check_keywords(node)
        extra = node.get("additionalProperties", node.get("unevaluatedProperties", True))
        if extra is not True and extra != {}:
            closed.append((set(node.get("properties", {})), extra))
        prefixed |= "prefixItems" in node or isinstance(node.get("items"), list)
        items_all |= "items" in node and not isinstance(node["items"], list) and "prefixItems" not in node
        for key, value in node.items():
            if key not in out:
                out[key] = value
            elif key == "type":
                a = set(out[key] if isinstance(out[key], list) else [out[key]])
                b = set(value if isinstance(value, list) else [value])
                both = (a & b) | ({"integer"} if ("number" in a and "integer" in b)
                                  or ("integer" in a and "number" in b) else set())
                if not both:
                    return False
                out[key] = [t for t in TYPES if t in both]
            elif key == "properties":
                props = dict(out[key])
                for name, sub in value.items():
                    props[name] = {"allOf": [props[name], sub]} if name in props else sub
                out[key] = props
            elif key == "required":
                out[key] = list(dict.fromkeys([*out[key], *value]))
            elif key in ("additionalProperties", "unevaluatedProperties"):
                a, b = out[key], value
                out[key] = False if a is False or b is False else b if a is True else a if b is True else {
                    "allOf": [a, b]}
            elif key in ("minimum", "exclusiveMinimum", "minLength", "minItems", "maximum", "exclusiveMaximum",
                         "maxLength", "maxItems"):
                if isinstance(out[key], bool) != isinstance(value, bool):
                    raise SchemaError(f"{key} as a number and as draft 4's flag are not merged here")
                low = key.startswith(("min", "exclusiveMin"))
                out[key] = (max if low else min)(out[key], value) if not isinstance(value, bool) else (
                    out[key] or value)
            elif key in ANNOTATIONS:
                continue
            elif key in ("anyOf", "oneOf") and out[key] != value:
                raise SchemaError(f"two {key} lists in one schema (through allOf or $ref) are not merged here")
            elif out[key] != value:
                raise SchemaError(f"schemas that differ in {key!r} are not merged here (allOf, or $ref beside "
                                  "other keywords)")
    if prefixed and items_all:
        raise SchemaError("one member's items and another's prefixItems are not merged here (allOf, or $ref beside "
                          "other keywords)")
    props = dict(out.get("properties", {}))
    required = out.get("required", [])
    for declared, extra in closed:  # keys a member does not declare take what its other keys take
        for name in [*props, *required]:
            if name in declared:
                continue
            if extra is False:
                if name in required:
                    return False
                props.pop(name, None)
            else:
                props[name] = {"allOf": [props.get(name, True), extra]}
    if "properties" in out or props:
        out["properties"] = props
    return out


KINDS = ("object", "array", "string", "number", "boolean", "null")


def _kinds(node: Any) -> set[str]:
    """The kinds of JSON value a merged schema node may accept (integers are numbers); every kind where that
    takes more than its `type`, `const` or `enum` to tell."""
    if node is False:
        return set()
    if not isinstance(node, dict):
        return set(KINDS)
    out = set(KINDS)
    if "type" in node:
        out &= {"number" if k == "integer" else k for k in _types(node) or ()}
    values = _values(node)
    if values is not None:
        out &= {_kind_of(v) for v in values}
    return out


def _kind_of(v: Any) -> str:
    kind = _type_of(v)
    return "number" if kind == "integer" else kind


def _values(node: Any) -> list | None:
    """The values a merged node admits at most (its `const` or `enum`), None where it does not list them."""
    if isinstance(node, dict):
        if "const" in node:
            return [node["const"]]
        if isinstance(node.get("enum"), list):
            return node["enum"]
    return None


def _member(node: dict, name: str) -> Any:
    """The schema an object node holds the value of key `name` to."""
    props = node.get("properties", {})
    return props[name] if name in props else node.get("additionalProperties", True)


def _disjoint(a: Any, b: Any, comp: _Compiler, depth: int = 8) -> bool:
    """Whether no value passes both merged nodes, as far as plain reasons show: no kind in common, listed values
    none equal, or objects (their only kind in common) where one requires a key whose value the other holds to a
    schema no value of it passes (or forbids it)."""
    if a is False or b is False:
        return True
    if a is True or b is True or depth <= 0:
        return False
    va, vb = _values(a), _values(b)
    if va is not None and vb is not None and not any(_json_equal(x, y) for x in va for y in vb):
        return True
    shared = _kinds(a) & _kinds(b)
    if not shared:
        return True
    if shared != {"object"}:
        return False
    for one, other in ((a, b), (b, a)):
        required = one.get("required", [])
        for name in required if isinstance(required, list) else []:
            mine, theirs = _member(one, name), _member(other, name)
            if theirs is False:
                return True
            if mine is False or theirs is True or not isinstance(theirs, dict) or not isinstance(mine, dict | bool):
                continue
            if _disjoint(_merge([mine], comp, []), _merge([theirs], comp, []), comp, depth - 1):
                return True
    return False


def _same_but_required(nodes: list) -> bool:
    """Objects alike in all but `required` (their annotations aside), each key they require declared: their
    automata write the same keys in the same order with the same values' automata, so each reads what another
    writes of the values it accepts."""
    def rest(node: Any) -> Any:
        return {k: v for k, v in node.items() if k != "required" and k not in ANNOTATIONS}

    if not nodes or not all(isinstance(m, dict) and _kinds(m) == {"object"} and isinstance(m.get("properties"), dict)
                            and all(r in m["properties"] for r in m.get("required", [])) for m in nodes):
        return False
    return all(schema_text(rest(m)) == schema_text(rest(nodes[0])) for m in nodes)  # key order too


def _pattern_only(node: Any) -> bool:
    """A string by a `pattern` alone: its automaton writes and reads each character in one form (`code_point`)."""
    return (isinstance(node, dict) and "pattern" in node and node.get("type", "string") == "string"
            and all(k in ("type", "pattern") or (k in ANNOTATIONS and k != "format") for k in node))


def _check_keywords(node: dict) -> None:
    """The types of the keywords `_merge` combines (others are checked where they compile)."""
    for key in ("minimum", "maximum"):
        if key in node and (isinstance(node[key], bool) or not isinstance(node[key], int | float)):
            raise SchemaError(f"{key} must be a number")
    for key in ("exclusiveMinimum", "exclusiveMaximum"):
        if key in node and not isinstance(node[key], int | float):
            raise SchemaError(f"{key} must be a number")
    for key in ("minLength", "maxLength", "minItems", "maxItems"):
        _count(node, key, 0)
    if "properties" in node and not isinstance(node["properties"], dict):
        raise SchemaError("properties must be an object")
    if "required" in node and (not isinstance(node["required"], list)
                               or not all(isinstance(r, str) for r in node["required"])):
        raise SchemaError("required must be a list of property names")
    if "type" in node:
        _types(node)


def _json_equal(a: Any, b: Any) -> bool:
    """Equality as JSON Schema compares instances: 1 == 1.0, but true is no number."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_json_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _types(node: dict) -> list[str] | None:
    kind = node.get("type")
    if kind is None:
        return None
    kinds = kind if isinstance(kind, list) else [kind]
    for k in kinds:
        if not isinstance(k, str) or k not in TYPES:
            raise SchemaError(f"unknown type {k!r}")
    return kinds


def _type_of(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "integer" if v == int(v) else "number"
    if isinstance(v, str):
        return "string"
    return "array" if isinstance(v, list) else "object"


def _by_width(a: int, b: int | None, widest: int) -> list[tuple[str, str]]:
    """The naturals a..b (b None: to `widest` digits) as runs of one width each: (first, last) digit strings."""
    runs = []
    for width in range(len(str(a)), (widest if b is None else len(str(b))) + 1):
        lo = max(a, 10 ** (width - 1) if width > 1 else 0)
        hi = 10 ** width - 1 if b is None else min(b, 10 ** width - 1)
        if lo <= hi:
            runs.append((str(lo), str(hi)))
    return runs


def _split(d: Decimal) -> tuple[int, str]:
    """A non-negative decimal's whole part and its fraction's digits (no trailing zeros)."""
    whole = int(d)
    frac = format(d - whole, "f")
    return whole, frac.split(".")[1].rstrip("0") if "." in frac else ""


def _count(node: dict, key: str, default: int | None) -> int | None:
    v = node.get(key, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or v < 0 or v != int(v):
        raise SchemaError(f"{key} must be a non-negative integer")
    return int(v)


def _bound(node: dict, key: str, excl: str, *, low: bool) -> tuple[float | None, bool]:
    """The bound (value, open) of one side, from `minimum` / `exclusiveMinimum` (a number, or draft 4's flag).
    A bound past what a number written here can reach (10^INT_DIGITS) bounds nothing."""
    val, is_open = node.get(key), False
    ex = node.get(excl)
    for name, v in ((key, val), (excl, ex)):
        if v is not None and not (isinstance(v, int | float) and (isinstance(v, int) or math.isfinite(v))):
            raise SchemaError(f"{name} must be a finite number")  # draft 4's flags (bool) pass, as ints
    if isinstance(val, bool):
        raise SchemaError(f"{key} must be a finite number")
    if isinstance(ex, bool):
        is_open = ex and val is not None
    elif ex is not None and (val is None or (ex >= val if low else ex <= val)):
        val, is_open = ex, True
    if val is not None and abs(val) >= 10 ** INT_DIGITS and (val < 0) == low:
        return None, False  # below (above) every number the automaton writes
    return val, is_open


# ---------------------------------------------------------------------------------------------- the DFA


def _state_id(ids: dict, order: list, key: Any, limit: int = MAX_DFA) -> int:
    """The DFA state of `key` (a set of NFA states, a tuple of branch states), numbered when first found; a
    SchemaError past `limit` states."""
    i = ids.get(key)
    if i is None:
        if len(order) >= limit:
            raise SchemaError(f"the schema is too large to enforce (over {limit} automaton states)")
        i = ids[key] = len(order)
        order.append(key)
    return i


def _build(nfa: _Nfa, start: int, final: int, limit: int = MAX_DFA) -> SchemaDfa:
    """Subset construction over byte classes (bytes no edge tells apart), then the trim: transitions into states
    from which no accepting state is reached are removed. A SchemaError past `limit` states."""
    masks = sorted({m for out in nfa.edges for m, _ in out})
    sig: dict[tuple[bool, ...], int] = {}
    byte_class = np.zeros(256, np.int64)
    for b in range(256):
        key = tuple(bool(m >> b & 1) for m in masks)
        byte_class[b] = sig.setdefault(key, len(sig))
    n_classes = len(sig)
    classes_of = {m: sorted({int(byte_class[b]) for b in range(256) if m >> b & 1}) for m in masks}
    closures: dict[frozenset[int], frozenset[int]] = {}

    def closure(states: frozenset[int]) -> frozenset[int]:
        got = closures.get(states)
        if got is None:
            seen, todo = set(states), list(states)
            while todo:
                for t in nfa.eps[todo.pop()]:
                    if t not in seen:
                        seen.add(t)
                        todo.append(t)
            if nfa.absorbing and (held := seen & nfa.absorbing):
                a = min(held)
                seen = closure(frozenset([a])) if states != frozenset([a]) else seen
            got = closures[states] = frozenset(seen)
        return got

    first = closure(frozenset([start]))
    ids: dict[frozenset[int], int] = {first: 0}
    order = [first]
    rows: list[list[int]] = []
    work = 0
    for cur in order:  # grows as states are found
        work += len(cur)
        if work > MAX_SUBSET_WORK:
            raise SchemaError(f"the schema is too large to enforce (its automaton's states hold over "
                              f"{MAX_SUBSET_WORK} states of the expression)")
        moves: dict[int, set[int]] = defaultdict(set)
        for s in cur:
            for m, t in nfa.edges[s]:
                for c in classes_of[m]:
                    moves[c].add(t)
        row = [-1] * n_classes
        for c, targets in moves.items():
            row[c] = _state_id(ids, order, closure(frozenset(targets)), limit)
        rows.append(row)
    table = np.array(rows, np.int32).reshape(len(order), n_classes)
    accept = np.array([final in s for s in order], bool)
    counted = np.array([bool(s & nfa.ws_states) for s in order], bool)
    # the trim: live states reach an accepting one
    live = accept.copy()
    while True:
        nxt = live | (live[np.maximum(table, 0)] & (table >= 0)).any(axis=1)
        if (nxt == live).all():
            break
        live = nxt
    if not live[0]:
        raise EmptySchema("the schema admits no value the server can write")
    table = np.where((table >= 0) & live[np.maximum(table, 0)], table, -1).astype(np.int32)
    terminal = accept & (table < 0).all(axis=1)
    plain = sorted({int(byte_class[b]) for b in range(256) if PLAIN >> b & 1})
    d = np.arange(table.shape[0])
    self_plain = (table[:, plain] == d[:, None]).all(axis=1) & ~counted
    return SchemaDfa(table, byte_class, accept, terminal, counted, self_plain)


_COMPILED: OrderedDict[str, SchemaDfa | SchemaError] = OrderedDict()  # by text: an automaton, or the refusal
_CACHED_BYTES = 0  # the kept automata's bytes (`_nbytes`)


def _nbytes(got: SchemaDfa | SchemaError) -> int:
    return 0 if isinstance(got, SchemaError) else sum(a.nbytes for a in (got.table, got.byte_class, got.accept,
                                                                          got.terminal, got.counted, got.self_plain))


_LOCK = threading.Lock()


def schema_text(schema: Any) -> str:
    """The schema's text as the cache and the engine key it: `json.dumps`, key order kept (it is the order
    properties are written in)."""
    try:
        return json.dumps(schema, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise SchemaError(f"the schema is not JSON: {e}") from None


def _cached(key: str, build: Any) -> SchemaDfa:
    """The automaton cached under `key`, or `build()`'s, kept (a refusal too, so that a schema refused once costs
    no second build); any error in reading the schema that is not a SchemaError (a keyword of a type nothing here
    checked, a schema nested past the interpreter's depth) becomes one, so that the API answers it as the client's
    error. Safe across threads (the build itself runs outside the lock). Kept: the `MAX_CACHED` automata last
    asked, within `MAX_CACHED_BYTES`."""
    global _CACHED_BYTES
    with _LOCK:
        got = _COMPILED.get(key)
        if got is not None:
            _COMPILED.move_to_end(key)
    if isinstance(got, SchemaError):
        raise type(got)(str(got))  # a fresh exception, its kind kept (an EmptySchema stays one)
    if got is not None:
        return got
    try:
        got = build()
    except SchemaError as e:
        got = e
    except RecursionError:
        got = SchemaError("the schema nests too deeply to enforce")
    except (TypeError, ValueError, AttributeError, KeyError, IndexError, OverflowError, UnicodeError) as e:
        got = SchemaError(f"the schema could not be read ({type(e).__name__}: {e})")
    with _LOCK:
        if key not in _COMPILED:
            _COMPILED[key] = got
            _CACHED_BYTES += _nbytes(got)
        while len(_COMPILED) > 1 and (len(_COMPILED) > MAX_CACHED or _CACHED_BYTES > MAX_CACHED_BYTES):
            _CACHED_BYTES -= _nbytes(_COMPILED.popitem(last=False)[1])
    if isinstance(got, SchemaError):
        raise type(got)(str(got))  # a fresh exception, its kind kept (an EmptySchema stays one)
    return got


def _with_lead(n: _Nfa, body: tuple[int, int]) -> tuple[int, int]:
    """`body` after at most TOP_WS whitespace bytes (the "\\n\\n" after a model's reasoning)."""
    return n.seq(n.repeat(lambda: n.cls(WS), 0, TOP_WS), body)


def compile_schema(schema: Any) -> SchemaDfa:
    """The byte automaton of the answers `schema` (a parsed JSON Schema, or its `schema_text`) admits; cached.
    Raises SchemaError where it cannot be enforced."""
    text = schema if isinstance(schema, str) else schema_text(schema)

    def build() -> SchemaDfa:
        comp = _Compiler(json.loads(text))
        return _build(comp.nfa, *_with_lead(comp.nfa, comp.value(comp.root)))

    return _cached(text, build)


def compile_calls(tools: list[dict[str, Any]], fmt: str = "json") -> SchemaDfa:
    """The automaton of one call of any of `tools` (``{"name", "parameters"}``, `tool_call_spec`'s entries) as the
    chat template writes it, in its form `fmt` (`chat.CallSyntax`): "json",
    ``<tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>``, ARGS a JSON object the tool's parameters
    accept (any JSON object where they cannot be enforced here; none but ``{}`` without parameters); "xml",
    ``<tool_call>\\n<function=NAME>\\n`` parameters ``</function>\\n</tool_call>`` (`_xml_call`). The tags are read
    as `OPEN_TAG` and `CLOSE_TAG` (only their tokens write them, never inside a value). Terminal where the call
    closes. Cached by the tools' text, as `compile_schema`'s automata; raises SchemaError past `MAX_DFA` states
    (`call_groups` then splits the tools)."""
    call = _call_of(fmt)

    def build() -> SchemaDfa:
        n = _Nfa()
        return _build(n, *n.alt(*[call(n, tool) for tool in tools]))

    return _cached(_calls_key(fmt) + schema_text(tools), build)


def _call_of(fmt: str) -> Any:
    """The fragment maker of one call in the form `fmt` ("json": `_call`, "xml": `_xml_call`)."""
    if fmt not in CALL_FORMATS:
        raise SchemaError(f"unknown tool-call format {fmt!r}")
    return _xml_call if fmt == "xml" else _call


def _calls_key(fmt: str) -> str:
    """The prefix a group of tools' call automaton (and its masks) is kept under, by form."""
    return "xmlcalls:" if fmt == "xml" else "calls:"


def _call(n: _Nfa, tool: dict[str, Any]) -> tuple[int, int]:
    """A call of `tool` as a fragment of `n` (`compile_calls`)."""
    params = tool.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}, "additionalProperties": False}
    try:  # the tool's arguments alone first (cached): where they cannot be enforced, any object
        args = _tool_arguments(params)
    except SchemaError:
        args = compile_schema({"type": "object"})
    head = f'\n{{"name": {json.dumps(tool["name"], ensure_ascii=False)}, "arguments": '
    return n.seq(n.lit(OPEN_TAG + head.encode()), _embed(n, args), n.lit(b"}\n" + CLOSE_TAG))


XML_TEXT = _span(0x00, RESERVED - 1)  # the bytes of an XML call's raw value (any text)
XML_KEY = _span(0x20, RESERVED - 1) & ~_bits(b"<>")  # the bytes of a parameter's name the tool does not declare
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def _xml_call(n: _Nfa, tool: dict[str, Any]) -> tuple[int, int]:
    """A call of `tool` in the XML form as a fragment of `n` (`compile_calls`): ``<tool_call>\\n<function=NAME>\\n``,
    its parameters (`_xml_arguments`; any parameters, those of ``{"type": "object"}``, where they cannot be
    enforced here, as the JSON form takes any object then), then
    ``</function>\\n</tool_call>``."""
    params = tool.get("parameters")
    try:
        args = _xml_arguments(params)
    except SchemaError:
        args = _xml_arguments({"type": "object"})
    head = f"\n{FUNCTION}{tool['name']}>\n".encode()
    return n.seq(n.lit(OPEN_TAG + head), _embed(n, args), n.lit(f"{END_FUNCTION}\n".encode() + CLOSE_TAG))


_XML_ROOT_REFUSED = (*UNSUPPORTED, "anyOf", "oneOf", "enum", "const")  # keywords at the parameters' root


def _xml_object(params: Any, lenient: bool = False) -> tuple[_Compiler, dict[str, Any], list[str], Any]:
    """A tool's parameters as the XML form writes them: (their compiler, each declared name's schema in the order
    `_Compiler.obj` writes keys (the properties, then the required names not among them, which take what extra
    keys take), the required names, what a name it does not declare takes: False where it declares any, as
    `obj` writes no extra key beside declared ones). SchemaError where the parameters' root is no plain object
    schema (`anyOf` / `oneOf` / `enum` there, keywords not enforced) or a name cannot be written in a
    ``<parameter=NAME>`` tag (empty, or holding ``<``, ``>`` or a newline); EmptySchema where it admits nothing.
    `lenient` (the names and schemas values are read by, `xml_param_kinds`): those root keywords and names are
    passed over, not refused (the calls then take any parameters, `_xml_call`, yet a declared one is still read
    by its schema)."""
    root = _NO_PARAMETERS if params is None else params
    comp = _Compiler(root)
    node = _merge([root, {"type": "object"}], comp, [])
    if node is False:
        raise EmptySchema("the parameters admit no value")
    for key in _XML_ROOT_REFUSED:
        if key in node and not lenient:
            raise SchemaError(f"parameters with {key!r} at their root are not enforced in the XML form")
    _check_keywords(node)
    props, required = node.get("properties", {}), node.get("required", [])
    extra = node.get("additionalProperties", node.get("unevaluatedProperties", True))
    names = list(props) + [r for r in dict.fromkeys(required) if r not in props]
    for name in names:
        if not lenient and (not name or any(c in name for c in "<>\n")):
            raise SchemaError(f"the parameter name {name!r} cannot be written in the XML form")
    return comp, {name: props.get(name, extra) for name in names}, required, False if names else extra


def _value_kinds(comp: _Compiler, schema: Any) -> frozenset[str] | None:
    """The kinds of JSON value `schema` admits (`chat.ParamKinds`: integers as "number"; None: any kind), as
    `_Compiler.value` reads its type: the `type`, the listed values' kinds, any of `anyOf` / `oneOf`'s branches,
    or the kind its keywords assert."""
    node = _merge([schema], comp, [])
    if node is False:
        return frozenset()
    if not isinstance(node, dict):
        return None
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list):
            rest = {k: v for k, v in node.items() if k != key}
            each = [_value_kinds(comp, {"allOf": [rest, sub]}) for sub in node[key]]
            return None if any(k is None for k in each) else frozenset().union(*each)
    types = _types(node)
    kinds = None if types is None else {"number" if t == "integer" else t for t in types}
    values = _values(node)
    if values is not None:
        listed = {_kind_of(v) for v in values}
        kinds = listed if kinds is None else kinds & listed
    if kinds is None:
        if "properties" in node or "required" in node or "additionalProperties" in node:
            kinds = {"object"}
        elif "items" in node or "prefixItems" in node:
            kinds = {"array"}
        elif any(k in node for k in BOUNDS):
            kinds = {"number"}
        elif "minLength" in node or "maxLength" in node or "pattern" in node:
            kinds = {"string"}
    return None if kinds is None else frozenset(kinds)


def xml_param_kinds(params: Any) -> ParamKinds:
    """The kinds of value each of a tool's parameters admits (`chat.ParamKinds`, by which the XML form's values
    are read), by the names and schemas `_xml_arguments` writes them by (also where a keyword the automaton does
    not enforce, at the root or in a parameter, leaves its calls any parameters: a string parameter is still read
    as the raw text, `_xml_object`'s `lenient`); any kind for a parameter whose schema cannot be read, and for
    every one where the parameters' root is no object schema `_xml_object` reads; for one that admits a string
    beside other kinds, which JSON texts are values of those (`_json_check`). Cached by the schema's text."""
    try:
        text = schema_text(params)
    except SchemaError:
        return ParamKinds()
    return _param_kinds(text)


_UNREADABLE = (SchemaError, RecursionError, TypeError, ValueError, AttributeError, KeyError, IndexError)


@lru_cache(maxsize=1024)
def _param_kinds(text: str) -> ParamKinds:
    try:
        comp, schemas, _, extra = _xml_object(json.loads(text), lenient=True)
    except _UNREADABLE:
        return ParamKinds()
    kinds = {name: _read_kinds(comp, sub) for name, sub in schemas.items()}
    extra_kinds = None if extra is False else _read_kinds(comp, extra)
    checks = {name: _json_check(comp.root, schemas[name], k) for name, k in kinds.items()}
    return ParamKinds(kinds, extra_kinds, {name: c for name, c in checks.items() if c is not None},
                      None if extra is False else _json_check(comp.root, extra, extra_kinds))


def _json_check(root: Any, schema: Any, kinds: frozenset[str] | None) -> Callable[[str], bool] | None:
    """For a parameter whose values are written in the "text" form beside other kinds (`chat.value_form`: a string
    or, say, a number), whether a JSON text of another kind is a value its schema accepts: one its automaton (what
    the constraint writes where the parameter admits no string) reads, so a number within its bounds, an integer
    where it asks for one (`chat.ParamKinds.json_ok`; else the parser reads the text as the string), or one nested
    past what that automaton reads (`_reads_json`). None for other parameters, and where that automaton cannot be
    built (then any JSON text of an admitted kind is the value). Its other limits stay: a number it does not write
    (more than `FLOAT_DIGITS` digits in a bounded number with a fraction, an exponent beside bounds, more than
    `INT_DIGITS` digits) or a whitespace run past `MAX_WS` is read as the string, which the schema also accepts."""
    if kinds is None or value_form(kinds) != "text":
        return None
    try:
        return partial(_reads_json, _own_dfa(root, schema))
    except _UNREADABLE:
        return None


def _own_dfa(root: Any, schema: Any) -> SchemaDfa:
    """The automaton of `schema` alone (a parameter's, `$ref`s read under `root`), on an NFA of its own; raises what
    `_build` raises (EmptySchema where it admits nothing, SchemaError where it cannot be built)."""
    comp = _Compiler(root)
    return _build(comp.nfa, *comp.merged([schema]))


def _reads_json(dfa: SchemaDfa, text: str) -> bool:
    """Whether `dfa`, a schema's automaton, takes the JSON `text` (one `chat.strict_json` reads) as far as it can
    tell: it reads the text, or the value nests objects and arrays deeper than the automaton reads a value the
    schema leaves free (`FREE_DEPTH`), a limit of the automaton, not of the schema, so such a value (a free
    object's payload) is its JSON, as before the automaton was asked, not the string."""
    if dfa.matches(text.encode()):
        return True
    try:
        return _nests_past(json.loads(text), FREE_DEPTH)
    except RecursionError:  # nested past the parser's own depth: past the automaton's too
        return True


def _nests_past(value: Any, levels: int) -> bool:
    """Whether `value` nests objects and arrays more than `levels` deep (a scalar nests none)."""
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
    if items is None:
        return False
    return levels == 0 or any(_nests_past(v, levels - 1) for v in items)


def _read_kinds(comp: _Compiler, schema: Any) -> frozenset[str] | None:
    """`_value_kinds` of one parameter's schema, None (any kind) where it cannot be read (a `$ref` to nothing, an
    unknown type), which leaves the other parameters read by theirs."""
    try:
        return _value_kinds(comp, schema)
    except _UNREADABLE:
        return None


def _xml_arguments(params: Any) -> SchemaDfa:
    """The automaton of a tool's parameters in the XML form (cached by their text): in the order `_xml_object`
    gives, each a declared name's ``<parameter=KEY>\\n`` VALUE ``\\n</parameter>\\n``, every required one present,
    the others may be left out; where the tool declares none, any names (`XML_KEY` bytes) as extra keys take them.
    A VALUE is by its schema's kinds (`_value_kinds`, `chat.value_form`): listed values (`enum`, `const`) each as
    the templates write it (`_listed_texts`: a string raw, others `json.dumps`); a string, or a string beside
    other kinds, or any kind: any text in which no ``</parameter>`` would end the value (`_xml_text`; a string's
    length, pattern or format are not enforced here; beside other kinds, a text is read as a value of another kind
    only where the schema accepts it, `_json_check`, so a number written there is within the schema's bounds, and
    any other text, ``-5`` beside ``"minimum": 0``, is a string); no string: JSON text the schema accepts (its
    `_Compiler.value`, less a string in which ``</parameter>`` would end the value, `_xml_json`; a boolean or null
    also as ``True``, ``False``, ``None``, `_python_literals`). The newline
    before ``</parameter>`` may be left out (as models write it), where the value then reads back the same
    (`chat.read_xml_value`)."""

    def build() -> SchemaDfa:
        comp, schemas, required, extra = _xml_object(params)
        n = comp.nfa
        parts = []
        for name, sub in schemas.items():
            entry = _xml_entry(comp, n.lit(f"{PARAMETER}{name}>\n".encode()), sub)
            parts.append(entry if name in required else n.opt(entry))
        if extra is not False:
            key = n.seq(n.lit(PARAMETER.encode()), n.cls(XML_KEY), n.star(n.cls(XML_KEY)), n.lit(b">\n"))
            parts.append(n.star(_xml_entry(comp, key, extra)))
        return _build(n, *n.seq(*parts))

    return _cached("xmlargs:" + schema_text(params), build)


def _xml_entry(comp: _Compiler, key: tuple[int, int], schema: Any) -> tuple[int, int]:
    """One parameter: its `key` fragment, its value by `schema` (`_xml_arguments`), then ``\\n</parameter>\\n``."""
    n = comp.nfa
    node = _merge([schema], comp, [])
    if node is False:
        return n.empty()
    kinds = _value_kinds(comp, schema)
    form = value_form(kinds)
    values = _values(node)
    if values is not None:
        texts = [t for v in values if kinds is None or _kind_of(v) in kinds for t in _listed_texts(v, form)]
        value = _xml_written(n, texts)
    elif form == "json":
        literals = _xml_written(n, _python_literals(comp.root, schema, kinds))
        value = n.alt(n.seq(_xml_json(comp, schema), n.opt(n.lit(b"\n"))), literals)
    else:
        value = _xml_text(n)
    return n.seq(key, value, n.lit(f"{END_PARAMETER}\n".encode()))


def _xml_json(comp: _Compiler, schema: Any) -> tuple[int, int]:
    """JSON text `schema` accepts (its `_Compiler.merged`) in which no ``</parameter>`` would end the value
    (`chat.read_xml_value`): JSON text holds a ``<`` only inside a string, which may hold ``</parameter>``, spaces
    and a `VALUE_NEXT` tag (no raw line break or tab); where the text can hold a ``<``, its automaton's product
    with the search for such an end (`_no_value_end`), else the fragment as it is."""
    n = comp.nfa
    frag = comp.merged([schema])
    if not _reads_byte(n, frag[0], ord("<")):
        return frag
    try:
        dfa = _own_dfa(comp.root, schema)
    except EmptySchema:
        return n.empty()
    return _embed(n, _product([dfa, _no_value_end()], all_of=True))


def _reads_byte(n: _Nfa, start: int, byte: int) -> bool:
    """Whether an edge of `n` reached from `start` reads `byte`."""
    seen, todo = {start}, [start]
    while todo:
        s = todo.pop()
        for mask, t in n.edges[s]:
            if mask >> byte & 1:
                return True
            if t not in seen:
                seen.add(t)
                todo.append(t)
        for t in n.eps[s]:
            if t not in seen:
                seen.add(t)
                todo.append(t)
    return False


def _xml_written(n: _Nfa, texts: list[str]) -> tuple[int, int]:
    """Each of `texts` as a value written before its ``</parameter>`` (`_xml_entry`), in each way that reads back
    as itself (`chat.read_xml_value`): followed by the template's newline, and without it where the text does not
    end in one; none for a text an end inside would cut."""
    forms = [f for t in dict.fromkeys(texts) for f in dict.fromkeys((t + "\n", t)) if _reads_back(f, t)]
    return n.alt(*[n.lit(f.encode()) for f in forms]) if forms else n.empty()


def _reads_back(written: str, text: str) -> bool:
    """Whether a value `written` before ``</parameter>``, then the next tag, is read back as `text`."""
    return read_xml_value(f"{written}{END_PARAMETER}\n{END_FUNCTION}", 0) == (text, len(written) + len(END_PARAMETER))


def _listed_texts(value: Any, form: str) -> list[str]:
    """How the templates write a listed value (`enum`, `const`) of a parameter written in `form`
    (`chat.value_form`): a string raw, others as JSON, and in the "json" form a boolean or null also as
    ``value|string`` writes it (`chat.PYTHON_LITERALS`, which `chat.xml_value` reads back)."""
    if isinstance(value, str):
        return [value]
    text = json.dumps(value, ensure_ascii=False)
    return [text, PYTHON_LITERALS[text]] if form == "json" and text in PYTHON_LITERALS else [text]


def _python_literals(root: Any, schema: Any, kinds: frozenset[str]) -> list[str]:
    """The spellings ``value|string`` writes (``True``, ``False``, ``None``: `chat.PYTHON_LITERALS`) of the JSON
    literals a "json"-form value of `schema` (under `root`, for its `$ref`s) is accepted as: those its own
    automaton accepts (none where that cannot be built on its own)."""
    wanted = [(js, py) for js, py in PYTHON_LITERALS.items() if ("null" if js == "null" else "boolean") in kinds]
    if not wanted:
        return []
    try:
        dfa = _own_dfa(root, schema)
    except SchemaError:
        return []
    return [py for js, py in wanted if dfa.matches(js.encode())]


def _xml_text(n: _Nfa) -> tuple[int, int]:
    """Any text (`XML_TEXT` bytes) in which no ``</parameter>`` would end a value (`chat.read_xml_value`: none
    followed by whitespace and a `VALUE_NEXT` tag), each point of it one where it may end: the states of a search
    for such an end (`_value_end_search`)."""
    table, count = _value_end_search()
    base = [n.state() for _ in range(count)]
    out = n.state()
    for s, row in enumerate(table):
        for mask, t in row:
            n.edges[base[s]].append((mask, base[t]))
        n.link(base[s], out)
    return base[0], out


@lru_cache(maxsize=1)
def _value_end_search() -> tuple[list[list[tuple[int, int]]], int]:
    """The automaton of a search for a value's end (`chat.read_xml_value`) over `XML_TEXT` bytes, as (each state's
    edges: (byte mask, state), the number of states), state 0 the start; no edge completes an end. A state is the
    set of places in ``</parameter>`` WHITESPACE* TAG the text read so far may stop at (the subset
    construction of that pattern after any text)."""
    head = END_PARAMETER.encode()
    space = set(XML_SPACE.encode())
    tags = [t.encode() for t in VALUE_NEXT]
    found = object()  # a place past a whole tag: an end

    def step(places: frozenset, b: int) -> frozenset | None:
        nxt = {("head", 0)}
        for kind, i, *tag in places:
            if kind == "head" and head[i] == b:
                nxt.add(("head", i + 1) if i + 1 < len(head) else ("space", 0))
            elif kind == "space":
                if b in space:
                    nxt.add(("space", 0))
                nxt |= {("tag", 1, t) if len(t) > 1 else found for t in tags if t[0] == b}
            elif kind == "tag" and tag[0][i] == b:
                nxt.add(("tag", i + 1, tag[0]) if i + 1 < len(tag[0]) else found)
        return None if found in nxt else frozenset(nxt)

    seen = set(head) | space | {c for t in tags for c in t}  # bytes the search tells apart; the rest as one
    rest = min(b for b in range(RESERVED) if b not in seen)
    classes = [(b, 1 << b) for b in sorted(seen)] + [(rest, XML_TEXT & ~_bits(seen))]
    start = frozenset({("head", 0)})
    ids, order, table = {start: 0}, [start], []
    for places in order:  # grows as states are found
        targets: dict[int, int] = defaultdict(int)
        for b, mask in classes:
            got = step(places, b)
            if got is not None:
                targets[_state_id(ids, order, got)] |= mask
        table.append([(m, t) for t, m in targets.items()])
    return table, len(order)


@lru_cache(maxsize=1)
def _no_value_end() -> SchemaDfa:
    """`_value_end_search` as an automaton (every state accepting; a reserved byte reads nothing): the texts in
    which no ``</parameter>`` would end a value, for a product with another automaton (`_xml_json`)."""
    rows, count = _value_end_search()
    full = np.full((count, 256), -1, np.int32)
    for s, row in enumerate(rows):
        for mask, t in row:
            full[s, [b for b in range(256) if mask >> b & 1]] = t
    _, rep, byte_class = np.unique(full.T, axis=0, return_index=True, return_inverse=True)
    every, none = np.ones(count, bool), np.zeros(count, bool)
    return SchemaDfa(np.ascontiguousarray(full[:, rep]), byte_class.reshape(256).astype(np.int64), every, none,
                     none, none)


def call_groups(tools: list[dict[str, Any]], fmt: str = "json") -> list[tuple[list[dict[str, Any]], SchemaDfa]]:
    """`tools` in groups whose one-call automaton (`compile_calls` in the form `fmt`) fits `MAX_DFA` states: the
    whole set where it fits, else each half's groups (the automata cached, refusals too, so a set is split once).
    Raises SchemaError where a tool's call alone does not fit."""
    try:
        return [(tools, compile_calls(tools, fmt))]
    except SchemaError:
        if len(tools) == 1:
            raise
    half = len(tools) // 2
    return call_groups(tools[:half], fmt) + call_groups(tools[half:], fmt)


def compile_tool_calls(spec: str) -> SchemaDfa:
    """The automaton of a whole reply made of tool calls only, of `spec`'s tools (`tool_call_spec`, in its form),
    after at most `TOP_WS` whitespace bytes; with `parallel`, more calls after a newline each; where the spec holds
    an `answer` schema, a reply may instead be such an answer. One automaton for the reply, bounded by `MAX_DFA`:
    the engine runs replies as `tool_calls.ToolCallReply` (calls by `compile_calls`' groups, the glue between them
    and an answer as automata side by side, so no set is too large); this is the language it is held to (its
    tests).
    Cached as `compile_schema`'s automata; raises SchemaError where no call can be written or it is too large."""

    def build() -> SchemaDfa:
        obj = json.loads(spec)
        n = _Nfa()
        make = _call_of(obj.get("format", "json"))
        call = n.alt(*[make(n, tool) for tool in obj["tools"]])  # `compile_calls`' fragments
        if obj.get("parallel", True):
            sep = n.lit(b"\n")
            n.link(call[1], sep[0])
            n.link(sep[1], call[0])
        if obj.get("answer") is not None:
            answer = compile_schema(obj["answer"])  # with its own lead
            reply = n.alt(_with_lead(n, call), _embed(n, answer))
        else:
            reply = _with_lead(n, call)
        return _build(n, *reply)

    return _cached("tools:" + spec, build)


def tags_as_bytes(text: bytes) -> bytes:
    """`text` with the tool-call tags as a tool-call automaton reads them (`OPEN_TAG`, `CLOSE_TAG`)."""
    for tag, b in TAGS:
        text = text.replace(tag, b)
    return text


def tags_as_text(data: bytes) -> bytes:
    """A tool-call automaton's bytes with the tags written as their text (what the reply's parser reads)."""
    for tag, b in TAGS:
        data = data.replace(b, tag)
    return data


def _tool_arguments(params: Any) -> SchemaDfa:
    """The automaton of a tool's arguments: a JSON object its parameters' schema accepts (cached by its text)."""

    def build() -> SchemaDfa:
        comp = _Compiler(params)
        return _build(comp.nfa, *comp.merged([params, {"type": "object"}]))

    return _cached("args:" + schema_text(params), build)


def _exactly_one(dfas: list[SchemaDfa]) -> SchemaDfa:
    """The product of `dfas`, accepting where exactly one of them accepts (untrimmed: the outer build trims)."""
    return _product(dfas, all_of=False)


def _product(dfas: list[SchemaDfa], all_of: bool) -> SchemaDfa:
    """The product of `dfas`, accepting where all of them accept (`all_of`) or exactly one does (untrimmed)."""
    keys = np.stack([d.byte_class for d in dfas], axis=1)  # [256, k]
    _, rep_bytes, byte_class = np.unique(keys, axis=0, return_index=True, return_inverse=True)
    start = tuple(d.start for d in dfas)
    ids, order, rows = {start: 0}, [start], []
    for cur in order:  # grows as states are found
        row = []
        for b in rep_bytes.tolist():
            nxt = tuple(int(d.table[s, d.byte_class[b]]) if s >= 0 else -1 for d, s in zip(dfas, cur))
            if max(nxt) < 0:
                row.append(-1)
                continue
            row.append(_state_id(ids, order, nxt))
        rows.append(row)
    want = len(dfas) if all_of else 1
    accept = np.array([sum(s >= 0 and bool(d.accept[s]) for d, s in zip(dfas, st)) == want for st in order], bool)
    counted = np.array([any(s >= 0 and bool(d.counted[s]) for d, s in zip(dfas, st)) for st in order], bool)
    table = np.array(rows, np.int32).reshape(len(order), len(rep_bytes))
    none = np.zeros(len(order), bool)
    return SchemaDfa(table, byte_class.reshape(256).astype(np.int64), accept, none, counted, none)


def _embed(n: _Nfa, dfa: SchemaDfa) -> tuple[int, int]:
    """A fragment of `n` that reads what `dfa` accepts (its states and counted whitespace kept)."""
    base = len(n.eps)
    for _ in range(dfa.num_states):
        n.state()
    end = n.state()
    class_bits = [0] * dfa.table.shape[1]
    for b in range(256):
        class_bits[int(dfa.byte_class[b])] |= 1 << b
    for d, row in enumerate(dfa.table.tolist()):
        targets: dict[int, int] = defaultdict(int)
        for c, t in enumerate(row):
            if t >= 0:
                targets[t] |= class_bits[c]
        n.edges[base + d] = [(m, base + t) for t, m in targets.items()]
        if dfa.accept[d]:
            n.link(base + d, end)
        if dfa.counted[d]:
            n.ws_states.add(base + d)
    return base + dfa.start, end


def compile_spec(spec: str) -> list[SchemaDfa]:
    """Build (and cache) what a `tool_call_spec` text's reply runs on (`tool_calls.ToolCallReply`): its tools'
    calls by groups (`call_groups`) and any answer schema's automaton. Raises SchemaError where that
    cannot be built (a tool whose call alone is past `MAX_DFA`, an answer schema that cannot be enforced)."""
    obj = json.loads(spec)
    if not isinstance(obj, dict) or not isinstance(obj.get("tools"), list) or not obj["tools"]:
        raise SchemaError("no tool to call")
    dfas = [dfa for _, dfa in call_groups(obj["tools"], obj.get("format", "json"))]
    if obj.get("answer") is not None:
        dfas.append(compile_schema(obj["answer"]))
    return dfas


def forget(prefix: str) -> None:
    """Drop the kept automata whose keys start with `prefix` (benchmarks and tests that time or watch a build)."""
    global _CACHED_BYTES
    with _LOCK:
        for key in [k for k in _COMPILED if k.startswith(prefix)]:
            _CACHED_BYTES -= _nbytes(_COMPILED.pop(key))


def precompile(params: Any) -> None:
    """Build (and cache) the automaton a request's sampling params name, if any: called on a thread that is not
    the engine's, so that a new schema's compile does not hold a step; a schema that cannot be enforced is left
    for the engine to refuse."""
    try:
        if getattr(params, "json_schema", None) is not None:
            compile_schema(params.json_schema)
        elif getattr(params, "tool_calls", None) is not None:
            compile_spec(params.tool_calls)
    except (SchemaError, ValueError, KeyError, TypeError, AttributeError):
        pass


def tool_call_spec(tools: list[dict[str, Any]], name: str | None, parallel: bool, answer: Any = None,
                   fmt: str = "json") -> str:
    """The text `compile_tool_calls` and `tool_calls.ToolCallReply` read for OpenAI function tools (`[{"type":
    "function", "function": {"name", "parameters"}}]`): every tool, or only `name`'s; `answer`, a JSON Schema the
    reply may follow instead of calling tools; `fmt`, the form calls are written in (`compile_calls`; the key
    "format" only where it is not "json")."""
    picked = [{"name": t["function"]["name"], "parameters": t["function"].get("parameters")}
              for t in tools if name is None or t["function"]["name"] == name]
    spec: dict[str, Any] = {"tools": picked, "parallel": parallel}
    if answer is not None:
        spec["answer"] = answer
    if fmt != "json":
        spec["format"] = fmt
    return json.dumps(spec, ensure_ascii=False, separators=(",", ":"))


# ---------------------------------------------------------------------------------------------- token masks


class SchemaVocab:
    """A schema's automaton read over a tokenizer's vocabulary (`JsonVocab`'s token tables): `allowed(state,
    ws)`, a bool [vocab_size] mask of every token read whole from the state (end-of-sequence ids where the value
    may end), kept as bitmaps for the `CACHE` states last asked (in `cache`, under `tag`, where several automata
    share one); the vocabulary's markup tokens only where `markup` (a tool-call reply's automaton, which reads the
    tags)."""

    CACHE = 1024

    def __init__(self, vocab: JsonVocab, dfa: SchemaDfa, markup: bool = False, cache: MaskCache | None = None,
                 tag: Any = None) -> None:
        self.vocab, self.dfa, self.markup, self.tag = vocab, dfa, markup, tag
        self.masks = cache if cache is not None else MaskCache(vocab.vocab_size, self.CACHE)  # (tag, state, ws)

    def allowed(self, state: int, ws: int) -> np.ndarray:
        v, dfa = self.vocab, self.dfa
        if not dfa.counted[state] or ws + v.ws_run <= MAX_WS:  # a run no token can overrun: as none
            ws = 0
        got = self.masks.get((self.tag, state, ws))
        if got is not None:
            return got
        allowed = np.zeros(v.vocab_size, bool)
        if dfa.accept[state]:
            allowed[v.eos] = True
        table, cls = dfa.table, dfa.byte_class
        alive = np.flatnonzero(table[state, cls[v.first]] >= 0)  # positions in `order`: first byte taken
        if dfa.self_plain[state]:  # string content through and through: allowed, nothing to read
            plain = v.plain[alive]
            allowed[v.order[alive[plain]]] = True
            alive = alive[~plain]
        states = np.full(alive.size, state, np.int64)
        runs = np.full(alive.size, ws, np.int64)
        j = 0
        while alive.size:
            ended = v.lens[alive] == j
            if ended.any():
                allowed[v.order[alive[ended]]] = True
                keep = ~ended
                alive, states, runs = alive[keep], states[keep], runs[keep]
                if not alive.size:
                    break
            b = v.flat[v.offsets[alive] + j]
            states = table[states, cls[b]].astype(np.int64)
            ok = states >= 0
            runs = np.where(_WS_TABLE[b] & dfa.counted[np.maximum(states, 0)], runs + 1, 0)
            ok &= runs <= MAX_WS
            alive, states, runs = alive[ok], states[ok], runs[ok]
            j += 1
        if not self.markup:
            allowed[v.markup] = False
        allowed[v.clash] = False  # a reserved byte outside a tag: no text's
        self.masks.put((self.tag, state, ws), allowed)
        return allowed


class SchemaState:
    """One answer's automaton under a schema (the interface of `json_mode.JsonState`): `advance` with each token
    it takes, `allowed` for the next sampling step; `think` a token id also allowed before the answer's first
    byte."""

    free = False  # never: every token of the answer is constrained

    def __init__(self, masks: SchemaVocab, think: int | None = None) -> None:
        self.masks, self.think = masks, think
        self.state, self.ws = masks.dfa.start, 0
        self.started = False

    def advance(self, token_bytes: bytes, token: int = -1) -> None:
        """Read the answer's next token: its bytes, or for a markup token (`token`, its id) the bytes the automaton
        reads for it."""
        token_bytes = self.masks.vocab.markup_bytes.get(token, token_bytes)
        dfa = self.masks.dfa
        self.started |= bool(token_bytes)
        for b in token_bytes:
            self.state, self.ws = dfa.step(self.state, self.ws, b)
            if self.state < 0:
                break

    @property
    def done(self) -> bool:
        """The value is whole and nothing can follow it."""
        return self.state >= 0 and bool(self.masks.dfa.terminal[self.state])

    @property
    def dead(self) -> bool:
        """The answer left the schema (a token the constraint did not choose, e.g. the LoopGuard's)."""
        return self.state < 0

    def allowed(self) -> np.ndarray:
        mask = self.masks.allowed(self.state, self.ws)
        if self.think is not None and not self.started and self.think < len(mask):
            mask[self.think] = True
        return mask

