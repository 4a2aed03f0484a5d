"""Where the engine puts what leaves the GPU pool: paused conversations (bundles) and evicted prefix pages.

`HostBundleStore` keeps paused bundles in process memory (the engine's default). `TierStores` puts both kinds
into the RAM -> disk tiers as checksummed units: a paused conversation's unit also carries its sequence
state (`decapybara.engine.persist`), so a later engine can resume it after a restart; an evicted prefix page
is keyed by its content hash, so a later prompt that starts the same way restores it instead of recomputing.
A unit that comes back damaged or not at all is reported as missing, and the engine recomputes from tokens.

Eviction is queue-aware: a conversation unit's `next_use` is its arrival time (the age-scored policy resumes
older conversations first, so the youngest is needed last and spills first); prefix pages carry no estimate
(None: they go before any conversation).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections import OrderedDict
from typing import Any, Protocol

from decapybara.backend.base import HybridState, KVPageData
from decapybara.kv.tiers import KVTiers
from decapybara.kv.units import Unit, conv_key, page_key, page_prefix

ABSENT, PRESENT, PRESENT_WITH_SNAPSHOT = 0, 1, 2


class BundleStore(Protocol):
    """Paused conversations: `put` returns a handle kept on the sequence; `get` returns the bundle or None when
    it was lost (then the engine recomputes the sequence from its tokens); `discard` forgets it."""

    def put(self, seq: Any, bundle: Any) -> Any: ...

    def get(self, seq: Any, handle: Any) -> Any: ...

    def discard(self, seq: Any, handle: Any) -> None: ...


class PageStore(Protocol):
    """Prefix pages evicted from the pool, by content hash."""

    def offload(self, page_hash: bytes, kv: KVPageData, snapshot: HybridState | None) -> None: ...

    def lookup(self, page_hash: bytes) -> int: ...  # ABSENT, PRESENT or PRESENT_WITH_SNAPSHOT

    def fetch(self, page_hash: bytes) -> tuple[KVPageData, HybridState | None] | None: ...

    def fetch_many(self, page_hashes: list[bytes]) -> list[tuple[KVPageData, HybridState | None] | None]: ...

    def forget(self, page_hash: bytes) -> None: ...

    # optional, for `save_cached_pages` (a copy kept across a restart): `begin_save(budget_s)`, `durable(page_hash)`,
    # `save(page_hash, kv, snapshot, rank) -> bool`, `persist_pages(first_rank, budget_s) -> int` (the pages a tier
    # holds only in memory) and `end_save()`; see `TierStores`


class HostBundleStore:
    """The default: paused bundles stay in this process's memory (nothing is ever lost)."""

    def put(self, seq: Any, bundle: Any) -> Any:
        return bundle

    def get(self, seq: Any, handle: Any) -> Any:
        return handle

    def discard(self, seq: Any, handle: Any) -> None:
        return None

def model_fingerprint(salt: bytes) -> str:
    """A conversation unit's mark of the engine that wrote it: its prefix salt (model config, weights, KV mode,
    page size) hashed."""
    return hashlib.blake2b(salt, digest_size=16).hexdigest()


class TierStores:
    """Both stores over in-process `KVTiers` (RAM budget, disk under an fsspec URL)."""

    MAX_PAGES = 1 << 20  # page records kept (~100 MB), the least recently offloaded or looked up dropped first

    def __init__(self, tiers: KVTiers, salt: bytes):
        self.tiers, self.salt = tiers, salt
        # page hash -> offloaded with a hybrid snapshot. A record outlives its unit where the tiers do not say
        # (under Ray, presence is not asked remotely): bounded, so that it cannot grow for ever
        self._pages: OrderedDict[bytes, bool] = OrderedDict()
        self._durable: dict[bytes, bool] = {}  # during a save: the disk tier's pages (`begin_save`)
        self._saved: list[str] = []  # ... the keys it saved, in rank order
        self._since = 0  # the disk tier's generation `news` asks from

    # ---- bundles -------------------------------------------------------------------------------------
    def put(self, seq: Any, bundle: Any) -> str:
        from decapybara.engine.persist import sequence_state

        meta, extras = sequence_state(seq)
        meta["model"] = model_fingerprint(self.salt)  # which engines may adopt it (`Engine.import_paused`)
        unit = Unit.from_bundle(conv_key(seq.request_id, seq.num_pauses), bundle, meta, extras)
        return self.tiers.put(unit, next_use=float(seq.arrival))

    def get(self, seq: Any, handle: str) -> Any:
        unit = self.tiers.take(handle)
        return None if unit is None else unit.to_bundle()

    def discard(self, seq: Any, handle: str) -> None:
        self.tiers.discard(handle)

    def take_unit(self, key: str) -> Unit | None:
        """A paused conversation's whole unit (bundle + sequence state), e.g. to resume it in a new engine."""
        return self.tiers.take(key)

    # ---- pages -----------------------------------------------------------------------------------------
    def offload(self, page_hash: bytes, kv: KVPageData, snapshot: HybridState | None) -> None:
        self.tiers.put(Unit.page(self.salt, page_hash, kv, snapshot), next_use=None)
        self._pages[page_hash] = snapshot is not None
        self._pages.move_to_end(page_hash)
        while len(self._pages) > self.MAX_PAGES:
            self._pages.popitem(last=False)

    # ---- a save (`Engine.save_cached_pages`) -------------------------------------------------------------
    def begin_save(self, budget_s: float = 10.0) -> None:
        """Before a save: the puts in flight land, and the page units the disk tier holds are read (`durable`),
        each with its snapshot flag (the RAM tier does not outlive the process, so its pages are saved too)."""
        self.tiers.wait_puts(budget_s)
        self._durable = self._page_flags(self.tiers.disk_flags(page_prefix(self.salt), budget_s))
        self._saved = []

    def durable(self, page_hash: bytes) -> int:
        """ABSENT, PRESENT or PRESENT_WITH_SNAPSHOT on the disk tier, as `begin_save` found it and the save went."""
        flag = self._durable.get(page_hash)
        return ABSENT if flag is None else PRESENT_WITH_SNAPSHOT if flag else PRESENT

    def save(self, page_hash: bytes, kv: KVPageData, snapshot: HybridState | None, rank: int) -> bool:
        """A pool page kept on the disk tier (it outlives this engine), ranked among the pages saved with it (0
        first: where room runs out, higher ranks give way, and units without a rank before them). False where the
        tier keeps no room for it or there is no disk tier."""
        unit = Unit.page(self.salt, page_hash, kv, snapshot)
        if not self.tiers.put_durable(unit, next_use=float(rank)):
            return False
        self._durable[page_hash] = snapshot is not None
        self._saved.append(unit.key)
        self._pages[page_hash] = snapshot is not None
        self._pages.move_to_end(page_hash)
        return True

    def persist_pages(self, first_rank: int = 0, budget_s: float | None = None) -> int:
        """The pages the RAM tier holds that the disk lacks, copied to it (`KVTiers.persist`), ranked after the
        `first_rank` pages saved before them. Returns how many."""
        keys = self.tiers.persist(page_prefix(self.salt), first_rank, budget_s)
        self._saved += keys
        return len(keys)

    def end_save(self) -> None:
        """After a save: its pages lose their ranks, and the disk's recency follows them (`KVTiers.settle`)."""
        self.tiers.settle(self._saved)
        self._saved = []

    def news(self, budget_s: float = 1.0) -> tuple[int, dict[bytes, bool]]:
        """The prefix pages of this salt the disk tier gained since the last `adopt` (`KVTiers.disk_news`: another
        server's on a shared folder, and this engine's own), hash -> holds a snapshot (a header not read within
        `budget_s`: False), with the generation they reach; for `adopt` on the engine's thread. Any thread, one
        caller at a time: news not adopted comes again."""
        mark, flags = self.tiers.disk_news(page_prefix(self.salt), self._since, budget_s)
        return mark, self._page_flags(flags)

    def adopt(self, pages: dict[bytes, bool], mark: int | None = None) -> int:
        """Record `pages` (`news`) that this store does not know yet, as the most recently used: prompts that start
        with them restore them; the next `news` asks from `mark`. Returns how many were recorded."""
        if mark is not None:
            self._since = max(self._since, mark)
        n = 0
        for h, snapshot in pages.items():
            if h not in self._pages:
                self._pages[h] = snapshot
                n += 1
        while len(self._pages) > self.MAX_PAGES:
            self._pages.popitem(last=False)
        return n

    def lookup(self, page_hash: bytes) -> int:
        has_snap = self._pages.get(page_hash)
        if has_snap is None:
            return ABSENT
        if self.tiers.where(page_key(self.salt, page_hash)) is None:  # evicted from every tier meanwhile
            del self._pages[page_hash]
            return ABSENT
        self._pages.move_to_end(page_hash)
        return PRESENT_WITH_SNAPSHOT if has_snap else PRESENT

    def fetch(self, page_hash: bytes) -> tuple[KVPageData, HybridState | None] | None:
        return self.fetch_many([page_hash])[0]

    def fetch_many(self, page_hashes: list[bytes]) -> list[tuple[KVPageData, HybridState | None] | None]:
        """The pages' (KV, snapshot) in order, None for each the tiers no longer hold (then forgotten), asked of the
        tiers at once (`get_many`: a prefix's pages in a few round trips to the tier actors, not two a page)."""
        units = self.tiers.get_many([page_key(self.salt, h) for h in page_hashes])
        out: list[tuple[KVPageData, HybridState | None] | None] = []
        for h, unit in zip(page_hashes, units, strict=True):
            if unit is None:
                self._pages.pop(h, None)
            out.append(None if unit is None else (unit.kv, unit.state))
        return out

    def forget(self, page_hash: bytes) -> None:
        self._pages.pop(page_hash, None)

    def _page_flags(self, flags: dict[str, bool | None]) -> dict[bytes, bool]:
        """Page hash -> holds a snapshot (not known: False), from the tiers' flags of this salt's page keys."""
        prefix, out = page_prefix(self.salt), {}
        for key, flag in flags.items():
            with contextlib.suppress(ValueError):
                out[bytes.fromhex(key[len(prefix):])] = bool(flag)
        return out

    def adopt_pages(self, budget_s: float = 10.0) -> int:
        """Record the prefix pages the tiers already hold for this salt (an earlier engine's: before a restart, or
        before its GPU actor was replaced), so that prompts starting with them restore them. A page whose header
        is not read within `budget_s` counts as one without a state snapshot (usable inside a match, not at its
        end); every page is checked whole when fetched. Returns how many were recorded."""
        n = 0
        for h, snapshot in self._page_flags(self.tiers.snapshot_flags(page_prefix(self.salt), budget_s)).items():
            if h not in self._pages:
                self._pages[h] = snapshot
                self._pages.move_to_end(h, last=False)  # older than what this engine offloads itself
                n += 1
        while len(self._pages) > self.MAX_PAGES:
            self._pages.popitem(last=False)
        return n
