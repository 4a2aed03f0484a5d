"""GPUActor: the data plane. Owns the weights, the KV pool and hybrid states, and the engine's step loop.

A thin Ray shell: `decapybara.server.engine_setup.build_engine` makes the engine (the model on the cupy backend
with one GPU: packed quantised weights, decode steps as CUDA graphs unless `cuda_graphs` is off, the KV pool fitted
to the free device memory unless given; elsewhere the numpy backend and no GPU), and
`decapybara.engine.driver.EngineDriver` runs it: `control()` queues the scheduler's messages, `run()` is a
streaming generator yielding one `StepReport` per engine step (every slot's tokens together).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from typing import Any

import ray

from decapybara.engine.driver import Control, EngineDriver, LoopStopped

log = logging.getLogger(__name__)
NEWS_S = 10.0  # how often the disk tier is asked for prefix pages another server wrote (`GPUActor._watch`)


class GPUActor:
    def __init__(self, app_config: dict[str, Any], tier_handles: dict[str, Any] | None = None):
        from decapybara.server.config import AppConfig
        from decapybara.server.engine_setup import build_engine

        cfg = AppConfig(**app_config)
        served = build_engine(cfg)
        self.cuda, self.engine, self.pool = served.cuda, served.engine, served.pool
        self.driver = EngineDriver(self.engine, remote_policy=True)
        self.tier_handles = tier_handles or {}
        if self.tier_handles:  # paused conversations and evicted prefix pages go to RAM, then disk
            from actors.kv_tier_actors import ray_tier_stores

            stores = self.stores = ray_tier_stores(self.tier_handles, self.engine.blocks.salt)
            self.engine.bundle_store = stores
            self.engine.set_page_store(stores)
            # the pages an earlier engine left in the tiers (before a restart, or this actor's predecessor's)
            self.adopted_pages = stores.adopt_pages()
        else:
            self.adopted_pages = 0
        self.news_pages = 0  # pages another server sharing the disk tier's folder wrote, learnt since (`_watch`)
        self._stopped = threading.Event()
        if "disk" in self.tier_handles:
            threading.Thread(target=self._watch, name="page-news", daemon=True).start()
        self.model_name = cfg.served_model_name
        self.load_seconds = served.load_seconds
        self._lock = threading.Lock()

    def info(self) -> dict[str, Any]:
        e = self.engine
        return {
            "backend": self.engine.model.backend.name, "cuda": self.cuda, "load_seconds": self.load_seconds,
            "model_type": e.model.cfg.model_type, "max_model_len": e.max_model_len,
            "vocab_size": e.model.cfg.vocab_size, "engine": dataclasses.asdict(e.cfg), "pid": os.getpid(),
            "runner": e.runner.info(), "kv_pool": None if self.pool is None else dataclasses.asdict(self.pool),
            "adopted_pages": self.adopted_pages, "news_pages": self.news_pages,
        }

    def take_staged(self, key: str):
        """A unit encoded for the RAM tier, returned to it (the result object is the tier's)."""
        return self.stores.tiers.take_staged(key)

    def control(self, control: Control) -> None:
        self.driver.submit(control)

    def run(self):
        """Streaming: one StepReport per step, stamped with the wall time it left the actor."""
        for report in self.driver.reports():
            report.stats["sent_at"] = time.time()
            yield report

    def stats(self) -> dict[str, Any]:
        return {**self.driver.last_stats, "news_pages": self.news_pages}

    def save_cache(self, budget_s: float) -> int:
        """The prefix cache's pages to the disk tier (`Engine.save_cached_pages`), for the next engine over it: at a
        graceful stop. Runs between two steps; returns the pages saved (0 without a disk tier)."""
        if "disk" not in self.tier_handles:
            return 0
        return self.driver.call(lambda engine: engine.save_cached_pages(budget_s), timeout_s=budget_s + 60)

    def _watch(self) -> None:
        """Every `NEWS_S`: the prefix pages the disk tier gained (`TierStores.news`: those another server sharing
        its folder wrote) recorded between two steps (`TierStores.adopt`), so that a prompt this server never saw
        but another one did restores them instead of prefilling them again."""
        while not self._stopped.wait(NEWS_S):
            try:
                mark, pages = self.stores.news()
                self.news_pages += self.driver.call(lambda engine, got=pages, m=mark: self.stores.adopt(got, m),
                                                    timeout_s=60)
            except LoopStopped as e:  # the engine's loop stopped: so does this
                log.debug("prefix page news stopped: %s", e)
                return
            except Exception as e:  # noqa: BLE001 - the next round asks again (from where the last adopt left)
                log.debug("prefix page news not taken: %s: %s", type(e).__name__, e)

    def stop(self) -> None:
        self._stopped.set()
        self.driver.stop()


def gpu_actor_class(cuda: bool, blas_threads: int = 0, name: str | None = None) -> Any:
    """The Ray actor class with resources for this machine: one GPU with CUDA, else CPUs only; named
    `name` (e.g. "<app>-gpu") so operators and tests can find it."""
    threads = str(blas_threads or max(1, (os.cpu_count() or 2) - 1))
    env = {"OMP_NUM_THREADS": threads, "OPENBLAS_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    return ray.remote(GPUActor).options(
        num_gpus=1 if cuda else 0, num_cpus=1, max_concurrency=8, runtime_env={"env_vars": env}, name=name,
    )
