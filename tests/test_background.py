"""Background responses' runs against a store whose calls take time (as the scheduler actor's Ray calls do) over
the live app of test_api (its scripted engine): a cancel or DELETE right after the create, a DELETE while the run
stores, an abort the server made, a store that fails once, the server stopping, a run lost with its server."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
from test_api import LiveServer, stack  # noqa: F401  (the module's live app)

from decapybara.api import background
from decapybara.api.app import create_app
from decapybara.api.response_store import LocalResponses
from decapybara.engine.sequence import FinishReason, TokenEvent

SLOW = {"model": "m", "input": "KEEP-TALKING SLOW-DOWN", "reasoning": {"effort": "none"}}  # ~0.06 s a token


class SlowStore:
    """A LocalResponses whose calls suspend (`delay` s, a Ray round trip); `storing` is set while an update is
    in flight; the updates numbered in `fail` raise."""

    def __init__(self, delay: float = 0.0, fail: set[int] = frozenset()) -> None:
        self.inner, self.delay, self.fail = LocalResponses(), delay, set(fail)
        self.storing = threading.Event()
        self.updates = 0

    def put(self, record):
        return self.inner.put(record)

    async def put_now(self, record):
        await asyncio.sleep(self.delay)
        return await self.inner.put_now(record)

    async def update(self, record):
        self.updates += 1
        if self.updates in self.fail:
            raise RuntimeError("the store actor is unavailable")
        self.storing.set()
        try:
            await asyncio.sleep(self.delay)
            return await self.inner.update(record)
        finally:
            self.storing.clear()

    async def get(self, rid):
        await asyncio.sleep(self.delay)
        return await self.inner.get(rid)

    async def get_versioned(self, rid):
        await asyncio.sleep(self.delay)
        return await self.inner.get_versioned(rid)

    async def swap(self, record, digest):
        await asyncio.sleep(self.delay)
        return await self.inner.swap(record, digest)

    async def chain(self, rid, partial=False):
        return await self.inner.chain(rid, partial)

    async def delete(self, rid):
        await asyncio.sleep(self.delay)
        return await self.inner.delete(rid)

    async def stats(self):
        return await self.inner.stats()


class Proxy:
    """The stack's engine client with another store (and, optionally, another generate)."""

    def __init__(self, client, store, generate=None):
        self._client, self.responses = client, store
        if generate is not None:
            self.generate = generate

    def __getattr__(self, name):
        return getattr(self._client, name)


@pytest.fixture
def serve(stack):  # noqa: F811
    servers = []

    def make(store, generate=None) -> httpx.Client:
        servers.append(LiveServer(create_app(Proxy(stack.client, store, generate))))
        return httpx.Client(base_url=servers[-1].url, timeout=60)
    yield make
    for s in servers:
        s.stop()


def status(http: httpx.Client, rid: str) -> str | None:
    r = http.get(f"/v1/responses/{rid}")
    return r.json()["status"] if r.status_code == 200 else None


def wait_for(http: httpx.Client, rid: str, until, timeout: float = 20.0) -> str | None:
    deadline = time.monotonic() + timeout
    while not until(s := status(http, rid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return s


def test_a_cancel_or_delete_right_after_the_create_stops_the_request(serve, stack):  # noqa: F811
    """The run starts its request before it stores anything, and a cancel aborts until the run has ended: a
    cancel sent at once ends it "cancelled" for good, a DELETE sent at once frees the engine (the run's next
    update is refused, so it stops)."""
    http = serve(SlowStore(delay=0.05))
    rid = http.post("/v1/responses", json={**SLOW, "max_output_tokens": 60, "background": True}).json()["id"]
    assert http.post(f"/v1/responses/{rid}/cancel").json()["status"] == "cancelled"
    time.sleep(0.5)
    assert rid not in stack.client.engine.seqs and status(http, rid) == "cancelled"
    rid = http.post("/v1/responses", json={**SLOW, "max_output_tokens": 60, "background": True}).json()["id"]
    assert http.delete(f"/v1/responses/{rid}").status_code == 200
    time.sleep(1.5)  # past the run's next update
    assert rid not in stack.client.engine.seqs and status(http, rid) is None


def test_a_delete_while_the_run_stores_is_never_undone(serve):
    """A DELETE that lands while the run's update is on its way: the update (one store call that checks and
    stores) is refused, the run stops, and the response stays deleted."""
    store = SlowStore(delay=0.3)
    http = serve(store)
    rid = http.post("/v1/responses", json={**SLOW, "max_output_tokens": 2000, "background": True}).json()["id"]
    assert wait_for(http, rid, lambda s: s == "in_progress") == "in_progress"
    assert store.storing.wait(5)
    assert http.delete(f"/v1/responses/{rid}").status_code == 200
    time.sleep(1.5)
    assert status(http, rid) is None


def test_an_abort_the_server_made_is_a_failure_and_a_store_hiccup_is_not(serve, stack):  # noqa: F811
    """An ABORT nobody asked for (the engine driver ends every request so when a step fails) stores the response
    "failed" with the error a foreground request gets; one failing update leaves the run going to its end."""
    def generate(request):
        async def events():
            async for ev in stack.client.generate(request):
                yield ev
                break
            yield TokenEvent(request.request_id, [], finish_reason=FinishReason.ABORT, note="engine step failed")
        return events()
    http = serve(SlowStore(), generate)
    rid = http.post("/v1/responses", json={**SLOW, "max_output_tokens": 30, "background": True}).json()["id"]
    assert wait_for(http, rid, lambda s: s in background.SETTLED) == "failed"
    assert "cancelled by the server" in http.get(f"/v1/responses/{rid}").json()["error"]["message"]
    http = serve(SlowStore(fail={1}))  # the run's first update raises
    rid = http.post("/v1/responses", json={**SLOW, "max_output_tokens": 30, "background": True}).json()["id"]
    assert wait_for(http, rid, lambda s: s in background.SETTLED) == "incomplete"


def test_stopping_the_server_fails_its_runs_and_a_lost_run_is_settled_when_read(stack):  # noqa: F811
    """The app's end stores its running responses "failed" (the server stopped); a record whose run stopped
    storing it over ORPHAN_S ago (its server crashed) reads "failed", and a turn may continue it."""
    from fastapi.testclient import TestClient

    store = SlowStore()
    with TestClient(create_app(Proxy(stack.client, store))) as http:
        rid = http.post("/v1/responses", json={**SLOW, "max_output_tokens": 2000, "background": True}).json()["id"]
        time.sleep(0.3)
    record = asyncio.run(store.get(rid))
    assert record["response"]["status"] == "failed" and "stopped" in record["response"]["error"]["message"]
    record["response"]["status"], record["beat"] = "in_progress", time.time() - background.ORPHAN_S - 1
    store.put(record)
    with TestClient(create_app(Proxy(stack.client, store))) as http:
        lost = http.get(f"/v1/responses/{rid}").json()
        assert lost["status"] == "failed" and "went away" in lost["error"]["message"]
        nxt = http.post("/v1/responses", json={"model": "m", "input": "SAY-STOP", "max_output_tokens": 8,
                                               "previous_response_id": rid})
        assert nxt.status_code == 200, nxt.text
        fresh = background.stamped({**record, "response": {**record["response"], "status": "in_progress"}})
        assert not background.orphaned(fresh) and background.orphaned(record)


def test_a_background_runs_input_items_keep_their_ids_while_it_runs(serve):
    """Input items sent without ids get theirs when the run is first stored (queued); each later store of the run
    (in progress, then its end) keeps them, so input_items lists the same ids throughout."""
    http = serve(SlowStore(delay=0.02))
    body = {**SLOW, "input": [{"role": "user", "content": "KEEP-TALKING SLOW-DOWN"}], "max_output_tokens": 60,
            "background": True}
    rid = http.post("/v1/responses", json=body).json()["id"]

    def ids():
        return [i["id"] for i in http.get(f"/v1/responses/{rid}/input_items").json()["data"]]

    first = ids()
    assert len(first) == 1
    assert wait_for(http, rid, lambda s: s == "in_progress") == "in_progress"
    assert ids() == first
    assert wait_for(http, rid, lambda s: s in ("completed", "incomplete")) in ("completed", "incomplete")
    assert ids() == first
