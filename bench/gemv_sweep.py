"""Sweep of mx_gemm's launch and kernel knobs on the products of one decode step, in one device call.

    PYTHONUNBUFFERED=1 python3 bench/gemv_sweep.py [fmt ...]     # default: mxfp4; JSON to $OUT/gemv_sweep.json
    SWEEP_MODEL=qwen3.8-35b-a3b SWEEP_M12=qkv|z,out,q|k|v ...     # another named model's products (default the 27B)

For each variant (a set of `cupy_ops_extra.TUNE` overrides and kernel defines) it times every distinct
dense product of a decode step (qwen3.8-27b: fused gate|up, down, qkv|z, out (o_proj too), q|k|v, lm_head;
bench/step_products.py) at M = 1 and the large ones at M = 12, as CUDA-graph replays timed with CUDA events. Each product cycles through enough
copies of its weights that they do not stay in the 50 MB L2 between calls (as in a real step, where the
next product's weights are not cached). Prints per-shape % of the copy bandwidth and the step-weighted total
(products x their count per step): the time the step spends in these products. `diag` variants skip the
weight decoding (their results are wrong; they measure what the decoding costs). MXFP4 / NVFP4 weights are
repacked before each variant into the code layouts its kernel reads (`e2m1_split`: split fields or plain
nibbles; `tiled`: band tiles or row-major; `reads_layout`), values unchanged, so every other variant's product
is checked against the baseline's. x rows are float32 unless SWEEP_X=bf16 (bf16 bits, as the decode step's
products take them from one row up: `TUNE["bf16_rows"]`), which halves the bytes the kernels stage.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import cupy as cp
import numpy as np
from gpu import bench_roofline, graph_time, random_packed  # bench/gpu.py
from step_products import step_products

from decapybara.backend import cupy_ops_extra as ex
from decapybara.backend.gemv_plan import band_rows, band_tiles, e2m1_plain_words, e2m1_split_words
from decapybara.kernels import get_kernel
from decapybara.model.config import named_config
from decapybara.model.quant.elements import bf16_decode

# [N, K] and how many times one decode step runs it, products fused as QwenModel fuses them (bench/step_products.py):
# SWEEP_MODEL's (default the 27B: gate|up, down, qkv|z, out, q|k|v, lm_head; 48 DeltaNet + 16 attention layers; the
# sweeps in docs/perf.md up to the seventh session's had "q" [12288, 5120] x 16 and "k" [1024, 5120] x 32 (k and
# v) where q|k|v is now; the 35B-A3B's: qkv|z, out, q|k|v, lm_head, its experts grouped launches, not timed here)
STEP = step_products(named_config(os.environ.get("SWEEP_MODEL", "qwen3.8-27b")))
# products also timed at M = 12 ("M12 ms": their step-weighted sum); SWEEP_M12 names others, e.g. "gate|up,down,
# qkv|z,out,q|k|v" (the column is then not comparable with docs/perf.md's earlier tables). SWEEP_MW times them at
# another row count (e.g. 4: the one-n-tile kernels; 32: four n-tiles), its column then "M4 ms", "M32 ms"
M12 = tuple(os.environ.get("SWEEP_M12", "gate|up,down,qkv|z").split(","))
MW = int(os.environ.get("SWEEP_MW", "12"))
X_BF16 = os.environ.get("SWEEP_X", "f32") == "bf16"  # x rows in bf16 bits (the steps' products) or float32
L2_CYCLE = 160e6  # bytes of distinct weights a graph cycles through per product

VARIANTS: list[tuple[str, dict[str, Any], tuple[tuple[str, int], ...]]] = [
    ("default", {}, ()),
    ("2/SM s2", {"stages": 2, "blocks_per_sm": 2}, ()),     # 2 resident blocks, 2 register stages
    ("3/SM s1", {"stages": 1, "blocks_per_sm": 3}, ()),     # 3 resident blocks (80 registers), 1 stage
    ("2/SM s4", {"stages": 4, "blocks_per_sm": 2}, ()),     # 4 register stages: a small product's chunks all in flight
    # the small build ("out" under 24 MB of codes on 2 / 2 rather than the default build; the default until the
    # `_1r` kernels, off since)
    ("small build", {"small_bytes": 24_000_000}, ()),
    ("small s4", {"small_bytes": 24_000_000, "small_stages": 4}, ()),  # the small build with 4 register stages
    ("small s3", {"small_bytes": 24_000_000, "small_stages": 3}, ()),
    # the same with the one-row build nowhere (`row1_fill` past 1: no plan fills more than the device), so that
    # one-row products under 24 MB ("out") take the small build rather than `row1_warps`'
    ("small only", {"small_bytes": 24_000_000, "row1_fill": 1.01}, ()),
    ("small s3 only", {"small_bytes": 24_000_000, "small_stages": 3, "row1_fill": 1.01}, ()),
    ("small s4 only", {"small_bytes": 24_000_000, "small_stages": 4, "row1_fill": 1.01}, ()),
    ("auto_fill 0.85", {"auto_fill": 0.85}, ()),             # stream-K below 85% of a wave (before the ninth session)
    ("stream-K", {"policy": "stream"}, ()),                   # every product stream-K
    ("min_chunks 4", {"min_chunks": 4}, ()),                  # stream-K blocks of at least 4 chunks (one-row "out")
    ("ksplit 1", {"ksplit": 1}, ()),                         # no K split (one-row gate|up: 272 blocks, no partial sums)
    ("ksplit 2", {"ksplit": 2}, ()),                         # every product on a tile grid of 2 / 3 / 4 K splits
    ("ksplit 3", {"ksplit": 3}, ()),
    ("ksplit 4", {"ksplit": 4}, ()),
    ("M12 2/SM s2", {"wide_blocks_per_sm": 2, "wide_stages": 0, "wide_warps": 8}, ()),  # two-n-tile kernels as before MXFP4's 3/1
    ("diag", {}, (("MX_DIAG", 1),)),
    ("diag nt1", {}, (("MX_DIAG", 2),)),                  # two-n-tile kernels: the first n-tile's MMAs only
    ("diag nt1 nodecode", {}, (("MX_DIAG", 3),)),
    ("diag nostage", {}, (("MX_DIAG", 4),)),              # no x staging (its barriers kept)
    ("diag nt1 nostage", {}, (("MX_DIAG", 6),)),
    ("diag all", {}, (("MX_DIAG", 7),)),                  # none of the three
    ("row1 off", {"row1": 0}, ()),                        # one-row MXFP4 / NVFP4 on the `_1` kernels (an FMA a code pair)
    ("diag row1 off", {"row1": 0}, (("MX_DIAG", 1),)),
    ("plain E2M1", {"e2m1_split": 0}, ()),                # MXFP4 / NVFP4 codes as plain nibbles (before MX_E2M1)
    ("row-major", {"tiled": 0}, ()),                      # MXFP4 / NVFP4 codes row by row (before MX_TILED)
    # `warps`: the one-n-tile kernels' blocks (and those past 16 rows where `many_warps` is 0); `wide_warps`: the
    # two-n-tile ones'.
    # Blocks an SM: blocks_per_sm x 8 / warps (at least 1), e.g. MXFP4's 3 at 10 warps: 2
    ("4 warps", {"warps": 4}, ()),                        # 64-row tiles: twice the tiles of a one-row product
    ("12 warps", {"warps": 12}, ()),                      # 192-row tiles: x staged once for more rows
    ("24 warps", {"warps": 24}, ()),                      # 384-row tiles, one block an SM
    ("wide 8 warps", {"wide_warps": 8}, ()),              # two-n-tile blocks of 8 warps (before the fifteenth session)
    ("wide 24 warps", {"wide_warps": 24}, ()),            # one two-n-tile block of 24 warps an SM
    ("wide 24 nostage", {"wide_warps": 24}, (("MX_DIAG", 4),)),
    ("wide 8 nostage", {"wide_warps": 8}, (("MX_DIAG", 4),)),
    ("wide 16 warps s2", {"wide_warps": 16, "wide_blocks_per_sm": 2, "wide_stages": 2}, ()),  # one of 16, 2 stages
    ("wide 12 3/SM s1", {"wide_warps": 12, "wide_blocks_per_sm": 3, "wide_stages": 1}, ()),  # MXFP4's before, any format
    ("wide 10 3/SM s1", {"wide_warps": 10, "wide_blocks_per_sm": 3, "wide_stages": 1}, ()),  # MXFP4's / NVFP4's: 92 registers
    ("wide 20 warps", {"wide_warps": 20}, ()),            # one two-n-tile block of 20 warps an SM (96 registers)
    # two register stages (a chunk's codes in flight while the one before is computed; ptxas, MXFP4 `_2` / `_2s`):
    # 2 blocks of 10 warps spill (52 / 60 bytes at 96 registers), one block of 10 warps takes 129 / 130
    ("wide 10 3/SM s2", {"wide_warps": 10, "wide_blocks_per_sm": 3, "wide_stages": 2}, ()),
    ("wide 10 2/SM s2", {"wide_warps": 10, "wide_blocks_per_sm": 2, "wide_stages": 2}, ()),  # one block an SM
    # the two-n-tile kernels' x staging rows (`wide_segk`): the nominal 1024 codes, and 2688 in dynamic shared memory
    ("wide segk 1024", {"wide_segk": 1024}, ()),
    ("wide segk 2688", {"wide_segk": 2688}, ()),
    ("part batch 1", {"part_batch": 1}, ()),              # a split tile's partial sums loaded one at a time (before)
    # each register stage's next chunk loaded inside the current chunk's MMAs (TUNE `early`: bits 1 one-row, 2 the
    # other one-n-tile kernels, 4 two n-tiles, 8 four and eight; MX_EARLY; one-row MXFP4 products under `row1_warps`
    # take bit 1 whatever these say)
    ("early 0", {"early": 0}, ()), ("early 5", {"early": 5}, ()), ("early 7", {"early": 7}, ()),
    # bits 2 and 8 each beside bit 4 (the forty-second session's comparisons with the then default, 4)
    ("early 6", {"early": 6}, ()), ("early 12", {"early": 12}, ()),
    # the one-row products' own build (`row1_warps`; MXFP4: 10 warps, two an SM at 96 registers, the early refill):
    # off (the blocks of `warps`, 8, three an SM, one stage, no refill at one row), or 10 warps with two register
    # stages and no refill; on for every one-row product whatever its plan fills (`row1_fill` 0), or wherever it
    # fills `row1_fill` whatever the plain build's plan fills (`row1_vs_plain` 0: the forty-seventh session's rule)
    ("r1 off", {"row1_warps": 0}, ()), ("r1 10w s2", {"row1_warps": 0, "warps": 10, "stages": 2}, ()),
    ("r1 all", {"row1_fill": 0}, ()), ("r1 fill only", {"row1_vs_plain": 0}, ()),
    # more warps an SM for the one-row products at fewer registers (`blocks_per_sm` sets the one-n-tile builds'
    # launch bounds, so the plain one-n-tile build too): 3 blocks of 10 warps or 4 of 8 at 64 registers (ptxas,
    # MXFP4 `_1r`: 80-88 bytes spilled), 5 of 8 at 48 (348)
    ("r1 3x10 64r", {"blocks_per_sm": 4}, ()), ("r1 4x8 64r", {"row1_warps": 8, "blocks_per_sm": 4}, ()),
    ("r1 5x8 48r", {"row1_warps": 8, "blocks_per_sm": 5}, ()),
    ("r1 4x8 64r all", {"row1_warps": 8, "blocks_per_sm": 4, "row1_fill": 0}, ()),
    # two register stages with the early refill (twice the bytes a warp has in flight): 2 blocks of 10 warps at 96
    # registers (ptxas, MXFP4 `_1r`: 40 bytes spilled), 2 of 8 at 128 (28)
    ("r1 2x10 s2", {"stages": 2}, ()), ("r1 2x8 s2", {"row1_warps": 8, "blocks_per_sm": 2, "stages": 2}, ()),
    # the kernels of 4 and 8 n-tiles (17-64 rows; SWEEP_MW): (`many_warps` a block, `many_segk` x staging codes a
    # row (0: the nominal 2048 / n-tiles; longer in dynamic shared memory), `many_stages` register stages (0: 2)),
    # each named in full so that a variant means the same under any default (the default: 16, 1024, 1)
    *((name, {"many_warps": w, "many_segk": k, "many_stages": st}, ()) for name, w, k, st in (
        ("many 8 nominal", 8, 0, 0),  # the kernels as before the forty-third session
        ("many 12", 12, 0, 0), ("many 16", 16, 0, 0), ("many segk 1024", 8, 1024, 0),
        ("many segk 1024 s4", 8, 1024, 4), ("many 12 segk 1024", 12, 1024, 0), ("many 12 segk 2048", 12, 2048, 0),
        ("many 16 segk 1024", 16, 1024, 0), ("many 12 segk 1024 s4", 12, 1024, 4),
        ("many 16 segk 1024 s1", 16, 1024, 1), ("many 16 segk 1536", 16, 1536, 0),
        ("many 12 segk 1536", 12, 1536, 0), ("many 24 segk 1024", 24, 1024, 0))),
]
# An older decapybara/kernels/mx_gemv.cu saved as decapybara/kernels/mx_gemv_prev.cu (e.g. `git show
# REV:decapybara/kernels/mx_gemv.cu`) is measured in the same run, against the same reference products.
if (Path(__file__).resolve().parents[1] / "decapybara" / "kernels" / "mx_gemv_prev.cu").exists():
    VARIANTS.insert(0, ("previous kernel", {"source": "mx_gemv_prev"}, ()))
if os.environ.get("SWEEP_VARIANTS"):  # e.g. "default,3/SM s1"
    VARIANTS = [v for v in VARIANTS if v[0] in os.environ["SWEEP_VARIANTS"].split(",")]


def reads_layout(tune: dict, fmt: str, shape: tuple[int, ...]) -> tuple[bool, bool]:
    """(split, tiled): whether the kernel of a variant (TUNE overrides `tune`) reads `fmt` codes of `shape` in
    the split-field layout and in band tiles: its `e2m1_split` / `tiled` for an E2M1 format, in a kernel file
    that knows MX_E2M1 / MX_TILED (an older one reads plain, row-major codes)."""
    full = ex.tune_for(fmt, {**ex.TUNE, **tune})
    return (ex.e2m1_layout(fmt, full["e2m1_split"]) and ex.kernel_knows(full["source"], "MX_E2M1"),
            ex.tile_layout(fmt, shape, full["tiled"]) and ex.kernel_knows(full["source"], "MX_TILED"))


def relayout(weights: dict, tune: dict) -> None:
    """Every E2M1 weight of `weights` (name -> PackedWeights) repacked into the code layouts the kernel of
    variant `tune` reads, where it is in others: same values, so products stay comparable across variants."""
    for ws in weights.values():
        for w in ws:
            if w.fmt not in ex.E2M1_FMTS:
                continue
            split, tiled = reads_layout(tune, w.fmt, w.codes.shape)
            piece = ex.scale_piece(w.fmt)
            if w.tiled and not tiled:
                w.codes, w.scales, w.tiled = band_rows(w.codes), band_rows(w.scales, piece), False
            if w.e2m1_split != split:
                w.codes = e2m1_split_words(w.codes) if split else e2m1_plain_words(w.codes)
                w.e2m1_split = split
            if tiled and not w.tiled:
                w.codes, w.scales, w.tiled = band_tiles(w.codes), band_tiles(w.scales, piece), True
    cp.cuda.Device().synchronize()  # the repacks run on the default stream, the timed graphs on their own


def precompile(variants: list, fmts: list[str]) -> None:
    """Build every (variant, format, tile) kernel up front, nvcc processes side by side."""
    jobs = set()
    for _, tune, defines in variants:
        for f in fmts:
            full = ex.tune_for(f, {**ex.TUNE, **tune})
            builds = [(1, full), (2, full)] + ([(1, ex.small_tune(full))] if full["small_bytes"] else [])
            builds += [(1, ex.row1_tune(full))] if full.get("row1_warps") else []
            for nt, t in builds:
                jobs.add((full["source"], f"mx_gemm_{f}_{nt}", (*ex.gemm_defines(t, f, *reads_layout(tune, f, (16, 128))),
                                                                *defines)))
    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 4)) as pool:
        list(pool.map(lambda j: get_kernel(*j), sorted(jobs)))


@contextlib.contextmanager
def tuned(tune: dict, defines: tuple) -> Iterator[None]:
    """ex.TUNE updated by `tune` and ex.TUNE_DEFINES set to `defines` inside the block, restored after."""
    saved, saved_d = dict(ex.TUNE), ex.TUNE_DEFINES
    ex.TUNE.update(tune)
    ex.TUNE_DEFINES = defines
    try:
        yield
    finally:
        ex.TUNE.clear()
        ex.TUNE.update(saved)
        ex.TUNE_DEFINES = saved_d


def values(y: Any) -> np.ndarray:
    """A product's output on the host as float64 values: y comes in x's type, so in bf16 bits under SWEEP_X=bf16
    (compared as integers, a rounding that flips a near-zero output's sign reads as a relative error of ~1)."""
    y = cp.asnumpy(y)
    return (bf16_decode(y) if y.dtype == np.uint16 else y).astype(np.float64)


def run_variant(weights: dict, xs: dict, copy_bw: float, ref: dict | None) -> dict[str, Any]:
    """Times every product under the current tuning; with `ref`, also the largest relative error against it."""
    out: dict[str, Any] = {}
    step_us, wide_us = 0.0, 0.0
    for name, ((n, k), count) in STEP.items():
        ws = weights[name]
        for m in (1, MW) if name in M12 else (1,):
            x = xs[m, k]
            state = {"i": 0}

            def call(ws=ws, x=x, state=state) -> None:
                ex.mx_linear(x, ws[state["i"] % len(ws)])
                state["i"] += 1

            calls = max(10, 2 * len(ws))
            t = graph_time(call, calls=calls, reps=3)
            out[f"{name} M{m}"] = {"us": t * 1e6, "pct_copy": 100 * ws[0].nbytes / t / 1e9 / copy_bw}
            if m == 1:
                step_us += count * t * 1e6
            else:
                wide_us += count * t * 1e6
        if ref is not None:  # a real variant must compute the same products as the baseline
            got = values(ex.mx_linear(xs[1, k], ws[0]))
            err = float(np.max(np.abs(got - ref[name])) / (np.max(np.abs(ref[name])) + 1e-30))
            if err > out.get("max_rel_err_vs_base", 0.0):
                out["max_rel_err_vs_base"], out["worst_product"] = err, name
    out["step_us_M1"] = step_us
    out["step_us_wide"] = wide_us  # the M12-named products at MW rows (default 12), weighted by their count
    out["rows_wide"] = MW
    return out


def main() -> None:
    fmts = sys.argv[1:] or ["mxfp4"]
    out_dir = Path(os.environ.get("OUT", "."))
    t0 = time.perf_counter()
    precompile(VARIANTS, fmts)
    print(f"compiled {len(VARIANTS)} variants x {fmts} in {time.perf_counter() - t0:.0f} s")
    copy_bw = bench_roofline()
    results: dict[str, Any] = {"copy_GBps": copy_bw, "variants": {}}
    for fmt in fmts:
        cp.random.seed(1)
        weights = {}
        for name, ((n, k), _) in STEP.items():
            one = random_packed(fmt, (n, k))
            weights[name] = [one] + [random_packed(fmt, (n, k)) for _ in range(int(L2_CYCLE // one.nbytes))]
        xs = {(m, k): cp.random.standard_normal((m, k), cp.float32) for m in (1, MW)
              for k in sorted({k for (_, k), _ in STEP.values()})}
        if X_BF16:  # x in bf16 bits (rounded toward zero), as the decode step's products take it (TUNE bf16_rows)
            xs = {key: (v.view(cp.uint32) >> 16).astype(cp.uint16) for key, v in xs.items()}
        if os.environ.get("SWEEP_X_ZERO"):  # measurement: x all zeros (does the products' speed depend on values?)
            xs = {key: cp.zeros_like(v) for key, v in xs.items()}
        ref = {name: values(ex.mx_linear(xs[1, k], weights[name][0])) for name, ((n, k), _) in STEP.items()}
        print(f"\n{fmt}: % of copy bandwidth per product (M1 unless marked), step-weighted M1 total")
        cols = [f"{n} M{m}" for n in STEP for m in ((1, MW) if n in M12 else (1,))]
        print(f"{'variant':<24}{'step ms':>8}{f'M{MW} ms':>8} " + " ".join(f"{c[:11]:>11}" for c in cols))
        # the first variant once untimed first: on a freshly started machine the first timed variant ran a few
        # % slow (ninth session: gate|up M1 57.9% where the same kernels gave 65.6% later in the run)
        for vname, tune, defines in [(None, *VARIANTS[0][1:]), *VARIANTS]:
            relayout(weights, tune)
            if vname is None:
                with tuned(tune, defines):
                    run_variant(weights, xs, copy_bw, None)
                continue
            try:
                with tuned(tune, defines):
                    r = run_variant(weights, xs, copy_bw, None if defines else ref)
            except Exception as e:  # noqa: BLE001 - one failing variant must not stop the sweep
                print(f"{vname:<24} failed: {type(e).__name__}: {e}")
                continue
            results["variants"][f"{fmt} {vname}"] = r
            print(f"{vname:<24}{r['step_us_M1'] / 1e3:>8.2f}{r['step_us_wide'] / 1e3:>8.2f} "
                  + " ".join(f"{r[c]['pct_copy']:>11.1f}" for c in cols)
                  + (f"  err {r['max_rel_err_vs_base']:.1e} ({r.get('worst_product', '-')})"
                     if "max_rel_err_vs_base" in r else ""))
        weights = None
        cp.get_default_memory_pool().free_all_blocks()
    (out_dir / "gemv_sweep.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
