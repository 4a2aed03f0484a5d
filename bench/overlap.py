"""Launch overlap in a 27B decode step: graph decode with and without programmatic dependent launch.

    PYTHONUNBUFFERED=1 python3 bench/overlap.py [variant]        # default mxfp4; JSON to $OUT/overlap.json

Builds the `qwen3.8-27b` shapes as bench/gpu.py does (seeded random weights on the device, bf16 KV pages or
OVERLAP_KV's mode, e.g. "6/4"), then for each setting captures fresh decode graphs and times graph steps
(median of 10, synchronised as an engine step) at OVERLAP_SHAPES (batch x context, default
1x1024,12x1024,1x32768,12x32768):

- "before": every kernel launched plainly (stream order: each waits for the one before to finish);
- "pdl": products, norms, gates, KV writes, attention and the DeltaNet decode kernels launched with
  programmatic dependent launch (`pdl.launch`): a product's first weight loads go out while the kernel
  before it finishes, a small kernel is resident and waiting when the product before it ends.

Prints step ms, tok/s and the ratio to the first setting per shape. OVERLAP_TUNES names `cupy_ops_extra.TUNE`
overrides timed under each setting (graphs captured afresh for each), OVERLAP_ROUNDS repeats the sequence.
OVERLAP_STEP times another graph step in place of the decode step: "verify" (a speculative verification step,
each sequence's token and a draft: `gpu.verify_batch`), "mtp" (the MTP head's pass, a pair a sequence; needs
BENCH_MTP=1), e.g. with '{"one": {}, "two": {"attention": {"verify_one_pass": 0}}}'.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
from pathlib import Path
from typing import Any

import cupy as cp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu as B

from decapybara.backend import chain_tails as ct
from decapybara.backend import cupy_attention as ca
from decapybara.backend import cupy_backend as cb
from decapybara.backend import cupy_deltanet as cd
from decapybara.backend import cupy_ops_extra as ex
from decapybara.backend import pdl
from decapybara.backend.cuda_graph import DecodeGraphRunner
from decapybara.backend.gemv_plan import merge_tune

SHAPES = [tuple(int(v) for v in s.split("x"))
          for s in os.environ.get("OVERLAP_SHAPES", "1x1024,12x1024,1x32768,12x32768").split(",")]
SETTINGS = {"before": "0", "pdl": "1"}  # name: $DECAPYBARA_PDL while the graphs are captured
if os.environ.get("OVERLAP_SETTINGS"):  # e.g. "before,pdl"
    SETTINGS = {k: v for k, v in SETTINGS.items() if k in os.environ["OVERLAP_SETTINGS"].split(",")}
# named TUNE overrides (merged as DECAPYBARA_MX_TUNE is), each captured and timed under every setting, e.g.
# '{"": {}, "small": {"small_bytes": 0}}'; OVERLAP_ROUNDS > 1 repeats the whole interleaved sequence (run-to-run
# spread beside the effect). The weights are packed once, before: layout keys (`e2m1_split`, `tiled`) belong in
# DECAPYBARA_MX_TUNE, one run per layout. Four more keys go elsewhere: "pairs" updates cupy_backend.PAIRS (the
# side stream of `linear_pair`), "deltanet" cupy_deltanet.FUSED_DECODE (e.g. {"enabled": false}), "attention"
# cupy_attention.DECODE (e.g. {"fill_ctas": 0, "short_ctas": 0}: decode_splits' rule before its fill and short
# parts; {"graph_cap": 32}: decode graphs' split cap before the fifteenth session),
# "x_f32" names CupyBackend methods whose `to_product` hint is dropped (their rows stay float32), e.g.
# ["paged_attention_gated", "deltanet_core_gated"] (a decode step's attention output gate is applied by
# "paged_attention_gated", other steps' by "sigmoid_gate"); the MLP activation is "silu_mul_halves" and, from TUNE
# `swiglu_rows` rows up, "swiglu"; "moe_norm" false: MoE blocks take their input norm's rows from the norm kernel
# (CupyBackend.moe_takes_product_rows off), not fused into the output projection before them (BENCH_MODEL's MoE);
# "chains" true: the graphs' layer tails as persistent product chains (DecodeGraphRunner(chains=True),
# decapybara/backend/chain_tails.py), "chain" updates chain_tails.CHAIN (e.g. {"prefetch": 8, "min_items": 3}), e.g.
# '{"": {}, "chains": {"chains": true}, "chains 1 build": {"chains": true, "row1_fill": 0}}'
TUNES: dict[str, dict] = json.loads(os.environ.get("OVERLAP_TUNES", '{"": {}}'))
ROUNDS = int(os.environ.get("OVERLAP_ROUNDS", "1"))
STEP = os.environ.get("OVERLAP_STEP", "decode")
assert STEP in ("decode", "verify", "mtp"), f"OVERLAP_STEP {STEP}: decode, verify or mtp"


def timed_step(runner: Any, kv: Any, states: Any, b: int, ctx: int) -> float:
    """Median seconds of OVERLAP_STEP's graph step at b sequences x ctx keys (synchronised as an engine step)."""
    if STEP == "mtp":
        assert B.CFG.mtp_num_hidden_layers, "OVERLAP_STEP=mtp needs BENCH_MTP=1 (a model with an MTP head)"
        pairs, hidden = B.mtp_pairs(b, ctx)
        assert runner.mtp(pairs, hidden, kv) is not None, f"the MTP pass did not replay a graph: {runner.stats}"
        return B.median_time(lambda: runner.mtp(pairs, hidden, kv), 10, warmup=3)
    batch = B.verify_batch(b, ctx) if STEP == "verify" else B.decode_batch(b, ctx)
    return B.median_time(lambda: runner.forward(batch, kv, states), 10, warmup=3)


def without_hint(fn: Any) -> Any:
    """The CupyBackend method `fn` called without its `to_product` hint, passed by keyword or by position (its
    rows then stay float32)."""
    sig = inspect.signature(fn)

    def call(self: Any, *a: Any, **kw: Any) -> Any:
        bound = sig.bind(self, *a, **kw)
        bound.arguments.pop("to_product", None)
        return fn(*bound.args, **bound.kwargs)
    return call


def main() -> None:
    variant = sys.argv[1] if len(sys.argv) > 1 else "mxfp4"
    kv, states, model = B.decode_setup(variant, os.environ.get("OVERLAP_KV", "16/16"))
    res: dict[str, dict[str, float]] = {}
    base_tune, base_pairs, base_dn, base_attn = dict(ex.TUNE), dict(cb.PAIRS), dict(cd.FUSED_DECODE), dict(ca.DECODE)
    base_moe_norm = cb.CupyBackend.moe_takes_product_rows
    base_chain = dict(ct.CHAIN)
    base_methods = {name: getattr(cb.CupyBackend, name) for name in ("sigmoid_gate", "deltanet_core_gated",
                                                                      "silu_mul_halves", "swiglu")}
    runs = [(f"{name} {tname}".strip() + (f" #{r + 1}" if ROUNDS > 1 else ""), pdl_env, tune)
            for r in range(ROUNDS) for name, pdl_env in SETTINGS.items() for tname, tune in TUNES.items()]
    for name, pdl_env, tune in runs:
        pdl.MODE["pdl"] = pdl_env
        tune = dict(tune)
        cb.PAIRS.update({**base_pairs, **tune.pop("pairs", {})})
        cd.FUSED_DECODE.update({**base_dn, **tune.pop("deltanet", {})})
        ca.DECODE.update({**base_attn, **tune.pop("attention", {})})
        for meth, fn in base_methods.items():
            setattr(cb.CupyBackend, meth, fn)
        for meth in tune.pop("x_f32", []):
            setattr(cb.CupyBackend, meth, without_hint(base_methods[meth]))
        cb.CupyBackend.moe_takes_product_rows = bool(tune.pop("moe_norm", base_moe_norm))
        chains = bool(tune.pop("chains", False))
        ct.CHAIN.update({**base_chain, **tune.pop("chain", {})})
        ex.TUNE.clear()
        ex.TUNE.update(merge_tune(base_tune, tune))
        runner = DecodeGraphRunner(model, max_pages=B.SEQ_PAGES, pad_page=kv.num_pages - 1, pad_slot=B.SLOTS,
                                   chains=chains)
        for b, ctx in SHAPES:
            res.setdefault(name, {})[f"{b}x{ctx}"] = timed_step(runner, kv, states, b, ctx) * 1e3
        print(name, {k: round(v, 3) for k, v in res[name].items()}, "graph steps:", runner.stats["graph_steps"],
              "verify steps:", runner.stats["verify_steps"], "mtp steps:", runner.stats["mtp_steps"],
              "failures:", runner.stats["failures"], *(("chains:", runner.chain_stats(),
                                                        "timed out:", any(st.chains.timed_out() for st in
                                                                          runner._graphs.values() if st.chains))
                                                       if chains else ()))
        runner = None
        cp.get_default_memory_pool().free_all_blocks()
    pdl.MODE["pdl"] = os.environ.get("DECAPYBARA_PDL", "1")
    ex.TUNE.clear()
    ex.TUNE.update(base_tune)
    cb.PAIRS.update(base_pairs)
    cd.FUSED_DECODE.update(base_dn)
    ca.DECODE.update(base_attn)
    for meth, fn in base_methods.items():
        setattr(cb.CupyBackend, meth, fn)
    cb.CupyBackend.moe_takes_product_rows = base_moe_norm
    ct.CHAIN.update(base_chain)
    first = next(iter(res))
    print(f"\n{variant}, graph {STEP} steps (ms; tok/s; x vs {first})")
    def cell(row: dict[str, float], b: int, c: int) -> str:
        ms = row[f"{b}x{c}"]
        return f"{ms:7.2f} {b / ms * 1e3:7.1f} {res[first][f'{b}x{c}'] / ms:6.3f}x"

    B.shape_table("setting", res, SHAPES, cell)
    dest = os.environ.get("OUT")
    if dest:
        Path(dest, "overlap.json").write_text(json.dumps({variant: res}, indent=1))


if __name__ == "__main__":
    main()
