"""A request as the engine sees it, and its mutable state while it runs.

`Request` is what a client asked for (immutable). `Sequence` is the engine's record: tokens (prompt then
output, plus tokens forced by the LoopGuard), how many of them have KV/state computed, the pages that hold
them, its state slot, counters, and per-request helpers (detokeniser, LoopGuard).
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from decapybara.engine.sampling import SamplingParams, union_sorted

_ids = itertools.count()


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds nothing
    RUNNING = "running"  # holds pages (and a state slot) in the pool
    PAUSED = "paused"  # its KV/state left the pool for host memory or a tier; resumes without re-prefill
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # eos, stop token or stop string
    LENGTH = "length"  # max_tokens or the context limit
    LOOP = "loop"  # LoopGuard ended a generation that would not leave its loop
    ABORT = "abort"  # cancelled by the client


@dataclass(slots=True, frozen=True)
class Request:
    """A generation request. `conversation` groups an agent's turns (affinity, age, pause decisions).
    `history_end`: where a chat prompt's history ends: the start of its generation prompt, or of a tool-choice
    note the API put in a turn of its own before it (None: not a chat, or not known). The agent's next turn
    repeats the history but not always the generation prompt (with thinking off it holds an empty think block the
    history does not), so a hybrid model's state is also snapshotted at the last page boundary of the history."""

    prompt_ids: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    conversation: str | None = None
    arrival: float | None = None  # clock time; the engine fills it when None
    history_end: int | None = None


@dataclass(slots=True)
class TokenEvent:
    """What one engine step produced for one request (token ids may be several when tokens were forced)."""

    request_id: str
    token_ids: list[int]
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    note: str | None = None  # LoopGuard intervention explained for the client
    stop_string: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens reused from the prefix cache (not computed)
    num_output_tokens: int = 0
    error: str | None = None  # set when the request was refused after submission (e.g. the pool is too small)
    error_type: str | None = None  # the refusing error's class name (ContextOverflowError, ...)
    # the prompt's tokens 1.. (logprob, alternatives), on the request's first event with tokens where its params ask
    # for them (`SamplingParams.prompt_logprobs`)
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


@dataclass(eq=False)
class Sequence:
    request: Request
    seed: int
    arrival: float
    tokens: list[int] = field(default_factory=list)
    num_prompt: int = 0
    num_computed: int = 0  # tokens whose KV/state are in the pool
    pages: list[int] = field(default_factory=list)
    page_hashes: list[bytes] = field(default_factory=list)  # hashes of the full pages registered so far
    state_slot: int | None = None
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: FinishReason | None = None
    num_cached_prompt: int = 0  # prompt tokens reused from the prefix cache at admission
    num_computed_prompt: int = 0  # prompt tokens actually run through the model (ever, incl. after resume)
    output_counts: dict[int, int] = field(default_factory=dict)
    num_output: int = 0
    first_token_time: float | None = None
    last_active: float = 0.0
    detok: Any = None
    loopguard: Any = None
    extra_penalty: float = 1.0
    banned: tuple[int, ...] = ()
    pending_text: str = ""
    pending_tokens: list[int] = field(default_factory=list)
    pending_logprobs: list[float] = field(default_factory=list)
    pending_top: list[list[tuple[int, float]]] = field(default_factory=list)
    pending_note: str | None = None
    in_thinking: bool = False
    json: Any = None  # JSON mode's automaton (`json_mode.JsonState`), where the request asks for it
    after_think: bool = False  # the reasoning just closed: the answer's leading whitespace is the template's
    # prompt logprobs (`SamplingParams.prompt_logprobs`): position p's (logprob, alternatives) at p - 1, for p in
    # 1 .. num_prompt - 1, as the prompt's chunks compute them; handed out once, on the first event with tokens
    prompt_lps: list[tuple[float, list[tuple[int, float]]] | None] | None = None
    prompt_lps_sent: bool = False
    drafts: tuple[int, ...] = ()  # speculation: the tokens guessed after the last one (engine._draft, _draft_ngram)
    guess: int | None = None  # ... a first guess too doubtful to draft alone (a verification graph's spare row)
    ngram: Any = None  # SPECULATOR ngram: its tokens' n-gram index (engine/ngram.py NgramIndex), built at first use
    paused_bundle: Any = None
    state_ahead: bool = False  # a failed step ran its forward past num_computed (its tail is not cached)
    num_pauses: int = 0
    num_resumes: int = 0
    num_admissions: int = 0  # > 1 only when a lost bundle forced a recompute
    _seen: Any = field(default=None, repr=False)  # seen_ids' sorted unique ids and the tokens they cover
    _seen_n: int = field(default=0, repr=False)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_uncomputed(self) -> int:
        return len(self.tokens) - self.num_computed

    @property
    def in_prefill(self) -> bool:
        """More than the last token awaits computation (prompt, or tokens forced by the LoopGuard)."""
        return self.num_uncomputed > 1 or self.num_output == 0

    def output_ids(self) -> list[int]:
        return self.tokens[self.num_prompt:]

    def seen_ids(self) -> np.ndarray:
        """Sorted unique ids of every token so far (prompt, output and forced tokens: the repetition penalty's
        set), int64. Tokens only ever append, so it is kept up to date from the new ones: a step's cost is the
        set's size, not the context's (np.unique over a 131k-token context took ~60 ms)."""
        n = len(self.tokens)
        if self._seen is None:
            self._seen = np.unique(np.asarray(self.tokens, np.int64))
        elif self._seen_n < n:
            self._seen = union_sorted(self._seen, np.unique(np.asarray(self.tokens[self._seen_n:], np.int64)))
        self._seen_n = n
        return self._seen

    def prompt_array(self) -> np.ndarray:
        return np.asarray(self.tokens[:self.num_prompt], dtype=np.int64)
