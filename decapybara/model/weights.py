"""Canonical tensor names and shapes of a model, and seeded random weights.

Names follow HF checkpoints (``model.layers.{i}.self_attn.q_proj.weight``...), with one change: the experts of
an MoE layer are stacked per layer into three tensors,
``model.layers.{i}.mlp.experts.{gate_proj,up_proj}`` [E, I, H] and ``...experts.down_proj`` [E, H, I],
so that a backend can index experts without a Python dict. MTP weights use the Qwen3.5 names under ``mtp.``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

from decapybara.model.config import FULL_ATTENTION, ModelConfig

Shape = tuple[int, ...]


def _attention(cfg: ModelConfig, p: str) -> dict[str, Shape]:
    h, d = cfg.hidden_size, cfg.head_dim
    q_out = cfg.num_attention_heads * d * (2 if cfg.attn_output_gate else 1)
    kv_out = cfg.num_key_value_heads * d
    t = {
        f"{p}.self_attn.q_proj.weight": (q_out, h),
        f"{p}.self_attn.k_proj.weight": (kv_out, h),
        f"{p}.self_attn.v_proj.weight": (kv_out, h),
        f"{p}.self_attn.o_proj.weight": (h, cfg.num_attention_heads * d),
        f"{p}.self_attn.q_norm.weight": (d,),
        f"{p}.self_attn.k_norm.weight": (d,),
    }
    if cfg.attention_bias:
        t.update({f"{p}.self_attn.q_proj.bias": (q_out,), f"{p}.self_attn.k_proj.bias": (kv_out,),
                  f"{p}.self_attn.v_proj.bias": (kv_out,), f"{p}.self_attn.o_proj.bias": (h,)})
    return t


def _deltanet(cfg: ModelConfig, p: str) -> dict[str, Shape]:
    h, nv = cfg.hidden_size, cfg.linear_num_value_heads
    return {
        f"{p}.linear_attn.in_proj_qkv.weight": (cfg.linear_conv_dim, h),
        f"{p}.linear_attn.in_proj_z.weight": (cfg.linear_value_dim, h),
        f"{p}.linear_attn.in_proj_b.weight": (nv, h),
        f"{p}.linear_attn.in_proj_a.weight": (nv, h),
        f"{p}.linear_attn.conv1d.weight": (cfg.linear_conv_dim, 1, cfg.linear_conv_kernel_dim),
        f"{p}.linear_attn.dt_bias": (nv,),
        f"{p}.linear_attn.A_log": (nv,),
        f"{p}.linear_attn.norm.weight": (cfg.linear_value_head_dim,),
        f"{p}.linear_attn.out_proj.weight": (h, cfg.linear_value_dim),
    }


def _mlp(p: str, h: int, inter: int) -> dict[str, Shape]:
    return {f"{p}.gate_proj.weight": (inter, h), f"{p}.up_proj.weight": (inter, h),
            f"{p}.down_proj.weight": (h, inter)}


def _ffn(cfg: ModelConfig, i: int, p: str) -> dict[str, Shape]:
    h = cfg.hidden_size
    if not cfg.layer_is_moe(i):
        return _mlp(f"{p}.mlp", h, cfg.intermediate_size)
    e, inter = cfg.num_experts, cfg.moe_intermediate_size
    t = {
        f"{p}.mlp.gate.weight": (e, h),
        f"{p}.mlp.experts.gate_proj": (e, inter, h),
        f"{p}.mlp.experts.up_proj": (e, inter, h),
        f"{p}.mlp.experts.down_proj": (e, h, inter),
    }
    if cfg.shared_expert_intermediate_size:
        t.update(_mlp(f"{p}.mlp.shared_expert", h, cfg.shared_expert_intermediate_size))
        t[f"{p}.mlp.shared_expert_gate.weight"] = (1, h)
    return t


def layer_tensors(cfg: ModelConfig, i: int, prefix: str = "model.layers", kind: str | None = None) -> dict[str, Shape]:
    """Tensors of decoder layer `i` (its mixer per `cfg.layer_types[i]` unless `kind` overrides)."""
    p = f"{prefix}.{i}"
    kind = kind or cfg.layer_types[i]
    t = {f"{p}.input_layernorm.weight": (cfg.hidden_size,),
         f"{p}.post_attention_layernorm.weight": (cfg.hidden_size,)}
    t.update(_attention(cfg, p) if kind == FULL_ATTENTION else _deltanet(cfg, p))
    t.update(_ffn(cfg, i, p))
    return t


def mtp_tensors(cfg: ModelConfig) -> dict[str, Shape]:
    """The multi-token-prediction head: fc over [norm(embed); norm(hidden)], full-attention layer(s), norm."""
    h = cfg.hidden_size
    t: dict[str, Shape] = {
        "mtp.pre_fc_norm_embedding.weight": (h,),
        "mtp.pre_fc_norm_hidden.weight": (h,),
        "mtp.fc.weight": (h, 2 * h),
        "mtp.norm.weight": (h,),
    }
    for j in range(cfg.mtp_num_hidden_layers):
        t.update(layer_tensors(cfg, j, prefix="mtp.layers", kind=FULL_ATTENTION))
    return t


def is_product_weight(name: str) -> bool:
    """Whether tensor `name` is the weight of one of a layer's linear products (q / k / v / o, gate / up / down,
    the DeltaNet's in_proj_* and out_proj, shared experts' and MTP layers' likewise): `*_proj*.weight`, not the
    embedding, the LM head, norms, convolutions or routers."""
    parts = name.rsplit(".", 2)
    return len(parts) == 3 and parts[2] == "weight" and "_proj" in parts[1]


def keeps_prefill_copy(name: str) -> bool:
    """Whether the server's `prefill_weights=bf16` keeps a bf16 copy of tensor `name` (where it is quantised and
    2-D): the products prompt chunks run (`is_product_weight`), not the MTP layers' (the engine does not run
    them)."""
    return is_product_weight(name) and not name.startswith("mtp.")


def expected_tensors(cfg: ModelConfig, include_mtp: bool = True) -> dict[str, Shape]:
    """Every tensor the model needs, name -> shape, in a stable order (embeddings first, head last)."""
    t: dict[str, Shape] = {"model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size)}
    for i in range(cfg.num_hidden_layers):
        t.update(layer_tensors(cfg, i))
    t["model.norm.weight"] = (cfg.hidden_size,)
    if not cfg.tie_word_embeddings:
        t["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    if include_mtp and cfg.mtp_num_hidden_layers:
        t.update(mtp_tensors(cfg))
    return t


def init_value(cfg: ModelConfig, name: str, shape: Shape, rng: np.random.Generator, std: float = 0.02) -> np.ndarray:
    """A plausible initial value for one tensor (the scheme HF uses for these families), float32."""
    if name.endswith("A_log"):
        return np.log(rng.uniform(1.0, 16.0, size=shape)).astype(np.float32)
    f32 = np.float32
    if name.endswith("dt_bias"):
        return np.ones(shape, np.float32)
    if len(shape) == 1 and "norm" in name:
        # zero-centred norms (1 + w) start at 0 ... but a gated DeltaNet norm multiplies by w directly.
        if cfg.norm_offset and "linear_attn.norm" not in name:
            return rng.standard_normal(shape, dtype=f32) * f32(0.1)
        return f32(1.0) + rng.standard_normal(shape, dtype=f32) * f32(0.1)
    out = rng.standard_normal(shape, dtype=f32)  # float32 throughout: a 27B tensor never exists in float64
    out *= f32(std)
    return out


def random_tensors(cfg: ModelConfig, seed: int = 0, include_mtp: bool = True, std: float = 0.02,
                   names: Iterable[str] | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """Seeded random weights, one tensor at a time (so a 27B config never sits whole in host RAM).

    Each tensor gets its own generator keyed by (seed, its index in `expected_tensors`), so any subset
    (`names`) is generated alone and equals the same tensors of a full run.
    """
    wanted = None if names is None else set(names)
    for idx, (name, shape) in enumerate(expected_tensors(cfg, include_mtp).items()):
        if wanted is not None and name not in wanted:
            continue
        rng = np.random.default_rng([seed, idx])
        yield name, init_value(cfg, name, shape, rng, std)
