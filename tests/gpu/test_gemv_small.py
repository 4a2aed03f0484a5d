"""decapybara/kernels/gemv_small.cu (`cupy_ops_extra.small_product`: bf16 products of few weight rows and few rows of x)
against the numpy reference and against the skinny GEMM it replaces (GPU only; outputs NaN-poisoned)."""

from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
from decapybara import kernels

if not kernels.has_cuda():
    pytest.skip("no CUDA device", allow_module_level=True)

from decapybara.backend import cupy_ops_extra as ex
from decapybara.model.quant.elements import bf16_decode, bf16_encode

pytestmark = pytest.mark.gpu


def bf16_round(a):
    return bf16_decode(bf16_encode(np.asarray(a, np.float32)))


def rel_err(got, ref):
    got, ref = np.asarray(cp.asnumpy(got), np.float64), np.asarray(ref, np.float64)
    assert got.shape == ref.shape and not np.isnan(got).any(), f"shape {got.shape} vs {ref.shape}, or NaN"
    return float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30))


@pytest.fixture
def small_on(monkeypatch):
    monkeypatch.setitem(ex.TUNE, "small_n", 4096)


@pytest.mark.parametrize("m", [1, 5, 12, 16, 17, 24, 32])  # past 16: a launch a 16 rows
@pytest.mark.parametrize("n,k", [(1, 8), (7, 264), (64, 2048), (257, 2048), (1000, 4104)])
@pytest.mark.parametrize("x_dtype", ["f32", "bf16", "f16"])
def test_small_product_matches_numpy(small_on, m, n, k, x_dtype):
    """x @ w^T with x rounded to bf16, float32 sums: every output row and column, including a last warp's rows
    past N and K past the codes loaded before the wait (4,104 = 513 groups of 8)."""
    rng = np.random.default_rng(m * 1000 + n + k)
    w = bf16_round(rng.standard_normal((n, k)) * 0.1)
    x = rng.standard_normal((m, k)).astype(np.float32)
    pw = ex.PackedWeight("bf16", (n, k), cp.asarray(bf16_encode(w)), persistent=True)
    assert ex.small_product(pw, m)
    xd = {"f32": lambda: cp.asarray(x), "bf16": lambda: cp.asarray(bf16_encode(x)),
          "f16": lambda: cp.asarray(x.astype(np.float16))}[x_dtype]()
    x = x.astype(np.float16).astype(np.float32) if x_dtype == "f16" else x
    got = ex.mx_linear(xd, pw, out_dtype=cp.float32)
    ref = bf16_round(x).astype(np.float64) @ w.astype(np.float64).T
    assert rel_err(got, ref) < 1e-5, f"m={m} n={n} k={k} {x_dtype}"


@pytest.mark.parametrize("warps,pre", [(8, 8), (16, 4), (4, 2)])
@pytest.mark.parametrize("m", [8, 9])
@pytest.mark.parametrize("x_dtype", ["f32", "bf16"])
def test_small_product_unaligned_x_and_builds(small_on, monkeypatch, warps, pre, m, x_dtype):
    """x that does not start 16-byte aligned (a contiguous array one element into its buffer: loaded element by
    element), the last row count of one n-tile and the first of two, and other block widths / register batches
    (TUNE small_warps, small_pre): K of 5,128 = 160.25 steps over the warps, 40 rows (a partial third tile)."""
    monkeypatch.setitem(ex.TUNE, "small_warps", warps)
    monkeypatch.setitem(ex.TUNE, "small_pre", pre)
    rng = np.random.default_rng(m * 10 + warps + pre)
    n, k = 40, 5128
    w = bf16_round(rng.standard_normal((n, k)) * 0.1)
    x = rng.standard_normal((m, k)).astype(np.float32)
    pw = ex.PackedWeight("bf16", (n, k), cp.asarray(bf16_encode(w)), persistent=True)
    flat = x.reshape(-1) if x_dtype == "f32" else bf16_encode(x).reshape(-1)
    buf = cp.zeros(flat.size + 1, flat.dtype)
    buf[1:] = cp.asarray(flat)
    xd = buf[1:].reshape(m, k)
    assert ex.dev_ptr(xd) % 16 != 0
    got = ex.mx_linear(xd, pw, out_dtype=cp.float32)
    ref = bf16_round(x).astype(np.float64) @ w.astype(np.float64).T
    assert rel_err(got, ref) < 1e-5, f"m={m} warps={warps} pre={pre} {x_dtype}"


@pytest.mark.parametrize("m", [1, 12])
def test_small_product_of_a_stack_row_range_in_bf16(small_on, m):
    """A row range of a stack (the router's rows of a [router; gate; ...] stack, a view that starts past the
    stack's first row) and bf16 output: the same values as the skinny GEMM over the same view, and as numpy."""
    rng = np.random.default_rng(7 + m)
    e, h = 256, 2048
    stack = bf16_round(rng.standard_normal((e + 40, h)) * 0.05)
    codes = cp.asarray(bf16_encode(stack))[3:e + 4]
    view = ex.PackedWeight("bf16", (e + 1, h), codes, persistent=True)
    x = rng.standard_normal((m, h)).astype(np.float32)
    assert ex.small_product(view, m)
    got = ex.mx_linear(cp.asarray(x), view, out_dtype=cp.uint16)
    ref = bf16_round(x).astype(np.float64) @ stack[3:e + 4].astype(np.float64).T
    assert rel_err(cp.asarray(bf16_decode(cp.asnumpy(got))), ref) < 1e-2
    ex.TUNE["small_n"] = 0
    skinny = ex.mx_linear(cp.asarray(x), view, out_dtype=cp.float32)
    ex.TUNE["small_n"] = 4096
    small = ex.mx_linear(cp.asarray(x), view, out_dtype=cp.float32)
    assert rel_err(small, cp.asnumpy(skinny)) < 1e-5


def test_small_product_limits(small_on, monkeypatch):
    """Other formats, more rows of x than SMALL_SPLIT_ROWS (two launches of SMALL_ROWS) and wider matrices than TUNE
    small_n stay on the skinny GEMM; small_n 0 turns the kernel off."""
    bf = ex.PackedWeight("bf16", (64, 2048), cp.zeros((64, 2048), cp.uint16), persistent=True)
    assert ex.small_product(bf, 16) and ex.small_product(bf, 17) and ex.small_product(bf, 32)
    assert not ex.small_product(bf, 33)
    assert ex.small_product(ex.PackedWeight("bf16", (64, 16384), cp.zeros((64, 16384), cp.uint16)), 12)
    assert not ex.small_product(ex.PackedWeight("bf16", (8192, 64), cp.zeros((8192, 64), cp.uint16)), 12)
    monkeypatch.setitem(ex.TUNE, "small_n", 63)
    assert not ex.small_product(bf, 1)
    monkeypatch.setitem(ex.TUNE, "small_n", 0)
    assert not ex.small_product(bf, 1)


@pytest.mark.parametrize("m", [1, 5, 8])
@pytest.mark.parametrize("n,k,tile", [(257, 2048, 128), (40, 5128, 64), (64, 2104, 32)])  # 16, 81 and 66 tile sums
@pytest.mark.parametrize("warps,pre", [(16, 4), (4, 2)])  # 4 warps: two rows of x a warp's denominators
def test_small_product_of_normed_rows(small_on, monkeypatch, m, n, k, tile, warps, pre):
    """`NormedRows` (a fused norm's rows, `mx_linear_add_norm`): the product over xg (bf16 bits, the producer's
    h (1 + w)) with each row divided by sqrt(its tile sums / K + eps), the denominators in the skinny kernels'
    order: within 1e-5 of the skinny GEMM's fused consumer, within 1e-4 of float64."""
    monkeypatch.setitem(ex.TUNE, "small_warps", warps)
    monkeypatch.setitem(ex.TUNE, "small_pre", pre)
    rng = np.random.default_rng(m * 100 + n + tile + warps)
    w = bf16_round(rng.standard_normal((n, k)) * 0.1)
    pw = ex.PackedWeight("bf16", (n, k), cp.asarray(bf16_encode(w)), persistent=True)
    h = (rng.standard_normal((m, k)) * 3).astype(np.float32)
    nw = (rng.standard_normal(k) * 0.2).astype(np.float32)
    xg = bf16_round(h * (np.float32(1.0) + nw)).astype(np.float32)
    tiles = -(-k // tile)
    sq = np.zeros((m, tiles), np.float32)
    for j in range(tiles):
        sq[:, j] = (h[:, tile * j:tile * (j + 1)].astype(np.float64) ** 2).sum(1)
    normed = ex.NormedRows(cp.asarray(h), cp.asarray(bf16_encode(xg)), cp.asarray(sq), cp.asarray(nw), 1e-6, 1.0)
    assert ex.small_product(pw, m) and ex.fuses_norms(pw, m)
    got = ex.mx_linear(normed, pw)
    denom = np.sqrt(sq.astype(np.float64).sum(1, keepdims=True) / k + 1e-6)
    assert rel_err(got, xg.astype(np.float64) @ w.astype(np.float64).T / denom) < 1e-4
    monkeypatch.setitem(ex.TUNE, "small_n", 0)
    assert rel_err(got, cp.asnumpy(ex.mx_linear(normed, pw))) < 1e-5
