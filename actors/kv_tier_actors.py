"""RamTierActor and DiskTierActor: the RAM and disk KV tiers as Ray actors, and the GPU actor's client.

RamTierActor owns ObjectRefs in the Ray object store under a byte budget (RAM_CACHE): the GPU actor puts a
unit's bytes into the object store itself with this actor as the owner (`ray.put(..., _owner=ram)`: one copy,
and the object outlives the request and the GPU actor), then hands over the ref. Over budget, the unit needed
last (queue-aware, by `next_use`) spills to the DiskTierActor, which reads it zero-copy from the object store
and writes it under an fsspec URL (DISK_CACHE). Every unit is checksummed and verified when it comes back.
"""

from __future__ import annotations

from typing import Any

import ray

from decapybara.kv.disk_tier import DiskTierStore
from decapybara.kv.ram_tier import RamTierStore
from decapybara.kv.units import UnitCorrupt, byte_view, decode_unit


class RamTierActor:
    def __init__(self, budget_bytes: int, disk: Any = None):
        self.store = RamTierStore(budget_bytes)
        self.disk = disk
        self.stats_ = {"puts": 0, "put_bytes": 0, "hits": 0, "misses": 0, "spills": 0, "spilled_bytes": 0,
                       "lost": 0}

    async def put(self, key: str, boxed_ref: list, nbytes: int, next_use: float | None = None) -> int:
        """Keep `boxed_ref[0]` (a ref this actor owns). Returns how many units spilled to disk."""
        self.stats_["puts"] += 1
        self.stats_["put_bytes"] += nbytes
        spilled = self.store.put(key, boxed_ref[0], nbytes, next_use)
        for s in spilled:
            self.stats_["spills"] += 1
            self.stats_["spilled_bytes"] += s.nbytes
            if self.disk is None:
                self.stats_["lost"] += 1
                continue
            await self.disk.put_ref.remote(s.key, [s.handle], s.next_use)  # the disk copy is written before
        return len(spilled)  # ... the last reference to the object is dropped here

    def get(self, key: str) -> list | None:
        ref = self.store.get(key)
        self.stats_["hits" if ref is not None else "misses"] += 1
        return None if ref is None else [ref]

    def pop(self, key: str) -> list | None:
        ref = self.store.pop(key)
        return None if ref is None else [ref]

    def contains(self, key: str) -> bool:
        return key in self.store

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

    def put(self, key: str, data: Any, next_use: float | None = None) -> int:
        mv = byte_view(data)
        dropped = self.store.put(key, mv, next_use)
        self.stats_["puts"] += 1
        self.stats_["put_bytes"] += len(mv)
        self.stats_["dropped"] += len(dropped)
        return len(dropped)

    def get(self, key: str) -> bytes | None:
        """The unit's verified bytes, or None (absent, or corrupt: then it is deleted and counted)."""
        data = self.store.get_bytes(key)
        self.stats_["hits" if data is not None else "misses"] += 1
        return data

    def contains(self, key: str) -> bool:
        return key in self.store

    def delete(self, key: str) -> bool:
        return self.store.delete(key)

    def keys(self) -> list[str]:
        return self.store.keys()

    def stats(self) -> dict[str, Any]:
        return {**self.stats_, **self.store.stats, "units": len(self.store), "used_bytes": self.store.used_bytes,
                "budget_bytes": self.store.budget_bytes}


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


def fetch_unit(tiers: dict[str, Any], key: str, timeout_s: float = 60.0):
    """The verified unit under `key` from RAM, else disk; None when lost or corrupt."""
    boxed = ray.get(tiers["ram"].get.remote(key), timeout=timeout_s)
    data = None
    if boxed is not None:
        data = ray.get(boxed[0], timeout=timeout_s)
    elif "disk" in tiers:
        data = ray.get(tiers["disk"].get.remote(key), timeout=timeout_s)
    if data is None:
        return None
    try:
        return decode_unit(data)
    except UnitCorrupt:
        return None
