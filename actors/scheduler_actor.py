"""SchedulerActor: the control plane. Owns the request registry and the multi-agent policy.

Ingress replicas call `generate(request)` as a streaming method and receive the request's `TokenEvent`s.
The actor forwards new requests and aborts to the GPU actor, consumes the GPU actor's stream of step reports
(one Ray message per engine step, all slots together), routes each event to its request's stream, and runs
the policy (`decapybara.scheduler`) on every report's `EngineView`; its admit / pause / resume decisions go
back as one `Control` message, applied by the GPU actor from its next step on. Decoding never waits for
this actor: the control overhead per step is measured and shown in `stats()`. A GPU actor lost (dead, or
silent past the watchdog) fails the open streams and is replaced by a new one over the same tiers (`_recover`,
retried with backoff); `health()` says whether the engine is up, for `/health` and the ingress's health check.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from typing import Any

import ray

from decapybara.api.response_store import BEAT_S, ResponseJournal, ResponseStore, load_records
from decapybara.engine.driver import Control, StepReport
from decapybara.engine.sequence import Request, TokenEvent
from decapybara.scheduler.remote import make_policy

log = logging.getLogger(__name__)
RESPONSES_SAVE_S = 5.0  # a graceful stop's save of the stored responses, after the prefix cache's (the ingress
# waits save_cache_s + 8 s for both)
RESPONSES_RETRY_S = 60.0  # a failed save of the stored responses is not tried again sooner
MAX_STREAMS = 10_000  # `generate` streams open at once; one past it is refused (a 503)
TIER_CALL_S = 30.0  # a call to a tier actor while a lost engine is replaced (`_drop_lost_units`)
CONTROL_CALLS = 1000  # the actor's calls beside its streams (health, aborts, stats, stored responses): each of its
# streams holds one of its concurrent calls for as long as it lasts, so these are kept room for


class SchedulerActor:
    def __init__(self, app_config: dict[str, Any]):
        from decapybara.server.config import AppConfig

        self.cfg = AppConfig(**app_config)
        cuda = self.cfg.use_cuda()
        tiers = None
        if self.cfg.ram_cache_gb > 0:
            from actors.kv_tier_actors import start_tiers

            tiers = start_tiers(self.cfg)
        self.tiers = tiers
        self.app_config, self.cuda = app_config, cuda
        self.gpu = self._new_gpu()
        self.policy = make_policy(self.cfg)
        self.queues: dict[str, asyncio.Queue] = {}
        self.pending = Control()
        self._wake: asyncio.Event | None = None
        self._tasks: list[asyncio.Task] = []
        self.last_report: StepReport | None = None
        self.overheads_us: deque[float] = deque(maxlen=512)  # scheduler work per report
        self.latencies_us: deque[float] = deque(maxlen=512)  # GPU actor -> scheduler delivery
        self.reports = 0
        self.started = time.time()
        self.metrics = RayMetrics(self.cfg.name)
        self.dead: str | None = None  # why the GPU actor is unreachable, once it is
        self.last_report_at = time.time()
        self.restarts = 0
        self._recovering: asyncio.Task | None = None
        self._lost_ids: set[str] = set()  # the requests of a lost engine, whose tier units `_recover` drops
        self._saving: asyncio.Future | None = None  # the engine's save at a graceful stop (`save_cache`)
        budget = int(self.cfg.responses_store_mb * (1 << 20))
        self.responses = ResponseStore(budget) if budget > 0 else None  # the Responses API's, for every ingress
        self.journal: ResponseJournal | None = None  # this server's files in the records' folder (response_store)
        self._journal_lock = asyncio.Lock()
        self._journal_task: asyncio.Task | None = None
        self._save_after = 0.0  # a failed save is not retried before this (monotonic seconds)
        if self.responses is not None and self.cfg.saves_cache():  # the folder's: saved files and journals
            load_records(self.responses, self.cfg.disk_cache)
            self.journal = ResponseJournal(self.cfg.disk_cache, budget)

    def _new_gpu(self) -> Any:
        from actors.gpu_actor import gpu_actor_class

        return gpu_actor_class(self.cuda, self.cfg.blas_threads, f"{self.cfg.name}-gpu").remote(
            self.app_config, self.tiers)

    async def settings(self) -> dict[str, Any]:
        return self.app_config

    async def health(self) -> dict[str, Any]:
        """ok, or why the engine is unavailable (for /health and Serve's replica health check)."""
        return {"status": "ok" if self.dead is None else "unavailable", "reason": self.dead,
                "engine_restarts": self.restarts}

    async def ready(self) -> dict[str, Any]:
        """Wait until the model is loaded; return the GPU actor's facts."""
        info = await self.gpu.info.remote()
        self._start()
        self._start_journal()  # its heartbeat from the start: this server's files are not taken over
        return {**info, "responses_store": self.responses.budget if self.responses is not None else 0}

    # ---- the Responses API's stored responses (`decapybara.api.response_store`) -----------------------
    async def put_response(self, response_id: str, parent: str | None, text: str) -> bool:
        return self._journaled(self.responses is not None and self.responses.put(response_id, parent, text),
                               response_id, parent, text)

    async def update_response(self, response_id: str, parent: str | None, text: str) -> bool:
        return self._journaled(self.responses is not None and self.responses.update(response_id, parent, text),
                               response_id, parent, text)

    async def swap_response(self, response_id: str, parent: str | None, text: str, digest: str) -> bool | None:
        return self._journaled(self.responses.swap(response_id, parent, text, digest)
                               if self.responses is not None else False, response_id, parent, text)

    def _journaled(self, stored: bool | None, response_id: str, parent: str | None, text: str) -> bool | None:
        """`stored` (a store's answer), the record written behind to the journal where the store took it."""
        if stored and self.journal is not None and self.cfg.responses_flush_s > 0:
            self.journal.put(response_id, parent, text)
        return stored

    def response_chain(self, response_id: str, partial: bool = False) -> tuple[list[str] | None, str | None]:
        if self.responses is None:
            return None, response_id
        return self.responses.lookup(response_id, partial)

    def get_response(self, response_id: str) -> str | None:
        return self.responses.get(response_id) if self.responses is not None else None

    async def delete_response(self, response_id: str) -> bool:
        if self.responses is None or not self.responses.delete(response_id):
            return False
        if self.journal is not None and self.cfg.responses_flush_s > 0:
            self.journal.delete(response_id)
        return True

    def response_stats(self) -> dict[str, int]:
        if self.responses is None:
            return {}
        return {**self.responses.stats(), **({"journal": dict(self.journal.stats)} if self.journal else {})}

    def _start_journal(self) -> None:
        if self.journal is not None and (self._journal_task is None or self._journal_task.done()):
            self._journal_task = asyncio.get_running_loop().create_task(self._journal_loop())

    async def _journal_loop(self) -> None:
        """This server's part of the records' folder (`response_store`): a heartbeat every `BEAT_S`; every
        `responses_flush_s` (where set) the store's changes since the last write as a journal segment, and a save
        of the store where one is due. A write that fails is retried with the next; a save that fails, after
        `RESPONSES_RETRY_S` (logged once a minute at most)."""
        jobs = [("heartbeat", BEAT_S, lambda: _in_thread(self.journal.beat))]
        if self.cfg.responses_flush_s > 0:
            jobs.append(("write", self.cfg.responses_flush_s, lambda: self._write_journal(save=False)))
        last, warned = [0.0] * len(jobs), 0.0
        while True:
            for i, (what, every, job) in enumerate(jobs):
                if time.monotonic() - last[i] < every:
                    continue
                last[i] = time.monotonic()
                try:
                    async with self._journal_lock:
                        await job()
                except Exception as e:  # noqa: BLE001 - the store serves on; the lines wait for the next write
                    if time.monotonic() - warned > 60:
                        warned = time.monotonic()
                        log.warning("stored responses' journal (%s) not written to %s: %s: %s", what,
                                    self.cfg.disk_cache, type(e).__name__, e)
            await asyncio.sleep(min(every for _, every, _ in jobs))

    async def _write_journal(self, save: bool) -> None:
        """(Under `_journal_lock`.) The lines queued as one segment, then a save of the store where one is due
        or `save` (a graceful stop's); what a save took over from quiet servers joins the store as its oldest."""
        journal, store = self.journal, self.responses
        lines = journal.take()
        if lines:
            try:
                await _in_thread(journal.write, lines)
            except BaseException as e:
                journal.requeue(lines)
                if not save or not isinstance(e, Exception):  # a save goes on: it holds these lines too
                    raise
        if save or (journal.due() and time.monotonic() >= self._save_after):
            try:  # the store's snapshot taken here (references), its lines made and written on the thread
                saved = await _in_thread(journal.compact, store.snapshot())
            except Exception:
                self._save_after = time.monotonic() + RESPONSES_RETRY_S
                raise
            store.apply(saved.rows, missing_only=True, oldest=True)

    async def _save_responses(self) -> None:
        """A graceful stop's save: the journal's loop stopped (once no write of its is in flight), then the lines
        it had queued and the whole store written."""
        async with self._journal_lock:
            if self._journal_task is not None:
                self._journal_task.cancel()
            await self._write_journal(save=True)

    def _start(self) -> None:
        if not self._tasks and self.dead is None:
            self._wake = asyncio.Event()
            loop = asyncio.get_running_loop()
            self._tasks = [loop.create_task(self._pump()), loop.create_task(self._send_loop()),
                           loop.create_task(self._watchdog())]

    # ---- requests ------------------------------------------------------------------------------------
    async def generate(self, request: Request):
        """Stream the request's events until it finishes; cancellation (client gone) aborts it."""
        self._start()
        rid = request.request_id
        q: asyncio.Queue = asyncio.Queue()
        self.queues[rid] = q
        if self.dead is not None:  # refused at once; nothing is queued for an engine that may not come back
            q.put_nowait(_failed(rid, self.dead))
        elif len(self.queues) > MAX_STREAMS:  # the actor's other calls (health, aborts) keep their room
            q.put_nowait(_failed(rid, f"{MAX_STREAMS} requests in flight: try again later"))
        else:
            self._send(Control(add=[request]))
        finished = False
        try:
            while True:
                ev: TokenEvent = await q.get()
                finished = ev.finish_reason is not None
                yield ev
                if finished:
                    return
        finally:
            self.queues.pop(rid, None)
            if not finished:
                self._send(Control(abort=[rid]))

    async def save_cache(self, budget_s: float) -> int:
        """At a graceful stop: the stored responses (`response_store.save_records`) and the engine's prefix cache
        (`GPUActor.save_cache`) to the disk tier's folder, for the next server on it. Returns the pages saved; 0
        where the engine is down."""
        if self._saving is None:  # one save, however many ingress replicas stop at once
            self._saving = asyncio.ensure_future(self._save_all(budget_s))
            self._saving.add_done_callback(self._saved)
        return await asyncio.shield(self._saving)

    def _saved(self, _: asyncio.Future) -> None:
        """After a save: the actor may serve on (one ingress replica of several stopped), so a later stop saves
        again and the journal's loop (stopped for the save) runs again."""
        self._saving = None
        if self.journal is not None:
            self._start_journal()

    async def _save_all(self, budget_s: float) -> int:
        """The prefix cache first (within `budget_s`), then the stored responses, taken here once it is done (so
        that responses stored meanwhile are in) and written by a thread, for `RESPONSES_SAVE_S` at most."""
        pages = 0
        if self.dead is None:
            try:
                pages = await self.gpu.save_cache.remote(budget_s)
            except Exception as e:  # noqa: BLE001 - the stored responses are saved all the same
                log.warning("prefix cache not saved: %s: %s", type(e).__name__, e)
        store = self.responses
        if self.journal is not None and (len(store) or store.deleted):
            write = asyncio.ensure_future(self._save_responses())
            done, _ = await asyncio.wait({write}, timeout=RESPONSES_SAVE_S)  # not cancelled: it may still land
            why = (f"{type(write.exception()).__name__}: {write.exception()}" if done and write.exception()
                   else None if done else f"not done within {RESPONSES_SAVE_S} s")
            if why is not None:  # a stop goes on without them
                log.warning("stored responses not saved to %s: %s", self.cfg.disk_cache, why)
        return pages

    async def abort(self, request_id: str) -> None:
        self._send(Control(abort=[request_id]))

    # ---- the loops -----------------------------------------------------------------------------------
    def _send(self, control: Control) -> None:
        self.pending.merge(control)
        if self._wake is not None:
            self._wake.set()

    async def _send_loop(self) -> None:
        """One control message in flight at a time, so the GPU actor applies them in order."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self.pending.empty() or self.dead is not None:
                continue
            control, self.pending = self.pending, Control()
            try:
                await self.gpu.control.remote(control)
            except Exception as exc:  # noqa: BLE001 - the GPU actor is gone
                self._engine_lost(exc)

    async def _watchdog(self, every_s: float = 1.0, silent_s: float = 2.0, timeout_s: float = 10.0) -> None:
        """While streams are open and reports have stopped, ask the GPU actor whether it is alive; a dead or
        unresponsive one fails every open stream (503) instead of leaving them waiting for ever."""
        while self.dead is None:
            await asyncio.sleep(every_s)
            if not self.queues or time.time() - self.last_report_at < silent_s:
                continue
            try:
                await asyncio.wait_for(asyncio.wrap_future(self.gpu.stats.remote().future()), timeout_s)
            except Exception as exc:  # noqa: BLE001 - dead actor or no answer: the engine is lost
                self._engine_lost(exc)

    def _engine_lost(self, exc: BaseException) -> None:
        if self.dead is None:
            self.dead = f"the engine stopped: {type(exc).__name__}"
        self._lost_ids.update(self.queues)  # the requests it held: the open streams, and those its last view
        if self.last_report is not None:   # showed (one whose abort it had not applied yet)
            self._lost_ids.update(s.request_id for s in self.last_report.view.seqs)
        self._fail_all(self.dead)
        if self._recovering is None or self._recovering.done():
            self._recovering = asyncio.get_running_loop().create_task(self._recover())

    async def _recover(self, wait_s: float = 1.0) -> None:
        """A new GPU actor in place of the lost one (its tiers kept); streams resume being served once it loads."""
        current = asyncio.current_task()
        for t in self._tasks:
            if t is not current:
                t.cancel()
        self._tasks = []
        while True:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(self.gpu, no_restart=True)
            await asyncio.sleep(wait_s)
            try:
                self.gpu = self._new_gpu()
                await self.gpu.info.remote()
                break
            except Exception:  # noqa: BLE001 - try again
                wait_s = min(30.0, wait_s * 2)
        await self._drop_lost_units()
        self.policy = make_policy(self.cfg)
        self.pending, self.last_report, self.dead = Control(), None, None
        self.last_report_at = time.time()
        self.restarts += 1
        self.metrics.last = {}  # the new engine counts from zero: its first report's counts are all new
        self._start()

    async def _drop_lost_units(self) -> None:
        """The tier units of the lost engine's requests (its paused conversations') dropped once its successor is up
        (a pause the lost one sent before it was killed has landed by then, and no request has reached the new
        one): their streams failed, so nothing resumes them, and ranked by their arrival (needed soonest) they
        would hold the tiers' room for good, every later pause and evicted page refused or spilled past them. The
        RAM tier first (a unit it is spilling is deleted from the disk once written), each within `TIER_CALL_S`
        (a tier that cannot be reached keeps them, and the recovery goes on)."""
        ids, self._lost_ids = sorted(self._lost_ids), set()
        for name in ("ram", "disk"):
            handle = (self.tiers or {}).get(name)
            if not ids or handle is None:
                continue
            try:
                await asyncio.wait_for(_awaited(handle.drop_conversations.remote(ids)), TIER_CALL_S)
            except Exception as e:  # noqa: BLE001 - a dead or stuck tier actor
                log.warning("the lost engine's paused conversations stay in the %s tier: %s: %s", name,
                            type(e).__name__, e)

    async def _pump(self) -> None:
        """The GPU actor's reports, for as long as its stream lasts; a stream that ends, by an error (the actor gone)
        or not (its driver stopped, while the actor may still answer calls), is a lost engine: no stream may wait
        for ever."""
        try:
            await self._consume()
        except Exception as exc:  # noqa: BLE001 - the GPU actor is gone
            self._engine_lost(exc)
        else:
            self._engine_lost(EngineStreamEnded("its report stream ended"))

    def _fail_all(self, message: str) -> None:
        for rid, q in list(self.queues.items()):
            q.put_nowait(_failed(rid, message))

    async def _consume(self) -> None:
        stream = self.gpu.run.options(num_returns="streaming").remote()
        async for ref in stream:
            report: StepReport = await ref
            t0 = self.last_report_at = time.time()
            self.latencies_us.append(max(0.0, t0 - report.stats.get("sent_at", t0)) * 1e6)
            for ev in report.events:
                q = self.queues.get(ev.request_id)
                if q is not None:
                    q.put_nowait(ev)
            decision = self.policy.decide(report.view)
            if decision is not None and not decision.empty():
                self._send(decision)
            self.last_report = report
            self.reports += 1
            self.metrics.update(report.stats)
            self.overheads_us.append((time.time() - t0) * 1e6)

    # ---- observability -------------------------------------------------------------------------------
    async def stats(self) -> dict[str, Any]:
        r = self.last_report
        if r is not None:
            engine = dict(r.stats)
        elif self.dead is not None:  # no report yet, and the engine is being replaced: its new actor may still
            engine = {}  # load for a while (or never start), and a call to it would wait as long
        else:
            engine = await self.gpu.stats.remote()
        engine.pop("sent_at", None)
        view = r.view if r is not None else None
        out: dict[str, Any] = {
            **engine,  # the engine's counters and gauges at the top level (as the in-process client has them)
            "slots": [] if view is None else [
                {"request_id": s.request_id, "conversation": s.conversation, "state": s.status,
                 "prompt_tokens": s.num_prompt, "computed": s.num_computed, "output_tokens": s.num_output,
                 "pages": s.num_pages} for s in view.seqs],
            "queue": {"streams": len(self.queues), "waiting": engine.get("waiting", 0)},
            "policy": self.policy.snapshot(),
            "control": {"reports": self.reports, "overhead_us_p50": _p50(self.overheads_us),
                        "delivery_us_p50": _p50(self.latencies_us),
                        "step_compute_ms_last": None if r is None else r.compute_s * 1e3},
            "uptime_seconds": time.time() - self.started,  # the in-process client's name
        }
        if self.tiers is not None:
            out["tiers"] = await _tier_stats(self.tiers)
        if self.responses is not None:
            out["responses_store"] = self.response_stats()
        return out


class RayMetrics:
    """The engine's counters and gauges exported through `ray.util.metrics` (Ray dashboard / Prometheus)."""

    COUNTERS = ("generated_tokens", "computed_prompt_tokens", "reused_prompt_tokens", "steps", "pauses",
                "resumes", "finished", "aborted", "restored_pages", "offloaded_pages", "lost_pages", "lost_bundles",
                "restored_snapshots", "demoted_pages", "saved_pages", "drafted_tokens", "accepted_tokens", "withheld_steps")
    GAUGES = ("running", "waiting", "paused", "free_pages", "used_pages", "cached_pages")

    def __init__(self, app: str):
        from ray.util import metrics

        tags = {"app": app}
        self.counters = {k: metrics.Counter(f"decapybara_{k}_total", tag_keys=("app",)) for k in self.COUNTERS}
        self.gauges = {k: metrics.Gauge(f"decapybara_{k}", tag_keys=("app",)) for k in self.GAUGES}
        for m in (*self.counters.values(), *self.gauges.values()):
            m.set_default_tags(tags)
        self.last: dict[str, float] = {}

    def update(self, stats: dict[str, Any]) -> None:
        for k, c in self.counters.items():
            v = float(stats.get(k, 0))
            if v > self.last.get(k, 0.0):
                c.inc(v - self.last.get(k, 0.0))
            self.last[k] = v
        for k, g in self.gauges.items():
            g.set(float(stats.get(k, 0)))


def _failed(request_id: str, message: str) -> TokenEvent:
    """A request's last event where the engine is lost or down (a 503)."""
    from decapybara.engine.sequence import FinishReason

    return TokenEvent(request_id, [], finish_reason=FinishReason.ABORT, error=message, error_type="CapacityError")


def _p50(xs: deque[float]) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[len(s) // 2]


async def _tier_stats(tiers: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for name, handle in tiers.items():
        try:
            out[name] = await handle.stats.remote()
        except Exception as exc:  # noqa: BLE001 - a dead tier actor must not take /stats down with it
            out[name] = {"error": f"{type(exc).__name__}"}
    return out


def scheduler_handle(app_config: dict[str, Any]) -> Any:
    """The app's named SchedulerActor, created on first use (one per app name in the cluster). Its concurrent calls
    cover `MAX_STREAMS` open streams and `CONTROL_CALLS` more, so that however many streams are open, health
    checks, aborts, stats and the stored responses are answered."""
    name = f"{app_config.get('name', 'decapybara')}-scheduler"
    cls = ray.remote(SchedulerActor).options(name=name, get_if_exists=True, num_cpus=0,
                                             max_concurrency=MAX_STREAMS + CONTROL_CALLS)
    return cls.remote(app_config)


class EngineStreamEnded(RuntimeError):
    """The GPU actor's report stream ended without an error."""


async def _awaited(ref: Any) -> Any:
    """An actor call's result (an ObjectRef awaited), as a coroutine for `asyncio.wait_for`."""
    return await ref


async def _in_thread(fn: Any, *args: Any) -> Any:
    """`fn(*args)` on a thread, awaited whole: a cancellation waits for the thread to finish before it is raised,
    so a lock held around this call covers the thread's work (the journal's writes and saves never overlap)."""
    fut = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        await asyncio.wait({fut})
        raise
