"""Small bf16 products (an MoE router stacked with its shared expert's gate, the DeltaNet b|a) on
decapybara/kernels/gemv_small.cu against the skinny GEMM, as a decode graph sees them.

    PYTHONUNBUFFERED=1 python3 bench/small_product.py

Each timed call is [the hidden-size RMSNorm of one residual row set (the product's producer, bf16 out), the
product over one of 48 copies of the weight (more bytes than L2 holds, so each product streams from HBM)],
captured 48 times in one CUDA graph with the products' overlapped launches (bench/gpu.py's graph_time); the norm
alone is timed the same way and subtracted. Variants: `skinny` (TUNE small_n 0: mx_gemv.cu's tiles and K
splits) and gemv_small builds `small W/P` (TUNE small_warps W, small_pre P). Prints microseconds per product and
each variant's ratio to the skinny GEMM; every variant's output is checked against the skinny GEMM's (float32,
max relative error).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cupy as cp
import gpu as B
import numpy as np

from decapybara.backend import cupy_ops as ops
from decapybara.backend import cupy_ops_extra as ex

COPIES = 48
SHAPES = [("35B router|gate", 257, 2048), ("35B b|a", 64, 2048), ("27B b|a", 96, 5120)]
ROWS = [1, 4, 12]
VARIANTS = [("skinny", None), ("small 8/8", (8, 8)), ("small 16/4", (16, 4)), ("small 4/8", (4, 8)),
            ("small 8/4", (8, 4))]


def set_variant(v: tuple[int, int] | None) -> None:
    if v is None:
        ex.TUNE["small_n"] = 0
    else:
        ex.TUNE["small_n"] = 4096
        ex.TUNE["small_warps"], ex.TUNE["small_pre"] = v


def main() -> None:
    rng = np.random.default_rng(0)
    table = []
    for name, n, k in SHAPES:
        ws = [ex.PackedWeight("bf16", (n, k), cp.asarray(rng.integers(0x3C00, 0x3E00, (n, k)).astype(np.uint16)
                                                         | (rng.integers(0, 2, (n, k)).astype(np.uint16) << 15)),
                              persistent=True) for _ in range(COPIES)]
        nw = cp.asarray(rng.standard_normal(k).astype(np.float32))
        for m in ROWS:
            h = cp.asarray(rng.standard_normal((m, k)).astype(np.float32))
            it = iter(range(1 << 30))

            def norm_only(h=h, nw=nw) -> None:
                ops.rms_norm(h, nw, 1e-6, 1.0, out_dtype=cp.uint16)

            def pair(h=h, nw=nw, ws=ws, it=it) -> None:
                x = ops.rms_norm(h, nw, 1e-6, 1.0, out_dtype=cp.uint16)
                ex.mx_linear(x, ws[next(it) % COPIES], out_dtype=cp.float32)

            base = B.graph_time(norm_only, calls=COPIES)
            x = ops.rms_norm(h, nw, 1e-6, 1.0, out_dtype=cp.uint16)
            ref = None
            row = [f"{name} {n}x{k}", m]
            for label, v in VARIANTS:
                set_variant(v)
                y = cp.asnumpy(ex.mx_linear(x, ws[0], out_dtype=cp.float32)).astype(np.float64)
                if ref is None:
                    ref = y
                err = float(np.abs(y - ref).max() / max(np.abs(ref).max(), 1e-30))
                t = B.graph_time(pair, calls=COPIES) - base
                row.append((label, t, err))
            table.append(row)
            set_variant(None)
    print(f"\n{'product':<26}{'M':>4}" + "".join(f"{label:>22}" for label, _ in VARIANTS))
    for row in table:
        sk = row[2][1]
        cells = "".join(f"{t * 1e6:>9.2f} us {sk / t:>5.2f}x{'' if e < 1e-5 else ' ERR':>4}" for _, t, e in row[2:])
        print(f"{row[0]:<26}{row[1]:>4}{cells}")
    print("us per product (its norm's time subtracted), ratio: skinny / variant (above 1: faster than the skinny GEMM)")


if __name__ == "__main__":
    main()
