"""RAM over disk for encoded units: the in-process form of the two tier actors (and what they delegate to).

A key names immutable content (conversations are keyed by their pause counter, pages by their content hash),
so the disk may keep a copy of a unit promoted back to RAM, and spilling it again costs no write
(inclusive tiers). Putting a key again replaces it and drops any older disk copy.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from decapybara.kv.disk_tier import DiskTierStore
from decapybara.kv.ram_tier import RamTierStore, Spilled
from decapybara.kv.units import Unit, UnitCorrupt, byte_view, decode_unit, encode_unit, read_header


@dataclass(slots=True)
class TierStats:
    puts: int = 0
    put_bytes: int = 0
    hits_ram: int = 0
    hits_disk: int = 0
    misses: int = 0
    spills: int = 0  # units moved RAM -> disk (or found already there)
    spilled_bytes: int = 0  # bytes actually written to disk by spills
    promotions: int = 0  # disk hits copied back to RAM
    promoted_bytes: int = 0
    corrupt: int = 0  # units found damaged (RAM or disk) and dropped
    lost: int = 0  # units that left every tier without being taken (evicted, refused, corrupt)


class KVTiers:
    """`put` to RAM, spill to disk, `get` from RAM else disk (promoting back), `take` to consume."""

    def __init__(self, ram: RamTierStore, disk: DiskTierStore | None = None) -> None:
        self.ram, self.disk = ram, disk
        self.stats = TierStats()

    def where(self, key: str) -> str | None:
        """"ram", "disk" or None."""
        if key in self.ram:
            return "ram"
        if self.disk is not None and key in self.disk:
            return "disk"
        return None

    def put(self, unit: Unit | Any, next_use: float | None = None) -> str:
        """Store a `Unit` (encoded here) or an encoded buffer; returns its key."""
        buf = encode_unit(unit) if isinstance(unit, Unit) else byte_view(unit)
        key = read_header(buf).key
        if self.disk is not None:
            self.disk.delete(key)  # an older copy must not come back
        self.stats.puts += 1
        self.stats.put_bytes += len(buf)
        self._spill(self.ram.put(key, buf, len(buf), next_use))
        return key

    def put_durable(self, unit: Unit | Any, next_use: float | None = None) -> bool:
        """Store a unit on the disk tier only (the copy that outlives this process); False where
        there is no disk tier or it keeps no room for the unit (see `BudgetedIndex.admit`)."""
        if self.disk is None:
            return False
        buf = encode_unit(unit) if isinstance(unit, Unit) else byte_view(unit)
        key = read_header(buf).key
        kept = self._to_disk(key, buf, next_use)
        if kept:  # content-addressed, but a RAM copy with less (no state snapshot) must not be read first
            self.ram.pop(key)
        return kept

    def _to_disk(self, key: str, buf: Any, next_use: float | None) -> bool:
        """`buf` put on the disk under `key`; whether it was kept (others it displaced and RAM lacks are lost)."""
        dropped = self.disk.put(key, buf, next_use)
        self.stats.lost += sum(1 for d in dropped if d.key != key and d.key not in self.ram)
        return all(d.key != key for d in dropped)

    def persist(self, prefix: str, first_rank: int = 0, budget_s: float | None = None) -> list[str]:
        """Copy the RAM units under `prefix` that the disk lacks to the disk (RAM keeps them), the most recently used
        first, each with the next rank from `first_rank` on as its next use (see `put_durable`). Stops at the first
        unit the disk keeps no room for, or once `budget_s` has passed. Returns the keys copied, in rank order."""
        if self.disk is None:
            return []
        deadline = None if budget_s is None else time.monotonic() + budget_s
        out: list[str] = []
        for key in reversed(self.ram.eviction_order()):
            if not key.startswith(prefix) or self.disk.holds(key):
                continue
            if deadline is not None and time.monotonic() > deadline:
                break
            if not self._to_disk(key, self.ram.peek(key), float(first_rank + len(out))):
                break
            out.append(key)
        return out

    def disk_flags(self, prefix: str, budget_s: float = 10.0) -> dict[str, bool | None]:
        """The disk tier's units under `prefix` (`DiskTierStore.snapshot_flags`); none without a disk tier."""
        return {} if self.disk is None else self.disk.snapshot_flags(prefix, budget_s)

    def disk_news(self, prefix: str, since: int, budget_s: float = 1.0) -> tuple[int, dict[str, bool | None]]:
        """`DiskTierStore.news` (nothing without a disk tier)."""
        return (since, {}) if self.disk is None else self.disk.news(prefix, since, budget_s)

    def settle(self, keys: list[str]) -> None:
        """After a save: its units (`keys`, in rank order) lose their ranks, and the disk's recency follows the ranks
        (rank 0 the most recent), in its index and across a restart (`DiskTierStore.refresh`)."""
        if self.disk is not None:
            self.disk.refresh(list(reversed(keys)))

    def wait_puts(self, timeout_s: float | None = None) -> None:
        """Puts here are synchronous: nothing to wait for (`RayTiers.wait_puts` waits for its RAM tier)."""

    def _spill(self, spilled: list[Spilled]) -> None:
        for s in spilled:
            if self.disk is None:
                self.stats.lost += 1
                continue
            self.stats.spills += 1
            if self.disk.holds(s.key):  # promoted earlier: the disk copy is the same bytes
                self.disk.update_next_use(s.key, s.next_use)
                continue
            try:
                dropped = self.disk.put(s.key, s.handle, s.next_use)
            except (UnitCorrupt, ValueError):  # a RAM copy damaged since its put: lost, the others still go down
                self.stats.corrupt += 1
                self.stats.lost += 1
                continue
            if all(d.key != s.key for d in dropped):
                self.stats.spilled_bytes += s.nbytes
            self.stats.lost += sum(1 for d in dropped if d.key not in self.ram)

    def get_many(self, keys: list[str]) -> list[Unit | None]:
        """`get` of each key, in order."""
        return [self.get(k) for k in keys]

    def get(self, key: str, promote: bool = True) -> Unit | None:
        """The verified unit, or None (absent, or corrupt: then dropped and counted). A disk hit is copied
        back to RAM when `promote` (keeping its next-use prediction)."""
        handle = self.ram.get(key)
        if handle is not None:
            try:
                unit = decode_unit(handle)
            except UnitCorrupt:
                self.ram.pop(key)
                self.stats.corrupt += 1
                if self.disk is None or key not in self.disk:
                    self.stats.lost += 1
            else:
                self.stats.hits_ram += 1
                return unit
        if self.disk is None or key not in self.disk:
            self.stats.misses += 1
            return None
        corrupt_before = self.disk.stats["corrupt"]
        next_use = self.disk.next_use(key)
        unit = self.disk.get(key)
        if unit is None:
            self.stats.misses += 1
            self.stats.corrupt += self.disk.stats["corrupt"] - corrupt_before
            self.stats.lost += 1
            return None
        self.stats.hits_disk += 1
        if promote:
            self.stats.promotions += 1
            self.stats.promoted_bytes += len(unit.buffer)
            self._spill(self.ram.put(key, unit.buffer, len(unit.buffer), next_use))
        return unit

    def take(self, key: str) -> Unit | None:
        """`get` and remove from every tier (a resumed conversation)."""
        unit = self.get(key, promote=False)
        self.discard(key)
        return unit

    def discard(self, key: str) -> None:
        self.ram.pop(key)
        if self.disk is not None:
            self.disk.delete(key)

    def snapshot_flags(self, prefix: str, budget_s: float = 10.0) -> dict[str, bool | None]:
        """Every unit under `prefix` in either tier, with whether it holds a hybrid state snapshot (None: not known;
        see `DiskTierStore.snapshot_flags`)."""
        out = self.disk_flags(prefix, budget_s)
        held = self.ram.keys()
        for key in held:
            if key.startswith(prefix):
                try:
                    out[key] = read_header(self.ram.peek(key)).state_layers is not None
                except UnitCorrupt:
                    out.setdefault(key, None)
        return out

    def update_next_use(self, key: str, next_use: float | None) -> None:
        self.ram.update_next_use(key, next_use)
        if self.disk is not None:
            self.disk.update_next_use(key, next_use)

    def snapshot_stats(self) -> dict[str, Any]:
        out: dict[str, Any] = dataclasses.asdict(self.stats)
        out.update(ram_units=len(self.ram), ram_used_bytes=self.ram.used_bytes, ram_budget_bytes=self.ram.budget_bytes)
        if self.disk is not None:
            out.update(disk_units=len(self.disk), disk_used_bytes=self.disk.used_bytes,
                       disk_budget_bytes=self.disk.budget_bytes, disk=dict(self.disk.stats))
        return out
