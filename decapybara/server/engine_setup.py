"""The served engine built from the app's settings, without Ray: the model loaded on this machine's backend under
its context plan (YaRN where asked), the KV pool sized, the Engine made. `actors/gpu_actor.py`'s GPUActor is a thin
Ray shell around `build_engine`; tests/gpu build the same engine on a GPU machine that has no Ray.

The KV pool, in order: `num_pages` where given; else `kv_memory_gb` of pages; else, on CUDA, the pages that the
device's free memory holds once the weights are loaded (`launcher.capacity.fit_pool`: less the DeltaNet state
pool (and the verification graphs' rollback states, `verify_checkpoints`), the working reserve and
`keep_free_gb`, at most every slot's whole context twice over); else (the CPU)
`EngineConfig`'s default pages.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from decapybara.backend.kv_codec import kv_bytes_per_token
from decapybara.errors import ConfigError
from decapybara.launcher.capacity import GIB, PoolFit, fit_pool
from decapybara.server.config import AppConfig

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ServedEngine:
    engine: Any  # decapybara.engine.engine.Engine
    cuda: bool
    load_seconds: float
    pool: PoolFit | None  # the fitted pool (CUDA, neither num_pages nor kv_memory_gb given), else None


def verify_checkpoints(engine_cfg: Any, mcfg: Any) -> int:
    """DeltaNet states that speculative verification graphs keep as rollback points (one a row of the largest
    bucket the engine's slots use, `graph_buckets`): with CUDA graphs, a hybrid model and a speculator that drafts
    for it (prompt lookup for any model, the MTP head where the model has one; draft_len not 0); else 0."""
    from decapybara.engine.runner import graph_buckets

    drafts = engine_cfg.draft_len > 0 and (engine_cfg.speculator == "ngram" or (engine_cfg.speculator == "mtp"
                                                                                and mcfg.mtp_num_hidden_layers > 0))
    on = drafts and engine_cfg.cuda_graphs and bool(mcfg.linear_layers)
    return max(graph_buckets(engine_cfg.max_slots)) if on else 0


def device_memory() -> tuple[int, int]:
    """(free, total) bytes of the current CUDA device, with CuPy's cached free blocks handed back first (what
    loading freed: stacked weights' parts, their bf16 copies)."""
    import cupy

    cupy.get_default_memory_pool().free_all_blocks()
    free, total = cupy.cuda.runtime.memGetInfo()
    return int(free), int(total)


def build_engine(cfg: AppConfig) -> ServedEngine:
    """Load `cfg`'s model on CUDA (the cupy backend: packed quantised weights, decode steps as CUDA graphs unless
    `cuda_graphs` is off) or the CPU (numpy), size the KV pool and build the Engine. ConfigError where the
    settings cannot be served (a context the rope scaling refuses, no room for a KV pool)."""
    from decapybara.engine.engine import Engine, pool_context
    from decapybara.engine.runner import graph_plan
    from decapybara.model.load import load_model

    t0 = time.perf_counter()
    cuda = cfg.use_cuda()
    if cuda:
        from decapybara.backend.cuda_factory import cuda_backend

        backend = cuda_backend("bf16", prefill_weights=cfg.prefill_weights)
    else:
        from decapybara.backend.numpy_backend import NumpyBackend

        backend = NumpyBackend()
    plan = None  # the served context: YaRN past the trained one where asked (AppConfig.context_plan)
    file_cfg = None  # the file's own model config (its rope before any extension)

    def context(mcfg: Any) -> int | None:
        nonlocal plan, file_cfg
        plan, file_cfg = cfg.context_plan(mcfg.max_position_embeddings), mcfg
        return plan.yarn_to

    loaded = load_model(cfg.resolved_model(), backend, context=context)
    mcfg = loaded.config
    engine_cfg = cfg.engine_config(cuda, max_model_len=plan.max_model_len)
    pool = None
    if not cfg.num_pages:
        page_bytes = kv_bytes_per_token(mcfg, engine_cfg.kv_mode) * engine_cfg.page_size
        if cfg.kv_memory_gb:
            engine_cfg = engine_cfg.replace(num_pages=max(2, int(cfg.kv_memory_gb * GIB // (page_bytes or 1))))
        elif cuda:
            free, total = device_memory()
            pool = fit_pool(mcfg, free, total, engine_cfg.kv_mode, engine_cfg.max_slots, engine_cfg.page_size,
                            engine_cfg.max_model_len or mcfg.max_position_embeddings,
                            keep_free_bytes=int(cfg.keep_free_gb * GIB), checkpoints=verify_checkpoints(engine_cfg, mcfg))
            if not pool.fits:
                raise ConfigError(f"no room for a KV pool: {pool.why_not()}; lower keep_free_gb, slots or the "
                                  "weights' size, or set num_pages / kv_memory_gb")
            engine_cfg = engine_cfg.replace(num_pages=pool.pages)
    usable = graph_plan(engine_cfg, loaded.model.backend.name, engine_cfg.max_model_len or mcfg.max_position_embeddings,
                        bool(mcfg.linear_layers)).usable_pages
    pool_tokens = pool_context(usable, engine_cfg)  # as the engine will count it
    if plan.yarn_to and fit_yarn(loaded.model, file_cfg, pool_tokens, plan.yarn_to):
        served = loaded.model.cfg.max_position_embeddings
        log.info("the KV pool holds %d tokens: the model's rope serves %d (YaRN factor %.4g), not the %d asked",
                 pool_tokens, served, loaded.model.cfg.rope.factor if loaded.model.cfg.rope.kind == "yarn" else 1.0,
                 plan.yarn_to)
        engine_cfg = engine_cfg.replace(max_model_len=min(engine_cfg.max_model_len or served, served))
    engine = Engine(loaded.model, engine_cfg, tokenizer=loaded.tokenizer)
    return ServedEngine(engine, cuda, time.perf_counter() - t0, pool)


def fit_yarn(model: Any, file_cfg: Any, pool_tokens: int, yarn_to: int) -> bool:
    """Where the KV pool holds fewer tokens than the YaRN extension (to `yarn_to`) that `model` was loaded with,
    extend the file's context no further than the pool needs: not at all where the file's own context (its rope as
    the file has it, YaRN included) covers the pool, else to the file's context times the power of two that covers
    it (at most `yarn_to`). YaRN's factor, and what it costs in quality, grow with the context, and no conversation
    is longer than the pool. Powers of two keep the rope, and with it the prefix cache's salt, the same across
    restarts whose free memory differs by a few pages. The model's rope is rebuilt in place (before an engine
    captures it). Returns whether it changed."""
    from decapybara.model.config import with_yarn
    from decapybara.model.rope import RotaryTable

    own = file_cfg.max_position_embeddings
    if pool_tokens <= own:
        fitted = file_cfg
    else:
        target = own
        while target < pool_tokens:
            target *= 2
        fitted = with_yarn(file_cfg, min(target, yarn_to))
    if fitted == model.cfg:
        return False
    model.cfg, model.rotary = fitted, RotaryTable.for_config(fitted)
    return True
