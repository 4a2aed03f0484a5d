"""Background responses (the Responses API's ``background: true``): a response generated apart from the request
that asked for it, which the client polls (GET /v1/responses/{id}), follows as a stream it may leave and join
again (``stream=true``, ``starting_after``), or cancels (POST /v1/responses/{id}/cancel).

Contracts:
- a run is an asyncio task of the ingress replica that took its request; it stores its response as it goes
  (`Run` driven by `drive`): "queued" before it starts, then every `UPDATE_S`, events or none, as it stands
  ("queued" until its first token, then "in_progress" with the items made so far), each record with its time
  (`beat`), and at its end "completed" / "incomplete", "failed" (a failure, an abort the server made, or the
  server stopping), or "cancelled" (a client's cancel). Each store is awaited before the next, so they land in
  order, and is the store's `update`: it lands only while the record is there and has not ended, so a client's
  DELETE or a cancel settled elsewhere stops the run (its request aborted) and is never undone.
- a record not settled whose `beat` is older than `ORPHAN_S` lost its run (the server that ran it crashed):
  `orphaned` tells, and readers settle it "failed" (`settle`).
- the run's stream lines (the typed events, numbered from 0) are kept while it runs and for `KEEP_S` after
  (at most `KEEP_RUNS` ended runs), so a stream can be followed from any sequence number on that replica.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from decapybara.api.common import aborted_error
from decapybara.api.errors import ApiError
from decapybara.api.response_store import SETTLED
from decapybara.api.streams import Heartbeat
from decapybara.engine.sequence import FinishReason, TokenEvent

log = logging.getLogger(__name__)

UPDATE_S = 1.0  # a running response is stored again with its items so far at most this often
KEEP_S = 600.0  # an ended run's stream lines are kept this long for streams that join it late
KEEP_RUNS = 64  # ... and at most this many ended runs
CANCEL_WAIT_S = 10.0  # a cancel waits this long for the run to store its end (else settles it "cancelled" itself)
ORPHAN_S = 30.0  # a record not settled whose run has not stored it for this long lost its run
FINAL_TRIES = 3  # a run's end is stored with this many tries


@dataclass(eq=False)
class Run:
    """One background response's run: its stream lines so far (line i is the event numbered i), whether it has
    ended, whether a client asked to cancel it, and an event set at every change (replaced after each, so a
    follower waits for the next)."""

    rid: str
    lines: list[str] = field(default_factory=list)
    done: bool = False
    ended_at: float = 0.0
    cancel_asked: bool = False
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None

    def add(self, lines: list[str]) -> None:
        if lines:
            self.lines += lines
            self._wake()

    def end(self) -> None:
        self.done, self.ended_at = True, time.monotonic()
        self._wake()

    def _wake(self) -> None:
        changed, self.changed = self.changed, asyncio.Event()
        changed.set()

    async def follow(self, after: int, idle_s: float, idle_line: str) -> AsyncIterator[str]:
        """The lines numbered past `after`, then each as it comes, `idle_line` after every `idle_s` seconds
        without one, until the run has ended."""
        i = max(after + 1, 0)
        while True:
            changed = self.changed
            while i < len(self.lines):
                yield self.lines[i]
                i += 1
            if self.done:
                return
            try:
                await asyncio.wait_for(changed.wait(), idle_s)
            except TimeoutError:
                yield idle_line


class BackgroundRuns:
    """The background runs of one ingress replica: those running and those ended within `KEEP_S` (at most
    `KEEP_RUNS` of them)."""

    def __init__(self, keep_s: float = KEEP_S, keep_runs: int = KEEP_RUNS) -> None:
        self.keep_s, self.keep_runs = keep_s, keep_runs
        self.runs: dict[str, Run] = {}

    def get(self, rid: str) -> Run | None:
        self._prune()
        return self.runs.get(rid)

    def start(self, rid: str, body: Callable[[Run], Awaitable[None]]) -> Run:
        """A run of `body` (a coroutine function of the run, which ends it), kept by id."""
        self._prune()
        run = Run(rid)
        self.runs[rid] = run
        run.task = asyncio.ensure_future(body(run))
        run.task.add_done_callback(_logged)
        return run

    def _prune(self) -> None:
        now = time.monotonic()
        ended = sorted((r for r in self.runs.values() if r.done), key=lambda r: r.ended_at)
        for i, run in enumerate(ended):
            if now - run.ended_at > self.keep_s or i < len(ended) - self.keep_runs:
                del self.runs[run.rid]

    async def close(self) -> None:
        """Stop the runs still going: each stores its response "failed" (the server stopped) and aborts its
        request."""
        tasks = [r.task for r in self.runs.values() if r.task is not None and not r.task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _logged(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("a background run failed", exc_info=task.exception())


def stamped(record: dict[str, Any]) -> dict[str, Any]:
    """`record` with the time it is stored at (`beat`: what `orphaned` reads)."""
    return {**record, "beat": time.time()}


def orphaned(record: dict[str, Any], now: float | None = None) -> bool:
    """Whether a stored background response lost its run: not settled, and not stored for `ORPHAN_S`."""
    now = time.time() if now is None else now
    return "response" in record and record["response"]["status"] not in SETTLED and now - record.get("beat", 0.0) > ORPHAN_S


async def settle(store: Any, record: dict[str, Any], status: str, error: dict[str, Any] | None = None
                 ) -> dict[str, Any]:
    """Store `record`'s response ended with `status` (and `error`), where it has not ended meanwhile; the record as
    stored then."""
    response = {**record["response"], "status": status, **({"error": error} if error else {})}
    if await store.update(stamped({**record, "response": response})):
        return {**record, "response": response}
    return await store.get(record["id"]) or {**record, "response": response}


async def drive(run: Run, stream: Any, events: AsyncIterator[TokenEvent], store: Any,
                record: Callable[[Any], dict[str, Any]], to_error: Callable[[BaseException], ApiError],
                update_s: float = UPDATE_S, after: Callable[[dict[str, Any]], Awaitable[None]] | None = None) -> None:
    """Run a background response: `stream` (an `openai_responses.ResponseStream`) turns `events` into the run's
    lines; the response as it stands every `update_s` and its end (`stream.final`, as `record` makes it a store
    record) go to `store` (`update`, awaited; a store that fails is logged, the run goes on). Where an update is
    refused (the response deleted, or settled by a cancel elsewhere), the run stops: its request is aborted and
    nothing more is stored. An aborted request ends "cancelled" where a client asked (`Run.cancel_asked`), else
    "failed"; a failure "failed" (`to_error`'s error); the server stopping (the task cancelled) "failed". `after`:
    awaited with the end's record of a reply that ended ("completed" / "incomplete"), before that end is stored
    and its events sent (a conversation's add: a client that reads the end reads the turn in the conversation)."""
    beat = Heartbeat(events)  # its first read starts the request before anything is stored
    kept = True  # whether the store still takes the response's updates

    async def put(response: Any) -> None:
        nonlocal kept
        try:
            kept = await store.update(stamped(record(response)))
        except Exception:  # a store that fails now may not later: the run goes on
            log.warning("background response %s: its store failed", run.rid, exc_info=True)

    tail: list[str] = []  # the end's events, sent once the end is stored (so a follower never reads past it)
    try:
        run.add(stream.start(None, queued=True))
        status, last = "queued", time.monotonic()
        while kept:
            ev = await beat.next(max(0.0, update_s - (time.monotonic() - last)))
            if ev is not None:
                if ev.finish_reason == FinishReason.ABORT:
                    tail = stream.cancelled() if run.cancel_asked else stream.error(aborted_error())
                    break
                status = "in_progress"
                if ev.finish_reason is not None:
                    tail = stream.event(ev) + stream.end(ev)
                    break
                run.add(stream.event(ev))
            if time.monotonic() - last >= update_s:
                await put(stream.snapshot(status))
                last = time.monotonic()
    except StopAsyncIteration:
        tail = stream.error(ApiError(500, "the engine stream ended without a finish reason"))
    except asyncio.CancelledError:  # the replica is stopping
        tail = stream.error(ApiError(503, "the server stopped while this response ran"))
    except Exception as exc:  # noqa: BLE001 - the run's end, stored as the response's
        tail = stream.error(to_error(exc))
    finally:
        await beat.close()  # aborts the request where the run ended before it did
        try:
            for _ in range(FINAL_TRIES if kept and stream.final is not None else 0):
                try:
                    final = record(stream.final)
                    if after is not None and stream.final.status in ("completed", "incomplete"):
                        await after(final)  # before the end is stored: a client polling to it reads the turn
                    after = None
                    await store.update(stamped(final))
                    break
                except Exception:  # tried again, then left as last stored (`orphaned` tells)
                    log.warning("background response %s: storing its end failed", run.rid, exc_info=True)
                    await asyncio.sleep(0.2)
        finally:
            run.add(tail)
            run.end()


async def settled(store: Any, rid: str, run: Run | None, abort: Callable[[], Awaitable[None]],
                  wait_s: float = CANCEL_WAIT_S) -> dict[str, Any] | None:
    """Cancel background response `rid`: abort its request (again every 0.25 s, so that an abort overtaking the
    request's arrival at the engine is not lost) until its run (where on this replica) has ended or the stored
    response has settled, for at most `wait_s` seconds; then the stored record (None where none is)."""
    deadline = time.monotonic() + wait_s
    if run is not None:
        run.cancel_asked = True
    while True:
        await abort()
        if run is not None and run.task is not None:
            await asyncio.wait({run.task}, timeout=0.25)
            if run.task.done():
                return await store.get(rid)
        else:
            await asyncio.sleep(0.25)
        record = await store.get(rid)
        if record is None or record["response"]["status"] in SETTLED or time.monotonic() >= deadline:
            return record
