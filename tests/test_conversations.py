"""OpenAI's Conversations API against a store whose calls suspend (as the scheduler actor's Ray calls do), over
the live app of test_api (its scripted engine): concurrent adds, a DELETE racing an add, locks, input_tokens,
duplicate ids, background turns, a client leaving at a stream's end, the store's budget."""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
import threading
import time

import httpx
import openai
import pytest
from test_api import LiveServer, stack  # noqa: F401  (the module's live app)
from test_background import SLOW, Proxy, SlowStore

from decapybara.api import app as app_mod
from decapybara.api.app import create_app
from decapybara.api.response_store import LocalResponses

MSG = {"type": "message", "role": "user", "content": "hello"}


@pytest.fixture
def serve(stack):  # noqa: F811
    servers = []

    def make(store, **kw):
        app = create_app(Proxy(stack.client, store))
        servers.append(LiveServer(app))
        return app, httpx.Client(base_url=servers[-1].url, timeout=60), servers[-1].url
    yield make
    for s in servers:
        s.stop()


def locks_of(app) -> dict:
    """create_app's `conversation_locks` (found through the update route's closures)."""
    def search(fn, depth=0):
        fn = getattr(fn, "__wrapped__", fn)
        code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
        if code is None or depth > 3:
            return None
        for name, cell in zip(code.co_freevars, cells):
            if name == "conversation_locks":
                return cell.cell_contents
            if callable(cell.cell_contents) and (found := search(cell.cell_contents, depth + 1)) is not None:
                return found
        return None
    for route in app.routes:
        if getattr(route, "path", "") == "/v1/conversations/{cid}" and "POST" in route.methods:
            return search(route.endpoint)
    raise AssertionError


def n_items(http, cid) -> int:
    return len(http.get(f"/v1/conversations/{cid}/items", params={"limit": 100}).json()["data"])


def add_at_once(https, cid, n) -> None:
    """`n` adds of one message each ("m0", "m1", ...) to conversation `cid`, started 5 ms apart, each through the
    next of the clients `https` in turn; every one answered 200."""
    answers = {}

    def add(i):
        answers[i] = https[i % len(https)].post(f"/v1/conversations/{cid}/items",
                                                json={"items": [{**MSG, "content": f"m{i}"}]})

    threads = [threading.Thread(target=add, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
        time.sleep(0.005)
    for t in threads:
        t.join()
    assert sorted(answers) == list(range(n)) and all(r.status_code == 200 for r in answers.values()), answers


def test_concurrent_adds_keep_every_item(serve):
    """Twelve adds at once to one conversation over a store whose calls suspend (as Ray's do): one at a time on
    the replica (a waiter's lock is never replaced), so every item is kept."""
    _, http, _ = serve(SlowStore(delay=0.02))
    cid = http.post("/v1/conversations", json={}).json()["id"]
    n = 12
    add_at_once([http], cid, n)
    assert n_items(http, cid) == n


def test_a_deleted_conversation_stays_deleted_past_an_add_in_flight(serve):
    """A DELETE that comes while an add is on its way waits for it (one lock), so the conversation stays deleted."""
    _, http, _ = serve(SlowStore(delay=0.1))
    cid = http.post("/v1/conversations", json={"items": [MSG]}).json()["id"]
    out = {}
    t1 = threading.Thread(target=lambda: out.setdefault("del", http.delete(f"/v1/conversations/{cid}")))
    t2 = threading.Thread(target=lambda: out.setdefault("add", http.post(f"/v1/conversations/{cid}/items",
                                                                            json={"items": [MSG]})))
    t2.start()  # the add: conversation() read (0.1 s), its own get (0.1 s), then put_now (0.1 s)
    time.sleep(0.05)
    t1.start()  # the delete: its read (0.1 s), then the delete lands between the add's get and its put
    t1.join()
    t2.join()
    assert out["del"].json()["deleted"] is True
    assert http.get(f"/v1/conversations/{cid}").status_code == 404, "deleted conversation came back"


def test_two_replicas_adding_at_once_keep_every_item(serve):
    """Adds to one conversation through two ingress replicas over one store (each replica's lock its own): the
    store's swap finds the other replica's change between a read and its store, so every item is kept."""
    store = SlowStore(delay=0.02)
    (_, a, _), (_, b, _) = serve(store), serve(store)
    cid = a.post("/v1/conversations", json={}).json()["id"]
    n = 12
    add_at_once([a, b], cid, n)
    assert n_items(a, cid) == n_items(b, cid) == n
    texts = {it["content"][0]["text"] for it in a.get(f"/v1/conversations/{cid}/items",
                                                      params={"limit": 100}).json()["data"]}
    assert texts == {f"m{i}" for i in range(n)}


def test_a_delete_on_one_replica_stays_past_an_add_on_another(serve):
    """A DELETE through one replica landing between another replica's read and store: the add's swap finds the
    conversation gone and answers 404, so it stays deleted."""
    store = SlowStore(delay=0.1)
    (_, a, _), (_, b, _) = serve(store), serve(store)
    cid = a.post("/v1/conversations", json={"items": [MSG]}).json()["id"]
    out = {}
    t1 = threading.Thread(target=lambda: out.setdefault("del", b.delete(f"/v1/conversations/{cid}")))
    t2 = threading.Thread(target=lambda: out.setdefault("add", a.post(f"/v1/conversations/{cid}/items",
                                                                         json={"items": [MSG]})))
    t1.start()  # the delete: its read (0.1 s), then the delete (0.1 s), landing at ~0.2 s
    time.sleep(0.03)
    t2.start()  # the add: its read at ~0.13 s (still there), its swap at ~0.23 s (gone: read again, a 404)
    t1.join()
    t2.join()
    assert out["del"].json()["deleted"] is True
    assert out["add"].status_code == 404, out["add"].text
    assert a.get(f"/v1/conversations/{cid}").status_code == 404, "deleted conversation came back"


def test_a_store_swap_takes_only_the_text_it_was_read_as():
    """`ResponseStore.swap`: stored where the record's text is the one read, None where it changed or is gone."""
    from decapybara.api.response_store import ResponseStore, text_digest
    st = ResponseStore(1 << 20)
    st.put("c", None, '{"v": 1}')
    d1 = text_digest(st.get("c"))
    assert st.swap("c", None, '{"v": 2}', d1) is True
    assert st.swap("c", None, '{"v": 3}', d1) is None and st.get("c") == '{"v": 2}'
    assert st.swap("c", None, "x" * (2 << 20), text_digest('{"v": 2}')) is False
    st.delete("c")
    assert st.swap("c", None, '{"v": 4}', text_digest('{"v": 2}')) is None and st.get("c") is None


def test_no_lock_is_left_behind_for_ids_named(serve):
    """Updates and item deletes naming conversations that do not exist (404s) leave no lock behind."""
    app, http, _ = serve(LocalResponses())
    for i in range(50):
        assert http.post(f"/v1/conversations/conv_nope{i}", json={"metadata": {}}).status_code == 404
        assert http.delete(f"/v1/conversations/conv_nada{i}/items/x").status_code == 404
    assert len(locks_of(app)) == 0, f"{len(locks_of(app))} locks left behind"


def test_input_tokens_counts_a_conversations_items(serve):
    """POST /v1/responses/input_tokens with `conversation` counts the conversation's items too; an unknown
    conversation is a 400."""
    _, http, _ = serve(LocalResponses())
    cid = http.post("/v1/conversations", json={"items": [{**MSG, "content": "word " * 200}]}).json()["id"]
    base = {"model": "m", "input": "hi"}
    plain = http.post("/v1/responses/input_tokens", json=base).json()["input_tokens"]
    unknown = http.post("/v1/responses/input_tokens", json={**base, "conversation": "conv_nope"})
    conv = http.post("/v1/responses/input_tokens", json={**base, "conversation": cid}).json()["input_tokens"]
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "conversation"
    assert conv > plain + 100


def test_items_sent_again_with_their_ids_are_refused(serve):
    """POST .../items with an id the conversation holds (a retried POST) is a 400, so ids stay unique and the
    SDK's pager (by last_id) ends."""
    _, http, url = serve(LocalResponses())
    oa = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    cid = oa.conversations.create().id
    dup = {"type": "message", "id": "msg_dup", "role": "user", "content": "x"}
    oa.conversations.items.create(cid, items=[dup, {"type": "message", "role": "user", "content": "y"}])
    with pytest.raises(openai.BadRequestError) as err:  # the same POST again (a client's retry)
        oa.conversations.items.create(cid, items=[dup, {"type": "message", "role": "user", "content": "y"}])
    assert "msg_dup" in str(err.value)
    with pytest.raises(openai.BadRequestError):  # twice in one POST
        oa.conversations.items.create(cid, items=[{**dup, "id": "msg_twice"}, {**dup, "id": "msg_twice"}])
    assert len(list(itertools.islice(oa.conversations.items.list(cid, order="asc", limit=1), 50))) == 2


def test_a_background_turn_is_in_the_conversation_once_it_reads_completed(serve):
    """A background turn adds its items before its end is stored: a client that polls to "completed" then reads
    the turn in the conversation."""
    _, http, _ = serve(SlowStore(delay=0.2))
    cid = http.post("/v1/conversations", json={}).json()["id"]
    rid = http.post("/v1/responses", json={"model": "m", "conversation": cid, "input": "SAY-STOP please",
                                           "max_output_tokens": 20, "reasoning": {"effort": "none"},
                                           "background": True}).json()["id"]
    while http.get(f"/v1/responses/{rid}").json()["status"] not in ("completed", "incomplete"):
        time.sleep(0.02)
    assert n_items(http, cid) == 2, "the turn's items are not in the conversation when it reads completed"


def test_a_client_leaving_a_stream_at_its_end_still_adds_the_turn(serve):
    """A streaming client that leaves while the turn is being added (the stream cancelled): the add goes on, so
    the stored, completed response's turn is in its conversation."""
    _, http, url = serve(SlowStore(delay=0.3))
    cid = http.post("/v1/conversations", json={}).json()["id"]
    body = json.dumps({"model": "m", "conversation": cid, "input": "SAY-STOP please", "max_output_tokens": 20,
                       "reasoning": {"effort": "none"}, "stream": True}).encode()
    host, port = url.split("//")[1].split(":")
    s = socket.create_connection((host, int(port)))
    s.sendall(b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
              + str(len(body)).encode() + b"\r\n\r\n" + body)
    got = b""
    s.settimeout(0.15)
    while True:  # read until the stream stalls (the add's gather), then leave
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            if b"output_text.delta" in got:
                break
            continue
        if not chunk:
            break
        got += chunk
    s.close()
    rid = json.loads(got.split(b"data: ", 1)[1].split(b"\n", 1)[0])["response"]["id"]
    time.sleep(1.5)
    stored = http.get(f"/v1/responses/{rid}")
    assert stored.status_code == 200 and stored.json()["status"] == "completed"
    assert n_items(http, cid) == 2, "the stored, completed response's turn is missing from its conversation"


def test_an_add_past_the_store_budget_is_a_400(serve):
    """A conversation (one record) that would grow past the store's budget: POST .../items is a 400, not a 200
    whose items are not there."""
    _, http, _ = serve(LocalResponses(budget_bytes=3000))
    cid = http.post("/v1/conversations", json={"items": [{**MSG, "content": "a" * 1000}]}).json()["id"]
    r = http.post(f"/v1/conversations/{cid}/items", json={"items": [{**MSG, "content": "b" * 1000}]})
    r2 = http.post(f"/v1/conversations/{cid}/items", json={"items": [{**MSG, "content": "c" * 1000}]})
    assert r.status_code == 200 and r2.status_code == 400 and r2.json()["error"]["param"] == "items"
    assert n_items(http, cid) == 2


def test_awaiting_lets_the_add_finish_when_its_consumer_is_cancelled():
    """`app.awaiting`: the add started at a stream's end finishes though the stream's task is cancelled (Ray Serve
    cancels a request's task when its client leaves)."""
    async def main():
        done = []

        async def add():
            await asyncio.sleep(0.05)
            done.append(1)

        pending: list = []

        async def lines():
            yield "a"
            pending.append(asyncio.ensure_future(add()))
            yield "b"

        async def consume():
            async for _ in app_mod.awaiting(lines(), pending):
                pass
        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.sleep(0.1)
        return done
    assert asyncio.run(main()) == [1]


def test_a_cancelled_background_turn_adds_nothing(serve):
    """A background turn cancelled adds nothing to its conversation, as a foreground turn that does not end adds
    nothing."""
    _, http, _ = serve(SlowStore(delay=0.0))
    cid = http.post("/v1/conversations", json={}).json()["id"]
    rid = http.post("/v1/responses", json={**SLOW, "conversation": cid, "max_output_tokens": 2000,
                                           "background": True}).json()["id"]
    time.sleep(0.5)
    assert http.post(f"/v1/responses/{rid}/cancel").json()["status"] == "cancelled"
    time.sleep(0.3)
    items = http.get(f"/v1/conversations/{cid}/items", params={"order": "asc"}).json()["data"]
    assert items == [], [(i["type"], i.get("status")) for i in items]
