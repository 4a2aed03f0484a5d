"""The sampler: sampling parameters, logit processing and the seeded draw (numpy reference).

Per row, in this order (all arithmetic in float64 on a copy of the logits):

1. logit_bias is added (NaN logits count as -inf, +inf as the float32 maximum);
2. penalties: repetition (HF/CTRL: a logit of a token seen in the prompt or the output is divided by r when
   > 0, else multiplied by r; r = max(params.repetition_penalty, row.extra_repetition_penalty)), then presence
   and frequency (OpenAI: ``logit - count * frequency - presence`` for each token in the OUTPUT);
3. masks to -inf: eos and stop ids while position < min_tokens (eos is left alone when ignore_eos), and the
   LoopGuard's banned ids (if this would mask every token, the row keeps its step-2 logits);
4. greedy (temperature 0; any below 1e-5 counts as 0): argmax, ties to the lowest id. Otherwise divide by
   the temperature, then top-k, top-p, min-p, and draw by inverse CDF (below).

Canonical order: descending scaled logit x (hence descending probability), ties by ascending token id.
w_i = exp(x_i - max x) in float64 (0 for a masked token); Z = np.sum(w) over the row in token-id order;
running sums are sequential float64 sums in canonical order.
- top-k keeps the first k tokens in canonical order (exactly k, even among ties);
- top-p keeps the shortest canonical prefix whose probability (renormalised after top-k) reaches p: a token
  is kept when the running sum of w strictly before it is < p * Z (w, Z over the top-k survivors), so at
  least one token survives;
- min-p keeps p_i >= min_p * max p, evaluated as w_i >= min_p.

Draw: with w and Z over the kept tokens, the token is the first in canonical order whose running sum of w
exceeds u * Z, u = philox.uniform(row.seed, row.position) on stream 0. The draw depends only on (seed,
position) and the row's own logits, never on the rest of the batch. Because running sums are prefix-stable,
large vocabularies sort only their best tokens and get the same token (`truncate_and_draw`). A CUDA sampler
that sums in another order can differ only where u lands within rounding distance of a CDF step.

Logprobs are the "processed" ones: log_softmax of the logits after steps 1-3 and the temperature (greedy
rows: temperature 1), BEFORE top-k/top-p/min-p truncation, so a truncated sampler still reports how likely
the model found each token. Masked tokens have logprob -inf and never appear among the alternatives.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from numbers import Real

import numpy as np

from decapybara.engine.loopguard import MODES as LOOP_GUARD_MODES
from decapybara.engine.philox import MASK64, uniforms
from decapybara.errors import InvalidRequestError

MAX_LOGPROBS = 20
MAX_TOP_K = 2**31 - 1  # the device sampler keeps top_k in int32; any k >= the vocabulary keeps every token
MAX_STOP_STRINGS = 16
MAX_LOGIT_BIAS = 100.0
MAX_OPENAI_PENALTY = 2.0
# repetition_penalty r lies in [1 / this, this]: far past any useful value, and a float32 logit times r (or over r),
# then over the least temperature, stays inside float64's range. Unbounded, r overflowed seen logits to -inf or +inf:
# a row of seen tokens then had NaN weights and drew garbage (the device sampler an id outside the vocabulary).
MAX_REPETITION_PENALTY = 1e6
# NOTE: below this a temperature is greedy: x / T could overflow, and the distribution is a point mass anyway.
GREEDY_TEMPERATURE = 1e-5
# Rows over this vocabulary size sort only a prefix of their best tokens (same result, see `_draw_row`).
FULL_SORT_MAX_VOCAB = 8192
NUM_CANDIDATES = 1024


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """What a request asks of the sampler; `validate` before use. Defaults are all 'off' at temperature 1."""

    temperature: float = 1.0  # 0 (or below GREEDY_TEMPERATURE) = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    min_p: float = 0.0  # 0 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1.0 = off; in [1 / MAX_REPETITION_PENALTY, MAX_REPETITION_PENALTY]
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None  # None = the engine picks one per request
    logprobs: int | None = None  # None = no logprobs; n = the sampled token's plus n alternatives
    # None = none; n = each prompt token's logprob (the model's, no sampler edit; the first token has none) plus n
    # alternatives, computed over the whole prompt (no prefix-cache reuse): the legacy completions' `echo`
    prompt_logprobs: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings, matched by the detokeniser
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    json_object: bool = False  # JSON mode: the answer is constrained to a JSON object (`engine.json_mode`)
    json_schema: str | None = None  # structured outputs: the answer is constrained to this JSON Schema's text
    tool_calls: str | None = None  # the answer is tool calls only (`engine.json_schema.tool_call_spec`'s text)
    lazy_tool_calls: bool = False  # with tool_calls: free text until the model opens a call (`ToolCallReply`)
    loop_guard: str | None = None  # this request's LoopGuard mode (stop | end_thinking | escape | off); None: the server's

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def scores_prompt(self) -> bool:
        """Whether the request scores its prompt (prompt logprobs) and asks for one token at most: the token
        sampled from its last row is never computed, so its prompt may fill the whole served context."""
        return self.prompt_logprobs is not None and self.max_tokens == 1

    def validate(self, vocab_size: int) -> None:
        """Raise InvalidRequestError naming the first bad field; return None when the params are usable."""
        _check_real("temperature", self.temperature, lo=0.0)
        _check_int("top_k", self.top_k, lo=0, hi=MAX_TOP_K)
        _check_real("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
        _check_real("min_p", self.min_p, lo=0.0, hi=1.0)
        _check_real("presence_penalty", self.presence_penalty, lo=-MAX_OPENAI_PENALTY, hi=MAX_OPENAI_PENALTY)
        _check_real("frequency_penalty", self.frequency_penalty, lo=-MAX_OPENAI_PENALTY, hi=MAX_OPENAI_PENALTY)
        _check_real("repetition_penalty", self.repetition_penalty, lo=1 / MAX_REPETITION_PENALTY,
                    hi=MAX_REPETITION_PENALTY)
        _check_int("max_tokens", self.max_tokens, lo=1)
        _check_int("min_tokens", self.min_tokens, lo=0, hi=self.max_tokens)
        if self.seed is not None:
            _check_int("seed", self.seed, lo=-(2**63), hi=MASK64)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, lo=0, hi=MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, lo=0, hi=MAX_LOGPROBS)
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}", "ignore_eos")
        if not isinstance(self.json_object, bool):
            raise InvalidRequestError(f"json_object must be a boolean, got {self.json_object!r}", "json_object")
        if self.json_schema is not None and (not isinstance(self.json_schema, str) or self.json_object):
            raise InvalidRequestError("json_schema must be a schema's JSON text, and not beside json_object",
                                      "json_schema")
        if self.tool_calls is not None and (not isinstance(self.tool_calls, str) or self.json_object
                                            or self.json_schema is not None):
            raise InvalidRequestError("tool_calls must be a tool set's JSON text, and not beside json_object or "
                                      "json_schema", "tool_calls")
        if not isinstance(self.lazy_tool_calls, bool) or (self.lazy_tool_calls and self.tool_calls is None):
            raise InvalidRequestError("lazy_tool_calls must be a boolean, true only beside tool_calls",
                                      "lazy_tool_calls")
        if self.loop_guard is not None and self.loop_guard not in LOOP_GUARD_MODES:
            raise InvalidRequestError(f"loop_guard must be one of {', '.join(LOOP_GUARD_MODES)}, got "
                                      f"{self.loop_guard!r}", "loop_guard")
        if not isinstance(self.logit_bias, Mapping):
            raise InvalidRequestError("logit_bias must map token ids to numbers", "logit_bias")
        for tok, bias in self.logit_bias.items():
            _check_int("logit_bias token id", tok, lo=0, hi=vocab_size - 1, param="logit_bias")
            _check_real(f"logit_bias[{tok}]", bias, lo=-MAX_LOGIT_BIAS, hi=MAX_LOGIT_BIAS, param="logit_bias")
        for tok in self.stop_token_ids:
            _check_int("stop_token_ids entry", tok, lo=0, hi=vocab_size - 1, param="stop_token_ids")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}",
                                      "stop")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty strings", "stop")


def _check_real(name: str, value: object, *, lo: float | None = None, hi: float | None = None,
                lo_open: bool = False, param: str | None = None) -> None:
    """`param`: the request field the error names (default `name`)."""
    param = param or name
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise InvalidRequestError(f"{name} must be a finite number, got {value!r}", param)
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise InvalidRequestError(f"{name} must be {'>' if lo_open else '>='} {lo}, got {value!r}", param)
    if hi is not None and value > hi:
        raise InvalidRequestError(f"{name} must be <= {hi}, got {value!r}", param)


def _check_int(name: str, value: object, *, lo: int, hi: int | None = None, param: str | None = None) -> None:
    param = param or name
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise InvalidRequestError(f"{name} must be an integer, got {value!r}", param)
    if value < lo or (hi is not None and value > hi):
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise InvalidRequestError(f"{name} must be {bound}, got {value!r}", param)


@dataclass(slots=True)
class SamplerRow:
    """One sequence to sample a token for. ``position`` is the number of output tokens so far."""

    params: SamplingParams
    prompt_token_ids: Sequence[int] | np.ndarray
    output_token_ids: Sequence[int] | np.ndarray
    position: int
    seed: int  # effective seed: params.seed, or one the engine chose for the request
    extra_repetition_penalty: float = 1.0  # LoopGuard; the effective penalty is the max with the params'
    banned_token_ids: Sequence[int] | np.ndarray = ()  # LoopGuard; masked to -inf


@dataclass(slots=True)
class SampleOutput:
    token_ids: np.ndarray  # int64 [B]
    logprobs: np.ndarray  # float32 [B]: the sampled token's processed logprob, NaN where not requested
    top_logprobs: list[list[tuple[int, float]]]  # per row: up to n (token_id, logprob), best first


# ---------------------------------------------------------------------------------------------- pure steps


def _ids(values: Sequence[int] | np.ndarray) -> np.ndarray:
    return np.asarray(values, dtype=np.int64).reshape(-1)


def union_sorted(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The union of two sorted unique int64 arrays, sorted unique: b's new ids inserted into a (a's size in
    work, where sorting everything again costs the union's; a itself when b adds nothing)."""
    if not b.size:
        return a
    if not a.size:
        return b
    at = np.searchsorted(a, b)
    fresh = (at == a.size) | (a[np.minimum(at, a.size - 1)] != b)
    return np.insert(a, at[fresh], b[fresh]) if fresh.any() else a


def log_softmax(x: np.ndarray) -> np.ndarray:
    """log_softmax over the last axis in float64; -inf entries stay -inf (a row of only -inf gives NaN)."""
    x = np.asarray(x, dtype=np.float64)
    m = np.max(x, axis=-1, keepdims=True)
    shifted = x - m
    return shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True))


def apply_penalties(logits: np.ndarray, prompt_token_ids: Sequence[int] | np.ndarray,
                    output_token_ids: Sequence[int] | np.ndarray, repetition: float = 1.0,
                    presence: float = 0.0, frequency: float = 0.0) -> np.ndarray:
    """Repetition, then presence and frequency penalties on one row ``logits [V]`` -> new float64 [V].

    Repetition r on every token of the prompt or the output: x / r if x > 0 else x * r. Presence and
    frequency on the output tokens only: x - count * frequency - presence (OpenAI's formula). The cost is
    O(len(prompt) + len(output)), not O(V), beyond the copy.
    """
    x = np.array(logits, dtype=np.float64)
    out_ids, counts = np.unique(_ids(output_token_ids), return_counts=True)
    if repetition != 1.0:
        # every id of either list, repeats and all: a repeated id reads and writes the same value, so no sort
        seen = np.concatenate([_ids(prompt_token_ids), out_ids])
        v = x[seen]
        x[seen] = np.where(v > 0, v / repetition, v * repetition)
    if presence != 0.0 or frequency != 0.0:
        x[out_ids] = x[out_ids] - counts * frequency - presence
    return x


def canonical_order(x: np.ndarray) -> np.ndarray:
    """Token ids of each row [B, V] by descending logit, ties by ascending id."""
    return np.argsort(-x, axis=-1, kind="stable")


def _weights(x: np.ndarray) -> np.ndarray:
    """w = exp(x - max x) over the last axis: unnormalised probabilities, 0 for masked tokens."""
    return np.exp(x - np.max(x, axis=-1, keepdims=True))


def mask_top_k(x: np.ndarray, top_k: np.ndarray, order: np.ndarray | None = None) -> np.ndarray:
    """Keep the first ``top_k[b]`` tokens of row b in canonical order (0 = off); others -> -inf."""
    k = np.asarray(top_k, dtype=np.int64)
    if not np.any(k > 0):
        return x
    order = canonical_order(x) if order is None else order
    ranks = np.empty_like(order)
    np.put_along_axis(ranks, order, np.broadcast_to(np.arange(x.shape[-1]), order.shape), axis=-1)
    keep = (k[:, None] <= 0) | (ranks < k[:, None])
    return np.where(keep, x, -np.inf)


def mask_top_p(x: np.ndarray, top_p: np.ndarray, order: np.ndarray | None = None) -> np.ndarray:
    """Keep the shortest canonical prefix with probability >= ``top_p[b]`` (1.0 = off); others -> -inf.

    ``order`` may be the canonical order of the logits before earlier masks: masked tokens weigh nothing.
    """
    p_top = np.asarray(top_p, dtype=np.float64)
    active = p_top < 1.0
    if not np.any(active):
        return x
    order = canonical_order(x) if order is None else order
    w = _weights(x)  # [B, V]
    total = np.sum(w, axis=-1, keepdims=True)  # in token-id order
    ws = np.take_along_axis(w, order, axis=-1)  # [B, V] in canonical order
    before = np.zeros_like(ws)  # running sum of w strictly before each token
    before[:, 1:] = np.cumsum(ws, axis=-1)[:, :-1]
    keep_sorted = (before < p_top[:, None] * total) | ~active[:, None]
    keep = np.empty_like(keep_sorted)
    np.put_along_axis(keep, order, keep_sorted, axis=-1)
    return np.where(keep, x, -np.inf)


def mask_min_p(x: np.ndarray, min_p: np.ndarray) -> np.ndarray:
    """Keep tokens with p >= ``min_p[b]`` * max p (0 = off); others -> -inf."""
    mp = np.asarray(min_p, dtype=np.float64)
    if not np.any(mp > 0):
        return x
    return np.where(_weights(x) >= mp[:, None], x, -np.inf)


def draw(x: np.ndarray, order: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Inverse-CDF draw over the canonical ``order`` of each row of (masked) logits ``x`` -> int64 [B]."""
    w = _weights(x)
    total = np.sum(w, axis=-1)  # in token-id order
    ws = np.take_along_axis(w, order, axis=-1)
    cdf = np.cumsum(ws, axis=-1)  # [B, V]
    target = np.asarray(u, dtype=np.float64) * total
    # NOTE: the clip to the last positive weight only matters if rounding put the target past the CDF's end.
    idx = np.minimum(np.sum(cdf <= target[:, None], axis=-1), np.sum(ws > 0, axis=-1) - 1)
    return np.take_along_axis(order, idx[:, None], axis=-1)[:, 0].astype(np.int64)


def truncate_and_draw(x: np.ndarray, top_k: np.ndarray, top_p: np.ndarray, min_p: np.ndarray,
                      u: np.ndarray) -> np.ndarray:
    """top-k, top-p, min-p, then `draw`, over scaled logits [B, V] -> int64 [B].

    Large vocabularies sort only a candidate prefix per row (`_draw_row`), with the same result.
    """
    if x.shape[-1] <= FULL_SORT_MAX_VOCAB:
        order = canonical_order(x)
        x = mask_min_p(mask_top_p(mask_top_k(x, top_k, order), top_p, order), min_p)
        return draw(x, order, u)
    return np.array([_draw_row(x[i], int(top_k[i]), float(top_p[i]), float(min_p[i]), float(u[i]))
                     for i in range(x.shape[0])], dtype=np.int64)


def _draw_row(x: np.ndarray, top_k: int, top_p: float, min_p: float, u: float) -> int:
    """`truncate_and_draw` of one row [V], sorting only a prefix: top_k tokens, or NUM_CANDIDATES then 16x.

    Sums over the row are in token-id order and running sums are sequential in canonical order, so the
    prefix's running sums are those of the full sort and every decision taken inside the prefix is the full
    sort's. Falls back to the full sort when the top-p cut or the draw lands past the largest prefix.
    """
    vocab = x.shape[0]
    w = _weights(x)
    k = top_k if 0 < top_k < vocab else 0
    for num in (k,) if k else (NUM_CANDIDATES, 16 * NUM_CANDIDATES):
        if num >= vocab:
            break
        token = _draw_prefix(x, w, num, k, top_p, min_p, u)
        if token is not None:
            return token
    return _full_row(x, top_k, top_p, min_p, u)


def _draw_prefix(x: np.ndarray, w: np.ndarray, num: int, k: int, top_p: float, min_p: float,
                 u: float) -> int | None:
    """The token if it is decided within the canonical prefix of the best ``num`` tokens, else None."""
    vocab = x.shape[0]
    cand = np.flatnonzero(x >= np.partition(x, vocab - num)[vocab - num])  # >= num tokens, ties included
    cand = cand[np.lexsort((cand, -x[cand]))]  # the canonical order's prefix
    keep = np.ones(vocab, dtype=bool)
    if k:
        keep[:] = False
        keep[cand[:k]] = True
    tail_kept = not k  # whether tokens past the prefix may still be kept
    if top_p < 1.0:
        wc = np.where(keep[cand], w[cand], 0.0)
        before = np.zeros_like(wc)
        before[1:] = np.cumsum(wc)[:-1]
        cut = before >= top_p * np.sum(np.where(keep, w, 0.0))
        if cut.any():
            in_prefix = np.zeros(vocab, dtype=bool)
            in_prefix[cand[~cut]] = True
            keep &= in_prefix
            tail_kept = False
        elif tail_kept:
            return None
    if min_p > 0:
        keep &= w >= min_p
    wk = np.where(keep, w, 0.0)
    cdf = np.cumsum(wk[cand])
    j = int(np.count_nonzero(cdf <= u * np.sum(wk)))
    if j < cand.size:
        return int(cand[j])
    if not tail_kept:  # as `draw`'s clip: the last candidate with positive weight
        return int(cand[np.count_nonzero(wk[cand] > 0) - 1])
    return None


def _full_row(x: np.ndarray, top_k: int, top_p: float, min_p: float, u: float) -> int:
    order = canonical_order(x[None, :])
    xm = mask_min_p(mask_top_p(mask_top_k(x[None, :], np.array([top_k]), order), np.array([top_p]), order),
                    np.array([min_p]))
    return int(draw(xm, order, np.array([u]))[0])


def top_n(logprobs: np.ndarray, n: int) -> list[tuple[int, float]]:
    """The n best (token_id, logprob) of one row, descending, ties by ascending id; each logprob at the float32
    precision of the sampled token's (`SampleOutput.logprobs`), so that a token's own logprob and its entry among the
    best are the same number. Only finite float32 values are entries (as the device sampler's): one past float32's
    range (a +inf logit, which counts as float32's largest, beside ordinary ones below temperature 1) is left out
    rather than written as -inf (null in a response's JSON)."""
    if n <= 0:
        return []
    n = min(n, logprobs.shape[-1])
    cand = np.argpartition(-logprobs, n - 1)[:n]
    cand = np.flatnonzero(logprobs >= logprobs[cand].min())  # every tie of the n-th value
    cand = cand[np.lexsort((cand, -logprobs[cand]))][:n]
    with np.errstate(over="ignore"):
        values = logprobs[cand].astype(np.float32)
    return [(int(t), float(v)) for t, v in zip(cand, values) if np.isfinite(v)]


# ---------------------------------------------------------------------------------------------- the batch


def masked_ids(row: SamplerRow, eos: np.ndarray) -> np.ndarray:
    """Step 3's masked ids of a row, int64, repeats possible: the LoopGuard's banned ids and, while the row is
    below min_tokens, the stop ids and (unless it ignores eos) `eos`."""
    p, masked = row.params, [_ids(row.banned_token_ids)]
    if row.position < p.min_tokens:
        masked.append(_ids(p.stop_token_ids))
        if not p.ignore_eos:
            masked.append(eos)
    return np.concatenate(masked)


def _process(x: np.ndarray, rows: Sequence[SamplerRow], eos_token_ids: Sequence[int]) -> None:
    """Steps 1-3 of the module docstring, in place on float64 [B, V]."""
    eos = _ids(eos_token_ids)
    for i, row in enumerate(rows):
        p = row.params
        if p.logit_bias:
            x[i, _ids(list(p.logit_bias))] += np.fromiter(p.logit_bias.values(), np.float64, len(p.logit_bias))
        rep = max(p.repetition_penalty, row.extra_repetition_penalty)
        if rep != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
            x[i] = apply_penalties(x[i], row.prompt_token_ids, row.output_token_ids, rep,
                                   p.presence_penalty, p.frequency_penalty)
        ids = masked_ids(row, eos)
        if ids.size:
            before = x[i, ids]
            x[i, ids] = -np.inf
            if not np.isfinite(x[i]).any():  # NOTE: a mask may never leave a row with nothing to sample
                x[i, ids] = before


def sample(logits: np.ndarray, rows: Sequence[SamplerRow], *,
           eos_token_ids: Sequence[int] = ()) -> SampleOutput:
    """Sample one token per row of ``logits`` float [B, V] as the module docstring specifies.

    ``eos_token_ids`` are the model's end-of-sequence ids, masked with the stop ids below min_tokens.
    """
    logits = np.asarray(logits)
    if logits.ndim != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits must be [len(rows)={len(rows)}, V], got {logits.shape}")
    num_rows = logits.shape[0]
    x = logits.astype(np.float64)
    if not np.isfinite(x).all():
        x = np.nan_to_num(x, nan=-np.inf, posinf=float(np.finfo(np.float32).max), neginf=-np.inf)
    if num_rows and not np.isfinite(x).any(axis=-1).all():
        raise ValueError("every row of logits needs at least one finite value")
    _process(x, rows, eos_token_ids)

    temperature = np.array([r.params.temperature for r in rows], dtype=np.float64)
    greedy = temperature < GREEDY_TEMPERATURE
    tokens = np.empty(num_rows, dtype=np.int64)
    tokens[greedy] = np.argmax(x[greedy], axis=-1)  # argmax returns the first (lowest) id among ties

    # [B, V] logits at the sampling temperature (greedy rows: temperature 1), the base of the logprobs.
    scaled = x / np.where(greedy, 1.0, temperature)[:, None]
    hot = np.flatnonzero(~greedy)
    if hot.size:
        u = uniforms(np.array([rows[i].seed & MASK64 for i in hot], dtype=np.uint64),
                     np.array([rows[i].position for i in hot], dtype=np.uint64))
        tokens[hot] = truncate_and_draw(scaled[hot], np.array([rows[i].params.top_k for i in hot]),
                                        np.array([rows[i].params.top_p for i in hot]),
                                        np.array([rows[i].params.min_p for i in hot]), u)

    token_logprobs = np.full(num_rows, np.nan, dtype=np.float32)
    top: list[list[tuple[int, float]]] = [[] for _ in rows]
    want = np.array([i for i, r in enumerate(rows) if r.params.logprobs is not None], dtype=np.int64)
    if want.size:
        lp = log_softmax(scaled[want])  # [W, V]
        token_logprobs[want] = lp[np.arange(want.size), tokens[want]]
        for j, i in enumerate(want):
            top[i] = top_n(lp[j], rows[i].params.logprobs)
    return SampleOutput(token_ids=tokens, logprobs=token_logprobs, top_logprobs=top)
