"""Would the DeltaNet decode run faster if its recurrent state were asked of the L2 while the product before it runs?

    python3 bench/state_prefetch.py        # table: batch, variant, us a layer, ratio to the first variant

At the 27B shape (Hk 16, Hv 48, dk = dv = 128) a layer's float32 state is 3.1 MB a sequence, read and written by
`gdn_decode` after the layer's qkv|z product (16384 x 5120, MXFP4, 44.6 MB). At twelve sequences that state traffic
is 0.87 ms of a 48-layer step at copy bandwidth, while the twelve-row products use ~42% of the bandwidth
(docs/perf.md, forty-fourth session). This benchmark times, per layer, in a CUDA graph over the layers
(GDN_LAYERS, default 16, as bench/gdn_decode.py; state and weights cycled past the L2):

- `decode`: the DeltaNet decode alone (gdn_decode + gdn_decode_finish, as bench/gdn_decode.py);
- `decode+decode`: two decodes of the layer, the second reading the state the first just wrote (as much of it as
  the L2 kept): how fast the decode is with its state in the L2;
- `prefetch`: the prefetch kernel alone;
- `product`: the qkv|z product alone, at the batch's rows;
- `product+decode`: the product, then the decode (what a step does);
- `product|prefetch`: the product with a kernel on a side stream, forked before it, that issues
  `cp.async.bulk.prefetch.L2` over the layer's state slots (STATE_PIECE bytes a request from each of
  STATE_PREFETCH_BLOCKS blocks' 128 threads, default 8; no registers or shared
  memory held: the requests leave at once); does that traffic slow the product?
- `product|prefetch+decode`: the same, joined, then the decode;
- `...(last)`: the prefetch under an L2 evict_last policy (`createpolicy`), so that the product's weight stream
  evicts other lines first;
- `prefetch+decode`: the prefetch, then the decode, with no product between (the bulk requests are asynchronous:
  the decode may start before they land).

Variants interleave over STATE_ROUNDS rounds; STATE_BATCHES the sequence counts (default 1,12). The product's
weights are random codes (bench/gpu.py `random_packed`): only the timing means something.
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
from gdn_decode import copy_bandwidth, decode_setup, random_pool  # bench/gdn_decode.py
from gpu import graph_seconds, random_packed  # bench/gpu.py

from decapybara.backend import cupy_deltanet as cd
from decapybara.backend import cupy_ops_extra as ex
from decapybara.backend.base import DeltaNetSegment
from decapybara.backend.cupy_backend import CupyBackend

BATCHES = [int(b) for b in os.environ.get("STATE_BATCHES", "1,12").split(",")]
ITERS = int(os.environ.get("STATE_ITERS", "10"))
ROUNDS = int(os.environ.get("STATE_ROUNDS", "2"))
PIECE = int(os.environ.get("STATE_PIECE", str(32 << 10)))
BLOCKS = int(os.environ.get("STATE_PREFETCH_BLOCKS", "8"))  # blocks of 128 threads the prefetch kernel takes
VARIANTS = os.environ.get("STATE_VARIANTS", "decode,decode+decode,prefetch,prefetch+decode,product,product+decode,"
                          "product|prefetch,product|prefetch+decode,product|prefetch(last)+decode").split(",")
QKVZ = (16384, 5120)

SRC = r"""
// Bulk L2 prefetch of [base, base + bytes): thread t of block b asks for pieces t * blocks + b, then that plus
// threads, ... of `piece` bytes (16-byte multiples; base 16-byte aligned): consecutive pieces on different blocks,
// so that a small range still spreads over the blocks' SMs. last != 0: under an L2 evict_last policy.
extern "C" __global__ void prefetch_l2(const char* base, unsigned long long bytes, unsigned int piece, int last) {
  unsigned long long pol = 0;
  if (last) asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
  const unsigned long long step = (unsigned long long)gridDim.x * blockDim.x * piece;
  for (unsigned long long off = ((unsigned long long)threadIdx.x * gridDim.x + blockIdx.x) * piece; off < bytes;
       off += step) {
    const unsigned int n = (unsigned int)(bytes - off < piece ? bytes - off : piece);
    if (last)
      asm volatile("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;" ::"l"(base + off), "r"(n), "l"(pol)
                   : "memory");
    else
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(base + off), "r"(n) : "memory");
  }
}
"""


def prefetch(kernel: Any, arr: Any, last: bool) -> None:
    """Bulk L2 prefetch of `arr`'s bytes (contiguous), BLOCKS blocks of 128 threads."""
    kernel((BLOCKS,), (128,), (arr, np.uint64(arr.nbytes), np.uint32(PIECE), np.int32(int(last))))


def layer_fn(variant: str, kernel: Any, side: Any, n: int, layer: int, pool: Any, plan: Any, x: Any, z: Any,
             ab: Any, params: Any, norm_w: Any, cfg: Any, w: Any, xp: Any) -> None:
    """One layer of `variant` on the current stream (the side stream forked and joined around the prefetch)."""
    hv = cfg.linear_num_value_heads
    state = pool.rec[layer][:n]  # this batch's slots 0..n-1: contiguous

    def decode() -> None:
        cd.deltanet_core(pool, layer, x, ab[:, hv:], ab[:, :hv], params, plan, cfg, {}, acc="float",
                         gate=(z, norm_w, 1e-6))

    if variant == "decode":
        decode()
        return
    if variant == "decode+decode":  # the second reads the state the first just wrote (the L2's, where it stayed)
        decode()
        decode()
        return
    if variant == "prefetch":
        prefetch(kernel, state, False)
        return
    if variant == "prefetch+decode":
        prefetch(kernel, state, False)
        decode()
        return
    main = cp.cuda.get_current_stream()
    forked = "|prefetch" in variant
    if forked:
        side.wait_event(main.record())
    try:
        if forked:
            with side:
                prefetch(kernel, state, "(last)" in variant)
        ex.mx_linear(xp, w[layer])
    finally:
        if forked:
            main.wait_event(side.record())  # joined even when a launch fails: a capture must not end forked
    if variant.endswith("+decode"):
        decode()


def time_variant(variant: str, layers: int, **kw: Any) -> float:
    """Seconds a layer: a fresh graph of `layers` layers of `variant`, median of ITERS replays (after 3)."""
    return graph_seconds(lambda: [layer_fn(variant, layer=layer, **kw) for layer in range(layers)], layers,
                         ITERS + 3, 3)


def main() -> None:
    be = CupyBackend("bf16")
    rng = np.random.default_rng(0)
    cfg, params, norm_w = decode_setup(rng)
    layers = cfg.num_hidden_layers
    c, hv, dv = cfg.linear_conv_dim, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    kernel = cp.RawModule(code=SRC, options=("-std=c++17",)).get_function("prefetch_l2")
    side = cp.cuda.Stream(non_blocking=True)
    w = [random_packed("mxfp4", QKVZ) for _ in range(layers)]
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; {layers} layers; qkv|z {QKVZ} MXFP4 {w[0].nbytes / 1e6:.1f} MB; "
          f"prefetch pieces {PIECE} B")
    print(f"{'batch':>5} {'variant':>34} {'us/layer':>9} {'ratio':>6}")
    for n in BATCHES:
        pool = random_pool(be, cfg, n, rng)
        plan = cd.plan_runs([DeltaNetSegment(i, 1, i, None) for i in range(n)])
        qkvz = cp.asarray(rng.standard_normal((n, c + hv * dv)).astype(np.float32))
        ab = cp.asarray(rng.standard_normal((n, 2 * hv)).astype(np.float32))
        x, z = qkvz[:, :c], qkvz[:, c:].reshape(n, hv, dv)
        xp = cp.asarray(rng.standard_normal((n, QKVZ[1])).astype(np.float32))
        kw = {"kernel": kernel, "side": side, "n": n, "pool": pool, "plan": plan, "x": x, "z": z, "ab": ab,
              "params": params, "norm_w": norm_w, "cfg": cfg, "w": w, "xp": xp}
        first = None
        for r in range(ROUNDS):
            for variant in VARIANTS:
                try:
                    t = time_variant(variant, layers, **kw)
                except Exception as e:  # noqa: BLE001 - one variant's failure must not lose the others
                    print(f"{n:5d} {variant:>34} failed: {type(e).__name__}: {e}")
                    continue
                first = first or t
                print(f"{n:5d} {variant + (f' #{r + 1}' if ROUNDS > 1 else ''):>34} {t * 1e6:9.1f} {t / first:6.3f}",
                      flush=True)


if __name__ == "__main__":
    main()
