"""Anthropic /v1/messages and /v1/messages/count_tokens: request -> engine `Request`, events -> message / events.

Choices made where the API leaves room:
- thinking: off unless ``thinking`` is "enabled", "adaptive" or "between_tools" (off is the API's default). With
  "enabled", the reasoning is capped at about ``budget_tokens``: the engine has no per-request hook for it, so
  `budgeted_thinking` ends the reasoning itself (abort, then continue from a prompt ending in ``</think>``; see
  streams.py). Anthropic's minimum budget (1,024) is not enforced, nor a budget below ``max_tokens``: ``max_tokens``
  caps the whole output, reasoning and the forced ``</think>`` included.
- thinking blocks carry a ``signature`` (a hash of the thinking text); signatures sent back are not checked.
  ``display: "omitted"`` returns thinking blocks with empty text and the signature.
- tool_choice "none" leaves the tools out of the prompt; "any" and "tool" add an instruction to the prompt and
  constrain the reply (after any reasoning) to tool calls of the tools allowed, their inputs to each tool's
  input_schema (not after a prefill, which has begun the reply). Under "auto" the reply is free until the model
  opens a call (its ``<tool_call>`` token); the calls are then held to the tools' names and input_schemas, in the
  form the chat template writes (JSON, or Qwen3.5 / Qwen3.6's XML: `decapybara.chat.CallSyntax`; either way a
  ``tool_use`` block's input is the object). Server tools (a ``type`` other than "custom") are refused.
- ``output_config.format`` (structured outputs, ``{"type": "json_schema", "schema": ...}``) constrains the reply's
  text, after any thinking, to what the schema accepts (`decapybara.engine.json_schema`), or, beside tools under
  tool_choice auto, to tool calls; beside "any" / "tool" the reply is the call; ``effort`` is read and not acted
  on.
- a tool_result with ``is_error`` is rendered as "Error: " + its content.
- a trailing assistant message is a prefill: the reply continues it and the response holds only the new text,
  as the model wrote it (its leading whitespace kept: prefill + reply is the whole text).
- a generation the LoopGuard stopped ends with stop_reason "end_turn" and an extra top-level field
  ``loop_guard: {"stopped": true, "note": ...}`` (in the stream: on the message_delta event).
- usage: input_tokens = prompt tokens not read from the prefix cache, cache_read_input_tokens = the cached ones,
  cache_creation_input_tokens = 0 (the cache is automatic and free to write).
- max_tokens is clamped to the context left after the prompt.
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass
from typing import Any

from decapybara.api import anthropic_schemas as an
from decapybara.api.common import (
    ChatInput,
    Collected,
    Prompt,
    ToolChoice,
    aborted_error,
    calls_only,
    checked_schema,
    constrained,
    conversation_key,
    make_request,
    new_id,
    output_budget,
    render_prompt,
    settle_constraint,
)
from decapybara.api.errors import bad_request
from decapybara.api.schemas_base import LoopGuardInfo
from decapybara.api.streams import sse_event
from decapybara.chat import (
    ContentDelta,
    ReasoningDelta,
    StreamingOutputParser,
    ToolCallEvent,
)
from decapybara.engine.sampling import SamplingParams
from decapybara.engine.sequence import FinishReason, Request, TokenEvent

# ---------------------------------------------------------------------------------------------- request


def _no_media(block: Any, where: str) -> None:
    if isinstance(block, an.ImageBlock):
        raise bad_request("image inputs are not supported yet: the served model reads text only", where,
                          "image_input_unsupported")
    if isinstance(block, an.DocumentBlock):
        raise bad_request("document blocks are not supported", where)


def _tool_result(block: an.ToolResultBlock, where: str) -> dict[str, Any]:
    if block.content is None or isinstance(block.content, str):
        text = block.content or ""
    else:
        for k, part in enumerate(block.content):
            _no_media(part, f"{where}.content.{k}")
        text = "".join(p.text for p in block.content)
    return {"role": "tool", "tool_call_id": block.tool_use_id, "content": ("Error: " + text) if block.is_error else text}


def _user(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, b in enumerate(blocks):
        at = f"{where}.content.{j}"
        _no_media(b, at)
        if isinstance(b, an.TextBlock):
            texts.append(b.text)
        elif isinstance(b, an.ToolResultBlock):
            if texts:
                out.append({"role": "user", "content": "".join(texts)})
                texts = []
            out.append(_tool_result(b, at))
        else:
            raise bad_request(f"{b.type} blocks may not appear in user messages", at)
    if texts or not out:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def _assistant(blocks: list[Any], where: str) -> dict[str, Any]:
    texts, reasoning, calls = [], [], []
    for j, b in enumerate(blocks):
        at = f"{where}.content.{j}"
        _no_media(b, at)
        if isinstance(b, an.TextBlock):
            texts.append(b.text)
        elif isinstance(b, an.ThinkingBlock):
            reasoning.append(b.thinking)
        elif isinstance(b, an.ToolUseBlock):
            calls.append({"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}})
        elif isinstance(b, an.ToolResultBlock):
            raise bad_request("tool_result blocks belong in user messages", at)
        # redacted_thinking: nothing this model can read
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if reasoning:
        msg["reasoning_content"] = "\n".join(reasoning)
    if calls:
        msg["tool_calls"] = calls
    return msg


def chat_messages(body: an.CountTokensRequest) -> tuple[list[dict[str, Any]], str]:
    """Anthropic system + messages -> (internal chat messages, prefill text of a trailing assistant message)."""
    out: list[dict[str, Any]] = []
    if body.system:
        text = body.system if isinstance(body.system, str) else "\n".join(b.text for b in body.system)
        out.append({"role": "system", "content": text})
    prefill = ""
    messages = list(body.messages)
    last = messages[-1]
    if last.role == "assistant" and (isinstance(last.content, str) or not any(
            isinstance(b, an.ToolUseBlock) for b in last.content)):
        prefill = last.content if isinstance(last.content, str) else "".join(
            b.text for b in last.content if isinstance(b, an.TextBlock))
        messages.pop()
        if not messages:
            raise bad_request("messages must contain a user message", "messages")
    for i, m in enumerate(messages):
        where = f"messages.{i}"
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
        elif m.role == "user":
            out += _user(m.content, where)
        else:
            out.append(_assistant(m.content, where))
    return out, prefill


def _tools(tools: list[an.ToolDef] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.type not in (None, "custom"):
            raise bad_request(f"server tool {t.type!r} is not supported; define client tools with an input_schema",
                              f"tools.{i}.type")
        if t.input_schema is None:
            raise bad_request("tools need an input_schema", f"tools.{i}.input_schema")
        fn: dict[str, Any] = {"name": t.name}
        if t.description:
            fn["description"] = t.description
        fn["parameters"] = t.input_schema
        out.append({"type": "function", "function": fn})
    return out


def chat_input(body: an.CountTokensRequest) -> ChatInput:
    messages, prefill = chat_messages(body)
    choice = body.tool_choice
    mode = {"auto": "auto", "any": "required", "tool": "named", "none": "none"}[choice.type] if choice else "auto"
    tool_choice = ToolChoice(mode, choice.name if isinstance(choice, an.ToolChoiceTool) else None,
                             not getattr(choice, "disable_parallel_tool_use", None))
    thinking = body.thinking is not None and not isinstance(body.thinking, an.ThinkingDisabled)
    return ChatInput(messages, _tools(body.tools), tool_choice, thinking, prefill=prefill)


def count_tokens(body: an.CountTokensRequest, tokenizer: Any) -> an.CountTokensResponse:
    return an.CountTokensResponse(input_tokens=len(render_prompt(tokenizer, chat_input(body)).ids))


def output_schema(body: an.MessagesRequest, chat: ChatInput) -> str | None:
    """`output_config.format`'s schema as `SamplingParams.json_schema` text (None without one); a 400 after a
    prefill (the constraint would start inside the reply). Beside a tool call tool_choice requires it is moot:
    the reply is that call (`settle_constraint`)."""
    fmt = body.output_config.format if body.output_config is not None else None
    fmt = fmt or body.output_format
    if fmt is None:
        return None
    if chat.prefill:
        raise bad_request("output_config.format cannot follow a prefilled assistant turn: the reply would begin "
                          "outside the schema", "output_config.format")
    return checked_schema(fmt.schema_, "output_config.format.schema")


@dataclass(slots=True)
class MessagePlan:
    request: Request
    prompt: Prompt
    model: str
    thinking_budget: int | None  # cap on reasoning tokens (thinking "enabled"), None = no cap
    show_thinking: bool  # False under display "omitted": thinking blocks keep only their signature
    prefilled: bool = False  # the prompt ends in a prefill the reply continues (its leading whitespace kept)

    def parser(self) -> StreamingOutputParser:
        return StreamingOutputParser(self.prompt.opens_reasoning, self.prompt.tools, self.prompt.max_calls,
                                     constrained(self.request.params), continues=self.prefilled,
                                     calls_only=calls_only(self.request.params))


def plan_message(body: an.MessagesRequest, client: Any, model: str, conversation: str | None) -> MessagePlan:
    """Validate and map a messages request; raises ApiError / InvalidRequestError / ContextOverflowError."""
    chat = chat_input(body)
    prompt = render_prompt(client.tokenizer, chat)
    max_tokens = output_budget(body.max_tokens, len(prompt.ids), client.max_model_len, "max_tokens")
    schema = output_schema(body, chat)
    params = SamplingParams(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0,
        stop=tuple(body.stop_sequences or ()), max_tokens=max(max_tokens, 1), json_schema=schema,
        loop_guard=body.loop_guard)
    params = settle_constraint(params, chat, prompt.call_format)
    user = body.metadata.user_id if body.metadata else None
    key = conversation_key(conversation, user, chat.messages)
    request = make_request(new_id("msg_"), prompt.ids, params, key, client.max_model_len, client.vocab_size,
                           history_end=prompt.history_end)
    budget = body.thinking.budget_tokens if isinstance(body.thinking, an.ThinkingEnabled) else None
    show = getattr(body.thinking, "display", None) != "omitted"
    return MessagePlan(request, prompt, model, budget, show, bool(chat.prefill))


# ---------------------------------------------------------------------------------------------- response


def signature(thinking: str) -> str:
    """The opaque signature of a thinking block (a hash of its text)."""
    return base64.b64encode(hashlib.sha256(b"decapybara-thinking\0" + thinking.encode()).digest()).decode()


def stop_reason(reason: FinishReason | None, stop_string: str | None, has_tool_calls: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished generation."""
    if reason == FinishReason.ABORT:
        raise aborted_error()
    if reason == FinishReason.LENGTH:
        return "max_tokens", None
    if reason == FinishReason.STOP and stop_string is not None:
        return "stop_sequence", stop_string
    if reason == FinishReason.STOP and has_tool_calls:
        return "tool_use", None
    return "end_turn", None


def _usage(num_prompt: int, num_cached: int, num_output: int) -> an.Usage:
    return an.Usage(input_tokens=num_prompt - num_cached, output_tokens=num_output, cache_read_input_tokens=num_cached)


def _guard(reason: FinishReason | None, note: str | None) -> LoopGuardInfo | None:
    return LoopGuardInfo(stopped=True, note=note) if reason == FinishReason.LOOP else None


def message(plan: MessagePlan, done: Collected) -> an.Message:
    # the blocks in the order the stream sends them (MessageStream): runs of one kind, tool calls as they come
    parser = plan.parser()
    runs: list[list] = []
    for out in [*parser.feed(done.text), *parser.finish()]:
        if not isinstance(out, ToolCallEvent) and runs and runs[-1][0] is type(out):
            runs[-1][1] += out.text
        else:
            runs.append([type(out), out.tool_call if isinstance(out, ToolCallEvent) else out.text])
    blocks: list[an.ContentOut] = []
    for kind, value in runs:
        if kind is ReasoningDelta:
            blocks.append(an.ThinkingOut(thinking=value if plan.show_thinking else "", signature=signature(value)))
        elif kind is ContentDelta:
            blocks.append(an.TextOut(text=value))
        else:
            blocks.append(an.ToolUseOut(id=new_id("toolu_"), name=value.name, input=value.arguments))
    has_calls = any(kind is ToolCallEvent for kind, _ in runs)
    reason, sequence = stop_reason(done.finish_reason, done.stop_string, has_calls)
    return an.Message(id=plan.request.request_id, model=plan.model, content=blocks, stop_reason=reason,
                      stop_sequence=sequence, loop_guard=_guard(done.finish_reason, done.note),
                      usage=_usage(done.num_prompt_tokens or len(plan.prompt.ids), done.num_cached_tokens,
                                   done.num_output_tokens))


def _sse(ev: an.ResponseModel) -> str:
    return sse_event(ev.type, ev.json_text())  # type: ignore[attr-defined]


PING = sse_event("ping", an.Ping().json_text())


class MessageStream:
    """Turns engine events into the Messages event sequence: message_start, ping, then per block
    content_block_start / content_block_delta... / content_block_stop (thinking blocks end with a
    signature_delta), then message_delta (stop_reason, usage) and message_stop."""

    def __init__(self, plan: MessagePlan) -> None:
        self.plan = plan
        self.parser = plan.parser()
        self.index = -1
        self.open: str | None = None  # "thinking" | "text" | None
        self.thinking = ""
        self.has_tool_calls = False

    def start(self, first: TokenEvent | None) -> list[str]:
        n = first.num_prompt_tokens if first is not None else len(self.plan.prompt.ids)
        cached = first.num_cached_tokens if first is not None else 0
        msg = an.Message(id=self.plan.request.request_id, model=self.plan.model, content=[], stop_reason=None,
                         stop_sequence=None, usage=_usage(n, cached, 0))
        return [_sse(an.MessageStart(message=msg)), PING]

    def _close(self) -> list[str]:
        lines = []
        if self.open == "thinking":
            lines.append(_sse(an.ContentBlockDelta(index=self.index,
                                                   delta=an.SignatureDelta(signature=signature(self.thinking)))))
        if self.open is not None:
            lines.append(_sse(an.ContentBlockStop(index=self.index)))
        self.open = None
        return lines

    def _open(self, kind: str, block: an.ContentOut) -> list[str]:
        lines = self._close()
        self.index += 1
        self.open = kind
        return [*lines, _sse(an.ContentBlockStart(index=self.index, content_block=block))]

    def event(self, ev: TokenEvent) -> list[str]:
        outputs = self.parser.feed(ev.text)
        if ev.finish_reason is not None:
            outputs += self.parser.finish()
        lines: list[str] = []
        for out in outputs:
            if isinstance(out, ReasoningDelta):
                if self.open != "thinking":
                    lines += self._open("thinking", an.ThinkingOut(thinking="", signature=""))
                    self.thinking = ""
                self.thinking += out.text
                if self.plan.show_thinking:
                    lines.append(_sse(an.ContentBlockDelta(index=self.index,
                                                           delta=an.ThinkingDelta(thinking=out.text))))
            elif isinstance(out, ContentDelta):
                if self.open != "text":
                    lines += self._open("text", an.TextOut(text=""))
                lines.append(_sse(an.ContentBlockDelta(index=self.index, delta=an.TextDelta(text=out.text))))
            elif isinstance(out, ToolCallEvent):
                self.has_tool_calls = True
                call = out.tool_call
                lines += self._open("tool_use", an.ToolUseOut(id=new_id("toolu_"), name=call.name, input={}))
                lines.append(_sse(an.ContentBlockDelta(index=self.index,
                                                       delta=an.InputJsonDelta(partial_json=call.arguments_json()))))
                lines += self._close()
        return lines

    def end(self, last: TokenEvent) -> list[str]:
        reason, sequence = stop_reason(last.finish_reason, last.stop_string, self.has_tool_calls)
        usage = _usage(last.num_prompt_tokens or len(self.plan.prompt.ids), last.num_cached_tokens,
                       last.num_output_tokens)
        delta = an.MessageDelta(delta=an.StopDelta(stop_reason=reason, stop_sequence=sequence), usage=usage,
                                loop_guard=_guard(last.finish_reason, last.note))
        return [*self._close(), _sse(delta), _sse(an.MessageStop())]
