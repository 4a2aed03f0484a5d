"""The Ray Serve ingress: the dual HTTP API (FastAPI) in front of the named SchedulerActor.

Replicas tokenise and render chat templates themselves (CPU work spread over ingress replicas); the
scheduler sees token ids only. Besides HTTP, the deployment offers Python methods for `DeploymentHandle`
callers (`chat`, `messages`: streaming, OpenAI chunk dicts / Anthropic event dicts; `stats`).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from decapybara.server.config import AppConfig


def _sse_payloads(lines: list[str]) -> list[dict[str, Any]]:
    """The JSON objects of SSE lines (`event: ...` / `data: {...}`); `[DONE]` and comments are dropped."""
    out = []
    for block in lines:
        for line in block.splitlines():
            if line.startswith("data: ") and line[6:].strip() != "[DONE]":
                out.append(json.loads(line[6:]))
    return out


async def _collect(events: AsyncIterator[Any]) -> Any:
    """All of a request's events folded together (for non-streaming answers)."""
    from decapybara.api.common import Collected

    done = Collected()
    async for ev in events:
        done.add(ev)
    return done


async def _stream_dicts(streamer: Any, events: AsyncIterator[Any]) -> AsyncIterator[dict[str, Any]]:
    """An API streamer's SSE output as the JSON objects it carries, event by event."""
    first = await anext(events, None)  # as the HTTP path: message_start's usage then has the cached-token split
    for payload in _sse_payloads(streamer.start(first)):
        yield payload

    async def all_events() -> AsyncIterator[Any]:
        if first is not None:
            yield first
        async for more in events:
            yield more

    async for ev in all_events():
        lines = streamer.event(ev) + (streamer.end(ev) if ev.finish_reason is not None else [])
        for payload in _sse_payloads(lines):
            yield payload


async def _own_scheduler(app_config: dict[str, Any], wait_s: float = 45.0) -> Any:
    """The app's scheduler actor with these settings. `scheduler_handle` gets an existing one by name: during a
    redeploy that is the previous version's, which dies with its replica (its owner) moments later, so this waits
    for it to go; one that stays is another app's under the same `name`."""
    import asyncio
    import time

    from actors.scheduler_actor import scheduler_handle
    from decapybara.errors import ConfigError

    deadline = time.monotonic() + wait_s
    while True:
        handle = scheduler_handle(app_config)
        try:
            if await handle.settings.remote() == app_config:
                return handle
        except Exception:  # the previous one died as we asked it: get or make it again
            if time.monotonic() > deadline:
                raise
        else:
            if time.monotonic() <= deadline:
                await asyncio.sleep(1.0)
                continue
            raise ConfigError(f"the actors named {app_config.get('name', 'decapybara')}-* serve other settings "
                              "(another app on this Ray cluster?): give this app its own name=...")
        await asyncio.sleep(1.0)


DRAIN_S = 60.0  # what a graceful stop leaves the requests in flight before the prefix cache's save


def shutdown_s(cfg: AppConfig) -> float:
    """The longest a replica's graceful stop takes (Serve's `graceful_shutdown_timeout_s`): drain, then save."""
    return DRAIN_S + cfg.save_cache_s + 10


@serve.ingress()
class Ingress:
    async def __init__(self, app_config: dict[str, Any]):
        from decapybara.mcapy import McapyFile
        from decapybara.server.ray_client import RayEngineClient
        from decapybara.tokenizer import Tokenizer

        self.cfg = AppConfig(**app_config)
        # a redeploy's previous scheduler goes once its replica's graceful stop (drain, save) ends
        self.scheduler = await _own_scheduler(app_config, wait_s=max(45.0, shutdown_s(self.cfg) + 15))
        info = await self.scheduler.ready.remote()
        with McapyFile.open(self.cfg.resolved_model()) as f:  # metadata only: weights stay in the GPU actor
            meta = f.metadata
        engine = info.get("engine") or {}
        self.model_info = {"model_config": meta.get("model_config"), "weights": meta.get("weights"),
                           "quality": (meta.get("sections") or {}).get("quality"),
                           "serving": {"max_model_len": info.get("max_model_len"), "backend": info.get("backend"),
                                       **{k: engine.get(k) for k in ("max_slots", "kv_mode", "page_size",
                                                                      "num_pages")},
                                       "kv_pool": info.get("kv_pool")}}
        tokenizer = Tokenizer.from_json(meta["tokenizer"], chat_template=meta.get("chat_template"))
        self.client = RayEngineClient(self.scheduler, tokenizer, info, self.cfg.served_model_name)

    def __serve_build_asgi_app__(self):
        from fastapi.responses import JSONResponse
        from ray.exceptions import TaskCancelledError

        from decapybara.api.app import create_app

        # a client that leaves mid-request has Serve cancel the request's task: its ASGI receive raises this (the
        # only other cancellation on this path is RayEngineClient's own, of a stream it abandons as it ends)
        app = create_app(self.client, api_key=self.cfg.api_key, served_model_name=self.cfg.served_model_name,
                         disconnects=(TaskCancelledError,))

        @app.get("/v1/model_info")
        async def model_info() -> JSONResponse:
            """The served file's architecture, weight format and measured quality table (for the launcher), and what
            this server serves it with (context, slots, KV mode and pool; `kv_pool`: the pool fitted to the device's
            free memory, null where given)."""
            return JSONResponse(self.model_info)

        return app

    async def __del__(self) -> None:
        """Serve's graceful stop of this replica (`serve shutdown`, Ctrl-C of `serve run` or `decapybara serve`, a
        redeploy): the engine's prefix cache is saved to the disk tier first, for `save_cache_s` at most, so that the
        next server on the same `disk_cache` restores it instead of prefilling it again."""
        import asyncio
        import logging

        cfg, scheduler = getattr(self, "cfg", None), getattr(self, "scheduler", None)
        if cfg is None or scheduler is None or not cfg.saves_cache():
            return
        log = logging.getLogger(__name__)
        try:
            saved = await asyncio.wait_for(scheduler.save_cache.remote(cfg.save_cache_s), cfg.save_cache_s + 8)
        except Exception as e:  # noqa: BLE001 - a stop goes on without the save
            log.warning("prefix cache not saved: %s: %s", type(e).__name__, e)
        else:
            log.info("prefix cache: %d pages saved to %s", saved, cfg.disk_cache)

    async def check_health(self) -> None:
        """Serve's replica health check: a dead scheduler actor (and with it the GPU and tier actors it owns)
        has Serve replace this replica, whose start makes new ones."""
        await self.scheduler.health.remote()

    # ---- Python (DeploymentHandle) API ---------------------------------------------------------------
    async def chat(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """OpenAI chat completion for Python callers: with ``"stream": true`` yields chunk dicts, else yields
        one ChatCompletion dict. Call as ``handle.options(stream=True).chat.remote(body)``."""
        from decapybara.api import openai_api
        from decapybara.api import openai_schemas as oa
        from decapybara.api.streams import engine_events

        req = oa.ChatCompletionRequest.model_validate(body)
        plan = openai_api.plan_chat(req, self.client, self.cfg.served_model_name, None)
        events = engine_events(self.client, plan.request)
        if not req.stream:
            yield openai_api.chat_completion(plan, await _collect(events), self.client.tokenizer).dump()
            return
        async for payload in _stream_dicts(openai_api.ChatStream(plan, self.client.tokenizer), events):
            yield payload

    async def messages(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Anthropic messages for Python callers: streaming yields the event dicts (message_start ...
        message_stop), otherwise one Message dict."""
        from decapybara.api import anthropic_api
        from decapybara.api import anthropic_schemas as an
        from decapybara.api.streams import budgeted_thinking, engine_events

        req = an.MessagesRequest.model_validate(body)
        plan = anthropic_api.plan_message(req, self.client, self.cfg.served_model_name, None)
        events = engine_events(self.client, plan.request)
        if plan.thinking_budget is not None:
            events = budgeted_thinking(self.client, plan.request, plan.thinking_budget, plan.prompt.opens_reasoning)
        if not req.stream:
            yield anthropic_api.message(plan, await _collect(events)).dump()
            return
        async for payload in _stream_dicts(anthropic_api.MessageStream(plan), events):
            yield payload

    async def stats(self) -> dict[str, Any]:
        return await self.client.stats()


def build_app(args: dict[str, Any] | None = None) -> Any:
    """The Serve application for `serve run serve_app:build_app key=value ...` (validated by AppConfig; Serve's
    builders take the one argument). A model given by name is looked up here, in this process's model folders, so
    that the actors get its path."""
    return application(args)


def application(args: dict[str, Any] | None = None, checked: bool = False) -> Any:
    """`build_app`'s application; `checked`: the caller already made `preflight`'s checks (`decapybara serve`,
    before Ray starts)."""
    from decapybara.server.cli_serve import preflight

    cfg = AppConfig(**(args or {}))
    if "model" in cfg.model_fields_set:
        cfg = cfg.model_copy(update={"model": cfg.resolved_model()})
    if not checked:  # what the GPU actor would refuse (context plan, disk tier), refused here, once
        preflight(cfg, device=False)
    deployment = serve.deployment(
        Ingress, name="DecapybaraIngress", num_replicas=cfg.ingress_replicas,
        max_ongoing_requests=cfg.max_ongoing_requests, ray_actor_options={"num_cpus": 0},
        health_check_period_s=2.0,  # `check_health`: a lost scheduler actor replaced within seconds
        # the whole stop: requests in flight drain first (up to DRAIN_S is left for them), then `__del__`'s save
        graceful_shutdown_timeout_s=shutdown_s(cfg),
    )
    return deployment.bind(actor_settings(cfg))


def actor_settings(cfg: AppConfig) -> dict[str, Any]:
    """The settings the deployment hands its ingress, and through it the scheduler and GPU actors, which rebuild
    `AppConfig` from them: every setting given, even one equal to its default (a preset's values give way to the
    settings given beside it, `AppConfig.engine_config`, e.g. `slots=12` beside `preset=medium`), and no other."""
    return cfg.model_dump(exclude_unset=True)
