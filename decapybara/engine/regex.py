"""JSON Schema's `pattern` (ECMA-262 regular expressions), parsed into a tree the structured-output compiler
turns into automaton fragments (`json_schema._Compiler.pattern`).

What a pattern can say here is a regular language over code points: literals and escapes (`\\t \\n \\r \\f \\v
\\0`, `\\xHH`, `\\uHHHH`, `\\u{H...}`, an escaped metacharacter), classes (`[...]`, ranges, `[^...]`, `\\d \\w \\s`
and their negations, inside or outside a class), `.` (any code point but a line terminator), groups (`(...)`,
`(?:...)`, `(?<name>...)`), alternation, the quantifiers `* + ? {n} {n,} {n,m}` (lazy or greedy: the same set of
strings), and the anchors `^` and `$` at the start and end of a top-level alternative. As in JSON Schema a pattern
is not anchored: an alternative without `^` may be preceded by anything, one without `$` followed by anything.
What a finite automaton cannot enforce, or that this parser does not read, is a `PatternError` naming it:
backreferences, lookaround, word boundaries, anchors elsewhere, Unicode property escapes.

The tree: `("set", ranges)` (one code point from sorted, disjoint inclusive ranges), `("seq", [nodes])`,
`("alt", [nodes])`, `("rep", node, lo, hi)` (hi None: unbounded). `parse(pattern)` returns the top-level
alternatives as `(node, anchored_start, anchored_end)`.
"""

from __future__ import annotations

from typing import Any

MAX_CP = 0x10FFFF
SURROGATES = (0xD800, 0xDFFF)  # no code point of Unicode text
MAX_REPEAT = 1000  # a quantifier's bound at most


class PatternError(ValueError):
    """A pattern this parser does not read or a finite automaton cannot enforce; the message says which."""


Ranges = list[tuple[int, int]]


def normalise(ranges: Ranges) -> Ranges:
    """Sorted, merged, surrogates left out."""
    out: Ranges = []
    for lo, hi in sorted(ranges):
        for a, b in ((lo, min(hi, SURROGATES[0] - 1)), (max(lo, SURROGATES[1] + 1), hi)):
            if a > b:
                continue
            if out and a <= out[-1][1] + 1:
                out[-1] = (out[-1][0], max(out[-1][1], b))
            else:
                out.append((a, b))
    return out


def complement(ranges: Ranges) -> Ranges:
    out, nxt = [], 0
    for lo, hi in normalise(ranges):
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= MAX_CP:
        out.append((nxt, MAX_CP))
    return normalise(out)


ANY: Ranges = normalise([(0, MAX_CP)])
LINE_TERMINATORS: Ranges = [(0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029)]
DOT: Ranges = complement(LINE_TERMINATORS)
DIGITS: Ranges = [(0x30, 0x39)]
WORD: Ranges = normalise([(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)])
SPACE: Ranges = normalise([(0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A),
                           (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF)])
CLASS_ESCAPES = {"d": DIGITS, "D": complement(DIGITS), "w": WORD, "W": complement(WORD), "s": SPACE,
                 "S": complement(SPACE)}
CONTROL_ESCAPES = {"t": 0x09, "n": 0x0A, "r": 0x0D, "f": 0x0C, "v": 0x0B, "0": 0x00}
DIGIT_CHARS = frozenset("0123456789")
HEX_DIGITS = frozenset("0123456789abcdefABCDEF")
ASCII_LETTERS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


def parse(pattern: str) -> list[tuple[Any, bool, bool]]:
    """The top-level alternatives of `pattern` as (tree, anchored at the start, anchored at the end)."""
    if not isinstance(pattern, str):
        raise PatternError("a pattern must be a string")
    p = _Parser(pattern)
    tree = p.alternation()
    if p.i < len(pattern):
        raise PatternError(f"pattern {pattern!r}: unbalanced ')' at {p.i}")
    out = []
    for branch in tree[1] if tree[0] == "alt" else [tree]:
        items = list(branch[1]) if branch[0] == "seq" else [branch]
        start = bool(items) and items[0] == ("bol",)
        end = bool(items) and items[-1] == ("eol",) and len(items) > int(start)
        items = items[int(start):len(items) - int(end)]
        body = ("seq", items)
        if _has_anchor(body):
            raise PatternError(f"pattern {pattern!r}: '^' and '$' are enforced only at the start and end of a "
                               "top-level alternative")
        out.append((body, start, end))
    return out


def nullable(node: Any) -> bool:
    """Whether the tree matches the empty string."""
    kind = node[0]
    if kind == "set":
        return False
    if kind == "seq":
        return all(nullable(c) for c in node[1])
    if kind == "alt":
        return any(nullable(c) for c in node[1])
    return node[2] == 0 or nullable(node[1])


def first_chars(node: Any) -> Ranges:
    """The code points a non-empty match of the tree can begin with (normalised ranges)."""
    kind = node[0]
    if kind == "set":
        return normalise(node[1])
    if kind == "rep":
        return first_chars(node[1]) if node[3] != 0 else []
    out: Ranges = []
    for child in node[1]:
        out += first_chars(child)
        if kind == "seq" and not nullable(child):
            break
    return normalise(out)


def _has_anchor(node: Any) -> bool:
    kind = node[0]
    if kind in ("bol", "eol"):
        return True
    if kind in ("seq", "alt"):
        return any(_has_anchor(c) for c in node[1])
    if kind == "rep":
        return _has_anchor(node[1])
    return False


class _Parser:
    def __init__(self, text: str) -> None:
        self.s, self.i = text, 0

    def fail(self, what: str) -> PatternError:
        return PatternError(f"pattern {self.s!r}: {what} (at {self.i}) is not enforced here")

    def peek(self, k: int = 0) -> str | None:
        j = self.i + k
        return self.s[j] if j < len(self.s) else None

    def alternation(self) -> Any:
        branches = [self.sequence()]
        while self.peek() == "|":
            self.i += 1
            branches.append(self.sequence())
        return branches[0] if len(branches) == 1 else ("alt", branches)

    def sequence(self) -> Any:
        items = []
        while (c := self.peek()) is not None and c not in "|)":
            atom = self.atom()
            items.append(self.quantified(atom))
        return ("seq", items)

    def quantified(self, atom: Any) -> Any:
        c = self.peek()
        if c in ("*", "+", "?"):
            self.i += 1
            lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
        elif c == "{" and (q := self.braces()) is not None:
            lo, hi = q
        else:
            return atom
        if self.peek() == "?":  # lazy: the same strings
            self.i += 1
        if atom[0] in ("bol", "eol"):
            raise self.fail("a quantified anchor")
        if self.peek() in ("*", "+", "?") or (self.peek() == "{" and self.braces(look=True) is not None):
            raise self.fail("a quantifier after a quantifier")
        return ("rep", atom, lo, hi)

    def braces(self, look: bool = False) -> tuple[int, int | None] | None:
        """`{n}`, `{n,}` or `{n,m}` at the cursor (consumed unless `look`); None where the brace is a literal."""
        j, s = self.i + 1, self.s
        k = j
        while k < len(s) and s[k] in DIGIT_CHARS:
            k += 1
        if k == j:
            return None
        lo, hi = int(s[j:k]), None
        if k < len(s) and s[k] == ",":
            m = k + 1
            while m < len(s) and s[m] in DIGIT_CHARS:
                m += 1
            hi = int(s[k + 1:m]) if m > k + 1 else None
            k = m
        else:
            hi = lo
        if k >= len(s) or s[k] != "}":
            return None
        if not look:
            self.i = k + 1
            if hi is not None and hi < lo:
                raise PatternError(f"pattern {s!r}: quantifier {{{lo},{hi}}} out of order")
            if max(lo, hi or 0) > MAX_REPEAT:
                raise PatternError(f"pattern {s!r}: a quantifier past {MAX_REPEAT} is not enforced here")
        return lo, hi

    def atom(self) -> Any:
        c = self.s[self.i]
        if c == "(":
            return self.group()
        if c == "[":
            return ("set", self.char_class())
        if c == ".":
            self.i += 1
            return ("set", DOT)
        if c == "^":
            self.i += 1
            return ("bol",)
        if c == "$":
            self.i += 1
            return ("eol",)
        if c == "\\":
            got = self.escape(in_class=False)
            return ("set", got if isinstance(got, list) else [(got, got)])
        if c in "*+?":
            raise self.fail(f"a quantifier {c!r} with nothing to repeat")
        if c == "{" and self.braces(look=True) is not None:
            raise self.fail("a quantifier with nothing to repeat")
        cp = ord(c)
        self.i += 1
        return ("set", normalise([(cp, cp)]))

    def group(self) -> Any:
        self.i += 1
        if self.peek() == "?":
            nxt = self.peek(1)
            if nxt == ":":
                self.i += 2
            elif nxt == "<" and self.peek(2) not in ("=", "!"):
                end = self.s.find(">", self.i)
                if end < 0:
                    raise self.fail("an unterminated group name")
                self.i = end + 1
            else:
                raise self.fail("a lookaround or group flag")
        inner = self.alternation()
        if self.peek() != ")":
            raise PatternError(f"pattern {self.s!r}: unbalanced '('")
        self.i += 1
        return inner

    def char_class(self) -> Ranges:
        self.i += 1
        negate = self.peek() == "^"
        if negate:
            self.i += 1
        ranges: Ranges = []
        first = True
        while True:
            c = self.peek()
            if c is None:
                raise PatternError(f"pattern {self.s!r}: unterminated character class")
            if c == "]" and not first:
                self.i += 1
                break
            if c == "]":  # `[]` matches nothing in ECMA-262, `[^]` anything
                self.i += 1
                break
            first = False
            lo = self.class_atom()
            if self.peek() == "-" and self.peek(1) not in ("]", None) and not isinstance(lo, list):
                self.i += 1
                hi = self.class_atom()
                if isinstance(hi, list):
                    raise self.fail("a range ending in a class escape")
                if hi < lo:
                    raise PatternError(f"pattern {self.s!r}: range out of order in a character class")
                ranges.append((lo, hi))
            elif isinstance(lo, list):
                ranges += lo
            else:
                ranges.append((lo, lo))
        ranges = normalise(ranges)
        return complement(ranges) if negate else ranges

    def class_atom(self) -> int | Ranges:
        c = self.s[self.i]
        if c == "\\":
            return self.escape(in_class=True)
        self.i += 1
        return ord(c)

    def escape(self, in_class: bool) -> int | Ranges:
        """A backslash escape at the cursor: a code point, or a class escape's ranges."""
        self.i += 1
        c = self.peek()
        if c is None:
            raise PatternError(f"pattern {self.s!r}: a trailing backslash")
        self.i += 1
        if c in CLASS_ESCAPES:
            return CLASS_ESCAPES[c]
        if c in CONTROL_ESCAPES and not (c == "0" and (self.peek() or "") in DIGIT_CHARS):
            return CONTROL_ESCAPES[c]
        if c == "b" and in_class:
            return 0x08
        if c == "x":
            return self.hex_digits(2)
        if c == "u":
            if self.peek() == "{":
                end = self.s.find("}", self.i)
                digits = self.s[self.i + 1:end] if end > 0 else ""
                if not 1 <= len(digits) <= 6 or any(d not in HEX_DIGITS for d in digits):
                    raise self.fail("a bad \\u{...} (one to six hex digits)")
                self.i = end + 1
                cp = int(digits, 16)
                if cp > MAX_CP:
                    raise self.fail("a code point past U+10FFFF")
                return cp
            cp = self.hex_digits(4)
            if SURROGATES[0] <= cp <= 0xDBFF and self.s.startswith("\\u", self.i):  # a pair: one code point
                mark = self.i
                self.i += 2
                low = self.hex_digits(4) if len(self.s) >= self.i + 4 else -1
                if 0xDC00 <= low <= SURROGATES[1]:
                    return 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00)
                self.i = mark
            if SURROGATES[0] <= cp <= SURROGATES[1]:
                raise self.fail("a lone surrogate (a code unit, no character: write the character, or "
                                "\\u{...} for one past U+FFFF)")
            return cp
        if c == "c":
            if (self.peek() or "") not in ASCII_LETTERS:
                raise self.fail("\\c without an ASCII letter")
            self.i += 1
            return ord(self.s[self.i - 1]) % 32
        if c in DIGIT_CHARS or c in "bBkpP":
            raise self.fail({"b": "a word boundary", "B": "a word boundary", "k": "a backreference",
                             "p": "a Unicode property escape", "P": "a Unicode property escape"}.get(c, "a backreference"))
        return ord(c)  # an escaped metacharacter or any other identity escape

    def hex_digits(self, n: int) -> int:
        digits = self.s[self.i:self.i + n]
        if len(digits) != n or any(d not in HEX_DIGITS for d in digits):
            raise self.fail(f"a bad escape (\\x or \\u needs {n} hex digits)")
        self.i += n
        return int(digits, 16)


def utf8_sequences(ranges: Ranges) -> list[list[tuple[int, int]]]:
    """The UTF-8 encodings of the code points in `ranges` (no surrogates) as sequences of byte ranges: each
    sequence one byte range a position, the whole set their union."""
    out: list[list[tuple[int, int]]] = []
    for lo, hi in normalise(ranges):
        for a, b in ((0, 0x7F), (0x80, 0x7FF), (0x800, 0xFFFF), (0x10000, MAX_CP)):
            x, y = max(lo, a), min(hi, b)
            if x <= y:
                _split(x, y, out)
    return out


def _split(lo: int, hi: int, out: list) -> None:
    n = len(chr(lo).encode())
    for i in range(1, n):
        m = (1 << (6 * i)) - 1
        if lo & ~m != hi & ~m:
            if lo & m:
                _split(lo, lo | m, out)
                _split((lo | m) + 1, hi, out)
                return
            if hi & m != m:
                _split(lo, (hi & ~m) - 1, out)
                _split(hi & ~m, hi, out)
                return
    out.append(list(zip(chr(lo).encode(), chr(hi).encode(), strict=True)))
