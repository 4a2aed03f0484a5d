"""The device sampler's fallback sort: each row's canonical order of 248,320 float64 scaled logits (descending, ties
by ascending id) by CuPy's argsort along the rows against `cupy_ops_extra.canonical_orders` (two 1-D stable sorts),
1, 4 and 12 rows, the same orders checked; GPU and host microseconds a call, medians.

    python3 bench/sample_orders.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupy as cp
import cupyx.profiler as prof
import numpy as np

from decapybara.backend import cupy_ops_extra as ex

VOCAB = 248_320


def along_rows(z: cp.ndarray) -> cp.ndarray:
    """The previous form: one stable argsort of -z along its rows."""
    return cp.ascontiguousarray(cp.argsort(-z + 0.0, axis=-1).astype(cp.int32))


def main() -> None:
    rng = np.random.default_rng(0)
    print(f"{'rows':>4} {'form':<18} {'GPU us':>8} {'host us':>8} {'x along rows':>12}  same")
    for r in (1, 4, 12):
        z = cp.asarray(rng.standard_normal((r, VOCAB)) * 2 + 0.0)
        z[:, :50] = 1.0  # ties
        want = along_rows(z)
        base = None
        for name, fn in (("along rows", lambda z=z: along_rows(z)),
                         ("canonical_orders", lambda z=z: ex.canonical_orders(z))):
            same = bool((fn() == want).all())
            t = prof.benchmark(fn, n_repeat=15, n_warmup=3)
            gpu = float(np.median(t.gpu_times)) * 1e6
            base = base or gpu
            print(f"{r:4d} {name:<18} {gpu:8.1f} {float(np.median(t.cpu_times)) * 1e6:8.1f} {gpu / base:12.3f}  {same}")


if __name__ == "__main__":
    main()
