"""What agents get from the engine on the GPU: decode tokens/s through `Engine.step()` against the bare graph step.

    PYTHONUNBUFFERED=1 python3 bench/engine_gpu.py        # table last; JSON to $OUT/engine_gpu.json

Builds `qwen3.8-27b` with seeded random MXFP4 weights on the device (bench/gpu.py's `build_model`), then for each
case an `Engine` (CUDA graphs on, bf16 KV pages of 512 tokens, the prefix cache on unless the case says
otherwise) with B sequences whose prompts are 1,000 + 4 i tokens (sequence i): the engine prefills them, then
decodes. Over STEPS decode steps (after WARM) it records each step's wall time (`Engine.step()`: plan, forward,
sample, post-process), and in a second, synchronised pass splits a step into the forward (`ModelRunner.run`
and its device work), the sampler (`Backend.sample`) and the rest (the engine's host work). The prompts cross a
512-token page boundary during the decode at different steps, so steps that take a hybrid-state snapshot (an
eager forward) are among them, as in a real run.

First, the device sampler alone (host and device microseconds a call, 1 and 12 rows of 248,320 logits). Cases
(ENGINE_CASES picks some, comma list): sampler "device" (the backend's, the default), "host" (the numpy
reference after copying the logits) or "prev" (bench/sampler.py's SAMPLER_PREV file: an earlier form of the device
sampler), sampling "greedy", "t07" (temperature 0.7, top-p 0.8, top-k 20) or "t10" (temperature 1, no filters:
an API client's defaults), the prefix cache on or "nocache", at 1 and 12 sequences; "ngram1" / "ngram4" (prompt
lookup drafting up to 1 or 4 tokens a step, `speculator=ngram`, every draft verified: the governor off; "repeat" the same prompts without it), whose
prompts repeat a block of 40 random tokens, so drafts are accepted where the random model's greedy output follows
the repetition (or falls into a loop of its own). tok/s counts the tokens the sequences gained over the timed
steps; `accepted` the drafts kept among `drafted`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import cupy as cp
from gpu import CFG, build_model  # bench/gpu.py

from decapybara.backend.base import Backend
from decapybara.config import EngineConfig
from decapybara.engine.engine import Engine
from decapybara.engine.sampling import SamplingParams
from decapybara.engine.sequence import Request

STEPS, WARM = int(os.environ.get("ENGINE_STEPS", "48")), 4
CASES = {  # name -> (sequences, sampler, sampling, prefix cache[, speculator, draft_len])
    "1 device greedy": (1, "device", "greedy", True),
    "12 device greedy": (12, "device", "greedy", True),
    "12 device t07": (12, "device", "t07", True),
    "12 device greedy nocache": (12, "device", "greedy", False),
    "1 host greedy": (1, "host", "greedy", True),
    "12 host greedy": (12, "host", "greedy", True),
    "12 host t07": (12, "host", "t07", True),
    "1 device t07": (1, "device", "t07", True),
    "1 device t10": (1, "device", "t10", True),
    "12 device t10": (12, "device", "t10", True),
    "1 prev t07": (1, "prev", "t07", True),
    "12 prev t07": (12, "prev", "t07", True),
    "1 prev t10": (1, "prev", "t10", True),
    "12 prev t10": (12, "prev", "t10", True),
    "1 greedy repeat": (1, "device", "greedy", True, "off", 1),  # the ngram cases' prompts, no speculation
    "4 greedy repeat": (4, "device", "greedy", True, "off", 1),
    "12 greedy repeat": (12, "device", "greedy", True, "off", 1),
    "1 greedy ngram1": (1, "device", "greedy", True, "ngram", 1),
    "1 greedy ngram4": (1, "device", "greedy", True, "ngram", 4),
    "4 greedy ngram4": (4, "device", "greedy", True, "ngram", 4),
    "12 greedy ngram4": (12, "device", "greedy", True, "ngram", 4),
}
PICK = [c.strip() for c in os.environ.get("ENGINE_CASES", "").split(",") if c.strip()] or list(CASES)


def params(kind: str) -> SamplingParams:
    if kind == "greedy":
        return SamplingParams(temperature=0, max_tokens=4096, ignore_eos=True)
    if kind == "t10":  # an API client's defaults: temperature 1, no filters
        return SamplingParams(temperature=1.0, max_tokens=4096, ignore_eos=True)
    return SamplingParams(temperature=0.7, top_p=0.8, top_k=20, max_tokens=4096, ignore_eos=True)


def make_engine(model: Any, b: int, sampler: str, cache: bool, speculator: str = "off", draft_len: int = 1) -> Engine:
    cfg = EngineConfig(max_slots=12, page_size=512, num_pages=12 * 3 + 2, max_batch_tokens=2048, kv_mode="16/16",
                       loop_guard="off", enable_prefix_cache=cache, max_model_len=4096, speculator=speculator,
                       draft_len=draft_len, spec_adaptive=False)
    e = Engine(model, cfg)
    vars(e.model.backend).pop("sample", None)  # an earlier case's sampler (below) off the shared backend
    if sampler == "host":  # the numpy reference on a host copy of the logits (Backend's default)
        e.model.backend.sample = lambda logits, rows, eos=(): Backend.sample(e.model.backend, logits, rows, eos)
    elif sampler == "prev":  # an earlier form of the device sampler: bench/sampler.py's SAMPLER_PREV file
        from sampler import previous  # bench/sampler.py

        prev = previous()
        e.model.backend.sample = lambda logits, rows, eos=(): prev(logits, rows, eos_token_ids=eos)
    return e


def decode_ready(e: Engine, b: int, kind: str, seed: int, repeat: bool = False) -> None:
    rng = np.random.default_rng(seed)
    for i in range(b):
        n = 1000 + 4 * i
        ids = np.resize(rng.integers(0, CFG.vocab_size, 40), n) if repeat else rng.integers(0, CFG.vocab_size, n)
        e.add_request(Request(tuple(ids.tolist()), params(kind)))
    while any(s.in_prefill for s in e.running) or e.waiting:
        e.step()


def run_case(model: Any, name: str) -> dict[str, Any]:
    b, sampler, kind, cache, *spec = CASES[name]
    e = make_engine(model, b, sampler, cache, *spec)
    decode_ready(e, b, kind, seed=1, repeat=bool(spec))
    for _ in range(WARM):
        e.step()
    cp.cuda.Device().synchronize()
    eager0, walls = e.runner.graph_stats()["eager_steps"], []
    out0 = sum(s.num_output for s in e.running)
    drafted0, accepted0 = e.stats.drafted_tokens, e.stats.accepted_tokens
    for _ in range(STEPS):
        t = time.perf_counter()
        e.step()
        walls.append(time.perf_counter() - t)
    cp.cuda.Device().synchronize()
    eager = e.runner.graph_stats()["eager_steps"] - eager0
    gained = sum(s.num_output for s in e.running) - out0
    drafted, accepted = e.stats.drafted_tokens - drafted0, e.stats.accepted_tokens - accepted0
    # the split: forward (its device work waited for) and the sampler, each synchronised; the rest is host work
    run0, sample0, split = e.runner.run, e.model.backend.sample, {"forward": [], "sample": [], "step": []}

    def timed(fn: Any, key: str) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            out = fn(*a, **k)
            cp.cuda.Device().synchronize()
            split[key].append(time.perf_counter() - t)
            return out
        return wrapper

    e.runner.run, e.model.backend.sample = timed(run0, "forward"), timed(sample0, "sample")
    for _ in range(min(STEPS, 24)):
        t = time.perf_counter()
        e.step()
        split["step"].append(time.perf_counter() - t)
    e.runner.run, e.model.backend.sample = run0, sample0
    w = np.array(walls)
    res = {"sequences": b, "sampler": sampler, "sampling": kind, "prefix_cache": cache, "eager_steps": eager,
           "step_ms_median": float(np.median(w) * 1e3), "step_ms_mean": float(w.mean() * 1e3),
           "step_ms_max": float(w.max() * 1e3), "tok_s": gained / float(w.sum()), "drafted": drafted,
           "accepted": accepted,
           "split_ms": {k: float(np.median(v) * 1e3) for k, v in split.items()}}
    res["split_ms"]["host"] = res["split_ms"]["step"] - res["split_ms"]["forward"] - res["split_ms"]["sample"]
    print(name, json.dumps(res))
    del e
    cp.get_default_memory_pool().free_all_blocks()
    return res


def sampler_alone() -> dict[str, Any]:
    """`cupy_ops_extra.cuda_sample` on [B, 248,320] float32 logits: host and device time (cupyx's benchmark)."""
    from cupyx.profiler import benchmark

    from decapybara.backend import cupy_ops_extra as ex
    from decapybara.engine.sampling import SamplerRow

    out = {}
    for b in (1, 12):
        # peaked, LLM-like: 64 likely tokens, in one id range (the frequent ones, low ids) or anywhere
        for where in ("low ids", "spread"):
            logits = cp.random.standard_normal((b, CFG.vocab_size), cp.float32) * 2.0
            ids = cp.arange(64) if where == "low ids" else cp.random.permutation(CFG.vocab_size)[:64]
            logits[:, ids] += cp.linspace(14.0, 6.0, 64, dtype=cp.float32)
            for kind in ("greedy", "t07"):
                rows = [SamplerRow(params(kind), [], [], position=i, seed=i) for i in range(b)]
                r = benchmark(ex.cuda_sample, (logits, rows), n_repeat=30, n_warmup=3)
                key = f"{b} {kind} {where}"
                out[key] = {"cpu_us": float(np.median(r.cpu_times) * 1e6), "gpu_us": float(np.median(r.gpu_times) * 1e6)}
                print(f"sampler {key}: {out[key]}")
    return out


def main() -> None:
    t0 = time.perf_counter()
    model = build_model("mxfp4")
    cp.cuda.Device().synchronize()
    print(f"model built in {time.perf_counter() - t0:.1f} s")
    sampler = sampler_alone()
    out = {name: run_case(model, name) for name in PICK}
    print(f"\n{'case':<28}{'tok/s':>9}{'median ms':>11}{'mean ms':>9}{'max ms':>9}{'eager':>7}"
          f"{'fwd ms':>9}{'sample':>9}{'host':>8}{'accepted':>14}")
    for name, r in out.items():
        s = r["split_ms"]
        print(f"{name:<28}{r['tok_s']:>9.1f}{r['step_ms_median']:>11.2f}{r['step_ms_mean']:>9.2f}"
              f"{r['step_ms_max']:>9.2f}{r['eager_steps']:>7}{s['forward']:>9.2f}{s['sample']:>9.2f}{s['host']:>8.2f}"
              f"{r['accepted']:>7}/{r['drafted']:<6}")
    (Path(os.environ.get("OUT", ".")) / "engine_gpu.json").write_text(json.dumps({"cases": out, "sampler": sampler},
                                                                                indent=1))


if __name__ == "__main__":
    main()
