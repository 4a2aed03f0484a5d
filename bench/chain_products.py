"""Persistent product chains (decapybara/backend/product_chain.py) against the same products launched, at the 27B's
one-row shapes.

    PYTHONUNBUFFERED=1 python3 bench/chain_products.py [fmt]     # default mxfp4; JSON to $OUT/chain_products.json

A decode layer's run of products between two token mixers: out (the residual and the next norm fused), gate|up
(SwiGLU over that norm), down (residual, norm), the next layer's input product (qkv|z over that norm): 203 MB of
MXFP4 at the 27B's shapes. Four sets of weights (distinct: ~0.8 GB, so every product reads its weights from DRAM)
take turns over CHAIN_RUNS runs (default 16) a CUDA graph (CHAIN_SHAPES: other shapes). Variants, their graphs' replays interleaved over
CHAIN_ROUNDS rounds (default 7):
- `launched`: the products as a decode graph launches them (PDL), under the shipped tuning (each product's build);
- `launched, one build`: the same, every product on the one-row build (TUNE `row1_fill` 0), as the chain runs them;
- `chain PF n`: each run one persistent launch (`ProductChain`) of those products, on every resident block, its
  blocks asking the L2 for n chunks of the next product's weights before each wait (CHAIN_PF, default "0,4,8").
The chain's outputs are checked against the launches' (one build) byte for byte, eager before the timing and from its
graph after it. Prints us a run, the ratio
to `launched`, and the share of the copy bandwidth that the run's bytes at that time are.
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
from gemv_sweep import tuned  # bench/gemv_sweep.py
from gpu import bench_roofline, interleaved_times, random_packed  # bench/gpu.py

from decapybara.backend import cupy_ops_extra as ex
from decapybara.backend import pdl
from decapybara.backend.cuda_graph import capture_graph
from decapybara.backend.product_chain import ProductChain

# the 27B: hidden, MLP width, a DeltaNet layer's qkv|z rows, out's K (CHAIN_SHAPES="H,I,QZ,O": others, e.g. small
# ones for a dry run on the host emulator)
H, I, QZ, O = (int(v) for v in os.environ.get("CHAIN_SHAPES", "5120,17408,16384,6144").split(","))
ONE_BUILD = {"row1_fill": 0}


def layer(ws: dict, x: Any, res: Any, g1: Any, g2: Any) -> list:
    """The run of products between two token mixers, as a decode step launches them: its outputs."""
    normed, h = ex.mx_linear_add_norm(x, ws["out"], None, res, g1, 1e-6, 1.0)
    a = ex.mx_swiglu(normed, ws["gate_up"], out_dtype=np.uint16)
    normed2, h2 = ex.mx_linear_add_norm(a, ws["down"], None, h, g2, 1e-6, 1.0)
    q = ex.mx_linear(normed2, ws["qkv"])
    return [h, normed.xg, normed.sq, a, h2, normed2.xg, normed2.sq, q]


def main() -> int:
    fmt = sys.argv[1] if len(sys.argv) > 1 else "mxfp4"
    runs, rounds = int(os.environ.get("CHAIN_RUNS", "16")), int(os.environ.get("CHAIN_ROUNDS", "7"))
    pdl.MODE["pdl"] = os.environ.get("DECAPYBARA_PDL", "1")
    copy_bw = bench_roofline() * 1e9
    shapes = {"out": (H, O), "gate_up": (2 * I, H), "down": (H, I), "qkv": (QZ, H)}
    sets = []
    for _ in range(4):
        ws = {k: random_packed(fmt, s) for k, s in shapes.items()}
        for w in ws.values():
            w.persistent = True  # model weights: overlapped launches, as in a decode graph
        sets.append(ws)
    run_bytes = sum(w.nbytes for w in sets[0].values())
    rng = np.random.default_rng(0)
    x, res = (cp.asarray(rng.standard_normal((1, n)).astype(np.float32)) for n in (O, H))
    g1, g2 = (cp.asarray(rng.standard_normal(H).astype(np.float32) * 0.1) for _ in range(2))
    args = (x, res, g1, g2)

    with tuned(ONE_BUILD, ex.TUNE_DEFINES):  # the chain's products, recorded; one run checked against launches
        ref = [cp.asnumpy(o) for o in layer(sets[0], *args)]
        recorded, outs = [], []
        for r in range(runs):
            with pdl.recording() as launches:
                outs.append(layer(sets[r % 4], *args))
            recorded.append(launches)
    pfs = [int(v) for v in os.environ.get("CHAIN_PF", "0,4,8").split(",")]
    chain_sets = {pf: [ProductChain(launches, prefetch=pf) for launches in recorded] for pf in pfs}
    chains = chain_sets[pfs[0]]
    chains[0]()
    bad = [i for i, (o, r) in enumerate(zip(outs[0], ref, strict=True))
           if not np.array_equal(cp.asnumpy(o).view(np.uint8), r.view(np.uint8))]
    print(f"{fmt}: runs of {run_bytes / 1e6:.1f} MB (at copy bandwidth {run_bytes / copy_bw * 1e6:.1f} us); chain of "
          f"{chains[0].n} products on {chains[0].blocks} blocks ({chains[0].resident()} an SM); outputs "
          f"{'equal to the launches' if not bad else f'DIFFERENT at {bad}'}; timed out: {chains[0].timed_out()}")

    stream, pool = cp.cuda.Stream(non_blocking=True), cp.cuda.MemoryPool()
    graphs = {"launched": capture_graph(lambda: [layer(sets[r % 4], *args) for r in range(runs)], stream, pool)[0]}
    with tuned(ONE_BUILD, ex.TUNE_DEFINES):
        graphs["launched, one build"] = capture_graph(lambda: [layer(sets[r % 4], *args) for r in range(runs)],
                                                      stream, pool)[0]
    for pf, cs in chain_sets.items():
        graphs[f"chain PF {pf}"] = capture_graph(lambda cs=cs: [c() for c in cs], stream, pool)[0]
    times = interleaved_times(graphs, stream, rounds, per=runs)
    med = {n: float(np.median(ts)) for n, ts in times.items()}
    bad_graph = []
    for pf in pfs:  # each chain graph's outputs, checked like the eager chain's
        for o in outs[0]:
            o[...] = 0
        cp.cuda.runtime.deviceSynchronize()  # the zeros (current stream) before the replay (a stream of its own)
        graphs[f"chain PF {pf}"].launch(stream)
        stream.synchronize()
        bad_graph += [(pf, i) for i, (o, r) in enumerate(zip(outs[0], ref, strict=True))
                      if not np.array_equal(cp.asnumpy(o).view(np.uint8), r.view(np.uint8))]
    print(f"\n{'variant':<22}{'us a run':>10}{'x launched':>12}{'% copy':>8}  (medians of {rounds}, {runs} runs a graph)")
    for name, t in med.items():
        print(f"{name:<22}{t * 1e6:10.2f}{t / med['launched']:12.3f}{100 * run_bytes / copy_bw / t:8.1f}")
    print(f"chain graph outputs {'equal to the launches' if not bad_graph else f'DIFFERENT at {bad_graph}'}; "
          f"timed out: {any(c.timed_out() for cs in chain_sets.values() for c in cs)}")
    res_json = {"fmt": fmt, "run_bytes": run_bytes, "copy_Bps": copy_bw, "blocks": chains[0].blocks,
                "equal": not bad and not bad_graph, "s_per_run": med, "rounds_s": times}
    Path(os.environ.get("OUT", ".")).joinpath("chain_products.json").write_text(json.dumps(res_json, indent=1))
    return 0 if not bad and not bad_graph else 1


if __name__ == "__main__":
    sys.exit(main())
