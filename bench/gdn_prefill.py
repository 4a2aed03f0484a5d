"""One DeltaNet layer's prefill at the 27B shape (Hk 16, Hv 48, dk = dv = 128), bf16 backend (float arithmetic):
the chunked form on tensor cores (decapybara/kernels/deltanet_chunk.cu) against gdn_recurrent and HF transformers' torch
chunked rule on the same shapes.

    python3 bench/gdn_prefill.py          # table: runs, ms a layer (recurrent, chunked, HF), ratios, max error

GDN_CASES: comma-separated run layouts "NxL" (N runs of L rows; "+" joins layouts into one forward), default
"1x2048,4x512,1x2048+11x1,1x2048+64x1,1x512,1x256,1x64" ("chunked" runs every case through the chunked kernels,
its runs under 64 rows through gdn_recurrent). Each forward is `CupyBackend.deltanet_core` whole (conv + SiLU,
q / k norms, gates, the rule, the conv state), timed with CUDA events, median of GDN_ITERS after a warm-up, the
chunked and recurrent variants interleaved. "HF" is `torch_chunk_gated_delta_rule` of transformers' qwen3_5 model
(float32, q / k already normed and repeated to the value heads as its layer does; the rule alone, no conv or
gates), one call per run. "err" is the chunked output's largest difference from the recurrent one, relative to
the latter's largest magnitude. GDN_DIAGS (e.g. "1,2,4,7") then times the first case's chunked forward built with
each CHUNK_DIAG (phases of gdn_chunk_prep left out; results wrong) against the full one, and GDN_WARPS (e.g.
"4,8") with each number of warps a gdn_chunk_scan CTA, GDN_BUFS (e.g. "1") with each number of W | q fragment
buffers (SCAN_WQ_BUFS; default 2).
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupy as cp
import numpy as np

from decapybara.backend import cupy_deltanet as cd
from decapybara.backend.base import DeltaNetParams, DeltaNetSegment
from decapybara.backend.cupy_backend import CupyBackend
from decapybara.model.config import ModelConfig

CASES = os.environ.get("GDN_CASES", "1x2048,4x512,1x2048+11x1,1x2048+64x1,1x512,1x256,1x64").split(",")
ITERS = int(os.environ.get("GDN_ITERS", "10"))
DIAGS = [int(d) for d in os.environ.get("GDN_DIAGS", "").split(",") if d]
WARPS = [int(w) for w in os.environ.get("GDN_WARPS", "").split(",") if w]
BUFS = [int(b) for b in os.environ.get("GDN_BUFS", "").split(",") if b]
HK, HV, D = 16, 48, 128


def config() -> ModelConfig:
    return ModelConfig(model_type="qwen3_5_text", vocab_size=16, hidden_size=16, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=32, layer_types=("linear_attention",),
                       linear_num_key_heads=HK, linear_num_value_heads=HV, linear_key_head_dim=D,
                       linear_value_head_dim=D, linear_conv_kernel_dim=4)


def runs_of(case: str) -> list[int]:
    lengths: list[int] = []
    for part in case.split("+"):
        n, length = part.split("x")
        lengths += [int(length)] * int(n)
    return lengths


def median_ms(fn, iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end))
    return float(np.median(times))


def hf_ms(lengths: list[int], rng: np.random.Generator) -> float | None:
    """transformers' torch chunked rule over the same runs (one call each), or None where it does not import."""
    try:
        import torch
        from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule
    except Exception as e:  # noqa: BLE001 - the peer is optional
        print(f"HF peer unavailable: {e}")
        return None
    dev = torch.device("cuda")
    calls = []
    for n in lengths:
        q = torch.nn.functional.normalize(torch.randn(1, n, HV, D, device=dev), dim=-1)
        k = torch.nn.functional.normalize(torch.randn(1, n, HV, D, device=dev), dim=-1)
        v = torch.randn(1, n, HV, D, device=dev)
        g = -torch.rand(1, n, HV, device=dev)
        beta = torch.rand(1, n, HV, device=dev)
        state = torch.zeros(1, HV, D, D, device=dev)
        calls.append((q, k, v, g, beta, state))

    def run() -> None:
        with torch.no_grad():
            for q, k, v, g, beta, state in calls:
                torch_chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True)

    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(max(3, ITERS // 2)):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times))


def main() -> None:
    cd.CHUNKED["min_len"] = 2  # every case takes the chunked kernels where they are on
    cfg = config()
    cub = CupyBackend("bf16")
    rng = np.random.default_rng(0)
    c = cfg.linear_conv_dim
    w = rng.standard_normal((c, 4)).astype(np.float32) * 0.5
    params = DeltaNetParams(cp.asarray(w), -cp.exp(cp.asarray(np.log(rng.uniform(1, 16, HV)).astype(np.float32))),
                            cp.asarray((rng.standard_normal(HV) * 0.5 + 1).astype(np.float32)))
    print(f"{'runs':<16}{'rows':>6}{'recurrent ms':>14}{'chunked ms':>12}{'x':>7}{'HF ms':>9}{'x HF':>7}"
          f"{'err':>10}")
    for case in CASES:
        lengths = runs_of(case)
        t = sum(lengths)
        pool = cub.new_state_pool(cfg, len(lengths))
        segs, row = [], 0
        for s, n in enumerate(lengths):
            pool.reset(s)
            segs.append(DeltaNetSegment(row, n, s, None))
            row += n
        x = cp.asarray(rng.standard_normal((t, c)).astype(np.float32))
        a = cp.asarray(rng.standard_normal((t, HV)).astype(np.float32))
        b = cp.asarray(rng.standard_normal((t, HV)).astype(np.float32) * 2)
        outs, ms = {}, {True: [], False: []}
        for chunked in (True, False):
            cd.CHUNKED["enabled"] = chunked
            for s in range(len(lengths)):
                pool.reset(s)
            outs[chunked] = cp.asnumpy(cub.deltanet_core(pool, 0, x, a, b, params, segs, cfg, {}))
        call = functools.partial(cub.deltanet_core, pool, 0, x, a, b, params, segs, cfg)
        for _ in range(ITERS):  # interleaved
            for chunked in (True, False):
                cd.CHUNKED["enabled"] = chunked
                ms[chunked].append(median_ms(functools.partial(call, {}), 1))
        cd.CHUNKED["enabled"] = True
        rec, chk = float(np.median(ms[False])), float(np.median(ms[True]))
        err = float(np.abs(outs[True] - outs[False]).max() / max(np.abs(outs[False]).max(), 1e-30))
        hf = hf_ms(lengths, rng)
        hf_s = f"{hf:>9.3f}{hf / chk:>7.1f}" if hf is not None else f"{'-':>9}{'-':>7}"
        print(f"{case:<16}{t:>6}{rec:>14.3f}{chk:>12.3f}{rec / chk:>7.2f}{hf_s}{err:>10.1e}")
        if case == CASES[0]:  # the variants, each against the first case's default
            for diag in DIAGS:
                cd.CHUNKED["defines"] = {"CHUNK_DIAG": diag}
                d_ms = float(np.median([median_ms(functools.partial(call, {}), 1) for _ in range(ITERS)]))
                print(f"  CHUNK_DIAG {diag}: {d_ms:.3f} ms (full {chk:.3f}: the left-out phases ~{chk - d_ms:.3f})")
            cd.CHUNKED["defines"] = {}
            for warps in WARPS:
                cd.CHUNKED["warps"] = warps
                w_ms = float(np.median([median_ms(functools.partial(call, {}), 1) for _ in range(ITERS)]))
                print(f"  gdn_chunk_scan of {warps} warps: {w_ms:.3f} ms (default {chk:.3f})")
            cd.CHUNKED["warps"] = None
            default_bufs = cd.CHUNKED["wq_bufs"]
            for bufs in BUFS:
                cd.CHUNKED["wq_bufs"] = bufs
                b_ms = float(np.median([median_ms(functools.partial(call, {}), 1) for _ in range(ITERS)]))
                print(f"  gdn_chunk_scan with {bufs} W | q buffers: {b_ms:.3f} ms (default {chk:.3f})")
            cd.CHUNKED["wq_bufs"] = default_bufs


if __name__ == "__main__":
    main()
