"""Builders of tiny models and tokenizers for tests, benchmarks and the GPU checks, and a chat template that
writes tool calls in Qwen3.5 / Qwen3.6's XML form (`XML_CHAT_TEMPLATE`).

Nothing here downloads anything: tokenizers are trained on a fixed in-repo text, HF checkpoints are built with
transformers' ``from_config`` under a fixed seed. torch and transformers are imported lazily (test extra).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import numpy as np

# Special tokens in the order the ChatML / Qwen tokenizers use them.
SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
)

_TRAIN_TEXT = """\
def fibonacci(n: int) -> int:
    \"\"\"Return the n-th Fibonacci number.\"\"\"
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a

class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        return self.items.pop()

import os, sys, json
print("Hello, world!")  # a comment
The quick brown fox jumps over the lazy dog. Ünïcödé: naïve café, 日本語のテキスト, emoji 🦫🚀.
You are a helpful assistant. Call the tool get_weather with {"city": "Paris"} and report back.
"""


def make_tokenizer_json(vocab_size: int = 512, extra_special: tuple[str, ...] = ()) -> str:
    """A byte-level BPE tokenizer (HF `tokenizers` JSON) with the ChatML special tokens and `extra_special` after
    them (such as the fill-in-the-middle markers), deterministic."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[*SPECIAL_TOKENS, *extra_special], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([_TRAIN_TEXT] * 4, trainer=trainer)
    return tok.to_str()


# A chat template in the structure of Qwen3.5 / Qwen3.6's (tools and the XML call form in the system turn, past
# calls rendered as XML, values that are no strings as JSON, as Qwen3.6 writes them), for tests of that form.
XML_CHAT_TEMPLATE = """\
{%- macro render_content(content) %}
    {%- if content is string %}
        {{- content }}
    {%- elif content is iterable and content is not mapping %}
        {%- for part in content %}
            {{- part.text }}
        {%- endfor %}
    {%- endif %}
{%- endmacro %}
{%- if tools %}
    {{- '<|im_start|>system\\n# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' + tool | tojson }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nIf you choose to call a function ONLY reply in the following format with NO suffix:\\n\\n' }}
    {{- '<tool_call>\\n<function=example_function_name>\\n' }}
    {{- '<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n' }}
    {{- '</function>\\n</tool_call>' }}
    {%- if messages[0].role == 'system' %}
        {{- '\\n\\n' + render_content(messages[0].content) }}
    {%- endif %}
    {{- '<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + render_content(messages[0].content) + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- if message.role == 'user' %}
        {%- set ns.last_query_index = (messages|length - 1) - loop.index0 %}
        {%- break %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = render_content(message.content) %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\\n' }}
        {%- if loop.index0 > ns.last_query_index and message.reasoning_content is string %}
            {{- '<think>\\n' + message.reasoning_content.strip('\\n') + '\\n</think>\\n\\n' }}
        {%- endif %}
        {{- content.lstrip('\\n') }}
        {%- for tool_call in message.tool_calls or [] %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {%- if loop.first %}
                {{- ('\\n\\n' if content | trim else '') + '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}
            {%- else %}
                {{- '\\n<tool_call>\\n<function=' + tool_call.name + '>\\n' }}
            {%- endif %}
            {%- for args_name, args_value in tool_call.arguments|items %}
                {{- '<parameter=' + args_name + '>\\n' }}
                {{- args_value if args_value is string else args_value | tojson }}
                {{- '\\n</parameter>\\n' }}
            {%- endfor %}
            {{- '</function>\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""


# Tiny HF configs, one per family: small enough for CPU tests, with every structural feature present
# (GQA, partial rotary, several DeltaNet + attention layers, MoE with > top-k experts, shared expert).
TINY_HF_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3": {
        "model_type": "qwen3", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 1024,
        "rope_theta": 10000.0, "tie_word_embeddings": False,
    },
    "qwen3_moe": {
        "model_type": "qwen3_moe", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
        "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 1024, "tie_word_embeddings": False,
    },
    "qwen3_5_text": {
        "model_type": "qwen3_5_text", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_conv_kernel_dim": 4,
        "max_position_embeddings": 1024, "tie_word_embeddings": False,
    },
    "qwen3_5_moe_text": {
        "model_type": "qwen3_5_moe_text", "vocab_size": 512, "hidden_size": 64, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48, "num_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_conv_kernel_dim": 4,
        "max_position_embeddings": 1024, "tie_word_embeddings": False,
    },
}
FAMILIES = tuple(TINY_HF_CONFIGS)


def make_hf_model(family: str, seed: int = 0, overrides: dict[str, Any] | None = None):
    """A transformers CausalLM of the family with seeded weights spread wide enough for clear argmaxes."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(TINY_HF_CONFIGS[family])
    kw.update(overrides or {})
    model_type = kw.pop("model_type")
    cfg = AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(1.0, 16.0, generator=gen).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5 + 1.0)
            elif p.ndim == 1:  # norm weights: zero-centred or one-centred depending on the family
                base = 0.0 if ("qwen3_5" in model_type and "linear_attn.norm" not in name) else 1.0
                p.copy_(base + torch.randn(p.shape, generator=gen) * 0.1)
            else:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=gen) * (1.0 / fan_in) ** 0.5)
    model.eval()
    return model


def save_hf_checkpoint(model, out_dir: str | Path, tokenizer_json: str | None = None,
                       chat_template: str | None = None, max_shard_size: str | None = None) -> Path:
    """Save `model` as a HF folder (safetensors, optionally sharded) with tokenizer files beside it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kwargs)
    (out / "tokenizer.json").write_text(tokenizer_json or make_tokenizer_json(model.config.vocab_size))
    tok_cfg: dict[str, Any] = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    if chat_template:
        tok_cfg["chat_template"] = chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=1))
    return out


def canonical_tensors(model) -> dict[str, Any]:
    """A transformers model's weights under our canonical names (experts stacked), float32 numpy."""
    import re

    import numpy as np

    out: dict[str, Any] = {}
    experts: dict[tuple[str, str], dict[int, Any]] = {}
    for name, value in model.state_dict().items():
        arr = value.detach().float().numpy()
        m = re.match(r"(.+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$", name)
        if m:
            experts.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = arr
        elif name.endswith("mlp.experts.gate_up_proj"):
            half = arr.shape[1] // 2
            out[name.replace("gate_up_proj", "gate_proj")] = arr[:, :half]
            out[name.replace("gate_up_proj", "up_proj")] = arr[:, half:]
        else:
            out[name] = arr
    for (prefix, kind), per_expert in experts.items():
        out[f"{prefix}.{kind}"] = np.stack([per_expert[e] for e in sorted(per_expert)])
    if getattr(model.config, "tie_word_embeddings", False):
        out.pop("lm_head.weight", None)
    return out


def tiny_qwen(family: str, seed: int = 0, backend=None, overrides: dict[str, Any] | None = None):
    """(our QwenModel on `backend` (numpy by default), the transformers model) with identical weights."""
    from decapybara.backend.numpy_backend import NumpyBackend
    from decapybara.model.config import ModelConfig
    from decapybara.model.qwen import QwenModel

    hf = make_hf_model(family, seed, overrides)
    cfg = ModelConfig.from_hf(hf.config.to_dict())
    return QwenModel.from_tensors(cfg, backend or NumpyBackend(), canonical_tensors(hf)), hf


def prefilled_sequences(model, kv, states, lengths, seed: int, pages_each: int = 8) -> list[list]:
    """Sequences of random prompts (`lengths` tokens; state slot i, pages [i * pages_each, (i + 1) *
    pages_each)) prefilled in one batch, each with its greedy next token appended: [[tokens, slot, pages]]
    ready for decode steps (the decode-graph tests' set-up)."""
    from decapybara.model.batch import ForwardBatch

    rng = np.random.default_rng(seed)
    seqs = []
    for i, n in enumerate(lengths):
        states.reset(i)
        seqs.append([list(rng.integers(0, 512, n)), i,
                     np.arange(pages_each * i, pages_each * (i + 1), dtype=np.int32)])
    prefill = ForwardBatch.build([(s[0], 0, s[2], s[1]) for s in seqs], kv.page_size, logits="last")
    last = model.backend.to_host(model.forward(prefill, kv, states).logits)
    for i, s in enumerate(seqs):
        s[0].append(int(np.argmax(last[i])))
    return seqs


@functools.cache
def tiny_checkpoint(family: str, seed: int = 7) -> tuple[Any, dict[str, Any]]:
    """(ModelConfig, canonical tensors) of `make_hf_model(family, seed)`, built once per process."""
    from decapybara.model.config import ModelConfig

    hf = make_hf_model(family, seed=seed)
    return ModelConfig.from_hf(hf.config.to_dict()), canonical_tensors(hf)


def quantized_matrices(tensors: dict[str, Any], fmt: str) -> dict[str, Any]:
    """`tensors` with every matrix but the conv1d weights quantised to `fmt` (QuantTensors, which a packed-weight
    backend keeps packed), the other tensors as they are."""
    from decapybara.model import quant

    return {k: quant.quantize(v, fmt) if v.ndim == 2 and not k.endswith("conv1d.weight") else v
            for k, v in tensors.items()}


def attach_tiers(engine, url: str, ram_bytes: int = 0, disk_bytes: int = 1 << 30):
    """A RAM tier of `ram_bytes` over a disk tier at `url` (fsspec) as `engine`'s bundle and page store, as the
    server wires them; returns the `TierStores` (a paused sequence's unit: `take_unit(seq.paused_bundle)`)."""
    from decapybara.kv.disk_tier import DiskTierStore
    from decapybara.kv.ram_tier import RamTierStore
    from decapybara.kv.stores import TierStores
    from decapybara.kv.tiers import KVTiers

    stores = TierStores(KVTiers(RamTierStore(ram_bytes), DiskTierStore(url, disk_bytes)), engine.blocks.salt)
    engine.bundle_store = stores
    engine.set_page_store(stores)
    return stores
