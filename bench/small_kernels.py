"""The small per-layer kernels of a 27B decode step, one at a time, as a decode graph sees them.

    PYTHONUNBUFFERED=1 python3 bench/small_kernels.py

A decode step streams ~14 GB of weights between two uses of a layer's norm weights and residual row, so
those come from HBM, not L2. Each timed call here is [an L2 flush (a 96 MB device copy), the kernel]
captured 20 times in one CUDA graph and replayed (bench/gpu.py's graph_time); the flush alone is timed the
same way and subtracted. Rows: the hidden-size RMSNorm with its fused residual add (`rms_norm_block`) at
128, 256 and 512 threads (the launch uses 512), the per-head q / k norm (`rms_norm_warp`), the DeltaNet
gated norm and the MLP's silu(gate) * up, for 1 and 12 rows. Prints microseconds per call.

Then the prefill path's whole-matrix dequantisation to bf16 (`dequant`, no flush: each call moves more bytes
than L2 holds): decapybara/kernels/mx_gemv.cu `mx_dequant_rows` (one thread an element) against `mx_dequant_bf16` (whole
octets, 16-byte stores; MX_DQ_OCTETS 4, the launch's, and 2 / 8) on 27B-like MXFP4 matrices (split-field codes,
band tiles: the MLP's 17408 x 5120 and 5120 x 17408), median ms per call, GB/s of bytes read (codes, scales)
and written (bf16), and the ratio to the old kernel; the new outputs are checked bit for bit against the old.
`python3 bench/small_kernels.py dequant` runs this part alone.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cupy as cp
import gpu as B
import numpy as np

from decapybara.backend import cupy_ops as ops
from decapybara.backend import cupy_ops_extra as ex
from decapybara.backend.cupy_ops import F32, I32
from decapybara.model import quant

FLUSH = 96 << 20


def main() -> None:
    if sys.argv[1:] != ["dequant"]:
        small()
    dequant()


def small() -> None:
    src, dst = cp.zeros(FLUSH // 4, cp.float32), cp.zeros(FLUSH // 4, cp.float32)

    def flush() -> None:
        dst[...] = src

    base = B.graph_time(flush)
    rows = [row for m in (1, 12) for row in timed(m, flush, base)]
    print(f"\nL2 flush alone: {base * 1e6:.1f} us; kernel us per call (flush subtracted)")
    for name, m, t in rows:
        print(f"{name:<42}{m:>4}{t * 1e6:>9.2f}")


def timed(m: int, flush, base: float) -> list[tuple[str, int, float]]:
    """(kernel, rows, seconds per call) of the small kernels for m rows."""
    cfg = B.CFG
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    rows = []
    x = cp.random.standard_normal((m, hidden), cp.float32)
    res = cp.random.standard_normal((m, hidden), cp.float32)
    w = cp.random.standard_normal(hidden, cp.float32)
    out, res_out = cp.empty_like(x), cp.empty_like(x)
    for threads in (128, 256, 512):  # the launch uses 512 (68 registers: 1024 threads do not fit)
        def norm(t: int = threads) -> None:
            flush()
            ops._k("rms_norm_block")((m,), (t,), (x, res, w, out, res_out, I32(m), I32(hidden), F32(1e-6),
                                                   F32(1.0), I32(0)))
        rows.append((f"rms_norm_block + residual, {threads} threads", m, B.graph_time(norm) - base))
    q = cp.random.standard_normal((m, cfg.num_attention_heads, cfg.head_dim), cp.float32)
    qw = cp.random.standard_normal(cfg.head_dim, cp.float32)
    rows.append(("rms_norm_warp (q heads)", m, B.graph_time(lambda: (flush(), ops.rms_norm(q, qw, 1e-6, 1.0)))
                 - base))
    core = cp.random.standard_normal((m, cfg.linear_num_value_heads, cfg.linear_value_head_dim), cp.float32)
    z = cp.random.standard_normal(core.shape, cp.float32)
    gw = cp.random.standard_normal(cfg.linear_value_head_dim, cp.float32)
    rows.append(("gated_rms_norm", m, B.graph_time(lambda: (flush(), ops.gated_rms_norm(core, z, gw, 1e-6)))
                 - base))
    gu = cp.random.standard_normal((m, 2 * inter), cp.float32)
    rows.append(("silu_mul_halves", m, B.graph_time(lambda: (flush(), ops.silu_mul_halves(gu))) - base))
    return rows


def dequant() -> None:
    """mx_dequant_rows against mx_dequant_bf16 on 27B-like MXFP4 weights (module docstring)."""
    cfg = B.CFG
    print("\nbf16 dequantisation of MXFP4 weights (split codes, band tiles): ms per call, GB/s read + written")
    print(f"{'kernel':<40}{'shape':>14}{'ms':>9}{'GB/s':>8}{'x old':>8}")
    for shape in ((cfg.intermediate_size, cfg.hidden_size), (cfg.hidden_size, cfg.intermediate_size)):
        w = mxfp4_weight(shape)
        assert w.e2m1_split and w.tiled and ex.dequant_bf16_ok(w)
        old, new = cp.empty(shape, cp.uint16), cp.empty(shape, cp.uint16)
        nbytes = w.nbytes + old.nbytes
        t_old = B.graph_time(lambda w=w, old=old: ex.dequant_rows(w, None, old))
        rows = [("mx_dequant_rows (one thread/element)", t_old)]
        for octets in (ex.DQ_OCTETS, 2, 8):
            defines = (*ops.MX_NO_GEMM, ("MX_DQ_OCTETS", octets))
            new.fill(0xFFFF)
            ex.dequant_bf16(w, new, defines, octets)
            assert bool(cp.array_equal(new, old)), f"mx_dequant_bf16 ({octets} octets) differs from mx_dequant_rows"
            t = B.graph_time(lambda w=w, new=new, d=defines, o=octets: ex.dequant_bf16(w, new, d, o))
            rows.append((f"mx_dequant_bf16, {octets} octets/thread" + (" *" if octets == ex.DQ_OCTETS else ""), t))
        for name, t in rows:
            print(f"{name:<40}{f'{shape[0]}x{shape[1]}':>14}{t * 1e3:>9.3f}{nbytes / t / 1e9:>8.0f}"
                  f"{t_old / t:>8.1f}")
        del w, old, new
    print("* the launch's (cupy_ops_extra.DQ_OCTETS)")


def mxfp4_weight(shape: tuple[int, int]) -> ex.PackedWeight:
    """A packed MXFP4 weight of random codes and E8M0 scales 112..131 (blocks of 2^-15 .. 2^4)."""
    rng = np.random.default_rng(0)
    f = quant.get_format("mxfp4")
    codes = rng.integers(0, 256, f.code_shape(shape), dtype=np.uint8)
    scales = rng.integers(112, 132, f.scale_shape(shape), dtype=np.uint8)
    return ex.pack_weight(quant.QuantTensor("mxfp4", shape, codes, scales, None), e2m1_split=True, tiled=True)


if __name__ == "__main__":
    main()
