"""The multi-agent policy's knobs and scores: pure functions of a few numbers (no engine, no clock).

NOTE: the scores. Work is counted in decode-token equivalents: a job's expected remaining work is
``W = prefill_weight * prompt tokens still to compute (after prefix-cache reuse)
    + resume_weight * tokens to bring back (paused only) + decode tokens still expected``,
and it enters the scores clamped, ``w = min(W, C)`` with ``C = work_cap``. Decode tokens still expected are
``min(max_tokens, E) - output so far`` (at least 0), where ``E`` is the conversation's moving average of its
turns' output lengths, or `default_output_tokens` for its first turn.

- A *candidate* (waiting, or paused) that has waited ``t`` seconds since it last became one (its arrival or
  its last pause) has the credit ``x = a * t`` (``a = age_weight``, tokens per second) and the score
  ``S = x - w * (1 - min(x, C) / C)``: throughput first at ``t = 0`` (``S = -w``: the least work goes first,
  paused jobs pay no prefill, cached prompts little), growing faster than linearly (slope ``a (1 + w / C)``),
  and from ``t >= C / a`` on exactly ``S = x``: the work penalty has faded and overdue candidates rank by how
  long they have waited, FIFO.
- A *running* job of age ``T`` (seconds since its request arrived) has the victim score
  ``V = min(a * T, C) - w``: the youngest job with the most work left is paused first; ``V <= C`` always.
- A candidate ``c`` preempts the lowest-``V`` running job ``r`` when ``S_c > V_r + m`` (``m = margin``) and
  ``r`` has run at least ``q = quantum_s`` since its admission or resume (hysteresis on both sides).

NOTE: the wait bound. Assume the pool holds any ``N`` running sequences plus the reserve (no memory pauses,
no admission refused for pages) and the engine consults the policy at least every ``dt`` seconds. Let
``B`` be the number of other candidates that became one no later than ``c``. Then ``c`` waits at most
``T_max = (C + m) / a + ceil((B + 1) / N) * (q + dt)``, whatever arrives afterwards:
1. From ``t >= C / a`` on, ``S_c = a t``, while a candidate that entered after ``c`` has waited less, so its
   score is at most its credit ``< a t``: only the ``<= B`` candidates older than ``c`` can rank above it, and
   once admitted, such a job re-enters (if paused) younger than ``c``. The set ahead of ``c`` only shrinks.
2. Once ``t > (C + m) / a``, ``S_c > C + m >= V_r + m`` for every running ``r``: every running job past
   its quantum is preempted at the next decision by a candidate ranked at least as high as ``c``. So within
   any ``q + dt`` every one of the ``N`` slots is handed to such a candidate (on completion or preemption).
3. Each hand-over takes one job out of the ``<= B`` ahead of ``c``, or admits ``c``: after
   ``ceil((B + 1) / N)`` windows ``c`` runs. With ``a = 0`` there is no bound: a stream of lighter jobs
   starves a heavy one (the tests show both). ``B`` is at most the requests in flight minus one, i.e. the
   number of agents when each agent has one request at a time.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from decapybara.errors import ConfigError


@dataclass(slots=True, frozen=True)
class PolicyConfig:
    """Knobs of `AgePolicy`; `validate()` returns self or raises `ConfigError` naming the bad field."""

    age_weight: float = 128.0  # a: score credited per second of waiting (tokens/s); 0 = pure throughput
    work_cap: float = 4096.0  # C: work beyond this many tokens ranks the same; C / a = when FIFO takes over
    margin: float = 256.0  # m: a candidate must beat a running job's victim score by this much to preempt it
    quantum_s: float = 2.0  # q: least run time after admission/resume before a job may be preempted by score
    preemption: bool = True  # pause running jobs for better-scored candidates (memory pauses happen anyway)
    prefill_weight: float = 0.1  # cost of one prompt token to compute, in decode tokens (batched: cheaper)
    resume_weight: float = 0.005  # cost of one token of KV/state brought back on resume (a copy)
    default_output_tokens: int = 1024  # expected output of a conversation's first turn (capped by max_tokens)
    output_ema: float = 0.5  # weight of the latest turn in a conversation's expected output length
    reserve_pages_per_seq: int = 1  # free pages kept per running sequence when admitting (growth headroom)
    idle_timeout_s: float = 1200.0  # a conversation with nothing in flight for this long counts as finished
    history: int = 64  # recent decisions kept for /stats

    def validate(self) -> PolicyConfig:
        nonneg = ("age_weight", "margin", "quantum_s", "prefill_weight", "resume_weight")
        for name in nonneg:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < math.inf:
                raise ConfigError(f"policy.{name} must be a finite number >= 0, got {value!r}")
        for name in ("work_cap", "idle_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < math.inf:
                raise ConfigError(f"policy.{name} must be a finite number > 0, got {value!r}")
        if not 0 < self.output_ema <= 1:
            raise ConfigError(f"policy.output_ema must be in (0, 1], got {self.output_ema!r}")
        if not isinstance(self.default_output_tokens, int) or self.default_output_tokens < 1:
            raise ConfigError(f"policy.default_output_tokens must be an integer >= 1, "
                              f"got {self.default_output_tokens!r}")
        for name in ("reserve_pages_per_seq", "history"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"policy.{name} must be an integer >= 0, got {value!r}")
        return self

    def replace(self, **kw) -> PolicyConfig:
        return dataclasses.replace(self, **kw)


def work_estimate(cfg: PolicyConfig, prefill_tokens: float, decode_tokens: float,
                  resume_tokens: float = 0.0) -> float:
    """W: expected remaining work of a job in decode-token equivalents (unclamped)."""
    return cfg.prefill_weight * prefill_tokens + cfg.resume_weight * resume_tokens + decode_tokens


def candidate_score(cfg: PolicyConfig, wait_s: float, work: float) -> float:
    """S of a waiting/paused job: higher is served first; increasing in `wait_s`, decreasing in `work`."""
    x = cfg.age_weight * max(0.0, wait_s)
    w = min(work, cfg.work_cap)
    return x - w * (1.0 - min(x, cfg.work_cap) / cfg.work_cap)


def victim_score(cfg: PolicyConfig, age_s: float, work: float) -> float:
    """V of a running job: lower is paused first (young, much work left); never above `work_cap`."""
    return min(cfg.age_weight * max(0.0, age_s), cfg.work_cap) - min(work, cfg.work_cap)


def wait_bound_s(cfg: PolicyConfig, num_slots: int, num_ahead: int, step_s: float) -> float:
    """T_max of the module NOTE: the longest wait of a candidate with `num_ahead` others that entered no
    later, `num_slots` slots and a decision at least every `step_s` seconds (inf without aging/preemption)."""
    if cfg.age_weight == 0 or not cfg.preemption:
        return math.inf
    windows = -(-(num_ahead + 1) // num_slots)
    return (cfg.work_cap + cfg.margin) / cfg.age_weight + windows * (cfg.quantum_s + step_s)
