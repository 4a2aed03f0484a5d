"""The HTTP edge of the app (methods, the API key, SSE framing) on a scripted engine client, in process."""

from __future__ import annotations

import asyncio

import pytest
from fastapi.testclient import TestClient

from decapybara.api import create_app
from decapybara.engine.sequence import FinishReason, TokenEvent
from decapybara.testing import make_tokenizer_json
from decapybara.tokenizer import Tokenizer

TOK = Tokenizer.from_json(make_tokenizer_json())
KEY = "sk-edge"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
MESSAGE = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}


class ScriptedClient:
    """An engine client whose every request answers `texts`, one event each."""

    model_name = "scripted"
    tokenizer = TOK
    max_model_len = 4096
    vocab_size = TOK.vocab_size

    def __init__(self, texts: tuple[str, ...] = ("Hello", " world")) -> None:
        self.texts = texts

    async def generate(self, request):
        for i, text in enumerate(self.texts):
            await asyncio.sleep(0)
            yield TokenEvent(request.request_id, [5], text,
                             finish_reason=FinishReason.STOP if i == len(self.texts) - 1 else None,
                             num_prompt_tokens=len(request.prompt_ids), num_output_tokens=i + 1)

    async def abort(self, request_id: str) -> None:
        pass

    async def stats(self) -> dict:
        return {"steps": 1, "running": 0}


def test_head_is_answered_on_the_service_routes():
    """Load balancers and uptime monitors probe with HEAD: it is answered as GET is, without a body."""
    http = TestClient(create_app(ScriptedClient(), api_key=KEY))
    r = http.head("/health")
    assert r.status_code == 200 and r.content == b""
    assert http.head("/v1/models").status_code == 401
    for path in ("/v1/models", "/v1/models/scripted", "/metrics", "/stats"):
        r = http.head(path, headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200 and r.content == b"", (path, r.status_code)


def test_a_wrong_method_is_a_405_that_says_the_allowed_ones():
    http = TestClient(create_app(ScriptedClient()))
    r = http.get("/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
    assert r.headers.get("allow") == "POST"
    r = http.delete("/v1/messages")
    assert r.status_code == 405 and r.json()["type"] == "error" and r.headers.get("allow") == "POST"


def test_the_key_is_taken_from_either_header():
    """An Anthropic client with both an API key and an auth token configured sends both headers: the request is
    let in where either carries the server's key (each compared in full), refused where neither does."""
    http = TestClient(create_app(ScriptedClient(), api_key=KEY))
    both = {"x-api-key": "sk-ant-other", "Authorization": f"Bearer {KEY}"}
    assert http.post("/v1/messages", json=MESSAGE, headers=both).status_code == 200
    assert http.post("/v1/messages", json=MESSAGE, headers={"x-api-key": KEY, "Authorization": "Bearer x"}
                     ).status_code == 200
    for headers in ({"x-api-key": "sk-ant-other", "Authorization": "Bearer nope"}, {"x-api-key": KEY[:-1]},
                    {"Authorization": f"Bearer {KEY}x"}, {"Authorization": KEY}, {}):
        r = http.post("/v1/messages", json=MESSAGE, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", headers


def test_a_non_ascii_key_is_matched_as_the_client_sends_it():
    """A key with non-ASCII characters arrives as its UTF-8 bytes (curl -H 'x-api-key: ...')."""
    key = "clé-секрет"
    http = TestClient(create_app(ScriptedClient(), api_key=key))
    assert http.get("/v1/models", headers=[("x-api-key", key.encode())]).status_code == 200
    assert http.get("/v1/models", headers=[("authorization", b"Bearer " + key.encode())]).status_code == 200
    assert http.get("/v1/models", headers=[("x-api-key", key.encode("latin-1", "replace"))]).status_code == 401


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"])
def test_sse_lines_hold_no_unicode_line_breaks(path):
    """U+2028, U+2029 and U+0085 in the text are written as JSON escapes: line readers that split on every Unicode
    line break (httpx's iter_lines, which older httpx-sse releases read streams with) keep each data line whole."""
    body = {"/v1/chat/completions": CHAT, "/v1/messages": MESSAGE, "/v1/completions": {"prompt": "hi", "max_tokens": 5},
            "/v1/responses": {"input": "hi"}}[path]
    http = TestClient(create_app(ScriptedClient(("a\u2028b", " c\u0085d", "e\u2029f"))))
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = list(r.iter_lines())
    assert lines and all(not line or line.startswith(("data: ", "event: ", ":")) for line in lines), lines
    text = "\n".join(lines)
    assert "\\u2028" in text and "\\u0085" in text and "\\u2029" in text
