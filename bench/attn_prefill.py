"""Prefill attention of the `qwen3.8-27b` shapes: the tensor-core kernel's builds (decapybara/kernels/attn_prefill.cu)
against the general float32 kernel and torch's SDPA, one chunk over a cached prefix, all in one run.

    PYTHONUNBUFFERED=1 python3 bench/attn_prefill.py     # ATTN_PREFILL=2048@0,2048@16384+11 (tokens@prefix,
                                                         # +N: N decode rows at that context beside the chunk),
                                                         # ATTN_KV=16/16,6/4 (page modes),
                                                         # ATTN_BUILDS=mma4/1,mma8/2,wg8/2,wg8/3o,wg8/3od
                                                         # ATTN_GENERAL=0: the general kernel untimed

24 query heads over 4 KV heads of 256 dims, pages of 512 keys (bench/gpu.py's cache and its 16 attention layers),
one sequence whose chunk of `tokens` new tokens follows `prefix` cached ones (and "+N" decode rows of as many
other sequences at the same context, each on its own pages: a mixed step; no torch row). A build is "mma" (mma.sync) or "wg"
(warpgroup MMAs, Hopper), then warps a CTA, then "/" and the (K, V) tile pairs, "o" for the overlapped loop
(cupy_attention.PREFILL), "b" for q and P as one bf16 term each (PREFILL "split" 0; else hi + lo terms); over
microscaled pages a build decodes each tile itself; with "d" the sequences of 16+ new tokens read bf16 scratch
copies of their pages, decoded once a call (`dequant_pages`; the time includes that decoding), the others as
before in a second launch; with "a" every sequence the prefill kernel takes reads the scratch; the decode rows of a mixed step run the
decode kernel (attn_decode.cu, DECODE "mixed"), with "p" the prefill kernel instead. Each timed call is one layer's attention with its split-K reduce, cycling through the 16
layers, 5 calls captured in one CUDA graph, replays timed with CUDA events. TFLOP/s = 4 x heads x head_dim x (query, key) pairs under the causal rule /
time (the useful products; the hi / lo split doubles the MMAs). Each build's output is checked against the general
kernel's in the same run (max error / max |output|). torch = F.scaled_dot_product_attention on bf16 q, K and V with
a lower-right causal mask (`causal_lower_right`: the chunk's rows see the prefix and their own past), K and V
repeated to the 24 query heads, whichever backend torch picks, back-to-back launches.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cupy as cp
import gpu as B
from attn_decode import layer_cycle  # one layer's attention per call, the next layer each call

from decapybara.backend import cupy_attention as ca
from decapybara.backend.cupy_attention import attention, plan_attention
from decapybara.model.batch import ForwardBatch

CASES = [tuple(int(v) for v in c.replace("+", "@").split("@")) + (0,) * (1 - c.count("+"))  # tokens @ prefix + rows
         for c in os.environ.get("ATTN_PREFILL", "2048@0,2048@16384,2048@30720").split(",")]
MODES = os.environ.get("ATTN_KV", "16/16,6/4").split(",")
BUILDS = os.environ.get("ATTN_BUILDS", "mma4/1,mma8/1,mma8/2,wg8/1,wg8/2,wg8/3,wg8/3o").split(",")
GENERAL = os.environ.get("ATTN_GENERAL", "1") != "0"  # time the general kernel (its output is the reference anyway)
SEQ_PAGES = max(B.SEQ_PAGES, *(-(-(t + p) // B.PAGE) for t, p, _ in CASES))  # pages a sequence: the longest case


def build_settings(name: str) -> dict:
    """cupy_attention.PREFILL settings of a build name such as "wg8/2" ("wg8/3o": the overlapped loop; "wg8/3ob":
    q and P as one bf16 term each; "wg8/3od": chunks over bf16 scratch copies of microscaled pages, "wg8/3oa":
    every sequence; "p": a mixed step's decode rows through this build rather than the decode kernel; the key
    "mixed" is DECODE's; a tail "w<MiB>": the scratch's cap, past which it is taken in windows)."""
    head, tail = name.split("/")
    kind = head.rstrip("0123456789")
    parsed = re.fullmatch(r"(\d+)([obdap]*)(?:w(\d+))?", tail)
    assert kind in ("mma", "wg") and parsed and not ("d" in tail and "a" in tail), name
    stages, flags, cap = int(parsed[1]), parsed[2], parsed[3]
    scratch = "d" if "d" in flags else "a" if "a" in flags else ""
    return {"enabled": True, "wg": int(kind == "wg"), "warps": int(head[len(kind):]), "stages": stages,
            "mx_stages": 1 if scratch == "d" else stages,  # "d": the other sequences as the default decodes them
            "overlap": int("o" in flags), "split": int("b" not in flags),
            "dequant_tokens": {"d": 16, "a": 1}.get(scratch, 0), "mixed": int("p" not in flags),
            **({"dequant_mb": int(cap)} if cap else {})}


def causal_pairs(tokens: int, prefix: int, rows: int = 0) -> int:
    """(query, key) pairs a chunk's rows attend (each sees the prefix and the chunk up to itself), and `rows`
    decode rows over prefix + 1 keys each."""
    return tokens * prefix + tokens * (tokens + 1) // 2 + rows * (prefix + 1)


def mixed_batch(tokens: int, prefix: int, rows: int) -> ForwardBatch:
    """A chunk of `tokens` after `prefix` cached ones, and `rows` decode rows at the same context, each sequence on
    its own pages (SEQ_PAGES a sequence)."""
    pages = [np.arange(i * SEQ_PAGES, (i + 1) * SEQ_PAGES, dtype=np.int32) for i in range(1 + rows)]
    return ForwardBatch.build([(np.arange(tokens) % 1000, prefix, pages[0], 0)]
                              + [([7], prefix, pages[1 + i], 1 + i) for i in range(rows)], B.PAGE)


def main() -> None:
    cfg = B.CFG
    nq, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    states = B.CupyBackend("bf16").new_state_pool(cfg, 1)
    defaults, mixed = dict(ca.PREFILL), ca.DECODE["mixed"]
    rows = []
    seqs = 1 + max(c[2] for c in CASES)
    for mode in MODES:
        kv = B.CupyBackend("bf16").new_kv_cache(cfg, seqs * SEQ_PAGES + 1, B.PAGE, mode)
        B.fill_random(kv, states)
        layers = sorted(kv.store)
        bits = (kv.key_bits, kv.value_bits)
        for tokens, prefix, extra in CASES:
            batch = mixed_batch(tokens, prefix, extra)
            q = cp.random.standard_normal((batch.num_tokens, nq, d), cp.float32)
            ca.PREFILL.update(enabled=False)  # the general float32 kernel: the reference and the baseline
            plan = plan_attention(batch, nq, nkv, d, kv_bits=bits)
            ref = cp.asnumpy(attention(q, kv.parts(layers[0], "k"), kv.parts(layers[0], "v"), plan, nkv, B.PAGE,
                                       d ** -0.5))
            res = {"general": B.graph_time(layer_cycle(kv, layers, q, plan, nkv, d), calls=5, reps=3)} if GENERAL \
                else {}
            errs = {}
            for name in BUILDS:
                settings = build_settings(name)
                ca.PREFILL.update(defaults)
                ca.DECODE["mixed"] = settings.pop("mixed")
                ca.PREFILL.update(settings)
                if settings["dequant_tokens"] and bits == (16, 16):
                    continue  # bf16 pages need no scratch
                if not ca.DECODE["mixed"] and not extra:
                    continue  # no decode rows: the same as without "p"
                plan = plan_attention(batch, nq, nkv, d, kv_bits=bits)  # the plan carries the build
                if plan.prefill is None or (plan.prefill.wg, plan.prefill.warps, plan.prefill.stages) != (
                        ca.PREFILL["wg"], ca.PREFILL["warps"], ca.PREFILL["stages"]) or (
                        ca.PREFILL["overlap"] and not ca.prefill_overlap(plan.prefill)) or (
                        ca.PREFILL["dequant_tokens"] and plan.dequant is None):
                    continue  # not on this device (e.g. wg off Hopper) or not in its shared memory
                got = cp.asnumpy(attention(q, kv.parts(layers[0], "k"), kv.parts(layers[0], "v"), plan, nkv,
                                           B.PAGE, d ** -0.5))
                errs[name] = float(np.abs(got - ref).max() / np.abs(ref).max())
                res[name] = B.graph_time(layer_cycle(kv, layers, q, plan, nkv, d), calls=5, reps=3)
            ca.PREFILL.update(defaults)
            ca.DECODE["mixed"] = mixed
            if mode == MODES[0] and not extra:
                res["torch sdpa"] = torch_sdpa(tokens, prefix, nq, nkv, d)
            rows.append((mode, tokens, prefix, extra, res, errs))
        kv = None
        cp.get_default_memory_pool().free_all_blocks()
    print("\nprefill attention, one layer: ms per call (TFLOP/s of the causal products); err = max |build - "
          "general| / max |general|")
    names = list(dict.fromkeys(n for row in rows for n in row[4]))
    print(f"{'KV':>6}{'chunk@prefix+rows':>17}" + "".join(f"{n:>18}" for n in names) + f"{'best x general':>16}"
          + f"{'max err':>10}")
    for mode, tokens, prefix, extra, res, errs in rows:
        flop = 4 * nq * d * causal_pairs(tokens, prefix, extra)
        cells = "".join(f"{res[n] * 1e3:>9.3f} ({flop / res[n] / 1e12:>5.0f})" if n in res else f"{'':>18}"
                        for n in names)
        best = min((v for n, v in res.items() if n in BUILDS), default=res.get("general", 0.0))
        vs = f"{res['general'] / best:>15.2f}x" if "general" in res and best else f"{'-':>16}"
        print(f"{mode:>6}{f'{tokens}@{prefix}' + (f'+{extra}' if extra else ''):>17}{cells}{vs}"
              f"{max(errs.values(), default=0.0):>10.1e}")
        print(f"{'err':>23}" + "".join(f"{errs[n]:>18.1e}" if n in errs else f"{'':>18}" for n in names))


def torch_sdpa(tokens: int, prefix: int, nq: int, nkv: int, d: int) -> float:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    keys = prefix + tokens
    qt = torch.randn(1, nq, tokens, d, device="cuda", dtype=torch.bfloat16)
    kt = torch.randn(1, nkv, keys, d, device="cuda", dtype=torch.bfloat16).repeat_interleave(nq // nkv, dim=1)
    vt = torch.randn(1, nkv, keys, d, device="cuda", dtype=torch.bfloat16).repeat_interleave(nq // nkv, dim=1)
    mask = causal_lower_right(tokens, keys)
    t = B.torch_time(lambda: F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask), calls=5, reps=3)
    qt = kt = vt = None
    torch.cuda.empty_cache()
    return t


if __name__ == "__main__":
    main()
