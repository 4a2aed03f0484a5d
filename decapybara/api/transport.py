"""HTTP plumbing under the routes: error responses in each API's shape, body limits, the API-key check,
server-sent-event responses and the loops that drive engine streams into them.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import re
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, Protocol

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from decapybara.api.common import Collected
from decapybara.api.errors import ApiError, to_api_error
from decapybara.api.streams import Heartbeat, sse_data, sse_event
from decapybara.engine.sequence import TokenEvent

OPENAI, ANTHROPIC, RESPONSES = "openai", "anthropic", "responses"
ROUTES = ("/health", "/stats", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions",
          "/v1/responses", "/v1/responses/input_tokens", "/v1/messages", "/v1/messages/count_tokens")


def api_of(path: str) -> str:
    """Which API's error shape a path answers in (the Responses API's bodies are OpenAI's; its stream's error
    events its streamer's own, `openai_responses.ResponseStream.error`)."""
    if path.startswith("/v1/messages"):
        return ANTHROPIC
    return RESPONSES if path.startswith("/v1/responses") else OPENAI


def error_response(err: ApiError, api: str, headers: Mapping[str, str] | None = None) -> JSONResponse:
    if api == ANTHROPIC:
        return JSONResponse(err.anthropic_body(), status_code=err.anthropic_status(), headers=headers)
    return JSONResponse(err.openai_body(), status_code=err.status, headers=headers)


def error_line(err: ApiError, api: str) -> str:
    """An error inside a stream whose headers are already sent."""
    if api == ANTHROPIC:
        return sse_event("error", json.dumps(err.anthropic_body(), ensure_ascii=False))
    return sse_data(json.dumps(err.openai_body(), ensure_ascii=False))


async def read_body(request: HttpRequest, limit: int) -> bytes:
    """The body, or ApiError 413 when it is over `limit` bytes.

    NOTE: an over-long body is still read (and dropped) up to a hard cap, so the client, which writes its whole
    body before reading, gets the 413 instead of a broken connection.
    """
    hard_cap = max(4 * limit, 64 << 20)
    too_large = ApiError(413, f"the request body is larger than the limit of {limit} bytes")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > hard_cap:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > hard_cap:
            raise too_large
        if size <= limit:
            chunks.append(chunk)
    if size > limit:
        raise too_large
    return b"".join(chunks)


# A JSON \\u escape of a surrogate (a pair or a lone one) where its backslash is no escaped backslash's second.
_SURROGATE_ESCAPE = re.compile(
    rb"(?<!\\)((?:\\\\)*)(\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}|\\u[dD][89a-fA-F][0-9a-fA-F]{2})")


def _lone_to_replacement(m: re.Match[bytes]) -> bytes:
    return m.group(0) if len(m.group(2)) == 12 else m.group(1) + rb"\ufffd"


def well_formed_json(body: bytes) -> bytes:
    """`body` with every lone surrogate escape (``"\\ud83d"`` not followed by its low half, or a stray low half)
    written as U+FFFD's, as decoding invalid UTF-8 does. JavaScript clients send them where they cut a string
    inside a surrogate pair (JSON.stringify escapes the half it keeps); the JSON parser refuses them as invalid
    JSON, and a conversation that once held one would be refused on every later turn."""
    if b"\\u" not in body:
        return body
    return _SURROGATE_ESCAPE.sub(_lone_to_replacement, body)


class EdgeMiddleware:
    """Pure ASGI middleware: the API-key check (everything but /health, when a key is set; `Authorization:
    Bearer <key>` or `x-api-key: <key>`), and HTTP response counts by route and status for /metrics."""

    def __init__(self, app: ASGIApp, api_key: str | None, counts: Counter[tuple[str, int]]) -> None:
        self.app, self.api_key, self.counts = app, api_key, counts

    def _authorised(self, scope: Scope) -> bool:
        """Whether the key is given in either header (an Anthropic client configured with both an API key and an
        auth token sends both: one of them someone else's). Compared as the bytes the client sent (a key's
        non-ASCII characters arrive as their UTF-8)."""
        if self.api_key is None or scope["path"] == "/health":
            return True
        key = self.api_key.encode()
        given = []
        for name, value in scope.get("headers") or ():
            if name == b"x-api-key":
                given.append(value.strip())
            elif name == b"authorization" and value[:7].lower() == b"bearer ":
                given.append(value[7:].strip())
        # every header compared (constant time each), so the time says nothing of which one matched
        return sum(hmac.compare_digest(g, key) for g in given if g) > 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        route = path if path in ROUTES else ("/v1/models" if path.startswith("/v1/models/") else
                                             "/v1/responses/{id}" if path.startswith("/v1/responses/") else "other")

        head = scope["method"] == "HEAD"

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.counts[(route, int(message["status"]))] += 1
            elif head and message["type"] == "http.response.body" and message.get("body"):
                message = {**message, "body": b""}  # a HEAD's answer: the GET's headers, no body
            await send(message)

        if self._authorised(scope):
            await self.app(scope, receive, counting_send)
            return
        err = ApiError(401, "invalid or missing API key (send it as 'Authorization: Bearer <key>' or 'x-api-key')",
                       code="invalid_api_key")
        await error_response(err, api_of(path))(scope, receive, counting_send)


class EventStreamResponse(StreamingResponse):
    """A text/event-stream response that always closes its body iterator, whatever ended the response
    (normal end, client disconnect, server error), so the engine request is aborted promptly."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], disconnects: tuple[type[BaseException], ...] = ()) -> None:
        """`disconnects`: what the transport raises into a response whose client left (`create_app`'s): the
        response then ends quietly, as a plain disconnect does."""
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.disconnects = disconnects

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except self.disconnects:
            pass
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


class Streamer(Protocol):
    """Turns engine events into SSE lines for one API (OpenAI chunks, Anthropic events)."""

    def start(self, first: TokenEvent | None) -> list[str]: ...

    def event(self, ev: TokenEvent) -> list[str]: ...

    def end(self, last: TokenEvent) -> list[str]: ...


async def drive_stream(streamer: Streamer, beat: Heartbeat, first: TokenEvent | None, api: str,
                       interval: float, idle_line: str,
                       disconnects: tuple[type[BaseException], ...] = ()) -> AsyncIterator[str]:
    """The SSE body: the streamer's lines for every event, `idle_line` after every `interval` seconds without
    one, and an error event (in the API's shape) if the stream fails after the headers went out
    (`to_api_error`'s, with `disconnects`)."""
    try:
        for line in streamer.start(first):
            yield line
        ev = first
        while True:
            if ev is not None:
                for line in streamer.event(ev):
                    yield line
                if ev.finish_reason is not None:
                    for line in streamer.end(ev):
                        yield line
                    return
            ev = await beat.next(interval)
            if ev is None:
                yield idle_line
    except StopAsyncIteration:
        for line in _failure(streamer, ApiError(500, "the engine stream ended without a finish reason"), api):
            yield line
    except Exception as exc:  # noqa: BLE001 - reported to the client in the stream
        for line in _failure(streamer, to_api_error(exc, disconnects), api):
            yield line
    finally:
        await beat.close()


def _failure(streamer: Streamer, err: ApiError, api: str) -> list[str]:
    """The lines that end a failed stream: the streamer's own (`error`, where it has one: the Responses API's
    numbered events), else the API's error line."""
    own = getattr(streamer, "error", None)
    return own(err) if own is not None else [error_line(err, api)]


async def start_stream(events: AsyncIterator[TokenEvent], wait: float) -> tuple[Heartbeat, TokenEvent | None]:
    """Wait up to `wait` seconds for the first event, so that a request the engine refuses still gets a proper
    4xx status; raises what the stream raises. Returns the heartbeat reader and the first event (None if it
    did not come in time: the response then starts without it)."""
    beat = Heartbeat(events)
    try:
        first = await beat.next(wait)
    except StopAsyncIteration:
        raise ApiError(500, "the engine stream ended without an event") from None
    except BaseException:
        await beat.close()
        raise
    return beat, first


async def _disconnected(request: HttpRequest) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def collect(events: AsyncIterator[TokenEvent], request: HttpRequest) -> Collected | None:
    """Fold a whole stream for a non-streaming response; None if the client went away first (the request is
    then aborted by cancelling the read)."""
    done = await collect_all([events], request)
    return None if done is None else done[0]


async def collect_all(streams: list[AsyncIterator[TokenEvent]], request: HttpRequest,
                      leaders: list[int] | None = None) -> list[Collected] | None:
    """`collect` of several streams at once (a request's choices), one watch on the client; None if it went away
    first. `leaders[j]`: the stream whose first event stream j's read waits for (its prompt computed, j's read from
    the prefix cache; j itself: at once; default: the first stream leads every other). Where one stream fails, or
    the client leaves, every other stream's read is cancelled (its request aborted, or never made) before this
    returns or raises the first failure."""
    dones = [Collected() for _ in streams]
    leaders = leaders or [0] * len(streams)
    firsts = {j: asyncio.Event() for j in set(leaders)}

    async def consume(j: int, events: AsyncIterator[TokenEvent], done: Collected) -> None:
        if leaders[j] != j:
            await firsts[leaders[j]].wait()
        try:
            async for ev in events:
                done.add(ev)
                if j in firsts:
                    firsts[j].set()
        finally:
            if j in firsts:
                firsts[j].set()

    reads = [asyncio.ensure_future(consume(j, e, d)) for j, (e, d) in enumerate(zip(streams, dones))]
    watching = asyncio.ensure_future(_disconnected(request))
    try:
        pending: set[asyncio.Future[Any]] = set(reads)
        while pending and not watching.done():
            done, pending = await asyncio.wait({*pending, watching}, return_when=asyncio.FIRST_COMPLETED)
            pending.discard(watching)
            if any(t is not watching and not t.cancelled() and t.exception() is not None for t in done):
                break  # one failed: the others are cancelled below
    finally:
        finished = all(t.done() for t in reads)
        for task in (watching, *reads):
            task.cancel()  # a no-op on a finished task
        # all settled: the reads' cleanup has aborted their requests, and none leaves an unretrieved error
        await asyncio.gather(watching, *reads, return_exceptions=True)
    failed = next((t.exception() for t in reads if not t.cancelled() and t.exception() is not None), None)
    if failed is not None:
        raise failed
    return dones if finished else None


async def merged_stream(streamers: list[Any], streams: list[AsyncIterator[TokenEvent]], api: str, interval: float,
                        idle_line: str, tail: Callable[[list[TokenEvent]], list[str]],
                        disconnects: tuple[type[BaseException], ...] = (),
                        leaders: list[int] | None = None) -> AsyncIterator[str]:
    """The SSE body of a request of several choices: choice i's `streamers[i]` lines for its `streams[i]` events
    as they come, a choice's `finish(last)` lines at its end, then `tail(lasts)` (the last events in the choices'
    order); `idle_line` after every `interval` seconds without an event; a failure an error line in the API's
    shape (`to_api_error`'s). Every stream is read by a task of its own, cancelled (its request aborted) when the
    body closes. A stream's read starts once its leader's first event is in (`leaders[j]`, default the first
    stream: its prompt computed, theirs read from the prefix cache; a leader's own at once); a stream not read is
    never started, so its request never reaches the engine."""
    queue: asyncio.Queue[tuple[int, TokenEvent | None, BaseException | None]] = asyncio.Queue()
    leaders = leaders or [0] * len(streams)

    async def pump(i: int, events: AsyncIterator[TokenEvent]) -> None:
        try:
            async for ev in events:
                queue.put_nowait((i, ev, None))
                if ev.finish_reason is not None:
                    return
            queue.put_nowait((i, None, ApiError(500, "the engine stream ended without a finish reason")))
        except BaseException as exc:  # reported in the stream (a cancellation too, then raised on)
            queue.put_nowait((i, None, exc))
            if not isinstance(exc, Exception):
                raise

    tasks = {j: asyncio.ensure_future(pump(j, streams[j])) for j in range(len(streams)) if leaders[j] == j}
    try:
        for streamer in streamers:
            for line in streamer.start(None):
                yield line
        lasts: dict[int, TokenEvent] = {}
        while len(lasts) < len(streams):
            try:
                i, ev, exc = await asyncio.wait_for(queue.get(), interval)
            except TimeoutError:
                yield idle_line
                continue
            if exc is not None:
                raise exc
            for j, events in enumerate(streams):  # a leader's first event: its prompt is computed
                if leaders[j] == i and j not in tasks:
                    tasks[j] = asyncio.ensure_future(pump(j, events))
            for line in streamers[i].event(ev):
                yield line
            if ev.finish_reason is not None:
                lasts[i] = ev
                for line in streamers[i].finish(ev):
                    yield line
        for line in tail([lasts[i] for i in range(len(streams))]):
            yield line
    except Exception as exc:  # noqa: BLE001 - reported to the client in the stream
        yield error_line(to_api_error(exc, disconnects), api)
    finally:
        for task in tasks.values():
            task.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        for j, events in enumerate(streams):
            if j not in tasks:
                await events.aclose()  # type: ignore[attr-defined]  # never started: nothing to abort


async def guarded(api: str, handler: Callable[[], Any], disconnects: tuple[type[BaseException], ...] = ()) -> Any:
    """Run a route body; any exception becomes an error response in the API's shape (`to_api_error`'s, with
    `disconnects`)."""
    try:
        return await handler()
    except Exception as exc:  # noqa: BLE001 - answered in the API's error shape
        return error_response(to_api_error(exc, disconnects), api)
