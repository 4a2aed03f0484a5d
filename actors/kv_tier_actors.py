"""RamTierActor and DiskTierActor: the RAM and disk KV tiers as Ray actors, and the GPU actor's client.

RamTierActor owns ObjectRefs in the Ray object store under a byte budget (RAM_CACHE). The GPU actor encodes a
unit and stages it; the RAM tier then calls the GPU actor's `take_staged(key)`: the returned object is written
into the object store once, by the GPU actor, and owned by the RAM tier (a task's caller owns its result), so
it outlives the request and the GPU actor. Over budget, the unit needed
last (queue-aware, by `next_use`) spills to the DiskTierActor, which reads it zero-copy from the object store
and writes it under an fsspec URL (DISK_CACHE). Every unit is checksummed and verified when it comes back.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time
from typing import Any

import ray

from decapybara.kv.disk_tier import DiskTierStore
from decapybara.kv.ram_tier import RamTierStore
from decapybara.kv.units import UnitCorrupt, byte_view, decode_unit, key_component


class RamTierActor:
    def __init__(self, budget_bytes: int, disk: Any = None):
        self.store = RamTierStore(budget_bytes)
        self.disk = disk
        self.snapshots: dict[str, bool | None] = {}  # key -> holds a hybrid state, as its writer said
        # units spilled whose disk write has not landed: still read here (key -> ref); those taken meanwhile (`pop`)
        # are not written, or deleted from the disk once their write lands
        self.spilling: dict[str, Any] = {}
        self.taken: set[str] = set()
        self.stats_ = {"puts": 0, "put_bytes": 0, "hits": 0, "misses": 0, "spills": 0, "spilled_bytes": 0,
                       "lost": 0}

    async def put_from(self, key: str, source: Any, nbytes: int, next_use: float | None = None,
                       snapshot: bool | None = None) -> int:
        """Adopt a unit staged by `source` (an actor with `take_staged(key)`): its result ref is ours. `snapshot`:
        whether it holds a hybrid state (told by the writer, for `snapshot_flags`)."""
        return await self._keep(key, source.take_staged.remote(key), nbytes, next_use, snapshot)

    async def put_bytes(self, key: str, data: Any, nbytes: int, next_use: float | None = None,
                        snapshot: bool | None = None) -> int:
        """Adopt a unit passed by value (callers that are not actors): one copy into an object we own."""
        return await self._keep(key, ray.put(data), nbytes, next_use, snapshot)

    async def _keep(self, key: str, ref: Any, nbytes: int, next_use: float | None, snapshot: bool | None) -> int:
        """Keep `ref` (owned by this actor). Returns how many units spilled to disk."""
        self.stats_["puts"] += 1
        self.stats_["put_bytes"] += nbytes
        spilled = self.store.put(key, ref, nbytes, next_use)
        self.snapshots[key] = snapshot
        for s in spilled:
            self.snapshots.pop(s.key, None)
            self.stats_["spills"] += 1
            self.stats_["spilled_bytes"] += s.nbytes
            if self.disk is not None:
                self.spilling[s.key] = s.handle
        for s in spilled:
            if self.disk is None:
                self.stats_["lost"] += 1
                continue
            if self.spilling.get(s.key) is not s.handle:  # taken, or put again, while earlier writes ran
                self.taken.discard(s.key)
                continue
            try:
                await self.disk.put_ref.remote(s.key, [s.handle], s.next_use)  # the disk copy is written before
            except Exception:  # noqa: BLE001 - a dead or failing disk tier: the unit is lost, not the RAM tier's put
                self.stats_["lost"] += 1
            finally:
                if self.spilling.get(s.key) is s.handle:
                    del self.spilling[s.key]
            if s.key in self.taken:  # taken while it was written: a delete sent meanwhile may have come first
                self.taken.discard(s.key)
                with contextlib.suppress(Exception):  # a failing disk tier: the copy stays until it is evicted
                    await self.disk.delete.remote(s.key)
        return len(spilled)  # ... the last reference to the object is dropped here

    async def persist(self, prefix: str, first_rank: int = 0, budget_s: float | None = None) -> list[str]:
        """Copy the units under `prefix` that the disk tier lacks to it (this tier keeps them), the most recently
        used first, ranked from `first_rank` on (`KVTiers.persist`). Returns the keys copied, in rank order."""
        if self.disk is None:
            return []
        deadline = None if budget_s is None else time.monotonic() + budget_s
        on_disk = set(await self.disk.keys.remote())
        out: list[str] = []
        for key in reversed(self.store.eviction_order()):
            if not key.startswith(prefix) or key in on_disk:
                continue
            if deadline is not None and time.monotonic() > deadline:
                break
            ref = self.store.peek(key)
            if ref is None:  # taken while an earlier copy was awaited
                continue
            if not await self.disk.save_ref.remote(key, [ref], float(first_rank + len(out))):
                break
            out.append(key)
        return out

    def get(self, key: str) -> list | None:
        ref = self.store.get(key)
        if ref is None:
            ref = self.spilling.get(key)
        self.stats_["hits" if ref is not None else "misses"] += 1
        return None if ref is None else [ref]

    def get_many(self, keys: list[str]) -> list[list | None]:
        """`get` of each key, in order (one call for a prefix's pages)."""
        return [self.get(k) for k in keys]

    def pop(self, key: str) -> list | None:
        ref = self.store.pop(key)
        self.snapshots.pop(key, None)
        spilling = self.spilling.pop(key, None)
        if spilling is not None:
            self.taken.add(key)
            ref = spilling if ref is None else ref
        return None if ref is None else [ref]

    def drop_conversations(self, request_ids: list[str]) -> int:
        """Drop the paused-conversation units of `request_ids` (those being spilled too: their disk copies are
        deleted once written, `pop`); returns how many. For the requests of a lost engine (`SchedulerActor`)."""
        keys = conversation_keys({*self.store.keys(), *self.spilling}, request_ids)
        for key in keys:
            self.pop(key)
        return len(keys)

    def snapshot_flags(self, prefix: str) -> dict[str, bool | None]:
        """The units under `prefix`, with whether each holds a hybrid state (None: its writer did not say)."""
        held = self.store.keys()
        return {k: self.snapshots.get(k) for k in held if k.startswith(prefix)}

    def contains(self, key: str) -> bool:
        return key in self.store or key in self.spilling

    def update_next_use(self, key: str, next_use: float | None) -> bool:
        return self.store.update_next_use(key, next_use)

    def stats(self) -> dict[str, Any]:
        return {**self.stats_, "units": len(self.store), "used_bytes": self.store.used_bytes,
                "budget_bytes": self.store.budget_bytes}


class DiskTierActor:
    def __init__(self, url: str | None, budget_bytes: int):
        self.store = DiskTierStore(url, budget_bytes)
        self.stats_ = {"puts": 0, "put_bytes": 0, "hits": 0, "misses": 0, "dropped": 0}

    def put_ref(self, key: str, boxed_ref: list, next_use: float | None = None) -> int:
        data = ray.get(boxed_ref[0])  # zero-copy view of the object store buffer
        return self.put(key, data, next_use)

    def save_ref(self, key: str, boxed_ref: list, next_use: float | None = None) -> bool:
        """`save` of a unit in the object store."""
        return self.save(key, ray.get(boxed_ref[0]), next_use)

    def put(self, key: str, data: Any, next_use: float | None = None) -> int:
        """Store a unit; returns how many units were dropped (others evicted, or this one)."""
        return len(self._put(key, data, next_use))

    def save(self, key: str, data: Any, next_use: float | None = None) -> bool:
        """Store a unit; False where it was not kept (no room for it, or a failed write)."""
        return all(d.key != key for d in self._put(key, data, next_use))

    def _put(self, key: str, data: Any, next_use: float | None) -> list[Any]:
        mv = byte_view(data)
        dropped = self.store.put(key, mv, next_use)
        self.stats_["puts"] += 1
        self.stats_["put_bytes"] += len(mv)
        self.stats_["dropped"] += len(dropped)
        return dropped

    def snapshot_flags(self, prefix: str, budget_s: float = 10.0) -> dict[str, bool | None]:
        return self.store.snapshot_flags(prefix, budget_s)

    def refresh(self, keys: list[str]) -> None:
        self.store.refresh(keys)

    def news(self, prefix: str, since: int, budget_s: float = 1.0) -> tuple[int, dict[str, bool | None]]:
        return self.store.news(prefix, since, budget_s)

    def get(self, key: str) -> bytes | None:
        """The unit's verified bytes, or None (absent, or corrupt: then it is deleted and counted)."""
        data = self.store.get_bytes(key)
        self.stats_["hits" if data is not None else "misses"] += 1
        return data

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        """`get` of each key, in order (one call for a prefix's pages the RAM tier lacks)."""
        return [self.get(k) for k in keys]

    def contains(self, key: str) -> bool:
        return self.store.holds(key)

    def delete(self, key: str) -> bool:
        return self.store.delete(key)

    def drop_conversations(self, request_ids: list[str]) -> int:
        """Delete the paused-conversation units of `request_ids` (`RamTierActor.drop_conversations`); returns how
        many."""
        return sum(self.store.delete(key) for key in conversation_keys(self.keys(), request_ids))

    def keys(self) -> list[str]:
        """The units held; listed afresh where another server shares the folder (`DiskTierStore.shared`)."""
        if self.store.shared:
            self.store.resync()
        return self.store.keys()

    def stats(self) -> dict[str, Any]:
        return {**self.stats_, **self.store.stats, "units": len(self.store), "used_bytes": self.store.used_bytes,
                "budget_bytes": self.store.budget_bytes}


def conversation_keys(keys: Any, request_ids: list[str]) -> list[str]:
    """Those of `keys` that name a paused-conversation unit of one of `request_ids` (`units.conv_key`'s
    "conv/<id>/<n>")."""
    ids = {key_component(r) for r in request_ids}
    return [k for k in keys if k.startswith("conv/") and k.split("/", 2)[1] in ids]


def start_tiers(cfg: Any) -> dict[str, Any]:
    """Create this app's named tier actors (RAM over disk) from an `AppConfig`."""
    name = cfg.name
    disk = None
    if cfg.disk_cache_gb > 0:
        disk = ray.remote(DiskTierActor).options(name=f"{name}-disk-tier", get_if_exists=True, num_cpus=0).remote(
            cfg.disk_cache, int(cfg.disk_cache_gb * 2**30))
    ram = ray.remote(RamTierActor).options(name=f"{name}-ram-tier", get_if_exists=True, num_cpus=0).remote(
        int(cfg.ram_cache_gb * 2**30), disk)
    return {"ram": ram, **({"disk": disk} if disk is not None else {})}


def fetch_units(tiers: dict[str, Any], keys: list[str], timeout_s: float = 60.0) -> list[Any]:
    """The verified units under `keys`, in order, each from RAM, else disk; None for one lost or corrupt. At most
    three waits whatever the count: the RAM tier's refs, their objects together, the disk tier's bytes of the
    units RAM lacks."""
    if not keys:
        return []
    boxed = ray.get(tiers["ram"].get_many.remote(list(keys)), timeout=timeout_s)
    data: list[Any] = [None] * len(keys)
    held = [i for i, b in enumerate(boxed) if b is not None]
    for i, d in zip(held, _objects([boxed[i][0] for i in held], timeout_s), strict=True):
        data[i] = d
    missing = [i for i, b in enumerate(boxed) if b is None]
    if missing and "disk" in tiers:
        got = ray.get(tiers["disk"].get_many.remote([keys[i] for i in missing]), timeout=timeout_s)
        for i, d in zip(missing, got, strict=True):
            data[i] = d
    return [_decoded(d) for d in data]


def _objects(refs: list[Any], timeout_s: float) -> list[Any]:
    """The objects of `refs`, waited for together; where one of them is lost, each on its own, None for the lost
    ones (so that one lost page costs the pages from it on, not the whole prefix). A timeout raises (a stuck tier:
    every unit reads as missing, `RayTiers.get_many`)."""
    if not refs:
        return []
    try:
        return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise
    except Exception:  # noqa: BLE001 - an object lost (its owner or a spill gone)
        out = []
        for ref in refs:
            try:
                out.append(ray.get(ref, timeout=timeout_s))
            except ray.exceptions.GetTimeoutError:
                raise
            except Exception:  # noqa: BLE001
                out.append(None)
        return out


def _decoded(data: Any) -> Any:
    if data is None:
        return None
    try:
        return decode_unit(data)
    except UnitCorrupt:
        return None


class RayTiers:
    """The tier actors behind the interface of `decapybara.kv.tiers.KVTiers` that `TierStores` uses, so the
    GPU actor's engine gets the same bundle and page stores as an in-process one.

    Units are encoded here and staged for the RAM tier, which fetches them (the object is then the tier's).
    Any failure to reach a tier (actor dead, timeout) or a damaged unit reads as missing: the engine then
    recomputes from tokens, never waits forever and never uses wrong data."""

    def __init__(self, tiers: dict[str, Any], timeout_s: float = 30.0):
        self.handles, self.timeout_s = tiers, timeout_s
        self.errors = 0
        self.staged: dict[str, Any] = {}  # encoded units waiting for the RAM tier to take them
        self.pending: set[Any] = set()  # futures of puts the RAM tier has not finished (under `_lock`)
        self._lock = threading.Lock()
        try:
            self.actor = ray.get_runtime_context().current_actor  # inside the GPU actor
        except RuntimeError:
            self.actor = None

    def put(self, unit: Any, next_use: float | None = None) -> str:
        import numpy as np

        from decapybara.kv.units import encode_unit

        buf = np.frombuffer(encode_unit(unit), np.uint8)  # numpy: zero-copy reads from the object store
        ram = self.handles["ram"]
        snapshot = unit.state is not None
        if self.actor is not None:  # the RAM tier fetches it: one write into the object store, owned by the tier
            self.staged[unit.key] = buf
            done = ram.put_from.remote(unit.key, self.actor, len(buf), next_use, snapshot)
            # the tier takes it (take_staged) once put_from has run; where that call fails (the tier is gone), nobody
            # will: drop it here, else it stays for ever
            fut = done.future()
            with self._lock:
                self.pending.add(fut)
            fut.add_done_callback(lambda f, k=unit.key, b=buf: self._landed(f, k, b))
        else:
            ram.put_bytes.remote(unit.key, buf, len(buf), next_use, snapshot)
        return unit.key

    def put_durable(self, unit: Any, next_use: float | None = None) -> bool:
        """The unit to the disk tier only, waited for (`KVTiers.put_durable`); False where there is none, it keeps
        no room for the unit, or cannot be reached."""
        import numpy as np

        from decapybara.kv.units import encode_unit

        if "disk" not in self.handles:
            return False
        kept = bool(self._ask("disk", "save", unit.key, np.frombuffer(encode_unit(unit), np.uint8), next_use,
                              default=False))
        if kept:  # a RAM copy with less (no snapshot) must not be read first
            self.handles["ram"].pop.remote(unit.key)
        return kept

    def wait_puts(self, timeout_s: float | None = None) -> None:
        """Until the puts sent to the RAM tier so far have landed (and any spill they made reached the disk tier),
        or `timeout_s`."""
        with self._lock:
            pending = list(self.pending)
        concurrent.futures.wait(pending, timeout=self.timeout_s if timeout_s is None else timeout_s)

    def _ask(self, tier: str, method: str, *args: Any, default: Any, extra_s: float = 0.0) -> Any:
        """`tier`'s `method(*args)`, waited for; `default` where there is no such tier or it cannot be reached (dead,
        or past `timeout_s` + `extra_s`)."""
        if tier not in self.handles:
            return default
        try:
            return ray.get(getattr(self.handles[tier], method).remote(*args), timeout=self.timeout_s + extra_s)
        except Exception:  # noqa: BLE001 - a dead tier actor or a timeout
            self.errors += 1
            return default

    def persist(self, prefix: str, first_rank: int = 0, budget_s: float | None = None) -> list[str]:
        """`KVTiers.persist` by the RAM tier actor; none where a tier cannot be reached."""
        if "disk" not in self.handles:
            return []
        return list(self._ask("ram", "persist", prefix, first_rank, budget_s, default=[], extra_s=budget_s or 0.0))

    def disk_flags(self, prefix: str, budget_s: float = 10.0) -> dict[str, bool | None]:
        """`KVTiers.disk_flags` of the disk tier actor (none where it cannot be reached)."""
        return dict(self._ask("disk", "snapshot_flags", prefix, budget_s, default={}, extra_s=budget_s))

    def disk_news(self, prefix: str, since: int, budget_s: float = 1.0) -> tuple[int, dict[str, bool | None]]:
        """`KVTiers.disk_news` of the disk tier actor (nothing new where it cannot be reached)."""
        if "disk" not in self.handles:
            return since, {}
        mark, flags = self._ask("disk", "news", prefix, since, budget_s, default=(since, {}), extra_s=budget_s)
        return int(mark), dict(flags)

    def settle(self, keys: list[str]) -> None:
        """`KVTiers.settle` on the disk tier actor (where it cannot be reached, the ranks stay)."""
        if keys:
            self._ask("disk", "refresh", list(reversed(keys)), default=None)

    def snapshot_flags(self, prefix: str, budget_s: float = 10.0) -> dict[str, bool | None]:
        """The units under `prefix` in either tier actor (`KVTiers.snapshot_flags`; the RAM tier's flag where it has
        the unit); those of a tier that cannot be reached are left out."""
        out = self.disk_flags(prefix, budget_s)
        # the RAM tier's copy is the one read first (`fetch_units`): its flag wins where it is known
        for k, flag in self._ask("ram", "snapshot_flags", prefix, default={}).items():
            if flag is not None or k not in out:
                out[k] = flag
        return out

    def take_staged(self, key: str) -> Any:
        return self.staged.pop(key)

    def _landed(self, fut: Any, key: str, buf: Any) -> None:
        with self._lock:
            self.pending.discard(fut)
        if fut.exception() is not None:
            self._unstage(key, buf)

    def _unstage(self, key: str, buf: Any) -> None:
        if self.staged.get(key) is buf:  # not a later put of the same key
            self.staged.pop(key, None)

    def get(self, key: str) -> Any:
        return self.get_many([key])[0]

    def get_many(self, keys: list[str]) -> list[Any]:
        """`KVTiers.get_many` over the tier actors (`fetch_units`): all missing where a tier cannot be reached."""
        try:
            return fetch_units(self.handles, keys, self.timeout_s)
        except Exception:  # noqa: BLE001 - a dead tier actor or a timeout is a lost unit
            self.errors += 1
            return [None] * len(keys)

    def take(self, key: str) -> Any:
        unit = self.get(key)
        self.discard(key)
        return unit

    def discard(self, key: str) -> None:
        try:
            self.handles["ram"].pop.remote(key)
            if "disk" in self.handles:
                self.handles["disk"].delete.remote(key)
        except Exception:  # noqa: BLE001
            self.errors += 1

    def where(self, key: str) -> str:
        """Presence is not asked remotely on every prefix lookup: a unit that turns out to be gone is a failed
        fetch, which the engine handles by forgetting it and matching again."""
        return "tiers"


def ray_tier_stores(tiers: dict[str, Any], salt: bytes, timeout_s: float = 30.0) -> Any:
    """The engine's bundle and page stores over this app's tier actors."""
    from decapybara.kv.stores import TierStores

    return TierStores(RayTiers(tiers, timeout_s), salt)
