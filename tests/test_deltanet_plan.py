"""The DeltaNet core's work plans (decapybara/backend/deltanet_plan.py), on any machine: runs of a forward's
segments, the chunked prefill's chunk table and which runs it takes. The GPU tests (tests/gpu/test_kernels_core.py)
run the kernels over these plans against the numpy reference."""

from __future__ import annotations

import numpy as np
import pytest

from decapybara.backend import deltanet_plan as dp
from decapybara.backend.base import DeltaNetSegment as Seg
from decapybara.backend.numpy_backend import gated_delta_chunk

# a prompt's chunk in three segments (snapshots after 64 and 215 rows), a decode row, another prompt's 129 rows
SEGS = [Seg(0, 64, 0, (0, 64)), Seg(64, 1, 0, None), Seg(65, 150, 0, (0, 215)), Seg(215, 1, 1, None),
        Seg(216, 129, 2, None)]


def test_group_runs_merges_a_sequence_s_consecutive_segments():
    g = dp.group_runs(SEGS)
    assert g.runs == [[0, 215, 0, 0, 3], [215, 1, 1, 3, 1], [216, 129, 2, 4, 1]]
    assert g.segs == [(64, 0), (65, -1), (215, 1), (1, -1), (129, -1)]  # ends from the run's start, snapshots
    assert g.snapshot_keys == [(0, 64), (0, 215)] and g.max_len == 215
    assert dp.group_runs([]).max_len == 0


@pytest.mark.parametrize("segments, match", [
    ([Seg(0, 0, 0)], "empty"),
    ([Seg(0, 4, 0), Seg(5, 4, 0)], "consecutive"),  # a gap in one slot's rows
    ([Seg(0, 4, 0), Seg(4, 4, 1), Seg(8, 4, 0)], "consecutive"),  # a slot in two places
])
def test_group_runs_refuses_what_no_kernel_can_take(segments, match):
    with pytest.raises(ValueError, match=match):
        dp.group_runs(segments)


def test_chunk_table_cuts_each_segment_from_its_start():
    g = dp.group_runs(SEGS)
    long, short = dp.split_runs(g.runs)
    assert long == [g.runs[0], g.runs[2]] and short == [g.runs[1]]  # the decode row stays with gdn_recurrent
    chunks, run_chunks = dp.chunk_table(SEGS, long, [s[1] for s in g.segs])
    assert chunks.dtype == np.int32 and run_chunks.dtype == np.int32
    assert chunks.tolist() == [[0, 64, 0], [64, 1, -1], [65, 64, -1], [129, 64, -1], [193, 22, 1],
                               [216, 64, -1], [280, 64, -1], [344, 1, -1]]
    assert run_chunks.tolist() == [[0, 5], [5, 3]]
    empty = dp.chunk_table(SEGS, [], [s[1] for s in g.segs])
    assert empty[0].shape == (0, 3) and empty[1].shape == (0, 2)


def test_chunks_are_the_reference_s_chunks():
    """The reference run one chunk-table chunk at a time (each a call of at most CHUNK rows from the state the last
    left) gives the bits of the reference over the whole segment: the table cuts where the reference does."""
    rng = np.random.default_rng(0)
    h, n, d = 2, 150, 8
    q, k, v = (rng.standard_normal((h, n, d)).astype(np.float32) * 0.3 for _ in range(3))
    g = -np.abs(rng.standard_normal((h, n))).astype(np.float32) * 0.1
    beta = (1 / (1 + np.exp(-rng.standard_normal((h, n))))).astype(np.float32)
    whole_state = np.zeros((h, d, d), np.float32)
    whole = gated_delta_chunk(q, k, v, g, beta, whole_state)
    seg = [Seg(0, n, 0)]
    chunks, _ = dp.chunk_table(seg, dp.group_runs(seg).runs, [-1])
    state = np.zeros((h, d, d), np.float32)
    parts = [gated_delta_chunk(*(a[:, r:r + c] for a in (q, k, v, g, beta)), state) for r, c, _ in chunks.tolist()]
    assert np.array_equal(np.concatenate(parts, axis=1), whole) and np.array_equal(state, whole_state)
