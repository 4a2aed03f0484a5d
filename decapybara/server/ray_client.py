"""`EngineClient` over Ray: the ingress's way to the SchedulerActor (streaming actor calls)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from decapybara.api.response_store import RemoteResponses
from decapybara.engine.sequence import Request, TokenEvent
from decapybara.errors import CapacityError, ContextOverflowError, DecapybaraError, InvalidRequestError

_ERRORS = {"ContextOverflowError": ContextOverflowError, "InvalidRequestError": InvalidRequestError,
           "CapacityError": CapacityError}


class RayEngineClient:
    """Implements `decapybara.api.client.EngineClient` with the scheduler actor's `generate` stream.

    A refusal reported by the engine (an event carrying `error`) is raised as its typed error from the first
    `__anext__`; closing the iterator early (client disconnect) cancels the stream, and the scheduler aborts
    the request.
    """

    def __init__(self, scheduler: Any, tokenizer: Any, info: dict[str, Any], model_name: str):
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = int(info["max_model_len"])
        self.vocab_size = int(info["vocab_size"])
        self.info = info
        budget = int(info.get("responses_store") or 0)
        self.responses = RemoteResponses(scheduler, budget) if budget > 0 else None

    async def generate(self, request: Request) -> AsyncIterator[TokenEvent]:
        stream = self.scheduler.generate.options(num_returns="streaming").remote(request)
        done = False
        try:
            async for ref in stream:
                ev: TokenEvent = await ref
                if ev.error is not None:
                    done = True
                    raise _ERRORS.get(ev.error_type or "", DecapybaraError)(ev.error)
                done = ev.finish_reason is not None
                yield ev
                if done:
                    return
        finally:
            if not done:
                import ray

                ray.cancel(stream)
                await self.scheduler.abort.remote(request.request_id)

    async def abort(self, request_id: str) -> None:
        await self.scheduler.abort.remote(request_id)

    async def health(self) -> dict[str, Any]:
        try:
            return await self.scheduler.health.remote()
        except Exception as exc:  # noqa: BLE001 - the scheduler actor is gone
            return {"status": "unavailable", "reason": f"the scheduler stopped: {type(exc).__name__}"}

    async def stats(self) -> dict[str, Any]:
        return await self.scheduler.stats.remote()
