"""Where an engine step's host time goes with speculation on and off: the demo model through `Engine.generate`
on this machine's backend (`SPEC_BACKEND=cupy`: the cupy backend in float32 with decode graphs, as
`bench/speculation.py` chooses), one round untimed (graph captures, prompt prefixes cached), then one round under
cProfile for each mode, `PROFILE_AGENTS` agents (default 1, at most speculation.py's 12 prompts) greedy. Prints
wall ms a step, steps, withheld steps, and cProfile's top `PROFILE_TOP` (25) functions by cumulative and by own
time, so that what a withheld step costs beyond a plain one can be read off.

    SPEC_BACKEND=cupy python3 bench/spec_profile.py
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import time

from speculation import TEXTS, env_backend

from decapybara.config import DEMO_MODEL, EngineConfig
from decapybara.engine.engine import Engine
from decapybara.engine.sampling import SamplingParams
from decapybara.model.load import load_model


def main() -> None:
    backend, graphs = env_backend()
    loaded = load_model(str(DEMO_MODEL), backend)
    agents, top = int(os.environ.get("PROFILE_AGENTS", "1")), int(os.environ.get("PROFILE_TOP", "25"))
    prompts = [loaded.tokenizer.encode(t) for t in TEXTS[:agents]]
    params = [SamplingParams(temperature=0.0, seed=i, max_tokens=128, ignore_eos=True) for i in range(agents)]
    for spec in ("off", "mtp"):
        cfg = EngineConfig(page_size=16, num_pages=512, max_batch_tokens=256, loop_guard="off", cuda_graphs=graphs,
                           speculator=spec)
        e = Engine(loaded.model, cfg, tokenizer=loaded.tokenizer)
        e.generate(prompts, params)  # untimed: captures, prefixes
        steps, withheld = e.stats.steps, e.stats.withheld_steps
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        e.generate(prompts, params)
        prof.disable()
        dt = time.perf_counter() - t0
        steps, withheld = e.stats.steps - steps, e.stats.withheld_steps - withheld
        print(f"\n== {spec}: {dt / steps * 1e3:.3f} ms a step (under cProfile), {steps} steps, {withheld} withheld")
        for key in ("cumulative", "tottime"):
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(top)
            print("\n".join(line[:150] for line in buf.getvalue().splitlines()[6:6 + top + 3]))


if __name__ == "__main__":
    main()
