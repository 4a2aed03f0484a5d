"""Locust load test: coding agents hammering one Decapybara server through both APIs.

Each simulated agent keeps a multi-turn conversation: every turn appends the model's answer and a new user
message (sometimes a tool result after a tool call), so its prompts share a growing prefix the server
should reuse. A third of the agents speak OpenAI chat completions (`/v1/chat/completions`), a third Anthropic
(`/v1/messages`), a third OpenAI's Responses API (`/v1/responses`, each turn continuing the stored one by
`previous_response_id`), all streaming. Besides each request, locust records three derived entries per turn:
``TTFT`` (time to first token, ms), ``ITL`` (mean inter-token latency of the turn, ms) and ``tokens``
(the turn's output tokens, as the "response length", so the totals give tokens/s).

    locust -f loadtests/locustfile.py --headless -u 30 -r 10 -t 5m --host http://127.0.0.1:8000
    # env: DECAPYBARA_API_KEY, DECAPYBARA_MAX_TOKENS (default 64), DECAPYBARA_TURNS (default 6)
"""

from __future__ import annotations

import json
import os
import random
import time

from locust import HttpUser, between, task

API_KEY = os.environ.get("DECAPYBARA_API_KEY", "")
MAX_TOKENS = int(os.environ.get("DECAPYBARA_MAX_TOKENS", "64"))
TURNS = int(os.environ.get("DECAPYBARA_TURNS", "6"))

SYSTEM = ("You are a coding agent working in a Python repository. Read files with the tools, make small "
          "changes, run the tests, and explain what you did in one short paragraph.")
TOOLS_OPENAI = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file of the repository",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
TOOLS_RESPONSES = [{"type": "function", **TOOLS_OPENAI[0]["function"]}]
TOOLS_ANTHROPIC = [{"name": "read_file", "description": "Read a file of the repository",
                    "input_schema": {"type": "object", "properties": {"path": {"type": "string"}},
                                     "required": ["path"]}}]
ASKS = [
    "Write a Python function `slugify(text)` that lower-cases text and joins words with dashes.",
    "Complete this code:\n```python\ndef parse_args(argv):\n    parser = argparse.ArgumentParser()\n",
    "Explain what `functools.lru_cache` does and when to use it.",
    "Write a Python function `chunks(seq, n)`: Yield successive n-sized chunks from seq.",
    "Fix the bug: `def mean(xs): return sum(xs) / len(xs) + 1`",
    "Write a Python function `read_lines(path)`: Return the lines of a text file without newlines.",
]
FILES = ["os.py", "json/__init__.py", "pathlib.py", "shutil.py", "textwrap.py"]


class Agent(HttpUser):
    """One coding agent: a conversation of up to TURNS turns, then a fresh one."""

    wait_time = between(0.2, 1.0)
    abstract = True
    api = "openai"

    def on_start(self) -> None:
        self.headers = {"content-type": "application/json", "x-conversation-id": f"agent-{id(self):x}"}
        if API_KEY:
            self.headers["authorization"] = f"Bearer {API_KEY}"
        self.reset()

    def reset(self) -> None:
        self.turn = 0
        self.messages: list[dict] = []

    def _record(self, name: str, started: float, first: float | None, times: list[float], tokens: int,
                exc: Exception | None = None) -> None:
        fire = self.environment.events.request.fire
        if first is not None:
            fire(request_type="agent", name="TTFT", response_time=(first - started) * 1000, response_length=0,
                 exception=None, context={})
        if len(times) > 1:
            itl = (times[-1] - times[0]) / (len(times) - 1) * 1000
            fire(request_type="agent", name="ITL", response_time=itl, response_length=0, exception=None, context={})
        fire(request_type="agent", name="tokens", response_time=(time.perf_counter() - started) * 1000,
             response_length=tokens, exception=exc, context={})

    def _stream(self, path: str, body: dict, name: str) -> tuple[str, list[dict], int] | None:
        """POST a streaming request; returns (text, tool calls, output tokens) and records the timings; None
        when it failed (a status other than 200, or an error event in the stream: a failure in locust's
        table)."""
        started, first, times, text, calls, tokens = time.perf_counter(), None, [], "", [], 0
        with self.client.post(path, data=json.dumps(body), headers=self.headers, stream=True, name=name,
                              catch_response=True) as resp:
            self.refusal = "" if resp.status_code == 200 else resp.text
            if resp.status_code != 200:
                resp.failure(f"{resp.status_code}: {resp.text[:200]}")
                self._record(name, started, None, [], 0, RuntimeError(str(resp.status_code)))
                return None
            for raw in resp.iter_lines():
                line = raw.decode() if isinstance(raw, bytes) else raw
                if not line.startswith("data: ") or line[6:] == "[DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data or data.get("type") in ("error", "response.failed"):  # OpenAI's error chunk,
                    # Anthropic's or the Responses API's error event: the turn failed mid-stream
                    err = data.get("error") or {k: data.get(k) for k in ("code", "message")}
                    resp.failure(f"stream error: {json.dumps(err)[:200]}")
                    self._record(name, started, first, times, tokens, RuntimeError("stream error"))
                    return None
                piece = self._piece(data, calls)
                if data.get("usage") and self.api == "openai":
                    tokens = data["usage"].get("completion_tokens", tokens)
                if data.get("type") == "message_delta":
                    tokens = data.get("usage", {}).get("output_tokens", tokens)
                if data.get("type") in ("response.completed", "response.incomplete"):
                    tokens = (data["response"].get("usage") or {}).get("output_tokens", tokens)
                if piece:
                    now = time.perf_counter()
                    first = first or now
                    times.append(now)
                    text += piece
            if not self._ended():  # the stream stopped before its last event
                resp.failure("the stream ended before its final event")
                self._record(name, started, first, times, tokens, RuntimeError("cut stream"))
                return None
            resp.success()
        self._record(name, started, first, times, tokens)
        return text, calls, tokens

    def _piece(self, data: dict, calls: list[dict]) -> str:
        raise NotImplementedError

    def _ended(self) -> bool:
        """Whether the stream just read reached its final event (where the API has one the agent needs)."""
        return True

    @task
    def turn_task(self) -> None:
        if self.turn >= TURNS:
            self.reset()
        self.turn += 1
        self.step(random.choice(ASKS), random.choice(FILES))


class OpenAIAgent(Agent):
    api = "openai"
    weight = 1

    def _piece(self, data: dict, calls: list[dict]) -> str:
        out = ""
        for ch in data.get("choices", []):
            delta = ch.get("delta", {})
            out += (delta.get("content") or "") + (delta.get("reasoning_content") or "")
            calls += delta.get("tool_calls") or []
        return out

    def step(self, ask: str, file: str) -> None:
        if not self.messages:
            self.messages = [{"role": "system", "content": SYSTEM}]
        self.messages.append({"role": "user", "content": ask})
        body = {"model": "decapybara", "messages": self.messages, "tools": TOOLS_OPENAI, "stream": True,
                "max_tokens": MAX_TOKENS, "temperature": 0.7, "stream_options": {"include_usage": True}}
        got = self._stream("/v1/chat/completions", body, "openai chat")
        if got is None:  # the turn failed: the agent asks again next time, its history unchanged
            self.messages.pop()
            return
        text = got[0]
        if self.turn % 3 == 0:  # a tool round trip every third turn
            call_id = f"call_{self.turn}"
            self.messages.append({"role": "assistant", "content": text, "tool_calls": [
                {"id": call_id, "type": "function",
                 "function": {"name": "read_file", "arguments": json.dumps({"path": file})}}]})
            self.messages.append({"role": "tool", "tool_call_id": call_id, "content": f"# {file}\nimport os\n"})
        else:
            self.messages.append({"role": "assistant", "content": text})


class AnthropicAgent(Agent):
    api = "anthropic"
    weight = 1

    def on_start(self) -> None:
        super().on_start()
        self.headers["anthropic-version"] = "2023-06-01"
        if API_KEY:
            self.headers["x-api-key"] = API_KEY

    def _piece(self, data: dict, calls: list[dict]) -> str:
        if data.get("type") != "content_block_delta":
            return ""
        d = data.get("delta", {})
        return d.get("text") or d.get("thinking") or d.get("partial_json") or ""

    def step(self, ask: str, file: str) -> None:
        self.messages.append({"role": "user", "content": ask})
        body = {"model": "decapybara", "system": SYSTEM, "messages": self.messages, "tools": TOOLS_ANTHROPIC,
                "stream": True, "max_tokens": MAX_TOKENS, "temperature": 0.7}
        got = self._stream("/v1/messages", body, "anthropic messages")
        if got is None:  # the turn failed: the agent asks again next time, its history unchanged
            self.messages.pop()
            return
        text = got[0]
        if self.turn % 3 == 0:
            tool_id = f"toolu_{self.turn}"
            self.messages.append({"role": "assistant", "content": [
                {"type": "text", "text": text or "Reading the file."},
                {"type": "tool_use", "id": tool_id, "name": "read_file", "input": {"path": file}}]})
            self.messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": tool_id, "content": f"# {file}\nimport os\n"}]})
        else:
            self.messages.append({"role": "assistant", "content": text or "Done."})


class ResponsesAgent(Agent):
    """Sends only each turn's new items: the conversation so far is the server's, by `previous_response_id`."""

    api = "responses"
    weight = 1

    def reset(self) -> None:
        super().reset()
        self.previous: str | None = None
        self.pending: list[dict] = []  # outputs of the calls the last response made, sent with the next turn

    def _piece(self, data: dict, calls: list[dict]) -> str:
        kind = data.get("type", "")
        if kind in ("response.completed", "response.incomplete"):
            self.latest = data["response"]
        if kind in ("response.output_text.delta", "response.reasoning_text.delta",
                    "response.function_call_arguments.delta"):
            return data.get("delta") or ""
        return ""

    def _ended(self) -> bool:
        return self.latest is not None

    def step(self, ask: str, file: str) -> None:
        self.latest = None
        body = {"model": "decapybara", "instructions": SYSTEM, "tools": TOOLS_RESPONSES, "stream": True,
                "input": [*self.pending, {"role": "user", "content": ask}], "max_output_tokens": MAX_TOKENS,
                "temperature": 0.7}
        if self.previous is not None:
            body["previous_response_id"] = self.previous
        got = self._stream("/v1/responses", body, "openai responses")
        if got is None:  # the turn failed: asked again next time, the chain as it was, or a fresh conversation
            if "previous_response_not_found" in self.refusal:  # where the server no longer holds the chain
                self.reset()
            return
        self.previous = self.latest["id"]
        # the calls the model made get their outputs with the next turn (the chain's calls all answered)
        self.pending = [{"type": "function_call_output", "call_id": item["call_id"],
                         "output": f"# {file}\nimport os\n"}
                        for item in self.latest.get("output", []) if item.get("type") == "function_call"]
