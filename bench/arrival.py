"""What decoding agents get while another agent's prompt is prefilled, and that prompt's time to its first token.

    PYTHONUNBUFFERED=1 python3 bench/arrival.py          # table last; JSON to $OUT/arrival.json
    ARRIVAL_CASES=1024:tails,1024:eager ARRIVAL_PROMPT=8192 python3 bench/arrival.py

Builds `qwen3.8-27b` with seeded random MXFP4 weights on the device (bench/gpu.py's `build_model`). Each case is an
`Engine` as the server makes one on CUDA (CUDA graphs on, 16/16 KV pages of 512 tokens, the balanced prefill
policy) with `max_batch_tokens` B and piecewise graphs on ("tails") or off ("eager"): eleven agents with prompts
of 1,000 + 4 i tokens decode (greedy, no end) and, once their steps are graph replays, a twelfth agent's prompt of
ARRIVAL_PROMPT (4,096) fresh tokens arrives. Until that prompt's first token the bench records the wall time
(its time to first token), the eleven's tokens (their tok/s during the prefill: what an arrival costs the
others) and each step's rows and wall. The arrival runs twice: the first warms the eager steps' caches and
captures their tails, the second is the one reported (its request a new prompt, so nothing is reused). The
eleven's tok/s with no arrival, over the same number of steps after it, is the baseline.

Cases (ARRIVAL_CASES, comma list of B:tails or B:eager): 512, 1024 and 2048 tokens, each with and without tails.
ARRIVAL_WEIGHTS=bf16 builds the model with bf16 copies of its product weights (`prefill_weights=bf16`).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import cupy as cp
from gpu import CFG, build_model  # bench/gpu.py

from decapybara.config import EngineConfig
from decapybara.engine.engine import Engine
from decapybara.engine.sampling import SamplingParams
from decapybara.engine.sequence import Request

AGENTS = 11
PROMPT = int(os.environ.get("ARRIVAL_PROMPT", "4096"))
CASES = [c.strip() for c in os.environ.get(
    "ARRIVAL_CASES", "512:tails,512:eager,1024:tails,1024:eager,2048:tails,2048:eager").split(",") if c.strip()]
WEIGHTS = os.environ.get("ARRIVAL_WEIGHTS", "packed")  # bf16: the server's prefill_weights=bf16 (bf16 copies)
GREEDY = SamplingParams(temperature=0, max_tokens=1024, ignore_eos=True)


def make_engine(model: Any, budget: int, tails: bool) -> Engine:
    pages = AGENTS * 6 + 2 * (PROMPT // 512 + 2) + 2
    cfg = EngineConfig(max_slots=12, page_size=512, num_pages=pages, max_batch_tokens=budget, kv_mode="16/16",
                       loop_guard="off", enable_prefix_cache=False, max_model_len=16384,
                       prefill_policy="balanced", piecewise_graphs=tails)
    return Engine(model, cfg)


def arrival(e: Engine, rng: np.random.Generator, agents: set[str]) -> dict[str, Any]:
    """A fresh prompt of PROMPT tokens arrives; steps until its first token."""
    req = Request(tuple(rng.integers(0, CFG.vocab_size, PROMPT).tolist()), SamplingParams(temperature=0, max_tokens=1))
    e.add_request(req)
    t0, tokens, walls = time.perf_counter(), 0, []
    while True:
        t = time.perf_counter()
        events = e.step()
        cp.cuda.Device().synchronize()
        walls.append(time.perf_counter() - t)
        tokens += sum(len(ev.token_ids) for ev in events if ev.request_id in agents)
        if any(ev.request_id == req.request_id and ev.token_ids for ev in events):
            break
    ttft = time.perf_counter() - t0
    while e.has_work() and any(s.request.request_id == req.request_id for s in e.running):
        e.step()  # its one token done: it leaves
    return {"ttft_s": ttft, "steps": len(walls), "agents_tok_s": tokens / ttft,
            "step_ms_median": statistics.median(walls) * 1e3, "step_ms_max": max(walls) * 1e3}


def run_case(model: Any, case: str) -> dict[str, Any]:
    budget, mode = case.split(":")
    e = make_engine(model, int(budget), mode == "tails")
    rng = np.random.default_rng(3)
    agents = {e.add_request(Request(tuple(rng.integers(0, CFG.vocab_size, 1000 + 4 * i).tolist()), GREEDY)).request.request_id
              for i in range(AGENTS)}
    while any(s.in_prefill for s in e.running) or e.waiting:
        e.step()
    for _ in range(8):
        e.step()
    first = arrival(e, rng, agents)
    for _ in range(4):
        e.step()
    res = arrival(e, rng, agents)
    cp.cuda.Device().synchronize()
    t, tokens = time.perf_counter(), 0
    for _ in range(res["steps"] * 4):
        tokens += sum(len(ev.token_ids) for ev in e.step() if ev.request_id in agents)
    cp.cuda.Device().synchronize()
    res["alone_tok_s"] = tokens / (time.perf_counter() - t)
    res["first_ttft_s"] = first["ttft_s"]
    res["graphs"] = {k: v for k, v in e.runner.graph_stats().items() if isinstance(v, (int, float, bool))}
    print(case, json.dumps(res))
    del e
    cp.get_default_memory_pool().free_all_blocks()
    return res


def main() -> None:
    t0 = time.perf_counter()
    model = build_model("mxfp4", prefill_weights=WEIGHTS)
    cp.cuda.Device().synchronize()
    print(f"model built in {time.perf_counter() - t0:.1f} s")
    out = {case: run_case(model, case) for case in CASES}
    print(f"\n{PROMPT}-token prompt arriving beside {AGENTS} decoding agents, prefill_weights={WEIGHTS}")
    print(f"{'case':<14}{'TTFT s':>8}{'1st TTFT':>9}{'steps':>7}{'step ms':>9}{'max ms':>8}"
          f"{'agents tok/s':>14}{'alone':>8}{'share':>7}")
    for case, r in out.items():
        print(f"{case:<14}{r['ttft_s']:>8.3f}{r['first_ttft_s']:>9.3f}{r['steps']:>7}{r['step_ms_median']:>9.1f}"
              f"{r['step_ms_max']:>8.1f}{r['agents_tok_s']:>14.0f}{r['alone_tok_s']:>8.0f}"
              f"{r['agents_tok_s'] / r['alone_tok_s']:>7.2f}")
    (Path(os.environ.get("OUT", ".")) / "arrival.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
