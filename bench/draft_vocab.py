"""What the MTP head's draft vocabulary (EngineConfig.draft_vocab: its guesses among the ids below it) saves and costs.

    python3 bench/draft_vocab.py demo            # drafts on the CPU demo model: steps, drafts, acceptance by size
    PYTHONUNBUFFERED=1 python3 bench/draft_vocab.py gpu [variant]   # the 27B head's pass by size; JSON to $OUT

`demo`: the embedded demo model (8,192 ids) on numpy, speculator mtp with up to 3 drafts a step, every draft
verified (the governor off), code prompts, greedy, 1 and 12 agents of 96 tokens; for each draft vocabulary (0: the
whole, then 4,096 down to 256 ids): steps, drafts made, accepted, tokens a step an agent, and the share of the
generated tokens below the size (what a guess can hit at all). The outputs are checked equal to speculation off.

`gpu`: the `qwen3.8-27b` shapes with their random MTP head (bench/gpu.py with BENCH_MTP=1: seeded random weights
on the device, weights in `variant`, default mxfp4), the head's pass after a decode (one (hidden, token) pair a
sequence at 1k context, `DecodeGraphRunner.mtp`: its layer, final norm, LM head over the draft vocabulary and the
guesses' argmax) through its CUDA graph, medians of 20 replays, at 1 and 12 sequences, for the LM head in the
variant's format, MXFP8 (the medium preset's) and bf16 (xxl's), and draft vocabularies 0 (all 248,320 ids),
65,536, 32,768 (the default) and 16,384, each with seven eos and markup ids past it (`EXTRA`, as an engine adds
its tokenizer's: a second small product over their gathered rows).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SIZES = (0, 4096, 2048, 1024, 512, 256)
GPU_SIZES = (0, 65536, 32768, 16384)
EXTRA = (248044, 248045, 248046, 248058, 248059, 248068, 248069)  # eos and markup ids past the slice, as an engine's


def demo() -> None:
    from decapybara.backend.numpy_backend import NumpyBackend
    from decapybara.config import DEMO_MODEL, EngineConfig
    from decapybara.engine.engine import Engine
    from decapybara.engine.sampling import SamplingParams
    from decapybara.model.load import load_model

    loaded = load_model(str(DEMO_MODEL), NumpyBackend())
    tok = loaded.tokenizer
    code = ["def main():\n    print(", "import os\nimport sys\n\n\ndef ", "class Stack:\n    def __init__(self):\n",
            "    for i in range(10):\n        if i % 2", "# Return the JSON document at path\ndef read_json(path):\n",
            "async def fetch(url):\n", "with open(path) as f:\n", "try:\n    import numpy\nexcept"]
    params = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    print(f"{'agents':>6}{'vocab':>7}{'steps':>7}{'drafts':>8}{'accepted':>10}{'tok/step/agent':>16}{'covered':>9}"
          f"{'s':>7}")
    for agents in (1, 12):
        prompts = [tok.encode(code[i % len(code)] + "    " * (i // len(code))) for i in range(agents)]

        def engine(speculator: str, vocab: int) -> Engine:
            return Engine(loaded.model, EngineConfig(speculator=speculator, draft_len=3, draft_vocab=vocab,
                                                     page_size=16, num_pages=512, max_batch_tokens=512,
                                                     max_model_len=4096,
                                                     loop_guard="off", spec_adaptive=False), tokenizer=tok)
        plain = engine("off", 0)
        ref = plain.generate(prompts, params)
        out = [t for o in ref for t in o]
        print(f"{agents:>6}{'off':>7}{plain.stats.steps:>7}{'':>8}{'':>10}{len(out) / plain.stats.steps / agents:>16.2f}")
        for vocab in SIZES:
            e = engine("mtp", vocab)
            t = time.perf_counter()
            got = e.generate(prompts, params)
            wall = time.perf_counter() - t
            assert got == ref, f"vocab {vocab}: outputs differ from speculation off"
            covered = sum(t < (vocab or tok.vocab_size) for t in out) / len(out)
            print(f"{agents:>6}{vocab or 'all':>7}{e.stats.steps:>7}{e.stats.drafted_tokens:>8}"
                  f"{e.stats.accepted_tokens:>10}{len(out) / e.stats.steps / agents:>16.2f}{covered:>9.3f}{wall:>7.1f}")


def gpu(variant: str) -> None:
    os.environ.setdefault("BENCH_MTP", "1")  # bench/gpu.py keeps the preset's MTP head
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import cupy as cp
    import gpu as B  # bench/gpu.py

    from decapybara.backend.cuda_graph import DecodeGraphRunner

    assert B.CFG.mtp_num_hidden_layers, "the config has no MTP head"
    kv, _states, model = B.decode_setup(variant)
    shape = (B.CFG.vocab_size, B.CFG.hidden_size)
    res: dict[str, Any] = {}
    for head in dict.fromkeys((variant, "mxfp8", "bf16")):
        model.w["lm_head.weight"] = B.random_packed(head, shape)
        model.w["lm_head.weight"].persistent = True
        model._draft_heads.clear()
        for b in (1, 12):
            pairs, hidden = B.mtp_pairs(b, 1024)
            for vocab in GPU_SIZES:
                runner = DecodeGraphRunner(model, max_pages=B.SEQ_PAGES, pad_page=kv.num_pages - 1, pad_slot=B.SLOTS,
                                           draft_head=model.draft_head(vocab, EXTRA))
                got = runner.mtp(pairs, hidden, kv)
                assert got is not None, f"the MTP pass did not replay a graph: {runner.stats}"
                if vocab:
                    assert all(g < vocab or g in EXTRA for g in cp.asnumpy(got[0]).tolist())
                ms = B.median_time(lambda r=runner, p=pairs, h=hidden: r.mtp(p, h, kv), 20, warmup=3) * 1e3
                res[f"{head} b{b} v{vocab}"] = ms
                del runner
                cp.get_default_memory_pool().free_all_blocks()
    print(f"\nthe MTP head's pass (graph replay, median ms; x: against the whole vocabulary), {variant} model")
    print(f"{'LM head':<9}{'seqs':>5}" + "".join(f"{(v or 'all'):>16}" for v in GPU_SIZES))
    for head in dict.fromkeys((variant, "mxfp8", "bf16")):
        for b in (1, 12):
            whole = res[f"{head} b{b} v0"]
            cells = "".join(f"{res[f'{head} b{b} v{v}']:>8.3f} ({res[f'{head} b{b} v{v}'] / whole:.2f}x)"
                            for v in GPU_SIZES)
            print(f"{head:<9}{b:>5}{cells}")
    (Path(os.environ.get("OUT", ".")) / "draft_vocab.json").write_text(json.dumps({"variant": variant, "ms": res},
                                                                                  indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "gpu":
        gpu(sys.argv[2] if len(sys.argv) > 2 else "mxfp4")
    else:
        demo()
