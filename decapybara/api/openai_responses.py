"""OpenAI /v1/responses (the Responses API): request -> engine `Request`, engine events -> a response object or
its stream of typed events.

Choices made where the API leaves room:
- the conversation is the ``input`` items (messages, ``function_call`` / ``function_call_output``,
  ``reasoning``), after those of the stored responses ``previous_response_id`` continues (each turn's input
  items, then its output items; instructions and tools are not carried over, as the API has it). A response is
  stored unless ``store`` is false or the server keeps no store (`decapybara.api.response_store`: in memory, least
  recently used dropped past its budget; a chain with a turn dropped is a 400 naming it). ``background``
  runs apart from the request (decapybara/api/background.py); ``conversation`` reads and adds to a stored
  conversation (decapybara/api/conversations.py); ``prompt`` is a 400. ``instructions`` and the system / developer messages before the
  first other item are one system turn. ``prompt_cache_key`` (else ``user``) groups an agent's turns.
  ``include: ["reasoning.encrypted_content"]`` puts the reasoning's text in its item's ``encrypted_content``
  (not encrypted: this server's own, for clients that send reasoning back only so, as stateless agents do), read
  back from input reasoning items that carry nothing else. ``include: ["message.output_text.logprobs"]`` (or
  ``top_logprobs`` given) puts each answer token's log probability, with ``top_logprobs`` alternatives (0-20), in
  its message's ``output_text`` part and the text deltas (`AnswerTokens`: the sampled tokens outside the reasoning
  and the calls, their tags and the end token left out); other ``include`` values and ``text.verbosity`` are read
  and not acted on. ``truncation: "auto"`` drops turns from the middle of a
  conversation past the context (`middle_cuts`), "disabled" (the default) lets it fail as too long.
- tools are function tools (``{"type": "function", "name", "parameters"}``); built-in tools (web search, file
  search, ...) are a 400 naming them. tool_choice and parallel_tool_calls act as in chat completions: "required"
  and a named function constrain the reply to calls; under "auto" a call the model opens is held to the tools'
  schemas (`decapybara.engine.tool_calls`), in the form the chat template writes (JSON, or Qwen3.5 / Qwen3.6's
  XML: `decapybara.chat.CallSyntax`; a ``function_call`` item's arguments are JSON either way).
- ``text.format`` json_object / json_schema constrain the answer as chat completions' response_format does.
- ``reasoning.effort`` "none" / "minimal" turns thinking off, any other value (or none given) leaves it on; the
  reasoning comes back as a ``reasoning`` item with ``reasoning_text`` content (the model's own words: no summary).
- output items in the order the model wrote them: reasoning, then its text as a ``message``, then its calls as
  ``function_call`` items; a reply cut by ``max_output_tokens`` is ``status: "incomplete"`` (its last item too);
  one the LoopGuard stopped is completed and carries ``loop_guard``. Images, files and audio in the input are a
  400. tool_choice also takes chat completions' ``{"type": "function", "function": {"name"}}`` and
  ``allowed_tools`` (the tools it lists, under its mode).
- the stream is the API's typed events, each with its ``sequence_number``: ``response.created``,
  ``response.in_progress``, per item ``response.output_item.added`` / ``.done`` with the text, reasoning and
  argument deltas between, and ``response.completed`` (or ``response.incomplete``) with the whole response; a
  stream that fails after its headers ends with a numbered ``error`` event and ``response.failed``; a background
  run's opens with ``response.created`` and ``response.queued`` (the response "queued", as it is stored), its
  ``response.in_progress`` with its first tokens.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter

from decapybara.api import responses_schemas as rs
from decapybara.api.common import (
    ChatInput,
    Collected,
    Prompt,
    ToolChoice,
    aborted_error,
    call_arguments,
    calls_only,
    checked_schema,
    constrained,
    conversation_key,
    make_request,
    new_id,
    output_budget,
    reasoning_tokens,
    render_prompt,
    settle_constraint,
)
from decapybara.api.errors import ApiError, bad_request
from decapybara.api.openai_api import token_logprobs
from decapybara.api.schemas_base import LoopGuardInfo
from decapybara.api.streams import sse_event
from decapybara.chat import ContentDelta, ReasoningDelta, StreamingOutputParser, ToolCallEvent
from decapybara.engine.sampling import SamplingParams
from decapybara.engine.sequence import FinishReason, Request, TokenEvent
from decapybara.errors import InvalidRequestError
from decapybara.tokenizer import IncrementalDetokenizer

# ---------------------------------------------------------------------------------------------- request


def _text(content: str | list[Any], where: str, field: str = "content") -> str:
    """A message's text: the string, or its text parts joined; other parts are a 400 (a refusal is skipped)."""
    if isinstance(content, str):
        return content
    out = []
    for j, part in enumerate(content):
        if isinstance(part, rs.TextIn):
            out.append(part.text)
        elif part.type != "refusal":
            raise bad_request(f"{where}.{field}.{j}: {part.type} parts are not supported (text only)",
                              f"{where}.{field}")
    return "".join(out)


_ITEMS = TypeAdapter(list[rs.ItemIn])
MAX_METADATA = 16  # metadata: at most this many string pairs (keys up to 64 characters, values up to 512)


def checked_metadata(metadata: Any) -> dict[str, str]:
    """The metadata of a request (a response's, or a conversation's create or update): a 400 naming it where it
    breaks the API's bounds."""
    if metadata is None:
        return {}
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512 for k, v in metadata.items()):
        raise bad_request(f"metadata must be at most {MAX_METADATA} string pairs (keys up to 64 characters, values "
                          "up to 512)", "metadata")
    return dict(metadata)


def own_items(body: rs.ResponsesRequest) -> list[Any]:
    """The request's input items (a string input one user message)."""
    return [rs.MessageIn(role="user", content=body.input)] if isinstance(body.input, str) else list(body.input)


def earlier_items(records: list[dict[str, Any]]) -> list[Any]:
    """The input items of a stored conversation (`response_store` records, oldest first): each turn's input,
    then its response's output (output items read as input items, as a client sends them back); a
    conversation's record (decapybara/api/conversations.py) its items."""
    items: list[Any] = []
    for record in records:
        items += record["items"] if "items" in record else record["input"] + record["response"]["output"]
    return _ITEMS.validate_python(items)


def input_messages(body: rs.ResponsesRequest, earlier: list[Any] = ()) -> list[dict[str, Any]]:
    """The request's instructions and input items (after `earlier`'s, a stored conversation's) -> the internal
    chat form: the instructions and the system / developer messages before the first other item one system turn
    (templates take one system message, first), later ones system turns of their own (`fold_system` where the
    template refuses them); a call joins the assistant turn before it (or opens one), a call's output is a tool
    turn, reasoning goes with the next assistant turn (dropped at a user or tool turn before one)."""
    lead = [body.instructions] if body.instructions else []
    items = [*earlier, *own_items(body)]
    msgs: list[dict[str, Any]] = []
    reasoning: str | None = None
    for i, item in enumerate(items):
        where = f"input.{i - len(earlier)}"  # the request's own items numbered as it sent them
        if isinstance(item, rs.MessageIn):
            role = "system" if item.role == "developer" else item.role
            text = _text(item.content, where)
            if role == "system" and not msgs:
                lead.append(text)
                continue
            msg = {"role": role, "content": text}
            if role == "assistant" and reasoning is not None:
                msg["reasoning_content"] = reasoning
            reasoning = None
            msgs.append(msg)
        elif isinstance(item, rs.FunctionCallIn):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": call_arguments(item.arguments)}}
            last = msgs[-1] if msgs else None
            if last is not None and last["role"] == "assistant" and reasoning is None:
                last.setdefault("tool_calls", []).append(call)
            else:
                msg = {"role": "assistant", "content": "", "tool_calls": [call]}
                if reasoning is not None:
                    msg["reasoning_content"], reasoning = reasoning, None
                msgs.append(msg)
        elif isinstance(item, rs.FunctionCallOutputIn):
            msgs.append({"role": "tool", "tool_call_id": item.call_id,
                         "content": _text(item.output, where, "output")})
            reasoning = None
        elif isinstance(item, rs.ReasoningIn):
            parts = item.content if item.content else item.summary
            text = "".join(p.text for p in parts) if parts else item.encrypted_content or ""
            reasoning = (reasoning or "") + text
        else:
            raise bad_request(f"{where}: input items of type {item.type!r} are not supported (messages, "
                              "function_call, function_call_output and reasoning are)", f"{where}.type")
    return ([{"role": "system", "content": "\n\n".join(lead)}] if lead else []) + msgs


def fold_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with every system turn after the first folded into the first (for a template that takes one
    system message, first)."""
    later = [m["content"] for m in messages[1:] if m["role"] == "system"]
    rest = [m for m in messages[1:] if m["role"] != "system"]
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": "\n\n".join([messages[0]["content"], *later])}, *rest]
    return ([{"role": "system", "content": "\n\n".join(later)}] if later else []) + [messages[0], *rest]


def _tools(body: rs.ResponsesRequest) -> list[dict[str, Any]] | None:
    """Function tools in the chat form; built-in tools are a 400."""
    if not body.tools:
        return None
    out = []
    for i, tool in enumerate(body.tools):
        if tool.get("type") != "function":
            raise bad_request(f"tools.{i}: tools of type {tool.get('type')!r} are not supported (function tools "
                              "are)", f"tools.{i}.type")
        name = tool.get("name")
        params = tool.get("parameters")
        if not isinstance(name, str) or not name or (params is not None and not isinstance(params, dict)):
            raise bad_request(f"tools.{i}: a function tool needs a name and an object of parameters", f"tools.{i}")
        fn = {"name": name, "description": tool.get("description"), "parameters": params}
        out.append({"type": "function", "function": {k: v for k, v in fn.items() if v is not None}})
    return out


def _tool_choice(body: rs.ResponsesRequest, tools: list[dict[str, Any]] | None
                 ) -> tuple[ToolChoice, list[dict[str, Any]] | None]:
    """tool_choice -> (the internal choice, the tools offered): "auto" / "none" / "required", a function by name
    (``{"type": "function", "name"}``, or chat completions' ``{"function": {"name"}}``), or ``allowed_tools``
    (the tools it lists, under its mode "auto" or "required")."""
    parallel = body.parallel_tool_calls is not False
    choice = body.tool_choice
    if isinstance(choice, rs.FunctionChoice):
        return ToolChoice("named", choice.name, parallel), tools
    if not isinstance(choice, dict):
        return ToolChoice(choice or "auto", parallel=parallel), tools
    kind = choice.get("type")
    fn = choice.get("function")
    if kind == "function" and isinstance(fn, dict) and isinstance(fn.get("name"), str):
        return ToolChoice("named", fn["name"], parallel), tools
    if kind == "allowed_tools" and choice.get("mode", "auto") in ("auto", "required") and isinstance(
            choice.get("tools"), list):
        names = {t.get("name") for t in choice["tools"] if isinstance(t, dict) and t.get("type") == "function"}
        kept = [t for t in tools or () if t["function"]["name"] in names]
        return ToolChoice(choice.get("mode", "auto"), parallel=parallel), kept or None
    raise bad_request(f"tool_choice of type {kind!r} is not supported (\"auto\", \"none\", \"required\", "
                      '{"type": "function", "name": ...} or {"type": "allowed_tools", "mode": "auto" | "required", '
                      '"tools": [...]} are)', "tool_choice")


def chat_input(body: rs.ResponsesRequest, earlier: list[Any] = ()) -> ChatInput:
    """The chat of `body` after `earlier` (a stored conversation's items, `earlier_items`); an item of the request
    with the id of one of `earlier`'s (sent again beside previous_response_id) is a 400."""
    seen = {item.id for item in earlier if getattr(item, "id", None)}
    for i, item in enumerate(own_items(body)):
        if getattr(item, "id", None) in seen:
            raise bad_request(f"Duplicate item found with id {item.id!r}: previous_response_id already holds it, so "
                              "send only the new items", f"input.{i}")
    checked_metadata(body.metadata)
    if body.prompt is not None:
        raise bad_request("prompt is not supported: prompt templates are not stored (send the instructions and the "
                          "input themselves)", "prompt")
    tool_choice, tools = _tool_choice(body, _tools(body))  # a named tool not among them: `render_prompt`'s 400
    effort = body.reasoning.effort if body.reasoning is not None else None
    messages = input_messages(body, earlier)
    if not messages:
        raise bad_request("input must hold at least one item (or follow a stored response: previous_response_id)",
                          "input")
    return ChatInput(messages, tools, tool_choice, effort not in ("none", "minimal"))


def _stored_part(part: Any, role: str) -> dict[str, Any]:
    if isinstance(part, rs.TextIn):
        return {"type": "output_text" if role == "assistant" else "input_text", "text": part.text}
    return part.model_dump(exclude_none=True)


_ID_PREFIX = {"message": "msg_", "function_call": "fc_", "function_call_output": "fco_", "reasoning": "rs_"}


def stored_input(body: rs.ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input items as a stored record keeps them (and input_items lists them): `stored_items`."""
    return stored_items(own_items(body))


def stored_items(items: list[Any]) -> list[dict[str, Any]]:
    """Input items as a store keeps them: each with its id (the one it came with, else a new one) and a status,
    a message's content as parts."""
    out = []
    for item in items:
        d = item.model_dump(exclude_none=True)
        if isinstance(item, rs.MessageIn):
            parts = [rs.TextIn(type="input_text", text=item.content)] if isinstance(item.content, str) else \
                item.content
            d = {"type": "message", "role": item.role, "content": [_stored_part(p, item.role) for p in parts]}
        rid = item.id or new_id(_ID_PREFIX.get(d["type"], "item_"))
        out.append({**d, "id": rid, "status": "completed"})
    return out


def sampling_params(body: rs.ResponsesRequest, max_tokens: int) -> SamplingParams:
    fmt = body.text.format if body.text is not None and body.text.format is not None else None
    schema = None
    if fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise bad_request('text.format json_schema needs a schema, e.g. {"type": "json_schema", "name": '
                              '"reply", "schema": {"type": "object"}}', "text.format.schema")
        schema = checked_schema(fmt.schema_, "text.format.schema")
    return SamplingParams(temperature=1.0 if body.temperature is None else body.temperature,
                          top_p=1.0 if body.top_p is None else body.top_p, max_tokens=max_tokens,
                          json_object=fmt is not None and fmt.type == "json_object", json_schema=schema,
                          logprobs=(body.top_logprobs or 0) if wants_logprobs(body) else None,
                          loop_guard=body.loop_guard)


LOGPROBS_INCLUDE = "message.output_text.logprobs"


def wants_logprobs(body: rs.ResponsesRequest) -> bool:
    """Whether the answer's messages carry their tokens' log probabilities: asked for by ``include``, or by
    ``top_logprobs`` given."""
    return LOGPROBS_INCLUDE in (body.include or ()) or body.top_logprobs is not None


@dataclass(slots=True)
class ResponsePlan:
    """A responses request mapped for the engine, with what the response needs."""

    request: Request
    prompt: Prompt
    body: rs.ResponsesRequest
    model: str
    created: int
    keep: Callable[[dict[str, Any]], bool] | None = None  # stores the finished response's record (`record`)
    conversation: str | None = None  # the id of the conversation it is made in
    stored: list[dict[str, Any]] | None = None  # its input items as stored (`record`): made once, so new ids stay


def _render(tokenizer: Any, chat: ChatInput) -> Prompt:
    try:
        return render_prompt(tokenizer, chat)
    except (ApiError, InvalidRequestError):
        if sum(m["role"] == "system" for m in chat.messages) < 2:
            raise
        chat.messages = fold_system(chat.messages)  # a template that takes one system message, first
        return render_prompt(tokenizer, chat)


def middle_cuts(messages: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The conversations ``truncation: "auto"`` may shorten `messages` to, fewest dropped first: the leading system
    turn, the first user message and the latest one are kept; of the rest, everything before one of the later
    assistant turns is dropped (a turn's calls and their outputs go together, and the kept part still opens with a
    user message and reads as a conversation)."""
    lead = 1 if messages and messages[0]["role"] == "system" else 0
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if not users:
        return []
    first, last = users[0], users[-1]
    cuts = []
    for b in range(first + 2, len(messages)):
        if messages[b]["role"] != "assistant":
            continue
        kept_last = [messages[last]] if first < last < b else []
        cuts.append([*messages[:lead], messages[first], *kept_last, *messages[b:]])
    return cuts


def fitted(tokenizer: Any, chat: ChatInput, room: int) -> Prompt:
    """The prompt of `chat`, or of the fewest-dropped of its `middle_cuts` whose prompt is shorter than `room`
    tokens (a binary search: each cut drops more than the one before), else of the cut that drops the most;
    `chat.messages` is left as the prompt renders them."""
    prompt = _render(tokenizer, chat)
    cuts = middle_cuts(chat.messages)
    if len(prompt.ids) < room or not cuts:
        return prompt
    lo, hi, best = 0, len(cuts) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        chat.messages = cuts[mid]
        tried = _render(tokenizer, chat)
        if len(tried.ids) < room:
            best, hi = (tried, chat.messages), mid - 1
        else:
            lo = mid + 1
    if best is None:
        chat.messages = cuts[-1]
        return _render(tokenizer, chat)
    chat.messages = best[1]
    return best[0]


def rendered(body: rs.ResponsesRequest, client: Any, earlier: list[dict[str, Any]] | None) -> tuple[ChatInput, Prompt]:
    """The chat of `body` after `earlier` (stored records, oldest first) and its prompt (`fitted` under
    ``truncation: "auto"``)."""
    chat = chat_input(body, earlier_items(earlier or []))
    if body.truncation == "auto":
        reply = min(body.max_output_tokens or 1024, client.max_model_len // 4)
        return chat, fitted(client.tokenizer, chat, client.max_model_len - reply)
    return chat, _render(client.tokenizer, chat)


def input_tokens(body: rs.ResponsesRequest, client: Any, earlier: list[dict[str, Any]] | None) -> dict[str, Any]:
    """POST /v1/responses/input_tokens: the prompt tokens the same request to /v1/responses would have (under
    ``truncation: "auto"``, with max_output_tokens as given, else 1,024, left to the reply); what that request
    would be refused for (a schema in ``text.format`` included) is refused here too."""
    sampling_params(body, 1)
    return {"object": "response.input_tokens", "input_tokens": len(rendered(body, client, earlier)[1].ids)}


def plan_response(body: rs.ResponsesRequest, client: Any, model: str, conversation: str | None,
                  earlier: list[dict[str, Any]] | None = None) -> ResponsePlan:
    """Validate and map a responses request continuing `earlier` (the stored records `previous_response_id`
    names, oldest first); raises ApiError / InvalidRequestError / ContextOverflowError. Under ``truncation:
    "auto"`` a conversation past the context drops turns from its middle (`middle_cuts`) until its prompt leaves
    max_output_tokens (at most a quarter of the context; 1,024 where none is given) to the reply."""
    chat, prompt = rendered(body, client, earlier)
    max_tokens = output_budget(body.max_output_tokens, len(prompt.ids), client.max_model_len, "max_output_tokens")
    params = settle_constraint(sampling_params(body, max(max_tokens, 1)), chat, prompt.call_format)
    key = conversation_key(conversation, body.prompt_cache_key or body.user, chat.messages)
    request = make_request(new_id("resp_"), prompt.ids, params, key, client.max_model_len, client.vocab_size,
                           prompt_param="input", history_end=prompt.history_end)
    return ResponsePlan(request, prompt, body, model, int(time.time()))


def input_items_page(records: list[dict[str, Any]], order: str, limit: str, after: str | None) -> dict[str, Any]:
    """GET /v1/responses/{id}/input_items: the items the last of `records` (a stored chain, oldest first; the
    turns still stored where an earlier one was dropped) was made from (the earlier turns' inputs and outputs,
    then its own input), as `items_page` pages them."""
    items = [item for r in records[:-1] for item in r["input"] + r["response"]["output"]] + records[-1]["input"]
    return items_page(items, order, limit, after, "this response")


def items_page(items: list[dict[str, Any]], order: str, limit: str, after: str | None, where: str
               ) -> dict[str, Any]:
    """A page of `items` (oldest first) as the API lists them: newest first under ``order`` "desc" (the
    default) or oldest first under "asc"; at most `limit` (1-100) of them, after the item ``after`` (a 400
    naming `where` it is not in)."""
    if order not in ("asc", "desc"):
        raise bad_request('order must be "asc" or "desc"', "order")
    if not (limit.isdigit() and 1 <= int(limit) <= 100):
        raise bad_request("limit must be an integer from 1 to 100", "limit")
    items = items[::-1] if order == "desc" else list(items)
    if after is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise bad_request(f"after: no item {after!r} in {where}", "after")
        items = items[ids.index(after) + 1:]
    page = items[:int(limit)]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > len(page)}


def record(plan: ResponsePlan, whole: rs.ResponseObject) -> dict[str, Any]:
    """The stored form of a response (`response_store`'s record; a background run's at each of its stores, its
    input items' ids the same each time)."""
    if plan.stored is None:
        plan.stored = stored_input(plan.body)
    return {"id": whole.id, "parent": plan.body.previous_response_id, "input": copy.deepcopy(plan.stored),
            "response": whole.dump()}


def _kept(plan: ResponsePlan, whole: rs.ResponseObject) -> rs.ResponseObject:
    """`whole` after it is stored (`plan.keep`); saying ``store: false`` where the store refused it (larger than
    its whole budget)."""
    if plan.keep is not None and not plan.keep(record(plan, whole)):
        return whole.model_copy(update={"store": False})
    return whole


# ---------------------------------------------------------------------------------------------- response


class AnswerTokens:
    """The log probabilities of a reply's answer tokens, as the Responses API gives them (``logprobs`` entries:
    token, logprob, bytes, top_logprobs), read from its sampled tokens by their ids: a token is the answer's where
    it lies outside the reasoning (up to ``</think>``, from the start where the prompt opens it) and outside the
    calls (``<tool_call>`` to ``</tool_call>``, where the reply's calls are read: `tools`; else their text is the
    answer's), and is neither one of the tags read nor an end or control token. Tokens the LoopGuard forced have
    none."""

    def __init__(self, tokenizer: Any, opens_reasoning: bool, tools: bool) -> None:
        self.tokenizer = tokenizer
        sp = tokenizer.special_ids
        self.think, self.end_think = sp.think, sp.end_think
        self.open_call, self.close_call = (sp.tool_call, sp.end_tool_call) if tools else (None, None)
        text_tags = set() if tools else {sp.tool_call, sp.end_tool_call}  # call markup read as the answer's text
        self.left_out = (set(tokenizer.added_ids) | set(tokenizer.eos_token_ids)) - text_tags
        self.in_reasoning, self.in_call = opens_reasoning, False

    def entries(self, token_ids: list[int], logprobs: list[float],
                top: list[list[tuple[int, float]]]) -> list[dict[str, Any]]:
        """The entries of the answer tokens among `token_ids` (the reply's next tokens: the first len(`logprobs`)
        sampled, with their `logprobs` and `top` alternatives, the rest forced), moving through the reply's
        reasoning and calls as their tags pass (forced ones too)."""
        keep = []
        for i, t in enumerate(token_ids):
            forced = i >= len(logprobs)  # no entry, but a tag it is still moves the state
            if t == self.think:
                self.in_reasoning = True
            elif t == self.end_think:
                self.in_reasoning = False
            elif t == self.open_call:
                self.in_call = True
            elif t == self.close_call:
                self.in_call = False
            elif not (forced or self.in_reasoning or self.in_call or t in self.left_out):
                keep.append(i)
        if not keep:
            return []
        made = token_logprobs(self.tokenizer, [token_ids[i] for i in keep], [logprobs[i] for i in keep],
                              [top[i] if i < len(top) else [] for i in keep])
        return [entry.dump() for entry in made]


class Items:
    """The reply's output items as its parsed pieces arrive (reasoning, text, calls, in the model's order): the
    stream's events for each piece (`add`, `close`), and the items (`items`). A text that is only whitespace
    opens no message (it stays pending until a visible character joins it). With logprobs, the answer tokens'
    entries (`tokens`) wait until the next text delta of a message, which carries them."""

    def __init__(self, emit: Any, encrypted: bool = False) -> None:
        self.emit = emit  # (event type, payload dict) -> None
        self.encrypted = encrypted  # reasoning items carry their text as `encrypted_content` too
        self.items: list[rs.MessageOut | rs.ReasoningOut | rs.FunctionCallOut] = []
        self.open: str | None = None  # "reasoning" | "message": the item taking deltas
        self.item_id = ""  # the open item's
        self.text = ""
        self.pending = ""  # whitespace not yet in a message
        self.waiting: list[dict[str, Any]] = []  # answer tokens' logprobs entries not yet in a delta
        self.logprobs: list[dict[str, Any]] = []  # the open message's

    def so_far(self) -> list[Any]:
        """The items made so far, the open one as it stands ("in_progress")."""
        return list(self.items) if self.open is None else [*self.items, self._open_item("in_progress")]

    def _open_item(self, status: str) -> Any:
        """The open item as an output item with `status` (its one content part: `item.content[0]`)."""
        if self.open == "reasoning":
            return rs.ReasoningOut(id=self.item_id, content=[rs.ReasoningText(text=self.text)], status=status,
                                   encrypted_content=self.text if self.encrypted else None)
        return rs.MessageOut(id=self.item_id, content=[rs.OutputText(text=self.text, logprobs=self.logprobs)],
                             status=status)

    def tokens(self, entries: list[dict[str, Any]]) -> None:
        """Answer tokens' logprobs entries (`AnswerTokens.entries`), for the next message text delta."""
        self.waiting += entries

    def _index(self) -> int:
        return len(self.items)

    def _start(self, kind: str) -> None:
        self.close()
        self.open, self.text = kind, ""
        self.item_id = item_id = new_id("rs_" if kind == "reasoning" else "msg_")
        if kind == "reasoning":
            added: dict[str, Any] = {"type": "reasoning", "id": item_id, "summary": [], "content": [],
                                     "status": "in_progress"}
            part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
        else:
            added = {"type": "message", "id": item_id, "status": "in_progress", "role": "assistant", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self.logprobs = []
        self.emit("response.output_item.added", {"output_index": self._index(), "item": added})
        self.emit("response.content_part.added", {"item_id": item_id, "output_index": self._index(),
                                                  "content_index": 0, "part": part})

    def _delta(self, text: str) -> None:
        self.text += text
        kind = "response.reasoning_text.delta" if self.open == "reasoning" else "response.output_text.delta"
        extra: dict[str, Any] = {}
        if self.open == "message":
            extra["logprobs"], self.waiting = self.waiting, []
            self.logprobs += extra["logprobs"]
        self.emit(kind, {"item_id": self.item_id, "output_index": self._index(), "content_index": 0,
                         "delta": text, **extra})

    def reasoning(self, text: str) -> None:
        if self.open != "reasoning":
            self._start("reasoning")
        self._delta(text)

    def content(self, text: str) -> None:
        if self.open != "message":
            if not (self.pending + text).strip():
                self.pending += text
                return
            text, self.pending = self.pending + text, ""
            self._start("message")
        self._delta(text)

    def call(self, name: str, arguments: str) -> None:
        self.close()
        item = rs.FunctionCallOut(id=new_id("fc_"), call_id=new_id("call_"), name=name, arguments=arguments)
        i = self._index()
        self.emit("response.output_item.added", {"output_index": i, "item": {**item.dump(), "arguments": "",
                                                                            "status": "in_progress"}})
        self.emit("response.function_call_arguments.delta", {"item_id": item.id, "output_index": i,
                                                            "delta": arguments})
        self.emit("response.function_call_arguments.done", {"item_id": item.id, "output_index": i,
                                                           "name": name, "arguments": arguments})
        self.items.append(item)
        self.emit("response.output_item.done", {"output_index": i, "item": item.dump()})

    def close(self, status: str = "completed") -> None:
        """End the open reasoning or message item (`status` "incomplete" where max_output_tokens cut it)."""
        if self.open is None:
            return
        i, item_id, text = self._index(), self.item_id, self.text
        item = self._open_item(status)
        part = item.content[0]
        if self.open == "reasoning":
            self.emit("response.reasoning_text.done", {"item_id": item_id, "output_index": i, "content_index": 0,
                                                       "text": text})
        else:
            self.emit("response.output_text.done", {"item_id": item_id, "output_index": i, "content_index": 0,
                                                    "text": text, "logprobs": self.logprobs})
        self.emit("response.content_part.done", {"item_id": item_id, "output_index": i, "content_index": 0,
                                                 "part": part.dump()})
        self.items.append(item)
        self.emit("response.output_item.done", {"output_index": i, "item": item.dump()})
        self.open = None

    def feed(self, outputs: list) -> None:
        for out in outputs:
            if isinstance(out, ReasoningDelta):
                self.reasoning(out.text)
            elif isinstance(out, ContentDelta):
                self.content(out.text)
            elif isinstance(out, ToolCallEvent):
                self.call(out.tool_call.name, out.tool_call.arguments_json())


def _encrypted(plan: ResponsePlan) -> bool:
    return "reasoning.encrypted_content" in (plan.body.include or ())


def _parser(plan: ResponsePlan) -> StreamingOutputParser:
    return StreamingOutputParser(plan.prompt.opens_reasoning, plan.prompt.tools, plan.prompt.max_calls,
                                 constrained(plan.request.params), calls_only=calls_only(plan.request.params))


def _response(plan: ResponsePlan, items: list, last: TokenEvent | Collected | None, output_ids: list[int],
              tokenizer: Any) -> rs.ResponseObject:
    """The response object: in progress (`last` None) or finished with `last`'s finish reason and usage."""
    body = plan.body
    usage, status, incomplete, guard = None, "in_progress", None, None
    if last is not None:
        reason = last.finish_reason
        if reason == FinishReason.ABORT:
            raise aborted_error()
        status = "incomplete" if reason == FinishReason.LENGTH else "completed"
        incomplete = rs.IncompleteDetails(reason="max_output_tokens") if reason == FinishReason.LENGTH else None
        guard = LoopGuardInfo(stopped=True, note=last.note) if reason == FinishReason.LOOP else None
        sp = tokenizer.special_ids
        reasoning = reasoning_tokens(output_ids, sp.end_think, plan.prompt.opens_reasoning, sp.think) or 0
        num_prompt = last.num_prompt_tokens or len(plan.prompt.ids)
        usage = rs.ResponseUsage(input_tokens=num_prompt,
                                 input_tokens_details=rs.InputTokensDetails(cached_tokens=last.num_cached_tokens),
                                 output_tokens=last.num_output_tokens,
                                 output_tokens_details=rs.OutputTokensDetails(reasoning_tokens=reasoning),
                                 total_tokens=num_prompt + last.num_output_tokens)
    fmt = body.text.format if body.text is not None and body.text.format is not None else None
    text: dict[str, Any] = {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}}
    if body.text is not None and body.text.verbosity is not None:
        text["verbosity"] = body.text.verbosity
    return rs.ResponseObject(
        id=plan.request.request_id, created_at=plan.created, status=status, incomplete_details=incomplete,
        instructions=body.instructions, model=plan.model, output=items,
        parallel_tool_calls=body.parallel_tool_calls is not False, temperature=body.temperature, top_p=body.top_p,
        max_output_tokens=body.max_output_tokens,
        tool_choice=echoed_tool_choice(body.tool_choice), tools=body.tools or [], text=text,
        reasoning=body.reasoning.model_dump() if body.reasoning is not None else None,
        previous_response_id=body.previous_response_id, store=plan.keep is not None, background=bool(body.background),
        conversation={"id": plan.conversation} if plan.conversation else None,
        truncation=body.truncation or "disabled",
        metadata=body.metadata or {}, usage=usage, user=body.user, loop_guard=guard)


def echoed_tool_choice(choice: Any) -> Any:
    """tool_choice as the response carries it: in the API's shape (a function by name as ``{"type": "function",
    "name"}``, chat completions' ``{"function": {"name"}}`` form too), "auto" where none was given."""
    if isinstance(choice, rs.FunctionChoice):
        return choice.model_dump()
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        return {"type": "function", "name": choice["function"].get("name")}
    return choice or "auto"


def _item_status(last: TokenEvent | Collected) -> str:
    """The status of the item open at the end: cut by max_output_tokens, or completed."""
    return "incomplete" if last.finish_reason == FinishReason.LENGTH else "completed"


def response(plan: ResponsePlan, done: Collected, tokenizer: Any) -> rs.ResponseObject:
    """The whole response of a finished request (its text parsed as the stream parses it; with logprobs, token
    by token as the stream reads them, so that each message carries its own tokens' entries)."""
    parser = _parser(plan)
    items = Items(lambda kind, payload: None, _encrypted(plan))
    if plan.request.params.logprobs is None:
        items.feed(parser.feed(done.text) + parser.finish())
    else:
        answer = AnswerTokens(tokenizer, plan.prompt.opens_reasoning, bool(plan.prompt.tools))
        detok, j = IncrementalDetokenizer(tokenizer), 0  # j: the next sampled token's entry
        for t, sampled in zip(done.token_ids, done.sampled):
            items.tokens(answer.entries([t], done.logprobs[j:j + sampled], done.top_logprobs[j:j + sampled]))
            j += sampled
            items.feed(parser.feed(detok.push(t)))
        items.feed(parser.feed(detok.finish()) + parser.finish())
    items.close(_item_status(done))
    return _kept(plan, _response(plan, items.items, done, done.token_ids, tokenizer))


class ResponseStream:
    """Turns engine events into the Responses API's typed SSE events (module docstring)."""

    def __init__(self, plan: ResponsePlan, tokenizer: Any) -> None:
        self.plan, self.tokenizer = plan, tokenizer
        self.parser = _parser(plan)
        self.lines: list[str] = []
        self.seq = 0
        self.items = Items(self._emit, _encrypted(plan))
        self.output_ids: list[int] = []
        self.final: rs.ResponseObject | None = None  # the whole response, once the stream has ended
        self._progress_due = False  # a queued run's response.in_progress, sent with its first tokens (`start`)
        self.answer = AnswerTokens(tokenizer, plan.prompt.opens_reasoning, bool(plan.prompt.tools)) \
            if plan.request.params.logprobs is not None else None

    def _emit(self, kind: str, payload: dict[str, Any]) -> None:
        self.lines.append(sse_event(kind, json.dumps({"type": kind, "sequence_number": self.seq, **payload},
                                                     ensure_ascii=False)))
        self.seq += 1

    def _take(self) -> list[str]:
        lines, self.lines = self.lines, []
        return lines

    def start(self, first: TokenEvent | None, queued: bool = False) -> list[str]:
        """The stream's opening: ``response.created`` and ``response.in_progress``; a background run's (`queued`,
        before its request has run) ``response.created`` and ``response.queued`` with the response "queued", its
        ``response.in_progress`` then before its first tokens' events (`event`)."""
        head = _response(self.plan, [], None, [], self.tokenizer)
        if queued:
            waiting = head.model_copy(update={"status": "queued"}).dump()
            self._emit("response.created", {"response": waiting})
            self._emit("response.queued", {"response": waiting})
            self._progress_due = True
        else:
            self._emit("response.created", {"response": head.dump()})
            self._emit("response.in_progress", {"response": head.dump()})
        return self._take()

    def event(self, ev: TokenEvent) -> list[str]:
        if self._progress_due:
            self._progress_due = False
            self._emit("response.in_progress", {"response": _response(self.plan, [], None, [],
                                                                      self.tokenizer).dump()})
        self.output_ids += ev.token_ids
        if self.answer is not None:
            self.items.tokens(self.answer.entries(ev.token_ids, ev.logprobs, ev.top_logprobs))
        outputs = self.parser.feed(ev.text)
        if ev.finish_reason is not None:
            outputs += self.parser.finish()
        self.items.feed(outputs)
        return self._take()

    def snapshot(self, status: str) -> rs.ResponseObject:
        """The response as it stands (its items so far, the open one in progress), with `status`."""
        head = _response(self.plan, self.items.so_far(), None, self.output_ids, self.tokenizer)
        return head.model_copy(update={"status": status})

    def error(self, err: ApiError) -> list[str]:
        """The stream's end where it fails after its headers: the API's ``error`` event, numbered as the others,
        then ``response.failed`` with the error and the items made so far (`final`; not stored, unless in the
        background, whose runs keep every end)."""
        body = err.openai_body()["error"]
        code = body["code"] or body["type"]
        self._emit("error", {"code": code, "message": body["message"], "param": body["param"]})
        failed = _response(self.plan, self.items.items, None, self.output_ids, self.tokenizer)
        self.final = failed.model_copy(update={"status": "failed", "store": bool(self.plan.body.background),
                                               "error": {"code": code, "message": body["message"]}})
        self._emit("response.failed", {"response": self.final.dump()})
        return self._take()

    def cancelled(self) -> list[str]:
        """The end of a background response cancelled (its request aborted): the open item "incomplete", the
        response "cancelled" (`final`), in a ``response.failed`` event (the stream's events have no other for an
        end without a reply)."""
        self.items.close("incomplete")
        whole = _response(self.plan, self.items.items, None, self.output_ids, self.tokenizer)
        self.final = whole.model_copy(update={"status": "cancelled"})
        self._emit("response.failed", {"response": self.final.dump()})
        return self._take()

    def end(self, last: TokenEvent) -> list[str]:
        self.items.close(_item_status(last))
        self.final = _kept(self.plan, _response(self.plan, self.items.items, last, self.output_ids, self.tokenizer))
        self._emit("response.incomplete" if self.final.status == "incomplete" else "response.completed",
                   {"response": self.final.dump()})
        return self._take()
