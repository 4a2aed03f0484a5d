"""Whether a step's speculative drafts are verified: chosen by measured token rates, a choice per step width.

A draft's row costs what any row costs. On an H200 at the 27B shape with 4-bit weights (docs/perf.md, fifty-fourth
session), one agent's verification step took 1.23x its decode step, which pays from ~25% of drafts accepted; twelve
agents' took 1.94x theirs, which no acceptance repays. How much a draft saves depends on the model, the device, the
weights, the number of agents and how predictable their text is, so the engine measures it as it runs.

`SpecGovernor` keeps two arms per width (the number of sequences a pure decode step decodes): drafts verified
("on") and drafts withheld ("off"). Each arm's rate is the tokens its steps emitted over their wall time, both
summed with exponential decay (`decay` a step of that arm), so a change in the agents' text or in the context length
shows within tens of steps. An arm's first step at a width is not counted (it pays one-time costs: first calls,
allocations), and a step's seconds count at most `clip` times the median of the arm's last five (a host hiccup
moves the rate by one step's worth, a lasting change passes within three steps; in an arm's first counted steps,
the median of both arms' recent steps). Each arm is tried `warmup` times first ("on" first: speculation is what
was asked for), then the faster arm is taken, and the slower one tried again once every `explore_every` steps of
that width, so a change in which arm wins is found. Exploring costs at most one slower step in `explore_every`; an
exploration is handed out once (a step not then recorded spends it too).

What the engine records: pure decode steps only (every chunk one real token, plus a draft where one is verified),
and none that captured a CUDA graph or tried to (a capture takes many steps' time once). Tokens are those the step
emitted, accepted drafts' included; seconds run from after planning (a resume's page imports and a pause's exports
are not a decode's) to the step's end, plus the MTP head's pass of the step before, which drafted for this one (or,
withheld, only kept the head's cache): each arm pays for its own head pass. A step whose head pass was a prompt's,
another sequence's or captured a graph is not recorded. The engine records a step before it asks for the next
step's choice. Drafts never change what is sampled, so the governor changes speed only, never tokens. Pure
arithmetic: no clock of its own (the engine hands it each step's seconds).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field


@dataclass(slots=True)
class _Arm:
    tokens: float = 0.0  # decayed sum of tokens emitted by this arm's steps
    seconds: float = 0.0  # ... and of their wall time
    steps: int = 0  # steps recorded (not decayed)
    last: int = -1  # the width's step count when this arm last ran
    seen: int = 0  # steps handed in, the first (not recorded) included
    recent: deque = field(default_factory=lambda: deque(maxlen=5))  # the last steps' seconds, unclipped

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass(slots=True)
class _Width:
    on: _Arm = field(default_factory=_Arm)
    off: _Arm = field(default_factory=_Arm)
    steps: int = 0  # steps recorded at this width


@dataclass
class SpecGovernor:
    """Per-width choice of verifying drafts or not. `allow(width)` before a step; `record(width, allowed, tokens,
    seconds)` after a pure decode step that ran as `allow` said."""
    decay: float = 0.9
    warmup: int = 3
    clip: float = 3.0  # a step's seconds count at most this times the median of the arm's last five
    explore_every: int = 48
    widths: dict[int, _Width] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 < self.decay < 1 or self.warmup < 1 or self.explore_every < 2 or self.clip < 1:
            raise ValueError(f"decay in (0, 1), warmup >= 1, explore_every >= 2, clip >= 1; got {self}")

    def allow(self, width: int) -> bool:
        """Whether a step decoding `width` sequences should verify their drafts."""
        w = self.widths.get(width)
        if w is None or w.on.steps < self.warmup:
            return True
        if w.off.steps < self.warmup:
            return False
        best_on = self._best(w)
        loser = w.off if best_on else w.on
        if w.steps - loser.last >= self.explore_every:
            loser.last = w.steps  # handed out once: a step that is then not recorded (mixed) spends it too
            return not best_on
        return best_on

    def _best(self, w: _Width) -> bool:
        """Whether verifying is the measured faster arm of `w` (True until both are measured)."""
        if w.on.steps < self.warmup or w.off.steps < self.warmup:
            return True
        return w.on.rate >= w.off.rate

    def record(self, width: int, allowed: bool, tokens: int, seconds: float) -> None:
        """A pure decode step of `width` sequences, drafts verified where `allowed`: `tokens` emitted in `seconds`."""
        if seconds <= 0:
            return
        w = self.widths.setdefault(width, _Width())
        arm = w.on if allowed else w.off
        arm.seen += 1
        if arm.seen == 1:  # an arm's first step at a width pays one-time costs (first calls, allocations)
            arm.last = w.steps
            w.steps += 1
            return
        other = w.off if allowed else w.on
        ref = arm.recent if len(arm.recent) >= 3 else [*arm.recent, *other.recent]  # warm-up: both arms' steps
        clipped = min(seconds, self.clip * statistics.median(ref)) if ref else seconds
        arm.recent.append(seconds)
        arm.tokens = self.decay * arm.tokens + tokens
        arm.seconds = self.decay * arm.seconds + clipped
        arm.steps += 1
        arm.last = w.steps
        w.steps += 1

    def summary(self) -> dict[str, dict[str, float]]:
        """Per width (as a string): each arm's tokens/s and steps, and the arm now preferred (JSON-able)."""
        return {str(n): {"on_tok_s": round(w.on.rate, 1), "off_tok_s": round(w.off.rate, 1),
                         "on_steps": w.on.steps, "off_steps": w.off.steps,
                         "verify": float(self._best(w))}
                for n, w in sorted(self.widths.items())}
