"""Does a DeltaNet layer's z product gain from running beside the decode instead of inside the qkv|z product?

    python3 bench/z_beside.py          # table: batch, variant, us a layer, ratio to the first variant

A 27B DeltaNet layer's input products are qkv|z (16384 x 5120: q, k, v 10240 rows and z 6144, MXFP4 44.6 MB) and
b|a (96 x 5120 bf16, on a side stream beside it: `CupyBackend.linear_pair`); its decode (`gdn_decode`) reads q, k,
v, b and a, and only the launch after it (`gdn_decode_finish`, the gated norm) reads z. The decode streams its
float32 state at ~66% of copy bandwidth (docs/perf.md, forty-fourth session), so z's 16.7 MB could be read beside
it. Variants, per layer, in a CUDA graph over ZB_LAYERS layers (default 16; weights and states cycled past the L2),
launched as a decode graph launches them (overlapped where the step does):

- `fused`: linear_pair(qkv|z, b|a), then the decode and finish (the step as it is);
- `split`: linear_pair(qkv, b|a), then the decode with z deferred (`cupy_deltanet.SIDE_Z` "decode": gdn_decode
  launched first, z's product on a side stream forked after qkv, joined before the finish);
- `split z-first`: the same, z's product launched before gdn_decode (SIDE_Z "z");
- `split serial`: linear_pair(qkv, b|a), z's product, then the decode: what splitting costs with nothing beside.

ZB_BATCHES the sequence counts (default 1,4,8,12), ZB_ROUNDS rounds (interleaved), ZB_ITERS replays (median). The
weights are random codes (bench/gpu.py `random_packed`) and the decode reads the products' real outputs: only the
timing means something.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import cupy as cp
import numpy as np
from gdn_decode import config, layer_params  # bench/gdn_decode.py
from gpu import random_packed  # bench/gpu.py

from decapybara.backend import cupy_deltanet as cd
from decapybara.backend.base import DeltaNetSegment
from decapybara.backend.cuda_factory import cuda_backend
from decapybara.backend.cuda_graph import capture_graph

BATCHES = [int(b) for b in os.environ.get("ZB_BATCHES", "1,4,8,12").split(",")]
ITERS = int(os.environ.get("ZB_ITERS", "10"))
ROUNDS = int(os.environ.get("ZB_ROUNDS", "2"))
LAYERS = int(os.environ.get("ZB_LAYERS", "16"))
VARIANTS = os.environ.get("ZB_VARIANTS", "fused,split,split z-first,split serial").split(",")
HIDDEN = 5120


def layer_fn(variant: str, be: Any, layer: int, pool: Any, plan: Any, xp: Any, w: dict, params: Any, norm_w: Any,
             cfg: Any) -> Any:
    """One DeltaNet layer's input products and decode on the current stream; returns the gated core output."""
    c, hv = cfg.linear_conv_dim, cfg.linear_num_value_heads
    if variant == "fused":
        qkvz, ba = be.linear_pair(xp, w["qkvz"][layer], w["ba"][layer])
        mixed, z = qkvz[:, :c], qkvz[:, c:]
    else:
        mixed, ba = be.linear_pair(xp, w["qkv"][layer], w["ba"][layer])

        def z() -> Any:
            return be.linear(xp, w["z"][layer])

        if variant == "split serial":
            z = z()
    cd.SIDE_Z["order"] = "z" if variant == "split z-first" else "decode"
    n = xp.shape[0]
    z = z if callable(z) else z.reshape(n, hv, -1)
    return cd.deltanet_core(pool, layer, mixed, ba[:, hv:], ba[:, :hv], params, plan, cfg, {}, acc="float",
                            gate=(z, norm_w, 1e-6))


def time_variant(variant: str, **kw: Any) -> float:
    """Seconds a layer: a fresh graph of LAYERS layers of `variant`, median of ITERS replays (after 3)."""
    stream, mem = cp.cuda.Stream(non_blocking=True), cp.cuda.MemoryPool()
    graph, _ = capture_graph(lambda: [layer_fn(variant, layer=i, **kw) for i in range(LAYERS)], stream, mem)
    times = []
    for _ in range(ITERS + 3):
        start = stream.record()
        graph.launch(stream)
        end = stream.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) * 1e-3 / LAYERS)
    return float(np.median(times[3:]))


def main() -> None:
    cfg = config()
    be = cuda_backend("bf16")
    rng = np.random.default_rng(0)
    c, hv, dv = cfg.linear_conv_dim, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    params, norm_w = layer_params(cfg, rng)
    shapes = {"qkvz": (c + hv * dv, HIDDEN), "qkv": (c, HIDDEN), "z": (hv * dv, HIDDEN)}
    w = {k: [random_packed("mxfp4", s) for _ in range(LAYERS)] for k, s in shapes.items()}
    w["ba"] = [random_packed("bf16", (2 * hv, HIDDEN)) for _ in range(LAYERS)]
    print(f"{LAYERS} layers; qkv|z {shapes['qkvz']} = qkv {shapes['qkv']} + z {shapes['z']} MXFP4, b|a bf16; "
          f"SIDE_Z default {cd.SIDE_Z}")
    print(f"{'batch':>5} {'variant':>22} {'us/layer':>9} {'ratio':>6}")
    base = dict(cd.SIDE_Z)
    for n in BATCHES:
        pool = be.new_state_pool(cfg, n)
        for layer in range(LAYERS):
            pool.rec[layer][...] = cp.asarray(rng.standard_normal(pool.rec[layer].shape).astype(np.float32) * 0.05)
        plan = cd.plan_runs([DeltaNetSegment(i, 1, i, None) for i in range(n)])
        xp = cp.asarray(rng.standard_normal((n, HIDDEN)).astype(np.float32))
        kw = {"be": be, "pool": pool, "plan": plan, "xp": xp, "w": w, "params": params, "norm_w": norm_w,
              "cfg": cfg}
        first = None
        for r in range(ROUNDS):
            for variant in VARIANTS:
                try:
                    t = time_variant(variant, **kw)
                except Exception as e:  # noqa: BLE001 - one variant's failure must not lose the others
                    print(f"{n:5d} {variant:>22} failed: {type(e).__name__}: {e}")
                    continue
                finally:
                    cd.SIDE_Z.update(base)
                first = first or t
                name = variant + (f" #{r + 1}" if ROUNDS > 1 else "")
                print(f"{n:5d} {name:>22} {t * 1e6:9.1f} {t / first:6.3f}", flush=True)


if __name__ == "__main__":
    main()
