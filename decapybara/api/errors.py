"""HTTP errors and their two wire shapes (OpenAI and Anthropic).

Every error the API layer answers with is an `ApiError` (status, message, param, code). `to_api_error` maps
what the layers below raise: pydantic `ValidationError` and the library's `InvalidRequestError` /
`ContextOverflowError` are the client's fault (400); `CapacityError` is overload (503 / Anthropic 529); anything
else is a server error (500) whose message hides internals.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from decapybara.errors import CapacityError, ContextOverflowError, DecapybaraError, InvalidRequestError

log = logging.getLogger(__name__)

_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                 404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
                 429: "rate_limit_error", 503: "overloaded_error"}
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                    429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}

PROMPT_TOO_LONG = "prompt is too long"  # how the Anthropic API's context-overflow messages begin


@dataclass(slots=True)
class ApiError(Exception):
    """An error answered to the client. `status` is the HTTP status in the OpenAI API's convention."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None

    def __str__(self) -> str:
        return f"{self.status}: {self.message}"

    def openai_body(self) -> dict[str, Any]:
        """``{"error": {"message", "type", "param", "code"}}`` as the OpenAI API writes it."""
        kind = _OPENAI_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def anthropic_status(self) -> int:
        """Anthropic answers overload with 529 where OpenAI uses 503."""
        return 529 if self.status == 503 else self.status

    def anthropic_body(self) -> dict[str, Any]:
        """``{"type": "error", "error": {"type", "message"}}`` as the Anthropic API writes it. Its bodies carry no
        code, so a prompt past the context says it in the API's own words ("prompt is too long: ..."), which
        Anthropic clients look for to compact the conversation and retry."""
        kind = _ANTHROPIC_TYPES.get(self.anthropic_status(),
                                    "invalid_request_error" if self.status < 500 else "api_error")
        message = self.message
        if self.code == "context_length_exceeded" and not message.lower().startswith(PROMPT_TOO_LONG):
            message = f"{PROMPT_TOO_LONG}: {message}"
        return {"type": "error", "error": {"type": kind, "message": message}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


_TYPE_LABELS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "function-after", "function-before"})


def _union_label(part: object) -> bool:
    """A path element pydantic adds for a union's branch (its type's name: a builtin's, a generic's, or a model
    class's CamelCase one), not a field (snake_case) or an index."""
    return isinstance(part, str) and ("[" in part or part in _TYPE_LABELS or (part[:1].isupper() and
                                                                               part.isidentifier()))


def validation_error(exc: ValidationError) -> ApiError:
    """A pydantic error as a 400 naming the offending field (``messages.0.role``): of a union's failed branches
    the one that got furthest into the value (a list of content blocks with an unknown block's type, rather than
    "not a string"), the branches' own labels (``str``, ``list[...]``) left out of the field's path."""
    errors = exc.errors(include_url=False, include_context=False, include_input=False)
    if not errors:
        return bad_request("invalid request body")
    first = max(errors, key=lambda e: len(e["loc"]))  # the first of the deepest
    if first["type"] == "json_invalid":
        return bad_request(f"the request body is not valid JSON: {first['msg']}", code="invalid_json")
    param = ".".join(str(p) for p in first["loc"] if not _union_label(p)) or None
    message = f"{param}: {first['msg']}" if param else first["msg"]
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return bad_request(message, param)


def to_api_error(exc: BaseException, disconnects: tuple[type[BaseException], ...] = ()) -> ApiError:
    """Map any exception to the ApiError the client sees; unexpected ones are logged and become 500s.
    `disconnects`: what the transport raises into a request whose client left (nobody reads the answer, a 499;
    noted in the debug log only)."""
    if isinstance(exc, disconnects):
        log.debug("the client left: %s", type(exc).__name__)
        return ApiError(499, "the client closed the request")
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ValidationError):
        return validation_error(exc)
    if isinstance(exc, ContextOverflowError):
        return bad_request(str(exc), exc.param or "messages", "context_length_exceeded")
    if isinstance(exc, InvalidRequestError):
        return bad_request(str(exc), exc.param)
    if isinstance(exc, CapacityError):
        return ApiError(503, f"the server is overloaded: {exc}")
    if isinstance(exc, DecapybaraError):
        log.error("engine error: %s", exc)
        return ApiError(500, f"the engine failed: {type(exc).__name__}: {exc}")
    log.error("unexpected error while serving a request", exc_info=exc)
    return ApiError(500, "internal server error")
