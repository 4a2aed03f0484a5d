"""mx_gemv, act_quant, moe, sample, checksum and probe kernels against the numpy reference (GPU only).

Fresh random inputs at several sizes; outputs NaN-poisoned (`cupy_ops.POISON`) so unwritten elements fail.
Precision classes: dequantisation, activation quantisation, Philox and checksums bit-exact; skinny GEMMs
(bf16 x, exact weights, fp32 accumulation) within 1e-4 of max |ref| for float32 outputs and 1e-2 for bf16
outputs; sampled tokens identical to `sampling.sample` (a mismatch only passes when u * Z lies within
rounding distance of a CDF step, see decapybara/kernels/sample.cu).
"""

from __future__ import annotations

import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
from decapybara import kernels

if not kernels.has_cuda():
    pytest.skip("no CUDA device", allow_module_level=True)

from decapybara.backend import cupy_ops_extra as ex
from decapybara.backend.cupy_backend import CupyBackend
from decapybara.backend.gemv_plan import band_tiles, e2m1_split_words
from decapybara.backend.numpy_backend import NumpyBackend
from decapybara.engine import philox, sampling
from decapybara.model import quant
from decapybara.model.quant.elements import E4M3, bf16_decode, bf16_encode

pytestmark = pytest.mark.gpu
FORMATS = ("bf16", "mxfp8", "mxfp6", "mxfp4", "nvfp4")


def host(a):
    return cp.asnumpy(a) if isinstance(a, cp.ndarray) else np.asarray(a)


def assert_close(got, ref, rtol, name):
    """max |got - ref| <= rtol * max |ref|; NaN where the reference has none fails (unwritten output)."""
    got, ref = np.asarray(host(got), np.float64), np.asarray(ref, np.float64)
    assert got.shape == ref.shape, f"{name}: shape {got.shape}, reference {ref.shape}"
    bad = np.isnan(got) & ~np.isnan(ref)
    assert not bad.any(), f"{name}: {int(bad.sum())} NaN of {got.size}, first at {np.argwhere(bad)[0]}"
    scale = max(float(np.nanmax(np.abs(ref))) if ref.size else 0.0, 1e-30)
    err = np.where(np.isnan(ref), 0.0, np.abs(got - ref))
    rel = float(err.max()) / scale if err.size else 0.0
    if rel > rtol:
        i = tuple(int(j) for j in np.unravel_index(int(np.argmax(err)), err.shape))
        raise AssertionError(f"{name}: max rel err {rel:.3e} > {rtol:.1e} (max |ref| {scale:.3e}) at {i}: "
                             f"got {got[i]!r}, ref {ref[i]!r}; shape {got.shape}")


def assert_bytes_equal(got, ref, name):
    got, ref = host(got), host(ref)
    assert got.shape == ref.shape and got.dtype == ref.dtype, f"{name}: {got.dtype}{got.shape} vs {ref.dtype}{ref.shape}"
    if got.dtype.kind == "f":
        got, ref = got.view(f"u{got.dtype.itemsize}"), ref.view(f"u{ref.dtype.itemsize}")
    diff = np.argwhere(got != ref)
    if diff.size:
        i = tuple(int(j) for j in diff[0])
        raise AssertionError(f"{name}: {len(diff)} of {got.size} differ, first at {i}: got {got[i]!r}, ref {ref[i]!r}")


def random_weight(rng, fmt, shape):
    """(QuantTensor or bf16 bits, float64 dequantised reference): random codes over every code value and
    realistic block scales (NVFP4 includes subnormal E4M3 block scales), never a NaN code."""
    if fmt == "bf16":
        bits = bf16_encode(rng.standard_normal(shape).astype(np.float32) * 0.05)
        return bits, bf16_decode(bits).astype(np.float64)
    f = quant.get_format(fmt)
    codes = rng.integers(0, 256, f.code_shape(shape), dtype=np.uint8)
    if fmt == "mxfp8":
        codes[(codes & 0x7F) == 0x7F] &= 0xF7  # E4M3 NaN -> a finite code
    if fmt == "nvfp4":
        scales = rng.integers(1, 0x70, f.scale_shape(shape), dtype=np.uint8)
        ts = np.float32(rng.uniform(1e-4, 1e-2))
    else:
        scales = rng.integers(112, 132, f.scale_shape(shape), dtype=np.uint8)
        ts = None
    q = quant.QuantTensor(fmt, shape, codes, scales, ts)
    return q, quant.dequantize(q).astype(np.float64)


def bf16_round(x):
    return bf16_decode(bf16_encode(np.asarray(x, np.float32)))


# ---- mx_gemv ------------------------------------------------------------------------------------------------
_WEIGHTS: dict = {}


@pytest.mark.parametrize("m", [1, 5, 12, 16, 33, 64, 130])
@pytest.mark.parametrize("n,k", [(1000, 320), (4100, 1536), (130, 64), (1040, 768)])  # the last: band tiles
@pytest.mark.parametrize("fmt", FORMATS)
def test_mx_linear_matches_dequantised_product(fmt, n, k, m):
    rng = np.random.default_rng(zlib.crc32(f"{fmt}-{n}-{k}-{m}".encode()))
    if (fmt, n, k) not in _WEIGHTS:  # one random weight per (format, shape), fresh x per case
        wq, w_ref = random_weight(np.random.default_rng(zlib.crc32(f"{fmt}-{n}-{k}".encode())), fmt, (n, k))
        _WEIGHTS.clear()
        _WEIGHTS[(fmt, n, k)] = (ex.pack_weight(wq), w_ref)
    w, w_ref = _WEIGHTS[(fmt, n, k)]
    assert w.e2m1_split == (fmt in ex.E2M1_FMTS)  # MXFP4 / NVFP4: the split-field kernels (pack_weight's default)
    assert w.tiled == (fmt in ex.E2M1_FMTS and n % 16 == 0 and k % 256 == 0)  # band tiles where whole
    x = rng.standard_normal((m, k)).astype(np.float32)
    xb = bf16_round(x).astype(np.float64)
    ref = xb @ w_ref.T
    outs = []
    for x_dev, out_dtype, rtol in ((cp.asarray(x), cp.float32, 1e-4),
                                   (cp.asarray(bf16_encode(x)), cp.float32, 1e-4),
                                   (cp.asarray(x.astype(np.float16)), cp.uint16, 1e-2)):
        y = ex.mx_linear(x_dev, w, out_dtype=out_dtype)
        outs.append(y)
        got = bf16_decode(host(y)) if out_dtype == cp.uint16 else host(y)
        this_ref = (bf16_round(x.astype(np.float16)).astype(np.float64) @ w_ref.T
                    if x_dev.dtype == cp.float16 else ref)
        assert_close(got, this_ref, rtol, f"mx_linear {fmt} [{m}x{k}] @ [{n}x{k}]^T x={x_dev.dtype} y={out_dtype}")
    # the kernels round float32 x to bf16 as they stage it: bf16 rows of the same values give the same bytes
    assert_bytes_equal(outs[1], outs[0], f"mx_linear {fmt} [{m}x{k}]: bf16 x against float32 x")


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_row_slice_of_a_packed_weight_is_its_first_rows(fmt):
    """`row_slice` (the MTP head's draft vocabulary, QwenModel.draft_head): a packed weight's first 16 k rows over the
    same memory, in its layout (band tiles whole), whose products are the whole weight's first columns, at 1, 3, 12
    and 40 rows of x; the dequantised rows too."""

    class Packed(ex.PackedWeightsMixin, CupyBackend):
        pass

    rng = np.random.default_rng(zlib.crc32(f"slice-{fmt}".encode()))
    wq, w_ref = random_weight(rng, fmt, (1040, 768))
    backend = Packed("fp32")
    w = backend.prepare_weight("lm_head.weight", wq)
    if fmt == "bf16":
        w = cp.asarray(wq)
    part = backend.row_slice(w, 208)
    assert part.shape == (208, 768)
    if isinstance(w, ex.PackedWeight):
        assert (part.tiled, part.e2m1_split, part.fmt) == (w.tiled, w.e2m1_split, w.fmt)
        assert part.codes.shape == (208, w.codes.shape[1]) and part.persistent
        assert_bytes_equal(ex.mx_dequant(part), w_ref[:208].astype(np.float32), f"{fmt} sliced rows")
    for m in (1, 3, 12, 40):
        x = cp.asarray(rng.standard_normal((m, 768)).astype(np.float32))
        whole, got = host(backend.linear(x, w)), host(backend.linear(x, part))
        assert got.shape == (m, 208)
        assert_close(got, whole[:, :208], 1e-5, f"{fmt}: a slice's product at {m} rows")


def test_nvfp4_past_dense_rows_is_a_cublas_product_scaled_by_alpha(monkeypatch):
    """NVFP4 products of more than DENSE_ROWS rows: the codes times their E4M3 block scales (exact in bf16) in one
    cuBLAS GEMM whose alpha is the tensor scale; against numpy and the skinny kernels on the same rows."""
    rng = np.random.default_rng(41)
    wq, w_ref = random_weight(rng, "nvfp4", (1040, 768))
    w = ex.pack_weight(wq)
    assert w.tensor_scale != 1.0
    x = rng.standard_normal((130, 768)).astype(np.float32)
    alphas = []
    gemm = ex.gemm_bf16
    monkeypatch.setattr(ex, "gemm_bf16", lambda a, b, alpha=1.0: alphas.append(alpha) or gemm(a, b, alpha))
    got = host(ex.mx_linear(cp.asarray(x), w, out_dtype=cp.float32))
    assert alphas == [np.float32(w.tensor_scale)] or alphas == [w.tensor_scale], alphas
    assert_close(got, bf16_round(x).astype(np.float64) @ w_ref.T, 1e-4, "nvfp4 through cuBLAS")
    monkeypatch.setattr(ex, "DENSE_ROWS", 1000)  # the skinny kernels take the same rows
    skinny = host(ex.mx_linear(cp.asarray(x), w, out_dtype=cp.float32))
    assert len(alphas) == 1
    assert_close(got, skinny, 1e-5, "nvfp4: cuBLAS against the skinny kernels")


# launch / kernel knobs of mx_gemm; each case runs with `small_bytes` 0 (the default) unless it sets its own
TUNE_CASES = [
    ({"acc": 2}, (700, 1536)), ({"acc": 2, "policy": "balance"}, (700, 1536)), ({"ksplit": 3, "acc": 2}, (700, 1536)),
    ({"stages": 3, "acc": 2}, (700, 1536)), ({"stages": 4, "acc": 1}, (700, 1536)), ({"stages": 1}, (700, 1536)),
    ({"warps": 4, "acc": 2}, (700, 1536)), ({"policy": "wave", "acc": 1}, (4100, 5120)),
    # stream-K: tiles split over several blocks, blocks spanning tiles, uneven shares (U % blocks != 0)
    ({"policy": "stream", "acc": 2}, (700, 1536)), ({"policy": "stream", "min_chunks": 1}, (4100, 5120)),
    ({"policy": "stream", "acc": 2, "warps": 4}, (4100, 5120)), ({"policy": "stream", "min_chunks": 7}, (300, 5120)),
    ({"blocks_per_sm": 3, "stages": 1}, (4100, 5120)), ({"blocks_per_sm": 2, "stages": 2}, (4100, 5120)),
    ({"wide_blocks_per_sm": 3, "wide_stages": 1}, (4100, 5120)),
    ({"small_bytes": 1 << 40, "row1_warps": 0}, (700, 1536)),
    ({"small_bytes": 1 << 40, "small_stages": 3, "row1_warps": 0}, (4100, 5120)),
    # whole bands of whole chunks: MXFP4 / NVFP4 codes in band tiles (MX_TILED)
    ({"policy": "stream", "min_chunks": 1}, (4096, 5120)), ({"policy": "stream", "acc": 2, "warps": 4}, (4096, 5120)),
    ({"ksplit": 3, "acc": 2}, (704, 1536)), ({"small_bytes": 1 << 40, "row1_warps": 0}, (704, 1536)),
    ({"wide_blocks_per_sm": 3, "wide_stages": 1}, (4096, 5120)), ({"blocks_per_sm": 3, "stages": 1}, (704, 1536)),
    # the small build under 24 MB (the default until the `_1r` kernels)
    ({"small_bytes": 24_000_000, "row1_warps": 0}, (704, 1536)),
    # two-n-tile blocks of other widths than the one-n-tile ones (`wide_warps`): 8, 10 (MXFP4's and NVFP4's
    # default), 12 (MXFP8's), 16 and 4
    ({"wide_warps": 8}, (4096, 5120)), ({"wide_warps": 12, "policy": "stream", "min_chunks": 1}, (4100, 5120)),
    ({"wide_warps": 10, "policy": "stream", "min_chunks": 1}, (4100, 5120)), ({"wide_warps": 10}, (700, 17408)),
    ({"wide_warps": 16, "wide_blocks_per_sm": 2}, (700, 1536)), ({"wide_warps": 4, "ksplit": 3}, (704, 1536)),
    # the two-n-tile kernels' x staging rows (`wide_segk`): the nominal 1024 codes and the longest static row, 1408
    ({"wide_segk": 1024}, (4096, 5120)), ({"wide_segk": 1408, "policy": "stream", "min_chunks": 1}, (4100, 5120)),
    ({"wide_segk": 1408, "ksplit": 3}, (700, 17408)),
    # the kernels of 4 and 8 n-tiles (40 rows here): blocks of other widths (`many_warps`), longer x staging rows
    # in dynamic shared memory (`many_segk`), other register stage counts (`many_stages`)
    ({"many_warps": 12, "many_segk": 1024}, (4096, 5120)), ({"many_warps": 16, "many_stages": 1}, (700, 17408)),
    ({"many_warps": 12, "policy": "stream", "min_chunks": 1}, (4100, 5120)),
    ({"many_segk": 2048, "many_stages": 4, "ksplit": 3}, (704, 1536))]


@pytest.mark.parametrize("tune,shape", [({"small_bytes": 0, **t}, s) for t, s in TUNE_CASES])
@pytest.mark.parametrize("fmt", FORMATS)
def test_mx_linear_tuning_variants_compute_the_same_product(fmt, tune, shape, monkeypatch):
    """Every launch / kernel knob of mx_gemm (ex.TUNE) computes the product, split or not; MXFP4 / NVFP4
    matrices of whole bands and chunks in band tiles."""
    rng = np.random.default_rng(zlib.crc32(f"tune-{fmt}-{sorted(tune.items())}-{shape}".encode()))
    wq, w_ref = random_weight(rng, fmt, shape)
    w = ex.pack_weight(wq)
    assert w.tiled == (fmt in ex.E2M1_FMTS and shape[0] % 16 == 0 and shape[1] % 256 == 0)
    monkeypatch.setattr(ex, "TUNE", {**ex.TUNE, **tune})
    for m in (1, 12, 40):
        x = rng.standard_normal((m, shape[1])).astype(np.float32)
        got = host(ex.mx_linear(cp.asarray(x), w))
        assert_close(got, bf16_round(x).astype(np.float64) @ w_ref.T, 1e-4, f"mx_linear {fmt} {tune} M{m}")


def build_ahead(w, rows, tunes, swiglu):
    """Builds the skinny kernels that products of each of `rows` rows over `w` launch under each TUNE of `tunes`
    (and their SwiGLU launches where `swiglu`), side by side: the byte tests' variants are mostly kernel builds,
    one nvcc process each, which one at a time took minutes of a GPU call. TUNE is restored after. Returns each
    tune's set of kernels."""
    each, saved = [], ex.TUNE
    try:
        for tune in tunes:
            ex.TUNE = tune
            each.append(frozenset(ex.launch_kernel(w, m, swiglu=s) for m in rows for s in (False, True)[:1 + swiglu]))
    finally:
        ex.TUNE = saved
    modules = {(src, defines): (src, name, defines) for src, name, defines in sorted(set().union(*each))}
    device = cp.cuda.runtime.getDevice()

    def build(job):
        with cp.cuda.Device(device):  # a thread starts on device 0
            kernels.get_kernel(*job)

    with ThreadPoolExecutor(max_workers=min(8, len(modules) or 1)) as pool:  # the launches get the rest from these
        list(pool.map(build, modules.values()))
    return each


def check_same_bytes(tag, fmt, cases, rows, variants, monkeypatch, base=None):
    """mx_linear (and mx_swiglu where N % 16 == 0) over each (shape, TUNE overrides) of `cases` at each row count of
    `rows`: the same bytes under each TUNE override set of `variants` (over `base`, then the case's) as under the
    first, where the variants launch other kernels (else the comparison would hold whatever the kernels did);
    inputs seeded by `tag`."""
    rng, tune0 = np.random.default_rng(zlib.crc32(f"{tag}-{fmt}-{cases}".encode())), ex.TUNE
    for shape, tune in cases:
        wq, _ = random_weight(rng, fmt, shape)
        w = ex.pack_weight(wq)
        tunes = [{**tune0, **(base or {}), **tune, **v} for v in variants]  # each variant over the same base
        built = build_ahead(w, rows, tunes, shape[0] % 16 == 0)
        assert len(set(built)) > 1, f"{fmt} {shape} {tune}: every variant launches the same kernels"
        for m in rows:
            x = cp.asarray(rng.standard_normal((m, shape[1])).astype(np.float32))
            got, swi = [], []
            for v in tunes:
                monkeypatch.setattr(ex, "TUNE", v)
                got.append(host(ex.mx_linear(x, w)).view(np.uint32))
                if shape[0] % 16 == 0:
                    swi.append(host(ex.mx_swiglu(x, w)).view(np.uint32))
            for v, g in zip(variants[1:], got[1:]):
                assert np.array_equal(g, got[0]), f"{fmt} {shape} {tune} M{m}: {v} changed the product"
            for v, g in zip(variants[1:], swi[1:]):
                assert np.array_equal(g, swi[0]), f"{fmt} {shape} {tune} M{m}: {v} changed the SwiGLU bytes"


def check_early_refill(fmt, cases, rows, monkeypatch):
    """`check_same_bytes` with TUNE `early` 0 and 15 (every kernel kind), the small products and the one-row
    products' own build (`row1_warps`, which takes bit 1 whatever `early` says) off."""
    check_same_bytes("early", fmt, cases, rows, ({"early": 0}, {"early": 15}), monkeypatch,
                     base={"small_bytes": 0, "small_n": 0, "row1_warps": 0})


@pytest.mark.parametrize("fmt", FORMATS)
def test_early_refill_keeps_the_bytes(fmt, monkeypatch):
    """Each register stage's next chunk loaded inside the current chunk's MMAs (TUNE `early`, MX_EARLY) changes
    when the loads go out, not what is loaded or summed: the bytes of every kernel kind that takes it (one row,
    the one-n-tile kernels at 4 rows, the two-n-tile ones at 12 and 16, the wider ones at 40; plain and SwiGLU
    launches), as the plain loop gives them: tile grids, stream-K, several staging segments a block (K 17408
    unsplit), band tiles and row-major codes (N % 16 != 0), a stage count of two, K splits."""
    check_early_refill(fmt, (((4096, 5120), {}), ((4096, 5120), {"policy": "stream", "min_chunks": 1}),
                             ((192, 17408), {"ksplit": 1}), ((700, 1536), {"stages": 2, "wide_stages": 2}),
                             ((4096, 5120), {"ksplit": 3})), (1, 4, 12, 16, 40), monkeypatch)


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_early_refill_keeps_the_bytes_small(fmt, monkeypatch):
    """The same at sizes the host emulator runs in CI (tests/test_cuda_emu.py): one, four and twelve rows, a tile
    grid of band tiles with each block's whole K range (refills past the first stages) and stream-K blocks of at
    least four chunks."""
    check_early_refill(fmt, (((256, 2048), {"ksplit": 1}), ((256, 2048), {"policy": "stream", "min_chunks": 4})),
                       (1, 4, 12), monkeypatch)


ROW1_WIDTHS = ({"row1_warps": 0}, {"row1_warps": 10}, {"row1_warps": 12})


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_one_row_blocks_of_their_own_width_keep_the_bytes(fmt, monkeypatch):
    """The one-row products' own build (TUNE `row1_warps`: blocks of that many warps with the early refill, in
    place of `warps`' 8 without it) where every block sums a tile's whole K range (no split): the same bytes, plain
    and SwiGLU launches (`_1r` / `_1rs`), band tiles and row-major codes (N % 16 != 0), several staging segments a
    block (K 17408); a one-row launch takes that build, a two-row one does not (`row1_fill` 0: whatever its plan)."""
    w = ex.pack_weight(random_weight(np.random.default_rng(3), fmt, (704, 1536))[0])
    monkeypatch.setattr(ex, "TUNE", {**ex.TUNE, "row1_warps": 10, "row1_fill": 0})
    assert ex.launch_tune(w, 1)["warps"] == 10 and ex.launch_tune(w, 1)["early"] & 1
    assert ex.launch_tune(w, 2)["warps"] == ex.tune_for(fmt)["warps"]
    check_same_bytes("row1", fmt, (((4096, 5120), {"ksplit": 1}), ((700, 2048), {"ksplit": 1}),
                                   ((192, 17408), {"ksplit": 1})), (1,), ROW1_WIDTHS, monkeypatch,
                     base={"small_bytes": 0, "row1_fill": 0})


@pytest.mark.parametrize("fmt", ["mxfp4"])
def test_one_row_build_only_where_its_plan_fills_the_device(fmt, monkeypatch):
    """TUNE `row1_fill`: a one-row product takes its own build (`row1_warps`) where that build's plan is a tile
    grid of at least that fraction of the resident blocks, else the plain one; at 0 always. On a device of 2 SMs
    (two 10-warp blocks each: 4 slots), 640 rows (4 tiles of 160 columns, one K split: 4 of 4 slots) take it, 480
    (3 of 4: 0.75) and a stream-K plan do not; two rows never do."""
    monkeypatch.setattr(ex, "sm_count", lambda: 2)
    rng = np.random.default_rng(11)
    ws = {n: ex.pack_weight(random_weight(rng, fmt, (n, 1024))[0]) for n in (640, 480)}
    for n, fill, policy, own in ((640, 0.8, "auto", True), (480, 0.8, "auto", False), (480, 0.7, "auto", True),
                                 (640, 0.8, "stream", False), (640, 0, "stream", True), (480, 0, "auto", True)):
        monkeypatch.setattr(ex, "TUNE", {**ex.TUNE, "row1_warps": 10, "row1_fill": fill, "policy": policy,
                                         "min_chunks": 1, "small_bytes": 0, "early": 14, "auto_fill": 0.7})
        w, plain = ws[n], ex.tune_for(fmt)
        assert ex.plan_slots(ex.row1_tune(plain), 1) == 4 and ex.plan_slots(plain, 1) == 6
        tune = ex.launch_tune(w, 1)
        assert (tune["warps"], tune["early"]) == ((10, 15) if own else (8, 14)), (n, fill, policy)
        assert ex.launch_tune(w, 2)["warps"] == 8
        plan = ex.gemm_plan(w, 1)
        if own:  # the build's own plan: stream-K, or one K split and a block a tile of 160 columns
            assert plan.stream == (policy == "stream") and (plan.stream or plan.grid[:2] == (n // 160, 1)), plan


@pytest.mark.parametrize("fmt", ["mxfp4"])
def test_one_row_build_only_where_it_fills_no_less_than_the_plain_one(fmt, monkeypatch):
    """TUNE `row1_vs_plain`: past `row1_fill`, a one-row product takes its own build only where the plain build's
    plan (the build it takes otherwise: the small build under `small_bytes`) is stream-K or fills no more of its
    own slots. On a device of 5 SMs (10 slots of 10-warp blocks, 15 of 8-warp ones), K 2048: 640 rows fill 8 of 10
    (0.8) against the plain build's 15 of 15, so the plain one; 320 rows 0.8 against 0.8 and 800 rows 1.0 against
    0.93, their own; K 1024, 1280 rows 0.8 against stream-K, their own; 320 rows under the small build (two 8-warp
    blocks an SM: 10 slots) 0.8 against its 0.9, the small one. With `row1_vs_plain` 0, each its own."""
    monkeypatch.setattr(ex, "sm_count", lambda: 5)
    rng = np.random.default_rng(12)
    ws = {shape: ex.pack_weight(random_weight(rng, fmt, shape)[0])
          for shape in ((640, 2048), (320, 2048), (800, 2048), (1280, 1024))}
    for shape, small, fills, own in (((640, 2048), 0, (1.0, 0.8), False), ((320, 2048), 0, (0.8, 0.8), True),
                                     ((800, 2048), 0, (14 / 15, 1.0), True), ((1280, 1024), 0, (None, 0.8), True),
                                     ((320, 2048), 10**6, (0.9, 0.8), False)):
        w = ws[shape]
        for vs_plain in (1, 0):
            monkeypatch.setattr(ex, "TUNE", {**ex.TUNE, "row1_warps": 10, "row1_fill": 0.8, "row1_vs_plain": vs_plain,
                                             "policy": "auto", "min_chunks": 1, "small_bytes": small, "early": 14,
                                             "auto_fill": 0.7, "fill_chunks": 2, "ksplit": 0, "small_stages": 2,
                                             "small_blocks_per_sm": 2})
            tune = ex.tune_for(fmt)
            plain = ex.small_tune(tune) if small else tune
            got = (ex.plan_fill(w, plain), ex.plan_fill(w, ex.row1_tune(tune)))
            assert got == pytest.approx(fills) if fills[0] else (got[0] is None and got[1] == fills[1]), (shape, got)
            launched = ex.launch_tune(w, 1)
            if own or not vs_plain:
                assert (launched["warps"], launched["early"]) == (10, 15), (shape, small, vs_plain)
            else:
                assert (launched["warps"], launched["blocks_per_sm"]) == (8, 2 if small else 3), (shape, small)


@pytest.mark.parametrize("fmt", ["mxfp4"])
def test_one_row_blocks_of_their_own_width_keep_the_bytes_small(fmt, monkeypatch):
    """The same at sizes the host emulator runs in CI (tests/test_cuda_emu.py): band tiles, one block a tile's K."""
    check_same_bytes("row1", fmt, (((256, 2048), {"ksplit": 1}),), (1,), ROW1_WIDTHS[:2], monkeypatch,
                     base={"small_bytes": 0, "row1_fill": 0})


@pytest.mark.parametrize("fmt", FORMATS)
def test_wide_staging_rows_keep_the_bytes(fmt, monkeypatch):
    """The two-n-tile kernels' x staging row length (`wide_segk`, MX_SEGK2; in static shared memory or past it
    in dynamic) changes how often a block stages x, not what it sums: the same bytes at 9, 12 and 16 rows, tile
    grid and stream-K, and blocks whose K range takes several segments at every length (K = 17408 unsplit)."""
    rng = np.random.default_rng(zlib.crc32(f"segk-{fmt}".encode()))
    for shape, tune in (((4096, 5120), {}), ((4096, 5120), {"policy": "stream", "min_chunks": 1}),
                        ((192, 17408), {"ksplit": 1})):
        wq, _ = random_weight(rng, fmt, shape)
        w = ex.pack_weight(wq)
        for m in (9, 12, 16):
            x = cp.asarray(rng.standard_normal((m, shape[1])).astype(np.float32))
            got = []
            for segk in (1024, 1408, 2688):  # 2688: past static shared memory (dynamic)
                monkeypatch.setattr(ex, "TUNE", {**ex.TUNE, **tune, "wide_segk": segk})
                got.append(host(ex.mx_linear(x, w)).view(np.uint32))
            assert all(np.array_equal(g, got[0]) for g in got[1:]), f"{fmt} {tune} M{m}: wide_segk changed the bytes"


MANY_SAME_PLAN = ({"many_segk": 0, "many_stages": 0}, {"many_segk": 1024}, {"many_segk": 1024, "many_stages": 1},
                  {"many_segk": 1024, "many_stages": 4})


@pytest.mark.parametrize("fmt", FORMATS)
def test_many_row_kernels_keep_the_bytes(fmt, monkeypatch):
    """The kernels of 4 and 8 n-tiles (17-64 rows): their x staging row length (`many_segk`, MX_SEGK4; past the
    nominal 2048 / n-tiles in dynamic shared memory) and register stages (`many_stages`, MX_STAGES4) change how
    often a block stages x and when its loads go out, not what it sums: the same bytes at 17, 24, 32, 40 and 64
    rows, plain and SwiGLU launches, tile grids (several staging segments a block: K 17408 unsplit), stream-K
    and row-major codes (N % 16 != 0). Where every block sums a tile's whole K range (no split), their block
    width (`many_warps`) and rows past 1024 a segment (2048, one block an SM at 4 n-tiles) neither."""
    rows = (17, 24, 32, 40, 64)
    # stream-K plans by the blocks an SM, which the staging rows would change at 4 warps (shared memory): 16 warps
    check_same_bytes("many", fmt, (((4096, 5120), {"policy": "stream", "min_chunks": 1, "many_warps": 16}),
                                   ((704, 1536), {"ksplit": 3})), rows, MANY_SAME_PLAN, monkeypatch)
    check_same_bytes("many", fmt, (((192, 17408), {"ksplit": 1}), ((700, 2048), {"ksplit": 1})), rows,
                    MANY_SAME_PLAN + ({"many_warps": 12, "many_segk": 2048}, {"many_warps": 16, "many_segk": 1024},
                                      {"many_warps": 4}), monkeypatch)


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_many_row_kernels_keep_the_bytes_small(fmt, monkeypatch):
    """The same at sizes the host emulator runs in CI (tests/test_cuda_emu.py, MXFP4): 24 and 40 rows, a tile grid
    of band tiles with each block's whole K range, the default (16 warps, 1024-code rows in dynamic shared memory,
    one stage) against the kernels as they were (8 warps, the nominal rows, several segments a block, two stages)."""
    check_same_bytes("many", fmt, (((256, 2048), {"ksplit": 1}),), (24, 40),
                     ({}, {"many_warps": 8, "many_segk": 0, "many_stages": 0}), monkeypatch)


@pytest.mark.parametrize("limit_kb", [99, 48])
def test_many_row_staging_rows_fit_smaller_gpus(limit_kb, monkeypatch):
    """On a GPU of less shared memory a block (99 KB: below the data-centre parts; 48 KB: none opted in) the 4- and
    8-n-tile kernels' staging rows are fitted to it (`fit_many_segk`): shorter rows, or the nominal ones in static
    shared memory, whose launches fit, and the same bytes as the default's rows (MXFP4, 24 and 40 rows)."""
    rng = np.random.default_rng(limit_kb)
    wq, _ = random_weight(rng, "mxfp4", (4096, 5120))
    w = ex.pack_weight(wq)
    xs = {m: cp.asarray(rng.standard_normal((m, 5120)).astype(np.float32)) for m in (24, 40)}
    monkeypatch.setattr(ex, "TUNE", {**ex.TUNE, "ksplit": 1, "many_segk": 1024})
    want = {m: host(ex.mx_linear(x, w)).view(np.uint32) for m, x in xs.items()}
    monkeypatch.setattr(ex, "smem_per_block", lambda: limit_kb * 1024)
    for m, x in xs.items():
        nt = ex.n_tiles(m)
        tune = ex.launch_tune(w, m)
        assert ex.staging_bytes(tune, nt) + 4096 <= limit_kb * 1024, (limit_kb, m, tune["many_segk"])
        assert tune["many_segk"] == {(99, 4): 1024, (99, 8): 512, (48, 4): 0, (48, 8): 0}[limit_kb, nt]
        assert np.array_equal(host(ex.mx_linear(x, w)).view(np.uint32), want[m]), (limit_kb, m)


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4", "nvfp4"])
def test_split_sums_in_batches_keep_the_bytes(fmt, monkeypatch):
    """A split tile's last block loads its partial sums in batches (TUNE `part_batch`, decapybara/kernels/mx_gemv.cu
    `sum_parts`: the one-row kernels) and adds them in the same order: the same bytes as one at a time, with
    batches that do not divide the parts (11 K splits, batches of 3 and 8; stream-K), plain and SwiGLU
    epilogues (SwiGLU's two sums share a batch: 3 gives one part at a time there), tile grid and stream-K; the
    few- and twelve-row kernels (one at a time whatever the setting) alike."""
    rng = np.random.default_rng(zlib.crc32(f"parts-{fmt}".encode()))
    for shape, tune in (((704, 5632), {"ksplit": 11}), ((704, 1536), {"ksplit": 5}),
                        ((4096, 5120), {"policy": "stream", "min_chunks": 1})):
        wq, _ = random_weight(rng, fmt, shape)
        w = ex.pack_weight(wq)
        for m in (1, 5, 12):
            x = cp.asarray(rng.standard_normal((m, shape[1])).astype(np.float32))
            got = []
            for batch in (1, 3, 8):
                monkeypatch.setattr(ex, "TUNE", {**ex.TUNE, "small_bytes": 0, **tune, "part_batch": batch})
                got.append((host(ex.mx_linear(x, w)).view(np.uint32), host(ex.mx_swiglu(x, w)).view(np.uint32)))
            for g in got[1:]:
                for a, b, name in zip(g, got[0], ("mx_linear", "mx_swiglu"), strict=True):
                    assert np.array_equal(a, b), f"{name} {fmt} {shape} {tune} M{m}: part_batch changed the bytes"


@pytest.mark.parametrize("fmt", FORMATS)
def test_bf16_x_staging_edges(fmt):
    """bf16 x staged two groups a pass (d, d + 4) where K % 16 == 8 (the second group of the last pair lies
    past K: zeros), and bf16 x the 16-byte loads cannot take (rows one element off alignment): the bytes of
    the product over float32 x of the same values."""
    rng = np.random.default_rng(zlib.crc32(f"bf16-edges-{fmt}".encode()))
    for k in (264, 360):
        wq, _ = random_weight(rng, fmt, (300, k))
        w = ex.pack_weight(wq)
        for m, over in ((1, False), (1, True), (5, True), (12, True)):
            x = bf16_round(rng.standard_normal((m, k))).astype(np.float32)
            # zeros of both signs, bf16 subnormals (exact times 2^64; but for an NVRTC build, whose -ftz flushes
            # the float32 staging's subnormals where the bf16 staging's bf16x2 FMA keeps them) and, in the last
            # row, a value whose 2^64 multiple is past the range (infinity either way)
            x[:, :2] = [0.0, -0.0]
            if kernels.compiler() == "nvcc":
                x[:, 2:6] = [2.0**-130, -(2.0**-133), 2.0**-126, 2.0**-128 + 2.0**-131]
            if over:
                x[-1, 7] = 2.0**70
            ref = ex.mx_linear(cp.asarray(x), w, out_dtype=cp.float32)
            got = ex.mx_linear(cp.asarray(bf16_encode(x)), w, out_dtype=cp.float32)
            assert_bytes_equal(got, ref, f"{fmt} K={k} M{m} {over=} bf16 x")
            buf = cp.empty(m * k + 1, cp.uint16)
            xd = buf[1:].reshape(m, k)
            xd[...] = cp.asarray(bf16_encode(x))
            assert ex.dev_ptr(xd) % 16 != 0
            assert_bytes_equal(ex.mx_linear(xd, w, out_dtype=cp.float32), ref, f"{fmt} K={k} M{m} {over=} unaligned bf16 x")


@pytest.mark.parametrize("fmt", FORMATS)
def test_mx_linear_k_tail(fmt):
    """K = 352 leaves a partial last chunk in every format, bf16's (64-code chunks) included: the kernel's
    bounds-checked loads (x pre-rounded to bf16, so a dense fallback layout compares exactly too)."""
    rng = np.random.default_rng(zlib.crc32(f"tail-{fmt}".encode()))
    wq, w_ref = random_weight(rng, fmt, (300, 352))
    w = ex.pack_weight(wq)
    for m in (1, 12):
        x = bf16_round(rng.standard_normal((m, 352))).astype(np.float32)
        got = host(ex.mx_linear(cp.asarray(x), w))
        assert_close(got, x.astype(np.float64) @ w_ref.T, 1e-4, f"mx_linear {fmt} K tail M{m}")


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4"])  # the formats whose kernels take K % 8 != 0
def test_mx_linear_float32_x_off_the_vector_loads(fmt):
    """float32 x that the staging's 16-byte loads cannot take, so each element is loaded on its own: K % 8 != 0
    (K = 100: a partial last group) and rows that do not start 16-byte aligned (a contiguous view one float
    into its buffer)."""
    rng = np.random.default_rng(zlib.crc32(f"f32-scalar-{fmt}".encode()))
    for k, offset in ((100, 0), (1536, 1)):
        wq, w_ref = random_weight(rng, fmt, (300, k))
        w = ex.pack_weight(wq)
        assert ex.gemm_ready(w), f"{fmt} K={k}: not on the skinny kernel"
        for m in (1, 12):
            x = bf16_round(rng.standard_normal((m, k))).astype(np.float32)
            buf = cp.empty(m * k + offset, cp.float32)
            xd = buf[offset:].reshape(m, k)
            xd[...] = cp.asarray(x)
            assert xd.flags.c_contiguous and (ex.dev_ptr(xd) % 16 != 0) == bool(offset)
            got = host(ex.mx_linear(xd, w))
            assert_close(got, x.astype(np.float64) @ w_ref.T, 1e-4, f"mx_linear {fmt} K={k} offset={offset} M{m}")


@pytest.mark.parametrize("n", [1, 7, 16, 17])
@pytest.mark.parametrize("fmt", FORMATS)
def test_mx_linear_few_rows_over_whole_chunks(fmt, n, monkeypatch):
    """N < 16 and partial warps with K = 1536 (whole chunks in every format: the loop walks row pointers, rows
    past N read row N - 1 and must never be stored, neither to y nor to the partial sums): the default plan
    (stream-K over a single tile), a tile grid split three ways, and one chunk per stream-K block."""
    rng = np.random.default_rng(zlib.crc32(f"few-rows-{fmt}-{n}".encode()))
    wq, w_ref = random_weight(rng, fmt, (n, 1536))
    w = ex.pack_weight(wq)
    for tune in ({}, {"ksplit": 3}, {"policy": "stream", "min_chunks": 1}):
        monkeypatch.setattr(ex, "TUNE", {**ex.TUNE, **tune})
        for m in (1, 12):
            x = bf16_round(rng.standard_normal((m, 1536))).astype(np.float32)
            got = host(ex.mx_linear(cp.asarray(x), w))
            assert_close(got, x.astype(np.float64) @ w_ref.T, 1e-4, f"mx_linear {fmt} N={n} {tune} M{m}")


def test_mx_linear_bias_and_fallback_layout():
    rng = np.random.default_rng(7)
    q, w_ref = random_weight(rng, "mxfp6", (70, 96))  # Kp = 96: rows not 16-byte aligned -> dense fallback
    x = bf16_round(rng.standard_normal((3, 96)))
    bias = rng.standard_normal(70).astype(np.float32)
    got = ex.mx_linear(cp.asarray(x), ex.pack_weight(q), cp.asarray(bias))
    assert_close(got, x.astype(np.float64) @ w_ref.T + bias, 1e-5, "mxfp6 fallback with bias")
    q4, w4 = random_weight(rng, "mxfp4", (300, 256))
    x4 = bf16_round(rng.standard_normal((3, 256)))
    bias4 = rng.standard_normal(300).astype(np.float32)
    got = ex.mx_linear(cp.asarray(x4), ex.pack_weight(q4), cp.asarray(bias4))
    assert_close(got, x4.astype(np.float64) @ w4.T + bias4, 1e-4, "mxfp4 kernel with bias")


@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_e2m1_code_layouts_compute_the_same_products(fmt, split, tiled):
    """MXFP4 / NVFP4 weights packed with plain nibble codes (MX_E2M1 = 0) or split-field codes (MX_E2M1 = 1),
    row-major or in band tiles (MX_TILED): the device bytes, the skinny kernels (one to eight n-tiles, more
    M-tiles; MXFP4 past DENSE_ROWS: the dequantised cuBLAS path), dequantisation of all rows and embedding rows,
    and fused stacks of one layout."""
    rng = np.random.default_rng(zlib.crc32(f"layout-{fmt}-{split}-{tiled}".encode()))
    n, k = 704, 1536  # 44 bands of 16 rows, 6 chunks of 256 codes
    wq, w_ref = random_weight(rng, fmt, (n, k))
    w = ex.pack_weight(wq, e2m1_split=split, tiled=tiled)
    assert (w.e2m1_split, w.tiled) == (split, tiled)
    want = e2m1_split_words(wq.codes) if split else wq.codes
    assert_bytes_equal(w.codes, band_tiles(want) if tiled else want, f"{fmt} split={split} tiled={tiled} codes")
    assert_bytes_equal(w.scales, band_tiles(wq.scales, ex.scale_piece(fmt)) if tiled else wq.scales, f"{fmt} scales")
    for m in (1, 12, 40, 130):
        x = bf16_round(rng.standard_normal((m, k))).astype(np.float32)
        got = ex.mx_linear(cp.asarray(x), w)
        assert_close(got, x.astype(np.float64) @ w_ref.T, 1e-4, f"mx_linear {fmt} split={split} tiled={tiled} M{m}")
    assert_bytes_equal(ex.mx_dequant(w), w_ref.astype(np.float32), f"{fmt} split={split} tiled={tiled} all rows")
    rows = rng.integers(0, n, 19).astype(np.int64)
    assert_bytes_equal(ex.embedding_rows(w, cp.asarray(rows)), w_ref[rows].astype(np.float32),
                       f"{fmt} split={split} tiled={tiled} rows")
    backend = CupyBackend("fp32")
    for other in (ex.pack_weight(wq, e2m1_split=not split, tiled=tiled),
                  ex.pack_weight(wq, e2m1_split=split, tiled=not tiled)):
        assert backend.concat_rows([w, other]) is None  # codes of two layouts cannot share one launch
    fused, (a, b) = backend.concat_rows([w, w])
    assert fused.e2m1_split == a.e2m1_split == b.e2m1_split == split and fused.tiled == a.tiled == b.tiled == tiled
    x = bf16_round(rng.standard_normal((3, k))).astype(np.float32)
    ref = x.astype(np.float64) @ w_ref.T
    assert_close(ex.mx_linear(cp.asarray(x), fused), np.concatenate([ref, ref], 1), 1e-4, f"{fmt} fused")
    assert_close(ex.mx_linear(cp.asarray(x), b), ref, 1e-4, f"{fmt} second view of the stack")


@pytest.mark.parametrize("split,tiled", [(True, True), (False, True), (True, False), (False, False)],
                         ids=["split-tiled", "plain-tiled", "split-rows", "plain-rows"])
@pytest.mark.parametrize("shape,tune", [((704, 1536), {}), ((4096, 5120), {"policy": "stream", "min_chunks": 1}),
                                        ((704, 1536), {"ksplit": 3}), ((300, 352), {}),
                                        ((704, 1536), {"small_bytes": 1 << 40}), ((64, 17408), {"ksplit": 1})],
                         ids=["grid", "stream", "ksplit", "tail", "small", "segments"])
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_one_row_block_sums(fmt, shape, tune, split, tiled, monkeypatch):
    """One-row MXFP4 / NVFP4 products on the `_1r` kernels (decapybara/kernels/mx_gemv.cu: codes unscaled into the MMA,
    one column per block, block scales on float32 sums; the launch checked by kernel name). Every output
    against the reference within 1e-5 of its row's sum of |terms|: rows whose blocks all take one scale from
    the whole range (MXFP4: the E8M0 codes the kernels take, 0 to 192, row values from ~2^-127 to 2^65; NVFP4:
    E4M3 from the smallest subnormal to 448, with a tensor scale), rows of mixed scales (their small blocks below
    the bound; NVFP4 of either sign), the rest calm but for one block of scale 2^-127 / zero; +-0.5 codes (bf16
    subnormals) throughout; NaN where a block's scale is NaN (NVFP4: in either set of sums) and nowhere else. Against the `_1` kernels (row1 off) where their bf16 scaled codes are exact (MXFP4: every
    scale of the row >= 70; NVFP4: all). Whole and partial chunks, tile grids, K splits, stream-K, the small
    build, a block's K range over two x staging segments (K = 17408), both code layouts."""
    n, k = shape
    rng = np.random.default_rng(zlib.crc32(f"row1-{fmt}-{shape}-{sorted(tune.items())}-{split}-{tiled}".encode()))
    f = quant.get_format(fmt)
    codes = rng.integers(0, 256, f.code_shape(shape), dtype=np.uint8)
    if fmt == "mxfp4":  # E8M0
        scales = rng.integers(118, 137, f.scale_shape(shape), dtype=np.uint8)
        scales[:8] = np.array([0, 1, 40, 64, 100, 127, 160, 192], np.uint8)[:, None]  # one scale a row
        scales[8, 1] = 255  # row 8: NaN
        scales[9:17] = rng.integers(0, 193, scales[9:17].shape, dtype=np.uint8)  # mixed
        ts = None
    else:  # E4M3 (0x7F / 0xFF NaN), and a float32 tensor scale
        scales = rng.integers(0x30, 0x41, f.scale_shape(shape), dtype=np.uint8)
        scales[:8] = np.array([0x01, 0x05, 0x08, 0x20, 0x38, 0x50, 0x70, 0x7E], np.uint8)[:, None]
        scales[:8:2] |= 0x80  # negative scales too
        scales[8, 1], scales[8, 6] = 0x7F, 0xFF  # NaN in the first set of sums (block 1: lane 0, 4t + 1) and the second (block 6: lane 1, 4t + 2)
        scales[9:17] = rng.integers(1, 0x7F, scales[9:17].shape, dtype=np.uint8)
        scales[9:17] |= (rng.integers(0, 2, scales[9:17].shape) << 7).astype(np.uint8)
        ts = np.float32(rng.uniform(1e-4, 1e-2))
    scales[20, 3] = 0  # a block of scale 2^-127 (MXFP4) or zero (NVFP4) among calm ones
    q = quant.QuantTensor(fmt, shape, codes, scales, ts)
    w_ref = np.nan_to_num(quant.dequantize(q).astype(np.float64), nan=0.0)
    w = ex.pack_weight(q, e2m1_split=split, tiled=tiled and n % 16 == 0 and k % 256 == 0)
    monkeypatch.setattr(ex, "TUNE", {**ex.TUNE, "small_bytes": 0, **tune})
    launched = []
    real = ex.get_kernel
    monkeypatch.setattr(ex, "get_kernel", lambda src, name, *a: launched.append(name) or real(src, name, *a))
    x = bf16_round(rng.standard_normal((1, k)) * 0.5).astype(np.float32)
    xd = x.astype(np.float64)
    ref, bound = (xd @ w_ref.T)[0], (np.abs(xd) @ np.abs(w_ref).T)[0]
    got = host(ex.mx_linear(cp.asarray(x), w))[0]
    assert launched[-1] == f"mx_gemm_{fmt}_1r", launched
    assert np.isnan(got[8]) and not np.isnan(np.delete(got, 8)).any(), "NaN exactly where a scale is NaN"

    def check_rows(out, rows, name):
        err = np.abs(out[rows].astype(np.float64) - ref[rows])
        bad = np.flatnonzero(err > 1e-5 * bound[rows])
        assert not bad.size, (f"{name} {fmt} {shape} {tune}: {bad.size} rows off, first {rows[bad[0]]}: got "
                              f"{out[rows[bad[0]]]!r}, ref {ref[rows[bad[0]]]!r}, bound {bound[rows[bad[0]]]:.3e}")

    check_rows(got, np.delete(np.arange(n), 8), "row1")
    monkeypatch.setattr(ex, "TUNE", {**ex.TUNE, "row1": 0})
    plain = host(ex.mx_linear(cp.asarray(x), w))[0]
    assert launched[-1] == f"mx_gemm_{fmt}_1", launched
    exact = np.delete(np.arange(n), 8)  # NVFP4: every row but the NaN one
    if fmt == "mxfp4":
        exact = np.flatnonzero((scales.min(axis=1) >= 70) & (scales.max(axis=1) <= 192))  # not row 8 (NaN)
    check_rows(plain, exact, "the _1 kernels")
    err = np.abs(got[exact].astype(np.float64) - plain[exact])
    assert (err <= 2e-5 * bound[exact]).all(), f"row1 against the _1 kernels {fmt} {shape} {tune}"


@pytest.mark.parametrize("split", [False, True])
def test_repack_codes_in_slices_keeps_every_experts_bands(split, monkeypatch):
    """pack_weight's repack of a stacked [E, N, K] tensor in slices of a few bands (SPLIT_SLICE shrunk so that
    slices cut through the stack): the bytes of E2M1 codes split and / or tiled matrix by matrix, the scales
    tiled, and the dequantised rows of every expert."""
    monkeypatch.setattr(ex, "SPLIT_SLICE", 48 * 128)  # 48 rows of 128 code bytes: slices end mid-expert
    rng = np.random.default_rng(7 + split)
    q = quant.quantize(rng.standard_normal((3, 32, 256)).astype(np.float32), "mxfp4")
    w = ex.pack_weight(q, e2m1_split=split)
    assert w.tiled and w.e2m1_split == split
    for e in range(3):
        want = e2m1_split_words(q.codes[e]) if split else q.codes[e]
        assert_bytes_equal(w.codes[e], band_tiles(want), f"expert {e} codes")
        assert_bytes_equal(w.scales[e], band_tiles(q.scales[e], ex.scale_piece("mxfp4")), f"expert {e} scales")


@pytest.mark.parametrize("shape", [(700, 1536), (704, 1440), (704, 1520), (16, 256)])
def test_band_tiles_only_where_whole_tiles_cover_the_matrix(shape):
    """pack_weight tiles E2M1 codes (TUNE's default) only where N % 16 == 0 and whole 256-code chunks cover the
    padded K (Kp, a multiple of 32: K = 1520 has Kp = 1536, tiled with a K tail); other weights stay row-major
    and compute the same product."""
    rng = np.random.default_rng(zlib.crc32(f"band-{shape}".encode()))
    wq, w_ref = random_weight(rng, "mxfp4", shape)
    w = ex.pack_weight(wq)
    assert w.tiled == (shape[0] % 16 == 0 and -(-shape[1] // 32) * 32 % 256 == 0)
    x = bf16_round(rng.standard_normal((5, shape[1]))).astype(np.float32)
    assert_close(ex.mx_linear(cp.asarray(x), w), x.astype(np.float64) @ w_ref.T, 1e-4, f"mxfp4 {shape}")
    assert not ex.pack_weight(random_weight(rng, "mxfp8", (64, 512))[0]).tiled  # E2M1 formats only


@pytest.mark.parametrize("fmt", FORMATS)
def test_mx_dequant_rows_is_exact(fmt):
    rng = np.random.default_rng(len(fmt))
    q, ref = random_weight(rng, fmt, (257, 160 if fmt != "mxfp6" else 192))
    w = ex.pack_weight(q)
    assert_bytes_equal(ex.mx_dequant(w), ref.astype(np.float32), f"{fmt} dequantise all rows")
    rows = rng.integers(0, 257, 19).astype(np.int64)
    assert_bytes_equal(ex.embedding_rows(w, cp.asarray(rows)), ref[rows].astype(np.float32), f"{fmt} rows")


def special_scales(rng, q, ts=None):
    """q with some block scales replaced by the edge cases of the dequantisers: E8M0 0 (2^-127), 1, the bounds
    2 and 252 of mx_dequant_bf16's MXFP4 bf16x2 path and 253 / 254 past them (overflow), 255 (NaN); NVFP4's
    E4M3 +-0, +-the smallest and largest subnormals, +-the smallest normal, +-448 and NaN (0x7F / 0xFF), each of
    those blocks holding all 16 E2M1 codes (+-0 included), the other scales of random sign, and tensor scale
    `ts` (None: q's). MXFP8 also gets E4M3 NaN codes."""
    scales, codes = q.scales.copy(), q.codes.copy()
    if q.fmt == "nvfp4":
        scales |= (rng.integers(0, 2, scales.shape) << 7).astype(np.uint8)
        special = [0x00, 0x80, 0x01, 0x81, 0x07, 0x87, 0x08, 0x88, 0x7E, 0xFE, 0x7F, 0xFF]
    else:
        special = [0, 1, 2, 252, 253, 254, 255]
    flat, count = scales.reshape(-1), min(scales.size // 2, 2 * len(special))
    at = rng.choice(flat.size, count, replace=False)
    flat[at] = np.resize(special, count)
    if q.fmt == "nvfp4":  # block b of row r: code bytes 8b .. 8b + 7, two nibbles each (low first)
        for r, b in zip(*np.divmod(at, scales.shape[-1])):
            c = rng.permutation(16).astype(np.uint8)
            codes[r, 8 * b:8 * b + 8] = c[0::2] | (c[1::2] << 4)
    if q.fmt == "mxfp8":
        codes.reshape(-1)[rng.choice(codes.size, 5, replace=False)] = [0x7F, 0xFF, 0x7F, 0xFF, 0x7F]
    return quant.QuantTensor(q.fmt, q.shape, codes, scales, q.tensor_scale if ts is None else ts)


def bf16_reference(q):
    """docs/quant.md's values of q as bf16 bits (round to nearest even), where they are NaN, and the elements
    not to compare bit for bit: the NaNs and, where the kernels may flush float32 subnormals to zero (NVRTC's
    -ftz), the subnormals."""
    with np.errstate(over="ignore"):  # E8M0 253 / 254 times the largest codes: infinity, as in the kernels
        ref = quant.dequantize(q).astype(np.float32)
    nan = np.isnan(ref)
    skip = nan.copy()
    if kernels.compiler() == "nvrtc":
        skip |= (np.abs(ref) < np.float32(2.0**-126)) & (ref != 0)
    return bf16_encode(ref), nan, skip


# (format, split, tiled, shape, tensor scale): every format and E2M1 layout; band tiles where N % 16 == 0 and
# whole 256-code chunks cover K; NVFP4 with a random tensor scale (None: random_weight's) and with 1 (its bf16x2
# path)
DQ_CASES = [(fmt, split, tiled, shape, ts)
            for fmt, split in (("mxfp8", False), ("mxfp6", False), ("mxfp4", False), ("mxfp4", True),
                               ("nvfp4", False), ("nvfp4", True))
            for tiled in ((False, True) if fmt in ex.E2M1_FMTS else (False,))
            for shape in ([(48, 512), (16, 256)] if tiled else [(1, 32), (7, 96), (33, 256), (48, 512)])
            for ts in ((None, 1.0) if fmt == "nvfp4" else (None,))]


@pytest.mark.parametrize("fmt,split,tiled,shape,ts", DQ_CASES)
def test_mx_dequant_bf16_matches_dequant_rows(fmt, split, tiled, shape, ts):
    """All rows as bf16 (the large-M path of mx_linear) by mx_dequant_bf16: bit for bit mx_dequant_rows' bf16
    output (the old kernel, launched directly) and the numpy reference rounded to bf16, in every format and
    E2M1 layout (band tiles where the shape allows: N % 16 == 0 and whole 256-code chunks), odd row counts,
    rows of 4 to 64 octets (a thread's octets, 256 apart, lie in different rows) and several thread blocks, with
    zero, NaN and out-of-range block scales (NVFP4: also negative and subnormal ones, under tensor scale 1, the
    bf16x2 path, and another). Both outputs start poisoned (all-ones bits), so unwritten elements fail."""
    seed = f"dq-bf16-{fmt}-{split}-{tiled}-{shape}" + ("-ts1" if ts else "")
    rng = np.random.default_rng(zlib.crc32(seed.encode()))
    q = special_scales(rng, random_weight(rng, fmt, shape)[0], ts)
    w = ex.pack_weight(q, e2m1_split=split, tiled=tiled)
    assert (w.e2m1_split, w.tiled) == (split, tiled) and ex.dequant_bf16_ok(w)
    name = f"{fmt} split={split} tiled={tiled} {shape} ts={w.tensor_scale}"
    new, old = ex.empty(shape, np.uint16), ex.empty(shape, np.uint16)
    ex.dequant_bf16(w, new)
    ex.dequant_rows(w, None, old)
    assert_bytes_equal(new, old, f"{name}: mx_dequant_bf16 against mx_dequant_rows")
    ref, nan, skip = bf16_reference(q)
    got = host(new)
    assert ((got[nan] & 0x7FFF) > 0x7F80).all(), f"{name}: NaN elements"
    assert (got != 0xFFFF).all(), f"{name}: unwritten (poisoned) elements"
    assert_bytes_equal(np.where(skip, 0, got), np.where(skip, 0, ref), f"{name}: against the numpy reference")
    assert_bytes_equal(ex.mx_dequant(w, out_dtype=cp.uint16), new, f"{name}: mx_dequant's bf16 path")


@pytest.mark.parametrize("fmt,shape", [("mxfp4", (5, 48)), ("nvfp4", (3, 40)), ("mxfp8", (4, 100)),
                                       ("mxfp6", (6, 70))])
def test_mx_dequant_bf16_falls_back_where_k_is_not_whole_blocks(fmt, shape):
    """K not a multiple of the block (padding codes): mx_dequant leaves bf16 output to mx_dequant_rows, the
    same bits as the reference."""
    rng = np.random.default_rng(zlib.crc32(f"dq-bf16-tail-{fmt}-{shape}".encode()))
    q = random_weight(rng, fmt, shape)[0]
    w = ex.pack_weight(q)
    assert not ex.dequant_bf16_ok(w)
    ref, nan, _ = bf16_reference(q)
    assert not nan.any()
    assert_bytes_equal(ex.mx_dequant(w, out_dtype=cp.uint16), ref, f"{fmt} {shape} bf16 through mx_dequant_rows")


# ---- activation quantiser ------------------------------------------------------------------------------------
@pytest.mark.parametrize("soft", [False, True], ids=["hw", "soft"])
@pytest.mark.parametrize("k", [32, 100, 5120])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_act_quant_bytes_equal_reference(k, dtype, soft):
    """The hardware E4M3 conversion and the software rounding (devices before sm_89) give the reference's
    bytes."""
    rng = np.random.default_rng(k)
    rows = 9
    x = (rng.standard_normal((rows, k)) * rng.choice([1e-3, 1.0, 300.0], (rows, 1))).astype(np.float32)
    x[1] = 0.0
    x[2, :5] = [1e-40, -1e-42, 0.0, -0.0, 3e-39]  # subnormals
    x[3, 7] = np.nan
    x[4, 0] = -np.inf
    x[5] *= 1e30  # huge but finite
    x[6, 1::2] = -x[6, ::2][: x[6, 1::2].size]  # exact ties of magnitude
    x[7] = np.where(rng.random(k) < 0.5, 448.0 * 2.0 ** rng.integers(-20, 20, k), 464.0)  # rounding at the top
    if dtype == "bf16":
        bits = bf16_encode(x)
        xin, xref = cp.asarray(bits), bf16_decode(bits)
    else:
        xin, xref = cp.asarray(x), x
    codes, scales = ex.act_quant_mxfp8(xin, soft=soft)
    q = quant.quantize(xref, "mxfp8")
    assert_bytes_equal(scales, q.scales, f"act_quant scales k={k} {dtype}")
    assert_bytes_equal(codes, q.codes, f"act_quant codes k={k} {dtype}")


@pytest.mark.parametrize("soft", [False, True], ids=["hw", "soft"])
def test_act_quant_rounds_every_e4m3_midpoint_to_even(soft):
    """Every value halfway between two neighbouring E4M3 magnitudes (and the float32 values either side of it),
    both signs, in blocks whose largest element (256) leaves them unscaled: the kernel's rounding, hardware or
    software, gives the reference's bytes, ties to the even code."""
    mids = E4M3.mids
    vals = np.concatenate([mids, np.nextafter(mids.astype(np.float32), np.float32(0)),
                           np.nextafter(mids.astype(np.float32), np.float32(np.inf)), [450.0, 463.9, 464.0, 500.0]])
    vals = np.concatenate([vals, -vals]).astype(np.float32)
    per = 31  # a block: 256 (its scale then leaves every element as it is) and 31 values
    blocks = -(-vals.size // per)
    x = np.zeros((blocks, 32), np.float32)
    x[:, 0] = 256.0
    x[:, 1:].flat[:vals.size] = vals
    x = x.reshape(1, -1)
    codes, scales = ex.act_quant_mxfp8(cp.asarray(x), soft=soft)
    q = quant.quantize(x, "mxfp8")
    assert (q.scales == 127).all()
    assert_bytes_equal(scales, q.scales, "act_quant midpoint scales")
    assert_bytes_equal(codes, q.codes, "act_quant midpoint codes")


# ---- MoE -----------------------------------------------------------------------------------------------------
def random_experts(rng, e, h, inter, experts, packed=False):
    """(device stacks, reference float32 stacks) of e experts' gate, up [e, inter, h] and down [e, h, inter]
    (std 0.05): bf16 values (device: float32 arrays, or bf16 PackedWeights where `packed`), or MXFP4 ("mxfp4": the
    codes in split fields, "mxfp4-plain": plain nibbles)."""
    weights, refs = [], []
    for shape in ((e, inter, h), (e, inter, h), (e, h, inter)):
        if experts == "bf16":
            wv = bf16_round(rng.standard_normal(shape) * 0.05).astype(np.float32)
            weights.append(ex.PackedWeight("bf16", shape, cp.asarray(bf16_encode(wv)), persistent=True) if packed
                           else cp.asarray(wv))
            refs.append(wv)
        else:
            q = quant.quantize(rng.standard_normal(shape).astype(np.float32) * 0.05, "mxfp4")
            weights.append(ex.pack_weight(q, e2m1_split=experts == "mxfp4"))
            refs.append(q.dequantize())
    return weights, refs


@pytest.mark.parametrize("t", [1, 3, 12, 37])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("experts", ["bf16", "mxfp4", "mxfp4-plain"])  # MXFP4 codes split (default) or plain
# 256 / 512: whole chunks (grouped scale loads); 256 / 200: gate / up over whole chunks with rows past N; 1024 /
# 256: gate / up of 4 chunks, split over K where few groups leave the device's blocks idle
@pytest.mark.parametrize("h,inter", [(128, 192), (256, 512), (256, 200), (1024, 256)])
def test_moe_matches_numpy_backend(t, normalize, experts, h, inter):
    rng = np.random.default_rng(t * 10 + normalize + h)
    e, k = 16, 4
    x = bf16_round(rng.standard_normal((t, h))).astype(np.float32)
    router = rng.standard_normal((e, h)).astype(np.float32) * 0.3
    weights, refs = random_experts(rng, e, h, inter, experts)
    for w in weights if experts != "bf16" else ():  # experts in band tiles
        assert w.tiled == (w.shape[1] % 16 == 0 and w.shape[2] % 256 == 0)
    ref = NumpyBackend().moe(x, router, *refs, k, normalize)
    got = ex.moe(cp.asarray(x), cp.asarray(router), *weights, k, normalize)
    assert_close(got, ref, 2e-2, f"moe t={t} normalize={normalize} experts={experts}")


@pytest.mark.parametrize("t", [1, 12, 37, 70])  # 70: past SWIGLU_ROWS, two grouped products over the views
@pytest.mark.parametrize("experts", ["bf16", "mxfp4"])  # mxfp4: band tiles, split codes
@pytest.mark.parametrize("h,inter", [(256, 512), (1024, 256)])  # 1024 / 256: split over K
def test_moe_gate_up_in_one_launch_matches_numpy_backend(t, experts, h, inter):
    """The experts' gate and up stacks stacked as the model stacks them (`CupyBackend.fuse_moe`: [E, 2 I, H], the
    parts' strided row views): one grouped SwiGLU launch (`FusedMoE.gate_up`) against the numpy
    reference, and against the same `moe` over the views (two grouped products and the activation: the views
    are kernel operands as they are)."""
    rng = np.random.default_rng(7 * t + h)
    e, k = 16, 4
    x = bf16_round(rng.standard_normal((t, h))).astype(np.float32)
    router = rng.standard_normal((e, h)).astype(np.float32) * 0.3
    dev, refs = random_experts(rng, e, h, inter, experts, packed=True)
    got = CupyBackend("bf16").fuse_moe({"router": cp.asarray(router), "gate": dev[0], "up": dev[1], "down": dev[2]})
    assert got is not None and not got[0].shared_slot and got[0].down is None and set(got[1]) == {"gate", "up"}
    gate_up, gate_v, up_v = got[0].gate_up, got[1]["gate"], got[1]["up"]
    assert gate_up.shape == (e, 2 * inter, h) and gate_up.tiled == dev[0].tiled
    assert not gate_v.codes.flags.c_contiguous and ex.gemm_ready(gate_v) and ex.gemm_ready(up_v)
    assert ex.fuses_grouped_swiglu(gate_up, t) == (t <= ex.SWIGLU_ROWS)
    ref = NumpyBackend().moe(x, router, *refs, k, True)
    fused = ex.moe(cp.asarray(x), cp.asarray(router), gate_v, up_v, dev[2], k, True, fused=ex.FusedMoE(gate_up=gate_up))
    assert_close(fused, ref, 2e-2, f"moe gate|up t={t} {experts} {h}x{inter}")
    views = ex.moe(cp.asarray(x), cp.asarray(router), gate_v, up_v, dev[2], k, True)
    assert_close(views, ref, 2e-2, f"moe over views t={t} {experts} {h}x{inter}")
    assert_close(fused, cp.asnumpy(views), 5e-3, f"one launch vs two t={t} {experts} {h}x{inter}")


@pytest.mark.parametrize("t", [5, 12, 16])  # 12: groups of 1-12 rows; 16: top-16 of 16, every group 16 rows
@pytest.mark.parametrize("experts", ["bf16", "mxfp4"])
def test_grouped_launches_take_the_kernels_of_few_rows(t, experts, monkeypatch):
    """TUNE `group_rows` 16: an MoE block's grouped launches of up to 16 rows take the one-n-tile kernels, a
    group's rows past 8 in more M tiles (at 16 rows and top-16 of 16 experts every group holds all 16: two M
    tiles); prefill-sized ones keep their own. Against the launches of the step's own row count (`group_rows` 0)
    within float32 rounding (another tile, so other K split points), and against numpy."""
    rng = np.random.default_rng(3 * t)
    e, h, inter = 16, 256, 512
    k = 16 if t == 16 else 4
    x = bf16_round(rng.standard_normal((t, h))).astype(np.float32)
    router = rng.standard_normal((e, h)).astype(np.float32) * 0.3
    dev, refs = random_experts(rng, e, h, inter, experts, packed=True)
    got = CupyBackend("bf16").fuse_moe({"router": cp.asarray(router), "gate": dev[0], "up": dev[1], "down": dev[2]})
    fused, views = got[0], got[1]
    out = {}
    for rows in (16, 0):
        monkeypatch.setitem(ex.TUNE, "group_rows", rows)
        assert ex.n_tiles(ex.tile_rows(fused.gate_up, t, e)) == (1 if rows else ex.n_tiles(t))
        assert ex.tile_rows(fused.gate_up, 17, e) == 17 and ex.tile_rows(fused.gate_up, t, None) == t
        out[rows] = ex.moe(cp.asarray(x), cp.asarray(router), views["gate"], views["up"], dev[2], k, True,
                           fused=fused)
    assert_close(out[16], cp.asnumpy(out[0]), 1e-3, f"t={t} {experts}: one-n-tile groups vs the step's")
    assert_close(out[16], NumpyBackend().moe(x, router, *refs, k, True), 2e-2, f"t={t} {experts} vs numpy")


@pytest.mark.parametrize("t", [1, 12, 37, 70])  # 70: past SWIGLU_ROWS, the shared expert in launches of its own
@pytest.mark.parametrize("experts", ["bf16", "mxfp4"])
def test_moe_shared_expert_as_one_expert_more_matches_numpy_backend(t, experts):
    """`CupyBackend.fuse_moe` as the model calls it at load: the router and shared gate stacked, the experts' gate
    and up stacked, and the shared expert's MLP (the routed experts' width and storage) appended to the stacks
    as expert E, a slot more of every token (`FusedMoE.shared_slot`); against the numpy reference over the
    original weights, and (views) the same MoE with the shared expert computed apart."""
    rng = np.random.default_rng(300 + t)
    e, k, h, inter = 16, 4, 256, 512
    x = bf16_round(rng.standard_normal((t, h))).astype(np.float32)
    f32 = {"router": bf16_round(rng.standard_normal((e, h)) * 0.3), "shared_gate": bf16_round(rng.standard_normal((1, h)) * 0.3)}
    shapes = {"gate": (e, inter, h), "up": (e, inter, h), "down": (e, h, inter), "shared_gate_proj": (inter, h),
              "shared_up_proj": (inter, h), "shared_down_proj": (h, inter)}
    from decapybara.backend.cuda_factory import cuda_backend

    backend = cuda_backend("bf16")  # packed weights' products (PackedWeightsMixin) and bf16 ones
    parts, refs = {n: cp.asarray(bf16_encode(v.astype(np.float32))) for n, v in f32.items()}, dict(f32)
    for role, shape in shapes.items():
        if experts == "bf16":
            refs[role] = bf16_round(rng.standard_normal(shape) * 0.05).astype(np.float32)
            parts[role] = cp.asarray(bf16_encode(refs[role]))
        else:
            q = quant.quantize(rng.standard_normal(shape).astype(np.float32) * 0.05, "mxfp4")
            refs[role], parts[role] = q.dequantize(), ex.pack_weight(q)
    parts["shared_gate_up"], (parts["shared_gate_proj"], parts["shared_up_proj"]) = backend.concat_rows(
        [parts["shared_gate_proj"], parts["shared_up_proj"]])
    fused, views = backend.fuse_moe(parts)
    assert fused.shared_slot and fused.gate_up.shape == (e + 1, 2 * inter, h) and fused.down.shape == (e + 1, h, inter)
    assert set(views) == set(parts)
    np_ops = NumpyBackend()

    def shared_of(ops, w):
        g = ops.linear(x, w["shared_gate_proj"])
        return ops.linear(ops.silu_mul(g, ops.linear(x, w["shared_up_proj"])), w["shared_down_proj"])

    ref = np_ops.moe(x, refs["router"], refs["gate"], refs["up"], refs["down"], k, True, shared_of(np_ops, refs),
                     refs["shared_gate"])

    def shared_dev():  # the shared expert over its views (the model's MLP, apart)
        return backend.linear(backend.silu_mul_halves(backend.linear(cp.asarray(x), views["shared_gate_up"])),
                              views["shared_down_proj"])

    calls = []
    got = backend.moe(cp.asarray(x), views["router"], views["gate"], views["up"], views["down"], k, True,
                      lambda: calls.append(1) or shared_dev(), views["shared_gate"], fused)
    assert_close(got, ref, 2e-2, f"moe, shared expert in the stacks, t={t} {experts}")
    assert len(calls) == (t > ex.SWIGLU_ROWS), "the shared expert's own launches: past SWIGLU_ROWS rows only"
    apart = backend.moe(cp.asarray(x), views["router"], views["gate"], views["up"], views["down"], k, True,
                        shared_dev, views["shared_gate"])
    assert_close(got, cp.asnumpy(apart), 1e-2, f"stacked vs apart t={t} {experts}")


@pytest.mark.parametrize("k", [2, 9])  # 9 (+ a shared slot): a group of 8 slots' loads and the slots after it
@pytest.mark.parametrize("t", [1, 12, 70])
# the kernel's builds by width (MC_J columns a thread of 512: 1, 2, 4, 8, 16); 9000: past its cached columns
@pytest.mark.parametrize("h", [256, 1024, 2048, 4096, 9000])
@pytest.mark.parametrize("shared", ["apart", "slot"])  # the shared expert's output added, or a routed slot
def test_moe_combine_with_residual_add_and_norm(t, h, shared, k):
    """`moe(..., norm=...)` (`moe_combine_norm`: the combine, the residual add and RMSNorm in one launch) against
    the same `moe` followed by `cupy_ops.rms_norm` with the residual (the two launches it replaces) and the numpy
    reference's `moe` then `add_rms_norm`."""
    from decapybara.backend import cupy_ops

    rng = np.random.default_rng(500 + t + h + k)
    e, inter = 16, 64
    x = bf16_round(rng.standard_normal((t, h))).astype(np.float32)
    residual = rng.standard_normal((t, h)).astype(np.float32)
    norm_w = (rng.standard_normal(h) * 0.1).astype(np.float32)
    router = bf16_round(rng.standard_normal((e, h)) * 0.1).astype(np.float32)
    sgate = bf16_round(rng.standard_normal((1, h)) * 0.1).astype(np.float32)
    ws = [bf16_round(rng.standard_normal(s) * 0.05).astype(np.float32)
          for s in ((e + 1, inter, h), (e + 1, inter, h), (e + 1, h, inter))]  # expert e: the shared one
    refs = [w[:e] for w in ws]
    sh_ref = NumpyBackend().linear(NumpyBackend().silu_mul(x @ ws[0][e].T, x @ ws[1][e].T), ws[2][e])
    y_ref = NumpyBackend().moe(x, router, *refs, k, True, sh_ref, sgate)
    want = NumpyBackend().add_rms_norm(y_ref, residual, norm_w, 1e-6, 1.0)

    def bits(a):
        return cp.asarray(bf16_encode(a))

    stack = bits(np.concatenate([router, sgate]))
    if shared == "slot":
        gu = ex.PackedWeight("bf16", (e + 1, 2 * inter, h), bits(np.concatenate([ws[0], ws[1]], axis=1)), persistent=True)
        down = ex.PackedWeight("bf16", (e + 1, h, inter), bits(ws[2]), persistent=True)
        fused = ex.FusedMoE(stack, gu, down, True)
        experts = [ex.PackedWeight("bf16", (e, inter, h), gu.codes[:e, :inter], persistent=True),
                   ex.PackedWeight("bf16", (e, inter, h), gu.codes[:e, inter:], persistent=True),
                   ex.PackedWeight("bf16", (e, h, inter), down.codes[:e], persistent=True)]
    else:
        fused = ex.FusedMoE(router_gate=stack)
        experts = [ex.PackedWeight("bf16", w.shape, bits(w), persistent=True) for w in refs]
    args = (cp.asarray(x), stack[:e], *experts, k, True, cp.asarray(sh_ref), stack[e:], fused)
    got_x, got_h = ex.moe(*args, norm=(cp.asarray(residual), cp.asarray(norm_w), 1e-6, 1.0))
    two_x, two_h = cupy_ops.rms_norm(ex.moe(*args), cp.asarray(norm_w), 1e-6, 1.0, residual=cp.asarray(residual))
    assert_close(got_h, cp.asnumpy(two_h), 0.0, f"residual stream t={t} h={h} {shared}")  # the same float operations
    assert_close(got_x, cp.asnumpy(two_x), 1e-5, f"normed rows t={t} h={h} {shared}")  # sums of squares reordered
    assert_close(got_h, want[1], 2e-2, f"residual stream vs numpy t={t} h={h} {shared}")
    assert_close(got_x, want[0], 2e-2, f"normed rows vs numpy t={t} h={h} {shared}")


@pytest.mark.parametrize("t", [1, 3, 8, 9])  # 9: past FUSED_ROWS (the rows materialised first)
@pytest.mark.parametrize("shared", ["apart", "slot"])
@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])  # of the experts' gate|up stack
@pytest.mark.parametrize("norm", [False, True])  # `moe`, or `moe_add_rms_norm`'s form (the combine's norm)
def test_moe_over_normed_rows(t, shared, fmt, norm, monkeypatch):
    """An MoE block over `NormedRows` (the output projection before it fused the residual add and left its norm
    to the products): the router|gate product (gemv_small or the skinny kernels) and the experts' grouped SwiGLU
    launch divide each row's sums by its denominator, the routing kernel copying each gathered row's sums of
    squares by y row; no norm kernel runs. Against the numpy reference over the rows those products see,
    bf16(h (1 + w)) / denom, the rows of h at scales 0.25-4 (a row divided by another's denominator is off by
    several times); xg in bf16 bits, or float32 at 3 rows; past FUSED_ROWS the rows are materialised and the
    result is the plain block's."""
    rng = np.random.default_rng(zlib.crc32(f"normed-moe-{t}-{shared}-{fmt}-{norm}".encode()))
    e, k, hd, inter, eps = 16, 4, 512, 64, 1e-6
    monkeypatch.setitem(ex.TUNE, "small_n", 1024 if t % 2 else 0)  # the router on gemv_small, or not
    hres = (rng.standard_normal((t, hd)) * rng.uniform(0.25, 4, (t, 1))).astype(np.float32)
    nw = (rng.standard_normal(hd) * 0.2).astype(np.float32)
    xg = bf16_round(hres * (np.float32(1.0) + nw)).astype(np.float32)
    sq = np.zeros((t, hd // 128), np.float32)
    for j in range(hd // 128):  # the producer's sums of squares by 128-column tile
        sq[:, j] = (hres[:, 128 * j:128 * (j + 1)].astype(np.float64) ** 2).sum(1)
    denom = np.sqrt(sq.astype(np.float64).sum(1, keepdims=True) / hd + eps)
    x_eff = (xg / denom).astype(np.float32)  # what the fused products compute over, up to float32 rounding
    router = bf16_round(rng.standard_normal((e, hd)) * 0.3).astype(np.float32)
    sgate = bf16_round(rng.standard_normal((1, hd)) * 0.3).astype(np.float32)
    gu_all = rng.standard_normal((e + 1, 2 * inter, hd)).astype(np.float32) * 0.05  # expert e: the shared one
    down_all = bf16_round(rng.standard_normal((e + 1, hd, inter)) * 0.05).astype(np.float32)
    if fmt == "mxfp4":
        q = quant.quantize(gu_all, "mxfp4")
        gu, gu_ref = ex.pack_weight(q), q.dequantize()
    else:
        gu_ref = bf16_round(gu_all).astype(np.float32)
        gu = ex.PackedWeight("bf16", gu_ref.shape, cp.asarray(bf16_encode(gu_ref)), persistent=True)
    down = ex.PackedWeight("bf16", down_all.shape, cp.asarray(bf16_encode(down_all)), persistent=True)
    refs = [gu_ref[:e, :inter], gu_ref[:e, inter:], down_all[:e]]
    experts = [ex.PackedWeight("bf16", w.shape, cp.asarray(bf16_encode(w)), persistent=True) for w in refs]
    stack = cp.asarray(bf16_encode(np.concatenate([router, sgate])))
    npb = NumpyBackend()

    def shared_of(x):
        return npb.linear(npb.silu_mul(x @ gu_ref[e, :inter].T, x @ gu_ref[e, inter:].T), down_all[e])

    xg_dev = cp.asarray(xg) if t == 3 else cp.asarray(bf16_encode(xg))  # float32 xg: TUNE bf16_rows off
    normed = ex.NormedRows(cp.asarray(hres), xg_dev, cp.asarray(sq), cp.asarray(nw), eps, 1.0)
    if shared == "slot":
        fused, sh = ex.FusedMoE(stack, gu, down, True), lambda: pytest.fail("the stacks' shared expert ran apart")
    else:
        fused, sh = ex.FusedMoE(router_gate=stack, gate_up=gu), cp.asarray(shared_of(x_eff))
    # a small residual, so that the block's output weighs in the combine's norm
    residual = (rng.standard_normal((t, hd)) * 0.01).astype(np.float32)
    kw = {"norm": (cp.asarray(residual), cp.asarray(nw), eps, 1.0)} if norm else {}
    args = (stack[:e], *experts, k, True, sh, stack[e:], fused)

    def check_ref(got, x):  # against the numpy block over rows x
        y_ref = npb.moe(x, router, *refs, k, True, shared_of(x), sgate)
        if norm:
            want_x, want_h = npb.add_rms_norm(y_ref, residual, nw, eps, 1.0)
            assert_close(got[1], want_h, 1e-2, f"residual stream t={t} {shared} {fmt}")
            assert_close(got[0], want_x, 1e-2, f"normed rows t={t} {shared} {fmt}")
        else:
            assert got.dtype == cp.float32
            assert_close(got, y_ref, 1e-2, f"moe t={t} {shared} {fmt}")

    if t <= ex.FUSED_ROWS:  # the fused path: nothing materialises the rows
        with monkeypatch.context() as m:
            m.setattr(ex.NormedRows, "materialize", lambda self: pytest.fail("materialised"))
            got = ex.moe(normed, *args, **kw)
        check_ref(got, x_eff)
    else:
        rows = normed.materialize()
        plain = ex.moe(rows, *args, **kw)
        got = ex.moe(normed, *args, **kw)
        for g, p in zip(got if norm else (got,), plain if norm else (plain,), strict=True):
            assert_bytes_equal(g, p, f"t={t} {shared} {fmt}: the materialised rows' block")
        check_ref(got, host(rows))


@pytest.mark.parametrize("t", [1, 12, 37])  # route and dispatch in one launch (up to 32 rows), in two past that
@pytest.mark.parametrize("gates", ["f32", "bf16"])  # bf16: router and shared gate as one stacked product, as
# QwenModel stacks them (`router_gate`; `router` and `shared_gate` its row views)
def test_moe_with_shared_expert_matches_numpy_backend(t, gates):
    """The shared expert's gated output added in the combine (`moe(..., shared, shared_gate)`) against the
    reference's sum + sigmoid(x @ gate^T) * shared (given as an array, and as a function that computes it);
    with bf16 gates also the plain routed result (the stacked router's logits route as the router's alone)."""
    rng = np.random.default_rng(100 + t)
    e, k, h, inter = 16, 4, 256, 512
    x = bf16_round(rng.standard_normal((t, h))).astype(np.float32)
    router = bf16_round(rng.standard_normal((e, h)) * 0.3).astype(np.float32)
    sgate = bf16_round(rng.standard_normal((1, h)) * 0.3).astype(np.float32)
    shared = rng.standard_normal((t, h)).astype(np.float32)
    qs = [quant.quantize(rng.standard_normal(s).astype(np.float32) * 0.05, "mxfp4")
          for s in ((e, inter, h), (e, inter, h), (e, h, inter))]
    weights, refs = [ex.pack_weight(q) for q in qs], [q.dequantize() for q in qs]
    if gates == "bf16":
        stack = cp.asarray(bf16_encode(np.concatenate([router, sgate])))
        dev = [stack[:e], stack[e:]]
    else:
        stack, dev = None, [cp.asarray(a) for a in (router, sgate)]
    for normalize in (True, False):
        ref = NumpyBackend().moe(x, router, *refs, k, normalize, shared, sgate)
        got = ex.moe(cp.asarray(x), dev[0], *weights, k, normalize, cp.asarray(shared), dev[1],
                     ex.FusedMoE(router_gate=stack))
        assert_close(got, ref, 2e-2, f"moe + shared t={t} gates={gates} normalize={normalize}")
        late = ex.moe(cp.asarray(x), dev[0], *weights, k, normalize, lambda: cp.asarray(shared), dev[1],
                      ex.FusedMoE(router_gate=stack))
        assert_close(late, cp.asnumpy(got), 0.0, f"moe + shared computed on demand t={t} gates={gates}")
        plain = ex.moe(cp.asarray(x), dev[0], *weights, k, normalize)
        assert_close(plain, NumpyBackend().moe(x, router, *refs, k, normalize), 2e-2, f"moe t={t} gates={gates}")


@pytest.mark.parametrize("t", [5, 40])  # routing and dispatch in one launch, in two
@pytest.mark.parametrize("e", [16, 300])
def test_moe_routing_of_nan_and_infinite_logits(t, e):
    """Router logits with NaNs, infinities and rows of nothing else: every (token, slot) still gets a distinct
    expert below E with a finite weight, finite rows route as the numpy reference does, and the dispatch's
    counts cover every pair (the grouped products never index past the experts)."""
    rng = np.random.default_rng(e + t)
    k = 4
    logits = rng.standard_normal((t, e)).astype(np.float32)
    logits[0] = np.nan
    logits[1] = -np.inf
    logits[2, :] = rng.standard_normal(e)
    logits[2, 3] = np.inf
    logits[2, 7] = np.inf
    logits[3, : e // 2] = np.nan
    logits[4, ::3] = -np.inf
    logits[4, 1::3] = np.nan
    p = t * k
    ng = min(e, p)
    ids, wts = cp.empty((t, k), cp.int32), cp.empty((t, k), cp.float32)
    counts, offsets, gids = (cp.empty(ng, cp.int32) for _ in range(3))
    gather, slot_pos = cp.empty(p, cp.int32), cp.empty(p, cp.int32)
    dev = cp.asarray(logits)
    jpl = (("MOE_JPL", next(j for j in (8, 16, 32) if 32 * j >= e)),)
    I32, I64 = np.int32, np.int64
    route = (dev, I64(e), I32(t), I32(e), I32(k), I32(1), I32(0), ids, wts)  # normalised, no shared slot
    # a fused norm's sums of squares of the rows (5 tiles), which the one launch copies to each y row
    nsq = cp.asarray(rng.standard_normal((t, 5)).astype(np.float32))
    g_nsq = cp.full((p, 5), np.nan, cp.float32)
    if t <= ex.ROUTE_DISPATCH_ROWS:
        kernels.get_kernel("moe", "moe_route_dispatch", jpl)((1,), (512,), (*route, I32(ng), counts, offsets, gids,
                                                                             gather, slot_pos, nsq, I32(5), g_nsq),
                                                       shared_mem=8 * e + 4 * p)  # counters, cursors, the ids
        assert_bytes_equal(g_nsq, nsq[gather], "sums of squares by y row")
    else:
        kernels.get_kernel("moe", "moe_route", jpl)((-(-t * 32 // 256),), (256,), route)
        kernels.get_kernel("moe", "moe_dispatch")((1,), (1024,), (ids, I32(p), I32(e), I32(ng), counts, offsets, gids,
                                                                  gather, slot_pos, I32(k)), shared_mem=8 * e)
    ids_h, w_h = cp.asnumpy(ids), cp.asnumpy(wts)
    assert ((ids_h >= 0) & (ids_h < e)).all(), ids_h[:5]
    assert all(len(set(r)) == k for r in ids_h.tolist()), ids_h[:5]
    assert np.isfinite(w_h).all() and np.allclose(w_h.sum(1), 1.0, atol=1e-5)
    assert ids_h[0].tolist() == list(range(k)) and ids_h[1].tolist() == list(range(k))  # nothing to rank: ties
    assert ids_h[2, :2].tolist() == [3, 7] and np.allclose(w_h[2, :2], 0.5)  # the infinite logits share it all
    finite = np.isfinite(logits).all(1)
    with np.errstate(invalid="ignore"):
        probs = np.exp(logits - logits.max(1, keepdims=True))
    top = np.argsort(-(probs / probs.sum(1, keepdims=True)), axis=1, kind="stable")[:, :k]
    assert (ids_h[finite] == top[finite]).all()
    c = cp.asnumpy(counts)
    assert c.sum() == p and sorted(cp.asnumpy(gather).tolist()) == sorted(np.repeat(np.arange(t), k).tolist())


# ---- sampler -------------------------------------------------------------------------------------------------
def test_philox_uniforms_bit_identical():
    rng = np.random.default_rng(11)
    seeds = rng.integers(0, 2**63, 5000, dtype=np.uint64) * np.uint64(2) + rng.integers(0, 2, 5000, dtype=np.uint64)
    pos = rng.integers(0, 2**40, 5000, dtype=np.uint64)
    for stream in (0, 1, 7):
        assert_bytes_equal(ex.philox_uniforms(seeds, pos, stream), philox.uniforms(seeds, pos, stream),
                           f"philox stream {stream}")


def random_rows(rng, b, v):
    rows = []
    for _ in range(b):
        p = sampling.SamplingParams(
            temperature=float(rng.choice([0.0, 0.3, 0.7, 1.0, 1.5])), top_k=int(rng.choice([0, 0, 1, 5, 50, 2000])),
            top_p=float(rng.choice([1.0, 1.0, 0.9, 0.5, 0.99])), min_p=float(rng.choice([0.0, 0.0, 0.05, 0.2])),
            presence_penalty=float(rng.choice([0.0, 0.5, -0.3])), frequency_penalty=float(rng.choice([0.0, 0.2])),
            repetition_penalty=float(rng.choice([1.0, 1.2, 0.8])),
            logit_bias={int(t): float(rng.uniform(-5, 5)) for t in rng.integers(0, v, rng.integers(0, 3))},
            stop_token_ids=tuple(int(t) for t in rng.integers(0, v, 2)), min_tokens=int(rng.integers(0, 3)),
            logprobs=int(rng.choice([0, 3])) if rng.random() < 0.3 else None)
        rows.append(sampling.SamplerRow(p, rng.integers(0, v, rng.integers(0, 30)), rng.integers(0, v, rng.integers(0, 30)),
                                        position=int(rng.integers(0, 1000)), seed=int(rng.integers(-2**63, 2**63 - 1)),
                                        extra_repetition_penalty=float(rng.choice([1.0, 1.0, 1.3])),
                                        banned_token_ids=rng.integers(0, v, rng.integers(0, 3))))
    return rows


def random_logits(rng, b, v):
    kind = rng.integers(0, 4)
    if kind == 0:
        x = rng.standard_normal((b, v))
    elif kind == 1:
        x = rng.standard_normal((b, v)) * 5
    elif kind == 2:
        x = rng.integers(-3, 3, (b, v)).astype(np.float64)  # many exact ties
    else:
        x = rng.standard_normal((b, v)) * 2
        x[:, rng.integers(0, v, 3)] = 12.0
    x = x.astype(np.float32)
    if rng.random() < 0.2:
        x[0, rng.integers(0, v, max(1, v // 10))] = np.nan
    return x


def boundary_note(logits, row, eos, ref_tok, got_tok):
    """How close the draw was to a CDF step (the documented caveat), for the failure message."""
    out = sampling.sample(logits[None, :], [row], eos_token_ids=eos)
    return f"numpy {out.token_ids[0]} (ref {ref_tok}), cuda {got_tok}, params {row.params}"


@pytest.mark.parametrize("v,b,trials", [(7, 4, 40), (1000, 6, 40), (9000, 4, 20), (248_320, 3, 4)])
def test_cuda_sample_same_tokens_as_numpy(v, b, trials):
    rng = np.random.default_rng(v)
    mismatches = []
    for trial in range(trials):
        logits, rows = random_logits(rng, b, v), random_rows(rng, b, v)
        eos = [int(rng.integers(0, v))]
        ref = sampling.sample(logits, rows, eos_token_ids=eos)
        got = ex.cuda_sample(cp.asarray(logits), rows, eos_token_ids=eos)
        for i in np.flatnonzero(ref.token_ids != got.token_ids):
            mismatches.append(f"trial {trial} row {i}: " + boundary_note(logits[i], rows[i], eos, ref.token_ids[i],
                                                                          got.token_ids[i]))
        for i, r in enumerate(rows):
            if r.params.logprobs is None or ref.token_ids[i] != got.token_ids[i]:
                continue
            assert abs(float(got.logprobs[i]) - float(ref.logprobs[i])) <= 1e-4 * max(1.0, abs(float(ref.logprobs[i]))), (
                f"logprob row {i}: {got.logprobs[i]} vs {ref.logprobs[i]}")
            assert [t for t, _ in got.top_logprobs[i]] == [t for t, _ in ref.top_logprobs[i]], (
                f"top ids row {i}: {got.top_logprobs[i]} vs {ref.top_logprobs[i]}")
    assert not mismatches, f"{len(mismatches)} token mismatches:\n" + "\n".join(mismatches[:10])


@pytest.mark.parametrize("r,v", [(1, 9), (2, 1000), (5, 4096), (12, 3000)])
def test_canonical_orders_are_the_stable_argsort_of_each_row(r, v):
    """The fallback's canonical orders (`canonical_orders`: two 1-D stable sorts where there are several rows) are
    np.argsort(-z, kind="stable") of each row: many exact ties (within a row and across rows), zeros of both signs
    (which tie, as they compare), -inf (masked tokens), rows of equal values."""
    rng = np.random.default_rng(r * v)
    z = rng.integers(-4, 4, (r, v)).astype(np.float64) / 3.0
    z[:, rng.integers(0, v, max(1, v // 7))] = -np.inf
    z[0, :3] = -0.0
    z[0, 3:6] = 0.0
    z[-1] = 0.5
    got = cp.asnumpy(ex.canonical_orders(cp.asarray(z)))
    assert got.dtype == np.int32 and got.shape == (r, v)
    for i in range(r):
        assert np.array_equal(got[i], np.argsort(-z[i], kind="stable")), f"row {i}"


def test_cuda_sample_ties_masks_and_dtypes():
    v = 64
    flat = np.zeros((1, v), np.float32)
    for p in (sampling.SamplingParams(temperature=0.0), sampling.SamplingParams(top_k=5, seed=1),
              sampling.SamplingParams(top_p=0.1), sampling.SamplingParams(min_p=0.9)):
        for pos in range(6):
            row = sampling.SamplerRow(p, [], [], position=pos, seed=1234)
            ref = sampling.sample(flat, [row]).token_ids
            assert np.array_equal(ex.cuda_sample(cp.asarray(flat), [row]).token_ids, ref), (p, pos)
    logits = np.random.default_rng(3).standard_normal((2, 4)).astype(np.float32)
    rows = [sampling.SamplerRow(sampling.SamplingParams(seed=5), [], [], position=i, seed=99,
                                banned_token_ids=[0, 1, 2, 3]) for i in range(2)]  # masks everything: reverted
    assert np.array_equal(ex.cuda_sample(cp.asarray(logits), rows).token_ids, sampling.sample(logits, rows).token_ids)
    big = np.random.default_rng(4).standard_normal((3, 5000)).astype(np.float32)
    rows = [sampling.SamplerRow(sampling.SamplingParams(temperature=0.8), [], [], position=i, seed=i) for i in range(3)]
    bits = bf16_encode(big)
    assert np.array_equal(ex.cuda_sample(cp.asarray(bits), rows).token_ids,
                          sampling.sample(bf16_decode(bits), rows).token_ids), "bf16 logits"
    with pytest.raises(ValueError, match="finite"):
        ex.cuda_sample(cp.asarray(np.full((1, 8), np.nan, np.float32)), rows[:1])


@pytest.mark.parametrize("v", [7, 1000, 9000])
def test_cuda_sample_at_the_parameters_bounds(v):
    """The parameters' edges as numpy samples them: temperatures just past greedy and huge, top_k past the
    vocabulary, top_p of one token, min_p 1, logit_bias +-100, the repetition penalty's bounds (seen tokens of
    float32's largest logits too), 20 alternatives of fewer tokens, +inf logits beside ordinary ones (alternatives
    past float32's range left out); tokens, logprobs and the alternatives' ids (their values beside +inf logits)."""
    rng = np.random.default_rng(v)
    big = float(np.finfo(np.float32).max)
    params = [sampling.SamplingParams(**kw) for kw in (
        {"temperature": 1e-5, "logprobs": 5}, {"temperature": 2e-5, "logprobs": 20}, {"temperature": 1e6, "logprobs": 3},
        {"temperature": 1e300}, {"top_k": 2**31 - 1, "logprobs": 20}, {"top_p": 1e-300}, {"min_p": 1.0},
        {"logit_bias": {0: 100.0, 1: 100.0}}, {"temperature": 0, "logit_bias": {v - 1: 100.0}, "logprobs": 20},
        {"repetition_penalty": sampling.MAX_REPETITION_PENALTY, "logprobs": 4},
        {"repetition_penalty": 1 / sampling.MAX_REPETITION_PENALTY, "temperature": 1e-5, "logprobs": 4},
        {"presence_penalty": 2, "frequency_penalty": 2}, {"temperature": 3.0, "top_k": 3, "top_p": 0.5, "min_p": 0.5},
        {"temperature": 0.5, "logprobs": 4})]
    for kind in range(4):
        x = (rng.standard_normal((1, v)) * [1, 30, 3, 1][kind]).astype(np.float32)
        if kind == 2:
            x = np.round(x)  # ties
        if kind == 3:
            x[0, :3] = [big, -big, np.inf]
        rows = [sampling.SamplerRow(p, np.arange(min(v, 50)), [0, 0, 1], position=pos,
                                    seed=int(rng.integers(0, 2**63))) for p in params for pos in range(2)]
        logits = np.repeat(x, len(rows), 0)
        ref = sampling.sample(logits, rows, eos_token_ids=[v - 1])
        got = ex.cuda_sample(cp.asarray(logits), rows, eos_token_ids=[v - 1])
        for i, r in enumerate(rows):
            where = (kind, r.params)
            assert got.token_ids[i] == ref.token_ids[i], where
            assert np.isclose(got.logprobs[i], ref.logprobs[i], rtol=1e-5, atol=1e-4, equal_nan=True), where
            dev, host = (np.array(out.top_logprobs[i], np.float64).reshape(-1, 2) for out in (got, ref))  # (id, lp)
            assert dev.shape == host.shape and np.allclose(dev[:, 1], host[:, 1], rtol=1e-5, atol=1e-4), where
            # (beside float32's extremes the rest's logprobs tie in float64; the device lists those by their logits)
            assert kind == 3 or np.array_equal(dev[:, 0], host[:, 0]), where


@pytest.mark.parametrize("v,b", [(64, 1), (5000, 5), (248_320, 12)])
def test_cuda_sample_greedy_short_path(v, b):
    """Greedy rows with no edits and no logprobs stop at the row maxima (`sample_greedy_pick`): the lowest id of
    the maximum, ties planted before and after it, +inf (as the float32 maximum) and NaN (never chosen), float32
    and bf16 logits; a batch with one row that wants logprobs, or one with a penalty, takes the full path."""
    rng = np.random.default_rng(v + b)
    logits = rng.standard_normal((b, v)).astype(np.float32)
    for i in range(b):
        j = int(rng.integers(1, v - 1))
        logits[i, j] = logits[i, j - 1] = logits[i, j + 1] = logits[i].max() + 1.0  # a three-way tie
    logits[0, v // 2] = np.nan
    if b > 1:
        logits[1, v - 1] = logits[1, v // 3] = np.inf  # two +inf: the lower id
    rows = [sampling.SamplerRow(sampling.SamplingParams(temperature=0.0), [], [], position=i, seed=i)
            for i in range(b)]
    ref = sampling.sample(logits, rows).token_ids
    got = ex.cuda_sample(cp.asarray(logits), rows)
    assert np.array_equal(got.token_ids, ref) and np.isnan(got.logprobs).all() and got.top_logprobs == [[]] * b
    bits = bf16_encode(logits)
    assert np.array_equal(ex.cuda_sample(cp.asarray(bits), rows).token_ids,
                          sampling.sample(bf16_decode(bits), rows).token_ids), "bf16 logits"
    mixed = rows[:-1] + [sampling.SamplerRow(sampling.SamplingParams(temperature=0.0, logprobs=2), [], [],
                                             position=0, seed=0)]
    out = ex.cuda_sample(cp.asarray(logits), mixed)
    assert np.array_equal(out.token_ids, ref) and np.isfinite(out.logprobs[-1]) and len(out.top_logprobs[-1]) == 2
    banned = rows[:-1] + [sampling.SamplerRow(sampling.SamplingParams(temperature=0.0), [], [], position=0, seed=0,
                                              banned_token_ids=[int(ref[-1])])]
    assert np.array_equal(ex.cuda_sample(cp.asarray(logits), banned).token_ids,
                          sampling.sample(logits, banned).token_ids), "a masked row"
    dead = logits.copy()
    dead[-1] = -np.inf
    with pytest.raises(ValueError, match="finite"):
        ex.cuda_sample(cp.asarray(dead), rows)


@pytest.mark.parametrize("r,v", [(1, 7), (3, 2048), (12, 248_320), (5, 10_001)])
def test_guesses_are_numpy_argmax_and_softmax_max(r, v):
    """`cupy_ops_extra.guesses` (the MTP head's drafts: sample.cu `guess_partial` / `guess_finish`): the lowest id
    of each row's maximum as numpy's argmax, ties planted across chunks, a -inf run, a row of one token's mass,
    and a row view of unit stride in a wider array; the probability within float32 rounding of numpy's."""
    from decapybara.backend.numpy_backend import NumpyBackend

    rng = np.random.default_rng(r * 1000 + v)
    x = (rng.standard_normal((r, v)) * 3).astype(np.float32)
    if v > 4:
        x[0, [v - 1, v // 2, 1]] = x[0].max() + 2.0  # a three-way tie: the lowest id, 1
        x[-1, : v // 3] = -np.inf
    if r > 1:
        x[1] = -30.0
        x[1, v - 2] = 40.0  # one token holds the mass
    guess, prob = ex.guesses(cp.asarray(x))
    ref_g, ref_p = NumpyBackend().argmax_prob(x)
    assert np.array_equal(cp.asnumpy(guess), ref_g) and cp.asnumpy(guess).dtype == np.int64
    np.testing.assert_allclose(cp.asnumpy(prob), ref_p, rtol=2e-6)
    wide = cp.asarray(np.concatenate([x, x[:, :5]], axis=1))[:, :v]  # rows of stride v + 5
    g2, p2 = ex.guesses(wide)
    assert np.array_equal(cp.asnumpy(g2), ref_g) and np.array_equal(cp.asnumpy(p2), cp.asnumpy(prob))


def test_cuda_sample_kept_buffers_carry_nothing_between_calls():
    """The sampler keeps its buffers per (thread, device, rows, vocabulary) (`_SampleWork`): a call after others
    of other shapes and settings (greedy, edits, alternatives) gives what the first call gave, bit for bit, and
    the same as a call from another thread (its own buffers); the reference's tokens throughout."""
    import threading

    rng = np.random.default_rng(11)
    v = 5000
    logits = (rng.standard_normal((4, v)) * 2).astype(np.float32)
    rows = [sampling.SamplerRow(sampling.SamplingParams(temperature=0.8, top_k=40, top_p=0.9, logprobs=3), [], [],
                                position=i, seed=77 + i) for i in range(4)]
    first = ex.cuda_sample(cp.asarray(logits), rows)
    assert np.array_equal(first.token_ids, sampling.sample(logits, rows).token_ids)
    other = (rng.standard_normal((6, v)) * 3).astype(np.float32)
    other[1, 7] = np.inf
    greedy = [sampling.SamplerRow(sampling.SamplingParams(temperature=0.0), [], [], position=0, seed=0)] * 6
    edits = [sampling.SamplerRow(sampling.SamplingParams(temperature=0.5, repetition_penalty=1.3), [1, 2, 3], [4],
                                 position=i, seed=i, banned_token_ids=[int(np.argmax(other[i]))]) for i in range(6)]
    for rs in (greedy, edits):
        assert np.array_equal(ex.cuda_sample(cp.asarray(other), rs).token_ids, sampling.sample(other, rs).token_ids)
    louder = logits[::-1] * 3 + 5  # the same shape (the same buffers), larger maxima
    for rs in (rows, greedy[:4]):
        assert np.array_equal(ex.cuda_sample(cp.asarray(louder), rs).token_ids, sampling.sample(louder, rs).token_ids)
    thin = np.ascontiguousarray(logits[:, :700])
    narrow = ex.cuda_sample(cp.asarray(thin), rows)  # another vocabulary, the same rows
    assert np.array_equal(narrow.token_ids, sampling.sample(thin, rows).token_ids)
    again = ex.cuda_sample(cp.asarray(logits), rows)
    box = {}
    t = threading.Thread(target=lambda: box.update(out=ex.cuda_sample(cp.asarray(logits), rows)))
    t.start()
    t.join()
    for out in (again, box["out"]):
        assert np.array_equal(out.token_ids, first.token_ids)
        assert np.array_equal(out.logprobs, first.logprobs) and out.top_logprobs == first.top_logprobs


@pytest.mark.parametrize("v", [248_320, 20_000])
def test_cuda_sample_fallback_scans_over_spans(v, monkeypatch):
    """Rows whose draw lies past the certified prefix (flat logits, no top-k or one past the prefix) take the
    fallback: their canonical orders, `sample_scan_parts` over spans of 8,192 tokens (31 and 3 here) and
    `sample_scan_pick`'s searches. The reference's tokens, logprobs and alternatives for T 1 without filters, top-p
    0.9, min-p with T 1.5, a top-k of 5,000, top-p with a top-k of 3,000 and a greedy row with alternatives, over
    several draws; the fallback was taken."""
    b = 6
    rng = np.random.default_rng(v + 1)
    params = [sampling.SamplingParams(temperature=1.0), sampling.SamplingParams(temperature=0.9, top_p=0.9),
              sampling.SamplingParams(temperature=1.5, min_p=0.02), sampling.SamplingParams(top_k=5000),
              sampling.SamplingParams(temperature=0.8, top_p=0.7, top_k=3000, logprobs=3),
              sampling.SamplingParams(temperature=0.0, logprobs=5)]
    orders = []
    real = ex.canonical_orders
    monkeypatch.setattr(ex, "canonical_orders", lambda z: orders.append(z.shape[0]) or real(z))
    for trial in range(3):
        logits = rng.standard_normal((b, v)).astype(np.float32)
        rows = [sampling.SamplerRow(params[i], [], [], position=trial * b + i, seed=77 + i) for i in range(b)]
        ref = sampling.sample(logits, rows)
        got = ex.cuda_sample(cp.asarray(logits), rows)
        assert np.array_equal(got.token_ids, ref.token_ids), (trial, got.token_ids, ref.token_ids)
        for i, r in enumerate(rows):
            if r.params.logprobs is not None:
                assert abs(float(got.logprobs[i]) - float(ref.logprobs[i])) <= 1e-4 * max(1.0, abs(float(ref.logprobs[i])))
                assert [t for t, _ in got.top_logprobs[i]] == [t for t, _ in ref.top_logprobs[i]], (trial, i)
    assert orders and max(orders) >= 3, f"rows through the fallback: {orders}"


@pytest.mark.parametrize("v", [248_320, 140_000])
def test_cuda_sample_tiles_report_their_first_tokens_in_canonical_order(v):
    """sample_stats' candidates of rows with no top-k (every tile reports its first L tokens; vocabularies of 64+
    tiles take `block_first`, no full sort): each tile's (z, id) list is the first L of its tokens (ids b + nblk j)
    by z = y / T descending, ties by ascending id (numpy's stable argsort), read from the call's kept buffers.
    Ties within and across a tile's warps, -0.0 and +0.0 logits, a row of equal logits, T 0.7 and T 1."""
    b = 4
    rng = np.random.default_rng(v)
    logits = rng.integers(-6, 6, (b, v)).astype(np.float32) / 4  # many exact ties
    logits[1] = rng.standard_normal(v).astype(np.float32) * 2
    logits[1, :5000:3] = -0.0
    logits[1, 1:5000:3] = 0.0
    logits[2] = 1.5
    temps = [0.7, 1.0, 1.0, 0.7]
    rows = [sampling.SamplerRow(sampling.SamplingParams(temperature=temps[i], top_p=0.9), [], [], position=i,
                                seed=50 + i) for i in range(b)]
    ex.cuda_sample(cp.asarray(logits), rows)
    work = ex._sample_work(b, v)
    nblk, lc = work.nblk, work.lc
    assert lc <= 32, "these vocabularies take the warps' merges"
    cz, cid = cp.asnumpy(work.dev["cz"]), cp.asnumpy(work.dev["cid"])
    for r in range(b):
        z = logits[r].astype(np.float64) / temps[r] + 0.0
        for t in range(nblk):
            ids = np.arange(t, v, nblk)
            first = ids[np.argsort(-z[ids], kind="stable")[:lc]]
            assert np.array_equal(cid[r, t], first), f"row {r} tile {t}: ids {cid[r, t]} against {first}"
            assert np.array_equal(cz[r, t], z[first]), f"row {r} tile {t}: z"


@pytest.mark.parametrize("where", ["low ids", "spread", "ties"])
def test_cuda_sample_top_k_rows_sort_few_tiles(where):
    """Rows that keep at most K tokens (top-k, logprob alternatives) sort only the tiles whose first token is
    among the K best tiles' (`sample_tilemax`); the others bound the certified prefix with that token. Peaked
    logits whose likely tokens sit in one id range, anywhere, or tie exactly: the reference's tokens, logprobs
    and alternatives, beside rows with no top-k (every tile sorted) and a greedy row with alternatives."""
    v, b = 248_320, 12
    rng = np.random.default_rng(len(where))
    logits = (rng.standard_normal((b, v)) * 2.0).astype(np.float32)
    for i in range(b):
        ids = np.arange(64) if where == "low ids" else rng.permutation(v)[:64]
        if where == "ties":
            logits[i, ids] = 12.0  # 64 equal best tokens: canonical order by id
        else:
            logits[i, ids] += np.linspace(14.0, 6.0, 64, dtype=np.float32)
    params = [sampling.SamplingParams(temperature=0.7, top_p=0.8, top_k=20, logprobs=5),
              sampling.SamplingParams(temperature=1.0, top_k=3),
              sampling.SamplingParams(temperature=0.6, top_p=0.95),  # no top-k: every tile
              sampling.SamplingParams(temperature=0.0, logprobs=4)]
    rows = [sampling.SamplerRow(params[i % 4], [], [], position=i, seed=1000 + i) for i in range(b)]
    ref = sampling.sample(logits, rows)
    got = ex.cuda_sample(cp.asarray(logits), rows)
    assert np.array_equal(got.token_ids, ref.token_ids), (got.token_ids, ref.token_ids)
    for i, r in enumerate(rows):
        if r.params.logprobs is not None:
            assert abs(float(got.logprobs[i]) - float(ref.logprobs[i])) <= 1e-4 * max(1.0, abs(float(ref.logprobs[i])))
            assert [t for t, _ in got.top_logprobs[i]] == [t for t, _ in ref.top_logprobs[i]], i


# ---- checksum and probe -----------------------------------------------------------------------------------------
def fletcher_ref(data: np.ndarray, chunk_bytes: int) -> np.ndarray:
    raw = np.frombuffer(data.tobytes(), np.uint8)
    n = max(1, -(-raw.size // chunk_bytes))
    padded = np.zeros(n * chunk_bytes, np.uint8)
    padded[:raw.size] = raw
    w = padded.view("<u4").reshape(n, -1).astype(np.uint64)
    m = np.uint64(0xFFFFFFFF)
    weights = np.arange(w.shape[1], 0, -1, dtype=np.uint64)
    s1 = w.sum(axis=1) % m
    s2 = (w * weights).sum(axis=1) % m
    return (s2 << np.uint64(32)) | s1


@pytest.mark.parametrize("nbytes,chunk", [(1, 4), (3, 64), (4096, 4096), (65536 * 3 + 5, 65536), (1 << 22, 1 << 16)])
def test_checksum_matches_host_reference(nbytes, chunk):
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    assert_bytes_equal(ex.checksum(cp.asarray(data), chunk), fletcher_ref(data, chunk), f"fletcher {nbytes}/{chunk}")


def test_checksum_locates_a_single_flipped_bit():
    rng = np.random.default_rng(99)
    buf = cp.random.randint(0, 2**31 - 1, (1 << 28) // 4, dtype=cp.int32)  # 256 MiB
    ref = ex.checksum(buf)
    assert ex.locate_corruption(buf, ref).size == 0
    for _ in range(3):
        byte, bit = int(rng.integers(0, buf.nbytes)), int(rng.integers(0, 8))
        raw = buf.view(cp.uint8)
        raw[byte] ^= np.uint8(1 << bit)
        assert list(ex.locate_corruption(buf, ref)) == [byte // (1 << 16)], f"flip at byte {byte} bit {bit}"
        raw[byte] ^= np.uint8(1 << bit)
        assert ex.locate_corruption(buf, ref).size == 0


def test_bandwidth_probe_reports_throughput():
    res = ex.bandwidth_probe(nbytes=1 << 26, repeats=2)
    assert set(res) == {"read_GBps", "write_GBps", "copy_GBps", "cupy_copy_GBps"}
    assert all(np.isfinite(v) and v > 0 for v in res.values()), res
    print(res)


def test_launcher_plans_with_the_probe(capsys):
    """`decapybara plan` on a CUDA machine: the device's free memory and the probe's copy bandwidth."""
    from decapybara.cli import main
    from decapybara.launcher.probe import this_machine

    m = this_machine(measure=True)
    total = cp.cuda.runtime.memGetInfo()[1]
    assert m.device.startswith("cuda:") and m.memory_bytes == total and 0 < m.free_bytes <= total
    assert m.bandwidth > 1e11, m  # any CUDA GPU copies faster than 100 GB/s
    assert main(["plan", "--config", "qwen3.8-27b", "--weights", "tiny", "--slots", "12"]) == 0
    out = capsys.readouterr().out
    print(out)
    assert "machine: cuda:" in out and "(free)" in out and "(measured)" in out
