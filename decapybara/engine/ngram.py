"""Prompt-lookup drafts (SPECULATOR ngram): the token that followed the latest earlier occurrence of a sequence's
last few tokens. Coding agents re-emit what their context holds (a file they read, the call they just wrote),
so the continuation of a repeated n-gram is often the next token; any model can verify it as a second row, with
no head or draft model.

`NgramIndex` keeps, per sequence, the latest ending position of every n-gram (n in [min_n, max_n]) whose next
token is known, extended as tokens are appended: O(1) dictionary work a token (built over a prompt once, at its
first proposal), so a step's drafts cost no scan of a long context.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class NgramIndex:
    """The latest earlier position of a token list's n-grams (see the module docstring). `propose` takes the list
    as it grows: only appended tokens are indexed again."""

    min_n: int = 2
    max_n: int = 3
    upto: int = 0  # ending positions [0, upto) are indexed
    last: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> latest ending position indexed

    def extend(self, tokens: Sequence[int], upto: int) -> None:
        """Index the ending positions [self.upto, upto) of `tokens` (each with a next token: upto < len(tokens)):
        a prompt indexed chunk by chunk as it is computed, so that its first proposal does not build the index
        of a long prompt in one step (~0.1 s at 100k tokens)."""
        for e in range(self.upto, min(upto, len(tokens) - 1)):
            for n in range(self.min_n, self.max_n + 1):
                if e - n + 1 < 0:
                    break
                self.last[tuple(tokens[e - n + 1:e + 1])] = e
        self.upto = max(self.upto, min(upto, len(tokens) - 1))

    def propose(self, tokens: Sequence[int], k: int = 1) -> tuple[tuple[int, ...], int]:
        """(`k` tokens after the latest earlier occurrence of the longest n-gram that ends `tokens`, n), longest
        first from max_n down to min_n; ((), 0) where none recurs. Positions whose next token is known are indexed
        (every one but the last), so a match is always strictly earlier than the end and has at least one token
        after it. Where the list ends within `k` tokens of the match, the text repeats with the period of the
        match's distance from the end (a run of one token, a line written again and again), so the proposal goes
        on with the tokens that period back, its own included: a loop is drafted `k` tokens deep, not one."""
        self.extend(tokens, len(tokens) - 1)  # the suffix's own end: not indexed (it has no next token yet)
        for n in range(self.max_n, self.min_n - 1, -1):
            if n > len(tokens):
                continue
            e = self.last.get(tuple(tokens[len(tokens) - n:]))
            if e is not None:
                shift, out = len(tokens) - 1 - e, []  # tokens[e - n + 1:e + 1] == tokens[-n:]: shift apart
                for j in range(k):
                    out.append(int(tokens[e + 1 + j]) if e + 1 + j < len(tokens) else out[j - shift])
                return tuple(out), n
        return (), 0
