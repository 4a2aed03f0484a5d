"""CUDA kernels (``decapybara/kernels/*.cu``) and their cached loader.

`load_module(name, defines)` compiles ``decapybara/kernels/<name>.cu`` once per (name, defines, device arch) and returns
a ``cupy.RawModule``; `get_kernel(name, func, defines)` returns one ``extern "C"`` entry point of it.

Compile options live here and nowhere else: ``--std=c++17 -O3``, the include path of this folder, the
device's own architecture (``sm_90`` on Hopper), and no ``-use_fast_math`` (kernels must reproduce the numpy
reference: IEEE division, sqrt, exp). Two compilers:

- ``nvcc`` (when found on PATH or under $CUDA_PATH): builds a cubin with exactly these options (subnormals
  kept), cached on disk under $DECAPYBARA_KERNEL_CACHE (default ``~/.cache/decapybara/kernels``) by a hash
  of the sources, defines, options and the nvcc version. A failed nvcc build falls back to NVRTC (warning).
  At most $DECAPYBARA_NVCC_JOBS (default: the CPUs the process may use) nvcc processes run at once among the
  processes that share the cache folder (pytest-xdist workers each building several variants side by side).
- NVRTC through ``cupy.RawModule(code=...)``: CuPy appends the architecture itself and forces ``-ftz=true``,
  so float32 subnormals flush to zero (only results below ~1e-38 can differ from the reference).

$DECAPYBARA_KERNEL_COMPILER = ``nvcc`` | ``nvrtc`` forces one. $DECAPYBARA_KERNEL_LINEINFO (set, not empty) adds
``-lineinfo``: the same code, with the source line of each instruction for profilers (Nsight Compute's source
page; bench/ncu_source.py). `cupy` is imported lazily: ``import decapybara.kernels`` works on machines without CuPy.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

KERNEL_DIR = Path(__file__).resolve().parent
BASE_OPTIONS = ("--std=c++17", "-O3")
Defines = tuple[tuple[str, Any], ...]


def has_cuda() -> bool:
    """True when CuPy imports and at least one CUDA device is visible."""
    try:
        import cupy
    except (ImportError, RuntimeError, OSError):
        return False
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except (RuntimeError, OSError):  # CUDARuntimeError is a RuntimeError
        return False


def device_arch() -> str:
    """Compute capability of the current device as ``"90"`` (Hopper), ``"100"``... (cached per device: every
    eager launch asks, through `get_kernel`)."""
    import cupy

    return _arch_of(cupy.cuda.runtime.getDevice())


@functools.cache
def _arch_of(device: int) -> str:
    import cupy

    return cupy.cuda.Device(device).compute_capability


def arch_flag(arch: str, defines: Defines = ()) -> str:
    """``-arch=sm_90`` on Hopper, else the device's own ``sm_XX``; ``sm_90a`` (Hopper's arch-specific features:
    wgmma, decapybara/kernels/wgmma.cuh) for a build whose defines set SM90A."""
    accel = arch == "90" and needs_sm90a(defines)
    return f"-arch=sm_{arch}{'a' if accel else ''}"


def _source_text(name: str) -> str:
    path = KERNEL_DIR / f"{name}.cu"
    if not path.is_file():
        raise FileNotFoundError(f"no kernel source {path}")
    return path.read_text()


def _headers_text() -> str:
    return "".join(p.read_text() for p in sorted(KERNEL_DIR.glob("*.cuh")))


def _define_flags(defines: Defines) -> tuple[str, ...]:
    flags = []
    for key, value in defines:
        if not key.isidentifier():
            raise ValueError(f"bad define name {key!r}")
        flags.append(f"-D{key}={int(value) if isinstance(value, bool) else value}")
    return tuple(flags)


def _find_nvcc() -> str | None:
    return _nvcc_at(os.environ.get("CUDA_PATH") or os.environ.get("CUDA_HOME"), os.environ.get("PATH"))


@functools.cache
def _nvcc_at(cuda: str | None, path: str | None) -> str | None:
    """nvcc under $CUDA_PATH / $CUDA_HOME, else on PATH, else /usr/local/cuda's (cached by those settings: a
    PATH search took ~80 us, and `get_kernel` asks at every eager launch)."""
    if cuda and (Path(cuda) / "bin" / "nvcc").is_file():
        return str(Path(cuda) / "bin" / "nvcc")
    return shutil.which("nvcc", path=path) or (
        "/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").is_file() else None)


def line_info() -> tuple[str, ...]:
    """``("-lineinfo",)`` where $DECAPYBARA_KERNEL_LINEINFO is set (not empty), else nothing."""
    return ("-lineinfo",) if os.environ.get("DECAPYBARA_KERNEL_LINEINFO") else ()


def compiler() -> str:
    """``nvcc`` or ``nvrtc``: what `load_module` uses on this machine."""
    forced = os.environ.get("DECAPYBARA_KERNEL_COMPILER", "").lower()
    if forced in ("nvcc", "nvrtc"):
        return forced
    return "nvcc" if _find_nvcc() else "nvrtc"


@functools.cache
def _nvcc_version(nvcc: str) -> str:
    return subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout


def _cache_dir() -> Path:
    """$DECAPYBARA_KERNEL_CACHE, else ~/.cache/decapybara/kernels, else a folder under the temp dir."""
    env = os.environ.get("DECAPYBARA_KERNEL_CACHE")
    for cand in ([Path(env)] if env else []) + [Path.home() / ".cache" / "decapybara" / "kernels",
                                                 Path(tempfile.gettempdir()) / "decapybara-kernels"]:
        try:
            cand.mkdir(parents=True, exist_ok=True)
            return cand
        except OSError:
            continue
    raise RuntimeError("no writable folder for compiled kernels; set DECAPYBARA_KERNEL_CACHE")


def nvcc_jobs() -> int:
    """How many nvcc processes may run at once among the processes sharing the kernel cache:
    $DECAPYBARA_NVCC_JOBS (at least 1), else the CPUs this process may run on. Processes that share a cache
    should agree on it (each counts the slots it was given)."""
    env = os.environ.get("DECAPYBARA_NVCC_JOBS")
    if env:
        return max(1, int(env))
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    return max(1, len(cpus))


@contextlib.contextmanager
def _nvcc_slot(cache: Path) -> Iterator[None]:
    """Holds one of `nvcc_jobs()` slots, each an exclusive lock on a file of the cache folder, for the duration
    of one nvcc process; waits while all are held (a lock is released when its holder exits, however it ends)."""
    n, start = nvcc_jobs(), os.getpid()
    while True:
        for i in range(n):
            fh = open(cache / f"nvcc-slot-{(start + i) % n}.lock", "w")  # noqa: SIM115 (held past the loop)
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                fh.close()
                continue
            except BaseException:
                fh.close()
                raise
            try:
                yield
            finally:
                fh.close()
            return
        time.sleep(0.05)


def _build_cubin(name: str, options: tuple[str, ...]) -> Path:
    nvcc = _find_nvcc()
    if nvcc is None:
        raise RuntimeError("DECAPYBARA_KERNEL_COMPILER=nvcc but no nvcc found")
    cache = _cache_dir()
    key = hashlib.sha256("\0".join([_source_text(name), _headers_text(), *options,
                                    _nvcc_version(nvcc)]).encode()).hexdigest()[:24]
    out = cache / f"{name}-{key}.cubin"
    if out.is_file():
        return out
    # One build per cubin across processes (pytest-xdist workers, a benchmark's compile pool): the others wait
    # on the lock, then find the file. Without it every worker compiled every kernel variant itself, and the
    # GPU suite's first run spent minutes of its device time in duplicate nvcc processes.
    with open(cache / f"{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if out.is_file():
            return out
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            tmp_out = Path(tmp) / out.name
            cmd = [nvcc, "-cubin", *options, "-o", str(tmp_out), str(KERNEL_DIR / f"{name}.cu")]
            with _nvcc_slot(cache):
                res = subprocess.run(cmd, check=False, capture_output=True, text=True)
            if res.returncode != 0:
                raise RuntimeError(f"nvcc failed for {name}.cu ({' '.join(cmd)}):\n{res.stderr}")
            os.replace(tmp_out, out)  # atomic: a reader without the lock sees no file or the whole one
    return out


def needs_sm90a(defines: Defines) -> bool:
    """Whether a build's defines ask for Hopper's arch-specific code (SM90A: wgmma)."""
    return any(k == "SM90A" and v for k, v in defines)


def sm90a_ok() -> bool:
    """Whether this device takes sm_90a builds: a Hopper device, the nvcc compiler, and a build of
    ``wgmma_probe.cu`` that succeeds (once per process; the cubin is cached on disk). Where it does not, callers
    choose their plain builds (a failed nvcc build of sm_90a code has no NVRTC fallback)."""
    return _sm90a_ok(device_arch(), compiler())


@functools.cache
def _sm90a_ok(arch: str, which: str) -> bool:
    if arch != "90" or which != "nvcc":
        return False
    try:
        load_module("wgmma_probe", (("SM90A", 1),))
    except (RuntimeError, OSError) as e:
        warnings.warn(f"no sm_90a build here, the plain builds serve: {e}", stacklevel=2)
        return False
    return True


def nvcc_options(arch: str, defines: Defines = ()) -> tuple[str, ...]:
    """The nvcc options of a build for compute capability `arch` (e.g. "90") with `defines`."""
    return (*BASE_OPTIONS, arch_flag(arch, defines), f"-I{KERNEL_DIR}", *line_info(), *_define_flags(defines))


@functools.cache
def _load(name: str, defines: Defines, arch: str, which: str) -> Any:
    import cupy

    if which == "nvcc":
        try:
            return cupy.RawModule(path=str(_build_cubin(name, nvcc_options(arch, defines))))
        except (RuntimeError, OSError) as e:  # e.g. nvcc without a host compiler: NVRTC still works
            if needs_sm90a(defines):  # but not for sm_90a code (NVRTC targets plain sm_90): callers check first
                raise
            warnings.warn(f"nvcc build of {name}.cu failed, compiling with NVRTC instead: {e}", stacklevel=3)
    # NOTE: CuPy adds -arch=sm_<device> (capped at NVRTC's newest) and -ftz=true itself.
    options = (*BASE_OPTIONS[:1], f"-I{KERNEL_DIR}", *line_info(), *_define_flags(defines))
    return cupy.RawModule(code=_source_text(name), options=options)


def load_module(name: str, defines: Defines = ()) -> Any:
    """The compiled ``decapybara/kernels/<name>.cu`` (a ``cupy.RawModule``), cached per (name, defines, arch)."""
    return _load(name, tuple((str(k), v) for k, v in defines), device_arch(), compiler())


_KERNELS: dict[tuple[Any, ...], Any] = {}  # (name, func, defines as given, device) -> kernel


def get_kernel(name: str, func: str, defines: Defines = ()) -> Any:
    """One ``extern "C"`` kernel of ``<name>.cu`` (a ``cupy.RawKernel``), cached like its module. Every
    eager launch asks, so a kernel seen before on this device comes from one dict lookup, without reading the
    environment again: the compiler in force at its first use on a device (`compiler()`) is the one it keeps."""
    import cupy

    d = defines if type(defines) is tuple else tuple(defines)
    key = (name, func, d, cupy.cuda.runtime.getDevice())
    kernel = _KERNELS.get(key)
    if kernel is None:
        kernel = _KERNELS[key] = _get_kernel(name, func, tuple((str(k), v) for k, v in d), device_arch(), compiler())
    return kernel


def kernel_origin(kernel: Any) -> tuple[str, str, Defines] | None:
    """(kernel file, function, defines) that `get_kernel` gave `kernel` for, or None for one it did not give."""
    for (name, func, defines, _device), k in _KERNELS.items():
        if k is kernel:
            return name, func, defines
    return None


@functools.cache
def _get_kernel(name: str, func: str, defines: Defines, arch: str, which: str) -> Any:
    return _load(name, defines, arch, which).get_function(func)
