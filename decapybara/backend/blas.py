"""cuBLAS GEMMs that a CUDA graph can capture.

CuPy's cuBLAS wrappers set the handle's stream at every call and refuse to while the stream captures
(NotImplementedError), so no CuPy cuBLAS call can sit in a graph. cuBLAS itself captures fine when no call
allocates or syncs: this module calls libcublas (the copy CuPy loaded) through ctypes on handles of its own, one
a (device, stream), each bound to its stream with a fixed workspace (`WORKSPACE` bytes) and host pointer mode
once, when first asked for outside a capture. A call afterwards sets nothing, so it is legal
during a capture; a stream first met during a capture has no handle and the call raises `CaptureError` (bind it
before: `bind(stream)`).

Host pointer mode: alpha and beta are read at the call; in a capture, their values at capture time are the
graph's (`gemm_ex` callers pass constants).
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from dataclasses import dataclass
from typing import Any

import cupy as cp

WORKSPACE = 32 << 20  # bytes a handle's workspace (cuBLAS's advice for Hopper)
CUBLAS_POINTER_MODE_HOST = 0


class CaptureError(RuntimeError):
    """A cuBLAS call during a capture on a stream with no bound handle."""


class Library:
    """The libcublas entry points used, typed (ctypes)."""

    def __init__(self, lib: ctypes.CDLL):
        vp, i, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
        self._create = lib.cublasCreate_v2
        self._create.argtypes = [ctypes.POINTER(vp)]
        self._set_stream = lib.cublasSetStream_v2
        self._set_stream.argtypes = [vp, vp]
        self._set_workspace = lib.cublasSetWorkspace_v2
        self._set_workspace.argtypes = [vp, vp, sz]
        self._set_pointer_mode = lib.cublasSetPointerMode_v2
        self._set_pointer_mode.argtypes = [vp, i]
        self._gemm_ex = lib.cublasGemmEx
        self._gemm_ex.argtypes = [vp, i, i, i, i, i, vp, vp, i, i, vp, i, i, vp, vp, i, i, i, i]
        for f in (self._create, self._set_stream, self._set_workspace, self._set_pointer_mode, self._gemm_ex):
            f.restype = i

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{what}: cublasStatus_t {status}")

    def create(self) -> int:
        h = ctypes.c_void_p()
        self._check(self._create(ctypes.byref(h)), "cublasCreate_v2")
        return int(h.value)

    def bind(self, handle: int, stream: int, workspace: int, size: int) -> None:
        """Binds `handle` to `stream` with its own workspace, host pointer mode (the stream first: setting it
        resets the workspace to cuBLAS's pool)."""
        self._check(self._set_stream(handle, stream), "cublasSetStream_v2")
        self._check(self._set_workspace(handle, workspace, size), "cublasSetWorkspace_v2")
        self._check(self._set_pointer_mode(handle, CUBLAS_POINTER_MODE_HOST), "cublasSetPointerMode_v2")

    def gemm_ex(self, handle: int, *args: int) -> None:
        """cublasGemmEx(handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc,
        computeType, algo), pointers as ints."""
        self._check(self._gemm_ex(handle, *args), "cublasGemmEx")


_SONAMES = ("libcublas.so.13", "libcublas.so.12", "libcublas.so")


@functools.cache
def library() -> Library | None:
    """libcublas through ctypes: the copy CuPy's cuBLAS module loaded (opened by soname with RTLD_NOLOAD, else by
    its path in the process's map), once CuPy has made its handle; None where none opens (then `gemm_ex` takes
    CuPy's wrapper, which no capture can hold)."""
    cp.cuda.device.get_cublas_handle()  # CuPy's cuBLAS loaded
    with open("/proc/self/maps") as f:
        paths = sorted({fields[5] for fields in map(str.split, f) if len(fields) >= 6 and "/libcublas.so" in fields[5]})
    flags = os.RTLD_NOLOAD | os.RTLD_LAZY  # never a second copy
    for name in (*_SONAMES, *paths):
        try:
            return Library(ctypes.CDLL(name, mode=flags))
        except (OSError, AttributeError):  # not loaded, or without an entry point used
            continue
    return None


@dataclass(frozen=True)
class _Bound:
    handle: int
    workspace: Any  # uint8 [WORKSPACE] device array from the default pool, held for the handle's life


# NOTE: a handle lives as long as the process: one a stream the process ever ran a GEMM on (the engine's: its
# compute stream and its tails' capture stream; each new engine in one process adds its capture stream's)
_HANDLES: dict[tuple[int, int], _Bound] = {}
_LOCK = threading.Lock()


def _capturing(stream: int) -> bool:
    return bool(cp.cuda.runtime.streamIsCapturing(stream))


def bind(stream: Any = None) -> int:
    """The handle bound to `stream` (a cupy Stream of the current device, or the current stream), made and bound
    now if it has none; CaptureError where that would happen during a capture. Its workspace comes from the
    default memory pool whatever allocator is in use (a graph's private pool would free it with the graph)."""
    ptr = int((stream if stream is not None else cp.cuda.get_current_stream()).ptr)
    key = (cp.cuda.runtime.getDevice(), ptr)
    bound = _HANDLES.get(key)
    if bound is not None:
        return bound.handle
    if _capturing(ptr):
        raise CaptureError(f"stream {ptr:#x} captures and has no cuBLAS handle: bind it before the capture")
    from decapybara.backend.cupy_ops import dev_ptr  # (cupy_ops imports this module)

    lib = library()
    assert lib is not None, "no libcublas to bind"
    with _LOCK:
        bound = _HANDLES.get(key)
        if bound is None:
            with cp.cuda.using_allocator(cp.get_default_memory_pool().malloc):
                workspace = cp.empty(WORKSPACE, cp.uint8)
            handle = lib.create()
            lib.bind(handle, ptr, dev_ptr(workspace), WORKSPACE)
            bound = _HANDLES[key] = _Bound(handle, workspace)
    return bound.handle


def gemm_ex(*args: int) -> None:
    """cublasGemmEx on the current stream's handle (`bind`); args as `Library.gemm_ex` takes them after the
    handle. Without a library of its own (`library` None), CuPy's handle and wrapper: the same product, but a
    capture refuses it."""
    lib = library()
    if lib is None:
        from cupy_backends.cuda.libs import cublas

        handle = cp.cuda.device.get_cublas_handle()
        cublas.setStream(handle, cp.cuda.get_current_stream().ptr)
        cublas.setPointerMode(handle, CUBLAS_POINTER_MODE_HOST)
        cublas.gemmEx(handle, *args)
        return
    lib.gemm_ex(bind(), *args)
