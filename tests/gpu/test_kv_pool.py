"""The server's KV pool fitted to a real device (GPU only): `build_engine` on CUDA with neither num_pages nor
kv_memory_gb sizes the pool from the free memory it measures after loading the demo model, less the DeltaNet
states, the working reserve and `keep_free_gb`; the pool's allocation is what the plan counted; the engine then
serves requests (decode graphs included) and leaves at least `keep_free_gb` of the device free."""

from __future__ import annotations

import gc

import pytest

cp = pytest.importorskip("cupy")
from decapybara import kernels

if not kernels.has_cuda():
    pytest.skip("no CUDA device", allow_module_level=True)

from decapybara.engine.sampling import SamplingParams
from decapybara.errors import ConfigError
from decapybara.launcher.capacity import GIB
from decapybara.server.config import AppConfig
from decapybara.server.engine_setup import build_engine, device_memory

pytestmark = pytest.mark.gpu


def release(served) -> None:
    served.engine = None
    gc.collect()
    cp.get_default_memory_pool().free_all_blocks()


def serve_some(engine) -> list[list[int]]:
    prompts = [[5, 9, 13, 200, 7] * 30, [11, 3, 99] * 7]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True) for _ in prompts]
    out = engine.generate(prompts, params)
    assert [len(o) for o in out] == [24, 24]
    return out


def test_the_pool_fills_the_device_up_to_its_cap_and_keep_free():
    served = build_engine(AppConfig(device="cuda", slots=2))
    fit = served.pool
    assert served.cuda and fit is not None and fit.keep_free_bytes == 0
    # the demo model is small: the cap (every slot's 32,768 tokens twice, + the graphs' padding page) binds
    assert fit.pages == fit.cap == 2 * 2 * 64 + 1 < fit.by_memory
    assert served.engine.cfg.num_pages == fit.pages
    first = serve_some(served.engine)
    assert served.engine.snapshot_stats()["graphs"]["graph_steps"] > 0
    release(served)

    # keep_free so that the memory, not the cap, binds at about 800 pages of twelve slots' 1,537: measured just
    # before this build, so only the weights' load lies between it and the server's own measure
    free_before, _ = device_memory()
    target = 800 * fit.page_bytes
    keep = (free_before - fit.state_bytes // 3 * 13 - fit.reserve_bytes - target) / GIB  # states: 13 slots, not 3
    served = build_engine(AppConfig(device="cuda", slots=12, keep_free_gb=keep))
    fit2 = served.pool
    assert fit2.keep_free_bytes == int(keep * GIB) and fit2.cap == 2 * 12 * 64 + 1
    assert fit2.pages == fit2.by_memory < fit2.cap, fit2
    loaded = free_before - fit2.free_bytes  # what loading the weights took
    assert 800 - loaded // fit2.page_bytes - 2 <= fit2.pages <= 800, (fit2, loaded)
    assert served.engine.cfg.num_pages == fit2.pages
    # the KV cache allocates what the plan counted a page
    kv = served.engine.runner.kv
    assert kv.num_pages == fit2.pages and kv.bytes_per_page == fit2.page_bytes
    assert sum(a.nbytes for parts in kv.store.values() for a in parts.values()) == fit2.pages * fit2.page_bytes
    assert serve_some(served.engine) == first  # the same greedy tokens from a smaller pool
    free, _ = device_memory()
    assert free >= fit2.keep_free_bytes, (free, fit2)
    release(served)


def test_no_room_for_a_pool_is_refused_with_the_reason():
    _, total = device_memory()
    with pytest.raises(ConfigError, match="no room for a KV pool: .*keep_free"):
        build_engine(AppConfig(device="cuda", slots=2, keep_free_gb=total / GIB))
