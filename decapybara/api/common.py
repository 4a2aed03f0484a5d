"""What both APIs share: the internal chat input, prompt rendering, request checks, ids and event collection.

Pure functions and dataclasses; no FastAPI here.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import secrets
import string
from dataclasses import dataclass, field
from typing import Any

from decapybara.api.errors import ApiError, bad_request
from decapybara.chat import JSON_CALLS, TEMPLATE_GLOBALS, CallSyntax, prompt_opens_reasoning
from decapybara.engine.json_schema import (
    SchemaError,
    compile_schema,
    compile_spec,
    schema_text,
    tool_call_spec,
    xml_param_kinds,
)
from decapybara.engine.sampling import SamplingParams
from decapybara.engine.sequence import FinishReason, Request, TokenEvent
from decapybara.errors import ContextOverflowError, InvalidRequestError

_ALNUM = string.ascii_letters + string.digits
# Template variables a request may not set through chat_template_kwargs (render_chat's own arguments).
_RESERVED_TEMPLATE_VARS = frozenset({"messages", "tools", "add_generation_prompt", "documents", "template"}
                                    ) | TEMPLATE_GLOBALS


def new_id(prefix: str, length: int = 24) -> str:
    """A random id such as ``call_3fT...`` (letters and digits)."""
    return prefix + "".join(secrets.choice(_ALNUM) for _ in range(length))


@dataclass(slots=True, frozen=True)
class ToolChoice:
    """How the request wants tools used: auto | none | required | named (then `name`); `parallel` False: at most
    one call in the reply (OpenAI's parallel_tool_calls, Anthropic's disable_parallel_tool_use)."""

    mode: str = "auto"
    name: str | None = None
    parallel: bool = True


@dataclass(slots=True)
class ChatInput:
    """A chat request in the internal form `Tokenizer.render_chat` takes.

    `messages` use roles system/user/assistant/tool, assistant `tool_calls` as ``{"function": {"name",
    "arguments"}}`` and reasoning as `reasoning_content`; `tools` are OpenAI function tools. `prefill` is text the
    assistant's reply must start with (an Anthropic trailing assistant message): it ends the prompt.
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    enable_thinking: bool = True
    template_vars: dict[str, Any] = field(default_factory=dict)
    prefill: str = ""


@dataclass(slots=True, frozen=True)
class Prompt:
    ids: tuple[int, ...]
    text: str
    opens_reasoning: bool  # the model's output starts inside <think> (parse with in_reasoning=True)
    # where the request offers tools (and tool_choice is not "none"), the form of their calls: parse <tool_call>
    # blocks with it (the parsers' `tools`); None: no tools
    tools: CallSyntax | None = None
    max_calls: int | None = None  # 1 where parallel calls are off: the reply's later calls are dropped
    history_end: int | None = None  # `Request.history_end`: where the generation prompt (and any note) starts

    @property
    def call_format(self) -> str:
        """The form the model writes calls in ("json" or "xml"; `call_syntax`)."""
        return (self.tools or JSON_CALLS).format


def call_syntax(fmt: str, tools: list[dict[str, Any]]) -> CallSyntax:
    """How a reply's calls of OpenAI function `tools` are read, in the form `fmt` (the tokenizer's
    `tool_format`): for the XML form, with each tool's parameter kinds (`json_schema.xml_param_kinds`)."""
    if fmt != "xml":
        return JSON_CALLS
    return CallSyntax(fmt, {t["function"]["name"]: xml_param_kinds(t["function"].get("parameters")) for t in tools})


def call_arguments(arguments: str | dict[str, Any]) -> str | dict[str, Any]:
    """A call's arguments sent back in a conversation, as chat templates take them: the object where the string
    is JSON of one (templates read them as a mapping, e.g. Qwen3.5's ``tool_call.arguments|items``, which a
    string breaks; a JSON template writes the object back as `ToolCall.arguments_json` wrote it, an XML one each
    value as the model wrote it: a string raw, others as JSON), else as sent."""
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except (ValueError, RecursionError):
            return arguments
        return parsed if isinstance(parsed, dict) else arguments
    return arguments


def tool_instruction(choice: ToolChoice) -> str | None:
    """The sentence that asks for the calls tool_choice required / named constrains the reply to (so that the
    model writes them by choice, not only where the constraint leaves nothing else), or for parallel calls off."""
    if choice.mode == "required":
        return (f"In this reply you must call {'at least' if choice.parallel else 'exactly'} one of the tools listed "
                "in <tools></tools>, inside <tool_call></tool_call> tags.")
    if choice.mode == "named":
        return (f"In this reply you must call the tool `{choice.name}`{'' if choice.parallel else ' once'}, inside "
                "<tool_call></tool_call> tags.")
    if choice.mode == "auto" and not choice.parallel:
        return "In this reply call at most one tool."
    return None


def _with_system_note(messages: list[dict[str, Any]], note: str) -> list[dict[str, Any]]:
    """`note` appended to the first system message (one made where there is none)."""
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0])
        content = first.get("content")
        if isinstance(content, list):
            first["content"] = [*content, {"type": "text", "text": "\n\n" + note}]
        else:
            first["content"] = (content + "\n\n" + note) if content else note
        return [first, *messages[1:]]
    return [{"role": "system", "content": note}, *messages]


def render_prompt(tokenizer: Any, chat: ChatInput) -> Prompt:
    """Render and tokenise a chat with the generation prompt.

    tool_choice "none" leaves the tools out of the prompt; "required" and named choices, and parallel calls off,
    add an instruction after the conversation (`tool_instruction`; in the first system message where the chat
    template takes system messages only first). Under "required" and named choices the reply is also constrained
    to tool calls (`settle_constraint`); a reply's calls past `Prompt.max_calls` are dropped; they are read in the
    form the chat template writes them (`Prompt.tools`, `Tokenizer.tool_format`). Raises ApiError /
    InvalidRequestError on bad input.
    """
    reserved = _RESERVED_TEMPLATE_VARS.intersection(chat.template_vars)
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {sorted(reserved)}", "chat_template_kwargs")
    tools = chat.tools or None
    messages = chat.messages
    if chat.tool_choice.mode != "auto" and chat.tool_choice.mode != "none" and not tools:
        raise bad_request("tool_choice requires tools", "tool_choice")
    if chat.tool_choice.mode == "named":
        names = [t["function"]["name"] for t in tools or ()]
        if chat.tool_choice.name not in names:
            raise bad_request(f"tool_choice names {chat.tool_choice.name!r}, which is not among the tools",
                              "tool_choice")
    if tools and tokenizer.tool_format == "xml":
        _check_xml_names(tools)
    if chat.tool_choice.mode == "none":
        tools = None
    note = tool_instruction(chat.tool_choice) if tools else None

    def render(messages: list[dict[str, Any]]) -> tuple[str, list[int], str]:
        return tokenizer.chat_prompt(messages, tools, add_generation_prompt=True,
                                     enable_thinking=chat.enable_thinking, tail=chat.prefill, **chat.template_vars)

    turns_after = 1  # turns the prompt adds after the history: the generation prompt, and a note's own turn
    if note is None:
        text, ids, markup = render(messages)
    else:
        try:  # a turn of its own after the conversation: the prompt's prefix stays the same
            text, ids, markup = render([*messages, {"role": "system", "content": note}])
            turns_after = 2
        except InvalidRequestError:  # a template that takes a system message only first
            text, ids, markup = render(_with_system_note(messages, note))
    if chat.prefill and tokenizer.special_ids.im_start is not None:  # turn starts written in the prefill's text
        turns_after += tokenizer.encode(chat.prefill).count(tokenizer.special_ids.im_start)
    syntax = call_syntax(tokenizer.tool_format, tools) if tools else None
    return Prompt(tuple(ids), text, prompt_opens_reasoning(markup), syntax, None if chat.tool_choice.parallel else 1,
                  _history_end(ids, tokenizer.special_ids.im_start, turns_after))


def _check_xml_names(tools: list[dict[str, Any]]) -> None:
    """A 400 for a tool whose name the XML call form cannot hold (``<function=NAME>``: no ``<``, ``>`` or
    whitespace): its calls could be neither written under the constraint nor read back."""
    for i, tool in enumerate(tools):
        name = tool["function"]["name"]
        if any(c in "<>" or c.isspace() for c in name):
            raise bad_request(f"tools[{i}]: the name {name!r} cannot be written in this model's tool-call form "
                              "(<function=NAME>: no '<', '>' or whitespace)", f"tools[{i}].name")


def checked_schema(schema: Any, param: str) -> str:
    """A request's JSON Schema as `SamplingParams.json_schema` text, compiled here first so that one the server
    cannot enforce is a 400 naming `param` before the request is queued (the engine finds the automaton cached
    by its text where it runs in this process)."""
    try:
        text = schema_text(schema)
        compile_schema(text)
    except SchemaError as e:
        raise bad_request(f"{param}: {e}", param, "unsupported_schema") from None
    return text


def constrained(params: SamplingParams) -> bool:
    """Whether the reply is constrained from its start (JSON mode, a schema, tool calls): its parser then reads
    reasoning only at its start (`parse_assistant_output`'s `reasoning_once`), since the answer's strings may hold
    the tags. A reply whose calls are constrained only once it opens one (`lazy_tool_calls`) is read as a free one."""
    return (params.json_object or params.json_schema is not None
            or (params.tool_calls is not None and not params.lazy_tool_calls))


def calls_only(params: SamplingParams) -> bool:
    """Whether the reply is tool calls alone (tool_choice required or named: no answer beside them), so a call cut
    short by max_tokens is dropped rather than shown as content (the parsers' `calls_only`)."""
    return params.tool_calls is not None and not params.lazy_tool_calls and not _answers(params.tool_calls)


@functools.lru_cache(maxsize=256)
def _answers(spec: str) -> bool:
    """Whether a tool-call spec (`tool_call_spec`'s text, one an agent sends again and again) offers an answer."""
    return "answer" in json.loads(spec)


def settle_constraint(params: SamplingParams, chat: ChatInput, call_format: str) -> SamplingParams:
    """`params` with the reply's constraint settled (after the request's other checks, so that a request refused
    anyway compiles nothing), where tools are offered (not after a prefill, which has begun the reply):
    - tool_choice required or named: the reply is tool calls (a JSON answer asked for beside them is moot: the
      reply calls a tool);
    - auto with a schema's answer: that answer, or tool calls instead;
    - auto otherwise: free text, and once the model opens a call (`<tool_call>`), calls of the offered tools with
      arguments their parameters accept (`lazy_tool_calls`); JSON mode stays JSON mode (its objects nest deeper
      than a schema's free values).
    The calls are in `call_format`, the form the chat template writes (`Prompt.call_format`: "json" or "xml").
    They run on automata of groups of tools (`json_schema.call_groups`), so any tool set is enforced; where
    one tool's call alone cannot be built (too large), the calls are asked for, not forced."""
    tools = chat.tools if chat.tool_choice.mode != "none" and not chat.prefill else None
    if not tools:
        return params
    mode, lazy = chat.tool_choice.mode, False
    parallel = chat.tool_choice.parallel
    if mode in ("required", "named"):
        spec = tool_call_spec(tools, chat.tool_choice.name if mode == "named" else None, parallel, fmt=call_format)
    elif params.json_schema is not None:
        spec = tool_call_spec(tools, None, parallel, answer=json.loads(params.json_schema), fmt=call_format)
    elif not params.json_object:
        spec, lazy = tool_call_spec(tools, None, parallel, fmt=call_format), True
    else:
        return params
    try:
        compile_spec(spec)  # cached (failures too): the engine finds it where it runs in this process
    except SchemaError:
        return params if mode == "auto" else dataclasses.replace(params, json_schema=None, json_object=False)
    return dataclasses.replace(params, json_schema=None, json_object=False, tool_calls=spec, lazy_tool_calls=lazy)


def _history_end(ids: tuple[int, ...], im_start: int | None, turns_after: int) -> int | None:
    """The position of the `turns_after`-th last turn start (`<|im_start|>`) in a ChatML prompt: where the
    history ends (None without such turns)."""
    if im_start is None:
        return None
    seen = 0
    for i in range(len(ids) - 1, -1, -1):  # from the end: a long history is not scanned
        if ids[i] == im_start:
            seen += 1
            if seen == turns_after:
                return i
    return None


def conversation_key(header: str | None, user: str | None, messages: list[dict[str, Any]] | None,
                     prompt_text: str = "") -> str:
    """The key that groups an agent's turns: the x-conversation-id header, else the API's user field, else a
    hash of the first user message (of the prompt's opening for raw completions)."""
    if header:
        return header[:256]
    if user:
        return "user:" + user[:256]
    basis = prompt_text[:2048]
    for msg in messages or ():
        if msg.get("role") == "user":
            content = msg.get("content")
            basis = content if isinstance(content, str) else "".join(
                p.get("text", "") for p in content or () if isinstance(p, dict))
            break
    return "h:" + hashlib.sha256(basis.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def check_prompt(ids: tuple[int, ...], max_model_len: int, vocab_size: int, param: str = "messages",
                 scoring: bool = False) -> None:
    """The engine's own prompt checks, done early so they fail before any streaming starts; `param` names the
    request's prompt field in the errors; `scoring` (`SamplingParams.scores_prompt`): the prompt may fill the
    context."""
    if not ids:
        raise InvalidRequestError("the prompt is empty", param)
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise InvalidRequestError(f"prompt token ids must lie in [0, {vocab_size})", param)
    if len(ids) >= max_model_len + scoring:
        raise ContextOverflowError(f"the prompt has {len(ids)} tokens, which does not leave room for output in "
                                   f"the served context of {max_model_len} tokens", param)


def output_budget(requested: int | None, num_prompt: int, max_model_len: int, param: str) -> int:
    """max_tokens for the engine: the request's (clamped to the context left) or, when None, all of it.

    NOTE: clamping instead of rejecting prompt + max_tokens > context lets agents that always ask for large
    outputs (e.g. 32k) use a model with a smaller context; generation then ends with "length" at the limit.
    """
    if requested is not None and (isinstance(requested, bool) or requested < 1):
        raise bad_request(f"{param} must be >= 1, got {requested}", param)
    room = max_model_len - num_prompt
    return room if requested is None else min(requested, room)


def make_request(request_id: str, prompt_ids: tuple[int, ...], params: SamplingParams, conversation: str,
                 max_model_len: int, vocab_size: int, prompt_param: str = "messages",
                 history_end: int | None = None, scoring: bool = False) -> Request:
    """Validate everything the engine would (sampling values, prompt) and build the engine request."""
    params.validate(vocab_size)
    check_prompt(prompt_ids, max_model_len, vocab_size, prompt_param, scoring and params.scores_prompt)
    return Request(prompt_ids, params, request_id=request_id, conversation=conversation, history_end=history_end)


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


@dataclass(slots=True)
class Collected:
    """All events of one request folded together (non-streaming responses)."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprob_token_ids: list[int] = field(default_factory=list)  # the sampled tokens that `logprobs` describe
    logprobs: list[float] = field(default_factory=list)
    sampled: list[bool] = field(default_factory=list)  # per token of `token_ids`: it has a logprob (not forced)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    note: str | None = None
    stop_string: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    prompt_logprobs: list | None = None  # the prompt's tokens 1.. (logprob, alternatives), where asked for

    def add(self, ev: TokenEvent) -> None:
        if ev.prompt_logprobs is not None:
            self.prompt_logprobs = ev.prompt_logprobs
        self.token_ids += ev.token_ids
        self.text += ev.text
        # NOTE: tokens forced by the LoopGuard have no logprobs; they follow the sampled token of their event.
        self.logprob_token_ids += ev.token_ids[:len(ev.logprobs)]
        self.logprobs += ev.logprobs
        self.sampled += [i < len(ev.logprobs) for i in range(len(ev.token_ids))]
        self.top_logprobs += ev.top_logprobs
        self.note = ev.note or self.note
        if ev.finish_reason is not None:
            self.finish_reason, self.stop_string = ev.finish_reason, ev.stop_string
        self.num_prompt_tokens = ev.num_prompt_tokens or self.num_prompt_tokens
        self.num_cached_tokens = ev.num_cached_tokens or self.num_cached_tokens
        self.num_output_tokens = max(self.num_output_tokens, ev.num_output_tokens)


def aborted_error() -> ApiError:
    """What a consumer raises when the server (not its client) cancelled the request."""
    return ApiError(503, "the request was cancelled by the server")


def reasoning_tokens(token_ids: list[int], end_think_id: int | None, opens_reasoning: bool,
                     think_id: int | None) -> int:
    """Output tokens up to and including the one closing the reasoning (all of them if it never closed);
    0 when the output has no reasoning (the prompt did not open it and the output never opens it first)."""
    end = token_ids.index(end_think_id) if end_think_id in token_ids else len(token_ids)
    if not opens_reasoning and think_id not in token_ids[:end]:
        return 0
    return min(end + 1, len(token_ids))
