"""Prefill weights in bf16 (the server's `prefill_weights=bf16`; GPU only): the quantised product weights keep
their bf16 values (`cupy_ops_extra.attach_dense`, `PackedWeightsMixin.dense_prefill`), so that products of more
than DENSE_ROWS rows skip dequantising them. They are the bits the dequantisation makes, so products and a
model's logits are the same bytes either way; the decode-sized products do not read them.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
from decapybara import kernels

if not kernels.has_cuda():
    pytest.skip("no CUDA device", allow_module_level=True)

from test_cupy_model import forward_chunks
from test_kernels_extra import assert_bytes_equal, assert_close, bf16_round, host, random_weight

from decapybara.backend import cupy_ops_extra as ex
from decapybara.backend.cuda_factory import cuda_backend
from decapybara.model import quant
from decapybara.model.qwen import QwenModel
from decapybara.model.weights import keeps_prefill_copy
from decapybara.testing import tiny_checkpoint

pytestmark = pytest.mark.gpu


def _dequantisations(monkeypatch) -> list[tuple[str, tuple[int, ...]]]:
    """Records (format, shape) of every whole-weight bf16 dequantisation (`mx_dequant` of all rows to uint16)."""
    seen: list[tuple[str, tuple[int, ...]]] = []
    real = ex.mx_dequant

    def counted(w, rows=None, out_dtype=np.float32):
        if rows is None and out_dtype is cp.uint16:
            seen.append((w.fmt, w.shape))
        return real(w, rows, out_dtype)

    monkeypatch.setattr(ex, "mx_dequant", counted)
    return seen


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "mxfp8"])
def test_dense_values_are_the_dequantisation(fmt, monkeypatch):
    """`attach_dense` keeps the bits `mx_dequant` makes (NVFP4: without the tensor scale, which the GEMM's alpha
    applies); a large product then reads them, no dequantisation, the same bytes and numpy's values; a
    decode-sized product is the skinny kernels' either way."""
    rng = np.random.default_rng(zlib.crc32(f"dense-{fmt}".encode()))
    wq, w_ref = random_weight(rng, fmt, (320, 512))
    plain, w = ex.pack_weight(wq), ex.pack_weight(wq)
    assert ex.attach_dense(w) and ex.dense_of(w).dtype == cp.uint16 and ex.dense_of(w).shape == (320, 512)
    twin = ex._unscaled(plain) if fmt == "nvfp4" else plain
    assert_bytes_equal(ex.dense_of(w), ex.mx_dequant(twin, out_dtype=cp.uint16), f"{fmt} dense values")
    seen = _dequantisations(monkeypatch)
    for m in (ex.DENSE_ROWS + 1, 150):
        x = rng.standard_normal((m, 512)).astype(np.float32)
        seen.clear()
        got = ex.mx_linear(cp.asarray(x), w, out_dtype=cp.float32)
        assert seen == [], f"{fmt} M{m}: dequantised with dense values kept"
        assert_bytes_equal(got, ex.mx_linear(cp.asarray(x), plain, out_dtype=cp.float32), f"{fmt} M{m}")
        assert seen == [(fmt, w.shape)]
        assert_close(host(got), bf16_round(x).astype(np.float64) @ w_ref.T, 1e-4, f"{fmt} M{m} against numpy")
    x = cp.asarray(rng.standard_normal((12, 512)).astype(np.float32))
    assert_bytes_equal(ex.mx_linear(x, w), ex.mx_linear(x, plain), f"{fmt} M12")
    # new codes: the kept values go with the old ones (never read stale), the product is the new weight's
    wq2, w_ref2 = random_weight(rng, fmt, (320, 512))
    w2 = ex.pack_weight(wq2)
    w.codes, w.scales, w.tensor_scale = w2.codes, w2.scales, w2.tensor_scale
    assert ex.dense_of(w) is None
    x = rng.standard_normal((100, 512)).astype(np.float32)
    assert_close(host(ex.mx_linear(cp.asarray(x), w, out_dtype=cp.float32)),
                 bf16_round(x).astype(np.float64) @ w_ref2.T, 1e-4, f"{fmt} new codes")
    assert not ex.attach_dense(ex.PackedWeight("bf16", (16, 64), cp.zeros((16, 64), cp.uint16)))  # bf16 already


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5_text"])
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_bf16_prefill_weights_change_no_logit(family, fmt, monkeypatch):
    """A model loaded with prefill_weights "bf16": every product weight (the stacked gate|up, qkv|z, b|a, q|k|v
    too, where the format stacks them) keeps its bf16 values, the embedding none; a prompt in a chunk of 90
    tokens and in chunks of 10 gives the logits of the packed-only model byte for byte, the 90-token chunk with
    no dequantisation but the LM head's (logits of all 90 rows here; a server's prompt chunk asks for its last
    row's)."""
    cfg, tensors = tiny_checkpoint(family)
    tensors = {k: quant.quantize(v, fmt) if v.ndim == 2 and not k.endswith("conv1d.weight") else v
               for k, v in tensors.items()}
    packed = QwenModel.from_tensors(cfg, cuda_backend("bf16"), tensors)
    dense = QwenModel.from_tensors(cfg, cuda_backend("bf16", prefill_weights="bf16"), tensors)
    stacks = [*dense.fused_mlp.values(), *(w for pair in dense.fused_dn.values() for w in pair),
              *(w for w, _ in dense.fused_qkv.values())]
    assert stacks or fmt == "nvfp4"  # NVFP4 parts of other tensor scales stay apart (`concat_rows`)
    assert all(isinstance(w, ex.PackedWeight) and ex.dense_of(w) is not None for w in stacks)
    products = {n: w for n, w in dense.w.items() if keeps_prefill_copy(n) and isinstance(w, ex.PackedWeight)}
    assert products and all(ex.dense_of(w) is not None for w in products.values())
    assert all(ex.dense_of(w) is None for n, w in dense.w.items()
               if isinstance(w, ex.PackedWeight) and n not in products)
    assert all(ex.dense_of(w) is None for w in packed.w.values() if isinstance(w, ex.PackedWeight))
    seen = _dequantisations(monkeypatch)
    ids = np.random.default_rng(zlib.crc32(f"{family}-{fmt}".encode())).integers(0, 512, 90)
    for chunk in (90, 10):
        seen.clear()
        got = forward_chunks(dense, ids, chunk)
        head = (fmt, (cfg.vocab_size, cfg.hidden_size))
        if chunk > ex.DENSE_ROWS:
            assert set(seen) <= {head}, f"{family} {fmt}: dequantised {seen} with bf16 prefill weights"
        ref = forward_chunks(packed, ids, chunk)
        assert chunk <= ex.DENSE_ROWS or len(set(seen) - {head}) > 3, "the packed model did not dequantise"
        assert_bytes_equal(got, ref, f"{family} {fmt} chunks of {chunk}")


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_kept_rows_take_cublas_from_fewer_rows(fmt, monkeypatch):
    """KEPT_ROWS below DENSE_ROWS: products of KEPT_ROWS + 1 to DENSE_ROWS rows over a weight that keeps its bf16
    values run cuBLAS on them (no dequantisation, the bytes of the dequantise + cuBLAS path), up to KEPT_ROWS
    the skinny kernels (the bytes of a weight without them); weights without kept values take the skinny
    kernels to DENSE_ROWS. The SwiGLU and norm fusions and the backend's side-stream pairs (skinny kernels
    only) follow the same split, and a tiny model's logits in chunks of 40 tokens stay within bf16 rounding of
    the packed model's."""
    from decapybara.backend import cupy_backend as cb
    from decapybara.backend.cupy_ops import gemm_bf16, to_bf16_bits

    monkeypatch.setattr(ex, "KEPT_ROWS", 16)
    rng = np.random.default_rng(zlib.crc32(f"kept-{fmt}".encode()))
    wq, w_ref = random_weight(rng, fmt, (320, 512))
    plain, w = ex.pack_weight(wq), ex.pack_weight(wq)
    assert ex.attach_dense(w)
    seen = _dequantisations(monkeypatch)
    alpha = w.tensor_scale if fmt == "nvfp4" else 1.0
    deq = ex.mx_dequant(ex._unscaled(plain) if fmt == "nvfp4" else plain, out_dtype=cp.uint16)
    for m in (1, 16, 17, 40, ex.DENSE_ROWS):
        x = rng.standard_normal((m, 512)).astype(np.float32)
        seen.clear()
        got = ex.mx_linear(cp.asarray(x), w, out_dtype=cp.float32)
        assert seen == [], f"{fmt} M{m}: dequantised with dense values kept"
        assert ex.skinny_product(w, m) == (m <= 16) and ex.skinny_product(plain, m)
        ref = (ex.mx_linear(cp.asarray(x), plain, out_dtype=cp.float32) if m <= 16
               else gemm_bf16(to_bf16_bits(cp.asarray(x)), deq, alpha=alpha))
        assert_bytes_equal(got, ref, f"{fmt} M{m}")
        assert_close(host(got), bf16_round(x).astype(np.float64) @ w_ref.T, 1e-4, f"{fmt} M{m} against numpy")
        assert ex.fuses_norms(w, m) == ex.fuses_norms(plain, m) == (m <= ex.FUSED_ROWS)
        assert cb._own_kernels(w, m) == (m <= 16) and cb._own_kernels(plain, m)
    gu_q, _ = random_weight(rng, fmt, (256, 512))
    gate_up = ex.pack_weight(gu_q)
    assert ex.attach_dense(gate_up)
    assert ex.fuses_swiglu(gate_up, 16) and not ex.fuses_swiglu(gate_up, 17)
    assert ex.fuses_swiglu(ex.pack_weight(gu_q), 40)
    cfg, tensors = tiny_checkpoint("qwen3_5_text")
    tensors = {k: quant.quantize(v, fmt) if v.ndim == 2 and not k.endswith("conv1d.weight") else v
               for k, v in tensors.items()}
    packed = QwenModel.from_tensors(cfg, cuda_backend("bf16"), tensors)
    dense = QwenModel.from_tensors(cfg, cuda_backend("bf16", prefill_weights="bf16"), tensors)
    ids = np.random.default_rng(zlib.crc32(f"kept-model-{fmt}".encode())).integers(0, 512, 80)
    seen.clear()
    got = forward_chunks(dense, ids, 40)
    head = (fmt, (cfg.vocab_size, cfg.hidden_size))
    assert set(seen) <= {head}, f"{fmt}: dequantised {seen} with bf16 prefill weights at 40 rows"
    assert_close(got, forward_chunks(packed, ids, 40), 2e-2, f"{fmt} logits, chunks of 40")


def test_prefill_weights_setting_is_checked():
    with pytest.raises(ValueError, match="packed or bf16"):
        cuda_backend("bf16", prefill_weights="fp8")
