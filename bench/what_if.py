"""What a 27B decode step would cost without each group of its small kernels: an upper bound on fusing them.

    PYTHONUNBUFFERED=1 python3 bench/what_if.py [variant]        # default mxfp4; JSON to $OUT/what_if.json

Builds the `qwen3.8-27b` shapes as bench/gpu.py does (seeded random weights on the device, bf16 KV pages),
then for each DROP set replaces those ops of the model's backend by ones that return a buffer of the right
shape without launching anything (the results are wrong; only the timing means something), captures fresh
decode graphs and times graph steps (median of 10) at WHATIF_SHAPES (default 1x1024,12x1024). The groups:

- norms: the residual add + RMSNorm between blocks (129 a step, or what is left of them where the output
  projections fuse them, `fuse_norms`), and the final norm;
- silu: silu(gate) * up after the fused gate|up product (64; up to 8 rows the product's own epilogue, `swiglu`,
  which then runs as the plain product);
- small: products over weights under 4 MB (the DeltaNet a|b products, 48);
- deltanet: the DeltaNet decode (conv1d state, recurrence, gated norm; 48 layers);
- gate: the attention output gate alone (16: in a decode step the attention kernels' gated stores,
  `paged_attention_gated`, whose attention then runs ungated; else `sigmoid_gate`);
- kvwrite: the attention layers' KV page writes alone (two launches a layer, 32);
- finish: the DeltaNet decode's second launch alone (gdn_decode_finish: the conv state update and the gated
  norm; the output projection then reads the core's float32 rows);
- attention: q / k norm + RoPE, paged attention with its KV write, the output gate (16 layers);
- rest: all of the above: what remains is the large products and the embedding row.

Prints step ms and the saving against the full step per shape; WHATIF_ROUNDS repeats the interleaved
sequence (two captures of one graph differ by a few %); WHATIF_DROPS names the sets to time (e.g.
"full,finish"; default all).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import cupy as cp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu as B

from decapybara.backend import cupy_deltanet as cd
from decapybara.backend import cupy_kv as ck
from decapybara.backend import cupy_ops_extra as ex
from decapybara.backend.cuda_graph import DecodeGraphRunner

SHAPES = [tuple(int(v) for v in s.split("x")) for s in os.environ.get("WHATIF_SHAPES", "1x1024,12x1024").split(",")]
GROUPS = ("norms", "silu", "small", "deltanet", "attention")
DROPS: dict[str, tuple[str, ...]] = {"full": (), **{g: (g,) for g in GROUPS}, "finish": ("finish",), "gate": ("gate",),
                                     "kvwrite": ("kvwrite",), "rest": GROUPS}
if os.environ.get("WHATIF_DROPS"):
    DROPS = {k: v for k, v in DROPS.items() if k in os.environ["WHATIF_DROPS"].split(",")}
_GET_KERNEL = cd.get_kernel
_KV_WRITE = ck.CupyKVCache.write
ROUNDS = int(os.environ.get("WHATIF_ROUNDS", "2"))
SMALL_BYTES = 4 << 20


class Buffers:
    """One uninitialised float32 device buffer per shape, reused: an op's stand-in result."""

    def __init__(self) -> None:
        self.bufs: dict[tuple[int, ...], Any] = {}

    def get(self, *shape: int) -> Any:
        if shape not in self.bufs:
            self.bufs[shape] = cp.empty(shape, cp.float32)
        return self.bufs[shape]


def patch(ops: Any, drop: tuple[str, ...], buf: Buffers) -> None:
    """Instance attributes over the backend's methods for the dropped groups (removed again by `unpatch`)."""
    cls = type(ops)
    if "norms" in drop:
        ops.add_rms_norm = lambda x, res, w, eps, off: (x, res)
        ops.rms_norm = lambda x, w, eps, off: x
        ops.linear_add_rms_norm = lambda x, w, bias, res, nw, eps, off: (ops.linear(x, w, bias), res)
    if "silu" in drop:
        ops.silu_mul_halves = lambda y, to_product=None: buf.get(y.shape[0], y.shape[1] // 2)
        ops.swiglu = lambda x, w, to_product=None: ops.silu_mul_halves(ops.linear(x, w))
    if "small" in drop:
        def linear(x: Any, w: Any, bias: Any = None) -> Any:
            if isinstance(w, ex.PackedWeight) and w.nbytes < SMALL_BYTES:
                return buf.get(x.shape[0], w.N)
            return cls.linear(ops, x, w, bias)
        ops.linear = linear
    if "deltanet" in drop:
        ops.deltanet_core_gated = lambda states, layer, mixed, a, b, params, segments, cfg, raw, z, w, eps, \
            to_product=None: buf.get(*z.shape)
    if "finish" in drop:  # the core without its gate: gdn_decode, then conv1d_state_update, dropped below
        ops.deltanet_core_gated = lambda states, layer, mixed, a, b, params, segments, cfg, raw, z, w, eps, \
            to_product=None: ops.deltanet_core(states, layer, mixed, a, b, params, segments, cfg, raw)
        cd.get_kernel = lambda src, name, defines=(): ((lambda *a, **k: None) if name == "conv1d_state_update"
                                                       else _GET_KERNEL(src, name, defines))
    if "gate" in drop:  # the attention without its output gate (the decode kernels' gated stores, or its launch)
        ops.paged_attention_gated = lambda kv, layer, q, k, v, batch, scale, gate, to_product=None: \
            ops.paged_attention(kv, layer, q, k, v, batch, scale)
        ops.sigmoid_gate = lambda o, gate, to_product=None: o
    if "kvwrite" in drop:
        ck.CupyKVCache.write = lambda self, layer, slots, k, v: None
    if "attention" in drop:
        ops.qk_norm_rope = lambda q, k, *a: (q, k)
        ops.paged_attention = lambda kv, layer, q, k, v, batch, scale: buf.get(*q.shape)
        ops.paged_attention_gated = lambda kv, layer, q, k, v, batch, scale, gate, to_product=None: \
            buf.get(*q.shape)
        ops.sigmoid_gate = lambda o, gate, to_product=None: o


def unpatch(ops: Any) -> None:
    for name in ("add_rms_norm", "rms_norm", "linear_add_rms_norm", "silu_mul_halves", "swiglu", "linear",
                 "deltanet_core_gated", "qk_norm_rope", "paged_attention", "paged_attention_gated",
                 "sigmoid_gate"):
        ops.__dict__.pop(name, None)
    cd.get_kernel = _GET_KERNEL
    ck.CupyKVCache.write = _KV_WRITE


def main() -> None:
    variant = sys.argv[1] if len(sys.argv) > 1 else "mxfp4"
    kv, states, model = B.decode_setup(variant)
    buf = Buffers()
    res: dict[str, dict[str, list[float]]] = {}
    for r in range(ROUNDS):
        for name, drop in DROPS.items():
            patch(model.backend, drop, buf)
            try:
                runner = DecodeGraphRunner(model, max_pages=B.SEQ_PAGES, pad_page=kv.num_pages - 1, pad_slot=B.SLOTS)
                for b, ctx in SHAPES:
                    batch = B.decode_batch(b, ctx)
                    t = B.median_time(lambda batch=batch, r=runner: r.forward(batch, kv, states), 10, warmup=3)
                    res.setdefault(name, {}).setdefault(f"{b}x{ctx}", []).append(t * 1e3)
                print(f"round {r + 1} {name}:", {k: round(v[-1], 3) for k, v in res[name].items()},
                      "graph steps:", runner.stats["graph_steps"], "failures:", runner.stats["failures"])
            finally:
                unpatch(model.backend)
                runner = None
                cp.get_default_memory_pool().free_all_blocks()
    print(f"\n{variant}, graph decode steps without each group (ms, best of {ROUNDS}; saving vs full, ms and %)")
    def cell(row: dict[str, list[float]], b: int, c: int) -> str:
        ms, full = min(row[f"{b}x{c}"]), min(res["full"][f"{b}x{c}"])
        return f"{ms:7.2f} {full - ms:7.2f} {100 * (full - ms) / full:6.1f}%"

    B.shape_table("dropped", res, SHAPES, cell, width=12)
    dest = os.environ.get("OUT")
    if dest:
        Path(dest, "what_if.json").write_text(json.dumps({variant: res}, indent=1))


if __name__ == "__main__":
    main()
