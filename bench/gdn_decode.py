"""The DeltaNet decode of one layer at the 27B shape (Hk 16, Hv 48, dk = dv = 128): gdn_decode + gdn_decode_finish.

    python3 bench/gdn_decode.py                    # table: batch, us a layer, state GB/s, % of copy bandwidth
    GDN_BATCHES=12 GDN_ITERS=1 ncu --clock-control none -k regex:gdn_decode$ --launch-skip 20 --launch-count 1 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
        python3 bench/gdn_decode.py                # one launch for Nsight Compute
    DECAPYBARA_KERNEL_LINEINFO=1 ... ncu ... --set full --import-source yes -o rep python3 bench/gdn_decode.py
    ncu --import rep.ncu-rep --page source --csv --print-source cuda,sass > rep_lines.csv
    python3 bench/ncu_source.py rep_lines.csv      # its stall samples and instructions by source line

GDN_ROWS=2 times a verification step's layer instead: each sequence a token and its draft, cut after the token with
its state's snapshot into checkpoint buffers (as a verification graph's plan, with its empty throwaway runs); the
state traffic is then a read and two writes. A variant's "multi" key names `cupy_deltanet.MULTI_DECODE` overrides
(e.g. '{"general": {"multi": {"max_rows": 0}}, "multi": {}, "m32": {"multi": {"vcols": 32}}}': the general path's
three launches against gdn_decode's multi-row build).

GDN_TUNES names `cupy_deltanet.FUSED_DECODE` overrides (e.g. '{"": {}, "v32": {"vcols": 32}, "minb4": {"defines":
{"GDN_MINB": 4}}, "prev": {"source": "deltanet_prefill_prev", "vcols": 32, "runs": 1}}', the last an older kernel file
(one run a CTA: kernels before the twentieth session take no more; they had their own CTAs an SM, 3 at 27B,
which the launch's GDN_MINB now overrides unless a variant sets it):
`git show <commit>:decapybara/kernels/deltanet_prefill.cu > decapybara/kernels/deltanet_prefill_prev.cu`, ignored by
git; its CTAs have 32 value columns), each captured afresh and timed in turn, GDN_ROUNDS times over (interleaved: the
spread between rounds beside the effect); the table's last column is the ratio to the first. GDN_VHEADS sets the
value heads (32: the 35B-A3B's DeltaNet layers).

A CUDA graph of GDN_LAYERS layers (default 16: at 12 sequences 16 x 37.7 MB of state, past the L2; launched
overlapped as in a decode graph) is timed with CUDA events, median of GDN_ITERS replays, per layer. A layer reads and writes 3.1 MB of float32 state per
sequence; the table compares that traffic with the copy bandwidth (a CuPy device-to-device copy, read + write)
measured in the same run.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import cupy as cp
import numpy as np
from gpu import graph_seconds  # bench/gpu.py

from decapybara.backend import cupy_deltanet as cd
from decapybara.backend.base import DeltaNetParams, DeltaNetSegment
from decapybara.backend.cupy_backend import CupyBackend
from decapybara.model.config import ModelConfig

BATCHES = [int(b) for b in os.environ.get("GDN_BATCHES", "1,4,8,12").split(",")]
LAYERS = int(os.environ.get("GDN_LAYERS", "16"))
ITERS = int(os.environ.get("GDN_ITERS", "20"))
TUNES: dict[str, dict] = json.loads(os.environ.get("GDN_TUNES", '{"": {}}'))
ROUNDS = int(os.environ.get("GDN_ROUNDS", "1"))
VHEADS = int(os.environ.get("GDN_VHEADS", "48"))  # value heads: 48 the 27B's, 32 the 35B-A3B's
ROWS = int(os.environ.get("GDN_ROWS", "1"))  # rows a sequence: 1 decode, 2 verification (a token and its draft)


def config(layers: int = LAYERS) -> ModelConfig:
    """A model of `layers` DeltaNet layers at the 27B's DeltaNet shape (GDN_VHEADS value heads; the rest tiny)."""
    return ModelConfig(model_type="qwen3_5_text", vocab_size=16, hidden_size=16, num_hidden_layers=layers,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                       layer_types=("linear_attention",) * layers, linear_num_key_heads=16,
                       linear_num_value_heads=VHEADS, linear_key_head_dim=128, linear_value_head_dim=128,
                       linear_conv_kernel_dim=4)


def copy_bandwidth() -> float:
    """Bytes moved (read + write) per second by a 1 GB device-to-device copy, median of 5."""
    a, b = cp.zeros(1 << 28, cp.float32), cp.empty(1 << 28, cp.float32)
    times = []
    for _ in range(6):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        b[...] = a
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) * 1e-3)
    return 2 * a.nbytes / float(np.median(times[1:]))


def layer_params(cfg: ModelConfig, rng: np.random.Generator) -> tuple[DeltaNetParams, cp.ndarray]:
    """Random DeltaNet parameters of `cfg`'s layers (conv weight, A, dt bias) and a gated norm weight of ones."""
    c, hv, dv = cfg.linear_conv_dim, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    params = DeltaNetParams(cp.asarray(rng.standard_normal((c, 4)).astype(np.float32) * 0.5),
                            -cp.exp(cp.asarray(np.log(rng.uniform(1, 16, hv)).astype(np.float32))),
                            cp.asarray(rng.standard_normal(hv).astype(np.float32) * 0.5 + 1))
    return params, cp.ones(dv, cp.float32)


def decode_setup(rng: np.random.Generator, layers: int = LAYERS) -> tuple[ModelConfig, DeltaNetParams, cp.ndarray]:
    """(config, random layer parameters, gated norm weight) of `layers` DeltaNet layers of the 27B's head dims and
    GDN_VHEADS value heads (`config`, `layer_params`)."""
    cfg = config(layers)
    return (cfg, *layer_params(cfg, rng))


def random_pool(be: CupyBackend, cfg: ModelConfig, n: int, rng: np.random.Generator) -> object:
    """A state pool of `n` slots whose every layer's recurrent state is random (0.05 standard deviation)."""
    pool = be.new_state_pool(cfg, n)
    for layer in range(cfg.num_hidden_layers):
        pool.rec[layer][...] = cp.asarray(rng.standard_normal(pool.rec[layer].shape).astype(np.float32) * 0.05)
    return pool


def main() -> None:
    be = CupyBackend("bf16")
    rng = np.random.default_rng(0)
    cfg, params, norm_w = decode_setup(rng)
    c, hv, dv = cfg.linear_conv_dim, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; {LAYERS} layers of state cycled; ACC float (bf16 backend)")
    print(f"{'batch':>5} {'variant':>12} {'us/layer':>9} {'state MB':>9} {'GB/s':>7} {'% copy':>7} {'ratio':>6}")
    base_dn, base_multi = dict(cd.FUSED_DECODE), dict(cd.MULTI_DECODE)
    passes = 2 if ROWS == 1 else 3  # the state read, written and (verification) written to its checkpoint
    for n in BATCHES:
        pool = random_pool(be, cfg, n, rng)
        plan = cd.plan_runs([DeltaNetSegment(i, 1, i, None) for i in range(n)]) if ROWS == 1 else verify_plan(cfg, n)
        t_rows = n * ROWS
        qkvz = cp.asarray(rng.standard_normal((t_rows, c + hv * dv)).astype(np.float32))
        ab = cp.asarray(rng.standard_normal((t_rows, 2 * hv)).astype(np.float32))
        x, z = qkvz[:, :c], qkvz[:, c:].reshape(t_rows, hv, dv)
        first = None
        for r in range(ROUNDS):
            for tname, tune in TUNES.items():
                tune = dict(tune)
                cd.MULTI_DECODE.update({**base_multi, **tune.pop("multi", {})})
                cd.FUSED_DECODE.update({**base_dn, **tune})
                t = time_layers(pool, plan, x, z, ab, params, norm_w, cfg)
                first = first or t
                state = pool.rec[0].nbytes * n / pool.rec[0].shape[0]  # this batch's slots
                name = (tname or "default") + (f" #{r + 1}" if ROUNDS > 1 else "")
                print(f"{n:5d} {name:>12} {t * 1e6:9.1f} {state / 1e6:9.1f} {passes * state / t / 1e9:7.0f} "
                      f"{passes * state / t / bw * 100:6.1f}% {t / first:6.3f}")
    cd.FUSED_DECODE.update(base_dn)
    cd.MULTI_DECODE.update(base_multi)


def verify_plan(cfg: ModelConfig, n: int) -> cd.RunPlan:
    """A verification graph's DeltaNet plan for `n` sequences in slots 0..n-1 (cuda_graph `_fill_verify_runs`): run
    i rows 2i, 2i + 1, cut after the first with its snapshot into checkpoint i of every layer's buffers; runs n..2n-1
    the throwaway rows, none here (every sequence has its draft)."""
    runs = np.zeros((2 * n, 5), np.int32)
    runs[:n] = np.stack([np.arange(n) * 2, np.full(n, 2), np.arange(n), np.arange(n) * 2, np.full(n, 2)], 1)
    runs[n:] = np.stack([np.arange(n) * 2 + 1, np.zeros(n), np.zeros(n), 2 * n + np.arange(n), np.ones(n)], 1)
    segs = np.zeros((3 * n, 2), np.int32)
    segs[0:2 * n:2] = np.stack([np.ones(n), np.arange(n)], 1)
    segs[1:2 * n:2] = (2, -1)
    segs[2 * n:] = (0, -1)
    c, hv = cfg.linear_conv_dim, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    ckpt = {layer: (cp.zeros((n, c, 3), cp.float32), cp.zeros((n, hv, dk, dv), cp.float32))
            for layer in range(cfg.num_hidden_layers)}
    return cd.RunPlan(cp.asarray(runs), cp.asarray(segs), 2 * n, 2, [], snap_bufs=ckpt)


def time_layers(pool, plan, x, z, ab, params, norm_w, cfg) -> float:
    """Seconds a layer: a fresh graph of LAYERS decode forwards, median of ITERS replays (after 3)."""
    hv = cfg.linear_num_value_heads
    return graph_seconds(lambda: [
        cd.deltanet_core(pool, layer, x, ab[:, hv:], ab[:, :hv], params, plan, cfg, {}, acc="float",
                         gate=(z, norm_w, 1e-6), out_dtype=cp.uint16) for layer in range(LAYERS)],
        LAYERS, ITERS, min(3, ITERS - 1))


if __name__ == "__main__":
    main()
