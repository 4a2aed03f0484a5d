"""gemmEx on host memory (column-major semantics, bf16 / f32 operands) for the fake CuPy: CuPy's wrapper module
(whose setStream refuses during a capture, as CuPy's does) and `LIBRARY`, libcublas as
decapybara/backend/blas.py's `Library` calls it (its GEMMs recorded during a capture, as a real capture does)."""
import ctypes, os
import numpy as np
NOOP = os.environ.get("CUDA_EMU_NOOP") == "1"  # as fake_cupy's: record the call, compute nothing
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUBLAS_POINTER_MODE_HOST, CUBLAS_POINTER_MODE_DEVICE = 0, 1
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT = -1
calls = []
def setStream(h, s):
    import fake_cupy
    if fake_cupy.CAPTURE is not None:  # as CuPy's wrapper does (every cuBLAS call sets its stream first)
        raise NotImplementedError("calling cuBLAS API during stream capture is currently unsupported")
def setPointerMode(h, m): assert m == CUBLAS_POINTER_MODE_HOST
def _mat(ptr, dtype, rows, cols, ld):
    # column-major rows x cols with leading dimension ld
    itemsize = {0: 4, 14: 2}[dtype]
    n = ld * (cols - 1) + rows
    buf = (ctypes.c_char * (n * itemsize)).from_address(ptr)
    a = np.frombuffer(buf, dtype=np.float32 if dtype == 0 else np.uint16, count=n)
    full = np.zeros(ld * cols, a.dtype); full[:n] = a
    m = full.reshape(cols, ld).T[:rows]
    if dtype == 14:
        m = (m.astype(np.uint32) << 16).view(np.float32)
    return m.astype(np.float64)
def gemmEx(handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc, computeType, algo):
    calls.append((transa, transb, m, n, k))
    if NOOP:
        return
    al = ctypes.c_float.from_address(alpha).value; be = ctypes.c_float.from_address(beta).value
    a = _mat(A, Atype, k if transa else m, m if transa else k, lda)
    a = a.T if transa else a
    b = _mat(B, Btype, n if transb else k, k if transb else n, ldb)
    b = b.T if transb else b
    assert Ctype == 0 and computeType == CUBLAS_COMPUTE_32F
    buf = (ctypes.c_float * (ldc * (n - 1) + m)).from_address(C)
    c = np.frombuffer(buf, np.float32)
    res = al * (a @ b)  # [m, n]
    for j in range(n):
        col = c[j * ldc: j * ldc + m]
        col[:] = (res[:, j] + (be * col if be != 0 else 0)).astype(np.float32)


class FakeLibrary:
    """decapybara.backend.blas.Library's methods over `gemmEx`; handles are counted ints bound to stream ids."""
    def __init__(self):
        self.handles = {}
    def create(self):
        h = len(self.handles) + 1
        self.handles[h] = None
        return h
    def bind(self, handle, stream, workspace, size):
        import fake_cupy
        assert fake_cupy.CAPTURE is None, "cuBLAS handle bound during a capture"
        assert workspace and size > 0
        self.handles[handle] = stream
    def gemm_ex(self, handle, *args):
        import fake_cupy
        assert self.handles.get(handle, "unbound") != "unbound", "unknown handle"
        # host pointer mode: alpha and beta read at the call (a capture's replays use the values it saw)
        scalars = [np.full(1, ctypes.c_float.from_address(args[i]).value, np.float32) for i in (5, 12)]
        args = list(args)
        args[5], args[12] = (a.ctypes.data for a in scalars)
        fake_cupy.deferred(lambda: (scalars, gemmEx(handle, *args)))
LIBRARY = FakeLibrary()
