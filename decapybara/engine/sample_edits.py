"""The device sampler's edit lists (decapybara/kernels/sample.cu `sample_edits`): sampling steps 1-3 of
`decapybara.engine.sampling` (logit bias, repetition / presence / frequency penalties, masks) as sparse
per-(row, token) edits, merged per token so that the kernel applies each token's edits once, in the reference's
order. Pure numpy (the host half of `cupy_ops_extra.cuda_sample`).

A repetition-penalty row's set (its prompt's and output's ids) can be as large as the context's distinct ids.
When the row brings it sorted and unique (the engine's `Sequence.seen_ids`), the lists are merged into it by
binary search rather than by sorting everything again: ~1 ms a row for 20k distinct ids, 10x that at 100k, was
the cost of each step.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from decapybara.engine.sampling import masked_ids, union_sorted

EDIT_SEEN, EDIT_MASK, EDIT_BIAS = 1, 2, 4  # flags of an edit: the repetition penalty's set, masked, has a bias


def needs_edits(r: Any) -> bool:
    """Whether a row's sampling steps 1-3 change any logit (`row_edits` would return edits)."""
    p = r.params
    return bool(p.logit_bias or max(p.repetition_penalty, r.extra_repetition_penalty) != 1.0 or p.presence_penalty
                or p.frequency_penalty or len(r.banned_token_ids) or r.position < p.min_tokens)


def _sorted_unique(a: np.ndarray) -> bool:
    return a.size < 2 or bool((a[1:] > a[:-1]).all())


def row_edits(r: Any, eos: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One row's edits merged per token: (tokens sorted unique int64, bias float64 (the logit bias, else 0),
    flags int32 (EDIT_*), output counts int64 (presence / frequency, else 0))."""
    p = r.params
    parts: list[tuple[np.ndarray, int, Any, Any]] = []  # the small lists: (unique ids, flag, bias, count)
    if p.logit_bias:
        ids = np.fromiter(p.logit_bias, np.int64, len(p.logit_bias))
        parts.append((ids, EDIT_BIAS, np.fromiter(p.logit_bias.values(), np.float64, len(p.logit_bias)), 0))
    seen = None
    rep = max(p.repetition_penalty, r.extra_repetition_penalty)
    if rep != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
        out_ids, counts = np.unique(np.asarray(r.output_token_ids, np.int64).reshape(-1), return_counts=True)
        if rep != 1.0:
            prompt = np.asarray(r.prompt_token_ids, np.int64).reshape(-1)
            seen = union_sorted(prompt, out_ids) if _sorted_unique(prompt) else np.union1d(prompt, out_ids)
        if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
            parts.append((out_ids, 0, 0.0, counts))
    parts.append((np.unique(masked_ids(r, eos)), EDIT_MASK, 0.0, 0))
    small = np.unique(np.concatenate([q[0] for q in parts]))
    tok = small if seen is None else union_sorted(seen, small)
    flags, bias, count = np.zeros(tok.size, np.int32), np.zeros(tok.size), np.zeros(tok.size, np.int64)
    if seen is not None:
        flags[np.searchsorted(tok, seen)] |= EDIT_SEEN
    for ids, flag, b, c in parts:  # each list's ids are unique: plain indexed updates
        at = np.searchsorted(tok, ids)
        flags[at] |= flag
        bias[at] += b
        count[at] += c
    return tok, bias, flags, count


def edit_lists(rows: Any, eos: np.ndarray) -> tuple[np.ndarray, ...]:
    """All rows' edits as CSR: (row pointer [B + 1], row, token, bias, flags, count) arrays, the kernels' dtypes."""
    empty_row = (np.zeros(0, np.int64), np.zeros(0), np.zeros(0, np.int32), np.zeros(0, np.int64))
    per = [row_edits(r, eos) if needs_edits(r) else empty_row for r in rows]
    ptr = np.concatenate([[0], np.cumsum([e[0].size for e in per])]).astype(np.int32)
    row = np.concatenate([np.full(e[0].size, i, np.int32) for i, e in enumerate(per)])
    tok, bias, flags, count = (np.concatenate([e[j] for e in per]) for j in range(4))
    return ptr, row, tok.astype(np.int32), bias.astype(np.float64), flags.astype(np.int32), count.astype(np.int32)
