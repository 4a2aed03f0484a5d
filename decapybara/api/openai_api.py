"""OpenAI /v1/chat/completions: request -> engine `Request`, engine events -> completion or chunks.

Choices made where the API leaves room:
- thinking: on by default (the model family's default); ``reasoning_effort`` "none"/"minimal" turns it off,
  "low".."max" on; ``chat_template_kwargs.enable_thinking`` overrides both. Reasoning is returned in
  ``reasoning_content``, separate from ``content``.
- tool_choice "none" leaves the tools out of the prompt; "required" and a named function add an instruction
  to the prompt and constrain the reply (after any reasoning) to tool calls of the tools allowed, their
  arguments to each tool's parameters schema (`decapybara.engine.json_schema.compile_tool_calls`); a
  response_format beside them is moot (the reply is the calls). Under "auto" the reply is free until the model
  opens a call (its ``<tool_call>`` token); the calls are then held to the tools' names and parameters, as
  ``strict`` asks, for every tool (one whose schema uses a keyword not enforced here gets any JSON object); a set
  too large for one automaton runs on automata of groups of its tools (`decapybara.engine.tool_calls`), so any
  number of tools is enforced. Calls are read and constrained in the form the chat template writes (JSON, or
  Qwen3.5 / Qwen3.6's XML: `decapybara.chat.CallSyntax`); either way ``tool_calls`` carry JSON arguments.
- a generation the LoopGuard stopped finishes with "stop" and carries an extra choice field
  ``loop_guard: {"stopped": true, "note": ...}`` (also on the final stream chunk), so agents can tell a loop
  from a normal end.
- max_tokens / max_completion_tokens default to the rest of the context and are clamped to it.
- response_format "json_object" is JSON mode (`decapybara.engine.json_mode`: the answer, after any reasoning, is
  constrained token by token to a JSON object, and ends when it closes); "json_schema" constrains it to what
  `json_schema.schema` accepts (`decapybara.engine.json_schema`; a schema whose assertions are not enforced
  here is refused with a 400 naming the keyword); both in legacy completions too; beside tools under tool_choice auto, a schema's answer may instead be tool calls (JSON mode's
  may not). A constrained reply does not end while it reasons.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from decapybara.api import openai_schemas as oa
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
    stop_strings,
)
from decapybara.api.errors import bad_request
from decapybara.api.schemas_base import LoopGuardInfo
from decapybara.api.streams import sse_data
from decapybara.chat import (
    ContentDelta,
    ReasoningDelta,
    StreamingOutputParser,
    ToolCallEvent,
    parse_assistant_output,
)
from decapybara.engine.sampling import MAX_LOGPROBS, SamplingParams
from decapybara.engine.sequence import FinishReason, Request, TokenEvent

# ---------------------------------------------------------------------------------------------- request


def _content(content: Any, where: str) -> str | list[dict[str, str]] | None:
    if content is None or isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        if isinstance(part, oa.TextPart | oa.RefusalPart):
            parts.append({"type": "text", "text": part.text if isinstance(part, oa.TextPart) else part.refusal})
        elif isinstance(part, oa.ImagePart):
            raise bad_request("image inputs are not supported yet: the served model reads text only",
                              f"{where}.content.{j}", "image_input_unsupported")
        else:
            raise bad_request(f"{part.type} content parts are not supported", f"{where}.content.{j}")
    return parts


def chat_messages(messages: list[oa.ChatMessage]) -> list[dict[str, Any]]:
    """OpenAI messages -> the internal chat form (developer -> system, tool calls, reasoning, tool results)."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        where = f"messages.{i}"
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                               "content": _content(m.content, where)}
        if m.role == "assistant":
            reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
            if reasoning is not None:
                msg["reasoning_content"] = reasoning
            if m.tool_calls:
                msg["tool_calls"] = [{"id": tc.id, "type": "function", "function": {
                    "name": tc.function.name, "arguments": call_arguments(tc.function.arguments)}}
                    for tc in m.tool_calls]
            if m.content is None and not m.tool_calls and reasoning is None:
                raise bad_request(f"{where}: an assistant message needs content or tool_calls", f"{where}.content")
        elif m.tool_calls:
            raise bad_request(f"{where}: only assistant messages may carry tool_calls", f"{where}.tool_calls")
        elif m.content is None:
            raise bad_request(f"{where}: a {m.role} message needs content", f"{where}.content")
        if m.role == "tool":
            if not m.tool_call_id:
                raise bad_request(f"{where}: a tool message needs the tool_call_id of the call it answers",
                                  f"{where}.tool_call_id")
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def thinking_enabled(body: oa.ChatCompletionRequest) -> bool:
    kwargs = body.chat_template_kwargs or {}
    flag = kwargs.get("enable_thinking")
    if flag is not None:
        if not isinstance(flag, bool):
            raise bad_request("chat_template_kwargs.enable_thinking must be a boolean",
                              "chat_template_kwargs.enable_thinking")
        return flag
    return body.reasoning_effort not in ("none", "minimal")


def chat_input(body: oa.ChatCompletionRequest) -> ChatInput:
    choice = body.tool_choice
    parallel = body.parallel_tool_calls is not False
    if isinstance(choice, oa.NamedToolChoice):
        tool_choice = ToolChoice("named", choice.function.name, parallel)
    else:
        tool_choice = ToolChoice(choice or "auto", parallel=parallel)
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    extra = {k: v for k, v in (body.chat_template_kwargs or {}).items() if k != "enable_thinking"}
    return ChatInput(chat_messages(body.messages), tools, tool_choice, thinking_enabled(body), extra)


def sampling_params(body: oa.ChatCompletionRequest | oa.CompletionRequest, max_tokens: int,
                    logprobs: int | None) -> SamplingParams:
    """The sampling fields shared by chat and legacy completions (API defaults: temperature 1, all else off)."""
    bias: dict[int, float] = {}
    for key, value in (body.logit_bias or {}).items():
        try:  # decimal digits only: int() would also take "1_0", " 5 " and non-ASCII digits
            if not (key.isascii() and key.lstrip("-").isdigit()):
                raise ValueError(key)
            bias[int(key)] = value
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
    top_k = body.top_k if body.top_k not in (None, -1) else 0
    fmt = body.response_format.type if body.response_format is not None else "text"
    schema = response_schema(body.response_format) if fmt == "json_schema" else None
    return SamplingParams(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_k=top_k, top_p=1.0 if body.top_p is None else body.top_p,
        min_p=body.min_p or 0.0, presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        logit_bias=bias, seed=body.seed, logprobs=logprobs,
        stop_token_ids=tuple(body.stop_token_ids or ()), stop=stop_strings(body.stop),
        max_tokens=max_tokens, min_tokens=body.min_tokens or 0, ignore_eos=bool(body.ignore_eos),
        json_object=fmt == "json_object", json_schema=schema, loop_guard=body.loop_guard)


def response_schema(fmt: oa.ResponseFormat) -> str:
    """The text of a `json_schema` response format's schema, compiled here first so that one the server cannot
    enforce is a 400 before the request is queued (the engine finds the compiled automaton cached by text where
    it runs in this process)."""
    spec = fmt.json_schema
    if spec is None or "schema" not in spec:
        raise bad_request('response_format json_schema needs json_schema.schema (a JSON Schema), e.g. '
                          '{"type": "json_schema", "json_schema": {"name": "reply", "schema": {"type": "object"}}}',
                          "response_format.json_schema")
    return checked_schema(spec["schema"], "response_format.json_schema.schema")


@dataclass(slots=True)
class ChatPlan:
    """A chat request mapped for the engine, with what the response needs."""

    request: Request
    prompt: Prompt
    model: str
    logprobs: bool
    include_usage: bool
    created: int
    n: int = 1  # choices (`choice_requests`)


def plan_chat(body: oa.ChatCompletionRequest, client: Any, model: str, conversation: str | None) -> ChatPlan:
    """Validate and map a chat request; raises ApiError / InvalidRequestError / ContextOverflowError."""
    chat = chat_input(body)
    prompt = render_prompt(client.tokenizer, chat)
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = output_budget(requested, len(prompt.ids), client.max_model_len, param)
    if body.top_logprobs and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {logprobs}", "top_logprobs")
    n = 1 if body.n is None else body.n
    if not 1 <= n <= MAX_CHOICES:
        raise bad_request(f"n must be from 1 to {MAX_CHOICES}", "n")
    params = sampling_params(body, max(max_tokens, 1), logprobs)
    params = settle_constraint(params, chat, prompt.call_format)
    key = conversation_key(conversation, body.user, chat.messages)
    request = make_request(new_id("chatcmpl-"), prompt.ids, params, key, client.max_model_len, client.vocab_size,
                           history_end=prompt.history_end)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return ChatPlan(request, prompt, model, bool(body.logprobs), include_usage, int(time.time()), n)


MAX_CHOICES = 16  # n: choices a chat request may ask for (each an engine request of its own, a slot each)


def choice_requests(plan: Any) -> list[Request]:
    """The engine requests of `plan`'s choices (a chat or a legacy completion plan: its `request` and `n`): its
    own, then one a further choice (id ``<id>-<i>``, the seed ``seed + i`` where one is given, so that seeded
    choices differ and repeat)."""
    out = [plan.request]
    for i in range(1, plan.n):
        # (prompt logprobs: the first choice's request computes them, the others read the prompt from the cache)
        params = plan.request.params
        if not getattr(plan, "score_only", False):  # (a prompt scored alone: every choice the same, its own rows)
            params = dataclasses.replace(params, prompt_logprobs=None)
        if params.seed is not None:  # wrapped into the seeds' range: the draws key on the seed mod 2**64
            seed = params.seed + i
            params = dataclasses.replace(params, seed=seed - (1 << 64) if seed >= 1 << 64 else seed)
        out.append(dataclasses.replace(plan.request, request_id=f"{plan.request.request_id}-{i}", params=params))
    return out


# ---------------------------------------------------------------------------------------------- response


def token_logprobs(tokenizer: Any, token_ids: list[int], logprobs: list[float],
                   top: list[list[tuple[int, float]]]) -> list[oa.TokenLogprob]:
    def entry(t: int) -> tuple[str, list[int]]:
        return tokenizer.decode([t]), list(tokenizer.token_bytes(t))

    out = []
    for i, (t, lp) in enumerate(zip(token_ids, logprobs)):
        text, raw = entry(t)
        alts = [oa.TopLogprob(token=entry(a)[0], logprob=alp, bytes=entry(a)[1]) for a, alp in
                (top[i] if i < len(top) else [])]
        out.append(oa.TokenLogprob(token=text, logprob=lp, bytes=raw, top_logprobs=alts))
    return out


def finish_reason(reason: FinishReason | None, has_tool_calls: bool) -> str:
    if reason == FinishReason.ABORT:
        raise aborted_error()
    if reason == FinishReason.LENGTH:
        return "length"
    return "tool_calls" if has_tool_calls and reason == FinishReason.STOP else "stop"


def loop_guard(reason: FinishReason | None, note: str | None) -> LoopGuardInfo | None:
    return LoopGuardInfo(stopped=True, note=note) if reason == FinishReason.LOOP else None


def usage(num_prompt: int, num_cached: int, num_output: int, reasoning: int | None = None) -> oa.Usage:
    details = oa.CompletionTokensDetails(reasoning_tokens=reasoning) if reasoning is not None else None
    return oa.Usage(prompt_tokens=num_prompt, completion_tokens=num_output, total_tokens=num_prompt + num_output,
                    prompt_tokens_details=oa.PromptTokensDetails(cached_tokens=num_cached),
                    completion_tokens_details=details)


def _chat_usage(plan: ChatPlan, tokenizer: Any, last: TokenEvent | Collected, output_ids: list[int]) -> oa.Usage:
    sp = tokenizer.special_ids
    reasoning = reasoning_tokens(output_ids, sp.end_think, plan.prompt.opens_reasoning, sp.think)
    return usage(last.num_prompt_tokens or len(plan.prompt.ids), last.num_cached_tokens, last.num_output_tokens,
                 reasoning)


def chat_completions(plan: ChatPlan, dones: list[Collected], tokenizer: Any) -> oa.ChatCompletion:
    """The response of a request of several choices (`dones`, in the choices' order): each choice indexed, the
    prompt's tokens counted once (its cached ones as the first choice read them), the output's summed."""
    whole = [chat_completion(plan, done, tokenizer) for done in dones]
    choices = [c.choices[0].model_copy(update={"index": i}) for i, c in enumerate(whole)]
    return whole[0].model_copy(update={"choices": choices, "usage": summed_usage([c.usage for c in whole])})


def summed_usage(each: list[oa.Usage]) -> oa.Usage:
    """One usage of several choices' (the prompt once, the outputs summed)."""
    first = each[0]
    output = sum(u.completion_tokens for u in each)
    reasoning = [u.completion_tokens_details.reasoning_tokens for u in each if u.completion_tokens_details]
    return usage(first.prompt_tokens, first.prompt_tokens_details.cached_tokens, output,
                 sum(r or 0 for r in reasoning) if reasoning else None)


def chat_completion(plan: ChatPlan, done: Collected, tokenizer: Any) -> oa.ChatCompletion:
    parsed = parse_assistant_output(done.text, plan.prompt.opens_reasoning, plan.prompt.tools,
                                    plan.prompt.max_calls, constrained(plan.request.params),
                                    calls_only(plan.request.params))
    calls = [oa.ToolCallOut(id=new_id("call_"), function=oa.FunctionCallOut(name=c.name, arguments=c.arguments_json()))
             for c in parsed.tool_calls]
    message = oa.AssistantMessage(content=parsed.content if parsed.content or not calls else None,
                                  reasoning_content=parsed.reasoning or None,  # as streamed: none when empty
                                  tool_calls=calls or None)
    logprobs = None
    if plan.logprobs:
        logprobs = oa.ChoiceLogprobs(content=token_logprobs(tokenizer, done.logprob_token_ids, done.logprobs,
                                                            done.top_logprobs))
    choice = oa.ChatChoice(message=message, logprobs=logprobs, finish_reason=finish_reason(done.finish_reason, bool(calls)),
                           loop_guard=loop_guard(done.finish_reason, done.note))
    return oa.ChatCompletion(id=plan.request.request_id, created=plan.created, model=plan.model, choices=[choice],
                             usage=_chat_usage(plan, tokenizer, done, done.token_ids))


class ChatStream:
    """Turns engine events into SSE chunk lines: role chunk, content / reasoning / tool call deltas, the final
    chunk with finish_reason (and loop_guard), an optional usage chunk, then ``data: [DONE]``."""

    def __init__(self, plan: ChatPlan, tokenizer: Any, index: int = 0) -> None:
        self.plan, self.tokenizer, self.index = plan, tokenizer, index  # index: the choice's (n > 1)
        self.parser = StreamingOutputParser(plan.prompt.opens_reasoning, plan.prompt.tools, plan.prompt.max_calls,
                                            constrained(plan.request.params),
                                            calls_only=calls_only(plan.request.params))
        self.num_calls = 0
        self.output_ids: list[int] = []

    def _chunk(self, delta: oa.Delta, logprobs: oa.ChoiceLogprobs | None = None, finish: str | None = None,
               guard: LoopGuardInfo | None = None) -> str:
        p = self.plan
        choice = oa.ChunkChoice(index=self.index, delta=delta, logprobs=logprobs, finish_reason=finish,
                                loop_guard=guard)
        return sse_data(oa.ChatCompletionChunk(id=p.request.request_id, created=p.created, model=p.model,
                                               choices=[choice]).json_text())

    def start(self, first: TokenEvent | None) -> list[str]:
        return [self._chunk(oa.Delta(role="assistant", content=""))]

    def _deltas(self, outputs: list) -> list[oa.Delta]:
        deltas = []
        for out in outputs:
            if isinstance(out, ContentDelta):
                deltas.append(oa.Delta(content=out.text))
            elif isinstance(out, ReasoningDelta):
                deltas.append(oa.Delta(reasoning_content=out.text))
            elif isinstance(out, ToolCallEvent):
                i = self.num_calls
                self.num_calls += 1
                head = oa.ToolCallDelta(index=i, id=new_id("call_"), type="function",
                                        function=oa.FunctionDelta(name=out.tool_call.name, arguments=""))
                body = oa.ToolCallDelta(index=i, function=oa.FunctionDelta(arguments=out.tool_call.arguments_json()))
                deltas += [oa.Delta(tool_calls=[head]), oa.Delta(tool_calls=[body])]
        return deltas

    def event(self, ev: TokenEvent) -> list[str]:
        """Chunks for one engine event (the final one included: call `end` after it)."""
        self.output_ids += ev.token_ids
        outputs = self.parser.feed(ev.text)
        if ev.finish_reason is not None:
            outputs += self.parser.finish()
        deltas = self._deltas(outputs)
        logprobs = None
        if self.plan.logprobs and ev.token_ids:
            logprobs = oa.ChoiceLogprobs(content=token_logprobs(self.tokenizer, ev.token_ids, ev.logprobs,
                                                                ev.top_logprobs))
            if not deltas:
                deltas = [oa.Delta()]
        return [self._chunk(d, logprobs if i == 0 else None) for i, d in enumerate(deltas)]

    def finish(self, last: TokenEvent) -> list[str]:
        """The choice's last chunk (its finish_reason and loop_guard)."""
        finish = finish_reason(last.finish_reason, self.num_calls > 0)
        return [self._chunk(oa.Delta(), finish=finish, guard=loop_guard(last.finish_reason, last.note))]

    def usage(self, last: TokenEvent) -> oa.Usage:
        return _chat_usage(self.plan, self.tokenizer, last, self.output_ids)

    def end(self, last: TokenEvent) -> list[str]:
        return [*self.finish(last), *self.tail(self.usage(last))]

    def tail(self, total: oa.Usage) -> list[str]:
        """What follows the choices' last chunks: the usage chunk where asked for, then ``data: [DONE]``."""
        p = self.plan
        lines = [sse_data(oa.ChatCompletionChunk(id=p.request.request_id, created=p.created, model=p.model,
                                                 choices=[], usage=total).json_text())] if p.include_usage else []
        return [*lines, sse_data("[DONE]")]
