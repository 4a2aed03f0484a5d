"""Stored responses of the Responses API (``store``, ``previous_response_id``, ``GET`` / ``DELETE
/v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``).

A stored response is one record (JSON-able, so it crosses Ray as plain data):
``{"id", "parent", "input", "response"}``: the previous response it continues (or None), this request's own input
items (each with an id), and the response object as it was returned. A conversation is the chain of its records
(`ResponseStore.chain`): each record's input items, then its response's output items, oldest first; so a record
holds its own turn only and a chain of n turns is stored in O(n), not O(n^2).

`ResponseStore` is the pure core: least recently used records dropped past a byte budget (a record's bytes are its
compact JSON's). Reading a chain touches every record in it, so a live conversation's older turns stay while
abandoned ones age out; a chain with a record dropped is reported broken (`ChainBroken`), never silently cut.
It is not thread-safe: `LocalResponses` (a lock, for the in-process client) and the scheduler actor (one event loop)
wrap it.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_BUDGET_BYTES = 64 << 20
MAX_CHAIN = 100_000  # turns followed back before a chain is taken for a cycle


class ChainBroken(LookupError):
    """A chain's record is not in the store: `missing` is its id (the one asked for, or an earlier turn's)."""

    def __init__(self, missing: str, asked: str) -> None:
        super().__init__(missing)
        self.missing, self.asked = missing, asked


@dataclass(slots=True)
class _Entry:
    record: dict[str, Any]
    nbytes: int


def record_bytes(record: dict[str, Any]) -> int:
    """The bytes a record is counted at: its compact JSON's."""
    return len(json.dumps(record, separators=(",", ":"), ensure_ascii=False).encode())


class ResponseStore:
    """Records by response id, least recently used dropped past `budget_bytes` (module docstring)."""

    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        self.budget = int(budget_bytes)
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self.nbytes = 0
        self.stored = self.dropped = self.refused = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, record: dict[str, Any]) -> bool:
        """Keep `record` (replacing one of its id), dropping the least recently used past the budget; a record
        larger than the whole budget is refused (False)."""
        size = record_bytes(record)
        if size > self.budget:
            self.refused += 1
            return False
        self.delete(record["id"])
        self._entries[record["id"]] = _Entry(record, size)
        self.nbytes += size
        self.stored += 1
        while self.nbytes > self.budget:
            _, old = self._entries.popitem(last=False)
            self.nbytes -= old.nbytes
            self.dropped += 1
        return True

    def get(self, rid: str) -> dict[str, Any] | None:
        entry = self._entries.get(rid)
        if entry is None:
            return None
        self._entries.move_to_end(rid)
        return entry.record

    def delete(self, rid: str) -> bool:
        entry = self._entries.pop(rid, None)
        if entry is None:
            return False
        self.nbytes -= entry.nbytes
        return True

    def chain(self, rid: str) -> list[dict[str, Any]]:
        """The records from the conversation's first turn to `rid`'s, oldest first, each touched; raises
        ChainBroken naming the first id not found (or one seen twice: a cycle)."""
        out: list[dict[str, Any]] = []
        seen: set[str] = set()
        cur: str | None = rid
        while cur is not None:
            record = self.get(cur) if cur not in seen and len(out) < MAX_CHAIN else None
            if record is None:
                raise ChainBroken(cur, rid)
            seen.add(cur)
            out.append(record)
            cur = record.get("parent")
        for record in out:  # newest first, so the oldest turn, which every later one needs, is dropped last
            self._entries.move_to_end(record["id"])
        out.reverse()
        return out

    def lookup(self, rid: str) -> tuple[list[dict[str, Any]] | None, str | None]:
        """`chain` as plain data (for a call across processes): (the records, None), or (None, the missing id)."""
        try:
            return self.chain(rid), None
        except ChainBroken as exc:
            return None, exc.missing

    def stats(self) -> dict[str, int]:
        return {"records": len(self._entries), "bytes": self.nbytes, "budget_bytes": self.budget,
                "stored": self.stored, "dropped": self.dropped, "refused": self.refused}


class RemoteResponses:
    """The scheduler actor's store, for the Ray ingress: `put` submits and returns (calls from one ingress run in
    the order they were made, so a response's record is in before that ingress reads a chain through it); the
    reads wait for the actor."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def put(self, record: dict[str, Any]) -> None:
        self.actor.put_response.remote(record)

    async def chain(self, rid: str) -> list[dict[str, Any]]:
        records, missing = await self.actor.response_chain.remote(rid)
        if records is None:
            raise ChainBroken(missing, rid)
        return records

    async def get(self, rid: str) -> dict[str, Any] | None:
        return await self.actor.get_response.remote(rid)

    async def delete(self, rid: str) -> bool:
        return await self.actor.delete_response.remote(rid)

    async def stats(self) -> dict[str, int]:
        return await self.actor.response_stats.remote()


class LocalResponses:
    """A `ResponseStore` for the in-process client: the same calls as the scheduler actor's store, under a lock
    (`put` returns at once; the reads are coroutines, as the remote store's)."""

    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        self.store = ResponseStore(budget_bytes)
        self._lock = threading.Lock()

    def put(self, record: dict[str, Any]) -> None:
        with self._lock:
            self.store.put(record)

    async def chain(self, rid: str) -> list[dict[str, Any]]:
        """The conversation's records up to `rid`, oldest first; raises ChainBroken."""
        with self._lock:
            return self.store.chain(rid)

    async def get(self, rid: str) -> dict[str, Any] | None:
        with self._lock:
            return self.store.get(rid)

    async def delete(self, rid: str) -> bool:
        with self._lock:
            return self.store.delete(rid)

    async def stats(self) -> dict[str, int]:
        with self._lock:
            return self.store.stats()
