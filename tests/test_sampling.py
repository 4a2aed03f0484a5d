"""The sampler: Philox KAT, the uniform draw contract, each logit processor, the draw's distribution."""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest

from decapybara.engine import sampling
from decapybara.engine.philox import bits_to_uniform, philox4x32, philox4x32_10, uniform, uniforms
from decapybara.engine.sampling import (
    SamplerRow,
    SamplingParams,
    apply_penalties,
    log_softmax,
    mask_min_p,
    mask_top_k,
    mask_top_p,
    sample,
)
from decapybara.errors import InvalidRequestError

# ------------------------------------------------------------------------------------------------ Philox

# Known-answer vectors copied from Random123's tests/kat_vectors (github.com/DEShawResearch/random123,
# commit 9545ff6413f258be2f04c1d319d99aaef7521150, lines 24-29): rounds, counter[4], key[2] -> output[4].
RANDOM123_KAT = [
    (7, "00000000 00000000 00000000 00000000", "00000000 00000000", "5f6fb709 0d893f64 4f121f81 4f730a48"),
    (7, "ffffffff ffffffff ffffffff ffffffff", "ffffffff ffffffff", "5207ddc2 45165e59 4d8ee751 8c52f662"),
    (7, "243f6a88 85a308d3 13198a2e 03707344", "a4093822 299f31d0", "4dfccaba 190a87f0 c47362ba b6b5242a"),
    (10, "00000000 00000000 00000000 00000000", "00000000 00000000", "6627e8d5 e169c58d bc57ac4c 9b00dbd8"),
    (10, "ffffffff ffffffff ffffffff ffffffff", "ffffffff ffffffff", "408f276d 41c83b0e a20bc7c6 6d5451fd"),
    (10, "243f6a88 85a308d3 13198a2e 03707344", "a4093822 299f31d0", "d16cfe09 94fdcceb 5001e420 24126ea1"),
]


def _words(text: str) -> list[int]:
    return [int(w, 16) for w in text.split()]


@pytest.mark.parametrize("rounds,counter,key,expected", RANDOM123_KAT)
def test_philox_matches_random123_known_answers(rounds, counter, key, expected):
    out = philox4x32(np.array(_words(counter), np.uint32), np.array(_words(key), np.uint32), rounds=rounds)
    assert out.dtype == np.uint32
    assert out.tolist() == _words(expected)
    if rounds == 10:
        assert philox4x32_10(_words(counter), _words(key)).tolist() == _words(expected)


def _philox_scalar(ctr: list[int], key: list[int], rounds: int = 10) -> list[int]:
    """Plain-integer Philox4x32-R written from the paper's round function (independent of the numpy code)."""
    c, k = list(ctr), list(key)
    for r in range(rounds):
        if r:
            k = [(k[0] + 0x9E3779B9) % 2**32, (k[1] + 0xBB67AE85) % 2**32]
        a, b = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(b >> 32) ^ c[1] ^ k[0], b % 2**32, (a >> 32) ^ c[3] ^ k[1], a % 2**32]
    return c


def test_philox_vectorised_agrees_with_scalar_reference_and_broadcasts_the_key():
    rng = np.random.default_rng(0)
    counters = rng.integers(0, 2**32, size=(3, 50, 4), dtype=np.uint64).astype(np.uint32)
    key = np.array([0xDEADBEEF, 0x01234567], np.uint32)
    out = philox4x32_10(counters, key)  # key broadcast over [3, 50]
    assert out.shape == (3, 50, 4)
    for idx in np.ndindex(3, 50):
        assert out[idx].tolist() == _philox_scalar(counters[idx].tolist(), key.tolist())


# ------------------------------------------------------------------------------------------------ uniform


def test_uniform_of_seed0_position0_is_the_first_kat_word():
    # counter = key = 0 is Random123's first philox4x32-10 vector, whose first word is 0x6627e8d5.
    assert uniform(0, 0) == ((0x6627E8D5 >> 8) + 0.5) * 2.0**-24


def test_uniform_counter_and_key_layout():
    seed, pos, stream = 0x0123456789ABCDEF, 0x1122334455667788, 5
    x0 = _philox_scalar([0x55667788, 0x11223344, stream, 0], [0x89ABCDEF, 0x01234567])[0]
    assert uniform(seed, pos, stream) == ((x0 >> 8) + 0.5) / 2**24
    vec = uniforms([seed, seed], [pos, pos + 1], stream)
    assert vec[0] == uniform(seed, pos, stream) and vec[1] == uniform(seed, pos + 1, stream)


def test_bits_to_uniform_stays_strictly_inside_the_unit_interval():
    lo, low_bits_dropped, hi = bits_to_uniform(np.array([0, 0xFF, 0xFFFFFFFF], np.uint32))
    assert lo == low_bits_dropped == 2.0**-25 and hi == 1.0 - 2.0**-25
    assert 0.0 < lo and hi < 1.0


def test_uniforms_are_reproducible_distinct_and_uniform():
    positions = np.arange(20000)
    u = uniforms(np.full(20000, 3), positions)
    assert np.array_equal(u, uniforms(np.full(20000, 3), positions))
    assert np.all((u > 0) & (u < 1))
    hist = np.bincount((u * 20).astype(int), minlength=20)
    assert _chi2_sf(float(np.sum((hist - 1000.0) ** 2 / 1000.0)), 19) > 1e-4
    assert np.mean(uniforms(np.full(20000, 4), positions) == u) < 0.001  # another seed
    assert np.mean(uniforms(np.full(20000, 3), positions, stream=1) == u) < 0.001  # another stream
    assert len(np.unique(u[:1000])) == 1000  # another position
    assert [uniform(3, p) for p in range(5)] == u[:5].tolist()


def test_uniform_seed_wraps_modulo_2_64_and_rejects_bad_positions():
    assert uniform(-1, 9) == uniform(2**64 - 1, 9)
    assert uniform(7, 2**64 - 1) == uniforms([7], np.array([2**64 - 1], np.uint64))[0]
    with pytest.raises(ValueError):
        uniform(7, 2**64)
    with pytest.raises(ValueError):
        uniform(7, -1)


# ------------------------------------------------------------------------------------------------ helpers


def _chi2_sf(x: float, df: int) -> float:
    """Exact chi-square survival function for integer df (recurrence from df = 1 or 2)."""
    if df % 2:
        q, k = math.erfc(math.sqrt(x / 2)), 1
    else:
        q, k = math.exp(-x / 2), 2
    while k < df:
        q += math.exp(-x / 2 + (k / 2) * math.log(x / 2) - math.lgamma(k / 2 + 1))
        k += 2
    return q


def _row(params: SamplingParams, seed: int = 0, position: int = 0, prompt=(), output=(), **kw) -> SamplerRow:
    return SamplerRow(params=params, prompt_token_ids=list(prompt), output_token_ids=list(output),
                      position=position, seed=seed, **kw)


def _all_logprobs(logits: list[float], row: SamplerRow) -> np.ndarray:
    """The processed logprobs of every token of a small vocab, read back through SampleOutput (at float32
    precision: compare within ~1e-6)."""
    out = sample(np.array([logits], np.float32), [row])
    lp = np.full(len(logits), -np.inf)
    for tok, value in out.top_logprobs[0]:
        lp[tok] = value
    return lp


def test_chi2_sf_matches_known_critical_values():
    assert _chi2_sf(3.841458820694124, 1) == pytest.approx(0.05, rel=1e-9)
    assert _chi2_sf(5.991464547107979, 2) == pytest.approx(0.05, rel=1e-9)
    assert _chi2_sf(33.1369, 10) == pytest.approx(2.58e-4, rel=1e-2)


# ------------------------------------------------------------------------------------------------ penalties

LOGITS = [2.0, -1.0, 0.5, 3.0, -2.0, 1.0]


def test_penalties_hand_computed():
    # prompt {0, 4}, output [1, 1, 3]: repetition 2 on {0, 1, 3, 4}, then presence 0.5 / frequency 0.25 on
    # the output counts {1: 2, 3: 1} only.
    got = apply_penalties(np.array(LOGITS), [0, 4], [1, 1, 3], repetition=2.0, presence=0.5, frequency=0.25)
    assert got.tolist() == [1.0, -3.0, 0.5, 0.75, -4.0, 1.0]
    assert apply_penalties(np.array(LOGITS), [0, 4], [1, 1, 3], presence=0.5).tolist() == [
        2.0, -1.5, 0.5, 2.5, -2.0, 1.0]  # presence counts a token once, the prompt not at all
    assert apply_penalties(np.array(LOGITS), [0, 4], [1, 1, 3], frequency=-1.0).tolist() == [
        2.0, 1.0, 0.5, 4.0, -2.0, 1.0]  # negative frequency rewards repeats
    assert apply_penalties(np.array(LOGITS), [0, 4], [], repetition=0.5).tolist() == [
        4.0, -1.0, 0.5, 3.0, -1.0, 1.0]  # r < 1 favours seen tokens


def test_logit_bias_then_penalties_inside_sample():
    params = SamplingParams(temperature=0, repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25,
                            logit_bias={4: 3.0, 5: 2.0}, logprobs=6)
    lp = _all_logprobs(LOGITS, _row(params, prompt=[0, 4], output=[1, 1, 3], position=3))
    # token 4: (-2 + 3) / 2 = 0.5 (bias first); token 5: 1 + 2 = 3 (not seen).
    expected = log_softmax(np.array([1.0, -3.0, 0.5, 0.75, 0.5, 3.0]))
    np.testing.assert_allclose(lp, expected, rtol=0, atol=1e-6)


def test_loopguard_extra_repetition_penalty_takes_the_max():
    lp = _all_logprobs(LOGITS, _row(SamplingParams(temperature=0, repetition_penalty=1.5, logprobs=6),
                                    output=[3], position=1, extra_repetition_penalty=2.0))
    np.testing.assert_allclose(lp, log_softmax(np.array([2.0, -1.0, 0.5, 1.5, -2.0, 1.0])), atol=1e-6)
    lp = _all_logprobs(LOGITS, _row(SamplingParams(temperature=0, repetition_penalty=3.0, logprobs=6),
                                    output=[3], position=1, extra_repetition_penalty=2.0))
    np.testing.assert_allclose(lp, log_softmax(np.array([2.0, -1.0, 0.5, 1.0, -2.0, 1.0])), atol=1e-6)


def test_repetition_penalty_past_its_bounds_is_refused_and_at_them_every_row_still_samples():
    """Past its bounds a repetition penalty turned a row's seen logits -inf (a negative logit times r) or +inf (a
    positive one over r): a row of seen tokens had NaN weights and drew garbage (the device sampler: an id outside
    the vocabulary) with a NaN logprob. Such values are refused; at the bounds, float32's extreme logits at the least
    temperature still draw a token of the vocabulary with a finite logprob."""
    for r in (1e300, 1e-300, 2 * sampling.MAX_REPETITION_PENALTY):
        with pytest.raises(InvalidRequestError, match="repetition_penalty"):
            SamplingParams(repetition_penalty=r).validate(vocab_size=4)
    big = float(np.finfo(np.float32).max)
    logits = np.array([[-big, -big / 2, -3.0, -4.0], [big, big / 2, 3.0, 4.0]], np.float32)
    for r in (sampling.MAX_REPETITION_PENALTY, 1 / sampling.MAX_REPETITION_PENALTY):
        for t in (0.0, sampling.GREEDY_TEMPERATURE, 1.0):
            params = SamplingParams(temperature=t, repetition_penalty=r, logit_bias={0: -100.0, 1: 100.0},
                                    logprobs=4)
            params.validate(vocab_size=4)
            out = sample(logits, [_row(params, seed=s, prompt=[0, 1, 2, 3]) for s in range(2)])
            assert np.isfinite(out.logprobs).all() and ((out.token_ids >= 0) & (out.token_ids < 4)).all(), (r, t)


# ------------------------------------------------------------------------------------------------ masks

PROBS = np.log(np.array([[0.1, 0.5, 0.15, 0.25]]))  # canonical order: 1, 3, 2, 0


def _kept(x: np.ndarray) -> list[list[int]]:
    return [np.flatnonzero(np.isfinite(row)).tolist() for row in x]


def test_top_k_keeps_exactly_k_with_ties_to_the_lowest_id():
    x = np.array([[1.0, 3.0, 2.0, 3.0, 0.5], [1.0, 2.0, 2.0, 2.0, 0.0], [1.0, 2.0, 2.0, 2.0, 0.0]])
    assert _kept(mask_top_k(x, np.array([2, 2, 0]))) == [[1, 3], [1, 2], [0, 1, 2, 3, 4]]
    assert _kept(mask_top_k(x, np.array([3, 1, 5]))) == [[1, 2, 3], [1], [0, 1, 2, 3, 4]]


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    x = np.repeat(PROBS, 5, axis=0)
    got = _kept(mask_top_p(x, np.array([0.4, 0.7, 0.8, 0.95, 1.0])))
    assert got == [[1], [1, 3], [1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3]]
    # tokens 1 and 3 hold 0.75 together: just below it they suffice, just above it token 2 joins.
    assert _kept(mask_top_p(x[:2], np.array([0.75 - 1e-9, 0.75 + 1e-9]))) == [[1, 3], [1, 2, 3]]
    # four equal tokens (exact quarters): a prefix whose mass EQUALS p is enough.
    assert _kept(mask_top_p(np.zeros((2, 4)), np.array([0.25, 0.5]))) == [[0], [0, 1]]


def test_top_p_renormalises_after_top_k():
    # after top-k = 2 the kept probabilities are 2/3 and 1/3, so p = 0.6 keeps one token (not two).
    assert _kept(mask_top_p(mask_top_k(PROBS, np.array([2])), np.array([0.6]))) == [[1]]
    assert _kept(mask_top_p(PROBS, np.array([0.6]))) == [[1, 3]]


def test_min_p_keeps_tokens_above_a_fraction_of_the_max():
    x = np.repeat(PROBS, 4, axis=0)
    assert _kept(mask_min_p(x, np.array([0.25, 0.45, 0.6, 0.0]))) == [[1, 2, 3], [1, 3], [1], [0, 1, 2, 3]]
    # token 3 has exactly half the top probability.
    assert _kept(mask_min_p(x[:2], np.array([0.5 - 1e-9, 0.5 + 1e-9]))) == [[1, 3], [1]]


def test_top_k_1_and_tiny_top_p_take_the_first_canonical_token_but_min_p_1_keeps_ties():
    logits = np.array([[0.3, 1.2, 1.2, -0.5]], np.float32)
    for seed in range(20):
        for params in (SamplingParams(top_p=1e-9), SamplingParams(top_k=1)):
            assert sample(logits, [_row(params, seed=seed)]).token_ids[0] == 1
    tokens = {int(sample(logits, [_row(SamplingParams(min_p=1.0), seed=s)]).token_ids[0]) for s in range(40)}
    assert tokens == {1, 2}


# ------------------------------------------------------------------------------------------------ greedy, eos


def test_greedy_is_argmax_with_ties_to_the_lowest_id_and_ignores_the_seed():
    logits = np.array([[0.5, 2.0, -1.0, 2.0], [3.0, 3.0, 3.0, 3.0]], np.float32)
    for seed in range(10):
        rows = [_row(SamplingParams(temperature=0, top_k=1), seed=seed), _row(SamplingParams(temperature=0))]
        assert sample(logits, rows).token_ids.tolist() == [1, 0]


def test_tiny_temperatures_are_greedy_and_bad_logits_do_not_poison_the_row():
    logits = np.array([[0.5, 2.0, -1.0, 1.9], [np.nan, 1.0, 3.0, np.inf], [np.nan, -np.inf, 0.0, np.nan]],
                      np.float32)
    params = SamplingParams(temperature=1e-300, logprobs=2)
    out = sample(logits, [_row(params, seed=s) for s in range(3)])
    assert out.token_ids.tolist() == [1, 3, 2]  # NaN counts as -inf, +inf as the largest finite logit
    assert np.isfinite(out.logprobs).all() and params.greedy
    with pytest.raises(ValueError):
        sample(np.full((1, 4), np.nan, np.float32), [_row(SamplingParams())])


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = np.array([[1.0, 0.0, 2.0, 0.5, 3.0]], np.float32)  # eos = 4, stop id = 2
    params = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=(2,), logprobs=5)
    for position, expected in [(0, 0), (2, 0), (3, 4)]:
        out = sample(logits, [_row(params, position=position)], eos_token_ids=(4,))
        assert out.token_ids[0] == expected
        assert (expected == 4) == any(t in (2, 4) for t, _ in out.top_logprobs[0])
    ignore = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=(4,), ignore_eos=True)
    assert sample(logits, [_row(ignore)], eos_token_ids=(2,)).token_ids[0] == 2  # eos free, stop id masked


def test_banned_tokens_are_never_sampled_unless_everything_is_banned():
    logits = np.array([[1.0, 4.0, 3.9, 0.0]], np.float32)
    assert sample(logits, [_row(SamplingParams(temperature=0), banned_token_ids=[1])]).token_ids[0] == 2
    for seed in range(50):
        row = _row(SamplingParams(temperature=5.0), seed=seed, banned_token_ids=[1, 2])
        assert sample(logits, [row]).token_ids[0] in (0, 3)
    everything = _row(SamplingParams(temperature=0), banned_token_ids=[0, 1, 2, 3])
    assert sample(logits, [everything]).token_ids[0] == 1


# ------------------------------------------------------------------------------------------------ the draw


def test_draw_is_the_inverse_cdf_in_canonical_order():
    x = [0.1, 2.0, 1.0, 2.0, -1.0]  # tokens 1 and 3 tie: 1 comes first
    order = sorted(range(5), key=lambda i: (-x[i], i))
    w = [math.exp(x[i] - 2.0) for i in order]
    cdf = [sum(w[: j + 1]) for j in range(5)]
    rows = [_row(SamplingParams(), seed=11, position=p) for p in range(300)]
    got = sample(np.array([x] * 300, np.float32), rows).token_ids
    for p in range(300):
        u = uniform(11, p)
        assert got[p] == order[next(j for j in range(5) if cdf[j] > u * cdf[-1])]
    assert {1, 3} <= set(got.tolist())


def _counts(logits: list[float], params: SamplingParams, n: int = 20000) -> np.ndarray:
    rows = [_row(params, seed=1234, position=p) for p in range(n)]
    tokens = sample(np.array([logits] * n, np.float32), rows).token_ids
    return np.bincount(tokens, minlength=len(logits))


def _gof_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    keep = probs > 0
    expected = probs[keep] * counts.sum()
    return _chi2_sf(float(np.sum((counts[keep] - expected) ** 2 / expected)), int(keep.sum()) - 1)


CHI_LOGITS = [2.0, 1.5, 1.0, 0.6, 0.2, -0.3, -0.8, 0.9, 1.7]


def test_temperature_sampling_fits_softmax_over_temperature():
    counts = _counts(CHI_LOGITS, SamplingParams(temperature=0.7))
    x = np.array(CHI_LOGITS, np.float32).astype(np.float64)
    assert _gof_pvalue(counts, np.exp(log_softmax(x / 0.7))) > 1e-4
    assert _gof_pvalue(counts, np.exp(log_softmax(x))) < 1e-12  # the test has power: T = 1 is rejected


def test_truncated_sampling_fits_the_renormalised_kept_set():
    params = SamplingParams(temperature=1.3, top_k=7, top_p=0.9, min_p=0.2)
    counts = _counts(CHI_LOGITS, params)
    x = np.array(CHI_LOGITS, np.float32).astype(np.float64) / 1.3
    order = sorted(range(9), key=lambda i: (-x[i], i))[:7]  # top-k
    p = np.exp(x[order] - x[order].max())
    p /= p.sum()
    kept = [t for j, t in enumerate(order) if p[:j].sum() < 0.9 and p[j] >= 0.2 * p.max()]
    probs = np.zeros(9)
    probs[kept] = np.exp(x[kept] - x.max())
    probs /= probs.sum()
    assert 2 <= len(kept) < 7
    assert counts[probs == 0].sum() == 0
    assert _gof_pvalue(counts, probs) > 1e-4


def test_large_vocab_candidate_path_draws_exactly_what_the_full_sort_draws(monkeypatch):
    rng = np.random.default_rng(9)
    vocab, n = 400, 64
    cases = [(0, 1.0, 0.0), (5, 1.0, 0.0), (0, 0.3, 0.0), (0, 0.9, 0.0), (0, 0.999, 0.0), (50, 0.9, 0.0),
             (0, 1.0, 0.01), (0, 0.95, 0.05), (1, 1.0, 0.0), (399, 0.999, 0.001), (0, 1.0, 0.3)]
    full_row_calls = []
    real_full_row = sampling._full_row
    for top_k, top_p, min_p in cases:
        # rounded logits give ties; a tall head and a long flat tail make the tail matter for the draw.
        x = np.round(rng.normal(0, 1.5, (n, vocab)), 1)
        x[:, rng.integers(0, vocab, 50)] = -np.inf
        args = (x, np.full(n, top_k), np.full(n, top_p), np.full(n, min_p), uniforms(np.arange(n), 0))
        expected = sampling.truncate_and_draw(*args)
        with monkeypatch.context() as m:
            m.setattr(sampling, "FULL_SORT_MAX_VOCAB", 0)
            m.setattr(sampling, "NUM_CANDIDATES", 8)
            m.setattr(sampling, "_full_row", lambda *a: full_row_calls.append(a) or real_full_row(*a))
            got = sampling.truncate_and_draw(*args)
        assert got.tolist() == expected.tolist(), (top_k, top_p, min_p)
    assert 0 < len(full_row_calls) < len(cases) * n / 2  # both the prefix and the fallback were exercised


# ------------------------------------------------------------------------------------------------ batch, logprobs


def test_a_rows_token_does_not_depend_on_its_batch():
    rng = np.random.default_rng(5)
    vocab = 300
    target = np.asarray(rng.normal(0, 2, vocab), np.float32)
    others = [SamplingParams(temperature=0), SamplingParams(temperature=1.5, top_k=40), SamplingParams(min_p=0.1),
              SamplingParams(top_p=0.5, presence_penalty=1.0), SamplingParams(temperature=0.3, logprobs=3),
              SamplingParams(repetition_penalty=1.3, logit_bias={5: 10.0})]
    params = SamplingParams(temperature=0.8, top_p=0.95, frequency_penalty=0.5, repetition_penalty=1.2, logprobs=5)
    seen_tokens = set()
    for seed in range(40):
        row = _row(params, seed=seed, position=seed % 7, prompt=[1, 2, 3], output=[4, 4, 9])
        alone = sample(target[None, :], [row])
        batch = [_row(p, seed=seed * 31 + j, position=j, output=[j, 7]) for j, p in enumerate(others)]
        batch.insert(3, row)
        logits = np.asarray(rng.normal(0, 2, (7, vocab)), np.float32)
        logits[3] = target
        together = sample(logits, batch)
        assert together.token_ids[3] == alone.token_ids[0]
        assert together.logprobs[3] == alone.logprobs[0]
        assert together.top_logprobs[3] == alone.top_logprobs[0]
        seen_tokens.add(int(alone.token_ids[0]))
    assert len(seen_tokens) > 5  # really sampled, not greedy


def test_logprobs_are_processed_before_truncation_and_sorted_with_ties_by_id():
    logits = np.array([[1.0, 3.0, 3.0, 0.0], [1.0, 3.0, 3.0, 0.0], [1.0, 3.0, 3.0, 0.0]], np.float32)
    rows = [_row(SamplingParams(temperature=0.5, top_k=1, logprobs=3)), _row(SamplingParams()),
            _row(SamplingParams(logprobs=0))]
    out = sample(logits, rows)
    lp = log_softmax(np.array([1.0, 3.0, 3.0, 0.0]) / 0.5)
    assert out.token_ids[0] == 1 and out.logprobs[0] == np.float32(lp[1])  # top_k=1, still log p < 0
    assert [t for t, _ in out.top_logprobs[0]] == [1, 2, 0]
    np.testing.assert_allclose([v for _, v in out.top_logprobs[0]], lp[[1, 2, 0]], atol=1e-6)
    assert out.top_logprobs[0][0][1] == float(out.logprobs[0])  # the token's own logprob, the same number
    assert np.isnan(out.logprobs[1]) and out.top_logprobs[1] == []
    assert np.isfinite(out.logprobs[2]) and out.top_logprobs[2] == []
    assert out.token_ids.dtype == np.int64 and out.logprobs.dtype == np.float32


def test_alternatives_past_float32s_range_are_left_out_not_minus_infinity():
    """A +inf logit counts as float32's largest; below temperature 1 the other tokens' logprobs then lie past
    float32's range. They were entries of -inf (null in a response's JSON, where OpenAI's schema has a number); they
    are left out, as the device sampler leaves them, and the sampled token's own entry stays."""
    logits = np.array([[np.inf, 0.0, 1.0, -1.0]], np.float32)
    for t in (0.5, 0.0):
        out = sample(logits, [_row(SamplingParams(temperature=t, logprobs=4))])
        assert out.token_ids[0] == 0 and out.top_logprobs[0][0] == (0, float(out.logprobs[0]))
        assert all(np.isfinite(v) for _, v in out.top_logprobs[0]), out.top_logprobs
    assert len(sample(logits, [_row(SamplingParams(temperature=0.5, logprobs=4))]).top_logprobs[0]) == 1


# ------------------------------------------------------------------------------------------------ validation


@pytest.mark.parametrize("kwargs,field", [
    ({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.01}, "top_p"),
    ({"top_k": -1}, "top_k"), ({"top_k": 2.5}, "top_k"), ({"min_p": -0.1}, "min_p"), ({"min_p": 1.5}, "min_p"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"repetition_penalty": 1e300}, "repetition_penalty"), ({"max_tokens": 0}, "max_tokens"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"), ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"), ({"logit_bias": {100: 1.0}}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"), ({"logit_bias": {3: 100.5}}, "logit_bias"),
    ({"stop": tuple(f"s{i}" for i in range(17))}, "stop"), ({"stop": ("",)}, "stop"),
    ({"stop_token_ids": (100,)}, "stop_token_ids"), ({"seed": 2**64}, "seed"), ({"top_k": 2**31}, "top_k"),
    ({"top_k": 2**70}, "top_k"),
])
def test_validate_rejects_bad_params_naming_the_field(kwargs, field):
    with pytest.raises(InvalidRequestError, match=field) as err:
        SamplingParams(**kwargs).validate(vocab_size=100)
    assert err.value.param == field  # the API's error body names it
    again = pickle.loads(pickle.dumps(err.value))  # as it crosses Ray
    assert (type(again), str(again), again.param) == (type(err.value), str(err.value), field)


def test_validate_accepts_the_edges():
    SamplingParams(top_k=2**31 - 1).validate(vocab_size=100)  # any k past the vocabulary keeps every token
    SamplingParams(temperature=0, top_p=1.0, min_p=1.0, presence_penalty=-2, frequency_penalty=2,
                   logprobs=20, logit_bias={0: -100, 99: 100.0}, seed=-1, stop=("a",) * 16,
                   max_tokens=1, min_tokens=1).validate(vocab_size=100)
