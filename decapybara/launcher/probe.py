"""What the planner measures on this machine: device memory and copy bandwidth.

On CUDA the bandwidth is decapybara/kernels/probe.cu's streaming copy (`cupy_ops_extra.bandwidth_probe`, read + write
bytes per second) and the memory is the device's; without CUDA the numpy backend serves from host RAM, so
both are the host's (a numpy copy of a buffer well past the caches).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class Machine:
    device: str  # "cuda:<name>" or "cpu"
    memory_bytes: int  # device memory (host RAM without CUDA)
    free_bytes: int
    bandwidth: float  # copy bandwidth, bytes/s (read + write), 0 when not measured


def host_memory() -> tuple[int, int]:
    """(total, available) host RAM in bytes: Linux's MemAvailable (free plus reclaimable cache) where
    /proc/meminfo has it, else the free pages."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = page * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return total, int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return total, page * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError):
        return total, total


def host_bandwidth(nbytes: int = 256 << 20, repeats: int = 3) -> float:
    """Host copy bandwidth in bytes/s (read + write, the best of `repeats` copies of `nbytes`)."""
    src = np.ones(nbytes // 8, np.float64)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.nbytes / best


def cuda_machine(measure: bool = True) -> Machine | None:
    """The current CUDA device (memory, probe bandwidth), or None without CuPy / a device."""
    try:
        import cupy as cp

        if cp.cuda.runtime.getDeviceCount() < 1:
            return None
        free, total = cp.cuda.runtime.memGetInfo()
        name = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"]
        name = name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # noqa: BLE001 - no CuPy, no driver, no device: plan for the host
        return None
    bw = 0.0
    if measure:
        try:
            from decapybara.backend import cupy_ops_extra as ex

            res = ex.bandwidth_probe(min(1 << 30, free // 4), repeats=3)
            bw = max(res["copy_GBps"], res["cupy_copy_GBps"]) * 1e9
        except Exception:  # noqa: BLE001 - the probe did not build or run: plan without a roofline
            bw = 0.0
    return Machine(f"cuda:{name}", int(total), int(free), bw)


def this_machine(measure: bool = True) -> Machine:
    """The CUDA device when there is one, else the host."""
    m = cuda_machine(measure)
    if m is not None:
        return m
    total, avail = host_memory()
    return Machine("cpu", total, avail, host_bandwidth() if measure else 0.0)
