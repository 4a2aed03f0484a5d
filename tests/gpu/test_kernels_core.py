"""Kernels of the CUDA backend against the numpy reference, on fresh random inputs (GPU only).

Precision classes: float32 math within ~1e-5 relative (max-norm over the output), bf16 operands ~1e-2;
KV quantisation, bf16 rounding and weight dequantisation bit-exact. Every output starts NaN-poisoned
(`cupy_ops.POISON`), so an element a kernel forgets to write fails the check. Failures print the max error,
the first offending index with both values, and the shapes.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
from decapybara import kernels

if not kernels.has_cuda():
    pytest.skip("no CUDA device", allow_module_level=True)

from decapybara.backend import cupy_ops as ops
from decapybara.backend.cupy_backend import CupyBackend
from decapybara.backend.cupy_kv import write_kv
from decapybara.backend.kv_codec import codec_for, f32_to_bf16_bits
from decapybara.backend.numpy_backend import NumpyBackend
from decapybara.model import quant
from decapybara.model.batch import ForwardBatch
from decapybara.model.config import ModelConfig

pytestmark = pytest.mark.gpu
NP = NumpyBackend()


def rand(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def assert_close(got, ref, rtol, name):
    """max |got - ref| <= rtol * max |ref|; NaN where the reference has none fails (unwritten output)."""
    got = np.asarray(cp.asnumpy(got) if isinstance(got, cp.ndarray) else got, np.float64)
    ref = np.asarray(cp.asnumpy(ref) if isinstance(ref, cp.ndarray) else ref, np.float64)
    assert got.shape == ref.shape, f"{name}: shape {got.shape}, reference {ref.shape}"
    bad_nan = np.isnan(got) & ~np.isnan(ref)
    if bad_nan.any():
        first = tuple(int(i) for i in np.argwhere(bad_nan)[0])
        raise AssertionError(f"{name}: {int(bad_nan.sum())} of {got.size} NaN (unwritten?), first at {first}; "
                             f"shape {got.shape}")
    scale = max(float(np.nanmax(np.abs(ref))) if ref.size else 0.0, 1e-30)
    err = np.where(np.isnan(ref), 0.0, np.abs(got - ref))
    rel = float(err.max()) / scale if err.size else 0.0
    if rel > rtol:
        bad = np.argwhere(err > rtol * scale)
        i = tuple(int(j) for j in bad[0])
        raise AssertionError(f"{name}: max rel err {rel:.3e} > {rtol:.1e} (max |ref| {scale:.3e}); {len(bad)} of "
                             f"{got.size} off, first at {i}: got {got[i]!r}, ref {ref[i]!r}; shape {got.shape}")
    print(f"{name}: rel err {rel:.2e} (shape {got.shape})")


def assert_bytes_equal(got, ref, name):
    got = cp.asnumpy(got) if isinstance(got, cp.ndarray) else np.asarray(got)
    ref = cp.asnumpy(ref) if isinstance(ref, cp.ndarray) else np.asarray(ref)  # e.g. snapshots: device copies
    assert got.shape == ref.shape and got.dtype == ref.dtype, (
        f"{name}: {got.dtype} {got.shape} vs reference {ref.dtype} {ref.shape}")
    if got.dtype.kind == "f":  # compare bit patterns (NaN poison included)
        got, ref = got.view(f"u{got.dtype.itemsize}"), ref.view(f"u{ref.dtype.itemsize}")
    diff = got != ref
    if diff.any():
        i = tuple(int(j) for j in np.argwhere(diff)[0])
        raise AssertionError(f"{name}: {int(diff.sum())} of {got.size} differ, first at {i}: got {got[i]!r}, "
                             f"ref {ref[i]!r}; shape {got.shape}")


# ---- norms, RoPE, elementwise ------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [16, 128, 1000, 5120])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_and_fused_residual(n, offset):
    rng = np.random.default_rng(n)
    x, r, w = rand(rng, 7, n, scale=3.0), rand(rng, 7, n), rand(rng, n, scale=0.2)
    got = ops.rms_norm(cp.asarray(x), cp.asarray(w), 1e-6, offset)
    assert_close(got, NP.rms_norm(x, w, 1e-6, offset), 1e-5, f"rms_norm n={n}")
    out, h = ops.rms_norm(cp.asarray(x), cp.asarray(w), 1e-6, offset, residual=cp.asarray(r))
    assert_close(h, x + r, 0.0, "residual sum")
    assert_close(out, NP.rms_norm(x + r, w, 1e-6, offset), 1e-5, f"add_rms_norm n={n}")
    # bf16 rows for the products (out_dtype uint16): the float32 rows rounded to nearest even, h unchanged
    out16, h16 = ops.rms_norm(cp.asarray(x), cp.asarray(w), 1e-6, offset, residual=cp.asarray(r),
                              out_dtype=cp.uint16)
    assert_bytes_equal(out16, cp.asnumpy(ops.to_bf16_bits(out)), f"add_rms_norm n={n} in bf16 bits")
    assert_bytes_equal(h16, cp.asnumpy(h), "residual sum beside bf16 rows")
    assert_bytes_equal(ops.rms_norm(cp.asarray(x), cp.asarray(w), 1e-6, offset, out_dtype=cp.uint16),
                       cp.asnumpy(ops.to_bf16_bits(got)), f"rms_norm n={n} in bf16 bits")


@pytest.mark.parametrize("shape", [(5, 4, 16), (9, 48, 128), (1, 3, 256)])
def test_gated_rms_norm(shape):
    rng = np.random.default_rng(sum(shape))
    x, z, w = rand(rng, *shape), rand(rng, *shape, scale=2.0), rand(rng, shape[-1])
    got = ops.gated_rms_norm(cp.asarray(x), cp.asarray(z), cp.asarray(w), 1e-6)
    assert_close(got, NP.gated_rms_norm(x, z, w, 1e-6), 1e-5, f"gated_rms_norm {shape}")


@pytest.mark.parametrize("t,h,d,rot", [(5, 4, 16, 16), (33, 8, 128, 64), (7, 2, 256, 64), (3, 1, 64, 32)])
def test_rope_table_and_positions(t, h, d, rot):
    from decapybara.model.rope import RotaryTable, default_inv_freq

    rng = np.random.default_rng(t * d)
    x = rand(rng, t, h, d)
    positions = np.sort(rng.integers(0, 1_000_000, t)).astype(np.int64)
    table = RotaryTable(default_inv_freq(1e7, rot), 1.0)
    cos, sin = table.cos_sin(positions)
    ref = NP.rope(x, cos, sin, rot)
    assert_close(ops.rope(cp.asarray(x), cp.asarray(cos), cp.asarray(sin), rot), ref, 1e-6, "rope_table")
    inplace = cp.asarray(x)
    ops.rope(inplace, cp.asarray(cos), cp.asarray(sin), rot, out=inplace)
    assert_close(inplace, ref, 1e-6, "rope_table in place")
    factor = 1.25
    cos2, sin2 = RotaryTable(table.inv_freq, factor).cos_sin(positions)
    got = ops.rope_positions(cp.asarray(x), cp.asarray(positions), cp.asarray(table.inv_freq), factor)
    # cosf / sinf vs numpy's float32 cos / sin: a few ulp of the result
    assert_close(got, NP.rope(x, cos2, sin2, rot), 1e-5, "rope_pos")


@pytest.mark.parametrize("n", [1, 1000, 12345])
def test_elementwise(n):
    rng = np.random.default_rng(n)
    a, b = rand(rng, n, scale=4.0), rand(rng, n)
    assert_close(ops.silu_mul(cp.asarray(a), cp.asarray(b)), NP.silu_mul(a, b), 1e-6, "silu_mul")
    assert_close(ops.sigmoid(cp.asarray(a)), NP.sigmoid(a), 1e-6, "sigmoid")
    assert_close(ops.sigmoid_mul(cp.asarray(b), cp.asarray(a)), b * NP.sigmoid(a), 1e-6, "sigmoid_mul")


@pytest.mark.parametrize("rows,n", [(1, 1), (3, 1000), (12, 8704), (5, 1030), (300, 2052)])
def test_silu_mul_halves_in_float32_and_bf16_bits(rows, n):
    """Widths that are multiples of 4 take silu_mul_halves4 (4 columns a thread): the bits of the one-element
    kernel, launched directly here, in float32 and bf16 bits; other widths take that kernel."""
    rng = np.random.default_rng(rows * n)
    y = rand(rng, rows, 2 * n, scale=4.0)
    got = ops.silu_mul_halves(cp.asarray(y))
    assert_close(got, NP.silu_mul(y[:, :n], y[:, n:]), 1e-6, "silu_mul_halves")
    bits = ops.silu_mul_halves(cp.asarray(y), out_dtype=cp.uint16)
    assert_bytes_equal(bits, cp.asnumpy(ops.to_bf16_bits(got)), "silu_mul_halves in bf16 bits")
    for out_bf16, want in ((0, got), (1, bits)):
        one = ops.empty((rows, n), cp.uint16 if out_bf16 else cp.float32)
        ops._k("silu_mul_halves")((ops.grid_for(one.size),), (ops.THREADS,),
                                  (cp.asarray(y), one, ops.I64(rows), ops.I32(n), ops.I32(out_bf16)))
        assert_bytes_equal(want, cp.asnumpy(one), f"one element a thread, out_bf16={out_bf16}")


def test_bf16_rounding_is_exact():
    rng = np.random.default_rng(0)
    x = rand(rng, 100_001, scale=1e3)
    x[:4] = [np.inf, -np.inf, 0.0, -0.0]
    bits = ops.to_bf16_bits(cp.asarray(x))
    assert_bytes_equal(bits, f32_to_bf16_bits(x), "f32 -> bf16")
    back = ops.bf16_bits_to_f32(bits)
    assert_bytes_equal(back.view(cp.uint32), (f32_to_bf16_bits(x).astype(np.uint32) << 16), "bf16 -> f32")
    table = f32_to_bf16_bits(rand(rng, 50, 24))
    ids = rng.integers(0, 50, 13).astype(np.int64)
    got = ops.embed_bf16(cp.asarray(table), cp.asarray(ids))
    assert_close(got, (table[ids].astype(np.uint32) << 16).view(np.float32), 0.0, "embed_bf16")


@pytest.mark.parametrize("fmt", sorted(quant.FORMATS))
@pytest.mark.parametrize("shape", [(7, 50), (3, 5, 64), (1, 32), (130, 288)])
def test_weight_dequantisation_is_exact(fmt, shape):
    rng = np.random.default_rng(len(fmt) * 31 + shape[-1])
    w = rand(rng, *shape) * np.exp(rng.uniform(-4, 4, shape[:-1] + (1,))).astype(np.float32)
    q = quant.quantize(w, fmt)
    ref = quant.dequantize(q)
    assert_bytes_equal(ops.dequantize(q, bf16=False), ref, f"{fmt} -> f32")
    assert_bytes_equal(ops.dequantize(q, bf16=True), f32_to_bf16_bits(ref), f"{fmt} -> bf16")


@pytest.mark.parametrize("t,n,k", [(1, 64, 64), (3, 100, 72), (37, 513, 1000), (12, 5120, 5120)])
def test_gemm_bf16(t, n, k):
    rng = np.random.default_rng(t + n + k)
    x, w = rand(rng, t, k), rand(rng, n, k, scale=k ** -0.5)
    xb, wb = f32_to_bf16_bits(x), f32_to_bf16_bits(w)
    ref = (xb.astype(np.uint32) << 16).view(np.float32).astype(np.float64) @ (
        (wb.astype(np.uint32) << 16).view(np.float32).astype(np.float64)).T
    got = ops.gemm_bf16(cp.asarray(xb), cp.asarray(wb))
    assert_close(got, ref, 1e-5, f"gemm_bf16 {t}x{n}x{k}")


# ---- KV pages ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("view", [False, True])
@pytest.mark.parametrize("bits", [32, 16, 8, 6, 4])
@pytest.mark.parametrize("d", [16, 64, 128, 256])
def test_kv_write_matches_codec_bytes(bits, d, view):
    """Quantised in the kernel exactly as quant.quantize_kv: same scales, rounding and packed bytes. With `view`
    x is read in place as the value columns of a fused q|k|v product (rows of D contiguous, tokens a row of the
    product apart); without, a C-contiguous array."""
    rng = np.random.default_rng(bits * 1000 + d)
    pages, page_size, heads, t = 6, 16, 3, 37
    codec = codec_for({32: None, 16: "16/16"}.get(bits, f"{bits}/{bits}"))
    store = {}
    for name, (pshape, dtype) in codec.parts(d, "k").items():
        fill = np.nan if np.dtype(dtype).kind == "f" else 0xAB
        store[name] = cp.asarray(np.full((pages, page_size, heads) + pshape, fill, dtype))
    before = {name: cp.asnumpy(a) for name, a in store.items()}
    x = rand(rng, t, heads, d) * np.exp(rng.uniform(-8, 8, (t, heads, 1))).astype(np.float32)
    x[0, 0, :5] = 0.0  # a block with zeros and, below, an all-zero vector
    x[1, 1] = 0.0
    slots = rng.permutation(pages * page_size)[:t].astype(np.int64)  # unique, across page boundaries
    codes = store.get("x", store.get("codes"))
    x_dev = cp.asarray(x)
    if view:  # [T, q | k | v] with x as v, the columns around it poisoned
        prod = cp.asarray(np.full((t, 3 * heads * d + heads * d), np.nan, np.float32))
        prod[:, -heads * d:] = x_dev.reshape(t, heads * d)
        x_dev = prod[:, -heads * d:].reshape(t, heads, d)
        assert not x_dev.flags.c_contiguous and x_dev.strides[0] == prod.strides[0]
    write_kv(codes, store.get("scales", cp.zeros(1, cp.uint8)), bits, x_dev, cp.asarray(slots))
    ref = codec.encode(x, "k")
    pg, off = slots // page_size, slots % page_size
    for name, a in store.items():
        got = cp.asnumpy(a)
        assert_bytes_equal(got[pg, off], ref[name], f"{bits}-bit {name} d={d}")
        untouched = np.ones(got.shape[:2], bool)
        untouched[pg, off] = False
        assert_bytes_equal(got[untouched], before[name][untouched], f"{bits}-bit {name} untouched slots")


# ---- attention -----------------------------------------------------------------------------------------
def attn_config(nq: int, nkv: int, d: int) -> ModelConfig:
    return ModelConfig(model_type="qwen3", vocab_size=16, hidden_size=16, num_hidden_layers=1,
                       num_attention_heads=nq, num_key_value_heads=nkv, head_dim=d,
                       layer_types=("full_attention",))


def run_attention_steps(cfg, kv_mode, steps, page_size, num_pages, splits=None, seed=0, fill_first=False,
                        rtol=2e-5):
    """Drive numpy and cupy paged attention through the same calls; each step lists new tokens per sequence.
    With `fill_first` the first step only writes K/V (long contexts without a quadratic numpy reference)."""
    rng = np.random.default_rng(seed)
    nq, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    cub = CupyBackend("fp32", attention_splits=splits)
    np_kv = NP.new_kv_cache(cfg, num_pages, page_size, kv_mode)
    cu_kv = cub.new_kv_cache(cfg, num_pages, page_size, kv_mode)
    nseq = len(steps[0])
    total = [sum(step[i] for step in steps) for i in range(nseq)]
    perm = rng.permutation(num_pages)
    tables, used = [], 0
    for n in total:
        need = -(-n // page_size)
        tables.append(perm[used:used + need].astype(np.int32))
        used += need
    assert used <= num_pages, f"test needs {used} pages"
    ctx = [0] * nseq
    for si, step in enumerate(steps):
        chunks = [(np.zeros(n, np.int64), ctx[i], tables[i], None) for i, n in enumerate(step) if n]
        batch = ForwardBatch.build(chunks, page_size, logits="none")
        t = batch.num_tokens
        q, k, v = rand(rng, t, nq, d), rand(rng, t, nkv, d), rand(rng, t, nkv, d, scale=2.0)
        if fill_first and si == 0:
            np_kv.write(0, batch.slot_mapping, k, v)
            cu_kv.write(0, cp.asarray(batch.slot_mapping), cp.asarray(k), cp.asarray(v))
        else:
            ref = NP.paged_attention(np_kv, 0, q, k, v, batch, d ** -0.5)
            got = cub.paged_attention(cu_kv, 0, cp.asarray(q), cp.asarray(k), cp.asarray(v), batch, d ** -0.5)
            assert_close(got, ref, rtol, f"attention step {si} (T={t}, {kv_mode or '32/32'}, d={d}, {nq}/{nkv}, "
                                         f"splits={splits})")
        ctx = [c + n for c, n in zip(ctx, step)]
    pages = np.concatenate(tables)
    a, b = np_kv.export_pages(pages), cu_kv.export_pages(pages)
    assert sorted(a.arrays) == sorted(b.arrays)
    for key in a.arrays:  # the same bytes: written by the kernel exactly as the codec encodes
        assert_bytes_equal(b.arrays[key], a.arrays[key], f"exported page part {key}")


@pytest.mark.parametrize("kv_mode", [None, "16/16", "8/8", "6/4", "4/4"])
@pytest.mark.parametrize("nq,nkv,d", [(4, 4, 64), (8, 2, 128), (24, 4, 256), (12, 1, 64), (4, 2, 16)])
def test_attention_prefill_chunks_then_decode(kv_mode, nq, nkv, d):
    """Odd lengths, page boundaries, GQA ratios 1..12, contexts from earlier chunks, then decode steps."""
    steps = [[1, 17, 40], [5, 1, 33], [1, 1, 1], [1, 1, 1]]
    run_attention_steps(attn_config(nq, nkv, d), kv_mode, steps, page_size=16, num_pages=24, seed=nq + d)


@pytest.mark.parametrize("splits", [None, 3])
@pytest.mark.parametrize("kv_mode", [None, "6/4"])
def test_attention_decode_twelve_sequences_split_k(splits, kv_mode):
    """12 sequences decoding over long contexts: split-K partials and the reduce kernel."""
    rng = np.random.default_rng(7)
    prompt = [int(n) for n in rng.integers(300, 2500, 12)]
    steps = [prompt, [1] * 12, [1] * 12]
    run_attention_steps(attn_config(24, 4, 256), kv_mode, steps, page_size=64, num_pages=512, splits=splits,
                        fill_first=True)


def record_kernels(monkeypatch, module) -> list:
    """The (function, defines) of every kernel `module` gets from kernels.get_kernel from now on."""
    launched = []
    get = module.get_kernel
    monkeypatch.setattr(module, "get_kernel",
                        lambda m, f, defs=(): launched.append((f, dict(defs))) or get(m, f, defs))
    return launched


def run_decode_kernel(monkeypatch, kv_mode, heads, shape, mx):
    """Decode steps over contexts of 1-300 keys (forced and planned splits) with the decode kernel's launch
    shape (warps, stages) set; one score chain for the (1, 2) shape. Returns the decode launches' defines."""
    from decapybara.backend import cupy_attention as ca
    nq, nkv, d, page_size = heads
    monkeypatch.setitem(ca.DECODE, "mx_warps" if mx else "warps", shape[0])
    monkeypatch.setitem(ca.DECODE, "mx_stages" if mx else "stages", shape[1])
    monkeypatch.setitem(ca.DECODE, "chains", 1 if shape == (1, 2) else 2)
    launched = record_kernels(monkeypatch, ca)
    steps = [[1, 17, 40, 300], [1, 1, 1, 1], [1, 1, 1, 1]]
    for splits in (None, 3):
        run_attention_steps(attn_config(nq, nkv, d), kv_mode, steps, page_size, num_pages=420 // page_size + 8,
                            splits=splits, seed=d + nq + page_size)
    name = "paged_decode_attention_mx" if mx else "paged_decode_attention"
    return [defs for f, defs in launched if f == name]


@pytest.mark.parametrize("shape", [(4, 3), (2, 4), (8, 2), (1, 2)])
@pytest.mark.parametrize("heads", [(24, 4, 256, 64), (8, 1, 128, 16), (4, 4, 64, 5), (16, 2, 256, 7)])
def test_decode_attention_tensor_cores(monkeypatch, shape, heads):
    """decapybara/kernels/attn_decode.cu (bf16 pages, one new token per sequence, g <= 8) against numpy at float32
    tolerance: contexts of one key, partial last tiles, pages of 5 or 7 keys splitting tiles, forced and
    planned splits, every launch shape (warps x stages), one or two accumulator chains for the scores."""
    from decapybara.backend import cupy_attention as ca
    dec = run_decode_kernel(monkeypatch, "16/16", heads, shape, mx=False)
    d = heads[2]
    want, limit = ca.decode_shape(d), ca._smem_optin()
    if limit >= 227 * 1024:  # Hopper's: 8 warps x 2 stages of 16 KB tiles (d = 256) exceed 227 KB: 4 x 2
        assert want == (shape if shape[0] * shape[1] * 64 * d <= 227 * 1024 else (shape[0] // 2, shape[1]))
    else:  # less shared memory a block (an L40S's 99 KB): the shape asked where it fits, else one no larger that does
        fits = ca.decode_smem(d, 16, 16, *shape) <= limit
        assert want == shape if fits else (ca.decode_smem(d, 16, 16, *want) <= limit
                                           and want[0] <= shape[0] and want[1] <= shape[1] and want != shape)
    assert dec and all((defs["DEC_WARPS"], defs["DEC_STAGES"]) == want for defs in dec), dec


MX_DECODE_CASES = [("8/8", (24, 4, 256, 64), (8, 3)), ("6/6", (8, 1, 128, 16), (4, 2)),
                   ("6/4", (16, 2, 256, 7), (2, 3)), ("4/4", (4, 4, 128, 5), (1, 2)),
                   ("4/8", (24, 4, 256, 64), (4, 3)), ("8/6", (8, 2, 128, 7), (8, 2)),
                   ("4/4", (24, 4, 256, 512), (8, 3)), ("6/4", (8, 1, 128, 64), (8, 3))]


@pytest.mark.parametrize("kv_mode,heads,shape", MX_DECODE_CASES)
def test_decode_attention_microscaled_pages(monkeypatch, kv_mode, heads, shape):
    """decapybara/kernels/attn_decode.cu's paged_decode_attention_mx: every key and value format (8 / 6 / 4 bits),
    head_dim 128 and 256, g 1-8, pages of 5, 7, 16, 64 and 512 keys, forced and planned splits, several launch shapes
    and one or two score chains, against numpy over the same quantised pages at float32 tolerance (the
    dequantised codes are exact in bf16)."""
    from decapybara.backend import cupy_attention as ca
    dec = run_decode_kernel(monkeypatch, kv_mode, heads, shape, mx=True)
    d = heads[2]
    kb, vb = (int(b) for b in kv_mode.split("/"))
    want = ca.decode_shape(d, kb, vb)
    assert want is not None and want[0] <= shape[0] and want[1] <= shape[1]
    assert dec and all((defs["DEC_WARPS"], defs["DEC_STAGES"], defs["KBITS"], defs["VBITS"]) == (*want, kb, vb)
                       for defs in dec), dec
    assert ca.decode_smem(d, kb, vb, *want) <= ca._smem_optin()


def test_decode_shape_rules(monkeypatch):
    """Which pages take the decode kernel, and launch shapes lowered to fit the shared memory (at least the two
    stages the microscaled kernel needs)."""
    from decapybara.backend import cupy_attention as ca
    monkeypatch.setitem(ca.DECODE, "mx_stages", 1)
    assert ca.decode_shape(256, 8, 8)[1] == 2
    monkeypatch.setitem(ca.DECODE, "mx_stages", 3)
    assert ca.decode_shape(64, 16, 16) is not None and ca.decode_shape(64, 8, 8) is None  # mx: 128 / 256 only
    assert ca.decode_shape(256, 16, 8) is None and ca.decode_shape(96, 16, 16) is None
    for kb in (8, 6, 4):
        for vb in (8, 6, 4):
            w, s = ca.decode_shape(256, kb, vb)
            smem = ca.decode_smem(256, kb, vb, w, s)
            assert s >= 2 and smem <= ca._smem_optin() and 32 * w * 258 <= smem


@pytest.mark.parametrize("kv_mode", ["16/16", "6/4", "8/8"])
def test_decode_attention_long_context_and_off_switch(monkeypatch, kv_mode):
    """5k- and 2k-key decodes match numpy to float32 tolerance through the tensor-core kernel and through the
    general kernel (DECODE off)."""
    from decapybara.backend import cupy_attention as ca
    steps = [[5000, 2100], [1, 1], [1, 1]]
    for on in (True, False):
        monkeypatch.setitem(ca.DECODE, "enabled", on)
        run_attention_steps(attn_config(24, 4, 256), kv_mode, steps, page_size=512, num_pages=16, seed=11,
                            fill_first=True)


PREFILL_TC_CASES = [("16/16", (24, 4, 256, 64)), ("16/16", (8, 2, 128, 16)), ("16/16", (4, 4, 64, 5)),
                    ("16/16", (12, 1, 16, 7)), ("8/8", (24, 4, 256, 64)), ("6/4", (8, 1, 128, 16)),
                    ("4/4", (4, 2, 64, 7)), ("4/8", (24, 4, 256, 512))]


@pytest.mark.parametrize("wg,warps,stages,overlap", [(1, 4, 1, 0), (0, 4, 1, 0), (1, 8, 1, 0), (0, 8, 1, 0),
                                                     (1, 8, 2, 0), (0, 8, 2, 0), (1, 8, 3, 0), (0, 8, 3, 0),
                                                     (1, 8, 3, 1)])
@pytest.mark.parametrize("tile", [(64, 1), (32, 1), (64, 0)])
@pytest.mark.parametrize("kv_mode,heads", PREFILL_TC_CASES)
def test_prefill_attention_tensor_cores(monkeypatch, kv_mode, heads, tile, wg, warps, stages, overlap):
    """decapybara/kernels/attn_prefill.cu's paged_prefill_attention_tc (bf16 and microscaled pages): prefill chunks over
    earlier chunks' keys, partial key tiles, pages of 5 / 7 keys splitting tiles, mixed steps of chunks and
    decode rows, forced and planned splits, 32- and 64-key tiles, against numpy; its warpgroup-MMA build (wg,
    on Hopper for head_dim 64 / 128 / 256, swizzled tiles) and its mma.sync build, CTAs of 4 and 8 warps, one
    (K, V) pair or a ring of two or three (fewer where they do not fit), the wgmma build's overlapped loop. q and P as two bf16 terms (split) keep
    float32 tolerance; one term each is within bf16 tolerance. (Pure decode steps take the decode kernel or
    the general one: tested above.)"""
    from decapybara import kernels
    from decapybara.backend import cupy_attention as ca
    nq, nkv, d, page_size = heads
    monkeypatch.setitem(ca.PREFILL, "block_n", tile[0])
    monkeypatch.setitem(ca.PREFILL, "block_n_wide", tile[0])
    monkeypatch.setitem(ca.PREFILL, "split", tile[1])
    monkeypatch.setitem(ca.PREFILL, "wg", wg)
    monkeypatch.setitem(ca.PREFILL, "warps", warps)
    monkeypatch.setitem(ca.PREFILL, "stages", stages)
    monkeypatch.setitem(ca.PREFILL, "mx_stages", stages)
    monkeypatch.setitem(ca.PREFILL, "overlap", overlap)
    monkeypatch.setitem(ca.PREFILL, "dequant_tokens", 0)  # microscaled pages decoded by the kernel (below: scratch)
    want_wg = int(bool(wg) and d in (64, 128, 256) and kernels.sm90a_ok())
    launched = record_kernels(monkeypatch, ca)
    steps = [[1, 17, 40, 300], [70, 1, 130, 5], [2, 1, 1, 1]]
    for splits in (None, 3):
        run_attention_steps(attn_config(nq, nkv, d), kv_mode, steps, page_size, num_pages=560 // page_size + 8,
                            splits=splits, seed=d + nq + page_size, rtol=2e-5 if tile[1] else 2e-2)
    tc = [defs for f, defs in launched if f == "paged_prefill_attention_tc"]
    kb, vb = (int(b) for b in kv_mode.split("/"))
    want = ca.prefill_launch(d, (kb, vb))  # the settings, or fewer stages / warps where they do not fit
    limit = ca._smem_optin()
    assert want.wg == want_wg
    assert want.warps == warps or ca.prefill_smem(d, *tile, want.wg, warps, 1) > limit
    assert want.stages == stages or ca.prefill_smem(d, *tile, want.wg, want.warps, stages) > limit
    assert tc and all((defs["TC_BLOCK_N"], defs["TC_SPLIT"], defs["KBITS"], defs["VBITS"], defs["ROWS_PER_WARP"],
                       defs.get("PREFILL_WG", 0), defs.get("TC_WARPS", 4), defs.get("TC_STAGES", 1),
                       defs.get("TC_OVERLAP", 0)) == (*tile, kb, vb, 16, *want[2:], int(ca.prefill_overlap(want)))
                      for defs in tc), tc
    assert not any(f == "paged_attention_fwd" for f, _ in launched)


@pytest.mark.parametrize("kv_mode,heads", [("6/4", (24, 4, 256, 64)), ("8/8", (8, 2, 128, 16)),
                                           ("4/4", (4, 2, 64, 7)), ("4/8", (24, 4, 256, 512))])
def test_prefill_attention_dequant_pages(monkeypatch, kv_mode, heads):
    """Prefill plans over microscaled pages whose chunks first decode the pages they read into bf16 scratch pages
    (kv_pages_bf16) and run the bf16 pages' build, the other sequences (short chunks; decode rows where the decode
    kernel does not take them) in a second launch over the pages: against numpy through prefill chunks, mixed
    steps and forced splits, every sequence through the scratch or only chunks of 16+ tokens; the same bits as
    the kernel decoding each tile itself at the same launch shape, also when the scratch cannot be allocated;
    pages shared by two sequences decoded once; the rule and the size cap."""
    from decapybara.backend import cupy_attention as ca
    nq, nkv, d, page_size = heads
    kb, vb = (int(b) for b in kv_mode.split("/"))
    cfg = attn_config(nq, nkv, d)
    rows = ca.decode_launch(nq // nkv, d, (kb, vb)) is not None  # the decode kernel takes mixed steps' decode rows
    steps = [[1, 17, 40, 300], [70, 1, 130, 5], [2, 1, 1, 1]]
    for least in (1, 16):  # every sequence through the scratch; the chunks of 16+ tokens
        monkeypatch.setitem(ca.PREFILL, "dequant_tokens", least)
        launched = record_kernels(monkeypatch, ca)
        for splits in (None, 3):
            run_attention_steps(cfg, kv_mode, steps, page_size, num_pages=560 // page_size + 8, splits=splits,
                                seed=d + nq + page_size + 1)
        tc = [(defs["KBITS"], defs["VBITS"]) for f, defs in launched if f == "paged_prefill_attention_tc"]
        dq = [(defs["KBITS"], defs["VBITS"]) for f, defs in launched if f == "kv_pages_bf16"]
        assert set(dq) == {(kb, vb)} and tc.count((16, 16)) == len(dq), (tc, dq)
        # per run of the steps: three scratch launches (least 1); or two, beside the short runs' launches over
        # the pages (least 16: the 5 and the 2 tokens of steps 2 and 3; the last step has no chunk of 16), and
        # the decode rows', unless the decode kernel takes them (one launch in every step)
        want = {(16, 16): 6} if least == 1 else {(16, 16): 4, (kb, vb): 4 if rows else 6}
        assert {k: tc.count(k) for k in set(tc)} == want, tc
        assert sum(f == "paged_decode_attention_mx" for f, _ in launched) == (6 if rows else 0)

    # the same launch shape both ways: bit-identical outputs
    for key, val in (("stages", 1), ("mx_stages", 1), ("overlap", 0)):
        monkeypatch.setitem(ca.PREFILL, key, val)
    rng = np.random.default_rng(d + kb)
    npages = 700 // page_size + 8
    kv = CupyBackend("fp32").new_kv_cache(cfg, npages, page_size, kv_mode)
    slots = cp.arange(npages * page_size, dtype=cp.int64)
    kv.write(0, slots, cp.asarray(rand(rng, len(slots), nkv, d)), cp.asarray(rand(rng, len(slots), nkv, d, scale=2.0)))
    shared = -(-300 // page_size)  # two sequences over the same first 300 keys (a reused prefix), then their own
    perm = rng.permutation(npages).astype(np.int32)
    ta = perm[:-(-650 // page_size)]
    tb = np.concatenate([ta[:shared], perm[len(ta):len(ta) + -(-350 // page_size) - shared]])
    td = perm[npages - -(-120 // page_size):]  # a decode row beside them (its pages may be theirs: read alike)
    batch = ForwardBatch.build([(np.zeros(250, np.int64), 400, ta, None), (np.zeros(50, np.int64), 300, tb, None),
                                (np.zeros(1, np.int64), 119, td, None)], page_size, logits="none")
    q = cp.asarray(rand(rng, batch.num_tokens, nq, d))

    def run(plan):
        return cp.asnumpy(ca.attention(q, kv.parts(0, "k"), kv.parts(0, "v"), plan, nkv, page_size, d ** -0.5))

    outs = {}
    for least, used in ((0, None), (16, [ta, tb]), (1, [ta, tb] if rows else [ta, tb, td])):
        monkeypatch.setitem(ca.PREFILL, "dequant_tokens", least)
        plan = ca.plan_attention(batch, nq, nkv, d, kv_bits=(kb, vb))
        if used is None:
            assert plan.dequant is None
        else:
            assert plan.dequant.npages == len(np.unique(np.concatenate(used)))  # shared pages decoded once
            assert list(plan.dequant.chunks) == [True, True, least == 1 and not rows]
            assert (plan.rows is not None) == rows
            work = cp.asnumpy(plan.work)
            first = plan.dequant.chunks[work[:plan.dequant.num_work, 0]]
            assert first.all() and not plan.dequant.chunks[work[plan.dequant.num_work:, 0]].any()
        outs[least] = run(plan)
    assert np.isfinite(outs[0]).all()
    for least in (16, 1):
        assert np.array_equal(outs[least].view(np.uint32), outs[0].view(np.uint32)), least

    def no_room(*args):
        raise cp.cuda.memory.OutOfMemoryError(1 << 40, 0)

    with monkeypatch.context() as m:
        m.setattr(ca, "scratch_kv", no_room)  # the scratch not allocated: the kernel decodes every tile
        launched.clear()
        got = run(ca.plan_attention(batch, nq, nkv, d, kv_bits=(kb, vb)))
    assert np.array_equal(got.view(np.uint32), outs[0].view(np.uint32))
    assert [(defs["KBITS"], defs["VBITS"]) for f, defs in launched if f == "paged_prefill_attention_tc"] == [(kb, vb)]

    # past the cap: the chunks' keys in windows of whole pages and 32-key tiles, each within the cap
    unit = math.lcm(page_size, 32)
    cap = 2 * unit // page_size  # pages: windows of `unit` keys for the two chunks
    with monkeypatch.context() as m:
        m.setitem(ca.PREFILL, "dequant_tokens", 16)
        m.setitem(ca.PREFILL, "dequant_mb", 4 * cap * page_size * nkv * d / 2 ** 20)
        launched.clear()
        plan = ca.plan_attention(batch, nq, nkv, d, kv_bits=(kb, vb))
        dq = plan.dequant
        over = len(np.unique(np.concatenate([ta, tb]))) > cap  # pages the chunks read (pages of 512: 2, no windows)
        assert dq.window == (unit if over else 0) and len(dq.windows) == (-(-650 // unit) if over else 1)
        assert dq.npages <= cap
        work = cp.asnumpy(plan.work)
        assert [w.begin for w in dq.windows] == [0] + [w.end for w in dq.windows[:-1]]
        assert dq.windows[-1].end == dq.num_work and dq.chunks[work[:dq.num_work, 0]].all()
        for i, w in enumerate(dq.windows):  # each window's items: its keys only, the pages they read
            items = work[w.begin:w.end]
            if over:
                assert (items[:, 2] // unit == i).all() and ((items[:, 3] - 1) // unit == i).all(), (i, items)
            tables, src = cp.asnumpy(w.block_tables), cp.asnumpy(w.src)
            for seq, _, begin, end, _ in items:
                pages = np.arange(begin // page_size, (end - 1) // page_size + 1)
                assert (src[tables[seq, pages]] == batch.seqs[seq].block_table[pages]).all()
        got = run(plan)
        dq_calls = [f for f, _ in launched if f == "kv_pages_bf16"]
        assert len(dq_calls) == len(dq.windows)
        m.setattr(ca, "scratch_kv", no_room)  # windowed items over the pages themselves
        fallback = run(ca.plan_attention(batch, nq, nkv, d, kv_bits=(kb, vb)))
    assert_close(got, outs[0], 2e-5, f"windowed scratch ({kv_mode}, page {page_size})")
    assert_close(fallback, outs[0], 2e-5, f"windowed plan, no scratch ({kv_mode}, page {page_size})")

    # the rule: chunks of PREFILL "dequant_tokens" new tokens or more; their scratch at most "dequant_mb"
    monkeypatch.setitem(ca.PREFILL, "dequant_tokens", 16)
    short = ForwardBatch.build([(np.zeros(15, np.int64), 300, ta, None), (np.zeros(1, np.int64), 600, ta, None)],
                               page_size, logits="none")
    assert ca.plan_attention(short, nq, nkv, d, kv_bits=(kb, vb)).dequant is None
    chunk = ForwardBatch.build([(np.zeros(16, np.int64), 300, ta, None), (np.zeros(1, np.int64), 600, ta, None)],
                               page_size, logits="none")
    assert ca.plan_attention(chunk, nq, nkv, d, kv_bits=(kb, vb)).dequant.npages == -(-316 // page_size)
    scratch = 4 * -(-316 // page_size) * page_size * nkv * d  # bytes, K and V
    monkeypatch.setitem(ca.PREFILL, "dequant_mb", scratch / 2 ** 20)
    dq = ca.plan_attention(chunk, nq, nkv, d, kv_bits=(kb, vb)).dequant
    assert dq.window == 0 and len(dq.windows) == 1
    monkeypatch.setitem(ca.PREFILL, "dequant_mb", (scratch - 1) / 2 ** 20)  # a page short: windows, or none
    cdiv = ca.cdiv
    most = (cdiv(316, page_size) - 1) * page_size // unit * unit  # keys a window may have: then equal windows
    window = cdiv(cdiv(316, cdiv(316, most)), unit) * unit if most else 0
    dq = ca.plan_attention(chunk, nq, nkv, d, kv_bits=(kb, vb)).dequant
    assert dq is None if window == 0 else (dq.window == window and len(dq.windows) == cdiv(316, most)), (window, dq)


@pytest.mark.parametrize("kv_mode,heads", [("6/4", (24, 4, 256, 64)), ("16/16", (8, 2, 128, 16)),
                                           ("8/8", (4, 1, 128, 32)), ("4/4", (4, 2, 64, 16))])
def test_mixed_step_decode_rows(monkeypatch, kv_mode, heads):
    """A mixed step's decode rows run the decode kernel, planned as the pure decode step of the same sequences:
    their outputs are that step's bit for bit, and the chunks' rows those of the step without the decode rows
    (the same prefill plan); the whole step matches numpy, and with DECODE "mixed" off (every row through the
    prefill kernel) agrees within float32 rounding. Where the decode kernel does not take the pages (microscaled
    at head_dim 64) the prefill kernel keeps them."""
    from decapybara.backend import cupy_attention as ca
    nq, nkv, d, page_size = heads
    kb, vb = (int(b) for b in kv_mode.split("/"))
    cfg = attn_config(nq, nkv, d)
    rng = np.random.default_rng(d + nq + kb)
    lens = {"chunk": (300, 200), "short": (5, 90), "d1": (1, 118), "d2": (1, 700), "d3": (1, 2500)}  # new, cached
    names = list(lens)
    npages = sum(-(-(n + c) // page_size) for n, c in lens.values())
    perm, at, tables = rng.permutation(npages).astype(np.int32), 0, {}
    for name, (n, ctx) in lens.items():
        tables[name] = perm[at:at + -(-(n + ctx) // page_size)]
        at += len(tables[name])

    def batch_of(which, cached=False):  # the sequences' new tokens; `cached`: their cached ones instead
        return ForwardBatch.build([(np.zeros(lens[n][1] if cached else lens[n][0], np.int64),
                                    0 if cached else lens[n][1], tables[n], None) for n in which],
                                  page_size, logits="none")

    np_kv = NP.new_kv_cache(cfg, npages, page_size, kv_mode)
    kv = CupyBackend("fp32").new_kv_cache(cfg, npages, page_size, kv_mode)
    mixed = batch_of(names)
    for batch in (batch_of(names, cached=True), mixed):  # the cached keys, then the step's own
        k, v = rand(rng, batch.num_tokens, nkv, d), rand(rng, batch.num_tokens, nkv, d, scale=2.0)
        kv.write(0, cp.asarray(batch.slot_mapping), cp.asarray(k), cp.asarray(v))
        if batch is not mixed:
            np_kv.write(0, batch.slot_mapping, k, v)
    q = rand(rng, mixed.num_tokens, nq, d)
    ref = NP.paged_attention(np_kv, 0, q, k, v, mixed, d ** -0.5)  # writes the step's keys as the kernel did
    rows = {n: np.arange(s.start, s.start + s.length) for n, s in zip(names, mixed.seqs)}
    decoding, chunks = ["d1", "d2", "d3"], ["chunk", "short"]

    def run(which):
        batch = batch_of(which)
        plan = ca.plan_attention(batch, nq, nkv, d, kv_bits=(kb, vb))
        qq = cp.asarray(q[np.concatenate([rows[n] for n in which])])
        return plan, cp.asnumpy(ca.attention(qq, kv.parts(0, "k"), kv.parts(0, "v"), plan, nkv, page_size,
                                             d ** -0.5))

    takes = ca.decode_launch(nq // nkv, d, (kb, vb)) is not None
    launched = record_kernels(monkeypatch, ca)
    plan, got = run(names)
    assert (plan.rows is not None) == takes and plan.decode is None and plan.prefill is not None
    assert sum(f.startswith("paged_decode_attention") for f, _ in launched) == int(takes)
    if takes:
        assert plan.rows.decode == ca.decode_launch(nq // nkv, d, (kb, vb)) and plan.rows.prefill is None
        assert sorted(set(cp.asnumpy(plan.rows.work)[:, 0])) == [2, 3, 4]  # indices of the batch's sequences
        assert sorted(set(cp.asnumpy(plan.work)[:, 0])) == [0, 1]
        assert plan.rows.num_reduce > 0  # the 2,500-key row is split: its own parts and reduce
        for which in (decoding, chunks):
            _, alone = run(which)
            part = np.concatenate([rows[n] for n in which])
            assert np.array_equal(got[part].view(np.uint32), alone.view(np.uint32)), which
    assert_close(got, ref, 2e-5, f"mixed step against numpy ({kv_mode})")
    monkeypatch.setitem(ca.DECODE, "mixed", 0)
    plan, off = run(names)
    assert plan.rows is None
    assert_close(got, off, 2e-5, "mixed step: decode rows in the decode kernel against the prefill kernel")


@pytest.mark.parametrize("kv_mode", ["16/16", "6/4"])
def test_prefill_attention_long_prefix_and_off_switch(monkeypatch, kv_mode):
    """A 700-token chunk over a 3,000-key prefix and a 40-token chunk over 5,000 (split over the SMs) match
    numpy through the tensor-core kernel and through the general kernel (PREFILL off); float32 pages never
    take the tensor-core kernel."""
    from decapybara.backend import cupy_attention as ca
    steps = [[3000, 5000], [700, 40], [1, 1]]
    for on in (True, False):
        monkeypatch.setitem(ca.PREFILL, "enabled", on)
        launched = record_kernels(monkeypatch, ca)
        run_attention_steps(attn_config(24, 4, 256), kv_mode, steps, page_size=512, num_pages=24, seed=5,
                            fill_first=True)
        names = {f for f, _ in launched}
        assert ("paged_prefill_attention_tc" in names) == on and ("paged_attention_fwd" in names) != on, names
    monkeypatch.setitem(ca.PREFILL, "enabled", True)
    assert ca.prefill_launch(256, (16, 16)) is not None and ca.prefill_launch(256, (32, 32)) is None
    assert ca.prefill_launch(96, (16, 16)) is not None and ca.prefill_launch(72, (16, 16)) is None
    assert ca.prefill_launch(256, None) is None and ca.prefill_smem(256, 32, 1) <= 100 * 1024
    assert ca.prefill_smem(256, 32, 1, 1) == 97 * 1024 and ca.prefill_smem(256, 32, 1, 0, 8, 2) <= 227 * 1024


def test_attention_single_long_sequence_split_k():
    steps = [[3000], [1], [4]]
    run_attention_steps(attn_config(8, 2, 128), "8/8", steps, page_size=32, num_pages=128, seed=3, fill_first=True)


# ---- DeltaNet -------------------------------------------------------------------------------------------
def dn_config(hk, hv, dk, dv) -> ModelConfig:
    return ModelConfig(model_type="qwen3_5_text", vocab_size=16, hidden_size=16, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                       layer_types=("linear_attention",), linear_num_key_heads=hk, linear_num_value_heads=hv,
                       linear_key_head_dim=dk, linear_value_head_dim=dv, linear_conv_kernel_dim=4)


def dn_params(backend, cfg, rng):
    from decapybara.backend.base import DeltaNetParams

    c, hv = cfg.linear_conv_dim, cfg.linear_num_value_heads
    w = rand(rng, c, cfg.linear_conv_kernel_dim, scale=0.5)
    a_log = np.log(rng.uniform(1.0, 16.0, hv)).astype(np.float32)
    dt = (rng.standard_normal(hv) * 0.5 + 1.0).astype(np.float32)
    up = backend.from_host
    return DeltaNetParams(up(w), -backend.xp.exp(up(a_log)), up(dt))


def gated_setup(dims, acc, seed, params_seed):
    """(rng, config, backend, DeltaNet parameters, gated-norm weight) of a DeltaNet layer of `dims` (Hk, Hv, dk,
    dv) on the float64 (`acc` double) or bf16 (float) backend."""
    rng = np.random.default_rng(seed)
    cfg = dn_config(*dims)
    cub = CupyBackend("fp32" if acc == "double" else "bf16")
    params = dn_params(cub, cfg, np.random.default_rng(params_seed))
    return rng, cfg, cub, params, cp.asarray(rand(rng, cfg.linear_value_head_dim, scale=0.5) + 1.0)


@pytest.mark.parametrize("acc", ["double", "float"])
@pytest.mark.parametrize("dims", [(2, 4, 16, 16), (4, 8, 128, 128), (2, 6, 64, 32)])
def test_deltanet_core_matches_reference(acc, dims):
    """Three sequences: lengths 1, 70 and 130 (chunk boundaries at 64 / 128) with snapshots inside, then two
    decode steps; outputs, final conv / recurrent state and snapshots against the numpy reference."""
    from decapybara.backend.base import DeltaNetSegment

    rng = np.random.default_rng(sum(dims))
    cfg = dn_config(*dims)
    cub = CupyBackend("fp32" if acc == "double" else "bf16")
    np_pool, cu_pool = NP.new_state_pool(cfg, 4), cub.new_state_pool(cfg, 4)
    for s in range(4):
        np_pool.reset(s)
        cu_pool.reset(s)
    p_np = dn_params(NP, cfg, np.random.default_rng(1))
    p_cu = dn_params(cub, cfg, np.random.default_rng(1))
    tol = 1e-5 if acc == "double" else 1e-3
    rounds = [
        [(1, 2, None), (70, 0, (1, 33)), (130, 3, (2, 64))],  # (length, slot, snapshot after (seq, tokens))
        [(1, 2, None), (1, 0, None), (1, 3, None)],
        [(1, 2, None), (1, 0, None), (1, 3, None)],
    ]
    for ri, rnd in enumerate(rounds):
        segs, row = [], 0
        for si, (n, slot, snap) in enumerate(rnd):
            if snap is not None:
                cut = snap[1]
                segs.append(DeltaNetSegment(row, cut, slot, (si, cut)))
                segs.append(DeltaNetSegment(row + cut, n - cut, slot, None))
            else:
                segs.append(DeltaNetSegment(row, n, slot, None))
            row += n
        c, hv = cfg.linear_conv_dim, cfg.linear_num_value_heads
        x, a, b = rand(rng, row, c), rand(rng, row, hv), rand(rng, row, hv, scale=2.0)
        snaps_np, snaps_cu = {}, {}
        ref = NP.deltanet_core(np_pool, 0, x, a, b, p_np, segs, cfg, snaps_np)
        got = cub.deltanet_core(cu_pool, 0, cp.asarray(x), cp.asarray(a), cp.asarray(b), p_cu, segs, cfg, snaps_cu)
        assert_close(got, ref, tol, f"deltanet out round {ri} dims {dims} acc {acc}")
        for slot in (0, 2, 3):
            s_np, s_cu = np_pool.get(slot), cu_pool.get(slot)
            assert_close(s_cu.conv[0], s_np.conv[0], 1e-6, f"conv state slot {slot} round {ri}")
            assert_close(s_cu.recurrent[0], s_np.recurrent[0], tol, f"recurrent state slot {slot} round {ri}")
        assert sorted(snaps_cu) == sorted(snaps_np), (sorted(snaps_cu), sorted(snaps_np))
        for key in snaps_np:
            assert_close(snaps_cu[key][0][0], snaps_np[key][0][0], 1e-6, f"conv snapshot {key}")
            assert_close(snaps_cu[key][0][1], snaps_np[key][0][1], tol, f"recurrent snapshot {key}")


@pytest.mark.parametrize("acc", ["double", "float"])
@pytest.mark.parametrize("dims", [(2, 6, 64, 32), (2, 4, 128, 32), (16, 48, 128, 128)])
def test_deltanet_prefill_fused_launches_give_the_same_bits(monkeypatch, acc, dims):
    """Other forwards' DeltaNet with FUSED_PREFILL (conv, gates and, at key head dim 128, the q / k norms in one
    launch, `conv1d_silu_gates`; the conv state update and the gated norm in one, `gdn_finish`) gives the bits of
    the separate launches: gated output, conv and recurrent states, snapshots; runs of 1, 5 and 37 rows (a
    snapshot inside), a and b interleaved columns of one product and z a column view, as the model passes them."""
    from decapybara.backend import cupy_deltanet as cd
    from decapybara.backend.base import DeltaNetSegment

    rng, cfg, cub, params, norm_w = gated_setup(dims, acc, sum(dims) + 3, 2)
    c, hv, dv = cfg.linear_conv_dim, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    segs = [DeltaNetSegment(0, 1, 2, None), DeltaNetSegment(1, 5, 0, None), DeltaNetSegment(6, 20, 3, (2, 20)),
            DeltaNetSegment(26, 17, 3, None)]
    x = cp.asarray(rand(rng, 43, c))
    ab = cp.asarray(rand(rng, 43, 2 * hv))
    z = cp.asarray(rand(rng, 43, hv * dv + 5))[:, :hv * dv].reshape(43, hv, dv)  # a column view, as the model's z
    init = [rand(rng, 4, c, 3), rand(rng, 4, hv, dims[2], dv, scale=0.1)]
    launched = []
    get_dn = cd.get_kernel
    monkeypatch.setattr(cd, "get_kernel", lambda m, f, d=(): launched.append(f) or get_dn(m, f, d))
    got = {}
    for fused in (True, False):
        monkeypatch.setitem(cd.FUSED_PREFILL, "enabled", fused)
        pool = cub.new_state_pool(cfg, 4)
        pool.conv[0][...] = cp.asarray(init[0])
        pool.rec[0][...] = cp.asarray(init[1])
        launched.clear()
        snaps = {}
        out = cub.deltanet_core_gated(pool, 0, x, ab[:, hv:], ab[:, :hv], params, segs, cfg, snaps, z, norm_w, 1e-6)
        mine = {"conv1d_silu_gates", "gdn_finish"}
        assert (mine <= set(launched)) if fused else not (mine & set(launched)), launched
        assert ("gdn_gates" in launched) == (not fused) and ("conv1d_state_update" in launched) == (not fused)
        assert ("gdn_qk_norm" in launched) == (not fused or dims[2] != 128), launched  # in the conv launch at dk 128
        got[fused] = (cp.asnumpy(out), cp.asnumpy(pool.conv[0]), cp.asnumpy(pool.rec[0]),
                      {k: [cp.asnumpy(p) for p in v[0]] for k, v in snaps.items()})
    assert not np.isnan(got[True][0]).any(), "unwritten gated output"
    for i, name in enumerate(("gated output", "conv state", "recurrent state")):
        assert_bytes_equal(got[True][i], got[False][i], f"{name} dims {dims} acc {acc}")
    assert sorted(got[True][3]) == sorted(got[False][3]) == [(2, 20)]
    for j in (0, 1):
        assert_bytes_equal(got[True][3][(2, 20)][j], got[False][3][(2, 20)][j], f"snapshot part {j}")


def test_deltanet_chunk_table_splits_segments_from_their_starts():
    """Chunks of at most CHUNK rows from each segment's start; a segment's snapshot on its last chunk; long runs'
    chunk ranges; runs under CHUNK rows left to gdn_recurrent."""
    from decapybara.backend import cupy_deltanet as cd
    from decapybara.backend.base import DeltaNetSegment

    segs = [DeltaNetSegment(0, 64, 0, (0, 64)), DeltaNetSegment(64, 1, 0, None), DeltaNetSegment(65, 150, 0, (0, 215)),
            DeltaNetSegment(215, 1, 1, None), DeltaNetSegment(216, 129, 2, None)]
    plan = cd.plan_runs(segs)
    work = cd.chunk_work(plan)
    assert cd.chunk_work(plan) is work  # built once a plan
    chunks, run_chunks = cp.asnumpy(work.chunks).tolist(), cp.asnumpy(work.run_chunks).tolist()
    assert chunks == [[0, 64, 0], [64, 1, -1], [65, 64, -1], [129, 64, -1], [193, 22, 1],
                      [216, 64, -1], [280, 64, -1], [344, 1, -1]]
    assert run_chunks == [[0, 5], [5, 3]]
    assert cp.asnumpy(work.long_runs).tolist() == [[0, 215, 0, 0, 3], [216, 129, 2, 4, 1]] and work.num_long == 2
    assert cp.asnumpy(work.short_runs).tolist() == [[215, 1, 1, 3, 1]] and work.num_short == 1  # a decode row
    assert cd.plan_runs([DeltaNetSegment(0, 1, 0, None), DeltaNetSegment(1, 1, 1, None)]).chunk_src is None


@pytest.mark.parametrize("dims", [(2, 4, 16, 16), (2, 6, 128, 128), (2, 6, 64, 32), (1, 2, 32, 128)])
def test_deltanet_chunked_matches_reference(monkeypatch, dims):
    """The chunked form on tensor cores (gdn_chunk_prep + gdn_chunk_scan, the bf16 backend's prefill; the scan with
    one and two chunks of W | q fragments staged, the same bits) against the numpy reference, and against
    gdn_recurrent at float arithmetic, to 1e-4 of the largest value: outputs, the
    final recurrent states and snapshots, over runs of 215 rows in three segments (a 64-row segment ending in a
    snapshot, a 1-row one, 150 rows in three chunks of which the last has 22 rows, ending in a snapshot), a
    1-row run (a decode row in the same forward: gdn_recurrent's) and a 129-row run (a 1-row last chunk), from
    nonzero states; the scan's CTAs also with 4 warps where dv / 16 is not a multiple of 4 (warps past the
    value columns idle)."""
    from decapybara.backend import cupy_deltanet as cd
    from decapybara.backend.base import DeltaNetSegment

    cfg = dn_config(*dims)
    c, hv = cfg.linear_conv_dim, cfg.linear_num_value_heads
    rng = np.random.default_rng(sum(dims))
    segs = [DeltaNetSegment(0, 64, 0, (0, 64)), DeltaNetSegment(64, 1, 0, None), DeltaNetSegment(65, 150, 0, (0, 215)),
            DeltaNetSegment(215, 1, 1, None), DeltaNetSegment(216, 129, 2, None)]
    t = 345
    warm = [DeltaNetSegment(40 * s, 40, s, None) for s in range(3)]
    xw, aw, bw = rand(rng, 120, c), rand(rng, 120, hv), rand(rng, 120, hv, scale=2.0)
    x, a, b = rand(rng, t, c), rand(rng, t, hv), rand(rng, t, hv, scale=2.0)
    np_pool = NP.new_state_pool(cfg, 3)
    for s in range(3):
        np_pool.reset(s)
    p_np = dn_params(NP, cfg, np.random.default_rng(1))
    NP.deltanet_core(np_pool, 0, xw, aw, bw, p_np, warm, cfg, {})
    warm_states = [(np_pool.get(s).conv[0].copy(), np_pool.get(s).recurrent[0].copy()) for s in range(3)]
    snaps_np = {}
    ref = NP.deltanet_core(np_pool, 0, x, a, b, p_np, segs, cfg, snaps_np)
    results = {}
    monkeypatch.setitem(cd.CHUNKED, "min_len", 2)  # runs of 215 rows take the chunked kernels
    variants = [(True, 1, None), (True, 2, None), (False, 1, None)]  # W | q fragments one or two chunks ahead
    if (cfg.linear_value_head_dim // 16) % 4:
        variants.append((True, 1, 4))
    for chunked, bufs, warps in variants:
        monkeypatch.setitem(cd.CHUNKED, "enabled", chunked)
        monkeypatch.setitem(cd.CHUNKED, "wq_bufs", bufs)
        monkeypatch.setitem(cd.CHUNKED, "warps", warps)
        launched = record_kernels(monkeypatch, cd)
        cub = CupyBackend("bf16")
        pool = cub.new_state_pool(cfg, 3)
        for s in range(3):
            pool.reset(s)
            pool.conv[0][s] = cp.asarray(warm_states[s][0])
            pool.rec[0][s] = cp.asarray(warm_states[s][1])
        snaps = {}
        out = cub.deltanet_core(pool, 0, cp.asarray(x), cp.asarray(a), cp.asarray(b),
                                dn_params(cub, cfg, np.random.default_rng(1)), segs, cfg, snaps)
        names = {f for f, _ in launched}
        assert ("gdn_chunk_scan" in names) == chunked and "gdn_recurrent" in names, names  # the 1-row run
        scan_warps = warps or next(w for w in (4, 2, 1) if (cfg.linear_value_head_dim // 16) % w == 0)
        fits = cd.chunk_scan_smem_bytes(cfg.linear_key_head_dim, scan_warps, bufs) <= ops.smem_per_block()
        want = bufs if fits else 1  # two buffers where the device's shared memory a block holds them
        assert all(d["SCAN_WQ_BUFS"] == want for f, d in launched if f == "gdn_chunk_scan"), launched
        results[chunked, bufs, warps] = cp.asnumpy(out)
        what = f"chunked ({bufs} W | q buffers, warps {warps})" if chunked else "recurrent"
        assert_close(out, ref, 1e-4, f"{what} out dims {dims}")
        for s in range(3):
            assert_close(pool.get(s).recurrent[0], np_pool.get(s).recurrent[0], 1e-4, f"{what} state {s}")
        assert sorted(snaps) == sorted(snaps_np)
        for key in snaps_np:
            assert_close(snaps[key][0][1], snaps_np[key][0][1], 1e-4, f"{what} snapshot {key}")
    assert_close(results[True, 1, None], results[False, 1, None], 1e-4, f"chunked against recurrent, dims {dims}")
    for key, got in results.items():
        if key[0]:
            assert_bytes_equal(got, results[True, 1, None], f"chunked {key} against the default, {dims}")


@pytest.mark.parametrize("dims", [(2, 4, 16, 16), (4, 8, 128, 128), (2, 6, 64, 32), (2, 4, 12, 8)])
def test_deltanet_recurrent_blocks_give_the_same_bits(monkeypatch, dims):
    """gdn_recurrent stages its inputs in blocks of RECURRENT["tokens"] tokens: blocks of 1, 5, 16 and 32 tokens
    give the same bits (outputs, states, snapshots) for runs of 1, 70 and 130 tokens with snapshots inside
    (block edges inside and outside chunks and segments); dk 12 makes row slices of 3 floats. (Each token's
    arithmetic is delta_step's, which gdn_decode shares: test_deltanet_decode_fused_is_bit_identical holds the
    two kernels to the same bits, and the reference tests above hold both to numpy.)"""
    from decapybara.backend import cupy_deltanet as cd
    from decapybara.backend.base import DeltaNetSegment

    monkeypatch.setitem(cd.CHUNKED, "enabled", False)
    cfg = dn_config(*dims)
    c, hv = cfg.linear_conv_dim, cfg.linear_num_value_heads
    rng = np.random.default_rng(3)
    x, a, b = rand(rng, 201, c), rand(rng, 201, hv), rand(rng, 201, hv, scale=2.0)
    segs = [DeltaNetSegment(0, 1, 2, None), DeltaNetSegment(1, 33, 0, (1, 33)), DeltaNetSegment(34, 37, 0, None),
            DeltaNetSegment(71, 64, 3, (2, 64)), DeltaNetSegment(135, 66, 3, None)]
    results = []
    for tokens in (1, 5, 16, 32):
        monkeypatch.setitem(cd.RECURRENT, "tokens", tokens)
        cub = CupyBackend("bf16")
        pool = cub.new_state_pool(cfg, 4)
        for s in range(4):
            pool.reset(s)
        snaps = {}
        out = cub.deltanet_core(pool, 0, cp.asarray(x), cp.asarray(a), cp.asarray(b),
                                dn_params(cub, cfg, np.random.default_rng(1)), segs, cfg, snaps)
        results.append((cp.asnumpy(out), [cp.asnumpy(pool.get(s).recurrent[0]) for s in (0, 2, 3)],
                        {k: np.asarray(v[0][1]) for k, v in snaps.items()}))
    for tokens, (out, rec, snaps) in zip((5, 16, 32), results[1:]):
        assert_bytes_equal(out, results[0][0], f"outputs, blocks of {tokens} tokens against 1")
        for got, want in zip(rec, results[0][1]):
            assert_bytes_equal(got, want, f"recurrent state, blocks of {tokens}")
        assert sorted(snaps) == sorted(results[0][2])
        for key in snaps:
            assert_bytes_equal(snaps[key], results[0][2][key], f"snapshot {key}, blocks of {tokens}")


@pytest.mark.parametrize("smem_state", [False, True])
@pytest.mark.parametrize("runs", [None, 2, 3, 5])
@pytest.mark.parametrize("vcols", [64, 32, 16])
@pytest.mark.parametrize("acc", ["double", "float"])
@pytest.mark.parametrize("dims", [(2, 4, 16, 16), (4, 8, 128, 128), (2, 6, 64, 32), (2, 4, 16, 8)])
def test_deltanet_decode_fused_is_bit_identical(monkeypatch, acc, dims, vcols, runs, smem_state):
    """gdn_decode (one launch for a decode forward's conv, q / k norms, gates and recurrent step) gives the bits
    of the four kernels it replaces: outputs, conv and recurrent states and snapshots, over three steps of five
    sequences in scattered slots from random states, with a and b as column views of one product; value heads
    of 8 make one warp a CTA (it computes both norms); `vcols` value columns a CTA: 64 (eight warps where dv
    allows; the plan's from 13 runs up), 32 (four; the plan's up to 12 runs) and 16 (two); for dv <= 32 some of them
    build the same kernel. `runs` a CTA takes
    one after another: as planned (one at these sizes), 2 (CTAs of 2, 2 and 1: the snapshots at second runs), 3
    (3 and 2: a snapshot at a CTA's middle run and at its first) and all five in one CTA. `smem_state`: the delta
    step on the state slice in shared memory (DEC_SMEM_S), by the plan's rule at float arithmetic (FUSED_DECODE
    "smem_runs" 1: CTAs of up to 32 columns at 5 an SM), by its define in float64 (one CTA an SM)."""
    from decapybara.backend import cupy_deltanet as cd
    from decapybara.backend.base import DeltaNetSegment

    rng = np.random.default_rng(sum(dims) + 7)
    cfg = dn_config(*dims)
    cub = CupyBackend("fp32" if acc == "double" else "bf16")
    pools = {fused: cub.new_state_pool(cfg, 6) for fused in (True, False)}
    init = [rand(rng, *pools[True].conv[0].shape), rand(rng, *pools[True].rec[0].shape, scale=0.1)]
    for pool in pools.values():
        pool.conv[0][...] = cp.asarray(init[0])
        pool.rec[0][...] = cp.asarray(init[1])
    params = dn_params(cub, cfg, np.random.default_rng(1))
    c, hv = cfg.linear_conv_dim, cfg.linear_num_value_heads
    slots = [4, 0, 5, 2, 1]
    launched = []
    get = cd.get_kernel
    monkeypatch.setattr(cd, "get_kernel", lambda m, f, d=(): launched.append((f, dict(d))) or get(m, f, d))
    monkeypatch.setitem(cd.FUSED_DECODE, "vcols", vcols)
    monkeypatch.setitem(cd.FUSED_DECODE, "runs", runs)
    if smem_state and acc == "double":
        monkeypatch.setitem(cd.FUSED_DECODE, "defines", {"DEC_SMEM_S": 1, "GDN_MINB": 1})
    elif smem_state:
        monkeypatch.setitem(cd.FUSED_DECODE, "smem_runs", 1)
    smem_build = smem_state and (acc == "double" or min(vcols, dims[3]) <= 32)
    for step in range(3):
        segs = [DeltaNetSegment(i, 1, slot, (i, step) if i in (1, 3) else None) for i, slot in enumerate(slots)]
        x = cp.asarray(rand(rng, len(slots), c))
        ab = cp.asarray(rand(rng, len(slots), 2 * hv + 3))
        a, b = ab[:, :hv], ab[:, hv + 3:]  # views of one product, rows 2 hv + 3 floats apart
        got = {}
        for fused, pool in pools.items():
            monkeypatch.setitem(cd.FUSED_DECODE, "enabled", fused)
            launched.clear()
            snaps = {}
            out = cub.deltanet_core(pool, 0, x, a, b, params, segs, cfg, snaps)
            decode = [d for f, d in launched if f == "gdn_decode"]
            assert bool(decode) == fused, launched
            if fused:
                assert bool(decode[0].get("DEC_SMEM_S")) == smem_build, decode
                if smem_build and acc == "float":
                    assert decode[0]["GDN_MINB"] == cd.DECODE_SMEM_CTAS, decode
            got[fused] = (cp.asnumpy(out), cp.asnumpy(pool.conv[0]), cp.asnumpy(pool.rec[0]), snaps)
        for i, name in enumerate(("output", "conv state", "recurrent state")):
            assert_bytes_equal(got[True][i], got[False][i], f"{name} step {step} dims {dims} acc {acc}")
        assert sorted(got[True][3]) == sorted(got[False][3]) == [(1, step), (3, step)]
        for key, layers in got[True][3].items():
            for j in (0, 1):
                assert_bytes_equal(layers[0][j], got[False][3][key][0][j], f"snapshot {key} part {j}")


def _verify_like_plan(cd, lens, cuts, slots, pad_slot, ckpt):
    """A RunPlan as a verification graph builds it (cuda_graph `_fill_verify_runs`): runs [0, b) sequence i's
    `lens[i]` rows from row 2i (a cut after row cuts[i] with its snapshot into checkpoint i where cuts[i]), runs
    [b, 2b) a throwaway row on the pad slot where sequence i has one row, else none."""
    b = len(lens)
    runs = np.zeros((2 * b, 5), np.int32)
    segs = np.zeros((3 * b, 2), np.int32)
    runs[:b, 0], runs[:b, 2], runs[:b, 3], runs[:b, 4] = np.arange(b) * 2, slots, np.arange(b) * 2, 1
    runs[:b, 1] = lens
    runs[b:, 0], runs[b:, 2], runs[b:, 3], runs[b:, 4] = np.arange(b) * 2 + 1, pad_slot, 2 * b + np.arange(b), 1
    segs[:2 * b], segs[2 * b:] = (2, -1), (0, -1)
    for i, (n, cut) in enumerate(zip(lens, cuts)):
        if cut:
            segs[2 * i], segs[2 * i + 1], runs[i, 4] = (cut, i), (n, -1), 2
        else:
            segs[2 * i] = (n, -1)
        if n == 1:
            runs[b + i, 1], segs[2 * b + i] = 1, (1, -1)
    return cd.RunPlan(cp.asarray(runs), cp.asarray(segs), 2 * b, max(lens), [], snap_bufs=ckpt)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("runs", [None, 2, 3])
@pytest.mark.parametrize("vcols", [None, 64, 16])
@pytest.mark.parametrize("acc", ["double", "float"])
@pytest.mark.parametrize("dims", [(2, 4, 16, 16), (4, 8, 128, 128), (2, 6, 64, 32), (2, 4, 16, 8)])
def test_deltanet_multi_row_runs_give_the_general_paths_bits(monkeypatch, acc, dims, vcols, runs, gated):
    """Forwards whose runs have a few rows (speculative verification) take gdn_decode's DEC_MULTI build
    (MULTI_DECODE): its outputs, conv and recurrent states and snapshots are the bytes of the general path's
    launches (conv1d_silu_gates, gdn_recurrent, gdn_finish / conv1d_state_update; MULTI_DECODE "max_rows" 0).
    Two forwards: runs of 2, 1, 3, 2 and 4 rows in scattered slots with snapshots after a run's first row, at its
    end and inside a run of 4 (segments as the model cuts them); then a verification graph's plan (runs of 2 and 1
    rows with snapshots into checkpoint buffers, throwaway runs of one row or none on a pad slot, which are not
    compared: two of them race on that slot in either path, as in the graphs). `vcols` value
    columns and `runs` runs a CTA as MULTI_DECODE's (None: the plan's); with `gated` the gated norm after it, in bf16
    bits (the multi path's `out_dtype`) against the general path's float32 rounded. Outputs start NaN-poisoned."""
    from decapybara.backend import cupy_deltanet as cd
    from decapybara.backend.base import DeltaNetSegment

    assert ops.POISON, "outputs must start poisoned (tests/conftest.py)"
    rng, cfg, cub, params, norm_w = gated_setup(dims, acc, sum(dims) + 21, 3)
    c, hv, dk, dv = cfg.linear_conv_dim, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    monkeypatch.setitem(cd.MULTI_DECODE, "vcols", vcols)
    monkeypatch.setitem(cd.MULTI_DECODE, "runs", runs)
    launched = []
    get_dn = cd.get_kernel
    monkeypatch.setattr(cd, "get_kernel", lambda m, f, d=(): launched.append((f, dict(d))) or get_dn(m, f, d))
    pools = {multi: cub.new_state_pool(cfg, 8) for multi in (True, False)}
    init = [rand(rng, *pools[True].conv[0].shape), rand(rng, *pools[True].rec[0].shape, scale=0.1)]
    for pool in pools.values():
        pool.conv[0][...] = cp.asarray(init[0])
        pool.rec[0][...] = cp.asarray(init[1])
    model_segs = [DeltaNetSegment(0, 1, 5, (0, 1)), DeltaNetSegment(1, 1, 5, None), DeltaNetSegment(2, 1, 0, (1, 1)),
                  DeltaNetSegment(3, 3, 2, (2, 3)), DeltaNetSegment(6, 1, 7, (3, 1)), DeltaNetSegment(7, 1, 7, (3, 2)),
                  DeltaNetSegment(8, 2, 1, (4, 2)), DeltaNetSegment(10, 2, 1, None)]
    ckpts = {multi: {0: (cp.full((4, c, 3), np.nan, cp.float32), cp.full((4, hv, dk, dv), np.nan, cp.float32))}
             for multi in (True, False)}
    forwards = [(12, lambda multi: cd.plan_runs(model_segs)),
                (8, lambda multi: _verify_like_plan(cd, [2, 1, 2, 1], [1, 0, 1, 0], [3, 6, 0, 4], 7, ckpts[multi]))]
    for fi, (rows, make_plan) in enumerate(forwards):
        x = cp.asarray(rand(rng, rows, c))
        ab = cp.asarray(rand(rng, rows, 2 * hv + 3))
        a, b = ab[:, :hv], ab[:, hv + 3:]
        z = cp.asarray(rand(rng, rows, hv, dv))
        got = {}
        for multi, pool in pools.items():
            monkeypatch.setitem(cd.MULTI_DECODE, "max_rows", 8 if multi else 0)
            launched.clear()
            snaps, plan = {}, make_plan(multi)
            gate = (z, norm_w, 1e-6) if gated else None
            out = cd.deltanet_core(pool, 0, x, a, b, params, plan, cfg, snaps, acc=acc, gate=gate,
                                   out_dtype=np.uint16 if gated else np.float32)
            names = [f for f, _ in launched]
            assert ("gdn_decode" in names) == multi and ("gdn_recurrent" in names) != multi, names
            if multi:
                d = next(d for f, d in launched if f == "gdn_decode")
                assert d.get("DEC_MULTI") == 1 and not d.get("DEC_SMEM_S"), d
                if vcols:
                    assert d["DEC_VCOLS"] == min(vcols, dv), d
            snap_host = {k: [cp.asnumpy(p) for p in v[0]] for k, v in snaps.items()}
            if plan.snap_bufs is not None:
                snap_host = {("ckpt", i): [cp.asnumpy(ckpts[multi][0][0][i]), cp.asnumpy(ckpts[multi][0][1][i])]
                             for i in (0, 2)}
            out = cp.asnumpy(out)
            if gated and not multi:  # the general path's float32, rounded as the bf16 output rounds
                out = cp.asnumpy(ops.to_bf16_bits(cp.asarray(out)))
            kept = list(range(8)) if fi == 0 else list(range(7))  # the pad slot's two throwaway runs race
            got[multi] = (out, cp.asnumpy(pool.conv[0][kept]), cp.asnumpy(pool.rec[0][kept]), snap_host)
        real = [r for r in range(rows) if fi == 0 or r % 2 == 0 or r in (1, 5)]  # the sequences' rows
        assert not np.isnan(got[True][0][real].astype(np.float32)).any(), f"unwritten output, forward {fi}"
        for i, name in enumerate(("output", "conv state", "recurrent state")):
            g, w = got[True][i], got[False][i]
            if i == 0:
                g, w = g[real], w[real]
            assert_bytes_equal(g, w, f"{name} forward {fi} dims {dims} acc {acc}")
        assert sorted(got[True][3]) == sorted(got[False][3]) and got[True][3], (sorted(got[True][3]), fi)
        for key, parts in got[True][3].items():
            for j in (0, 1):
                assert not np.isnan(parts[j]).any(), f"unwritten snapshot {key}"
                assert_bytes_equal(parts[j], got[False][3][key][j], f"snapshot {key} part {j}, forward {fi}")


def test_deltanet_decode_plan_fills_one_wave_or_takes_two_runs_a_cta(monkeypatch):
    """decode_runs_per_cta: the fewest runs a CTA (at most 3) that put all CTAs in one wave of resident CTAs,
    else 2; one run, 1. The 27B shape (48 heads; 2 column blocks of 64 on 2 CTAs an SM, or 4 of 32 on 4, of 132
    SMs: two run groups a wave either way). decode_vcols: CTAs of 32 value columns up to 12 runs, 64 past that.
    decode_ctas_per_sm: 2 CTAs an SM at 27B (64 columns), 4 at 32 columns, 1 in float64. decode_smem_state: from
    FUSED_DECODE's "smem_runs" runs up (0: never), CTAs of at most 32 columns, float arithmetic."""
    from decapybara.backend import cupy_deltanet as cd

    for n in (0, 1, 10):
        monkeypatch.setitem(cd.FUSED_DECODE, "smem_runs", n)
        assert [cd.decode_smem_state(r, 32, "float") for r in (1, 9, 10, 12)] == [n == 1, n == 1, n > 0, n > 0]
        assert not any(cd.decode_smem_state(r, v, a) for r in (10, 12) for v, a in ((64, "float"), (32, "double")))
        assert cd.decode_smem_state(12, 16, "float") == (n > 0)

    want = [1, 1, 2, 2, 3, 3] + [2] * 6
    assert [cd.decode_runs_per_cta(r, 48, 2, 264) for r in range(1, 13)] == want
    assert [cd.decode_runs_per_cta(r, 48, 4, 528) for r in range(1, 13)] == want
    assert [cd.decode_vcols(r, 128) for r in (1, 5, 12, 13, 64)] == [32, 32, 32, 64, 64]
    assert cd.decode_vcols(1, 16) == 16 and cd.decode_vcols(40, 16) == 16 and cd.decode_vcols(40, 96) == 32
    assert cd.decode_ctas_per_sm(128, 64, "float") == 2 and cd.decode_ctas_per_sm(128, 64, "double") == 1
    assert cd.decode_ctas_per_sm(128, 32, "float") == 4
    for heads, blocks, slots in ((48, 2, 264), (48, 4, 528), (4, 1, 264), (300, 1, 264), (8, 4, 32), (7, 1, 10)):
        for runs in range(1, 200):
            per = cd.decode_runs_per_cta(runs, heads, blocks, slots)
            assert 1 <= per <= min(runs, 3, cd.DECODE_MAX_RUNS), (runs, heads, blocks, slots, per)
            fits = [p for p in range(1, 4) if p <= runs and -(-runs // p) * heads * blocks <= slots]
            assert per == (fits[0] if fits else min(runs, 2)), (runs, heads, blocks, slots, per)


def test_deltanet_decode_overlaps_only_over_model_parameters(monkeypatch):
    """gdn_decode reads the conv weight, A and dt before its wait, so it launches overlapped (`pdl.launch`) only
    where they are float32 device arrays the step does not make: parameters given as host arrays or in another
    dtype are copied for the call, and then the launch is plain. Both give the same bits."""
    from decapybara.backend import cupy_deltanet as cd
    from decapybara.backend import pdl
    from decapybara.backend.base import DeltaNetParams, DeltaNetSegment

    rng = np.random.default_rng(5)
    cfg = dn_config(2, 4, 16, 16)
    cub = CupyBackend("bf16")
    params = dn_params(cub, cfg, np.random.default_rng(1))
    copied = DeltaNetParams(cp.asnumpy(params.conv_weight), params.neg_A.astype(cp.float64), params.dt_bias)
    c, hv = cfg.linear_conv_dim, cfg.linear_num_value_heads
    x, ab = cp.asarray(rand(rng, 3, c)), cp.asarray(rand(rng, 3, 2 * hv))
    segs = [DeltaNetSegment(i, 1, i, None) for i in range(3)]
    init = rand(rng, *cub.new_state_pool(cfg, 3).rec[0].shape, scale=0.1)
    calls, outs, names = [], [], {}
    get = cd.get_kernel

    def named(module, func, defines=()):
        kernel = get(module, func, defines)
        names[id(kernel)] = func
        return kernel
    monkeypatch.setattr(cd, "get_kernel", named)
    for name in ("launch", "plain"):
        real = getattr(pdl, name)
        monkeypatch.setattr(pdl, name, lambda k, *a, _r=real, _n=name, **kw: calls.append((_n, k)) or _r(k, *a, **kw))
    for p in (params, copied):
        pool = cub.new_state_pool(cfg, 3)
        pool.rec[0][...] = cp.asarray(init)
        calls.clear()
        outs.append(cp.asnumpy(cub.deltanet_core(pool, 0, x, ab[:, :hv], ab[:, hv:], p, segs, cfg, {})))
        decode = [n for n, k in calls if names.get(id(k)) == "gdn_decode"]  # launch may call plain
        assert decode[:1] == (["launch"] if p is params else ["plain"]) and len(decode) <= 2, calls
        assert p is params or "launch" not in decode, calls
    assert_bytes_equal(outs[0], outs[1], "plain against overlapped launch")


@pytest.mark.parametrize("views", [True, False])
@pytest.mark.parametrize("acc", ["double", "float"])
@pytest.mark.parametrize("dims,batches", [((4, 8, 128, 128), (1, 3, 12)), ((16, 48, 128, 128), (1, 4, 5)),
                                          ((2, 6, 64, 32), (2, 7)), ((2, 4, 16, 8), (1, 4))])
def test_deltanet_decode_gated_norm_is_bit_identical(monkeypatch, acc, dims, batches, views):
    """deltanet_core_gated on a decode forward (gdn_decode, then gdn_decode_finish: conv state and gated RMS norm,
    no gated_rms_norm_warp launch) and on other forwards (the recurrence, then gdn_finish) gives the bits of
    deltanet_core then gated_rms_norm (conv1d_state_update, gated_rms_norm_warp): gated output, conv and recurrent
    states, snapshots. Per batch size: a two-row prefill round, then two decode steps in scattered slots from random
    states; with `views` mixed / a / b / z are column views of fused products as QwenModel passes them (z a
    contiguous array in the last step), else contiguous arrays (what the host emulator can run). Outputs start
    NaN-poisoned. Value heads of 8 and 48 (27B: Hk 16, Hv 48, dk = dv = 128; 4 and 5 sequences take two and three
    runs a gdn_decode CTA in float32 on 132 SMs, `decode_runs_per_cta`), 6 (a partial norm block), dv = 8."""
    from decapybara.backend import cupy_deltanet as cd
    from decapybara.backend.base import DeltaNetSegment

    assert ops.POISON, "outputs must start poisoned (tests/conftest.py)"
    rng, cfg, cub, params, norm_w = gated_setup(dims, acc, sum(dims) + 11, 1)
    c, hv, dv = cfg.linear_conv_dim, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    launched = []
    get_dn, get_ops = cd.get_kernel, ops.get_kernel
    monkeypatch.setattr(cd, "get_kernel", lambda m, f, d=(): launched.append(f) or get_dn(m, f, d))
    monkeypatch.setattr(ops, "get_kernel", lambda m, f, d=(): launched.append(f) or get_ops(m, f, d))
    for n in batches:
        nslots = n + 3
        pools = {fused: cub.new_state_pool(cfg, nslots) for fused in (True, False)}
        init = [rand(rng, *pools[True].conv[0].shape), rand(rng, *pools[True].rec[0].shape, scale=0.1)]
        for pool in pools.values():
            pool.conv[0][...] = cp.asarray(init[0])
            pool.rec[0][...] = cp.asarray(init[1])
        slots = [int(s) for s in rng.permutation(nslots)[:n]]
        for step in range(3):
            rows = 2 if step == 0 else 1  # step 0: a prefill forward (runs of two rows)
            segs = [DeltaNetSegment(i * rows, rows, slot, (i, step) if i % 2 else None) for i, slot in enumerate(slots)]
            qkvz = cp.asarray(rand(rng, n * rows, c + hv * dv + 5))  # [T, conv_dim | Hv * dv | 5 more columns]
            ab = cp.asarray(rand(rng, n * rows, 2 * hv))
            x, a, b = qkvz[:, :c], ab[:, hv:], ab[:, :hv]
            z = qkvz[:, c:c + hv * dv].reshape(n * rows, hv, dv)
            if not views:
                x, a, b = (cp.ascontiguousarray(v) for v in (x, a, b))
            if step == 2 or not views:
                z = cp.ascontiguousarray(z)
            got = {}
            for fused, pool in pools.items():
                launched.clear()
                snaps = {}
                if fused:
                    out = cub.deltanet_core_gated(pool, 0, x, a, b, params, segs, cfg, snaps, z, norm_w, 1e-6)
                else:
                    core = cub.deltanet_core(pool, 0, x, a, b, params, segs, cfg, snaps)
                    out = cub.gated_rms_norm(core, z, norm_w, 1e-6)
                finish = "gdn_finish" if rows > 1 else "gdn_decode_finish"  # one launch for both, fused
                assert ("gated_rms_norm_warp" in launched) == (not fused), launched
                assert ("conv1d_state_update" in launched) == (not fused), launched
                assert [f for f in launched if f.endswith("finish")] == ([finish] if fused else []), launched
                got[fused] = (cp.asnumpy(out), cp.asnumpy(pool.conv[0]), cp.asnumpy(pool.rec[0]), snaps)
            assert not np.isnan(got[True][0]).any(), f"unwritten gated output, batch {n} step {step}"
            for i, name in enumerate(("gated output", "conv state", "recurrent state")):
                assert_bytes_equal(got[True][i], got[False][i], f"{name} batch {n} step {step} dims {dims} acc {acc}")
            keys = [(i, step) for i in range(1, n, 2)]
            assert sorted(got[True][3]) == sorted(got[False][3]) == keys
            for key, layers in got[True][3].items():
                for j in (0, 1):
                    assert_bytes_equal(layers[0][j], got[False][3][key][0][j], f"snapshot {key} part {j}")


# ---- MoE ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_moe_matches_reference(dtype):
    rng = np.random.default_rng(5)
    t, h, inter, e, k = 19, 64, 32, 8, 2
    x, router = rand(rng, t, h), rand(rng, e, h, scale=0.5)
    gate, up, down = rand(rng, e, inter, h, scale=h ** -0.5), rand(rng, e, inter, h, scale=h ** -0.5), rand(
        rng, e, h, inter, scale=inter ** -0.5)
    cub = CupyBackend(dtype)
    dev = [cub.prepare_weight(n, w) for n, w in (("mlp.gate.weight", router), ("experts.gate_proj", gate),
                                                  ("experts.up_proj", up), ("experts.down_proj", down))]
    if dtype == "bf16":  # the reference on the same bf16-rounded weights and operands
        def rb(a):
            return (f32_to_bf16_bits(a).astype(np.uint32) << 16).view(np.float32)
        router, gate, up, down = rb(router), rb(gate), rb(up), rb(down)
        x_ref = rb(x)  # cupy rounds the GEMM operand; the router then sees the same logits (no top-k flips)
    else:
        x_ref = x
    for normalize in (True, False):
        ref = NP.moe(x_ref, router, gate, up, down, k, normalize)
        got = cub.moe(cp.asarray(x), *dev, k, normalize)
        assert_close(got, ref, 1e-5 if dtype == "fp32" else 2e-2, f"moe {dtype} normalize={normalize}")


@pytest.mark.parametrize("batch", [1, 5])
def test_deltanet_decode_gated_norm_in_bf16_bits(batch):
    """gdn_decode_finish with a bf16-bits output (rows that only feed the out product): the float32 output's
    values rounded to nearest even, the states alike; a two-row forward (gdn_decode's multi-row build, then
    gdn_finish) likewise, and with MULTI_DECODE off (the general path) stays float32."""
    from decapybara.backend import cupy_deltanet as cd
    from decapybara.backend.base import DeltaNetSegment

    rng = np.random.default_rng(batch + 40)
    cfg = dn_config(16, 48, 128, 128)
    cub = CupyBackend("bf16")
    c, hv, dv = cfg.linear_conv_dim, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    params = dn_params(cub, cfg, np.random.default_rng(2))
    norm_w = cp.asarray(rand(rng, dv, scale=0.5) + 1.0)
    pools = {dt: cub.new_state_pool(cfg, batch + 1) for dt in (np.float32, np.uint16)}
    init = [rand(rng, *pools[np.float32].conv[0].shape), rand(rng, *pools[np.float32].rec[0].shape, scale=0.1)]
    for pool in pools.values():
        pool.conv[0][...] = cp.asarray(init[0])
        pool.rec[0][...] = cp.asarray(init[1])
    for rows, multi in ((1, 8), (2, 8), (2, 0)):
        cd.MULTI_DECODE["max_rows"], keep = multi, cd.MULTI_DECODE["max_rows"]
        segs = [DeltaNetSegment(i * rows, rows, i, None) for i in range(batch)]
        plan = cd.plan_runs(segs)
        x, z = cp.asarray(rand(rng, batch * rows, c)), cp.asarray(rand(rng, batch * rows, hv, dv))
        ab = cp.asarray(rand(rng, batch * rows, 2 * hv))
        try:
            got = {dt: cd.deltanet_core(pool, 0, x, ab[:, hv:], ab[:, :hv], params, plan, cfg, {}, acc="float",
                                        gate=(z, norm_w, 1e-6), out_dtype=dt) for dt, pool in pools.items()}
        finally:
            cd.MULTI_DECODE["max_rows"] = keep
        want = ops.to_bf16_bits(got[np.float32]) if multi else got[np.float32]
        assert got[np.uint16].dtype == want.dtype and not np.isnan(cp.asnumpy(got[np.float32])).any()
        assert_bytes_equal(cp.asnumpy(got[np.uint16]), cp.asnumpy(want), f"gated output, batch {batch}, rows {rows}")
        for name in ("conv", "rec"):
            assert_bytes_equal(cp.asnumpy(getattr(pools[np.uint16], name)[0]),
                               cp.asnumpy(getattr(pools[np.float32], name)[0]), f"{name} state, batch {batch}")
