"""The RAM and disk tier actors on the session's Ray: object-store units owned by the RAM tier, spills to the
disk tier, exact resume through them, and a killed RAM tier treated as lost (recompute, no hang)."""

from __future__ import annotations

import functools
import time
from types import SimpleNamespace

import numpy as np
import pytest
import ray

from actors.kv_tier_actors import ray_tier_stores, start_tiers
from decapybara.config import EngineConfig
from decapybara.engine.engine import Engine
from decapybara.engine.sampling import SamplingParams
from decapybara.engine.sequence import Request
from decapybara.kv.units import page_key
from decapybara.testing import tiny_qwen

pytestmark = pytest.mark.timeout(300)
GREEDY = SamplingParams(temperature=0, max_tokens=30)


@functools.cache
def model():
    return tiny_qwen("qwen3_5_text")[0]


def setup(tmp_path, name: str, ram_gb: float):
    cfg = SimpleNamespace(name=name, disk_cache=f"file://{tmp_path}/kv", disk_cache_gb=0.1, ram_cache_gb=ram_gb)
    tiers = start_tiers(cfg)
    engine = Engine(model(), EngineConfig(page_size=8, num_pages=64))
    stores = ray_tier_stores(tiers, engine.blocks.salt, timeout_s=20)
    engine.bundle_store = stores
    engine.set_page_store(stores)
    return engine, tiers


def pause_midway(engine: Engine, p: list[int]) -> dict[str, list[int]]:
    engine.add_request(Request(tuple(p), GREEDY, "agent"))
    outs: dict[str, list[int]] = {}
    for _ in range(5):
        for ev in engine.step():
            outs.setdefault(ev.request_id, []).extend(ev.token_ids)
    engine.pause(engine.seqs["agent"])
    return outs


def finish(engine: Engine, outs: dict[str, list[int]]) -> None:
    while engine.has_work():
        for ev in engine.step():
            outs.setdefault(ev.request_id, []).extend(ev.token_ids)


@pytest.mark.parametrize("ram_gb", [0.25, 0.0])
def test_resume_through_the_tier_actors_is_exact(ray_cluster, tmp_path, ram_gb):
    p = np.random.default_rng(1).integers(0, 512, 27).tolist()
    ref = Engine(model(), EngineConfig(page_size=8, num_pages=64)).generate([p], GREEDY)[0]
    engine, tiers = setup(tmp_path, f"t{int(ram_gb * 100)}", ram_gb)
    outs = pause_midway(engine, p)
    key = engine.seqs["agent"].paused_bundle
    where = "ram" if ram_gb > 0 else "disk"
    deadline = time.time() + 30  # the put is asynchronous (and the tier actors may still be starting)
    while not ray.get(tiers[where].contains.remote(key)) and time.time() < deadline:
        time.sleep(0.05)
    assert ray.get(tiers[where].contains.remote(key))
    computed = engine.stats.computed_prompt_tokens
    finish(engine, outs)
    assert outs["agent"] == ref and engine.stats.computed_prompt_tokens == computed
    ram = ray.get(tiers["ram"].stats.remote())
    assert ram["used_bytes"] <= ram["budget_bytes"]
    for h in tiers.values():
        ray.kill(h)


def test_killed_ram_tier_means_lost_units_and_recompute(ray_cluster, tmp_path):
    p = np.random.default_rng(2).integers(0, 512, 23).tolist()
    ref = Engine(model(), EngineConfig(page_size=8, num_pages=64)).generate([p], GREEDY)[0]
    engine, tiers = setup(tmp_path, "killed", 0.25)
    outs = pause_midway(engine, p)
    ray.kill(tiers["ram"])
    t0 = time.time()
    finish(engine, outs)
    assert time.time() - t0 < 60  # nothing hangs
    assert engine.stats.lost_bundles == 1
    assert outs["agent"] == ref  # recomputed from its tokens
    ray.kill(tiers["disk"])


def _unit(key: str, seed: int = 0):
    from decapybara.kv.units import HybridState, KVPageData, Unit

    rng = np.random.default_rng(seed)
    kv = {"3|k": rng.standard_normal((2, 8, 2, 32)).astype(np.float32)}
    state = HybridState([rng.standard_normal((24, 3)).astype(np.float32)],
                        [rng.standard_normal((4, 16, 16)).astype(np.float32)])
    return Unit.conversation(key, KVPageData(kv), state, 13)


def test_a_dead_disk_tier_loses_spills_and_leaves_the_ram_tier_and_stats_up(ray_cluster, tmp_path):
    """A RAM tier whose spills cannot reach a dead disk tier counts them lost and goes on taking units; the
    scheduler's tier statistics report the dead tier instead of failing."""
    import asyncio

    from actors.kv_tier_actors import RayTiers
    from actors.scheduler_actor import _tier_stats

    cfg = SimpleNamespace(name="deaddisk", disk_cache=f"file://{tmp_path}/kv", disk_cache_gb=0.1,
                          ram_cache_gb=12_000 / 2**30)  # room for about one unit
    tiers = start_tiers(cfg)
    ray.get(tiers["disk"].stats.remote())
    ray.kill(tiers["disk"])
    ram = RayTiers(tiers)
    for i in range(4):
        ram.put(_unit(f"conv/a/{i}", i))
    deadline = time.time() + 30
    while ray.get(tiers["ram"].stats.remote())["puts"] < 4 and time.time() < deadline:
        time.sleep(0.05)
    stats = ray.get(tiers["ram"].stats.remote())
    held = [i for i in range(4) if ray.get(tiers["ram"].contains.remote(f"conv/a/{i}"))]
    assert stats["puts"] == 4 and stats["lost"] == stats["spills"] == 4 - len(held) >= 2, (stats, held)
    out = asyncio.run(_tier_stats(tiers))
    assert out["ram"]["puts"] == 4 and set(out["disk"]) == {"error"}
    ray.kill(tiers["ram"])


@ray.remote
class _Stager:
    """An actor putting units through `RayTiers`, as the GPU actor does: staged for the RAM tier to take."""

    def __init__(self, tiers):
        from actors.kv_tier_actors import RayTiers

        self.tiers = RayTiers(tiers)

    def put(self, unit) -> str:
        return self.tiers.put(unit)

    def take_staged(self, key: str):
        return self.tiers.take_staged(key)

    def staged(self) -> int:
        return len(self.tiers.staged)


def test_a_staged_unit_is_dropped_when_the_ram_tier_cannot_take_it(ray_cluster, tmp_path):
    cfg = SimpleNamespace(name="stager", disk_cache=f"file://{tmp_path}/kv", disk_cache_gb=0.0, ram_cache_gb=0.01)
    tiers = start_tiers(cfg)
    stager = _Stager.remote(tiers)
    ray.get(stager.put.remote(_unit("conv/s/0")))
    deadline = time.time() + 30
    while ray.get(stager.staged.remote()) and time.time() < deadline:  # taken by the tier
        time.sleep(0.05)
    assert ray.get(tiers["ram"].contains.remote("conv/s/0")) and ray.get(stager.staged.remote()) == 0
    ray.kill(tiers["ram"])
    time.sleep(0.5)
    ray.get(stager.put.remote(_unit("conv/s/1", 1)))
    deadline = time.time() + 30
    while ray.get(stager.staged.remote()) and time.time() < deadline:  # the failed call lets it go
        time.sleep(0.05)
    assert ray.get(stager.staged.remote()) == 0
    ray.kill(stager)


def test_new_engines_adopt_the_pages_the_tier_actors_hold(ray_cluster, tmp_path, monkeypatch):
    """A GPU actor's successor over the same tier actors adopts the prefix pages its predecessor evicted into them,
    and after a graceful stop's save (`save_cached_pages`: to the disk tier actor) an engine over new tier actors on
    the same disk adopts those: both restore the pages instead of prefilling them, with the uncached greedy tokens,
    each prefix's pages in at most three waits on the tier actors (not two a page)."""
    import actors.kv_tier_actors as kta
    from decapybara.engine.block_manager import hash_chain

    waits = []
    real_get = kta.ray.get

    def counted(*a, **k):
        waits.append(1)
        return real_get(*a, **k)

    cfg = SimpleNamespace(name="adopt", disk_cache=f"file://{tmp_path}/kv", disk_cache_gb=0.1, ram_cache_gb=0.25)
    tiers = start_tiers(cfg)

    def engine_over(tiers, num_pages=64):
        engine = Engine(model(), EngineConfig(page_size=8, num_pages=num_pages, loop_guard="off"))
        stores = ray_tier_stores(tiers, engine.blocks.salt, timeout_s=20)
        engine.bundle_store = stores
        engine.set_page_store(stores)
        return engine, stores

    rng = np.random.default_rng(7)
    system = rng.integers(0, 512, 40).tolist()  # five pages
    first, _ = engine_over(tiers, num_pages=12)
    first.add_request(Request(tuple(system + [1, 2, 3]), SamplingParams(temperature=0, max_tokens=4), "a"))
    finish(first, {})
    for i in range(3):  # other traffic pushes the system prompt's pages out of the 12-page pool
        first.add_request(Request(tuple(rng.integers(0, 512, 60).tolist()), SamplingParams(temperature=0, max_tokens=4),
                                  f"x{i}"))
        finish(first, {})
    keys = {page_key(first.blocks.salt, h) for h in hash_chain(system, 8, first.blocks.salt)}
    deadline = time.time() + 30  # the puts are asynchronous
    while not all(ray.get(tiers["ram"].contains.remote(k)) for k in keys) and time.time() < deadline:
        time.sleep(0.05)
    second = system + rng.integers(0, 512, 9).tolist()
    ref = Engine(model(), EngineConfig(page_size=8, num_pages=64, enable_prefix_cache=False, loop_guard="off",
                                       max_model_len=first.max_model_len)).generate([second], GREEDY)[0]

    engine, stores = engine_over(tiers, num_pages=12)  # the replaced GPU actor's engine
    assert stores.adopt_pages() >= 5
    outs: dict[str, list[int]] = {}
    engine.add_request(Request(tuple(second), GREEDY, "b"))
    with monkeypatch.context() as m:
        m.setattr(kta.ray, "get", counted)
        finish(engine, outs)
    assert len(waits) <= 3, len(waits)
    assert engine.stats.restored_pages == 5 and engine.stats.computed_prompt_tokens == len(second) - 40
    assert outs["b"] == ref
    assert engine.save_cached_pages() >= 5  # a graceful stop: the pool's pages to the disk tier actor

    for h in tiers.values():  # the whole server stops; a new one starts on the same disk
        ray.kill(h)
    cfg.name = "adopt2"
    tiers = start_tiers(cfg)
    engine, stores = engine_over(tiers, num_pages=12)
    assert stores.adopt_pages() >= 5
    mark, news = stores.news()  # the disk tier actor's pages as news (what the GPU actor asks every NEWS_S)
    assert len(news) >= 5 and stores.adopt(news, mark) == 0 and stores.news()[1] == {}  # known already
    outs = {}
    engine.add_request(Request(tuple(second), GREEDY, "c"))
    waits.clear()
    with monkeypatch.context() as m:
        m.setattr(kta.ray, "get", counted)
        finish(engine, outs)
    assert len(waits) <= 3, len(waits)
    assert engine.stats.restored_pages >= 5 and engine.stats.computed_prompt_tokens < len(second) - 40 + 8
    assert outs["c"] == ref
    for h in tiers.values():
        ray.kill(h)


def test_one_lost_object_among_a_prefixs_units_costs_only_itself(monkeypatch):
    """`fetch_units` waits for a prefix's objects together; where one of them is lost, the others still come back
    (each waited for on its own) and only the lost one reads as missing, so the prefix is reused up to it. A timeout
    is a stuck tier: it is raised, for every unit to read as missing (`RayTiers.get_many`)."""
    import actors.kv_tier_actors as kta

    def fake_get(refs, timeout=None):
        if isinstance(refs, list):
            if "lost" in refs:
                raise ray.exceptions.ObjectLostError("x", "y", "z")
            if "slow" in refs:
                raise ray.exceptions.GetTimeoutError("slow")
            return [f"data:{r}" for r in refs]
        if refs == "lost":
            raise ray.exceptions.ObjectLostError("x", "y", "z")
        return f"data:{refs}"

    monkeypatch.setattr(kta.ray, "get", fake_get)
    assert kta._objects(["a", "lost", "b"], 1.0) == ["data:a", None, "data:b"]
    assert kta._objects(["a", "b"], 1.0) == ["data:a", "data:b"] and kta._objects([], 1.0) == []
    with pytest.raises(ray.exceptions.GetTimeoutError):
        kta._objects(["a", "slow"], 1.0)
