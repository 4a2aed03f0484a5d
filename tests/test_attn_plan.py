"""Attention work plans (decapybara/backend/attn_plan.py): the decode kernel's key-split rule and the work items
it yields, on any machine. The GPU tests (tests/gpu/test_cuda_graph.py) check that the graph runner and the
eager plans use it with the device's SM count and residency."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from decapybara.backend import attn_plan as ap

SMS = 132  # an H100 / H200


def graph_splits(seqs: int, keys: int, per_sm: int = 1) -> int:
    """Splits of a decode graph at 27B attention shapes (4 KV heads, one row tile a sequence: 4 CTAs a split)."""
    return ap.decode_splits(4 * seqs, keys, SMS, pow2=True, cap=ap.graph_split_cap(4 * seqs, SMS, per_sm),
                            per_sm=per_sm)


def eager_splits(seqs: int, keys: int, per_sm: int = 1) -> int:
    return ap.decode_splits(4 * seqs, keys, SMS, cap=ap.cdiv(ap.DECODE_WAVES * SMS, 4 * seqs), per_sm=per_sm)


def test_decode_splits_at_27b_shapes():
    """At least 512 keys a split; within that the fewest splits that make 128 CTAs (times the CTAs an SM holds),
    more while the CTAs fill under 80% of their waves' slots; below 32 CTAs, splits down to 128 keys. The
    counts bench/attn_decode.py measured best over bf16 pages (docs/perf.md, fourteenth session)."""
    graph = {(1, 1025): 8, (2, 1025): 4, (4, 1025): 2, (12, 1025): 2, (1, 700): 4, (1, 300): 2, (1, 100): 1,
             (12, 300): 1, (1, 2049): 8, (1, 8193): 16, (4, 8193): 8, (8, 8193): 4, (12, 8193): 8,
             (2, 16385): 16, (12, 16385): 8, (1, 32769): 32, (2, 32769): 16, (4, 32769): 8, (8, 32769): 4,
             (12, 32769): 8, (1, 131073): 32}
    assert {case: graph_splits(*case) for case in graph} == graph
    eager = {(1, 1025): 8, (1, 700): 5, (12, 8193): 5, (12, 32769): 5, (4, 32769): 8, (1, 131073): 32}
    assert {case: eager_splits(*case) for case in eager} == eager
    # three CTAs an SM (6/4-bit pages): three times the CTAs, so one or two sequences keep many splits (one
    # sequence's graphs 64, as many as one wave holds; two sequences' 32, where 64 was slower)
    assert [graph_splits(1, 32769, 3), graph_splits(2, 32769, 3), graph_splits(2, 16385, 3),
            graph_splits(12, 32769, 3)] == [64, 32, 32, 8]
    assert [eager_splits(1, 32769, 3), eager_splits(2, 16385, 3), eager_splits(1, 1025, 3)] == [64, 32, 8]


def test_graph_split_cap(monkeypatch):
    """32, or the power of two one wave of the kernel's CTAs holds where that is more: 64 for one sequence's 4
    CTAs a split at three CTAs an SM (396 slots), 32 at one (132) and for two sequences; DECODE["graph_cap"]
    overrides."""
    assert [ap.graph_split_cap(4, SMS, 3), ap.graph_split_cap(4, SMS, 1), ap.graph_split_cap(8, SMS, 3),
            ap.graph_split_cap(1, SMS, 3), ap.graph_split_cap(2000, SMS, 3)] == [64, 32, 32, 256, 32]
    monkeypatch.setitem(ap.DECODE, "graph_cap", 16)
    assert ap.graph_split_cap(4, SMS, 3) == 16
    monkeypatch.setitem(ap.DECODE, "graph_cap", 48)  # a power of two, as graphs are captured per count
    assert ap.graph_split_cap(4, SMS, 3) == 32


def test_decode_splits_parts_of_the_rule(monkeypatch):
    """Each part of the rule on its own: without the fill part as many splits as 512-key splits allow (the plans
    before it), without the short part no split under 512 keys; pow2 counts are powers of two, cap holds."""
    monkeypatch.setitem(ap.DECODE, "fill_ctas", 0)
    assert graph_splits(1, 40000) == 32 and eager_splits(1, 40000) == 78 and eager_splits(12, 32769) == 22
    monkeypatch.setitem(ap.DECODE, "short_ctas", 0)
    assert graph_splits(1, 1025) == 2 and graph_splits(1, 511) == 1
    monkeypatch.undo()
    for per_split in (1, 3, 4, 12, 48, 200, 2000):
        for keys in (1, 100, 513, 4097, 70000, 10 ** 6):
            n = ap.decode_splits(per_split, keys, SMS, pow2=True, cap=32)
            assert 1 <= n <= 32 and n & (n - 1) == 0, (per_split, keys, n)
            assert n == 1 or keys // n >= ap.DECODE["short_keys"], (per_split, keys, n)
            assert n == 1 or keys // n >= ap.DECODE["min_keys"] or per_split * n <= 2 * ap.DECODE["short_ctas"]
            assert ap.decode_splits(per_split, keys, SMS, cap=3) <= 3


@pytest.mark.parametrize("decode_per_sm,windowed,splits", [(0, False, None), (1, False, None), (3, False, None),
                                                            (0, True, None), (0, True, 3), (0, False, 3)])
@pytest.mark.parametrize("lengths,contexts", [([1] * 12, [1023] * 12), ([1, 1, 1], [5, 40000, 700]),
                                              ([9, 1], [0, 300]), ([300, 40], [9000, 2000])])
def test_plan_work_covers_every_key_once(decode_per_sm, windowed, splits, lengths, contexts):
    """Every tile's keys [0, context + its last token] come in order, once, in whole 32-key tiles but the last
    split; split tiles have one reduce entry over consecutive parts, numbered in order; with windows, no item
    reads keys of two windows of its sequence."""
    g, nkv, block_m = 6, 4, 8
    windows = [(0, 32, 224, 4096)[s % 4] for s in range(len(lengths))] if windowed else None
    work, reduce, parts = ap.plan_work(lengths, contexts, g, nkv, block_m, splits, waves=ap.DECODE_WAVES,
                                       decode_per_sm=decode_per_sm, sms=SMS, windows=windows)
    if windowed:
        for seq, _, begin, end, _ in work.tolist():
            assert not windows[seq] or begin // windows[seq] == (end - 1) // windows[seq], (seq, begin, end)
        plain = ap.plan_work(lengths, contexts, g, nkv, block_m, splits, waves=ap.DECODE_WAVES, sms=SMS)[0]
        assert len(work) > len(plain)
    assert work.dtype == np.int32 and reduce.dtype == np.int32
    tiles = {}
    for seq, row0, begin, end, part in work.tolist():
        tiles.setdefault((seq, row0), []).append((begin, end, part))
    expect = {(s, r): contexts[s] + (min(lengths[s] * g, r + block_m) - 1) // g + 1
              for s in range(len(lengths)) for r in range(0, lengths[s] * g, block_m)}
    assert sorted(tiles) == sorted(expect)
    red = {(s, r): (first, n) for s, r, first, n in reduce.tolist()}
    numbered = []
    for tile, items in tiles.items():
        assert items[0][0] == 0 and items[-1][1] == expect[tile], (tile, items)
        assert all(a[1] == b[0] for a, b in itertools.pairwise(items)), items
        assert all((end - begin) % ap.BLOCK_N == 0 for begin, end, _ in items[:-1]), items
        if len(items) == 1:
            assert items[0][2] == -1 and tile not in red
        else:
            first, n = red[tile]
            assert [p for _, _, p in items] == list(range(first, first + n)), (tile, items)
            numbered += [p for _, _, p in items]
    assert sorted(numbered) == list(range(parts))


def test_rows_per_warp():
    assert [ap.rows_per_warp(256, rows) for rows in (1, 4, 6, 8, 16, 40)] == [1, 1, 2, 2, 4, 4]
    assert [ap.rows_per_warp(64, rows) for rows in (1, 5, 16, 40)] == [1, 2, 4, 8]
