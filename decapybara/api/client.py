"""The engine as the HTTP layer sees it: `EngineClient`, and `LocalEngineClient` running an `Engine` in a thread.

The Ray Serve deployment implements `EngineClient` with calls to the scheduler actor; `LocalEngineClient` runs a
real in-process `Engine` for tests and single-process serving.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol, runtime_checkable

from decapybara.api.response_store import DEFAULT_BUDGET_BYTES, LocalResponses
from decapybara.engine.engine import Engine
from decapybara.engine.sequence import Request, TokenEvent
from decapybara.errors import DecapybaraError

log = logging.getLogger(__name__)


@runtime_checkable
class EngineClient(Protocol):
    """An async engine. Contracts:

    - `generate` yields the request's `TokenEvent`s, the last one with a `finish_reason`. Errors that make the
      request unacceptable (InvalidRequestError, ContextOverflowError) are raised from the first `__anext__`,
      before any event, or reported by an event whose `error` / `error_type` fields are set (for engines in
      another process; the API layer raises them, see `streams.engine_events`). A consumer that stops early (``aclose()``, GeneratorExit, CancelledError, e.g. a client
      disconnect) aborts the request, and the engine frees its slot within one step.
    - `abort` cancels a request by id (a no-op for unknown or finished ones).
    - `stats` returns a JSON-able dict of engine counters and gauges (see `Engine.snapshot_stats`).
    - model facts: the served `model_name`, the `tokenizer` (chat rendering is done by the caller), the context
      length `max_model_len` and the model's `vocab_size`.
    """

    model_name: str
    tokenizer: Any
    max_model_len: int
    vocab_size: int

    def generate(self, request: Request) -> AsyncIterator[TokenEvent]: ...

    async def abort(self, request_id: str) -> None: ...

    async def stats(self) -> dict[str, Any]: ...


class _Route:
    """Where one request's events go: a queue owned by the event loop that awaits them."""

    __slots__ = ("loop", "queue")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[TokenEvent | BaseException] = asyncio.Queue()

    def put(self, item: TokenEvent | BaseException) -> None:
        """Thread-safe: hand an event (or the exception ending the request) to the consumer's loop."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed: nobody is listening any more
            pass


class LocalEngineClient:
    """Runs `engine` in ONE background thread and serves any number of asyncio consumers (on any loops).

    The thread owns the engine (it is not thread-safe): it applies queued commands (add, abort, stats), then
    steps while the engine has work, and sleeps on a condition when idle. Commands from other threads are
    queued under the condition and run before the next step, so an abort frees the slot within one step.
    Events are routed to per-request asyncio queues with ``loop.call_soon_threadsafe``.
    """

    def __init__(self, engine: Engine, model_name: str = "decapybara", start: bool = True,
                 responses_budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        """`responses_budget_bytes`: the Responses API's store of responses (0: none kept)."""
        if engine.tokenizer is None:
            raise ValueError("LocalEngineClient needs an engine built with a tokenizer")
        self.engine = engine
        self.model_name = model_name
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.model.cfg.vocab_size
        self._cond = threading.Condition()
        self._commands: deque[Callable[[], None]] = deque()
        self._routes: dict[str, _Route] = {}  # guarded by _cond
        self._stop = False
        self._thread: threading.Thread | None = None
        self._started_at = time.time()
        self._stats: dict[str, Any] = engine.snapshot_stats()  # replaced (never mutated) by the engine thread
        self._step_errors = 0
        self.responses = LocalResponses(responses_budget_bytes) if responses_budget_bytes > 0 else None
        if start:
            self.start()

    # ---- lifecycle -------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="decapybara-engine", daemon=True)
            self._thread.start()

    def close(self, timeout: float | None = 5.0) -> None:
        """Stop the engine thread (pending requests get an error) and wait for it."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    # ---- EngineClient ----------------------------------------------------------------------------------
    async def generate(self, request: Request) -> AsyncIterator[TokenEvent]:
        rid = request.request_id
        route = _Route(asyncio.get_running_loop())
        with self._cond:
            if self._stop:
                raise DecapybaraError("the engine client is closed")
            if rid in self._routes:
                raise DecapybaraError(f"request id {rid!r} is already being served")
            self._routes[rid] = route
        self._submit(lambda: self._add(request, route))
        finished = False
        try:
            while True:
                item = await route.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.finish_reason is not None:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            with self._cond:
                self._routes.pop(rid, None)
            if not finished:
                # NOTE: synchronous on purpose: this runs under cancellation, where an await would be cut short.
                self._submit(lambda: self.engine.abort(rid))

    async def abort(self, request_id: str) -> None:
        self._submit(lambda: self._abort(request_id))

    async def stats(self) -> dict[str, Any]:
        stats = dict(self._stats)
        with self._cond:
            stats["open_requests"] = len(self._routes)
        stats["engine_errors"] = self._step_errors
        stats["uptime_seconds"] = time.time() - self._started_at
        if self.responses is not None:
            stats["responses_store"] = await self.responses.stats()
        return stats

    # ---- the engine thread -----------------------------------------------------------------------------
    def _submit(self, command: Callable[[], None]) -> None:
        with self._cond:
            self._commands.append(command)
            self._cond.notify()

    def _add(self, request: Request, route: _Route) -> None:
        with self._cond:
            if self._routes.get(request.request_id) is not route:
                return  # the consumer left before the request reached the engine
        try:
            self.engine.add_request(request)
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which maps it to an HTTP error
            self._deliver(request.request_id, exc)

    def _abort(self, request_id: str) -> None:
        event = self.engine.abort(request_id)
        if event is not None:
            self._deliver(request_id, event)

    def _deliver(self, request_id: str, item: TokenEvent | BaseException) -> None:
        with self._cond:
            route = self._routes.get(request_id)
            if route is not None and (isinstance(item, BaseException) or item.finish_reason is not None):
                del self._routes[request_id]
        if route is not None:
            route.put(item)

    def _run(self) -> None:
        engine = self.engine
        while True:
            with self._cond:
                while not self._commands and not self._stop and not engine.has_work():
                    self._cond.wait()
                if self._stop:
                    break
                commands = list(self._commands)
                self._commands.clear()
            for command in commands:
                try:
                    command()
                except Exception:  # a failed command must not kill the engine thread
                    log.exception("engine command failed")
            if engine.has_work():
                try:
                    events = engine.step()
                except Exception as exc:
                    self._step_errors += 1
                    log.error("engine step failed; aborting %d request(s)", len(engine.seqs), exc_info=exc)
                    self._fail_all(f"the engine failed: {type(exc).__name__}: {exc}")
                    events = []
                for event in events:
                    self._deliver(event.request_id, event)
            self._stats = engine.snapshot_stats()
        self._fail_all("the engine client was closed")

    def _fail_all(self, message: str) -> None:
        """Abort every request in the engine and end every open stream with an error saying `message`.

        Used when a step raised (the engine's state is suspect) and on close.
        """
        for rid in list(self.engine.seqs):
            try:
                self.engine.abort(rid)
            except Exception:
                log.exception("abort after a failed step failed")
        with self._cond:
            routes, self._routes = self._routes, {}
        for route in routes.values():
            route.put(DecapybaraError(message))
