"""The disk tier's store: encoded units as files under any fsspec URL, within a byte budget.

One file per unit, `<root>/<key with '/' as '+'>.dkv`. Writes are atomic: with `commit="rename"` (local
disks) a unit is written to a hidden temp name and renamed; with `commit="marker"` (filesystems without an
atomic rename: object stores, `memory://`) the data is written under its name and a unit counts only once an
empty `<name>.dkv.ok` marker exists (removed first when a unit is replaced or deleted). On start the index is
rebuilt from the listing (recency from modification times); a leftover of an interrupted write is deleted once it
has stayed the same for `STALE_WRITE_S` across listings (another live server's write in flight changes or goes).

Servers may share one folder (two on one host under the default `~/.cache/decapybara/kv`): the budget is then the
folder's, not each server's (the smallest of theirs, in effect). A put, or a get of a unit not indexed, lists the
folder again once the last listing is `RESYNC_S` old where another server was seen, and up to `RESYNC_MAX_S` where
none was (`resync`): units another server wrote join the index as just used (counted, and evicted in their turn,
their files deleted), and units whose files another server deleted leave it (a later `get` of one is a miss either
way; `holds` checks the file where the folder is shared). Pages are shared as the engine finds them: those on disk
when a server starts (`TierStores.adopt_pages`), and those another server writes later as `news` reports them.

`get` checks every byte (see `decapybara.kv.units`): a damaged, truncated or misfiled unit is deleted,
counted in `stats["corrupt"]` and reported as a miss, so the caller recomputes instead of using wrong data.
Thread-safety: one writer and any number of readers (file I/O runs under one lock, checksums outside it).
NOTE: no fsync: a power cut may leave a torn file, which the checksums catch (a miss, not wrong data).
"""

from __future__ import annotations

import datetime
import itertools
import logging
import os
import secrets
import threading
import time
from collections import Counter
from typing import Any

import fsspec

from decapybara.kv.policy import BudgetedIndex, Dropped
from decapybara.kv.units import (
    FIXED_SIZE,
    Unit,
    UnitCorrupt,
    byte_view,
    decode_unit,
    header_length,
    is_valid_key,
    read_header,
)

log = logging.getLogger(__name__)

SUFFIX, MARKER_SUFFIX, TEMP_SUFFIX = ".dkv", ".dkv.ok", ".tmp"
STALE_WRITE_S = 600.0  # an uncommitted file seen unchanged this long is an interrupted write (else maybe another
# server's write in flight)
RESYNC_S = 5.0  # a put lists the folder again at most this often where another server was seen on it
NEWS_LIST_S = 60.0  # `news` lists the folder again once the last listing is this old ...
NEWS_LIST_TIMES = 600  # ... and this many times as old as that listing took (a large folder: seldom)
RESYNC_MAX_S = 300.0  # ... and where none was, the interval doubling up to this


def default_cache_url() -> str:
    """`$XDG_CACHE_HOME/decapybara/kv`, else `~/.cache/decapybara/kv`."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "decapybara", "kv")


def _stamp(info: dict[str, Any]) -> float:
    """A file's modification (or creation) time from an fsspec listing entry; 0 when unknown."""
    for k in ("mtime", "LastModified", "last_modified", "updated", "created"):
        v = info.get(k)
        if isinstance(v, int | float):
            return float(v)
        if isinstance(v, datetime.datetime):
            return v.timestamp()
    return 0.0


class DiskTierStore:
    """Units on an fsspec filesystem (the `DISK_CACHE` budget). See the module docstring for the contract."""

    def __init__(self, url: str | None = None, budget_bytes: int = 64 << 30, commit: str | None = None,
                 resync_s: float = RESYNC_S, **storage_options: Any) -> None:
        self.url = url or default_cache_url()
        self.fs, root = fsspec.core.url_to_fs(self.url, **storage_options)
        self.root = root.rstrip("/")
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        self.commit = commit or ("rename" if "file" in protocols else "marker")
        if self.commit not in ("rename", "marker"):
            raise ValueError(f"commit must be 'rename' or 'marker', got {commit!r}")
        self.fs.makedirs(self.root, exist_ok=True)
        self.stats: Counter[str] = Counter()  # puts, hits, misses, corrupt, missing, evicted, rejected, ...
        self._index = BudgetedIndex(budget_bytes)
        self._gen: dict[str, int] = {}  # key -> write generation (a corrupt read deletes only what it read)
        self._counter = itertools.count(1)
        self._snapshots: dict[str, bool] = {}  # key -> the unit holds a hybrid state (`snapshot_flags`)
        self._lock = threading.RLock()
        self.resync_s = resync_s  # and `_interval`: until the next listing is due (`resync`)
        self._listed = 0.0  # time.monotonic() of the last listing
        self._loose: dict[str, tuple[float, tuple[int, float]]] = {}  # uncommitted file -> (first seen, signature)
        self._touched: set[str] | None = None  # keys written or dropped while a listing runs
        self.shared = False  # another server was seen writing or deleting in the folder
        self._took = 0.0  # the last listing's seconds
        self._listing_lock = threading.Lock()  # one `resync` at a time
        self._scan()

    # ---- paths -------------------------------------------------------------------------------------------
    def path_of(self, key: str) -> str:
        """The file (on `self.fs`) that holds `key`'s unit."""
        return self._path(key)

    def _path(self, key: str) -> str:
        return f"{self.root}/{key.replace('/', '+')}{SUFFIX}"

    def _marker(self, key: str) -> str:
        return f"{self.root}/{key.replace('/', '+')}{MARKER_SUFFIX}"

    def _temp(self, key: str) -> str:
        return f"{self.root}/.{key.replace('/', '+')}.{secrets.token_hex(6)}{TEMP_SUFFIX}"

    def _rm(self, path: str) -> None:
        try:
            self.fs.rm_file(path)
        except FileNotFoundError:
            pass
        except Exception as e:  # noqa: BLE001 - fsspec backends raise their own errors; a file we cannot delete
            log.warning("KV disk tier: cannot delete %s: %s", path, e)  # is found again (and retried) at next start

    def _delete_files(self, key: str) -> None:
        if self.commit == "marker":
            self._rm(self._marker(key))  # invisible first
        self._rm(self._path(key))

    # ---- start -------------------------------------------------------------------------------------------
    def _listing(self) -> dict[str, tuple[int, float]]:
        """The committed units in the folder, key -> (size, modification time). An uncommitted file (a temp file;
        in marker mode a marker without its data or data without its marker) is deleted as an interrupted write
        once this store has seen it unchanged for `STALE_WRITE_S` (by its own clock, not the file's time: a live
        server's replacement leaves old data without its marker for a moment); others' files are left alone."""
        try:
            infos = self.fs.ls(self.root, detail=True)
        except FileNotFoundError:
            infos = []
        data: dict[str, tuple[int, float]] = {}
        markers: dict[str, tuple[int, float]] = {}
        loose: dict[str, tuple[int, float]] = {}  # uncommitted files: path -> (size, time)
        for info in infos:
            if info.get("type", "file") != "file":
                continue
            path = info["name"].rstrip("/")
            base = path.rsplit("/", 1)[-1]
            sig = (int(info.get("size") or 0), _stamp(info))
            if base.startswith(".") and base.endswith(TEMP_SUFFIX):
                loose[path] = sig  # a write in flight, or an interrupted one (rename mode)
            elif base.endswith(MARKER_SUFFIX) and is_valid_key(k := base[:-len(MARKER_SUFFIX)].replace("+", "/")):
                markers[k] = sig
            elif base.endswith(SUFFIX) and is_valid_key(k := base[:-len(SUFFIX)].replace("+", "/")):
                data[k] = sig
            # anything else is not ours: left alone
        if self.commit == "marker":
            for k in markers.keys() - data.keys():
                loose[self._marker(k)] = markers[k]
            for k in [k for k in data if k not in markers]:  # written but not (yet) committed
                loose[self._path(k)] = data.pop(k)
        now = time.monotonic()
        seen, self._loose = self._loose, {}
        for path, sig in loose.items():
            first, was = seen.get(path, (now, None))
            if was is not None and was == sig and now - first >= STALE_WRITE_S:
                self._rm(path)
                self.stats["orphans"] += 1
            else:
                self._loose[path] = (first if was == sig else now, sig)
        return data

    def _scan(self) -> None:
        """Rebuild the index from the listing (`_listing`)."""
        data = self._listing()
        self._listed = time.monotonic()
        for k, (size, _) in sorted(data.items(), key=lambda kv: (kv[1][1], kv[0])):  # oldest first = LRU
            self._gen[k] = next(self._counter)
            self._evict(self._index.admit(k, size, None))
        self.stats["found"] = len(self._index)

    @property
    def resync_s(self) -> float:
        """The interval between listings where another server was seen (`resync`); setting it starts it afresh."""
        return self._resync_s

    @resync_s.setter
    def resync_s(self, value: float) -> None:
        self._resync_s = self._interval = float(value)

    def _resync_due(self) -> bool:
        return time.monotonic() - self._listed >= self._interval

    def resync(self) -> list[Dropped]:
        """List the folder again (servers sharing it, module docstring): units not in the index (another server's)
        join it as just used, oldest first, evicting as the budget asks; units whose files are gone leave it.
        Listed outside the lock (a listing of many files takes long); units this store wrote, replaced or
        deleted meanwhile keep what it did. Returns the units evicted. The next listing is due `resync_s` on
        where another server was seen (units that appeared or vanished), else twice as long as the last interval
        (a lone server lists seldom, `RESYNC_MAX_S`), and never sooner than ten listings' time."""
        if not self._listing_lock.acquire(blocking=False):
            return []  # another thread is listing: its listing serves
        try:
            return self._resync()
        finally:
            self._listing_lock.release()

    def _resync(self) -> list[Dropped]:
        with self._lock:
            mark = next(self._counter)  # units written from here on are newer than the listing
            self._touched = set()
        t0 = time.monotonic()
        data = self._listing()
        took = self._took = time.monotonic() - t0
        dropped: list[Dropped] = []
        with self._lock:
            self._listed = time.monotonic()
            held = self._index.keys()
            gone = [k for k in held if k not in data and self._gen.get(k, 0) < mark and k not in self._touched]
            for k in gone:
                self._forget(k, "vanished")
            # units another server wrote again under a key held here (a page with or without its state snapshot),
            # counted at their size now so that the folder stays within the budget; then units new here
            resized = [(k, data[k][0], self._index.next_use(k)) for k in held
                       if k in data and k in self._index and data[k][0] != self._index.nbytes(k)
                       and self._gen.get(k, 0) < mark and k not in self._touched]
            new = sorted(((v[1], k, v[0]) for k, v in data.items()
                          if k not in self._index and k not in self._touched))
            for (k, size, next_use), why in [*((r, "resized") for r in resized),
                                             *(((k, size, None), "foreign") for _, k, size in new)]:
                self._gen[k] = next(self._counter)
                self._snapshots.pop(k, None)  # another server's unit: its flag is read from its file
                self.stats[why] += 1
                evicted = self._index.admit(k, size, next_use)
                self._evict(evicted)
                dropped += evicted
            self._touched = None
            self.shared = self.shared or bool(gone or new or resized)
            self._interval = self.resync_s if gone or new or resized else min(RESYNC_MAX_S, 2 * self._interval)
            if self.resync_s > 0:
                self._interval = max(self._interval, 10 * took)
        return dropped

    def holds(self, key: str) -> bool:
        """Whether the unit is here: in the index and, once another server was seen on the folder (`shared`),
        still on disk (it may have been evicted there since the last listing)."""
        if key not in self._index:
            return False
        if not self.shared:
            return True
        try:
            if self.fs.exists(self._path(key)):
                return True
        except OSError:
            return True  # cannot tell: the get will
        with self._lock:
            if key in self._index:
                self._forget(key, "vanished")
        return False

    def _forget(self, key: str, why: str | None) -> None:
        """Drop an indexed unit whose file is gone or going (another server's, or anyone's, deletion; a corrupt
        one's), counted as `why` where given."""
        if self._touched is not None:  # a listing under way may have seen its file: it does not bring it back
            self._touched.add(key)
        self._unindex(key)
        if why is not None:
            self.stats[why] += 1

    def _unindex(self, key: str) -> None:
        """`key` out of the index, its generation and its snapshot flag."""
        self._index.remove(key)
        self._gen.pop(key, None)
        self._snapshots.pop(key, None)

    # ---- queries -------------------------------------------------------------------------------------------
    @property
    def budget_bytes(self) -> int:
        return self._index.budget_bytes

    @property
    def used_bytes(self) -> int:
        return self._index.used_bytes

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, key: str) -> bool:
        return key in self._index

    def contains(self, key: str) -> bool:
        return key in self._index

    def keys(self) -> list[str]:
        with self._lock:
            return self._index.keys()

    def next_use(self, key: str) -> float | None:
        return self._index.next_use(key)

    def eviction_order(self) -> list[str]:
        with self._lock:
            return self._index.eviction_order()

    # ---- writes ----------------------------------------------------------------------------------------------
    def _evict(self, dropped: list[Dropped]) -> None:
        for d in dropped:
            self._forget(d.key, "evicted")
            self._delete_files(d.key)
            self.stats["evicted_bytes"] += d.nbytes

    def put(self, key: str, data: Any, next_use: float | None = None) -> list[Dropped]:
        """Store an encoded unit under `key` (replacing any). Returns the units dropped: others evicted to
        make room, or `[key]` alone when this unit does not fit, is the one needed last, or could not be
        written (OSError, counted in `stats["write_errors"]`). Raises UnitCorrupt when `data` is not a unit
        and ValueError when it is another key's unit."""
        if not is_valid_key(key):
            raise ValueError(f"bad unit key {key!r}")
        mv = byte_view(data)
        header = read_header(mv)
        if header.key != key:
            raise ValueError(f"unit {header.key!r} put under key {key!r}")
        nbytes = len(mv)
        others = [d for d in self.resync() if d.key != key] if self._resync_due() else []
        with self._lock:
            if self._touched is not None:
                self._touched.add(key)
            existed = key in self._index
            dropped = self._index.admit(key, nbytes, next_use)
            if any(d.key == key for d in dropped):
                if existed:
                    self._delete_files(key)
                    self._unindex(key)
                self.stats["rejected"] += 1
                return dropped
            self._evict(dropped)
            try:
                self._write(key, mv)
            except Exception as e:  # noqa: BLE001 - OSError, or a backend's own (HTTP, SDK, NotImplementedError)
                log.warning("KV disk tier: cannot write %s: %s", key, e)
                self._unindex(key)
                self._delete_files(key)  # any older version too: the index no longer counts it
                self.stats["write_errors"] += 1
                return dropped + [Dropped(key, nbytes, next_use)]
            except BaseException:
                self._unindex(key)
                raise
            self._gen[key] = next(self._counter)
            self._snapshots[key] = header.state_layers is not None
            self.stats["puts"] += 1
            self.stats["bytes_written"] += nbytes
            return others + dropped

    def _write(self, key: str, mv: memoryview) -> None:
        path = self._path(key)
        if self.commit == "rename":
            tmp = self._temp(key)
            try:
                self.fs.pipe_file(tmp, mv)
                self.fs.mv(tmp, path)
            except Exception:  # NOTE: not BaseException: a process being killed leaves the temp to _scan
                self._rm(tmp)
                raise
        else:
            self._rm(self._marker(key))
            try:
                self.fs.pipe_file(path, mv)
                self.fs.pipe_file(self._marker(key), b"")
            except Exception:
                self._rm(path)
                raise

    def delete(self, key: str) -> bool:
        """Remove a unit; False when absent."""
        with self._lock:
            if self._touched is not None:
                self._touched.add(key)
            if not self._index.remove(key):
                return False
            self._gen.pop(key, None)
            self._snapshots.pop(key, None)
            self._delete_files(key)
            self.stats["deleted"] += 1
            return True

    def update_next_use(self, key: str, next_use: float | None) -> bool:
        with self._lock:
            return self._index.update_next_use(key, next_use)

    def refresh(self, keys: list[str]) -> None:
        """Mark `keys` used in this order (the last the most recent) and drop their next-use estimates; on a local
        disk their files' modification times follow, so that a restart's scan ranks them the same (a save's
        pages, ranked while it ran)."""
        now = time.time()
        with self._lock:
            for i, key in enumerate(keys):
                if key not in self._index:
                    continue
                self._index.update_next_use(key, None)
                self._index.touch(key)
                if self.commit == "rename":
                    stamp = now + i * 1e-6
                    try:
                        os.utime(self._path(key), (stamp, stamp))
                    except OSError:
                        pass  # the scan then ranks it by its write

    def set_budget(self, budget_bytes: int) -> list[Dropped]:
        """Resize; units beyond the new budget are deleted (returned)."""
        with self._lock:
            dropped = self._index.set_budget(budget_bytes)
            self._evict(dropped)
            return dropped

    def snapshot_flags(self, prefix: str, budget_s: float = 10.0) -> dict[str, bool | None]:
        """Every unit whose key starts with `prefix`, with whether it holds a hybrid state snapshot: known from its
        put, else read from the file's header (units found at start). None where the header could not be read
        within `budget_s` in all, or at all; the unit itself is checked whole when it is read (`get`)."""
        with self._lock:
            held = self._index.keys()
        return self._flags([k for k in held if k.startswith(prefix)], budget_s)

    def _flags(self, keys: list[str], budget_s: float) -> dict[str, bool | None]:
        """Each unit's snapshot flag: known from its put, else read from its file's header while `budget_s` lasts."""
        deadline = time.monotonic() + budget_s
        out: dict[str, bool | None] = {}
        for k in keys:
            flag = self._snapshots.get(k)
            if flag is None and time.monotonic() < deadline:
                flag = self._peek_snapshot(k)
            out[k] = flag
        return out

    def news(self, prefix: str, since: int, budget_s: float = 1.0) -> tuple[int, dict[str, bool | None]]:
        """The units under `prefix` that joined the index after generation `since` (this store's writes and another
        server's units, the folder listed again where `resync` is due or the last listing is `NEWS_LIST_S` old),
        with their snapshot flags (`snapshot_flags`' way, headers read within `budget_s`), and the generation to
        ask from next time. How a server learns of the prefix pages another one sharing the folder writes."""
        if self._resync_due() or time.monotonic() - self._listed >= max(NEWS_LIST_S, NEWS_LIST_TIMES * self._took):
            self.resync()
        with self._lock:
            mark = next(self._counter)
            keys = [k for k, g in self._gen.items() if since < g < mark and k.startswith(prefix) and k in self._index]
        return mark, self._flags(keys, budget_s)

    def _peek_snapshot(self, key: str) -> bool | None:
        """Whether `key`'s file holds a hybrid state, from its header alone; None when unreadable or corrupt."""
        try:
            size = self._index.nbytes(key)
            with self.fs.open(self._path(key), "rb") as f:
                head = f.read(FIXED_SIZE)
                head += f.read(header_length(head) - FIXED_SIZE)
            h = read_header(head, size)
        except (KeyError, UnitCorrupt):
            return None
        except Exception as e:  # noqa: BLE001 - fsspec backends raise their own errors: an unknown flag, not a failure
            log.debug("KV disk tier: cannot read the header of %s: %s", key, e)
            return None
        if h.key != key:
            return None
        flag = h.state_layers is not None
        with self._lock:
            if key in self._index:
                self._snapshots[key] = flag
        return flag

    # ---- reads -----------------------------------------------------------------------------------------------
    def get(self, key: str) -> Unit | None:
        """The unit, fully verified (its arrays view the file's bytes), or None: absent, vanished, or corrupt
        (then deleted and counted). A hit refreshes recency."""
        found = self.get_verified(key)
        return None if found is None else found[0]

    def get_bytes(self, key: str) -> bytes | None:
        """Like `get`, but the verified encoded bytes (to ship elsewhere without re-encoding)."""
        found = self.get_verified(key)
        return None if found is None else found[1]

    def get_verified(self, key: str) -> tuple[Unit, bytes] | None:
        """(unit, its encoded bytes) after full verification, or None (see `get`)."""
        if key not in self._index and self._resync_due():
            self.resync()  # another server sharing the folder may have written it since
        with self._lock:
            if key not in self._index:
                self.stats["misses"] += 1
                return None
            gen = self._gen.get(key)
            try:
                raw = self.fs.cat_file(self._path(key))
            except FileNotFoundError:  # removed behind our back
                self._forget(key, "missing")
                return None
            except OSError as e:
                log.warning("KV disk tier: cannot read %s: %s", key, e)
                self.stats["read_errors"] += 1
                return None
            self._index.touch(key)
        try:
            unit = decode_unit(raw)
            if unit.key != key:
                raise UnitCorrupt("bad_json", f"file of {key!r} holds unit {unit.key!r}")
        except UnitCorrupt as e:
            log.warning("KV disk tier: %s is corrupt (%s); deleted", key, e)
            with self._lock:
                self.stats["corrupt"] += 1
                if self._gen.get(key) == gen:  # not replaced meanwhile
                    self._forget(key, None)
                    self._delete_files(key)
            return None
        with self._lock:
            self.stats["hits"] += 1
            self.stats["bytes_read"] += len(raw)
        return unit, raw

    def pop(self, key: str) -> Unit | None:
        """`get` then `delete` (a resumed conversation's bundle is not needed again)."""
        with self._lock:
            unit = self.get(key)
            if unit is not None:
                self.delete(key)
            return unit
