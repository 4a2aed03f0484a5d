"""decapybara/kernels/wgmma.cuh's warpgroup MMAs and descriptors against numpy (GPU only, Hopper: sm_90a builds).

One warpgroup computes D = A B^T with both operands in shared tiles (m64n32k16 / m64n64k16) and D = A V with A
in registers and V read MN-major (m64n256k16), over bf16 inputs with float32 accumulation, for chunk-major and
128-byte swizzled tiles: within float32 rounding of numpy's float64 product of the same bf16 values. Where the
header's descriptors fail, the message says whether exchanging their leading and stride byte offsets would pass
(the probe's odd layouts)."""

from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
from decapybara import kernels

if not kernels.has_cuda():
    pytest.skip("no CUDA device", allow_module_level=True)
if not kernels.sm90a_ok():
    pytest.skip("wgmma: Hopper (sm_90a), built by nvcc", allow_module_level=True)

from decapybara.backend.kv_codec import f32_to_bf16_bits

pytestmark = pytest.mark.gpu
DEFINES = (("SM90A", 1),)


def bf16(rng, *shape):
    """(bits as uint16, their float64 values) of standard normal bf16 values."""
    bits = f32_to_bf16_bits(rng.standard_normal(shape).astype(np.float32))
    return bits, (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def run_ss(a, b, k, n, layout):
    kern = kernels.get_kernel("wgmma_probe", "wg_probe_ss", DEFINES)
    smem = (64 + n) * k * 2 + 1024
    kern.max_dynamic_shared_size_bytes = smem
    d = cp.full((64, n), cp.nan, cp.float32)
    kern((1,), (128,), (cp.asarray(a), cp.asarray(b), d, np.int32(k), np.int32(n), np.int32(layout)), shared_mem=smem)
    return cp.asnumpy(d).astype(np.float64)


def run_rs(a, v, k, layout):
    kern = kernels.get_kernel("wgmma_probe", "wg_probe_rs", DEFINES)
    smem = k * 512 + 1024
    kern.max_dynamic_shared_size_bytes = smem
    d = cp.full((64, 256), cp.nan, cp.float32)
    kern((1,), (128,), (cp.asarray(a), cp.asarray(v), d, np.int32(k), np.int32(layout)), shared_mem=smem)
    return cp.asnumpy(d).astype(np.float64)


def rel_err(got, ref) -> float:
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def check(got, ref, other):
    """got within float32 rounding of ref; on failure the message also gives `other()`'s error (the same
    product with the descriptor's leading and stride byte offsets exchanged)."""
    err = rel_err(got, ref)
    assert err < 1e-5, f"rel err {err:.3g} (nan: {np.isnan(got).any()}); exchanged offsets: {rel_err(other(), ref):.3g}"


@pytest.mark.parametrize("layout", [0, 2], ids=["chunk-major", "swizzled"])
@pytest.mark.parametrize("n", [32, 64])
@pytest.mark.parametrize("k", [16, 64, 256])
def test_shared_operands(n, k, layout):
    if layout == 2 and k % 64:
        pytest.skip("swizzled tiles: rows of 64-element blocks")
    rng = np.random.default_rng(1000 * n + k)
    a, af = bf16(rng, 64, k)
    b, bfl = bf16(rng, n, k)
    check(run_ss(a, b, k, n, layout), af @ bfl.T, lambda: run_ss(a, b, k, n, layout + 1))


@pytest.mark.parametrize("layout", [0, 2], ids=["chunk-major", "swizzled"])
@pytest.mark.parametrize("k", [16, 32, 64])
def test_register_a_transposed_b(k, layout):
    rng = np.random.default_rng(7 + k)
    a, af = bf16(rng, 64, k)
    v, vf = bf16(rng, k, 256)
    check(run_rs(a, v, k, layout), af @ vf, lambda: run_rs(a, v, k, layout + 1))
