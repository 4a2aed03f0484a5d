"""What several drafts a step cost at the 27B shape (DRAFT_LEN): a step verifying k drafts a sequence against the
decode step, and the accepted drafts a step that repays it.

    PYTHONUNBUFFERED=1 python3 bench/draft_rows.py [variant]     # default mxfp4; JSON to $OUT/draft_rows.json

Builds the `qwen3.8-27b` shapes as bench/gpu.py does (seeded random weights on the device, bf16 KV pages, random
DeltaNet states), then at DRAFT_SHAPES (sequences x context, default 1x1024,4x1024,1x32768) times, as the engine
runs them (`DecodeGraphRunner.forward` with the piecewise layer tails the server uses), medians of 10 synchronised
steps:
- the decode step (a graph, one row a sequence);
- steps of k = 1..DRAFT_MAX (default 7) drafts a sequence: 1 + k rows, the rollback points after the real token
  and each draft but the last kept on the device, through verification graphs of 1 + k rows a sequence where
  they take k drafts at that width (`DecodeGraphRunner.max_drafts`: the checkpoints of the largest bucket, 12,
  shared by the batch's sequences), else eagerly ("eager k"); "eager 1" is one draft through the eager path, for
  the graphs' share.

Prints ms, the ratio to the decode step, and the tokens a step must emit to repay it (the ratio: a step of ratio r
that emits r tokens a sequence breaks even), with what a chain accepted at a per-draft rate p emits
(1 + p + ... + p^k) for p = 0.6 and 0.8; then the device memory each graph's own pool holds (its activations,
logits and outputs), by rows a sequence, and the rollback checkpoints'.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import cupy as cp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu as B

from decapybara.backend.cuda_graph import DecodeGraphRunner
from decapybara.backend.piecewise import PiecewiseTails
from decapybara.model.batch import ForwardBatch

SHAPES = [tuple(int(v) for v in s.split("x")) for s in os.environ.get("DRAFT_SHAPES", "1x1024,4x1024,1x32768").split(",")]
DRAFT_MAX = int(os.environ.get("DRAFT_MAX", "7"))


def draft_batch(b: int, ctx: int, k: int) -> ForwardBatch:
    """`b` sequences ending at `ctx` tokens, each its last real token and `k` drafts, logits of every row, the
    rollback points after the real token and each draft but the last kept on the device (as the engine asks)."""
    p0 = ctx - 1 - k
    batch = ForwardBatch.build([([7 + i, *range(11 + i, 11 + i + k)], p0,
                                 np.arange(i * B.SEQ_PAGES, (i + 1) * B.SEQ_PAGES, dtype=np.int32), i)
                                for i in range(b)], B.PAGE, logits="all",
                               snapshot_at=[tuple(range(p0 + 1, p0 + 1 + k))] * b)
    batch.device_snapshots = frozenset((i, q) for i in range(b) for q in range(p0 + 1, p0 + 1 + k))
    return batch


def chain_tokens(p: float, k: int) -> float:
    return sum(p ** i for i in range(k + 1))


def main() -> None:
    variant = sys.argv[1] if len(sys.argv) > 1 else "mxfp4"
    kv, states, model = B.decode_setup(variant)
    runner = DecodeGraphRunner(model, max_pages=B.SEQ_PAGES, pad_page=kv.num_pages - 1, pad_slot=B.SLOTS,
                               tails=PiecewiseTails())
    res: dict[str, Any] = {}
    for b, ctx in SHAPES:
        row: dict[str, float] = {}
        dec_batch = B.decode_batch(b, ctx)
        row["decode"] = B.median_time(lambda d=dec_batch: runner.forward(d, kv, states), 10, warmup=3)
        for k in range(1, DRAFT_MAX + 1):
            batch = draft_batch(b, ctx, k)
            if k == 1:  # the eager path for one draft (the model's own forward, the runner's piecewise tails)
                row["eager 1"] = B.median_time(lambda batch=batch: model.forward(batch, kv, states, tails=runner.tails),
                                               10, warmup=3)
            graph = k <= runner.max_drafts(b, kv)
            assert (runner.ineligible(batch, kv) is None) == graph, runner.ineligible(batch, kv)
            steps = runner.stats["graph_steps"]
            row[f"{'graph' if graph else 'eager'} {k}"] = B.median_time(
                lambda batch=batch: runner.forward(batch, kv, states), 10, warmup=3)
            assert (runner.stats["graph_steps"] > steps) == graph, runner.stats["failures"]
        res[f"{b}x{ctx}"] = {n: t * 1e3 for n, t in row.items()}
        dec = row["decode"]
        print(f"\n{b}x{ctx}: decode step {dec * 1e3:.2f} ms (graph steps {runner.stats['graph_steps']}, eager "
              f"{runner.stats['eager_steps']}, failures {runner.stats['failures']})")
        print(f"{'step':<10}{'ms':>9}{'x decode':>10}{'p=0.6 gain':>12}{'p=0.8 gain':>12}")
        for name, t in row.items():
            k = 0 if name == "decode" else int(name.split()[-1])
            r = t / dec
            print(f"{name:<10}{t * 1e3:>9.2f}{r:>10.3f}{chain_tokens(0.6, k) / r:>12.2f}{chain_tokens(0.8, k) / r:>12.2f}")
        cp.get_default_memory_pool().free_all_blocks()
    pools = {f"b{k[0]} s{k[1]} r{k[2]}": st.pool.total_bytes() / 2**20 for k, st in runner._graphs.items()
             if st.pool is not None}
    print("\ngraph pools, MiB: " + ", ".join(f"{k} {v:.1f}" for k, v in pools.items())
          + f"; checkpoints {runner.checkpoint_bytes() / 2**20:.0f} MiB")
    out = Path(os.environ.get("OUT", "."))
    (out / "draft_rows.json").write_text(json.dumps({"variant": variant, "ms": res, "pool_mib": pools}, indent=1))


if __name__ == "__main__":
    main()
