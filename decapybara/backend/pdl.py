"""Programmatic dependent launch (Hopper and newer): a kernel launched through `launch` may begin while the
kernel before it in the stream is still running, once every block of that one has executed `pdl_trigger()`
(decapybara/kernels/pdl.cuh). The launched kernel must call `pdl_wait()` before it reads anything written since the last
kernel that completes only after waiting itself (in practice: anything a kernel of this step writes) and
before it writes anything; what it does before (the skinny GEMM: its first loads of a persistent weight;
gdn_decode: its first run's recurrent state and conv state, the conv weights, A and dt) overlaps
the earlier kernels' tails and the launch itself. Stream capture records the overlap as a programmatic graph
edge, so CUDA-graph decode steps keep it.

`launch(kernel, grid, block, args)` goes through the driver's ``cuLaunchKernelEx`` with the
programmatic-stream-serialization attribute when `enabled()`: compute capability 9.0 or newer, a driver
that exports it, and `MODE["pdl"]` (from $DECAPYBARA_PDL at import): ``0`` never, ``1`` (the default) while
`capturing()` (the decode graphs, `cuda_graph.capture_graph`), ``always`` also for eager launches. Otherwise
(and for kernels without a driver handle, e.g. on the host emulator) it is `plain`, the CuPy launch. Either
way the kernel computes the same values: under a plain launch `pdl_wait()` returns at once. Graphs only, not eager steps: an eager step is
bound by its Python launches, where the ctypes launch costs more than CuPy's and the overlap gains nothing.
On by default since the overlap tests (tests/gpu/test_pdl.py, which turn the output poisoning off so that
kernels really overlap) passed on the GPU (docs/perf.md).

Arguments are those of a CuPy `RawKernel` call as the wrappers pass them: device arrays, None (a null
pointer) and typed numpy scalars (int32 / int64 / uint32 / uint64 / float32 / float64).

`recording()` keeps this thread's `launch` / `plain` launches instead of making them (a persistent product
chain's items: decapybara/backend/product_chain.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import cupy as cp
import numpy as np

ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID (cuda.h)
_STATE = threading.local()  # depth: nesting of `capturing()` on this thread
# the overlap mode (module docstring), read once: an eager step asks at every launch
MODE: dict[str, str] = {"pdl": os.environ.get("DECAPYBARA_PDL", "1")}


class _Attr(ctypes.Structure):  # CUlaunchAttribute: id, 4 bytes of padding, a 64-byte value union (8-aligned)
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint64 * 8)]


class _Config(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_Attr)), ("num_attrs", ctypes.c_uint)]


_SCALARS = {np.dtype(np.int32): ctypes.c_int32, np.dtype(np.int64): ctypes.c_int64,
            np.dtype(np.uint32): ctypes.c_uint32, np.dtype(np.uint64): ctypes.c_uint64,
            np.dtype(np.float32): ctypes.c_float, np.dtype(np.float64): ctypes.c_double}


@functools.cache
def _driver() -> Any:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


@functools.cache
def _launch_ex() -> Any:
    """The driver's cuLaunchKernelEx, or None where the driver library or the entry point is missing."""
    fn = getattr(_driver(), "cuLaunchKernelEx", None)
    if fn is None:
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(_Config), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    return fn


def _error_name(code: int) -> str:
    name = ctypes.c_char_p()
    get = getattr(_driver(), "cuGetErrorName", None)
    if get is None or get(ctypes.c_int(code), ctypes.byref(name)) != 0 or not name.value:
        return f"CUresult {code}"
    return name.value.decode()


@contextlib.contextmanager
def _nested(counter: str) -> Iterator[None]:
    """Counts this thread's nesting in `_STATE.<counter>` while inside."""
    setattr(_STATE, counter, getattr(_STATE, counter, 0) + 1)
    try:
        yield
    finally:
        setattr(_STATE, counter, getattr(_STATE, counter) - 1)


def capturing() -> contextlib.AbstractContextManager[None]:
    """Marks this thread's launches as part of a graph capture (with $DECAPYBARA_PDL=1 they overlap)."""
    return _nested("depth")


def in_capture() -> bool:
    """Whether this thread is inside `capturing()` (a graph capture in progress: launches are recorded, nothing
    runs, and nothing may wait on the device)."""
    return getattr(_STATE, "depth", 0) > 0


def serial() -> contextlib.AbstractContextManager[None]:
    """This thread's launches inside are plain ones, even while `capturing()`."""
    return _nested("serial")


@functools.cache
def _device_ok(device: int) -> bool:
    return int(cp.cuda.Device(device).compute_capability) >= 90


def enabled() -> bool:
    """Whether `launch` overlaps kernels now (see the module docstring)."""
    mode = MODE["pdl"]
    if mode not in ("1", "always") or (mode == "1" and not getattr(_STATE, "depth", 0)) or getattr(_STATE, "serial", 0):
        return False
    try:
        return _device_ok(cp.cuda.Device().id) and _launch_ex() is not None
    except Exception:  # noqa: BLE001 - no usable device or driver: plain launches
        return False


def _function_handle(kernel: Any) -> int | None:
    """The CUfunction of a CuPy RawKernel (None when it has none, e.g. the host emulator's kernels)."""
    fn = getattr(kernel, "kernel", None)
    ptr = getattr(fn, "ptr", None)
    return int(ptr) if ptr else None


def resident_blocks(kernel: Any, threads: int, shared_mem: int = 0) -> int | None:
    """Blocks of `kernel` (a CuPy RawKernel) of `threads` threads and `shared_mem` bytes of dynamic shared memory an
    SM keeps resident at once (the driver's occupancy), or None where the driver cannot say (e.g. the host
    emulator's kernels)."""
    handle, lib = _function_handle(kernel), _driver()
    if handle is None or lib is None:
        return None
    got = ctypes.c_int(0)
    err = lib.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(got), ctypes.c_void_p(handle),
                                                           ctypes.c_int(threads), ctypes.c_size_t(shared_mem))
    return got.value if err == 0 else None


def _arg(a: Any) -> Any:
    if a is None:
        return ctypes.c_void_p(0)
    if isinstance(a, cp.ndarray):
        return ctypes.c_void_p(a.data.ptr)
    if isinstance(a, np.generic) and a.dtype in _SCALARS:
        return _SCALARS[a.dtype](a.item())
    raise TypeError(f"kernel argument of type {type(a).__name__} (expected a device array or a numpy scalar)")


@dataclass(frozen=True)
class Launch:
    """A launch `recording()` kept instead of making it (`overlap`: made by `launch` outside `serial()`, else
    plain); `make()` makes it as it would have been made."""

    kernel: Any
    grid: tuple[int, ...]
    block: tuple[int, ...]
    args: tuple[Any, ...]
    shared_mem: int
    overlap: bool = True

    def make(self) -> None:
        (launch if self.overlap else plain)(self.kernel, self.grid, self.block, self.args, self.shared_mem)


@contextlib.contextmanager
def recording() -> Iterator[list[Launch]]:
    """Inside, this thread's `launch` and `plain` launch nothing: each appends its `Launch` to the list yielded
    (decapybara/backend/product_chain.py runs recorded products as one persistent launch). Kernels launched any
    other way run as usual."""
    before = getattr(_STATE, "recorder", None)
    _STATE.recorder = out = []
    try:
        yield out
    finally:
        _STATE.recorder = before


def _recorded(kernel: Any, grid: tuple[int, ...], block: tuple[int, ...], args: tuple[Any, ...],
              shared_mem: int, overlap: bool) -> bool:
    rec = getattr(_STATE, "recorder", None)
    if rec is None:
        return False
    rec.append(Launch(kernel, tuple(grid), tuple(block), tuple(args), shared_mem, overlap))
    return True


def plain(kernel: Any, grid: tuple[int, ...], block: tuple[int, ...], args: tuple[Any, ...],
          shared_mem: int = 0) -> None:
    """The CuPy launch (the kernel starts after the one before it has finished)."""
    if _recorded(kernel, grid, block, args, shared_mem, False):
        return
    kernel(grid, block, args, shared_mem=shared_mem)


def launch(kernel: Any, grid: tuple[int, ...], block: tuple[int, ...], args: tuple[Any, ...],
           shared_mem: int = 0) -> None:
    """Launch `kernel` on the current stream, allowed to overlap the previous kernel (when `enabled()`). Only
    for kernels that call pdl_wait() as the module docstring says."""
    if _recorded(kernel, grid, block, args, shared_mem, not getattr(_STATE, "serial", 0)):
        return
    handle = _function_handle(kernel) if enabled() else None
    if handle is None:
        kernel(grid, block, args, shared_mem=shared_mem)
        return
    g = (*grid, 1, 1, 1)[:3]
    b = (*block, 1, 1, 1)[:3]
    attr = _Attr(id=ATTR_PROGRAMMATIC_STREAM_SERIALIZATION)
    attr.value[0] = 1  # programmaticStreamSerializationAllowed
    cfg = _Config((ctypes.c_uint * 3)(*g), (ctypes.c_uint * 3)(*b), shared_mem,
                  ctypes.c_void_p(cp.cuda.get_current_stream().ptr), ctypes.pointer(attr), 1)
    values = [_arg(a) for a in args]
    params = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
    err = _launch_ex()(ctypes.byref(cfg), ctypes.c_void_p(handle), params, None)
    if err != 0:
        raise RuntimeError(f"cuLaunchKernelEx failed: {_error_name(err)} ({getattr(kernel, 'name', kernel)})")
