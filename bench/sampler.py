"""The device sampler alone (`cupy_ops_extra.cuda_sample`) on the 27B's vocabulary: where a call's time goes, per
kernel, against a peer (torch's sampling ops on the same logits) and the bytes of logits read.

    PYTHONUNBUFFERED=1 python3 bench/sampler.py          # table last; JSON to $OUT/sampler.json

For 1 and 12 rows of 248,320 logits (float32 on the device), each sampling setting (SAMPLER_SETTINGS, comma
list, default all):
  greedy       temperature 0
  qwen         T 0.7, top-p 0.8, top-k 20 (the Qwen3 coding agents' setting)
  topp         T 0.6, top-p 0.95, no top-k
  plain        T 1.0, no filters
  penalty      qwen's, with a repetition penalty 1.1 over 2,000 seen ids (the edits path)
and two kinds of logits: "peaked" (standard normal x 2 with 64 likely tokens spread over the ids, as a trained
model's) and "flat" (standard normal, as a model of random weights gives). Prints a call's host wall time
(cupyx.profiler.benchmark's CPU time: the call returns after its tokens are on the host), its GPU time, the
kernels by name (CUPTI through torch's profiler) and, where torch is present, torch's peer on the same logits:
softmax(z / T) with top-k / top-p by a sort (the scheme of vLLM's torch sampler) and one multinomial draw, and
greedy as one argmax. The peer does not give the reference's tokens (its own random numbers); it is a measure
of what sampling these logits costs on this device through a general library. SAMPLER_PREV=<file.py> also times
that file's `cuda_sample` (an earlier form of the sampler, e.g. its kernels saved as
decapybara/kernels/sample_prev.cu, ignored by git) on the same calls, checks that both give the same tokens, and
prints the ratio.
"""

from __future__ import annotations

import collections
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import cupy as cp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from decapybara.backend import cupy_ops_extra as ex
from decapybara.engine.sampling import SamplerRow, SamplingParams

VOCAB = int(os.environ.get("SAMPLER_VOCAB", "248320"))  # smaller: a quick check (the host emulator)
SETTINGS = {
    "greedy": {"temperature": 0.0},
    "qwen": {"temperature": 0.7, "top_p": 0.8, "top_k": 20},
    "topp": {"temperature": 0.6, "top_p": 0.95},
    "plain": {"temperature": 1.0},
    "penalty": {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.1},
}
REPEAT = int(os.environ.get("SAMPLER_REPEAT", "30"))


def logits_of(kind: str, b: int, seed: int = 0) -> Any:
    """[b, VOCAB] float32 device logits: "peaked" (a trained model's shape) or "flat" (random weights')."""
    rs = cp.random.RandomState(seed)
    if kind == "flat":
        return rs.standard_normal((b, VOCAB), cp.float32)
    x = rs.standard_normal((b, VOCAB), cp.float32) * 2.0
    ids = rs.permutation(VOCAB)[:64]
    x[:, ids] += cp.linspace(14.0, 6.0, 64, dtype=cp.float32)
    return x


def rows_of(setting: str, b: int) -> list[SamplerRow]:
    p = SamplingParams(max_tokens=4096, ignore_eos=True, **SETTINGS[setting])
    # sorted and unique, as the engine hands them over (`Sequence.seen_ids`)
    seen = np.sort(np.random.default_rng(1).choice(VOCAB, 2000, replace=False)) if setting == "penalty" else []
    return [SamplerRow(p, seen, [], position=7 + i, seed=1000 + i) for i in range(b)]


def timed(fn, repeat: int = REPEAT) -> tuple[float, float]:
    """(host wall us, GPU us) medians of `repeat` calls after 3 (cupyx's benchmark)."""
    from cupyx.profiler import benchmark

    r = benchmark(fn, n_repeat=repeat, n_warmup=3)
    return float(np.median(r.cpu_times) * 1e6), float(np.median(r.gpu_times) * 1e6)


def kernels(fn, calls: int = 10) -> dict[str, tuple[float, float]]:
    """{kernel name: (GPU us a call, launches a call)} over `calls` calls, from CUPTI (torch's profiler)."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return {}
    fn()
    cp.cuda.Device().synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        cp.cuda.Device().synchronize()
    agg: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            name = ev.name.split("(")[0][:48]
            agg[name][0] += getattr(ev, "device_time_total", 0.0) or ev.cuda_time_total
            agg[name][1] += 1
    return {k: (v[0] / calls, v[1] / calls) for k, v in agg.items()}


def torch_peer(logits: Any, setting: str) -> Any:
    """torch's sampling of the same logits (None without torch): the call to time."""
    try:
        import torch
    except ImportError:
        return None
    x = torch.as_tensor(logits, device="cuda")
    s = SETTINGS[setting]
    gen = torch.Generator(device="cuda").manual_seed(0)
    if s["temperature"] == 0.0:
        return lambda: x.argmax(dim=-1).cpu()

    def run() -> Any:
        z = x / s["temperature"]
        if s.get("repetition_penalty"):
            z = z.clone()
        k, p = s.get("top_k", 0), s.get("top_p", 1.0)
        if k or p < 1.0:
            srt, idx = z.sort(dim=-1, descending=True)
            if k:
                srt[:, k:] = -float("inf")
            if p < 1.0:
                probs = srt.softmax(dim=-1)
                cum = probs.cumsum(dim=-1)
                srt = srt.masked_fill(cum - probs > p, -float("inf"))
            pick = torch.multinomial(srt.softmax(dim=-1), 1, generator=gen)
            return idx.gather(-1, pick).cpu()
        return torch.multinomial(z.softmax(dim=-1), 1, generator=gen).cpu()

    return run


def previous() -> Any:
    """SAMPLER_PREV's `cuda_sample`, or None."""
    path = os.environ.get("SAMPLER_PREV")
    if not path:
        return None
    import importlib.util

    spec = importlib.util.spec_from_file_location("sampler_prev", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.cuda_sample


def main() -> None:
    prev = previous()
    settings = [s for s in os.environ.get("SAMPLER_SETTINGS", ",".join(SETTINGS)).split(",") if s]
    print(f"device: {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}, vocabulary {VOCAB:,}, "
          f"medians of {REPEAT} calls")
    out: list[dict[str, Any]] = []
    for b in (1, 12):
        for kind in ("peaked", "flat"):
            logits = logits_of(kind, b)
            for setting in settings:
                rows = rows_of(setting, b)
                def call(logits: Any = logits, rows: list[SamplerRow] = rows) -> Any:
                    return ex.cuda_sample(logits, rows)

                first = call()
                assert np.array_equal(first.token_ids, call().token_ids)  # seeded: the same tokens again
                host_us, gpu_us = timed(call)
                table = kernels(call)
                prev_host = prev_gpu = float("nan")
                prev_table: dict[str, tuple[float, float]] = {}
                if prev is not None:
                    def before(logits: Any = logits, rows: list[SamplerRow] = rows) -> Any:
                        return prev(logits, rows)

                    assert np.array_equal(before().token_ids, first.token_ids), "the previous form's tokens"
                    prev_host, prev_gpu = timed(before)
                    prev_table = kernels(before)
                peer = torch_peer(logits, setting)
                peer_host, peer_gpu = timed(peer) if peer is not None else (float("nan"), float("nan"))
                res = {"rows": b, "logits": kind, "setting": setting, "host_us": host_us, "gpu_us": gpu_us,
                       "torch_host_us": peer_host, "torch_gpu_us": peer_gpu,
                       "prev_host_us": prev_host, "prev_gpu_us": prev_gpu,
                       "prev_kernels": {k: list(v) for k, v in sorted(prev_table.items(), key=lambda kv: -kv[1][0])},
                       "kernels": {k: list(v) for k, v in sorted(table.items(), key=lambda kv: -kv[1][0])}}
                out.append(res)
                ks = ", ".join(f"{k} {v[0]:.0f}" for k, v in list(res["kernels"].items())[:6])
                if prev_table:
                    ks += " | previous: " + ", ".join(f"{k} {v[0]:.0f}" for k, v in list(res["prev_kernels"].items())[:6])
                print(f"{b:>2} rows {kind:<6} {setting:<8} host {host_us:7.0f} us  GPU {gpu_us:7.0f} us  "
                      f"previous {prev_host:7.0f} / {prev_gpu:7.0f}  torch {peer_host:7.0f} / {peer_gpu:7.0f} | {ks}")
    print("\n| rows | logits | setting | call, us (host) | GPU, us | kernels, us | previous, us (host) | x previous "
          "| torch, us (host) | x torch |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in out:
        ksum = sum(v[0] for v in r["kernels"].values())
        print(f"| {r['rows']} | {r['logits']} | {r['setting']} | {r['host_us']:.0f} | {r['gpu_us']:.0f} | "
              f"{ksum:.0f} | {r['prev_host_us']:.0f} | {r['host_us'] / r['prev_host_us']:.2f} | {r['torch_host_us']:.0f} | "
              f"{r['host_us'] / r['torch_host_us']:.2f} |")
    guesses = []
    for b in (1, 12):  # the MTP head's drafts: the two-launch guesses against CuPy's argmax, gather, exp and sum
        from decapybara.backend.base import Backend
        from decapybara.backend.cupy_backend import CupyBackend

        logits, be = logits_of("peaked", b), CupyBackend("fp32")
        def new_form(logits: Any = logits) -> Any:
            return ex.guesses(logits)

        def old_form(logits: Any = logits, be: Any = be) -> Any:
            return Backend.argmax_prob(be, logits)

        new, old = timed(new_form), timed(old_form)
        same = bool((ex.guesses(logits)[0] == Backend.argmax_prob(be, logits)[0]).all())
        guesses.append({"rows": b, "gpu_us": new[1], "cupy_gpu_us": old[1], "same_ids": same})
        print(f"guesses, {b} rows: GPU {new[1]:.0f} us against CuPy's ops {old[1]:.0f} us (same ids: {same})")
    med = statistics.median(r["host_us"] / r["torch_host_us"] for r in out) if out else float("nan")
    print(f"median call / torch's: {med:.2f}")
    dest = os.environ.get("OUT")
    if dest:
        Path(dest, "sampler.json").write_text(json.dumps({"when": time.time(), "cases": out, "guesses": guesses}, indent=1))


if __name__ == "__main__":
    main()
