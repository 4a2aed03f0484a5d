"""Per-block timeline of two consecutive skinny products in a chain of launches: where a product's fixed cost goes.

    PYTHONUNBUFFERED=1 python3 bench/gemv_trace.py [fmt]        # default mxfp4; JSON to $OUT/gemv_trace.json

Builds the products with MX_TRACE (decapybara/kernels/mx_gemv.cu: thread 0 of each block stamps the globaltimer at its
entry, after its wait for the kernel before, after its first x staging, at the end of its last K loop and at
its exit), captures a CUDA graph of one-row products over distinct weight copies (more bytes than the L2
holds) launched as a decode graph launches them (`pdl.launch`), replays it, and reads the stamps of the last
two consecutive launches (A, then B). Prints for each stamp the earliest, median and latest block in us from
A's first entry, and what the bytes of one product take at the probe's read bandwidth. TRACE_DEFINES adds
kernel defines (JSON list of [name, value]), e.g. '[["MX_SYNC", 0]]', TRACE_TUNE TUNE overrides, TRACE_M the rows of x (default 1).
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
from gemv_fixed import weight_chain  # bench/gemv_fixed.py
from gemv_sweep import tuned  # bench/gemv_sweep.py

from decapybara.backend import cupy_ops_extra as ex
from decapybara.backend import pdl
from decapybara.backend.cuda_graph import capture_graph
from decapybara.kernels import load_module

SHAPES = {"gate|up": (34816, 5120), "down": (5120, 17408), "qkv|z": (16384, 5120), "out": (5120, 6144)}
STAMPS = ("entry", "waited", "staged", "loop end", "exit")
EXTRA = tuple(tuple(d) for d in json.loads(os.environ.get("TRACE_DEFINES", "[]")))
TUNE = json.loads(os.environ.get("TRACE_TUNE", "{}"))  # cupy_ops_extra.TUNE overrides, e.g. '{"warps": 4}'
ROWS = int(os.environ.get("TRACE_M", "1"))  # rows of x


def trace_pair(fmt: str, shape: tuple[int, int]) -> tuple[np.ndarray, int]:
    """Stamps [2 launches, blocks, 6] (ns; column 5 the SM id) of two consecutive launches, and their blocks."""
    ws, call = weight_chain(fmt, shape, ROWS, copies=3)
    defines = (("MX_TRACE", 1), *EXTRA)
    with tuned(TUNE, defines):
        w0 = ws[0]
        t = ex.launch_tune(w0, ROWS)  # the build the products launch, whose module holds the stamps
        mod = load_module(t["source"], ex.gemm_defines(t, w0.fmt, w0.e2m1_split, w0.tiled))
        calls = 2 * len(ws)
        # the last launch over copy 0 is calls - len(ws); copy 1's follows it
        keys = np.array([ws[0].codes.data.ptr, ws[1].codes.data.ptr], np.uint64)
        cp.cuda.runtime.memcpy(mod.get_global("mx_trace_key").ptr, keys.ctypes.data, keys.nbytes,
                               cp.cuda.runtime.memcpyHostToDevice)
        stream, pool = cp.cuda.Stream(non_blocking=True), cp.cuda.MemoryPool()
        graph, _ = capture_graph(lambda: [call() for _ in range(calls)], stream, pool)
        tr = mod.get_global("mx_trace")
        host = np.zeros((2, 4096, 6), np.uint64)
        for _ in range(3):  # the last replay's stamps
            cp.cuda.runtime.memsetAsync(tr.ptr, 0, host.nbytes, stream.ptr)
            graph.launch(stream)
            stream.synchronize()
        cp.cuda.runtime.memcpy(host.ctypes.data, tr.ptr, host.nbytes, cp.cuda.runtime.memcpyDeviceToHost)
    blocks = int((host[0, :, 0] > 0).sum())
    return host[:, :blocks].astype(np.int64), w0.nbytes


def main() -> None:
    fmt = sys.argv[1] if len(sys.argv) > 1 else "mxfp4"
    pdl.MODE["pdl"] = os.environ.get("DECAPYBARA_PDL", "1")
    read_bw = ex.bandwidth_probe(1 << 30, repeats=3)["read_GBps"] * 1e9
    res: dict[str, Any] = {"read_GBps": read_bw / 1e9, "defines": EXTRA, "tune": TUNE}
    for name, shape in SHAPES.items():
        st, nbytes = trace_pair(fmt, shape)
        t0 = st[0, :, 0].min()
        print(f"\n{name} {shape}, {fmt}, M {ROWS}, {st.shape[1]} blocks a launch, {nbytes / 1e6:.1f} MB: its bytes take "
              f"{nbytes / read_bw * 1e6:.2f} us at {read_bw / 1e12:.2f} TB/s read; us from A's first entry "
              "(earliest / median / latest block)")
        out: dict[str, Any] = {"blocks": st.shape[1], "bytes": nbytes}
        for li, launch in enumerate("AB"):
            for si, stamp in enumerate(STAMPS):
                v = (st[li, :, si] - t0) / 1e3
                q = (float(v.min()), float(np.median(v)), float(v.max()))
                out[f"{launch} {stamp}"] = q
                print(f"  {launch} {stamp:9s} {q[0]:8.2f} {q[1]:8.2f} {q[2]:8.2f}")
        # where the K loops end late: across SMs (an SM's last block) or within one (its blocks' spread)
        for li, launch in enumerate("AB"):
            ends, sms = st[li, :, 3], st[li, :, 5]
            last = np.array([ends[sms == s].max() for s in np.unique(sms)])
            spread = np.array([np.ptp(ends[sms == s]) for s in np.unique(sms)])
            per_sm = np.bincount(sms.astype(np.int64))
            print(f"  {launch}: {len(last)} SMs, blocks per SM {per_sm[per_sm > 0].min()}-{per_sm.max()}; SMs' last "
                  f"loop end (us from the first) p10 / p50 / p90 / max {np.percentile((last - last.min()) / 1e3, [10, 50, 90, 100]).round(2).tolist()}; "
                  f"spread within an SM p50 / max {np.percentile(spread / 1e3, [50, 100]).round(2).tolist()}")
            slow = np.unique(sms)[np.argsort(last)[-8:]]
            print(f"    slowest SMs {slow.tolist()}; fastest {np.unique(sms)[np.argsort(last)[:8]].tolist()}")
        out["raw"] = st.tolist()
        a_exit, b_wait = st[0, :, 4].max(), st[1, :, 1].min()
        print(f"  A: last exit - first entry {(a_exit - t0) / 1e3:.2f} us; B waited {(b_wait - a_exit) / 1e3:.2f} us "
              f"after A's last exit; B's K loops ended {(st[1, :, 3].max() - b_wait) / 1e3:.2f} us after its wait")
        res[name] = out
    (Path(os.environ.get("OUT", ".")) / "gemv_trace.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
