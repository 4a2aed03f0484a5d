"""SchedulerActor's request registry and engine-loss handling, driven with a fake GPU actor (no Ray cluster)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import sys
import time
from typing import Any

import numpy as np
import pytest

import actors.scheduler_actor as sa
from decapybara.engine.driver import Control, EngineView, StepReport
from decapybara.engine.sampling import SamplingParams
from decapybara.engine.sequence import FinishReason, Request, TokenEvent


class _Ref:
    """An ObjectRef's stand-in: awaitable, and `future()` for the watchdog."""

    def __init__(self, value: Any = None, exc: BaseException | None = None, fut: asyncio.Future | None = None):
        self.value, self.exc, self.fut = value, exc, fut

    def __await__(self):
        if self.fut is not None:
            return self.fut.__await__()
        return self._get().__await__()

    async def _get(self):
        if self.exc is not None:
            raise self.exc
        return self.value

    def future(self) -> concurrent.futures.Future:
        f: concurrent.futures.Future = concurrent.futures.Future()
        if self.exc is not None:
            f.set_exception(self.exc)
        else:
            f.set_result(self.value)
        return f


class _Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *a, **k):
        return self.fn(*a, **k)

    def options(self, **_):
        return self


class FakeGPU:
    """Reports are pushed by the test (`report`); `die()` ends the report stream with an error. A `loading` one
    answers no call (an actor whose constructor has not returned)."""

    def __init__(self, loading: bool = False) -> None:
        self.controls: list[Control] = []
        self.reports: asyncio.Queue = asyncio.Queue()
        self.dead = False
        self.loading = loading
        self.info = _Method(lambda: self._answer({"max_model_len": 64, "vocab_size": 10}))
        self.control = _Method(self._control)
        self.stats = _Method(lambda: self._answer({}))
        self.run = _Method(self._run)
        self.save_cache = _Method(lambda budget_s: _Ref(0))

    def _answer(self, value: Any) -> _Ref:
        if self.loading:
            return _Ref(fut=asyncio.get_running_loop().create_future())
        return _Ref(exc=RuntimeError("actor died")) if self.dead else _Ref(value)

    def _control(self, c: Control) -> _Ref:
        if self.dead:
            return _Ref(exc=RuntimeError("actor died"))
        self.controls.append(c)
        return _Ref(None)

    async def _run(self):
        while True:
            item = await self.reports.get()
            if item is None:  # the stream ends without an error (the actor's driver stopped)
                return
            if isinstance(item, BaseException):
                raise item
            yield _Ref(item)

    def report(self, *events: TokenEvent) -> None:
        view = EngineView(0.0, [], 1, 1, 10, 10, 16)
        self.reports.put_nowait(StepReport(1, list(events), view, 0.0, {}))

    def die(self) -> None:
        self.dead = True
        self.reports.put_nowait(RuntimeError("actor died"))


class _Metrics:
    def __init__(self, *_):
        self.last = {}

    def update(self, stats):
        pass


@pytest.fixture
def make_actor(monkeypatch):
    """`make(**config)`: a SchedulerActor over FakeGPUs, and the list of those it made; set `make.loading` to have
    the next ones never finish loading."""
    gpus: list[FakeGPU] = []

    def new_gpu(self):
        gpus.append(FakeGPU(loading=make.loading))
        return gpus[-1]

    monkeypatch.setattr(sa.SchedulerActor, "_new_gpu", new_gpu)
    monkeypatch.setattr(sa, "RayMetrics", _Metrics)
    monkeypatch.setattr(sa.ray, "kill", lambda *a, **k: None)

    def make(**cfg):
        actor = sa.SchedulerActor({"ram_cache_gb": 0, "responses_store_mb": 0, **cfg})
        return actor, gpus

    make.loading = False
    return make


def _req(rid: str) -> Request:
    return Request((1, 2, 3), SamplingParams(max_tokens=4), request_id=rid)


async def _settle(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def test_a_request_while_the_engine_is_down_fails_at_once_and_queues_nothing(make_actor):
    """While a lost engine is replaced (for as long as that takes), each new request is refused at once and leaves
    nothing behind: no control message holding its prompt, no stream."""
    async def main():
        actor, gpus = make_actor()
        await actor.ready()
        gpus[0].die()
        await _settle(20)
        assert actor.dead is not None
        for i in range(3):
            events = [ev async for ev in actor.generate(_req(f"late{i}"))]
            assert len(events) == 1 and events[0].error_type == "CapacityError"
            assert events[0].finish_reason == FinishReason.ABORT
        assert actor.pending.empty() and not actor.queues
        actor._recovering.cancel()
        for t in actor._tasks:
            t.cancel()

    asyncio.run(main())


def test_a_report_stream_that_ends_counts_as_a_lost_engine(make_actor):
    """The GPU actor's report stream ending without an error (its driver stopped, the actor still answering calls):
    the open streams fail at once instead of waiting for ever, and the engine is replaced."""
    async def main():
        actor, gpus = make_actor()
        await actor.ready()

        async def one():
            return [ev async for ev in actor.generate(_req("r0"))]

        task = asyncio.create_task(one())
        await _settle(20)
        gpus[0].reports.put_nowait(None)
        events = await asyncio.wait_for(task, 2.0)
        assert len(events) == 1 and events[0].finish_reason == FinishReason.ABORT and events[0].error_type
        assert actor.dead is not None
        await asyncio.sleep(1.3)  # `_recover`'s first wait: its successor made
        assert len(gpus) == 2
        await asyncio.wait_for(actor._recovering, 2.0)
        assert actor.dead is None and actor.restarts == 1
        for t in actor._tasks:
            t.cancel()

    asyncio.run(main())


class _InPlace:
    """A Ray actor handle's stand-in over the actor's own class: `method.remote(...)` runs it here, awaitable."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __getattr__(self, name: str) -> _Method:
        fn = getattr(self.obj, name)
        return _Method(lambda *a, **k: _Ref(fn(*a, **k)))


def test_a_lost_engines_paused_conversations_leave_the_tiers(make_actor, tmp_path):
    """The conversations a lost engine had paused live on only as tier units that nothing will resume (their
    streams failed). Ranked by their arrival, older than any later pause, they would hold the tiers' room for
    good: the replacement drops them from both tiers (one the RAM tier is spilling, once written), for the open
    streams and for requests its last view showed, and nothing else (prefix pages, others' conversations)."""
    from actors.kv_tier_actors import DiskTierActor, RamTierActor
    from decapybara.backend.base import KVPageData
    from decapybara.engine.driver import SeqView
    from decapybara.kv.units import Unit, conv_key, encode_unit, page_key

    def unit(key: str) -> bytes:
        return encode_unit(Unit.conversation(key, KVPageData({"3|k.values": np.ones((1, 4, 2), np.float32)}),
                                             None, 4))

    ram, disk = RamTierActor(1 << 20), DiskTierActor(f"file://{tmp_path}/kv", 1 << 20)
    page = page_key(b"salt", b"\x01" * 16)
    for key in (conv_key("a", 1), conv_key("other", 1), page):
        ram.store.put(key, object(), 100, 1.0 if key.startswith("conv/") else None)
    ram.spilling[conv_key("b", 2)] = object()  # spilled, its disk write not landed yet
    for key in (conv_key("c", 3), conv_key("other", 2)):
        disk.put(key, unit(key))

    async def main():
        actor, gpus = make_actor()
        actor.tiers = {"ram": _InPlace(ram), "disk": _InPlace(disk)}
        await actor.ready()
        # "c" paused, its stream gone (its abort not applied yet)
        view = EngineView(0.0, [SeqView("c", None, "paused", 0.0, 3, 3, 0, 4, 1)], 1, 1, 10, 10, 16)
        gpus[0].reports.put_nowait(StepReport(1, [], view, 0.0, {}))
        streams = [actor.generate(_req(rid)) for rid in ("a", "b")]
        reads = [asyncio.ensure_future(g.__anext__()) for g in streams]
        await _settle()
        gpus[0].die()
        await _settle(20)
        assert [(await r).error_type for r in reads] == ["CapacityError"] * 2
        await asyncio.wait_for(actor._recovering, 5)  # a new engine is up
        assert len(gpus) == 2 and actor.dead is None
        assert sorted(ram.store.keys()) == sorted([conv_key("other", 1), page])
        assert ram.taken == {conv_key("b", 2)}  # its disk copy deleted once written
        assert disk.keys() == [conv_key("other", 2)]
        for g in streams:
            await g.aclose()
        for t in actor._tasks:
            t.cancel()

    asyncio.run(main())


def test_stats_answer_while_a_lost_engine_is_replaced(make_actor):
    """An engine lost before its first report: /stats and /metrics answer from the scheduler at once, neither
    asking the dead actor nor waiting for its successor to load."""
    async def main():
        actor, gpus = make_actor()
        await actor.ready()
        make_actor.loading = True
        gpus[0].die()
        await _settle(20)
        out = await asyncio.wait_for(actor.stats(), 1.0)  # the dead actor's handle
        assert out["queue"]["streams"] == 0
        await asyncio.sleep(1.3)  # `_recover`'s first wait: the new actor is loading
        assert len(gpus) == 2 and actor.dead is not None
        out = await asyncio.wait_for(actor.stats(), 1.0)
        assert out["slots"] == []
        actor._recovering.cancel()

    asyncio.run(main())


def test_streams_past_the_limit_are_refused_at_once(make_actor, monkeypatch):
    """Past `MAX_STREAMS` open streams a request is refused (a 503) rather than holding one of the calls the
    actor keeps for health checks and aborts."""
    monkeypatch.setattr(sa, "MAX_STREAMS", 2)

    async def main():
        actor, gpus = make_actor()
        await actor.ready()
        open_ = [actor.generate(_req(f"r{i}")) for i in range(2)]
        reads = [asyncio.ensure_future(g.__anext__()) for g in open_]
        await _settle()
        events = [ev async for ev in actor.generate(_req("r2"))]
        assert len(events) == 1 and events[0].error_type == "CapacityError" and "in flight" in events[0].error
        await _settle()
        sent = [r.request_id for c in gpus[0].controls for r in c.add]
        assert sent == ["r0", "r1"]
        gpus[0].report(*(TokenEvent(f"r{i}", [1], "x", finish_reason=FinishReason.STOP) for i in range(2)))
        assert [(await r).finish_reason for r in reads] == [FinishReason.STOP] * 2
        for g in open_:
            await g.aclose()
        assert not actor.queues
        for t in actor._tasks:
            t.cancel()

    asyncio.run(main())


class _Sched(sa.SchedulerActor):
    """The scheduler actor over a FakeGPU, in a Ray actor."""

    def _new_gpu(self):
        return FakeGPU()

    async def finish(self, request_id: str) -> None:
        self.gpu.report(TokenEvent(request_id, [1], "x", finish_reason=FinishReason.STOP))


def test_open_streams_leave_the_scheduler_answering_health_checks(ray_cluster, monkeypatch):
    """A thousand streams open at once (a busy server: every one waits for the engine's slots) still leave the
    scheduler actor room to answer health checks, aborts and stats: Serve's health check would otherwise time out
    and restart the replica, and with it the actors it owns."""
    import ray
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this test module
    monkeypatch.setattr(sa, "SchedulerActor", _Sched)
    handle = sa.scheduler_handle({"name": "pytest-streams", "ram_cache_gb": 0, "responses_store_mb": 0})
    try:
        ray.get(handle.ready.remote(), timeout=60)
        streams = [handle.generate.options(num_returns="streaming").remote(_req(f"r{i}")) for i in range(1000)]
        deadline = time.monotonic() + 60
        while ray.get(handle.stats.remote(), timeout=30)["queue"]["streams"] < 1000:
            assert time.monotonic() < deadline
            time.sleep(0.5)
        assert ray.get(handle.health.remote(), timeout=10)["status"] == "ok"
        ray.get(handle.finish.remote("r7"), timeout=10)
        ev = ray.get(next(streams[7]), timeout=10)
        assert ev.request_id == "r7" and ev.finish_reason == FinishReason.STOP
        for s in streams:
            ray.cancel(s)
    finally:
        ray.kill(handle)
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
