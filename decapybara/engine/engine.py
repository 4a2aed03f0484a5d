"""The in-process engine: continuous batching over up to `max_slots` sequences on one model.

`Engine.step()` is schedule -> run -> postprocess. Requests wait in a queue; an admission policy fills free
slots (FCFS by default; the multi-agent policy of `decapybara.scheduler` plugs in through `admission`).
Running sequences hold KV pages (and, for hybrid models, a DeltaNet state slot); when the pool runs dry the
youngest running sequence (or the policy's `choose_victim`) is paused whole (pages + state to host memory)
and later resumed with no re-prefill. No Ray here: plain objects, a clock that tests can fake.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from decapybara.config import EngineConfig
from decapybara.engine.block_manager import BlockManager, page_hash, root_hash
from decapybara.engine.loopguard import ActionKind, LoopGuard, LoopGuardConfig
from decapybara.engine.memory import MemoryMixin
from decapybara.engine.ngram import NgramIndex
from decapybara.engine.planner import StepPlan, plan_step
from decapybara.engine.runner import ModelRunner
from decapybara.engine.sampling import SamplerRow, SamplingParams, sample
from decapybara.engine.sequence import FinishReason, Request, SeqStatus, Sequence, TokenEvent
from decapybara.engine.spec_governor import SpecGovernor
from decapybara.errors import ContextOverflowError, InvalidRequestError
from decapybara.kv.stores import HostBundleStore
from decapybara.model.qwen import QwenModel

log = logging.getLogger(__name__)
SCHEMAS_KEPT = 16  # JSON Schemas (and tool sets) whose token masks an engine keeps (`Engine._json_state`)
CALL_MASKS_KEPT = 4096  # tool calls' masks an engine keeps, every tool set's together (`tool_calls.ToolSetVocab`)


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    prompt_tokens: int = 0  # prompt tokens of admitted requests
    computed_prompt_tokens: int = 0  # ... run through the model
    reused_prompt_tokens: int = 0  # ... taken from the prefix cache
    generated_tokens: int = 0
    forward_tokens: int = 0  # all rows run through the model
    pauses: int = 0
    resumes: int = 0
    finished: int = 0
    aborted: int = 0
    loopguard: dict[str, int] = field(default_factory=dict)
    step_seconds: float = 0.0
    offloaded_pages: int = 0  # prefix pages evicted from the pool into the page store
    restored_pages: int = 0  # ... brought back on a later hit instead of being recomputed
    lost_pages: int = 0  # ... found missing or damaged, or without the snapshot they left with (recomputed instead)
    restored_snapshots: int = 0  # state snapshots of in-pool pages brought back from a tier's copy of the page
    lost_bundles: int = 0  # paused conversations whose bundle was lost (recomputed from their tokens)
    drafted_tokens: int = 0  # speculation: drafts verified as more rows of a decode
    accepted_tokens: int = 0  # ... that the sampled token matched (a token gained without a step of its own)
    withheld_steps: int = 0  # ... steps whose drafts spec_adaptive withheld (verifying measured slower there)
    demoted_pages: int = 0  # cached pages of expired conversations made the next evicted (`demote_cached`)
    saved_pages: int = 0  # pool pages copied to the page store for the next engine (`save_cached_pages`)


@dataclass(frozen=True, slots=True)
class _HeadPass:
    """The MTP head's pass at the end of a step, as the next step's measure takes it: its seconds, the sequences
    it drafted for, the graphs captured (or tried) before it. It holds the sequences themselves, so that while it
    lives no other sequence can take the id of one of them (an aborted agent's, freed, and a new agent's at its
    address: the new agent's first step then took the old one's pass)."""
    seconds: float
    seqs: tuple[Sequence, ...]
    captures: int

    @property
    def ids(self) -> frozenset[int]:
        return frozenset(map(id, self.seqs))


class Engine(MemoryMixin):
    def __init__(self, model: QwenModel, cfg: EngineConfig | None = None, tokenizer: Any = None,
                 clock: Callable[[], float] = time.monotonic, eos_token_ids: Iterable[int] | None = None,
                 admission: Callable[[Engine], None] | None = None,
                 logits_processor: Callable[[Sequence, np.ndarray], np.ndarray] | None = None):
        self.model, self.cfg, self.tokenizer, self.clock = model, cfg or EngineConfig(), tokenizer, clock
        cfg = self.cfg
        self.max_model_len = cfg.max_model_len or model.cfg.max_position_embeddings
        if eos_token_ids is None:
            eos_token_ids = tokenizer.eos_token_ids if tokenizer is not None else model.cfg.eos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        # the MTP head guesses the ids below cfg.draft_vocab, and these: the ends of a reply and its markup
        markup = () if tokenizer is None else (tokenizer.special_ids.think, tokenizer.special_ids.end_think,
                                               tokenizer.special_ids.tool_call, tokenizer.special_ids.end_tool_call)
        self.runner = ModelRunner(model, cfg, self.max_model_len,
                                  draft_ids=tuple(i for i in (*self.eos_token_ids, *markup) if i is not None))
        self.hybrid = self.runner.hybrid
        # the prefix hashes' namespace: the model's whole config (architecture, YaRN), its weights (a file's
        # checksums: two weight presets of one architecture compute different KV), the KV mode, the page size, the
        # backend and its precision (another rounding of the same KV: a restart on another device must not restore
        # it), and whether the MTP head's KV is written (its pages otherwise hold none)
        backend = model.backend
        salt = (f"{model.cfg!r}|{getattr(model, 'weights_id', '')}|{cfg.kv_mode}|{cfg.page_size}|{backend.name}:"
                f"{getattr(backend, 'dtype', '')}|mtp={cfg.speculator == 'mtp' and cfg.draft_len > 0}").encode()
        state_bytes = model.cfg.state_bytes_per_sequence() if self.hybrid else 0
        budget = cfg.snapshot_budget(state_bytes)
        # hybrid-state snapshots are taken only where the budget can keep one (a copy it would drop at once
        # costs a step its device-to-host transfer for nothing)
        self.snapshots = self.hybrid and cfg.enable_prefix_cache and state_bytes <= budget
        if self.snapshots and hasattr(self.runner.states, "reserve_host_copies"):  # a device pool: pin them now
            self.runner.states.reserve_host_copies(min(budget // max(state_bytes, 1), 2 * cfg.max_slots) + 2)
        # the block manager owns the usable pages only (with CUDA graphs the pool's last page is padding's)
        self.blocks = BlockManager(self.runner.plan.usable_pages, cfg.page_size, cfg.enable_prefix_cache,
                                   self.hybrid, budget, salt)
        # the served context: no longer than one sequence holding the whole pool (the API clamps max_tokens to it,
        # and /v1/models reports it), so a pool smaller than the model's context shortens conversations instead of
        # refusing every request that leaves max_tokens to its default. With the prefix cache, one page less: an
        # admission holds a cached partial last page (`match.tail_page`) beside the pages it takes while it copies
        # it, so a sequence of every page would never be admitted.
        pool_tokens = pool_context(self.blocks.num_pages, cfg)
        if pool_tokens < self.max_model_len:
            log.warning("the KV pool holds %d tokens for one conversation (%d pages of %d), fewer than the context "
                        "of %d: serving a context of %d", pool_tokens, self.blocks.num_pages, cfg.page_size,
                        self.max_model_len, pool_tokens)
            self.max_model_len = pool_tokens
        self.free_slots = list(range(cfg.max_slots - 1, -1, -1))
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.paused: list[Sequence] = []
        self.seqs: dict[str, Sequence] = {}
        self.stats = EngineStats()
        self.admission = admission or fcfs_admission
        self.bundle_store: Any = HostBundleStore()  # where paused bundles go (the KV tiers in the GPU actor)
        self.page_store: Any = None  # where evicted prefix pages go (None: they are dropped)
        # (engine, needing) -> running sequence to pause when the pool runs dry; None: the admission policy's
        # `choose_victim` when it has one, else the youngest.
        self.choose_victim: Callable[[Engine, Sequence], Sequence] | None = None
        self.logits_processor = logits_processor  # (sequence, logits [V]) -> logits, before sampling
        self._rng = random.Random(cfg.seed)
        self._loop_cfg = LoopGuardConfig(mode=cfg.loop_guard).validate()
        special = getattr(tokenizer, "special_ids", None)
        self._think = (getattr(special, "think", None), getattr(special, "end_think", None))
        self._im_start = getattr(special, "im_start", None)
        self._think_close = tokenizer.encode("</think>\n\n") if tokenizer is not None and self._think[1] else []
        # speculation: the MTP head (or prompt lookup) drafts each decoding sequence's next tokens, verified as more rows
        self.speculate = ((cfg.speculator == "mtp" and model.has_mtp) or cfg.speculator == "ngram") and cfg.draft_len > 0
        if cfg.speculator == "mtp" and not model.has_mtp:
            log.warning("speculator=mtp: the model has no MTP layers, so nothing is drafted "
                        "(speculator=ngram drafts by prompt lookup for any model)")
        self.mtp = self.speculate and cfg.speculator == "mtp"  # drafts from the MTP head (else prompt lookup)
        graphs = self.runner.graphs
        # ... with decode graphs, a step of decodes alone verifies as many drafts a sequence as a verification graph
        # of its width takes (`ModelRunner.graph_drafts`: a hybrid model's rollback checkpoints bound them; a step
        # of more would run eagerly, at the 27B shape on an H100 4-8x a decode step; docs/perf.md, seventy-second
        # session); a step beside a prompt's chunk, eager anyway and bound by its launches, every draft
        # (`_draft_cap`)
        self.graph_drafts = self.runner.graph_drafts if graphs is not None else None
        # ... with verification graphs, the decodes of a step that verifies a draft verify their guesses too
        self.fill_rows = max(graphs.buckets) if self.speculate and cfg.spec_fill and graphs is not None else 0
        # ... verified only at the step widths where that is measured faster (engine/spec_governor.py)
        self.governor = SpecGovernor() if self.speculate and cfg.spec_adaptive else None
        self.timer: Callable[[], float] = time.perf_counter  # a step's wall time (the governor's measure)
        # the governor's choice for the next step (its width, verify), made as the head drafts; this step's
        # measure until the governor has it; the head pass's seconds that go to the next step's measure
        self._next_verify: tuple[int, bool] | None = None
        self._pending: tuple | None = None
        self._head: _HeadPass | None = None
        self._json_vocab: Any = None  # the automata's vocabulary tables (`_json_vocabulary`)
        self._call_masks: Any = None  # every tool set's call masks (`_constraint_masks`)
        self._schema_masks: OrderedDict[str, Any] = OrderedDict()  # a schema's text -> its token masks

    # ---- requests -----------------------------------------------------------------------------------
    def add_request(self, request: Request) -> Sequence:
        """Validate and queue. Raises InvalidRequestError / ContextOverflowError before any work."""
        params = request.params
        params.validate(self.model.cfg.vocab_size)
        n = len(request.prompt_ids)
        if n == 0:
            raise InvalidRequestError("the prompt is empty")
        if request.request_id in self.seqs:
            raise InvalidRequestError(f"duplicate request id {request.request_id!r}")
        ids = np.asarray(request.prompt_ids)
        if ids.min() < 0 or ids.max() >= self.model.cfg.vocab_size:
            raise InvalidRequestError("prompt token ids must lie in [0, vocab_size)")
        if n >= self.max_model_len + params.scores_prompt:  # (a prompt scored alone may fill the context)
            raise ContextOverflowError(f"prompt of {n} tokens does not fit the served context of {self.max_model_len}")
        now = self.clock()
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        seq = Sequence(request, seed, request.arrival if request.arrival is not None else now,
                       tokens=list(request.prompt_ids), num_prompt=n, last_active=now)
        if self.tokenizer is not None:
            from decapybara.tokenizer import IncrementalDetokenizer

            seq.detok = IncrementalDetokenizer(self.tokenizer, stop=params.stop)
            seq.in_thinking = self._prompt_opens_thinking(request.prompt_ids)
        seq.json = self._json_state(params, request.prompt_ids)
        seq.loopguard = self.loop_guard_for(params)
        self.seqs[request.request_id] = seq
        self.waiting.append(seq)
        return seq

    def loop_guard_for(self, params: SamplingParams, state: Any = None) -> LoopGuard | None:
        """A request's LoopGuard: under its own mode where it names one (`params.loop_guard`), else the server's;
        None where that is off. `state`: a paused guard's, resumed."""
        mode = params.loop_guard or self.cfg.loop_guard
        if mode == "off":
            return None
        cfg = self._loop_cfg if mode == self._loop_cfg.mode else dataclasses.replace(self._loop_cfg, mode=mode)
        return LoopGuard(cfg, state)

    def _json_state(self, params: SamplingParams, prompt: Any) -> Any:
        """The automaton of JSON mode, of a JSON Schema, or of a reply's tool calls (forced, or those a reply under
        tool_choice auto opens: `lazy_tool_calls`; `tool_calls.ToolCallReply`) for a request that asks for one
        (None otherwise, and for tool calls where the tokenizer has no tool-call tag tokens: they are then only
        asked for); the vocabulary's tables are built at the first such request and shared, the masks of a schema
        (or tool set) kept for the `SCHEMAS_KEPT` last asked. Where the prompt's last chat turn holds no reasoning
        markup (a model that may open its reasoning itself), `<think>` is allowed as the answer's first token (not
        after a raw completion prompt, whose text is the answer)."""
        if not params.json_object and params.json_schema is None and params.tool_calls is None:
            return None
        param = "json_object" if params.json_object else "json_schema" if params.tool_calls is None else "tool_calls"
        if self.tokenizer is None:
            raise InvalidRequestError("constrained replies (JSON, schemas, tool calls) need the engine's tokenizer",
                                      param)
        ids = self.tokenizer.special_ids
        tags = (ids.tool_call, ids.end_tool_call)
        if params.tool_calls is not None and any(t is None or t >= self.model.cfg.vocab_size for t in tags):
            # no tag token to write a call with: the calls are asked for, not constrained (an answer schema still is)
            answer = json.loads(params.tool_calls).get("answer")
            if answer is None:
                return None
            from decapybara.engine.json_schema import schema_text

            params = dataclasses.replace(params, tool_calls=None, lazy_tool_calls=False, json_schema=schema_text(answer))
            param = "json_schema"
        from decapybara.engine.json_mode import JsonState

        masks = None if params.json_object else self._constraint_masks(params, param)
        think = None
        start = getattr(ids, "im_start", None)
        for t in reversed(prompt):  # the last turn: a think block there (opened, or an empty one) settles it
            if t in self._think:
                break
            if t == start:  # a chat turn without one (a raw completion prompt has no turn: no reasoning)
                think = self._think[0]
                break
        if masks is None:
            return JsonState(self._json_vocabulary(), think)
        from decapybara.engine.json_schema import SchemaState
        from decapybara.engine.tool_calls import ToolCallReply, ToolSetVocab

        if isinstance(masks, ToolSetVocab):
            return ToolCallReply(masks, ids.tool_call, params.lazy_tool_calls, think)
        return SchemaState(masks, think)

    def _json_vocabulary(self) -> Any:
        """The vocabulary's tables for the automata (the tool-call tags read as the bytes the tool-call automata
        read for them, allowed only in a tool-call reply's masks), built once."""
        from decapybara.engine.json_mode import JsonVocab
        from decapybara.engine.json_schema import CLOSE_TAG, OPEN_TAG

        if self._json_vocab is None:
            ids = self.tokenizer.special_ids
            tags = {t: b for t, b in ((ids.tool_call, OPEN_TAG), (ids.end_tool_call, CLOSE_TAG)) if t is not None}
            self._json_vocab = JsonVocab(self.tokenizer, self.model.cfg.vocab_size, markup=tags)
        return self._json_vocab

    def _constraint_masks(self, params: SamplingParams, param: str) -> Any:
        """The token masks of a request's schema (`json_schema.SchemaVocab`) or tool set (`tool_calls.ToolSetVocab`,
        with any answer schema), kept by its text."""
        from decapybara.engine.json_mode import MaskCache
        from decapybara.engine.json_schema import SchemaError, SchemaVocab, compile_schema
        from decapybara.engine.tool_calls import ToolSetVocab

        key = params.json_schema if params.tool_calls is None else "tools:" + params.tool_calls
        masks = self._schema_masks.get(key)
        if masks is None:
            try:
                if params.tool_calls is None:
                    masks = SchemaVocab(self._json_vocabulary(), compile_schema(params.json_schema))
                else:  # a group of tools' masks in one cache of the engine's, whatever set offers the group
                    if self._call_masks is None:
                        self._call_masks = MaskCache(self.model.cfg.vocab_size, CALL_MASKS_KEPT)
                    masks = ToolSetVocab(self._json_vocabulary(), params.tool_calls, self._call_masks)
            except (SchemaError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise InvalidRequestError(f"{param}: {e}", param) from None
            self._schema_masks[key] = masks
            if len(self._schema_masks) > SCHEMAS_KEPT:
                self._schema_masks.popitem(last=False)
        self._schema_masks.move_to_end(key)
        return masks

    def _json_active(self, s: Sequence) -> bool:
        """Whether JSON mode constrains `s`'s next token (its answer; not its reasoning, nor a reply that left the
        automaton through a token the engine forced, nor the free text of a reply that has opened no tool call)."""
        return s.json is not None and not s.in_thinking and not s.json.dead and not s.json.free

    def abort(self, request_id: str) -> TokenEvent | None:
        """Cancel a request wherever it is; its pages and slot are freed at once."""
        seq = self.seqs.get(request_id)
        if seq is None or seq.status == SeqStatus.FINISHED:
            return None
        self.stats.aborted += 1
        return self._finish(seq, FinishReason.ABORT)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.paused)

    # ---- admission, pause, resume ---------------------------------------------------------------------
    def can_admit(self) -> bool:
        return bool(self.free_slots) and len(self.running) < self.cfg.max_slots

    def step(self) -> list[TokenEvent]:
        """Admit, plan, run one forward, sample and post-process. Returns this step's token events."""
        t0 = self.timer()
        self.admission(self)
        allowed = self._govern()
        plan = self._plan_with_pages()
        head, self._head = self._head, None
        if not plan.chunks:
            return []
        if self.governor is not None:
            if not allowed and any(c.sample and c.num_tokens == 1 for c in plan.chunks):
                self.stats.withheld_steps += 1
            # the governor's clock from here: a resume's imports and a pause's exports are not the step's decode
            self._pending = (plan, allowed, self.runner.captures(), self.stats.generated_tokens, self.timer(), head)
        try:
            out = self.runner.run(plan, normed=self.mtp)
            events = self._postprocess(plan, out)
        except Exception:
            for c in plan.chunks:  # their KV / hybrid state may have run past num_computed: no tail offered
                c.seq.state_ahead = True
            raise
        self._measure()  # where the head's pass did not already (`_draft`)
        self.stats.steps += 1
        self.stats.forward_tokens += plan.num_tokens
        self.stats.step_seconds += self.timer() - t0
        return events

    def _govern(self) -> bool:
        """Before planning: whether this step's drafts are verified (always, without spec_adaptive). The choice
        `_draft` made for this step where it stands (the same number of decoding sequences; a withheld choice
        stands whatever: the head then drafted nothing), else the governor's now. Drafts withheld are dropped
        from the sequences (the next step's are made afresh)."""
        if self.governor is None:
            return True
        decoding = sum(s.num_uncomputed == 1 for s in self.running)
        made, self._next_verify = self._next_verify, None
        if made is not None and (made[0] == decoding or not made[1]):
            allowed = made[1]
        else:
            allowed = self.governor.allow(decoding)
        if not allowed:
            for s in self.running:
                s.drafts, s.guess = (), None
        return allowed

    def _measure(self) -> None:
        """Hand the governor this step's measure, once (`_pending`, set by `step`): a pure decode step (every
        sequence running decodes one token, plus a draft where one is verified) that captured no graph, its
        tokens emitted and its wall time from after planning to now. With the MTP head, also the head's pass of
        the step before (`_head`: the pass that drafted for this one, or kept the head's cache for it), and only
        where that pass was over a decode's pairs (one to eight a sequence) of the same sequences and captured no
        graph either (after a prompt's chunk its pass covers the prompt: that step is not measured)."""
        if self._pending is None:
            return
        plan, allowed, captures, emitted, start, head = self._pending
        self._pending = None
        seconds = self.timer() - start
        if self.mtp:
            if head is None or head.ids != frozenset(id(c.seq) for c in plan.chunks):
                return
            seconds, captures = seconds + head.seconds, min(captures, head.captures)
        width = len(plan.chunks)
        if (width == len(self.running) and self.runner.captures() == captures
                and all(c.sample and c.num_tokens - len(c.drafts) == 1 for c in plan.chunks)):
            self.governor.record(width, allowed, self.stats.generated_tokens - emitted, seconds)

    def _give_pages(self, s: Sequence, tokens: int) -> bool:
        """Pages for `s`'s first `tokens` tokens (those it lacks, from the pool); False where the pool ran dry."""
        for _ in range(self.blocks.pages_for(tokens) - len(s.pages)):
            page = self.blocks.append()
            if page is None:
                return False
            s.pages.append(page)
        return True

    def _plan_with_pages(self) -> StepPlan:
        """Plan, then give every chunk the pages it writes: first the real tokens' of every chunk, then the drafts'
        rows (a draft, or a doubtful guess, never takes a page a real token needs); where a sequence's drafts lack
        a page, its last draft is dropped and the step planned again; while a real token's page is lacking, pause a
        victim (`choose_victim`)."""
        while True:
            plan = plan_step(self.running, self.cfg, self.snapshots, self.fill_rows, self.graph_drafts)
            short = next((c.seq for c in plan.chunks
                          if not self._give_pages(c.seq, c.seq.num_computed + c.num_tokens - len(c.drafts))), None)
            if short is None:
                lacking = next((c for c in plan.chunks if c.drafts
                                and not self._give_pages(c.seq, c.seq.num_computed + c.num_tokens)), None)
                if lacking is None:
                    return plan
                s = lacking.seq  # plan again with fewer: no pause for a draft
                s.drafts, s.guess = (lacking.drafts[:-1], s.guess) if len(lacking.drafts) > 1 else ((), None)
                for c in plan.chunks:  # the pages the drafts' rows took go back: the next plan may differ
                    keep = self.blocks.pages_for(c.seq.num_computed + c.num_tokens - len(c.drafts))
                    if c.drafts and len(c.seq.pages) > keep:
                        self.blocks.release(c.seq.pages[keep:])
                        del c.seq.pages[keep:]
                continue
            choose = self.choose_victim or getattr(self.admission, "choose_victim", youngest_victim)
            victim = choose(self, short)
            self.pause(victim)
            if not self.running:
                return StepPlan([])

    def _postprocess(self, plan: StepPlan, out: Any) -> list[TokenEvent]:
        """Sample, account and emit. A chunk with drafts samples its real token's row as any decode does; its first
        draft is accepted where that token is the draft, and then the draft's own row samples the next token (after
        the first is appended, so the penalties and the LoopGuard see it as they would a step later; where that
        row cannot depend on the tokens before it (`_ahead`), it is sampled in the first call and kept only if the
        sequence's row then is the one predicted, `_same_row`), which accepts the second draft where it is that
        draft, and so on: the tokens and draws of decoding without speculation. The state after a rejected draft's
        row goes back to the snapshot before it (its KV slots are rewritten later). With speculation the head
        then drafts each decoding sequence's next tokens (`_draft`, `_draft_ngram`)."""
        now = self.clock()
        for ci, r0, p0, n in out.prompt_rows:  # prompt logprobs: row p predicts the prompt's token p + 1
            s = plan.chunks[ci].seq
            lp, tops = self.model.backend.token_logprobs(out.logits, np.arange(r0, r0 + n),
                                                         np.asarray(s.tokens[p0 + 1:p0 + 1 + n]),
                                                         s.params.prompt_logprobs)
            if s.prompt_lps is None:
                s.prompt_lps = [None] * s.num_prompt
            s.prompt_lps[p0 + 1:p0 + 1 + n] = [(float(v), t) for v, t in zip(lp, tops)]
        sampling = [c for c in plan.chunks if c.sample]
        first, r = [], 0  # each sampling chunk's first logits row (a chunk with k drafts has 1 + k)
        for c in sampling:
            first.append(r)
            r += 1 + len(c.drafts)
        rows = [self._sampler_row(c.seq) for c in sampling]
        # the drafts' own rows sampled in the first call where their sampler rows are known before the tokens
        # ahead of them are appended (`_ahead`): each kept below only if the sequence's row then is the one predicted
        ahead = {(j, d): dataclasses.replace(rows[j], position=rows[j].position + d)
                 for j, c in enumerate(sampling) if c.drafts and self._ahead(c.seq) for d in range(1, len(c.drafts) + 1)}
        seqs = [c.seq for c in sampling]
        try:  # rows j < len(sampling): the real tokens'; then the ahead rows in `ahead`'s order
            sampled = self._sample(out.logits, first + [first[j] + d for j, d in ahead],
                                   seqs + [seqs[j] for j, _ in ahead], rows + list(ahead.values())) if sampling else None
        except ValueError:  # a draft's row the sampler refuses (no finite logit): the real tokens' rows alone, as
            if not ahead:   # before, so that a draft never sampled after a rejection cannot fail the step
                raise
            ahead = {}
            sampled = self._sample(out.logits, first, seqs, rows)
        pick = {(j, 0): (sampled, j) for j in range(len(sampling))}  # (j, depth) -> (a sampler call's output, its row)
        pick.update({key: (sampled, len(sampling) + k) for k, key in enumerate(ahead)})
        before = []
        for c in plan.chunks:
            s = c.seq
            before.append(s.num_computed)
            n = 1 if c.drafts else c.num_tokens  # a draft's row counts once its token is sampled and is the draft
            if s.num_computed < s.num_prompt:
                done = min(n, s.num_prompt - s.num_computed)
                s.num_computed_prompt += done
                self.stats.computed_prompt_tokens += done
            s.num_computed += n
            s.last_active = now
            self.stats.drafted_tokens += len(c.drafts)
        live = list(range(len(sampling)))  # the chunks whose token at this depth is sampled
        for d in range(1 + max((len(c.drafts) for c in sampling), default=0)):
            if d:  # the rows after accepted drafts: the token after them, sampled ahead or now
                after = {j: self._sampler_row(seqs[j]) for j in live}
                late = [j for j in live if (j, d) not in ahead or not _same_row(after[j], ahead[(j, d)])]
                if late:
                    extra = self._sample(out.logits, [first[j] + d for j in late], [seqs[j] for j in late],
                                         [after[j] for j in late])
                    pick.update({(j, d): (extra, k) for k, j in enumerate(late)})
            nxt = []
            for j in live:
                c, (res, k) = sampling[j], pick[(j, d)]
                tok = int(res.token_ids[k])
                kept = d < len(c.drafts) and tok == c.drafts[d]
                if kept:  # the draft's row computed this token: it counts
                    c.seq.num_computed += 1
                    self.stats.accepted_tokens += 1
                self._append_output(c.seq, tok, float(res.logprobs[k]), res.top_logprobs[k], now)
                # on unless the token ended the sequence or the LoopGuard forced tokens after it
                if kept and c.seq.finish_reason is None and c.seq.num_uncomputed == 0:
                    nxt.append(j)
            live = nxt
        for ci, c in enumerate(plan.chunks):  # the pages that became full: the tokens they hold are all appended
            s = c.seq
            if c.drafts and self.hybrid:
                back = s.num_computed  # the state after the tokens kept: a snapshot unless every draft was kept
                device = {q: out.snapshots.pop((ci, q)) for q in c.rollback}  # never prefix-cache snapshots
                if back < before[ci] + c.num_tokens:
                    self.runner.reset_state(s.state_slot, device[back] if back in device else out.snapshots[(ci, back)])
            self._register_pages(s, ci, out.snapshots)
        if self.mtp:
            self._draft(plan, out, before)
        elif self.speculate:
            self._draft_ngram(plan)
        events: list[TokenEvent] = []
        for c in sampling:
            ev = self._event_if_due(c.seq)
            if ev is not None:
                events.append(ev)
        return events

    def _ahead(self, s: Sequence) -> bool:
        """Whether `s`'s draft row may be sampled beside its real token's row: its sampler row after the real token
        is appended is then known (the next position, no penalty that reads token ids, the LoopGuard's penalty and
        bans as they are; `_postprocess` checks that they stayed so), no host hook sees the sequence, and no
        constraint masks it (a JSON answer's, a schema's, an open tool call's masks after the draft are its state's
        after it: sampled once the draft is read)."""
        return (self.logits_processor is None and not any(_penalties_read_ids(s))
                and (s.json is None or s.json.free))

    def _sample(self, logits: Any, idx: list[int], seqs: list[Sequence], rows: list[SamplerRow]) -> Any:
        """Sample the step's logits rows `idx` for `seqs` by their sampler rows (through the host hook
        `logits_processor` when set; else where the logits are: on a GPU only tokens and logprobs cross)."""
        if self.logits_processor is not None:  # the rows asked for alone cross to the host
            host = self.model.backend.to_host(logits[self.model.backend.from_host(np.asarray(idx, np.int64))])
            host = host.astype(np.float32, copy=False)
            lg = np.stack([self.logits_processor(s, host[k]) for k, s in enumerate(seqs)])
            return sample(self._json_masked(lg, seqs, np), rows, eos_token_ids=self.eos_token_ids)
        if idx != list(range(int(logits.shape[0]))):
            logits = logits[self.model.backend.from_host(np.asarray(idx, np.int64))]
        return self.model.backend.sample(self._json_masked(logits, seqs), rows, self.eos_token_ids)

    def _json_masked(self, logits: Any, seqs: list[Sequence], xp: Any = None) -> Any:
        """`logits` [len(seqs), V] with the banned tokens of constrained rows at -inf (where the logits are: the
        allowed masks cross as bool rows): an answer's tokens its automaton does not allow, and the end of sequence
        while a constrained reply is still reasoning. Before the sampler's own edits, so its bias, penalties and the
        LoopGuard's bans (which keep the row's logits where they would leave nothing) work within those tokens."""
        rows = [i for i, s in enumerate(seqs) if self._json_active(s)]
        # a constrained reply's reasoning may not end the reply: its answer is still to come
        reasoning = [i for i, s in enumerate(seqs) if s.json is not None and s.in_thinking and not s.json.dead
                     and not s.json.free and not s.params.ignore_eos]
        if not rows and not reasoning:
            return logits
        xp = xp or self.model.backend.xp
        mask = np.zeros(logits.shape, bool)
        v = min(logits.shape[1], self.model.cfg.vocab_size)
        for i in rows:
            mask[i, :v] = seqs[i].json.allowed()[:v]
        keep = np.ones(len(seqs), bool)
        keep[rows] = False
        mask[keep] = True
        eos = [t for t in self.eos_token_ids if t < logits.shape[1]]
        for i in reasoning:
            mask[i, eos] = False
        dev = mask if xp is np else self.model.backend.from_host(mask)
        return xp.where(dev, logits, xp.asarray(-np.inf, dtype=logits.dtype))

    def _wants_draft(self, c: Any, cap: int) -> bool:
        """Whether chunk `c`'s sequence may draft: its next step decodes one token and a second could still be
        taken (max_tokens, the context)."""
        s = c.seq
        return c.sample and s.finish_reason is None and s.num_uncomputed == 1 and self._draft_room(s, cap) > 0

    def _draft_room(self, s: Sequence, cap: int) -> int:
        """How many drafts `s`'s next step may verify: up to `cap` (`_draft_cap`'s, taken once a drafting pass),
        while every token they could gain would still be taken (max_tokens, the context)."""
        return max(0, min(cap, s.params.max_tokens - s.num_output - 1, self.max_model_len - s.num_tokens - 1))

    def _draft_cap(self) -> int:
        """Drafts a sequence makes for the next step: draft_len, but with decode graphs no more than a
        verification graph of the running sequences takes (`graph_drafts`), unless a prompt's chunk will run
        beside the decodes (a running sequence still prefilling), whose step runs eagerly and takes every draft
        (`plan_step`'s `graph_drafts`). A waiting request is not counted: it may wait many steps (for pages, or
        the scheduler), and drafts made for it would be cut, their head passes wasted."""
        live = [s for s in self.running if s.finish_reason is None]
        if self.graph_drafts is None or any(s.num_uncomputed > 1 for s in live):
            return self.cfg.draft_len
        return min(self.cfg.draft_len, self.graph_drafts(len(live)) or self.cfg.draft_len)

    @staticmethod
    def _opens_constraint(s: Sequence, token: int) -> bool:
        """Whether `token` would switch `s`'s constraint on (a free reply's `<tool_call>`): no draft is it, so that
        a free reply's drafts leave it free and its next tokens may be sampled ahead (`_ahead`)."""
        return s.json is not None and s.json.free and token == s.json.trigger

    def _draft_ngram(self, plan: StepPlan) -> None:
        """Prompt-lookup drafts (SPECULATOR ngram, engine/ngram.py): the tokens that followed the latest earlier
        occurrence of a sequence's last three tokens are its drafts (up to `_draft_room`, cut before any that would
        switch a constraint on); of its last two only, the first is a guess (verified in a verification graph's
        spare row, `spec_fill`)."""
        cap = self._draft_cap()
        for c in plan.chunks:
            s = c.seq
            s.drafts, s.guess = (), None
            if s.finish_reason is not None:
                continue
            if s.ngram is None:
                s.ngram = NgramIndex()
            if not self._wants_draft(c, cap):  # a prompt's chunk: its positions indexed as they are computed
                s.ngram.extend(s.tokens, s.num_computed)
                continue
            tokens, n = s.ngram.propose(s.tokens, self._draft_room(s, cap))
            cut = next((i for i, t in enumerate(tokens) if self._opens_constraint(s, t)), len(tokens))
            if cut and n >= s.ngram.max_n:
                s.drafts = tokens[:cut]
            elif cut:
                s.guess = tokens[0]

    def _draft(self, plan: StepPlan, out: Any, before: list[int]) -> None:
        """The MTP head over each running sequence's positions computed this step, paired with the tokens after
        them (so its KV follows the main model's), and, for a sequence whose next step decodes one token, the
        head's greedy guess of the token after that one: its next draft, where the head gives it at least
        `spec_min_confidence` (confidence scheduling: a guess it doubts is seldom accepted, and its row costs as
        much as any); with draft_len > 1, more drafts while the head stays that sure (`_chain`). Drafts never
        change what is sampled; they only let a step verify more tokens. Where the governor (`spec_adaptive`)
        will withhold the next step's drafts, the head only writes its keys and values (`ModelRunner.mtp_kv`):
        its attention, MLP and logits are what a draft costs beyond them. A sequence this step finished (its
        pages still held: it is released after) gets the head's keys and values too, no draft: its pages go to the
        prefix cache, whose later readers' heads attend over them."""
        entries, rows, draft_rows, wants, served = [], [], [], [], []
        n, cap = 0, self._draft_cap()
        for c, p0, b in zip(plan.chunks, before, out.batch.seqs):
            s = c.seq
            s.drafts, s.guess = (), None
            # (positions paired with the token after them: a sequence that ended on an accepted draft has none
            # after its last computed position)
            end = min(s.num_computed, len(s.tokens) - 1)
            if end <= p0:
                continue
            k = end - p0
            entries.append((s.tokens[p0 + 1:end + 1], p0, s.pages))
            served.append(s)
            rows.extend(range(b.start, b.start + k))
            n += k
            if self._wants_draft(c, cap):
                draft_rows.append(n - 1)
                wants.append(s)
        if not entries:
            return
        verify = True
        if self.governor is not None:  # this step measured first, then the next step's choice
            self._measure()
            width = sum(s.finish_reason is None and s.num_uncomputed == 1 for s in self.running)
            verify = self.governor.allow(width)
            self._next_verify = (width, verify)
            captures, t = self.runner.captures(), self.timer()
        chain = cap > 1
        if verify:
            guesses, confidence, own = self.runner.mtp(entries, np.asarray(rows, np.int64), draft_rows, out.normed,
                                                       chain=chain)
        else:  # no draft verified next step: the head's keys and values only
            self.runner.mtp_kv(entries, np.asarray(rows, np.int64), out.normed)
        if verify and wants:  # the head's greedy guess: a draft where its probability reaches spec_min_confidence
            sure = []
            for i, (s, g, p) in enumerate(zip(wants, guesses, confidence)):
                if self._opens_constraint(s, int(g)):
                    continue
                if p >= self.cfg.spec_min_confidence:
                    s.drafts = (int(g),)
                    sure.append(i)
                else:
                    s.guess = int(g)
            if chain and sure:
                self._chain([wants[i] for i in sure], own[self.model.backend.from_host(np.asarray(sure, np.int64))],
                            [float(confidence[i]) for i in sure], cap)
        if self.governor is not None:  # the next step's share of its measure: only a pure decode step's pass
            decode = all(c.sample and c.num_tokens - len(c.drafts) == 1 for c in plan.chunks)
            self._head = _HeadPass(self.timer() - t, tuple(served), captures) if decode else None

    def _chain(self, seqs: list[Sequence], own: Any, sure: list[float], cap: int) -> None:
        """More drafts after each of `seqs`' first: the head's pair of its own final-normed state where it guessed
        (`own` [len(seqs), H]) with that guess, one position on, guesses the token after it (as the head's chained
        passes in multi-token prediction), while the product of the head's probabilities along the chain (`sure`:
        the first guesses'), the chance that every draft up to the new one is accepted as far as the head knows,
        stays at least `spec_min_confidence` (each agent drafts as many tokens as are likely to be accepted), the
        sequence has room (`_draft_room`) and already holds a page for the row that would verify the new draft (and
        so for the pair's position, where the head writes keys and values that the next pass over computed
        positions writes again): a chain takes no page, which another sequence's real token may need."""
        ops = self.model.backend
        live = seqs  # own's rows in this order
        while live:
            go = [r for r, s in enumerate(live)
                  if len(s.drafts) < self._draft_room(s, cap)
                  and self.blocks.pages_for(s.num_computed + len(s.drafts) + 2) <= len(s.pages)]
            if not go:
                return
            entries = [(live[r].drafts[-1], live[r].num_computed + len(live[r].drafts) - 1, live[r].pages) for r in go]
            guesses, confidence, nxt = self.runner.mtp_chain(entries, own[ops.from_host(np.asarray(go, np.int64))])
            keep = []
            for k, (r, g, p) in enumerate(zip(go, guesses, confidence)):
                if sure[r] * p >= self.cfg.spec_min_confidence and not self._opens_constraint(live[r], int(g)):
                    live[r].drafts += (int(g),)
                    keep.append(k)
            live, sure = [live[go[k]] for k in keep], [sure[go[k]] * float(confidence[k]) for k in keep]
            if live:
                own = nxt[ops.from_host(np.asarray(keep, np.int64))]

    def _sampler_row(self, s: Sequence) -> SamplerRow:
        """The sampler's view of `s`: token ids only where a penalty reads them. The repetition penalty's set is
        the prompt's and the output's ids together: `seen_ids` (kept incrementally) stands for the prompt ids,
        the same union. Presence and frequency read the output. Copying a long context's token list every step
        cost ~0.8 ms a sequence at 131k tokens, and taking its unique ids ~60 ms."""
        rep, counts = _penalties_read_ids(s)
        out = s.output_ids() if rep or counts else ()
        return SamplerRow(s.params, s.seen_ids() if rep else (), out, s.num_output, s.seed, s.extra_penalty, s.banned)

    def _register_pages(self, s: Sequence, chunk_index: int, snapshots: dict) -> None:
        """Hash and register pages that became full; store hybrid snapshots taken at their ends."""
        ps = self.cfg.page_size
        full = s.num_computed // ps
        while len(s.page_hashes) < full:
            i = len(s.page_hashes)
            parent = s.page_hashes[-1] if s.page_hashes else root_hash(self.blocks.salt)
            h = page_hash(parent, s.tokens[i * ps:(i + 1) * ps])
            s.page_hashes.append(h)
            self.blocks.register(s.pages[i], h)
            snap = snapshots.get((chunk_index, (i + 1) * ps))
            if snap is not None:
                self.blocks.put_snapshot(h, snap, snap.nbytes)

    def _append_output(self, s: Sequence, tok: int, lp: float, top: list, now: float) -> None:
        p = s.params
        s.tokens.append(tok)
        s.num_output += 1
        s.output_counts[tok] = s.output_counts.get(tok, 0) + 1
        self.stats.generated_tokens += 1
        if s.first_token_time is None:
            s.first_token_time = now
        s.pending_tokens.append(tok)
        if p.logprobs is not None:
            s.pending_logprobs.append(lp)
            s.pending_top.append(top)
        is_eos = tok in self.eos_token_ids and not p.ignore_eos
        stops = (is_eos or tok in p.stop_token_ids) and s.num_output > p.min_tokens - 1
        # a token that ends the request as eos or a stop token id adds no text (its id is in the output): an end
        # marker the vocabulary holds as plain text (fill-in-the-middle's <|fim_pad|>) stays out of the answer
        text = "" if stops else self._detok_push(s, tok)
        s.pending_text += text
        if s.json is not None and s.json.done:  # JSON mode: the object closed, the answer is whole
            self._mark_finished(s, FinishReason.STOP)
            return
        if stops:
            self._mark_finished(s, FinishReason.STOP)
            return
        if s.detok is not None and s.detok.stopped:
            s.pending_note = None
            self._mark_finished(s, FinishReason.STOP)
            return
        if s.num_output >= p.max_tokens or s.num_tokens >= self.max_model_len:
            self._mark_finished(s, FinishReason.LENGTH)
            return
        if s.loopguard is not None:
            self._loop_guard(s, tok, text)

    def _detok_push(self, s: Sequence, tok: int) -> str:
        """Track <think> / </think> and push `tok` to the detokeniser: stop strings are looked for in the answer
        only, not in the reasoning, its markup, nor the whitespace that separates it from the answer."""
        if s.json is not None and not s.in_thinking and tok not in self._think:  # an answer token: JSON mode reads it
            s.json.advance(self.tokenizer.token_bytes(tok) if tok not in self.eos_token_ids else b"", tok)
        if tok == self._think[0]:
            s.in_thinking = True
            if s.json is not None:  # reasoning opens once: the answer's constraint no longer allows `<think>`
                s.json.think = None
        first = False  # the answer's first visible token: its leading whitespace is still the markup's
        if tok == self._think[1]:
            s.after_think = True
        elif s.after_think and self.tokenizer.token_bytes(tok).strip():
            s.after_think, first = False, True
        text = (s.detok.push(tok, not s.in_thinking and not s.after_think, lstrip=first)
                if s.detok is not None else "")
        if tok == self._think[1]:
            s.in_thinking = False
        return text

    def _loop_guard(self, s: Sequence, tok: int, text: str) -> None:
        action = s.loopguard.observe(tok, text, s.in_thinking)
        s.extra_penalty, s.banned = action.repetition_penalty, tuple(action.banned_token_ids)
        if action.kind == ActionKind.NONE:
            return
        kind, note = action.kind, action.note
        if kind == ActionKind.END_THINKING:
            forced = self._think_close or []
            # the forced tokens and one answer token after them must fit the served context and max_tokens
            room = min(self.max_model_len - s.num_tokens, s.params.max_tokens - s.num_output) - 1
            if not forced or len(forced) > room:  # no close: a stop, and said so
                kind, note = ActionKind.STOP, note.replace(
                    "thinking ended so the answer can start", "generation stopped (the thinking block's close "
                    "would not fit max_tokens or the served context) so the client can recover")
        self.stats.loopguard[kind.value] = self.stats.loopguard.get(kind.value, 0) + 1
        if kind == ActionKind.STOP:
            s.pending_note = note
            self._mark_finished(s, FinishReason.LOOP)
        elif kind == ActionKind.END_THINKING:
            s.pending_note = note
            closed = False
            for t in forced:  # forced tokens join the output; the next step computes them as a chunk
                s.tokens.append(t)
                s.num_output += 1
                s.pending_tokens.append(t)
                s.pending_text += s.detok.push(t, False) if s.detok is not None else ""
                if closed and s.json is not None:  # the answer's first bytes, as an adoption's replay reads them
                    s.json.advance(self.tokenizer.token_bytes(t), t)
                closed |= t == self._think[1]
            s.in_thinking, s.after_think = False, True  # as where the model closes its reasoning itself

    def _mark_finished(self, s: Sequence, reason: FinishReason) -> None:
        s.finish_reason = reason

    def _event_if_due(self, s: Sequence) -> TokenEvent | None:
        if s.finish_reason is not None:
            return self._finish(s, s.finish_reason)
        # a step that forced tokens (the LoopGuard's close, with its note) ends their event: forced tokens have no
        # logprobs and follow the sampled tokens of their event, never a later sampled one (`api.common.Collected`)
        if len(s.pending_tokens) < self.cfg.stream_interval and s.pending_note is None:
            return None
        return self._drain(s)

    def _drain(self, s: Sequence, reason: FinishReason | None = None) -> TokenEvent:
        ev = TokenEvent(s.request_id, s.pending_tokens, s.pending_text, s.pending_logprobs, s.pending_top, reason,
                        s.pending_note, s.detok.stop_string if s.detok is not None else None, s.num_prompt,
                        s.num_cached_prompt, s.num_output)
        if s.params.prompt_logprobs is not None and s.pending_tokens and not s.prompt_lps_sent:
            ev.prompt_logprobs, s.prompt_lps_sent = (s.prompt_lps or [None] * s.num_prompt)[1:], True
            s.prompt_lps = None
        s.pending_tokens, s.pending_text, s.pending_logprobs, s.pending_top, s.pending_note = [], "", [], [], None
        return ev

    def _finish(self, s: Sequence, reason: FinishReason) -> TokenEvent:
        if s.detok is not None and reason != FinishReason.ABORT:
            s.pending_text += s.detok.finish()
        if s.status == SeqStatus.RUNNING:
            self._offer_tail(s)
            self.blocks.release(s.pages)
            s.pages = []
            self._free_slot(s)
            self.running.remove(s)
        elif s.status == SeqStatus.WAITING:
            self.waiting.remove(s)
        elif s.status == SeqStatus.PAUSED:
            self.paused.remove(s)
            self.bundle_store.discard(s, s.paused_bundle)
            s.paused_bundle = None
        s.status, s.finish_reason = SeqStatus.FINISHED, reason
        self.stats.finished += 1
        ev = self._drain(s, reason)
        del self.seqs[s.request_id]
        return ev

    def _prompt_opens_thinking(self, prompt: tuple[int, ...]) -> bool:
        """Whether the prompt's last turn (from its last `<|im_start|>`) left a `<think>` open, as
        `chat.prompt_opens_reasoning` reads the prompt's text: a `<think>` in an earlier turn (a user's text about
        the tag) opens nothing."""
        think, end = self._think
        if think is None:
            return False
        for t in reversed(prompt):
            if t == end or t == self._im_start:
                return False
            if t == think:
                return True
        return False

    # ---- conveniences ---------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 max_steps: int = 1_000_000) -> list[list[int]]:
        """Run prompts to completion; returns each one's output token ids (scripts, tests, benchmarks)."""
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = [self.add_request(Request(tuple(p), sp)).request_id for p, sp in zip(prompts, plist)]
        outs: dict[str, list[int]] = {i: [] for i in ids}
        for _ in range(max_steps):
            if not self.has_work():
                break
            for ev in self.step():
                if ev.request_id in outs:
                    outs[ev.request_id].extend(ev.token_ids)
        return [outs[i] for i in ids]

    def snapshot_stats(self) -> dict[str, Any]:
        b = self.blocks
        return {
            "running": len(self.running), "waiting": len(self.waiting), "paused": len(self.paused),
            "free_pages": b.num_free, "used_pages": b.num_used, "cached_pages": len(b.lru),
            "total_pages": b.num_pages, "snapshots": len(b.snapshots), "snapshot_bytes": b.snapshot_bytes,
            **dataclasses.asdict(self.stats),
            "graphs": self.runner.graph_stats(), "graph_failures": self.runner.graph_failures(),
            **({"policy": self.admission.snapshot()} if hasattr(self.admission, "snapshot") else {}),
            **({"speculation": self.governor.summary()} if self.governor is not None else {}),
        }


def pool_context(usable_pages: int, cfg: EngineConfig) -> int:
    """The tokens one conversation can hold in a pool of `usable_pages` (the block manager's: without the CUDA
    graphs' pad page): with the prefix cache, one page less, which an admission holds for a cached partial tail
    while it copies it."""
    return max(1, usable_pages - (1 if cfg.enable_prefix_cache else 0)) * cfg.page_size


def _penalties_read_ids(s: Sequence) -> tuple[bool, bool]:
    """(the repetition penalty is on (the request's or the LoopGuard's): it reads the seen ids and the output,
    presence or frequency is on: they read the output's counts)."""
    p = s.params
    return max(p.repetition_penalty, s.extra_penalty) != 1.0, bool(p.presence_penalty or p.frequency_penalty)


def _same_row(a: SamplerRow, b: SamplerRow) -> bool:
    """Whether two sampler rows of one sequence (its params and seed), neither reading token ids for a penalty
    (`Engine._ahead`; a LoopGuard penalty that changed makes them differ here), draw alike: the same position,
    LoopGuard penalty and bans."""
    return (a.position == b.position and a.extra_repetition_penalty == b.extra_repetition_penalty
            and tuple(a.banned_token_ids) == tuple(b.banned_token_ids))


def youngest_victim(engine: Engine, needing: Sequence) -> Sequence:
    """Default victim when the pool runs dry: the youngest running sequence (latest arrival)."""
    return max(engine.running, key=lambda q: (q.arrival, q.request_id))


def fcfs_admission(engine: Engine) -> None:
    """Default policy: resume paused sequences first (oldest first), then admit waiting ones in order."""
    for seq in sorted(engine.paused, key=lambda s: s.arrival):
        if not engine.can_admit() or not engine.resume(seq):
            return
    for seq in list(engine.waiting):
        if not engine.can_admit() or not engine.admit(seq):
            return
