"""The Anthropic Messages mapping at the function level: requests planned on the test tokenizer, replies built
from scripted engine events (no engine, no HTTP)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from decapybara.api import anthropic_api
from decapybara.api import anthropic_schemas as an
from decapybara.api.common import Collected
from decapybara.engine.sequence import FinishReason, TokenEvent
from decapybara.testing import make_tokenizer_json
from decapybara.tokenizer import Tokenizer

TOK = Tokenizer.from_json(make_tokenizer_json())


@dataclass
class FakeClient:
    tokenizer: Tokenizer = TOK
    max_model_len: int = 4096
    vocab_size: int = TOK.vocab_size


def plan(**body):
    req = an.MessagesRequest.model_validate({"model": "m", "max_tokens": 64, **body})
    return anthropic_api.plan_message(req, FakeClient(), "m", None)


def reply(p, *texts, reason=FinishReason.STOP, stop_string=None):
    """(the whole message, the stream's event data) of a reply written as `texts` deltas."""
    done = Collected()
    events = []
    for i, text in enumerate(texts):
        last = i == len(texts) - 1
        ev = TokenEvent(p.request.request_id, [1], text, finish_reason=reason if last else None,
                        stop_string=stop_string if last else None, num_prompt_tokens=len(p.prompt.ids),
                        num_output_tokens=i + 1)
        done.add(ev)
        events.append(ev)
    stream = anthropic_api.MessageStream(p)
    lines = stream.start(events[0])
    for ev in events:
        lines += stream.event(ev)
    lines += stream.end(events[-1])
    data = [json.loads(line.split("\n")[1].removeprefix("data: ")) for line in lines]
    return anthropic_api.message(p, done).dump(), data


def streamed_text(data):
    return "".join(e["delta"].get("text", "") for e in data if e["type"] == "content_block_delta")


def test_a_prefill_is_continued_as_written():
    """A trailing assistant message is a prefill: the reply is its continuation, leading whitespace included, so
    that prefill + reply is the text the model wrote."""
    p = plan(messages=[{"role": "user", "content": "What is six times seven?"},
                       {"role": "assistant", "content": "The answer is"}])
    whole, data = reply(p, " 42", ".")
    assert whole["content"] == [{"type": "text", "text": " 42."}]
    assert streamed_text(data) == " 42."


def test_a_prompt_past_the_context_is_reported_as_anthropic_words_it():
    """Anthropic clients tell a context overflow (to compact the conversation and retry) by its message, "prompt
    is too long: ...": the 400 says so, its details kept."""
    from decapybara.api.errors import to_api_error
    from decapybara.errors import ContextOverflowError

    req = an.MessagesRequest.model_validate({"model": "m", "max_tokens": 8, "messages": [
        {"role": "user", "content": "word " * 200}]})
    with pytest.raises(ContextOverflowError) as exc:
        anthropic_api.plan_message(req, FakeClient(max_model_len=64), "m", None)
    err = to_api_error(exc.value)
    assert err.anthropic_status() == 400
    body = err.anthropic_body()
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith("prompt is too long: ")
    assert "context of 64 tokens" in body["error"]["message"]
    assert err.openai_body()["error"]["message"] == str(exc.value)  # the OpenAI shape keeps its own words


def test_xml_calls_are_tool_use_blocks_whole_and_streamed():
    """Under a template that writes XML calls (Qwen3.5 / 3.6): tool_choice any / tool / auto constrain calls in that
    form; the model's XML call is a tool_use block whose input is read by the tool's schema, streamed as one
    input_json_delta in chunks of any size, stop_reason "tool_use"; sent back as a tool_use block it renders to the
    text the model wrote."""
    from decapybara.testing import XML_CHAT_TEMPLATE

    tok = Tokenizer.from_json(make_tokenizer_json(), chat_template=XML_CHAT_TEMPLATE)
    client = FakeClient(tokenizer=tok)
    tools = [{"name": "run", "input_schema": {"type": "object", "properties": {
        "command": {"type": "string"}, "timeout": {"type": "integer"}, "quiet": {"type": "boolean"}},
        "required": ["command"]}}]
    messages = [{"role": "user", "content": "List the files."}]

    def xml_plan(**body):
        req = an.MessagesRequest.model_validate({"model": "m", "max_tokens": 64, "messages": messages,
                                                 "tools": tools, **body})
        return anthropic_api.plan_message(req, client, "m", None)

    for choice, lazy in (({"type": "any"}, False), ({"type": "tool", "name": "run"}, False),
                         ({"type": "auto"}, True)):
        params = xml_plan(tool_choice=choice).request.params
        assert json.loads(params.tool_calls)["format"] == "xml" and params.lazy_tool_calls == lazy
    p = xml_plan()
    text = ("Listing.\n\n<tool_call>\n<function=run>\n<parameter=command>\nls -l | grep '<x>'\n</parameter>\n"
            "<parameter=timeout>\n30\n</parameter>\n<parameter=quiet>\nfalse\n</parameter>\n</function>\n</tool_call>")
    args = {"command": "ls -l | grep '<x>'", "timeout": 30, "quiet": False}
    for size in (1, 3, len(text)):
        whole, data = reply(p, *[text[i:i + size] for i in range(0, len(text), size)])
        assert whole["stop_reason"] == "tool_use"
        assert [b["type"] for b in whole["content"]] == ["text", "tool_use"]
        assert whole["content"][1]["name"] == "run" and whole["content"][1]["input"] == args
        partial = [e["delta"]["partial_json"] for e in data if e["type"] == "content_block_delta"
                   and e["delta"]["type"] == "input_json_delta"]
        assert json.loads("".join(partial)) == args and streamed_text(data) == "Listing."
    follow = [*messages, {"role": "assistant", "content": whole["content"]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": whole["content"][1]["id"],
                                            "content": "a.py"}]}]
    req = an.MessagesRequest.model_validate({"model": "m", "max_tokens": 64, "messages": follow, "tools": tools})
    again = anthropic_api.plan_message(req, client, "m", None)
    # (the empty think block of a reply without thinking is the template's to drop; the reply's text stays whole)
    assert p.prompt.text.endswith("<think>\n\n</think>\n\n")
    history = p.prompt.text.removesuffix("<think>\n\n</think>\n\n")
    assert again.prompt.text.startswith(history + text + "<|im_end|>\n"), again.prompt.text
