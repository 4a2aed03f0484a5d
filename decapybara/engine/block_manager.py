"""CPU bookkeeping of the paged KV pool: free pages, ref counts, and the content-addressed prefix cache.

A page holds `page_size` consecutive tokens of one sequence. Once full, a page is identified by a hash chain
over all tokens up to its end (`hash_i = H(hash_{i-1}, tokens of page i)`, with a namespace salt that names
the model and KV mode), registered in the prefix cache, and may be shared by any sequence whose tokens start
the same way. Unreferenced registered pages stay cached (LRU) until the pool needs them.

For hybrid models the DeltaNet/conv state after a full page is kept as a snapshot keyed by the same hash
(bounded by `snapshot_budget_bytes`, dropped with its page), so a prefix is reusable only up to the deepest
page that has a snapshot.

Contract: `allocate` / `append` return None when the pool cannot satisfy them (the caller decides whom to
pause); every page is either free, referenced by >= 1 sequence, or cached with ref count 0 (evictable).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np


def page_hash(parent: bytes, tokens: np.ndarray | list[int]) -> bytes:
    """16-byte hash of a full page given its parent's hash (stable across processes and restarts)."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.digest()


def root_hash(salt: bytes) -> bytes:
    """The parent hash of a sequence's first page."""
    return hashlib.blake2b(salt, digest_size=16).digest()


def hash_chain(tokens: list[int] | np.ndarray, page_size: int, salt: bytes = b"", limit: int | None = None) -> list[bytes]:
    """Hashes of every full page of `tokens` (at most `limit` pages)."""
    tokens = np.asarray(tokens, dtype=np.int64)
    n = len(tokens) // page_size if limit is None else min(limit, len(tokens) // page_size)
    out, parent = [], root_hash(salt)
    for i in range(n):
        parent = page_hash(parent, tokens[i * page_size:(i + 1) * page_size])
        out.append(parent)
    return out


class PrefixMatch(NamedTuple):
    """What a new sequence can reuse: full pages (ids in order), the token count covered in total, the hybrid
    state snapshot at that point, and optionally a cached partial page (`tail_page`, holding `tail_len` more
    tokens) whose content must be copied into a private page before the sequence appends to it."""

    pages: list[int | None]  # None: the page is not in the pool but in a tier (`external`): restore it
    num_tokens: int
    snapshot: Any  # None for hybrid models when the snapshot travels with an external page
    tail_page: int | None = None
    tail_len: int = 0
    hashes: list[bytes] | tuple = ()  # hashes of `pages`
    # hybrid: the last page is in the pool but its snapshot only in a tier (a page a resume put back from its
    # bundle after the tier took it with its snapshot): fetch the snapshot of this hash from the tier
    snapshot_from: bytes | None = None


@dataclass(slots=True)
class BlockManagerStats:
    prefix_hits_tokens: int = 0
    prefix_queries_tokens: int = 0
    evicted_pages: int = 0
    snapshot_evictions: int = 0


@dataclass
class BlockManager:
    """Free list + ref counts + prefix cache over `num_pages` pages of `page_size` tokens."""

    num_pages: int
    page_size: int
    enable_prefix_cache: bool = True
    needs_snapshots: bool = False  # hybrid models: reuse only where a state snapshot exists
    snapshot_budget_bytes: int = 64 << 20
    salt: bytes = b""
    ref: np.ndarray = field(init=False)
    free: list[int] = field(init=False)
    page_of_hash: dict[bytes, int] = field(init=False, default_factory=dict)
    hash_of_page: dict[int, bytes] = field(init=False, default_factory=dict)
    lru: OrderedDict[int, None] = field(init=False, default_factory=OrderedDict)  # cached pages with ref 0
    snapshots: OrderedDict[bytes, Any] = field(init=False, default_factory=OrderedDict)
    snapshot_bytes: int = field(init=False, default=0)
    stats: BlockManagerStats = field(init=False, default_factory=BlockManagerStats)
    on_evict: Any = field(init=False, default=None)  # callback(page_id, hash, snapshot) before a cached page is reused
    # Partial last pages of finished sequences (an agent's next turn continues exactly there):
    # parent hash -> {tail tokens -> page}, and the reverse.
    tails: dict[bytes, dict[tuple[int, ...], int]] = field(init=False, default_factory=dict)
    tail_of_page: dict[int, tuple[bytes, tuple[int, ...]]] = field(init=False, default_factory=dict)
    # Pages evicted to a tier: hash -> 0 absent, 1 present, 2 present with a hybrid snapshot (the page store)
    external: Any = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.ref = np.zeros(self.num_pages, dtype=np.int32)
        self.free = list(range(self.num_pages - 1, -1, -1))  # pop() hands out page 0 first

    # ---- capacity --------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Pages obtainable right now: free ones plus evictable cached ones."""
        return len(self.free) + len(self.lru)

    @property
    def num_used(self) -> int:
        return int(np.count_nonzero(self.ref))

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # ---- prefix cache -------------------------------------------------------------------------------------
    def match_prefix(self, tokens: list[int] | np.ndarray, count: bool = True) -> PrefixMatch:
        """Longest cached prefix of `tokens` usable without recomputation; at least one token is always left
        to compute (its logits are needed). Does not take references (see `allocate`). `count` False: an
        estimate, left out of the hit statistics."""
        if not self.enable_prefix_cache:
            return PrefixMatch([], 0, None)
        ps = self.page_size
        limit = (len(tokens) - 1) // ps
        snap, best, used = None, 0, None  # used: the key of the snapshot `snap` (refreshed in the LRU)
        from_tier = None  # the hash whose tier copy holds the snapshot at `best` (an in-pool page's)
        matched: list[int] = []
        hashes = hash_chain(tokens, ps, self.salt, limit)
        for i, h in enumerate(hashes):
            page = self.page_of_hash.get(h)
            if page is None:
                ext = self.external(h) if self.external is not None else 0
                if not ext:
                    break
                matched.append(None)
                if not self.needs_snapshots:
                    best = i + 1
                elif ext == 2:
                    best, snap, used, from_tier = i + 1, None, None, None  # the snapshot comes back with the page
                continue
            matched.append(page)
            if not self.needs_snapshots:
                best = i + 1
            elif h in self.snapshots:
                best, snap, used, from_tier = i + 1, self.snapshots[h][0], h, None
            elif self.external is not None and self.external(h) == 2:
                best, snap, used, from_tier = i + 1, None, None, h  # only the snapshot comes back, from the tier
        # A cached partial tail continues the deepest matched full page; it carries its own state snapshot,
        # so for hybrid models it also extends reuse past full pages that have none.
        tail_page, tail_len, depth = None, 0, len(matched)
        parent = hashes[depth - 1] if depth else root_hash(self.salt)
        for tail, page in self.tails.get(parent, {}).items():
            n = len(tail)
            if n > tail_len and depth * ps + n <= len(tokens) - 1 and tuple(tokens[depth * ps:depth * ps + n]) == tail:
                tail_snap = self.snapshots.get(page_hash(parent, tail)) if self.needs_snapshots else None
                if self.needs_snapshots and tail_snap is None:
                    continue
                tail_page, tail_len = page, n
                if tail_snap is not None:
                    snap, used, from_tier = tail_snap[0], page_hash(parent, tail), None
        if tail_page is not None:
            best = depth
        if used is not None:  # a hit keeps its snapshot (LRU, not first-in first-out)
            self.snapshots.move_to_end(used)
        start = best * ps
        num = start + tail_len
        if count:
            self.stats.prefix_queries_tokens += len(tokens)
            self.stats.prefix_hits_tokens += num
        return PrefixMatch(matched[:best], num, snap, tail_page, tail_len, hashes[:best], from_tier)

    def register_tail(self, parent: bytes, tail: tuple[int, ...], page: int, snapshot: Any = None,
                      nbytes: int = 0) -> None:
        """Offer a finishing sequence's partial last page (referenced by it) to later sequences."""
        if not self.enable_prefix_cache or not tail or page in self.tail_of_page or page in self.hash_of_page:
            return
        bucket = self.tails.setdefault(parent, {})
        if tail in bucket:
            return
        bucket[tail] = page
        self.tail_of_page[page] = (parent, tail)
        if snapshot is not None:
            self._put_snapshot(page_hash(parent, tail), snapshot, nbytes)

    def register(self, page: int, h: bytes) -> None:
        """Record that `page` (full, referenced) holds the tokens hashing to `h`."""
        if not self.enable_prefix_cache or page in self.hash_of_page:
            return
        if h in self.page_of_hash:  # identical content computed twice concurrently: keep the first
            return
        self.page_of_hash[h] = page
        self.hash_of_page[page] = h

    def put_snapshot(self, h: bytes, snapshot: Any, nbytes: int) -> None:
        """Keep the hybrid state after the page hashing to `h` (LRU within the byte budget)."""
        if h in self.page_of_hash:
            self._put_snapshot(h, snapshot, nbytes)

    def _put_snapshot(self, h: bytes, snapshot: Any, nbytes: int) -> None:
        if not self.enable_prefix_cache or nbytes > self.snapshot_budget_bytes:
            return
        if h in self.snapshots:
            self.snapshots.move_to_end(h)
            return
        self.snapshots[h] = (snapshot, nbytes)
        self.snapshot_bytes += nbytes
        while self.snapshot_bytes > self.snapshot_budget_bytes:
            _, (_, nb) = self.snapshots.popitem(last=False)
            self.snapshot_bytes -= nb
            self.stats.snapshot_evictions += 1

    def get_snapshot(self, h: bytes) -> Any:
        item = self.snapshots.get(h)
        return None if item is None else item[0]

    def _drop_snapshot(self, h: bytes) -> None:
        item = self.snapshots.pop(h, None)
        if item is not None:
            self.snapshot_bytes -= item[1]

    # ---- allocation -------------------------------------------------------------------------------------
    def _take_page(self) -> int | None:
        if self.free:
            return self.free.pop()
        return self._evict_one()

    def _evict_one(self) -> int | None:
        """Reclaim the least recently released cached page (None when nothing is cached)."""
        if not self.lru:
            return None
        page, _ = self.lru.popitem(last=False)
        if page in self.tail_of_page:
            parent, tail = self.tail_of_page.pop(page)
            del self.tails[parent][tail]
            if not self.tails[parent]:
                del self.tails[parent]
            self._drop_snapshot(page_hash(parent, tail))
            self.stats.evicted_pages += 1
            return page
        h = self.hash_of_page.pop(page)
        del self.page_of_hash[h]
        if self.on_evict is not None:
            self.on_evict(page, h, self.get_snapshot(h))
        self._drop_snapshot(h)
        self.stats.evicted_pages += 1
        return page

    def can_allocate(self, num_new_pages: int, reused: list[int] = ()) -> bool:
        cached_reused = sum(1 for p in reused if self.ref[p] == 0)
        return self.num_free - cached_reused >= num_new_pages

    def allocate(self, num_new_pages: int, reused: list[int] = ()) -> list[int] | None:
        """Reference `reused` (from `match_prefix`) and take `num_new_pages` fresh pages; all-or-nothing."""
        if not self.can_allocate(num_new_pages, reused):
            return None
        for p in reused:
            if self.ref[p] == 0:
                self.lru.pop(p, None)
            self.ref[p] += 1
        fresh = []
        for _ in range(num_new_pages):
            page = self._take_page()
            assert page is not None
            self.ref[page] = 1
            fresh.append(page)
        return list(reused) + fresh

    def append(self) -> int | None:
        """One fresh page for a growing sequence, or None when the pool is exhausted."""
        page = self._take_page()
        if page is not None:
            self.ref[page] = 1
        return page

    def release(self, pages: list[int]) -> None:
        """Drop one reference from each page; registered pages become cached (evictable), others free."""
        for p in reversed(pages):  # tail pages first, so a sequence's opening pages stay cached longest
            self.ref[p] -= 1
            assert self.ref[p] >= 0, f"page {p} released twice"
            if self.ref[p] == 0:
                if p in self.hash_of_page or p in self.tail_of_page:
                    self.lru[p] = None
                    self.lru.move_to_end(p)
                else:
                    self.free.append(p)

    def evict_all_cached(self) -> int:
        """Free every unreferenced cached page (tests, reconfiguration). Returns how many."""
        n = 0
        while self.lru:
            self.free.append(self._evict_one())  # type: ignore[arg-type]
            n += 1
        return n
