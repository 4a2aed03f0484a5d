"""The byte-level BPE tokenizer (HF `tokenizers`), chat rendering on top of it (and the form its chat template
writes tool calls in, `Tokenizer.tool_format`), and incremental detokenisation.

Only byte-level tokenizers (the Qwen family's) are accepted: every token then stands for a fixed byte string,
which lets `IncrementalDetokenizer` turn a token stream into text in O(1) per token and still give exactly what
`decode` gives for the whole sequence.
"""

from __future__ import annotations

import codecs
import json
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders

from decapybara import chat
from decapybara.errors import ConfigError, InvalidRequestError

# Markup tokens the output parser reads: kept in the text even when special tokens are skipped
# (Qwen marks them non-special; small test tokenizers may mark them special).
MARKUP_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
DEFAULT_EOS_TOKENS = ("<|im_end|>", "<|endoftext|>")
# Fill-in-the-middle (Qwen coder tokenizers): the prompt's three markers, and the tokens that end a middle
FIM_TOKENS = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
FIM_STOP_TOKENS = ("<|fim_pad|>", "<|file_sep|>", "<|repo_name|>")  # (<|endoftext|> ends it as eos)
# What `tokenizers` takes for whitespace around an added token with lstrip / rstrip (Unicode White_Space; Python's
# str.strip would take \x1c-\x1f too)
_WHITE_SPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a" \
    "\u2028\u2029\u202f\u205f\u3000"


@dataclass(slots=True, frozen=True)
class SpecialTokenIds:
    """Ids of the ChatML control and markup tokens; None where the vocabulary lacks one."""

    endoftext: int | None
    im_start: int | None
    im_end: int | None
    think: int | None
    end_think: int | None
    tool_call: int | None
    end_tool_call: int | None
    tool_response: int | None
    end_tool_response: int | None


def _bytes_of_char() -> dict[str, int]:
    """The GPT-2 byte-level alphabet, inverted: printable stand-in character -> byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(keep)
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars)}


_BYTE_OF = _bytes_of_char()


def _token_bytes(token: str) -> bytes:
    # NOTE: the same rule as the ByteLevel decoder of `tokenizers`: a token made only of alphabet characters
    # stands for those bytes; any other token (an added token such as "日本") for its own UTF-8.
    try:
        return bytes(_BYTE_OF[c] for c in token)
    except KeyError:
        return token.encode("utf-8")


class Tokenizer:
    """A byte-level BPE tokenizer plus its chat template and end-of-sequence tokens."""

    def __init__(self, hf: HFTokenizer, chat_template: str | None = None, eos_tokens: tuple[str, ...] | None = None,
                 template_vars: dict[str, str] | None = None) -> None:
        if not isinstance(hf.decoder, decoders.ByteLevel):
            raise ConfigError(f"only byte-level BPE tokenizers are supported (decoder {hf.decoder!r})")
        self._hf = hf
        self._hf_plain = HFTokenizer.from_str(hf.to_str())  # encodes special-token text as ordinary text
        self._hf_plain.encode_special_tokens = True
        self.chat_template = chat_template or chat.default_chat_template()
        self.template_vars = dict(template_vars or {})  # what transformers passes as special_tokens_map
        vocab = hf.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1
        self._vocab = vocab
        added = hf.get_added_tokens_decoder()
        self.special_ids = SpecialTokenIds(*(vocab.get(t) for t in (
            "<|endoftext|>", "<|im_start|>", "<|im_end|>", *MARKUP_TOKENS)))
        # Ids dropped by decode(skip_special_tokens=True): special added tokens other than the markup.
        self.skip_ids = frozenset(i for i, t in added.items() if t.special and t.content not in MARKUP_TOKENS)
        self.added_ids = frozenset(added)  # every added token (control and markup tokens): no text of the model's
        # The control strings a message's text may not open (`chat_prompt`): those of the skipped ids, longest
        # first; and every added token's, where the tokenizer cuts a text
        controls = sorted((added[i].content for i in self.skip_ids), key=len, reverse=True)
        self._controls = tuple(controls)
        self._control_re = re.compile("|".join(map(re.escape, controls))) if controls else None
        self._control_prefixes = tuple(sorted({c[:k] for c in controls for k in range(1, len(c))}, key=len,
                                              reverse=True))
        cuts = sorted({t.content for t in added.values()}, key=len, reverse=True)
        self._added_re = re.compile("|".join(map(re.escape, cuts))) if cuts else None
        self._lstrip = frozenset(t.content for t in added.values() if t.lstrip)  # whitespace each takes in
        self._rstrip = frozenset(t.content for t in added.values() if t.rstrip)
        names = eos_tokens if eos_tokens is not None else DEFAULT_EOS_TOKENS
        missing = [t for t in names if t not in vocab]
        if eos_tokens is not None and missing:
            raise ConfigError(f"eos tokens not in the vocabulary: {missing}")
        self.eos_token_ids = tuple(dict.fromkeys(vocab[t] for t in names if t in vocab))
        self.fim_ids = tuple(vocab[t] for t in FIM_TOKENS) if all(t in vocab for t in FIM_TOKENS) else None
        self.fim_stop_ids = tuple(vocab[t] for t in FIM_STOP_TOKENS if t in vocab)
        self._bytes: list[bytes] | None = None

    @classmethod
    def from_json(cls, json_str: str, chat_template: str | None = None,
                  eos_tokens: tuple[str, ...] | list[str] | None = None) -> Tokenizer:
        """From the text of a tokenizer.json; default template and eos (<|im_end|>, <|endoftext|>) when None."""
        return cls(_parse_hf(json_str), chat_template, tuple(eos_tokens) if eos_tokens is not None else None)

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        """From a tokenizer.json, or a model folder holding one (with tokenizer_config.json / chat_template.jinja).

        The folder's chat template replaces the default one; its `eos_token` joins the default eos tokens.
        """
        path = Path(path)
        folder = path if path.is_dir() else path.parent
        json_path = path / "tokenizer.json" if path.is_dir() else path
        if not json_path.is_file():
            raise ConfigError(f"no tokenizer.json at {json_path}")
        cfg: dict[str, Any] = {}
        if (folder / "tokenizer_config.json").is_file():
            cfg = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        hf = _parse_hf(json_path.read_text(encoding="utf-8"))
        specials = {k: _token_content(cfg[k]) for k in ("bos_token", "eos_token", "pad_token", "unk_token")
                    if cfg.get(k)}
        vocab = hf.get_vocab(with_added_tokens=True)
        eos = [t for t in DEFAULT_EOS_TOKENS if t in vocab]
        if specials.get("eos_token") in vocab:
            eos.append(specials["eos_token"])
        return cls(hf, template, tuple(dict.fromkeys(eos)), specials)

    # ------------------------------------------------------------------------------------------ text <-> ids

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        """Token ids of `text`; with allow_special=False, control-token strings are encoded as plain text."""
        hf = self._hf if allow_special else self._hf_plain
        return hf.encode(text, add_special_tokens=False).ids

    def infill(self, prefix: list[int] | tuple[int, ...], suffix: list[int] | tuple[int, ...]) -> list[int]:
        """A fill-in-the-middle prompt, as Qwen coder models read one: ``<|fim_prefix|>`` prefix ``<|fim_suffix|>``
        suffix ``<|fim_middle|>``; what the model writes next is the middle, ended by one of `fim_stop_ids` or eos.
        InvalidRequestError where the vocabulary has no such markers."""
        if self.fim_ids is None:
            raise InvalidRequestError("this model's tokenizer has no fill-in-the-middle tokens (<|fim_prefix|>, "
                                      "<|fim_suffix|>, <|fim_middle|>), so a suffix cannot be given", "suffix")
        pre, suf, mid = self.fim_ids
        return [pre, *prefix, suf, *suffix, mid]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids` (ids outside the vocabulary decode to nothing); skipping keeps the markup tokens."""
        skip = self.skip_ids if skip_special_tokens else frozenset()
        ids = [i for i in ids if 0 <= i < self.vocab_size and i not in skip]
        return self._hf.decode(ids, skip_special_tokens=False)

    def token_to_str(self, token_id: int) -> str | None:
        """The vocabulary entry of an id (byte-level form, e.g. 'Ġhello'), or None."""
        return self._hf.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._vocab.get(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (b'' for an id outside the vocabulary)."""
        table = self._byte_table()
        return table[token_id] if 0 <= token_id < len(table) else b""

    def _byte_table(self) -> list[bytes]:
        if self._bytes is None:
            table = [b""] * self.vocab_size
            for token, i in self._vocab.items():
                table[i] = _token_bytes(token)
            self._bytes = table
        return self._bytes

    # ------------------------------------------------------------------------------------------ chat

    @property
    def tool_format(self) -> str:
        """The form the chat template writes tool calls in, which the model is taught to write them in: "xml"
        (Qwen3.5 / Qwen3.6 templates) or "json" (Qwen2.5 / Qwen3, the built-in template);
        `chat.template_call_format`."""
        return chat.template_call_format(self.chat_template)

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = True, enable_thinking: bool = True, **template_vars: Any) -> str:
        """The prompt text of a conversation under this tokenizer's chat template (see chat.render_chat)."""
        return chat.render_chat(messages, tools, add_generation_prompt, enable_thinking, self.chat_template,
                                **{**self.template_vars, **template_vars})

    def apply_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                   add_generation_prompt: bool = True, enable_thinking: bool = True, **template_vars: Any) -> list[int]:
        """Token ids of the rendered conversation (`chat_prompt`'s)."""
        return self.chat_prompt(messages, tools, add_generation_prompt, enable_thinking, **template_vars)[1]

    def chat_prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = True, enable_thinking: bool = True, tail: str = "",
                    **template_vars: Any) -> tuple[str, list[int], str]:
        """(text, ids, markup) of the rendered conversation followed by `tail` (an assistant prefill, the model's
        own text). Control tokens the template writes, and those written in `tail`, become their ids; a
        control-token string inside a message or a tool (a user's text, a file an agent read, say "<|im_end|>") is
        ordinary text, as a hosted API reads it, so it can neither end its turn nor open another (nor can parts of a
        message that the template joins). `markup`: the text with each such string held by a placeholder
        (`_Holds`), for finding the template's own turns in it.

        Where no message holds a control string the ids are `encode(text)`'s; otherwise the text is cut at the
        added tokens it writes (as the tokenizer itself cuts at them; the held strings are not among them) and each
        piece between encoded as text, the held strings back in it."""
        holds = _Holds(self._controls, self._control_re, self._control_prefixes)
        markup = self.render_chat(holds.value(messages), holds.value(tools), add_generation_prompt, enable_thinking,
                                  **template_vars) + tail
        markup = holds.settle(markup)
        if not holds.held(markup):
            return markup, self.encode(markup), markup
        ids: list[int] = []
        at = 0
        for m in self._added_re.finditer(markup) if self._added_re is not None else ():
            token = m.group()
            piece = markup[at:m.start()]
            ids += self._hf_plain.encode(holds.release(piece.rstrip(_WHITE_SPACE) if token in self._lstrip else piece),
                                         add_special_tokens=False).ids
            ids.append(self._vocab[token])
            at = m.end()
            if token in self._rstrip:
                at = len(markup) - len(markup[at:].lstrip(_WHITE_SPACE))
        ids += self._hf_plain.encode(holds.release(markup[at:]), add_special_tokens=False).ids
        return holds.release(markup), ids, markup


class _Holds:
    """Strings held by placeholders while a chat renders (`Tokenizer.chat_prompt`): each control string in a text,
    and a text's last characters where they begin one, which a later text (the next part of a message's content,
    joined by the template) could complete; those are held only where one does (`settle`). A placeholder is ASCII
    letters and digits around a random nonce, which no text can forge and which escaping (a repr, JSON) leaves as
    it is: "q", the nonce, "q", its number, then "h" (held) or "p" (a beginning, until settled)."""

    def __init__(self, controls: tuple[str, ...], pattern: re.Pattern | None, prefixes: tuple[str, ...]) -> None:
        self.controls, self.pattern, self.prefixes = controls, pattern, prefixes
        self.nonce = secrets.token_hex(8)
        self._marks = re.compile(f"q{self.nonce}q([0-9]+)([hp])")
        self.table: list[str] = []

    def _mark(self, text: str, kind: str = "h") -> str:
        self.table.append(text)
        return f"q{self.nonce}q{len(self.table) - 1}{kind}"

    def value(self, value: Any) -> Any:
        """`value` with its strings (keys too) held."""
        if isinstance(value, str):
            out = self.pattern.sub(lambda m: self._mark(m.group()), value) if self.pattern is not None else value
            end = next((p for p in self.prefixes if out.endswith(p)), None)
            return out if end is None else out[:-len(end)] + self._mark(end, "p")
        if isinstance(value, dict):
            return {self.value(k): self.value(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.value(v) for v in value]
        if isinstance(value, tuple):
            return tuple(self.value(v) for v in value)
        return value

    def settle(self, markup: str) -> str:
        """`markup` with each held beginning of a control string released unless the text after it completes one
        (it stays held: text); released, it joins what follows as `encode` would read it (a markup token)."""
        controls = self.controls
        longest = max(map(len, controls), default=0)

        def one(m: re.Match) -> str:
            start = self.table[int(m.group(1))]
            after = self.release(markup[m.end():m.end() + longest * (len(self.nonce) + 8)])
            joined = start + after
            return m.group()[:-1] + "h" if any(joined.startswith(c) for c in controls) else start

        return self._marks.sub(lambda m: one(m) if m.group(2) == "p" else m.group(), markup)

    def held(self, text: str) -> bool:
        return self._marks.search(text) is not None

    def release(self, text: str) -> str:
        """Placeholders back to the strings they held."""
        table = self.table
        return self._marks.sub(lambda m: table[int(m.group(1))] if int(m.group(1)) < len(table) else m.group(), text)


def _parse_hf(json_str: str) -> HFTokenizer:
    try:
        return HFTokenizer.from_str(json_str)
    except Exception as exc:  # the Rust side raises bare Exceptions
        raise ConfigError(f"not a valid tokenizer.json: {exc}") from exc


def _token_content(value: Any) -> str:
    return value["content"] if isinstance(value, dict) else str(value)


_ASCII_SPACE = " \t\n\r\x0b\x0c"  # what bytes.strip() strips


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas, with stop strings.

    Contract: the concatenation of every `push` result and `finish()` equals
    `tokenizer.decode(ids, skip_special_tokens)` of all pushed ids, cut right before the first stop string
    (the one completed first) when one matched. A delta never ends inside a UTF-8 character, and text that could
    be the start of a stop string is held back until it is known. O(1) amortised work per token.
    """

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] | list[str] = (),
                 skip_special_tokens: bool = True) -> None:
        if any(not isinstance(s, str) or not s for s in stop):
            raise InvalidRequestError("stop strings must be non-empty strings")
        self._table = tokenizer._byte_table()
        self._skip = tokenizer.skip_ids if skip_special_tokens else frozenset()
        # NOTE: Python's "replace" handler substitutes maximal invalid subparts like Rust's from_utf8_lossy,
        # which is what `tokenizers` uses, so invalid byte runs also decode as in batch.
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = tuple(dict.fromkeys(stop))
        self._max_held = max((len(s) for s in self._stop), default=1) - 1
        self._held = ""  # decoded text that could still be the start of a stop string
        self.stopped = False
        self.stop_string: str | None = None
        self.num_tokens = 0

    def push(self, token_id: int, match: bool = True, lstrip: bool = False) -> str:
        """Add one token; return the text it completes ("" once stopped). `match=False`: its text (and what was
        held back before it) is released without looking for stop strings in it (reasoning, markup).
        `lstrip=True`: only the text after its leading ASCII whitespace is looked at (the answer's first token,
        whose leading whitespace belongs to the markup before it)."""
        if self.stopped:
            return ""
        self.num_tokens += 1
        if token_id in self._skip or not 0 <= token_id < len(self._table):
            return ""
        new = self._utf8.decode(self._table[token_id])
        if not match or lstrip:
            body = new.lstrip(_ASCII_SPACE) if match else ""
            out, self._held = self._held + new[:len(new) - len(body)], ""
            return out + self._release(body) if body else out
        return self._release(new)

    def push_many(self, token_ids: list[int]) -> str:
        return "".join(self.push(t) for t in token_ids)

    def finish(self) -> str:
        """End of stream: flush held-back text (an unfinished character becomes U+FFFD) unless a stop matched."""
        if self.stopped:
            return ""
        text = self._release(self._utf8.decode(b"", final=True))
        if self.stopped:
            return text
        text, self._held = text + self._held, ""
        return text

    def _release(self, new: str) -> str:
        if not self._stop:
            return new
        buf = self._held + new
        best: tuple[int, int, str] | None = None  # (end, -len, stop): the stop completed first wins
        for s in self._stop:
            i = buf.find(s)
            if i >= 0 and (best is None or (i + len(s), -len(s)) < best[:2]):
                best = (i + len(s), -len(s), s)
        if best is not None:
            self.stopped, self.stop_string, self._held = True, best[2], ""
            return buf[:best[0] + best[1]]
        keep = self._held_length(buf)
        self._held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep]

    def _held_length(self, buf: str) -> int:
        for n in range(min(len(buf), self._max_held), 0, -1):
            tail = buf[-n:]
            if any(s.startswith(tail) for s in self._stop):
                return n
        return 0
