"""Queue-aware eviction shared by the KV tiers: a byte budget over keyed units.

Each unit carries `next_use`, the caller's estimate of when it will be needed next (any monotone clock or
rank the scheduler uses: smaller = sooner; None = unknown, treated as never). When the units exceed the
budget, the one needed LAST goes first (Belady's rule with predictions), ties broken by least recent use.
A unit that is itself the one needed last is refused instead of displacing others (it goes one tier down).
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass
from typing import NamedTuple


@dataclass(slots=True)
class _Entry:
    nbytes: int
    next_use: float  # math.inf when unknown
    touch: int  # recency stamp, larger = more recent


class Dropped(NamedTuple):
    """A unit that left the index: its payload must be moved one tier down or deleted by the caller."""

    key: str
    nbytes: int
    next_use: float | None


def _dropped(key: str, e: _Entry) -> Dropped:
    return Dropped(key, e.nbytes, None if e.next_use == math.inf else e.next_use)


def _next_use(t: float | None) -> float:
    if t is None:
        return math.inf
    t = float(t)
    if math.isnan(t):
        raise ValueError("next_use must not be NaN")
    return t


class BudgetedIndex:
    """Sizes, next-use predictions and recency of keyed units within `budget_bytes`.

    Contract: after every call `used_bytes <= budget_bytes`; `admit` returns the keys it dropped (the
    caller moves or deletes their payloads) in eviction order; victims are chosen in O(log n) from a heap
    whose stale entries are skipped lazily.
    """

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.budget_bytes = int(budget_bytes)
        self.used_bytes = 0
        self._entries: dict[str, _Entry] = {}
        self._heap: list[tuple[float, int, str]] = []  # (-next_use, touch, key): the next victim on top
        self._clock = itertools.count()

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[str]:
        return list(self._entries)

    def nbytes(self, key: str) -> int:
        return self._entries[key].nbytes

    def next_use(self, key: str) -> float | None:
        t = self._entries[key].next_use
        return None if t == math.inf else t

    def _push(self, key: str, e: _Entry) -> None:
        heapq.heappush(self._heap, (-e.next_use, e.touch, key))
        if len(self._heap) > 2 * len(self._entries) + 64:  # too many stale entries: rebuild
            self._heap = [(-x.next_use, x.touch, k) for k, x in self._entries.items()]
            heapq.heapify(self._heap)

    def _insert(self, key: str, e: _Entry) -> None:
        self._entries[key] = e
        self.used_bytes += e.nbytes
        self._push(key, e)

    def _pop_victim(self) -> tuple[str, _Entry]:
        while True:
            neg, touch, key = heapq.heappop(self._heap)
            e = self._entries.get(key)
            if e is not None and e.touch == touch and -neg == e.next_use:
                self.remove(key)
                return key, e

    def admit(self, key: str, nbytes: int, next_use: float | None = None) -> list[Dropped]:
        """Insert (or replace) `key`, then evict until within budget. Returns the dropped keys: either
        others (in eviction order) or `[key]` alone when the new unit does not fit or is the one needed last
        (then nothing else is dropped). The unit counts as just used."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        nu = _next_use(next_use)
        self.remove(key)
        if nbytes > self.budget_bytes:
            return [Dropped(key, int(nbytes), next_use)]
        self._insert(key, _Entry(int(nbytes), nu, next(self._clock)))
        victims: list[tuple[str, _Entry]] = []
        while self.used_bytes > self.budget_bytes:
            victim, e = self._pop_victim()
            if victim == key:
                for k, x in victims:  # NOTE: they fitted before this unit came; they fit again
                    self._insert(k, x)
                return [_dropped(key, e)]
            victims.append((victim, e))
        return [_dropped(k, e) for k, e in victims]

    def remove(self, key: str) -> bool:
        e = self._entries.pop(key, None)
        if e is None:
            return False
        self.used_bytes -= e.nbytes
        return True

    def touch(self, key: str) -> None:
        """Mark a use (a hit): the unit becomes the most recently used."""
        e = self._entries.get(key)
        if e is not None:
            e.touch = next(self._clock)
            self._push(key, e)

    def update_next_use(self, key: str, next_use: float | None) -> bool:
        """Refresh a prediction (not a use). False when the key is absent."""
        e = self._entries.get(key)
        if e is None:
            return False
        e.next_use = _next_use(next_use)
        self._push(key, e)
        return True

    def set_budget(self, budget_bytes: int) -> list[Dropped]:
        """Change the budget; returns the keys evicted to meet it."""
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.budget_bytes = int(budget_bytes)
        out = []
        while self.used_bytes > self.budget_bytes:
            out.append(_dropped(*self._pop_victim()))
        return out

    def eviction_order(self) -> list[str]:
        """All keys, first victim first (tests, /stats)."""
        return [k for k, _ in sorted(self._entries.items(), key=lambda kv: (-kv[1].next_use, kv[1].touch))]
