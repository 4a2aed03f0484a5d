"""Base classes of the wire schemas: strict, lenient requests and exact responses."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, model_serializer


class RequestModel(BaseModel):
    """A request body part. Types are strict (a string is never a number, 1.0 is not an integer, NaN is
    refused) so wrong types are 400s; unknown fields are ignored, as agents send vendor extras."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class ResponseModel(BaseModel):
    """A response body part. Fields are always written (``null`` included) except those named in
    `omit_if_none`, the optional extras that real APIs leave out when they do not apply."""

    model_config = ConfigDict(extra="forbid")
    omit_if_none: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _omit_nones(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        for name in self.omit_if_none:
            if data.get(name) is None:
                data.pop(name, None)
        return data

    def dump(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def json_text(self) -> str:
        return self.model_dump_json()


LoopGuardMode = Literal["stop", "end_thinking", "escape", "off"]  # a request's own LoopGuard mode (an extension)


class LoopGuardInfo(ResponseModel):
    """Extra field of a response whose generation the LoopGuard stopped (both APIs): ``stopped`` is always
    true and ``note`` says why, so an agent's frontend can recover (e.g. retry with other settings)."""

    stopped: bool = True
    note: str | None = None
