"""Pydantic schemas of the Anthropic Messages API: /v1/messages and /v1/messages/count_tokens.

Unknown fields (cache_control, citations, service_tier, ...) are ignored; unknown block, tool_choice or
thinking types are 400s.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from decapybara.api.schemas_base import LoopGuardInfo, LoopGuardMode, RequestModel, ResponseModel

# ---------------------------------------------------------------------------------------------- requests


class TextBlock(RequestModel):
    type: Literal["text"]
    text: str


class ImageBlock(RequestModel):
    type: Literal["image"]
    source: Any = None


class DocumentBlock(RequestModel):
    type: Literal["document"]
    source: Any = None


class ToolUseBlock(RequestModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(RequestModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[TextBlock | ImageBlock | DocumentBlock, Field(discriminator="type")]] | None = None
    is_error: bool | None = None


class ThinkingBlock(RequestModel):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(RequestModel):
    type: Literal["redacted_thinking"]
    data: str = ""


InputBlock = Annotated[
    TextBlock | ImageBlock | DocumentBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class InputMessage(RequestModel):
    role: Literal["user", "assistant"]
    content: str | list[InputBlock]


class ToolDef(RequestModel):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None  # None or "custom": a client tool; anything else is a server tool (unsupported)


class ToolChoiceAuto(RequestModel):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(RequestModel):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(RequestModel):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(RequestModel):
    type: Literal["none"]


ToolChoice = Annotated[ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")]


class ThinkingEnabled(RequestModel):
    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1)
    display: Literal["summarized", "omitted"] | None = None  # omitted: empty thinking text, signature kept


class ThinkingAdaptive(RequestModel):
    type: Literal["adaptive"]
    display: Literal["summarized", "omitted"] | None = None


class ThinkingBetweenTools(RequestModel):
    type: Literal["between_tools"]


class ThinkingDisabled(RequestModel):
    type: Literal["disabled"]


ThinkingConfig = Annotated[ThinkingEnabled | ThinkingAdaptive | ThinkingBetweenTools | ThinkingDisabled,
                           Field(discriminator="type")]


class Metadata(RequestModel):
    user_id: str | None = None


class CountTokensRequest(RequestModel):
    model: str | None = None  # any name is accepted
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None


class OutputFormat(RequestModel):
    """Structured outputs: the text of the reply is constrained to what `schema` accepts."""

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(RequestModel):
    format: OutputFormat | None = None
    effort: str | None = None  # read, not acted on: the reasoning's length is the model's own


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    output_config: OutputConfig | None = None
    output_format: OutputFormat | None = None  # the structured-outputs beta's form of output_config.format
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: Metadata | None = None
    loop_guard: LoopGuardMode | None = None  # extension: this request's LoopGuard mode (None: the server's)


# ---------------------------------------------------------------------------------------------- responses


class TextOut(ResponseModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingOut(ResponseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str


class ToolUseOut(ResponseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


ContentOut = TextOut | ThinkingOut | ToolUseOut


class Usage(ResponseModel):
    """input_tokens counts only the prompt tokens not read from the prefix cache (the Anthropic convention)."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class Message(ResponseModel):
    omit_if_none = frozenset({"loop_guard"})

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentOut]
    stop_reason: str | None
    stop_sequence: str | None
    usage: Usage
    loop_guard: LoopGuardInfo | None = None


class CountTokensResponse(ResponseModel):
    input_tokens: int


# ---- stream events


class MessageStart(ResponseModel):
    type: Literal["message_start"] = "message_start"
    message: Message


class ContentBlockStart(ResponseModel):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: ContentOut


class TextDelta(ResponseModel):
    type: Literal["text_delta"] = "text_delta"
    text: str


class ThinkingDelta(ResponseModel):
    type: Literal["thinking_delta"] = "thinking_delta"
    thinking: str


class SignatureDelta(ResponseModel):
    type: Literal["signature_delta"] = "signature_delta"
    signature: str


class InputJsonDelta(ResponseModel):
    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


class ContentBlockDelta(ResponseModel):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: TextDelta | ThinkingDelta | SignatureDelta | InputJsonDelta


class ContentBlockStop(ResponseModel):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class StopDelta(ResponseModel):
    stop_reason: str | None
    stop_sequence: str | None


class MessageDelta(ResponseModel):
    """The final usage is cumulative and includes the input counts (the SDKs take them from here too)."""

    omit_if_none = frozenset({"loop_guard"})

    type: Literal["message_delta"] = "message_delta"
    delta: StopDelta
    usage: Usage
    loop_guard: LoopGuardInfo | None = None


class MessageStop(ResponseModel):
    type: Literal["message_stop"] = "message_stop"


class Ping(ResponseModel):
    type: Literal["ping"] = "ping"


StreamEvent = MessageStart | ContentBlockStart | ContentBlockDelta | ContentBlockStop | MessageDelta | MessageStop | Ping
