"""The engine's step loop as a data-plane service: control in, one report per step out (no Ray here).

The GPU actor wraps an `EngineDriver`: the scheduler sends `Control` messages (new requests, aborts, and its
policy's admit / pause / resume decisions) at any time; the driver applies them at the next step boundary,
steps the engine continuously while it has runnable work, and yields one `StepReport` per step carrying every
slot's token events together, plus a `EngineView` of all sequences for the policy. Decode never waits for
the control plane: decisions taken on step n's view apply from step n+1 on.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from decapybara.engine.block_manager import hash_chain
from decapybara.engine.engine import Engine
from decapybara.engine.json_schema import precompile
from decapybara.engine.memory import CachedTrail
from decapybara.engine.sequence import FinishReason, Request, SeqStatus, Sequence, TokenEvent
from decapybara.errors import DecapybaraError


class LoopStopped(RuntimeError):
    """`EngineDriver.call` after the engine's loop stopped or ended."""


@dataclass(slots=True)
class Control:
    """What the control plane asks of the data plane; ids of finished sequences are ignored."""

    add: list[Request] = field(default_factory=list)
    abort: list[str] = field(default_factory=list)
    admit: list[str] = field(default_factory=list)  # waiting -> running, in this order, while room remains
    pause: list[str] = field(default_factory=list)  # running -> paused (KV + state leave the pool)
    resume: list[str] = field(default_factory=list)  # paused -> running, in this order, while room remains
    victims: list[str] | None = None  # preferred pause order when the pool runs dry (first = first paused)
    expire: list[str] = field(default_factory=list)  # conversations idle past the timeout: demote their pages

    def empty(self) -> bool:
        return not (self.add or self.abort or self.admit or self.pause or self.resume or self.expire
                    or self.victims is not None)

    def merge(self, other: Control) -> None:
        self.add += other.add
        self.abort += other.abort
        self.admit += other.admit
        self.pause += other.pause
        self.resume += other.resume
        self.expire += other.expire
        if other.victims is not None:
            self.victims = other.victims


@dataclass(slots=True)
class SeqView:
    """What the policy may know of one sequence."""

    request_id: str
    conversation: str | None
    status: str  # waiting | running | paused
    arrival: float
    num_prompt: int
    num_computed: int
    num_output: int
    max_tokens: int
    num_pages: int  # pages held now (running) or needed to resume (paused)
    cached_estimate: int = 0  # prompt tokens the prefix cache would serve (waiting)
    last_active: float = 0.0
    own_pages: int = 0  # pages a pause frees (running): those no other sequence or cached prefix shares
    # pages of its cached prompt prefix that running sequences hold (waiting): the only ones starting it does not
    # take out of `free_pages` (evictable cached pages are counted there, and a tier's are restored into fresh ones)
    shared_pages: int = 0
    # tokens a start reserves pages for in fixed context mode (waiting, paused): the whole context, its prompt and
    # max_tokens up to the engine's context length (`MemoryMixin._admission_pages`); 0 in pool mode
    context_tokens: int = 0


@dataclass(slots=True)
class EngineView:
    now: float
    seqs: list[SeqView]
    free_slots: int
    max_slots: int
    free_pages: int
    total_pages: int
    page_size: int
    # the requests the report's events ended: (request id, output tokens, ended by abort: not a finished turn)
    ended: tuple[tuple[str, int, bool], ...] = ()


@dataclass(slots=True)
class StepReport:
    step: int
    events: list[TokenEvent]
    view: EngineView
    compute_s: float  # time inside Engine.step
    stats: dict[str, Any]


def engine_view(engine: Engine, events: list[TokenEvent] = ()) -> EngineView:
    """What the policy sees after a step; `events`, the step's, name the requests it ended."""
    seqs = []
    ps = engine.cfg.page_size
    for status, group in (("waiting", engine.waiting), ("running", engine.running), ("paused", engine.paused)):
        for s in group:
            pages = len(s.pages) if status == "running" else -(-s.num_computed // ps)
            own = int(np.count_nonzero(engine.blocks.ref[s.pages] == 1)) if status == "running" and s.pages else 0
            shared = _shared_prefix_pages(engine, s) if status == "waiting" else 0
            context = engine.fixed_context_tokens(s) if status != "running" else 0
            seqs.append(SeqView(s.request_id, s.request.conversation, status, s.arrival, s.num_prompt,
                                s.num_computed, s.num_output, s.params.max_tokens, pages,
                                getattr(s, "cached_estimate", 0), s.last_active, own, shared, context))
    ended = tuple((ev.request_id, ev.num_output_tokens, ev.finish_reason == FinishReason.ABORT)
                  for ev in events if ev.finish_reason is not None)
    return EngineView(engine.clock(), seqs, len(engine.free_slots), engine.cfg.max_slots, engine.blocks.num_free,
                      engine.blocks.num_pages, ps, ended)


def _prompt_chain(engine: Engine, req: Request) -> list[bytes]:
    """The hashes of the prompt's full pages a prefix match may cover (one token is always left to compute);
    none for a request that matches no cached prefix (prompt logprobs) or without the prefix cache."""
    b = engine.blocks
    if not b.enable_prefix_cache or req.params.prompt_logprobs is not None:
        return []
    return hash_chain(req.prompt_ids, b.page_size, b.salt, (len(req.prompt_ids) - 1) // b.page_size)


def _shared_prefix_pages(engine: Engine, seq: Sequence) -> int:
    """Pages of a waiting sequence's cached prompt prefix that running sequences hold, found as the in-process
    policy's `AgePolicy._peek` finds the prefix (full pages in the pool, up to the deepest with the snapshot a
    hybrid model resumes from), over the prompt's page hashes `EngineDriver` keeps on the sequence
    (`prompt_chain`). Its admission takes every other page of its prompt out of `blocks.num_free`."""
    b = engine.blocks
    if not engine.running:
        return 0
    pages: list[int] = []
    usable = 0
    page_of, snapshots = b.page_of_hash.get, b.snapshots
    for h in getattr(seq, "prompt_chain", ()):
        page = page_of(h)
        if page is None:
            break
        pages.append(page)
        if not b.needs_snapshots or h in snapshots:
            usable = len(pages)
    return int(np.count_nonzero(b.ref[pages[:usable]])) if usable else 0


def apply_decisions(engine: Engine, control: Control) -> None:
    """Apply a policy's decisions to the engine: pauses first (they free room), then resumes and admits."""
    seqs = engine.seqs
    for rid in control.pause:
        s = seqs.get(rid)
        if s is not None and s.status == SeqStatus.RUNNING:
            engine.pause(s)
    for rid in control.resume:
        s = seqs.get(rid)
        if s is not None and s.status == SeqStatus.PAUSED and engine.can_admit() and not engine.resume(s):
            break
    for rid in control.admit:
        s = seqs.get(rid)
        if s is not None and s.status == SeqStatus.WAITING and engine.can_admit() and not engine.admit(s):
            break


class EngineDriver:
    """Runs an engine on one thread: `submit` from any thread, iterate `reports()` on the engine's thread.

    With `remote_policy=True` the engine admits/pauses/resumes only what `Control` messages say (the
    scheduler actor's policy decides); otherwise the engine's own admission hook runs in-process. It keeps what
    each conversation's last finished request left in the prefix cache (`CachedTrail`, at most `MAX_TRAILS`
    conversations, the least recently finished dropped first), so that a conversation the policy expires has
    its cached pages made the next evicted, as the in-process policy does.
    """

    MAX_TRAILS = 4096

    def __init__(self, engine: Engine, remote_policy: bool = True, idle_wait_s: float = 0.5):
        self.engine = engine
        self.remote_policy = remote_policy
        self.idle_wait_s = idle_wait_s
        self._pending = Control()
        self._cond = threading.Condition()
        self._stopped = False
        self._decisions = Control()
        self._victims: list[str] | None = None
        self._live: dict[str, Sequence] = {}  # requests of a conversation, until they end
        self._trails: OrderedDict[str, CachedTrail] = OrderedDict()  # conversation -> its last request's trail
        self._trail_pages: Counter[bytes] = Counter()  # the trails' page hashes, each with how many trails hold it
        self.last_stats: dict[str, Any] = {}
        self._calls: list[tuple[Callable[[Engine], Any], Future]] = []  # `call`s for the engine's thread
        if remote_policy:
            engine.admission = self._admit_from_decisions
            engine.choose_victim = self._choose_victim  # type: ignore[attr-defined]

    # ---- any thread ------------------------------------------------------------------------------------
    def submit(self, control: Control) -> None:
        for req in control.add:  # a new JSON schema's automaton built here, not on the engine's thread
            precompile(req.params)
        with self._cond:
            self._pending.merge(control)
            self._cond.notify()

    def stop(self) -> None:
        self._end_calls("the engine's loop stopped")

    def _end_calls(self, why: str) -> None:
        """The loop is over: no call may wait on it (those queued get LoopStopped(`why`))."""
        with self._cond:
            self._stopped = True
            calls, self._calls = self._calls, []
            self._cond.notify()
        for _, fut in calls:
            fut.set_exception(LoopStopped(why))

    def call(self, fn: Callable[[Engine], Any], timeout_s: float | None = None) -> Any:
        """`fn(engine)` run on the engine's thread between two steps (`reports` must be running); its result, or
        its exception. Raises TimeoutError after `timeout_s` (a call not started by then never runs) and
        LoopStopped (a RuntimeError) once the loop has stopped or ended."""
        fut: Future = Future()
        with self._cond:
            if self._stopped:
                raise LoopStopped("the engine's loop stopped")
            self._calls.append((fn, fut))
            self._cond.notify()
        try:
            return fut.result(timeout_s)
        except TimeoutError:
            fut.cancel()  # not run later, where it has not started
            raise

    # ---- the engine's thread ---------------------------------------------------------------------------
    def reports(self) -> Iterator[StepReport]:
        """Yield one report per engine step (or per control batch that produced events) until `stop()`."""
        try:
            yield from self._reports()
        finally:  # ended (stopped, closed, or raised)
            self._end_calls("the engine's loop ended")

    def _reports(self) -> Iterator[StepReport]:
        engine = self.engine
        while True:
            heartbeat = False
            with self._cond:
                while not self._stopped and self._pending.empty() and not self._calls and not self._runnable():
                    if not self._cond.wait(self.idle_wait_s) and (engine.waiting or engine.paused):
                        heartbeat = True  # queued work the policy has not admitted yet: show it the view again
                        break
                if self._stopped:
                    return
                control, self._pending = self._pending, Control()
                calls, self._calls = self._calls, []
            for fn, fut in calls:
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn(engine))
                    except Exception as exc:  # noqa: BLE001 - the caller's to see
                        fut.set_exception(exc)
            events = self._apply(control)
            steps_before = engine.stats.steps
            t0 = time.perf_counter()
            if engine.has_work():
                try:
                    events += engine.step()
                except Exception as exc:  # noqa: BLE001 - a broken step must not kill the service silently
                    events += self._fail_all(f"engine step failed: {exc!r}")
            dt = time.perf_counter() - t0
            self._note_ended(events)
            ran = engine.stats.steps != steps_before
            if events or ran or heartbeat or not control.empty():
                self.last_stats = engine.snapshot_stats()
                yield StepReport(engine.stats.steps, events, engine_view(engine, events), dt, self.last_stats)
            if not ran and not events:
                with self._cond:  # nothing runnable yet: wait for the control plane instead of spinning
                    if self._pending.empty() and not self._stopped:
                        self._cond.wait(self.idle_wait_s)

    def _runnable(self) -> bool:
        """Running sequences always make progress; with a local policy queued ones can be admitted."""
        e = self.engine
        return bool(e.running) or (not self.remote_policy and e.has_work())

    def _apply(self, control: Control) -> list[TokenEvent]:
        engine = self.engine
        events: list[TokenEvent] = []
        for req in control.add:
            try:
                seq = engine.add_request(req)
                seq.cached_estimate = (0 if req.params.prompt_logprobs is not None  # type: ignore[attr-defined]
                                       else engine.blocks.match_prefix(req.prompt_ids, count=False).num_tokens)
                seq.prompt_chain = _prompt_chain(engine, req)  # type: ignore[attr-defined]
            except DecapybaraError as exc:
                events.append(TokenEvent(req.request_id, [], finish_reason=FinishReason.ABORT,
                                         error=str(exc), error_type=type(exc).__name__))
            else:
                if req.conversation is not None:
                    self._live[req.request_id] = seq
        for rid in control.abort:
            ev = engine.abort(rid)
            if ev is not None:
                events.append(ev)
        if control.victims is not None:
            self._victims = control.victims
        if self.remote_policy:
            self._decisions.merge(Control(admit=control.admit, pause=control.pause, resume=control.resume))
        if control.expire:
            self._expire(control.expire)
        return events

    def _note_ended(self, events: list[TokenEvent]) -> None:
        """Keep the trail of each conversation's request that `events` ended (finished, or aborted after some of
        it was computed: one aborted while it waited leaves the conversation's trail as it was)."""
        for ev in events:
            if ev.finish_reason is None:
                continue
            seq = self._live.pop(ev.request_id, None)
            if seq is None or seq.num_computed == 0:
                continue
            self._set_trail(seq.request.conversation, CachedTrail.of(seq, self.engine.cfg.page_size))
            while len(self._trails) > self.MAX_TRAILS:
                self._set_trail(next(iter(self._trails)), None)

    def _set_trail(self, key: str, trail: CachedTrail | None) -> CachedTrail | None:
        """Replace (None: drop) conversation `key`'s trail, keeping `_trail_pages` the count of the trails' pages;
        returns the trail it held."""
        old = self._trails.pop(key, None)
        for h in old.page_hashes if old is not None else ():
            if self._trail_pages[h] == 1:
                del self._trail_pages[h]
            else:
                self._trail_pages[h] -= 1
        if trail is not None:
            self._trails[key] = trail
            self._trail_pages.update(trail.page_hashes)
        return old

    def _expire(self, keys: list[str]) -> int:
        """Demote the cached pages that expired conversations' last requests left, except pages a live
        request or another conversation's last request uses (or a waiting prompt would reuse). Returns the pages
        moved. Its work is the expired trails' pages and the live requests' (rare: once a conversation an idle
        timeout)."""
        engine = self.engine
        live = {s.request.conversation for s in engine.seqs.values()}
        dead = [self._set_trail(k, None) for k in keys if k in self._trails and k not in live]
        if not dead:
            return 0
        in_use: set[bytes] = set()
        blocks = engine.blocks
        for s in engine.seqs.values():
            in_use.update(s.page_hashes)
            if s.status is SeqStatus.WAITING:
                in_use.update(hash_chain(s.tokens[:s.num_prompt], blocks.page_size, blocks.salt))
        keep = _Keep(self._trail_pages, in_use)
        return sum(engine.demote_cached(trail, keep) for trail in dead)

    def _admit_from_decisions(self, engine: Engine) -> None:
        decisions, self._decisions = self._decisions, Control()
        apply_decisions(engine, decisions)

    def _choose_victim(self, engine: Engine, needing: Any) -> Any:
        """The scheduler's preferred victim among the running (its order first, then the youngest)."""
        order = {rid: i for i, rid in enumerate(self._victims or [])}
        return min(engine.running, key=lambda s: (order.get(s.request_id, len(order)), -s.arrival))

    def _fail_all(self, message: str) -> list[TokenEvent]:
        events = []
        for rid in list(self.engine.seqs):
            ev = self.engine.abort(rid)
            if ev is not None:
                ev.note = message
                events.append(ev)
        return events


class _Keep:
    """Pages an expire leaves where they are: those other trails hold, and those live requests use."""

    __slots__ = ("in_use", "trails")

    def __init__(self, trails: Counter[bytes], in_use: set[bytes]) -> None:
        self.trails, self.in_use = trails, in_use

    def __contains__(self, h: object) -> bool:
        return h in self.trails or h in self.in_use
