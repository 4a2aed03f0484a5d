"""Work plans of the device's Gated DeltaNet core, on any machine (cupy_deltanet turns them into device arrays).

`group_runs(segments)` groups a forward's `DeltaNetSegment`s into runs: maximal groups of consecutive segments
of one sequence (same state slot, contiguous rows), the unit every DeltaNet kernel takes. `split_runs` separates
the runs the chunked prefill takes (CHUNK rows or more) from those gdn_recurrent keeps, and `chunk_table` cuts
the former's segments into the chunks the numpy reference uses (at most CHUNK rows, from each segment's start).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from decapybara.backend.base import DeltaNetSegment

CHUNK = 64  # the reference's chunk: the state is stored as float32 every CHUNK tokens of a segment


@dataclass(slots=True)
class RunGroups:
    """A forward's segments as runs (host lists; RunPlan's device arrays hold the same rows)."""

    runs: list[list[int]]  # [first row, rows, slot, first segment, number of segments] a run
    segs: list[tuple[int, int]]  # (segment end in rows from its run's start, snapshot index or -1) a segment
    snapshot_keys: list[tuple[int, int]]  # snapshot index -> key

    @property
    def max_len(self) -> int:
        return max((r[1] for r in self.runs), default=0)


def group_runs(segments: list[DeltaNetSegment]) -> RunGroups:
    """Runs of `segments`, in order. Raises ValueError on an empty segment, or on a slot whose segments are not
    consecutive rows of one sequence."""
    runs: list[list[int]] = []
    segs: list[tuple[int, int]] = []
    keys: list[tuple[int, int]] = []
    for seg in segments:
        if seg.length <= 0:
            raise ValueError(f"empty DeltaNet segment {seg}")
        last = runs[-1] if runs else None
        if last is not None and last[2] == seg.slot and last[0] + last[1] == seg.start:
            last[1] += seg.length
            last[4] += 1
        else:
            runs.append([seg.start, seg.length, seg.slot, len(segs), 1])
            last = runs[-1]
        snap = -1
        if seg.snapshot_key is not None:
            snap = len(keys)
            keys.append(seg.snapshot_key)
        segs.append((last[1], snap))
    slots = [r[2] for r in runs]
    if len(set(slots)) != len(slots):
        raise ValueError(f"state slots {slots}: a slot's segments must be consecutive rows of one sequence")
    return RunGroups(runs, segs, keys)


def split_runs(runs: list[list[int]], min_rows: int = CHUNK) -> tuple[list[list[int]], list[list[int]]]:
    """(runs of at least `min_rows` rows, the others), each in order."""
    return [r for r in runs if r[1] >= min_rows], [r for r in runs if r[1] < min_rows]


def chunk_table(segments: list[DeltaNetSegment], runs: list[list[int]],
                snaps: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(chunks [NCH, 3], run_chunks [R, 2]) int32 of `runs` (rows of RunGroups.runs over `segments`; snaps[i] the
    snapshot index of segment i or -1): a chunk's first row, rows and snapshot index (its segment's, on the
    segment's last chunk; else -1); a run's first chunk and number of chunks."""
    chunks: list[tuple[int, int, int]] = []
    run_chunks: list[tuple[int, int]] = []
    for run in runs:
        first = len(chunks)
        for i in range(run[3], run[3] + run[4]):
            seg = segments[i]
            for off in range(0, seg.length, CHUNK):
                n = min(CHUNK, seg.length - off)
                chunks.append((seg.start + off, n, snaps[i] if off + n == seg.length else -1))
        run_chunks.append((first, len(chunks) - first))
    return np.asarray(chunks, np.int32).reshape(-1, 3), np.asarray(run_chunks, np.int32).reshape(-1, 2)
