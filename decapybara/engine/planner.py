"""Step planning: which running sequences compute how many tokens in the next forward call.

NOTE: the algorithm. Every running sequence is either decoding (one uncomputed token: the last sample) or
prefilling (several: its prompt, or tokens the LoopGuard forced). A step has a token budget. Decodes cost one
token each; prefill chunks take what the policy leaves them:
- ``decode-priority``: all decodes first, then prefill chunks in admission order with the rest;
- ``prefill-priority``: prefill chunks first (oldest first), decodes only with what is left;
- ``balanced``: all decodes, and prefill may take at most `balanced_prefill_share` of the budget while any
  sequence decodes (the whole remaining budget when none does), bounding inter-token latency.
For hybrid models with the prefix cache on, a chunk that crosses a snapshot boundary asks for a state
snapshot there, so the prefix cache can reuse the state at that point: every `cfg.snapshot_interval` tokens
(a multiple of the page size), the last page boundary of the prompt (where a repeated or shared prompt
is reusable up to), and that of a chat prompt's history (`Request.history_end`: the agent's next turn repeats the
history, not always the generation prompt). A sequence samples only when its chunk reaches its
last token. With speculation, a decoding sequence that holds drafts (the tokens guessed after its last) computes
them as more rows of its chunk, as many as the budget leaves room for once the prompts' chunks have the tokens
they would have with no draft (`ScheduledChunk.drafts`, `_prefill_reserve`), with a state
snapshot after its real token and after each draft but the last for hybrid models (where a draft is rejected, the
state goes back to the one after the tokens before it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from decapybara.config import EngineConfig
from decapybara.engine.sequence import Sequence

# a prompt's chunk of a request for prompt logprobs takes at most this many tokens a step: each row's logits are
# kept and read (a 27B's vocabulary: ~1 MB a row in float32, and the log-softmax's temporaries beside them)
PROMPT_LOGPROB_ROWS = 256


@dataclass(slots=True)
class ScheduledChunk:
    seq: Sequence
    num_tokens: int  # tokens computed this step, starting at seq.num_computed
    sample: bool  # the chunk ends at the sequence's last token: sample the next one
    snapshot_at: tuple[int, ...] = ()  # absolute token counts after which to snapshot hybrid state
    drafts: tuple[int, ...] = ()  # speculation: tokens guessed after the last, computed as rows 2.. of the chunk
    # ... a rejection goes back to the state after the tokens before it (seq.num_computed + 1 .. + len(drafts),
    # snapshot points); those points that are not also prefix-cache snapshot points, kept as the backend's arrays
    rollback: tuple[int, ...] = ()


@dataclass(slots=True)
class StepPlan:
    chunks: list[ScheduledChunk]  # in batch row order

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def num_decodes(self) -> int:
        return sum(1 for c in self.chunks if c.num_tokens == 1 and c.sample)


def plan_step(running: list[Sequence], cfg: EngineConfig, snapshots: bool, fill_rows: int = 0,
              graph_drafts: Callable[[int], int] | None = None) -> StepPlan:
    """Compose one step over `running` (ordered oldest admission first); `snapshots`: a hybrid model whose
    state snapshots the prefix cache keeps; `fill_rows` > 0: a step of at most that many decodes, no prompt,
    and some draft replays a verification graph whose every sequence has a second row (or more), so the other
    decodes' doubtful guesses (`Sequence.guess`) are drafted too; `graph_drafts` (with
    decode graphs: the drafts a sequence that a verification graph of n sequences takes, 0 for none): a step
    without a prompt's chunk of two tokens or more verifies at most that many drafts a sequence, a step with one
    (eager anyway) every draft. Pure: reads, never mutates."""
    every = cfg.snapshot_every if (snapshots and cfg.enable_prefix_cache) else 0
    ps = cfg.page_size
    budget = cfg.max_batch_tokens
    decodes = [s for s in running if not s.in_prefill]
    prefills = [s for s in running if s.in_prefill]
    # drafts take only what the prompts' chunks leave: those get the tokens they would get with no draft
    share = _prefill_reserve(cfg, len(decodes), sum(s.num_uncomputed for s in prefills))

    def compose(cap: int | None) -> list[ScheduledChunk]:
        """The step's chunks, each decode verifying at most `cap` of its drafts (None: all)."""
        chunks: list[ScheduledChunk] = []

        def add_prefills(limit: int) -> int:
            used = 0
            for s in prefills:
                room = limit - used
                if room <= 0:
                    break
                n = min(s.num_uncomputed, room)
                if s.params.prompt_logprobs is not None and s.num_computed + 1 < s.num_prompt:
                    n = min(n, PROMPT_LOGPROB_ROWS)  # each of its rows a vocabulary's logits
                chunks.append(_chunk(s, n, every, ps))
                used += n
            return used

        def held(s: Sequence) -> tuple[int, ...]:
            return s.drafts if cap is None else s.drafts[:cap]

        # (unless a graph takes the drafts, `cap` set, a step with two or more a sequence runs eagerly: no spare rows)
        fill = (0 < len(decodes) <= fill_rows and not prefills and any(held(s) for s in decodes)
                and (cap is not None or all(len(s.drafts) <= 1 for s in decodes)))

        def add_decodes(limit: int) -> int:
            """Decodes in order, one token each, and a sequence's drafts as more rows, as many as the budget leaves
            while it keeps one token for every decode after it and the prompts' chunks theirs (`_prefill_reserve`)."""
            used = 0
            for k, s in enumerate(decodes):
                if used >= limit:
                    break
                drafts = held(s) or ((s.guess,) if fill and s.guess is not None else ())
                drafts = drafts[:max(0, limit - share - used - 1 - (len(decodes) - k - 1))]
                if drafts:
                    # snapshot points over every row (a draft's count only if it is kept), and the states after the
                    # real token and each draft but the last: where a rejection is rolled back to
                    n = 1 + len(drafts)
                    bounds = _boundaries(s, n, every, ps)
                    backs = range(s.num_computed + 1, s.num_computed + n)
                    chunks.append(ScheduledChunk(s, n, True, tuple(sorted({*bounds, *backs})), drafts,
                                                 tuple(b for b in backs if b not in bounds)))
                    used += n
                else:
                    chunks.append(ScheduledChunk(s, 1, True, _boundaries(s, 1, every, ps)))
                    used += 1
            return used

        if cfg.prefill_policy == "prefill-priority":
            used = add_prefills(budget)
            add_decodes(max(0, budget - used))
        else:
            rest = budget - add_decodes(budget)
            if cfg.prefill_policy == "balanced" and decodes:
                rest = min(rest, max(1, int(budget * cfg.balanced_prefill_share)))
            add_prefills(rest)
        return chunks

    if graph_drafts is None:
        return StepPlan(compose(None))
    # with decode graphs: every draft where a prompt's chunk of 2+ tokens runs beside the decodes (that step is
    # eager anyway), else as many a sequence as a verification graph of the step's sequences takes (every draft
    # where none takes them: a step that runs eagerly)
    chunks = compose(None) if prefills else []
    if not any(c.num_tokens - len(c.drafts) > 1 for c in chunks):
        chunks = compose(graph_drafts(len(decodes) + len(prefills)) or None)
    return StepPlan(chunks)


def _prefill_reserve(cfg: EngineConfig, decodes: int, pending: int) -> int:
    """The tokens of a step's budget that its prompts' chunks (`pending` tokens uncomputed) take beside `decodes`
    decoding sequences when no sequence holds a draft, which drafts therefore never take: balanced, the prefill
    share; decode-priority, what the decodes' own tokens leave; prefill-priority none (its chunks are planned
    before the decodes and their drafts)."""
    budget = cfg.max_batch_tokens
    if cfg.prefill_policy == "balanced":
        return min(pending, max(1, int(budget * cfg.balanced_prefill_share)))
    if cfg.prefill_policy == "decode-priority":
        return min(pending, max(0, budget - decodes))
    return 0


def _boundaries(s: Sequence, n: int, every: int, page_size: int) -> tuple[int, ...]:
    """Snapshot points in (num_computed, num_computed + n]: multiples of `every`, the prompt's last page
    boundary, and the last page boundary of a chat prompt's history (`Request.history_end`: what the next turn
    repeats); none when `every` is 0."""
    if not every:
        return ()
    lo, hi = s.num_computed, s.num_computed + n
    points = {p * every for p in range(lo // every + 1, hi // every + 1)}
    ends = {s.num_prompt} if s.request.history_end is None else {s.num_prompt, min(s.request.history_end,
                                                                                          s.num_prompt)}
    points.update(edge for end in ends if lo < (edge := end // page_size * page_size) <= hi)
    return tuple(sorted(points))


def _chunk(s: Sequence, n: int, every: int, page_size: int) -> ScheduledChunk:
    return ScheduledChunk(s, n, s.num_computed + n == s.num_tokens, _boundaries(s, n, every, page_size))
