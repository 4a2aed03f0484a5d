"""The dense weight products of one decode step of a model, as the model runs them fused: [N, K] and count.

    python3 bench/step_products.py [config name ...]   # default: qwen3.8-27b qwen3.8-35b-a3b

Read off the model's tensors (`decapybara.model.weights.expected_tensors`), no GPU needed. Per layer of the main
model: attention q|k|v (q_proj, k_proj, v_proj stacked, as `QwenModel._fuse_attention_inputs` stacks them) and its
o_proj ("out"); DeltaNet qkv|z (in_proj_qkv then in_proj_z, `_fuse_deltanet_inputs`) and its out_proj ("out"); a
dense MLP's gate|up (`_fuse_mlps`) and down; lm_head (or the tied embedding) once. Products of one role and shape
are counted together; a role met at two shapes takes the shape into the second one's name. Left out: products that
do not run on the skinny kernels as dense launches of these shapes (DeltaNet's b|a, an MoE block's router|gate:
bf16 on gemv_small; the experts and the shared expert: grouped launches over their stacks) and the MTP head.
`bench/gemv_sweep.py` times these (SWEEP_MODEL).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from decapybara.model.config import ModelConfig, named_config
from decapybara.model.weights import expected_tensors

# role -> the tensors of a layer (after "model.layers.<i>.") stacked along N, in the order the roles are listed
ROLES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("gate|up", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    ("down", ("mlp.down_proj.weight",)),
    ("qkv|z", ("linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight")),
    ("out", ("linear_attn.out_proj.weight",)),
    ("out", ("self_attn.o_proj.weight",)),
    ("q|k|v", ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")),
)


def step_products(cfg: ModelConfig) -> dict[str, tuple[tuple[int, int], int]]:
    """name -> ((N, K), products of that shape a decode step runs), in ROLES' order, lm_head last."""
    tensors = expected_tensors(cfg)
    layers: dict[int, dict[str, tuple[int, ...]]] = {}
    for name, shape in tensors.items():
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
        if m:
            layers.setdefault(int(m.group(1)), {})[m.group(2)] = shape
    out: dict[str, tuple[tuple[int, int], int]] = {}

    def add(role: str, shape: tuple[int, int], count: int = 1) -> None:
        name = role
        if name in out and out[name][0] != shape:
            name = f"{role} {shape[0]}x{shape[1]}"
        prev = out.get(name, (shape, 0))
        out[name] = (shape, prev[1] + count)

    for role, parts in ROLES:
        for i in sorted(layers):
            shapes = [layers[i].get(p) for p in parts]
            if all(s is not None and len(s) == 2 for s in shapes):
                add(role, (sum(s[0] for s in shapes), shapes[0][1]))
    head = tensors.get("lm_head.weight") or tensors["model.embed_tokens.weight"]
    add("lm_head", (head[0], head[1]))
    return out


def main() -> None:
    for name in sys.argv[1:] or ["qwen3.8-27b", "qwen3.8-35b-a3b"]:
        products = step_products(named_config(name))
        print(f"{name}: dense products of a decode step")
        for role, ((n, k), count) in products.items():
            print(f"  {role:<16} [{n:>6} x {k:>5}] x {count:>3}")


if __name__ == "__main__":
    main()
