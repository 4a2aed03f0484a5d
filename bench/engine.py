"""Engine throughput on the CPU (numpy backend) against HF transformers `generate` on the same weights.

    python bench/engine.py [--family qwen3_5_text] [--prompt 128] [--new 64] [--streams 1 12]

Both sides run float32 on the same random model (demo-model shape: hidden 256, 8 layers, vocab 8192),
greedy, same prompts (equal lengths, so HF needs no padding). Prints one row per stream count: end-to-end
generated tokens/s (prefill included) of each, and our/HF ratio; with --check, also that greedy tokens agree.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np


def build(family: str, seed: int):
    from decapybara.testing import tiny_qwen

    overrides = {"vocab_size": 8192, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 8,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 4096}
    if "qwen3_5" in family:
        overrides.update(linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=4,
                         linear_num_value_heads=8)
    if "moe" in family:
        overrides.pop("intermediate_size")
        overrides.update(moe_intermediate_size=128, num_experts=16, num_experts_per_tok=4)
        if "qwen3_5" in family:
            overrides.update(shared_expert_intermediate_size=256)
    return tiny_qwen(family, seed=seed, overrides=overrides)


def run_ours(model, prompts: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    from decapybara.config import EngineConfig
    from decapybara.engine.engine import Engine
    from decapybara.engine.sampling import SamplingParams

    n = len(prompts)
    cfg = EngineConfig(max_slots=max(n, 1), page_size=16, num_pages=64 * n + 64, max_batch_tokens=2048,
                       loop_guard="off", enable_prefix_cache=False)
    engine = Engine(model, cfg)
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    return time.perf_counter() - t0, outs


def run_hf(hf, prompts: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    import torch

    ids = torch.tensor(prompts)
    with torch.no_grad():
        t0 = time.perf_counter()
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, pad_token_id=0, eos_token_id=None)
        dt = time.perf_counter() - t0
    return dt, out[:, ids.shape[1]:].tolist()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default="qwen3_5_text")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 12])
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    model, hf = build(args.family, seed=0)
    rng = np.random.default_rng(0)
    rows = []
    for n in args.streams:
        prompts = rng.integers(0, 8192, (n, args.prompt)).tolist()
        run_ours(model, prompts[:1], 4)  # warm-up
        t_ours, ours = run_ours(model, prompts, args.new)
        t_hf, theirs = run_hf(hf, prompts, args.new)
        same = sum(a == b for a, b in zip(ours, theirs)) if args.check else None
        tok = n * args.new
        rows.append((n, tok / t_ours, tok / t_hf, same))
    print(f"\nfamily={args.family} prompt={args.prompt} new={args.new} cpu_count={os.cpu_count()} (float32, greedy)")
    print(f"{'streams':>8} {'ours tok/s':>11} {'HF tok/s':>10} {'ours/HF':>8}" + ("  greedy-equal" if args.check else ""))
    for n, a, b, same in rows:
        extra = f"  {same}/{n}" if same is not None else ""
        print(f"{n:>8} {a:>11.1f} {b:>10.1f} {a / b:>8.2f}" + extra)
    if len(rows) > 1:
        print(f"12-stream / 1-stream (ours): {rows[-1][1] / rows[0][1]:.2f}x; HF: {rows[-1][2] / rows[0][2]:.2f}x")


if __name__ == "__main__":
    main()
