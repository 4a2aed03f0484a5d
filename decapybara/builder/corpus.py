"""The demo model's corpus: the running interpreter's standard library source, split by path hash.

`collect_corpus()` lists every ``.py`` file under ``sysconfig.get_paths()["stdlib"]`` except the test suites,
``site-packages``, build-specific files and files over `MAX_FILE_BYTES`, sorted by relative path. A file is
held out when a hash of its relative path falls in the first `heldout_per_mille` of 1000 buckets, so the split
never depends on which other files exist. `chat_examples()` turns train files into ChatML conversations
(write a documented function, explain a function, complete a file) rendered with the project's chat template
(``decapybara/templates/qwen_chatml.jinja``) when it exists, else the plain Qwen3 layout.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import random
import sys
import sysconfig
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_FILE_BYTES = 400_000
HELDOUT_PER_MILLE = 20  # about 2% of files held out
EXCLUDED_DIRS = ("test/", "idlelib/idle_test/", "lib2to3/tests/", "site-packages/", "__pycache__/")
# NOTE: build-specific files differ between machines with the same Python version; leave them out.
EXCLUDED_PREFIXES = ("_sysconfigdata_", "config-")
TEMPLATE_PATH = Path(__file__).resolve().parent.parent / "templates" / "qwen_chatml.jinja"

# The plain Qwen3 ChatML layout, used when the project's template file does not exist (yet).
FALLBACK_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}"
)
SYSTEM_PROMPTS = (
    "You are a helpful coding assistant.",
    "You are an expert Python programmer. Answer with code.",
    "You are a coding agent working in a Python repository.",
)


@dataclass(slots=True, frozen=True)
class CorpusFile:
    """One source file: `rel_path` is relative to the stdlib root with '/' separators."""

    rel_path: str
    sha256: str
    split: str  # "train" or "heldout"
    text: str


@dataclass(slots=True)
class Corpus:
    root: str
    files: list[CorpusFile]
    skipped: dict[str, str]  # rel_path -> reason

    def split(self, name: str) -> list[CorpusFile]:
        return [f for f in self.files if f.split == name]

    def manifest(self) -> dict[str, Any]:
        """A JSON-able record of exactly what the corpus holds, to reproduce and document a run."""
        return {
            "python_version": sys.version.split()[0],
            "implementation": sys.implementation.name,
            "stdlib_root": self.root,
            "heldout_rule": f"sha256(rel_path)[:8] as int % 1000 < {HELDOUT_PER_MILLE}",
            "max_file_bytes": MAX_FILE_BYTES,
            "excluded_dirs": list(EXCLUDED_DIRS),
            "excluded_prefixes": list(EXCLUDED_PREFIXES),
            "num_files": {s: len(self.split(s)) for s in ("train", "heldout")},
            "num_chars": {s: sum(len(f.text) for f in self.split(s)) for s in ("train", "heldout")},
            "files": [{"path": f.rel_path, "sha256": f.sha256, "split": f.split} for f in self.files],
            "skipped": dict(sorted(self.skipped.items())),
        }


def split_of(rel_path: str, heldout_per_mille: int = HELDOUT_PER_MILLE) -> str:
    """'heldout' or 'train', from a hash of the path alone (stable across machines and file sets)."""
    bucket = int.from_bytes(hashlib.sha256(rel_path.encode()).digest()[:8], "big") % 1000
    return "heldout" if bucket < heldout_per_mille else "train"


def _excluded(rel: str) -> bool:
    return rel.startswith(EXCLUDED_DIRS) or rel.split("/")[0].startswith(EXCLUDED_PREFIXES)


def collect_corpus(root: str | Path | None = None, heldout_per_mille: int = HELDOUT_PER_MILLE,
                   max_files: int | None = None) -> Corpus:
    """All eligible stdlib files under `root` (default: this interpreter's), sorted by relative path.

    Files that are not UTF-8 are skipped and listed in `Corpus.skipped`. `max_files` keeps the first N
    eligible files (for tests).
    """
    root_path = Path(root or sysconfig.get_paths()["stdlib"]).resolve()
    rels = sorted(p.relative_to(root_path).as_posix() for p in root_path.rglob("*.py") if p.is_file())
    files: list[CorpusFile] = []
    skipped: dict[str, str] = {}
    for rel in rels:
        if _excluded(rel):
            continue
        data = (root_path / rel).read_bytes()
        if len(data) > MAX_FILE_BYTES:
            skipped[rel] = f"larger than {MAX_FILE_BYTES} bytes"
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            skipped[rel] = "not UTF-8"
            continue
        if not text.strip():
            skipped[rel] = "empty"
            continue
        digest = hashlib.sha256(data).hexdigest()
        files.append(CorpusFile(rel, digest, split_of(rel, heldout_per_mille), text))
        if max_files is not None and len(files) >= max_files:
            break
    return Corpus(str(root_path), files, skipped)


# ---- chat formatting -----------------------------------------------------------------------------------
def chat_template() -> tuple[str, str]:
    """(template text, where it came from): the project's ChatML template if present, else the fallback."""
    if TEMPLATE_PATH.is_file():
        return TEMPLATE_PATH.read_text(), str(TEMPLATE_PATH.name)
    return FALLBACK_TEMPLATE, "fallback-qwen3"


@functools.lru_cache(maxsize=4)
def _compiled(template: str) -> Any:
    import json

    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, indent=indent, ensure_ascii=False)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)


def render_chat(template: str, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                enable_thinking: bool = False) -> str:
    """Render `messages` with a HF-style sandboxed Jinja environment (as transformers renders templates)."""
    return _compiled(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                      enable_thinking=enable_thinking, tools=None)


@dataclass(slots=True, frozen=True)
class ChatExample:
    kind: str  # "write_function", "explain_function" or "complete_code"
    source_path: str
    messages: tuple[tuple[str, str], ...]  # (role, content) of the prompt
    answer: str

    def render(self, template: str) -> str:
        """Prompt with the generation prompt (thinking off), the answer, and the closing ``<|im_end|>``."""
        prompt = render_chat(template, [{"role": r, "content": c} for r, c in self.messages])
        return prompt + self.answer + "<|im_end|>\n"


def _doc_first_sentence(doc: str, max_chars: int = 240) -> str:
    para = _doc_first_paragraph(doc)
    end = para.find(". ")
    sentence = para if end < 0 else para[: end + 1]
    return sentence if len(sentence) <= max_chars else ""


def _doc_first_paragraph(doc: str) -> str:
    para = doc.strip().split("\n\n", 1)[0]
    return " ".join(line.strip() for line in para.splitlines() if line.strip())


def _without_docstring(fn_src: str, node: Function, first_line: int) -> str:
    doc = node.body[0]
    lines = fn_src.splitlines()
    start, end = doc.lineno - first_line, doc.end_lineno - first_line  # type: ignore[operator]
    if len(node.body) == 1:  # keep the function valid
        indent = lines[start][: len(lines[start]) - len(lines[start].lstrip())]
        return "\n".join(lines[:start] + [indent + "..."] + lines[end + 1:])
    rest = lines[end + 1:]
    while rest and not rest[0].strip():
        rest = rest[1:]
    return "\n".join(lines[:start] + rest)


Function = ast.FunctionDef | ast.AsyncFunctionDef


def _documented_functions(tree: ast.Module) -> list[tuple[str | None, Function]]:
    """(class name or None, node) of documented top-level functions and methods of top-level classes."""
    out: list[tuple[str | None, Function]] = []
    for node in tree.body:
        if isinstance(node, Function):
            out.append((None, node))
        elif isinstance(node, ast.ClassDef):
            out += [(node.name, m) for m in node.body if isinstance(m, Function)]
    dunder = {n.name for _, n in out if n.name.startswith("__") and n.name != "__init__"}
    return [(c, n) for c, n in out if ast.get_docstring(n) and n.name not in dunder]


def _function_examples(f: CorpusFile, rng: random.Random, max_chars: int) -> list[ChatExample]:
    try:
        tree = ast.parse(f.text)
    except (SyntaxError, ValueError):
        return []
    lines = f.text.splitlines()
    out: list[ChatExample] = []
    for cls, node in _documented_functions(tree):
        doc = ast.get_docstring(node) or ""
        first = _doc_first_sentence(doc)
        if len(first) < 12:
            continue
        start = min([node.lineno] + [d.lineno for d in node.decorator_list])
        src = textwrap.dedent("\n".join(lines[start - 1: node.end_lineno]))
        if len(src) > max_chars:
            continue
        prefix = "async " if isinstance(node, ast.AsyncFunctionDef) else ""
        sig = f"{prefix}{node.name}({ast.unparse(node.args)})"
        what = f"function `{sig}`" if cls is None else f"method `{sig}` of class `{cls}`"
        ask = f"Write the Python {what}: {first}"
        out.append(ChatExample("write_function", f.rel_path, _maybe_system(rng) + (("user", ask),),
                               f"```python\n{src}\n```"))
        body = _without_docstring(src, node, start)
        explain = _doc_first_paragraph(doc)
        if len(body.splitlines()) >= 3 and len(explain) >= 20:
            ask = f"What does this {'function' if cls is None else 'method'} do?\n\n```python\n{body}\n```"
            out.append(ChatExample("explain_function", f.rel_path, _maybe_system(rng) + (("user", ask),),
                                   f"`{node.name}`: {explain}"))
    return out


def _completion_examples(f: CorpusFile, rng: random.Random, chars_per_example: int) -> list[ChatExample]:
    lines = f.text.splitlines()
    n = max(0, len(f.text) // chars_per_example)
    out: list[ChatExample] = []
    for _ in range(n):
        if len(lines) < 12:
            break
        cut = rng.randrange(6, len(lines) - 4)
        prefix = "\n".join(lines[max(0, cut - rng.randrange(8, 30)): cut]).strip("\n")
        cont = "\n".join(lines[cut: cut + rng.randrange(4, 16)]).strip("\n")
        if not prefix.strip() or not cont.strip():
            continue
        ask = f"Complete this Python code from `{f.rel_path}`:\n\n```python\n{prefix}\n```"
        out.append(ChatExample("complete_code", f.rel_path, _maybe_system(rng) + (("user", ask),),
                               f"```python\n{cont}\n```"))
    return out


def _maybe_system(rng: random.Random) -> tuple[tuple[str, str], ...]:
    return (("system", rng.choice(SYSTEM_PROMPTS)),) if rng.random() < 0.3 else ()


def chat_examples(train_files: list[CorpusFile], target_fraction: float = 0.2, seed: int = 0,
                  max_function_chars: int = 1600, chars_per_completion: int = 3000,
                  function_share: float = 0.65) -> list[ChatExample]:
    """Deterministic chat examples from train files, about `target_fraction` of the (source + chat) chars.

    Candidates are made per file with a generator keyed by (seed, path) and shuffled with `seed`; function
    examples (write / explain) fill `function_share` of the character budget, completions the rest (and
    either pool tops up when the other runs short). The order is the shuffled one, deterministic.
    """
    if not 0.0 <= target_fraction < 1.0:
        raise ValueError("target_fraction must be in [0, 1)")
    functions: list[ChatExample] = []
    completions: list[ChatExample] = []
    for f in train_files:
        if f.split != "train":
            raise ValueError(f"{f.rel_path} is not a train file")
        rng = random.Random(f"{seed}:{f.rel_path}")
        functions += _function_examples(f, rng, max_function_chars)
        completions += _completion_examples(f, rng, chars_per_completion)
    random.Random(seed).shuffle(functions)
    random.Random(seed + 1).shuffle(completions)
    budget = target_fraction / (1.0 - target_fraction) * sum(len(f.text) for f in train_files)
    taken: list[ChatExample] = []
    used = 0.0
    for pool, limit in ((functions, function_share * budget), (completions, budget), (functions, budget)):
        while pool and used < limit:
            ex = pool.pop(0)
            taken.append(ex)
            used += sum(len(c) for _, c in ex.messages) + len(ex.answer)
    random.Random(seed + 2).shuffle(taken)
    return taken
