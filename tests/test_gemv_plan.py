"""The skinny GEMM's launch plan (decapybara/backend/gemv_plan.py), checked without a GPU: every stream-K unit
is computed exactly once, each tile's contributors number their partial sums 0..nparts-1 within the buffer,
and the tile-grid splits cover K."""

from __future__ import annotations

import random

import pytest

from decapybara.backend.gemv_plan import GemmPlan, merge_tune, plan_gemm, stream_segments, tune_for

TUNE = {"policy": "auto", "min_chunks": 2, "fill_chunks": 2, "ksplit": 0, "auto_fill": 0.85}


def check_stream(plan: GemmPlan, tiles: int, nchunks: int) -> None:
    blocks = plan.grid[0]
    seen = [[0] * nchunks for _ in range(tiles)]
    parts: dict[int, dict[int, int]] = {}
    for b in range(blocks):
        segs = stream_segments(b, blocks, tiles, nchunks)
        assert segs, f"block {b} of {blocks} has no work"
        for tile, c0, c1, part, nparts in segs:
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
