"""ChatML rendering (a sandboxed Jinja2 chat template) and parsing of what the model writes back.

`render_chat` renders exactly what transformers' `apply_chat_template(..., tokenize=False)` renders for the same
template and inputs: same sandbox, same globals and `tojson`, same whitespace settings, same message clean-up.
`parse_assistant_output` and `StreamingOutputParser` split model output into reasoning (`<think>...</think>`),
content and tool calls; the streaming parser gives the same result as the batch one however the text is cut into
deltas.

A call's body (between `<tool_call>` and `</tool_call>`) is in one of two forms (`CallSyntax`), the one the chat
template writes (`template_call_format`):
- "json" (Qwen2.5 / Qwen3 templates): ``{"name": NAME, "arguments": {...}}``;
- "xml" (Qwen3.5 / Qwen3.6 / Qwen3-Coder templates, whose text holds ``<function=`` and ``<parameter=``)::

      <function=NAME>
      <parameter=KEY>
      VALUE
      </parameter>
      </function>

  a VALUE is the text after ``<parameter=KEY>`` (and one newline, ``\n`` or ``\r\n``) up to the ``</parameter>``
  that ends it, less one newline before that tag (`read_xml_value`: the first ``</parameter>`` followed by
  whitespace, or none, and the next tag, so a value written without the newline, ``src/a.py</parameter>``, with a
  space or tab after the tag, or with CRLF line ends, as models write where nothing constrains them, ends there
  too, as vLLM's and SGLang's qwen3_coder parsers read it); raw text for a
  string parameter, JSON text for others (the templates write ``value|string`` or ``value|tojson``). Each value is
  read by the kinds of value its parameter's schema admits (`ParamKinds`, which
  `engine.json_schema.xml_param_kinds` finds, as the constraint that writes XML calls does; `xml_value` says how).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from functools import cache, lru_cache
from importlib import resources
from typing import Any, ClassVar

import jinja2
import jinja2.defaults
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from decapybara.errors import ConfigError, InvalidRequestError

ROLES = ("system", "user", "assistant", "tool")
# Names a message's reasoning may come under; templates read the first (transformers aliases the others).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

THINK, END_THINK = "<think>", "</think>"
TOOL_CALL, END_TOOL_CALL = "<tool_call>", "</tool_call>"
# the XML form's markup (`CallSyntax`): a value ends at an END_PARAMETER that whitespace (XML_SPACE, or none) and
# one of VALUE_NEXT (or the body's end) follow (`read_xml_value`)
FUNCTION, END_FUNCTION = "<function=", "</function>"
PARAMETER, END_PARAMETER = "<parameter=", "</parameter>"
VALUE_NEXT = (PARAMETER, END_FUNCTION, END_TOOL_CALL)
XML_SPACE = JSON_SPACE = " \t\r\n"
CALL_FORMATS = ("json", "xml")


@cache
def default_chat_template() -> str:
    """The packaged Qwen3-style ChatML template (decapybara/templates/qwen_chatml.jinja)."""
    return (resources.files("decapybara") / "templates" / "qwen_chatml.jinja").read_text(encoding="utf-8")


def template_call_format(template: str) -> str:
    """The form a chat template writes tool calls in (`CallSyntax`): "xml" where its text holds ``<function=`` and
    ``<parameter=`` (Qwen3.5 / Qwen3.6 / Qwen3-Coder templates, which instruct and render calls that way), else
    "json"."""
    return "xml" if FUNCTION in template and PARAMETER in template else "json"


# ----------------------------------------------------------------------------------------------- rendering


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (assistant-mask markers in HF templates): renders its body as is."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore-prefixed attributes, as transformers' sandbox does."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]  # NOTE: as jinja's Namespace, so namespace(self=...) works
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes ({name!r})")


class _TemplateDict:
    """`dict(...)` for templates, without exposing the `dict` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # NOTE: transformers replaces Jinja's tojson (which HTML-escapes) with plain json.dumps; we must match it.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


# Names every template sees from its environment (jinja2's defaults and the helpers below); a template variable
# may not shadow them.
TEMPLATE_GLOBALS = frozenset(jinja2.defaults.DEFAULT_NAMESPACE) | {"raise_exception", "strftime_now", "dict",
                                                                    "namespace"}


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                       namespace=_Namespace)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(f"chat template does not compile: {exc}") from exc


def _plain(value: Any) -> Any:
    """A fresh copy made of plain JSON types only (the template never sees caller objects)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    for kind in (bool, str, int, float):  # subclasses (enums, numpy scalars) lose their extra methods
        if isinstance(value, kind):
            return kind(value)
    raise InvalidRequestError(f"unsupported value of type {type(value).__name__} in chat input")


def _check_content(content: Any, where: str, required: bool) -> None:
    if content is None:
        if required:
            raise InvalidRequestError(f"{where}: content is required")
        return
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise InvalidRequestError(f"{where}: content must be a string or a list of text parts")
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise InvalidRequestError(f"{where}: content part {j} has type {kind!r}; only 'text' parts are supported")
        if not isinstance(part.get("text"), str):
            raise InvalidRequestError(f"{where}: content part {j} needs a string 'text'")


def _check_tool_calls(calls: Any, where: str) -> None:
    if not isinstance(calls, list):
        raise InvalidRequestError(f"{where}: tool_calls must be a list")
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidRequestError(f"{where}: tool_calls[{j}] needs a function with a non-empty name")
        if not isinstance(fn.get("arguments", {}), (dict, str)):
            raise InvalidRequestError(f"{where}: tool_calls[{j}].function.arguments must be an object or a string")


def validate_messages(messages: Any, tools: Any = None) -> None:
    """Raise InvalidRequestError unless `messages` (and `tools`) are in the internal chat form."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list")
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise InvalidRequestError(f"{where} must be an object")
        role = msg.get("role")
        if role not in ROLES:
            raise InvalidRequestError(f"{where}: unknown role {role!r} (expected one of {', '.join(ROLES)})")
        content = msg.get("content")
        if role == "assistant":
            if content is None and not msg.get("tool_calls") and msg.get("reasoning_content") is None:
                raise InvalidRequestError(f"{where}: an assistant message needs content or tool_calls")
            _check_content(content, where, required=False)
            if msg.get("tool_calls") is not None:
                _check_tool_calls(msg["tool_calls"], where)
            if not isinstance(msg.get("reasoning_content", ""), (str, type(None))):
                raise InvalidRequestError(f"{where}: reasoning_content must be a string")
        else:
            _check_content(content, where, required=True)
            if msg.get("tool_calls"):
                raise InvalidRequestError(f"{where}: only assistant messages may carry tool_calls")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise InvalidRequestError("tools must be a list of objects (JSON schemas)")


def render_chat(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                add_generation_prompt: bool = True, enable_thinking: bool = True, template: str | None = None,
                **template_vars: Any) -> str:
    """Render a conversation to the prompt text; bad messages raise InvalidRequestError.

    Matches `apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=...,
    enable_thinking=..., **template_vars)` of transformers for the same template (the default one when None).
    """
    validate_messages(messages, tools)
    shadowing = TEMPLATE_GLOBALS.intersection(template_vars)
    if shadowing:
        raise InvalidRequestError(f"template variables may not replace the template's {sorted(shadowing)}")
    chat = []
    for msg in _plain(messages):
        msg = {k: v for k, v in msg.items() if v is not None}  # as transformers: None means absent
        reasoning = next((msg[k] for k in _REASONING_FIELDS if msg.get(k) is not None), None)
        if reasoning is not None:
            msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
        chat.append(msg)
    compiled = _compile(template if template is not None else default_chat_template())
    try:
        return compiled.render(messages=chat, tools=_plain(tools), documents=None,
                               add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking,
                               **_plain(template_vars))
    except jinja2.TemplateError as exc:
        raise InvalidRequestError(f"chat template rejected the conversation: {exc}") from exc
    except (TypeError, ValueError, AttributeError, KeyError, IndexError) as exc:  # a value of the wrong kind
        raise InvalidRequestError(f"chat template cannot render the conversation: {exc}") from exc


def prompt_opens_reasoning(prompt: str) -> bool:
    """True when the prompt's final turn left a `<think>` open, so the model's output starts inside reasoning."""
    tail = prompt[max(prompt.rfind("<|im_start|>"), 0):]  # a prompt without turn markers: all of it
    return tail.rfind(THINK) > tail.rfind(END_THINK)


# ----------------------------------------------------------------------------------------------- output parsing


@dataclass(slots=True, frozen=True)
class ToolCall:
    """One call the model asked for; `arguments` is the decoded JSON object."""

    name: str
    arguments: dict[str, Any]

    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass(slots=True)
class ParsedOutput:
    """Model output split into parts; `reasoning` is None when the output had no reasoning section."""

    reasoning: str | None
    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"number out of range: {text}")
    return value


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


def strict_json(text: str) -> Any:
    """`json.loads` of RFC 8259 JSON only: NaN, Infinity, numbers past the float range and strings holding a lone
    surrogate (``"\\ud800"``: no Unicode text, so no UTF-8 response can carry it) raise ValueError, so what is
    parsed can be written back as JSON that any client parses."""
    value = json.loads(text, parse_float=_finite, parse_constant=_no_constant)
    if "\\u" in text:  # only an escape can make a surrogate here (the text itself is decoded UTF-8)
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("a string holds a lone surrogate") from None
    return value


def parse_tool_call(body: str) -> ToolCall | None:
    """The call in a `<tool_call>` body, or None unless it is a JSON object (strict JSON, `strict_json`) with a
    name and object arguments."""
    try:
        obj = strict_json(body)
    except (ValueError, RecursionError):  # RecursionError: nested past the parser's depth
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models double-encode the arguments
        try:
            args = strict_json(args)
        except (ValueError, RecursionError):
            return None
    return ToolCall(obj["name"], args) if isinstance(args, dict) else None


def _cut_short(body: str) -> bool:
    """Whether a `<tool_call>` body that is no call ends inside a JSON string left open: its text held a
    `</tool_call>` (as a call writing a file about tool calls does), which then closed nothing. Only a string can
    hold the tag, so any other error ends the call at its tag."""
    try:
        json.loads(body, parse_int=str)  # (an integer past Python's digit limit is no syntax error here)
    except json.JSONDecodeError as e:
        return e.msg.startswith("Unterminated string")
    except ValueError:  # not JSON text at all
        pass
    except RecursionError:  # nested past the parser's depth: no string left open is known
        pass
    return False


# ----------------------------------------------------------------------------------------------- XML calls


@dataclass(slots=True, frozen=True)
class ParamKinds:
    """The kinds of value each parameter of a tool admits, by name (JSON types, integers counted as "number";
    None: any kind), and `extra`, those of a parameter it does not declare (None: any)."""

    kinds: Mapping[str, frozenset[str] | None] = field(default_factory=dict)
    extra: frozenset[str] | None = None
    # of a parameter that admits strings beside other kinds (`value_form` "text"): whether the JSON text of a value
    # of another kind is one its schema accepts (the constraint's automaton of it reads it), else the value is the
    # string; by name, and `extra_json` for a parameter it does not declare (None: any such text is)
    json_ok: Mapping[str, Callable[[str], bool]] = field(default_factory=dict)
    extra_json: Callable[[str], bool] | None = None

    def of(self, name: str) -> frozenset[str] | None:
        return self.kinds.get(name, self.extra)

    def json_of(self, name: str) -> Callable[[str], bool] | None:
        return self.json_ok.get(name) if name in self.kinds else self.extra_json


def value_form(kinds: frozenset[str] | None) -> str:
    """How an XML call writes a value of `kinds` (`ParamKinds`): "string" (strings only: the raw text), "json"
    (no strings: JSON text), or "text" (a string beside other kinds, or any kind: raw text or JSON)."""
    if kinds is not None and kinds == {"string"}:
        return "string"
    return "json" if kinds is not None and "string" not in kinds else "text"


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    return "string" if isinstance(value, str) else "array" if isinstance(value, list) else "object"


# JSON's literals as a template's ``value|string`` writes them (Qwen3.5's, Qwen3-Coder's: Python's spelling)
PYTHON_LITERALS = {"true": "True", "false": "False", "null": "None"}


def xml_value(text: str, kinds: frozenset[str] | None, json_ok: Callable[[str], bool] | None = None) -> Any:
    """An XML call's VALUE text read by its parameter's `kinds` (`value_form`), as vLLM's and SGLang's qwen3_coder
    parsers read it: "string", the text itself; "json", its JSON value (strict, `strict_json`), else a boolean
    written in any case (``True``, as a template's ``value|string`` writes one), or null written ``None`` (ditto,
    `PYTHON_LITERALS`), where the parameter admits one, else the text; "text", its JSON value where that is of a
    kind other than a string the parameter admits and its JSON text (less surrounding whitespace) passes
    `json_ok` (`ParamKinds.json_of`: a number within the schema's bounds, say; None: any), else the text (so that a
    string that reads as JSON of another kind, or as a value the schema refuses, ``-5`` beside ``"minimum": 0``,
    stays the string the template writes back as it was: where vLLM and SGLang read ``-5``)."""
    form = value_form(kinds)
    if form == "string":
        return text
    try:
        value = strict_json(text)
    except (ValueError, RecursionError):
        word = text.strip()
        if form == "json" and "boolean" in kinds and word.lower() in ("true", "false"):
            return word.lower() == "true"
        if form == "json" and "null" in kinds and word == PYTHON_LITERALS["null"]:
            return None
        return text
    if form == "json":
        return value
    if isinstance(value, str) or (kinds is not None and _kind(value) not in kinds):
        return text
    return value if json_ok is None or json_ok(text.strip(JSON_SPACE)) else text


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in XML_SPACE:
        pos += 1
    return pos


def read_xml_value(body: str, pos: int) -> tuple[str, int] | None:
    """(the text of the value that starts at `pos` of an XML call's body, the position after its
    ``</parameter>``), or None where no ``</parameter>`` ends it. The end is the first ``</parameter>`` followed by
    whitespace (`XML_SPACE`: spaces, tabs, CRs, newlines; or none), then a `VALUE_NEXT` tag (the next parameter,
    ``</function>``) or the body's end (where the ``</tool_call>`` it was cut at stood); the text is what comes
    before it, less one newline at its end, ``\n`` or ``\r\n`` (the template's: ``\n</parameter>\n``, or a
    model's ``VALUE</parameter>\n``, ``VALUE\r\n</parameter> \r\n``, ``VALUE</parameter></function>``). So a
    value may hold ``</parameter>`` anywhere no tag follows it, on a line of its own too (a file that holds the
    tag), and an end the model wrote without its newline, or with a space after it, does not run on to a later
    one (as vLLM's qwen3_coder parser ends a value at a ``</parameter>`` that whitespace and a known tag or the
    end follow; SGLang's at the first one, whatever follows)."""
    end = pos
    while (end := body.find(END_PARAMETER, end)) >= 0:
        end += len(END_PARAMETER)
        nxt = _skip_ws(body, end)
        if nxt == len(body) or body.startswith(VALUE_NEXT, nxt):
            text = body[pos:end - len(END_PARAMETER)]
            return text[:-len(newline)] if (newline := _newline_at_end(text)) else text, end
    return None


def _newline_at_end(text: str) -> str:
    """The line break `text` ends with (``\r\n`` or ``\n``), or ""."""
    return "\r\n" if text.endswith("\r\n") else "\n" if text.endswith("\n") else ""


def _xml_name(body: str, pos: int, opener: str) -> tuple[str, int] | None:
    """The name of `opener` (``<function=`` or ``<parameter=``) at `pos` up to its ``>``, and the position after
    that; None where there is none (no opener, an empty name, or one that runs past a line or a tag)."""
    if not body.startswith(opener, pos):
        return None
    start = pos + len(opener)
    end = body.find(">", start)
    name = body[start:end] if end >= 0 else ""
    if not name or "\n" in name or "<" in name:
        return None
    return name, end + 1


def _read_xml_call(body: str, params: Mapping[str, ParamKinds]) -> tuple[ToolCall | None, bool]:
    """(the call in an XML body or None, whether the body ends inside a parameter's value). A call is
    ``<function=NAME>`` then parameters ``<parameter=KEY>`` VALUE ``</parameter>`` (after one newline, ``\n`` or
    ``\r\n``, up to its end: `read_xml_value`), then ``</function>``, whitespace between them and at the ends; a
    later value of a key replaces an earlier one."""
    head = _xml_name(body, _skip_ws(body, 0), FUNCTION)
    if head is None:
        return None, False
    name, pos = head
    kinds = params.get(name, ParamKinds())
    args: dict[str, Any] = {}
    while True:
        pos = _skip_ws(body, pos)
        if body.startswith(END_FUNCTION, pos):
            whole = _skip_ws(body, pos + len(END_FUNCTION)) == len(body)
            return (ToolCall(name, args) if whole else None), False
        key = _xml_name(body, pos, PARAMETER)
        if key is None:
            return None, False
        key_name, pos = key
        if body.startswith("\n", pos):
            pos += 1
        elif body.startswith("\r\n", pos):
            pos += 2
        value = read_xml_value(body, pos)
        if value is None:
            return None, True
        text, pos = value
        args[key_name] = xml_value(text, kinds.of(key_name), kinds.json_of(key_name))


@dataclass(slots=True, frozen=True)
class CallSyntax:
    """The form of a call's body (module docstring): `format` "json" or "xml"; `params`, each offered tool's
    `ParamKinds` by name (the XML form reads values by them; a tool not in it takes any kind)."""

    format: str = "json"
    params: Mapping[str, ParamKinds] = field(default_factory=dict)

    def parse(self, body: str) -> ToolCall | None:
        """The call a `<tool_call>` body holds, or None."""
        if self.format == "xml":
            return _read_xml_call(body, self.params)[0]
        return parse_tool_call(body)

    def cut_short(self, body: str) -> bool:
        """Whether a body that is no call ends inside a value (JSON: a string left open; XML: a parameter's value
        without its end), so that the `</tool_call>` it stopped at was the value's text, not the close."""
        if self.format == "xml":
            return _read_xml_call(body, self.params)[1]
        return _cut_short(body)


JSON_CALLS = CallSyntax()


def _syntax(tools: bool | CallSyntax | None) -> CallSyntax | None:
    """The parsers' `tools` argument as a syntax: None (calls are text), True (the JSON form) or a syntax."""
    if isinstance(tools, CallSyntax):
        return tools
    return JSON_CALLS if tools else None


def parse_assistant_output(text: str, in_reasoning: bool = False, tools: bool | CallSyntax | None = True,
                           max_calls: int | None = None, reasoning_once: bool = False,
                           calls_only: bool = False) -> ParsedOutput:
    """Split a whole completion into reasoning, content and tool calls; never raises on odd text.

    `in_reasoning`: the prompt already opened `<think>` (see `prompt_opens_reasoning`), so the text starts
    inside reasoning. Reasoning is every `<think>` section, content the text outside them and outside valid
    tool calls, each stripped of surrounding whitespace. A `</tool_call>` inside the call's JSON (a body cut short
    there) does not close it (nor one inside an XML call's value). A `<tool_call>` block whose body is not a valid
    call, or one never closed, stays in the content verbatim. `tools`: the calls' form (`CallSyntax`; True: JSON),
    or False / None: `<tool_call>` is text. `max_calls`: valid calls past it are dropped.
    A stray `</think>` in content is dropped. `reasoning_once` (a constrained reply, whose answer may hold the
    tags' text inside its JSON strings): reasoning opens only before any content, and once it closes, or content
    has begun, `<think>` and `</think>` are text. `calls_only` (a reply constrained to tool calls alone): a call
    never closed (cut by max_tokens) is dropped, not content.
    """
    syntax = _syntax(tools)
    reasoning: list[str] = []
    content: list[str] = []
    calls: list[ToolCall] = []
    has_reasoning, pos, thinking = in_reasoning, 0, in_reasoning
    settled = False  # reasoning_once: the tags are text from here on
    while pos < len(text):
        if thinking:
            end = text.find(END_THINK, pos)
            reasoning.append(text[pos:] if end < 0 else text[pos:end])
            if end < 0:
                break
            pos, thinking, settled = end + len(END_THINK), False, reasoning_once
            continue
        tags = (THINK, END_THINK, TOOL_CALL) if syntax else (THINK, END_THINK)
        hits = [(i, tag) for tag in tags if (i := text.find(tag, pos)) >= 0]
        if not hits:
            content.append(text[pos:])
            break
        start, tag = min(hits)
        settled |= reasoning_once and bool(text[pos:start].strip())
        if settled and tag in (THINK, END_THINK):
            content.append(text[pos:start + len(tag)])
            pos = start + len(tag)
            continue
        content.append(text[pos:start])
        pos = start + len(tag)
        if tag == THINK:
            has_reasoning = thinking = True
        elif tag == END_THINK:  # stray: dropped
            settled |= reasoning_once
        elif tag == TOOL_CALL:
            end = text.find(END_TOOL_CALL, pos)
            call = syntax.parse(text[pos:end]) if end >= 0 else None
            while end >= 0 and call is None and syntax.cut_short(text[pos:end]):  # the tag was inside a value
                end = text.find(END_TOOL_CALL, end + len(END_TOOL_CALL))
                call = syntax.parse(text[pos:end]) if end >= 0 else None
            if end < 0:
                if not calls_only:
                    content.append(text[start:])
                break
            pos = end + len(END_TOOL_CALL)
            if call is None:
                content.append(text[start:pos])
                settled |= reasoning_once
            elif max_calls is None or len(calls) < max_calls:
                calls.append(call)
    return ParsedOutput("".join(reasoning).strip() if has_reasoning else None, "".join(content).strip(), calls)


@dataclass(slots=True, frozen=True)
class ReasoningDelta:
    text: str


@dataclass(slots=True, frozen=True)
class ContentDelta:
    text: str


@dataclass(slots=True, frozen=True)
class ToolCallEvent:
    """A tool call, emitted once its closing tag arrived and its body parsed."""

    index: int
    tool_call: ToolCall


OutputEvent = ReasoningDelta | ContentDelta | ToolCallEvent


class _Trimmed:
    """Emits a text stream stripped of leading and trailing whitespace, without looking ahead."""

    __slots__ = ("pending", "started")

    def __init__(self) -> None:
        self.started = False
        self.pending = ""  # whitespace seen after the last non-space character

    def push(self, text: str) -> str:
        if not self.started:
            text = text.lstrip()
        body = text.rstrip()
        if not body:
            if self.started:
                self.pending += text
            return ""
        out, self.pending, self.started = self.pending + body, text[len(body):], True
        return out


def _held_suffix(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is a proper prefix of one of `tags`."""
    for n in range(min(len(text), max(len(t) for t in tags) - 1), 0, -1):
        tail = text[-n:]
        if any(t.startswith(tail) for t in tags):
            return n
    return 0


class StreamingOutputParser:
    """Incremental `parse_assistant_output`: feed text deltas, get typed events.

    Contract: concatenating the ReasoningDelta texts gives the batch `reasoning`, the ContentDelta texts the batch
    `content`, and the ToolCallEvents its `tool_calls`, for any cut of the text into deltas. Text that could be
    the start of a tag is held back until it is known, so a partial tag is never emitted.
    """

    _CONTENT_TAGS = (THINK, END_THINK, TOOL_CALL)

    def __init__(self, in_reasoning: bool = False, tools: bool | CallSyntax | None = True,
                 max_calls: int | None = None, reasoning_once: bool = False, continues: bool = False,
                 calls_only: bool = False) -> None:
        """`tools`, `reasoning_once` and `calls_only` as `parse_assistant_output` takes them. `continues`: the text
        continues a part the prompt began (a prefilled reply): that part's leading whitespace is the model's,
        kept."""
        self._calls_only = calls_only
        self._syntax = _syntax(tools)
        self._content_tags = self._CONTENT_TAGS if self._syntax else (THINK, END_THINK)
        self._once = reasoning_once
        self._settled = False  # reasoning_once: the think tags are text from here on
        self._max_calls = max_calls
        self._thinking = in_reasoning
        self._has_reasoning = in_reasoning
        self._in_tool: list[str] | None = None  # body of an open <tool_call>
        self._buf = ""
        self._reasoning, self._content = _Trimmed(), _Trimmed()
        (self._reasoning if in_reasoning else self._content).started = continues
        self._parts: dict[type, list[str]] = {ReasoningDelta: [], ContentDelta: []}
        self._calls: list[ToolCall] = []
        self._events: list[OutputEvent] = []

    def feed(self, delta: str) -> list[OutputEvent]:
        """Consume a delta; return the events it completes (adjacent deltas of one kind merged)."""
        self._buf += delta
        while self._step():
            pass
        return self._take()

    def finish(self) -> list[OutputEvent]:
        """End of output: flush what was held back (a partial tag is text; an open tool call becomes content, or
        is dropped under `calls_only`)."""
        buf, self._buf = self._buf, ""
        if self._in_tool is not None:
            if not self._calls_only:
                self._emit(ContentDelta, TOOL_CALL + "".join(self._in_tool) + buf)
            self._in_tool = None
        else:
            self._emit(ReasoningDelta if self._thinking else ContentDelta, buf)
        return self._take()

    def result(self) -> ParsedOutput:
        """Everything emitted so far, in the batch parser's form."""
        reasoning = "".join(self._parts[ReasoningDelta]) if self._has_reasoning else None
        return ParsedOutput(reasoning, "".join(self._parts[ContentDelta]), list(self._calls))

    def _step(self) -> bool:
        """Process the buffer up to the next tag; False when it must wait for more text."""
        buf = self._buf
        if self._in_tool is not None:
            end = buf.find(END_TOOL_CALL)
            if end < 0:
                keep = _held_suffix(buf, (END_TOOL_CALL,))
                self._in_tool.append(buf[:len(buf) - keep])
                self._buf = buf[len(buf) - keep:]
                return False
            body = "".join(self._in_tool) + buf[:end]
            self._in_tool, self._buf = None, buf[end + len(END_TOOL_CALL):]
            call = self._syntax.parse(body)
            if call is None and self._syntax.cut_short(body):  # the tag was inside a value: read on to the next
                self._in_tool = [body + END_TOOL_CALL]
                return True
            if call is None:
                self._emit(ContentDelta, TOOL_CALL + body + END_TOOL_CALL)
            elif self._max_calls is None or len(self._calls) < self._max_calls:
                self._calls.append(call)
                self._events.append(ToolCallEvent(len(self._calls) - 1, call))
            return True
        tags = (END_THINK,) if self._thinking else self._content_tags
        kind = ReasoningDelta if self._thinking else ContentDelta
        hits = [(i, tag) for tag in tags if (i := buf.find(tag)) >= 0]
        if not hits:
            keep = _held_suffix(buf, tags)
            self._emit(kind, buf[:len(buf) - keep])
            self._buf = buf[len(buf) - keep:]
            return False
        start, tag = min(hits)
        self._settled |= self._once and not self._thinking and bool(buf[:start].strip())
        if self._settled and tag in (THINK, END_THINK) and not self._thinking:
            self._emit(kind, buf[:start + len(tag)])
            self._buf = buf[start + len(tag):]
            return True
        self._emit(kind, buf[:start])
        self._buf = buf[start + len(tag):]
        if tag == THINK:
            self._thinking = self._has_reasoning = True
        elif tag == END_THINK:
            self._thinking = False
            self._settled |= self._once
        else:
            self._in_tool = []
        return True

    def _emit(self, kind: type, text: str) -> None:
        self._settled |= self._once and kind is ContentDelta and bool(text.strip())
        text = (self._reasoning if kind is ReasoningDelta else self._content).push(text)
        if not text:
            return
        self._parts[kind].append(text)
        if self._events and type(self._events[-1]) is kind:
            self._events[-1] = kind(self._events[-1].text + text)
        else:
            self._events.append(kind(text))

    def _take(self) -> list[OutputEvent]:
        events, self._events = self._events, []
        return events
