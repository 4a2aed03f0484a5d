"""Host time of eager forwards (prefill chunks, mixed steps): what the Python side costs beside the GPU's work.

    PYTHONUNBUFFERED=1 python3 bench/host_step.py [variant]           # default: mxfp4
    HOST_CASES=256@0,16@16384+11 HOST_KV=6/4 HOST_PROFILE=40 python3 bench/host_step.py mxfp4
    HOST_PREFILL_WEIGHTS=packed,bf16,packed,bf16 HOST_CASES=256@0 python3 bench/host_step.py   # bf16 copies
    HOST_PREFILL_WEIGHTS=packed,bf16:16,bf16:32 HOST_CASES=32@0+11 python3 bench/host_step.py  # and KEPT_ROWS
    HOST_PREFILL_WEIGHTS=packed,packed+tails HOST_CASES=32@0+11 python3 bench/host_step.py   # piecewise graphs

Builds the `qwen3.8-27b` shapes as bench/gpu.py does (seeded random weights on the device). For each case
(tokens@start, +N decode rows at that context, as bench/profile_step.py's PROFILE_PREFILL) it times, after two
warm-up forwards on the same batch object (its plans cached, as the engine's step reuses them within a step),
HOST_REPS (9) of each (medians; every sample printed):
- wall: one forward and a device synchronize, median of HOST_REPS;
- host: the forward's return without a synchronize, after one (the time Python takes to enqueue the step);
- gpu: CUDA events around the forward, enqueued behind a spin kernel that holds the stream until the host is
  done, so the span is the GPU's work alone (unless the forward synchronizes inside).
Then, with HOST_PROFILE=N, cProfile of HOST_REPS forwards (no synchronize inside): the top N functions by own
time and by cumulative time. A table of ratios (wall / gpu-alone, host / wall) ends the output, with the host's
speed before and after the cases (`host_speed`: a fixed Python loop, to tell a noisy process); JSON to
$OUT/host_step.json.
"""

from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import cupy as cp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu as B

from decapybara.backend import cupy_ops_extra as ex
from decapybara.backend.piecewise import PiecewiseTails

CASES = [s for s in os.environ.get("HOST_CASES", "256@0,16@16384+11,2048@0").split(",") if s]
REPS = int(os.environ.get("HOST_REPS", "9"))
# the server's prefill_weights settings to run the cases under, in turn, in this one process (e.g.
# "packed,bf16,packed,bf16": bf16 copies of the product weights, `attach_dense`, under the server's KEPT_ROWS;
# "bf16:16": with them, and cupy_ops_extra.KEPT_ROWS 16: products of more than 16 rows run cuBLAS on them; a
# "+tails" suffix: the layers' tails replayed as CUDA graphs, decapybara/backend/piecewise.py, one PiecewiseTails
# a setting)
PREFILL_WEIGHTS = [s for s in os.environ.get("HOST_PREFILL_WEIGHTS", "packed").split(",") if s]
TOP = int(os.environ.get("HOST_PROFILE", "30"))
KEPT_DEFAULT = ex.KEPT_ROWS  # "bf16" without ":N" runs the server's KEPT_ROWS


def parse(case: str) -> tuple[int, int, int]:
    """"tokens@start[+rows]" -> (tokens, start, rows)."""
    tokens, rest = case.split("@")
    start, _, rows = rest.partition("+")
    return int(tokens), int(start), int(rows or 0)


def batch(tokens: int, start: int, rows: int) -> B.ForwardBatch:
    """One sequence's chunk over its first pages (slot 0), `rows` decode rows at the same context after it."""
    seqs = [(np.arange(start, start + tokens) % 1000, start, np.arange(B.SEQ_PAGES, dtype=np.int32), 0)]
    seqs += [([7], start, np.arange(i * B.SEQ_PAGES, (i + 1) * B.SEQ_PAGES, dtype=np.int32), i)
             for i in range(1, rows + 1)]
    return B.ForwardBatch.build(seqs, B.PAGE)


def time_case(fwd, reps: int) -> dict[str, float]:
    """Median wall, host-enqueue and event-timed GPU ms of `fwd()`."""
    dev = cp.cuda.Device()
    for _ in range(2):
        fwd()
    dev.synchronize()
    walls, hosts, gpus = [], [], []
    for _ in range(reps):
        t = time.perf_counter()
        fwd()
        dev.synchronize()
        walls.append((time.perf_counter() - t) * 1e3)
    for _ in range(reps):
        dev.synchronize()
        t = time.perf_counter()
        fwd()
        hosts.append((time.perf_counter() - t) * 1e3)
        dev.synchronize()
    for _ in range(reps):  # GPU span with the host ahead: enqueue into a stream held by a long sleep kernel
        a, b = cp.cuda.Event(), cp.cuda.Event()
        cp.cuda.Device().synchronize()
        _spin(20.0 + 2 * max(walls))
        a.record()
        fwd()
        b.record()
        b.synchronize()
        gpus.append(cp.cuda.get_elapsed_time(a, b))
    return {"wall_ms": statistics.median(walls), "host_ms": statistics.median(hosts),
            "gpu_ms": statistics.median(gpus), "walls": walls, "hosts": hosts, "gpus": gpus}


_SPIN = None


def _spin(ms: float) -> None:
    """Keeps the current stream busy for about `ms` so that the host enqueues what follows ahead of the GPU."""
    global _SPIN
    if _SPIN is None:
        _SPIN = cp.RawKernel(r'''extern "C" __global__ void spin(long long cycles) {
            long long t0 = clock64(); while (clock64() - t0 < cycles) { } }''', "spin")
    rate = cp.cuda.runtime.deviceGetAttribute(cp.cuda.runtime.cudaDevAttrClockRate, 0)  # kHz
    _SPIN((1,), (1,), (np.int64(ms * rate),))


def host_speed(reps: int = 7) -> float:
    """ms of a fixed pure-Python loop (dict lookups, calls, small tuples: what a forward's wrappers do), median of
    `reps`: how fast this process's host runs now. The device machine is a virtual machine whose host speed moves
    between processes and within one (docs/perf.md, twenty-ninth session); a slow figure here marks a noisy run."""
    d = {i: i for i in range(256)}

    def f(a, b):
        return (a, b)

    times = []
    for _ in range(reps):
        t = time.perf_counter()
        acc = 0
        for i in range(100_000):
            acc += len(f(d[i & 255], i))
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def profile_case(fwd, reps: int, top: int) -> str:
    prof = cProfile.Profile()
    cp.cuda.Device().synchronize()
    prof.enable()
    for _ in range(reps):
        fwd()
    prof.disable()
    cp.cuda.Device().synchronize()
    out = io.StringIO()
    st = pstats.Stats(prof, stream=out)
    st.sort_stats("tottime").print_stats(top)
    st.sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def packed_weights(model) -> list:
    """Every PackedWeight of `model`: its tensors (the stacked ones' row views among them) and their stacks."""
    stacks = [*model.fused_mlp.values(), *(w for pair in model.fused_dn.values() for w in pair),
              *(w for w, _ in model.fused_qkv.values()),
              *(w for f in model.fused_moe.values() for w in (f.router_gate, f.gate_up, f.down) if w is not None)]
    return [w for w in (*model.w.values(), *stacks) if isinstance(w, ex.PackedWeight)]


def use_weights(model, chosen: dict[int, object]) -> None:
    """Sets every packed weight's bf16 copy to `chosen`'s ({id(weight): values}; none where it has none)."""
    for w in packed_weights(model):
        ex.set_dense(w, chosen.get(id(w)))


def main() -> None:
    variant = (sys.argv[1:] or ["mxfp4"])[0]
    kv = B.CupyBackend("bf16").new_kv_cache(B.CFG, B.SLOTS * B.SEQ_PAGES + 1, B.PAGE,
                                            os.environ.get("HOST_KV", "6/4"))
    states = B.CupyBackend("bf16").new_state_pool(B.CFG, B.SLOTS + 1)
    B.fill_random(kv, states)
    # with bf16 prefill weights anywhere in the list, one model that keeps them (as the server's setting), and
    # "packed" runs with its copies set aside
    model = B.build_model(variant, prefill_weights="bf16" if any(p.startswith("bf16") for p in PREFILL_WEIGHTS)
                          else "packed")
    copies = {id(w): ex.dense_of(w) for w in packed_weights(model) if ex.dense_of(w) is not None}
    sets = {"packed": {}, "bf16": copies}
    results = {}
    speed = [host_speed()]
    print(f"host speed: {speed[0]:.2f} ms a fixed Python loop (lower is faster)", flush=True)
    if copies:
        own = sum(int(d.nbytes) for d in copies.values() if d.base is None)  # not the parts' row slices
        print(f"bf16 prefill weights: {own / 2**30:.1f} GiB", flush=True)
    runs = []  # (name, case, prefill weights)
    for i, pw in enumerate(PREFILL_WEIGHTS):
        tag = "" if len(PREFILL_WEIGHTS) == 1 else f" {pw}" + (
            f" #{PREFILL_WEIGHTS[:i + 1].count(pw)}" if PREFILL_WEIGHTS.count(pw) > 1 else "")
        runs += [(case + tag, case, pw) for case in CASES]
    tails = {pw: PiecewiseTails() for pw in PREFILL_WEIGHTS if pw.endswith("+tails")}
    for name, case, pw in runs:
        setting, _, kept_rows = pw.removesuffix("+tails").partition(":")
        use_weights(model, sets[setting])
        ex.KEPT_ROWS = int(kept_rows) if kept_rows else KEPT_DEFAULT
        tokens, start, rows = parse(case)
        fb = batch(tokens, start, rows)
        tail = tails.get(pw)
        fwd = lambda fb=fb, t=tail: model.forward(fb, kv, states, tails=t)
        r = time_case(fwd, REPS)
        results[name] = r
        print(f"== {variant} {name}: wall {r['wall_ms']:.2f} ms, host {r['host_ms']:.2f} ms, "
              f"gpu {r['gpu_ms']:.2f} ms ({(tokens + rows) / r['wall_ms'] * 1e3:,.0f} tok/s)", flush=True)
        for series in ("walls", "hosts", "gpus"):
            print(f"   {series}: " + " ".join(f"{v:.1f}" for v in r[series]))
        if TOP:
            print(profile_case(fwd, REPS, TOP), flush=True)
    speed.append(host_speed())
    results["host_speed_ms"] = speed
    for pw, t in tails.items():
        results[f"tails {pw}"] = dict(t.stats, memory_bytes=t.memory_bytes())
        print(f"tails {pw}: {t.stats}, {t.memory_bytes() / 2**20:.0f} MiB held")
    print(f"\nhost speed before / after the cases: {speed[0]:.2f} / {speed[1]:.2f} ms a fixed Python loop")
    print(f"{'case':<18}{'wall ms':>9}{'host ms':>9}{'gpu ms':>9}{'wall/gpu':>9}{'host/wall':>10}")
    for case in [name for name, _, _ in runs]:
        r = results[case]
        print(f"{case:<18}{r['wall_ms']:>9.2f}{r['host_ms']:>9.2f}{r['gpu_ms']:>9.2f}"
              f"{r['wall_ms'] / r['gpu_ms']:>9.2f}{r['host_ms'] / r['wall_ms']:>10.2f}")
    dest = os.environ.get("OUT")
    if dest:
        Path(dest, "host_step.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
