"""The residual add and RMSNorm fused across two skinny products (decapybara/kernels/mx_gemv.cu, header; GPU only).

The producer (`mx_linear_add_norm`) must store exactly the unfused h = `mx_linear(x, w, bias) + residual`, h
times the norm's (offset + weight) rounded to bf16 bits, and the sums of squares of h's rows by column tile; the consumer
(`mx_linear` on `NormedRows`) must compute the product of the normalised rows. Outputs NaN-poisoned
(`cupy_ops.POISON`), so unwritten sums fail. Launch variants: the plain products' tuning cases (at up to 8 rows
they all split K: the tile's last split reduces it) and DIRECT, where one block computes a whole tile (one
split: the direct store) or a stream-K block runs whole tiles and split ones in turn, with 8 and 4 warps. Only
products of up to FUSED_ROWS rows fuse (the one-n-tile kernels); wider ones run the plain ops.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
from decapybara import kernels

if not kernels.has_cuda():
    pytest.skip("no CUDA device", allow_module_level=True)

from test_kernels_extra import (
    FORMATS,
    TUNE_CASES,
    assert_bytes_equal,
    assert_close,
    bf16_round,
    host,
    random_weight,
)

from decapybara.backend import cupy_ops as ops
from decapybara.backend import cupy_ops_extra as ex
from decapybara.backend.cuda_factory import cuda_backend
from decapybara.backend.cupy_backend import CupyBackend, _reads_bf16
from decapybara.model import quant
from decapybara.model.quant.elements import bf16_encode
from decapybara.model.qwen import QwenModel
from decapybara.testing import quantized_matrices, tiny_checkpoint

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def skinny_small_products(monkeypatch):
    """Small bf16 products on the skinny GEMM (TUNE small_n 0), not gemv_small: the fused launches are compared
    bit for bit with the skinny kernels' own unfused products."""
    monkeypatch.setitem(ex.TUNE, "small_n", 0)


CASES = [({"small_bytes": 0, **t}, s) for t, s in TUNE_CASES]
DIRECT = [({"small_bytes": 0, **t}, s) for t, s in [
    ({"ksplit": 1}, (700, 1536)), ({"ksplit": 1, "warps": 4}, (4096, 1024)), ({"ksplit": 1}, (300, 700)),
    ({"policy": "stream", "min_chunks": 3}, (4100, 512)),
    ({"policy": "stream", "warps": 4, "min_chunks": 2}, (700, 256))]]


def tile_sums(h: np.ndarray, tile: int) -> np.ndarray:
    """float64 sums of squares of h's rows by column tile [M, ceil(N / tile)]."""
    m, n = h.shape
    pad = np.zeros((m, -(-n // tile) * tile))
    pad[:, :n] = np.asarray(h, np.float64) ** 2
    return pad.reshape(m, -1, tile).sum(axis=2)


@pytest.mark.parametrize("tune,shape", CASES + DIRECT)
@pytest.mark.parametrize("fmt", FORMATS)
def test_producer_adds_the_residual_and_sums_each_tile(fmt, tune, shape, monkeypatch):
    rng = np.random.default_rng(zlib.crc32(f"fused-{fmt}-{sorted(tune.items())}-{shape}".encode()))
    wq, _ = random_weight(rng, fmt, shape)
    w = ex.pack_weight(wq)
    monkeypatch.setattr(ex, "TUNE", {**ex.TUNE, **tune})
    for m, with_bias in ((1, False), (5, True), (8, False), (9, False)):
        tile = 16 * ex.block_warps(ex.launch_tune(w, m), 1)  # the launch's blocks (one row: `row1_warps`)
        x = cp.asarray(rng.standard_normal((m, shape[1])).astype(np.float32))
        res = cp.asarray(rng.standard_normal((m, shape[0])).astype(np.float32))
        bias = cp.asarray(rng.standard_normal(shape[0]).astype(np.float32)) if with_bias else None
        nw = cp.asarray(rng.standard_normal(shape[0]).astype(np.float32))
        got = ex.mx_linear_add_norm(x, w, bias, res, nw, 1e-6, 1.0)
        if m > ex.FUSED_ROWS or not ex.gemm_ready(w):  # the two-n-tile kernels do not fuse, and nothing fuses
            assert got is None                         # a weight they cannot stream: the caller runs the plain ops
            continue
        normed, h = got
        assert normed.h is h and normed.weight is nw and normed.sq.shape == (m, -(-shape[0] // tile))
        assert_bytes_equal(h, ex.mx_linear(x, w, bias, out_dtype=cp.float32) + res, f"{fmt} {tune} M{m} h")
        xg = host(h) * (np.float32(1.0) + host(nw))  # in bf16 bits from TUNE bf16_rows rows up
        assert_bytes_equal(normed.xg, bf16_encode(xg) if m >= ex.TUNE["bf16_rows"] else xg, f"{fmt} {tune} M{m} xg")
        assert_close(normed.sq, tile_sums(host(h), tile), 1e-5, f"{fmt} {tune} M{m} tile sums")


@pytest.mark.parametrize("tune,shape", CASES[::3] + DIRECT)
@pytest.mark.parametrize("fmt", FORMATS)
def test_consumer_stages_the_normalised_rows(fmt, tune, shape, monkeypatch):
    """A product over NormedRows = the product over h (offset + w) rounded to bf16 (as x always is), each row
    divided by its denominator from the tile sums; and within rounding the product over the norm kernel's
    rows (those are rounded to bf16 after the division, so a few round the other way)."""
    rng = np.random.default_rng(zlib.crc32(f"consumer-{fmt}-{sorted(tune.items())}-{shape}".encode()))
    k = shape[1]
    wq, w_ref = random_weight(rng, fmt, shape)
    w = ex.pack_weight(wq)
    monkeypatch.setattr(ex, "TUNE", {**ex.TUNE, **tune})
    eps, off = 1e-6, 1.0
    for m in (1, 5, 8, 12):
        h = rng.standard_normal((m, k)).astype(np.float32) * 3
        nw = (rng.standard_normal(k) * 0.2).astype(np.float32)
        sq = tile_sums(h, 128).astype(np.float32)
        xg = h * (np.float32(off) + nw)
        normed = ex.NormedRows(cp.asarray(h), cp.asarray(xg), cp.asarray(sq), cp.asarray(nw), eps, off)
        denom = np.sqrt(sq.astype(np.float64).sum(axis=1, keepdims=True) / k + eps)
        got = ex.mx_linear(normed, w)
        plain = ex.mx_linear(ops.rms_norm(cp.asarray(h), cp.asarray(nw), eps, off), w)
        if m > ex.FUSED_ROWS or not ex.gemm_ready(w):  # materialised by the norm kernel: the plain product
            assert_bytes_equal(got, plain, f"{fmt} {tune} M{m} materialised")
            continue
        assert_close(got, bf16_round(xg).astype(np.float64) @ w_ref.T / denom, 1e-4, f"{fmt} {tune} M{m}")
        assert_close(got, host(plain), 1e-2, f"{fmt} {tune} M{m} vs the norm kernel's rows")


@pytest.mark.parametrize("tile", [16, 32, 57])
def test_consumer_sums_any_number_of_tiles(tile, monkeypatch):
    """37, 66 and 132 tile sums a row (4-warp producers of wide rows give more than 64): every one counts."""
    rng = np.random.default_rng(tile)
    k, m = 2100, 5
    wq, w_ref = random_weight(rng, "mxfp4", (300, k))
    w = ex.pack_weight(wq)
    monkeypatch.setattr(ex, "TUNE", {**ex.TUNE, "small_bytes": 0, "ksplit": 1})
    h = rng.standard_normal((m, k)).astype(np.float32) * 3
    nw = (rng.standard_normal(k) * 0.2).astype(np.float32)
    sq = tile_sums(h, tile).astype(np.float32)
    xg = h * (np.float32(1.0) + nw)
    normed = ex.NormedRows(cp.asarray(h), cp.asarray(xg), cp.asarray(sq), cp.asarray(nw), 1e-6, 1.0)
    denom = np.sqrt(sq.astype(np.float64).sum(axis=1, keepdims=True) / k + 1e-6)
    got = ex.mx_linear(normed, w)
    assert_close(got, bf16_round(xg).astype(np.float64) @ w_ref.T / denom, 1e-4, f"{sq.shape[1]} tiles")


def test_normed_rows_materialise_where_no_skinny_product_runs():
    """Past DENSE_ROWS rows (the dequantise + cuBLAS path) NormedRows go through the norm kernel, and no
    product of that many rows fuses."""
    rng = np.random.default_rng(7)
    wq, _ = random_weight(rng, "mxfp4", (256, 512))
    w = ex.pack_weight(wq)
    m = ex.DENSE_ROWS + 3
    h = rng.standard_normal((m, 512)).astype(np.float32)
    nw = rng.standard_normal(512).astype(np.float32)
    normed = ex.NormedRows(cp.asarray(h), cp.asarray(h * (1 + nw)), cp.asarray(tile_sums(h, 128).astype(np.float32)),
                           cp.asarray(nw), 1e-6, 1.0)
    x = ops.rms_norm(cp.asarray(h), cp.asarray(nw), 1e-6, 1.0)
    assert_bytes_equal(ex.mx_linear(normed, w), ex.mx_linear(x, w), "materialised")
    assert ex.mx_linear_add_norm(cp.asarray(h), w, None, cp.zeros((m, 256), cp.float32), cp.asarray(nw[:256]),
                                 1e-6, 1.0) is None


class EmulatedRows:
    """`NumpyBF16Fused`'s deferred normed rows: xg = h (offset + w) and each row's denominator."""

    def __init__(self, xg: np.ndarray, denom: np.ndarray) -> None:
        self.xg, self.denom, self.shape = xg, denom, xg.shape

    def __getitem__(self, rows: np.ndarray) -> EmulatedRows:  # rows of them (an MoE expert's)
        return EmulatedRows(self.xg[rows], self.denom[rows])


def numpy_bf16_fused():
    """The bf16 emulation (test_cupy_model.NumpyBF16) with the fused norms' rounding: up to FUSED_ROWS rows, an
    output projection's rows h = product + residual are normed for the next products as bf16(h (offset + w))
    @ W^T / denom (rounded to bf16 before the division by the RMS, not after)."""
    from test_cupy_model import NumpyBF16

    class NumpyBF16Fused(NumpyBF16):
        moe_takes_product_rows = True  # as CupyBackend: the router and experts divide their products

        def moe(self, x, router, gate_w, up_w, down_w, top_k, normalize, shared=None, shared_gate=None, fused=None):
            if not isinstance(x, EmulatedRows):
                return super().moe(x, router, gate_w, up_w, down_w, top_k, normalize, shared, shared_gate, fused)
            # NumpyBackend.moe over the deferred rows (its zeros_like needs an array)
            logits = self.linear(x, router)
            probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
            probs /= probs.sum(axis=-1, keepdims=True)
            top = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
            weights = np.take_along_axis(probs, top, axis=-1)
            if normalize:
                weights = weights / weights.sum(axis=-1, keepdims=True)
            out = np.zeros(x.shape, np.float32)
            for e in np.unique(top):
                rows, which = np.nonzero(top == e)
                h = self.silu_mul(self.linear(x[rows], gate_w[e]), self.linear(x[rows], up_w[e]))
                out[rows] += self.linear(h, down_w[e]) * weights[rows, which][:, None]
            return self.add_shared_expert(out, x, shared, shared_gate)

        def linear_add_rms_norm(self, x, weight, bias, residual, norm_weight, eps, offset):
            if x.shape[0] > ex.FUSED_ROWS:
                return super().linear_add_rms_norm(x, weight, bias, residual, norm_weight, eps, offset)
            h = (self.linear(x, weight, bias) + residual).astype(np.float32)
            xg = (h * (np.float32(offset) + norm_weight)).astype(np.float32)
            denom = np.sqrt((h.astype(np.float64) ** 2).mean(axis=1, keepdims=True) + eps).astype(np.float32)
            return EmulatedRows(xg, denom), h

        def linear(self, x, weight, bias=None):
            if not isinstance(x, EmulatedRows):
                return super().linear(x, weight, bias)
            y = (super().linear(x.xg, weight) / x.denom).astype(np.float32)
            return y + bias if bias is not None else y

    return NumpyBF16Fused()


@pytest.mark.parametrize("weights", ["bf16", "mxfp4"])
@pytest.mark.parametrize("family", ["qwen3", "qwen3_5_text"])
def test_fused_norm_decode_matches_the_bf16_emulation(family, weights):
    """Decode steps (one row: fused norms) of the bf16 backend over bf16 matrices or MXFP4 packed ones against
    the numpy bf16 emulation with the fused rounding: every row within 1e-2 (test_cupy_model's bf16 bound).
    The GPU's sums of squares come in another order than the emulation's; the fused calls happened."""
    from test_cupy_model import PROMPT, forward_chunks

    cfg, tensors = tiny_checkpoint(family)
    if weights == "mxfp4":
        tensors = quantized_matrices(tensors, "mxfp4")
    backend = CupyBackend("bf16") if weights == "bf16" else cuda_backend("bf16")
    calls = []
    real = backend.linear_add_rms_norm
    backend.linear_add_rms_norm = lambda *a: calls.append(a[0].shape[0]) or real(*a)
    got = forward_chunks(QwenModel.from_tensors(cfg, backend, tensors), PROMPT[:24], 1)
    emul = forward_chunks(QwenModel.from_tensors(cfg, numpy_bf16_fused(), tensors), PROMPT[:24], 1)
    assert calls and set(calls) == {1}
    rows = np.abs(got - emul).max(-1) / np.abs(emul).max()
    print(f"{family} {weights}: worst rows {np.sort(rows)[-3:]}")
    assert rows.max() <= 1e-2


@pytest.mark.parametrize("weights", ["bf16", "mxfp4"])
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe_text", "qwen3_5_moe_text/slot"])
def test_moe_blocks_take_the_fused_norm(family, weights, monkeypatch):
    """Decode steps (one row) of MoE models (bf16 or MXFP4 matrices and experts; /slot: the shared expert in the
    stacks): the output projection before each MoE block fuses the residual add and hands `NormedRows` to the
    block (`Backend.moe_takes_product_rows`), whose router (gemv_small or, MXFP4, the skinny kernels) and expert
    products divide by the rows' denominators, none materialised. Against the numpy bf16 emulation with that
    rounding (router, experts and shared expert over bf16(h (offset + w)) / denom): every row within 1e-2, the
    dense decode's bound above (the host emulator: 2.4e-5 at most with every router on the skinny kernels, 2.3e-3
    with the bf16 ones on gemv_small, whose sums go in another order than numpy's). Not against the model with
    the norm kernel between, whose other rounding flips qwen3_moe's MXFP4 router at a 9e-4 margin of its logits,
    which these tiny random models amplify to 0.1 of a row. The MoE got NormedRows."""
    from test_cupy_model import PROMPT, forward_chunks
    from test_piecewise import checkpoint_of, model_of

    monkeypatch.setitem(ex.TUNE, "small_n", 1024)  # the bf16 routers on gemv_small, as by default
    seen = []
    real = ex.moe
    monkeypatch.setattr(ex, "moe", lambda x, *a, **kw: seen.append(type(x).__name__) or real(x, *a, **kw))
    with monkeypatch.context() as m:  # every block over NormedRows fuses them: nothing materialises
        m.setattr(ex.NormedRows, "materialize", lambda self: pytest.fail("materialised"))
        got = forward_chunks(model_of(family, weights), PROMPT[:16], 1)
    assert "NormedRows" in seen
    cfg, tensors = checkpoint_of(family, weights)
    emul = forward_chunks(QwenModel.from_tensors(cfg, numpy_bf16_fused(), tensors), PROMPT[:16], 1)
    rows = np.abs(got - emul).max(-1) / np.abs(emul).max()
    print(f"{family} {weights}: worst rows {np.sort(rows)[-3:]} of the emulation")
    assert rows.max() <= 1e-2


def test_fused_producer_output_is_a_normed_rows_object():
    """The bf16 backend hands NormedRows (no norm kernel) to the next products of a skinny step."""
    backend = CupyBackend("bf16")
    rng = np.random.default_rng(2)
    w = ops.to_bf16_bits(cp.asarray(rng.standard_normal((256, 128)).astype(np.float32)))
    x = cp.asarray(rng.standard_normal((3, 128)).astype(np.float32))
    res = cp.asarray(rng.standard_normal((3, 256)).astype(np.float32))
    nw = cp.asarray(rng.standard_normal(256).astype(np.float32))
    normed, h = backend.linear_add_rms_norm(x, w, None, res, nw, 1e-6, 1.0)
    assert isinstance(normed, ex.NormedRows) and normed.h is h
    ref_x, ref_h = backend.add_rms_norm(backend.linear(x, w), res, nw, 1e-6, 1.0)
    assert_bytes_equal(h, ref_h, "residual stream")
    w2 = ops.to_bf16_bits(cp.asarray(rng.standard_normal((64, 256)).astype(np.float32)))
    assert_close(backend.linear(normed, w2), host(backend.linear(ref_x, w2)), 1e-2, "consumer")


@pytest.mark.parametrize("weights", ["bf16", "mxfp4"])
def test_wider_steps_hand_bf16_rows_to_the_products(weights):
    """Past FUSED_ROWS (up to SKINNY_ROWS), the bf16 backend's output projection + residual add + norm writes
    the normed rows in bf16 bits: the rounding the next products apply to float32 rows anyway, so their
    outputs are byte for byte those of the float32 rows, and the residual stream is unchanged."""
    backend = cuda_backend("bf16")
    rng = np.random.default_rng(12)
    m = 12

    def weight(n, k):
        w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
        return ex.pack_weight(quant.quantize(w, "mxfp4")) if weights == "mxfp4" else ops.to_bf16_bits(cp.asarray(w))

    w, w2 = weight(512, 256), weight(384, 512)
    x = cp.asarray(rng.standard_normal((m, 256)).astype(np.float32))
    res = cp.asarray(rng.standard_normal((m, 512)).astype(np.float32))
    nw = cp.asarray(rng.uniform(-0.2, 0.2, 512).astype(np.float32))
    normed, h = backend.linear_add_rms_norm(x, w, None, res, nw, 1e-6, 1.0)
    ref_x, ref_h = backend.add_rms_norm(backend.linear(x, w), res, nw, 1e-6, 1.0)
    assert normed.dtype == cp.uint16 and normed.shape == (m, 512)
    assert_bytes_equal(normed, ops.to_bf16_bits(ref_x), "bf16 rows")
    assert_bytes_equal(h, ref_h, "residual stream")
    assert_bytes_equal(backend.linear(normed, w2), backend.linear(ref_x, w2), "the next product")
    # a float32 weight takes bf16 rows widened to their float32 values (not their bits as integers)
    dense = cp.asarray(rng.standard_normal((64, 512)).astype(np.float32))
    assert_bytes_equal(backend.linear(normed, dense), backend.linear(ops.bf16_bits_to_f32(normed), dense), "float32")
    # the fp32 backend keeps float32 rows: its matrices may be float32 (no rounding of x) beside packed ones
    fp32 = cuda_backend("fp32")
    assert fp32.linear_add_rms_norm(x, w, None, res, nw, 1e-6, 1.0)[0].dtype == cp.float32


def test_mlp_activation_goes_to_the_down_product_in_bf16_bits():
    """silu(gate) * up for a down product the skinny kernels run comes in bf16 bits (from TUNE bf16_rows rows
    up to SKINNY_ROWS: the fused norms do not cover it); the down product's bytes are those of the float32
    rows. Rows below bf16_rows (none at its default of one), and a float32 down weight (the reference
    backend's), get float32 rows."""
    backend = cuda_backend("bf16")
    rng = np.random.default_rng(5)
    least = ex.tune_for("mxfp4")["bf16_rows"]
    for m in (1, 2, 8, 12):
        bf16 = 0 < least <= m
        y = cp.asarray(rng.standard_normal((m, 1024)).astype(np.float32))
        down = ex.pack_weight(quant.quantize(rng.standard_normal((256, 512)).astype(np.float32) * 0.05, "mxfp4"))
        act = backend.silu_mul_halves(y, to_product=down)
        plain = backend.silu_mul_halves(y)
        assert act.dtype == (cp.uint16 if bf16 else cp.float32) and plain.dtype == cp.float32
        assert_bytes_equal(act, ops.to_bf16_bits(plain) if bf16 else plain, f"M{m} activation")
        assert cuda_backend("fp32").silu_mul_halves(y, to_product=down).dtype == cp.float32
        assert_bytes_equal(backend.linear(act, down), backend.linear(plain, down), f"M{m} down product")
        dense = cp.asarray(rng.standard_normal((256, 512)).astype(np.float32))
        assert backend.silu_mul_halves(y, to_product=dense).dtype == cp.float32


@pytest.mark.parametrize("weights", ["bf16", "mxfp4"])
@pytest.mark.parametrize("family", ["qwen3", "qwen3_5_text", "qwen3_5_moe_text"])
def test_bf16_rows_change_no_logit(family, weights, monkeypatch):
    """Rows handed to the products in bf16 bits (TUNE `bf16_rows`, here from one row up: the fused norms' xg,
    the norms after output projections past 8 rows, the MLP activation, the attention output gate, and on
    decode rows of the hybrid family the DeltaNet gated norm; the MoE family's blocks over them, fused or in
    bf16 bits) give every logit byte for byte as float32 rows do, over decode rows (fused norms) and chunks of
    12 rows (the wide kernels)."""
    from test_cupy_model import PROMPT, forward_chunks

    cfg, tensors = tiny_checkpoint(family)
    if weights == "mxfp4":
        tensors = quantized_matrices(tensors, "mxfp4")
    model = QwenModel.from_tensors(cfg, cuda_backend("bf16"), tensors)
    down = model.w["model.layers.0.mlp." + ("shared_expert." if "moe" in family else "") + "down_proj.weight"]
    assert _reads_bf16(down, 12), "the tiny model's products are not on the skinny kernels"
    got = {}
    for on in (1, 0):
        monkeypatch.setitem(ex.TUNE, "bf16_rows", on and 1)  # every row count, or none
        got[on] = [forward_chunks(model, PROMPT[:24], chunk) for chunk in (1, 12)]
    for chunk, a, b in zip((1, 12), got[1], got[0], strict=True):
        assert_bytes_equal(a, b, f"{family} {weights} chunks of {chunk}")
