"""Pydantic schemas of the OpenAI API: /v1/chat/completions, /v1/completions, /v1/models.

Requests take the official fields plus the extras vLLM-style clients send (top_k, min_p, repetition_penalty,
min_tokens, ignore_eos, stop_token_ids, chat_template_kwargs); other unknown fields are ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from decapybara.api.schemas_base import LoopGuardInfo, LoopGuardMode, RequestModel, ResponseModel

# ---------------------------------------------------------------------------------------------- requests


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class RefusalPart(RequestModel):
    type: Literal["refusal"]
    refusal: str


class ImagePart(RequestModel):
    type: Literal["image_url"]
    image_url: Any = None


class AudioPart(RequestModel):
    type: Literal["input_audio"]
    input_audio: Any = None


class FilePart(RequestModel):
    type: Literal["file"]
    file: Any = None


ContentPart = Annotated[TextPart | RefusalPart | ImagePart | AudioPart | FilePart, Field(discriminator="type")]


class FunctionCallIn(RequestModel):
    name: str
    arguments: str | dict[str, Any] = "{}"  # a JSON string per the API; an object is accepted too


class ToolCallIn(RequestModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None  # the name some clients send reasoning back under


class FunctionDef(RequestModel):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(RequestModel):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


class ResponseFormat(RequestModel):
    """`text`; `json_object` (JSON mode: the reply is constrained to a JSON object); `json_schema` (the reply is
    constrained to `json_schema.schema`; `name`, `description` and `strict` are read as OpenAI defines them and
    change nothing: every schema taken is enforced)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class StreamOptions(RequestModel):
    include_usage: bool | None = None


class _SamplingFields(RequestModel):
    """Sampling fields shared by chat and legacy completions (None = the API default)."""

    model: str | None = None  # any name is accepted
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension; 0 or -1 = off
    min_p: float | None = None  # extension
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # extension
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension
    min_tokens: int | None = None  # extension
    ignore_eos: bool | None = None  # extension
    loop_guard: LoopGuardMode | None = None  # extension: this request's LoopGuard mode (None: the server's)
    n: int | None = None  # only 1 is supported
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None  # json_object: JSON mode (legacy completions: an extension)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = None  # the legacy API's default is 16
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


# ---------------------------------------------------------------------------------------------- responses


class PromptTokensDetails(ResponseModel):
    cached_tokens: int


class CompletionTokensDetails(ResponseModel):
    reasoning_tokens: int


class Usage(ResponseModel):
    omit_if_none = frozenset({"completion_tokens_details"})

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails | None = None


class FunctionCallOut(ResponseModel):
    name: str
    arguments: str  # JSON text of the arguments object


class ToolCallOut(ResponseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class TopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(ResponseModel):
    content: list[TokenLogprob]
    refusal: None = None


class AssistantMessage(ResponseModel):
    omit_if_none = frozenset({"reasoning_content", "tool_calls"})

    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None
    refusal: None = None


class ChatChoice(ResponseModel):
    omit_if_none = frozenset({"loop_guard"})

    index: int = 0
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str
    loop_guard: LoopGuardInfo | None = None


class ChatCompletion(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class FunctionDelta(ResponseModel):
    omit_if_none = frozenset({"name", "arguments"})

    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(ResponseModel):
    omit_if_none = frozenset({"id", "type"})

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta


class Delta(ResponseModel):
    omit_if_none = frozenset({"role", "content", "reasoning_content", "tool_calls"})

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(ResponseModel):
    omit_if_none = frozenset({"loop_guard"})

    index: int = 0
    delta: Delta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    loop_guard: LoopGuardInfo | None = None


class ChatCompletionChunk(ResponseModel):
    omit_if_none = frozenset({"usage"})

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class LegacyLogprobs(ResponseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token (nothing before it predicts it)
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(ResponseModel):
    omit_if_none = frozenset({"loop_guard"})

    index: int = 0
    text: str
    logprobs: LegacyLogprobs | None = None
    finish_reason: str | None = None
    loop_guard: LoopGuardInfo | None = None


class Completion(ResponseModel):
    omit_if_none = frozenset({"usage"})

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "decapybara"
    max_model_len: int


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
