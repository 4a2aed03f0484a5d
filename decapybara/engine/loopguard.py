"""LoopGuard: the two-stage repetition guard the engine consults after every generated token.

One `LoopGuard` per conversation; a pure state machine (no clock, no randomness, no engine imports).

Stage 1, detection. The guard keeps the last `window_chars` characters of output, normalised so that every
run of whitespace is one space (a loop that varies only its indentation or line breaks is still a loop). For
every unit length L in [min_unit_chars, max_unit_chars] it keeps ``runs[L]``: how many trailing characters
equal the character L positions before them. The output then ends with ``runs[L] + L`` characters of period L,
i.e. ``(runs[L] + L) / L`` copies of its last L characters. Each new character updates all L at once (one
vectorised compare against the characters L back), so a check costs O(max_unit_chars) per character and runs
on every token, not on a cadence. A loop is reported for the smallest L whose periodic suffix has at least
`min_repeats` copies and covers at least `min_covered_chars` characters. A run of raw whitespace of
`min_covered_chars` characters (which normalisation would hide) is a loop too.

Stage 2, intervention. While a loop persists the repetition penalty ramps (`start`, then one `step` per
`tokens_per_step` loop tokens, up to `cap`); once the loop has been gone for `relax_after_tokens` tokens it
steps back down, one step per `tokens_per_step` tokens, to 1.0. When the penalty sits at the cap and the loop
goes on for `cap_tokens` more tokens, the mode decides: ``stop`` stops; ``end_thinking`` forces the end of the
thinking block (and stops outside one); ``escape`` bans the tokens that continued the loop before, for a few
tokens, and stops after `escape_attempts` such bans failed (a ban failed where the loop is seen again before a
whole window of output, `window_chars`, went by without it); ``off`` never intervenes. The same loop seen again
after at most `min_covered_chars` of other text (a model that rewords a line under the penalty, then loops on)
takes up one step past the highest level it reached, not the relaxed one; once that was the cap, the tokens the
loop took to be seen again count as loop tokens at the cap, so such a loop is stopped too.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from decapybara.errors import ConfigError

MODES = ("stop", "end_thinking", "escape", "off")
STEP_KINDS = ("add", "mul")
_SENTINEL = -1  # never equal to a code point: what lies before the first character


class ActionKind(enum.StrEnum):
    """What the guard did on this token (the sampling constraints are in the action's other fields)."""

    NONE = "none"
    RAMP = "ramp"
    RELAX = "relax"
    STOP = "stop"
    END_THINKING = "end_thinking"
    BAN = "ban"


@dataclass(slots=True, frozen=True)
class LoopGuardConfig:
    """Thresholds and penalty ramp; `validate()` raises `ConfigError`.

    NOTE on the detection defaults, measured on CPython 3.11's standard library (every .py file outside
    site-packages, whitespace-normalised): outside the test suites the longest exact periodic run is 291
    characters (32 identical ``'\\ufffe'`` table lines in encodings/iso8859_8.py), then 134 (difflib), then
    ``# ----`` banners of <= 80; raw whitespace runs reach 67. Hence min_covered_chars = 320: a real loop is
    caught within ~320 characters (~100 tokens), and a table of more than ~35 identical short lines is treated
    as a loop. The test suites hold longer periodic test data (up to 980 characters), which would trip it.

    NOTE on the penalty defaults: the penalty divides the logits of every token already in the context, and
    code legitimately repeats identifiers and punctuation, so a high penalty damages correct code. It is only
    applied while a loop persists (and relaxes afterwards): 1.1 .. 1.5 in steps of 0.1 every 8 tokens reaches
    the cap 32 tokens after detection; a model still looping at 1.5 rarely breaks out at 2.0 with anything but
    garbage, so past the cap the guard acts (stop / end thinking / ban) instead of going higher.
    """

    mode: str = "stop"
    window_chars: int = 8192  # normalised output characters kept and examined
    min_unit_chars: int = 1  # shortest repeating unit considered
    # longest repeating unit considered (min_repeats * this <= window_chars): a ~60-line function (~2,000
    # characters), or a long paragraph of reasoning, written over and over is a loop too; the check's cost hardly
    # depends on it (16 against 19 us a token at 1024 and 2048 on a loaded 2-core host: per-call overhead
    # dominates)
    max_unit_chars: int = 2048
    min_repeats: int = 4  # copies of the unit the output must end with
    min_covered_chars: int = 320  # characters those copies must cover (see the NOTE above)
    penalty_start: float = 1.1  # penalty of the first RAMP
    penalty_step: float = 0.1  # added per step (step_kind "add") or multiplied (step_kind "mul", e.g. 1.1)
    step_kind: str = "add"
    penalty_cap: float = 1.5
    tokens_per_step: int = 8  # loop tokens between ramp steps, and quiet tokens between relax steps
    relax_after_tokens: int = 32  # tokens without a loop before the penalty starts to relax
    cap_tokens: int = 48  # loop tokens at the cap before the final action
    escape_ban_tokens: int = 4  # sampling steps a BAN lasts
    escape_attempts: int = 3  # BANs tried (mode escape) before STOP

    def validate(self) -> LoopGuardConfig:
        """Return self, or raise `ConfigError` naming the first bad field."""
        if self.mode not in MODES:
            raise ConfigError(f"loop_guard.mode must be one of {MODES}, got {self.mode!r}")
        if self.step_kind not in STEP_KINDS:
            raise ConfigError(f"loop_guard.step_kind must be one of {STEP_KINDS}, got {self.step_kind!r}")
        ints = ("window_chars", "min_unit_chars", "max_unit_chars", "min_repeats", "min_covered_chars",
                "tokens_per_step", "relax_after_tokens", "cap_tokens", "escape_ban_tokens", "escape_attempts")
        for name in ints:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"loop_guard.{name} must be an integer >= 1, got {value!r}")
        if self.min_repeats < 2:
            raise ConfigError(f"loop_guard.min_repeats must be >= 2, got {self.min_repeats}")
        if self.max_unit_chars < self.min_unit_chars:
            raise ConfigError("loop_guard.max_unit_chars must be >= min_unit_chars")
        if self.min_repeats * self.max_unit_chars > self.window_chars:
            raise ConfigError("loop_guard: min_repeats * max_unit_chars must fit in window_chars")
        if self.min_covered_chars > self.window_chars:
            raise ConfigError("loop_guard.min_covered_chars must be <= window_chars")
        if not 1.0 < self.penalty_start <= self.penalty_cap:
            raise ConfigError("loop_guard: need 1.0 < penalty_start <= penalty_cap")
        if self.penalty_step <= (0.0 if self.step_kind == "add" else 1.0):
            raise ConfigError(f"loop_guard.penalty_step must be > {0 if self.step_kind == 'add' else 1} "
                              f"for step_kind {self.step_kind!r}, got {self.penalty_step}")
        return self

    @property
    def max_level(self) -> int:
        """Number of ramp steps from `penalty_start` (level 1) to `penalty_cap`."""
        level = 1
        while self.penalty_at(level) < self.penalty_cap:
            level += 1
        return level

    def penalty_at(self, level: int) -> float:
        """Penalty at ramp level `level` (0 = no penalty), capped; rounded so that levels compare exactly."""
        if level <= 0:
            return 1.0
        if self.step_kind == "add":
            raw = self.penalty_start + (level - 1) * self.penalty_step
        else:
            raw = self.penalty_start * self.penalty_step ** (level - 1)
        return min(self.penalty_cap, round(raw, 6))


@dataclass(slots=True, frozen=True)
class LoopAction:
    """The guard's answer for one token.

    Whatever the kind, the engine applies `repetition_penalty` (as max(user penalty, this)) and
    `banned_token_ids` to the next sampling step; `kind` says what changed and `note` explains it to the client.
    """

    kind: ActionKind = ActionKind.NONE
    repetition_penalty: float = 1.0
    banned_token_ids: tuple[int, ...] = ()
    note: str = ""


@dataclass(slots=True)
class LoopGuardState:
    """Everything a guard needs to resume: JSON-able through `to_dict`/`from_dict` (paused-conversation bundle).

    In a live guard `text`, `char_seqs` and `runs` live in numpy buffers; `LoopGuard.state` fills them in.
    """

    text: str = ""  # the last <= window_chars normalised output characters
    char_seqs: list[int] = field(default_factory=list)  # per char of `text`: the sequence number of its token
    token_ids: dict[int, int] = field(default_factory=dict)  # sequence number -> token id, for chars in `text`
    runs: list[int] = field(default_factory=list)  # per unit length, min..max: see the module docstring
    num_tokens: int = 0  # tokens observed so far (the next token's sequence number)
    blank_chars: int = 0  # raw whitespace characters at the end of the output
    blank_ids: list[int] = field(default_factory=list)  # distinct ids of whitespace-only tokens in that run
    level: int = 0  # ramp level; penalty = config.penalty_at(level)
    tokens_since_step: int = 0
    quiet_tokens: int = 0  # tokens since the loop was last seen
    quiet_chars: int = 0  # normalised characters since then (a whole window of them forgives the bans, the level
    # reached and the loop tokens at the cap)
    recent_level: int = 0  # the highest level `recent_unit`'s loop reached (forgotten after a whole quiet window)
    recent_unit: str = ""  # the last loop's unit (a loop seen again has a rotation of it: `_same_unit`)
    loop_tokens_at_cap: int = 0
    banned: list[int] = field(default_factory=list)
    ban_tokens_left: int = 0
    escapes: int = 0
    stop_note: str = ""  # non-empty once the guard stopped the generation
    interventions: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["token_ids"] = [[seq, tid] for seq, tid in self.token_ids.items()]  # JSON keys must be strings
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LoopGuardState:
        kw = dict(d)
        kw["token_ids"] = {int(seq): int(tid) for seq, tid in d.get("token_ids", [])}
        try:
            return cls(**kw)
        except TypeError as e:
            raise ConfigError(f"bad LoopGuard state: {e}") from None


class _Loop(NamedTuple):
    unit_chars: int  # period of the repeating suffix, in normalised characters (1 for a whitespace run)
    covered: int  # characters of that suffix (raw characters for a whitespace run)
    unit: str  # the unit's text, normalised

    @property
    def repeats(self) -> int:
        return self.covered // self.unit_chars


def _same_unit(a: str, b: str) -> bool:
    """Whether two units are one loop's, seen in any phase (one a rotation of the other)."""
    return len(a) == len(b) and a in b + b


class LoopGuard:
    """Per-conversation repetition guard; call `observe` after every generated token, `reset` per generation."""

    def __init__(self, config: LoopGuardConfig | None = None, state: LoopGuardState | None = None) -> None:
        self.config = cfg = (config or LoopGuardConfig()).validate()
        # NOTE: unit lengths are stored longest first, so that the characters L back, for every L, are one
        # contiguous slice of the buffer: buf[n - max_unit_chars : n - min_unit_chars + 1].
        self._units = np.arange(cfg.max_unit_chars, cfg.min_unit_chars - 1, -1, dtype=np.int64)
        # A unit of length L fires when the suffix covers >= min_repeats * L and >= min_covered_chars chars.
        covered = np.maximum(cfg.min_repeats * self._units, cfg.min_covered_chars)
        self._thresholds = covered - self._units  # ... i.e. when runs[L] >= this
        self._headroom = 0  # a lower bound of min(thresholds - runs): characters before anything can fire
        self._pad = cfg.max_unit_chars  # sentinel prefix: look-backs never index below 0
        cap = self._pad + 2 * cfg.window_chars
        self._buf = np.full(cap, _SENTINEL, dtype=np.int64)  # normalised code points
        self._seq = np.full(cap, -1, dtype=np.int64)  # token sequence number per character
        self._n = self._pad
        self._runs = np.zeros(self._units.size, dtype=np.int64)
        self._s = LoopGuardState()
        if state is not None:
            self._restore(state)

    # -- public API -------------------------------------------------------------------------------------------

    @property
    def repetition_penalty(self) -> float:
        return self.config.penalty_at(self._s.level)

    @property
    def interventions(self) -> dict[str, int]:
        """Count of each non-NONE action kind returned so far (keys are `ActionKind` values)."""
        return dict(self._s.interventions)

    @property
    def state(self) -> LoopGuardState:
        """A snapshot; `LoopGuard(config, state)` resumes with identical behaviour."""
        snap = copy.deepcopy(self._s)
        lo = max(self._pad, self._n - self.config.window_chars)
        snap.char_seqs = self._seq[lo:self._n].tolist()
        snap.text = "".join(map(chr, self._buf[lo:self._n].tolist()))
        first = snap.char_seqs[0] if snap.char_seqs else snap.num_tokens
        snap.token_ids = {seq: tid for seq, tid in snap.token_ids.items() if seq >= first}
        snap.runs = self._runs[::-1].tolist()  # shortest unit first
        return snap

    def reset(self) -> None:
        """Forget the output and the penalty (a new generation); the intervention counts stay."""
        counts, num_tokens = self._s.interventions, self._s.num_tokens
        self._s = LoopGuardState(num_tokens=num_tokens, interventions=counts)
        self._clear_window()

    def observe(self, token_id: int, text_delta: str, in_thinking: bool) -> LoopAction:
        """Feed one generated token and the text it produced ("" for a partial UTF-8 character)."""
        cfg, s = self.config, self._s
        if cfg.mode == "off":
            return LoopAction()
        if s.stop_note:  # terminal until reset(): the engine should already have finished the sequence
            return LoopAction(ActionKind.STOP, self.repetition_penalty, note=s.stop_note)
        num_chars = self._push(token_id, text_delta)
        loop = self._detect(num_chars)
        if s.ban_tokens_left:
            s.ban_tokens_left -= 1
            if loop is not None and s.ban_tokens_left:
                s.banned = sorted(set(s.banned) | set(self._next_ids(loop)))
            if not s.ban_tokens_left:
                s.banned = []
        if loop is None:
            return self._on_quiet(num_chars)
        return self._on_loop(loop, in_thinking)

    # -- stage 2: the state machine ---------------------------------------------------------------------------

    def _on_loop(self, loop: _Loop, in_thinking: bool) -> LoopAction:
        cfg, s = self.config, self._s
        back = False  # the last loop again after a break of at most min_covered_chars (a line reworded)
        if s.quiet_tokens > 0 or s.level == 0:  # a loop seen anew
            gap = s.quiet_chars - loop.covered  # the text between: what was not the loop
            back = s.recent_level > 0 and gap <= cfg.min_covered_chars and _same_unit(loop.unit, s.recent_unit)
            if not back:  # another loop, or this one after other text: the last level and cap tokens do not count
                s.recent_unit, s.recent_level, s.loop_tokens_at_cap = loop.unit, 0, 0
        s.quiet_tokens = s.quiet_chars = 0
        if back:
            # The penalty reached last time broke the period (a reworded line) but not the loop: go on from one
            # step past it, and at the cap count the tokens the loop took to be seen again as tokens at the cap.
            s.tokens_since_step = 0
            if s.recent_level < cfg.max_level:
                s.level = s.recent_level = max(s.level, s.recent_level + 1)
                return self._action(ActionKind.RAMP, f"LoopGuard: output repeats {_describe(loop)} again; "
                                                     f"repetition penalty raised to {self.repetition_penalty:g}")
            s.level = cfg.max_level
            s.loop_tokens_at_cap += self._loop_tokens(loop)
        elif s.level < cfg.max_level:
            if s.level > 0:
                s.tokens_since_step += 1
                if s.tokens_since_step < cfg.tokens_per_step:
                    return self._action(ActionKind.NONE)
            s.level += 1
            s.recent_level = max(s.recent_level, s.level)
            s.tokens_since_step = 0
            return self._action(ActionKind.RAMP, f"LoopGuard: output repeats {_describe(loop)}; "
                                                 f"repetition penalty raised to {self.repetition_penalty:g}")
        s.loop_tokens_at_cap += 1
        if s.loop_tokens_at_cap < cfg.cap_tokens:
            return self._action(ActionKind.NONE)
        s.loop_tokens_at_cap = 0
        failed = (f"LoopGuard: output repeated {_describe(loop)}; repetition penalty reached "
                  f"{self.repetition_penalty:g} without breaking the loop")
        if cfg.mode == "end_thinking" and in_thinking:
            self.reset()
            return self._action(ActionKind.END_THINKING, f"{failed}; thinking ended so the answer can start")
        if cfg.mode == "escape" and s.escapes < cfg.escape_attempts:
            s.escapes += 1
            s.banned = sorted(set(self._next_ids(loop)))
            s.ban_tokens_left = cfg.escape_ban_tokens
            return self._action(ActionKind.BAN, f"{failed}; banning the {len(s.banned)} token(s) that continued "
                                                f"it (escape {s.escapes} of {cfg.escape_attempts})")
        if cfg.mode == "escape":
            failed += f" or {cfg.escape_attempts} token bans"
        s.stop_note = f"{failed}; generation stopped so the client can recover"
        return self._action(ActionKind.STOP, s.stop_note)

    def _on_quiet(self, num_chars: int) -> LoopAction:
        """A token with no loop at the end of the output. The penalty relaxes; the escape mode's count of bans,
        the level the loop reached and its tokens at the cap are forgiven only once a whole window of output
        (`window_chars`) has gone by without the loop: a ban or a reworded line breaks the loop's period, and the
        detector needs `min_covered_chars` of it again to see a loop that came back, by which time the penalty
        may well have relaxed to nothing."""
        cfg, s = self.config, self._s
        s.quiet_chars += num_chars
        if s.quiet_chars >= cfg.window_chars:
            s.escapes = s.recent_level = s.loop_tokens_at_cap = 0
        if s.level == 0:
            return self._action(ActionKind.NONE)
        s.quiet_tokens += 1
        past = s.quiet_tokens - cfg.relax_after_tokens
        if past < 0 or past % cfg.tokens_per_step:
            return self._action(ActionKind.NONE)
        s.level -= 1
        if s.level == 0:
            s.tokens_since_step = 0
        return self._action(ActionKind.RELAX, f"LoopGuard: no repetition for {s.quiet_tokens} tokens; "
                                              f"repetition penalty relaxed to {self.repetition_penalty:g}")

    def _action(self, kind: ActionKind, note: str = "") -> LoopAction:
        s = self._s
        if kind is not ActionKind.NONE:
            s.interventions[kind.value] = s.interventions.get(kind.value, 0) + 1
        banned = tuple(s.banned) if s.ban_tokens_left else ()
        return LoopAction(kind, self.repetition_penalty, banned, note)

    # -- stage 1: detection -----------------------------------------------------------------------------------

    def _push(self, token_id: int, text: str) -> int:
        """Normalise `text` and append it, updating runs[] for every unit length; return the chars appended."""
        s = self._s
        seq = s.num_tokens
        s.num_tokens += 1
        out: list[str] = []
        last_space = self._buf[self._n - 1] == 32
        for ch in text:
            if ch.isspace():
                s.blank_chars += 1
                if not last_space:
                    out.append(" ")
                    last_space = True
            else:
                s.blank_chars = 0
                out.append(ch)
                last_space = False
        if text and s.blank_chars >= len(text):  # a whitespace-only token continuing a whitespace run
            if token_id not in s.blank_ids and len(s.blank_ids) < 8:
                s.blank_ids.append(token_id)
        elif text:
            s.blank_ids = []
        if out:
            s.token_ids[seq] = token_id
            chars = "".join(out)
            step = self.config.window_chars
            for i in range(0, len(chars), step):
                self._append(chars[i:i + step], seq)
        return len(out)

    def _append(self, chars: str, seq: int) -> None:
        cfg = self.config
        if self._n + len(chars) > self._buf.size:
            self._shift()
        buf, runs, n0 = self._buf, self._runs, self._n
        n, back_lo, back_hi = n0, cfg.max_unit_chars, cfg.min_unit_chars - 1
        for ch in chars:
            code = ord(ch)
            # runs[L] += 1 where the character L back equals this one, else runs[L] = 0; for all L at once.
            np.add(runs, 1, out=runs)
            np.multiply(runs, buf[n - back_lo:n - back_hi] == code, out=runs)  # [num_units], longest first
            buf[n] = code
            n += 1
        self._seq[n0:n] = seq
        self._n = n
        np.minimum(runs, cfg.window_chars, out=runs)

    def _shift(self) -> None:
        """Move the last window (plus the look-back pad) to the front of the buffer; drop stale token ids."""
        keep = self.config.window_chars + self._pad
        lo = self._n - keep
        self._buf[:keep] = self._buf[lo:self._n]
        self._seq[:keep] = self._seq[lo:self._n]
        self._n = keep
        first = int(self._seq[self._n - self.config.window_chars])
        ids = self._s.token_ids
        for seq in [seq for seq in ids if seq < first]:
            del ids[seq]

    def _detect(self, num_chars: int) -> _Loop | None:
        cfg, s = self.config, self._s
        self._headroom -= num_chars  # each run grew by at most num_chars
        if s.blank_chars >= cfg.min_covered_chars:
            return _Loop(1, s.blank_chars, " ")
        if self._headroom > 0:
            return None
        margin = self._thresholds - self._runs
        self._headroom = int(margin.min())
        if self._headroom > 0:
            return None
        i = int(np.flatnonzero(margin <= 0)[-1])  # the shortest unit that fires
        unit = int(self._units[i])
        covered = min(int(self._runs[i]) + unit, cfg.window_chars)
        start = self._n - covered  # show the unit in the phase the loop started with
        return _Loop(unit, covered, "".join(map(chr, self._buf[start:start + unit].tolist())))

    def _loop_tokens(self, loop: _Loop) -> int:
        """Tokens whose characters the loop's periodic suffix spans (within the window); a whitespace run's, its
        own (the buffer holds one space for the run, with its first token's number)."""
        if loop.unit == " " and loop.unit_chars == 1 and loop.covered == self._s.blank_chars:
            return self._s.num_tokens - int(self._seq[self._n - 1])
        first = self._n - min(loop.covered, self._n - self._pad, self.config.window_chars)
        return self._s.num_tokens - int(self._seq[first]) if first < self._n else 1

    def _next_ids(self, loop: _Loop) -> list[int]:
        """Ids of the tokens that came right after the current point one, two and three periods back."""
        s = self._s
        if loop.unit == " ":
            return list(s.blank_ids)
        oldest = self._n - min(loop.covered, self.config.window_chars)
        ids: list[int] = []
        for k in (1, 2, 3):
            pos = self._n - k * loop.unit_chars
            if pos < oldest:
                break
            tid = s.token_ids.get(int(self._seq[pos]))
            if tid is not None and tid not in ids:
                ids.append(tid)
        return ids

    # -- state ------------------------------------------------------------------------------------------------

    def _clear_window(self) -> None:
        self._buf.fill(_SENTINEL)
        self._seq.fill(-1)
        self._n = self._pad
        self._runs = np.zeros(self._units.size, dtype=np.int64)
        self._headroom = 0

    def _restore(self, state: LoopGuardState) -> None:
        cfg = self.config
        if (len(state.runs) != self._units.size or len(state.text) > cfg.window_chars
                or len(state.char_seqs) != len(state.text)):
            raise ConfigError("LoopGuard state does not match this config (window or unit lengths differ)")
        self._s = LoopGuardState.from_dict(state.to_dict())  # a private copy
        k = len(state.text)
        self._buf[self._pad:self._pad + k] = [ord(c) for c in state.text]
        self._seq[self._pad:self._pad + k] = state.char_seqs
        self._n = self._pad + k
        self._runs = np.asarray(state.runs[::-1], dtype=np.int64)


def _describe(loop: _Loop) -> str:
    if loop.unit == " ":  # normalised text never holds two spaces in a row: this is a raw whitespace run
        return f"whitespace only ({loop.covered} characters)"
    unit = loop.unit if len(loop.unit) <= 40 else loop.unit[:37] + "..."
    return f"a {loop.unit_chars}-character unit {loop.repeats} times ({unit!r})"
