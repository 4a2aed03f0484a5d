"""OpenAI's Responses API (/v1/responses) through the openai SDK against the live app of test_api (its scripted
engine): plain text, a conversation of input items with calls and their outputs, tools, reasoning items, the
typed stream against the whole response, structured outputs, the incomplete status, and bad input."""

from __future__ import annotations

import json
import os
import time

import httpx
import openai
import pytest
from pydantic import BaseModel
from test_api import SCRIPTS, TOOLS_OA, _post, stack  # noqa: F401  (the module's live app)

TOOLS_R = [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
            "parameters": t["function"]["parameters"]} for t in TOOLS_OA]


def kinds(response) -> list[str]:
    return [item.type for item in response.output]


def test_a_plain_reply_is_one_message(stack):  # noqa: F811
    r = stack.oa().responses.create(model="m", input="SAY-STOP please", max_output_tokens=40,
                                    reasoning={"effort": "none"})
    assert r.status == "completed" and kinds(r) == ["message"]
    assert r.output_text == SCRIPTS["SAY-STOP"] and r.output[0].content[0].type == "output_text"
    assert r.usage.output_tokens > 0 and r.usage.input_tokens == r.usage.total_tokens - r.usage.output_tokens
    assert r.id.startswith("resp_") and r.object == "response" and r.store is True


def test_reasoning_text_and_a_call_are_three_items_in_the_models_order(stack):  # noqa: F811
    """The scripted reply thinks, says a sentence and calls the tool: a reasoning item, a message, a
    function_call with its call id and JSON arguments."""
    r = stack.oa().responses.create(model="m", input="CALL-THE-TOOL: weather in Paris?", tools=TOOLS_R,
                                    max_output_tokens=80)
    assert kinds(r) == ["reasoning", "message", "function_call"], r.output
    assert r.output[0].content[0].text == "The user wants the weather."
    assert r.output_text.strip() == "Let me check."
    call = r.output[2]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_") and r.usage.output_tokens_details.reasoning_tokens > 0


def test_a_conversation_of_items_renders_as_the_chat_it_is(stack):  # noqa: F811
    """instructions, a user message, the assistant's reasoning, call and the call's output, and the next user
    turn render as the chat template renders that conversation (the tool result inside the user turn)."""
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Weather in Oslo?"}]},
             {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Call it."}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 C"},
             {"role": "developer", "content": "Answer in one word."},
             {"role": "user", "content": "And now SAY-STOP"}]
    r = stack.oa().responses.create(model="m", input=items, instructions="You are terse.", tools=TOOLS_R,
                                    max_output_tokens=30)
    prompt = stack.prompt(r.id)
    assert prompt.startswith("<|im_start|>system\nYou are terse.")
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in prompt
    assert "<tool_response>\nSunny, 21 C\n</tool_response>" in prompt
    assert r.output_text == SCRIPTS["SAY-STOP"]


def test_the_stream_builds_the_response_the_whole_reply_is(stack):  # noqa: F811
    """The typed events, numbered in order, give (through the SDK's stream helper) the response a non-streaming
    request gets: the same items, texts and arguments; deltas add up to each item's text."""
    kw = {"model": "m", "input": "CALL-THE-TOOL: weather in Paris?", "tools": TOOLS_R, "max_output_tokens": 80}
    whole = stack.oa().responses.create(**kw)
    with stack.oa().responses.stream(**kw) as s:
        events = list(s)
        final = s.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert kinds(final) == kinds(whole)
    assert [getattr(i, "arguments", None) for i in final.output] == [getattr(i, "arguments", None)
                                                                      for i in whole.output]
    assert final.output_text == whole.output_text and final.output[0].content[0].text == "The user wants the weather."
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text


def test_a_required_call_and_a_schemas_answer(stack):  # noqa: F811
    r = stack.oa().responses.create(model="m", input="TWO-CALLS", tools=TOOLS_R, tool_choice="required",
                                    max_output_tokens=80, reasoning={"effort": "none"})
    assert [json.loads(i.arguments)["city"] for i in r.output if i.type == "function_call"] == ["Rome", "Oslo"]
    r = stack.oa().responses.create(model="m", input="TWO-CALLS", tools=TOOLS_R, parallel_tool_calls=False,
                                    tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=80,
                                    reasoning={"effort": "none"})
    assert [json.loads(i.arguments)["city"] for i in r.output if i.type == "function_call"] == ["Rome"]

    class Trip(BaseModel):
        city: str
        days: list[float | bool]

    p = stack.oa().responses.parse(model="m", input="JSON-REPLY", text_format=Trip, max_output_tokens=60,
                                   reasoning={"effort": "none"})
    assert p.output_parsed == Trip(city="Rome", days=[1, 2.5, True])


def test_a_reply_cut_by_max_output_tokens_is_incomplete(stack):  # noqa: F811
    r = stack.oa().responses.create(model="m", input="KEEP-TALKING", max_output_tokens=8,
                                    reasoning={"effort": "none"})
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 8
    with stack.oa().responses.stream(model="m", input="KEEP-TALKING", max_output_tokens=8,
                                     reasoning={"effort": "none"}) as s:
        events = list(s)
    assert events[-1].type == "response.incomplete"


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input.0.content"),
    ({"input": [{"type": "file_search_call", "id": "x"}]}, "input.0.type"),
    ({"input": []}, "input"),
    ({"input": "x", "tools": TOOLS_R, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "r", "schema": {"type": "string",
                                                                                      "pattern": "(a)\\1"}}}},
     "text.format.schema"),
])
def test_bad_input_is_a_400_naming_the_field(stack, body, param):  # noqa: F811
    r = _post(stack.url + "/v1/responses", {"model": "m", **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    with pytest.raises(openai.BadRequestError):
        stack.oa().responses.create(model="m", **body)


def test_instructions_and_developer_items_are_one_system_turn_for_a_strict_template():
    """Codex-style input (instructions, a developer item, the user's) makes one system turn first; a developer
    item later in the conversation folds into it where the template takes one system message, first."""
    from types import SimpleNamespace

    from test_api import make_tokenizer_json

    from decapybara.api import openai_responses as orr
    from decapybara.api import responses_schemas as rs
    from decapybara.chat import default_chat_template
    from decapybara.tokenizer import Tokenizer

    strict = ("{%- for m in messages %}{%- if m.role == 'system' and not loop.first %}"
              "{{ raise_exception('System message must be at the beginning.') }}{%- endif %}{%- endfor %}"
              + default_chat_template())
    client = SimpleNamespace(tokenizer=Tokenizer.from_json(make_tokenizer_json(), chat_template=strict),
                             max_model_len=4096, vocab_size=8192)
    body = rs.ResponsesRequest.model_validate({"instructions": "Be terse.", "input": [
        {"role": "developer", "content": "Use tools."}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello."}, {"role": "developer", "content": "Now in French."},
        {"role": "user", "content": "again"}]})
    assert [m["role"] for m in orr.input_messages(body)] == ["system", "user", "assistant", "system", "user"]
    plan = orr.plan_response(body, client, "m", None)
    head = plan.prompt.text[:plan.prompt.text.index("<|im_start|>user")]
    assert head.count("<|im_start|>system") == 1 and "Be terse.\n\nUse tools.\n\nNow in French." in head


def test_a_calls_arguments_reach_the_template_as_the_object_they_are():
    """A function_call item's arguments (a JSON string, as the API sends them) reach the chat template as the
    object, as chat completions' tool_calls do: templates read them as a mapping (Qwen3.5's XML calls,
    ``tool_call.arguments|items``), which a string broke (a 400 for every conversation holding a call). A string
    that is no JSON object is passed on as it is, one nested past the parser's depth too (no 500)."""
    from types import SimpleNamespace

    from test_api import make_tokenizer_json

    from decapybara.api import openai_responses as orr
    from decapybara.api import responses_schemas as rs
    from decapybara.tokenizer import Tokenizer

    xml_calls = ("{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
                 "{%- for tc in m.tool_calls or [] %}<tool_call>\n<function={{ tc.function.name }}>\n"
                 "{%- for k, v in tc.function.arguments|items %}<parameter={{ k }}>\n{{ v }}\n</parameter>\n"
                 "{%- endfor %}</function>\n</tool_call>{%- endfor %}<|im_end|>\n{%- endfor %}"
                 "<|im_start|>assistant\n")
    client = SimpleNamespace(tokenizer=Tokenizer.from_json(make_tokenizer_json(), chat_template=xml_calls),
                             max_model_len=4096, vocab_size=8192)
    items = [{"role": "user", "content": "Weather in Oslo?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"}]
    plan = orr.plan_response(rs.ResponsesRequest.model_validate({"input": items}), client, "m", None)
    assert "<function=get_weather><parameter=city>\nOslo\n</parameter></function>" in plan.prompt.text
    for arguments in ("not json", "[1, 2]", "[" * 100_000):
        body = rs.ResponsesRequest.model_validate({"input": [{**items[1], "arguments": arguments}]})
        assert orr.input_messages(body)[0]["tool_calls"][0]["function"]["arguments"] == arguments


def test_reasoning_goes_with_the_next_assistant_turn_only():
    from decapybara.api import openai_responses as orr
    from decapybara.api import responses_schemas as rs

    r1 = {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "R1"}]}
    body = rs.ResponsesRequest.model_validate({"input": [
        {"role": "user", "content": "q1"}, r1, {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "A2"}, r1, {"role": "assistant", "content": "A3"}]})
    msgs = orr.input_messages(body)
    assert "reasoning_content" not in msgs[2] and msgs[3]["reasoning_content"] == "R1"


def test_tool_choice_forms_and_stored_state(stack):  # noqa: F811
    """allowed_tools offers only the tools it lists (under its mode), chat completions' named form names a
    function; conversations, background runs and stored prompts are 400s naming the field."""
    tools = [*TOOLS_R, {"type": "function", "name": "other", "parameters": {"type": "object"}}]
    r = stack.oa().responses.create(model="m", input="hi", tools=tools, max_output_tokens=4, tool_choice={
        "type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "other"}]})
    prompt = stack.prompt(r.id)
    assert '"name": "other"' in prompt and '"name": "get_weather"' not in prompt
    r = stack.oa().responses.create(model="m", input="TWO-CALLS", tools=TOOLS_R, max_output_tokens=80,
                                    parallel_tool_calls=False, reasoning={"effort": "none"},
                                    tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert [i.type for i in r.output] == ["function_call"]
    for extra, param in [({"conversation": "conv_1"}, "conversation"), ({"prompt": {"id": "pmpt_1"}}, "prompt"),
                         ({"tool_choice": {"type": "mcp"}, "tools": TOOLS_R}, "tool_choice"),
                         ({"input": [{"type": "function_call_output", "call_id": "c",
                                      "output": [{"type": "input_image"}]}]}, "input.0.output")]:
        r = _post(stack.url + "/v1/responses", {"model": "m", "input": "x", **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_cut_item_is_incomplete_and_a_failed_stream_says_so(stack):  # noqa: F811
    """The item max_output_tokens cut is "incomplete" (whole or streamed); a stream that fails after its headers
    ends with a numbered error event and response.failed."""
    from decapybara.api import openai_responses as orr
    from decapybara.api.errors import ApiError

    r = stack.oa().responses.create(model="m", input="KEEP-TALKING", max_output_tokens=8,
                                    reasoning={"effort": "none"})
    assert r.output[-1].status == "incomplete"
    with stack.oa().responses.stream(model="m", input="KEEP-TALKING", max_output_tokens=8,
                                     reasoning={"effort": "none"}) as s:
        events = list(s)
    assert events[-1].response.output[-1].status == "incomplete"
    body = orr.rs.ResponsesRequest.model_validate({"input": "hi"})
    plan = orr.plan_response(body, stack.client, "m", None)
    plan.keep = lambda record: True  # a server that stores responses: a failed one still is not stored
    stream = orr.ResponseStream(plan, stack.client.tokenizer)
    lines = stream.start(None) + stream.error(ApiError(503, "the request was cancelled by the server"))
    events = [json.loads(line.split("data: ", 1)[1]) for line in lines]
    assert [e["sequence_number"] for e in events] == [0, 1, 2, 3]
    assert events[2]["type"] == "error" and events[2]["message"] == "the request was cancelled by the server"
    assert events[3]["type"] == "response.failed" and events[3]["response"]["status"] == "failed"
    assert events[3]["response"]["store"] is False
    assert events[3]["response"]["error"]["message"] == "the request was cancelled by the server"


def test_reasoning_comes_back_through_encrypted_content(stack):  # noqa: F811
    """A stateless client (store false, include reasoning.encrypted_content) that sends reasoning back only as
    encrypted_content: the next turn's prompt holds that reasoning where the model wrote it, so it renders as the
    turn before did (without include, no encrypted_content is written)."""
    kw = {"model": "m", "input": "CALL-THE-TOOL: weather in Paris?", "tools": TOOLS_R, "max_output_tokens": 80}
    plain = stack.oa().responses.create(**kw)
    assert plain.output[0].encrypted_content is None
    r = stack.oa().responses.create(**kw, include=["reasoning.encrypted_content"], store=False)
    reasoning, _, call = r.output
    assert reasoning.encrypted_content == "The user wants the weather."
    with stack.oa().responses.stream(**kw, include=["reasoning.encrypted_content"]) as s:
        assert s.get_final_response().output[0].encrypted_content == "The user wants the weather."
    back = [{"role": "user", "content": "CALL-THE-TOOL: weather in Paris?"},
            {"type": "reasoning", "id": reasoning.id, "summary": [], "encrypted_content": reasoning.encrypted_content},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}]
    nxt = stack.oa().responses.create(model="m", input=back, tools=TOOLS_R, max_output_tokens=4)
    assert "<think>\nThe user wants the weather.\n</think>" in stack.prompt(nxt.id)


def test_answer_tokens_carry_their_logprobs_whole_or_streamed(stack):  # noqa: F811
    """include message.output_text.logprobs (top_logprobs 2): the message's part holds one entry per answer
    token, whose bytes are its text's with the whitespace the parser trims around it (the reasoning, the call,
    their tags and the end token have none); the stream's text deltas carry the same entries, each delta its own
    tokens'; a request without include gets none.
    A reply without reasoning has the entries chat completions gives its tokens, less the end token."""
    kw = {"model": "m", "input": "CALL-THE-TOOL: weather in Paris?", "tools": TOOLS_R, "max_output_tokens": 80}
    assert stack.oa().responses.create(**kw).output[1].content[0].logprobs == []
    r = stack.oa().responses.create(**kw, include=["message.output_text.logprobs"], top_logprobs=2)
    assert kinds(r) == ["reasoning", "message", "function_call"]
    part = r.output[1].content[0]
    joined = b"".join(bytes(e.bytes) for e in part.logprobs).decode()
    assert joined != joined.strip() and joined.strip() == part.text == "Let me check."
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.logprob - 1e-6 for e in part.logprobs)
    with stack.oa().responses.stream(**kw, include=["message.output_text.logprobs"], top_logprobs=2) as s:
        events = list(s)
        final = s.get_final_response()
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    for d in deltas:
        assert b"".join(bytes(e.bytes) for e in d.logprobs).decode().strip() == d.delta.strip()
    streamed = [e.model_dump() for d in deltas for e in d.logprobs]
    assert streamed == [e.model_dump() for e in final.output[1].content[0].logprobs]
    assert streamed == [e.model_dump() for e in part.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert [e.model_dump() for e in done.logprobs] == streamed

    plain = {"model": "m", "input": "SAY-STOP please", "max_output_tokens": 40, "reasoning": {"effort": "none"}}
    r = stack.oa().responses.create(**plain, top_logprobs=3)  # top_logprobs alone asks for them too
    chat = stack.oa().chat.completions.create(model="m", messages=[{"role": "user", "content": "SAY-STOP please"}],
                                              max_tokens=40, logprobs=True, top_logprobs=3,
                                              extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    want = [(lp.token, lp.logprob, lp.bytes) for lp in chat.choices[0].logprobs.content
            if bytes(lp.bytes) != b"<|im_end|>"]
    assert [(e.token, e.logprob, e.bytes) for e in r.output[0].content[0].logprobs] == want


def test_answer_tokens_follow_the_tags_forced_ones_too():
    """`AnswerTokens`: entries for the tokens outside the reasoning and the calls; a forced tag (the LoopGuard's
    end of thinking) moves the reading though it has no entry of its own."""
    from decapybara.api.openai_responses import AnswerTokens
    from decapybara.testing import make_tokenizer_json
    from decapybara.tokenizer import Tokenizer

    tok = Tokenizer.from_json(make_tokenizer_json())
    sp = tok.special_ids
    a, b, c = tok.encode(" alpha beta gamma")[:3]
    reader = AnswerTokens(tok, opens_reasoning=True, tools=True)
    assert reader.entries([a, sp.end_think], [-0.5], [[]]) == []  # thinking; the forced close has no entry
    got = reader.entries([b, sp.tool_call, c, sp.end_tool_call, a, sp.im_end], [-1.0] * 6, [[(a, -0.1)]] * 6)
    assert [(e["token"], e["logprob"]) for e in got] == [(tok.decode([b]), -1.0), (tok.decode([a]), -1.0)]
    assert got[0]["top_logprobs"] == [{"token": tok.decode([a]), "logprob": -0.1, "bytes": list(tok.token_bytes(a))}]
    plain = AnswerTokens(tok, opens_reasoning=False, tools=False)  # no tools: call markup is the answer's text
    got = plain.entries([b, sp.tool_call, c, sp.end_tool_call, sp.im_end], [-1.0] * 5, [])
    assert [e["token"] for e in got] == [tok.decode([t]) for t in (b, sp.tool_call, c, sp.end_tool_call)]


# ---------------------------------------------------------------------------------------------- stored responses


def test_previous_response_id_continues_the_stored_conversation(stack):  # noqa: F811
    """A turn sent as previous_response_id plus its new items renders the prompt the whole conversation sent as
    items renders (the earlier turn's input, then its output items: reasoning, text and call), so the prefix
    cache serves the earlier turns; instructions are not carried over, tools are sent again."""
    first = stack.oa().responses.create(model="m", input="CALL-THE-TOOL: weather in Paris?", tools=TOOLS_R,
                                        instructions="Be brief.", max_output_tokens=80)
    assert first.store is True and first.previous_response_id is None
    call = first.output[-1]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}
    chained = stack.oa().responses.create(model="m", previous_response_id=first.id, input=[result],
                                          tools=TOOLS_R, instructions="Be brief.", max_output_tokens=30)
    assert chained.previous_response_id == first.id and chained.store is True
    whole = [{"role": "user", "content": "CALL-THE-TOOL: weather in Paris?"},
             *[item.model_dump(exclude_none=True) for item in first.output], result]
    sent_whole = stack.oa().responses.create(model="m", input=whole, tools=TOOLS_R, instructions="Be brief.",
                                             max_output_tokens=30, store=False)
    assert stack.prompt(chained.id) == stack.prompt(sent_whole.id)
    assert "<tool_response>\nSunny, 21 C\n</tool_response>" in stack.prompt(chained.id)
    assert chained.usage.input_tokens_details.cached_tokens >= 16
    # the usage as the SDK's own model reads it strictly (`cache_write_tokens` is required there)
    from openai.types.responses.response_usage import ResponseUsage
    strict = ResponseUsage.model_validate(chained.usage.model_dump(), strict=True)
    assert strict.input_tokens_details.cache_write_tokens == 0
    # a third turn through two stored ones; another turn's instructions are its own
    third = stack.oa().responses.create(model="m", previous_response_id=chained.id, input="And now SAY-STOP",
                                        max_output_tokens=30)
    prompt = stack.prompt(third.id)
    assert "Be brief." not in prompt and "Sunny, 21 C" in prompt and "CALL-THE-TOOL" in prompt
    assert third.output_text == SCRIPTS["SAY-STOP"]


def test_stored_responses_retrieved_listed_and_deleted(stack):  # noqa: F811
    """retrieve gives the response as it was returned (streamed ones too), input_items lists the items a response
    was made from (newest first by default, pages through `after`), delete forgets it: a later retrieve is a
    404 and a turn continuing it a 400 naming previous_response_id; store false keeps nothing."""
    oa = stack.oa()
    first = oa.responses.create(model="m", input="CALL-THE-TOOL: weather in Paris?", tools=TOOLS_R,
                                max_output_tokens=80)
    assert oa.responses.retrieve(first.id).model_dump() == first.model_dump()
    with oa.responses.stream(model="m", previous_response_id=first.id, max_output_tokens=30, input=[
            {"type": "function_call_output", "call_id": first.output[-1].call_id, "output": "Rain"}]) as s:
        streamed = list(s)[-1].response  # completed, or incomplete at max_output_tokens
    assert oa.responses.retrieve(streamed.id).model_dump() == streamed.model_dump()
    items = list(oa.responses.input_items.list(streamed.id, order="asc", limit=2))  # the SDK pages by `after`
    assert [i.type for i in items] == ["message", "reasoning", "message", "function_call", "function_call_output"]
    assert [i.id for i in items[1:4]] == [o.id for o in first.output] and len({i.id for i in items}) == 5
    assert items[0].role == "user" and items[0].content[0].text == "CALL-THE-TOOL: weather in Paris?"
    newest = oa.responses.input_items.list(streamed.id, limit=1)
    assert [i.id for i in newest.data] == [items[-1].id] and newest.has_more
    for query, param in (("order=up", "order"), ("limit=0", "limit"), ("after=nope", "after")):
        r = httpx.get(f"{stack.url}/v1/responses/{streamed.id}/input_items?{query}")
        assert r.status_code == 400 and r.json()["error"]["param"] == param
    # an item sent with its id keeps it; sent again beside previous_response_id it is a duplicate
    mine = {"type": "function_call_output", "call_id": first.output[-1].call_id, "output": "Snow", "id": "fco_mine"}
    again = oa.responses.create(model="m", previous_response_id=first.id, input=[mine], max_output_tokens=4)
    listed = list(oa.responses.input_items.list(again.id, order="asc"))
    assert listed[-1].id == "fco_mine" and listed[-1].status == "completed"
    with pytest.raises(openai.BadRequestError) as err:
        oa.responses.create(model="m", previous_response_id=again.id, input=[mine], max_output_tokens=4)
    assert err.value.body["param"] == "input.0" and "fco_mine" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:  # the request's own items numbered as it sent them
        oa.responses.create(model="m", previous_response_id=again.id, max_output_tokens=4,
                            input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}])
    assert err.value.body["param"] == "input.0.content"
    assert httpx.delete(f"{stack.url}/v1/responses/{first.id}").json() == {"id": first.id, "object": "response",
                                                                           "deleted": True}
    with pytest.raises(openai.NotFoundError):
        oa.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as err:  # an earlier turn of the chain is gone
        oa.responses.create(model="m", previous_response_id=streamed.id, input="x", max_output_tokens=4)
    assert err.value.body["param"] == "previous_response_id" and first.id in err.value.body["message"]
    assert [i.type for i in oa.responses.input_items.list(streamed.id, order="asc")] == [
        "function_call_output"]  # the turns still stored
    budget = stack.client.responses.store.budget
    stack.client.responses.store.budget = 100  # a record larger than the whole store: not kept, and said so
    try:
        big = oa.responses.create(model="m", input="SAY-STOP", max_output_tokens=8)
    finally:
        stack.client.responses.store.budget = budget
    assert big.store is False
    with pytest.raises(openai.NotFoundError):
        oa.responses.retrieve(big.id)
    with pytest.raises(openai.BadRequestError) as err:
        oa.responses.create(model="m", previous_response_id="resp_none", input="x", max_output_tokens=4)
    assert err.value.body["code"] == "previous_response_not_found"
    unstored = oa.responses.create(model="m", input="SAY-STOP", max_output_tokens=8, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        oa.responses.retrieve(unstored.id)
    assert httpx.delete(f"{stack.url}/v1/responses/{first.id}").status_code == 404


def test_a_server_without_a_store_refuses_previous_response_id(stack):  # noqa: F811
    from fastapi.testclient import TestClient

    from decapybara.api.app import create_app
    from decapybara.api.client import LocalEngineClient

    client = LocalEngineClient(stack.client.engine, "m", start=False, responses_budget_bytes=0)
    with TestClient(create_app(client)) as http:
        r = http.post("/v1/responses", json={"input": "x", "previous_response_id": "resp_1"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
        assert "responses_store_mb" in r.json()["error"]["message"]
        assert http.get("/v1/responses/resp_1").status_code == 404
        assert http.get("/v1/responses/resp_1/input_items").status_code == 404


def test_the_store_drops_the_least_recently_used_and_reports_broken_chains():
    from decapybara.api.response_store import ChainBroken, ResponseStore, record_text

    def rec(rid, parent=None, pad=0):
        return rid, parent, record_text({"id": rid, "parent": parent, "input": [{"id": "m" + rid, "text": "x" * pad}],
                                         "response": {"id": rid, "output": []}})

    size = len(rec("r1")[2])
    store = ResponseStore(budget_bytes=4 * size + 4)
    for rid, parent in (("r1", None), ("r2", "r1"), ("r3", "r2"), ("o1", None)):
        assert store.put(*rec(rid, parent))
    assert [json.loads(t)["id"] for t in store.chain("r3")] == ["r1", "r2", "r3"]  # touched: o1 the oldest now
    store.put(*rec("o2"))
    assert store.get("o1") is None and store.get("r1") is not None and store.stats()["dropped"] == 1
    store.chain("r3")  # its oldest turn touched last: dropped after r2 and r3
    store.put(*rec("o3"))
    assert store.get("o2") is None
    store.put(*rec("n0"))  # the newest turn goes first
    assert store.get("r3") is None and store.get("r2") is not None
    store.delete("r1")
    with pytest.raises(ChainBroken) as err:
        store.chain("r2")
    assert err.value.missing == "r1" and err.value.asked == "r2"
    assert store.lookup("r2") == (None, "r1") and store.lookup("zz") == (None, "zz")
    assert [json.loads(t)["id"] for t in store.chain("r2", partial=True)] == ["r2"]  # the turns still stored
    assert store.lookup("zz", partial=True) == (None, "zz")
    assert not store.put(*rec("big", pad=5 * size)) and store.stats()["refused"] == 1
    store.put(*rec("c1", "c2"))
    store.put(*rec("c2", "c1"))  # a cycle is a broken chain, not a hang
    with pytest.raises(ChainBroken):
        store.chain("c1")
    assert store.delete("c1") and not store.delete("c1")
    assert store.nbytes == sum(len(store.get(k)) for k in list(store._entries))


def test_truncation_auto_drops_the_middle_of_a_conversation_past_the_context(stack):  # noqa: F811
    """A conversation longer than the context is a 400 (context_length_exceeded) unless truncation is "auto":
    then turns from its middle are dropped until the reply has room, the first and the latest user messages
    kept."""
    n = stack.client.max_model_len
    per_word = len(stack.tok.encode(" ".join(["word"] * 100))) / 100
    filler = " ".join(["word"] * int(n / 6 / per_word))
    assert n // 8 < len(stack.tok.encode(filler)) < n // 5
    items = [{"role": "user", "content": "FIRST " + filler}]
    for i in range(5):
        items += [{"role": "assistant", "content": f"answer{i} " + filler}, {"role": "user", "content": f"turn{i} "
                                                                                                  + filler}]
    items[-1] = {"role": "user", "content": "LAST SAY-STOP"}
    kw = {"model": "m", "input": items, "max_output_tokens": 40, "reasoning": {"effort": "none"}, "store": False}
    with pytest.raises(openai.BadRequestError) as err:
        stack.oa().responses.create(**kw)
    assert err.value.body["code"] == "context_length_exceeded"
    r = stack.oa().responses.create(**kw, truncation="auto")
    prompt = stack.prompt(r.id)
    assert "FIRST" in prompt and "LAST SAY-STOP" in prompt and "answer0" not in prompt and "answer4" in prompt
    assert r.truncation == "auto" and r.output_text == SCRIPTS["SAY-STOP"]
    assert r.usage.input_tokens + 40 <= n


def test_middle_cuts_keep_calls_with_their_outputs():
    from decapybara.api.openai_responses import middle_cuts

    call = {"role": "assistant", "content": "", "tool_calls": [{"id": "c"}]}
    turn = [("system", "S"), ("user", "u0"), None, ("tool", "t1"), ("tool", "t1b"), ("assistant", "a2"),
            ("tool", "t2"), ("user", "u1"), ("assistant", "a3"), ("user", "u2")]
    msgs = [call if t is None else {"role": t[0], "content": t[1]} for t in turn]
    cuts = middle_cuts(msgs)
    assert [[m["content"] for m in cut] for cut in cuts] == [
        ["S", "u0", "a2", "t2", "u1", "a3", "u2"], ["S", "u0", "a3", "u2"]]
    assert middle_cuts(msgs[:1]) == [] and middle_cuts([msgs[1], msgs[8]]) == []


def test_input_tokens_counts_the_prompt_a_response_would_have(stack):  # noqa: F811
    """responses.input_tokens.count gives the input_tokens of the same request's response, for a whole
    conversation and for a turn continuing a stored one."""
    oa = stack.oa()
    kw = {"input": "CALL-THE-TOOL: weather in Paris?", "tools": TOOLS_R, "instructions": "Be brief."}
    first = oa.responses.create(model="m", max_output_tokens=80, **kw)
    counted = oa.responses.input_tokens.count(model="m", **kw)
    assert counted.object == "response.input_tokens" and counted.input_tokens == first.usage.input_tokens
    nxt = {"previous_response_id": first.id, "tools": TOOLS_R, "input": [
        {"type": "function_call_output", "call_id": first.output[-1].call_id, "output": "Sunny"}]}
    assert oa.responses.input_tokens.count(model="m", **nxt).input_tokens == oa.responses.create(
        model="m", max_output_tokens=4, **nxt).usage.input_tokens
    with pytest.raises(openai.BadRequestError):
        oa.responses.input_tokens.count(model="m", previous_response_id="resp_none", input="x")


def _rec(rid, parent=None, text="x"):
    from decapybara.api.response_store import record_text

    return record_text({"id": rid, "parent": parent, "input": [text], "response": {"id": rid}})


def test_saved_files_take_over_quiet_writers_and_never_a_live_ones(tmp_path, monkeypatch):
    """A save writes its writer's records and deletions as its own file and deletes its own segments; an earlier
    version's single file and the files of a writer quiet for STALE_S are merged in (under this store's records)
    and deleted, a live writer's are left alone. A start reads every saved file's records, then their deletions
    (one server's deletion forgets another's copy), then the segments; a torn line is skipped, any character
    survives; a failed write leaves no temporary file, and a stale temporary is deleted."""
    import fsspec

    from decapybara.api import response_store as rs

    folder, root = str(tmp_path), tmp_path / rs.JOURNAL_NAME

    def names():
        return sorted(p.name for p in root.iterdir())

    (tmp_path / rs.SAVED_NAME).write_text(rs.put_line("old1", None, _rec("old1")) + '["torn", null, "{\\"id\\"')
    a, b = rs.ResponseStore(1 << 20), rs.ResponseStore(1 << 20)
    for rid in ("a1", "shared"):
        a.put(rid, None, _rec(rid, text="line\u2028sep\x85and\u2029more"))
    b.put("b1", None, _rec("b1")), b.put("shared", None, _rec("shared", text="b's"))
    saved = rs.save_records(b.snapshot(), 1 << 20, folder, "bbbb")
    assert saved.records == 3 and len(saved.adopted) == 1  # old1 taken over, the torn line left out
    assert not (tmp_path / rs.SAVED_NAME).exists() and names() == ["bbbb.jsonl"]
    a.delete("shared")
    saved = rs.save_records(a.snapshot(), 1 << 20, folder, "aaaa")
    assert saved.records == 1 and saved.adopted == [] and names() == ["aaaa.jsonl", "bbbb.jsonl"]  # b is live
    fresh = rs.ResponseStore(1 << 20)
    rs.load_records(fresh, folder)
    assert sorted(fresh._entries) == ["a1", "b1", "old1"] and "shared" in fresh.deleted  # a's deletion wins
    assert json.loads(fresh.get("a1"))["input"][0] == "line\u2028sep\x85and\u2029more"

    # b goes quiet for STALE_S (its file and segments old): the next save of a's takes them over
    late = rs.ResponseJournal(folder, 1 << 20, writer="bbbb")
    late.put("b2", "b1", _rec("b2", "b1"))
    seg = late.write(late.take())
    old = time.time() - rs.STALE_S - 5
    os.utime(root / "bbbb.jsonl", (old, old))
    (root / f"{(time.time_ns() - int(rs.STALE_S * 1e9) - 10**10):020d}-bbbb.jsonl").write_text(
        rs.put_line("b3", None, _rec("b3")))
    os.rename(seg, root / f"{(time.time_ns() - int(rs.STALE_S * 1e9) - 10**9):020d}-bbbb.jsonl")
    tmp = root / ".aaaa.jsonl.1234.tmp"
    tmp.write_text("half")
    os.utime(tmp, (old, old))
    saved = rs.save_records(a.snapshot(), 1 << 20, folder, "aaaa")
    assert sorted(rid for rid, _, _ in rs._parsed(saved.adopted)) == ["b1", "b2", "b3", "old1", "shared"]
    assert names() == ["aaaa.jsonl"] and saved.records == 5  # a1, b1, b2, b3, old1 (shared stays deleted)
    fresh = rs.ResponseStore(1 << 20)
    rs.load_records(fresh, folder)
    assert sorted(fresh._entries) == ["a1", "b1", "b2", "b3", "old1"] and fresh.get("shared") is None

    fs = fsspec.core.url_to_fs(folder)[0]  # fsspec's cached instance, which save_records gets too
    monkeypatch.setattr(fs, "mv", lambda *a, **k: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    with pytest.raises(OSError):
        rs.save_records(a.snapshot(), 1 << 20, folder, "aaaa")
    assert names() == ["aaaa.jsonl"]
    assert rs.load_records(rs.ResponseStore(), str(tmp_path / "none")) == 0


def test_the_journal_outlives_a_crash(tmp_path, monkeypatch):
    """Between saves a store's changes are written behind as segments (`ResponseJournal`), so a server killed
    mid-run loses none that were written: a new store reads them in their order, deletions included, whatever the
    clock does meanwhile. A failed write keeps its lines for the next; a folder failing for long drops the oldest
    lines past the budget; a save falls due by bytes or by segments and starts the count afresh."""
    import fsspec

    from decapybara.api import response_store as rs

    folder = str(tmp_path)
    live, j = rs.ResponseStore(1 << 20), rs.ResponseJournal(folder, 1 << 20, writer="aaaa")
    for rid, parent in (("r1", None), ("r2", "r1"), ("r3", "r2")):
        live.put(rid, parent, _rec(rid, parent)), j.put(rid, parent, _rec(rid, parent))
    j.write(j.take())
    monkeypatch.setattr(time, "time_ns", lambda: 5)  # the clock steps back: the next segment still sorts after
    live.delete("r1"), j.delete("r1")
    j.put("r4", None, _rec("r4")), live.put("r4", None, _rec("r4"))
    j.write(j.take())
    monkeypatch.undo()
    assert j.take() == [] and len(list((tmp_path / rs.JOURNAL_NAME).iterdir())) == 2
    crashed = rs.ResponseStore(1 << 20)  # the process dies here: a new server reads both segments
    rs.load_records(crashed, folder)
    assert list(crashed._entries) == ["r2", "r3", "r4"] and crashed.get("r3") == live.get("r3")
    with pytest.raises(rs.ChainBroken) as broken:
        crashed.chain("r3")
    assert broken.value.missing == "r1"

    fs = fsspec.core.url_to_fs(folder)[0]
    j.put("r5", None, _rec("r5"))
    lines = j.take()
    monkeypatch.setattr(fs, "mv", lambda *a, **k: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    with pytest.raises(OSError):
        j.write(lines)
    j.requeue(lines)
    j.put("r6", None, _rec("r6"))
    monkeypatch.undo()
    j.write(j.take())
    again = rs.ResponseStore(1 << 20)
    rs.load_records(again, folder)
    assert list(again._entries)[-2:] == ["r5", "r6"] and j.stats["failures"] == 1
    assert not [p for p in (tmp_path / rs.JOURNAL_NAME).iterdir() if p.name.endswith(".tmp")]
    saved = j.compact(live.snapshot())  # a save: this writer's segments go, its file holds the store
    assert sorted(p.name for p in (tmp_path / rs.JOURNAL_NAME).iterdir()) == ["aaaa.jsonl"] and saved.records == 3

    small = rs.ResponseJournal(folder, 64, writer="dddd")
    assert not small.due()
    small.since_bytes = rs.COMPACT_MIN_BYTES
    assert small.due()
    small.since_bytes, small.since_segments = 0, rs.COMPACT_SEGMENTS
    assert small.due()
    for i in range(10):  # a queue past the budget drops its oldest lines
        small.put(f"q{i}", None, "y" * 10)
    assert small.queued_bytes <= 64 and small.stats["dropped"] > 0 and json.loads(small.queued[-1])[0] == "q9"


def test_live_writers_are_never_taken_over_and_deletions_win(tmp_path):
    """A writer whose heartbeat is fresh keeps its files however old its records are, so two idle servers saving
    at once lose nothing; a takeover of a quiet writer that deleted a record this store still holds drops it here
    too; a segment left behind holding a record its writer's saved file deletes does not bring it back; saved files
    are read oldest first, so under the budget the newest writer's records stay."""
    from decapybara.api import response_store as rs

    folder, root = str(tmp_path), tmp_path / rs.JOURNAL_NAME
    old = time.time() - rs.STALE_S - 5

    def store(*ids, budget=1 << 20):
        st = rs.ResponseStore(budget)
        for rid in ids:
            st.put(rid, None, _rec(rid))
        return st

    a, b = store("a1"), store("b1")
    ja, jb = rs.ResponseJournal(folder, 1 << 20, writer="aaaa"), rs.ResponseJournal(folder, 1 << 20, writer="bbbb")
    ja.compact(a.snapshot()), jb.compact(b.snapshot())
    for name in ("aaaa.jsonl", "bbbb.jsonl"):
        os.utime(root / name, (old, old))
    ja.beat(), jb.beat()  # both alive: neither takes the other over, whatever their files' age
    assert ja.compact(a.snapshot()).adopted == [] and jb.compact(b.snapshot()).adopted == []
    fresh = rs.ResponseStore(1 << 20)
    rs.load_records(fresh, folder)
    assert sorted(fresh._entries) == ["a1", "b1"]

    c, d = store("x", "c1"), store("x", "d1")  # c deletes x, which d still holds; then c goes quiet
    c.delete("x")
    jc, jd = rs.ResponseJournal(folder, 1 << 20, writer="cccc"), rs.ResponseJournal(folder, 1 << 20, writer="dddd")
    jc.compact(c.snapshot())
    for name in ("cccc.jsonl",):
        os.utime(root / name, (old, old))
    saved = jd.compact(d.snapshot())
    assert rs.merge_records(d, [saved.adopted], missing_only=True, oldest=True) == 1  # c1, as d's oldest
    assert d.get("x") is None and "x" in d.deleted and list(d._entries) == ["c1", "d1"]
    fresh = rs.ResponseStore(1 << 20)
    rs.load_records(fresh, folder)
    assert fresh.get("x") is None and sorted(fresh._entries) == ["a1", "b1", "c1", "d1"]

    e = store("y")
    je = rs.ResponseJournal(folder, 1 << 20, writer="eeee")
    je.put("y", None, _rec("y"))
    leftover = je.write(je.take())
    e.delete("y")
    (root / "eeee.jsonl").write_text("".join(e.lines()))  # its save, whose deletion of the segment failed
    assert os.path.exists(leftover)
    fresh = rs.ResponseStore(1 << 20)
    rs.load_records(fresh, folder)
    assert fresh.get("y") is None

    other = tmp_path / "other" / rs.JOURNAL_NAME
    other.mkdir(parents=True)
    for i, name in enumerate(("ffff", "0000")):  # 0000 is newer, though its name sorts first
        (other / f"{name}.jsonl").write_text(rs.put_line(f"{name}-r", None, _rec(f"{name}-r")))
        os.utime(other / f"{name}.jsonl", (old + i, old + i))
    small = rs.ResponseStore(len(_rec("ffff-r")) + 5)
    rs.load_records(small, str(tmp_path / "other"))
    assert list(small._entries) == ["0000-r"]

    live = store("A", "B", budget=3 * len(_rec("A")) + 2)  # records taken over go in as the oldest, where they fit
    rows = rs.parse_merged([[rs.put_line(r, None, _rec(r)) for r in ("D", "E", "F")]])
    assert live.apply(rows, missing_only=True, oldest=True) == 1 and list(live._entries) == ["F", "A", "B"]
    roomy = store("A", "X")
    roomy.delete("X")  # deleted here: another server's copy taken over does not bring it back
    rows = rs.parse_merged([[rs.put_line(r, None, _rec(r)) for r in ("X", "D", "E")]])
    assert roomy.apply(rows, missing_only=True, oldest=True) == 2
    assert list(roomy._entries) == ["D", "E", "A"] and "X" in roomy.deleted  # in their order, before the store's


# ---------------------------------------------------------------------------------------------- background


def poll(oa, rid: str, until: set[str], timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        r = oa.responses.retrieve(rid)
        if r.status in until or time.monotonic() > deadline:
            return r
        time.sleep(0.05)


def test_a_background_response_is_queued_then_polled_to_its_end(stack):  # noqa: F811
    """background: the request returns at once with the response "queued"; polling finds it completed with the
    items the same request gets in the foreground; it continues a conversation as any stored response does."""
    oa = stack.oa()
    kw = {"model": "m", "input": "CALL-THE-TOOL: weather in Paris?", "tools": TOOLS_R, "max_output_tokens": 80}
    queued = oa.responses.create(**kw, background=True)
    assert queued.status == "queued" and queued.background is True and queued.output == []
    done = poll(oa, queued.id, {"completed", "incomplete", "failed"})
    fg = oa.responses.create(**kw)
    assert done.status == "completed" and done.background is True and fg.background is False
    assert kinds(done) == kinds(fg) and done.output_text == fg.output_text
    assert done.output[-1].arguments == fg.output[-1].arguments and done.usage.output_tokens == fg.usage.output_tokens
    call = done.output[-1]
    nxt = oa.responses.create(model="m", previous_response_id=done.id, tools=TOOLS_R, max_output_tokens=8,
                              input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sun"}])
    assert "<tool_response>\nSun\n</tool_response>" in stack.prompt(nxt.id)
    assert oa.responses.cancel(done.id).status == "completed"  # cancelling an ended response changes nothing


def test_a_background_response_shows_its_progress_and_is_cancelled(stack):  # noqa: F811
    """A long background run is stored "in_progress" with its text so far; cancel aborts it: "cancelled", with
    the text made until then in an incomplete message, the same on a second cancel and on retrieve; the engine
    frees its slot; a turn continuing a running response is a 400."""
    oa = stack.oa()
    queued = oa.responses.create(model="m", input="KEEP-TALKING SLOW-DOWN", reasoning={"effort": "none"},
                                 max_output_tokens=2000, background=True)
    running = queued
    deadline = time.monotonic() + 20
    while not (running.status == "in_progress" and running.output) and time.monotonic() < deadline:
        time.sleep(0.1)
        running = oa.responses.retrieve(queued.id)
    assert running.status == "in_progress" and running.output[0].status == "in_progress", running
    with pytest.raises(openai.BadRequestError) as err:
        oa.responses.create(model="m", previous_response_id=queued.id, input="more")
    assert "still running" in str(err.value)
    cancelled = oa.responses.cancel(queued.id)
    assert cancelled.status == "cancelled" and cancelled.output[0].status == "incomplete"
    assert cancelled.output[0].content[0].text.startswith(running.output[0].content[0].text)
    assert oa.responses.cancel(queued.id).model_dump() == cancelled.model_dump()
    assert oa.responses.retrieve(queued.id).model_dump() == cancelled.model_dump()
    with pytest.raises(openai.BadRequestError) as err:  # a foreground response cannot be cancelled
        oa.responses.cancel(oa.responses.create(model="m", input="SAY-STOP", max_output_tokens=8).id)
    assert "only background responses" in str(err.value)


def test_a_background_stream_is_left_and_joined_again(stack):  # noqa: F811
    """background with stream: the client reads a few events and leaves (the run goes on); a GET with stream
    and starting_after gives the events after the last one read, numbered on, ending as a foreground stream of
    the same request does (opened "queued", as the run is stored); a stream joined from the start gives them
    all."""
    oa = stack.oa()
    kw = {"model": "m", "input": "CALL-THE-TOOL: weather in Paris?", "tools": TOOLS_R, "max_output_tokens": 80}
    first = []
    with oa.responses.create(**kw, background=True, stream=True) as s:
        for ev in s:
            first.append(ev)
            if len(first) == 4:
                break
    rid = first[0].response.id
    rest = list(oa.responses.retrieve(rid, stream=True, starting_after=first[-1].sequence_number))
    events = first + rest
    assert [e.sequence_number for e in events] == list(range(len(events)))
    fg = list(oa.responses.create(**kw, stream=True))
    # a run opens "queued" (response.queued), then response.in_progress before its first tokens' events
    assert [e.type for e in events[:3]] == ["response.created", "response.queued", "response.in_progress"]
    assert [e.response.status for e in events[:3]] == ["queued", "queued", "in_progress"]
    assert [e.type for e in fg[:2]] == ["response.created", "response.in_progress"]
    assert [e.type for e in events[3:]] == [e.type for e in fg[2:]]
    assert events[-1].type == "response.completed" and events[-1].response.background is True
    assert events[-1].response.output_text == fg[-1].response.output_text
    again = list(oa.responses.retrieve(rid, stream=True))
    assert [e.model_dump() for e in again] == [e.model_dump() for e in events]
    with pytest.raises(openai.BadRequestError) as err:  # a foreground response's events are not kept
        list(oa.responses.retrieve(fg[-1].response.id, stream=True))
    assert "did not run in the background" in str(err.value)


def test_background_needs_the_store_and_a_deleted_run_stays_deleted(stack):  # noqa: F811
    """background with store false, or on a server without a store, is a 400 naming background; a background
    response deleted while it runs is stopped and not stored again."""
    from fastapi.testclient import TestClient

    from decapybara.api.app import create_app
    from decapybara.api.client import LocalEngineClient

    oa = stack.oa()
    with pytest.raises(openai.BadRequestError) as err:
        oa.responses.create(model="m", input="hi", background=True, store=False)
    assert err.value.body["param"] == "background" and "store: false" in err.value.body["message"]
    client = LocalEngineClient(stack.client.engine, "m", start=False, responses_budget_bytes=0)
    with TestClient(create_app(client)) as http:
        r = http.post("/v1/responses", json={"input": "x", "background": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "background"
        assert "responses_store_mb" in r.json()["error"]["message"]
    queued = oa.responses.create(model="m", input="KEEP-TALKING SLOW-DOWN", reasoning={"effort": "none"},
                                 max_output_tokens=2000, background=True)
    poll(oa, queued.id, {"in_progress"})
    oa.responses.delete(queued.id)
    time.sleep(1.5)  # past the run's next store
    with pytest.raises(openai.NotFoundError):
        oa.responses.retrieve(queued.id)


# ---------------------------------------------------------------------------------------------- conversations


def test_a_conversation_holds_its_turns_and_renders_as_the_chat_it_is(stack):  # noqa: F811
    """Through the openai SDK: a conversation made with a first item; a response in it reads that item first and
    adds its input and output items (before its end goes out, streamed or not); the next turn in it renders the
    prompt the whole conversation sent as input renders; items listed (newest first by default, paged), read one
    by one, added, deleted; metadata updated; the conversation deleted (then a 404, and a turn in it a 400)."""
    oa = stack.oa()
    conv = oa.conversations.create(items=[{"type": "message", "role": "user", "content": "Weather in Paris?"}],
                                   metadata={"agent": "a1"})
    assert conv.id.startswith("conv_") and conv.metadata == {"agent": "a1"}
    first = oa.responses.create(model="m", conversation=conv.id, input="CALL-THE-TOOL now", tools=TOOLS_R,
                                max_output_tokens=80)
    assert first.conversation.id == conv.id
    assert "Weather in Paris?" in stack.prompt(first.id)
    items = list(oa.conversations.items.list(conv.id, order="asc", limit=2))  # the SDK pages by `after`
    assert [i.type for i in items] == ["message", "message", "reasoning", "message", "function_call"]
    assert [i.id for i in items[2:]] == [o.id for o in first.output]
    call = first.output[-1]
    with oa.responses.stream(model="m", conversation={"id": conv.id}, tools=TOOLS_R, max_output_tokens=8, input=[
            {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}]) as s:
        second = list(s)[-1].response
    # the add happened before the stream's last event: the next read sees the turn
    assert oa.conversations.items.list(conv.id).data[0].id == second.output[-1].id
    whole = [{"role": "user", "content": "Weather in Paris?"}, {"role": "user", "content": "CALL-THE-TOOL now"},
             *[o.model_dump(exclude_none=True) for o in first.output],
             {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}]
    sent = oa.responses.create(model="m", input=whole, tools=TOOLS_R, max_output_tokens=8, store=False)
    assert stack.prompt(second.id) == stack.prompt(sent.id)
    one = oa.conversations.items.retrieve(call.id, conversation_id=conv.id)
    assert one.type == "function_call" and one.call_id == call.call_id
    added = oa.conversations.items.create(conv.id, items=[{"type": "message", "role": "user", "content": "x"}])
    assert len(added.data) == 1 and oa.conversations.items.list(conv.id).data[0].id == added.data[0].id
    oa.conversations.items.delete(added.data[0].id, conversation_id=conv.id)
    assert oa.conversations.items.list(conv.id).data[0].id != added.data[0].id
    for call_ in (lambda: oa.responses.retrieve(conv.id), lambda: oa.responses.delete(conv.id)):
        with pytest.raises(openai.NotFoundError):  # a conversation is no response
            call_()
    with pytest.raises(openai.BadRequestError):
        oa.responses.create(model="m", previous_response_id=conv.id, input="hi")
    assert oa.conversations.update(conv.id, metadata={"agent": "a2"}).metadata == {"agent": "a2"}
    assert oa.conversations.retrieve(conv.id).metadata == {"agent": "a2"}
    assert oa.conversations.delete(conv.id).deleted is True
    with pytest.raises(openai.NotFoundError):
        oa.conversations.retrieve(conv.id)
    with pytest.raises(openai.BadRequestError) as err:
        oa.responses.create(model="m", conversation=conv.id, input="hi")
    assert err.value.body["param"] == "conversation"


def test_conversations_refuse_bad_input_and_background_turns_add_to_them(stack):  # noqa: F811
    """conversation beside previous_response_id, metadata past its bounds, more than 20 first items, items that
    do not read are 400s naming the field; a background response in a conversation adds its turn at its end."""
    oa = stack.oa()
    conv = oa.conversations.create()
    bad = [({"conversation": conv.id, "previous_response_id": "resp_1", "input": "x"}, "/v1/responses", "conversation"),
           ({"metadata": {"k": "v" * 600}}, "/v1/conversations", "metadata"),
           ({"items": [{"role": "user", "content": "x"}] * 21}, "/v1/conversations", "items"),
           ({"items": [{"type": "no-such-item"}]}, "/v1/conversations", "items.0.type")]
    for body, path, param in bad:
        r = _post(stack.url + path, {"model": "m", **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, r.text)
    queued = oa.responses.create(model="m", conversation=conv.id, input="SAY-STOP please", max_output_tokens=20,
                                 reasoning={"effort": "none"}, background=True)
    done = poll(oa, queued.id, {"completed", "incomplete"})
    listed = oa.conversations.items.list(conv.id, order="asc").data
    assert [i.type for i in listed] == ["message", "message"] and listed[-1].id == done.output[-1].id


# ---------------------------------------------------------------------------------------------- echoed request fields


def test_the_response_echoes_tool_choice_and_text_in_the_apis_shape(stack):  # noqa: F811
    """tool_choice given in chat completions' form comes back in the Responses API's ({"type": "function",
    "name"}), which the SDK reads; text.format keeps its description and text its verbosity."""
    r = stack.oa().responses.create(model="m", input="TWO-CALLS", tools=TOOLS_R, max_output_tokens=80,
                                    parallel_tool_calls=False, reasoning={"effort": "none"},
                                    tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert r.tool_choice.type == "function" and r.tool_choice.name == "get_weather"
    fmt = {"type": "json_schema", "name": "n", "description": "a reply", "schema": {"type": "object"}, "strict": True}
    r = stack.oa().responses.create(model="m", input="x", max_output_tokens=2, reasoning={"effort": "none"},
                                    text={"format": fmt, "verbosity": "low"})
    assert r.text.format.description == "a reply" and r.text.format.name == "n" and r.text.verbosity == "low"


@pytest.mark.parametrize("metadata", [{f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513}])
def test_metadata_past_the_apis_bounds_is_a_400(stack, metadata):  # noqa: F811
    """metadata is at most 16 string pairs, keys up to 64 characters, values up to 512 (as for conversations)."""
    r = _post(stack.url + "/v1/responses", {"model": "m", "input": "x", "max_output_tokens": 2, "metadata": metadata})
    assert r.status_code == 400 and r.json()["error"]["param"] == "metadata", r.text
    ok = _post(stack.url + "/v1/responses", {"model": "m", "input": "x", "max_output_tokens": 2,
                                            "metadata": {f"k{i}": "v" * 512 for i in range(16)}})
    assert ok.status_code == 200 and len(ok.json()["metadata"]) == 16


@pytest.mark.parametrize("item, param", [
    ({"type": "function_call", "name": "f", "arguments": "{}"}, "input.0.call_id"),
    ({"type": "function_call_output", "call_id": "c"}, "input.0.output"),
    ({"role": "user"}, "input.0.content"),
    ({"role": "user", "content": [{"type": "input_text"}]}, "input.0.content.0.text"),
    ({"role": "user", "content": [{"type": "text", "text": 5}]}, "input.0.content.0.text"),
    ({"type": "reasoning", "summary": [{"type": "summary_text"}]}, "input.0.summary.0.text"),
])
def test_a_bad_input_item_names_its_field_without_the_items_kind(stack, item, param):  # noqa: F811
    """A field missing or wrong in an input item is named by its path in the request (``input.0.call_id``), not
    with the kind of item or part pydantic read it as in between."""
    r = _post(stack.url + "/v1/responses", {"model": "m", "input": [item]})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_xml_calls_are_function_call_items_whole_and_streamed():
    """Under a template that writes XML calls (Qwen3.5 / 3.6): a required tool_choice constrains calls in that
    form; the model's XML call is a function_call item whose JSON arguments are read by the tool's schema, whole
    and streamed in chunks of 1, 3 or all characters; sent back as an item it renders as the model wrote it."""
    from types import SimpleNamespace

    from test_api import XML_ARGS, XML_REPLY, XML_TOOLS, make_tokenizer_json, scripted_events

    from decapybara.api import openai_responses as orr
    from decapybara.api import responses_schemas as rs
    from decapybara.api.common import Collected
    from decapybara.testing import XML_CHAT_TEMPLATE
    from decapybara.tokenizer import Tokenizer

    client = SimpleNamespace(tokenizer=Tokenizer.from_json(make_tokenizer_json(), chat_template=XML_CHAT_TEMPLATE),
                             max_model_len=4096, vocab_size=512)
    tools = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
             for t in XML_TOOLS]
    user = [{"role": "user", "content": "Edit src/a.py."}]

    def plan(**body):
        return orr.plan_response(rs.ResponsesRequest.model_validate({"input": user, "tools": tools, **body}),
                                 client, "m", None)

    assert json.loads(plan(tool_choice="required").request.params.tool_calls)["format"] == "xml"
    p = plan()
    done = Collected()
    for ev in scripted_events(p.request.request_id, XML_REPLY, len(XML_REPLY)):
        done.add(ev)
    whole = orr.response(p, done, client.tokenizer)
    assert [i.type for i in whole.output] == ["reasoning", "message", "function_call"]
    call = whole.output[2]
    assert call.name == "edit" and json.loads(call.arguments) == XML_ARGS
    for size in (1, 3, len(XML_REPLY)):
        stream = orr.ResponseStream(p, client.tokenizer)
        events = scripted_events(p.request.request_id, XML_REPLY, size)
        lines = stream.start(events[0]) + [line for ev in events for line in stream.event(ev)] + stream.end(events[-1])
        data = [json.loads(line.split("\ndata: ")[1]) for line in lines if "\ndata: " in line]
        done_args = [e["arguments"] for e in data if e["type"] == "response.function_call_arguments.done"]
        assert [json.loads(a) for a in done_args] == [XML_ARGS]
        assert data[-1]["type"] == "response.completed"
    items = [*user, {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "Edit it."}]},
             {"role": "assistant", "content": "Editing now."},
             {"type": "function_call", "call_id": call.call_id, "name": "edit", "arguments": call.arguments},
             {"type": "function_call_output", "call_id": call.call_id, "output": "done"}]
    again = orr.plan_response(rs.ResponsesRequest.model_validate({"input": items, "tools": tools}), client, "m", None)
    assert XML_REPLY + "<|im_end|>" in again.prompt.text, again.prompt.text
