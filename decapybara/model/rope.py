"""Rotary position embedding tables (default and YaRN), computed on the host in float32.

`RotaryTable.cos_sin(positions)` returns cos/sin of shape [T, rotary_dim // 2] for arbitrary positions, so no
table proportional to the context (up to 1M tokens) is ever materialised. Values equal transformers'
(inv_freq in float32, angle = position * inv_freq in float32, then cos/sin, times the attention factor).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from decapybara.model.config import ModelConfig


def default_inv_freq(theta: float, dim: int) -> np.ndarray:
    """1 / theta^(2i/dim) for i < dim/2, float32 (same op order as HF: float32 arange / dim)."""
    exps = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    return (1.0 / (np.float32(theta) ** exps)).astype(np.float32)


def yarn_inv_freq(theta: float, dim: int, factor: float, original_max: int, beta_fast: float,
                  beta_slow: float, truncate: bool = True) -> np.ndarray:
    """YaRN: interpolate low frequencies by `factor`, keep high ones, linear ramp in between."""

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original_max / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    pos_freqs = np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim))
    extrapolation = (1.0 / pos_freqs).astype(np.float32)
    interpolation = (1.0 / (np.float32(factor) * pos_freqs)).astype(np.float32)
    extra_factor = (1 - ramp).astype(np.float32)
    return (interpolation * (1 - extra_factor) + extrapolation * extra_factor).astype(np.float32)


def yarn_attention_factor(factor: float, mscale: float, mscale_all_dim: float) -> float:
    def get(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if mscale and mscale_all_dim:
        return get(factor, mscale) / get(factor, mscale_all_dim)
    return get(factor)


@dataclass(slots=True)
class RotaryTable:
    """Inverse frequencies and the attention factor of a model's rotary embedding."""

    inv_freq: np.ndarray  # [rotary_dim // 2] float32
    attention_factor: float = 1.0

    @classmethod
    def for_config(cls, cfg: ModelConfig) -> RotaryTable:
        r, dim = cfg.rope, cfg.rotary_dim
        if r.kind == "yarn":
            inv = yarn_inv_freq(r.theta, dim, r.factor, r.original_max_position_embeddings, r.beta_fast, r.beta_slow,
                                r.truncate)
            att = r.attention_factor if r.attention_factor is not None else yarn_attention_factor(
                r.factor, r.mscale, r.mscale_all_dim)
            return cls(inv, float(att))
        return cls(default_inv_freq(r.theta, dim), 1.0)

    def cos_sin(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin: [T, rotary_dim // 2] float32 for integer positions [T]."""
        freqs = positions.astype(np.float32)[:, None] * self.inv_freq[None, :]  # [T, rot/2]
        cos = np.cos(freqs)
        sin = np.sin(freqs)
        if self.attention_factor != 1.0:
            cos = cos * np.float32(self.attention_factor)
            sin = sin * np.float32(self.attention_factor)
        return cos.astype(np.float32), sin.astype(np.float32)
