"""Stored responses of the Responses API (``store``, ``previous_response_id``, ``GET`` / ``DELETE
/v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``).

A stored response is one record (JSON-able, so it crosses Ray as plain data):
``{"id", "parent", "input", "response"}``: the previous response it continues (or None), this request's own input
items (each with an id), and the response object as it was returned. A conversation is the chain of its records
(`ResponseStore.chain`): each record's input items, then its response's output items, oldest first; so a record
holds its own turn only and a chain of n turns is stored in O(n), not O(n^2).

`ResponseStore` is the pure core: records kept as their compact JSON text (what crosses Ray, and what the budget
counts, close to the memory they hold), least recently used dropped past a byte budget. Reading a chain touches every record in it, so a live conversation's older turns stay while
abandoned ones age out; a chain with a record dropped is reported broken (`ChainBroken`), never silently cut.
It is not thread-safe: `LocalResponses` (a lock, for the in-process client) and the scheduler actor (one event loop)
wrap it. A server's graceful stop saves the records into the disk tier's folder and the next server on it reads
them back (`save_records`, `load_records`), so stored conversations outlive a restart, not a crash.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_BUDGET_BYTES = 64 << 20
SAVED_NAME = "responses.jsonl"  # the records a graceful stop saves, in the disk tier's folder
MAX_CHAIN = 100_000  # turns followed back before a chain is taken for a cycle


class ChainBroken(LookupError):
    """A chain's record is not in the store: `missing` is its id (the one asked for, or an earlier turn's)."""

    def __init__(self, missing: str, asked: str) -> None:
        super().__init__(missing)
        self.missing, self.asked = missing, asked


@dataclass(slots=True)
class _Entry:
    text: str  # the record's compact JSON
    parent: str | None


def record_text(record: dict[str, Any]) -> str:
    """A record as the store keeps it: its compact JSON (whose length in characters is what it counts)."""
    return json.dumps(record, separators=(",", ":"), ensure_ascii=False)


class ResponseStore:
    """Records (as their JSON text) by response id, least recently used dropped past `budget_bytes` of text
    (module docstring)."""

    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        self.budget = int(budget_bytes)
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self.nbytes = 0
        self.stored = self.dropped = self.refused = 0
        self.deleted: set[str] = set()  # ids deleted (by `delete` alone), which a save keeps out of the folder's file

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, rid: str, parent: str | None, text: str) -> bool:
        """Keep a record's text (replacing one of its id), dropping the least recently used past the budget; a
        record larger than the whole budget is refused (False)."""
        if len(text) > self.budget:
            self.refused += 1
            return False
        self._drop(rid)
        self.deleted.discard(rid)
        self._entries[rid] = _Entry(text, parent)
        self.nbytes += len(text)
        self.stored += 1
        while self.nbytes > self.budget:
            _, old = self._entries.popitem(last=False)
            self.nbytes -= len(old.text)
            self.dropped += 1
        return True

    def get(self, rid: str) -> str | None:
        entry = self._entries.get(rid)
        if entry is None:
            return None
        self._entries.move_to_end(rid)
        return entry.text

    def _drop(self, rid: str) -> bool:
        entry = self._entries.pop(rid, None)
        if entry is None:
            return False
        self.nbytes -= len(entry.text)
        return True

    def delete(self, rid: str) -> bool:
        """Forget a record (a client's DELETE): gone here, and from the folder's file at the next save."""
        self.deleted.add(rid)
        return self._drop(rid)

    def chain(self, rid: str, partial: bool = False) -> list[str]:
        """The records' texts from the conversation's first turn to `rid`'s, oldest first, each touched; raises
        ChainBroken naming the first id not found (or one seen twice: a cycle); with `partial`, the turns back to
        that one instead (ChainBroken only where `rid` itself is not found)."""
        out: list[str] = []
        ids: list[str] = []
        cur: str | None = rid
        while cur is not None:
            entry = self._entries.get(cur) if cur not in ids and len(out) < MAX_CHAIN else None
            if entry is None:
                if partial and out:
                    break
                raise ChainBroken(cur, rid)
            ids.append(cur)
            out.append(entry.text)
            cur = entry.parent
        for key in ids:  # newest first, so the oldest turn, which every later one needs, is dropped last
            self._entries.move_to_end(key)
        out.reverse()
        return out

    def lookup(self, rid: str, partial: bool = False) -> tuple[list[str] | None, str | None]:
        """`chain` as plain data (for a call across processes): (the texts, None), or (None, the missing id)."""
        try:
            return self.chain(rid, partial), None
        except ChainBroken as exc:
            return None, exc.missing

    def stats(self) -> dict[str, int]:
        return {"records": len(self._entries), "bytes": self.nbytes, "budget_bytes": self.budget,
                "stored": self.stored, "dropped": self.dropped, "refused": self.refused}

    def lines(self) -> list[str]:
        """The records as lines of `[id, parent, text]` JSON (ASCII, so no character of a record splits a line),
        least recently used first (`load` keeps the order)."""
        return [json.dumps([rid, e.parent, e.text]) + "\n" for rid, e in self._entries.items()]

    def load(self, lines: list[str], skip: set[str] = frozenset()) -> int:
        """Put the records of `lines` (`lines`' form) in their order, but those whose ids are in `skip` or this
        store, and lines that do not read (a torn file); returns the records put."""
        n = 0
        for line in lines:
            try:
                rid, parent, text = json.loads(line)
            except (ValueError, TypeError):
                continue
            if isinstance(rid, str) and isinstance(text, str) and rid not in self._entries and rid not in skip \
                    and self.put(rid, parent if isinstance(parent, str) else None, text):
                n += 1
        return n


def saved_path(folder_url: str) -> str:
    """Where a graceful stop saves the records: a file in the disk tier's folder (`SAVED_NAME`, which the tier
    leaves alone)."""
    return f"{folder_url.rstrip('/')}/{SAVED_NAME}"


def _read_lines(fs: Any, path: str) -> list[str]:
    try:
        return fs.cat_file(path).decode("utf-8", "replace").split("\n")
    except FileNotFoundError:
        return []


def save_records(lines: list[str], deleted: set[str], budget_bytes: int, folder_url: str) -> int:
    """At a graceful stop: a store's records (`ResponseStore.lines`, taken where the store lives) into
    `saved_path(folder_url)`, merged with the records already there (another server's on the same folder, or an
    earlier run's) but those in `deleted`, the store's the most recent, within `budget_bytes`. On a local disk
    written to a hidden temporary name and moved into place (a temporary left by a process killed meanwhile is the
    disk tier's to delete, as its own). Two servers stopping at once on one folder: the last to move wins. Returns
    the records written."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(saved_path(folder_url))
    merged = ResponseStore(budget_bytes)
    merged.load(_read_lines(fs, path), skip=deleted)
    for line in lines:
        rid, parent, text = json.loads(line)
        merged.put(rid, parent, text)  # replaces the file's copy, and ranks it newer
    body = "".join(merged.lines()).encode()
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    if "file" not in protocols:
        fs.pipe_file(path, body)
        return len(merged)
    folder, name = path.rsplit("/", 1)
    tmp = f"{folder}/.{name}.{secrets.token_hex(6)}.tmp"
    try:
        fs.pipe_file(tmp, body)
        fs.mv(tmp, path)
    except BaseException:
        try:
            fs.rm_file(tmp)
        except OSError:
            pass
        raise
    return len(merged)


def load_records(store: ResponseStore, folder_url: str) -> int:
    """At start: the records a graceful stop saved (`save_records`) into `store`; 0 where there are none or they
    cannot be read (logged)."""
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(saved_path(folder_url))
        return store.load(_read_lines(fs, path))
    except Exception as e:  # noqa: BLE001 - a server starts without them rather than not at all
        log.warning("stored responses not read from %s: %s", folder_url, e)
        return 0


class RemoteResponses:
    """The scheduler actor's store, for the Ray ingress (records cross as their JSON text). `put` submits and
    returns: whether the record fits the budget is known here, so the response can say whether it is stored; Ray
    runs an async actor's calls in no promised order, so a chain read right after may miss the newest turn for a
    moment (`api.app.stored_chain` looks again before calling it missing). The reads wait for the actor."""

    def __init__(self, actor: Any, budget_bytes: int) -> None:
        self.actor, self.budget = actor, budget_bytes

    def put(self, record: dict[str, Any]) -> bool:
        text = record_text(record)
        if len(text) > self.budget:
            return False
        self.actor.put_response.remote(record["id"], record.get("parent"), text)
        return True

    async def chain(self, rid: str, partial: bool = False) -> list[dict[str, Any]]:
        texts, missing = await self.actor.response_chain.remote(rid, partial)
        if texts is None:
            raise ChainBroken(missing, rid)
        return [json.loads(t) for t in texts]

    async def get(self, rid: str) -> dict[str, Any] | None:
        text = await self.actor.get_response.remote(rid)
        return None if text is None else json.loads(text)

    async def delete(self, rid: str) -> bool:
        return await self.actor.delete_response.remote(rid)

    async def stats(self) -> dict[str, int]:
        return await self.actor.response_stats.remote()


class LocalResponses:
    """A `ResponseStore` for the in-process client: the same calls as `RemoteResponses`, under a lock (`put`
    returns at once, whether the record is stored; the reads are coroutines)."""

    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        self.store = ResponseStore(budget_bytes)
        self._lock = threading.Lock()

    def put(self, record: dict[str, Any]) -> bool:
        text = record_text(record)
        with self._lock:
            return self.store.put(record["id"], record.get("parent"), text)

    async def chain(self, rid: str, partial: bool = False) -> list[dict[str, Any]]:
        """The conversation's records up to `rid`, oldest first; raises ChainBroken (`ResponseStore.chain`)."""
        with self._lock:
            texts = self.store.chain(rid, partial)
        return [json.loads(t) for t in texts]

    async def get(self, rid: str) -> dict[str, Any] | None:
        with self._lock:
            text = self.store.get(rid)
        return None if text is None else json.loads(text)

    async def delete(self, rid: str) -> bool:
        with self._lock:
            return self.store.delete(rid)

    async def stats(self) -> dict[str, int]:
        with self._lock:
            return self.store.stats()
