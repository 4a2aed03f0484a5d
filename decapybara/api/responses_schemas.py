"""Pydantic schemas of OpenAI's Responses API (/v1/responses): the request, its input items, the response and its
output items. Requests take the fields the API documents; unknown fields are ignored (as vendors' extras)."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Discriminator, Field, Tag

from decapybara.api.schemas_base import LoopGuardInfo, LoopGuardMode, RequestModel, ResponseModel

# ---------------------------------------------------------------------------------------------- requests


class TextIn(RequestModel):
    type: Literal["input_text", "output_text", "text"]
    text: str


class OtherIn(RequestModel):
    """A content part this server cannot read (images, files, audio), or a refusal: refused or skipped by name."""

    type: Literal["input_image", "input_file", "input_audio", "refusal"]
    refusal: str | None = None


def _part_kind(value: Any) -> str:
    """A content part's branch, by its type; named as its class, so that a 400's path leaves it out
    (`errors.validation_error`)."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "TextIn" if kind in ("input_text", "output_text", "text") else "OtherIn"


PartIn = Annotated[Annotated[TextIn, Tag("TextIn")] | Annotated[OtherIn, Tag("OtherIn")], Discriminator(_part_kind)]


class MessageIn(RequestModel):
    type: Literal["message"] = "message"
    id: str | None = None  # a stored item's, or one sent back: kept, so input_items lists it by it
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[PartIn]


class FunctionCallIn(RequestModel):
    type: Literal["function_call"]
    id: str | None = None  # a stored item's, or one sent back: kept, so input_items lists it by it
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputIn(RequestModel):
    type: Literal["function_call_output"]
    id: str | None = None  # a stored item's, or one sent back: kept, so input_items lists it by it
    call_id: str
    output: str | list[PartIn]


class ReasoningTextIn(RequestModel):
    type: Literal["summary_text", "reasoning_text"]
    text: str


class ReasoningIn(RequestModel):
    type: Literal["reasoning"]
    id: str | None = None  # a stored item's, or one sent back: kept, so input_items lists it by it
    summary: list[ReasoningTextIn] = Field(default_factory=list)
    content: list[ReasoningTextIn] | None = None
    encrypted_content: str | None = None  # this server's: the reasoning's text (`ReasoningOut.encrypted_content`)


_ITEM_CLASSES = {"message": "MessageIn", "function_call": "FunctionCallIn",
                 "function_call_output": "FunctionCallOutputIn", "reasoning": "ReasoningIn"}


def _item_kind(value: Any) -> str:
    """An input item's branch, by its type (a message where it has none); named as its class, so that a 400's
    path leaves it out (`errors.validation_error`)."""
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "message")
    return _ITEM_CLASSES.get(kind, "OtherItemIn") if isinstance(kind, str) else "OtherItemIn"


class OtherItemIn(RequestModel):
    """An input item of a kind this server does not serve (a built-in tool's call, an item reference)."""

    type: str


ItemIn = Annotated[Annotated[MessageIn, Tag("MessageIn")] | Annotated[FunctionCallIn, Tag("FunctionCallIn")]
                   | Annotated[FunctionCallOutputIn, Tag("FunctionCallOutputIn")]
                   | Annotated[ReasoningIn, Tag("ReasoningIn")] | Annotated[OtherItemIn, Tag("OtherItemIn")],
                   Discriminator(_item_kind)]


class TextFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(RequestModel):
    format: TextFormat | None = None
    verbosity: str | None = None


class ReasoningConfig(RequestModel):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: str | None = None


class FunctionChoice(RequestModel):
    type: Literal["function"]
    name: str


class ResponsesRequest(RequestModel):
    model: str | None = None
    input: str | list[ItemIn]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None  # function tools; other kinds are refused by name
    tool_choice: Literal["auto", "none", "required"] | FunctionChoice | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stream: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    previous_response_id: str | None = None
    conversation: Any = None  # a conversation's id, or {"id": ...} (decapybara/api/conversations.py)
    background: bool | None = None  # generated apart from the request (decapybara/api/background.py)
    prompt: Any = None  # stored prompt templates: refused
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    prompt_cache_key: str | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    truncation: Literal["auto", "disabled"] | None = None
    loop_guard: LoopGuardMode | None = None  # extension: this request's LoopGuard mode (None: the server's)


class ConversationRequest(RequestModel):
    """POST /v1/conversations (items and metadata) and POST /v1/conversations/{id} (metadata)."""

    items: list[Any] | None = None
    metadata: Any = None


class ConversationItemsRequest(RequestModel):
    """POST /v1/conversations/{id}/items."""

    items: list[Any]


class InputTokensRequest(ResponsesRequest):
    """POST /v1/responses/input_tokens: a responses request to count, whose input may be left out."""

    input: str | list[ItemIn] = Field(default_factory=list)


# ---------------------------------------------------------------------------------------------- responses


class OutputText(ResponseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class ReasoningText(ResponseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class MessageOut(ResponseModel):
    type: Literal["message"] = "message"
    id: str
    status: str = "completed"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class ReasoningOut(ResponseModel):
    omit_if_none: ClassVar[frozenset[str]] = frozenset({"encrypted_content"})

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]
    encrypted_content: str | None = None  # where `include` asks for it: the reasoning's text, which comes back
    status: str = "completed"


class FunctionCallOut(ResponseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: str = "completed"


class InputTokensDetails(ResponseModel):
    cached_tokens: int
    cache_write_tokens: int = 0  # the prefix cache is automatic and free to write (as Anthropic's usage says)


class OutputTokensDetails(ResponseModel):
    reasoning_tokens: int


class ResponseUsage(ResponseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(ResponseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(ResponseModel):
    omit_if_none: ClassVar[frozenset[str]] = frozenset({"loop_guard", "conversation"})

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    model: str
    output: list[MessageOut | ReasoningOut | FunctionCallOut]
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    tool_choice: Any = "auto"
    tools: list[Any] = Field(default_factory=list)
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    reasoning: dict[str, Any] | None = None
    previous_response_id: str | None = None
    conversation: dict[str, str] | None = None  # {"id": ...} of the conversation it was made in
    store: bool = False
    background: bool = False
    truncation: Literal["auto", "disabled"] = "disabled"
    metadata: dict[str, str] = Field(default_factory=dict)
    usage: ResponseUsage | None = None
    user: str | None = None
    loop_guard: LoopGuardInfo | None = None
