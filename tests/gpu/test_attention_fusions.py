"""The attention layer's fused kernels (GPU only): `qk_norm_rope` (per-head RMSNorm then RoPE of q and k, one
launch), `sigmoid_mul_rows` (the output gate o * sigmoid(gate), one launch) and the same gate in the decode
attention's kernels (`paged_attention_gated` of a pure decode step: no launch of its own).

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
from decapybara import kernels

if not kernels.has_cuda():
    pytest.skip("no CUDA device", allow_module_level=True)

from test_kernels_core import attn_config
from test_kernels_extra import assert_bytes_equal, assert_close, host

from decapybara.backend import cupy_ops as ops
from decapybara.backend.base import Backend
from decapybara.backend.cupy_attention import DECODE, attention, gate_fuses
from decapybara.backend.cupy_backend import CupyBackend
from decapybara.backend.numpy_backend import NumpyBackend
from decapybara.model.batch import ForwardBatch
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


def decode_batch(rng, cub, cfg, kv_mode, contexts, page_size):
    """Two KV caches holding the same random keys / values for sequences of `contexts` cached tokens, and the
    batch of one new token each (ForwardBatch, its tables over shuffled pages)."""
    nkv, d = cfg.num_key_value_heads, cfg.head_dim
    need = [-(-(c + 16) // page_size) for c in contexts]  # room for 16 new tokens
    pages = rng.permutation(sum(need) + 3).astype(np.int32)
    tables = np.split(pages[:sum(need)], np.cumsum(need)[:-1])
    caches = [cub.new_kv_cache(cfg, len(pages), page_size, kv_mode) for _ in range(2)]
    fill = ForwardBatch.build([(np.zeros(c, np.int64), 0, tb, None) for c, tb in zip(contexts, tables) if c],
                              page_size, logits="none")
    k, v = cp.asarray(rand(rng, fill.num_tokens, nkv, d)), cp.asarray(rand(rng, fill.num_tokens, nkv, d, scale=2.0))
    for kv in caches:
        kv.write(0, cp.asarray(fill.slot_mapping), k, v)
    step = ForwardBatch.build([(np.zeros(1, np.int64), c, tb, None) for c, tb in zip(contexts, tables)], page_size,
                              logits="none")
    return caches, step


# (contexts, q heads, kv heads, head_dim, page size): one sequence and twelve at the 27B's heads, GQA 4 at d 128
GATED_CASES = [((700,), 24, 4, 256, 64), ((1, 40, 300, 5, 77, 1000, 2, 64, 65, 128, 9, 333), 24, 4, 256, 16),
               ((17, 250, 3), 8, 2, 128, 16)]


@pytest.mark.parametrize("contexts,nq,nkv,d,page_size", GATED_CASES)
@pytest.mark.parametrize("kv_mode", ["16/16", "6/4"])
@pytest.mark.parametrize("splits", [None, 1, 3])
@pytest.mark.parametrize("out_dtype", [np.float32, np.uint16])
def test_gated_decode_attention_gives_attention_then_gate(contexts, nq, nkv, d, page_size, kv_mode, splits,
                                                          out_dtype):
    """The output gate in the decode kernel's final items (splits 1) and attention_reduce (split keys): the
    bytes of the attention's float32 output then sigmoid_mul_rows, float32 or bf16 bits, the gate read in place
    as the gate half of a [query | gate] product (left untouched)."""
    rng = np.random.default_rng(len(contexts) * 1000 + d + (splits or 0) + (out_dtype == np.uint16))
    cfg = attn_config(nq, nkv, d)
    cub = CupyBackend("fp32", attention_splits=splits)
    (kv, kv_ref), step = decode_batch(rng, cub, cfg, kv_mode, contexts, page_size)
    t = step.num_tokens
    prod = rand(rng, t, 2 * nq * d, scale=4.0)
    prod[0, d:d + 3] = [88.0, -88.0, -20.0]  # sigmoid 1, subnormal, small
    prod_d = cp.asarray(prod)
    q, gate = heads(prod_d, nq, d, True)
    k, v = cp.asarray(rand(rng, t, nkv, d)), cp.asarray(rand(rng, t, nkv, d))
    plan = cub._attention_plan(step, nq, nkv, d, (kv.key_bits, kv.value_bits))
    assert gate_fuses(plan)
    assert splits is None or (plan.num_reduce == 0) == (splits == 1), (splits, plan.num_reduce)  # the paths
    for c in (kv, kv_ref):
        c.write(0, plan.slots, k, v)
    args = (kv.kv_heads, page_size, d ** -0.5)
    got = attention(q, kv.parts(0, "k"), kv.parts(0, "v"), plan, *args, gate, out_dtype)
    plain = attention(q, kv_ref.parts(0, "k"), kv_ref.parts(0, "v"), plan, *args)
    name = f"{len(contexts)} sequences, {kv_mode}, splits {splits}, {np.dtype(out_dtype).name}"
    assert got.dtype == out_dtype and got.shape == (t, nq, d)
    assert_bytes_equal(got, ops.sigmoid_gate(plain, gate, out_dtype=out_dtype), name)
    assert_bytes_equal(prod_d, prod, f"gate product untouched, {name}")


@pytest.mark.parametrize("mixed,fuse", [(False, 1), (True, 1), (False, 0)])
def test_backend_gates_decode_steps_in_the_attention_and_others_apart(mixed, fuse, monkeypatch):
    """CupyBackend.paged_attention_gated: a pure decode step runs no sigmoid_gate (the attention kernels apply
    it), a step with a prompt's chunk, or any with DECODE "gate" 0, runs the two ops; all equal the two ops'
    bytes."""
    monkeypatch.setitem(DECODE, "gate", fuse)
    rng = np.random.default_rng(5 + mixed)
    cfg = attn_config(8, 2, 128)
    cub = CupyBackend("fp32")
    (kv, kv_ref), step = decode_batch(rng, cub, cfg, "16/16", (30, 200), 16)
    if mixed:  # the second sequence's next 9 tokens beside the first's one
            step = ForwardBatch.build([(np.zeros(n, np.int64), s.context, s.block_table, None)
                                   for s, n in zip(step.seqs, (1, 9))], 16, logits="none")
    t = step.num_tokens
    prod_d = cp.asarray(rand(rng, t, 2 * 8 * 128))
    q, gate = heads(prod_d, 8, 128, True)
    k, v = cp.asarray(rand(rng, t, 2, 128)), cp.asarray(rand(rng, t, 2, 128))
    ref = cub.sigmoid_gate(cub.paged_attention(kv_ref, 0, q, k, v, step, 0.1), gate)
    calls = []
    monkeypatch.setattr(cub, "sigmoid_gate", lambda *a: calls.append(1) or CupyBackend.sigmoid_gate(cub, *a))
    got = cub.paged_attention_gated(kv, 0, q, k, v, step, 0.1, gate)
    assert len(calls) == int(mixed or not fuse)
    assert_bytes_equal(got, ref, f"mixed={mixed} gate={fuse}")
