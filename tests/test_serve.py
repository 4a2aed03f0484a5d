"""The app under a real `serve run` (Ray Serve, SchedulerActor, GPUActor, tier actors) with the demo model,
driven by the official openai and anthropic SDKs, httpx, a Serve handle, and locust."""

from __future__ import annotations

import concurrent.futures as cf
import json
import subprocess
import sys
import time

import anthropic
import httpx
import openai
import pytest

from conftest import API_KEY, DEMO, ROOT

pytestmark = pytest.mark.timeout(600)
USER = [{"role": "user", "content": "Write a Python function `add(a, b)`: Return the sum of a and b."}]


@pytest.fixture(scope="module")
def oai(served):
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def ant(served):
    return anthropic.Anthropic(base_url=served.url, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def local():
    """The same model in-process (the reference for greedy answers and token counts)."""
    from decapybara.model.load import load_model

    return load_model(str(DEMO))


def stats(served) -> dict:
    return httpx.get(f"{served.url}/stats", headers={"authorization": f"Bearer {API_KEY}"}, timeout=30).json()


def test_models_chat_and_usage_consistent_with_the_tokenizer(oai, local):
    assert [m.id for m in oai.models.list().data] == ["decapybara"]
    r = oai.chat.completions.create(model="anything", messages=USER, max_tokens=16, temperature=0,
                                    extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    prompt = local.tokenizer.apply_chat(USER, enable_thinking=False)
    assert r.usage.prompt_tokens == len(prompt)
    assert 1 <= r.usage.completion_tokens <= 16 and r.choices[0].finish_reason in ("stop", "length")
    on = oai.chat.completions.create(model="x", messages=USER, max_tokens=1, temperature=0,
                                     extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert on.usage.prompt_tokens == len(local.tokenizer.apply_chat(USER, enable_thinking=True))
    assert on.usage.prompt_tokens != r.usage.prompt_tokens  # thinking off adds the empty <think> block


def test_greedy_over_http_equals_the_in_process_engine(oai, local):
    from decapybara.config import EngineConfig
    from decapybara.engine.engine import Engine
    from decapybara.engine.sampling import SamplingParams

    prompt = local.tokenizer.encode("import os\n\ndef list_python_files(root):\n")
    engine = Engine(local.model, EngineConfig(loop_guard="off"), tokenizer=local.tokenizer)
    want = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    r = oai.completions.create(model="m", prompt=prompt, max_tokens=24, temperature=0,
                               extra_body={"ignore_eos": True})
    assert r.choices[0].text == local.tokenizer.decode(want)
    text = "".join(c.choices[0].text for c in oai.completions.create(
        model="m", prompt=local.tokenizer.decode(prompt), max_tokens=24, temperature=0, stream=True,
        extra_body={"ignore_eos": True}) if c.choices)
    assert text == local.tokenizer.decode(want)


def test_streaming_chat_stop_sequences_and_cached_prompt_tokens(oai):
    chunks = list(oai.chat.completions.create(model="m", messages=USER, max_tokens=40, temperature=0, stream=True,
                                              stop=["\n"], stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "\n" not in text
    assert chunks[-1].usage is not None
    again = oai.chat.completions.create(model="m", messages=USER, max_tokens=4, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the repeated prompt came from the cache


def test_tool_call_round_trip_both_apis(oai, ant):
    tools = [{"type": "function", "function": {"name": "read_file", "description": "Read a file",
              "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]
    msgs = [{"role": "user", "content": "Read setup.py and summarise it."},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
             "function": {"name": "read_file", "arguments": json.dumps({"path": "setup.py"})}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "from setuptools import setup\nsetup()\n"}]
    r = oai.chat.completions.create(model="m", messages=msgs, tools=tools, max_tokens=24, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    m = ant.messages.create(model="m", max_tokens=24, tools=[{
        "name": "read_file", "description": "Read a file", "input_schema": {"type": "object"}}], messages=[
        {"role": "user", "content": "Read setup.py."},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "read_file",
                                            "input": {"path": "setup.py"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "setup()"}]}])
    assert m.stop_reason in ("end_turn", "max_tokens", "tool_use") and m.usage.input_tokens > 0
    # the same round trip through the Responses API: the openai SDK's items, the whole reply and its stream
    items = [{"role": "user", "content": "Read setup.py and summarise it."},
             {"type": "function_call", "call_id": "call_1", "name": "read_file",
              "arguments": json.dumps({"path": "setup.py"})},
             {"type": "function_call_output", "call_id": "call_1", "output": "from setuptools import setup\nsetup()\n"}]
    rtools = [{"type": "function", **tools[0]["function"]}]
    r = oai.responses.create(model="m", input=items, tools=rtools, max_output_tokens=24, temperature=0)
    assert r.status in ("completed", "incomplete") and r.output and r.usage.input_tokens > 0
    with oai.responses.stream(model="m", input=items, tools=rtools, max_output_tokens=24, temperature=0) as s:
        last = list(s)[-1]  # response.completed, or response.incomplete where max_output_tokens cut it
    assert last.type == f"response.{r.status}"
    assert [i.type for i in last.response.output] == [i.type for i in r.output]
    assert last.response.output_text == r.output_text
    # the next turn continues the stored one through the scheduler actor's store (tools sent again, as the API
    # asks): its prompt is the first turn's and more, so the prefix cache serves it
    nxt = oai.responses.create(model="m", previous_response_id=r.id, input="Thanks. List the files next.",
                               tools=rtools, max_output_tokens=8, temperature=0)
    assert nxt.previous_response_id == r.id and nxt.usage.input_tokens > r.usage.input_tokens
    assert oai.responses.retrieve(r.id).model_dump() == r.model_dump()
    listed = [i.type for i in oai.responses.input_items.list(nxt.id, order="asc", limit=100)]
    assert listed[:3] == ["message", "function_call", "function_call_output"] and listed[-1] == "message"
    # in the background, through the scheduler actor's store: queued, then the foreground reply's items
    queued = oai.responses.create(model="m", input=items, tools=rtools, max_output_tokens=24, temperature=0,
                                  background=True)
    assert queued.status == "queued"
    deadline = time.monotonic() + 60
    while (done := oai.responses.retrieve(queued.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, done
        time.sleep(0.1)
    assert done.status == r.status and done.output_text == r.output_text and done.background is True
    # a conversation kept in the scheduler actor's store: a turn in it reads its items and adds its own
    conv = oai.conversations.create(items=items[:1])
    turn = oai.responses.create(model="m", conversation=conv.id, input=items[1:], tools=rtools, max_output_tokens=24,
                                temperature=0)
    assert turn.output_text == r.output_text
    listed = oai.conversations.items.list(conv.id, order="asc", limit=100).data
    assert [i.type for i in listed[:3]] == ["message", "function_call", "function_call_output"]
    assert listed[-1].id == turn.output[-1].id


def test_structured_outputs_and_forced_tool_calls_both_apis(oai, ant):
    """The SDKs' own structured-output calls (openai `chat.completions.parse`, anthropic `messages.parse`, each
    with a pydantic model) get replies that parse into the model, and a required tool call is a call whose
    arguments follow its schema, from the demo model through the whole server."""
    from typing import Literal

    import pydantic

    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=12)
        age: int = pydantic.Field(ge=0, le=150)
        handle: str = pydantic.Field(pattern=r"^@[a-z_]{1,10}$")  # pydantic checks it again when it parses

    msgs = [{"role": "user", "content": "A person as JSON."}]
    r = oai.chat.completions.parse(model="m", messages=msgs, response_format=Person, max_tokens=400, temperature=0,
                                   reasoning_effort="none")
    assert isinstance(r.choices[0].message.parsed, Person) and r.choices[0].finish_reason == "stop"
    class Pet(pydantic.BaseModel):  # the anthropic SDK sends no length or bounds (it checks them itself)
        name: str
        kind: Literal["cat", "dog"]

    m = ant.messages.parse(model="m", max_tokens=400, messages=[{"role": "user", "content": "A pet as JSON."}],
                           output_format=Pet)
    assert isinstance(m.parsed_output, Pet) and m.stop_reason == "end_turn"
    tools = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object", "properties": {
        "path": {"type": "string", "maxLength": 40, "pattern": "\\.py$"}}, "required": ["path"],
        "additionalProperties": False}}}]
    r = oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "Read setup.py."}], tools=tools,
                                    tool_choice="required", parallel_tool_calls=False, max_tokens=200,
                                    temperature=0, reasoning_effort="none")
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "read_file"
    assert set(json.loads(call.function.arguments)) == {"path"}
    assert json.loads(call.function.arguments)["path"].endswith(".py")


def test_anthropic_messages_stream_events_and_count_tokens(ant, local):
    with ant.messages.stream(model="m", max_tokens=12, messages=USER) as stream:
        kinds = [ev.type for ev in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_delta" in kinds and "message_delta" in kinds
    assert final.usage.output_tokens >= 1
    counted = ant.messages.count_tokens(model="m", messages=USER)
    assert counted.input_tokens == len(local.tokenizer.apply_chat(USER, enable_thinking=False))  # thinking off
    thinking = ant.messages.create(model="m", max_tokens=16, messages=USER,
                                   thinking={"type": "enabled", "budget_tokens": 1024})
    assert thinking.stop_reason in ("end_turn", "max_tokens")


def test_api_key_and_bad_input_then_still_serving(served, oai):
    assert httpx.get(f"{served.url}/health").status_code == 200
    r = httpx.post(f"{served.url}/v1/chat/completions", json={"messages": USER})
    assert r.status_code == 401 and r.json()["error"]["type"]
    r = httpx.post(f"{served.url}/v1/messages", json={"messages": USER, "max_tokens": 4})
    assert r.status_code == 401 and r.json()["type"] == "error"
    h = {"authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
    bad = [("/v1/chat/completions", b"{not json"), ("/v1/chat/completions", b'{"messages": "hi"}'),
           ("/v1/chat/completions", json.dumps({"messages": [{"role": "robot", "content": "x"}]}).encode()),
           ("/v1/chat/completions", json.dumps({"messages": []}).encode()),
           ("/v1/chat/completions", json.dumps({"messages": USER, "temperature": -3}).encode()),
           ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x " * 5000}]}).encode()),
           ("/v1/messages", json.dumps({"messages": USER}).encode()),
           ("/v1/messages", json.dumps({"messages": USER, "max_tokens": 4, "top_p": 7}).encode())]
    for path, body in bad:
        r = httpx.post(f"{served.url}{path}", content=body, headers=h, timeout=30)
        assert 400 <= r.status_code < 500, (path, body[:60], r.status_code, r.text[:200])
        shape = r.json()
        assert ("error" in shape) if path.startswith("/v1/chat") else shape["type"] == "error"
    assert oai.chat.completions.create(model="m", messages=USER, max_tokens=2).usage.completion_tokens >= 1


def test_client_disconnect_frees_the_slot(served):
    h = {"authorization": f"Bearer {API_KEY}"}
    before = stats(served).get("aborted", 0)  # engine counters appear with the first engine step
    body = {"messages": USER, "max_tokens": 1000, "stream": True, "temperature": 0.8}
    with httpx.stream("POST", f"{served.url}/v1/chat/completions", json=body, headers=h, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 4:
                break  # leave mid-stream
    deadline = time.time() + 20
    while time.time() < deadline:
        s = stats(served)
        if s.get("aborted", 0) > before and s.get("running") == 0:
            break
        time.sleep(0.1)
    assert s.get("aborted", 0) > before and s.get("running") == 0, s


def test_thirty_streaming_agents_through_twelve_slots(served, oai, ant):
    """30 agents (both APIs) at once on 12 slots and a pool too small for all: everyone finishes, the policy
    pauses and resumes conversations, and no resumed conversation was prefilled again."""
    def agent(i: int) -> int:
        msgs = [{"role": "user", "content": f"Agent {i}: write a Python function `f{i}(x)` returning x * {i}."}]
        if i % 2:
            with ant.messages.stream(model="m", max_tokens=48, messages=msgs, extra_body={"temperature": 0.7}) as s:
                return s.get_final_message().usage.output_tokens
        chunks = oai.chat.completions.create(model="m", messages=msgs, max_tokens=48, temperature=0.7,
                                             stream=True, stream_options={"include_usage": True})
        return [c for c in chunks][-1].usage.completion_tokens

    with cf.ThreadPoolExecutor(30) as pool:
        outputs = list(pool.map(agent, range(30)))
    assert len(outputs) == 30 and all(n >= 1 for n in outputs)
    s = e = stats(served)
    assert e["running"] == 0 and e["waiting"] == 0
    assert e["pauses"] > 0 and e["resumes"] == e["pauses"]
    # every admitted prompt token was either computed once or reused from the cache: no re-prefill
    assert e["computed_prompt_tokens"] + e["reused_prompt_tokens"] == e["prompt_tokens"]
    assert s["policy"]["policy"] == "age" and s["control"]["overhead_us_p50"] is not None
    ram, disk = s["tiers"]["ram"], s["tiers"]["disk"]
    assert ram["puts"] >= e["pauses"]  # paused conversations went to the RAM tier (evicted pages too)
    assert ram["used_bytes"] <= ram["budget_bytes"] and disk["used_bytes"] <= disk["budget_bytes"]


def test_python_serve_handle_streams(served):
    from ray import serve

    handle = serve.get_app_handle(served.app_name)
    chunks = list(handle.options(stream=True).chat.remote({"messages": USER, "max_tokens": 6, "stream": True}))
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert any(c["choices"] and c["choices"][0]["finish_reason"] for c in chunks)
    body = {"messages": USER, "max_tokens": 6, "stream": True, "temperature": 0}
    list(handle.options(stream=True).messages.remote(body))  # its prompt is cached now
    events = list(handle.options(stream=True).messages.remote(body))
    assert events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop"
    # message_start carries the prompt's cached / computed split, as over HTTP (the first event read before it)
    start, delta = events[0]["message"]["usage"], next(e for e in events if e["type"] == "message_delta")["usage"]
    assert start["cache_read_input_tokens"] > 0
    assert (start["input_tokens"], start["cache_read_input_tokens"]) == (delta["input_tokens"],
                                                                         delta["cache_read_input_tokens"])
    whole = list(handle.options(stream=True).chat.remote({"messages": USER, "max_tokens": 6}))
    assert len(whole) == 1 and whole[0]["object"] == "chat.completion" and whole[0]["usage"]["completion_tokens"] >= 1
    message = list(handle.options(stream=True).messages.remote({"messages": USER, "max_tokens": 6}))
    assert len(message) == 1 and message[0]["type"] == "message"


def test_model_info_exposes_the_measured_quality_table(served):
    info = httpx.get(f"{served.url}/v1/model_info", headers={"x-api-key": API_KEY}, timeout=30).json()
    rows = info["quality"]["rows"]
    assert info["model_config"]["model_type"] == "qwen3_5_text" and info["weights"]["format"] == "bf16"
    ref = [r for r in rows if r["weights"] == "bf16" and r["kv_mode"] == "16/16" and r["context"] == 32768]
    assert ref and ref[0]["kl"] == 0 and ref[0]["top1"] == 100
    tiny = [r for r in rows if r["weights"] == "tiny" and r["kv_mode"] == "16/16" and r["context"] == 32768][0]
    assert tiny["kl"] > 0 and tiny["bytes"] < ref[0]["bytes"]
    serving = info["serving"]  # the served fixture's own settings, given: no pool fitted to a device
    assert serving["num_pages"] == 48 and serving["page_size"] == 16 and serving["kv_pool"] is None
    # 768 asked; one conversation gets 47 of the 48 pages (the prefix cache's spare): the served context is 752
    assert serving["backend"] == "numpy" and serving["max_model_len"] == 752 and serving["max_slots"] == 12


def test_metrics_are_prometheus_text(served):
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{served.url}/metrics", headers={"x-api-key": API_KEY}, timeout=30).text
    names = {f.name for f in text_string_to_metric_families(text)}
    assert any("generated_tokens" in n for n in names)
    # the in-process client's uptime name under Ray too, and the tiers' stats by tier and field
    assert "decapybara_uptime_seconds" in names and "decapybara_uptime_s" not in names and "decapybara_tiers" in names


def test_locust_thirty_agents_headless(served, tmp_path):
    cmd = [sys.executable, "-m", "locust", "-f", str(ROOT / "loadtests" / "locustfile.py"), "--headless",
           "-u", "30", "-r", "15", "-t", "25s", "--host", served.url, "--csv", str(tmp_path / "run"),
           "--only-summary", "--stop-timeout", "30"]
    env = {"DECAPYBARA_API_KEY": API_KEY, "DECAPYBARA_MAX_TOKENS": "24", "DECAPYBARA_TURNS": "4",
           "PATH": "/usr/bin:/bin"}
    import os

    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=240)
    rows = (tmp_path / "run_stats.csv").read_text().splitlines()
    by_name = {r.split(",")[1]: r.split(",") for r in rows[1:]}
    assert "TTFT" in by_name and "ITL" in by_name and "tokens" in by_name, proc.stdout[-2000:]
    names = ("openai chat", "anthropic messages", "openai responses")
    failures = sum(int(r[3]) for name, r in by_name.items() if name in names)
    requests = sum(int(r[2]) for name, r in by_name.items() if name in names)
    assert requests >= 30 and failures == 0, proc.stdout[-2000:]
    assert all(int(by_name[name][2]) > 0 for name in names), by_name  # every API's agents took turns


def test_serve_run_default_app_answers_with_the_demo_model(served, ray_cluster, tmp_path):
    """`serve run serve_app:app` (all defaults: the embedded demo model, no network), deployed beside the test
    app under its own route prefix on the session's Ray, answers a chat request, and answers it again the same
    after its GPU actor and then its scheduler actor are killed."""
    import os
    from pathlib import Path

    log = tmp_path / "default.log"
    cmd = [str(Path(sys.executable).parent / "serve"), "run", "--address", ray_cluster, "--non-blocking",
           "--name", "default", "--route-prefix", "/demo", "serve_app:app"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with log.open("w") as fh:
        assert subprocess.run(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT, timeout=300).returncode == 0
    r = httpx.post(f"{served.url}/demo/v1/chat/completions", timeout=120, json={
        "model": "decapybara", "max_tokens": 24, "temperature": 0,
        "messages": [{"role": "user", "content": "Write a Python function `is_even(n)`"}]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"].strip()

    # The engine dies mid-stream: the stream ends with an error, nothing hangs, and a new GPU actor takes its place:
    # /health says so meanwhile, and then the same greedy request gets the same answer.
    import ray
    from ray import serve

    greedy = {"model": "decapybara", "max_tokens": 24, "temperature": 0,
              "messages": [{"role": "user", "content": "Write a Python function `is_even(n)`"}]}
    answer = r.json()["choices"][0]["message"]["content"]
    body = {"model": "m", "max_tokens": 600, "stream": True, "temperature": 0.9,
            "messages": [{"role": "user", "content": "Write a long Python module."}]}
    t0 = time.time()
    with httpx.stream("POST", f"{served.url}/demo/v1/chat/completions", json=body, timeout=120) as stream:
        lines = stream.iter_lines()
        next(lines)
        ray.kill(ray.get_actor("decapybara-gpu"))
        rest = "\n".join(lines)
    assert '"error"' in rest and time.time() - t0 < 90
    _served_again(f"{served.url}/demo", greedy, answer, restarts=1)

    # The scheduler actor dies (and the GPU and tier actors it owns with it): Serve's health check replaces the
    # ingress replica, whose start makes new actors. A response it stored outlives it: its journal was written
    # behind into the disk tier's folder (`responses_flush_s`), which the new scheduler actor reads at its start.
    oa = openai.OpenAI(base_url=f"{served.url}/demo/v1", api_key="none", max_retries=0, timeout=120)
    stored = oa.responses.create(model="m", input="Name a Python builtin.", max_output_tokens=6, temperature=0)
    deadline = time.time() + 30
    while httpx.get(f"{served.url}/demo/stats", timeout=30).json()["responses_store"]["journal"]["lines"] < 1:
        assert time.time() < deadline, "the journal was not written"
        time.sleep(0.2)
    ray.kill(ray.get_actor("decapybara-scheduler"))
    _served_again(f"{served.url}/demo", greedy, answer, restarts=0)
    assert oa.responses.retrieve(stored.id).model_dump() == stored.model_dump()
    nxt = oa.responses.create(model="m", previous_response_id=stored.id, input="Another?", max_output_tokens=4)
    assert nxt.usage.input_tokens > stored.usage.input_tokens
    serve.delete("default")  # its scheduler actor, owned by the ingress replica, goes with it


def _served_again(url: str, greedy: dict, answer: str, restarts: int, within_s: float = 120.0) -> None:
    """Wait for `url`'s /health to say ok (its engine restarted `restarts` times), then the greedy request must
    get `answer`."""
    deadline = time.time() + within_s
    while True:
        try:
            h = httpx.get(f"{url}/health", timeout=10)
            if h.status_code == 200:
                break
            assert h.status_code == 503 and h.json()["status"] == "unavailable" and h.json()["reason"]
        except httpx.HTTPError:
            pass
        assert time.time() < deadline, "not served again"
        time.sleep(0.5)
    assert h.json() == {"status": "ok", "reason": None, "engine_restarts": restarts}
    again = httpx.post(f"{url}/v1/chat/completions", timeout=120, json=greedy)
    assert again.status_code == 200 and again.json()["choices"][0]["message"]["content"] == answer


def test_serve_run_with_mtp_speculation_answers_as_without(served, ray_cluster, tmp_path, local, oai):
    """`serve run serve_app:build_app speculator=mtp` beside the test app: the openai SDK's greedy answers, plain
    and streamed, and a seeded sampled one are the in-process engine's without speculation; /stats counts the
    drafts its decodes verified."""
    import os
    from pathlib import Path

    from decapybara.config import EngineConfig
    from decapybara.engine.engine import Engine
    from decapybara.engine.sampling import SamplingParams

    log = tmp_path / "spec.log"
    cmd = [str(Path(sys.executable).parent / "serve"), "run", "--address", ray_cluster, "--non-blocking",
           "--name", "spec", "--route-prefix", "/spec", "serve_app:build_app", "speculator=mtp", "spec_adaptive=false", "name=spec",
           "max_model_len=1024", "ram_cache_gb=0.1"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with log.open("w") as fh:
        assert subprocess.run(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT, timeout=300).returncode == 0
    try:
        client = openai.OpenAI(base_url=f"{served.url}/spec/v1", api_key="none", max_retries=0, timeout=120)
        prompt = local.tokenizer.encode("import os\n\ndef list_python_files(root):\n")
        engine = Engine(local.model, EngineConfig(loop_guard="off"), tokenizer=local.tokenizer)
        greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        hot = SamplingParams(temperature=0.8, seed=9, max_tokens=40, ignore_eos=True)
        want, want_hot = engine.generate([prompt, prompt], [greedy, hot])
        r = client.completions.create(model="m", prompt=prompt, max_tokens=40, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].text == local.tokenizer.decode(want) and r.usage.completion_tokens == 40
        text = "".join(c.choices[0].text for c in client.completions.create(
            model="m", prompt=prompt, max_tokens=40, temperature=0, stream=True,
            extra_body={"ignore_eos": True}) if c.choices)
        assert text == local.tokenizer.decode(want)
        r = client.completions.create(model="m", prompt=prompt, max_tokens=40, temperature=0.8, seed=9,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].text == local.tokenizer.decode(want_hot)
        s = httpx.get(f"{served.url}/spec/stats", timeout=30).json()
        assert s["accepted_tokens"] > 0 and s["drafted_tokens"] >= s["accepted_tokens"], s
        assert "drafted_tokens" not in stats(served) or stats(served)["drafted_tokens"] == 0  # the test app: off
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{served.url}/spec/metrics", timeout=30).text
        accepted = {m.name: m.value for f in text_string_to_metric_families(text) for m in f.samples}
        assert accepted["decapybara_accepted_tokens_total"] == s["accepted_tokens"] > 0
    finally:
        from ray import serve

        serve.delete("spec")


def test_a_restarted_server_restores_the_prefix_cache_its_predecessor_saved(served, ray_cluster, tmp_path):
    """A graceful stop (`serve.delete`, as Ctrl-C of `serve run` does) saves the engine's prefix cache to the disk
    tier; a server started on the same `disk_cache` reads a repeated conversation's prompt from it (the openai SDK's
    cached tokens) and answers it as the first server did, and holds the first server's stored responses."""
    import os
    from pathlib import Path

    from ray import serve

    def start(name: str) -> None:
        cmd = [str(Path(sys.executable).parent / "serve"), "run", "--address", ray_cluster, "--non-blocking",
               "--name", "warm", "--route-prefix", "/warm", "serve_app:build_app", f"name={name}",
               f"disk_cache={tmp_path / 'kv'}", "ram_cache_gb=0.1", "disk_cache_gb=0.5", "page_size=16",
               "max_model_len=1024", "save_cache_s=20"]
        with (tmp_path / f"{name}.log").open("w") as fh:
            assert subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=fh,
                                  stderr=subprocess.STDOUT, timeout=300).returncode == 0

    client = openai.OpenAI(base_url=f"{served.url}/warm/v1", api_key="none", max_retries=0, timeout=120)
    system = "You review Python code for a team of agents. " * 12
    messages = [{"role": "system", "content": system}, *USER]
    start("warm1")
    try:
        first = client.chat.completions.create(model="m", messages=messages, max_tokens=16, temperature=0)
        assert first.usage.prompt_tokens > 160 and first.usage.prompt_tokens_details.cached_tokens == 0
        stored = client.responses.create(model="m", input="Review utils.py.", max_output_tokens=8, temperature=0)
    finally:
        serve.delete("warm")  # graceful: the ingress saves the prefix cache (and stored responses) before its actors go
    start("warm2")
    try:
        again = client.chat.completions.create(model="m", messages=messages, max_tokens=16, temperature=0)
        assert again.choices[0].message.content == first.choices[0].message.content
        cached = again.usage.prompt_tokens_details.cached_tokens
        assert cached >= (first.usage.prompt_tokens // 16 - 1) * 16, (cached, first.usage.prompt_tokens)
        s = httpx.get(f"{served.url}/warm/stats", timeout=30).json()
        assert s["restored_pages"] >= cached // 16 and s["computed_prompt_tokens"] == again.usage.prompt_tokens - cached
        assert client.responses.retrieve(stored.id).model_dump() == stored.model_dump()  # saved, read back
        nxt = client.responses.create(model="m", previous_response_id=stored.id, input="And tests?",
                                      max_output_tokens=4, temperature=0)
        assert nxt.usage.input_tokens > stored.usage.input_tokens
    finally:
        serve.delete("warm")
