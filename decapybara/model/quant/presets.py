"""Size presets: which format each weight of a model is stored in, and what the whole model then weighs.

Every tensor has a role; each preset maps roles to formats (see `PRESET_TABLE` and docs/quant.md). Whatever
the preset, 1-D tensors (norms, biases, A_log, dt_bias) and the DeltaNet conv1d stay float32, and the small
gate projections (MoE router, shared-expert gate, DeltaNet in_proj_a / in_proj_b) stay bf16: they are a tiny
share of the bytes and steer routing and recurrent decay.
"""

from __future__ import annotations

import functools

from decapybara.errors import ConfigError
from decapybara.model.config import ModelConfig
from decapybara.model.quant.blocks import format_nbytes
from decapybara.model.weights import Shape, expected_tensors

PRESETS = ("tiny", "small", "medium", "large", "xxl", "bf16")

# role -> format per preset, in the order of PRESETS
PRESET_TABLE: dict[str, tuple[str, ...]] = {
    "embed": ("mxfp6", "mxfp6", "mxfp6", "mxfp8", "mxfp8", "bf16"),
    "head": ("mxfp6", "mxfp6", "mxfp8", "mxfp8", "bf16", "bf16"),
    # attention and DeltaNet projections, mtp.fc
    "mixer": ("mxfp4", "mxfp6", "mxfp6", "mxfp8", "mxfp8", "bf16"),
    "mlp_in": ("mxfp4", "mxfp4", "mxfp4", "mxfp6", "mxfp8", "bf16"),  # gate_proj, up_proj (experts too)
    "mlp_out": ("mxfp4", "mxfp4", "mxfp6", "mxfp6", "mxfp8", "bf16"),  # down_proj
}
_GATES = ("mlp.gate.weight", "shared_expert_gate.weight", "linear_attn.in_proj_a.weight",
          "linear_attn.in_proj_b.weight")


def tensor_role(name: str, shape: Shape, tied: bool = False) -> str:
    """The role of a tensor: a key of `PRESET_TABLE`, or ``f32`` / ``bf16`` for the fixed-precision ones."""
    if len(shape) == 1 or name.endswith("conv1d.weight"):
        return "f32"
    if name.endswith(_GATES):
        return "bf16"
    if name == "model.embed_tokens.weight":
        return "head" if tied else "embed"
    if name == "lm_head.weight":
        return "head"
    if name.endswith(("gate_proj.weight", "up_proj.weight", "experts.gate_proj", "experts.up_proj")):
        return "mlp_in"
    if name.endswith(("down_proj.weight", "experts.down_proj")):
        return "mlp_out"
    if ".self_attn." in name or ".linear_attn." in name or name == "mtp.fc.weight":
        return "mixer"
    raise ConfigError(f"no preset role for tensor {name!r}")


@functools.lru_cache(maxsize=8)
def _shapes(cfg: ModelConfig) -> dict[str, Shape]:
    return expected_tensors(cfg)


def _preset_index(preset: str) -> int:
    try:
        return PRESETS.index(preset)
    except ValueError:
        raise ConfigError(f"unknown size preset {preset!r}; known: {', '.join(PRESETS)}") from None


def preset_formats(preset: str, tensor_name: str, cfg: ModelConfig) -> str:
    """Format of `tensor_name` under `preset`: a block format name, ``bf16`` or ``f32``."""
    i = _preset_index(preset)
    shape = _shapes(cfg).get(tensor_name)
    if shape is None:
        raise ConfigError(f"{tensor_name!r} is not a tensor of this {cfg.model_type} config")
    role = tensor_role(tensor_name, shape, cfg.tie_word_embeddings)
    return role if role in ("f32", "bf16") else PRESET_TABLE[role][i]


def preset_bytes(preset: str, cfg: ModelConfig) -> int:
    """Bytes of every tensor of `expected_tensors(cfg)` (MTP included) stored under `preset`."""
    shapes = _shapes(cfg)
    return sum(format_nbytes(preset_formats(preset, name, cfg), shape) for name, shape in shapes.items())
