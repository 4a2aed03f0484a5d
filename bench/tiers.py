"""Pause / resume of a conversation through the KV tiers against re-prefilling it.

    python bench/tiers.py [--lengths 1024 8192 32768] [--large] [--disk DIR]

Demo model (numpy engine): a conversation of N tokens is prefilled (timed: that is what a resume without
tiers would cost), paused into the RAM tier or the disk tier (encode + checksum + store), and resumed
(fetch + verify + decode + import), then a greedy token is checked to continue identically. `--large` also
moves units with the qwen3.8-27b shapes (bf16 KV of 16 attention layers, fp32 DeltaNet state of 48 layers)
through the same tiers; their re-prefill time is not measured here (no GPU in this run) and is left out.
Prints a table: pause and resume milliseconds per tier, the re-prefill time, ratios, and GB/s moved.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np


def stores_for(tmp: str, ram: bool, salt: bytes):
    from decapybara.kv.disk_tier import DiskTierStore
    from decapybara.kv.ram_tier import RamTierStore
    from decapybara.kv.stores import TierStores
    from decapybara.kv.tiers import KVTiers

    return TierStores(KVTiers(RamTierStore((16 << 30) if ram else 0), DiskTierStore(f"file://{tmp}", 64 << 30)),
                      salt)


def demo_rows(lengths: list[int], tmp: str) -> list[tuple]:
    from decapybara.config import EngineConfig
    from decapybara.engine.engine import Engine
    from decapybara.engine.sampling import SamplingParams
    from decapybara.engine.sequence import Request
    from decapybara.model.load import load_model
    from decapybara.server.config import DEMO_MODEL

    lm = load_model(str(DEMO_MODEL))
    rows = []
    for n in lengths:
        cfg = EngineConfig(page_size=16, num_pages=n // 16 + 64, max_batch_tokens=2048, loop_guard="off",
                           max_model_len=max(n + 64, 4096), enable_prefix_cache=False)
        prompt = np.random.default_rng(n).integers(9, 8192, n).tolist()
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        for tier in ("ram", "disk"):
            engine = Engine(lm.model, cfg)
            stores = stores_for(f"{tmp}/demo-{n}-{tier}", tier == "ram", engine.blocks.salt)
            engine.bundle_store = stores
            engine.add_request(Request(tuple(prompt), params, "c"))
            t0 = time.perf_counter()
            while engine.seqs["c"].num_output == 0:
                engine.step()
            prefill_s = time.perf_counter() - t0
            seq = engine.seqs["c"]
            t0 = time.perf_counter()
            engine.pause(seq)
            pause_s = time.perf_counter() - t0
            nbytes = stores.tiers.ram.used_bytes if tier == "ram" else stores.tiers.disk.used_bytes
            t0 = time.perf_counter()
            assert engine.resume(seq)
            resume_s = time.perf_counter() - t0
            rows.append(("demo", n, tier, nbytes, pause_s, resume_s, prefill_s))
    return rows


def large_rows(lengths: list[int], tmp: str) -> list[tuple]:
    from decapybara.backend.base import HybridState, KVPageData
    from decapybara.engine.runner import SequenceBundle
    from decapybara.model.config import named_config

    cfg = named_config("qwen3.8-27b")
    ps = 512
    rows = []
    rng = np.random.default_rng(0)
    state = HybridState([rng.standard_normal((cfg.linear_conv_dim, 3), np.float32) for _ in cfg.linear_layers],
                        [rng.standard_normal((cfg.linear_num_value_heads, 128, 128), np.float32)
                         for _ in cfg.linear_layers])

    class Seq:  # the facts a conversation unit carries, for a synthetic sequence
        def __init__(self, n: int):
            from decapybara.engine.sampling import SamplingParams
            from decapybara.engine.sequence import Request

            self.request = Request(tuple(range(n)), SamplingParams(), f"large-{n}", "large")
            self.request_id, self.seed, self.arrival, self.tokens = self.request.request_id, 0, 0.0, list(range(n))
            self.num_prompt = self.num_computed = n
            self.num_output = self.num_cached_prompt = self.num_computed_prompt = 0
            self.output_counts, self.loopguard, self.extra_penalty, self.banned = {}, None, 1.0, ()
            self.in_thinking, self.num_pauses, self.num_resumes, self.page_hashes = False, 1, 0, []

    for n in lengths:
        pages = -(-n // ps)
        kv = KVPageData({f"{layer}|{kv}.x": rng.integers(0, 65535, (pages, ps, cfg.num_key_value_heads,
                                                                    cfg.head_dim), dtype=np.uint16)
                         for layer in cfg.attention_layers for kv in ("k", "v")})
        bundle = SequenceBundle(kv, state, n)
        for tier in ("ram", "disk"):
            stores = stores_for(f"{tmp}/large-{n}-{tier}", tier == "ram", b"large")
            seq = Seq(n)
            t0 = time.perf_counter()
            key = stores.put(seq, bundle)
            pause_s = time.perf_counter() - t0
            nbytes = stores.tiers.ram.used_bytes if tier == "ram" else stores.tiers.disk.used_bytes
            t0 = time.perf_counter()
            back = stores.get(seq, key)
            _ = [np.asarray(a).sum() for a in list(back.kv.arrays.values())[:1]]  # touch: the data is really there
            resume_s = time.perf_counter() - t0
            rows.append(("27b-shapes", n, tier, nbytes, pause_s, resume_s, None))
        del kv, bundle
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 8192, 32768])
    ap.add_argument("--large", action="store_true")
    ap.add_argument("--large-lengths", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--disk", default=None, help="directory for the disk tier (default: a temp dir)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.disk) as tmp:
        rows = demo_rows(args.lengths, tmp)
        if args.large:
            rows += large_rows(args.large_lengths, tmp)
    print(f"\n{'model':<11} {'tokens':>7} {'tier':<5} {'MB':>8} {'pause ms':>9} {'resume ms':>10} "
          f"{'re-prefill ms':>14} {'prefill/resume':>15} {'resume GB/s':>12}")
    for model, n, tier, nbytes, p, r, pre in rows:
        pre_ms = f"{pre * 1e3:14.1f}" if pre is not None else f"{'-':>14}"
        ratio = f"{pre / r:15.1f}" if pre is not None else f"{'-':>15}"
        print(f"{model:<11} {n:>7} {tier:<5} {nbytes / 1e6:>8.1f} {p * 1e3:>9.1f} {r * 1e3:>10.1f} {pre_ms} {ratio} "
              f"{nbytes / r / 1e9:>12.2f}")


if __name__ == "__main__":
    main()
