"""One-row MXFP4 products with their weights streamed by large bulk copies (decapybara/kernels/mx_ring.cu) against
the `_1r` kernels (mx_gemv.cu, the default tuning), on the 27B's large products.

    PYTHONUNBUFFERED=1 python3 bench/ring_probe.py          # JSON to $OUT/ring_probe.json

For each product, weight copies cycled past the L2 (as bench/gemv_sweep.py), one row of x in bf16 bits, products
chained in a CUDA graph with overlapped launches (as a decode graph), replays timed with events. RING_CONFIGS names
define sets of mx_ring.cu (RG_WARPS, RG_SLOTS, RG_G, RG_DIAG); RING_SHAPES "N:K:kparts,...". Checks each ring
build's products against the default kernel's (largest difference over the largest output) before timing.
Prints us per product, % of the copy bandwidth and the ratio to the default, and the step-weighted sum.
"""

from __future__ import annotations

import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import cupy as cp
import numpy as np
from gemv_fixed import probe_times  # bench/gemv_fixed.py
from gemv_sweep import L2_CYCLE  # bench/gemv_sweep.py
from gpu import graph_time, random_packed  # bench/gpu.py

from decapybara.backend import cupy_ops as ops
from decapybara.backend import cupy_ops_extra as ex
from decapybara.backend import pdl
from decapybara.kernels import get_kernel

# (name, N, K, kparts, launches a step)
SHAPES = [("gate|up", 34816, 5120, 1, 64), ("down", 5120, 17408, 4, 64), ("qkv|z", 16384, 5120, 1, 48),
          ("out", 5120, 6144, 2, 64)]
if os.environ.get("RING_SHAPES"):
    SHAPES = [(f"{n}x{k}", int(n), int(k), int(p), 1)
              for n, k, p in (s.split(":") for s in os.environ["RING_SHAPES"].split(","))]
CONFIGS: dict[str, dict] = json.loads(os.environ.get("RING_CONFIGS", json.dumps({
    "w8 s3 g2": {"RG_WARPS": 8, "RG_SLOTS": 3, "RG_G": 2},
    "w8 s4 g2": {"RG_WARPS": 8, "RG_SLOTS": 4, "RG_G": 2},
    "w12 s3 g2": {"RG_WARPS": 12, "RG_SLOTS": 3, "RG_G": 2},
    "w6 s3 g4": {"RG_WARPS": 6, "RG_SLOTS": 3, "RG_G": 4},
    "w8 s3 g2 diag": {"RG_WARPS": 8, "RG_SLOTS": 3, "RG_G": 2, "RG_DIAG": 1},
})))
DEFINES = (("MX_ONLY", 3), ("MX_E2M1", 1), ("MX_TILED", 1))


def smem_bytes(d: dict, k: int) -> int:
    w, s, g = d["RG_WARPS"], d["RG_SLOTS"], d["RG_G"]
    return w * s * (g * (2048 + 128) + 16 + 8) + (k + 128) * 2


def ring_kernel(d: dict):
    defines = DEFINES + tuple(sorted(d.items()))
    return get_kernel("mx_ring", "mx_ring_mxfp4_1r", defines)


def main() -> None:
    n_sm = cp.cuda.Device().attributes["MultiProcessorCount"]
    out: dict = {"configs": CONFIGS, "shapes": SHAPES, "rows": []}
    with ThreadPoolExecutor(max_workers=8) as pool:  # nvcc builds side by side
        kernels = dict(zip(CONFIGS, pool.map(ring_kernel, CONFIGS.values())))
    for name, n, k, kparts, count in SHAPES:
        w0 = random_packed("mxfp4", (n, k))
        assert w0.tiled and w0.e2m1_split, "the ring kernel reads split-field codes in band tiles"
        ws = [w0] + [random_packed("mxfp4", (n, k)) for _ in range(max(1, -(-int(L2_CYCLE) // w0.nbytes)) - 1)]
        for w in ws:
            w.persistent = True
        xf = cp.random.standard_normal((1, k), cp.float32)
        xb = ops.to_bf16_bits(xf)
        ref = ex.mx_linear(xf, ws[0]).astype(cp.float32).ravel()
        ctrs = [cp.zeros(2 + n // 16, cp.int32) for _ in ws]
        part = cp.zeros((kparts, n), cp.float32)
        y = cp.zeros(n, cp.float32)
        st = {"i": 0}

        def base(ws=ws, st=st, xb=xb) -> None:
            ex.mx_linear(xb, ws[st["i"] % len(ws)])
            st["i"] += 1

        t_base = graph_time(base, calls=max(16, 2 * len(ws)), reps=5)
        t_read = probe_times([w0.nbytes])[0]
        row = {"product": name, "N": n, "K": k, "bytes": w0.nbytes, "default_us": t_base * 1e6,
               "read_us": t_read * 1e6, "ring": {}}
        print(f"{name} [{n}, {k}] {w0.nbytes / 1e6:.1f} MB: default {t_base * 1e6:.2f} us, "
              f"probe_read {t_read * 1e6:.2f} us", flush=True)
        for cname, d in CONFIGS.items():
            kern = kernels[cname]
            smem = smem_bytes(d, k)
            if smem > cp.cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"]:
                print(f"  {cname:16s} (needs {smem} bytes of shared memory)")
                row["ring"][cname] = {"us": float("nan"), "err": float("nan")}
                continue
            kern.max_dynamic_shared_size_bytes = smem
            wi = {"i": 0}

            def ring(kern=kern, smem=smem, d=d, wi=wi, ws=ws, xb=xb, y=y, part=part, ctrs=ctrs, n=n, k=k,
                     kparts=kparts) -> None:
                j = wi["i"] % len(ws)
                w = ws[j]
                pdl.launch(kern, (n_sm,), (32 * d["RG_WARPS"],),
                           (w.codes, w.scales, xb, y, part, ctrs[j], np.int32(n), np.int32(k), np.int32(kparts)),
                           shared_mem=smem)
                wi["i"] += 1

            wi["i"] = 0
            y.fill(cp.nan)
            ring()
            cp.cuda.Device().synchronize()
            err = float(cp.max(cp.abs(y - ref)) / cp.max(cp.abs(ref)))
            t = graph_time(ring, calls=max(16, 2 * len(ws)), reps=5)
            row["ring"][cname] = {"us": t * 1e6, "err": err}
            print(f"  {cname:16s} {t * 1e6:8.2f} us  x{t_base / t:5.3f}  err {err:.2e}  "
                  f"{w0.nbytes / t / 1e12:.2f} TB/s", flush=True)
        out["rows"].append(row)
    print("\nstep-weighted (us x launches a step, ms):")
    base_ms = sum(r["default_us"] * s[4] for r, s in zip(out["rows"], SHAPES)) / 1e3
    read_ms = sum(r["read_us"] * s[4] for r, s in zip(out["rows"], SHAPES)) / 1e3
    print(f"  default {base_ms:.3f}   probe_read over the same bytes {read_ms:.3f}")
    for cname in CONFIGS:
        ms = sum(r["ring"][cname]["us"] * s[4] for r, s in zip(out["rows"], SHAPES)) / 1e3
        print(f"  {cname:16s} {ms:.3f}  x{base_ms / ms:.3f}")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "ring_probe.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
