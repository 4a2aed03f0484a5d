"""Structured outputs (`response_format: {"type": "json_schema"}`): the compiled automaton against `jsonschema`'s
validator on random answers it writes (every one valid), on documents written by hand (valid ones in the schema's
order read, others refused), the schemas it refuses, the tokens it allows against a token-by-token reading of the
demo vocabulary, and the engine's constrained answers."""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import zlib
from enum import Enum
from typing import Literal

import jsonschema
import numpy as np
import pytest
from pydantic import BaseModel, Field
from test_json_mode import adopt_midway, answer_text, demo, run

from decapybara.config import EngineConfig
from decapybara.engine.engine import Engine
from decapybara.engine.json_mode import MAX_WS, JsonVocab
from decapybara.engine.json_schema import (
    SchemaError,
    SchemaState,
    SchemaVocab,
    compile_schema,
    schema_text,
)
from decapybara.engine.sampling import SamplingParams
from decapybara.engine.sequence import Request


class Color(str, Enum):
    red = "red"
    green = "green"


class Item(BaseModel):
    name: str = Field(min_length=1, max_length=12)
    qty: int = Field(ge=1, le=99)
    price: float = Field(gt=0)


class Order(BaseModel):
    id: int
    items: list[Item] = Field(max_length=3)
    color: Color
    note: str | None = None
    kind: Literal["a", "b"]
    pair: tuple[int, str]
    extra: dict[str, int]
    ratio: float = Field(ge=0, le=1)
    u: int | str


TREE = {"$defs": {"node": {"type": "object", "properties": {
    "v": {"type": "integer", "minimum": -5, "maximum": 1234},
    "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}}, "required": ["v"]}},
    "$ref": "#/$defs/node"}

SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "minItems": 1, "maxItems": 3},
        "email": {"type": "string", "format": "email"}}, "required": ["name", "age"]},
    "order": Order.model_json_schema(),
    "tree": TREE,
    "any_object": {"type": "object"},
    "anything": {},
    "map": {"type": "object", "additionalProperties": {"type": "array", "items": {"type": "boolean"}}},
    "numbers": {"type": "object", "properties": {
        "a": {"type": "number", "minimum": -2.5, "exclusiveMaximum": 7},
        "b": {"type": "integer", "exclusiveMinimum": -3, "maximum": -1},
        "c": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
        "d": {"type": ["number", "null"]}, "e": {"type": "integer", "minimum": 999990}},
        "required": ["a", "b", "c", "d", "e"], "additionalProperties": False},
    "strings": {"type": "object", "properties": {
        "exact": {"type": "string", "minLength": 2, "maxLength": 2},
        "const": {"const": "h\u00e9llo \"q\""}, "enum": {"enum": [1, "x", None, [1, 2], {"k": True}]},
        "long": {"type": "string", "minLength": 3}}, "required": ["exact", "const", "enum", "long"]},
    "arrays": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "boolean"}],
               "items": {"type": "null"}, "minItems": 1, "maxItems": 4},
    "all_of": {"allOf": [{"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
                         {"properties": {"y": {"type": "string"}}, "required": ["y"]}]},
    "one_of": {"type": "object", "properties": {"shape": {"oneOf": [
        {"type": "object", "properties": {"kind": {"const": "circle"}, "r": {"type": "number"}},
         "required": ["kind", "r"], "additionalProperties": False},
        {"type": "object", "properties": {"kind": {"const": "square"}, "side": {"type": "integer"}},
         "required": ["kind", "side"], "additionalProperties": False}]}}, "required": ["shape"]},
    "top_string": {"type": "string", "maxLength": 5},
    "bounds": {"type": "array", "prefixItems": [
        {"type": "number", "minimum": 0.1, "maximum": 0.9},
        {"type": "number", "exclusiveMinimum": -0.25, "exclusiveMaximum": -0.125},
        {"type": "number", "minimum": -3, "exclusiveMaximum": 0},
        {"type": "number", "exclusiveMinimum": 0.5, "maximum": 2.75},
        {"type": "integer", "exclusiveMinimum": 2.5, "exclusiveMaximum": 9},
        {"type": "number", "minimum": 12.5}, {"type": "number", "maximum": -12.5}], "items": False, "minItems": 7},
    "doubles": {"type": "array", "prefixItems": [  # fractions within a double's digits: no parse onto a bound
        {"type": "number", "maximum": 9223372036854775807}, {"type": "number", "exclusiveMaximum": 1},
        {"type": "number", "exclusiveMinimum": 0.99999999999999, "maximum": 2}], "items": False, "minItems": 3},
    "enum_siblings": {"enum": ["a", "abcdef", 3, "xyz"], "maxLength": 3},
    "undeclared_required": {"type": "object", "required": ["a"], "additionalProperties": {"type": "integer"}},
    "unevaluated": {"type": "object", "unevaluatedProperties": False},
    "one_of_required": {"type": "object", "properties": {"url": {"type": "string"}, "path": {"type": "string"}},
                        "oneOf": [{"required": ["url"]}, {"required": ["path"]}]},
    "patterns": {"type": "object", "properties": {
        "fn": {"type": "string", "pattern": "^[a-z_][a-z0-9_]*\\(\\w*\\)$"},
        "version": {"pattern": "^v?\\d{1,3}(\\.\\d{1,3}){0,2}(-(alpha|beta))?$"},
        "quoted": {"type": "string", "pattern": "^[\"\\\\\n\t\u00e9\u2192x]{2,4}$"},
        "short": {"type": "string", "pattern": "^[A-Z]", "maxLength": 4},
        "day": {"type": "string", "format": "date", "pattern": "^2026-12-"},
        "loose": {"type": "string", "pattern": "ab|^c"}},
        "required": ["fn", "version", "quoted", "short", "day", "loose"]},
    "all_of_closed": {"allOf": [{"type": "object", "properties": {"x": {"type": "integer"}},
                                 "additionalProperties": False}, {"properties": {"y": {"type": "string"}}}]},
}


def distance_to_accept(dfa) -> np.ndarray:
    d = np.where(dfa.accept, 0, 1 << 30)
    while True:
        nxt = np.where(dfa.table >= 0, d[np.maximum(dfa.table, 0)] + 1, 1 << 30).min(axis=1)
        nd = np.minimum(d, nxt)
        if (nd == d).all():
            return d
        d = nd


def walk(dfa, rng: np.random.Generator, dist: np.ndarray, budget: int = 300) -> bytes:
    """A random answer the automaton writes: random bytes it allows, heading for an end past `budget` bytes."""
    members = [np.flatnonzero(dfa.byte_class == c) for c in range(dfa.table.shape[1])]
    ascii_ = [m[m < 0x80] for m in members]
    s, w, out = dfa.start, 0, bytearray()
    while True:
        if dfa.accept[s] and (dfa.terminal[s] or rng.random() < 0.05):
            return bytes(out)
        options = []
        for c in np.flatnonzero(dfa.table[s] >= 0):
            pool = ascii_[c] if ascii_[c].size and rng.random() < 0.9 else members[c]
            b = int(pool[rng.integers(0, pool.size)])
            ns, nw = dfa.step(s, w, b)
            if ns >= 0:
                options.append((b, ns, nw))
        assert options, "a live state with no way on"
        if len(out) > budget:
            b, s, w = min(options, key=lambda o: dist[o[1]])
        else:
            b, s, w = options[rng.integers(0, len(options))]
        out.append(b)


def parse(text: bytes):
    return json.loads(text.decode("utf-8", "replace"))  # as a client reads the reply


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_answer_the_automaton_writes_is_valid(name):
    schema = SCHEMAS[name]
    dfa = compile_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    rng = np.random.default_rng(abs(hash(name)) % 1000)
    dist = distance_to_accept(dfa)
    kinds = set()
    for _ in range(120):
        text = walk(dfa, rng, dist)
        validator.validate(parse(text))
        assert dfa.matches(text)
        kinds.add(text[:1])
    assert len(kinds) >= 1


def dumps(value, indent=None) -> bytes:
    return json.dumps(value, indent=indent, ensure_ascii=False).encode()


@pytest.mark.parametrize("indent", [None, 2])
def test_documents_in_the_schemas_order_are_read_and_invalid_ones_refused(indent):
    person = compile_schema(SCHEMAS["person"])
    ok = [{"name": "Ada", "age": 36}, {"name": "\u6f22\"\\", "age": 0, "tags": ["a", "bcd"], "email": "a@b"},
          {"name": "", "age": 150, "email": ""}]
    bad = [{"age": 36, "name": "Ada"}, {"name": "Ada"}, {"name": "Ada", "age": 151}, {"name": "Ada", "age": -1},
           {"name": "Ada", "age": 1.5}, {"name": "Ada", "age": 3, "tags": []}, {"name": "A", "age": 3, "x": 1},
           {"name": "Ada", "age": 3, "tags": ["abcd"]}, {"name": "Ada", "age": 3, "tags": ["a"] * 4}, [], "Ada"]
    for doc in ok:
        assert person.matches(dumps(doc, indent)), doc
    for doc in bad:
        assert not person.matches(dumps(doc, indent)), doc
    numbers = compile_schema(SCHEMAS["numbers"])
    good = [(-2.5, -2, 0.5, None, 999990), (6.999, -1, 0.001, -1e-3, 10**15), (0, -2, 0.999, 12.5e3, 999999)]
    wrong = [(-2.6, -2, 0.5, 1, 999990), (7, -2, 0.5, 1, 999990), (0, -3, 0.5, 1, 999990), (0, 0, 0.5, 1, 999990),
             (0, -2, 0, 1, 999990), (0, -2, 1, 1, 999990), (0, -2, 0.5, "1", 999990), (0, -2, 0.5, 1, 999989)]
    for a, b, c, d, e in good:
        assert numbers.matches(dumps({"a": a, "b": b, "c": c, "d": d, "e": e}, indent)), (a, b, c, d, e)
    for a, b, c, d, e in wrong:
        assert not numbers.matches(dumps({"a": a, "b": b, "c": c, "d": d, "e": e}, indent)), (a, b, c, d, e)
    strings = compile_schema(SCHEMAS["strings"])
    base = {"exact": "\U0001f600\u00e9", "const": "h\u00e9llo \"q\"", "enum": [1, 2], "long": "abc"}
    assert strings.matches(dumps(base, indent))
    for key, value in [("exact", "abc"), ("exact", "a"), ("const", "hello"), ("enum", 2), ("long", "ab")]:
        assert not strings.matches(dumps({**base, key: value}, indent)), (key, value)
    tree = compile_schema(TREE)
    assert tree.matches(dumps({"v": 1, "kids": [{"v": -5, "kids": []}, {"v": 1234, "kids": [{"v": 0}]}]}, indent))
    assert not tree.matches(dumps({"v": 1, "kids": [{"v": 1}, {"v": 2}, {"v": 3}]}, indent))
    assert not tree.matches(dumps({"kids": []}, indent))
    anything = compile_schema({})
    for doc in [1, -0.5e-7, "s", None, [], {"a": [1, {"b": [None, True]}]}]:
        assert anything.matches(dumps(doc, indent)), doc


def test_whitespace_runs_and_the_lead_are_bounded():
    dfa = compile_schema(SCHEMAS["person"])
    assert dfa.matches(b'  {"name":"a","age":1}')
    assert not dfa.matches(b'   {"name":"a","age":1}')
    assert dfa.matches(b'{"name":' + b" " * MAX_WS + b'"a","age":1}')
    assert not dfa.matches(b'{"name":' + b" " * (MAX_WS + 1) + b'"a","age":1}')
    assert dfa.matches(b'{"name":"' + b" " * 100 + b'","age":1}')  # inside a string, spaces are content
    assert not dfa.matches(b'{"name":"a","age":1} ')  # nothing after the value
    s, w = dfa.start, 0
    for b in b'{"name":"a","age":1}':
        assert not dfa.terminal[s]
        s, w = dfa.step(s, w, b)
    assert dfa.terminal[s]  # the object closed: the answer ends


# (ECMA-262 pattern, the same language for Python's `re.search` over the test alphabet: `$` is `\Z` there)
PATTERNS = [
    ("^[a-z]+-\\d{2}$", r"^[a-z]+-\d{2}\Z"),
    ("ab", "ab"),
    ("^(foo|ba+r)*$", r"^(foo|ba+r)*\Z"),
    ("[^a-c]{2,3}$", r"[^a-c]{2,3}\Z"),
    ("^\\w+@\\w+\\.(com|org)$", r"^\w+@\w+\.(com|org)\Z"),
    ("^\u00e9?\u2192+\U0001F600*$", "^\u00e9?\u2192+\U0001F600*\\Z"),
    ('^["\\\\]+$', '^["\\\\]+\\Z'),
    ("^[\\s\\S]{0,3}$", r"^[\s\S]{0,3}\Z"),
    ("^\\d{3}(?:-\\d{4})?$", r"^\d{3}(?:-\d{4})?\Z"),
    ("(?:x|y){2}z|^q", "(?:x|y){2}z|^q"),
    ("^[\\u0041-\\u0043]\\x44$", r"^[A-C]D\Z"),
    ("^.*$", r"^.*\Z"),
    ("^a.c", "^a.c"),
    ("^(?<word>[^\\d\\s]+?)\\.{1,}$", r"^(?P<word>[^\d\s]+?)\.{1,}\Z"),
    ("^\\t\\n[\\b]?$", "^\t\n[\b]?\\Z"),
    ("^[-a]+[a-]$", r"^[-a]+[a-]\Z"),
    ("x{2}y{1,}z{0,1}$", r"x{2}y{1,}z{0,1}\Z"),
]
ALPHABET = ["a", "b", "c", "f", "o", "r", "q", "x", "y", "z", "A", "D", "0", "1", "5", "-", ".", "@", "_", " ", '"',
            "\\", "\n", "\t", "\b", "\u00e9", "\u2192", "\U0001F600", "com"]


@pytest.mark.parametrize("ecma, python", PATTERNS)
def test_a_pattern_accepts_the_strings_it_matches_and_no_other(ecma, python):
    """A string schema's `pattern` (engine/regex.py) accepts a JSON string exactly where the pattern matches its
    text (searched, as JSON Schema says), over random strings and those the pattern's own examples make, each
    written as json.dumps writes it."""
    dfa = compile_schema({"type": "string", "pattern": ecma})
    rx = re.compile(python, re.ASCII)
    rng = np.random.default_rng(zlib.crc32(ecma.encode()))
    texts = ["", "ab", "foo", "bar", "baar", "foobar", "ab-12", "xyz", "q", "xxyyz", "abc", "a@b.com", "123",
             "123-4567", "\u00e9\u2192\u2192", "\u2192", '"\\"', "ABD", "a-", "-a", "word.", "w0rd..", "\t\n",
             "\t\n\b", "\n", "AD", "CD", "xxyz"]
    texts += ["".join(rng.choice(ALPHABET, rng.integers(0, 7))) for _ in range(400)]
    hits = 0
    for text in texts:
        want = rx.search(text) is not None
        hits += want
        assert dfa.matches(json.dumps(text, ensure_ascii=False).encode()) == want, (ecma, text)
    assert hits > 0
    rng = np.random.default_rng(0)  # what the automaton writes, read back, matches
    dist = distance_to_accept(dfa)
    for _ in range(50):
        doc = walk(dfa, rng, dist, budget=40)
        assert rx.search(json.loads(doc)) is not None, (ecma, doc)


# (pattern whose automaton with any text before it is too large; what is enforced instead: its alternatives not
# anchored at the start, at the first character that can begin one of them)
NARROWED = [
    ("[A-Z].{12}", r"^[^A-Z]*[A-Z].{12}"),
    ("a.{20}b", r"^[^a]*a.{20}b"),
    ("x|[A-Z].{12}", r"^[^xA-Z]*(?:x|[A-Z].{12})"),
    ("^q|[A-Z].{12}$", r"^q|^[^A-Z]*[A-Z].{12}\Z"),
]
ECMA_DOT = "[^\n\r\u2028\u2029]"  # `.` in ECMA-262 (Python's leaves out only "\n")


@pytest.mark.parametrize("ecma, python", NARROWED)
def test_a_pattern_too_large_after_any_text_is_matched_at_its_first_character(ecma, python):
    """Where a pattern's automaton with any text before it passes `PATTERN_FULL_DFA` states (`[A-Z].{12}`: one
    state a set of open matches), text before the match holds no character that can begin it: the automaton
    accepts exactly that narrower language, each string of which the pattern matches, so what it writes
    validates; it compiles in well under a second. One whose own automaton is too large is still refused."""
    import time

    t0 = time.monotonic()
    dfa = compile_schema({"type": "string", "pattern": ecma})
    assert time.monotonic() - t0 < 3 and dfa.num_states < 5000
    narrow = re.compile(python.replace(".", ECMA_DOT))
    full = re.compile(ecma.replace(".", ECMA_DOT).replace("$", r"\Z"))
    rng = np.random.default_rng(zlib.crc32(ecma.encode()))
    alphabet = ["a", "b", "x", "q", "A", "Z", "0", "7", " ", "\n", '"', "\u00e9"]
    dist = distance_to_accept(dfa)
    written = [json.loads(walk(dfa, rng, dist, budget=60)) for _ in range(60)]  # what the automaton writes
    for text in written:
        assert full.search(text) is not None, (ecma, text)
    texts = ["".join(rng.choice(alphabet, rng.integers(0, 30))) for _ in range(400)]
    texts += ["ABCDEFGHIJKLM", "abcABCDEFGHIJKLM", "bZcdefghijklmA", "q", "qZ", "xA", "a" + "c" * 20 + "b", "Ab"]
    for text in written:  # and near misses: a character changed, added or taken away
        i = int(rng.integers(0, len(text) + 1))
        texts += [text, text[:i] + str(rng.choice(alphabet)) + text[i + 1:], text[:i] + str(rng.choice(alphabet))
                  + text[i:], text[:i] + text[i + 1:]]
    hits = 0
    for text in texts:
        want = narrow.search(text) is not None
        hits += want
        assert dfa.matches(json.dumps(text, ensure_ascii=False).encode()) == want, (ecma, text)
        assert full.search(text) or not want  # the narrower language is within the pattern's
    assert 60 < hits < len(texts) - 100
    jsonschema.validate("abcABCDEFGHIJKLM", {"type": "string", "pattern": "[A-Z].{12}"})


def test_patterns_are_never_narrowed_where_that_would_be_wrong():
    """oneOf's branches and the checks of enum values take each pattern's very language: a string both branches
    match (one of them a pattern narrowed alone) is refused, as oneOf says; an enum value the pattern matches anywhere
    stays. An alternative not anchored at its start that matches the empty string matches every string (a few
    states, not a refusal)."""
    both = "Z\nBCDEFGHIJKL"  # `[A-Z].{8}` matches it at "BCDEFGHIJ", `^Z` at its start
    assert compile_schema({"type": "string", "pattern": "[A-Z].{8}"}).num_states < 1000  # narrowed alone
    one_of = compile_schema({"oneOf": [{"type": "string", "pattern": "[A-Z].{8}"}, {"type": "string", "pattern": "^Z"}]})
    assert not one_of.matches(json.dumps(both).encode()) and one_of.matches(b'"Zx"')
    assert one_of.matches(json.dumps("xxABCDEFGHIJKLM").encode())  # the first branch alone
    kept = compile_schema({"type": "string", "enum": [both, "none"], "pattern": "[A-Z].{8}"})
    assert kept.matches(json.dumps(both).encode()) and not kept.matches(b'"none"')
    for pattern in ("[A-Z].{12}|\\s*$", "[A-Z].{12}|$", "(x{0})"):
        d = compile_schema({"type": "string", "pattern": pattern})
        assert d.num_states < 100 and d.matches(b'"anything at all"') and d.matches(b'""'), pattern


def test_patterns_that_match_any_tail_stay_small_and_their_edges_hold():
    """A match complete, every continuation is one: `.{0,300}` (any string) and `a.*` compile to a few states; a
    surrogate pair escape is its one code point; a non-ASCII digit in braces is no quantifier; `enum` beside a
    `pattern` keeps the values that are not strings."""
    import time

    t0 = time.monotonic()
    assert compile_schema({"type": "string", "pattern": ".{0,300}"}).num_states < 100
    assert compile_schema({"type": "string", "pattern": "a.*"}).num_states < 200
    assert time.monotonic() - t0 < 5
    pair = compile_schema({"type": "string", "pattern": "^\\uD83D\\uDE00$"})
    assert pair.matches(json.dumps("\U0001F600", ensure_ascii=False).encode())
    assert compile_schema({"type": "string", "pattern": "^a{\u0661}$"}).matches(
        json.dumps("a{\u0661}", ensure_ascii=False).encode())
    mixed = compile_schema({"pattern": "^a", "enum": [1, "abc", "xyz", None]})
    assert [mixed.matches(json.dumps(v).encode()) for v in (1, "abc", "xyz", None)] == [True, True, False, True]
    bounded = compile_schema({"enum": [1, "ab", 5], "minimum": 2})  # a bound says nothing of strings
    assert [bounded.matches(json.dumps(v).encode()) for v in (1, "ab", 5)] == [False, True, True]
    never = compile_schema({"anyOf": [{"type": "string", "pattern": "[^\\s\\S]"}, {"type": "integer"}]})
    assert never.matches(b"1") and not never.matches(b'"x"')  # a pattern nothing matches: a branch not taken
    with pytest.raises(SchemaError, match="ASCII letter"):
        compile_schema({"type": "string", "pattern": "\\c1"})


@pytest.mark.parametrize("schema, says", [
    ({"type": "string", "pattern": "^(a)\\1$"}, "backreference"),
    ({"type": "string", "pattern": "a(?=b)"}, "lookaround"),
    ({"type": "string", "pattern": "a^b"}, "start and end"),
    ({"type": "string", "pattern": "[]"}, "admits no value"),
    ({"type": "string", "pattern": "^\\u{-1}$"}, "hex digits"),
    ({"type": "string", "pattern": "^\\uD83D$"}, "lone surrogate"),
    ({"type": "string", "pattern": "(a|b)*a(a|b){20}"}, "too large"),
    ({"type": "integer", "multipleOf": 3}, "multipleOf"),
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"not": {"type": "null"}}, "not"),
    ({"type": "object", "minProperties": 1}, "minProperties"),
    ({"$ref": "https://example.com/s.json"}, "local"),
    ({"$ref": "#/$defs/missing"}, "resolve"),
    ({"type": "integer", "minimum": 5, "maximum": 3}, "admits no value"),
    ({"type": "object", "properties": {"a": False}, "required": ["a"]}, "admits no value"),
    ({"$defs": {"n": {"type": "object", "properties": {"n": {"$ref": "#/$defs/n"}}, "required": ["n"]}},
      "$ref": "#/$defs/n"}, "admits no value"),
    ({"type": "wat"}, "unknown type"),
    ({"type": "string", "maxLength": -1}, "maxLength"),
    ({"type": "array", "items": {"type": "string", "maxLength": 200}, "maxItems": 1000}, "too large"),
    ({"allOf": [{"type": "array", "items": False}, {"prefixItems": [{"type": "integer"}]}]}, "prefixItems"),
    ({"const": 1, "enum": [True]}, "admits no value"),
    ({"const": 5, "minimum": 10}, "admits no value"),
    ({"type": "number", "minimum": "5", "exclusiveMinimum": 3}, "number"),
    ({"allOf": [{"minimum": 1}, {"minimum": None}]}, "number"),
    ({"allOf": [{"type": {"a": 1}}, {"type": "string"}]}, "unknown type"),
    ({"allOf": [{"properties": {"a": {}}}, {"properties": [1]}]}, "properties"),
])
def test_schemas_the_server_cannot_enforce_are_refused_by_name(schema, says):
    with pytest.raises(SchemaError, match=says):
        compile_schema(schema)


def test_schema_text_keeps_the_property_order_and_the_cache_returns_the_same_automaton():
    a = {"type": "object", "properties": {"z": {"type": "integer"}, "a": {"type": "integer"}}, "required": ["z", "a"]}
    assert schema_text(a).index('"z"') < schema_text(a).index('"a"')
    assert compile_schema(a) is compile_schema(schema_text(a))
    assert compile_schema(a).matches(b'{"z":1,"a":2}') and not compile_schema(a).matches(b'{"a":2,"z":1}')
    with pytest.raises(SchemaError):
        schema_text({"x": float("nan")})


@functools.cache
def demo_vocab():
    tok = demo().tokenizer
    return JsonVocab(tok, tok.vocab_size)


def brute_allowed(tok, dfa, state: int, ws: int) -> np.ndarray:
    allowed = np.zeros(tok.vocab_size, bool)
    for i in range(tok.vocab_size):
        data = tok.token_bytes(i)
        if i in tok.added_ids or not data:
            continue
        s, w = state, ws
        for b in data:
            s, w = dfa.step(s, w, b)
            if s < 0:
                break
        allowed[i] = s >= 0
    if dfa.accept[state]:
        allowed[list(tok.eos_token_ids)] = True
    return allowed


@pytest.mark.parametrize("name, doc", [
    ("person", b'{"name": "x\\"\\u00e9  \\n", "age": 42,\n  "tags": ["ab", "c"],  "email": "e"}'),
    ("numbers", b'{"a": -2.25, "b": -2, "c": 0.5, "d": 1.5e-3, "e": 1000000}'),
    ("tree", b'{"v": 7, "kids": [{"v": -1, "kids": []}]}'),
])
def test_the_tokens_allowed_are_those_read_whole_one_by_one(name, doc):
    tok = demo().tokenizer
    dfa = compile_schema(SCHEMAS[name])
    masks = SchemaVocab(demo_vocab(), dfa)
    st = SchemaState(masks)
    assert dfa.matches(doc)
    rng = np.random.default_rng(len(doc))
    checks = sorted(set(rng.integers(0, len(doc) + 1, 5).tolist()) | {0, 1, len(doc)})
    for k in range(len(doc) + 1):
        if k in checks:
            assert np.array_equal(st.allowed(), brute_allowed(tok, dfa, st.state, st.ws)), doc[:k]
        if k < len(doc):
            st.advance(doc[k:k + 1])
    assert st.done and not st.dead


@pytest.mark.parametrize("thinking", [False, True])
def test_the_engines_answers_follow_the_schema_alone_or_batched(thinking):
    """Greedy and sampled requests of the demo model under three schemas beside a JSON-mode and a plain one: each
    answer that ends by itself validates, one cut by max_tokens is a prefix the automaton reads; the tokens are
    the same alone and batched."""
    m = demo()
    tok = m.tokenizer
    prompt = tuple(tok.apply_chat([{"role": "user", "content": "Describe is_even(n) as a JSON object."}],
                                  enable_thinking=thinking))
    schemas = [SCHEMAS["person"], SCHEMAS["numbers"], SCHEMAS["order"]]
    params = [SamplingParams(temperature=0, max_tokens=300, json_schema=schema_text(schemas[0])),
              SamplingParams(temperature=1.0, seed=3, max_tokens=300, json_schema=schema_text(schemas[1])),
              SamplingParams(temperature=0.8, seed=5, top_p=0.95, max_tokens=120, json_schema=schema_text(schemas[2])),
              SamplingParams(temperature=0, max_tokens=60, json_object=True), SamplingParams(temperature=0, max_tokens=30)]
    cfg = EngineConfig(loop_guard="off", max_slots=6)
    alone = {}
    for i, p in enumerate(params):
        out, _ = run(Engine(m.model, cfg, tokenizer=tok), [Request(prompt, p, f"s{i}")])
        alone[f"s{i}"] = out[f"s{i}"]
    outs, ends = run(Engine(m.model, cfg, tokenizer=tok), [Request(prompt, p, f"s{i}") for i, p in enumerate(params)])
    assert outs == alone
    assert answers_follow(tok, outs, ends, schemas) >= 2


def answers_follow(tok, outs: dict, ends: dict, schemas: list) -> int:
    """Each answer s<i> that ended by itself validates against schemas[i], each cut one is a prefix its automaton
    reads; returns how many ended by themselves."""
    stopped = 0
    for i, schema in enumerate(schemas):
        text = answer_text(tok, outs[f"s{i}"])
        if ends[f"s{i}"] == "stop":
            jsonschema.validate(parse(text), schema)
            stopped += 1
        else:
            dfa = compile_schema(schema)
            s, w = dfa.start, 0
            for b in text:
                s, w = dfa.step(s, w, b)
            assert s >= 0, text
    return stopped


def test_the_engines_answers_match_their_patterns():
    """The demo model's answers under a schema of patterns (beside a length and a format too; one unanchored at
    its start whose full automaton is too large), greedy and sampled: each that ends by itself validates (jsonschema reads `pattern` with Python's re), each cut is a prefix."""
    m = demo()
    tok = m.tokenizer
    prompt = tuple(tok.apply_chat([{"role": "user", "content": "Name a Python function and its version."}],
                                  enable_thinking=False))
    schema = {"type": "object", "properties": {  # bounded: the tiny model's answers end
        "fn": {"type": "string", "pattern": "^[a-z_]{1,12}\\(\\)$"},
        "version": {"pattern": "^v?\\d{1,3}(\\.\\d{1,3}){0,2}$"},
        "short": {"type": "string", "pattern": "^[A-Z]", "maxLength": 4},
        "day": {"type": "string", "format": "date", "pattern": "^2026-12-"},
        "code": {"type": "string", "pattern": "^(ab|c)[0-9]{0,3}$"},
        "tag": {"type": "string", "pattern": "[A-Z].{12}$", "maxLength": 16}},  # matched at its first capital
        "required": ["fn", "version", "short", "day", "code", "tag"]}
    params = [SamplingParams(temperature=0, max_tokens=260, json_schema=schema_text(schema)),
              SamplingParams(temperature=1.0, seed=7, max_tokens=260, json_schema=schema_text(schema)),
              SamplingParams(temperature=0.7, seed=11, max_tokens=260, json_schema=schema_text(schema))]
    outs, ends = run(Engine(m.model, EngineConfig(loop_guard="off"), tokenizer=tok),
                     [Request(prompt, p, f"s{i}") for i, p in enumerate(params)])
    assert answers_follow(tok, outs, ends, [schema] * len(params)) >= 2


@pytest.mark.parametrize("extra", [{"min_tokens": 60}, {"ignore_eos": True}])
def test_an_answer_ends_where_its_schemas_value_closes(extra):
    """The answer ends (stop) with the token that closes the schema's object, whatever min_tokens or ignore_eos
    ask: the same tokens as without them."""
    m = demo()
    tok = m.tokenizer
    prompt = tuple(tok.apply_chat([{"role": "user", "content": "A person as JSON."}], enable_thinking=False))
    base = SamplingParams(temperature=0, max_tokens=300, json_schema=schema_text(SCHEMAS["person"]))
    want, ends = run(Engine(m.model, EngineConfig(loop_guard="off"), tokenizer=tok), [Request(prompt, base, "j")])
    assert ends["j"] == "stop"
    jsonschema.validate(parse(answer_text(tok, want["j"])), SCHEMAS["person"])
    params = dataclasses.replace(base, **extra)
    got, ends = run(Engine(m.model, EngineConfig(loop_guard="off"), tokenizer=tok), [Request(prompt, params, "j")])
    assert ends["j"] == "stop" and got == want


def test_an_answer_paused_to_the_tiers_and_adopted_goes_on_under_its_schema(tmp_path):
    """A conversation under a schema paused midway to the disk tier and adopted by a new engine replays its
    automaton from its tokens: the same tokens as an uninterrupted run."""
    tok = demo().tokenizer
    prompt = tuple(tok.apply_chat([{"role": "user", "content": "An order as JSON, please."}], enable_thinking=False))
    dfa = compile_schema(SCHEMAS["order"])

    def check(seq):
        replay = SchemaState(SchemaVocab(demo_vocab(), dfa))
        replay.advance(answer_text(tok, seq.tokens[seq.num_prompt:]))
        assert isinstance(seq.json, SchemaState) and (seq.json.state, seq.json.ws) == (replay.state, replay.ws)
        assert seq.json.state != dfa.start

    params = SamplingParams(temperature=0.8, seed=12, max_tokens=120, json_schema=schema_text(SCHEMAS["order"]))
    adopt_midway(prompt, params, tmp_path, check)


def test_a_schema_the_engine_cannot_enforce_is_an_invalid_request():
    from decapybara.errors import InvalidRequestError

    m = demo()
    engine = Engine(m.model, EngineConfig(loop_guard="off"), tokenizer=m.tokenizer)
    bad = SamplingParams(max_tokens=4, json_schema=schema_text({"type": "string", "pattern": "(x)\\1"}))
    with pytest.raises(InvalidRequestError, match="pattern"):
        engine.add_request(Request((1, 2, 3), bad, "bad"))
    with pytest.raises(InvalidRequestError, match="json_object"):
        SamplingParams(max_tokens=4, json_object=True, json_schema="{}").validate(100)


TOOLS = [
    {"type": "function", "function": {"name": "read_file", "parameters": {"type": "object", "properties": {
        "path": {"type": "string", "minLength": 1}, "line": {"type": "integer", "minimum": 1}},
        "required": ["path"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "list_dir"}},  # no parameters: no arguments
    {"type": "function", "function": {"name": "grep", "parameters": {"type": "object", "properties": {
        "pattern": {"type": "string", "pattern": "^([a-z])\\1$"}}}}},  # not enforced here: any JSON object
]


@pytest.mark.parametrize("name, parallel", [(None, True), (None, False), ("read_file", True)])
def test_tool_call_replies_the_automaton_writes_parse_as_calls_that_follow_the_schemas(name, parallel):
    """A reply under tool_choice required / named: only calls, as the reply parser reads them, of the tools
    allowed, their arguments valid (a tool whose schema is not enforced here: an object), one where parallel
    calls are off."""
    from decapybara.chat import parse_assistant_output
    from decapybara.engine.json_schema import compile_tool_calls, tags_as_text, tool_call_spec

    dfa = compile_tool_calls(tool_call_spec(TOOLS, name, parallel))
    schemas = {"read_file": TOOLS[0]["function"]["parameters"], "list_dir": {"type": "object", "maxProperties": 0},
               "grep": {"type": "object"}}
    rng = np.random.default_rng(len(str(name)) + parallel)
    dist = distance_to_accept(dfa)
    counts, names = set(), set()
    for _ in range(80):
        out = parse_assistant_output(tags_as_text(walk(dfa, rng, dist, budget=200)).decode("utf-8", "replace"))
        assert out.content == "" and out.tool_calls
        for call in out.tool_calls:
            jsonschema.validate(call.arguments, schemas[call.name])
            names.add(call.name)
        counts.add(len(out.tool_calls))
    assert names == ({name} if name else set(schemas))
    assert counts == {1} if not parallel else max(counts) > 1


@pytest.mark.parametrize("thinking", [False, True])
def test_the_engines_tool_call_replies_parse_as_calls(thinking):
    """The demo model under tool_choice required (its prompt's tools, the instruction note aside): a reply that
    ends by itself is one call, valid against its schema; with reasoning, after it (reasoning opens once: the
    constraint allows `<think>` only before it)."""
    from decapybara.chat import parse_assistant_output
    from decapybara.engine.json_schema import tool_call_spec

    m = demo()
    tok = m.tokenizer
    prompt = tuple(tok.apply_chat([{"role": "user", "content": "Read the file main.py."}], TOOLS[:2],
                                  enable_thinking=thinking))
    spec = tool_call_spec(TOOLS[:2], None, False)  # one call: the demo model, left to it, calls again and again
    outs, ends = run(Engine(m.model, EngineConfig(loop_guard="off"), tokenizer=tok),
                     [Request(prompt, SamplingParams(temperature=t, seed=5, max_tokens=300, tool_calls=spec), f"t{t}")
                      for t in (0, 1.0)])
    stopped = 0
    for rid, ids in outs.items():
        assert ids.count(tok.special_ids.think) <= 1
        if ends[rid] != "stop":
            continue
        stopped += 1
        text = tok.decode(ids, skip_special_tokens=False).replace("<|im_end|>", "")
        out = parse_assistant_output(text)
        assert out.content == "" and len(out.tool_calls) == 1 and text.count("<think>") <= 1, text
        for call in out.tool_calls:
            assert call.name in ("read_file", "list_dir")
            if call.name == "read_file":
                jsonschema.validate(call.arguments, TOOLS[0]["function"]["parameters"])
    assert stopped >= 1


def test_think_is_allowed_first_only_after_a_chat_turn_that_leaves_reasoning_to_the_model():
    m = demo()
    tok = m.tokenizer
    engine = Engine(m.model, EngineConfig(loop_guard="off"), tokenizer=tok)
    params = SamplingParams(max_tokens=4, json_schema=schema_text({"type": "object"}))
    turn = [{"role": "user", "content": "hi"}]
    assert engine._json_state(params, tok.apply_chat(turn, enable_thinking=True)).think == tok.special_ids.think
    assert engine._json_state(params, tok.apply_chat(turn, enable_thinking=False)).think is None  # closed in it
    assert engine._json_state(params, tok.encode("def f(x):")).think is None  # a raw completion prompt


def test_the_driver_builds_a_new_schemas_automaton_on_the_submitting_thread():
    """A request's schema (or forced tool calls) is compiled where it is submitted, not between two of the engine's
    steps; one that cannot be enforced is left for the engine to refuse."""
    from decapybara.engine import json_schema
    from decapybara.engine.driver import Control, EngineDriver
    from decapybara.engine.json_schema import tool_call_spec

    m = demo()
    driver = EngineDriver(Engine(m.model, EngineConfig(loop_guard="off"), tokenizer=m.tokenizer))
    schema = schema_text({"type": "object", "properties": {"n": {"type": "integer", "minimum": 7}}, "required": ["n"]})
    spec = tool_call_spec(TOOLS[:1], None, False)
    call = "calls:" + schema_text(json.loads(spec)["tools"])  # a forced reply runs on its tools' groups' automata
    json_schema.forget(schema)
    json_schema.forget(call)
    bad = schema_text({"type": "string", "pattern": "(x)\\1"})
    driver.submit(Control(add=[Request((1, 2), SamplingParams(max_tokens=2, json_schema=schema), "a"),
                               Request((1, 2), SamplingParams(max_tokens=2, tool_calls=spec), "b"),
                               Request((1, 2), SamplingParams(max_tokens=2, json_schema=bad), "c")]))
    assert schema in json_schema._COMPILED and call in json_schema._COMPILED
    driver.stop()


def test_formatted_strings_parse_as_pydantic_reads_them():
    """The formats date, time, date-time and uuid are written as they are: every answer the automaton writes for a
    pydantic model with such fields parses into it (real days only: no 30th of February); a format beside a length
    is refused, and other formats are annotations."""
    import datetime
    import uuid

    class Event(BaseModel):
        day: datetime.date
        at: datetime.datetime
        start: datetime.time
        id: uuid.UUID
        link: str = Field(json_schema_extra={"format": "uri"})  # an annotation: any string

    schema = Event.model_json_schema()
    dfa = compile_schema(schema)
    checker = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    rng = np.random.default_rng(9)
    dist = distance_to_accept(dfa)
    for _ in range(150):
        text = walk(dfa, rng, dist)
        Event.model_validate_json(text.decode("utf-8", "replace"))  # as the client gets it
        checker.validate(parse(text))
    assert not dfa.matches(b'{"day": "2024-02-30", "at": "2024-01-01T00:00:00Z", "start": "00:00:00Z", '
                           b'"id": "123e4567-e89b-12d3-a456-426614174000", "link": ""}')
    with pytest.raises(SchemaError, match="format"):
        compile_schema({"type": "string", "format": "date", "maxLength": 10})


def test_one_vocabulary_serves_every_automaton_the_markup_only_to_tool_calls():
    """The engine's one vocabulary table reads the tool-call tags as reserved bytes (no UTF-8 text's): a tool-call
    reply's masks allow them where the reply's automaton reads a tag, and nowhere else, not inside an argument's
    string; JSON mode's and a schema's masks never; a token that holds a reserved byte outside a tag never either."""
    from decapybara.engine.json_mode import JsonState
    from decapybara.engine.json_schema import CLOSE_TAG, OPEN_TAG, compile_tool_calls, tool_call_spec

    tok = demo().tokenizer
    tags = (tok.special_ids.tool_call, tok.special_ids.end_tool_call)
    vocab = JsonVocab(tok, tok.vocab_size, markup=dict(zip(tags, (OPEN_TAG, CLOSE_TAG))))
    assert vocab.clash.size and not np.isin(vocab.clash, tags).any()
    json_mode = JsonState(vocab)
    json_mode.advance(b'{"a": "')
    schema = SchemaState(SchemaVocab(vocab, compile_schema({"type": "string"})))
    schema.advance(b'"')
    calls = SchemaState(SchemaVocab(vocab, compile_tool_calls(tool_call_spec(TOOLS[:1], None, True)), markup=True))
    assert not json_mode.allowed()[list(tags)].any() and not schema.allowed()[list(tags)].any()
    assert not schema.allowed()[vocab.clash].any()
    assert calls.allowed()[tags[0]] and not calls.allowed()[tags[1]] and not calls.allowed()[vocab.clash].any()
    assert json_mode.allowed()[tok.encode("<")[0]]  # the same bytes as text stay string content
    calls.advance(b"<tool_call>", tags[0])  # the tag token: read as its reserved byte
    for t in tok.encode('\n{"name": "read_file", "arguments": {"path": "a'):
        calls.advance(tok.token_bytes(t), t)
    inside = calls.allowed()
    assert not inside[list(tags)].any() and inside[tok.encode("<")[0]]  # in a string: text, never a tag
    for t in tok.encode('"}}\n'):
        calls.advance(tok.token_bytes(t), t)
    assert calls.allowed()[tags[1]] and not calls.allowed()[tags[0]]
    calls.advance(b"</tool_call>", tags[1])
    assert calls.state >= 0 and not calls.allowed()[list(tags)].any()
    calls.advance(b"\n", tok.encode("\n")[0])
    assert calls.allowed()[tags[0]] and not calls.allowed()[tags[1]]  # parallel: another call after a newline


@pytest.mark.parametrize("schema, doc", [
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, b"1.0"),  # 1.0 is an integer too
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, b"1e0"),
    ({"oneOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                {"type": "object", "properties": {"b": {"type": "integer"}}}]}, b'{"a": 1}'),  # extra keys pass b
    ({"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 3}]}, b'"\\u0041"'),  # "A": both
    ({"oneOf": [{"type": "object", "properties": {"a": {}, "b": {}}},
                {"type": "object", "properties": {"b": {}, "a": {}}}]}, b'{"a": 1, "b": 2}'),  # either order
])
def test_one_of_never_writes_a_value_two_branches_accept(schema, doc):
    """oneOf's branches are held exclusive on what they accept, not on the forms their automata write: a value
    another branch accepts in a form its own automaton does not read is never written; branches that cannot be
    told apart so are refused by name."""
    assert len(list(jsonschema.Draft202012Validator(schema).iter_errors(json.loads(doc)))) > 0
    try:
        dfa = compile_schema(schema)
    except SchemaError as e:
        assert "oneOf" in str(e)
        return
    assert not dfa.matches(doc)
    rng = np.random.default_rng(0)
    dist = distance_to_accept(dfa)
    for _ in range(100):
        jsonschema.validate(parse(walk(dfa, rng, dist, budget=40)), schema)


def test_one_of_of_branches_told_apart_by_type_or_a_discriminator_compiles():
    """Branches no value can pass two of (disjoint types, a required property's disjoint constants, a required
    property another branch forbids) are any of them; branches alike but for `required`, and strings by pattern
    alone, keep the product of their automata."""
    cat = {"type": "object", "properties": {"kind": {"const": "cat"}, "meow": {"type": "integer"}}, "required": ["kind"]}
    dog = {"type": "object", "properties": {"kind": {"enum": ["dog", "wolf"]}, "n": {"type": "number"}},
           "required": ["kind", "n"]}
    schemas = [{"oneOf": [cat, dog]}, {"oneOf": [{"type": "integer"}, {"type": "string"}, {"type": "null"}]},
               {"oneOf": [{"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
                          {"type": "object", "properties": {"y": {}}, "additionalProperties": False}]},
               {"$defs": {"c": cat}, "oneOf": [{"$ref": "#/$defs/c"}, dog, {"type": "array"}]},
               SCHEMAS["one_of"], SCHEMAS["one_of_required"]]
    rng = np.random.default_rng(1)
    for schema in schemas:
        dfa = compile_schema(schema)
        dist = distance_to_accept(dfa)
        for _ in range(60):
            jsonschema.validate(parse(walk(dfa, rng, dist, budget=60)), schema)
    assert compile_schema(schemas[0]).matches(b'{"kind": "cat", "meow": 2}')
    assert compile_schema(schemas[0]).matches(b'{"kind": "wolf", "n": 2.5}')
