"""Microscaled reference codecs: spec vectors, rounding, packing, block bounds, GPTQ, KV, presets."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from decapybara.backend.kv_codec import kv_bytes_per_token
from decapybara.errors import ConfigError, WeightError
from decapybara.model.config import named_config
from decapybara.model.quant import (
    E2M1,
    E2M3,
    E3M2,
    E4M3,
    E5M2,
    FORMATS,
    KVMode,
    QuantTensor,
    bf16_decode,
    bf16_encode,
    decode_elements,
    dequantize,
    dequantize_kv,
    e8m0_decode,
    e8m0_encode,
    encode_elements,
    gptq_quantize,
    kv_storage_parts,
    kv_vector_bytes,
    pack_codes,
    preset_bytes,
    preset_formats,
    quantize,
    quantize_kv,
    select_scales,
    unpack_codes,
)
from decapybara.model.weights import expected_tensors

ELEMS = (E4M3, E5M2, E2M3, E3M2, E2M1)
MX = ("mxfp8", "mxfp8_e5m2", "mxfp6", "mxfp6_e3m2", "mxfp4")


# ---- element formats: spec values ----------------------------------------------------------------------
def test_every_fp4_code_decodes_to_the_spec_value():
    spec = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    got = decode_elements(E2M1, np.arange(16))
    assert got[:8].tolist() == spec and got[8:].tolist() == [-v for v in spec]
    assert np.signbit(got[8])  # 0b1000 is -0


def test_e4m3_spec_values():
    d = E4M3.table
    assert d[0x7E] == 448.0 and d[0xFE] == -448.0 and E4M3.max_normal == 448.0
    assert d[0x01] == 2.0**-9 and d[0x07] == 7 * 2.0**-9 and d[0x08] == 2.0**-6 and d[0x38] == 1.0
    assert np.flatnonzero(np.isnan(d)).tolist() == [0x7F, 0xFF]  # only S.1111.111
    assert not np.isinf(d).any()


def test_e5m2_spec_values():
    d = E5M2.table
    assert d[0x7B] == 57344.0 and d[0x01] == 2.0**-16 and d[0x3C] == 1.0
    assert d[0x7C] == np.inf and d[0xFC] == -np.inf and np.isnan(d[[0x7D, 0x7E, 0x7F]]).all()


def test_fp6_spec_values():
    assert E2M3.table[0x1F] == 7.5 and E2M3.table[0x01] == 0.125 and E2M3.table[0x08] == 1.0
    assert E3M2.table[0x1F] == 28.0 and E3M2.table[0x01] == 0.0625 and E3M2.table[0x0C] == 1.0
    assert np.isfinite(E2M3.table).all() and np.isfinite(E3M2.table).all()
    assert (E2M3.emax, E3M2.emax, E2M1.emax, E4M3.emax, E5M2.emax) == (2, 4, 2, 8, 15)


def test_e8m0_scale_codes():
    assert e8m0_decode(np.array([127, 0, 254, 128])).tolist() == [1.0, 2.0**-127, 2.0**127, 2.0]
    assert np.isnan(e8m0_decode(np.array([255])))[0]
    assert e8m0_encode(np.array([0, -3, -500, 500])).tolist() == [127, 124, 0, 254]


# ---- element formats: rounding -------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ELEMS, ids=lambda f: f.name)
def test_every_representable_value_round_trips(fmt):
    codes = np.arange(1 << fmt.bits)
    finite = np.isfinite(fmt.table)
    assert np.array_equal(encode_elements(fmt, fmt.table[finite]), codes[finite])
    assert np.array_equal(decode_elements(fmt, codes[finite]), fmt.table[finite].astype(np.float32))


@pytest.mark.parametrize("fmt", ELEMS, ids=lambda f: f.name)
def test_midpoints_round_to_the_even_code(fmt):
    pos = fmt.table[: 1 << (fmt.bits - 1)]
    pos = pos[np.isfinite(pos)]
    mids = (pos[:-1] + pos[1:]) / 2
    lo = np.arange(len(mids))
    even = np.where(lo % 2 == 0, lo, lo + 1)
    assert np.array_equal(encode_elements(fmt, mids), even)
    sign = 1 << (fmt.bits - 1)
    assert np.array_equal(encode_elements(fmt, -mids), even | sign)
    # just off a midpoint goes to the nearer neighbour
    assert np.array_equal(encode_elements(fmt, np.nextafter(mids, -np.inf)), lo)
    assert np.array_equal(encode_elements(fmt, np.nextafter(mids, np.inf)), lo + 1)


def test_fp4_ties_by_hand():
    x = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0])
    assert decode_elements(E2M1, encode_elements(E2M1, x)).tolist() == [0, 1, 1, 2, 2, 4, 4, -4]


def test_conversion_saturates_to_max_normal():
    assert encode_elements(E4M3, np.array([464.0, 1e6, np.inf, -np.inf])).tolist() == [0x7E, 0x7E, 0x7E, 0xFE]
    assert decode_elements(E2M1, encode_elements(E2M1, np.array([7.9, -100.0]))).tolist() == [6.0, -6.0]
    assert decode_elements(E2M3, encode_elements(E2M3, np.array([7.99]))).tolist() == [7.5]
    assert decode_elements(E3M2, encode_elements(E3M2, np.array([31.9]))).tolist() == [28.0]
    assert decode_elements(E5M2, encode_elements(E5M2, np.array([np.inf, 1e9]))).tolist() == [57344.0] * 2


def test_subnormals_and_underflow():
    assert encode_elements(E4M3, np.array([2.0**-10, 1.5 * 2.0**-10, 3 * 2.0**-10, -2.0**-12])).tolist() == [
        0, 1, 2, 0x80]
    assert encode_elements(E2M1, np.array([0.24, 0.26, 0.74])).tolist() == [0, 1, 1]


def test_nan_encoding():
    assert encode_elements(E4M3, np.array([np.nan])).tolist() == [0x7F]
    assert np.isnan(decode_elements(E5M2, encode_elements(E5M2, np.array([np.nan]))))[0]
    with pytest.raises(ValueError):
        encode_elements(E2M1, np.array([1.0, np.nan]))


def test_fp8_encoding_matches_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    x = (rng.choice([-1.0, 1.0], 50_000) * np.exp2(rng.uniform(-12, 10, 50_000))).astype(np.float32)
    ref = torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy()  # torch saturates e4m3fn
    assert np.array_equal(encode_elements(E4M3, x), ref)
    x5 = x[np.abs(x) <= 896] * np.float32(64)  # in range: torch's e5m2 cast overflows to inf, ours saturates
    ref5 = torch.from_numpy(x5).to(torch.float8_e5m2).view(torch.uint8).numpy()
    assert np.array_equal(encode_elements(E5M2, x5), ref5)


def test_bf16_matches_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.standard_normal(100_000).astype(np.float32) * 1e3,
                        np.array([np.inf, -np.inf, 0.0, -0.0, 3.4e38, 1e-40], np.float32)])
    ref = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(bf16_encode(x), ref)
    back = torch.from_numpy(ref.view(np.int16)).view(torch.bfloat16).float().numpy()
    assert np.array_equal(bf16_decode(ref), back)
    assert np.isnan(bf16_decode(bf16_encode(np.array([np.nan], np.float32))))[0]


# ---- packing ------------------------------------------------------------------------------------------
def test_packing_bit_layout_on_known_bytes():
    assert pack_codes(np.array([1, 2, 3, 4, 0xF, 0]), 4).tolist() == [0x21, 0x43, 0x0F]
    # 24-bit word 1 | 2 << 6 | 3 << 12 | 63 << 18 = 0xFC3081, low byte first
    assert pack_codes(np.array([0x01, 0x02, 0x03, 0x3F]), 6).tolist() == [0x81, 0x30, 0xFC]
    assert pack_codes(np.array([0, 0, 0, 1, 0x3F, 0, 0, 0]), 6).tolist() == [0, 0, 0x04, 0x3F, 0, 0]
    assert pack_codes(np.array([7, 200]), 8).tolist() == [7, 200]


@pytest.mark.parametrize("bits", [4, 6, 8])
def test_pack_unpack_round_trip(bits):
    codes = np.random.default_rng(bits).integers(0, 1 << bits, size=(3, 5, 64)).astype(np.uint8)
    packed = pack_codes(codes, bits)
    assert packed.shape == (3, 5, 64 * bits // 8)
    assert np.array_equal(unpack_codes(packed, bits), codes)


def test_quantized_bytes_of_a_known_mxfp4_block():
    x = np.zeros(32, np.float32)
    x[:4] = [0.5, 1.0, -1.5, 6.0]
    q = quantize(x, "mxfp4")
    assert q.scales.tolist() == [127]
    assert q.codes[:2].tolist() == [0x21, 0x7B] and not q.codes[2:].any()


# ---- block formats -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("fmt", "amax", "code"), [
    ("mxfp4", 1.0, 125), ("mxfp4", 6.0, 127), ("mxfp4", 7.9, 127), ("mxfp4", 8.0, 128), ("mxfp4", 0.0, 0),
    ("mxfp4", 2.0**-140, 0), ("mxfp8", 448.0, 127), ("mxfp8", 1.0, 119), ("mxfp8", 0.99, 118),
    ("mxfp6", 7.5, 127), ("mxfp6", 1.0, 125), ("mxfp6_e3m2", 28.0, 127), ("mxfp6_e3m2", 1.0, 123),
    ("mxfp8_e5m2", 1.0, 112), ("mxfp4", np.nan, 255), ("mxfp4", np.inf, 255),
])
def test_mx_scale_is_floor_log2_amax_minus_emax(fmt, amax, code):
    block = np.zeros(32)
    block[5] = -amax
    block[7] = amax / 3 if np.isfinite(amax) else 0.0
    codes, _ = select_scales(block[None], FORMATS[fmt])
    assert codes.tolist() == [code]


def _blocky(rng: np.random.Generator, rows: int, k: int, block: int) -> np.ndarray:
    """Gaussian rows whose blocks span magnitudes 2^-6 .. 2^6 (plus some exact zeros)."""
    x = rng.standard_normal((rows, k)) * np.exp2(rng.integers(-6, 7, (rows, k // block))).repeat(block, 1)
    x[rng.random(x.shape) < 0.02] = 0.0
    return x.astype(np.float32)


@pytest.mark.parametrize("fmt", (*MX, "nvfp4"))
def test_block_error_within_half_ulp_of_the_element_times_scale(fmt):
    f = FORMATS[fmt]
    x = _blocky(np.random.default_rng(2), 64, 256, f.block)
    q = quantize(x, fmt)
    deq = dequantize(q).astype(np.float64)
    xb = x.astype(np.float64).reshape(64, -1, f.block)  # [rows, blocks, block]
    _, scale = select_scales(xb, f, q.tensor_scale)
    scale = scale[..., None]
    v = np.abs(xb) / scale
    err = np.abs(deq.reshape(xb.shape) - xb)
    rounding = 2.0**-24 * np.abs(xb) if f.tensor_scale else 0.0  # NVFP4's one float32 rounding at decode
    sat = v > f.elem.max_normal
    assert np.all((err <= 0.5 * f.elem.ulp(v) * scale + rounding)[~sat])
    saturated = np.broadcast_to(f.elem.max_normal * scale, xb.shape)[sat]
    assert np.allclose(np.abs(deq.reshape(xb.shape))[sat], saturated, rtol=2**-23, atol=0)
    assert np.array_equal(np.signbit(deq.reshape(xb.shape))[xb != 0], np.signbit(xb)[xb != 0])


def test_block_with_nan_decodes_to_nan_and_leaves_other_blocks_alone():
    x = np.ones((2, 64), np.float32)
    x[0, 40] = np.nan
    q = quantize(x, "mxfp8")
    assert q.scales.tolist() == [[127 - 8, 255], [119, 119]]
    deq = dequantize(q)
    assert np.isnan(deq[0, 32:]).all() and (deq[0, :32] == 1).all() and (deq[1] == 1).all()


@pytest.mark.parametrize("fmt", MX)
def test_padding_keeps_the_logical_shape_and_exact_values(fmt):
    f = FORMATS[fmt]
    rng = np.random.default_rng(3)
    vals = f.elem.table[np.isfinite(f.elem.table)]
    x = rng.choice(vals[np.abs(vals) <= f.elem.max_normal], size=(2, 3, 50)).astype(np.float32)
    x[..., 0] = f.elem.max_normal  # every block's amax = max normal: scale 1.0
    x[..., 32] = f.elem.max_normal
    q = quantize(x, fmt)
    assert q.shape == (2, 3, 50) and q.scales.shape == (2, 3, 2) and q.codes.shape == (2, 3, 64 * f.bits // 8)
    assert (q.scales == 127).all() and not unpack_codes(q.codes, f.bits)[..., 50:].any()
    assert np.array_equal(dequantize(q), x)


def test_nvfp4_two_level_scaling():
    x = np.zeros((2, 32), np.float32)
    x[0, 0] = 2688.0  # tensor amax = 448 * 6 -> tensor scale 1.0
    x[0, 16:20] = [3.0, 1.5, -0.75, 0.125]  # block amax 3 -> block scale 0.5 (E4M3 0x30)
    x[1, :2] = [0.01, -0.005]  # block amax 0.01: 0.01 / 6 rounds to E4M3's min subnormal 2^-9 (0x01)
    x[1, 16] = 0.0005  # 0.0005 / 6 < 2^-10 rounds to scale 0: the block decodes to zeros
    q = quantize(x, "nvfp4")
    assert q.tensor_scale == np.float32(1.0)
    assert q.scales.tolist() == [[0x7E, 0x30], [0x01, 0x00]]
    deq = dequantize(q)
    assert deq[0, 0] == 2688.0 and deq[0, 16:20].tolist() == [3.0, 1.5, -0.75, 0.0]  # 0.125 / 0.5 ties to 0
    # 0.01 / 2^-9 = 5.12 -> 6 and 0.005 / 2^-9 = 2.56 -> 3
    assert deq[1, :3].tolist() == [6 * 2.0**-9, -3 * 2.0**-9, 0.0] and deq[1, 16] == 0.0
    y = x * np.float32(0.01)
    qy = quantize(y, "nvfp4")
    assert qy.tensor_scale == np.float32(np.float32(26.88) / np.float32(2688.0))
    assert qy.scales.tolist() == q.scales.tolist()
    assert np.allclose(dequantize(qy), deq * np.float32(0.01), rtol=1e-6, atol=0)
    z = quantize(np.zeros((1, 16), np.float32), "nvfp4")
    assert z.tensor_scale == 1.0 and not dequantize(z).any()


@pytest.mark.parametrize(("fmt", "bpw"), [("mxfp8", 8.25), ("mxfp6", 6.25), ("mxfp4", 4.25),
                                          ("nvfp4", 4.5 + 32 / (64 * 128))])
def test_nbytes_and_bits_per_weight(fmt, bpw):
    q = quantize(np.ones((64, 128), np.float32), fmt)
    assert q.bits_per_weight == pytest.approx(bpw) and q.nbytes == FORMATS[fmt].nbytes((64, 128))
    padded = quantize(np.ones((64, 100), np.float32), "mxfp4")
    assert padded.nbytes == 64 * 64 + 64 * 4


@pytest.mark.parametrize("fmt", ["mxfp6", "nvfp4"])
def test_parts_round_trip_and_reject_bad_parts(fmt):
    q = quantize(_blocky(np.random.default_rng(4), 8, 96, 32), fmt)
    parts = q.to_parts()
    assert set(parts) == ({"codes", "scales", "tensor_scale"} if fmt == "nvfp4" else {"codes", "scales"})
    back = QuantTensor.from_parts(fmt, (8, 96), parts)
    assert np.array_equal(back.dequantize(), dequantize(q)) and back.tensor_scale == q.tensor_scale
    with pytest.raises(WeightError):
        QuantTensor.from_parts(fmt, (8, 97 + 32), parts)
    with pytest.raises(WeightError):
        QuantTensor.from_parts(fmt, (8, 96), {**parts, "codes": parts["codes"].astype(np.int16)})
    with pytest.raises(WeightError):
        QuantTensor.from_parts(fmt, (8, 96), {"codes": parts["codes"]})
    with pytest.raises(WeightError):
        QuantTensor.from_parts("mxfp4" if fmt == "nvfp4" else "nvfp4", (8, 96), parts)
    with pytest.raises(ConfigError):
        quantize(np.ones((2, 32), np.float32), "mxfp5")


# ---- GPTQ ---------------------------------------------------------------------------------------------
def _calibration(seed: int, n: int = 48, k: int = 256, tokens: int = 1024) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    mix = rng.standard_normal((k, k)) * np.exp2(rng.uniform(-3, 1, k))[:, None]
    x = rng.standard_normal((tokens, k)) @ mix  # correlated features of uneven scale
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    return x, w


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp6", "mxfp8", "nvfp4"])
def test_gptq_beats_round_to_nearest_on_correlated_inputs(fmt):
    x, w = _calibration(5)
    out = x @ w.T.astype(np.float64)
    rtn = np.linalg.norm(out - x @ dequantize(quantize(w, fmt)).T.astype(np.float64))
    gq = gptq_quantize(w, x.T @ x, fmt, damp=0.01, block=64)
    gptq = np.linalg.norm(out - x @ dequantize(gq).T.astype(np.float64))
    assert gq.shape == w.shape and gq.codes.shape == quantize(w, fmt).codes.shape
    assert gptq < 0.8 * rtn, (fmt, gptq / rtn)


def _textbook_gptq(w: np.ndarray, h: np.ndarray, fmt: str, damp: float) -> np.ndarray:
    """Unbatched GPTQ straight from the paper (full update after every column); returns element codes."""
    f = FORMATS[fmt]
    w = w.astype(np.float64)
    h = h + damp * np.mean(np.diag(h)) * np.eye(len(h))
    u = np.linalg.cholesky(np.linalg.inv(h)).T
    ts = float(np.abs(w).max() / 2688.0) if f.tensor_scale else None
    codes = np.zeros(w.shape, np.uint8)
    for j in range(w.shape[1]):
        if j % f.block == 0:
            _, sv = select_scales(w[:, None, j:j + f.block], f, ts)
            s = sv[:, 0]
        codes[:, j] = encode_elements(f.elem, w[:, j] / s)
        err = (w[:, j] - f.elem.table[codes[:, j]] * s) / u[j, j]
        w[:, j:] -= np.outer(err, u[j, j:])
    return codes


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_gptq_lazy_batches_match_the_textbook_algorithm(fmt):
    x, w = _calibration(8, n=16, k=128, tokens=512)
    ref = _textbook_gptq(w, x.T @ x, fmt, 0.01)
    f = FORMATS[fmt]
    for block in (f.block, 64, 128):
        got = unpack_codes(gptq_quantize(w, x.T @ x, fmt, damp=0.01, block=block).codes, f.bits)
        assert np.mean(got == ref) > 0.995, (block, np.mean(got == ref))  # float round-off may flip a tie


def test_gptq_with_uncorrelated_inputs_is_round_to_nearest():
    w = _blocky(np.random.default_rng(6), 16, 96, 32)[:, :80]  # K = 80 pads to 96
    for fmt in ("mxfp4", "nvfp4"):
        g = gptq_quantize(w, np.diag(np.arange(1.0, 81.0)), fmt, block=32)
        r = quantize(w, fmt)
        assert np.array_equal(g.codes, r.codes) and np.array_equal(g.scales, r.scales)
    with pytest.raises(ValueError):
        gptq_quantize(w, np.eye(80), "nvfp4", block=24)


# ---- KV modes ----------------------------------------------------------------------------------------
def test_kv_mode_parsing():
    assert [str(KVMode.parse(s)) for s in ("16/16", "8/8", "6/6", "6/4", " 4 / 4 ")] == [
        "16/16", "8/8", "6/6", "6/4", "4/4"]
    assert KVMode.parse("6/4").key_format == "mxfp6" and KVMode.parse("6/4").value_format == "mxfp4"
    for bad in ("5/5", "4/6", "16/8", "8", "a/b", "", "6/4/4", None):
        with pytest.raises(ConfigError):
            KVMode.parse(bad)


def test_kv_bytes_per_element_and_token():
    assert KVMode(16, 16).bytes_per_element == (2.0, 2.0)
    assert KVMode(6, 4).bytes_per_element == (0.78125, 0.53125)
    assert KVMode(8, 8).bytes_per_element == (1.03125, 1.03125)
    cfg = named_config("qwen3.8-27b")  # 16 attention layers x 4 KV heads x head_dim 256 (+ the MTP layer's)
    per_token = {s: kv_bytes_per_token(cfg, s, include_mtp=False) for s in ("16/16", "8/8", "6/6", "6/4", "4/4")}
    assert per_token == {"16/16": 65536, "8/8": 33792, "6/6": 25600, "6/4": 21504, "4/4": 17408}
    assert per_token["6/4"] == 16 * 4 * 256 * (6.25 + 4.25) / 8  # bits per element, 32-block scales included
    assert kv_bytes_per_token(cfg, "6/4") == per_token["6/4"] * (16 + cfg.mtp_num_hidden_layers) // 16
    assert kv_bytes_per_token(cfg, None, include_mtp=False) == 16 * 4 * 256 * 8  # float32 pages
    assert kv_vector_bytes(16, 4) == 16 + 1  # head_dim 16 pads to one 32-block


@pytest.mark.parametrize("bits", [16, 8, 6, 4])
def test_kv_vectors_round_trip(bits):
    x = np.random.default_rng(bits).standard_normal((3, 4, 48)).astype(np.float32)  # head_dim 48 pads to 64
    parts = quantize_kv(x, bits)
    spec = kv_storage_parts(bits, 48)
    assert {k: (v.shape[2:], v.dtype) for k, v in parts.items()} == spec
    assert sum(v.itemsize * v.shape[-1] for v in parts.values()) == kv_vector_bytes(48, bits)
    back = dequantize_kv(parts, bits, 48)
    assert back.shape == x.shape and back.dtype == np.float32
    if bits == 16:
        assert np.array_equal(back, bf16_decode(bf16_encode(x)))
        assert np.allclose(back, x, rtol=2**-8, atol=0)
    else:
        assert np.array_equal(back, dequantize(quantize(x, {8: "mxfp8", 6: "mxfp6", 4: "mxfp4"}[bits])))
    empty = quantize_kv(np.zeros((0, 48), np.float32), bits)
    assert dequantize_kv(empty, bits, 48).shape == (0, 48)
    wrong = {"codes": parts["codes"]} if bits != 16 else {**parts, "scales": parts["codes"]}
    with pytest.raises(ValueError):
        dequantize_kv(wrong, bits, 48)


# ---- size presets -------------------------------------------------------------------------------------
MEGACAPYBARA_GIB = {"tiny": 12.70, "small": 13.67, "medium": 15.39, "large": 18.66, "xxl": 23.58}


def test_presets_grow_strictly_and_sit_in_the_published_ballpark():
    cfg = named_config("qwen3.8-27b")
    gib = {p: preset_bytes(p, cfg) / 2**30 for p in (*MEGACAPYBARA_GIB, "bf16")}
    print({p: round(v, 2) for p, v in gib.items()})
    values = list(gib.values())
    assert all(a < b for a, b in itertools.pairwise(values))
    for p, ref in MEGACAPYBARA_GIB.items():  # documented ballpark (docs/quant.md), not a fit
        assert 0.9 < gib[p] / ref < 1.3, (p, gib[p], ref)
    moe = named_config("qwen3.8-35b-a3b")
    sizes = [preset_bytes(p, moe) for p in (*MEGACAPYBARA_GIB, "bf16")]
    assert all(a < b for a, b in itertools.pairwise(sizes))


def test_preset_formats_per_tensor():
    cfg = named_config("qwen3.8-27b")
    assert preset_formats("tiny", "model.layers.0.mlp.up_proj.weight", cfg) == "mxfp4"
    assert preset_formats("tiny", "lm_head.weight", cfg) == "mxfp6"
    assert preset_formats("small", "model.layers.3.self_attn.q_proj.weight", cfg) == "mxfp6"
    assert preset_formats("xxl", "lm_head.weight", cfg) == "bf16"
    assert preset_formats("xxl", "model.layers.0.linear_attn.in_proj_qkv.weight", cfg) == "mxfp8"
    for name in ("model.layers.0.input_layernorm.weight", "model.layers.0.linear_attn.A_log",
                 "model.layers.0.linear_attn.dt_bias", "model.layers.0.linear_attn.conv1d.weight"):
        assert preset_formats("tiny", name, cfg) == "f32"
    assert preset_formats("tiny", "model.layers.0.linear_attn.in_proj_a.weight", cfg) == "bf16"
    moe = named_config("qwen3.8-35b-a3b")
    assert preset_formats("tiny", "model.layers.0.mlp.gate.weight", moe) == "bf16"
    assert preset_formats("tiny", "model.layers.0.mlp.experts.down_proj", moe) == "mxfp4"
    params = sum(math.prod(s) for s in expected_tensors(cfg).values())
    assert 2 * params < preset_bytes("bf16", cfg) < 2.01 * params
    with pytest.raises(ConfigError):
        preset_formats("huge", "lm_head.weight", cfg)
    with pytest.raises(ConfigError):
        preset_formats("tiny", "model.layers.99.mlp.up_proj.weight", cfg)


@pytest.mark.parametrize("amax", [1e-42, 1e-44, 1.4e-45, 1e-40])
def test_nvfp4_of_a_tensor_of_tiny_values_stays_finite(amax):
    x = np.zeros((2, 32), np.float32)
    x[0, 0], x[1, 20] = np.float32(amax), -np.float32(amax)
    q = quantize(x, "nvfp4")
    assert q.tensor_scale > 0 and np.isfinite(q.tensor_scale)
    deq = dequantize(q)
    assert np.isfinite(deq).all() and not deq[x == 0].any()
    assert deq[0, 0] > 0 and deq[1, 20] < 0
    assert np.allclose(deq, x, rtol=0.25, atol=np.finfo(np.float32).smallest_subnormal * 4)
