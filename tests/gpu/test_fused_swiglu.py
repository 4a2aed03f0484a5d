"""The MLP's gate|up product and silu(gate) * up in one launch (decapybara/kernels/mx_gemv.cu `_1s` kernels,
`mx_swiglu`; GPU only).

`mx_swiglu(x, [gate; up])` must be `silu_mul_halves(mx_linear(x, [gate; up]))`: the kernel reads each band's
gate and up rows in one lane and finishes them with the same float operations, so that where every output tile
splits K alike (tile grids) the bytes are the same; under stream-K a column's K range may be split at other
chunks than the plain product's (its tile is another), so there within float32 rounding. Launch variants:
the plain products' tuning cases and the fused norms' DIRECT ones (whole-tile stores, split tiles reduced by
their last block, stream-K), x as float32 rows, bf16 bits and NormedRows (a fused norm consumer), output in
float32 and bf16 bits; one to eight n-tiles of rows (`_1s` to `_8s`). Only products of up to SWIGLU_ROWS rows over
N % 16 == 0 rows take it. The byte comparisons run the SwiGLU launches in the plain products' blocks
(`NO_OWN_WIDTH`: TUNE `swiglu_wide_warps` and `swiglu_warps` 0); their own block widths (MXFP4 / NVFP4 two-n-tile
launches: 24 warps) are compared within float32 rounding (`test_swiglu_blocks_of_their_own_width`).
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
from decapybara import kernels

if not kernels.has_cuda():
    pytest.skip("no CUDA device", allow_module_level=True)

from test_fused_norm import CASES, DIRECT, skinny_small_products, tile_sums  # noqa: F401 (an autouse fixture)
from test_kernels_extra import FORMATS, assert_bytes_equal, assert_close, host, random_weight

from decapybara.backend import cupy_backend as cb
from decapybara.backend import cupy_ops as ops
from decapybara.backend import cupy_ops_extra as ex
from decapybara.backend.cuda_factory import cuda_backend
from decapybara.model import quant
from decapybara.model.qwen import QwenModel
from decapybara.testing import quantized_matrices, tiny_checkpoint

pytestmark = pytest.mark.gpu


NO_OWN_WIDTH = {"swiglu_wide_warps": 0, "swiglu_warps": 0}  # SwiGLU launches in the plain products' blocks


def assert_swiglu_close(got, gate_up, name, rtol=2e-6):
    """silu(g) * u from sums g, u that each may differ by float32 rounding of their K order: per element
    |got - ref| <= rtol (|u| max |g| + |g| max |u|), the first-order error of the product where each sum is within
    rtol of its own largest (ref from `gate_up` [M, 2 I], the plain product's float32 sums)."""
    gu = np.asarray(host(gate_up), np.float64)
    g, u = gu[:, : gu.shape[1] // 2], gu[:, gu.shape[1] // 2:]
    ref = g / (1.0 + np.exp(-g)) * u
    got = np.asarray(host(got), np.float64)
    assert got.shape == ref.shape and not np.isnan(got).any(), f"{name}: shape {got.shape} or NaN"
    bound = rtol * (np.abs(u) * np.abs(g).max() + np.abs(g) * np.abs(u).max()) + 1e-30
    excess = np.abs(got - ref) / bound
    i = np.unravel_index(int(np.argmax(excess)), excess.shape)
    assert excess[i] <= 1.0, f"{name}: error {abs(got[i] - ref[i]):.3e} at {i} over its bound {bound[i]:.3e}"


def assert_same(got, gate_up, w, m, name):
    """Bytes equal to silu_mul_halves(gate_up) under a tile-grid plan; under stream-K within float32 rounding of
    the sums (header; `assert_swiglu_close`)."""
    if ex.gemm_plan(w, m).stream:
        assert_swiglu_close(got, gate_up, name)
    else:
        assert_bytes_equal(got, ops.silu_mul_halves(gate_up), name)


def stacked_case(name: str, fmt: str, tune: dict, shape: tuple[int, int], monkeypatch):
    """(rng, a [gate; up] matrix of 2 I rows (2 I: the case's N rounded up to 16) over K, gate its first I rows)
    under the case's tuning; None where the kernels cannot stream its layout (asserted)."""
    rng = np.random.default_rng(zlib.crc32(f"{name}-{fmt}-{sorted(tune.items())}-{shape}".encode()))
    wq, _ = random_weight(rng, fmt, (-(-shape[0] // 16) * 16, shape[1]))
    w = ex.pack_weight(wq)
    monkeypatch.setattr(ex, "TUNE", {**ex.TUNE, **NO_OWN_WIDTH, **tune})  # the plain products' tiles
    if not ex.fuses_swiglu(w, 1):
        assert not ex.gemm_ready(w)  # a layout the kernels cannot stream
        return None
    return rng, w


@pytest.mark.parametrize("tune,shape", CASES[::2] + DIRECT)
@pytest.mark.parametrize("fmt", FORMATS)
def test_swiglu_is_the_product_then_the_activation(fmt, tune, shape, monkeypatch):
    case = stacked_case("swiglu", fmt, tune, shape, monkeypatch)
    if case is None:
        return
    rng, w = case
    for m in (1, 3, 8, 12, 16, 17, 32, 40, 64):
        x = cp.asarray(rng.standard_normal((m, w.K)).astype(np.float32) * 2)
        for xr in (x, ops.to_bf16_bits(x)):
            gate_up = ex.mx_linear(xr, w, out_dtype=cp.float32)
            got = ex.mx_swiglu(xr, w)
            assert_same(got, gate_up, w, m, f"{fmt} {tune} M{m} x {xr.dtype}")
        bits = ex.mx_swiglu(x, w, out_dtype=cp.uint16)
        assert_bytes_equal(bits, ops.to_bf16_bits(ex.mx_swiglu(x, w)), f"{fmt} M{m} bf16 out")


@pytest.mark.parametrize("tune,shape", [({"swiglu_wide_warps": 24}, (4096, 5120)), ({"swiglu_wide_warps": 24}, (700, 1536)),
                                        ({"swiglu_wide_warps": 24, "policy": "stream", "min_chunks": 1}, (4100, 2048)),
                                        ({"swiglu_wide_warps": 16, "ksplit": 3}, (1504, 1536)),
                                        ({"swiglu_warps": 24, "swiglu_wide_warps": 24}, (4096, 5120)),
                                        ({"swiglu_warps": 16, "policy": "stream", "min_chunks": 1}, (4100, 2048))])
@pytest.mark.parametrize("fmt", ["bf16", "mxfp4", "nvfp4", "mxfp8"])
def test_swiglu_blocks_of_their_own_width(fmt, tune, shape, monkeypatch):
    """`swiglu_wide_warps` / `swiglu_warps`: two-n-tile SwiGLU launches (9-16 rows) / one-n-tile ones of 2-8
    rows take blocks of that many warps whatever the plain products take (`wide_warps` / `warps`; the kernels
    each launch builds are recorded): other tiles, so other K split points, so the plain product then the
    activation within float32 rounding; one row keeps its blocks (the plain one-row product's: `row1_warps` on the
    `_1r` / `_1rs` kernels)."""
    case = stacked_case("swiglu-width", fmt, tune, shape, monkeypatch)
    if case is None:
        return
    rng, w = case
    own = ex.tune_for(w.fmt)
    assert ex.launch_tune(w, 12, swiglu=True)["wide_warps"] == (tune.get("swiglu_wide_warps") or own["wide_warps"])
    assert ex.launch_tune(w, 12)["wide_warps"] == own["wide_warps"]
    assert ex.launch_tune(w, 5, swiglu=True)["warps"] == (tune.get("swiglu_warps") or own["warps"])
    row1 = ex.launch_tune(w, 1)["warps"]  # one row: the plain one-row product's blocks (`row1_warps` where it fills)
    assert ex.launch_tune(w, 1, swiglu=True)["warps"] == row1
    built = []  # (kernel name, its warps define) of every launch
    monkeypatch.setattr(ex, "get_kernel", lambda src, name, defines, real=ex.get_kernel: built.append(
        (name, dict(defines)["MX_WARPS2" if name.endswith(("_2s", "_2")) else "MX_WARPS"]))
        or real(src, name, defines))
    for m in (9, 12, 16, 5, 2, 1):
        x = cp.asarray(rng.standard_normal((m, w.K)).astype(np.float32) * 2)
        for xr in (x, ops.to_bf16_bits(x)):
            built.clear()
            gate_up = ex.mx_linear(xr, w, out_dtype=cp.float32)
            got = ex.mx_swiglu(xr, w)
            assert_swiglu_close(got, gate_up, f"{fmt} {tune} M{m} x {xr.dtype}")
            # the plain product in its own blocks, the SwiGLU launch in the knob's (one row: the plain width)
            (_, plain_w), (name, swi_w) = built
            knob = tune.get("swiglu_wide_warps" if m > 8 else "swiglu_warps") if m > 1 else None
            assert name.endswith("s") and swi_w == (knob or plain_w), (m, built)
            assert plain_w == (own["wide_warps"] if m > 8 else row1 if m == 1 else own["warps"]), (m, built)


@pytest.mark.parametrize("tune,shape", CASES[1::4] + DIRECT)
@pytest.mark.parametrize("fmt", ["bf16", "mxfp4", "nvfp4"])
def test_swiglu_consumes_normed_rows(fmt, tune, shape, monkeypatch):
    """x = NormedRows (the gate|up product after an output projection that fused the norm): each row divided
    by its denominator before the activation, as the plain consumer product does."""
    case = stacked_case("swiglu-normed", fmt, tune, shape, monkeypatch)
    if case is None:
        return
    rng, w = case
    k = w.K
    for m in (1, 6):
        h = rng.standard_normal((m, k)).astype(np.float32) * 3
        nw = (rng.standard_normal(k) * 0.2).astype(np.float32)
        normed = ex.NormedRows(cp.asarray(h), cp.asarray(h * (np.float32(1.0) + nw)),
                               cp.asarray(tile_sums(h, 128).astype(np.float32)), cp.asarray(nw), 1e-6, 1.0)
        assert_same(ex.mx_swiglu(normed, w), ex.mx_linear(normed, w), w, m, f"{fmt} {tune} M{m} normed")


def test_backend_runs_one_launch_up_to_eight_rows(monkeypatch):
    """`swiglu` on the bf16 backend: mx_swiglu from TUNE `swiglu_rows` (here 2) up to SWIGLU_ROWS rows over
    packed or bf16 [gate; up] matrices, in bf16 bits where the down product reads them so (`silu_mul_halves`'
    dtype rule); the two ops below `swiglu_rows`, past SWIGLU_ROWS, over float32 matrices and with
    `swiglu_rows` 0; every result the two ops' (bytes under tile grids)."""
    monkeypatch.setitem(ex.TUNE, "swiglu_rows", 2)
    monkeypatch.setattr(ex, "TUNE", {**ex.TUNE, **NO_OWN_WIDTH})  # the plain products' tiles (bytes compared)
    rng = np.random.default_rng(6)
    backend = cuda_backend("bf16")
    calls = []
    monkeypatch.setattr(ex, "_gemm", lambda *a, real=ex._gemm, **kw: calls.append(kw.get("swiglu")) or real(*a, **kw))
    down = ex.pack_weight(quant.quantize(rng.standard_normal((128, 256)).astype(np.float32) * 0.05, "mxfp4"))
    gate = rng.standard_normal((256, 192)).astype(np.float32) * 0.05
    up = rng.standard_normal((256, 192)).astype(np.float32) * 0.05
    packed = backend.concat_rows([ex.pack_weight(quant.quantize(a, "mxfp4")) for a in (gate, up)])[0]
    bf16 = backend.concat_rows([ops.to_bf16_bits(cp.asarray(a)) for a in (gate, up)])[0]
    dense = cp.asarray(np.concatenate([gate, up]))
    for gu in (packed, bf16, dense):
        for m in (1, 5, 8, 12, 17, 40, 65):
            x = cp.asarray(rng.standard_normal((m, 192)).astype(np.float32))
            calls.clear()
            got = backend.swiglu(x, gu, to_product=down)
            ref = backend.silu_mul_halves(backend.linear(x, gu), to_product=down)
            w = cb._streamed(gu)
            if w is None or not 2 <= m <= ex.SWIGLU_ROWS or not ex.gemm_plan(w, m).stream:  # two ops / a tile grid
                assert_bytes_equal(got, ref, f"{type(gu).__name__} M{m}")
            else:  # float32 rounding of the sums, then (from bf16_rows rows) bf16 rounding of the rows
                f32 = (lambda a: host(ops.bf16_bits_to_f32(a) if a.dtype == cp.uint16 else a))
                assert got.dtype == ref.dtype
                assert_close(f32(got), f32(ref), 1e-2 if got.dtype == cp.uint16 else 2e-6, f"{type(gu).__name__} M{m}")
            assert (True in calls) == (2 <= m <= ex.SWIGLU_ROWS and gu is not dense), (m, calls)
    monkeypatch.setitem(ex.TUNE, "swiglu_rows", 0)
    calls.clear()
    x = cp.asarray(rng.standard_normal((2, 192)).astype(np.float32))
    assert_bytes_equal(backend.swiglu(x, packed), backend.silu_mul_halves(backend.linear(x, packed)), "off")
    assert True not in calls


@pytest.mark.parametrize("policy", ["auto", "balance"])
@pytest.mark.parametrize("weights", ["bf16", "mxfp4"])
@pytest.mark.parametrize("family", ["qwen3", "qwen3_5_text"])
def test_fused_swiglu_changes_no_logit(family, weights, policy, monkeypatch):
    """Decode rows and chunks of 4 (one launch for gate|up and the activation, x NormedRows; TUNE `swiglu_rows`
    1), of 12 (one launch, the two-n-tile kernel) and of 20 (the four-n-tile kernel) give the logits of
    `swiglu_rows` 0 (the two ops):
    byte for byte where every gate|up product runs a tile grid (policy "balance"), within float32 rounding and
    with the same greedy tokens under the default plans."""
    from test_cupy_model import PROMPT, forward_chunks

    cfg, tensors = tiny_checkpoint(family)
    if weights == "mxfp4":
        tensors = quantized_matrices(tensors, "mxfp4")
    model = QwenModel.from_tensors(cfg, cuda_backend("bf16"), tensors)
    assert model.fused_mlp, "the tiny model's MLPs should be fused gate|up products"
    monkeypatch.setitem(ex.TUNE, "policy", policy)
    monkeypatch.setattr(ex, "TUNE", {**ex.TUNE, **NO_OWN_WIDTH})  # the plain products' tiles (bytes compared)
    grids = all(not ex.gemm_plan(cb._streamed(gu), m).stream for gu in model.fused_mlp.values()
                for m in (1, 4, 12, 20))
    assert grids or policy != "balance"
    calls = []
    monkeypatch.setattr(cb, "mx_swiglu",
                        lambda x, *a, real=ex.mx_swiglu, **kw: calls.append(x.shape[0]) or real(x, *a, **kw))
    got = {}
    for on in (1, 0):
        monkeypatch.setitem(ex.TUNE, "swiglu_rows", on)
        got[on] = [forward_chunks(model, PROMPT[:24], chunk) for chunk in (1, 4, 12, 20)]
        if on:
            assert set(calls) == {1, 4, 12, 20}, set(calls)
    for chunk, a, b in zip((1, 4, 12, 20), got[1], got[0], strict=True):
        assert (a.argmax(-1) == b.argmax(-1)).all(), f"{family} {weights} chunks of {chunk}: greedy tokens"
        if grids:
            assert_bytes_equal(a, b, f"{family} {weights} chunks of {chunk}")
        else:
            assert_close(a, b, 1e-4, f"{family} {weights} chunks of {chunk}")
