"""`AgePolicy`: the multi-agent admission and pause policy, plugged in as `Engine(admission=AgePolicy(...))`.

NOTE: the algorithm (the scores S and V and the wait bound are in `decapybara.scheduler.scoring`). At the
start of every engine step the policy
1. syncs its records with the engine: new requests, finished ones (their conversation's turn count, expected
   output length and last activity), pauses and admissions made without it;
2. forgets every conversation with nothing in flight for `idle_timeout_s` (it counts as finished) and asks the
   engine to make its cached pages the next evicted, except pages a live conversation or request also uses;
3. ranks the candidates (waiting and paused sequences) by S, best first;
4. fills free slots in rank order while the candidate fits the pool: the pages it needs now (its whole prompt,
   or its whole context for a resume, less cached pages already held by others) plus
   `reserve_pages_per_seq` free pages per running sequence, beside the pages the running sequences still need
   for the tokens they hold (a prompt is admitted with its first chunk's pages: its other pages are spoken
   for). The first that does not fit stops admission, so a large job keeps its place instead of being overtaken
   for ever by small ones;
5. preempts: while the best remaining candidate beats the lowest-V running job past its quantum by the
   margin, pause the fewest such jobs (lowest V first) that free a slot and the pages it needs, and start it.
When the pool runs dry inside a step the engine calls `choose_victim`: the lowest-V running sequence among
those that free at least one page is paused. A pause takes a sequence out whole and its resume recomputes
nothing. The policy holds no Ray and no device state; its clock is the engine's.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from decapybara.engine.block_manager import hash_chain
from decapybara.engine.memory import CachedTrail
from decapybara.engine.sequence import FinishReason, SeqStatus, Sequence
from decapybara.scheduler.scoring import PolicyConfig, candidate_score, victim_score, work_estimate

if TYPE_CHECKING:
    from decapybara.engine.engine import Engine


@dataclass(slots=True)
class _Track:
    """The policy's record of one live sequence."""

    seq: Sequence
    order: int  # first-seen order: ties between equal scores go to the earlier one
    entered: float  # when it last became a candidate: its arrival, or its last pause
    run_since: float | None = None  # when it last started running (admission or resume); None unless running
    chain: list[bytes] | None = None  # hashes of its prompt's full pages (prefix-cache peeks), computed once


@dataclass(slots=True)
class _Conversation:
    """What the policy keeps per conversation (agent key) until it has been idle for `idle_timeout_s`."""

    last_active: float
    in_flight: int = 0  # requests of this conversation the engine holds
    turns: int = 0  # requests finished (not aborted)
    expected_output: float | None = None  # EMA of its turns' output lengths
    pauses: int = 0
    resumes: int = 0
    last_seq: Sequence | None = None  # its latest finished request (whose cached pages stay protected)


@dataclass(slots=True)
class PolicyStats:
    steps: int = 0  # decisions taken (hook calls)
    admitted: int = 0
    resumed: int = 0
    preemptions: int = 0  # pauses decided by score
    memory_pauses: int = 0  # victims chosen for the engine when the pool ran dry
    expired_conversations: int = 0
    demoted_pages: int = 0  # cached pages of expired conversations made the next evicted
    decision_seconds: float = 0.0  # time spent deciding, in the hook and choose_victim (actions excluded)
    max_decision_seconds: float = 0.0  # ... the longest hook call
    action_seconds: float = 0.0  # time in the engine's admit / resume / pause called by the hook


@dataclass(slots=True, frozen=True)
class Decision:
    time: float
    kind: str  # admit | resume | preempt | memory_pause | expire
    request_id: str | None
    conversation: str | None
    score: float  # S of a started candidate, V of a paused victim, 0 for an expiry
    by: str | None = None  # preempt: the request that took the slot; memory_pause: the one that needed pages


class AgePolicy:
    """Throughput-first, age-scored admission and pause policy. Contract: `policy(engine)` only moves
    sequences through `engine.admit` / `resume` / `pause`; `choose_victim` returns a running sequence."""

    def __init__(self, config: PolicyConfig | None = None):
        self.cfg = (config or PolicyConfig()).validate()
        self.stats = PolicyStats()
        self.tracks: dict[str, _Track] = {}
        self.conversations: dict[str, _Conversation] = {}
        self.recent: deque[Decision] = deque(maxlen=self.cfg.history)
        self._ranked: list[tuple[float, float, float, _Track]] = []  # (S, wait, work, track) of the last call
        self._order = itertools.count()
        self._started: set[str] = set()  # started during the current call: never a victim in the same call
        self._now = 0.0
        self._action_s = 0.0  # engine time inside the current call

    # ---- the hook ---------------------------------------------------------------------------------------
    def __call__(self, engine: Engine) -> None:
        t0 = time.perf_counter()
        now = self._now = engine.clock()
        self._started.clear()
        self._action_s = 0.0
        self._sync(engine, now)
        self._expire(engine, now)
        ranked = self._ranked = self._rank(engine, now)
        started = self._fill_free_slots(engine, ranked, now)
        if self.cfg.preemption:
            self._preempt(engine, ranked[started:], now)
        dt = time.perf_counter() - t0 - self._action_s
        self.stats.steps += 1
        self.stats.decision_seconds += dt
        self.stats.max_decision_seconds = max(self.stats.max_decision_seconds, dt)
        self.stats.action_seconds += self._action_s

    def choose_victim(self, engine: Engine, needing: Sequence) -> Sequence:
        """The running sequence to pause because `needing` cannot get a page: lowest V among those that free
        at least one page (then the youngest). The engine pauses it; the policy records the pause."""
        t0, now = time.perf_counter(), engine.clock()
        victim = min(engine.running,
                     key=lambda r: (self._frees(engine, r) == 0, *self._victim_key(engine, r, now)))
        v = self._victim_key(engine, victim, now)[0]
        self._note_pause(victim, now, "memory_pause", v, by=needing.request_id)
        self.stats.memory_pauses += 1
        self.stats.decision_seconds += time.perf_counter() - t0
        return victim

    # ---- records ------------------------------------------------------------------------------------------
    def _sync(self, engine: Engine, now: float) -> None:
        gone = [rid for rid, tr in self.tracks.items() if engine.seqs.get(rid) is not tr.seq]
        for rid in gone:  # finished or aborted since the last call
            self._retire(self.tracks.pop(rid), now)
        for seq in engine.seqs.values():
            tr = self.tracks.get(seq.request_id)
            if tr is None:
                tr = self._track(seq, now)
            if seq.status is SeqStatus.RUNNING and tr.run_since is None:
                tr.run_since = now  # admitted by someone else
            elif seq.status is SeqStatus.PAUSED and tr.run_since is not None:
                tr.run_since, tr.entered = None, now  # paused by someone else

    def _track(self, seq: Sequence, now: float) -> _Track:
        tr = _Track(seq, next(self._order), seq.arrival if seq.status is SeqStatus.WAITING else now)
        self.tracks[seq.request_id] = tr
        key = seq.request.conversation
        if key is not None:
            conv = self.conversations.get(key)
            if conv is None:
                conv = self.conversations[key] = _Conversation(now)
            conv.in_flight += 1
            conv.last_active = now
        return tr

    def _retire(self, tr: _Track, now: float) -> None:
        seq = tr.seq
        conv = self._conversation(seq)
        if conv is None:
            return
        conv.in_flight -= 1
        # a finished request's own last step, not this call's time: after an idle spell the hook runs late
        conv.last_active = max(conv.last_active,
                               now if seq.finish_reason is FinishReason.ABORT else min(now, seq.last_active))
        conv.last_seq = seq
        if seq.finish_reason is not FinishReason.ABORT:
            conv.turns += 1
            a, n = self.cfg.output_ema, float(seq.num_output)
            prev = conv.expected_output
            conv.expected_output = n if prev is None else (1 - a) * prev + a * n

    def _expire(self, engine: Engine, now: float) -> None:
        cutoff = now - self.cfg.idle_timeout_s
        expired = [k for k, c in self.conversations.items() if c.in_flight == 0 and c.last_active <= cutoff]
        if not expired:
            return
        dead = [self.conversations.pop(k) for k in expired]
        keep: set[bytes] = set()  # pages that live conversations or requests may still reuse
        for conv in self.conversations.values():
            if conv.last_seq is not None:
                keep.update(conv.last_seq.page_hashes)
        for tr in self.tracks.values():
            keep.update(tr.seq.page_hashes)
            keep.update(tr.chain or ())
        for key, conv in zip(expired, dead, strict=True):
            if conv.last_seq is not None:
                trail = CachedTrail.of(conv.last_seq, engine.cfg.page_size)
                self.stats.demoted_pages += engine.demote_cached(trail, keep)
            self.stats.expired_conversations += 1
            self.recent.append(Decision(now, "expire", None, key, 0.0))

    def _conversation(self, seq: Sequence) -> _Conversation | None:
        key = seq.request.conversation
        return self.conversations.get(key) if key is not None else None

    # ---- estimates ----------------------------------------------------------------------------------------
    def _work(self, engine: Engine, tr: _Track) -> float:
        """W of the scoring NOTE for a waiting, paused or running sequence."""
        s = tr.seq
        conv = self._conversation(s)
        expected = float(min(s.params.max_tokens, self.cfg.default_output_tokens))
        if conv is not None and conv.expected_output is not None:
            expected = min(float(s.params.max_tokens), conv.expected_output)
        decode = max(0.0, expected - s.num_output)
        if s.status is SeqStatus.WAITING:
            return work_estimate(self.cfg, s.num_prompt - self._peek(engine, tr)[0], decode)
        pending = max(0, s.num_tokens - s.num_computed - 1)  # prompt (or forced tokens) left to prefill
        resume = s.num_computed if s.status is SeqStatus.PAUSED else 0
        return work_estimate(self.cfg, pending, decode, resume)

    def _peek(self, engine: Engine, tr: _Track) -> tuple[int, list[int]]:
        """(prompt tokens the prefix cache would supply, their pages) with no side effect: the full-page part
        of `BlockManager.match_prefix` over hashes computed once per sequence (cached partial tails are left
        out, so this under-estimates by less than a page)."""
        b, s = engine.blocks, tr.seq
        if not b.enable_prefix_cache or (s.params.prompt_logprobs is not None and not s.prompt_lps_sent):
            return 0, []  # (prompt logprobs: the whole prompt is computed, `MemoryMixin.admit`)
        if tr.chain is None:
            limit = (s.num_prompt - 1) // b.page_size  # as match_prefix: one token is always left to compute
            tr.chain = hash_chain(s.tokens[:s.num_prompt], b.page_size, b.salt, limit)
        pages: list[int] = []
        best = 0
        for h in tr.chain:
            page = b.page_of_hash.get(h)
            if page is None:
                break
            pages.append(page)
            if not b.needs_snapshots or h in b.snapshots:
                best = len(pages)
        return best * b.page_size, pages[:best]

    def _need_pages(self, engine: Engine, tr: _Track, leaving: tuple[Sequence, ...] = ()) -> int:
        """Pages that starting `tr` takes out of `blocks.num_free`: its whole prompt (or context) plus one
        token, in fixed context mode its whole context at once (prompt and max_tokens, as the engine reserves
        it), less the cached pages it reuses that others already hold (others than `leaving`: a page only they
        hold is freed by their pauses and taken back by `tr`, so it makes no room)."""
        b, s = engine.blocks, tr.seq
        if s.status is SeqStatus.WAITING:
            reused = self._peek(engine, tr)[1]
        else:
            reused = []
            for h in s.page_hashes:
                page = b.page_of_hash.get(h)
                if page is None:
                    break
                reused.append(page)
        gone = Counter(p for r in leaving for p in r.pages)
        held = sum(1 for p in reused if b.ref[p] - gone[p] > 0)
        tokens = max(min(s.num_tokens + 1, engine.max_model_len), engine.fixed_context_tokens(s))
        return b.pages_for(tokens) - held

    def _fits(self, engine: Engine, tr: _Track, freed: int = 0, leaving: tuple[Sequence, ...] = ()) -> bool:
        """Whether `tr` fits the pool beside the running sequences (less `leaving`, whose pauses free `freed`
        pages): its pages, the reserve, and the pages the running ones still need for the tokens they hold
        (an admission or a resume takes its first chunk's pages only: a prompt still being computed has the rest
        of its pages spoken for)."""
        staying = [r for r in engine.running if r not in leaving]
        reserve = self.cfg.reserve_pages_per_seq * (len(staying) + 1) if staying else 0  # a lone job always fits
        owed = sum(self._owed(engine, r) for r in staying)
        return self._need_pages(engine, tr, leaving) + reserve + owed <= engine.blocks.num_free + freed

    @staticmethod
    def _owed(engine: Engine, seq: Sequence) -> int:
        """Pages a running sequence still takes for the tokens it holds (its prompt's rest, forced tokens)."""
        return max(0, engine.blocks.pages_for(min(seq.num_tokens, engine.max_model_len)) - len(seq.pages))

    @staticmethod
    def _frees(engine: Engine, seq: Sequence) -> int:
        """Pages a pause of `seq` would make obtainable (those no other sequence references)."""
        return sum(1 for p in seq.pages if engine.blocks.ref[p] == 1)

    def _victim_key(self, engine: Engine, r: Sequence, now: float) -> tuple[float, float, int]:
        """Lower is paused first: V, then the latest arrival, then the latest seen."""
        tr = self.tracks.get(r.request_id) or self._track(r, now)
        return victim_score(self.cfg, now - r.arrival, self._work(engine, tr)), -r.arrival, -tr.order

    # ---- decisions ----------------------------------------------------------------------------------------
    def _rank(self, engine: Engine, now: float) -> list[tuple[float, float, float, _Track]]:
        out = []
        for seq in itertools.chain(engine.waiting, engine.paused):
            tr = self.tracks[seq.request_id]
            work = self._work(engine, tr)
            wait = now - tr.entered
            out.append((candidate_score(self.cfg, wait, work), wait, work, tr))
        out.sort(key=lambda e: (-e[0], e[3].entered, e[3].order))
        return out

    def _fill_free_slots(self, engine: Engine, ranked: list, now: float) -> int:
        """Start candidates in rank order while a slot is free and they fit; returns how many started."""
        started = 0
        for score, _, _, tr in ranked:
            if not (engine.can_admit() and self._fits(engine, tr) and self._start(engine, tr, score, now)):
                break
            started += 1
        return started

    def _preempt(self, engine: Engine, ranked: list, now: float) -> None:
        cfg = self.cfg
        for score, _, _, tr in ranked:
            ready = [r for r in engine.running if r.request_id not in self._started
                     and now - self.tracks[r.request_id].run_since >= cfg.quantum_s]
            victims = sorted((self._victim_key(engine, r, now), r) for r in ready)
            chosen: list[tuple[float, Sequence]] = []
            freed, fits = 0, False
            for (v, *_), r in victims:
                if score <= v + cfg.margin:
                    break
                chosen.append((v, r))
                freed += self._frees(engine, r)
                if self._fits(engine, tr, freed, tuple(c for _, c in chosen)):
                    fits = True
                    break
            if not fits:
                return  # the best candidate cannot start: nobody below it may overtake it
            for v, r in chosen:
                t0 = time.perf_counter()
                engine.pause(r)
                self._action_s += time.perf_counter() - t0
                self._note_pause(r, now, "preempt", v, by=tr.seq.request_id)
                self.stats.preemptions += 1
            if not self._start(engine, tr, score, now):
                return

    def _start(self, engine: Engine, tr: _Track, score: float, now: float) -> bool:
        s = tr.seq
        resumed = s.status is SeqStatus.PAUSED
        t0 = time.perf_counter()
        ok = engine.resume(s) if resumed else engine.admit(s)
        self._action_s += time.perf_counter() - t0
        if not ok:
            return False
        tr.run_since = now
        self._started.add(s.request_id)
        if resumed:
            self.stats.resumed += 1
            conv = self._conversation(s)
            if conv is not None:
                conv.resumes += 1
        else:
            self.stats.admitted += 1
        self.recent.append(Decision(now, "resume" if resumed else "admit", s.request_id,
                                    s.request.conversation, score))
        return True

    def _note_pause(self, seq: Sequence, now: float, kind: str, v: float, by: str | None = None) -> None:
        tr = self.tracks.get(seq.request_id) or self._track(seq, now)
        tr.entered, tr.run_since = now, None
        conv = self._conversation(seq)
        if conv is not None:
            conv.pauses += 1
        self.recent.append(Decision(now, kind, seq.request_id, seq.request.conversation, v, by))

    # ---- /stats -------------------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """Counters, the last ranking (per request and per conversation) and recent decisions; JSON-ready."""
        st, now = self.stats, self._now
        queue = [{"request_id": tr.seq.request_id, "conversation": tr.seq.request.conversation,
                  "state": tr.seq.status.value, "wait_s": wait, "score": score, "work": work}
                 for score, wait, work, tr in self._ranked]
        best: dict[str, dict[str, Any]] = {}
        for q in queue:
            if q["conversation"] is not None and q["conversation"] not in best:
                best[q["conversation"]] = q
        conversations = {
            key: {"in_flight": c.in_flight, "idle_s": 0.0 if c.in_flight else now - c.last_active,
                  "turns": c.turns, "expected_output_tokens": c.expected_output, "pauses": c.pauses,
                  "resumes": c.resumes, "score": best.get(key, {}).get("score"),
                  "wait_s": best.get(key, {}).get("wait_s")}
            for key, c in self.conversations.items()}
        return {
            "decisions": st.steps, "admitted": st.admitted, "resumes": st.resumed,
            "pauses": st.preemptions + st.memory_pauses, "preemptions": st.preemptions,
            "memory_pauses": st.memory_pauses, "expired_conversations": st.expired_conversations,
            "demoted_pages": st.demoted_pages,
            "decision_us_mean": 1e6 * st.decision_seconds / st.steps if st.steps else 0.0,
            "decision_us_max": 1e6 * st.max_decision_seconds,
            "action_us_mean": 1e6 * st.action_seconds / st.steps if st.steps else 0.0,
            "fifo_after_s": self.cfg.work_cap / self.cfg.age_weight if self.cfg.age_weight else None,
            "queue": queue, "conversations": conversations,
            "recent": [asdict(d) for d in self.recent], "config": asdict(self.cfg),
        }
