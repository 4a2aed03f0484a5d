"""Where a 27B decode step spends its GPU time: kernels by name, per step, for eager and graph decode.

    PYTHONUNBUFFERED=1 python3 bench/profile_step.py [variant ...]      # default: mxfp4 bf16
    PROFILE_SHAPES=1x1024,12x1024 PROFILE_MODES=graph python3 bench/profile_step.py mxfp4
    PROFILE_MODES=graph,verify ...      # verify: speculative verification steps (a draft a sequence, graphs)
    PROFILE_MODES=verify,verify16 ...   # verify16: the same with bf16 small products past 16 rows of x on the
                                        # skinny GEMM (SMALL_SPLIT_ROWS 16), as before they split into launches
    PROFILE_MODES=verify,verifygen ...  # verifygen: the DeltaNet layers on the general path's three launches
                                        # (MULTI_DECODE off), as before gdn_decode took runs of two rows
    BENCH_MTP=1 PROFILE_MODES=mtp ...   # the MTP head's pass (graphs), a (hidden, token) pair a sequence
    PROFILE_KV=6/4 ...                                                   # KV pages (default bf16, 16/16)
    PROFILE_PREFILL=2048@0,2048@16384 ...    # also prefill chunks: tokens@start (the prefix before it cached);
                                             # tokens@start+N: and N decode rows at that context (a mixed step)
    PROFILE_PREFILL_ATTN=32:1,64:0,off ...   # prefill attention variants (keys a tile : split; off: general)
                                             # a third field :N sets gdn_recurrent's staged tokens; "mma" /
                                             # "wg": the mma.sync / warpgroup-MMA build (PREFILL "wg"), then
                                             # "4" for 4 warps (default 8), "s" for 2 stages (default 1), no
                                             # overlap, "/3" for TC_DIAG 3 (measurement only); "default": as
                                             # configured (wgmma, 8 warps, 3 stages, the overlap); "direct":
                                             # microscaled pages decoded by the kernel (no bf16 scratch);
                                             # "rows": a mixed step's decode rows through the prefill
                                             # kernel (DECODE "mixed" 0), not the decode kernel;
                                             # "min256": the chunked DeltaNet from 256 rows (CHUNKED min_len)

Builds the `qwen3.8-27b` shapes as bench/gpu.py does (seeded random weights on the device), then, for 1
sequence at 1k context and 12 sequences at 32k (PROFILE_SHAPES: batch x context, comma-separated), records
the CUDA kernels of 5 steps with the PyTorch profiler (CUPTI sees every kernel of the process, CuPy's
included) and prints, per kernel name, the GPU microseconds and launches per step, beside the step's wall
time. The sum of kernel time against the wall
time shows how much of a step is launch gaps; the top rows show which kernels to work on.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import cupy as cp
import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu as B

from decapybara.backend import cupy_ops_extra as EX
from decapybara.backend.attn_plan import DECODE as DECODE_SETTINGS
from decapybara.backend.attn_plan import PREFILL as PREFILL_SETTINGS
from decapybara.backend.cuda_graph import DecodeGraphRunner
from decapybara.backend.cupy_deltanet import CHUNKED, MULTI_DECODE, RECURRENT

STEPS = 5
SHAPES = [tuple(int(v) for v in s.split("x")) for s in os.environ.get("PROFILE_SHAPES", "1x1024,12x32768").split(",")]
MODES = os.environ.get("PROFILE_MODES", "eager,graph").split(",")
PREFILL = [tuple(int(v) for v in s.replace("+", "@").split("@")) + (0,) * (1 - s.count("+"))  # tokens, start, rows
           for s in os.environ.get("PROFILE_PREFILL", "").split(",") if s]
PREFILL_ATTN = os.environ.get("PROFILE_PREFILL_ATTN", "default").split(",")


def prefill_attn(variant: str) -> None:
    """Sets attn_plan.PREFILL (and DECODE "mixed", cupy_deltanet.RECURRENT / CHUNKED) for a PROFILE_PREFILL_ATTN
    entry: "default", "off", "direct", "rows", "mma", "wg", "min<rows>" (the chunked DeltaNet's min_len) or
    "keys:split[:tokens]"."""
    if variant.startswith("min"):
        CHUNKED.update(min_len=int(variant[3:]))
        return
    if variant == "off":  # else as configured (DECAPYBARA_PREFILL_ATTN)
        PREFILL_SETTINGS.update(enabled=False)
    if variant == "direct":
        PREFILL_SETTINGS.update(dequant_tokens=0)
    if variant == "rows":
        DECODE_SETTINGS.update(mixed=0)
    name, *diag = variant.split("/")
    base = name.rstrip("48s")
    if base in ("mma", "wg"):  # e.g. "wg8s": 8 warps, 2 stages; "mma4/3": 4 warps, 1 stage, TC_DIAG 3
        stages = 2 if "s" in name[len(base):] else 1
        PREFILL_SETTINGS.update(wg=int(base == "wg"), warps=4 if "4" in name else 8, stages=stages,
                                mx_stages=stages, overlap=0, diag=int(diag[0]) if diag else 0)
    if ":" in variant:
        n, split, *tokens = (int(v) for v in variant.split(":"))
        PREFILL_SETTINGS.update(block_n=n, block_n_wide=n, split=split)
        RECURRENT.update(tokens=tokens[0] if tokens else 16)


def kernel_table(fn, steps: int = STEPS) -> tuple[float, dict[str, tuple[float, float]]]:
    """(wall ms per step, {kernel: (GPU us per step, launches per step)}) of `fn` run `steps` times."""
    for _ in range(2):
        fn()
    cp.cuda.Device().synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            fn()
        cp.cuda.Device().synchronize()
        wall = (time.perf_counter() - t) / steps * 1e3
    agg: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            name = ev.name.split("(")[0][:60]
            agg[name][0] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
            agg[name][1] += 1
    return wall, {k: (v[0] / steps, v[1] / steps) for k, v in agg.items()}


def show(title: str, wall: float, table: dict[str, tuple[float, float]], top: int = 22) -> dict:
    total = sum(v[0] for v in table.values())
    launches = sum(v[1] for v in table.values())
    print(f"\n== {title}: wall {wall:.2f} ms/step, kernels {total / 1e3:.2f} ms/step in {launches:.0f} launches")
    print(f"{'kernel':<62}{'us/step':>10}{'n/step':>8}{'us/launch':>11}{'share':>7}")
    for name, (us, n) in sorted(table.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"{name:<62}{us:>10.0f}{n:>8.0f}{us / max(n, 1):>11.1f}{100 * us / max(total, 1e-9):>6.1f}%")
    return {"wall_ms": wall, "kernel_ms": total / 1e3, "launches": launches,
            "top": sorted(((k, v[0], v[1]) for k, v in table.items()), key=lambda r: -r[1])[:top]}


@contextlib.contextmanager
def _split16() -> Any:
    split, EX.SMALL_SPLIT_ROWS = EX.SMALL_SPLIT_ROWS, EX.SMALL_ROWS
    try:
        yield
    finally:
        EX.SMALL_SPLIT_ROWS = split


@contextlib.contextmanager
def _general_deltanet() -> Any:
    rows, MULTI_DECODE["max_rows"] = MULTI_DECODE["max_rows"], 0
    try:
        yield
    finally:
        MULTI_DECODE["max_rows"] = rows


# verification steps under another setting, each through graphs of a runner of its own (captured with it):
# verify16, small products past 16 rows on the skinny GEMM (SMALL_SPLIT_ROWS 16); verifygen, the DeltaNet layers'
# runs of two rows on the general path's three launches (MULTI_DECODE "max_rows" 0), not gdn_decode's multi-row build
VERIFY_SETTINGS = {"verify16": _split16, "verifygen": _general_deltanet}


def verify_with(mode: str, model: Any, kv: Any, states: Any, b: int, ctx: int, variant: str, out: dict) -> None:
    """The verification step under VERIFY_SETTINGS[mode]."""
    with VERIFY_SETTINGS[mode]():
        r = DecodeGraphRunner(model, max_pages=B.SEQ_PAGES, pad_page=kv.num_pages - 1, pad_slot=B.SLOTS)
        batch = B.verify_batch(b, ctx)
        wall, table = kernel_table(lambda: r.forward(batch, kv, states))
        out[f"{variant} {mode} b{b} ctx{ctx}"] = show(f"{variant} {mode} b={b} ctx={ctx}", wall, table)


def main() -> None:
    variants = sys.argv[1:] or ["mxfp4", "bf16"]
    kv = B.CupyBackend("bf16").new_kv_cache(B.CFG, B.SLOTS * B.SEQ_PAGES + 1, B.PAGE,
                                            os.environ.get("PROFILE_KV", "16/16"))
    states = B.CupyBackend("bf16").new_state_pool(B.CFG, B.SLOTS + 1)
    B.fill_random(kv, states)
    out: dict = {}
    for variant in variants:
        model = B.build_model(variant)
        runner = DecodeGraphRunner(model, max_pages=B.SEQ_PAGES, pad_page=kv.num_pages - 1, pad_slot=B.SLOTS)
        for b, ctx in SHAPES:
            for mode in MODES:  # in MODES' order, so that any may run first
                if mode in VERIFY_SETTINGS:
                    verify_with(mode, model, kv, states, b, ctx, variant, out)
                    continue
                fwd = {"eager": model.forward, "graph": runner.forward, "verify": runner.forward}.get(mode)
                if fwd is None:
                    continue
                # verify: each sequence's real token and a draft through the verification graphs
                batch = B.verify_batch(b, ctx) if mode == "verify" else B.decode_batch(b, ctx)
                wall, table = kernel_table(lambda fwd=fwd, batch=batch: fwd(batch, kv, states))
                out[f"{variant} {mode} b{b} ctx{ctx}"] = show(f"{variant} {mode} b={b} ctx={ctx}", wall, table)
            if "mtp" in MODES and B.CFG.mtp_num_hidden_layers:  # BENCH_MTP=1: the MTP head's pass, a pair a sequence
                pairs, hidden = B.mtp_pairs(b, ctx)
                wall, table = kernel_table(lambda pairs=pairs, hidden=hidden, r=runner: r.mtp(pairs, hidden, kv))
                out[f"{variant} mtp b{b} ctx{ctx}"] = show(f"{variant} mtp pass b={b} ctx={ctx}", wall, table)
        defaults, rec_defaults, mixed = dict(PREFILL_SETTINGS), dict(RECURRENT), DECODE_SETTINGS["mixed"]
        chunked_defaults = dict(CHUNKED)
        for tokens, start, rows in PREFILL:  # one sequence's chunk over its first pages (slot 0), decode rows after
            for attn in PREFILL_ATTN:
                prefill_attn(attn)
                # NOTE: a new batch object per variant: the backend keeps a batch's attention plan
                chunk = B.ForwardBatch.build([(np.arange(start, start + tokens) % 1000, start,
                                               np.arange(B.SEQ_PAGES, dtype=np.int32), 0)]
                                             + [([7], start, np.arange(i * B.SEQ_PAGES, (i + 1) * B.SEQ_PAGES,
                                                                       dtype=np.int32), i) for i in range(1, rows + 1)],
                                             B.PAGE)
                wall, table = kernel_table(lambda chunk=chunk, m=model: m.forward(chunk, kv, states), steps=2)
                title = f"{variant} prefill {tokens}@{start}" + (f"+{rows}" if rows else "") + f" attention {attn}"
                out[title] = show(title + f" ({tokens / wall * 1e3:,.0f} tok/s)", wall, table, top=16)
                PREFILL_SETTINGS.update(defaults)
                DECODE_SETTINGS.update(mixed=mixed)
                RECURRENT.update(rec_defaults)
                CHUNKED.update(chunked_defaults)
        print("graph stats:", runner.stats)
        model = runner = None
        cp.get_default_memory_pool().free_all_blocks()
    dest = os.environ.get("OUT")
    if dest:
        Path(dest, "profile_step.json").write_text(json.dumps(out, indent=1, default=float))


if __name__ == "__main__":
    main()
