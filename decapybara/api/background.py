"""Background responses (the Responses API's ``background: true``): a response generated apart from the request
that asked for it, which the client polls (GET /v1/responses/{id}), follows as a stream it may leave and join
again (``stream=true``, ``starting_after``), or cancels (POST /v1/responses/{id}/cancel).

Contracts:
- a run is an asyncio task of the ingress replica that took its request; it stores its response as it goes
  (`Run` driven by `drive`): "queued" before it starts, "in_progress" with the items made so far every
  `UPDATE_S` while it runs, and its end ("completed" / "incomplete", "failed", or "cancelled" where its request was
  aborted). Each store is awaited before the next, so they land in order.
- the run's stream lines (the typed events, numbered from 0) are kept while it runs and for `KEEP_S` after
  (at most `KEEP_RUNS` ended runs), so a stream can be followed from any sequence number on that replica.
- a response deleted while it runs is not stored again (the run checks before each store) and is aborted.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from decapybara.api.errors import ApiError
from decapybara.engine.sequence import FinishReason, TokenEvent

UPDATE_S = 1.0  # a running response is stored again with its items so far at most this often
KEEP_S = 600.0  # an ended run's stream lines are kept this long for streams that join it late
KEEP_RUNS = 64  # ... and at most this many ended runs
CANCEL_WAIT_S = 10.0  # a cancel waits this long for the run to store its end (else stores "cancelled" itself)
SETTLED = frozenset({"completed", "incomplete", "failed", "cancelled"})


@dataclass(eq=False)
class Run:
    """One background response's run: its stream lines so far (line i is the event numbered i), whether it has
    ended, and an event set at every change (replaced after each, so a follower waits for the next)."""

    rid: str
    lines: list[str] = field(default_factory=list)
    done: bool = False
    ended_at: float = 0.0
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
        return run

    def _prune(self) -> None:
        now = time.monotonic()
        ended = sorted((r for r in self.runs.values() if r.done), key=lambda r: r.ended_at)
        for i, run in enumerate(ended):
            if now - run.ended_at > self.keep_s or i < len(ended) - self.keep_runs:
                del self.runs[run.rid]

    async def close(self) -> None:
        """Cancel the runs still going (their requests are aborted as their streams close)."""
        tasks = [r.task for r in self.runs.values() if r.task is not None and not r.task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def drive(run: Run, stream: Any, events: AsyncIterator[TokenEvent], store: Any,
                record: Callable[[Any], dict[str, Any]], to_error: Callable[[BaseException], ApiError],
                update_s: float = UPDATE_S) -> None:
    """Run a background response: `stream` (an `openai_responses.ResponseStream`) turns `events` into the run's
    lines; its snapshots and its end (`stream.final`, as `record` makes it a store record) go to `store`
    (`put_now`, awaited), unless the response was deleted meanwhile. An aborted request ends "cancelled", a
    failure "failed" (`to_error`'s error)."""
    stored = True  # whether the store still has the record (a client's DELETE takes it)

    async def put(response: Any) -> None:
        nonlocal stored
        stored = stored and await store.get(run.rid) is not None and await store.put_now(record(response))

    try:
        run.add(stream.start(None))
        await put(stream.snapshot("in_progress"))
        last = time.monotonic()
        async for ev in events:
            if ev.finish_reason == FinishReason.ABORT:
                run.add(stream.cancelled())
                break
            run.add(stream.event(ev))
            if ev.finish_reason is not None:
                run.add(stream.end(ev))
                break
            if stored and time.monotonic() - last >= update_s:
                await put(stream.snapshot("in_progress"))
                last = time.monotonic()
        else:
            run.add(stream.error(ApiError(500, "the engine stream ended without a finish reason")))
    except asyncio.CancelledError:
        raise  # the replica is going away: nothing is stored (the response stays as last stored)
    except Exception as exc:  # noqa: BLE001 - the run's end, stored as the response's
        run.add(stream.error(to_error(exc)))
    finally:
        await events.aclose()  # aborts the request where the run ended before it did
        if stream.final is not None and not asyncio.current_task().cancelling():
            try:
                await put(stream.final)
            finally:
                run.end()
        else:
            run.end()


async def settled(store: Any, rid: str, run: Run | None, wait_s: float = CANCEL_WAIT_S) -> dict[str, Any] | None:
    """The stored response `rid` once its status is settled (its run, where on this replica, ended first), or
    as it stands after `wait_s` seconds; None where it is not stored."""
    if run is not None and run.task is not None:
        await asyncio.wait({run.task}, timeout=wait_s)
    deadline = time.monotonic() + wait_s
    while True:
        record = await store.get(rid)
        if record is None or record["response"]["status"] in SETTLED or time.monotonic() >= deadline:
            return record
        await asyncio.sleep(0.05)
