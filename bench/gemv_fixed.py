"""What one skinny product costs per launch and per byte, in a chain of launches as in a decode step.

    PYTHONUNBUFFERED=1 python3 bench/gemv_fixed.py [fmt]        # default mxfp4; JSON to $OUT/gemv_fixed.json

For two families of one-row products (the 27B's gate|up: K = 5120, N scaled; its down: N = 5120, K scaled)
and each size, captures a CUDA graph of products over distinct weight copies (more bytes than the L2 holds, so
every product reads its weights from DRAM, as in a step), launched as a decode graph launches them (model
weights: overlapped, `pdl.launch`), and times its replays. A least-squares line over the sizes,

    time per product = fixed + bytes / rate,

splits each variant's cost into a fixed part per launch (ramp-up, tail, reductions, the launch itself) and a
streaming rate. Reference: `probe_read` (decapybara/kernels/probe.cu, a grid-stride read) over the same bytes.
FIXED_TUNES names `cupy_ops_extra.TUNE` overrides to compare (default: the default alone);
FIXED_M sets the rows of x (default 1); FIXED_DEFINES names kernel define sets built over the default tuning; FIXED_DIAG=1 adds the default's build without the code decoding (MX_DIAG: wrong results, timing only).
Prints, per family and variant, us per product at each size, fixed us, rate TB/s and % of the copy bandwidth.
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
from gemv_sweep import L2_CYCLE, precompile, tuned  # bench/gemv_sweep.py
from gpu import bench_roofline, graph_time, random_packed  # bench/gpu.py

from decapybara.backend import cupy_ops_extra as ex
from decapybara.backend import pdl
from decapybara.kernels import get_kernel

FAMILIES: dict[str, list[tuple[int, int]]] = {  # [N, K] of each size
    "gate|up (K 5120)": [(n, 5120) for n in (4352, 8704, 17408, 34816, 69632)],
    "down (N 5120)": [(5120, k) for k in (4352, 8704, 17408, 34816)],
}
TUNES: dict[str, dict] = json.loads(os.environ.get("FIXED_TUNES", '{"default": {}}'))
DIAG = os.environ.get("FIXED_DIAG", "0") == "1"
ROWS = int(os.environ.get("FIXED_M", "1"))  # rows of x (decode: sequences in the batch)
# named kernel define sets, each a variant of the default tuning, e.g. '{"sync 0": [["MX_SYNC", 0]]}'
DEFINES: dict[str, list] = json.loads(os.environ.get("FIXED_DEFINES", "{}"))


def fit(sizes: list[int], times: list[float]) -> tuple[float, float]:
    """(fixed seconds, bytes per second) of the least-squares line time = fixed + bytes / rate."""
    slope, fixed = np.polyfit(np.asarray(sizes, float), np.asarray(times, float), 1)
    return float(fixed), float(1.0 / slope)


def weight_chain(fmt: str, shape: tuple[int, int], rows: int, copies: int = 2) -> tuple[list, Any]:
    """(weights, call): at least `copies` random weight copies of `shape`, enough that they do not stay in the L2
    together, marked as model weights (a decode graph's products launch overlapped), and a call that runs the
    next product over them on `rows` random rows of x."""
    ws = [random_packed(fmt, shape)]
    ws += [random_packed(fmt, shape) for _ in range(max(copies, -(-int(L2_CYCLE) // ws[0].nbytes)) - 1)]
    for w in ws:
        w.persistent = True
    x = cp.random.standard_normal((rows, shape[1]), cp.float32)
    state = {"i": 0}

    def call() -> None:
        ex.mx_linear(x, ws[state["i"] % len(ws)])
        state["i"] += 1

    return ws, call


def product_times(fmt: str, shapes: list[tuple[int, int]]) -> tuple[list[int], list[float]]:
    """Bytes and seconds per product of each shape under the current tuning, as a chain of overlapped launches."""
    sizes, times = [], []
    for shape in shapes:
        ws, call = weight_chain(fmt, shape, ROWS)
        times.append(graph_time(call, calls=max(16, 2 * len(ws)), reps=5))
        sizes.append(ws[0].nbytes)
        del ws, call
        cp.get_default_memory_pool().free_all_blocks()
    return sizes, times


def probe_times(sizes: list[int]) -> list[float]:
    """Seconds per `probe_read` of each byte count (plain launches over buffers cycled past the L2)."""
    fn, sink, blocks = get_kernel("probe", "probe_read"), cp.zeros(1, cp.uint32), ex.sm_count() * 8
    out = []
    for nbytes in sizes:
        n16 = nbytes // 16
        bufs = [cp.ones(n16 * 16, cp.uint8) for _ in range(max(2, -(-int(L2_CYCLE) // nbytes)))]
        state = {"i": 0}

        def call(bufs=bufs, n16=n16, state=state) -> None:
            fn((blocks,), (256,), (bufs[state["i"] % len(bufs)], ex.U64(n16), sink))
            state["i"] += 1

        out.append(graph_time(call, calls=max(16, 2 * len(bufs)), reps=5))
        del bufs
        cp.get_default_memory_pool().free_all_blocks()
    return out


def main() -> None:
    fmt = sys.argv[1] if len(sys.argv) > 1 else "mxfp4"
    pdl.MODE["pdl"] = os.environ.get("DECAPYBARA_PDL", "1")
    copy_bw = bench_roofline() * 1e9
    variants: list[tuple[str, dict, tuple]] = [(name, t, ()) for name, t in TUNES.items()]
    variants += [(name, {}, tuple(tuple(d) for d in defs)) for name, defs in DEFINES.items()]
    if DIAG:
        variants.append(("diag (wrong results)", {}, (("MX_DIAG", 1),)))
    precompile(variants, [fmt])
    res: dict[str, Any] = {"copy_GBps": copy_bw / 1e9}
    for fam, shapes in FAMILIES.items():
        print(f"\n{fam}, {fmt}, {ROWS} row(s): us per product at each size (MB of weights), fixed us + rate")
        rows: dict[str, Any] = {}
        sizes: list[int] = []
        for name, tune, defines in variants:
            with tuned(tune, defines):
                sizes, times = product_times(fmt, shapes)
            rows[name] = times
        rows["probe_read"] = probe_times(sizes)
        print(f"{'variant':24s}" + "".join(f"{s / 1e6:>9.1f}" for s in sizes) + f"{'fixed us':>10s}{'TB/s':>7s}{'%copy':>7s}")
        for name, times in rows.items():
            fixed, rate = fit(sizes, times)
            res[f"{fam} {name}"] = {"sizes": sizes, "us": [t * 1e6 for t in times], "fixed_us": fixed * 1e6,
                                    "rate_TBps": rate / 1e12}
            print(f"{name:24s}" + "".join(f"{t * 1e6:9.2f}" for t in times)
                  + f"{fixed * 1e6:10.2f}{rate / 1e12:7.2f}{100 * rate / copy_bw:7.1f}")
    out_dir = Path(os.environ.get("OUT", "."))
    (out_dir / "gemv_fixed.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
