"""A numpy-backed stand-in for CuPy whose RawModule kernels run in the host CUDA emulator (emu.cpp)."""
import contextlib, ctypes, hashlib, itertools, json, os, re, subprocess, sys, threading, types
import numpy as np
from ptx_lower import inline_includes, lower_asm, lower_dynamic_shared, register_static_shared

EMU = os.path.dirname(os.path.abspath(__file__))
BUILD = os.path.join(EMU, "build")
# a kernel module's build; -fno-gnu-unique: a template's static locals (the __shared__ arrays of a templated device
# function) stay each module's own, as on a GPU, not one copy for every loaded build of the same source.
# CUDA_EMU_DEBUG=1 adds debug information (-g, for gdb), which makes a build ~1.4x as long.
DEBUG = ("-g",) if os.environ.get("CUDA_EMU_DEBUG") == "1" else ()
CXXFLAGS = ("-O1", *DEBUG, "-std=c++20", "-shared", "-fPIC", "-fno-gnu-unique", "-Wno-unknown-pragmas")
os.makedirs(BUILD, exist_ok=True)
_TYPES = {"ptr": 0, "i32": 1, "i64": 2, "f32": 3, "f64": 4}
# CUDA_EMU_STRIDED=1: a non-contiguous array argument passes its first element's address, as CuPy passes a view
# (for kernels that take row strides, e.g. column views of fused products); else it is refused, so that a
# wrapper that forgets a copy shows up.
STRIDED = os.environ.get("CUDA_EMU_STRIDED") == "1"
# CUDA_EMU_RESIDENT=N (or fake_cupy.RESIDENT): a launch runs up to N blocks side by side, as a GPU keeps blocks
# resident, so that blocks that wait on one another (a persistent kernel's counters, spun on with clock64 or
# __nanosleep, which yield) can; 1 (the default): one block at a time. Each block then has dynamic shared memory of
# its own, dynamic and static.
RESIDENT = int(os.environ.get("CUDA_EMU_RESIDENT", "1"))
# CUDA_EMU_NOOP=1: kernels are not built or run; a launch checks its arguments against the kernel's signature and
# returns (bench/host_emu.py: the host side of a forward, timed without a GPU).
NOOP = os.environ.get("CUDA_EMU_NOOP") == "1"


def _classify(param: str) -> str:
    p = param.strip()
    if "*" in p:
        return "ptr"
    t = p.rsplit(None, 1)[0] if " " in p else p
    t = t.replace("const", "").strip()
    if t in ("i64", "long long", "long", "u64", "unsigned long long", "size_t"):
        return "i64"
    if t == "float":
        return "f32"
    if t == "double":
        return "f64"
    if t in ("int", "u32", "unsigned", "unsigned int", "bool"):
        return "i32"
    raise ValueError(f"unknown param type {p!r}")


def _tmp(path: str) -> str:
    """This thread's temporary name for `path`: emulator processes, and threads of one, may build side by side, so
    each writes a file of its own and renames it into place (a reader sees one writer's whole file, never a part)."""
    return f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"


def _emu_object() -> str:
    """emu.cpp compiled once into build/emu.o (rebuilt when emu.cpp / emu.h change)."""
    obj = os.path.join(BUILD, "emu.o")
    srcs = [os.path.join(EMU, f) for f in ("emu.cpp", "emu.h")]
    if not os.path.exists(obj) or os.path.getmtime(obj) < max(map(os.path.getmtime, srcs)):
        subprocess.run(["g++", "-O1", *DEBUG, "-std=c++20", "-fPIC", "-c", srcs[0], "-o", _tmp(obj)], check=True)
        os.replace(_tmp(obj), obj)
    return obj


# stream capture (`Stream.begin_capture` ... `end_capture`): launches and device-to-device copies are recorded, not
# run, and a graph's `launch` runs them in order; a cuBLAS call through CuPy's wrapper raises, as CuPy's does during a
# capture, and one through decapybara/backend/blas.py's handles (fake_cublas.LIBRARY) is recorded. Numpy work on
# device arrays (`DevArray`, what the fake CuPy's constructors return) during a capture is recorded too, as a real
# capture records CuPy's elementwise kernels: new arrays (elementwise ops and reductions, numpy functions, `astype` /
# `copy` / gathers by index arrays, copies by `asarray`) are computed at once and recomputed into themselves at each
# replay; work into existing arrays (`out=`, assignments, `fill`, `set`) is recorded and not done; host reads and
# boolean-mask gathers raise (`DevArray`).
CAPTURE: list | None = None
REPLAYING = False  # a graph's launch is running its recorded operations
# arrays allocated during the capture in progress (cp.empty, zeros, ...): its graph holds them, as a graph's memory
# pool holds its blocks, so that recorded operations that address them by pointer (cuBLAS, device copies) never
# write into memory numpy has handed back
CAPTURE_KEEP: list = []


def deferred(fn):
    """Runs fn now, or records it in the capture in progress."""
    if CAPTURE is not None:
        CAPTURE.append(fn)
    else:
        fn()


def _recording() -> bool:
    return CAPTURE is not None


def _remake(result, make):
    """Records, in the capture in progress, `make()` recomputed into `result` (an array it returned)."""
    CAPTURE_KEEP.append(result)
    CAPTURE.append(lambda: np.copyto(result, make(), casting="unsafe"))


def _base(a):
    return a.view(np.ndarray) if isinstance(a, DevArray) else a


def _dev(result):
    """A result as device arrays: arrays viewed as `DevArray`; during a capture a scalar as a 0-d one (CuPy's
    results stay on the device)."""
    if isinstance(result, tuple):
        return tuple(_dev(r) for r in result)
    if isinstance(result, np.ndarray):
        return result if isinstance(result, DevArray) else result.view(DevArray)
    if _recording() and isinstance(result, np.generic):
        return np.asarray(result).view(DevArray)
    return result


def _host_sync(what):
    if _recording():
        raise RuntimeError(f"{what} of a device array during a stream capture (a host synchronisation: the capture "
                           f"would fail on a GPU)")


_METADATA = {np.may_share_memory, np.shares_memory, np.shape, np.ndim, np.size, np.result_type, np.can_cast,
             np.iscomplexobj, np.isrealobj}


class DevArray(np.ndarray):
    """A fake device array: a numpy array whose numpy work during a capture is recorded for the graph's replays
    (module comment above). During a capture, work into existing arrays (`out=`, assignments, `fill`) is recorded
    and not done, as a real capture does nothing until its graph runs; new arrays are computed at once (their shapes)
    and recomputed at each replay; reading values on the host (`int()`, `float()`, `bool()`, `item()`, `asnumpy`)
    or a gather by a boolean mask (CuPy's syncs for its count) raises. Outside captures a plain numpy array in all
    but its type."""

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        args = tuple(_base(a) for a in inputs)
        outs = kwargs.get("out")
        if outs is not None:
            kwargs["out"] = tuple(_base(o) for o in outs)
        run = getattr(ufunc, method)
        if not _recording():
            result = run(*args, **kwargs)
            return (outs if len(outs) > 1 else outs[0]) if outs is not None else _dev(result)
        if method not in ("__call__", "reduce", "accumulate", "outer"):
            raise RuntimeError(f"{ufunc.__name__}.{method} on device arrays during a capture: not emulated")
        if outs is not None:  # into existing arrays: recorded, not done now
            again = dict(kwargs)
            if method != "__call__" or len(outs) == 1:
                again["out"] = kwargs["out"][0]
            CAPTURE.append(lambda: run(*args, **again))
            return outs if len(outs) > 1 else outs[0]
        got = _dev(run(*args, **kwargs))
        targets = tuple(g.view(np.ndarray) for g in (got if isinstance(got, tuple) else (got,)))
        CAPTURE_KEEP.extend(targets)
        again = {**kwargs, "out": targets if len(targets) > 1 else targets[0]}
        CAPTURE.append(lambda: run(*args, **again))
        return got

    def __array_function__(self, func, types_, args, kwargs):
        if func in _METADATA:  # shapes and addresses: host facts, no device work
            return func(*(_base(a) for a in args), **kwargs)
        result = super().__array_function__(func, types_, args, kwargs)
        if _recording():
            if result is None:  # in place (np.copyto, np.put, ...): it ran now; again at each replay
                CAPTURE.append(lambda: func(*args, **kwargs))
            elif isinstance(result, np.generic):  # a scalar: a 0-d device array, as CuPy's
                result = np.asarray(result)
                _remake(result, lambda: func(*args, **kwargs))
            elif not isinstance(result, np.ndarray):
                raise RuntimeError(f"numpy.{func.__name__} of device arrays during a capture: not emulated")
            elif not any(isinstance(a, np.ndarray) and np.may_share_memory(_base(result), _base(a))
                         for a in (*args, *kwargs.values())):
                _remake(result.view(np.ndarray), lambda: func(*args, **kwargs))
        return _dev(result)

    def _new(self, name, *a, **kw):
        """A method that computes an array from this one (or a view of it)."""
        result = getattr(np.ndarray, name)(self, *a, **kw)
        if _recording():
            if isinstance(result, np.ndarray) and not np.may_share_memory(_base(result), _base(self)):
                _remake(result.view(np.ndarray), lambda: getattr(np.ndarray, name)(self.view(np.ndarray), *a, **kw))
            elif not isinstance(result, np.ndarray):
                result = np.asarray(result)
                _remake(result, lambda: getattr(np.ndarray, name)(self.view(np.ndarray), *a, **kw))
        return _dev(result)

    def astype(self, *a, **kw):
        return self._new("astype", *a, **kw)

    def copy(self, *a, **kw):
        return self._new("copy", *a, **kw)

    def __getitem__(self, key):
        if _recording():
            keys = key if isinstance(key, tuple) else (key,)
            if any(isinstance(k, np.ndarray) and k.dtype == np.bool_ for k in keys):
                raise RuntimeError("a gather by a boolean mask during a capture (CuPy syncs for its count)")
        return self._new("__getitem__", key)

    def _in_place(self, name, *a, **kw):
        """A method that writes into this array: recorded and not done during a capture, else done."""
        if _recording():
            CAPTURE.append(lambda: getattr(np.ndarray, name)(self.view(np.ndarray), *a, **kw))
        else:
            getattr(np.ndarray, name)(self, *a, **kw)

    def _host_read(self, name, what, *a):
        """A method that reads values on the host: refused during a capture."""
        _host_sync(what)
        return getattr(np.ndarray, name)(self, *a)

    def set(self, arr, stream=None):
        """CuPy's host -> device copy into this array."""
        self[...] = arr

    def get(self, stream=None, order="C", out=None):
        return asnumpy(self, out=out)


for _name in ("__setitem__", "fill", "sort"):
    setattr(DevArray, _name, lambda self, *a, _n=_name, **kw: self._in_place(_n, *a, **kw))
for _name, _what in (("__float__", "float()"), ("__int__", "int()"), ("__index__", "an index"), ("__bool__", "bool()"),
                     ("item", "item()"), ("tolist", "tolist()"), ("nonzero", "nonzero() (its count)")):
    setattr(DevArray, _name, lambda self, *a, _n=_name, _w=_what: self._host_read(_n, _w, *a))
for _name in ("flatten", "ravel", "reshape", "take", "repeat", "argmax", "argmin", "cumsum", "cumprod", "round", "clip",
              "dot", "squeeze", "transpose", "swapaxes", "diagonal", "any", "all"):
    setattr(DevArray, _name, lambda self, *a, _n=_name, **kw: self._new(_n, *a, **kw))
DevArray.argsort = lambda self, axis=-1, kind=None, order=None: self._new("argsort", axis, kind="stable")  # as CuPy's


_ALLOCATOR = threading.local()  # `cuda.using_allocator`'s allocator on this thread


class _Held:
    """An allocator's memory (anything with a host address `ptr`: `HostBlock`, `MemoryPointer`) as numpy bytes;
    an array made of it keeps it (and its owner) alive."""

    def __init__(self, mem, nbytes):
        self.mem = mem
        self.__array_interface__ = {"data": (mem.ptr, False), "shape": (nbytes,), "typestr": "|u1", "version": 3}


def on_device(fn, allocates=False):
    """`fn`, its array results as device arrays (`DevArray`) and, made during a capture, kept with its graph (a
    copy of an array argument recomputed at each replay). `allocates` (`empty`, `empty_like`): the memory comes from
    the current allocator where one is set (`cuda.using_allocator`: `HostBlock`s, or `MemoryPointer`s over them as
    decapybara/backend/piecewise.py's arena hands out), else from numpy."""
    def make(*args, **kwargs):
        out = fn(*args, **kwargs)
        alloc = getattr(_ALLOCATOR, "fn", None)
        if allocates and alloc is not None and out.nbytes:  # the allocator's memory, held while the array lives
            out = np.asarray(_Held(alloc(out.nbytes), out.nbytes)).view(out.dtype).reshape(out.shape)
        if isinstance(out, np.ndarray):
            if CAPTURE is not None:
                src = args[0] if args and isinstance(args[0], np.ndarray) else None
                if src is not None and not allocates and not np.may_share_memory(_base(out), _base(src)):
                    _remake(out.view(np.ndarray), lambda: fn(*args, **kwargs))  # a copy: made again at each replay
                CAPTURE_KEEP.append(out)
            out = out.view(DevArray)
        return out
    return make


def asnumpy(a, stream=None, order="C", out=None, blocking=True):
    if isinstance(a, DevArray):
        _host_sync("asnumpy")
    if out is None:
        return np.array(a, copy=True, subok=False)
    out[...] = a
    return out


class FakeGraph:
    def __init__(self, ops, keep=()):
        self.ops, self.keep = ops, list(keep)

    def launch(self, stream=None):
        global REPLAYING
        REPLAYING = True
        try:
            for op in self.ops:
                op()
        finally:
            REPLAYING = False


class FakeKernel:
    def __init__(self, lib, name, sig):
        self.fn = ctypes.cast(getattr(lib, name), ctypes.c_void_p).value if lib is not None else None
        self.name, self.sig = name, sig
        self._max_dynamic = 48 * 1024
        self.lib = lib

    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        return self._max_dynamic

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, nbytes: int) -> None:
        optin = device_profile()[1]  # as cudaFuncSetAttribute refuses more than the device's opt-in limit
        if nbytes > optin:
            raise RuntimeError(f"{self.name}: {nbytes} B of dynamic shared memory asked, the device allows {optin}")
        self._max_dynamic = nbytes

    def __call__(self, grid, block, args, shared_mem=0, stream=None):
        if CAPTURE is not None:
            args = tuple(args)
            CAPTURE.append(lambda: self(grid, block, args, shared_mem, stream))
            return
        grid = tuple(grid) + (1,) * (3 - len(grid))
        block = tuple(block) + (1,) * (3 - len(block))
        if len(args) != len(self.sig):
            raise TypeError(f"{self.name}: {len(args)} args for {len(self.sig)} params")
        if shared_mem > self.max_dynamic_shared_size_bytes:
            raise RuntimeError(f"{self.name}: {shared_mem} B dynamic smem > limit {self.max_dynamic_shared_size_bytes}")
        if block[0] * block[1] * block[2] > 1024:
            raise RuntimeError(f"{self.name}: block too large {block}")
        keep, vals, types_ = [], [], []
        noop = self.lib is None  # NOOP: the checks alone
        for i, (a, kind) in enumerate(zip(args, self.sig)):
            if isinstance(a, np.ndarray):
                if kind != "ptr":
                    raise TypeError(f"{self.name} arg {i}: array for {kind}")
                if not a.flags.c_contiguous and not STRIDED:
                    raise TypeError(f"{self.name} arg {i}: non-contiguous array")
                if noop:
                    continue
                v = ctypes.c_void_p(a.ctypes.data if a.size else 0)
            elif a is None:
                if kind != "ptr":
                    raise TypeError(f"{self.name} arg {i}: None for {kind}")
                if noop:
                    continue
                v = ctypes.c_void_p(0)
            elif isinstance(a, (bool, int, float)) and not isinstance(a, np.generic):
                raise TypeError(f"{self.name} arg {i}: python scalar {a!r} (pass numpy typed scalars)")
            else:
                want = {"i32": np.int32, "i64": np.int64, "f32": np.float32, "f64": np.float64}.get(kind)
                unsigned = {"i32": np.uint32, "i64": np.uint64}.get(kind)  # the same bits (u32 / u64 parameters)
                if want is None or (type(a) is not want and type(a) is not unsigned):
                    raise TypeError(f"{self.name} arg {i}: {type(a).__name__} for {kind}")
                if noop:
                    continue
                if type(a) is unsigned:
                    a = a.view(want)
                v = {"i32": ctypes.c_int32, "i64": ctypes.c_int64, "f32": ctypes.c_float, "f64": ctypes.c_double}[kind](a)
            keep.append(v)
            vals.append(ctypes.cast(ctypes.pointer(v), ctypes.c_void_p))
            types_.append(_TYPES[kind])
        if noop:
            return
        n = len(args)
        va = (ctypes.c_void_p * max(n, 1))(*[x.value for x in vals])
        ta = (ctypes.c_int * max(n, 1))(*types_)
        r = self.lib.emu_launch(ctypes.c_void_p(self.fn), n, ta, va, *[ctypes.c_uint(g) for g in grid],
                                *[ctypes.c_uint(b) for b in block], ctypes.c_long(shared_mem), ctypes.c_int(RESIDENT))
        assert r == 0


class RawModule:
    def __init__(self, code=None, *, path=None, options=(), **kw):
        assert code is not None, "fake RawModule needs code"
        incs = [o for o in options if o.startswith("-I")]
        defs = [o for o in options if o.startswith("-D")]
        # local headers inlined and inline PTX lowered to emulator calls (ptx_lower.py)
        code = register_static_shared(lower_dynamic_shared(lower_asm(inline_includes(code, [i[2:] for i in incs]))))
        emu_src = ""  # the emulator's own sources and the lowering: every kernel .so links emu.o
        for f in ("emu.h", "emu.cpp", "ptx_lower.py"):
            with open(os.path.join(EMU, f)) as fh:
                emu_src += fh.read()
        key = hashlib.sha256((code + "|".join(options) + emu_src + " ".join(CXXFLAGS)).encode()).hexdigest()[:16]
        so = os.path.join(BUILD, f"k_{key}.so")
        src = os.path.join(BUILD, f"k_{key}.cu")
        with open(_tmp(src), "w") as f:
            f.write(code)
        os.replace(_tmp(src), src)
        sig_file = os.path.join(BUILD, f"k_{key}.sigs.json")  # the kernels' parameter kinds, once per build
        if os.path.exists(sig_file):
            with open(sig_file) as f:
                self.sigs = json.load(f)
        else:
            pre = subprocess.run(["g++", "-std=c++20", "-E", "-x", "c++", "-include", os.path.join(EMU, "emu.h"), *incs,
                                  *defs, src], capture_output=True, text=True)
            if pre.returncode:
                raise RuntimeError(pre.stderr)
            self.sigs = {}
            for m in re.finditer(r'extern\s+"C"\s+void\s+(\w+)\s*\(([^)]*)\)', pre.stdout):
                params = [p for p in m.group(2).split(",") if p.strip()]
                self.sigs[m.group(1)] = [_classify(p) for p in params]
            with open(_tmp(sig_file), "w") as f:
                json.dump(self.sigs, f)
            os.replace(_tmp(sig_file), sig_file)
        if NOOP:
            self.lib = None
            return
        if not os.path.exists(so):
            cmd = ["g++", *CXXFLAGS, "-include",
                   os.path.join(EMU, "emu.h"), *incs, *defs, "-x", "c++", src, "-x", "none", _emu_object(),
                   "-lffi", "-o", _tmp(so)]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode:
                raise RuntimeError(r.stderr[-5000:])
            os.replace(_tmp(so), so)
        self.lib = ctypes.CDLL(so)
        self.lib.emu_launch.restype = ctypes.c_int

    def get_function(self, name):
        if name not in self.sigs:
            raise AttributeError(f"no kernel {name}")
        return FakeKernel(self.lib, name, self.sigs[name])


# The device the fake CuPy reports, by $CUDA_EMU_DEVICE: (compute capability, shared memory a block may opt in to,
# shared memory an SM, SMs, name). The kernels run on the host either way; what changes is what the launch code
# plans for: overlapped launches and sm_90a builds on Hopper only, shared-memory fits, one wave's blocks.
DEVICE_PROFILES = {
    "h200": ("90", 232448, 233472, 132, b"FakeH200"),
    "a100": ("80", 166912, 167936, 108, b"FakeA100"),
    "l40s": ("89", 101376, 102400, 142, b"FakeL40S"),
    "b200": ("100", 232448, 233472, 148, b"FakeB200"),
    "rtx5090": ("120", 101376, 102400, 170, b"FakeRTX5090"),
}


def device_profile() -> tuple:
    name = os.environ.get("CUDA_EMU_DEVICE", "h200").lower()
    if name not in DEVICE_PROFILES:
        raise ValueError(f"CUDA_EMU_DEVICE={name!r}: one of {', '.join(DEVICE_PROFILES)}")
    return DEVICE_PROFILES[name]


def install():
    cp = types.ModuleType("cupy")
    for k in dir(np):
        if not k.startswith("__"):
            setattr(cp, k, getattr(np, k))
    cp.ndarray = np.ndarray
    for name in ("empty", "zeros", "ones", "full", "empty_like", "zeros_like", "ones_like", "full_like", "arange",
                 "asarray", "array", "ascontiguousarray", "linspace", "frombuffer", "concatenate", "stack"):
        setattr(cp, name, on_device(getattr(np, name), allocates=name in ("empty", "empty_like")))
    # CuPy's argsort is stable (a radix sort): ties keep ascending indices, which the sampler's full sort relies on
    cp.argsort = on_device(lambda a, axis=-1, kind=None, order=None: np.argsort(a, axis=axis, kind="stable"))
    cp.asnumpy = asnumpy
    cp.RawModule = RawModule
    cp.__version__ = "fake"
    cuda = types.ModuleType("cupy.cuda")
    arch, optin, per_sm, sms, gpu_name = device_profile()
    class Device:
        def __init__(self, i=0): self.id = i
        compute_capability = arch
        attributes = {"MaxSharedMemoryPerBlockOptin": optin, "MaxSharedMemoryPerMultiprocessor": per_sm,
                      "MultiProcessorCount": sms}
        def synchronize(self): pass
        def __enter__(self): return self
        def __exit__(self, *exc): return False
    cuda.Device = Device
    runtime = types.ModuleType("cupy.cuda.runtime")
    runtime.getDeviceCount = lambda: 1
    runtime.getDevice = lambda: 0
    runtime.memcpyDeviceToHost = 2
    runtime.memcpyAsync = lambda dst, src, n, kind, stream: deferred(lambda: ctypes.memmove(dst, src, n))
    runtime.getDeviceProperties = lambda i: {"multiProcessorCount": sms, "name": gpu_name}
    runtime.deviceSynchronize = lambda: None
    runtime.streamIsCapturing = lambda stream: CAPTURE is not None
    cuda.runtime = runtime
    class Event:  # the emulator runs every launch at once: events and streams order nothing
        def synchronize(self): pass
    current = []  # streams entered (`with stream:`), innermost last
    class Stream:  # streams order nothing (launches run at once); `with stream:` makes it the current one
        def __init__(self, non_blocking=False, ptr=0): self.ptr = ptr
        def synchronize(self): pass
        def begin_capture(self):
            global CAPTURE
            assert CAPTURE is None, "nested capture"
            CAPTURE = []
            CAPTURE_KEEP.clear()
        def end_capture(self):
            global CAPTURE
            ops, CAPTURE = CAPTURE, None
            graph = FakeGraph(ops, CAPTURE_KEEP)
            CAPTURE_KEEP.clear()
            return graph
        def record(self, event=None): return event or Event()
        def wait_event(self, event): pass
        def __enter__(self):
            current.append(self)
            return self
        def __exit__(self, *exc):
            current.pop()
            return False
    cuda.Event = Event
    stream_ids = itertools.count(1)
    cuda.Stream = lambda non_blocking=False: Stream(non_blocking, ptr=next(stream_ids))
    null_stream = Stream()
    cuda.get_current_stream = lambda: current[-1] if current else null_stream
    @contextlib.contextmanager
    def using_allocator(allocator=None):  # `empty` / `empty_like` take host blocks from it (`on_device`)
        before = getattr(_ALLOCATOR, "fn", None)
        _ALLOCATOR.fn = allocator
        try:
            yield
        finally:
            _ALLOCATOR.fn = before
    cuda.using_allocator = using_allocator
    cuda.get_allocator = lambda: getattr(_ALLOCATOR, "fn", None) or HostBlock
    cp.get_default_memory_pool = lambda: types.SimpleNamespace(malloc=HostBlock, free_all_blocks=lambda: None)
    cuda.MemoryPool = lambda: types.SimpleNamespace(malloc=None, free_all_blocks=lambda: None)

    class HostBlock:  # a default-pool allocation (MemoryPointer-like): numpy bytes
        def __init__(self, size):
            self.buf = np.empty(max(size, 1), np.uint8)
            self.ptr, self.device_id, self.size = self.buf.ctypes.data, 0, size
        def memset_async(self, value, size, stream=None):
            deferred(lambda: self.buf[:size].fill(value))

    class UnownedMemory:
        def __init__(self, ptr, size, owner, device_id=-1):
            self.ptr, self.size, self._owner, self.device_id = ptr, size, owner, device_id

    class MemoryPointer:
        def __init__(self, mem, offset):
            self.mem, self.ptr, self.device_id = mem, mem.ptr + offset, mem.device_id

    cuda.MemoryPointer = MemoryPointer
    memory = types.ModuleType("cupy.cuda.memory")
    class OutOfMemoryError(MemoryError):  # cupy's signature
        def __init__(self, size, total, limit=0):
            super().__init__(f"out of memory allocating {size} bytes (allocated so far: {total} bytes)")
    memory.OutOfMemoryError = OutOfMemoryError
    memory.UnownedMemory = UnownedMemory
    cuda.memory = memory
    device = types.ModuleType("cupy.cuda.device")
    device.get_cublas_handle = lambda: 1
    cuda.device = device
    cp.cuda = cuda
    cb = types.ModuleType("cupy_backends"); cbc = types.ModuleType("cupy_backends.cuda")
    libs = types.ModuleType("cupy_backends.cuda.libs")
    import fake_cublas
    cb.cuda = cbc; cbc.libs = libs; libs.cublas = fake_cublas
    cupyx = types.ModuleType("cupyx")  # pinned host memory: plain numpy memory here
    cupyx.empty_pinned = lambda shape, dtype=np.float32, order="C": np.empty(shape, dtype, order)
    for name, mod in [("cupy", cp), ("cupyx", cupyx), ("cupy.cuda", cuda), ("cupy.cuda.runtime", runtime),
                      ("cupy.cuda.device", device), ("cupy.cuda.memory", memory),
                      ("cupy_backends", cb), ("cupy_backends.cuda", cbc), ("cupy_backends.cuda.libs", libs),
                      ("cupy_backends.cuda.libs.cublas", fake_cublas)]:
        sys.modules[name] = mod
    os.environ["DECAPYBARA_KERNEL_COMPILER"] = "nvrtc"
    return cp


def patch_backend():
    """Points decapybara's device-pointer helper and cuBLAS library at the fakes (after `install`)."""
    import fake_cublas
    from decapybara.backend import blas, cupy_ops
    cupy_ops.dev_ptr = lambda a: a.ctypes.data
    blas.library = lambda: fake_cublas.LIBRARY
