"""The host side of eager forwards without a GPU: the CUDA backend's Python over the host emulator's CuPy stand-in
in no-op mode (tools/cuda_emu, CUDA_EMU_NOOP=1: each launch checks its arguments against the kernel's signature
and returns; arrays are numpy). For work on the wrappers' own cost, where the device machine's host speed moves
from process to process (docs/perf.md, twenty-eighth session); the GPU's figures stay bench/host_step.py's.

    python3 bench/host_emu.py                                   # the cases below, MXFP4 weights, 6/4 pages
    HOST_CASES=16@16384+11 HOST_PROFILE=30 python3 bench/host_emu.py mxfp4

The model has the `qwen3.8-27b` layout (64 layers, three DeltaNet layers to one attention layer, the same head
ratios and head dims) at small widths (hidden 512, MLP 1024, 6 query heads and 1 KV head of 256, DeltaNet 2 key
and 6 value heads of 128; vocabulary 2,048), so every product takes the kernels' paths of the 27B at the same
row counts, without the 27B's host memory. Numpy allocations stand in for CuPy's memory pool and the no-op
launch's checks for CuPy's launch, so absolute times are not the GPU machine's: compare trees and variants
here, in one process. Prints per case the median forward time of HOST_REPS (15) after two warm-ups, launches
and Python calls a forward, and with HOST_PROFILE=N cProfile's top N by own time.
"""

from __future__ import annotations

import cProfile
import dataclasses
import io
import os
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Self

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools" / "cuda_emu"))
os.environ["CUDA_EMU_NOOP"] = "1"
os.environ["CUDA_EMU_STRIDED"] = "1"  # views pass their first element's address, as CuPy passes them
import fake_cupy

fake_cupy.install()
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import numpy as np

from decapybara import kernels

fake_cupy.patch_backend()  # as tools/cuda_emu/emu_plugin.py
kernels.sm90a_ok = lambda: True

import gpu as B
from host_step import batch, parse  # the same cases as on the GPU

from decapybara.backend.piecewise import PiecewiseTails


class _Random:
    """CuPy's random functions the benchmark builders call, on numpy (whose signatures differ)."""

    def __init__(self) -> None:
        self.rng = np.random.default_rng(0)

    def seed(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def standard_normal(self, shape, dtype=np.float64):
        return self.rng.standard_normal(shape, dtype=np.float32).astype(dtype)

    def uniform(self, low, high, shape):
        return self.rng.uniform(low, high, shape)

    def randint(self, low, high, size, dtype=np.int64):
        return self.rng.integers(low, high, size, dtype=dtype)


B.cp.random = _Random()

CASES = [s for s in os.environ.get("HOST_CASES", "16@16384+11,64@16384+11,256@0").split(",") if s]
REPS = int(os.environ.get("HOST_REPS", "15"))
TOP = int(os.environ.get("HOST_PROFILE", "0"))
TAILS = os.environ.get("HOST_TAILS") == "1"  # the layers' tails as (emulated) CUDA graphs: decapybara/backend/piecewise.py
B.CFG = dataclasses.replace(B.CFG, hidden_size=512, intermediate_size=1024, num_attention_heads=6,
                            num_key_value_heads=1, linear_num_key_heads=2, linear_num_value_heads=6, vocab_size=2048)


class Launches:
    """Counts the no-op launches (fake_cupy.FakeKernel calls) while installed."""

    def __init__(self) -> None:
        self.n = 0
        self._call = fake_cupy.FakeKernel.__call__

    def __enter__(self) -> Self:
        def counted(kernel, *a, **kw):
            self.n += fake_cupy.CAPTURE is None and not fake_cupy.REPLAYING  # the host's launches, not a graph's
            return self._call(kernel, *a, **kw)
        fake_cupy.FakeKernel.__call__ = counted
        return self

    def __exit__(self, *exc) -> None:
        fake_cupy.FakeKernel.__call__ = self._call


def main() -> None:
    variant = (sys.argv[1:] or ["mxfp4"])[0]
    kv = B.CupyBackend("bf16").new_kv_cache(B.CFG, B.SLOTS * B.SEQ_PAGES + 1, B.PAGE, os.environ.get("HOST_KV", "6/4"))
    states = B.CupyBackend("bf16").new_state_pool(B.CFG, B.SLOTS + 1)
    model = B.build_model(variant)
    tails = PiecewiseTails() if TAILS else None
    print(f"{'case':<16}{'ms a forward':>14}{'min':>8}{'launches':>10}{'py calls':>10}")
    for case in CASES:
        fb = batch(*parse(case))
        for _ in range(2):
            model.forward(fb, kv, states, tails=tails)
        times = []
        for _ in range(REPS):
            t = time.perf_counter()
            model.forward(fb, kv, states, tails=tails)
            times.append((time.perf_counter() - t) * 1e3)
        with Launches() as launches:
            model.forward(fb, kv, states, tails=tails)
        prof = cProfile.Profile()
        prof.enable()
        model.forward(fb, kv, states, tails=tails)
        prof.disable()
        st = pstats.Stats(prof)
        print(f"{case:<16}{statistics.median(times):>14.2f}{min(times):>8.2f}{launches.n:>10}{st.total_calls:>10}",
              flush=True)
        if TOP:
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(TOP)
            print(out.getvalue())


if __name__ == "__main__":
    main()
