"""One skinny-GEMM product for Nsight Compute: warm-up launches, then the launch to profile.

    ncu --clock-control none -k regex:mx_gemm_ --launch-skip 3 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \
        python3 bench/gemv_ncu.py [fmt] [N] [K] [M]          # default: mxfp4 34816 5120 1 (fused 27B gate|up)

Warp-state and scheduler statistics say whether the kernel waits on memory, on dependent instructions or on
issue slots, which timing alone cannot separate; the per-instruction source page (`--section SourceCounters`,
exported as CSV) says which instructions those are: bench/ncu_source.py summarises it (with
DECAPYBARA_KERNEL_LINEINFO=1 and `--set full --import-source yes`, by CUDA source line too; docs/perf.md, the
forty-sixth session's table of the one- and twelve-row products). NCU_X=bf16 passes x in bf16 bits (as the decode
step's products take it; default float32); NCU_OP=swiglu launches the fused SwiGLU product (`mx_swiglu`: the step's
gate|up) in place of the plain one. A variant of bench/gemv_sweep.py: its TUNE through DECAPYBARA_MX_TUNE (e.g.
'{"source": "mx_gemv_prev"}' profiles an older kernel file saved beside the current one), its kernel defines
through NCU_DEFINES ("MX_DIAG=4,...").
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import cupy as cp
from gpu import random_packed

from decapybara.backend import cupy_ops_extra as ex


def main() -> None:
    fmt = sys.argv[1] if len(sys.argv) > 1 else "mxfp4"
    n, k, m = (int(a) for a in (sys.argv[2:5] if len(sys.argv) > 4 else (34816, 5120, 1)))
    ex.TUNE_DEFINES = tuple((d.split("=")[0], int(d.split("=")[1]))
                            for d in os.environ.get("NCU_DEFINES", "").split(",") if d)
    cp.random.seed(0)
    w = random_packed(fmt, (n, k))
    x = cp.random.standard_normal((m, k), cp.float32)
    if os.environ.get("NCU_X") == "bf16":
        x = (x.view(cp.uint32) >> 16).astype(cp.uint16)
    op = ex.mx_swiglu if os.environ.get("NCU_OP") == "swiglu" else ex.mx_linear
    for _ in range(4):  # three warm-up launches (compile, caches), then the profiled one
        op(x, w)
    cp.cuda.Device().synchronize()
    print(f"{fmt} [{n}, {k}] M {m} x {x.dtype} {op.__name__}: tuning {ex.launch_tune(w, m, swiglu=op is ex.mx_swiglu)}"
          f"{', defines ' + str(ex.TUNE_DEFINES) if ex.TUNE_DEFINES else ''}")


if __name__ == "__main__":
    main()
