"""Where products should leave the skinny kernels for cuBLAS (`cupy_ops_extra.DENSE_ROWS`), with and without kept
bf16 weights (`prefill_weights=bf16`), on the products of one 27B forward, in one device call.

    PYTHONUNBUFFERED=1 python3 bench/dense_rows.py [fmt]        # default: mxfp4; JSON to $OUT/dense_rows.json
    DENSE_M=8,16,32,64,128 python3 bench/dense_rows.py nvfp4

For each row count M (DENSE_M) and each distinct product of a qwen3.8-27b forward (bench/gemv_sweep.py's STEP,
lm_head left out: a prompt chunk runs it on its last row only) it times, with CUDA events after warm-up (the
GPU's work alone: enqueued behind a spin kernel), the median of DENSE_REPS (5) spans of back-to-back calls that
cycle through enough weight copies that the next one is not in the 50 MB L2:
- skinny: `mx_linear` on the packed weight (the kernels of decapybara/kernels/mx_gemv.cu; M <= 64 only, their bound);
- deq+gemm: the weight dequantised to bf16, then cuBLAS (what `mx_linear` does past DENSE_ROWS rows);
- kept: cuBLAS on the weight's kept bf16 values (`attach_dense`: what it does past DENSE_ROWS rows with them).
Every path's product is checked against the skinny one's (or, past 64 rows, deq+gemm's). The table gives the
forward-weighted ms (each product times its count in a forward) and the ratios against skinny: the row count
where a ratio crosses 1 is where DENSE_ROWS (and a threshold for kept weights) belongs.
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
import numpy as np
from gemv_sweep import STEP  # [N, K] and count of each product of a forward
from gpu import random_packed  # bench/gpu.py
from host_step import _spin  # bench/host_step.py

from decapybara.backend import cupy_ops as ops
from decapybara.backend import cupy_ops_extra as ex

MS = [int(s) for s in os.environ.get("DENSE_M", "8,12,16,24,32,40,48,64,96,128,256").split(",") if s]
REPS = int(os.environ.get("DENSE_REPS", "5"))
L2_CYCLE = 160e6  # bytes of distinct weights the calls cycle through
SKINNY_MAX = 64  # the skinny kernels' bound (their row tiles)


def event_time(fns: list[Any], reps: int = REPS) -> float:
    """Median device seconds of one call: each rep times one pass over `fns` (distinct weights) with events,
    enqueued behind a spin kernel that holds the stream until the host is done (the GPU's work alone: one
    call's Python takes longer than a small product's kernels)."""
    for f in fns:
        f()
    ts = []
    for _ in range(reps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        cp.cuda.Device().synchronize()
        _spin(2.0 + 0.5 * len(fns))
        a.record()
        for f in fns:
            f()
        b.record()
        b.synchronize()
        ts.append(cp.cuda.get_elapsed_time(a, b) / 1e3 / len(fns))
    return float(np.median(ts))


def skinny(x: Any, w: ex.PackedWeight) -> Any:
    """The skinny kernels' product whatever DENSE_ROWS and KEPT_ROWS say (M <= 64; the weights here keep bf16
    values, which past KEPT_ROWS would go to cuBLAS)."""
    old = ex.DENSE_ROWS, ex.KEPT_ROWS
    ex.DENSE_ROWS = ex.KEPT_ROWS = SKINNY_MAX
    try:
        return ex.mx_linear(x, w, out_dtype=np.float32)
    finally:
        ex.DENSE_ROWS, ex.KEPT_ROWS = old


def deq_gemm(x: Any, w: ex.PackedWeight) -> Any:
    scaled = w.fmt in ex.BF16_EXACT_SCALED
    wb = ex.mx_dequant(ex._unscaled(w) if scaled else w, out_dtype=cp.uint16)
    return ops.gemm_bf16(x, wb, alpha=w.tensor_scale if scaled else 1.0)


def kept(x: Any, w: ex.PackedWeight) -> Any:
    return ops.gemm_bf16(x, ex.dense_of(w), alpha=w.tensor_scale if w.fmt in ex.BF16_EXACT_SCALED else 1.0)


def main() -> None:
    fmt = sys.argv[1] if len(sys.argv) > 1 else "mxfp4"
    out_dir = Path(os.environ.get("OUT", "."))
    cp.random.seed(0)
    rows: dict[int, dict[str, float]] = {m: {"skinny": 0.0, "deq+gemm": 0.0, "kept": 0.0} for m in MS}
    per: dict[str, Any] = {}
    worst = 0.0
    for name, ((n, k), count) in STEP.items():
        if name == "lm_head":
            continue
        one = random_packed(fmt, (n, k))
        copies = max(1, min(8, int(np.ceil(L2_CYCLE / (n * k * 2)))))  # by the bf16 copy's bytes, the largest read
        ws = [one] + [random_packed(fmt, (n, k)) for _ in range(copies - 1)]
        for w in ws:
            w.persistent = True
            assert ex.attach_dense(w)
        per[name] = {}
        for m in MS:
            x = ops.to_bf16_bits(cp.random.standard_normal((m, k)).astype(cp.float32))
            ref = skinny(x, one) if m <= SKINNY_MAX else deq_gemm(x, one)
            scale = float(cp.abs(ref).max()) or 1.0
            times = {}
            for path, fn in (("skinny", skinny), ("deq+gemm", deq_gemm), ("kept", kept)):
                if path == "skinny" and m > SKINNY_MAX:
                    continue
                err = float(cp.abs(fn(x, one) - ref).max()) / scale
                worst = max(worst, err)
                assert err < 1e-3, f"{name} M={m} {path}: max error {err:.2e} of the largest output"
                times[path] = event_time([lambda w=w, fn=fn, x=x: fn(x, w) for w in ws])
                rows[m][path] += times[path] * count
            per[name][m] = {p: round(t * 1e6, 1) for p, t in times.items()}
            print(f"{name:8} M={m:4} " + "  ".join(f"{p} {t * 1e6:8.1f} us" for p, t in times.items()), flush=True)
        del ws, one
        cp.get_default_memory_pool().free_all_blocks()
    print(f"\n{fmt}: a forward's products (lm_head out), ms, and ratios against skinny; worst error {worst:.1e}")
    print("| M | skinny | deq+gemm | kept | deq+gemm / skinny | kept / skinny |")
    print("|---|---|---|---|---|---|")
    for m in MS:
        r = rows[m]
        s = r["skinny"] if m <= SKINNY_MAX else float("nan")
        print(f"| {m} | {s * 1e3:.2f} | {r['deq+gemm'] * 1e3:.2f} | {r['kept'] * 1e3:.2f} | "
              f"{r['deq+gemm'] / s:.2f} | {r['kept'] / s:.2f} |")
    (out_dir / "dense_rows.json").write_text(json.dumps({"fmt": fmt, "forward_s": rows, "per_product_us": per},
                                                        indent=1))


if __name__ == "__main__":
    main()
