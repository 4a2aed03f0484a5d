"""Launch wrappers of the per-token kernels (decapybara/kernels/decode_ops.cu) and the bf16 matrix product (cuBLAS, on
handles a CUDA graph can capture: `blas`).

Every wrapper checks dtype and contiguity of its device arrays before the launch, passes scalars as typed
numpy values (a Python int would reach the kernel as int64) and returns fresh float32 outputs unless an
`out` is given. Activations are float32 [rows, n]; bf16 tensors are uint16 arrays of bfloat16 bit patterns.
"""

from __future__ import annotations

import functools
from typing import Any

import cupy as cp
import numpy as np

from decapybara.backend import blas, pdl
from decapybara.kernels import get_kernel

I32, I64, F32 = np.int32, np.int64, np.float32
THREADS = 256
# cudaDataType / cublasComputeType_t values (cuda_runtime / cublas_api.h).
CUDA_R_32F, CUDA_R_16BF, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT = 0, 14, 68, -1
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1


def check(a: Any, dtype: Any, name: str, ndim: int | None = None) -> None:
    """Assert `a` is a C-contiguous device array of `dtype` (and `ndim`)."""
    assert isinstance(a, cp.ndarray), f"{name}: expected a cupy array, got {type(a).__name__}"
    assert a.dtype == dtype, f"{name}: dtype {a.dtype}, expected {np.dtype(dtype)}"
    assert a.flags.c_contiguous, f"{name}: not C-contiguous (shape {a.shape}, strides {a.strides})"
    assert ndim is None or a.ndim == ndim, f"{name}: {a.ndim}-D, expected {ndim}-D (shape {a.shape})"


MX_NO_GEMM = (("MX_ONLY", -1),)  # mx_gemv.cu built without its skinny-GEMM kernels (mx_dequant_rows, gemv_f32)
POISON = False  # tests set True: fresh outputs start as NaN (floats) / all-ones bits (integers)


def empty(shape: Any, dtype: Any = np.float32) -> Any:
    """cupy.empty, poisoned when `POISON` is set so that elements a kernel fails to write show up."""
    a = cp.empty(shape, dtype)
    if POISON:
        dt = np.dtype(dtype)
        a.fill(np.nan if dt.kind == "f" else np.iinfo(dt).max)
    return a


def empty_like(x: Any) -> Any:
    return empty(x.shape, x.dtype)


def null() -> Any:
    """A NULL pointer kernel argument (a zero-size array has device pointer 0), one a device: an eager step asks
    for thousands."""
    return _null(cp.cuda.runtime.getDevice())


@functools.cache
def _null(device: int) -> Any:  # asked with `device` current
    return cp.empty(0, cp.float32)


def f32(a: Any) -> Any:
    """A C-contiguous float32 device array of `a` (host arrays are uploaded; no copy when it already is one)."""
    return cp.ascontiguousarray(cp.asarray(a, dtype=cp.float32))


def f32_any(a: Any) -> Any:
    """`a` itself when it is a float32 device array (any strides: the caller handles them), else `f32(a)`."""
    return a if isinstance(a, cp.ndarray) and a.dtype == cp.float32 else f32(a)


@functools.cache
def sm_count() -> int:
    try:
        return int(cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["multiProcessorCount"])
    except (RuntimeError, KeyError, AttributeError):
        return 132


@functools.cache
def _device_attribute(device: int, name: str, default: int) -> int:
    """Device `device`'s CUDA attribute `name`, or `default` where the device does not say."""
    try:
        return int(cp.cuda.Device(device).attributes[name])
    except (RuntimeError, KeyError, AttributeError, ValueError, TypeError):
        return default


def smem_per_sm() -> int:
    """Shared memory an SM of the current device holds (0 where the device does not say)."""
    return _device_attribute(cp.cuda.Device().id, "MaxSharedMemoryPerMultiprocessor", 0)


def smem_per_block_of(device: int) -> int:
    """Opt-in shared memory a block of device `device` may have (48 KB where the device does not say)."""
    return _device_attribute(device, "MaxSharedMemoryPerBlockOptin", 48 * 1024)


def smem_per_block() -> int:
    """`smem_per_block_of` the current device."""
    return smem_per_block_of(cp.cuda.Device().id)


_SMEM_CHECKED: set[tuple[int, int, int]] = set()  # (device, kernel, bytes) whose limit is settled


def allow_dynamic_smem(kernel: Any, nbytes: int) -> None:
    """Raise `kernel`'s dynamic shared memory limit on the current device to `nbytes` where that and the
    kernel's static shared memory are past the default 48 KB together (once per device, kernel and size)."""
    key = (cp.cuda.Device().id, id(kernel), nbytes)
    if key in _SMEM_CHECKED:
        return
    if nbytes + int(getattr(kernel, "shared_size_bytes", 0)) > 48 * 1024:
        kernel.max_dynamic_shared_size_bytes = nbytes
    _SMEM_CHECKED.add(key)


def grid_for(n: int, threads: int = THREADS) -> int:
    """Blocks for a grid-stride loop over n items."""
    return max(1, min(-(-n // threads), sm_count() * 16))


def _k(func: str) -> Any:
    return get_kernel("decode_ops", func)


# ---- norms -------------------------------------------------------------------------------------------
def _bf16_out(out_dtype: Any) -> bool:
    """Whether a kernel with a float32 / bf16-bits output (`out_bf16`) writes bf16 bits for `out_dtype`."""
    assert np.dtype(out_dtype) in (np.float32, np.uint16), f"out_dtype {out_dtype}: float32 or uint16 (bf16 bits)"
    return np.dtype(out_dtype) == np.uint16


WARP_ROW_MAX = 1024  # rows up to this long are normed a warp each (rms_norm_warp), longer ones a block each


def rms_norm(x: Any, weight: Any, eps: float, offset: float, residual: Any = None, out_dtype: Any = np.float32) -> Any:
    """x / sqrt(mean(x^2) + eps) * (offset + w) over the last axis. With `residual`, normalises h = x + residual
    and returns (out, h) (the fused residual add); else returns out. out_dtype uint16: out in bf16 bits (the
    float32 values rounded to nearest even; h stays float32)."""
    x = f32(x)
    n = x.shape[-1]
    rows = x.size // n if n else 0
    check(weight, np.float32, "weight", 1)
    assert weight.shape[0] == n, f"weight {weight.shape} for rows of {n}"
    out_bf16 = _bf16_out(out_dtype)
    out = empty(x.shape, out_dtype)
    res_out = empty_like(x) if residual is not None else None
    if residual is not None:
        residual = f32(residual)
        assert residual.shape == x.shape, f"residual {residual.shape} vs x {x.shape}"
    if rows:
        args = (x, null() if residual is None else residual, weight, out,
                null() if res_out is None else res_out, I32(rows), I32(n), F32(eps), F32(offset), I32(out_bf16))
        if n <= WARP_ROW_MAX:
            pdl.launch(_k("rms_norm_warp"), (-(-rows // 8),), (256,), args)
        else:
            pdl.launch(_k("rms_norm_block"), (rows,), (512,), args)
    return out if residual is None else (out, res_out)


def gated_rms_norm(x: Any, z: Any, weight: Any, eps: float) -> Any:
    """rms_norm(x) * w * silu(z) over the last axis (no offset)."""
    x, z = f32(x), f32_any(z)
    assert x.shape == z.shape, f"x {x.shape} vs z {z.shape}"
    check(weight, np.float32, "weight", 1)
    n = x.shape[-1]
    rows = x.size // n if n else 0
    groups = _row_groups(z)
    if groups is None:
        z = f32(z)
        groups = (1, n)
    zh, ldz = groups
    out = empty_like(x)
    if rows:
        pdl.launch(_k("gated_rms_norm_warp"), (-(-rows // 8),), (256,),
                   (x, z, weight, out, I32(rows), I32(n), F32(eps), I32(zh), I64(ldz)))
    return out


def _row_groups(z: Any) -> tuple[int, int] | None:
    """(zh, ldz) describing z [..., n] as groups of zh contiguous rows of n, groups ldz elements apart (a view
    of a fused product's columns), or None when z has another layout (the caller copies it)."""
    n = z.shape[-1]
    if z.flags.c_contiguous:
        return 1, n
    if z.ndim == 3 and z.strides[2] == 4 and z.strides[1] == 4 * n and z.strides[0] % 4 == 0:
        return z.shape[1], z.strides[0] // 4
    return None


# ---- RoPE ----------------------------------------------------------------------------------------------
def rope(x: Any, cos: Any, sin: Any, rotary_dim: int, out: Any = None) -> Any:
    """Rotate-half RoPE on the first `rotary_dim` dims of x [T, H, D]; cos / sin [T, rotary_dim / 2]."""
    x = f32(x)
    t, h, d = x.shape
    cos, sin = f32(cos), f32(sin)
    assert rotary_dim % 2 == 0 and 0 < rotary_dim <= d, f"rotary_dim {rotary_dim} for head_dim {d}"
    assert cos.shape == (t, rotary_dim // 2) == sin.shape, f"cos {cos.shape} sin {sin.shape} for T={t}"
    out = empty_like(x) if out is None else out
    check(out, np.float32, "out", 3)
    n = t * h * (d - rotary_dim // 2)
    if n:
        _k("rope_table")((-(-n // THREADS),), (THREADS,), (x, cos, sin, out, I32(t), I32(h), I32(d),
                                                           I32(rotary_dim)))
    return out


def rope_positions(x: Any, positions: Any, inv_freq: Any, attention_factor: float = 1.0, out: Any = None) -> Any:
    """RoPE with the angles computed in the kernel: float32(position) * inv_freq [rotary_dim / 2]."""
    x = f32(x)
    t, h, d = x.shape
    check(positions, np.int64, "positions", 1)
    check(inv_freq, np.float32, "inv_freq", 1)
    rot = 2 * inv_freq.shape[0]
    assert positions.shape[0] == t and rot <= d
    out = empty_like(x) if out is None else out
    n = t * h * (d - rot // 2)
    if n:
        _k("rope_pos")((-(-n // THREADS),), (THREADS,), (x, positions, inv_freq, out, I32(t), I32(h), I32(d),
                                                         I32(rot), F32(attention_factor)))
    return out


def heads(x: Any) -> tuple[Any, int, int]:
    """(x, token stride, head stride) in elements for x [T, H, D] read in place when it is a float32 device
    array whose rows of D are contiguous (C-contiguous, or a column view of a fused product such as the query
    half of [query | gate] heads); else a C-contiguous float32 copy of x with its strides."""
    x = f32_any(x)
    assert x.ndim == 3, f"expected [T, H, D], got shape {x.shape}"
    st, sh, sd = x.strides
    if not (sd == 4 and st >= 0 and sh >= 0 and st % 4 == 0 and sh % 4 == 0):
        x = f32(x)
        st, sh = x.strides[:2]
    return x, st // 4, sh // 4


def qk_norm_rope(q: Any, k: Any, q_w: Any, k_w: Any, eps: float, offset: float, cos: Any, sin: Any,
                 rotary_dim: int) -> tuple[Any, Any]:
    """(rope(rms_norm(q, q_w)), rope(rms_norm(k, k_w))) for q [T, Hq, D], k [T, Hk, D] (D <= WARP_ROW_MAX) in
    one launch, bit-identical to `rms_norm` (rms_norm_warp) then `rope` (rope_table). q / k are read in place
    when their rows of D are contiguous (`heads`); cos / sin [T, rotary_dim / 2]. Returns fresh C-contiguous
    float32 [T, Hq, D], [T, Hk, D]."""
    q, q_st, q_sh = heads(q)
    k, k_st, k_sh = heads(k)
    t, hq, d = q.shape
    hk = k.shape[1]
    assert k.shape[0] == t and k.shape[2] == d, f"q {q.shape} vs k {k.shape}"
    assert 0 < d <= WARP_ROW_MAX, f"head_dim {d}: warp-per-row norm only up to {WARP_ROW_MAX}"
    for w, name in ((q_w, "q_w"), (k_w, "k_w")):
        check(w, np.float32, name, 1)
        assert w.shape[0] == d, f"{name} {w.shape} for heads of {d}"
    cos, sin = f32(cos), f32(sin)
    assert rotary_dim % 2 == 0 and 0 < rotary_dim <= d, f"rotary_dim {rotary_dim} for head_dim {d}"
    assert cos.shape == (t, rotary_dim // 2) == sin.shape, f"cos {cos.shape} sin {sin.shape} for T={t}"
    q_out, k_out = empty((t, hq, d)), empty((t, hk, d))
    rows = t * (hq + hk)
    if rows:  # 8 warps of 256 threads, a warp per row; shared memory: one normed row per warp
        pdl.launch(_k("qk_norm_rope"), (-(-rows // 8),), (256,),
                   (q, k, q_w, k_w, cos, sin, q_out, k_out, I64(q_st), I64(q_sh), I64(k_st), I64(k_sh),
                    I32(t), I32(hq), I32(hk), I32(d), I32(rotary_dim), F32(eps), F32(offset)),
                   shared_mem=8 * d * 4)
    return q_out, k_out


# ---- elementwise --------------------------------------------------------------------------------------
def _elementwise(func: str, *inputs: Any, out_dtype: Any = np.float32, in_dtype: Any = np.float32) -> Any:
    arrs = [cp.ascontiguousarray(cp.asarray(a, dtype=in_dtype)) for a in inputs]
    for a in arrs[1:]:
        assert a.shape == arrs[0].shape, f"{func}: shapes {[b.shape for b in arrs]}"
    out = empty(arrs[0].shape, dtype=out_dtype)
    n = out.size
    if n:
        _k(func)((grid_for(n),), (THREADS,), (*arrs, out, I64(n)))
    return out


def silu_mul(gate: Any, up: Any) -> Any:
    return _elementwise("silu_mul", gate, up)


def silu_mul_halves(y: Any, out_dtype: Any = np.float32) -> Any:
    """silu(y[:, :n]) * y[:, n:] for y [rows, 2n] float32 -> [rows, n] (one launch, no slice copies); out_dtype
    uint16: in bf16 bits (the float32 values rounded to nearest even)."""
    y = cp.ascontiguousarray(f32(y))
    rows, n2 = y.shape
    assert n2 % 2 == 0, f"silu_mul_halves: odd width {n2}"
    out_bf16 = _bf16_out(out_dtype)
    out = empty((rows, n2 // 2), out_dtype)
    n = n2 // 2
    if out.size and n % 4 == 0 and dev_ptr(y) % 16 == 0:  # 4 columns a thread (16-byte loads), the same arithmetic
        pdl.launch(_k("silu_mul_halves4"), (-(-n // (4 * THREADS)), min(rows, 65535)), (THREADS,),
                   (y, out, I64(rows), I32(n), I32(out_bf16)))
    elif out.size:
        pdl.launch(_k("silu_mul_halves"), (grid_for(out.size),), (THREADS,), (y, out, I64(rows), I32(n), I32(out_bf16)))
    return out


def sigmoid(x: Any) -> Any:
    return _elementwise("sigmoid_f32", x)


def sigmoid_mul(x: Any, gate: Any) -> Any:
    """x * sigmoid(gate)."""
    return _elementwise("sigmoid_mul", x, gate)


def sigmoid_gate(x: Any, gate: Any, out_dtype: Any = np.float32) -> Any:
    """x * sigmoid(gate) for x, gate [T, H, D] (or [T, N]) in one launch (sigmoid_mul_rows), bit-identical to
    `sigmoid(gate)` followed by a CuPy multiply. gate is read in place when its rows of D are contiguous
    (`heads`: e.g. the gate half of [query | gate] heads). Returns a fresh C-contiguous array: float32, or
    out_dtype uint16: bf16 bits (the float32 values rounded to nearest even)."""
    x = f32(x)
    if x.ndim == 2:
        return sigmoid_gate(x[:, None], gate[:, None], out_dtype)[:, 0]
    gate, g_st, g_sh = heads(gate)
    assert gate.shape == x.shape, f"x {x.shape} vs gate {gate.shape}"
    t, h, d = x.shape
    out_bf16 = _bf16_out(out_dtype)
    out = empty(x.shape, out_dtype)
    if out.size:
        pdl.launch(_k("sigmoid_mul_rows"), (grid_for(out.size),), (THREADS,),
                   (x, gate, out, I64(g_st), I64(g_sh), I32(t), I32(h), I32(d), I32(out_bf16)))
    return out


def to_bf16_bits(x: Any) -> Any:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even."""
    return _elementwise("f32_to_bf16_bits", x, out_dtype=np.uint16)


def bf16_bits_to_f32(b: Any) -> Any:
    return _elementwise("bf16_bits_to_f32", b, in_dtype=np.uint16)


def embed_bf16(table: Any, ids: Any) -> Any:
    """Rows `ids` [T] (int64, device) of a bf16 table [V, H], as float32 [T, H]."""
    check(table, np.uint16, "table", 2)
    check(ids, np.int64, "ids", 1)
    t, h = ids.shape[0], table.shape[1]
    out = empty((t, h), cp.float32)
    if t:
        _k("embed_bf16")((grid_for(t * h),), (THREADS,), (table, ids, out, I32(t), I32(h)))
    return out


# ---- weights ----------------------------------------------------------------------------------------
def dequantize(q: Any, bf16: bool) -> Any:
    """A `QuantTensor` -> device array of its logical shape: bf16 bits (uint16) or float32."""
    from decapybara.model.quant import get_format

    fmt = get_format(q.fmt)
    k = q.shape[-1]
    rows = int(np.prod(q.shape[:-1], dtype=np.int64))
    codes = cp.asarray(np.ascontiguousarray(q.codes).reshape(rows, -1))
    scales = cp.asarray(np.ascontiguousarray(q.scales).reshape(rows, -1))
    assert codes.shape[1] == fmt.padded(k) * fmt.bits // 8 and scales.shape[1] == fmt.padded(k) // fmt.block
    out = empty((rows, k), cp.uint16 if bf16 else cp.float32)
    ts = F32(q.tensor_scale if q.tensor_scale is not None else 1.0)
    func = f"dequant_{q.fmt}_{'bf16' if bf16 else 'f32'}"
    _k(func)((grid_for(rows * k),), (THREADS,), (codes, scales, ts, out, I64(rows), I32(k)))
    return out.reshape(q.shape)


def _product_dims(x: Any, w: Any, dtype: Any) -> tuple[int, int, int]:
    """(rows of x, rows of w, K) of x [M, K] @ w [N, K]^T, both C-contiguous device arrays of `dtype`."""
    check(x, dtype, "x", 2)
    check(w, dtype, "w", 2)
    assert w.shape[1] == x.shape[1], f"x {x.shape} @ w {w.shape}^T"
    return x.shape[0], w.shape[0], x.shape[1]


def gemm_bf16(x_bits: Any, w_bits: Any, alpha: float = 1.0) -> Any:
    """alpha * (x [T, K] @ w [N, K]^T) with bf16 operands (uint16 bits), float32 accumulation and output [T, N]
    (alpha scales the float32 sums in cuBLAS's epilogue)."""
    t, n, k = _product_dims(x_bits, w_bits, np.uint16)
    y = empty((t, n), cp.float32)
    if t == 0 or n == 0:
        return y
    if k == 0:
        y.fill(0)
        return y
    one, zero = _host_scalar(float(alpha)), _host_scalar(0.0)
    # NOTE: column-major view: Y^T [N, T] = W [N, K] (stored as K x N, transposed) @ X^T (stored as K x T).
    args = (n, t, k, one.ctypes.data, dev_ptr(w_bits), CUDA_R_16BF, k, dev_ptr(x_bits), CUDA_R_16BF, k,
            zero.ctypes.data, dev_ptr(y), CUDA_R_32F, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)
    blas.gemm_ex(CUBLAS_OP_T, CUBLAS_OP_N, *args)  # the stream's own handle: capturable
    return y


@functools.cache
def _host_scalar(value: float) -> np.ndarray:
    """A float32 [1] host array of `value` that stays alive (cuBLAS reads it at the call, host pointer mode),
    read-only."""
    a = np.full(1, value, np.float32)
    a.flags.writeable = False
    return a


def gemv_f32(x: Any, w: Any, bias: Any = None) -> Any:
    """x [M, K] @ w [N, K]^T (+ bias [N]) in float32 by decapybara/kernels/mx_gemv.cu `gemv_f32` (no cuBLAS: decode
    graphs capture it). For skinny x (decode, small chunks); one pass over w per 8 rows of x."""
    x = f32(x)
    m, n, k = _product_dims(x, w, np.float32)
    y = empty((m, n), cp.float32)
    if m and n:
        args = (w, x, bias if bias is not None else null(), y, I32(m), I32(n), I32(k))
        get_kernel("mx_gemv", "gemv_f32", MX_NO_GEMM)((-(-n // 8), -(-m // 8)), (256,), args)
    return y


def dev_ptr(a: Any) -> int:
    return a.data.ptr
