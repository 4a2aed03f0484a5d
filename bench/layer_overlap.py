"""How much of a DeltaNet layer's decode could run under the products on either side of it?

    python3 bench/layer_overlap.py     # table: batch, variant, us a layer, ratio to the chain

A 27B DeltaNet layer's decode reads the qkv|z product's output and the output product reads the decode's, so in a
decode step the three run one after the other (with overlapped launches), each latency-bound and far from the
copy bandwidth alone: qkv|z 44.6 MB of MXFP4 codes, the decode 3.1 MB of float32 state a sequence read and written,
"out" 16.7 MB. Timed per layer, in a CUDA graph over LO_LAYERS layers (default 16; weights and states cycled past
the L2), launched as a decode graph launches them:

- `chain`: qkv|z, then the decode (`deltanet_core` with its gated norm, in bf16 bits as the step writes it for
  the product after) over its output, then "out" over the decode's output: the step's order;
- `apart`: the same three launches with no data between them (the decode and "out" read fixed inputs), each on a
  stream of its own forked at the layer's start and joined at its end: the most that dependencies finer than a
  launch (a head's decode once its columns are written, a K range of "out" once its heads are decoded) could give;
- `in-edge`: qkv|z beside the decode, then "out"; `out-edge`: qkv|z, then the decode beside "out";
- `products`: qkv|z then "out", no decode; `decode`: the decode alone.

LO_BATCHES the sequence counts (default 1,12), LO_ROUNDS rounds (interleaved), LO_ITERS replays (median). Random
codes (bench/gpu.py `random_packed`) and random state: only the timing means something.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import cupy as cp
import numpy as np
from gdn_decode import decode_setup, random_pool  # bench/gdn_decode.py
from gpu import graph_seconds, random_packed  # bench/gpu.py

from decapybara.backend import cupy_deltanet as cd
from decapybara.backend import pdl
from decapybara.backend.base import DeltaNetSegment
from decapybara.backend.cuda_factory import cuda_backend

BATCHES = [int(b) for b in os.environ.get("LO_BATCHES", "1,12").split(",")]
ITERS = int(os.environ.get("LO_ITERS", "10"))
ROUNDS = int(os.environ.get("LO_ROUNDS", "2"))
LAYERS = int(os.environ.get("LO_LAYERS", "16"))
VARIANTS = os.environ.get("LO_VARIANTS", "chain,apart,in-edge,out-edge,products,decode").split(",")
HIDDEN = 5120
SIDES = (cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True))


@contextlib.contextmanager
def beside(i: int) -> Any:
    """Launches inside run on side stream i, forked from the current stream here and joined to it at the end."""
    main, side = cp.cuda.get_current_stream(), SIDES[i]
    side.wait_event(main.record())
    try:
        with side, pdl.serial():
            yield
    finally:
        main.wait_event(side.record())


def layer_fn(variant: str, layer: int, be: Any, pool: Any, plan: Any, xp: Any, w: dict, fixed: dict, params: Any,
             norm_w: Any, cfg: Any) -> None:
    """One layer's launches of `variant` on the current stream (and the side streams)."""
    c, hv = cfg.linear_conv_dim, cfg.linear_num_value_heads
    n = xp.shape[0]

    def qkvz() -> Any:
        return be.linear(xp, w["qkvz"][layer])

    def decode(y: Any) -> Any:
        return cd.deltanet_core(pool, layer, y[:, :c], fixed["a"], fixed["b"], params, plan, cfg, {}, acc="float",
                                gate=(y[:, c:].reshape(n, hv, -1), norm_w, 1e-6), out_dtype=cp.uint16)

    def out(o: Any) -> Any:
        return be.linear(o.reshape(n, -1), w["out"][layer])

    if variant == "chain":
        out(decode(qkvz()))
    elif variant == "apart":
        with beside(0):
            decode(fixed["qkvz"])
        with beside(1):
            out(fixed["core"])
        qkvz()
    elif variant == "in-edge":
        with beside(0):
            decode(fixed["qkvz"])
        qkvz()
        out(fixed["core"])
    elif variant == "out-edge":
        qkvz()
        with beside(0):
            out(fixed["core"])
        decode(fixed["qkvz"])
    elif variant == "products":
        qkvz()
        out(fixed["core"])
    elif variant == "decode":
        decode(fixed["qkvz"])
    else:
        raise ValueError(variant)


def time_variant(variant: str, **kw: Any) -> float:
    """Seconds a layer: a fresh graph of LAYERS layers of `variant`, median of ITERS replays (after 3)."""
    return graph_seconds(lambda: [layer_fn(variant, i, **kw) for i in range(LAYERS)], LAYERS, ITERS + 3, 3)


def main() -> None:
    be = cuda_backend("bf16")
    rng = np.random.default_rng(0)
    cfg, params, norm_w = decode_setup(rng, LAYERS)
    c, hv, dv = cfg.linear_conv_dim, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    w = {"qkvz": [random_packed("mxfp4", (c + hv * dv, HIDDEN)) for _ in range(LAYERS)],
         "out": [random_packed("mxfp4", (HIDDEN, hv * dv)) for _ in range(LAYERS)]}
    print(f"{LAYERS} layers; qkv|z ({c + hv * dv}, {HIDDEN}) and out ({HIDDEN}, {hv * dv}) MXFP4, bf16 x")
    print(f"{'batch':>5} {'variant':>14} {'us/layer':>9} {'ratio':>6}")
    for n in BATCHES:
        pool = random_pool(be, cfg, n, rng)
        plan = cd.plan_runs([DeltaNetSegment(i, 1, i, None) for i in range(n)])
        xp = cp.asarray(rng.standard_normal((n, HIDDEN)).astype(np.float32))
        xp = (xp.view(cp.uint32) >> 16).astype(cp.uint16)  # bf16 bits, as the step's products take x
        ba = cp.asarray(rng.standard_normal((n, 2 * hv)).astype(np.float32))
        fixed = {"qkvz": be.linear(xp, w["qkvz"][0]), "a": ba[:, hv:], "b": ba[:, :hv]}
        fixed["core"] = cd.deltanet_core(pool, 0, fixed["qkvz"][:, :c], fixed["a"], fixed["b"], params, plan, cfg,
                                         {}, acc="float", gate=(fixed["qkvz"][:, c:].reshape(n, hv, dv), norm_w, 1e-6),
                                         out_dtype=cp.uint16)
        kw = {"be": be, "pool": pool, "plan": plan, "xp": xp, "w": w, "fixed": fixed, "params": params,
              "norm_w": norm_w, "cfg": cfg}
        first = None
        for r in range(ROUNDS):
            for variant in VARIANTS:
                try:
                    t = time_variant(variant, **kw)
                except Exception as e:  # noqa: BLE001 - one variant's failure must not lose the others
                    print(f"{n:5d} {variant:>14} failed: {type(e).__name__}: {e}")
                    continue
                first = first or t
                name = variant + (f" #{r + 1}" if ROUNDS > 1 else "")
                print(f"{n:5d} {name:>14} {t * 1e6:9.1f} {t / first:6.3f}", flush=True)


if __name__ == "__main__":
    main()
