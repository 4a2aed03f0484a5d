"""Chat rendering against transformers' apply_chat_template, and the model-output parsers."""

from __future__ import annotations

import json
import random

import pytest

from decapybara.chat import (
    CallSyntax,
    ContentDelta,
    ReasoningDelta,
    StreamingOutputParser,
    ToolCall,
    ToolCallEvent,
    default_chat_template,
    parse_assistant_output,
    prompt_opens_reasoning,
    render_chat,
    template_call_format,
)
from decapybara.engine.json_schema import xml_param_kinds
from decapybara.errors import ConfigError, InvalidRequestError
from decapybara.testing import XML_CHAT_TEMPLATE, make_tokenizer_json

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather of a city, in °C.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}},
]


def _call(name: str, arguments: dict | str, cid: str = "call_0") -> dict:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": arguments}}


SYS = {"role": "system", "content": "You are a careful assistant."}
CONVERSATIONS: dict[str, tuple[list[dict], list[dict] | None]] = {
    "single_user": ([{"role": "user", "content": "Hello!"}], None),
    "system_user": ([SYS, {"role": "user", "content": "What is 2+2?"}], None),
    "multi_turn": ([SYS, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, how can I help?"},
                    {"role": "user", "content": "Tell me a joke."}], None),
    "multi_part_text": ([
        {"role": "system", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "Part one. "}, {"type": "text", "text": "Part two."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Done."}]},
        {"role": "user", "content": "next"}], None),
    "tools_no_system": ([{"role": "user", "content": "Weather in Paris?"}], TOOLS),
    "tool_round_trip": ([
        SYS, {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [_call("get_weather", {"city": "Paris"})]},
        {"role": "tool", "tool_call_id": "call_0", "name": "get_weather", "content": '{"temp": 21}'},
        {"role": "assistant", "content": "It is 21 °C in Paris."}], TOOLS),
    "parallel_calls_consecutive_results": ([
        {"role": "user", "content": "Read a.py and b.py, and the weather in Oslo"},
        {"role": "assistant", "content": None, "tool_calls": [
            _call("read_file", {"path": "a.py"}, "c1"), _call("read_file", '{"path": "b.py"}', "c2"),
            _call("get_weather", {"city": "Oslo"}, "c3")]},
        {"role": "tool", "tool_call_id": "c1", "content": "print('a')"},
        {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "print('b')"}]},
        {"role": "tool", "tool_call_id": "c3", "content": "-3"}], TOOLS),
    "thinking_in_history": ([
        {"role": "user", "content": "First question"},
        {"role": "assistant", "content": "First answer", "reasoning_content": "old thoughts, dropped"},
        {"role": "user", "content": "Second question"},
        {"role": "assistant", "content": "Second answer", "reasoning_content": "\nnew thoughts, kept\n"}], None),
    "inline_think_in_content": ([
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "<think>\nhidden\n</think>\n\nvisible 1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "<think>inline kept</think>visible 2"}], None),
    "multi_step_agent": ([
        SYS, {"role": "user", "content": "Fix the bug"},
        {"role": "assistant", "content": "", "reasoning_content": "look at the file",
         "tool_calls": [_call("read_file", {"path": "bug.py"})]},
        {"role": "tool", "content": "x = 1/0"},
        {"role": "assistant", "content": "Found it.", "reasoning": "division by zero",
         "tool_calls": [_call("read_file", {"path": "test.py"}, "c9")]},
        {"role": "tool", "content": "assert x"}], TOOLS),
    "system_in_middle": ([SYS, {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                          {"role": "system", "content": "New rule: answer in French."},
                          {"role": "user", "content": "c"}], None),
    "final_assistant_prefill": ([{"role": "user", "content": "Write code"},
                                 {"role": "assistant", "content": "def f():"}], None),
    "legacy_tool_response_in_user": ([
        {"role": "user", "content": "real query"},
        {"role": "assistant", "content": "calling", "thinking": "plan",
         "tool_calls": [_call("get_weather", {"city": "Rome"})]},
        {"role": "user", "content": "<tool_response>\n25\n</tool_response>"}], TOOLS),
    "unicode_and_code": ([
        {"role": "user", "content": "Ünïcödé 日本語 🦫\n```python\ndef f(x):\n    return {'a': x}\n```"},
        {"role": "assistant", "content": "Ça marche — 好的 🚀"}], [{"type": "function", "function": {
            "name": "noop", "description": "ünïcode schema ✓", "parameters": {"type": "object"}}}]),
}


@pytest.fixture(scope="module")
def hf_tokenizer():
    from tokenizers import Tokenizer as HFTokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=HFTokenizer.from_str(make_tokenizer_json()),
                                   chat_template=default_chat_template(), eos_token="<|im_end|>")


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("enable_thinking", [True, False])
def test_render_equals_transformers_apply_chat_template(hf_tokenizer, name, add_generation_prompt,
                                                        enable_thinking):
    messages, tools = CONVERSATIONS[name]
    ours = render_chat(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                       enable_thinking=enable_thinking)
    theirs = hf_tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                              add_generation_prompt=add_generation_prompt,
                                              enable_thinking=enable_thinking)
    assert ours == theirs


def test_template_renders_qwen3_structure():
    messages, tools = CONVERSATIONS["multi_step_agent"]
    text = render_chat(messages, tools=tools, enable_thinking=False)
    assert text.startswith("<|im_start|>system\nYou are a careful assistant.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(TOOLS[0], ensure_ascii=False) + "\n" in text
    assert ('<|im_start|>assistant\n<think>\nlook at the file\n</think>\n\n<tool_call>\n'
            '{"name": "read_file", "arguments": {"path": "bug.py"}}\n</tool_call><|im_end|>\n') in text
    assert "Found it.\n<tool_call>" in text and "<think>\ndivision by zero\n</think>\n\nFound it." in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    history = render_chat(*CONVERSATIONS["thinking_in_history"], add_generation_prompt=False)
    assert "old thoughts" not in history and "<think>\nnew thoughts, kept\n</think>\n\nSecond answer" in history
    grouped = render_chat(*CONVERSATIONS["parallel_calls_consecutive_results"])
    assert grouped.count("<|im_start|>user") == 2 and grouped.count("<tool_response>\n") == 3
    assert "</tool_response>\n<tool_response>\nprint('b')\n</tool_response>\n<tool_response>\n-3" in grouped
    inline = render_chat(*CONVERSATIONS["inline_think_in_content"], add_generation_prompt=False)
    assert "assistant\nvisible 1<|im_end|>" in inline and "<think>\ninline kept\n</think>\n\nvisible 2" in inline
    prefill = render_chat(*CONVERSATIONS["final_assistant_prefill"], add_generation_prompt=False)
    assert prefill.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\ndef f():<|im_end|>\n")
    legacy = render_chat(*CONVERSATIONS["legacy_tool_response_in_user"])  # a tool-response user turn is no query
    assert "<think>\nplan\n</think>\n\ncalling\n<tool_call>" in legacy


CUSTOM_TEMPLATE = """\
{%- set ns = namespace(n=0) %}
{%- for m in messages %}
    {%- if m.role == 'system' %}{% continue %}{% endif %}
    {%- set ns.n = ns.n + 1 %}
    {%- generation %}[{{ ns.n }}:{{ m.role }}] {{ m.content if m.content is string else m.content | tojson(indent=2) }}
    {%- endgeneration %}
    {% if m.tool_calls is defined %}<has tool_calls>{% endif %}
    {{ eos_token }}
{% endfor %}
{{- dict(a=1, b='é') | tojson(sort_keys=True) }}{{ tools | tojson(separators=(',', ':')) }}
"""


def test_custom_template_features_match_transformers(hf_tokenizer):
    messages = [SYS, {"role": "user", "content": "x <y> & 'z'"}, {"role": "user", "content": [
        {"type": "text", "text": "ünï"}]}, {"role": "assistant", "content": "ok", "tool_calls": None}]
    theirs = hf_tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False, chat_template=CUSTOM_TEMPLATE)
    ours = render_chat(messages, tools=TOOLS, template=CUSTOM_TEMPLATE, eos_token="<|im_end|>",
                       add_generation_prompt=False)
    assert ours == theirs and "<|im_end|>" in ours and "&" in ours and "has tool_calls" not in ours


def test_strftime_now_and_sandbox():
    year = render_chat([{"role": "user", "content": "x"}], template="{{ strftime_now('%Y') }}")
    assert year.isdigit() and len(year) == 4
    with pytest.raises(Exception, match="unsafe|underscore|access"):
        render_chat([{"role": "user", "content": "x"}], template="{{ messages.__class__.__mro__ }}")


@pytest.mark.parametrize("messages, match", [
    ([], "non-empty"),
    ("hello", "non-empty"),
    (["hello"], "must be an object"),
    ([{"role": "robot", "content": "beep"}], "unknown role"),
    ([{"content": "no role"}], "unknown role"),
    ([{"role": "user"}], "content is required"),
    ([{"role": "user", "content": None}], "content is required"),
    ([{"role": "tool", "tool_call_id": "c"}], "content is required"),
    ([{"role": "user", "content": 42}], "string or a list"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:..."}}]}], "only 'text'"),
    ([{"role": "user", "content": [{"type": "text"}]}], "string 'text'"),
    ([{"role": "user", "content": "q"}, {"role": "assistant"}], "content or tool_calls"),
    ([{"role": "assistant", "content": "", "tool_calls": {"name": "f"}}], "must be a list"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": {}}}]}], "non-empty name"),
    ([{"role": "assistant", "content": "", "tool_calls": [_call("f", 3)]}], "object or a string"),
    ([{"role": "user", "content": "q", "tool_calls": [_call("f", {})]}], "only assistant"),
    ([{"role": "user", "content": "q", "extra": object()}], "unsupported value"),
])
def test_bad_messages_raise_invalid_request(messages, match):
    with pytest.raises(InvalidRequestError, match=match):
        render_chat(messages)


def test_bad_tools_and_templates():
    with pytest.raises(InvalidRequestError, match="tools"):
        render_chat([{"role": "user", "content": "q"}], tools={"name": "f"})
    with pytest.raises(InvalidRequestError, match="nope"):
        render_chat([{"role": "user", "content": "q"}], template="{{ raise_exception('nope') }}")
    with pytest.raises(ConfigError, match="compile"):
        render_chat([{"role": "user", "content": "q"}], template="{% if %}")


# ------------------------------------------------------------------------------------------- output parsing


def test_parse_reasoning_content_and_tool_calls():
    text = ('<think>\nThe user wants weather.\n</think>\n\nLet me check.\n<tool_call>\n'
            '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
            '{"name": "read_file", "arguments": "{\\"path\\": \\"a.py\\"}"}\n</tool_call>')
    out = parse_assistant_output(text)
    assert out.reasoning == "The user wants weather."
    assert out.content == "Let me check."
    assert out.tool_calls == [ToolCall("get_weather", {"city": "Paris"}), ToolCall("read_file", {"path": "a.py"})]
    assert out.tool_calls[0].arguments_json() == '{"city": "Paris"}'


def test_parse_output_that_starts_inside_reasoning():
    out = parse_assistant_output("still thinking\n</think>\n\nThe answer is 4.", in_reasoning=True)
    assert (out.reasoning, out.content) == ("still thinking", "The answer is 4.")
    cut_short = parse_assistant_output("never closed <tool_call>", in_reasoning=True)
    assert (cut_short.reasoning, cut_short.content, cut_short.tool_calls) == ("never closed <tool_call>", "", [])
    plain = parse_assistant_output("no tags at all, 4 < 5")
    assert (plain.reasoning, plain.content) == (None, "no tags at all, 4 < 5")


@pytest.mark.parametrize("body", ['{"name": "f", "arguments": {"a": 1}', "not json", '["f"]', '{"arguments": {}}',
                                  '{"name": "f", "arguments": [1]}', '{"name": "f", "arguments": "{bad"}',
                                  '{"name": "f", "arguments": {"a": NaN}}', '{"name": "f", "arguments": {"a": 1e999}}',
                                  '{"name": "f", "arguments": "{\\"a\\": -Infinity}"}',
                                  '{"name": "f", "arguments": {"a": ' + "[" * 100_000 + "}}"])
def test_invalid_tool_call_stays_content(body):
    text = f"Before <tool_call>{body}</tool_call> after"
    out = parse_assistant_output(text)
    assert out.tool_calls == [] and out.content == text


def test_a_closing_tag_inside_the_calls_json_does_not_close_it():
    """A call writing text about tool calls holds `</tool_call>` inside a JSON string: the call runs to the tag
    that closes it, in the batch parser and in a stream cut anywhere."""
    call = '<tool_call>\n{"name": "write", "arguments": {"text": "a </tool_call> b"}}\n</tool_call>'
    text = f"Saving.\n{call}\nDone, then <tool_call>{{bad}}</tool_call>."
    out = parse_assistant_output(text)
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("write", {"text": "a </tool_call> b"})]
    assert out.content == "Saving.\n\nDone, then <tool_call>{bad}</tool_call>."
    for cut in range(1, len(text)):
        _check_stream_equals_batch(text, [cut], in_reasoning=False)
    never = parse_assistant_output('<tool_call>{"name": "w", "arguments": {"t": "x </tool_call> y')
    assert never.tool_calls == [] and never.content.startswith("<tool_call>")


def test_without_tools_a_tool_call_is_text():
    text = 'Sure.\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    out = parse_assistant_output(text, tools=False)
    assert out.tool_calls == [] and out.content == text
    parser = StreamingOutputParser(tools=False)
    events = parser.feed(text) + parser.finish()
    assert events == [ContentDelta(text)] and parser.result() == out


def test_unterminated_tool_call_and_stray_end_think():
    out = parse_assistant_output('ok </think>then <tool_call>{"name": "f", "arguments": {}}')
    assert out.content == 'ok then <tool_call>{"name": "f", "arguments": {}}' and out.tool_calls == []


def test_prompt_opens_reasoning():
    msgs = [{"role": "user", "content": "q"}]
    assert not prompt_opens_reasoning(render_chat(msgs, enable_thinking=True))
    assert not prompt_opens_reasoning(render_chat(msgs, enable_thinking=False))
    assert prompt_opens_reasoning(render_chat(msgs) + "<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\nx</think>\n")


def _stream(text: str, cuts: list[int], in_reasoning: bool, once: bool = False, tools=True, calls_only=False):
    parser = StreamingOutputParser(in_reasoning=in_reasoning, tools=tools, reasoning_once=once, calls_only=calls_only)
    events = []
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        events += parser.feed(text[a:b])
    events += parser.finish()
    return parser, events


def _check_stream_equals_batch(text: str, cuts: list[int], in_reasoning: bool, once: bool = False,
                               tools=True, calls_only=False) -> None:
    parser, events = _stream(text, cuts, in_reasoning, once, tools, calls_only)
    batch = parse_assistant_output(text, in_reasoning=in_reasoning, tools=tools, reasoning_once=once,
                                   calls_only=calls_only)
    assert parser.result() == batch, (text, cuts)
    assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == batch.content
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    assert reasoning == (batch.reasoning or "")
    calls = [e for e in events if isinstance(e, ToolCallEvent)]
    assert [e.tool_call for e in calls] == batch.tool_calls and [e.index for e in calls] == list(range(len(calls)))
    assert all(e.text for e in events if not isinstance(e, ToolCallEvent))


FRAGMENTS = ["<think>", "</think>", "<tool_call>", "</tool_call>", '{"name": "f", "arguments": {"a": [1, "<"]}}',
             '\n{"name": "g", "arguments": {}}\n', '{"name": ', "<", "</", "<thi", "</thin", "<tool_", "</tool_c",
             "think>", '{"name": "w", "arguments": {"t": "', "hello", " world", "\n", "\n\n", "  ", "x<y", "日本語", "🦫", "a</b>", "<tool_response>", "é"]


def test_streaming_parser_one_char_at_a_time_equals_batch():
    rng = random.Random(0)
    texts = [
        "<think>\nreasoning here\n</think>\n\nAnswer with <b>html</b> & a < b.",
        'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n<tool_call>\n{bad}\n</tool_call>\n',
        "done thinking</think>content<thi",
    ] + ["".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 30))) for _ in range(300)]
    for i, text in enumerate(texts):
        _check_stream_equals_batch(text, list(range(1, len(text))), in_reasoning=i % 3 == 0)


def test_streaming_parser_random_chunks_equals_batch():
    rng = random.Random(1)
    for i in range(400):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 40)))
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12)))) if text else []
        _check_stream_equals_batch(text, cuts, in_reasoning=rng.random() < 0.3, calls_only=i % 4 == 0)


def test_a_reply_of_calls_alone_drops_a_call_never_closed():
    """calls_only (tool_choice required or named): the call max_tokens cut short is no content, streamed or not;
    without it, it stays in the content as written."""
    text = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "g", "argu'
    for calls_only, content in ((True, ""), (False, '<tool_call>\n{"name": "g", "argu')):
        got = parse_assistant_output(text, calls_only=calls_only)
        assert (got.content, [c.name for c in got.tool_calls]) == (content, ["f"])
        for cut in range(1, len(text)):
            _check_stream_equals_batch(text, [cut], in_reasoning=False, once=True, calls_only=calls_only)


def test_a_constrained_replys_parser_reads_reasoning_only_at_its_start():
    """reasoning_once (JSON mode, schemas, forced tool calls): `<think>` opens reasoning only before any content, and
    once reasoning closes or content begins the tags are text (a JSON string may hold them); streamed or not, for
    any cut of the text."""
    cases = {
        '<think>\nr\n</think>\n\n{"a": "<think> x </think>"}': ("r", '{"a": "<think> x </think>"}', []),
        '{"a": "<think>", "b": "</think>"}': (None, '{"a": "<think>", "b": "</think>"}', []),
        '\n<tool_call>\n{"name": "f", "arguments": {"s": "</think><think>"}}\n</tool_call>':
            (None, "", [ToolCall("f", {"s": "</think><think>"})]),
        "<think>a</think><think>b</think>{}": ("a", "<think>b</think>{}", []),
    }
    for text, (reasoning, content, calls) in cases.items():
        got = parse_assistant_output(text, reasoning_once=True)
        assert (got.reasoning, got.content, got.tool_calls) == (reasoning, content, calls), text
        _check_stream_equals_batch(text, list(range(1, len(text))), in_reasoning=False, once=True)
    assert parse_assistant_output('{"a": "<think>"}').content == '{"a": "'  # without it: split there
    rng = random.Random(3)
    for _ in range(400):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 40)))
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12)))) if text else []
        _check_stream_equals_batch(text, cuts, in_reasoning=rng.random() < 0.3, once=True)


def test_at_most_max_calls_streamed_or_not():
    rng = random.Random(2)
    for _ in range(200):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 40)))
        batch = parse_assistant_output(text, max_calls=1)
        assert batch.tool_calls == parse_assistant_output(text).tool_calls[:1]
        parser = StreamingOutputParser(max_calls=1)
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12)))) if text else []
        events = [e for a, b in zip([0, *cuts], [*cuts, len(text)]) for e in parser.feed(text[a:b])] + parser.finish()
        assert parser.result() == batch
        assert [e.tool_call for e in events if isinstance(e, ToolCallEvent)] == batch.tool_calls


def test_streaming_parser_never_emits_partial_tags():
    parser = StreamingOutputParser()
    assert parser.feed("Hello <thi") == [ContentDelta("Hello")]
    assert parser.feed("nk>deep") == [ReasoningDelta("deep")]
    assert parser.feed(" thought</th") == [ReasoningDelta(" thought")]
    assert parser.feed("ink>\n\nok <tool") == [ContentDelta(" \n\nok")]  # whitespace held, then joined
    assert parser.feed('_call>{"name": "f", "arguments": {"x": 1}}</tool_') == []
    assert parser.feed("call>") == [ToolCallEvent(0, ToolCall("f", {"x": 1}))]
    assert parser.feed(" tail <") == [ContentDelta("  tail")]
    assert parser.finish() == [ContentDelta(" <")]
    assert parser.result() == parse_assistant_output(
        'Hello <think>deep thought</think>\n\nok <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call> tail <')


@pytest.mark.parametrize("first", ['<tool_call>\n{"name": "a", "arguments": {"x": 1}\n</tool_call>',
                                   "<tool_call>\n</tool_call>"])
def test_a_malformed_call_does_not_swallow_the_next(first):
    """Only a JSON string left open can hold a `</tool_call>`: a body missing a brace, or empty, ends at its tag
    and the valid call after it is still a call."""
    text = first + '\n<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>'
    assert [c.name for c in parse_assistant_output(text).tool_calls] == ["b"]
    for cut in range(1, len(text)):
        _check_stream_equals_batch(text, [cut], in_reasoning=False)


@pytest.mark.parametrize("body", ['{"name": "f", "arguments": {"n": ' + "1" * 5000 + "}}",
                                  '{"name": "f", "arguments": {"n": ' + "1" * 5000 + ', "s": "a'],
                         ids=["whole", "string_left_open"])
def test_a_call_with_an_integer_past_pythons_digit_limit_is_content(body):
    """Python refuses to parse integers of more than 4300 digits with a plain ValueError (no JSON position): such
    a call (a model repeating a digit) is not a call and stays in the content, streamed or not."""
    text = f"Before <tool_call>{body}</tool_call> after"
    out = parse_assistant_output(text)
    assert out.tool_calls == [] and out.content == text
    for cut in (8, 20, len(text) - 9, len(text) - 3):
        _check_stream_equals_batch(text, [cut], in_reasoning=False)


def test_a_prompt_without_turn_markers_is_read_whole_for_open_reasoning():
    """A template that writes no `<|im_start|>` (its own turn markup) still opens reasoning with a final
    `<think>`, as the engine reads the prompt's tokens."""
    assert prompt_opens_reasoning("User: q\nAssistant: <think>\n")
    assert prompt_opens_reasoning("<think>")
    assert not prompt_opens_reasoning("User: q\nAssistant: <think>\nr\n</think>\n\n")
    assert not prompt_opens_reasoning("User: q\nAssistant: ")


# ---------------------------------------------------------------------------------------------- XML calls

XML_PARAMS = {"type": "object", "properties": {
    "path": {"type": "string"}, "count": {"type": "integer"}, "ratio": {"type": "number"},
    "force": {"type": "boolean"}, "options": {"type": "object"}, "tags": {"type": "array", "items": {"type": "string"}},
    "note": {"anyOf": [{"type": "string"}, {"type": "null"}]}, "mode": {"enum": ["r", "w"]}}, "required": ["path"]}
XML_TOOLS = [{"type": "function", "function": {"name": "edit", "parameters": XML_PARAMS}},
             {"type": "function", "function": {"name": "ping"}}]
XML = CallSyntax("xml", {t["function"]["name"]: xml_param_kinds(t["function"].get("parameters")) for t in XML_TOOLS})


def _xml_call(name: str, *params: tuple[str, str]) -> str:
    """A call as the XML templates write it (each value's text as given)."""
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def test_the_call_format_is_the_chat_templates(tmp_path):
    """A template whose text holds `<function=` (Qwen3.5 / Qwen3.6) writes XML calls; the built-in one JSON; a model
    folder's chat_template.jinja settles it for its tokenizer."""
    assert template_call_format(default_chat_template()) == "json"
    assert template_call_format(XML_CHAT_TEMPLATE) == "xml"
    assert template_call_format("<function=example>{json}</function>") == "json"  # no <parameter=: not this form
    from decapybara.tokenizer import Tokenizer

    assert Tokenizer.from_json(make_tokenizer_json()).tool_format == "json"
    assert Tokenizer.from_json(make_tokenizer_json(), chat_template=XML_CHAT_TEMPLATE).tool_format == "xml"
    (tmp_path / "tokenizer.json").write_text(make_tokenizer_json())
    (tmp_path / "chat_template.jinja").write_text(XML_CHAT_TEMPLATE)
    assert Tokenizer.from_file(tmp_path).tool_format == "xml"


def test_an_xml_calls_values_are_read_by_their_parameters_schema():
    """A string is its raw text (one newline either side is the markup's); integers, numbers, booleans (in any
    case), null, objects and arrays are their JSON; a string beside null is null only as ``null``; an undeclared
    parameter's JSON where it is no string, else its text; what does not parse stays text."""
    call = _xml_call("edit", ("path", "src/a b.py"), ("count", "3"), ("ratio", "0.5"), ("force", "True"),
                     ("options", '{"a": [1, "x"]}'), ("tags", '["x", "y"]'), ("note", "null"), ("mode", "w"),
                     ("extra", "[1]"), ("other", '"quoted"'))
    out = parse_assistant_output("<think>\nr\n</think>\n\nI will edit.\n\n" + call, tools=XML)
    assert (out.reasoning, out.content) == ("r", "I will edit.")
    assert out.tool_calls == [ToolCall("edit", {
        "path": "src/a b.py", "count": 3, "ratio": 0.5, "force": True, "options": {"a": [1, "x"]},
        "tags": ["x", "y"], "note": None, "mode": "w", "extra": [1], "other": '"quoted"'})]
    text = _xml_call("edit", ("path", "\n  indented\n\nlines\n"), ("note", "42"), ("count", "three"),
                     ("options", "{bad"), ("force", "yes"))
    args = parse_assistant_output(text, tools=XML).tool_calls[0].arguments
    assert args == {"path": "\n  indented\n\nlines\n", "note": "42", "count": "three", "options": "{bad",
                    "force": "yes"}
    assert parse_assistant_output(_xml_call("ping"), tools=XML).tool_calls == [ToolCall("ping", {})]
    assert parse_assistant_output(_xml_call("unknown", ("n", "5"), ("s", "five")), tools=XML).tool_calls == [
        ToolCall("unknown", {"n": 5, "s": "five"})]
    # a schema whose keyword the constraint does not enforce (its calls take any parameters): still read by it
    odd = {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 3}, "s": {"type": "string"}}}
    syntax = CallSyntax("xml", {"odd": xml_param_kinds(odd)})
    assert parse_assistant_output(_xml_call("odd", ("n", "6"), ("s", "123")), tools=syntax).tool_calls == [
        ToolCall("odd", {"n": 6, "s": "123"})]


@pytest.mark.parametrize("root, extra", [
    ({"anyOf": [{"required": ["zip"]}, {"required": ["city"]}]}, {}),  # one of them, not enforced in this form
    ({"minProperties": 1}, {}), ({"dependentRequired": {"zip": ["city"]}}, {}),
    ({}, {"lost": {"$ref": "#/$defs/missing"}}), ({}, {"typo": {"type": "strnig"}})])  # a property not readable
def test_an_xml_calls_string_stays_its_text_beside_what_the_constraint_does_not_read(root, extra):
    """Where a tool's parameters hold a keyword the XML constraint does not enforce at their root, or a property
    whose schema cannot be read, the parameters it declares are still read by their schemas: a string that
    reads as JSON of another kind ("12345", "true") stays the text the model wrote (and the unreadable property
    takes any kind)."""
    params = {"type": "object", "properties": {"zip": {"type": "string"}, "city": {"type": "string"},
                                               "n": {"type": "integer"}, **extra}, **root}
    syntax = CallSyntax("xml", {"find": xml_param_kinds(params)})
    text = _xml_call("find", ("zip", "12345"), ("city", "true"), ("n", "7"), *((k, "[1]") for k in extra))
    (call,) = parse_assistant_output(text, tools=syntax).tool_calls
    assert call.arguments == {"zip": "12345", "city": "true", "n": 7, **{k: [1] for k in extra}}


@pytest.mark.parametrize("body", [
    "\n<function=edit>\n<parameter=path>\na\n</parameter>\n",  # no </function>
    "\n<function=edit>\n<parameter=path>\na\n</parameter>\n</function>\ntrailing\n",
    '\n{"name": "edit", "arguments": {"path": "a"}}\n',  # the JSON form, not this template's
    "\n<function=>\n</function>\n", "\n<function=edit\n</function>\n", "\nno call\n",
    "\n<function=edit>\nstray text\n</function>\n", "\n<function=edit>\n<parameter=>\nx\n</parameter>\n</function>\n",
    "\n<function=edit>\n<parameter=path>\nnever closed\n</function>\n"])
def test_a_malformed_xml_call_stays_content_verbatim(body):
    text = f"Before <tool_call>{body}</tool_call> after"
    out = parse_assistant_output(text, tools=XML)
    assert out.tool_calls == [] and out.content == text
    for size in (1, 3, len(text)):
        _check_stream_equals_batch(text, list(range(size, len(text), size)), in_reasoning=False, tools=XML)


def test_a_closing_tag_inside_an_xml_value_does_not_close_the_call():
    """A value writing about tool calls holds `</tool_call>` (and `</parameter>` not after a newline): the call runs
    to the tag that closes it."""
    value = "a </tool_call> b </parameter> c"
    text = "Saving.\n" + _xml_call("edit", ("path", value)) + "\nDone."
    out = parse_assistant_output(text, tools=XML)
    assert out.tool_calls == [ToolCall("edit", {"path": value})] and out.content == "Saving.\n\nDone."
    never = parse_assistant_output("<tool_call>\n<function=edit>\n<parameter=path>\nx </tool_call> y", tools=XML)
    assert never.tool_calls == [] and never.content.startswith("<tool_call>")


def test_an_xml_value_written_without_its_newline_ends_at_its_tag():
    """A value the model wrote without the newline before ``</parameter>`` (``src/a.py</parameter>``, as models
    write where nothing constrains them) ends there, as vLLM's and SGLang's qwen3_coder parsers read it: not at a
    later ``\n</parameter>`` (which ran it on into the next calls), nor is the call lost; a ``</parameter>`` that
    no tag follows (a line of a file that holds it) stays text. Streamed as the batch parser reads it."""
    short = ("<tool_call>\n<function=edit>\n<parameter=path>\nsrc/a.py</parameter>\n<parameter=count>\n5</parameter>"
             "\n</function>\n</tool_call>")
    xml_file = "<a>\n<parameter>\nx\n</parameter>\n</a>"
    text = "Two.\n" + short + "\n" + _xml_call("edit", ("path", xml_file)) + "\n" + _xml_call("ping")
    out = parse_assistant_output(text, tools=XML)
    assert out.tool_calls == [ToolCall("edit", {"path": "src/a.py", "count": 5}),
                              ToolCall("edit", {"path": xml_file}), ToolCall("ping", {})]
    assert out.content == "Two."
    for cut in range(1, len(text)):
        _check_stream_equals_batch(text, [cut], in_reasoning=False, tools=XML)


def test_an_xml_value_ends_at_its_tag_whatever_whitespace_follows_it():
    """A ``</parameter>`` followed by spaces, tabs, CRs or line breaks and then the next tag (or by the tag at once)
    ends its value, less one line break (``\n`` or ``\r\n``) before the tag, as vLLM's qwen3_coder parser reads
    it: a trailing space or tab, CRLF line endings and ``</parameter></function>`` keep the call; a
    ``</parameter>`` that no tag follows (after the whitespace) stays text. Streamed as the batch parser reads it."""
    spaced = ("<tool_call>\n<function=edit>\n<parameter=path>\na.py\n</parameter> \n<parameter=count>\n5\n</parameter>"
              "\t\n</function>\n</tool_call>")
    crlf = ("<tool_call>\r\n<function=edit>\r\n<parameter=path>\r\nb.py\r\n</parameter>\r\n<parameter=count>\r\n6"
            "\r\n</parameter>\r\n</function>\r\n</tool_call>")
    tight = ("<tool_call><function=edit><parameter=path>c.py</parameter><parameter=count>7</parameter></function>"
             "</tool_call>")
    kept = _xml_call("edit", ("path", "x</parameter> y\r\n</parameter>\t<z>\n</parameter> \r\n"))
    text = "Four.\n" + spaced + "\n" + crlf + "\n" + tight + "\n" + kept
    out = parse_assistant_output(text, tools=XML)
    assert out.tool_calls == [ToolCall("edit", {"path": "a.py", "count": 5}),
                              ToolCall("edit", {"path": "b.py", "count": 6}), ToolCall("edit", {"path": "c.py", "count": 7}),
                              ToolCall("edit", {"path": "x</parameter> y\r\n</parameter>\t<z>\n</parameter> \r\n"})]
    assert out.content == "Four."
    for cut in range(1, len(text)):
        _check_stream_equals_batch(text, [cut], in_reasoning=False, tools=XML)
    # the end at the body's end: the </tool_call> after a </parameter> is the call's (no </function>: text)
    cut = ("<tool_call>\n<function=edit>\n<parameter=path>\na </parameter> \r\n</tool_call> b\n</parameter>\n"
           "</function>\n</tool_call>")
    out = parse_assistant_output(cut, tools=XML)
    assert (out.tool_calls, out.content) == ([], cut)
    for size in (1, 2, 5):
        _check_stream_equals_batch(cut, list(range(size, len(cut), size)), in_reasoning=False, tools=XML)


def test_xml_calls_streamed_in_any_chunks_are_the_batch_ones():
    """Reasoning, text, two calls and a malformed block, streamed 1, 3 or all characters at a time, and at every
    single cut: the same calls, content and reasoning as the batch parser's."""
    text = ("<think>\nplan it\n</think>\n\nFirst.\n\n"
            + _xml_call("edit", ("path", "x </tool_call> y"), ("count", "7"), ("options", '{"k": "v"}'))
            + "\n" + _xml_call("ping") + "\n<tool_call>\n<function=edit>\nbad\n</tool_call>\nLast.")
    batch = parse_assistant_output(text, tools=XML)
    assert [c.name for c in batch.tool_calls] == ["edit", "ping"] and batch.reasoning == "plan it"
    assert batch.tool_calls[0].arguments == {"path": "x </tool_call> y", "count": 7, "options": {"k": "v"}}
    for size in (1, 3, len(text)):
        _check_stream_equals_batch(text, list(range(size, len(text), size)), in_reasoning=False, tools=XML)
    for cut in range(1, len(text)):
        _check_stream_equals_batch(text, [cut], in_reasoning=False, tools=XML)


def test_an_xml_call_sent_back_renders_as_the_model_wrote_it():
    """The model's call, parsed and sent back (arguments as a JSON string or an object), renders through its
    template to the very text it wrote: strings raw (several lines), integers, booleans and objects as JSON."""
    from decapybara.api.common import call_arguments

    call = _xml_call("edit", ("path", "a.py\nsecond line"), ("count", "12"), ("force", "false"),
                     ("options", '{"depth": 2, "names": ["a", "b"]}'))
    written = f"<think>\nCheck.\n</think>\n\nEditing.\n\n{call}"
    user = [{"role": "user", "content": "Edit it."}]
    prompt = render_chat(user, XML_TOOLS, template=XML_CHAT_TEMPLATE)
    out = parse_assistant_output(written, tools=XML)
    for arguments in (out.tool_calls[0].arguments_json(), out.tool_calls[0].arguments):
        sent = {"role": "assistant", "content": out.content, "reasoning_content": out.reasoning,
                "tool_calls": [_call("edit", call_arguments(arguments))]}
        again = render_chat([*user, sent, {"role": "tool", "content": "ok"}], XML_TOOLS, template=XML_CHAT_TEMPLATE)
        assert again.startswith(prompt + written + "<|im_end|>\n"), again
