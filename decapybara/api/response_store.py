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

Stored conversations outlive a server, a crashed one's too, in the records' folder (`responses.d/` in the disk tier's
folder). Each server (a writer, named afresh at each start) keeps two kinds of files there. Its saved file
(`<writer>.jsonl`: its store's records, least recently used first, then the ids it deleted) is written by
`save_records` at a graceful stop and whenever its journal grows past a quarter of the budget. Between saves, its
journal (`ResponseJournal`) turns the records put and the ids deleted since the last write into a segment every
`responses_flush_s` (`<time ns>-<writer>.jsonl`), so a server killed mid-run loses at most one interval. A start
(`load_records`) reads every saved file's records, then their deletions, then the segments oldest first. A save
deletes its own segments and takes over the files of writers quiet for `STALE_S` (a stopped or crashed
server's: merged into its own file, then deleted); it never deletes a live writer's, so servers sharing the folder
(two on a host under the default one) lose nothing to each other. Lines are `[id, parent, text]`, a deletion
`[id, null, null]`.
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
SAVED_NAME = "responses.jsonl"  # an earlier version's single saved file (read, then taken over)
MAX_CHAIN = 100_000  # turns followed back before a chain is taken for a cycle
JOURNAL_NAME = "responses.d"  # the records' folder (saved files, segments), in the disk tier's folder
_SEGMENT = re.compile(r"(\d{20})-([0-9a-f]+)\.jsonl")  # a segment's name: its time (ns), its writer
_SAVED = re.compile(r"([0-9a-f]+)\.jsonl")  # a writer's saved file
COMPACT_MIN_BYTES = 1 << 20  # segment bytes written before a save is due, at least (ResponseJournal.due)
COMPACT_SEGMENTS = 1_000  # segments written before a save is due, at most
STALE_S = 600.0  # another writer quiet this long (a stopped or crashed server) has its files taken over
DELETED_KEEP = 100_000  # deleted ids a store remembers (and saves), the latest


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
        # ids deleted (a client's DELETE, or a deletion read from the folder), the latest DELETED_KEEP: a save
        # writes them as deletions, so another server's copy of one does not come back
        self.deleted: OrderedDict[str, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, rid: str, parent: str | None, text: str) -> bool:
        """Keep a record's text (replacing one of its id), dropping the least recently used past the budget; a
        record larger than the whole budget is refused (False)."""
        if len(text) > self.budget:
            self.refused += 1
            return False
        self._drop(rid)
        self.deleted.pop(rid, None)
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
        """Forget a record (a client's DELETE): gone here, and, where it was here, remembered as deleted (a
        save writes its deletion). Returns whether it was here."""
        if not self._drop(rid):
            return False
        self._remember(rid)
        return True

    def _remember(self, rid: str) -> None:
        self.deleted[rid] = None
        self.deleted.move_to_end(rid)
        while len(self.deleted) > DELETED_KEEP:
            self.deleted.popitem(last=False)

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
        least recently used first (`load` keeps the order), then a `[id, null, null]` line a deleted id."""
        return ([put_line(rid, e.parent, e.text) for rid, e in self._entries.items()]
                + [delete_line(rid) for rid in self.deleted])

    def load(self, lines: list[str], puts: bool = True, deletions: bool = True, missing_only: bool = False) -> int:
        """Apply `lines` (`lines`' form) in their order: each record put (replacing one of its id, ranked newest;
        with `missing_only`, only those not here) where `puts`, each deletion applied and remembered where
        `deletions`; lines that do not read (a torn file) are passed over. Returns the records put."""
        n = 0
        for rid, parent, text in _parsed(lines):
            if text is None:
                if deletions:
                    self._drop(rid)
                    self._remember(rid)
            elif puts and not (missing_only and rid in self._entries) and self.put(rid, parent, text):
                n += 1
        return n


def _parsed(lines: list[str]) -> list[tuple[str, str | None, str | None]]:
    out = []
    for line in lines:
        try:
            rid, parent, text = json.loads(line)
        except (ValueError, TypeError):
            continue
        if isinstance(rid, str) and (text is None or isinstance(text, str)):
            out.append((rid, parent if isinstance(parent, str) else None, text))
    return out


def put_line(rid: str, parent: str | None, text: str) -> str:
    """A record as a line of a saved file or a journal segment (`ResponseStore.lines`' form)."""
    return json.dumps([rid, parent, text]) + "\n"


def delete_line(rid: str) -> str:
    """The line of a deletion: `rid` is forgotten where it is read."""
    return json.dumps([rid, None, None]) + "\n"


def saved_path(folder_url: str) -> str:
    """The single file an earlier version's graceful stop saved the records to (read at start, merged into the
    first save, then deleted)."""
    return f"{folder_url.rstrip('/')}/{SAVED_NAME}"


def journal_path(folder_url: str) -> str:
    """The records' folder (`JOURNAL_NAME`, inside the disk tier's folder, whose listing skips folders)."""
    return f"{folder_url.rstrip('/')}/{JOURNAL_NAME}"


def _read_lines(fs: Any, path: str) -> list[str]:
    try:
        return fs.cat_file(path).decode("utf-8", "replace").split("\n")
    except FileNotFoundError:
        return []


@dataclass(slots=True)
class _Folder:
    """What the records' folder holds: each writer's saved file, the segments oldest first ((stamp, writer,
    path)), and temporary files (path -> modification time, or None where the listing gives none)."""

    saved: dict[str, str]
    segments: list[tuple[int, str, str]]
    temps: dict[str, float | None]

    def newest(self, writer: str) -> int:
        """The stamp of `writer`'s newest segment (0: none)."""
        return max((t for t, w, _ in self.segments if w == writer), default=0)


def _list_folder(fs: Any, folder: str) -> _Folder:
    try:
        infos = fs.ls(folder, detail=True)
    except FileNotFoundError:
        infos = []
    out = _Folder({}, [], {})
    for info in infos:
        if info.get("type", "file") != "file":
            continue
        path = str(info["name"]).rstrip("/")
        base = path.rsplit("/", 1)[-1]
        if m := _SEGMENT.fullmatch(base):
            out.segments.append((int(m.group(1)), m.group(2), path))
        elif m := _SAVED.fullmatch(base):
            out.saved[m.group(1)] = path
        elif base.startswith(".") and base.endswith(".tmp"):
            t = info.get("mtime", info.get("LastModified", info.get("created")))
            out.temps[path] = t.timestamp() if hasattr(t, "timestamp") else (float(t) if t is not None else None)
    out.segments.sort()
    return out


def _is_local(fs: Any) -> bool:
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return "file" in protocols


def _write(fs: Any, path: str, body: bytes) -> None:
    """`body` into `path` whole: on a local disk through a hidden temporary name moved into place, so a reader
    never sees part of it (a temporary left by a process killed meanwhile is deleted by a later save, once
    `STALE_S` old); elsewhere one `pipe_file`."""
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


def _rm(fs: Any, path: str) -> None:
    try:
        fs.rm_file(path)
    except (FileNotFoundError, OSError) as e:  # another server's save took it first
        log.debug("%s not deleted: %s", path, e)


def load_records(store: ResponseStore, folder_url: str) -> int:
    """At start: the records the folder holds into `store`: an earlier version's single file and every writer's
    saved file (their records first, then their deletions, so a deletion saved by one server forgets another's
    copy), then the journals' segments oldest first. 0 where there are none or they cannot be read (logged).
    Returns the records put (one put twice counts twice)."""
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(saved_path(folder_url))
        folder = _list_folder(fs, journal_path(path.rsplit("/", 1)[0]))
        saved = [_read_lines(fs, path)] + [_read_lines(fs, p) for _, p in sorted(folder.saved.items())]
        n = sum(store.load(lines, deletions=False) for lines in saved)
        for lines in saved:
            store.load(lines, puts=False)
        for _, _, seg in folder.segments:
            n += store.load(_read_lines(fs, seg))
        return n
    except Exception as e:  # noqa: BLE001 - a server starts without them rather than not at all
        log.warning("stored responses not read from %s: %s", folder_url, e)
        return 0


@dataclass(slots=True)
class Saved:
    """What `save_records` did: the records its file holds, and the lines it took over from writers gone quiet
    (for the live store to load: records it may not have yet)."""

    records: int
    adopted: list[str]


def save_records(lines: list[str], budget_bytes: int, folder_url: str, writer: str) -> Saved:
    """Writer `writer`'s store (`ResponseStore.lines`, taken where the store lives) as its saved file in the records'
    folder (`<writer>.jsonl`), then its segments deleted (what they held is in the store, so in the file). The
    files of other writers quiet for `STALE_S` (a stopped or crashed server's) are taken over first: their saved
    file's and segments' lines merged under this store's (which rank newest), returned (`Saved.adopted`), and their
    files deleted; so is an earlier version's single file. A live writer's files are never deleted, so servers
    sharing the folder lose nothing to each other. Temporary files `STALE_S` old are deleted. Within
    `budget_bytes`. At a graceful stop, and as the journal's compaction (`ResponseJournal`)."""
    import fsspec

    fs, legacy = fsspec.core.url_to_fs(saved_path(folder_url))
    root = journal_path(legacy.rsplit("/", 1)[0])
    folder = _list_folder(fs, root)
    now = time.time_ns()
    stale = now - int(STALE_S * 1e9)
    quiet = {w for w in folder.saved if w != writer and folder.newest(w) < stale
             and _mtime_ns(fs, folder.saved[w], now) < stale}
    quiet |= {w for _, w, _ in folder.segments if w != writer and folder.newest(w) < stale and w not in folder.saved}
    adopted = _read_lines(fs, legacy)
    for w in sorted(quiet):
        if w in folder.saved:
            adopted += _read_lines(fs, folder.saved[w])
    for _, w, seg in folder.segments:
        if w in quiet:
            adopted += _read_lines(fs, seg)
    adopted = [line + "\n" for line in adopted if _parsed([line])]  # torn lines left out
    merged = ResponseStore(budget_bytes)
    merged.load(adopted)
    merged.load(lines)
    fs.makedirs(root, exist_ok=True)
    _write(fs, f"{root}/{writer}.jsonl", "".join(merged.lines()).encode())
    for _, w, seg in folder.segments:
        if w == writer or w in quiet:
            _rm(fs, seg)
    for w in quiet:
        if w in folder.saved:
            _rm(fs, folder.saved[w])
    if adopted and fs.exists(legacy):
        _rm(fs, legacy)
    for tmp, t in folder.temps.items():
        if t is not None and t * 1e9 < stale:
            _rm(fs, tmp)
    return Saved(len(merged), adopted)


def _mtime_ns(fs: Any, path: str, default: int) -> int:
    try:
        t = fs.modified(path)
        return int(t.timestamp() * 1e9)
    except (NotImplementedError, OSError, AttributeError):
        return default  # unknown: counted as now, so never taken for quiet


class ResponseJournal:
    """A store's changes, written behind into the records' folder so that they outlive a crash (module
    docstring): `put` / `delete` queue a line; `write` puts the lines queued (`take`) in one segment
    (`<time ns>-<writer>.jsonl`, times increasing within a writer whatever the clock does); once the segments written
    since the last save hold a quarter of the store's budget (at least `COMPACT_MIN_BYTES`) or number
    `COMPACT_SEGMENTS`, `due` says so and the owner saves (`compact`: `save_records` as this writer). Not
    thread-safe: the owner takes the queued lines on its own thread and writes them on another."""

    def __init__(self, folder_url: str, budget_bytes: int, writer: str | None = None) -> None:
        self.folder, self.budget = folder_url, budget_bytes
        self.writer = writer or secrets.token_hex(6)
        self.queued: list[str] = []
        self.queued_bytes = 0
        self.since_bytes = self.since_segments = 0  # written since the last save
        self._stamp = 0
        self._made = False  # the folder made
        self.stats = {"segments": 0, "lines": 0, "saves": 0, "failures": 0, "dropped": 0}

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
        """`lines` as one new segment (on any thread, one write at a time); returns its path."""
        import fsspec

        fs, folder = fsspec.core.url_to_fs(journal_path(self.folder))
        body = "".join(lines).encode()
        self._stamp = max(time.time_ns(), self._stamp + 1)
        path = f"{folder}/{self._stamp:020d}-{self.writer}.jsonl"
        if not self._made:
            fs.makedirs(folder, exist_ok=True)
            self._made = True
        _write(fs, path, body)
        self.since_bytes += len(body)
        self.since_segments += 1
        self.stats["segments"] += 1
        self.stats["lines"] += len(lines)
        return path

    def due(self) -> bool:
        """Whether the owner should save now."""
        return (self.since_bytes >= max(COMPACT_MIN_BYTES, self.budget // 4)
                or self.since_segments >= COMPACT_SEGMENTS)

    def compact(self, lines: list[str]) -> Saved:
        """`save_records` of the store's `lines` (taken on the owner's thread) as this writer; the journal starts
        afresh."""
        saved = save_records(lines, self.budget, self.folder, self.writer)
        self.since_bytes = self.since_segments = 0
        self.stats["saves"] += 1
        return saved


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
