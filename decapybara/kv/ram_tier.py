"""The RAM tier's store: opaque handles (ObjectRefs in the Ray actor, encoded buffers here) within a budget.

Pure bookkeeping, no I/O: `put` returns what no longer fits (queue-aware, see `decapybara.kv.policy`), and
the caller writes those to the disk tier. Not thread-safe (its actor is single-threaded).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, NamedTuple

from decapybara.kv.policy import BudgetedIndex, Dropped


class Spilled(NamedTuple):
    """A unit pushed out of RAM: the caller owns `handle` now (write it one tier down or drop it)."""

    key: str
    handle: Any
    nbytes: int
    next_use: float | None


class RamTierStore:
    """Units by key within `budget_bytes` (the `RAM_CACHE` setting)."""

    def __init__(self, budget_bytes: int) -> None:
        self._index = BudgetedIndex(budget_bytes)
        self._handles: dict[str, Any] = {}
        self.stats: Counter[str] = Counter()  # puts, hits, misses, spills, spilled_bytes

    @property
    def budget_bytes(self) -> int:
        return self._index.budget_bytes

    @property
    def used_bytes(self) -> int:
        return self._index.used_bytes

    def __len__(self) -> int:
        return len(self._handles)

    def __contains__(self, key: str) -> bool:
        return key in self._handles

    def contains(self, key: str) -> bool:
        return key in self._handles

    def keys(self) -> list[str]:
        return list(self._handles)

    def put(self, key: str, handle: Any, nbytes: int, next_use: float | None = None) -> list[Spilled]:
        """Hold `handle` (replacing any unit under `key`); returns the units spilled to make room, in eviction
        order. The new unit itself is the only one spilled when it exceeds the budget or is needed last."""
        if handle is None:
            raise ValueError("a RAM tier handle must not be None")
        old = self._handles.get(key)
        self._handles[key] = handle
        try:
            dropped = self._index.admit(key, nbytes, next_use)
        except BaseException:  # refused (a bad size or next use): the store is as it was
            if old is None:
                self._handles.pop(key, None)
            else:
                self._handles[key] = old
            raise
        self.stats["puts"] += 1
        return self._spill(dropped)

    def _spill(self, dropped: list[Dropped]) -> list[Spilled]:
        out = [Spilled(d.key, self._handles.pop(d.key), d.nbytes, d.next_use) for d in dropped]
        self.stats["spills"] += len(out)
        self.stats["spilled_bytes"] += sum(s.nbytes for s in out)
        return out

    def get(self, key: str) -> Any:
        """The handle (a use: refreshes recency), or None."""
        handle = self._handles.get(key)
        if handle is None:
            self.stats["misses"] += 1
            return None
        self.stats["hits"] += 1
        self._index.touch(key)
        return handle

    def peek(self, key: str) -> Any:
        """The handle without counting a use (None when absent)."""
        return self._handles.get(key)

    def pop(self, key: str) -> Any:
        """Remove and return the handle (the unit resumed or is no longer wanted), or None."""
        self._index.remove(key)
        return self._handles.pop(key, None)

    def nbytes(self, key: str) -> int:
        return self._index.nbytes(key)

    def next_use(self, key: str) -> float | None:
        return self._index.next_use(key)

    def update_next_use(self, key: str, next_use: float | None) -> bool:
        """The scheduler's refreshed prediction for `key` (False when absent)."""
        return self._index.update_next_use(key, next_use)

    def set_budget(self, budget_bytes: int) -> list[Spilled]:
        """Resize (e.g. KEEP_FREE changed); returns the units spilled to meet the new budget."""
        return self._spill(self._index.set_budget(budget_bytes))

    def eviction_order(self) -> list[str]:
        """Keys, first victim first."""
        return self._index.eviction_order()
