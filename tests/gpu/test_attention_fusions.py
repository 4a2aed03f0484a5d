"""The attention layer's fused kernels (GPU only): `qk_norm_rope` (per-head RMSNorm then RoPE of q and k, one
launch) and `sigmoid_mul_rows` (the output gate o * sigmoid(gate), one launch).

Each must give the unfused CUDA ops' bytes (rms_norm_warp then rope_table; sigmoid_f32 then a CuPy multiply)
and the numpy reference within float32 rounding. q and the gate are read as the column views QwenModel passes
(the query / gate halves of a fused [query | gate] product; with `qkv` q and k the columns of one fused q|k|v
product), and that product must come back untouched. Fresh
random inputs; every output starts NaN-poisoned (`cupy_ops.POISON`), so an unwritten element fails.
"""

from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
import kernels

if not kernels.has_cuda():
    pytest.skip("no CUDA device", allow_module_level=True)

from test_kernels_extra import assert_bytes_equal, assert_close, host

from decapybara.backend import cupy_ops as ops
from decapybara.backend.base import Backend
from decapybara.backend.cupy_backend import CupyBackend
from decapybara.backend.numpy_backend import NumpyBackend
from decapybara.model.rope import RotaryTable, default_inv_freq

pytestmark = pytest.mark.gpu
NP = NumpyBackend()
CUDA = CupyBackend("fp32")


def rand(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def heads(prod, nq, d, gated):
    """The query (and gate) heads [T, nq, d] of a q product [T, nq * d (* 2)], as QwenModel slices them."""
    if not gated:
        return prod.reshape(prod.shape[0], nq, d), None
    qg = prod.reshape(prod.shape[0], nq, 2 * d)
    return qg[..., :d], qg[..., d:]


# (T, q heads, kv heads, head_dim, rotary_dim): the 27B attention at decode widths, a full rotation, a rotation
# half that is no multiple of 32 (pairs across lanes), heads past 256 (the norm's tail loop)
SHAPES = [(1, 24, 4, 256, 64), (12, 24, 4, 256, 64), (3, 4, 2, 64, 64), (5, 3, 1, 96, 32), (2, 2, 3, 320, 128)]


@pytest.mark.parametrize("t,nq,nkv,d,rot", SHAPES)
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("qkv", [True, False])
def test_qk_norm_rope_matches_the_unfused_ops(t, nq, nkv, d, rot, offset, gated, qkv):
    rng = np.random.default_rng(t * 1000 + d + nq + int(offset) + 7 * gated)
    q_out = nq * d * (2 if gated else 1)
    prod = rand(rng, t, q_out, scale=3.0) * np.exp(rng.uniform(-4, 4, (t, 1))).astype(np.float32)
    k = rand(rng, t, nkv, d, scale=2.0)
    if qkv:  # [T, q | k | v]: q and k column views of one product
        prod = np.concatenate([prod, k.reshape(t, nkv * d), rand(rng, t, nkv * d)], axis=1)
    wq, wk = rand(rng, d, scale=0.3) + np.float32(1 - offset), rand(rng, d, scale=0.3) + np.float32(1 - offset)
    positions = np.sort(rng.integers(0, 1_000_000, t)).astype(np.int64)
    cos, sin = RotaryTable(default_inv_freq(1e7, rot), 1.0).cos_sin(positions)
    prod_d = cp.asarray(prod)
    q_d, _ = heads(prod_d[:, :q_out], nq, d, gated)
    k_d = prod_d[:, q_out:q_out + nkv * d].reshape(t, nkv, d) if qkv else cp.asarray(k)
    args = (cp.asarray(wq), cp.asarray(wk), 1e-6, offset, cp.asarray(cos), cp.asarray(sin), rot)
    got_q, got_k = CUDA.qk_norm_rope(q_d, k_d, *args)
    ref_q, ref_k = Backend.qk_norm_rope(CUDA, q_d, k_d, *args)  # rms_norm_warp, rope_table
    name = f"T={t} nq={nq} nkv={nkv} d={d} rot={rot} offset={offset} gated={gated} qkv={qkv}"
    assert_bytes_equal(got_q, ref_q, f"q vs unfused, {name}")
    assert_bytes_equal(got_k, ref_k, f"k vs unfused, {name}")
    assert_bytes_equal(prod_d, prod, f"q product untouched, {name}")
    np_q, np_k = NP.qk_norm_rope(heads(prod[:, :q_out], nq, d, gated)[0], k, wq, wk, 1e-6, offset, cos, sin, rot)
    assert_close(got_q, np_q, 1e-5, f"q vs numpy, {name}")
    assert_close(got_k, np_k, 1e-5, f"k vs numpy, {name}")


@pytest.mark.parametrize("t,nq,d", [(1, 24, 256), (12, 24, 256), (3, 5, 40)])
@pytest.mark.parametrize("gated", [True, False])
def test_sigmoid_gate_matches_the_unfused_ops(t, nq, d, gated):
    rng = np.random.default_rng(t * 100 + d + gated)
    prod = rand(rng, t, nq * d * (2 if gated else 1), scale=4.0)
    o = rand(rng, t, nq, d)
    gate = heads(prod, nq, d, gated)[1 if gated else 0]  # a view: writes land in prod
    gate[0, 0, :4] = [0.0, 88.0, -88.0, -20.0]  # sigmoid 0.5, 1, subnormal; and below, a subnormal product
    o[0, 0, 3] = 1e-30
    prod_d = cp.asarray(prod)
    gate_d = heads(prod_d, nq, d, gated)[1 if gated else 0]
    got = CUDA.sigmoid_gate(cp.asarray(o), gate_d)
    name = f"T={t} nq={nq} d={d} gated={gated}"
    assert_bytes_equal(got, cp.asarray(o) * ops.sigmoid(gate_d), f"vs sigmoid_f32 * o, {name}")  # the unfused ops
    assert_bytes_equal(prod_d, prod, f"gate product untouched, {name}")
    assert_close(got, o * NP.sigmoid(gate), 1e-6, f"vs numpy, {name}")
    flat = ops.sigmoid_gate(cp.asarray(o).reshape(t, nq * d), cp.asarray(np.ascontiguousarray(gate)).reshape(t, -1))
    assert_bytes_equal(flat, host(got).reshape(t, nq * d), f"[T, N] form, {name}")
    bits = ops.sigmoid_gate(cp.asarray(o), gate_d, out_dtype=cp.uint16)  # rows that only feed a skinny product
    assert bits.dtype == cp.uint16 and bits.shape == got.shape
    assert_bytes_equal(bits, ops.to_bf16_bits(got), f"in bf16 bits, {name}")
