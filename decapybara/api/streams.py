"""Event-stream plumbing shared by both APIs: heartbeats, the thinking budget, SSE framing.

Cleanup rule: whoever stops consuming an engine stream early closes it (or cancels the task awaiting it), so
the `EngineClient` aborts the request; no cleanup here awaits anything, since it may run under cancellation.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from decapybara.engine.sequence import FinishReason, Request, TokenEvent
from decapybara.errors import CapacityError, ContextOverflowError, DecapybaraError, InvalidRequestError

_END = object()
_ERRORS: dict[str, type[DecapybaraError]] = {
    cls.__name__: cls for cls in (ContextOverflowError, InvalidRequestError, CapacityError)}


async def engine_events(client: Any, request: Request) -> AsyncIterator[TokenEvent]:
    """`client.generate(request)`, raising the refusal an event reports in its `error` field (clients whose
    engine runs elsewhere report refusals that way) as the library error named by `error_type`."""
    events = client.generate(request)
    try:
        async for ev in events:
            error = getattr(ev, "error", None)
            if error:
                raise _ERRORS.get(getattr(ev, "error_type", None) or "", DecapybaraError)(error)
            yield ev
    finally:
        await events.aclose()


async def _next_or_end(events: AsyncIterator[TokenEvent]) -> Any:
    try:
        return await events.__anext__()
    except StopAsyncIteration:
        return _END


class Heartbeat:
    """Reads an event stream and reports silences: `next(timeout)` returns the next event, None when `timeout`
    seconds passed without one (the pending read is kept, never cancelled), and raises StopAsyncIteration at
    the end. Errors of the stream propagate. `close()` abandons the stream (which aborts its request)."""

    def __init__(self, events: AsyncIterator[TokenEvent]) -> None:
        self._events = events
        self._pending: asyncio.Future[Any] | None = None
        self._closed = False

    async def next(self, timeout: float | None) -> TokenEvent | None:
        if self._closed:
            raise StopAsyncIteration
        if self._pending is None:
            self._pending = asyncio.ensure_future(_next_or_end(self._events))
        done, _ = await asyncio.wait({self._pending}, timeout=timeout)
        if not done:
            return None
        task, self._pending = self._pending, None
        try:
            item = task.result()
        except BaseException:
            self._closed = True
            raise
        if item is _END:
            self._closed = True
            raise StopAsyncIteration
        return item

    async def close(self) -> None:
        """Idempotent; does not suspend unless the stream's own cleanup does."""
        if self._closed:
            return
        self._closed = True
        pending = self._pending
        if pending is not None:
            # nobody reads its outcome now: an error of it (the client's cleanup after a cancelled transport) is
            # not left unretrieved
            pending.add_done_callback(_retrieve)
            if not pending.done():
                pending.cancel()  # the read in flight gets CancelledError: the client's cleanup aborts
                return
        if hasattr(self._events, "aclose"):
            await self._events.aclose()


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


async def budgeted_thinking(client: Any, request: Request, budget: int, opens_reasoning: bool
                            ) -> AsyncIterator[TokenEvent]:
    """`client.generate(request)`, with the reasoning capped at about `budget` output tokens.

    When the reasoning reaches the budget while still open, the request is aborted and continued as a new one
    whose prompt is the old prompt + the output so far + ``</think>`` (the prefix cache makes that cheap: only
    the new tokens are computed), with the remaining max_tokens. The caller sees one stream for the original
    request id: the forced ``</think>`` arrives as text, usage counts continue (prompt and cached tokens are
    the first request's), and the cut happens at an event boundary, so the budget can be exceeded by the
    tokens of one event (one token at the default stream interval). Where max_tokens leaves no room for the
    close, the reasoning goes on to max_tokens.
    """
    tok = client.tokenizer
    think_id, end_id = tok.special_ids.think, tok.special_ids.end_think
    thinking, closed = opens_reasoning, False
    spent, out_ids, text = 0, [], ""
    first: TokenEvent | None = None
    longest_close = len(tok.encode("\n</think>\n\n"))
    inner = engine_events(client, request)
    try:
        async for ev in inner:
            first = first or ev
            for t in ev.token_ids:
                if t == think_id and not closed:
                    thinking = True
                elif t == end_id:
                    thinking, closed = False, True
                if thinking:
                    spent += 1
            out_ids += ev.token_ids
            text += ev.text
            if (ev.finish_reason is not None or not thinking or spent < budget or end_id is None
                    or len(out_ids) + longest_close > request.params.max_tokens):  # no room to close: it goes on
                yield ev
                continue
            await inner.aclose()  # aborts the request
            break
        else:
            return
    finally:
        await inner.aclose()
    # The budget ran out inside the reasoning: close it and continue with the answer.
    full = tok.decode(out_ids, skip_special_tokens=True)
    held = full[len(text):] if full.startswith(text) else ""  # text the detokeniser still held back
    close_text = ("" if (text + held).endswith("\n") else "\n") + "</think>\n\n"
    forced = tok.encode(close_text)
    base = {"num_prompt_tokens": first.num_prompt_tokens, "num_cached_tokens": first.num_cached_tokens}
    if len(out_ids) + len(forced) > request.params.max_tokens:  # no room to close it: max_tokens ends the reply
        yield TokenEvent(request.request_id, ev.token_ids, ev.text + held, ev.logprobs, ev.top_logprobs,
                         FinishReason.LENGTH, ev.note, num_output_tokens=len(out_ids), **base)
        return
    num_output = len(out_ids) + len(forced)
    remaining = request.params.max_tokens - num_output
    yield TokenEvent(request.request_id, ev.token_ids + forced, ev.text + held + close_text, ev.logprobs,
                     ev.top_logprobs, FinishReason.LENGTH if remaining <= 0 else None, ev.note,
                     num_output_tokens=num_output, **base)
    if remaining <= 0:
        return
    cont = Request(request.prompt_ids + tuple(out_ids) + tuple(forced),
                   dataclasses.replace(request.params, max_tokens=remaining),
                   request_id=request.request_id + "+answer", conversation=request.conversation,
                   history_end=request.history_end)
    answer = engine_events(client, cont)
    try:
        async for ev in answer:
            yield dataclasses.replace(ev, request_id=request.request_id,
                                      num_output_tokens=num_output + ev.num_output_tokens, **base)
    finally:
        await answer.aclose()


def _one_line(payload: str) -> str:
    """`payload` (JSON) with U+0085, U+2028 and U+2029 written as escapes: SSE lines end only at CR or LF, but
    line readers that split on every Unicode line break (httpx's `iter_lines`, which older httpx-sse releases read
    streams with) would cut a data line at them. In JSON they can only stand inside strings, where the escape
    means the same character."""
    if payload.isascii():
        return payload
    return payload.replace("\u2028", "\\u2028").replace("\u2029", "\\u2029").replace("\x85", "\\u0085")


def sse_data(payload: str) -> str:
    """One OpenAI-style server-sent event."""
    return f"data: {_one_line(payload)}\n\n"


def sse_event(kind: str, payload: str) -> str:
    """One Anthropic-style server-sent event (named)."""
    return f"event: {kind}\ndata: {_one_line(payload)}\n\n"
