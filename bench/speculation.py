"""Speculative decoding with the MTP head against decoding without it, through `Engine.generate` on this
machine's backend (numpy on the CPU; `SPEC_BACKEND=cupy` the cupy backend in float32, with decode graphs unless
`SPEC_GRAPHS=0`): the demo model, 1 / 5 / 12 agents of code prompts, greedy and at temperature 0.7, each setting
run `SPEC_ROUNDS` times interleaved (off, mtp, off, mtp, ...) by one engine a mode after an untimed round (which
captures the graphs and caches the prompts' prefixes), drafts of the head's guesses of probability
`SPEC_CONFIDENCE` and up (default: EngineConfig's `spec_min_confidence`). Prints tok/s (the medians' ratio) and,
of the last round, steps, drafts, accepted drafts and steps whose drafts were withheld; checks that both give the
same tokens. `SPEC_ADAPTIVE=0` verifies every draft (EngineConfig.spec_adaptive off; by default the governor
withholds them where verifying is measured slower). `SPEC_SPECULATOR=ngram` drafts by prompt lookup instead of
the MTP head (the "mtp" columns are then its). `SPEC_FILL=1` fills the spare rows of a step that verifies a draft
with the other agents' doubtful guesses as verification graphs do (`Engine.fill_rows`; on by itself with graphs):
on numpy, where those rows are not free, its steps and acceptance are what counts. `SPEC_DRAFT_LEN` drafts up to
that many tokens a step (EngineConfig.draft_len: the head's guesses chained, or prompt lookup's run).

    python3 bench/speculation.py
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

from decapybara.config import DEMO_MODEL, EngineConfig
from decapybara.engine.engine import Engine
from decapybara.engine.sampling import SamplingParams
from decapybara.model.load import load_model

CODE = ["def main():\n    print(", "import os\nimport sys\n\n\ndef ", "class Stack:\n    def __init__(self):\n",
        "    for i in range(10):\n        if i % 2", "# Return the JSON document at path\ndef read_json(path):\n"]
TEXTS = CODE + [c.replace("def", "async def") for c in CODE] + CODE[:2]


def env_backend() -> tuple[Any, bool]:
    """(backend, decode graphs) as SPEC_BACKEND / SPEC_GRAPHS ask: numpy, or cupy in float32 with graphs."""
    if os.environ.get("SPEC_BACKEND", "numpy") == "cupy":
        from decapybara.backend.cupy_backend import CupyBackend

        return CupyBackend("fp32"), os.environ.get("SPEC_GRAPHS", "1") != "0"
    from decapybara.backend.numpy_backend import NumpyBackend

    return NumpyBackend(), False


def main() -> None:
    backend, graphs = env_backend()
    loaded = load_model(str(DEMO_MODEL), backend)
    rounds = int(os.environ.get("SPEC_ROUNDS", "2"))
    tokens = int(os.environ.get("SPEC_TOKENS", "128"))
    confidence = float(os.environ.get("SPEC_CONFIDENCE", EngineConfig().spec_min_confidence))
    drafter = os.environ.get("SPEC_SPECULATOR", "mtp")
    adaptive = os.environ.get("SPEC_ADAPTIVE", "1") != "0"  # the governor (engine/spec_governor.py); 0: every draft
    draft_len = int(os.environ.get("SPEC_DRAFT_LEN", EngineConfig().draft_len))
    print(f"demo model on {backend.name}{' with decode graphs' if graphs else ''}, {tokens} tokens an agent, "
          f"{rounds} rounds, up to {draft_len} drafts of p >= {confidence:g}"
          f"{', spare rows filled' if os.environ.get('SPEC_FILL') == '1' else ''}, drafter {drafter}"
          f"{', drafts verified where measured faster (spec_adaptive)' if adaptive else ', every draft verified'}")
    print("agents  temp  off tok/s (steps)  mtp tok/s (steps)  drafts  accepted  withheld  mtp / off")
    for agents, temp in ((1, 0.0), (1, 0.7), (5, 0.0), (12, 0.0), (12, 0.7)):
        prompts = [loaded.tokenizer.encode(t) for t in TEXTS[:agents]]
        params = [SamplingParams(temperature=temp, seed=i, max_tokens=tokens, ignore_eos=True) for i in range(agents)]
        rates: dict[str, list[float]] = {"off": [], "mtp": []}
        outs, engines = {}, {}
        for spec in ("off", "mtp"):  # one engine a mode, kept across rounds: its graphs are captured once
            cfg = EngineConfig(page_size=16, num_pages=512, max_batch_tokens=256, loop_guard="off",
                               cuda_graphs=graphs, speculator=drafter if spec == "mtp" else spec,
                               spec_min_confidence=confidence, spec_adaptive=adaptive, draft_len=draft_len)
            engines[spec] = Engine(loaded.model, cfg, tokenizer=loaded.tokenizer)
            if spec == "mtp" and os.environ.get("SPEC_FILL") == "1":
                engines[spec].fill_rows = 12
        steps: dict[str, int] = {}
        for r in range(rounds + 1):  # round 0 untimed: it captures the graphs (and caches the prompts' prefixes)
            for spec in ("off", "mtp"):
                e = engines[spec]
                before = (e.stats.steps, e.stats.drafted_tokens, e.stats.accepted_tokens, e.stats.withheld_steps)
                t0 = time.perf_counter()
                out = e.generate(prompts, params)
                dt = time.perf_counter() - t0
                if r:
                    rates[spec].append(sum(map(len, out)) / dt)
                steps[spec] = e.stats.steps - before[0]
                if spec == "mtp":
                    drafted, accepted = e.stats.drafted_tokens - before[1], e.stats.accepted_tokens - before[2]
                    withheld = e.stats.withheld_steps - before[3]
                outs[spec] = out
        assert outs["off"] == outs["mtp"], "speculation changed the tokens"
        off, mtp = statistics.median(rates["off"]), statistics.median(rates["mtp"])
        print(f"{agents:6d}  {temp:4.1f}  {off:9.1f} ({steps['off']:4d})  {mtp:9.1f} ({steps['mtp']:4d})  "
              f"{drafted:6d}  {accepted:8d}  {withheld:8d}  {mtp / off:8.2f}x")


if __name__ == "__main__":
    main()
