"""The FastAPI app: OpenAI and Anthropic routes over an `EngineClient`, plus /health, /stats and /metrics.

Bodies are read and validated here (not by FastAPI's automatic validation) so that every error, including
malformed JSON and oversized bodies, has its API's shape. Rendering and tokenising run in a worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response

from decapybara.api import (
    anthropic_api,
    background,
    conversations,
    openai_api,
    openai_completions,
    openai_responses,
    response_store,
)
from decapybara.api import anthropic_schemas as an
from decapybara.api import openai_schemas as oa
from decapybara.api import responses_schemas as rs
from decapybara.api.client import EngineClient
from decapybara.api.errors import ApiError, bad_request, to_api_error
from decapybara.api.metrics import CONTENT_TYPE, prometheus_text
from decapybara.api.streams import budgeted_thinking, engine_events
from decapybara.api.transport import (
    ANTHROPIC,
    OPENAI,
    RESPONSES,
    EdgeMiddleware,
    EventStreamResponse,
    api_of,
    collect,
    collect_all,
    drive_stream,
    error_response,
    guarded,
    merged_stream,
    read_body,
    start_stream,
    well_formed_json,
)
from decapybara.engine.sequence import TokenEvent

DEFAULT_MAX_BODY_BYTES = 8 << 20
CONVERSATION_HEADER = "x-conversation-id"
log = logging.getLogger(__name__)
RUN_LOST = {"code": "server_error", "message": "its background run stopped: the server that ran it went away"}
KEEP_ALIVE = ": keep-alive\n\n"  # an SSE comment: OpenAI streams' idle line
SERVICE_METHODS = ["GET", "HEAD"]  # the read-only service routes: HEAD too (load balancers' and monitors' probes)
SWAP_TRIES = 16  # a conversation's change redone at most this often where other replicas' changes keep landing


def create_app(client: EngineClient, api_key: str | None = None, served_model_name: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, ping_interval_s: float = 10.0,
               first_event_wait_s: float = 1.0, disconnects: tuple[type[BaseException], ...] = ()) -> FastAPI:
    """The HTTP app over `client`.

    api_key: when set, every route but /health needs it (401 in each API's shape otherwise).
    served_model_name: the name /v1/models lists and responses carry (default: client.model_name); requests
    may name any model. max_body_bytes: larger bodies get 413. ping_interval_s: idle time after which a stream
    gets an Anthropic `ping` / an OpenAI keep-alive comment. first_event_wait_s: how long a streaming request
    waits for its first event before sending headers (a refusal within it is a proper 4xx). disconnects: the
    exception types the transport raises into a request whose client left (Ray Serve cancels its task): noted in
    the debug log, not reported as server errors.
    """
    served = served_model_name or client.model_name
    store = getattr(client, "responses", None)  # the Responses API's store, where the client keeps one
    runs = background.BackgroundRuns()  # this replica's background responses
    conversation_locks: dict[str, list[Any]] = {}  # conversations being added to on this replica
    created = int(time.time())
    counts: Counter[tuple[str, int]] = Counter()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await runs.close()  # background runs still going end with the app (their requests aborted)

    app = FastAPI(title="Decapybara", docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False,
                  lifespan=lifespan)
    app.add_middleware(EdgeMiddleware, api_key=api_key, counts=counts)
    app.state.client = client

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: HttpRequest, exc: StarletteHTTPException) -> Response:
        message = "no such route" if exc.status_code == 404 else str(exc.detail)
        return error_response(ApiError(exc.status_code, f"{message}: {request.method} {request.url.path}"),
                              api_of(request.url.path), exc.headers)  # a 405's Allow

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: HttpRequest, exc: RequestValidationError) -> Response:
        return error_response(ApiError(400, str(exc)), api_of(request.url.path))

    @app.exception_handler(Exception)
    async def _server_error(request: HttpRequest, exc: Exception) -> Response:
        return error_response(to_api_error(exc, disconnects), api_of(request.url.path))

    async def guard(api: str, handler: Callable[[], Any]) -> Any:
        return await guarded(api, handler, disconnects)

    async def parse(request: HttpRequest, model: type[Any]) -> Any:
        return model.model_validate_json(well_formed_json(await read_body(request, max_body_bytes)))

    async def run(request: HttpRequest, api: str, events: AsyncIterator[TokenEvent], stream: bool,
                  streamer: Callable[[], Any], respond: Callable[[Any], Any], idle_line: str) -> Response:
        """Serve a planned request: an event stream, or the collected response."""
        if stream:
            beat, first = await start_stream(events, first_event_wait_s)
            return EventStreamResponse(drive_stream(streamer(), beat, first, api, ping_interval_s, idle_line,
                                                    disconnects), disconnects)
        done = await collect(events, request)
        if done is None:  # the client left; nobody reads this
            return Response(status_code=499)
        return JSONResponse(respond(done).dump())

    # ---- service routes ------------------------------------------------------------------------------------
    @app.api_route("/health", methods=SERVICE_METHODS)
    async def health() -> Response:
        check = getattr(client, "health", None)
        state = await check() if check is not None else {"status": "ok"}
        return JSONResponse(state, status_code=200 if state.get("status") == "ok" else 503)

    @app.api_route("/stats", methods=SERVICE_METHODS)
    async def stats() -> Response:
        async def body() -> Response:
            return JSONResponse(await client.stats())
        return await guard(OPENAI, body)

    @app.api_route("/metrics", methods=SERVICE_METHODS)
    async def metrics() -> Response:
        async def body() -> Response:
            return PlainTextResponse(prometheus_text(await client.stats(), dict(counts)), media_type=CONTENT_TYPE)
        return await guard(OPENAI, body)

    # ---- OpenAI --------------------------------------------------------------------------------------------
    @app.api_route("/v1/models", methods=SERVICE_METHODS)
    async def models() -> Response:
        return JSONResponse(openai_completions.model_list(served, client.max_model_len, created).dump())

    @app.api_route("/v1/models/{model_id:path}", methods=SERVICE_METHODS)
    async def model(model_id: str) -> Response:
        if model_id != served:
            return error_response(ApiError(404, f"the model {model_id!r} does not exist", "model",
                                           "model_not_found"), OPENAI)
        return JSONResponse(openai_completions.model_list(served, client.max_model_len, created).data[0].dump())

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HttpRequest) -> Response:
        async def handle() -> Response:
            body = await parse(request, oa.ChatCompletionRequest)
            plan = await run_in_threadpool(openai_api.plan_chat, body, client, served,
                                           request.headers.get(CONVERSATION_HEADER))
            if plan.n > 1:
                return await choices(request, openai_api.choice_requests(plan), bool(body.stream),
                                     lambda i: openai_api.ChatStream(plan, client.tokenizer, i),
                                     lambda dones: openai_api.chat_completions(plan, dones, client.tokenizer),
                                     openai_api.summed_usage)
            return await run(request, OPENAI, engine_events(client, plan.request), bool(body.stream),
                             lambda: openai_api.ChatStream(plan, client.tokenizer),
                             lambda done: openai_api.chat_completion(plan, done, client.tokenizer), KEEP_ALIVE)
        return await guard(OPENAI, handle)

    async def choices(request: HttpRequest, requests: list[Any], stream: bool, streamer: Callable[[int], Any],
                      whole: Callable[[list[Any]], Any], total: Callable[[list[Any]], Any],
                      leaders: list[int] | None = None) -> Response:
        """A request of several choices (chat or legacy completions' n > 1, legacy completions' several prompts),
        each an engine request of its own (`choice_requests`): each prompt's first (`leaders[j]`: choice j's, by
        default the first) read to its first event before the others of that prompt start, so that its prompt
        is computed once and they read it from the prefix cache, the prompts side by side; collected into one
        response (`whole(dones)`) or merged into one stream (`streamer(i)`'s lines, choices by index, the usage
        chunk's `total` of their usages)."""
        streams = [engine_events(client, r) for r in requests]
        if stream:
            streamers = [streamer(i) for i in range(len(requests))]

            def tail(lasts: list[TokenEvent]) -> list[str]:
                return streamers[0].tail(total([s.usage(ev) for s, ev in zip(streamers, lasts)]))
            return EventStreamResponse(merged_stream(streamers, streams, OPENAI, ping_interval_s, KEEP_ALIVE, tail,
                                                     disconnects, leaders), disconnects)
        dones = await collect_all(streams, request, leaders)
        if dones is None:
            return Response(status_code=499)
        return JSONResponse(whole(dones).dump())

    @app.post("/v1/completions")
    async def completions(request: HttpRequest) -> Response:
        async def handle() -> Response:
            body = await parse(request, oa.CompletionRequest)
            plans = await run_in_threadpool(openai_completions.plan_completions, body, client, served,
                                            request.headers.get(CONVERSATION_HEADER))
            plan = plans[0]
            if len(plans) > 1 or plan.n > 1:  # choices prompt by prompt, n each, led by its first
                owner = [p for p in plans for _ in range(p.n)]
                leaders = [k - k % p.n for k, p in enumerate(owner)]
                return await choices(request, [r for p in plans for r in openai_api.choice_requests(p)],
                                     bool(body.stream),
                                     lambda i: openai_completions.CompletionStream(owner[i], client.tokenizer, i),
                                     lambda dones: openai_completions.batch_completion(plans, dones,
                                                                                       client.tokenizer),
                                     lambda each: openai_completions.batch_usage(plans, each), leaders)
            return await run(request, OPENAI, engine_events(client, plan.request), bool(body.stream),
                             lambda: openai_completions.CompletionStream(plan, client.tokenizer),
                             lambda done: openai_completions.completion(plan, done, client.tokenizer), KEEP_ALIVE)
        return await guard(OPENAI, handle)

    @app.post("/v1/responses")
    async def responses(request: HttpRequest) -> Response:
        async def handle() -> Response:
            body = await parse(request, rs.ResponsesRequest)
            if body.background and (store is None or body.store is False):
                raise bad_request("background responses are kept in the response store, which " + (
                    "this server keeps none of (its responses_store_mb is 0)" if store is None else
                    "store: false leaves out"), "background")
            cid, earlier = await earlier_turns(body)
            if earlier and background.orphaned(earlier[-1]):
                earlier[-1] = await background.settle(store, earlier[-1], "failed", RUN_LOST)
            if cid is None and earlier and earlier[-1]["response"]["status"] not in background.SETTLED:
                raise bad_request(f"previous_response_id: the response {body.previous_response_id!r} is still "
                                  "running in the background (wait for it, or cancel it)", "previous_response_id")
            plan = await run_in_threadpool(openai_responses.plan_response, body, client, served,
                                           request.headers.get(CONVERSATION_HEADER) or cid, earlier)
            plan.conversation = cid
            if body.background:
                return await start_background(plan, bool(body.stream))
            keep = store.put if store is not None and body.store is not False else None
            adding: list[asyncio.Future[Any]] = []  # the conversation's add, awaited before the end goes out
            if cid is not None:
                def keep_and_add(record: dict[str, Any]) -> bool:
                    adding.append(asyncio.ensure_future(add_turn(cid, record)))
                    return keep(record) if keep is not None else False
                plan.keep = keep_and_add
            else:
                plan.keep = keep
            answer = await run(request, RESPONSES, engine_events(client, plan.request), bool(body.stream),
                               lambda: openai_responses.ResponseStream(plan, client.tokenizer),
                               lambda done: openai_responses.response(plan, done, client.tokenizer), KEEP_ALIVE)
            if isinstance(answer, EventStreamResponse):
                answer.body_iterator = awaiting(answer.body_iterator, adding)
            else:
                await asyncio.shield(asyncio.gather(*adding))  # a request cancelled (Ray: client gone) still adds
            return answer
        return await guard(RESPONSES, handle)

    async def earlier_turns(body: rs.ResponsesRequest) -> tuple[str | None, list[dict[str, Any]] | None]:
        """(the conversation's id, where the request names one; the records its earlier turns are read from: that
        conversation's, or the stored chain `previous_response_id` names, or None)."""
        if body.conversation is None:
            return None, await stored_chain(store, body.previous_response_id)
        cid = conversations.conversation_id(body.conversation)
        if body.previous_response_id is not None:
            raise bad_request("conversation and previous_response_id cannot both be given (a conversation holds its "
                              "earlier turns)", "conversation")
        return cid, [await conversation(cid, "conversation", 400)]

    def needs_store(param: str) -> None:
        if store is None:
            raise bad_request("conversations are kept in the response store, which this server keeps none of (its "
                              "responses_store_mb is 0)", param)

    async def conversation(cid: str, param: str = "conversation_id", status: int = 404) -> dict[str, Any]:
        """The stored conversation `cid`, else a `status` error naming `param`."""
        needs_store(param)
        record = await store.get(cid)
        if not conversations.is_conversation(record):
            raise no_conversation(cid, param, status)
        return record

    def no_conversation(cid: str, param: str = "conversation_id", status: int = 404) -> ApiError:
        return ApiError(status, f"no conversation {cid!r} (never made, deleted, or dropped from the store)",
                        param=param, code="not_found" if status == 404 else None)

    @contextlib.asynccontextmanager
    async def conversation_lock(cid: str) -> AsyncIterator[None]:
        """One change at a time to conversation `cid` on this replica; the lock is forgotten once nobody holds
        or waits for it (counted, so a waiter's lock is never replaced by a fresh one)."""
        entry = conversation_locks.setdefault(cid, [asyncio.Lock(), 0])
        entry[1] += 1
        try:
            async with entry[0]:
                yield
        finally:
            entry[1] -= 1
            if entry[1] == 0 and conversation_locks.get(cid) is entry:
                del conversation_locks[cid]

    async def change_conversation(cid: str, change: Callable[[dict[str, Any]], None]) -> tuple[dict[str, Any], bool]:
        """Conversation `cid` (a 404 where it is not stored) changed in place by `change` (which may raise) and
        stored again: (the record, whether the store took it). One change at a time on this replica; a change
        from another replica (or its DELETE) landing between the read and the store is found by the store's
        swap, and the change redone on what it left (up to `SWAP_TRIES` times, then a 409)."""
        needs_store("conversation_id")
        async with conversation_lock(cid):
            for _ in range(SWAP_TRIES):
                record, digest = await store.get_versioned(cid)
                if not conversations.is_conversation(record):
                    raise no_conversation(cid)
                change(record)
                stored = await store.swap(record, digest)
                if stored is not None:
                    return record, stored
            raise ApiError(409, f"the conversation {cid!r} kept changing under this change; send it again",
                           param="conversation_id", code="conflict")

    async def add_turn(cid: str, record: dict[str, Any]) -> None:
        """A response's turn added to its conversation; a failure logged (the response itself stands)."""
        try:
            if not (await change_conversation(cid, lambda c: c["items"].extend(conversations.turn_items(record))))[1]:
                log.warning("conversation %s: response %s's turn not added (past the store's budget)", cid,
                            record["id"])
        except Exception:
            log.warning("conversation %s: adding response %s's turn failed", cid, record["id"], exc_info=True)

    async def start_background(plan: openai_responses.ResponsePlan, stream: bool) -> Response:
        """Store the response "queued", start its run (`background.drive`), and answer with the queued response
        or the run's stream (which the client may leave: the run goes on)."""
        plan.keep = lambda record: True  # the run stores the response (`drive`: each store awaited, in order)
        streamer = openai_responses.ResponseStream(plan, client.tokenizer)
        queued = streamer.snapshot("queued")
        if not await store.put_now(background.stamped(openai_responses.record(plan, queued))):
            raise bad_request("background: the response store's whole budget is smaller than this response",
                              "background")
        rid = plan.request.request_id
        cid = plan.conversation
        runs.start(rid, lambda run: background.drive(
            run, streamer, engine_events(client, plan.request), store,
            lambda response: openai_responses.record(plan, response), lambda exc: to_api_error(exc, disconnects),
            after=None if cid is None else lambda record: add_turn(cid, record)))
        if stream:
            return await follow(rid, -1)
        return JSONResponse(queued.dump())

    async def follow(rid: str, after: int) -> Response:
        """The stream of background response `rid` past the event numbered `after`, where its run is kept here."""
        run = runs.get(rid)
        if run is None:
            record = await stored(store, rid)
            raise bad_request(f"the events of response {rid!r} are not kept: " + (
                "it did not run in the background" if not record["response"].get("background") else
                f"its run ended over {runs.keep_s:.0f} s ago or ran on another server") +
                " (GET it without stream for the response)", "stream")
        return EventStreamResponse(run.follow(after, ping_interval_s, KEEP_ALIVE), disconnects)

    @app.post("/v1/responses/input_tokens")
    async def responses_input_tokens(request: HttpRequest) -> Response:
        async def handle() -> Response:
            body = await parse(request, rs.InputTokensRequest)
            earlier = (await earlier_turns(body))[1]
            return JSONResponse(await run_in_threadpool(openai_responses.input_tokens, body, client, earlier))
        return await guard(RESPONSES, handle)

    @app.get("/v1/responses/{response_id}")
    async def stored_response(request: HttpRequest, response_id: str) -> Response:
        async def handle() -> Response:
            q = request.query_params
            if q.get("stream", "false").lower() == "true":
                after = q.get("starting_after", "-1")
                if not re.fullmatch(r"-?[0-9]{1,18}", after):
                    raise bad_request("starting_after must be an integer (an event's sequence_number)",
                                      "starting_after")
                return await follow(response_id, int(after))
            record = await stored(store, response_id)
            if background.orphaned(record):
                record = await background.settle(store, record, "failed", RUN_LOST)
            return JSONResponse(record["response"])
        return await guard(RESPONSES, handle)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> Response:
        async def handle() -> Response:
            response = (await stored(store, response_id))["response"]
            if not response.get("background"):
                raise bad_request(f"only background responses can be cancelled, and {response_id!r} did not run "
                                  "in the background", "response_id")
            if response["status"] in background.SETTLED:
                return JSONResponse(response)  # cancelling again, or after the end: the response as it ended
            record = await background.settled(store, response_id, runs.get(response_id),
                                              lambda: client.abort(response_id))
            if record is None:
                raise not_stored(response_id)
            if record["response"]["status"] not in background.SETTLED:  # no run answered (another server's)
                record = await background.settle(store, record, "cancelled")
            return JSONResponse(record["response"])
        return await guard(RESPONSES, handle)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> Response:
        async def handle() -> Response:
            record = await store.get(response_id) if store is not None else None
            if record is None or conversations.is_conversation(record) or not await store.delete(response_id):
                raise not_stored(response_id)
            if record["response"]["status"] not in background.SETTLED:  # a background run: stopped too
                await client.abort(response_id)
            return JSONResponse({"id": response_id, "object": "response", "deleted": True})
        return await guard(RESPONSES, handle)

    @app.get("/v1/responses/{response_id}/input_items")
    async def input_items(request: HttpRequest, response_id: str) -> Response:
        async def handle() -> Response:
            records = await stored_chain(store, response_id, "response_id", 404, partial=True)
            q = request.query_params
            return JSONResponse(openai_responses.input_items_page(records, q.get("order", "desc"),
                                                                  q.get("limit", "20"), q.get("after")))
        return await guard(RESPONSES, handle)

    # ---- conversations (decapybara/api/conversations.py) --------------------------------------------------
    @app.post("/v1/conversations")
    async def create_conversation(request: HttpRequest) -> Response:
        async def handle() -> Response:
            body = await parse(request, rs.ConversationRequest)
            items = conversations.checked_items(body.items or [], conversations.MAX_NEW_ITEMS)
            record = conversations.new_record(items, openai_responses.checked_metadata(body.metadata))
            needs_store("items")
            if not await store.put_now(record):
                raise bad_request("the conversation is larger than the response store's whole budget", "items")
            return JSONResponse(record["conversation"])
        return await guard(RESPONSES, handle)

    @app.get("/v1/conversations/{cid}")
    async def get_conversation(cid: str) -> Response:
        async def handle() -> Response:
            return JSONResponse((await conversation(cid))["conversation"])
        return await guard(RESPONSES, handle)

    @app.post("/v1/conversations/{cid}")
    async def update_conversation(request: HttpRequest, cid: str) -> Response:
        async def handle() -> Response:
            body = await parse(request, rs.ConversationRequest)
            metadata = openai_responses.checked_metadata(body.metadata)
            record, _ = await change_conversation(cid, lambda c: c["conversation"].update(metadata=metadata))
            return JSONResponse(record["conversation"])
        return await guard(RESPONSES, handle)

    @app.delete("/v1/conversations/{cid}")
    async def delete_conversation(cid: str) -> Response:
        async def handle() -> Response:
            async with conversation_lock(cid):
                await conversation(cid)
                await store.delete(cid)
            return JSONResponse(conversations.deleted(cid))
        return await guard(RESPONSES, handle)

    @app.get("/v1/conversations/{cid}/items")
    async def conversation_items(request: HttpRequest, cid: str) -> Response:
        async def handle() -> Response:
            q = request.query_params
            return JSONResponse(conversations.items_page(await conversation(cid), q.get("order", "desc"),
                                                         q.get("limit", "20"), q.get("after")))
        return await guard(RESPONSES, handle)

    @app.post("/v1/conversations/{cid}/items")
    async def add_conversation_items(request: HttpRequest, cid: str) -> Response:
        async def handle() -> Response:
            body = await parse(request, rs.ConversationItemsRequest)
            items = conversations.checked_items(body.items, None)
            if not (await change_conversation(cid, lambda c: conversations.add_items(c, items)))[1]:
                raise bad_request("the conversation would be larger than the response store's whole budget", "items")
            return JSONResponse(conversations.added(items))
        return await guard(RESPONSES, handle)

    @app.get("/v1/conversations/{cid}/items/{item_id}")
    async def conversation_item(cid: str, item_id: str) -> Response:
        async def handle() -> Response:
            return JSONResponse(conversations.item(await conversation(cid), item_id))
        return await guard(RESPONSES, handle)

    @app.delete("/v1/conversations/{cid}/items/{item_id}")
    async def delete_conversation_item(cid: str, item_id: str) -> Response:
        async def handle() -> Response:
            record, _ = await change_conversation(cid, lambda c: conversations.delete_item(c, item_id))
            return JSONResponse(record["conversation"])
        return await guard(RESPONSES, handle)

    # ---- Anthropic -----------------------------------------------------------------------------------------
    @app.post("/v1/messages")
    async def messages(request: HttpRequest) -> Response:
        async def handle() -> Response:
            body = await parse(request, an.MessagesRequest)
            plan = await run_in_threadpool(anthropic_api.plan_message, body, client, served,
                                           request.headers.get(CONVERSATION_HEADER))
            if plan.thinking_budget is not None:
                events = budgeted_thinking(client, plan.request, plan.thinking_budget, plan.prompt.opens_reasoning)
            else:
                events = engine_events(client, plan.request)
            return await run(request, ANTHROPIC, events, bool(body.stream),
                             lambda: anthropic_api.MessageStream(plan),
                             lambda done: anthropic_api.message(plan, done), anthropic_api.PING)
        return await guard(ANTHROPIC, handle)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: HttpRequest) -> Response:
        async def handle() -> Response:
            body = await parse(request, an.CountTokensRequest)
            result = await run_in_threadpool(anthropic_api.count_tokens, body, client.tokenizer)
            return JSONResponse(result.dump())
        return await guard(ANTHROPIC, handle)

    return app


async def awaiting(lines: AsyncIterator[str], pending: list[asyncio.Future[Any]]) -> AsyncIterator[str]:
    """`lines`, each sent only once the work in `pending` at that moment is done (a conversation's add, which a
    stream's end starts: its last event goes out after it)."""
    try:
        async for line in lines:
            if pending:
                await asyncio.shield(asyncio.gather(*pending))  # the stream cancelled (client gone): still added
                pending.clear()
            yield line
    finally:
        await lines.aclose()  # type: ignore[attr-defined]


def not_stored(response_id: str, param: str = "response_id", status: int = 404) -> ApiError:
    return ApiError(status, f"Response with id {response_id!r} not found.", param,
                    "previous_response_not_found" if param == "previous_response_id" else "not_found")


async def stored(store: Any, response_id: str) -> dict[str, Any]:
    """The stored record of `response_id`, else a 404."""
    record = await store.get(response_id) if store is not None else None
    if record is None or conversations.is_conversation(record):
        raise not_stored(response_id)
    return record


async def stored_chain(store: Any, response_id: str | None, param: str = "previous_response_id",
                       status: int = 400, retries: int = 3, partial: bool = False) -> list[dict[str, Any]] | None:
    """The stored conversation up to `response_id` (None where none is named; with `partial`, the turns back to
    one no longer stored): a 400 (`status`) naming the turn not found. A response just stored may still be on its
    way to the store (another ingress replica's, or a Ray call overtaken), so the id asked for is looked up again
    `retries` times, 50 ms apart, before it counts as missing."""
    if response_id is None:
        return None
    if store is None:
        if status == 404:
            raise not_stored(response_id)
        raise bad_request(f"{param} needs stored responses, which this server keeps none of (its "
                          "responses_store_mb is 0): send the whole conversation as input", param)
    for attempt in range(retries + 1):
        try:
            records = await store.chain(response_id, partial)
            if conversations.is_conversation(records[-1]):  # a conversation's id is no response's
                raise response_store.ChainBroken(response_id, response_id)
            return records
        except response_store.ChainBroken as exc:
            broken = exc
        if broken.missing != response_id or attempt == retries:
            break
        await asyncio.sleep(0.05)
    if broken.missing == response_id:
        raise not_stored(response_id, param, status)
    raise ApiError(status, f"Response with id {broken.missing!r}, an earlier turn of {response_id!r}, is no longer "
                   "stored (the store keeps the most recently used within its budget)", param,
                   not_stored(response_id, param).code)
