"""The device sampler's edit lists (decapybara/engine/sample_edits.py) against the merge they replaced: the same
tokens, flags, biases and counts, byte for byte, for random rows whose repetition set comes unsorted with repeats
or sorted and unique (the engine's `Sequence.seen_ids`)."""

from __future__ import annotations

import numpy as np
import pytest

from decapybara.engine import sample_edits as se
from decapybara.engine.sampling import SamplerRow, SamplingParams, masked_ids


def reference_row_edits(r, eos):
    """The merge as it was: every list concatenated, one np.unique, ufunc.at updates (the masked ids from the
    reference sampler's own list)."""
    p = r.params
    parts = []
    if p.logit_bias:
        parts.append((np.fromiter(p.logit_bias, np.int64, len(p.logit_bias)), se.EDIT_BIAS,
                      np.fromiter(p.logit_bias.values(), np.float64, len(p.logit_bias)), 0))
    rep = max(p.repetition_penalty, r.extra_repetition_penalty)
    if rep != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
        out_ids, counts = np.unique(np.asarray(r.output_token_ids, np.int64).reshape(-1), return_counts=True)
        if rep != 1.0:
            parts.append((np.union1d(np.asarray(r.prompt_token_ids, np.int64).reshape(-1), out_ids), se.EDIT_SEEN,
                          0.0, 0))
        if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
            parts.append((out_ids, 0, 0.0, counts))
    parts.append((masked_ids(r, eos), se.EDIT_MASK, 0.0, 0))
    ids = np.concatenate([q[0] for q in parts])
    tok, inv = np.unique(ids, return_inverse=True)
    flags, bias, count = np.zeros(tok.size, np.int32), np.zeros(tok.size), np.zeros(tok.size, np.int64)
    np.bitwise_or.at(flags, inv, np.concatenate([np.full(q[0].size, q[1], np.int32) for q in parts]))
    np.add.at(bias, inv, np.concatenate([np.broadcast_to(np.asarray(q[2], np.float64), q[0].shape) for q in parts]))
    np.add.at(count, inv, np.concatenate([np.broadcast_to(np.asarray(q[3], np.int64), q[0].shape) for q in parts]))
    return tok, bias, flags, count


def random_row(rng, v):
    p = SamplingParams(
        temperature=0.7, repetition_penalty=float(rng.choice([1.0, 1.2, 0.8])),
        presence_penalty=float(rng.choice([0.0, 0.5])), frequency_penalty=float(rng.choice([0.0, 0.2])),
        logit_bias={int(t): float(rng.choice([-0.0, 2.5, -7.0])) for t in rng.integers(0, v, rng.integers(0, 4))},
        stop_token_ids=tuple(int(t) for t in rng.integers(0, v, 2)), min_tokens=int(rng.integers(0, 3)),
        ignore_eos=bool(rng.random() < 0.3))
    prompt = rng.integers(0, v, rng.integers(0, 300))
    out = rng.integers(0, v, rng.integers(0, 60)).tolist()
    kind = rng.integers(0, 3)
    if kind == 1:  # the engine's seen_ids: sorted unique, prompt and output together
        prompt = np.unique(np.concatenate([prompt, out])).astype(np.int64)
    elif kind == 2:  # sorted unique, the output's ids not all in it
        prompt = np.unique(prompt).astype(np.int64)
    return SamplerRow(p, prompt if kind else prompt.tolist(), out, position=int(rng.integers(0, 4)), seed=1,
                      extra_repetition_penalty=float(rng.choice([1.0, 1.0, 1.3])),
                      banned_token_ids=rng.integers(0, v, rng.integers(0, 3)))


@pytest.mark.parametrize("v", [50, 5000, 248_320])
def test_edit_lists_equal_the_full_merge(v):
    rng = np.random.default_rng(v)
    eos = np.array([1, 7], np.int64)
    rows = [random_row(rng, v) for _ in range(300)]
    for i, r in enumerate(rows):
        got, ref = se.row_edits(r, eos), reference_row_edits(r, eos)
        for g, f, name in zip(got, ref, ("tokens", "bias", "flags", "counts")):
            assert g.dtype == f.dtype and np.array_equal(g.view(np.uint64) if g.dtype == np.float64 else g,
                                                         f.view(np.uint64) if f.dtype == np.float64 else f), (i, name)
        assert se.needs_edits(r) or got[0].size == 0
    lists = se.edit_lists(rows, eos)
    ptr, row = lists[:2]
    per = [reference_row_edits(r, eos) if se.needs_edits(r) else (np.zeros(0, np.int64),) * 4 for r in rows]
    assert np.array_equal(np.diff(ptr), [e[0].size for e in per]) and ptr[-1] == row.size
    assert np.array_equal(row, np.concatenate([np.full(e[0].size, i) for i, e in enumerate(per)]))
    for got, j, dtype in zip(lists[2:], range(4), (np.int32, np.float64, np.int32, np.int32)):
        assert got.dtype == dtype and np.array_equal(got, np.concatenate([e[j] for e in per]).astype(dtype)), j
