"""Decode attention of the `qwen3.8-27b` shapes: the tensor-core kernel (decapybara/kernels/attn_decode.cu) in several
launch shapes against the general kernel (decapybara/kernels/attn_prefill.cu) and torch's SDPA, all in one run.

    PYTHONUNBUFFERED=1 python3 bench/attn_decode.py   # ATTN_KV=16/16,6/4 (page modes), ATTN_SHAPES /
                                                      # ATTN_MX_SHAPES=warps x stages,... to sweep,
                                                      # ATTN_MIN_KEYS=512,2048: plans of N+ keys a split,
                                                      # ATTN_CASES=1x1024,12x1024: batch x context

24 query heads over 4 KV heads of 256 dims, pages of 512 keys (bench/gpu.py's cache: its 16 attention layers,
12 sequences of up to 32k keys) in each KV mode of ATTN_KV (default bf16, 8/8, 6/4, 4/4). Each timed call is
one layer's attention with its split-K reduce, cycling through the 16 layers (as a decode step does, so the KV
comes from HBM, not the 50 MB L2), 20 calls captured in one CUDA graph, replays timed with CUDA events: the
figure a decode graph pays. GB/s = KV bytes read (codes and scales) / time; % = of the copy bandwidth measured
in the same run. torch = F.scaled_dot_product_attention (bf16, GQA) on contiguous [b, 24, ctx, 256] K/V for
one layer (cuDNN / flash, whichever torch picks), back-to-back launches, measured once per case (its bytes are
bf16's). The tensor-core kernel's output is checked against the general kernel's in the same run.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cupy as cp
import gpu as B

from decapybara.backend import cupy_attention as ca
from decapybara.backend.cupy_attention import attention, plan_attention

CASES = [tuple(int(v) for v in c.split("x")) for c in  # batch x context
         os.environ.get("ATTN_CASES", "1x1024,12x1024,1x8192,12x8192,1x32768,12x32768").split(",")]
MODES = os.environ.get("ATTN_KV", "16/16,8/8,6/4,4/4").split(",")
SHAPES = {bf: [tuple(int(v) for v in s.split("x")) for s in os.environ.get(env, default).split(",")]
          for bf, env, default in ((True, "ATTN_SHAPES", "4x3,4x2"), (False, "ATTN_MX_SHAPES", "4x3,4x4,4x2,8x3"))}
# plans of at least this many keys a split and about 8 CTAs an SM (cupy_attention.DECODE "min_keys" with the
# fill and short rules off: the plans before decode_splits) timed besides the default rule, e.g. "512,2048"
MIN_KEYS = [int(v) for v in os.environ.get("ATTN_MIN_KEYS", "").split(",") if v]


def main() -> None:
    cfg = B.CFG
    nq, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    copy_bw = B.bench_roofline() * 1e9
    states = B.CupyBackend("bf16").new_state_pool(cfg, 1)
    torch_t = {}
    rows = []
    for mode in MODES:
        kv = B.CupyBackend("bf16").new_kv_cache(cfg, B.SLOTS * B.SEQ_PAGES + 1, B.PAGE, mode)
        B.fill_random(kv, states)
        layers = sorted(kv.store)
        bits = (kv.key_bits, kv.value_bits)
        bf = bits == (16, 16)
        wk, sk = ("warps", "stages") if bf else ("mx_warps", "mx_stages")
        default = (ca.DECODE[wk], ca.DECODE[sk])
        for b, ctx in CASES:
            batch = B.decode_batch(b, ctx)
            q = cp.random.standard_normal((b, nq, d), cp.float32)
            kv_bytes = b * ctx * kv.bytes_per_page // B.PAGE // len(layers)
            ca.DECODE["enabled"] = False  # the general kernel with its own plan (64+ keys a split, 2 CTAs per SM)
            plan = plan_attention(batch, nq, nkv, d, kv_bits=bits)
            ref = cp.asnumpy(attention(q, kv.parts(layers[0], "k"), kv.parts(layers[0], "v"), plan, nkv, B.PAGE,
                                       d ** -0.5))
            res = {"general": B.graph_time(layer_cycle(kv, layers, q, plan, nkv, d))}
            ca.DECODE["enabled"] = True
            plan = plan_attention(batch, nq, nkv, d, kv_bits=bits)
            call = layer_cycle(kv, layers, q, plan, nkv, d)
            err = 0.0
            for i, (w, s) in enumerate(SHAPES[bf]):
                ca.DECODE[wk], ca.DECODE[sk] = w, s  # the plan carries the launch shape
                shaped = plan_attention(batch, nq, nkv, d, kv_bits=bits)
                got = cp.asnumpy(attention(q, kv.parts(layers[0], "k"), kv.parts(layers[0], "v"), shaped, nkv,
                                           B.PAGE, d ** -0.5))
                err = max(err, float(np.abs(got - ref).max() / np.abs(ref).max()))
                res[f"tc{i}"] = B.graph_time(layer_cycle(kv, layers, q, shaped, nkv, d))
            ca.DECODE[wk], ca.DECODE[sk] = default
            rule = {k: ca.DECODE[k] for k in ("min_keys", "fill_ctas", "short_ctas")}
            for mk in MIN_KEYS:  # the default shape over splits of `mk` keys at least, about 8 CTAs an SM
                ca.DECODE.update(min_keys=mk, fill_ctas=0, short_ctas=0)
                split = plan_attention(batch, nq, nkv, d, kv_bits=bits)
                got = cp.asnumpy(attention(q, kv.parts(layers[0], "k"), kv.parts(layers[0], "v"), split, nkv,
                                           B.PAGE, d ** -0.5))
                err = max(err, float(np.abs(got - ref).max() / np.abs(ref).max()))
                res[f"{mk} keys"] = B.graph_time(layer_cycle(kv, layers, q, split, nkv, d))
            ca.DECODE.update(rule)
            ca.DECODE["chains"] = 1  # the default shape with one accumulator chain for the scores
            res["1 chain"] = B.graph_time(call)
            ca.DECODE["chains"] = 2
            if (b, ctx) not in torch_t:
                torch_t[b, ctx] = torch_sdpa(b, ctx, nq, nkv, d)
            res["torch sdpa"] = torch_t[b, ctx]
            rows.append((mode, b, ctx, kv_bytes, res, err))
        kv = None
        cp.get_default_memory_pool().free_all_blocks()
    print(f"\ndecode attention, one layer: us per call (GB/s, % of copy {copy_bw / 1e9:.0f} GB/s); tc0.. = "
          f"bf16 shapes {SHAPES[True]}, microscaled {SHAPES[False]} (warps, stages)")
    names = list(dict.fromkeys(n for row in rows for n in row[4]))
    print(f"{'KV':>6}{'b':>3}{'ctx':>7}{'KV MB':>8}" + "".join(f"{n:>22}" for n in names)
          + f"{'best/general':>14}{'tc err':>9}")
    for mode, b, ctx, nbytes, res, err in rows:
        cells = "".join(f"{res[n] * 1e6:>9.1f} ({nbytes / res[n] / 1e9:>4.0f},{100 * nbytes / res[n] / copy_bw:>3.0f}%)"
                        if n in res else f"{'':>22}" for n in names)
        best = min(v for n, v in res.items() if n.startswith("tc") or n == "1 chain")
        print(f"{mode:>6}{b:>3}{ctx:>7}{nbytes / 1e6:>8.1f}{cells}{res['general'] / best:>13.2f}x{err:>9.1e}")


def layer_cycle(kv, layers, q, plan, nkv: int, d: int):
    """One layer's attention per call, the next layer each call."""
    count = iter(range(1 << 60))

    def call() -> None:
        layer = layers[next(count) % len(layers)]
        attention(q, kv.parts(layer, "k"), kv.parts(layer, "v"), plan, nkv, B.PAGE, d ** -0.5)
    return call


def torch_sdpa(b: int, ctx: int, nq: int, nkv: int, d: int) -> float:
    import torch
    import torch.nn.functional as F

    qt = torch.randn(b, nq, 1, d, device="cuda", dtype=torch.bfloat16)
    kt = torch.randn(b, nkv, ctx, d, device="cuda", dtype=torch.bfloat16)
    vt = torch.randn(b, nkv, ctx, d, device="cuda", dtype=torch.bfloat16)
    t = B.torch_time(lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True))
    qt = kt = vt = None
    torch.cuda.empty_cache()
    return t


if __name__ == "__main__":
    main()
