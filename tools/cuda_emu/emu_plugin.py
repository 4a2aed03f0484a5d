"""pytest plugin: run the GPU tests on the host CUDA emulator (a numpy-backed CuPy stand-in whose RawModule
kernels are compiled for the CPU against emu.h, one host thread per CUDA thread, barriers and warp shuffles
emulated; inline PTX lowered by ptx_lower.py, e.g. mma.sync as a warp collective, wgmma as a warpgroup one). For checking kernels and
launch code without a GPU before spending device time; it cannot see races, timing, NVRTC/nvcc differences,
the tensor cores' own summation order or cuBLAS itself, so the real GPU run stays the proof.

    PYTHONPATH=tools/cuda_emu python3 -m pytest -p emu_plugin -m gpu tests/gpu/test_kernels_core.py

CUDA_EMU_DEVICE (h200 by default; a100, l40s, b200, rtx5090: fake_cupy.DEVICE_PROFILES) sets the GPU the fake CuPy
reports, so that the launch code's plans for other GPUs (no overlapped launches before sm_90, no sm_90a builds off
Hopper, less shared memory a block) run too. Kernel arguments must be C-contiguous arrays unless CUDA_EMU_STRIDED=1,
which passes a view as CuPy does (its first element's address) for the kernels that take row strides (tests with
column views of fused products).
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fake_cupy

fake_cupy.install()
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
from decapybara import kernels
fake_cupy.patch_backend()
# the emulator runs wgmma (emu.h `wgmma`) whatever compiler it stands in for, so sm_90a builds serve where the
# device it reports ($CUDA_EMU_DEVICE, fake_cupy.DEVICE_PROFILES) is a Hopper one
kernels.sm90a_ok = lambda: kernels.device_arch() == "90"
