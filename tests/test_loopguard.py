"""LoopGuard: detection of repeating output, the penalty ramp, the final actions, and no false positives."""

from __future__ import annotations

import ast
import itertools
import json
import math
import random
import sysconfig
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from decapybara.engine.loopguard import ActionKind, LoopAction, LoopGuard, LoopGuardConfig, LoopGuardState
from decapybara.errors import ConfigError

CFG = LoopGuardConfig()
CODE_UNIT = ["def", " f", "():", "\n", "    ", "return", " f", "()", "\n"]  # normalised: "def f(): return f() "
PROSE_UNIT = ["I", " will", " check", " the", " file", ".", " "]  # normalised: "I will check the file. "
STDLIB = Path(sysconfig.get_paths()["stdlib"])


class Vocab:
    """Stable ids for pseudo-token strings."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}

    def __call__(self, text: str) -> int:
        return self.ids.setdefault(text, len(self.ids))


def vary_whitespace(tokens: list[str], rng: random.Random) -> list[str]:
    """The same tokens with whitespace-only variation (indentation, extra blank lines, tabs)."""
    out = []
    for t in tokens:
        if t.isspace():
            t = rng.choice([t, t + " ", "\n" if " " in t else t + "\n", "\t"])
        out.append(t)
    return out


def looping(unit: list[str], seed: int = 0, vary: bool = True) -> Iterator[str]:
    rng = random.Random(seed)
    while True:
        yield from (vary_whitespace(unit, rng) if vary else unit)


def pseudo_tokens(text: str, seed: int) -> Iterator[str]:
    """Cut `text` into pseudo-tokens of 1-6 characters (deterministic)."""
    rng = random.Random(seed)
    i = 0
    while i < len(text):
        k = rng.randint(1, 6)
        yield text[i:i + k]
        i += k


def fresh_text() -> Iterator[str]:
    """Non-repeating prose, as pseudo-tokens: what a model emits once it has broken out of a loop."""
    for n in itertools.count():
        yield from pseudo_tokens(f"Step {n}: the square of {n} is {n * n}, and its cube is {n ** 3}. ", n)


def run(guard: LoopGuard, model: Callable[[LoopAction], str], vocab: Vocab, num_tokens: int,
        in_thinking: Callable[[int], bool] = lambda i: False) -> list[LoopAction]:
    """Drive `guard` with a model that picks its next token text from the guard's last action."""
    actions: list[LoopAction] = []
    last = LoopAction()
    for i in range(num_tokens):
        text = model(last)
        last = guard.observe(vocab(text), text, in_thinking(i))
        actions.append(last)
        if last.kind is ActionKind.STOP:
            break
    return actions


def kinds_at(actions: list[LoopAction]) -> list[tuple[int, ActionKind, float]]:
    return [(i, a.kind, a.repetition_penalty) for i, a in enumerate(actions) if a.kind is not ActionKind.NONE]


def detection_bound(unit_tokens: int, unit_chars: int, cfg: LoopGuardConfig = CFG) -> int:
    """Tokens after which a loop of this unit must have been detected: enough copies to cover the thresholds,
    plus one copy of slack for the phase."""
    copies = math.ceil(max(cfg.min_covered_chars, cfg.min_repeats * unit_chars) / unit_chars) + 1
    return copies * unit_tokens


# -- (a) a persistent loop: detection, a step-by-step ramp, STOP with a note ------------------------------------

@pytest.mark.parametrize("unit,unit_chars", [(CODE_UNIT, 20), (PROSE_UNIT, 23)])
def test_persistent_loop_is_detected_ramps_step_by_step_then_stops(unit: list[str], unit_chars: int) -> None:
    guard, vocab = LoopGuard(CFG), Vocab()
    stream = looping(unit)
    actions = run(guard, lambda last: next(stream), vocab, 2000)
    events = kinds_at(actions)
    ramps = [e for e in events if e[1] is ActionKind.RAMP]
    first = ramps[0][0]
    assert first < detection_bound(len(unit), unit_chars)
    # One step per tokens_per_step loop tokens, from start to cap, exactly.
    assert [p for _, _, p in ramps] == [1.1, 1.2, 1.3, 1.4, 1.5]
    assert [i for i, _, _ in ramps] == [first + k * CFG.tokens_per_step for k in range(5)]
    # The penalty the engine applies never goes down while the loop persists and changes only on a RAMP.
    penalties = [a.repetition_penalty for a in actions]
    assert penalties[:first] == [1.0] * first
    for i in range(first + 1, len(actions)):
        assert penalties[i] == penalties[i - 1] or actions[i].kind is ActionKind.RAMP
    # STOP after cap_tokens more loop tokens at the cap; nothing else happened.
    assert events[-1][:2] == (ramps[-1][0] + CFG.cap_tokens, ActionKind.STOP)
    assert len(events) == 6 and guard.interventions == {"ramp": 5, "stop": 1}
    note = actions[-1].note
    assert f"repeated a {unit_chars}-character unit" in note and "1.5" in note and "stopped" in note
    # STOP is terminal until reset(); reset starts a new generation with no penalty.
    assert guard.observe(0, "x", False).kind is ActionKind.STOP and guard.interventions["stop"] == 1
    guard.reset()
    assert guard.observe(0, "x", False) == LoopAction() and guard.repetition_penalty == 1.0


def test_whitespace_only_variation_is_still_a_loop_and_raw_whitespace_floods_are_caught() -> None:
    guard, vocab = LoopGuard(CFG), Vocab()
    stream = looping(PROSE_UNIT, seed=3)
    exact = kinds_at(run(guard, lambda last: next(stream), vocab, 2000))
    unvaried = looping(PROSE_UNIT, vary=False)
    plain = kinds_at(run(LoopGuard(CFG), lambda last: next(unvaried), vocab, 2000))
    assert [k for _, k, _ in exact] == [k for _, k, _ in plain] == [ActionKind.RAMP] * 5 + [ActionKind.STOP]
    # Normalisation folds whitespace runs, so an endless stream of newlines is caught by its raw length.
    guard = LoopGuard(CFG)
    actions = run(guard, lambda last: "\n\n", vocab, 1000)
    assert actions[CFG.min_covered_chars // 2 - 1].kind is ActionKind.RAMP
    assert actions[-1].kind is ActionKind.STOP and "whitespace only" in actions[-1].note


# -- (b) a loop that the penalty breaks: RAMP then RELAX back to 1.0 -------------------------------------------

def test_loop_broken_by_the_penalty_relaxes_back_to_one_without_stopping() -> None:
    guard, vocab = LoopGuard(CFG), Vocab()
    loop, fresh = looping(CODE_UNIT, seed=1), fresh_text()
    moved_on = [False]

    def model(last: LoopAction) -> str:  # continuing the loop gets less likely as the penalty rises
        moved_on[0] = moved_on[0] or last.repetition_penalty >= 1.3
        return next(fresh) if moved_on[0] else next(loop)

    actions = run(guard, model, vocab, 600)
    events = kinds_at(actions)
    assert [(k, p) for _, k, p in events] == [
        (ActionKind.RAMP, 1.1), (ActionKind.RAMP, 1.2), (ActionKind.RAMP, 1.3),
        (ActionKind.RELAX, 1.2), (ActionKind.RELAX, 1.1), (ActionKind.RELAX, 1.0)]
    last_ramp, relaxes = events[2][0], [i for i, k, _ in events if k is ActionKind.RELAX]
    assert relaxes[0] - last_ramp == CFG.relax_after_tokens
    assert [b - a for a, b in itertools.pairwise(relaxes)] == [CFG.tokens_per_step] * 2
    assert guard.repetition_penalty == 1.0 and actions[-1].repetition_penalty == 1.0
    assert "relaxed to 1" in actions[relaxes[-1]].note


def test_a_loop_reworded_under_the_penalty_and_resumed_is_stopped() -> None:
    """A model that rewords one line of its loop whenever the penalty reaches 1.3, then loops on: each rewording
    breaks the period, and the loop is seen again only ~min_covered_chars later, the penalty relaxed meanwhile.
    A return takes the ramp up from one step past the level reached before, and past the cap the tokens the loop
    took to be seen again count toward the stop: it ends on its return (it used to run to max_tokens, ramping and
    relaxing)."""
    guard, vocab = LoopGuard(CFG), Vocab()
    base = pseudo_tokens("Let me re-read the test file to find why the assertion fails. ", 0)
    base, reworded = list(base), list(pseudo_tokens("Let me open the test module to see why it fails. ", 1))
    queue: list[str] = []

    def model(last: LoopAction) -> str:
        if not queue:
            queue.extend(reworded if last.repetition_penalty >= 1.3 else base)
        return queue.pop(0)

    actions = run(guard, model, vocab, 20_000)
    events = kinds_at(actions)
    assert actions[-1].kind is ActionKind.STOP and len(actions) < 600, (len(actions), events[-3:])
    kinds = [k for _, k, _ in events]
    assert kinds == [ActionKind.RAMP] * 5 + [ActionKind.RELAX] * 5 + [ActionKind.STOP]  # stopped on its return


def test_a_loop_that_breaks_below_the_cap_and_comes_back_goes_on_from_a_step_past_it() -> None:
    """Reworded as soon as the penalty reaches 1.3 (mid-line), the loop comes back at 1.4, then 1.5, then stops."""
    guard, vocab = LoopGuard(CFG), Vocab()
    loop = looping(PROSE_UNIT, seed=3, vary=False)
    other = itertools.cycle(pseudo_tokens("Perhaps the fixture is stale. ", 2))

    def model(last: LoopAction) -> str:
        return next(other) if last.kind is ActionKind.RAMP and last.repetition_penalty >= 1.3 else next(loop)

    actions = run(guard, model, vocab, 20_000)
    ramps = [(p, a.note.endswith(f"again; repetition penalty raised to {p:g}"))
             for (_, k, p), a in zip(kinds_at(actions), [a for a in actions if a.kind is not ActionKind.NONE])
             if k is ActionKind.RAMP]
    assert ramps == [(1.1, False), (1.2, False), (1.3, False), (1.4, True), (1.5, True)], ramps
    assert actions[-1].kind is ActionKind.STOP and len(actions) < 1000


def test_a_new_loop_a_whole_window_after_the_last_starts_the_ramp_afresh() -> None:
    """The level a loop reached is forgotten once a whole window of output went by without one."""
    guard, vocab = LoopGuard(CFG), Vocab()
    loop, fresh = looping(CODE_UNIT, seed=2), fresh_text()
    state = {"n": 0, "broke": None}

    def model(last: LoopAction) -> str:
        state["n"] += 1
        if state["broke"] is None and last.repetition_penalty >= 1.3:
            state["broke"] = state["n"]
        if state["broke"] is not None and state["n"] < state["broke"] + 3000:  # > window_chars of fresh text
            return next(fresh)
        return next(loop)

    actions = run(guard, model, vocab, 4000)
    ramps = [p for _, k, p in kinds_at(actions) if k is ActionKind.RAMP]
    assert ramps[:6] == [1.1, 1.2, 1.3, 1.1, 1.2, 1.3], ramps


# -- (c) end_thinking mode ---------------------------------------------------------------------------------------

def test_end_thinking_mode_ends_a_looping_thinking_block_and_stops_a_looping_answer() -> None:
    cfg = LoopGuardConfig(mode="end_thinking")
    guard, vocab = LoopGuard(cfg), Vocab()
    loop = looping(PROSE_UNIT, seed=2)
    thinking = [True]

    def model(last: LoopAction) -> str:
        if last.kind is ActionKind.END_THINKING:
            thinking[0] = False  # the engine forces </think> and the answer starts (and loops again)
        return next(loop)

    actions = run(guard, model, vocab, 3000, in_thinking=lambda i: thinking[0])
    events = kinds_at(actions)
    assert [k for _, k, _ in events] == [ActionKind.RAMP] * 5 + [ActionKind.END_THINKING] + \
        [ActionKind.RAMP] * 5 + [ActionKind.STOP]
    end = events[5][0]
    assert actions[end].repetition_penalty == 1.0 and "thinking ended" in actions[end].note
    # The guard forgot the window: the answer's loop is detected afresh, not on the next token.
    assert events[6][0] - end > CFG.min_covered_chars // 6
    assert "stopped" in actions[-1].note


# -- (d) escape mode ---------------------------------------------------------------------------------------------

def test_escape_mode_bans_the_tokens_that_continued_the_loop() -> None:
    cfg = LoopGuardConfig(mode="escape")
    guard, vocab = LoopGuard(cfg), Vocab()
    wanted, fresh = looping(CODE_UNIT, vary=False), fresh_text()
    pending: list[str] = []
    escaped = [False]

    def model(last: LoopAction) -> str:  # loops, but never samples a banned token: then it moves on for good
        if not pending:
            pending.append(next(wanted))
        if escaped[0] or vocab(pending[0]) in last.banned_token_ids:
            escaped[0] = True
            return next(fresh)
        return pending.pop()

    actions = run(guard, model, vocab, 800)
    events = kinds_at(actions)
    assert [k for _, k, _ in events][:6] == [ActionKind.RAMP] * 5 + [ActionKind.BAN]
    ban_at = events[5][0]
    # The loop's next token is banned (the text that followed this point one period back) ...
    assert vocab(pending[0]) in actions[ban_at].banned_token_ids
    # ... for exactly escape_ban_tokens sampling steps, then the ban lifts.
    carried = [bool(a.banned_token_ids) for a in actions[ban_at:ban_at + cfg.escape_ban_tokens + 1]]
    assert carried == [True] * cfg.escape_ban_tokens + [False]
    # The escape worked: no STOP, the penalty relaxes to 1.0.
    assert ActionKind.STOP not in {k for _, k, _ in events} and guard.repetition_penalty == 1.0
    assert "banning" in actions[ban_at].note


def test_escape_mode_stops_after_the_configured_number_of_failed_bans() -> None:
    cfg = LoopGuardConfig(mode="escape", escape_attempts=2)
    guard, vocab = LoopGuard(cfg), Vocab()
    wanted = looping(PROSE_UNIT, vary=False)
    pending: list[str] = []

    def model(last: LoopAction) -> str:  # a stubborn model: spells a banned token out character by character
        if not pending:
            pending.append(next(wanted))
        text = pending.pop()
        if vocab(text) in last.banned_token_ids and len(text) > 1:
            pending.append(text[1:])
            return text[0]
        return text

    actions = run(guard, model, vocab, 3000)
    assert guard.interventions == {"ramp": 5, "ban": 2, "stop": 1}
    assert actions[-1].kind is ActionKind.STOP and "2 token bans" in actions[-1].note


def test_escape_mode_stops_a_loop_that_comes_back_after_each_ban() -> None:
    """A model that takes another token while the loop's is banned, then loops again: each ban breaks the period,
    so the loop is seen again only ~min_covered_chars later, when the penalty has relaxed; those bans still
    failed, and the guard stops after escape_attempts of them."""
    cfg = LoopGuardConfig(mode="escape")
    guard, vocab = LoopGuard(cfg), Vocab()

    def model(last: LoopAction) -> str:
        return " bar" if vocab(" foo") in last.banned_token_ids else " foo"

    actions = run(guard, model, vocab, 3000)
    assert actions[-1].kind is ActionKind.STOP and f"{cfg.escape_attempts} token bans" in actions[-1].note
    assert guard.interventions["ban"] == cfg.escape_attempts and guard.interventions["stop"] == 1
    notes = [a.note for a in actions if a.kind is ActionKind.BAN]
    assert [n.rsplit("(", 1)[1] for n in notes] == [f"escape {i} of {cfg.escape_attempts})"
                                                    for i in range(1, cfg.escape_attempts + 1)]


def test_escape_bans_are_forgiven_after_a_window_without_the_loop() -> None:
    """A ban that worked (the output moved on for a whole window) does not count against a later, new loop."""
    cfg = LoopGuardConfig(mode="escape", escape_attempts=1)
    guard, vocab = LoopGuard(cfg), Vocab()
    fresh = fresh_text()
    phase = {"n": 0}

    def model(last: LoopAction) -> str:  # a loop, escaped for good once banned; a second loop much later
        phase["n"] += 1
        if last.banned_token_ids:
            phase["escaped"] = phase["n"]
        if "escaped" in phase and phase["n"] < phase["escaped"] + 3000:  # > window_chars of fresh text
            return next(fresh)
        return " foo"

    actions = run(guard, model, vocab, 4000)
    kinds = [a.kind for a in actions if a.kind in (ActionKind.BAN, ActionKind.STOP)]
    assert kinds[:2] == [ActionKind.BAN, ActionKind.BAN], kinds  # the second loop gets its own ban, not a STOP


def test_off_mode_never_intervenes() -> None:
    guard, vocab = LoopGuard(LoopGuardConfig(mode="off")), Vocab()
    stream = looping(CODE_UNIT)
    actions = run(guard, lambda last: next(stream), vocab, 1000)
    assert all(a == LoopAction() for a in actions) and guard.interventions == {}


# -- (e) no false positives on real code and prose -------------------------------------------------------------

# Long files with repetitive structure (tables, banners, many similar methods) plus a fixed sorted sample.
# encodings/iso8859_8.py holds the stdlib's longest exact periodic run outside the test suites (32 identical
# table lines, 291 normalised characters) and difflib.py the next (134): see LoopGuardConfig's NOTE.
NAMED = ["tkinter/__init__.py", "_pydecimal.py", "token.py", "locale.py", "stringprep.py", "html/entities.py",
         "encodings/iso8859_8.py", "encodings/cp1252.py", "encodings/mac_roman.py", "opcode.py", "keyword.py",
         "tokenize.py", "_strptime.py", "calendar.py", "string.py", "colorsys.py", "difflib.py"]


def stdlib_sample() -> list[Path]:
    named = [STDLIB / name for name in NAMED]
    rest = sorted(p for p in STDLIB.glob("*.py") if p not in named)
    return [p for p in named if p.exists()] + rest[::max(1, len(rest) // 20)][:20]


def docstrings(source: str) -> str:
    tree = ast.parse(source)
    nodes = [tree] + [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.ClassDef)]
    return "\n\n".join(d for n in nodes if (d := ast.get_docstring(n)))


def test_no_intervention_on_standard_library_code_and_prose() -> None:
    files = stdlib_sample()
    assert len(files) >= 30
    fired = {}
    for path in files:
        source = path.read_text(encoding="utf-8")
        for kind, text in (("code", source), ("prose", docstrings(source))):
            guard, vocab = LoopGuard(CFG), Vocab()
            for tok in pseudo_tokens(text, seed=len(text)):
                guard.observe(vocab(tok), tok, False)
            if guard.interventions:
                fired[f"{path.relative_to(STDLIB)} ({kind})"] = guard.interventions
    assert fired == {}


# -- (f) serialisation -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["stop", "escape"])
@pytest.mark.parametrize("split", [90, 200, 400, 600])
def test_restored_guard_continues_identically(mode: str, split: int) -> None:
    cfg = LoopGuardConfig(mode=mode, escape_attempts=2)
    # A stream that loops up to the cap, recovers (the penalty relaxes), then loops for good (BANs, STOP).
    texts = list(itertools.islice(looping(PROSE_UNIT, seed=5), 130)) + \
        [t.replace("e", "é") for t in itertools.islice(fresh_text(), 150)] + \
        list(itertools.islice(looping(CODE_UNIT, seed=6), 900))
    vocab = Vocab()
    original = LoopGuard(cfg)
    for t in texts[:split]:
        original.observe(vocab(t), t, True)
    bundle = json.loads(json.dumps(original.state.to_dict()))
    restored = LoopGuard(cfg, LoopGuardState.from_dict(bundle))
    assert restored.repetition_penalty == original.repetition_penalty
    assert restored.interventions == original.interventions
    for t in texts[split:]:
        a, b = original.observe(vocab(t), t, True), restored.observe(vocab(t), t, True)
        assert a == b
    assert restored.state == original.state
    assert {"ramp", "relax", "stop"} <= set(original.interventions)
    with pytest.raises(ConfigError):
        LoopGuard(LoopGuardConfig(max_unit_chars=64), LoopGuardState.from_dict(bundle))


# -- (g) cost --------------------------------------------------------------------------------------------------

def test_cost_per_observe_is_small() -> None:
    source = (STDLIB / "argparse.py").read_text(encoding="utf-8")
    texts = list(pseudo_tokens(source, seed=0)) + list(itertools.islice(looping(CODE_UNIT), 5000))
    guard, vocab = LoopGuard(LoopGuardConfig(cap_tokens=10**6)), Vocab()
    ids = [vocab(t) for t in texts]
    start = time.perf_counter()
    for tid, t in zip(ids, texts):
        guard.observe(tid, t, False)
    per_token_us = (time.perf_counter() - start) / len(texts) * 1e6
    print(f"LoopGuard.observe: {per_token_us:.1f} us per token over {len(texts)} tokens "
          f"(window {CFG.window_chars}, units {CFG.min_unit_chars}..{CFG.max_unit_chars})")
    assert guard.interventions.get("ramp") == 5  # the stream did loop at the end
    assert per_token_us < 200


# -- config ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [
    {"mode": "loud"}, {"step_kind": "pow"}, {"window_chars": 0}, {"min_repeats": 1},
    {"max_unit_chars": 4096}, {"min_unit_chars": 8, "max_unit_chars": 4}, {"min_covered_chars": 16384},
    {"penalty_start": 1.0}, {"penalty_start": 1.7}, {"penalty_step": 0.0}, {"step_kind": "mul"},
    {"cap_tokens": 0}, {"tokens_per_step": True}])
def test_bad_config_is_a_config_error(bad: dict) -> None:
    with pytest.raises(ConfigError):
        LoopGuardConfig(**bad).validate()


def test_multiplicative_ramp_reaches_the_cap() -> None:
    cfg = LoopGuardConfig(step_kind="mul", penalty_step=1.2, penalty_cap=1.6).validate()
    assert [cfg.penalty_at(k) for k in range(5)] == [1.0, 1.1, 1.32, 1.584, 1.6] and cfg.max_level == 4


# -- long units ----------------------------------------------------------------------------------------------------

LONG_FUNCTION = '''def load_config(path):
    """Read the settings file and merge it with the defaults."""
    with open(path, encoding="utf-8") as fh:
        raw = json.load(fh)
    settings = dict(DEFAULTS)
    for key, value in raw.items():
        if key not in DEFAULTS:
            log.warning("unknown setting %s ignored", key)
            continue
        settings[key] = value
    if settings["workers"] < 1:
        raise ValueError("workers must be at least 1")
    return settings

# and a longer comment to grow the unit past the limit a bit more
# and a longer comment to grow the unit past the limit a bit more
'''


def test_a_whole_function_written_over_and_over_is_stopped() -> None:
    """An agent that writes the same ~30-line function again and again (a unit of ~550 normalised characters)
    is looping as surely as one repeating a line: the guard ramps and stops it within a few copies."""
    assert 512 < len(" ".join(LONG_FUNCTION.split())) + 1 < 1024
    guard, vocab = LoopGuard(CFG), Vocab()
    tokens = list(pseudo_tokens(LONG_FUNCTION * 30, seed=1))
    stopped_at = None
    for i, tok in enumerate(tokens):
        if guard.observe(vocab(tok), tok, False).kind is ActionKind.STOP:
            stopped_at = i
            break
    assert stopped_at is not None, guard.interventions
    assert stopped_at < len(tokens) * 8 // 30  # within eight copies


def test_the_same_table_written_again_after_other_text_ramps_afresh() -> None:
    """Blocks of identical table rows between paragraphs of prose (not a loop that came back after a reworded line):
    each block's ramp starts again at the first step, and none is stopped."""
    guard, vocab, fresh = LoopGuard(CFG), Vocab(), fresh_text()
    ramps = []
    for block in range(1, 5):
        for tok in list(pseudo_tokens("| 0 | 0 | 0 | 0 |\n" * 24, block)) + [next(fresh) for _ in range(400)]:
            action = guard.observe(vocab(tok), tok, False)
            assert action.kind is not ActionKind.STOP
            if action.kind is ActionKind.RAMP:
                ramps.append((block, action.repetition_penalty))
    for block in range(1, 5):  # each block's ramp from its first step, step by step
        steps = [p for b, p in ramps if b == block]
        assert steps == [round(1.1 + 0.1 * i, 6) for i in range(len(steps))] and len(steps) >= 4, ramps


def test_a_long_paragraph_of_reasoning_written_over_and_over_is_stopped() -> None:
    """A reasoning loop of a whole ~1,100-character paragraph (past the former 1,024-character units) is stopped
    within a few copies, inside the thinking block as outside."""
    paragraph = " ".join(f"Wait, step {i} of the plan needs the parser's state {i * 7} before the lexer runs, so "
                         f"I should check the fixture that sets it." for i in range(10)) + " "
    assert 1024 < len(paragraph) < 2048
    guard, vocab = LoopGuard(CFG), Vocab()
    tokens = list(pseudo_tokens(paragraph * 20, seed=3))
    stopped_at = next((i for i, tok in enumerate(tokens)
                       if guard.observe(vocab(tok), tok, True).kind is ActionKind.STOP), None)
    assert stopped_at is not None and stopped_at < len(tokens) * 6 // 20  # within six copies


def test_a_paused_sequence_saved_under_the_former_window_restores_with_a_fresh_guard() -> None:
    from decapybara.engine.persist import restore_sequence, sequence_state
    from decapybara.engine.sequence import Request, Sequence

    seq = Sequence(Request((1, 2, 3)), 7, 0.0, tokens=[1, 2, 3, 4], num_prompt=3, num_computed=3, num_output=1)
    seq.loopguard = LoopGuard(LoopGuardConfig(window_chars=2048, max_unit_chars=512))
    seq.loopguard.observe(4, "x", False)
    meta, extras = sequence_state(seq)
    meta = json.loads(json.dumps(meta))
    restored = restore_sequence(meta, extras, lambda params, state=None: LoopGuard(CFG, state))
    assert restored.loopguard.config == CFG and restored.loopguard.repetition_penalty == 1.0
