"""Shared fixtures: one Ray instance per test session, and a real `serve run` of the app on it.

GPU tests (marked `gpu`) skip where CUDA/CuPy is absent; everything else runs on the CPU.
"""

from __future__ import annotations

import functools
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "decapybara" / "assets" / "demo.mcapy"
API_KEY = "test-key"
# Keep BLAS single-threaded in the test process: 2-core CI machines run Ray actors beside it.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")


@functools.cache
def _cuda_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


# GPU tests whose time is mostly nvcc builds of kernel variants (the H200 suite's `--durations`, forty-eighth
# session: 38-98 s a case for the first group, up to 61 s for the second's slowest), run first where CUDA is present
# so that `-n 16 --dist load` does not end on a few workers still compiling while the others idle (one test at a
# time to each worker: `pytest_configure`). The product chain's tests (forty-ninth session: builds of their own,
# MX_CHAIN, not yet timed) are in the second group by their build count alone.
BUILD_HEAVY = (
    ("test_many_row_kernels_keep_the_bytes", "test_split_sums_in_batches_keep_the_bytes",
     "test_early_refill_keeps_the_bytes", "test_one_row_blocks_of_their_own_width_keep_the_bytes"),
    ("test_swiglu_is_the_product_then_the_activation", "test_swiglu_blocks_of_their_own_width",
     "test_swiglu_consumes_normed_rows", "test_producer_adds_the_residual_and_sums_each_tile",
     "test_prefill_attention_long_prefix_and_off_switch", "test_moe_blocks_take_the_fused_norm",
     "test_consumer_stages_the_normalised_rows", "test_fp32_fused_qkv_is_bit_identical",
     "test_dense_values_are_the_dequantisation", "test_chain_writes_what_the_launches_write",
     "test_chain_prefetch_leaves_the_bytes", "test_chained_decode_graphs_write_the_launched_graphs_bytes"),
)


def build_rank(item) -> int:
    """0, 1: the BUILD_HEAVY group of a test; 2: any other."""
    name = getattr(item, "originalname", item.name)
    return next((i for i, group in enumerate(BUILD_HEAVY) if name in group), len(BUILD_HEAVY))


def heavy_first(items: list) -> list:
    """`items` with the BUILD_HEAVY groups first, the first group's tests each followed by one of the second's (so
    that the two tests xdist first hands each worker hold one of the heaviest), each group in collection order."""
    groups: list[list] = [[] for _ in range(len(BUILD_HEAVY) + 1)]
    for item in items:
        groups[build_rank(item)].append(item)
    first, second, rest = groups
    paired = [t for pair in zip(first, second, strict=False) for t in pair]
    n = min(len(first), len(second))
    return paired + first[n:] + second[n:] + rest


def pytest_configure(config):
    """Where CUDA is present, pytest-xdist's `load` scheduling (3.2 and later) hands tests to its workers one at a
    time (`--maxschedchunk 1`, unless given): by default it hands each worker a run of consecutive tests, up to a
    quarter of its share at first, which would put the BUILD_HEAVY tests sorted first all on the first worker."""
    if getattr(config.option, "maxschedchunk", 0) is None and not hasattr(config, "workerinput") \
            and _cuda_available():
        config.option.maxschedchunk = 1


@pytest.hookimpl(trylast=True)  # after `-k` / `-m` deselected what they do
def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        items[:] = heavy_first(items)
        return
    skip = pytest.mark.skip(reason="needs CUDA and CuPy")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
    emu_last(config, items)


def emu_last(config, items: list) -> None:
    """The host emulator's runs (tests/test_cuda_emu.py: minutes of single-threaded CPU work in processes of their
    own) started now, at the lowest CPU priority, and that module's tests moved to the end, so that the runs use
    the CPU time the rest of the suite leaves idle instead of holding it up (not in pytest-xdist workers)."""
    module = sys.modules.get("test_cuda_emu") or sys.modules.get("tests.test_cuda_emu")
    if module is None or hasattr(config, "workerinput") or config.option.collectonly or \
            not module.start_early(items):
        return
    items.sort(key=lambda item: getattr(item, "module", None) is module)  # stable: each part keeps its order


def pytest_sessionfinish(session, exitstatus):
    module = sys.modules.get("test_cuda_emu") or sys.modules.get("tests.test_cuda_emu")
    if module is not None:
        module.stop_early()


@pytest.fixture(autouse=True)
def poison(request):
    """In GPU tests, fresh device outputs start as NaN / all-ones bits (`cupy_ops.POISON`): unwritten elements
    fail the checks."""
    if "gpu" not in request.keywords:
        yield
        return
    from decapybara.backend import cupy_ops as ops

    ops.POISON = True
    yield
    ops.POISON = False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray instance for the whole session (~5 s, ~1 GiB); its GCS address."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=8, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    try:
        from ray import serve

        serve.shutdown()
    finally:
        ray.shutdown()


class Served:
    """A running `serve run` of the app: its base URL and the subprocess' log file."""

    def __init__(self, url: str, log: Path, app_name: str):
        self.url, self.log, self.app_name = url, log, app_name

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


def serve_run(address: str, port: int, app_name: str, args: dict[str, str], log: Path,
              timeout_s: float = 240.0) -> Served:
    """`serve run --non-blocking serve_app:build_app k=v ...` against the session's Ray; waits for /health."""
    import httpx
    from ray import serve

    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve_cli = str(Path(sys.executable).parent / "serve")
    cmd = [serve_cli, "run", "--address", address, "--non-blocking", "--name", app_name, "--route-prefix", "/",
           "serve_app:build_app", *[f"{k}={v}" for k, v in args.items()]]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with log.open("w") as fh:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout_s)
    url = f"http://127.0.0.1:{port}"
    if proc.returncode != 0:
        raise RuntimeError(f"serve run failed ({proc.returncode}):\n{log.read_text()[-4000:]}")
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return Served(url, log, app_name)
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the app did not become healthy:\n{log.read_text()[-4000:]}")


@pytest.fixture(scope="session")
def served(ray_cluster, tmp_path_factory) -> Served:
    """The demo model served by a real `serve run`, with a KV pool small enough that 30 agents force
    pauses and resumes (the policy's behaviour under memory pressure is part of what the tests see)."""
    tmp = tmp_path_factory.mktemp("serve")
    args = {"model": str(DEMO), "num_pages": "48", "page_size": "16", "max_batch_tokens": "512",
            "disk_cache": str(tmp / "kv"), "ram_cache_gb": "0.25", "disk_cache_gb": "1", "name": "pytest",
            "max_model_len": "768", "api_key": API_KEY}
    return serve_run(ray_cluster, free_port(), "decapybara", args, tmp / "serve.log")
