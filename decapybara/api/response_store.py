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
(`load_records`) reads the saved files, oldest first, then the segments oldest first; a deletion read anywhere
wins over a put read anywhere (`merge_records`: ids are never reused, so such a put is a stale copy). A save
deletes its own segments and takes over the files of writers quiet for `STALE_S` (a stopped or crashed
server's: merged into its own file, then deleted). A live writer beats every `BEAT_S` (`<writer>.alive`), so its
files are never taken over, however idle: servers sharing the folder (two on a host under the default one) lose
nothing to each other. Lines are `[id, parent, text]`, a deletion `[id, null, null]`.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import re
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_BUDGET_BYTES = 64 << 20
SAVED_NAME = "responses.jsonl"  # an earlier version's single saved file (read, then taken over)
MAX_CHAIN = 100_000  # turns followed back before a chain is taken for a cycle
JOURNAL_NAME = "responses.d"  # the records' folder (saved files, segments), in the disk tier's folder
_SEGMENT = re.compile(r"(\d{20})-([0-9a-f]+)\.jsonl")  # a segment's name: its time (ns), its writer
_SAVED = re.compile(r"([0-9a-f]+)\.jsonl")  # a writer's saved file
_ALIVE = re.compile(r"([0-9a-f]+)\.alive")  # a writer's heartbeat
BEAT_S = 120.0  # a live writer's heartbeat interval (well under STALE_S)
COMPACT_MIN_BYTES = 1 << 20  # segment bytes written before a save is due, at least (ResponseJournal.due)
COMPACT_SEGMENTS = 1_000  # segments written before a save is due, at most
STALE_S = 600.0  # another writer quiet this long (a stopped or crashed server) has its files taken over
DELETED_KEEP = 100_000  # deleted ids a store remembers (and saves), the latest


SETTLED = frozenset({"completed", "incomplete", "failed", "cancelled"})  # a response's statuses once it has ended


def text_digest(text: str) -> str:
    """A record text's digest: what a change read, for `ResponseStore.swap`."""
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


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

    def update(self, rid: str, parent: str | None, text: str) -> bool:
        """`put` where the record `rid` is here and its response has not ended (a background run's stores: none
        after a client's DELETE or once a cancel has settled it); False, storing nothing, otherwise."""
        entry = self._entries.get(rid)
        response = json.loads(entry.text).get("response") if entry is not None else None
        if response is None or response["status"] in SETTLED:  # none, or no response's (a conversation's)
            return False
        return self.put(rid, parent, text)

    def swap(self, rid: str, parent: str | None, text: str, digest: str) -> bool | None:
        """`put` where the record `rid` is here with the text `digest` names (`text_digest`): what a change read
        and made, stored only if nothing else stored or deleted the record meanwhile (another ingress replica's
        change). None, storing nothing, where it is gone or has changed (read it again and redo the change)."""
        entry = self._entries.get(rid)
        if entry is None or text_digest(entry.text) != digest:
            return None
        return self.put(rid, parent, text)

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
        return lines_of(self.snapshot())

    def load(self, lines: list[str], missing_only: bool = False, oldest: bool = False) -> int:
        """Apply `lines` (`lines`' form) in their order: each record put (replacing one of its id, ranked newest;
        with `missing_only`, only those not here; with `oldest`, ranked the least recently used, so the first to
        go), each deletion applied and remembered; lines that do not read (a torn file) are passed over. Returns
        the records put."""
        return self.apply(_parsed(lines), missing_only, oldest)

    def apply(self, rows: list[tuple[str, str | None, str | None]], missing_only: bool = False,
              oldest: bool = False) -> int:
        """`load` of parsed lines (`_parsed`'s rows). A record put `oldest` goes in only where it fits the room
        left, so that it never pushes out a record already here."""
        n = 0
        # records going in as the oldest: the newest of them first, each pushed ahead of it, so they keep their order
        ordered = ([r for r in rows if r[2] is None] + [r for r in reversed(rows) if r[2] is not None] if oldest
                   else rows)
        for rid, parent, text in ordered:
            if text is None:
                self._drop(rid)
                self._remember(rid)
            elif missing_only and (rid in self._entries or rid in self.deleted):  # a deleted one stays deleted
                continue
            elif oldest:
                if rid not in self._entries and self.nbytes + len(text) <= self.budget:
                    self.put(rid, parent, text)
                    self._entries.move_to_end(rid, last=False)
                    n += 1
            elif self.put(rid, parent, text):
                n += 1
        return n

    def snapshot(self) -> tuple[list[tuple[str, str | None, str]], list[str]]:
        """The records (id, parent, text), least recently used first, and the deleted ids, as they stand: cheap
        (references), for `lines_of` on another thread."""
        return [(rid, e.parent, e.text) for rid, e in self._entries.items()], list(self.deleted)


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


def lines_of(snapshot: tuple[list[tuple[str, str | None, str]], list[str]]) -> list[str]:
    """A store's `snapshot` as its lines (`ResponseStore.lines`), on any thread."""
    records, deleted = snapshot
    return [put_line(rid, parent, text) for rid, parent, text in records] + [delete_line(rid) for rid in deleted]


def _line(row: tuple[str, str | None, str | None]) -> str:
    return delete_line(row[0]) if row[2] is None else put_line(*row)


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
    path)), each writer's heartbeat file, temporary files, and the files' modification times (seconds; None where
    the listing gives none)."""

    saved: dict[str, str]
    segments: list[tuple[int, str, str]]
    alive: dict[str, str]
    temps: list[str]
    times: dict[str, float | None]

    def writers(self) -> set[str]:
        return set(self.saved) | set(self.alive) | {w for _, w, _ in self.segments}

    def last_seen(self, writer: str) -> float | None:
        """When `writer` last wrote here (its heartbeat, saved file or newest segment), in seconds; None where a
        file of its has no known time (it is then never taken for quiet)."""
        times = [self.times.get(p) for p in (self.saved.get(writer), self.alive.get(writer)) if p is not None]
        if any(t is None for t in times):
            return None
        times += [t / 1e9 for t, w, _ in self.segments if w == writer]
        return max(times, default=0.0)

    def saved_oldest_first(self) -> list[str]:
        return [p for _, p in sorted((self.times.get(p) or 0.0, p) for p in self.saved.values())]


def _info_time(info: dict) -> float | None:
    """A listing entry's modification time in seconds (local `mtime`, object stores' `LastModified` / `updated`
    / `created`, a naive datetime read as UTC)."""
    for key in ("mtime", "LastModified", "last_modified", "updated", "modified", "created"):
        t = info.get(key)
        if t is None:
            continue
        if isinstance(t, int | float):
            return float(t)
        if isinstance(t, str):
            try:
                t = datetime.datetime.fromisoformat(t)  # Python 3.11 reads a trailing Z
            except ValueError:
                continue
        if isinstance(t, datetime.datetime):
            return (t if t.tzinfo else t.replace(tzinfo=datetime.UTC)).timestamp()
    return None


def _list_folder(fs: Any, folder: str) -> _Folder:
    try:
        infos = fs.ls(folder, detail=True)
    except FileNotFoundError:
        infos = []
    out = _Folder({}, [], {}, [], {})
    for info in infos:
        if info.get("type", "file") != "file":
            continue
        path = str(info["name"]).rstrip("/")
        base = path.rsplit("/", 1)[-1]
        out.times[path] = _info_time(info)
        if m := _SEGMENT.fullmatch(base):
            out.segments.append((int(m.group(1)), m.group(2), path))
        elif m := _SAVED.fullmatch(base):
            out.saved[m.group(1)] = path
        elif m := _ALIVE.fullmatch(base):
            out.alive[m.group(1)] = path
        elif base.startswith(".") and base.endswith(".tmp"):
            out.temps.append(path)
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


def merge_records(store: ResponseStore, sources: list[list[str]], missing_only: bool = False,
                  oldest: bool = False) -> int:
    """`sources`' lines into `store`, a deletion anywhere winning over a put anywhere (ids are never reused, so
    a put of a deleted id is a stale copy): the ids deleted first (forgotten, remembered), then every put of
    another id in the sources' order. Returns the records put."""
    return store.apply(parse_merged(sources), missing_only, oldest)


def parse_merged(sources: list[list[str]]) -> list[tuple[str, str | None, str | None]]:
    """`merge_records`' rows of `sources` (on any thread, for `ResponseStore.apply` where the store lives)."""
    return _merged_rows([_parsed(lines) for lines in sources])


def _merged_rows(sources: list[list[tuple[str, str | None, str | None]]]) -> list[tuple[str, str | None, str | None]]:
    """Parsed sources as one list of rows: every deletion first, then the puts of ids no source deletes, in the
    sources' order."""
    gone = {rid for rows in sources for rid, _, text in rows if text is None}
    return [(rid, None, None) for rid in gone] + [row for rows in sources for row in rows
                                                  if row[2] is not None and row[0] not in gone]


def load_records(store: ResponseStore, folder_url: str) -> int:
    """At start: the records the folder holds into `store` (`merge_records`: a deletion saved anywhere wins): an earlier
    version's single file, every writer's saved file (oldest first), then the journals' segments oldest first. 0
    where there are none or they cannot be read (logged). Returns the records put."""
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(saved_path(folder_url))
        folder = _list_folder(fs, journal_path(path.rsplit("/", 1)[0]))
        sources = [_read_lines(fs, path)] + [_read_lines(fs, p) for p in folder.saved_oldest_first()]
        sources += [_read_lines(fs, seg) for _, _, seg in folder.segments]
        return merge_records(store, sources)
    except Exception as e:  # noqa: BLE001 - a server starts without them rather than not at all
        log.warning("stored responses not read from %s: %s", folder_url, e)
        return 0


@dataclass(slots=True)
class Saved:
    """What `save_records` did: the records its file holds, and the lines it took over from writers gone quiet
    (for the live store to merge: records it may not have, deletions it may not know)."""

    records: int
    adopted: list[str]
    rows: list = field(default_factory=list)  # `adopted` as merged rows (parsed off the owner's thread)


def save_records(snapshot: tuple, budget_bytes: int, folder_url: str, writer: str) -> Saved:
    """Writer `writer`'s store (`ResponseStore.snapshot`, taken where the store lives) as its saved file in the records'
    folder (`<writer>.jsonl`), then its segments deleted (what they held is in the store, so in the file). The
    files of writers quiet for `STALE_S` (no heartbeat, save or segment: a stopped or crashed server's; a live
    one beats every `BEAT_S`) are taken over first, as is an earlier version's single file: their lines merged
    under this store's (`merge_records`: a deletion from either wins), returned (`Saved.adopted`), and their files
    deleted. Temporary files `STALE_S` old are deleted. Within `budget_bytes`. At a graceful stop, and when the
    journal is due (`ResponseJournal`)."""
    import fsspec

    fs, legacy = fsspec.core.url_to_fs(saved_path(folder_url))
    root = journal_path(legacy.rsplit("/", 1)[0])
    folder = _list_folder(fs, root)
    stale = time.time() - STALE_S
    quiet = {w for w in folder.writers() - {writer} if (t := folder.last_seen(w)) is not None and t < stale}
    legacy_lines = _read_lines(fs, legacy)
    raw = list(legacy_lines)
    for w in sorted(quiet, key=lambda w: folder.last_seen(w) or 0.0):
        if w in folder.saved:
            raw += _read_lines(fs, folder.saved[w])
    for _, w, seg in folder.segments:
        if w in quiet:
            raw += _read_lines(fs, seg)
    adopted_rows = _parsed(raw)  # torn lines left out
    records, deleted = snapshot
    merged = ResponseStore(budget_bytes)
    merged.apply(_merged_rows([adopted_rows, records + [(rid, None, None) for rid in deleted]]))
    fs.makedirs(root, exist_ok=True)
    _write(fs, f"{root}/{writer}.jsonl", "".join(merged.lines()).encode())
    for _, w, seg in folder.segments:
        if w == writer or w in quiet:
            _rm(fs, seg)
    for w in quiet:
        for files in (folder.saved, folder.alive):
            if w in files:
                _rm(fs, files[w])
    if any(line.strip() for line in legacy_lines):
        _rm(fs, legacy)
    for tmp in folder.temps:
        if (t := folder.times.get(tmp)) is not None and t < stale:
            _rm(fs, tmp)
    return Saved(len(merged), [_line(row) for row in adopted_rows], _merged_rows([adopted_rows]))


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

    def beat(self) -> None:
        """This writer's heartbeat (`<writer>.alive`, its time what counts): a live server's files are never taken
        over, however long it stores nothing (on any thread)."""
        import fsspec

        fs, folder = fsspec.core.url_to_fs(journal_path(self.folder))
        if not self._made:
            fs.makedirs(folder, exist_ok=True)
            self._made = True
        fs.pipe_file(f"{folder}/{self.writer}.alive", str(time.time()).encode())

    def due(self) -> bool:
        """Whether the owner should save now."""
        return (self.since_bytes >= max(COMPACT_MIN_BYTES, self.budget // 4)
                or self.since_segments >= COMPACT_SEGMENTS)

    def compact(self, snapshot: tuple) -> Saved:
        """`save_records` of the store's `snapshot` (taken on the owner's thread) as this writer; the journal
        starts afresh."""
        saved = save_records(snapshot, self.budget, self.folder, self.writer)
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

    async def put_now(self, record: dict[str, Any]) -> bool:
        """`put`, returning once the actor has stored it (so that puts awaited one after another land in order)."""
        text = record_text(record)
        if len(text) > self.budget:
            return False
        return await self.actor.put_response.remote(record["id"], record.get("parent"), text)

    async def update(self, record: dict[str, Any]) -> bool:
        """`ResponseStore.update` on the actor (one call, so nothing lands between its check and its store)."""
        text = record_text(record)
        if len(text) > self.budget:
            return False
        return await self.actor.update_response.remote(record["id"], record.get("parent"), text)

    async def swap(self, record: dict[str, Any], digest: str) -> bool | None:
        """`ResponseStore.swap` on the actor (one call, so nothing lands between its check and its store)."""
        text = record_text(record)
        if len(text) > self.budget:
            return False
        return await self.actor.swap_response.remote(record["id"], record.get("parent"), text, digest)

    async def get_versioned(self, rid: str) -> tuple[dict[str, Any] | None, str | None]:
        """(the record `rid`, the digest of its text for `swap`), (None, None) where it is not stored."""
        text = await self.actor.get_response.remote(rid)
        return (None, None) if text is None else (json.loads(text), text_digest(text))

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

    async def put_now(self, record: dict[str, Any]) -> bool:
        return self.put(record)

    async def update(self, record: dict[str, Any]) -> bool:
        text = record_text(record)
        with self._lock:
            return self.store.update(record["id"], record.get("parent"), text)

    async def swap(self, record: dict[str, Any], digest: str) -> bool | None:
        text = record_text(record)
        with self._lock:
            return self.store.swap(record["id"], record.get("parent"), text, digest)

    async def get_versioned(self, rid: str) -> tuple[dict[str, Any] | None, str | None]:
        with self._lock:
            text = self.store.get(rid)
        return (None, None) if text is None else (json.loads(text), text_digest(text))

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
