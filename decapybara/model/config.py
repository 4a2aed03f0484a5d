"""One model config type for the four Qwen families we serve.

`ModelConfig` covers:
- ``qwen3``: dense GQA attention with per-head QK RMSNorm, SwiGLU MLP.
- ``qwen3_moe``: as qwen3 with a softmax top-k router over experts (optionally renormalised top-k).
- ``qwen3_5_text``: hybrid; per `layer_types`, Gated DeltaNet layers (causal conv + fp32 recurrent state) and
  gated full-attention layers (sigmoid output gate, partial rotary); RMSNorm weights are zero-centred (1 + w).
- ``qwen3_5_moe_text``: the hybrid with an MoE block (normalised top-k plus one sigmoid-gated shared expert).

`ModelConfig.from_hf(dict)` reads a HF ``config.json`` and raises `ConfigError` naming an unknown model_type
or a missing field. `to_dict`/`from_dict` round-trip through the .mcapy metadata.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from decapybara.errors import ConfigError

FAMILIES = ("qwen3", "qwen3_moe", "qwen3_5_text", "qwen3_5_moe_text")
FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"
SWIGLU_ACTS = ("silu", "swish")  # transformers' names of the activation our MLPs compute (silu(gate) * up)


@dataclass(slots=True, frozen=True)
class RopeConfig:
    """Rotary embedding parameters; `kind` is ``default`` or ``yarn``."""

    theta: float = 10000.0
    partial_rotary_factor: float = 1.0
    kind: str = "default"
    factor: float = 1.0  # yarn: context extension factor
    original_max_position_embeddings: int = 0  # yarn: the trained context
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True  # yarn: round the correction range to whole dimensions (HF's `truncate`)


@dataclass(slots=True, frozen=True)
class ModelConfig:
    """Architecture hyper-parameters. Field names follow HF's config.json where one exists."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int = 0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    rope: RopeConfig = field(default_factory=RopeConfig)
    layer_types: tuple[str, ...] = ()
    # Gated DeltaNet (qwen3_5*)
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    # MoE (qwen3_moe, qwen3_5_moe_text)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # Multi-token prediction layers (Qwen3.5 style; ignored by HF transformers)
    mtp_num_hidden_layers: int = 0
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.model_type not in FAMILIES:
            raise ConfigError(f"unknown model_type {self.model_type!r}; supported: {', '.join(FAMILIES)}")
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"config field {name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        for t in self.layer_types:
            if t not in (FULL_ATTENTION, LINEAR_ATTENTION):
                raise ConfigError(f"unknown layer type {t!r}")
        if not self.is_hybrid and LINEAR_ATTENTION in self.layer_types:
            raise ConfigError(f"{self.model_type} has no linear_attention layers")
        if self.is_moe and (self.num_experts <= 0 or not 0 < self.num_experts_per_tok <= self.num_experts):
            raise ConfigError("MoE config needs num_experts > 0 and 0 < num_experts_per_tok <= num_experts")
        if self.is_hybrid and self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if self.rotary_dim % 2 or self.rotary_dim <= 0:
            raise ConfigError(f"rotary dim {self.rotary_dim} must be positive and even")

    # ---- derived shape facts -------------------------------------------------------------------------
    @property
    def is_hybrid(self) -> bool:
        return self.model_type in ("qwen3_5_text", "qwen3_5_moe_text")

    @property
    def is_moe(self) -> bool:
        return self.model_type in ("qwen3_moe", "qwen3_5_moe_text")

    @property
    def norm_offset(self) -> float:
        """RMSNorm multiplies by (offset + w): 1.0 for the zero-centred qwen3_5 norms, else 0.0."""
        return 1.0 if self.is_hybrid else 0.0

    @property
    def attn_output_gate(self) -> bool:
        """qwen3_5 attention projects a sigmoid gate alongside q (q_proj has 2x the query width)."""
        return self.is_hybrid

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rope.partial_rotary_factor)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the causal conv: q, k and v of the DeltaNet concatenated."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    def layer_is_moe(self, i: int) -> bool:
        if not self.is_moe:
            return False
        if self.model_type == "qwen3_5_moe_text":
            return True
        return i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    def state_bytes_per_sequence(self) -> int:
        """Bytes of DeltaNet recurrent (fp32) + conv state (fp32) one sequence holds across linear layers."""
        rec = self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim * 4
        conv = self.linear_conv_dim * (self.linear_conv_kernel_dim - 1) * 4
        return len(self.linear_layers) * (rec + conv)

    # ---- (de)serialisation ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["layer_types"] = list(self.layer_types)
        d["mlp_only_layers"] = list(self.mlp_only_layers)
        d["eos_token_id"] = list(self.eos_token_id)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Inverse of `to_dict` (strict: unknown keys are an error)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ConfigError(f"unknown config fields: {sorted(unknown)}")
        d = dict(d)
        d["rope"] = RopeConfig(**d.get("rope", {}))
        for key in ("layer_types", "mlp_only_layers", "eos_token_id"):
            if key in d:
                d[key] = tuple(d[key])
        try:
            return cls(**d)
        except TypeError as e:
            raise ConfigError(f"bad model config: {e}") from None

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Read a HF config.json (a text config, or a multimodal one with `text_config`)."""
        if "model_type" not in hf:
            raise ConfigError("config.json has no model_type")
        if hf["model_type"] in ("qwen3_5", "qwen3_5_moe") and isinstance(hf.get("text_config"), dict):
            inner = dict(hf["text_config"])
            inner.setdefault("model_type", hf["model_type"] + "_text")
            for key in ("tie_word_embeddings", "eos_token_id", "bos_token_id"):
                if key in hf and key not in inner:
                    inner[key] = hf[key]
            hf = inner
        mt = hf["model_type"]
        if mt not in FAMILIES:
            raise ConfigError(f"unknown model_type {mt!r}; supported: {', '.join(FAMILIES)}")

        def need(name: str) -> Any:
            if name not in hf or hf[name] is None:
                raise ConfigError(f"config.json ({mt}) is missing required field {name!r}")
            return hf[name]

        if hf.get("use_sliding_window"):
            raise ConfigError("use_sliding_window=true is not supported")
        act = hf.get("hidden_act", "silu")
        if act not in SWIGLU_ACTS:
            raise ConfigError(f"hidden_act {act!r} is not supported (the MLPs and experts compute SwiGLU: silu)")
        n_layers = int(need("num_hidden_layers"))
        n_heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        hybrid = mt in ("qwen3_5_text", "qwen3_5_moe_text")
        moe = mt in ("qwen3_moe", "qwen3_5_moe_text")
        head_dim = int(hf.get("head_dim") or hidden // n_heads)
        layer_types = hf.get("layer_types")
        if not layer_types:
            if hybrid:
                interval = int(hf.get("full_attention_interval", 4))
                layer_types = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION
                               for i in range(n_layers)]
            else:
                layer_types = [FULL_ATTENTION] * n_layers
        eos = hf.get("eos_token_id")
        eos_ids = () if eos is None else (tuple(eos) if isinstance(eos, list) else (int(eos),))
        kw: dict[str, Any] = {
            "model_type": mt,
            "vocab_size": int(need("vocab_size")),
            "hidden_size": hidden,
            "num_hidden_layers": n_layers,
            "num_attention_heads": n_heads,
            "num_key_value_heads": int(hf.get("num_key_value_heads") or n_heads),
            "head_dim": head_dim,
            "rms_norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
            "max_position_embeddings": int(hf.get("max_position_embeddings", 32768)),
            "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
            "attention_bias": bool(hf.get("attention_bias", False)),
            "rope": _rope_from_hf(hf, hybrid),
            "layer_types": tuple(layer_types),
            "mtp_num_hidden_layers": int(hf.get("mtp_num_hidden_layers", 0) or 0),
            "bos_token_id": hf.get("bos_token_id"),
            "eos_token_id": eos_ids,
        }
        if not moe or mt == "qwen3_moe":
            kw["intermediate_size"] = int(need("intermediate_size"))
        if hybrid:
            for name in ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                         "linear_num_key_heads", "linear_num_value_heads"):
                kw[name] = int(need(name))
        if moe:
            n_exp = hf.get("num_experts", hf.get("num_local_experts"))
            if n_exp is None:
                raise ConfigError(f"config.json ({mt}) is missing required field 'num_experts'")
            kw.update(num_experts=int(n_exp), num_experts_per_tok=int(need("num_experts_per_tok")),
                      moe_intermediate_size=int(need("moe_intermediate_size")))
            if mt == "qwen3_moe":
                kw.update(norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                          decoder_sparse_step=int(hf.get("decoder_sparse_step", 1)),
                          mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()))
            else:
                kw.update(norm_topk_prob=True,
                          shared_expert_intermediate_size=int(need("shared_expert_intermediate_size")))
        return cls(**kw)


def _rope_from_hf(hf: dict[str, Any], hybrid: bool) -> RopeConfig:
    """The rotary embedding of a HF config, read as transformers reads it (`standardize_rope_params` and
    `_compute_yarn_parameters`): `rope_parameters` (or the legacy `rope_scaling`); for yarn a top-level
    `original_max_position_embeddings` before the parameters' own (else `max_position_embeddings`), a missing or
    null `factor` the ratio `max_position_embeddings / original_max_position_embeddings`, null betas their
    defaults (32, 1), `mscale` / `mscale_all_dim` only as a pair of non-zero values (else the attention factor is
    the plain 0.1 ln(factor) + 1: stored as mscale 1, mscale_all_dim 0) and `truncate` (default true) kept. Any
    other rope type is a `ConfigError`."""
    params = dict(hf.get("rope_parameters") or {})
    legacy = hf.get("rope_scaling") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    prf = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25 if hybrid else 1.0))
    kind = params.get("rope_type") or legacy.get("rope_type") or legacy.get("type") or "default"
    src = params if params.get("rope_type", "default") != "default" else legacy
    if kind not in ("default", "yarn"):
        raise ConfigError(f"rope type {kind!r} is not supported (default, yarn)")
    if kind == "default":
        return RopeConfig(theta=float(theta), partial_rotary_factor=float(prf))
    max_pos = int(hf.get("max_position_embeddings", 32768))
    original = int(hf.get("original_max_position_embeddings") or src.get("original_max_position_embeddings")
                   or max_pos)
    factor = src.get("factor")
    mscale, mscale_all_dim = src.get("mscale"), src.get("mscale_all_dim")
    if not (mscale and mscale_all_dim):
        mscale, mscale_all_dim = 1.0, 0.0
    return RopeConfig(
        theta=float(theta), partial_rotary_factor=float(prf), kind="yarn",
        factor=float(max_pos / original if factor is None else factor),
        original_max_position_embeddings=original,
        beta_fast=float(src.get("beta_fast") or 32.0), beta_slow=float(src.get("beta_slow") or 1.0),
        mscale=float(mscale), mscale_all_dim=float(mscale_all_dim),
        attention_factor=src.get("attention_factor"), truncate=bool(src.get("truncate", True)),
    )


def with_yarn(cfg: ModelConfig, max_context: int) -> ModelConfig:
    """The same model with YaRN context extension to `max_context` tokens (no-op when it already fits)."""
    trained = cfg.rope.original_max_position_embeddings or cfg.max_position_embeddings
    if max_context <= trained:
        return cfg
    factor = max_context / trained
    rope = dataclasses.replace(cfg.rope, kind="yarn", factor=factor, original_max_position_embeddings=trained)
    return dataclasses.replace(cfg, rope=rope, max_position_embeddings=max_context)


def _qwen38_27b() -> ModelConfig:
    n = 64
    return ModelConfig(
        model_type="qwen3_5_text", vocab_size=248320, hidden_size=5120, intermediate_size=17408,
        num_hidden_layers=n, num_attention_heads=24, num_key_value_heads=4, head_dim=256,
        rms_norm_eps=1e-6, max_position_embeddings=262144, tie_word_embeddings=False,
        rope=RopeConfig(theta=10_000_000.0, partial_rotary_factor=0.25),
        layer_types=tuple(FULL_ATTENTION if (i + 1) % 4 == 0 else LINEAR_ATTENTION for i in range(n)),
        linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_num_key_heads=16, linear_num_value_heads=48, mtp_num_hidden_layers=1,
        eos_token_id=(248046, 248044),
    )


def _qwen38_35b_a3b() -> ModelConfig:
    n = 40
    return ModelConfig(
        model_type="qwen3_5_moe_text", vocab_size=248320, hidden_size=2048, num_hidden_layers=n,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, max_position_embeddings=262144,
        rope=RopeConfig(theta=10_000_000.0, partial_rotary_factor=0.25),
        layer_types=tuple(FULL_ATTENTION if (i + 1) % 4 == 0 else LINEAR_ATTENTION for i in range(n)),
        linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
        num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        mtp_num_hidden_layers=1, eos_token_id=(248046, 248044),
    )


NAMED_CONFIGS = {
    "qwen3.8-27b": _qwen38_27b,
    "qwen3.8-35b-a3b": _qwen38_35b_a3b,
}


def named_config(name: str) -> ModelConfig:
    """A named architecture (for planning and random-weight benchmarks)."""
    try:
        return NAMED_CONFIGS[name]()
    except KeyError:
        raise ConfigError(f"unknown named config {name!r}; known: {', '.join(NAMED_CONFIGS)}") from None


def param_count(cfg: ModelConfig) -> int:
    """Parameters of the text model (embeddings and lm_head counted once each unless tied)."""
    from decapybara.model.weights import expected_tensors

    return sum(math.prod(shape) for shape in expected_tensors(cfg).values())
