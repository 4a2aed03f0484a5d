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
wrap it.

Stored conversations outlive a server, a crashed one's too, in the disk tier's folder. A graceful stop saves the
records into one file there (`save_records`: `responses.jsonl`, lines of `[id, parent, text]`, least recently used
first), and the next server on the folder reads them back (`load_records`). Between stops the scheduler actor
writes its store's changes behind (`ResponseJournal`): every `responses_flush_s` the records put and the ids
deleted since the last write become one segment file of the journal (`responses.d/<time ns>-<writer>.jsonl`, a
deletion's line `[id, null, null]`), so a server killed mid-run loses at most that interval's records. A start
reads the saved file, then the segments in time order. Once the segments hold a quarter of the budget, the writer
compacts: the file, every segment and its store are merged into a new file, and its own segments (and any older
than `STALE_SEGMENT_S`: a crashed server's) are deleted.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_BUDGET_BYTES = 64 << 20
SAVED_NAME = "responses.jsonl"  # the records a graceful stop saves, in the disk tier's folder
MAX_CHAIN = 100_000  # turns followed back before a chain is taken for a cycle
JOURNAL_NAME = "responses.d"  # the journal's segments, in the disk tier's folder (ResponseJournal)
_SEGMENT = re.compile(r"(\d{20})-([0-9a-z]+)\.jsonl")  # a segment's name: its time (ns), its writer
COMPACT_MIN_BYTES = 1 << 20  # segment bytes written before a compaction is due, at least (ResponseJournal.due)
COMPACT_SEGMENTS = 1_000  # segments written before a compaction is due, at most
STALE_SEGMENT_S = 600.0  # another writer's segment older than this is deleted once merged (a crashed server's)


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
        return [put_line(rid, e.parent, e.text) for rid, e in self._entries.items()]

    def load(self, lines: list[str], skip: set[str] = frozenset()) -> int:
        """Apply `lines` (`lines`' form, or a journal's: `[id, null, null]` forgets the id) in their order: each
        record put (replacing one of its id, and ranked newest), but those whose ids are in `skip`; lines that do
        not read (a torn file) are passed over. Returns the records put."""
        n = 0
        for line in lines:
            try:
                rid, parent, text = json.loads(line)
            except (ValueError, TypeError):
                continue
            if not isinstance(rid, str):
                continue
            if text is None:
                self._drop(rid)
            elif isinstance(text, str) and rid not in skip \
                    and self.put(rid, parent if isinstance(parent, str) else None, text):
                n += 1
        return n


def put_line(rid: str, parent: str | None, text: str) -> str:
    """A record as a line of the saved file or a journal segment (`ResponseStore.lines`' form)."""
    return json.dumps([rid, parent, text]) + "\n"


def delete_line(rid: str) -> str:
    """A journal segment's line that forgets `rid` (a client's DELETE)."""
    return json.dumps([rid, None, None]) + "\n"


def saved_path(folder_url: str) -> str:
    """Where a graceful stop saves the records: a file in the disk tier's folder (`SAVED_NAME`, which the tier
    leaves alone)."""
    return f"{folder_url.rstrip('/')}/{SAVED_NAME}"


def journal_path(folder_url: str) -> str:
    """The journal's folder (`JOURNAL_NAME`, inside the disk tier's folder, whose listing skips folders)."""
    return f"{folder_url.rstrip('/')}/{JOURNAL_NAME}"


def _read_lines(fs: Any, path: str) -> list[str]:
    try:
        return fs.cat_file(path).decode("utf-8", "replace").split("\n")
    except FileNotFoundError:
        return []


def _segments(fs: Any, folder: str) -> list[str]:
    """The journal's segment files, oldest first (their names begin with their time)."""
    try:
        names = fs.ls(folder, detail=False)
    except FileNotFoundError:
        return []
    paths = [str(n).rstrip("/") for n in names]
    return sorted((p for p in paths if _SEGMENT.fullmatch(p.rsplit("/", 1)[-1])), key=lambda p: p.rsplit("/", 1)[-1])


def _is_local(fs: Any) -> bool:
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return "file" in protocols


def _write(fs: Any, path: str, body: bytes) -> None:
    """`body` into `path` whole: on a local disk through a hidden temporary name moved into place, so a reader
    never sees part of it (a temporary left by a process killed meanwhile is deleted as the disk tier deletes its
    own: `.name.<hex>.tmp`); elsewhere one `pipe_file`."""
    if not _is_local(fs):
        fs.pipe_file(path, body)
        return
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


def save_records(lines: list[str], deleted: set[str], budget_bytes: int, folder_url: str,
                 writer: str | None = None) -> int:
    """A store's records (`ResponseStore.lines`, taken where the store lives) into `saved_path(folder_url)`,
    merged with what the folder already holds (the saved file, then the journal's segments in their order:
    another server's records on the same folder, or an earlier run's) but the ids in `deleted`, the store's the most
    recent, within `budget_bytes`. Then the segments merged that `writer` wrote, or that are older than
    `STALE_SEGMENT_S` (a crashed or long-quiet server's), are deleted: what they held is in the file. At a graceful
    stop, and as the journal's compaction (`ResponseJournal`). Two servers saving at once on one folder: the last
    to move its file wins. Returns the records written."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(saved_path(folder_url))
    merged = ResponseStore(budget_bytes)
    merged.load(_read_lines(fs, path), skip=deleted)
    segments = _segments(fs, journal_path(path.rsplit("/", 1)[0]))
    for seg in segments:
        merged.load(_read_lines(fs, seg), skip=deleted)
    merged.load(lines)  # replaces the folder's copies, and ranks them newest
    _write(fs, path, "".join(merged.lines()).encode())
    stale = time.time_ns() - int(STALE_SEGMENT_S * 1e9)
    kept = 0  # another writer's segments left in place
    for seg in segments:
        stamp, who = _SEGMENT.fullmatch(seg.rsplit("/", 1)[-1]).groups()
        if who != writer and int(stamp) >= stale:
            kept += 1
            continue
        try:
            fs.rm_file(seg)
        except (FileNotFoundError, OSError) as e:  # another server's compaction took it first
            log.debug("journal segment %s not deleted: %s", seg, e)
    if kept and deleted and writer is not None:  # a kept segment may hold a record deleted here: forget it again
        folder = journal_path(path.rsplit("/", 1)[0])
        _write(fs, f"{folder}/{time.time_ns():020d}-{writer}.jsonl", "".join(map(delete_line, sorted(deleted))).encode())
    return len(merged)


def load_records(store: ResponseStore, folder_url: str) -> int:
    """At start: the records the folder holds (the saved file, then the journal's segments in their order: a
    graceful stop's, and those of a server that crashed) into `store`; 0 where there are none or they cannot be
    read (logged). Returns the records put."""
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(saved_path(folder_url))
        n = store.load(_read_lines(fs, path))
        for seg in _segments(fs, journal_path(path.rsplit("/", 1)[0])):
            n += store.load(_read_lines(fs, seg))
        return n
    except Exception as e:  # noqa: BLE001 - a server starts without them rather than not at all
        log.warning("stored responses not read from %s: %s", folder_url, e)
        return 0


class ResponseJournal:
    """A store's changes, written behind into the folder's journal so that they outlive a crash (module
    docstring): `put` / `delete` queue a line, `flush` writes the lines queued as one segment
    (`<time ns>-<writer>.jsonl`), and once the segments written since the last compaction hold a quarter of the
    store's budget (at least `COMPACT_MIN_BYTES`) or number `COMPACT_SEGMENTS`, `due` says so and the owner
    compacts (`save_records` with this writer: the segments merged into the saved file, and deleted). Not
    thread-safe: the owner takes the queued lines (`take`) on its own thread and writes them on another."""

    def __init__(self, folder_url: str, budget_bytes: int, writer: str | None = None) -> None:
        self.folder, self.budget = folder_url, budget_bytes
        self.writer = writer or secrets.token_hex(4)
        self.queued: list[str] = []
        self.queued_bytes = 0
        self.since_bytes = self.since_segments = 0  # written since the last compaction
        self.stats = {"segments": 0, "lines": 0, "compactions": 0, "failures": 0, "dropped": 0}

    def put(self, rid: str, parent: str | None, text: str) -> None:
        self._queue(put_line(rid, parent, text))

    def delete(self, rid: str) -> None:
        self._queue(delete_line(rid))

    def _queue(self, line: str) -> None:
        self.queued.append(line)
        self.queued_bytes += len(line)
        while self.queued_bytes > self.budget and len(self.queued) > 1:  # a folder failing for long: oldest go
            self.queued_bytes -= len(self.queued.pop(0))
            self.stats["dropped"] += 1

    def take(self) -> list[str]:
        """The lines queued since the last `take`, oldest first (put back with `requeue` if their write fails)."""
        lines, self.queued, self.queued_bytes = self.queued, [], 0
        return lines

    def requeue(self, lines: list[str]) -> None:
        """Lines whose write failed, before those queued since (`take`)."""
        rest = self.queued
        self.queued, self.queued_bytes = [], 0
        for line in lines + rest:
            self._queue(line)
        self.stats["failures"] += 1

    def write(self, lines: list[str]) -> str:
        """`lines` as one new segment (on any thread); returns its path."""
        import fsspec

        fs, folder = fsspec.core.url_to_fs(journal_path(self.folder))
        body = "".join(lines).encode()
        path = f"{folder}/{time.time_ns():020d}-{self.writer}.jsonl"
        fs.makedirs(folder, exist_ok=True)
        _write(fs, path, body)
        self.since_bytes += len(body)
        self.since_segments += 1
        self.stats["segments"] += 1
        self.stats["lines"] += len(lines)
        return path

    def due(self) -> bool:
        """Whether the owner should compact now."""
        return (self.since_bytes >= max(COMPACT_MIN_BYTES, self.budget // 4)
                or self.since_segments >= COMPACT_SEGMENTS)

    def compact(self, lines: list[str], deleted: set[str]) -> int:
        """`save_records` of the store's `lines` and `deleted` (taken on the owner's thread) as this writer; the
        journal starts afresh. Returns the records written."""
        n = save_records(lines, deleted, self.budget, self.folder, self.writer)
        self.since_bytes = self.since_segments = 0
        self.stats["compactions"] += 1
        return n


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
