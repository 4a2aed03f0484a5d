"""GPUActor: the data plane. Owns the weights, the KV pool and hybrid states, and the engine's step loop.

A thin Ray shell around `decapybara.engine.driver.EngineDriver`: `control()` queues the scheduler's messages,
`run()` is a streaming generator yielding one `StepReport` per engine step (every slot's tokens together).
On a CUDA machine it takes one GPU and the cupy backend (packed quantised weights, decode steps as CUDA
graphs unless `cuda_graphs` is off); elsewhere the numpy backend and no GPU.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from typing import Any

import ray

from decapybara.engine.driver import Control, EngineDriver
from decapybara.launcher.capacity import kv_bytes_per_token


class GPUActor:
    def __init__(self, app_config: dict[str, Any], tier_handles: dict[str, Any] | None = None):
        from decapybara.engine.engine import Engine
        from decapybara.model.load import load_model
        from decapybara.server.config import AppConfig

        t0 = time.perf_counter()
        cfg = AppConfig(**app_config)
        self.cuda = cfg.use_cuda()
        if self.cuda:  # packed quantised weights on the mx_gemv kernels; decode steps as CUDA graphs
            from decapybara.backend.cuda_factory import cuda_backend

            backend = cuda_backend("bf16", prefill_weights=cfg.prefill_weights)
        else:
            from decapybara.backend.numpy_backend import NumpyBackend

            backend = NumpyBackend()
        plan = None  # the served context: YaRN past the trained one where asked (AppConfig.context_plan)

        def context(mcfg: Any) -> int | None:
            nonlocal plan
            plan = cfg.context_plan(mcfg.max_position_embeddings)
            return plan.yarn_to

        loaded = load_model(cfg.resolved_model(), backend, context=context)
        if self.cuda:  # what loading freed (stacked weights' parts, their bf16 copies) back to the device for the KV pool
            import cupy

            cupy.get_default_memory_pool().free_all_blocks()
        mcfg = loaded.config
        engine_cfg = cfg.engine_config(self.cuda, max_model_len=plan.max_model_len)
        if cfg.kv_memory_gb and not cfg.num_pages:
            bytes_per_page = kv_bytes_per_token(mcfg, engine_cfg.kv_mode) * engine_cfg.page_size or 1
            engine_cfg = engine_cfg.replace(num_pages=max(2, int(cfg.kv_memory_gb * 2**30 // bytes_per_page)))
        self.engine = Engine(loaded.model, engine_cfg, tokenizer=loaded.tokenizer)
        self.driver = EngineDriver(self.engine, remote_policy=True)
        self.tier_handles = tier_handles or {}
        if self.tier_handles:  # paused conversations and evicted prefix pages go to RAM, then disk
            from actors.kv_tier_actors import ray_tier_stores

            stores = self.stores = ray_tier_stores(self.tier_handles, self.engine.blocks.salt)
            self.engine.bundle_store = stores
            self.engine.set_page_store(stores)
        self.model_name = cfg.served_model_name
        self.load_seconds = time.perf_counter() - t0
        self._lock = threading.Lock()

    def info(self) -> dict[str, Any]:
        e = self.engine
        return {
            "backend": self.engine.model.backend.name, "cuda": self.cuda, "load_seconds": self.load_seconds,
            "model_type": e.model.cfg.model_type, "max_model_len": e.max_model_len,
            "vocab_size": e.model.cfg.vocab_size, "engine": dataclasses.asdict(e.cfg), "pid": os.getpid(),
            "runner": e.runner.info(),
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
        return dict(self.driver.last_stats)

    def stop(self) -> None:
        self.driver.stop()


def gpu_actor_class(cuda: bool, blas_threads: int = 0, name: str | None = None) -> Any:
    """The Ray actor class with resources for this machine: one GPU with CUDA, else CPUs only; named
    `name` (e.g. "<app>-gpu") so operators and tests can find it."""
    threads = str(blas_threads or max(1, (os.cpu_count() or 2) - 1))
    env = {"OMP_NUM_THREADS": threads, "OPENBLAS_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    return ray.remote(GPUActor).options(
        num_gpus=1 if cuda else 0, num_cpus=1, max_concurrency=8, runtime_env={"env_vars": env}, name=name,
    )
