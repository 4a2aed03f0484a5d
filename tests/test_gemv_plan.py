"""The skinny GEMM's launch plan (decapybara/backend/gemv_plan.py), checked without a GPU: every stream-K unit
is computed exactly once, each tile's contributors number their partial sums 0..nparts-1 within the buffer,
and the tile-grid splits cover K. Also the split-field layout of E2M1 weight codes: the repacking is a bit
permutation, and a numpy model of the kernel's decoders shows that it decodes to the plain decoder's bits."""

from __future__ import annotations

import copy
import pickle
import random

import numpy as np
import pytest

from decapybara.backend.gemv_plan import (
    GemmPlan,
    TuneDict,
    band_rows,
    band_tiles,
    band_tiles_ok,
    e2m1_plain_words,
    e2m1_split_words,
    merge_tune,
    plan_gemm,
    stream_segments,
    tune_for,
)
from decapybara.model.quant import E2M1, bf16_decode, decode_elements

TUNE = {"policy": "auto", "min_chunks": 2, "fill_chunks": 2, "ksplit": 0, "auto_fill": 0.85}


def check_stream(plan: GemmPlan, tiles: int, nchunks: int) -> None:
    blocks = plan.grid[0]
    seen = [[0] * nchunks for _ in range(tiles)]
    parts: dict[int, dict[int, int]] = {}
    segments = []
    for b in range(blocks):
        segs = stream_segments(b, blocks, tiles, nchunks)
        assert segs, f"block {b} of {blocks} has no work"
        segments += segs
    for tile, c0, c1, part, nparts in segments:
        assert 0 <= c0 < c1 <= nchunks
        for c in range(c0, c1):
            seen[tile][c] += 1
        assert 0 <= part < nparts
        if nparts > 1:
            assert nparts <= plan.partial_rows, (nparts, plan.partial_rows)
        assert parts.setdefault(tile, {}).setdefault(part, nparts) == nparts
        assert (c0, c1) != (0, nchunks) or nparts == 1
    assert all(v == 1 for row in seen for v in row), "a unit computed twice or never"
    for tile, p in parts.items():  # contributors 0..nparts-1, all present, all agreeing on nparts
        (nparts,) = set(p.values())
        assert sorted(p) == list(range(nparts)), (tile, p)


@pytest.mark.parametrize("seed", range(40))
def test_stream_k_covers_every_unit_once(seed):
    rng = random.Random(seed)
    tiles, nchunks = rng.randint(1, 300), rng.randint(1, 80)
    slots, mtiles = rng.choice([1, 7, 132, 264, 528]), rng.choice([1, 1, 2, 3])
    tune = {**TUNE, "policy": "stream", "min_chunks": rng.choice([1, 2, 4, 9])}
    plan = plan_gemm(tiles=tiles, nchunks=nchunks, mtiles=mtiles, groups=1, slots=slots, weight_bytes=0,
                     partial_bytes=0, tune=tune)
    assert plan.stream and plan.grid[2] == mtiles
    assert 1 <= plan.grid[0] <= max(1, slots // mtiles)
    check_stream(plan, tiles, nchunks)


def test_stream_k_stays_within_32_bit_unit_arithmetic():
    big = plan_gemm(tiles=1 << 16, nchunks=1 << 10, mtiles=1, groups=1, slots=1 << 10, weight_bytes=0,
                    partial_bytes=0, tune={**TUNE, "policy": "stream"}, max_counters=1 << 17)
    assert not big.stream and big.grid[1] == 1  # 2^26 units x 2^10 blocks: a tile grid, unsplit
    near = plan_gemm(tiles=1 << 12, nchunks=1 << 10, mtiles=1, groups=1, slots=1 << 9, weight_bytes=0,
                     partial_bytes=0, tune={**TUNE, "policy": "stream"})
    assert near.stream and near.grid[0] == 1 << 9  # 2^22 units x 2^9 blocks < 2^32


@pytest.mark.parametrize("policy", ["cost", "wave", "balance", "auto"])
@pytest.mark.parametrize("tiles,nchunks", [(272, 20), (40, 68), (128, 20), (8, 20), (1940, 20), (1, 1), (3, 97)])
def test_every_policy_covers_k(policy, tiles, nchunks):
    plan = plan_gemm(tiles=tiles, nchunks=nchunks, mtiles=1, groups=1, slots=264, weight_bytes=1 << 20,
                     partial_bytes=1 << 12, tune={**TUNE, "policy": policy})
    if plan.stream:
        check_stream(plan, tiles, nchunks)
    else:
        ks = plan.grid[1]
        assert plan.grid[0] == tiles and ks * plan.cps >= nchunks > (ks - 1) * plan.cps
        assert plan.partial_rows == ks


def test_auto_keeps_an_even_wave_and_streams_the_rest():
    def plan(tiles, nchunks):
        return plan_gemm(tiles=tiles, nchunks=nchunks, mtiles=1, groups=1, slots=264, weight_bytes=0,
                         partial_bytes=0, tune=TUNE)
    assert not plan(128, 20).stream and plan(128, 20).grid[1] == 2   # 256 blocks of 10 chunks: one full wave
    assert plan(272, 20).stream                                      # 272 tiles on 264 slots: stream-K
    assert plan(96, 20).stream                                       # a 2-way split fills 73% of the wave


def test_grouped_and_forced_splits():
    grouped = plan_gemm(tiles=12, nchunks=30, mtiles=2, groups=8, slots=264, weight_bytes=0, partial_bytes=0,
                        tune=TUNE, dense=False)
    assert grouped == GemmPlan((12, 1, 16), 30, 1, False)
    forced = plan_gemm(tiles=12, nchunks=30, mtiles=1, groups=1, slots=264, weight_bytes=0, partial_bytes=0,
                       tune={**TUNE, "ksplit": 4})
    assert not forced.stream and forced.grid == (12, 4, 1) and forced.cps == 8
    too_many = plan_gemm(tiles=70_000, nchunks=30, mtiles=1, groups=1, slots=264, weight_bytes=0,
                         partial_bytes=0, tune=TUNE)
    assert too_many.grid[1] == 1 and not too_many.stream  # more tiles than split counters: no split


def test_by_format_tuning_resolves_and_merges():
    """A tuning value is one setting or a dict by weight format ("*": the rest); overrides merge dicts."""
    tune = {"stages": {"*": 2, "mxfp4": 1}, "blocks_per_sm": {"*": 2, "mxfp4": 3}, "warps": 8}
    assert tune_for("mxfp4", tune) == {"stages": 1, "blocks_per_sm": 3, "warps": 8}
    assert tune_for("bf16", tune) == {"stages": 2, "blocks_per_sm": 2, "warps": 8}
    merged = merge_tune(tune, {"stages": {"bf16": 4}, "blocks_per_sm": 1, "acc": 2})
    assert tune_for("bf16", merged) == {"stages": 4, "blocks_per_sm": 1, "warps": 8, "acc": 2}
    assert tune_for("mxfp4", merged) == {"stages": 1, "blocks_per_sm": 1, "warps": 8, "acc": 2}
    assert tune == {"stages": {"*": 2, "mxfp4": 1}, "blocks_per_sm": {"*": 2, "mxfp4": 3}, "warps": 8}
    with pytest.raises(KeyError):  # a by-format dict needs a "*" entry for the formats it does not name
        tune_for("nvfp4", {"stages": {"mxfp4": 1}})


def test_tune_dict_counts_every_change():
    """TUNE's TuneDict moves its version on every way of changing it (caches of what is derived from it key on
    the version), not on reads; copies and pickles keep its contents."""
    t = TuneDict({"warps": 8, "stages": {"*": 2, "mxfp4": 1}})
    seen = [t.version]

    def changed() -> None:
        assert t.version != seen[-1], "a change left the version as it was"
        seen.append(t.version)

    t["warps"] = 4
    changed()
    t.update(acc=2)
    changed()
    t |= {"acc": 1}
    changed()
    t.setdefault("policy", "auto")
    changed()
    assert t.pop("policy") == "auto"
    changed()
    del t["acc"]
    changed()
    t.popitem()
    changed()
    t.clear()
    changed()
    t["warps"] = 8
    changed()
    _ = t["warps"], t.get("stages"), dict(t), list(t.items()), "warps" in t
    assert t.version == seen[-1], "a read moved the version"
    for clone in (copy.deepcopy(t), pickle.loads(pickle.dumps(t))):
        assert type(clone) is TuneDict and clone == t


# ---- E2M1 split-field layout (decapybara/kernels/mx_pairs.cuh) -------------------------------------------------------
U = np.uint32
M, S = U(0x01C001C0), U(0x80008000)


def plain_pairs(v: np.ndarray) -> list[np.ndarray]:
    """`e2m1_pairs` before its FMA, line for line: plain words v -> bf16x2 operands a[r] = (c_r, c_{r+4})."""
    return [((v << U(6)) & M) | ((v << U(12)) & S), ((v << U(2)) & M) | ((v << U(8)) & S),
            ((v >> U(2)) & M) | ((v << U(4)) & S), ((v >> U(6)) & M) | (v & S)]


def split_pairs(w: np.ndarray) -> list[np.ndarray]:
    """`e2m1_pairs_split` before its FMA, line for line (a[0] as the kernel's multiply, wrapping mod 2^32)."""
    return [((w & U(0x20072007)) * U(68)) & (M | S), (w << U(3)) & (M | S), w & (M | S),
            ((w >> U(3)) & M) | ((w << U(1)) & S)]


def split_pairs_by_shifts(w: np.ndarray) -> list[np.ndarray]:
    """The split decoder with a[0] as two shifted fields (what the multiply computes)."""
    return [((w << U(6)) & M) | ((w << U(2)) & S), *split_pairs(w)[1:]]


def words_to_check() -> np.ndarray:
    """uint32 words: every 16-bit half under random other halves, every byte value at every byte position
    (other bytes zero or random), and random words."""
    rng = np.random.default_rng(3)
    half = np.arange(1 << 16, dtype=U)[None, :]
    other = rng.integers(0, 1 << 16, (4, 1), dtype=U)
    byte = np.arange(256, dtype=U)
    per_byte = [(byte << U(8 * j)) | (rng.integers(0, 1 << 32, (2, 256), dtype=U) * U(k) & ~U(0xFF << 8 * j))
                for j in range(4) for k in (0, 1)]
    return np.concatenate([(half | (other << U(16))).ravel(), ((half << U(16)) | other).ravel(),
                           *(b.ravel() for b in per_byte), rng.integers(0, 1 << 32, 1 << 16, dtype=U)])


def test_e2m1_split_words_is_a_bit_permutation_with_its_inverse():
    rng = np.random.default_rng(11)
    for shape in ((7, 16), (2, 3, 40), (0, 8), (4,)):
        raw = rng.integers(0, 256, shape, dtype=np.uint8)
        split = e2m1_split_words(raw)
        assert split.dtype == np.uint8 and split.shape == raw.shape
        np.testing.assert_array_equal(e2m1_plain_words(split), raw)
        np.testing.assert_array_equal(e2m1_split_words(e2m1_plain_words(raw)), raw)
    raw = rng.integers(0, 256, (6, 32), dtype=np.uint8)
    np.testing.assert_array_equal(e2m1_split_words(raw[:, 8:24]), e2m1_split_words(raw)[:, 8:24])  # a strided view
    assert not e2m1_split_words(np.zeros((3, 8), np.uint8)).any()  # zero padding stays zero
    for i in range(32):  # one plain bit -> one split bit, each its own: a permutation of the 32 bits
        one = e2m1_split_words(np.array([1 << i], U).view(np.uint8)).view(U)[0]
        h, r, b = i // 16, (i % 16) // 4, i % 4
        assert one == 1 << (16 * h + (3 * r + b if b < 3 else (13, 12, 15, 14)[r])), f"plain bit {i}"


def test_e2m1_split_layout_on_known_bytes():
    """Plain word 0x876D4BA1, codes c0..c7 = 1, 0xA, 0xB, 4, 0xD, 6, 7, 8 (signs on c1, c2, c4, c7): low half
    magnitudes 1 | 2 << 3 | 3 << 6 | 4 << 9 = 0x08D1, signs of c1, c2 at bits 12, 15 -> 0x98D1; high half
    5 | 6 << 3 | 7 << 6 | 0 << 9 = 0x01F5, signs of c4, c7 at bits 13, 14 -> 0x61F5."""
    got = e2m1_split_words(np.array([0xA1, 0x4B, 0x6D, 0x87], np.uint8))
    np.testing.assert_array_equal(got, np.array([0xD1, 0x98, 0xF5, 0x61], np.uint8))


def test_e2m1_split_decoder_gives_the_plain_decoders_bits():
    """For every code pattern checked, the kernel's split decoder on `e2m1_split_words` of a word gives the same
    bf16x2 operands bit for bit as the plain decoder on the word (so the same products after the same FMA), and
    those are the E2M1 values times 2^-126 (c_r in the low half, c_{r+4} in the high half)."""
    v = words_to_check()
    w = e2m1_split_words(v.view(np.uint8)).view(U)
    plain, split, by_shifts = plain_pairs(v), split_pairs(w), split_pairs_by_shifts(w)
    codes = [(v >> U(4 * i)) & U(0xF) for i in range(8)]
    for r in range(4):
        np.testing.assert_array_equal(split[r], plain[r], err_msg=f"a[{r}]")
        np.testing.assert_array_equal(by_shifts[r], plain[r], err_msg=f"a[{r}], shift form")
        for half, code in ((0, codes[r]), (1, codes[r + 4])):
            bits = ((plain[r] >> U(16 * half)) & U(0xFFFF)).astype(np.uint16)
            want = decode_elements(E2M1, code.astype(np.uint8)).astype(np.float64)
            np.testing.assert_array_equal(bf16_decode(bits).astype(np.float64) * 2.0**126, want,
                                          err_msg=f"a[{r}] half {half}")


def test_e2m1_code_of_a_split_row_as_mx_dequant_rows_reads_it():
    """decapybara/kernels/mx_gemv.cu `e2m1_code` on a split row, line for line: code k from 16-bit half k / 4 (bytes
    2 (k / 4), 2 (k / 4) + 1), magnitude at bits 3r..3r+2 and sign at bit 12 + (r ^ 1), r = k % 4."""
    raw = np.random.default_rng(5).integers(0, 256, 64, dtype=np.uint8)
    row = e2m1_split_words(raw).astype(np.uint32)
    k = np.arange(128)
    half = row[2 * (k >> 2)] | (row[2 * (k >> 2) + 1] << U(8))
    r = (k & 3).astype(np.uint32)
    code = ((half >> (U(3) * r)) & U(7)) | (((half >> (U(12) + (r ^ U(1)))) & U(1)) << U(3))
    np.testing.assert_array_equal(code, (raw[k >> 1] >> (4 * (k & 1))) & 0xF)


def test_e2m1_split_a0_multiply_is_exact_for_every_field_value():
    """a[0] = ((w & 0x20072007) * 68) & (M | S) equals ((w << 6) & M) | ((w << 2) & S) for all 2^8 values of the
    masked bits (both halves' magnitude and sign of code 0), hence for every word."""
    bits = (0, 1, 2, 13, 16, 17, 18, 29)
    x = np.zeros(256, U)
    for j, b in enumerate(bits):
        x |= ((np.arange(256, dtype=U) >> U(j)) & U(1)) << U(b)
    np.testing.assert_array_equal((x * U(68)) & (M | S), ((x << U(6)) & M) | ((x << U(2)) & S))


def test_band_tiles_put_each_warps_chunk_in_one_block_and_invert():
    """Byte j of row r of each matrix lands at (r // 16) * 16 B + (j // 128) * 2048 + (r % 16) * 128 + j % 128
    (the kernel's row_off + lane_off), for single matrices and stacks, and band_rows undoes it."""
    rng = np.random.default_rng(5)
    for shape in ((16, 128), (48, 384), (3, 32, 256)):
        raw = rng.integers(0, 256, shape, dtype=np.uint8)
        tiles = band_tiles(raw)
        assert tiles.shape == raw.shape and tiles.dtype == np.uint8 and tiles.flags.c_contiguous
        np.testing.assert_array_equal(band_rows(tiles), raw)
        flat = tiles.reshape(-1, shape[-2] * shape[-1])
        mats = raw.reshape(-1, *shape[-2:])
        b = shape[-1]
        for e in range(mats.shape[0]):
            for r, j in ((0, 0), (shape[-2] - 1, b - 1), (17 % shape[-2], 130 % b), (5, 127)):
                assert flat[e, (r // 16) * 16 * b + (j // 128) * 2048 + (r % 16) * 128 + j % 128] == mats[e, r, j]
    one = np.zeros((32, 256), np.uint8)
    one[16:, 128:] = 1  # band 1's second chunk: the last 2 KB of the matrix
    assert band_tiles(one).reshape(-1)[-2048:].all() and band_tiles(one).reshape(-1)[:-2048].sum() == 0
    assert band_tiles_ok((32, 256)) and not band_tiles_ok((24, 256)) and not band_tiles_ok((32, 192))
    assert not band_tiles_ok((256,))
    scales = rng.integers(0, 256, (32, 40), dtype=np.uint8)  # MXFP4 scales of K = 1280: 8-byte pieces
    st = band_tiles(scales, 8)
    np.testing.assert_array_equal(band_rows(st, 8), scales)
    assert st.reshape(-1)[(19 // 16) * 16 * 40 + (13 // 8) * 128 + (19 % 16) * 8 + 13 % 8] == scales[19, 13]
    assert band_tiles_ok((32, 40), 8) and not band_tiles_ok((32, 40), 16)
    with pytest.raises(AssertionError):
        band_tiles(np.zeros((8, 128), np.uint8))
