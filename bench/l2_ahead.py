"""A product's weights asked of the L2 ahead of it, in isolation: what `cupy_ops_extra.l2_ahead` can give.

    PYTHONUNBUFFERED=1 python3 bench/l2_ahead.py          # JSON to $OUT/l2_ahead.json

In a decode step a latency-bound kernel (the DeltaNet recurrence, the attention) runs between a layer's input
product and its output product and leaves DRAM mostly idle. Here a spin kernel of L2A_SPIN_US microseconds (one
block, reads nothing) stands for it. For each product (the 27B's DeltaNet "out" and the larger qkv|z and down,
MXFP4, x in bf16 bits) at 1 and 12 rows, CUDA-graph replays of [spin, product] cycling through enough weight
copies that none stays in the L2 ("cold"), the same with `l2_ahead` of the product's weight launched before the
spin ("ahead"), and [spin, product] on one weight ("warm": what an L2-resident weight is worth, for products
that fit). Prints us a pair, the product's share after the spin alone, and ahead / cold.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import cupy as cp
from gpu import graph_time, random_packed  # bench/gpu.py
from step_products import step_products

from decapybara.backend import cupy_ops as ops
from decapybara.backend import cupy_ops_extra as ex
from decapybara.model.config import named_config

SPIN_US = float(os.environ.get("L2A_SPIN_US", "6"))
NAMES = os.environ.get("L2A_PRODUCTS", "out,qkv|z,down").split(",")
ROWS = [int(r) for r in os.environ.get("L2A_ROWS", "1,12").split(",")]
CYCLE = 160e6  # bytes of distinct weights a graph cycles through

_SPIN = cp.RawKernel(r"""
extern "C" __global__ void spin(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}""", "spin")


def spin_cycles() -> int:
    rate = cp.cuda.runtime.deviceGetAttribute(cp.cuda.runtime.cudaDevAttrClockRate, 0)  # kHz
    return int(SPIN_US * rate / 1e3)


def time_pairs(ws: list[Any], x: Any, spin: Any, warm_ok: bool) -> dict[str, float]:
    """us of a [spin, product] pair as a graph replays it: "cold" (the weights cycled), "ahead" (each product's
    weight asked of the L2 before its spin), "warm" (one weight, where `warm_ok`)."""
    m, it = x.shape[0], iter(range(1 << 30))

    def pair(ahead: bool, warm: bool) -> None:
        w = ws[0] if warm else ws[next(it) % len(ws)]
        if ahead:
            ex.TUNE["l2_ahead"] = 1
            ex.l2_ahead(w, m, 1)
            ex.TUNE["l2_ahead"] = 0
        spin()
        ex.mx_linear(x, w, out_dtype=cp.float32)

    return {label: graph_time(lambda a=ahead, h=warm: pair(a, h)) * 1e6
            for label, ahead, warm in (("cold", False, False), ("ahead", True, False), ("warm", False, True))
            if warm_ok or not warm}


def main() -> None:
    step = step_products(named_config("qwen3.8-27b"))
    cycles = spin_cycles()

    def spin() -> None:
        _SPIN((1,), (32,), (cp.int64(cycles),))

    base = graph_time(spin)
    print(f"spin alone: {base * 1e6:.2f} us ({cycles} cycles)")
    res: dict[str, Any] = {"spin_us": base * 1e6}
    for name in NAMES:
        (n, k), _ = step[name]
        ws: list[Any] = []
        nbytes = 0
        while not ws or len(ws) * nbytes < CYCLE:
            w = random_packed("mxfp4", (n, k))
            w.persistent = True  # a model weight: its product launches overlapped
            ws.append(w)
            nbytes = w.codes.nbytes + w.scales.nbytes
        for m in ROWS:
            x = ops.to_bf16_bits(cp.random.standard_normal((m, k), cp.float32))
            row = time_pairs(ws, x, spin, nbytes < 30e6)
            prod = {k2: v - base * 1e6 for k2, v in row.items()}
            res[f"{name} M{m}"] = {"pair_us": row, "product_us": prod, "MB": nbytes / 1e6}
            print(f"{name} [{n}x{k}] {nbytes / 1e6:.1f} MB, M={m}: pair us " +
                  ", ".join(f"{k2} {v:.2f}" for k2, v in row.items()) + "; product after the spin " +
                  ", ".join(f"{k2} {v:.2f}" for k2, v in prod.items()) +
                  f"; ahead / cold {prod['ahead'] / prod['cold']:.3f}", flush=True)
        ws = []
        cp.get_default_memory_pool().free_all_blocks()
    out = Path(os.environ.get("OUT", "."))
    (out / "l2_ahead.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
