"""The policy as the scheduler actor runs it: decisions from an `EngineView`, not from the engine itself.

`AgeViewPolicy.decide(view) -> Control | None` applies the scores of `decapybara.scheduler.scoring` (the same
S, V, margin, quantum and wait bound as the in-process `AgePolicy`) to a step report's view: it fills free
slots with the best-scored candidates that fit the pool, pauses the fewest lowest-V running jobs past their
quantum that the best remaining candidate beats by the margin and whose pauses make room for it, and sends the running jobs' pause order for memory pressure. It keeps
no engine object, so it runs in the SchedulerActor (control plane) while the GPU actor steps (data plane);
its decisions apply from the next step on, and a decision is not repeated while it is in flight. A conversation
idle past `idle_timeout_s` is forgotten and named in the control's `expire`, so that the engine makes its cached
pages the next evicted (`EngineDriver`), as the in-process policy asks of the engine.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

from decapybara.engine.driver import Control, EngineView, SeqView
from decapybara.scheduler.scoring import PolicyConfig, candidate_score, victim_score, work_estimate


class ViewPolicy(Protocol):
    def decide(self, view: EngineView) -> Control | None: ...

    def snapshot(self) -> dict[str, Any]: ...


@dataclass(slots=True)
class _Seen:
    order: int
    conversation: str | None
    entered: float  # when it last became a candidate (arrival or pause)
    status: str
    run_since: float | None = None
    num_output: int = 0
    decided_at: int = -1  # report number of the last decision about it (in flight until the view changes)


@dataclass(slots=True)
class _Conv:
    last_active: float
    expected_output: float | None = None
    turns: int = 0
    pauses: int = 0
    resumes: int = 0


class AgeViewPolicy:
    """Throughput-first, age-scored decisions from views (see the module docstring)."""

    def __init__(self, config: PolicyConfig | None = None, decision_ttl_reports: int = 4):
        self.cfg = (config or PolicyConfig()).validate()
        self.ttl = decision_ttl_reports
        self.seen: dict[str, _Seen] = {}
        self.convs: dict[str, _Conv] = {}
        self.reports = 0
        self._order = itertools.count()
        self.counts = {"admitted": 0, "resumed": 0, "preemptions": 0, "expired_conversations": 0}
        self.recent: deque[dict[str, Any]] = deque(maxlen=64)
        self.last_ranking: list[dict[str, Any]] = []
        self._last_victims: list[str] = []
        self._expired: list[str] = []  # conversations expired since the last control: the engine demotes their pages

    # ---- bookkeeping --------------------------------------------------------------------------------
    def _sync(self, view: EngineView) -> None:
        now, present = view.now, {s.request_id for s in view.seqs}
        ended = {rid: (n, aborted) for rid, n, aborted in view.ended}
        for rid in [r for r in self.seen if r not in present]:  # finished or aborted
            gone = self.seen.pop(rid)
            conv = self.convs.get(gone.conversation) if gone.conversation else None
            if conv is not None:
                conv.last_active = now
                n, aborted = ended.get(rid, (gone.num_output, False))  # its last step's tokens counted
                if aborted:  # a client gone or a refusal: no turn, and no measure of its output
                    continue
                conv.turns += 1
                a, n = self.cfg.output_ema, float(n)
                conv.expected_output = n if conv.expected_output is None else (1 - a) * conv.expected_output + a * n
        for s in view.seqs:
            st = self.seen.get(s.request_id)
            if st is None:
                st = self.seen[s.request_id] = _Seen(next(self._order), s.conversation, s.arrival, s.status)
                if s.conversation is not None:
                    self.convs.setdefault(s.conversation, _Conv(now))
            if s.status != st.status:
                st.decided_at = -1  # the decision landed (or something else moved it)
                if s.status == "running":
                    st.run_since = now
                    # counted as they happen (a decision the engine could not carry out is sent again)
                    if st.status in ("waiting", "paused"):
                        self.counts["admitted" if st.status == "waiting" else "resumed"] += 1
                    conv = self.convs.get(s.conversation) if s.conversation else None
                    if conv is not None and st.status == "paused":
                        conv.resumes += 1
                elif s.status == "paused":
                    st.entered, st.run_since = now, None
                    conv = self.convs.get(s.conversation) if s.conversation else None
                    if conv is not None:
                        conv.pauses += 1
                st.status = s.status
            elif s.status == "running" and st.run_since is None:
                st.run_since = now
            st.num_output = s.num_output
            if s.conversation is not None:
                self.convs[s.conversation].last_active = max(self.convs[s.conversation].last_active, s.last_active)
        live = {s.conversation for s in view.seqs if s.conversation is not None}
        for key in [k for k, c in self.convs.items() if k not in live and now - c.last_active >= self.cfg.idle_timeout_s]:
            del self.convs[key]  # idle past the timeout: the conversation counts as finished
            self._expired.append(key)
            self.counts["expired_conversations"] += 1
            self.recent.append({"time": now, "kind": "expire", "conversation": key})

    def _work(self, s: SeqView) -> float:
        conv = self.convs.get(s.conversation) if s.conversation else None
        expected = float(min(s.max_tokens, self.cfg.default_output_tokens))
        if conv is not None and conv.expected_output is not None:
            expected = min(float(s.max_tokens), conv.expected_output)
        decode = max(0.0, expected - s.num_output)
        if s.status == "waiting":  # (its output too where it recomputes after a lost bundle)
            return work_estimate(self.cfg, s.num_prompt + s.num_output - s.cached_estimate, decode)
        pending = max(0, s.num_prompt + s.num_output - s.num_computed - 1)
        return work_estimate(self.cfg, pending, decode, s.num_computed if s.status == "paused" else 0)

    def _need_pages(self, s: SeqView, page_size: int) -> int:
        """Pages starting `s` takes out of the view's `free_pages`: its whole context and one token (a paused one
        may have stopped mid-prompt), less, for a waiting one, the cached prompt pages running sequences already
        hold (`shared_pages`; its other cached pages are evictable ones, counted free, or a tier's, restored into
        fresh pages), as the in-process policy counts them. In fixed context mode it takes its whole context's
        (`context_tokens`) at once. A waiting one's context holds output too where it recomputes after a lost
        bundle."""
        pages = -(-max(s.num_prompt + s.num_output + 1, s.context_tokens) // page_size)
        return pages if s.status == "paused" else pages - s.shared_pages

    @staticmethod
    def _owed(s: SeqView, page_size: int) -> int:
        """Pages a running sequence still takes for the tokens it holds: an admission or a resume takes its first
        chunk's pages only, so the rest of a prompt still being computed is spoken for."""
        return max(0, -(-(s.num_prompt + s.num_output) // page_size) - s.num_pages)

    # ---- decisions ----------------------------------------------------------------------------------
    def decide(self, view: EngineView) -> Control | None:
        self.reports += 1
        self._sync(view)
        now, cfg = view.now, self.cfg
        in_flight = lambda s: 0 <= self.seen[s.request_id].decided_at and \
            self.reports - self.seen[s.request_id].decided_at < self.ttl
        running = [s for s in view.seqs if s.status == "running"]
        ranked = sorted(((candidate_score(cfg, now - self.seen[s.request_id].entered, self._work(s)), s)
                         for s in view.seqs if s.status in ("waiting", "paused") and not in_flight(s)),
                        key=lambda e: (-e[0], self.seen[e[1].request_id].entered, self.seen[e[1].request_id].order))
        self.last_ranking = [{"request_id": s.request_id, "conversation": s.conversation, "state": s.status,
                              "score": sc, "wait_s": now - self.seen[s.request_id].entered} for sc, s in ranked]
        control = Control(expire=self._expired)
        self._expired = []
        slots = view.free_slots
        free = view.free_pages - sum(self._owed(r, view.page_size) for r in running)
        n_running = len(running)
        victims = sorted(running, key=lambda r: (self._victim(r, now), -r.arrival))
        order = [r.request_id for r in victims]
        if order != self._last_victims:  # sent only when it changes: most steps need no control message
            control.victims = self._last_victims = order
        pending = list(ranked)
        while pending and slots > 0:  # fill free slots in rank order while the best fits
            score, s = pending[0]
            need = self._need_pages(s, view.page_size) + cfg.reserve_pages_per_seq * n_running
            if need > free and n_running:
                break
            self._start(control, s, score, now)
            pending.pop(0)
            slots, free, n_running = slots - 1, free - need, n_running + 1
        if cfg.preemption and pending:  # the best remaining candidate may take running jobs' slots
            score, s = pending[0]
            ready = [r for r in victims if r.request_id not in control.admit + control.resume
                     and self.seen[r.request_id].run_since is not None
                     and now - self.seen[r.request_id].run_since >= cfg.quantum_s and not in_flight(r)]
            for victim in self._preempted_for(s, score, ready, free, n_running, view.page_size, now):
                control.pause.append(victim.request_id)
                self.seen[victim.request_id].decided_at = self.reports
                self.counts["preemptions"] += 1
                self.recent.append({"time": now, "kind": "preempt", "request_id": victim.request_id,
                                    "score": self._victim(victim, now), "by": s.request_id})
            if control.pause:
                self._start(control, s, score, now)
        return None if control.empty() else control

    def _preempted_for(self, s: SeqView, score: float, ready: list[SeqView], free: int, n_running: int,
                       page_size: int, now: float) -> list[SeqView]:
        """The fewest of `ready` (lowest V first) that `s` beats by the margin and whose pauses free a slot and
        the pages `s` needs beside those staying (`free`: the free pages less what the running still owe; a
        pause frees the pages its job alone holds and what it owed); none where no such set exists, so that no
        job is paused for a candidate that still could not start (as the in-process policy decides). A cached
        prompt page of `s` that a victim alone holds counts once: the view cannot tell which running jobs hold `s`'s
        `shared_pages`, so as many of them as the pauses free are taken to be among them (the pause frees such a page
        and `s` takes it back: no room made)."""
        chosen: list[SeqView] = []
        need = self._need_pages(s, page_size)
        freed = own = 0
        for r in ready:
            if score <= self._victim(r, now) + self.cfg.margin:
                break
            chosen.append(r)
            freed += r.own_pages + self._owed(r, page_size)
            own += r.own_pages
            staying = n_running - len(chosen)
            taken_back = min(s.shared_pages, own)
            if not staying or need + taken_back + self.cfg.reserve_pages_per_seq * staying <= free + freed:
                return chosen
        return []

    def _victim(self, r: SeqView, now: float) -> float:
        return victim_score(self.cfg, now - r.arrival, self._work(r))

    def _start(self, control: Control, s: SeqView, score: float, now: float) -> None:
        (control.resume if s.status == "paused" else control.admit).append(s.request_id)
        self.seen[s.request_id].decided_at = self.reports
        kind = "resume" if s.status == "paused" else "admit"
        self.recent.append({"time": now, "kind": kind, "request_id": s.request_id, "score": score})

    def snapshot(self) -> dict[str, Any]:
        return {"policy": "age", **self.counts, "reports": self.reports, "queue": self.last_ranking[:32],
                "conversations": {k: {"turns": c.turns, "pauses": c.pauses, "resumes": c.resumes,
                                      "expected_output_tokens": c.expected_output}
                                  for k, c in self.convs.items()},
                "recent": list(self.recent)[-16:],
                "fifo_after_s": self.cfg.work_cap / self.cfg.age_weight if self.cfg.age_weight else None}


def make_policy(cfg: Any) -> ViewPolicy:
    """The scheduler actor's policy for an `AppConfig`."""
    return AgeViewPolicy(PolicyConfig(idle_timeout_s=float(getattr(cfg, "idle_timeout_s", 1200.0))))
