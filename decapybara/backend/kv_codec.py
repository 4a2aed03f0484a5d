"""How KV vectors are stored in pages: float32 (the exact reference), bf16, or a microscaled KV mode.

A codec maps x [..., head_dim] float32 to named storage parts and back. Key and value may use different
formats (KV mode "6/4" = 6-bit keys, 4-bit values); `kv` selects "k" or "v". `kv_bytes_per_token` is the
one count of a mode's bytes per token (the caches' allocations, the server's pool sizing, the planner).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from decapybara.dtypes import bf16_to_f32, f32_to_bf16
from decapybara.errors import ConfigError
from decapybara.model import quant
from decapybara.model.config import ModelConfig

# The one bf16 codec of the project (round to nearest even, NaN kept quiet), under the names pages use.
f32_to_bf16_bits = f32_to_bf16
bf16_bits_to_f32 = bf16_to_f32


class KVCodec:
    """Interface: storage parts per element vector, encode, decode."""

    name = "abstract"

    def parts(self, head_dim: int, kv: str) -> dict[str, tuple[tuple[int, ...], Any]]:
        raise NotImplementedError

    def encode(self, x: np.ndarray, kv: str) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def decode(self, parts: dict[str, np.ndarray], kv: str, head_dim: int) -> np.ndarray:
        raise NotImplementedError


@dataclass(slots=True)
class F32Codec(KVCodec):
    """Full precision pages (float32; float64 for the exactness reference)."""

    dtype: Any = np.float32
    name = "32/32"

    def parts(self, head_dim: int, kv: str) -> dict[str, tuple[tuple[int, ...], Any]]:
        return {"x": ((head_dim,), self.dtype)}

    def encode(self, x: np.ndarray, kv: str) -> dict[str, np.ndarray]:
        return {"x": x}

    def decode(self, parts: dict[str, np.ndarray], kv: str, head_dim: int) -> np.ndarray:
        return parts["x"]


class BF16Codec(KVCodec):
    name = "16/16"

    def parts(self, head_dim: int, kv: str) -> dict[str, tuple[tuple[int, ...], Any]]:
        return {"x": ((head_dim,), np.uint16)}

    def encode(self, x: np.ndarray, kv: str) -> dict[str, np.ndarray]:
        return {"x": f32_to_bf16_bits(x)}

    def decode(self, parts: dict[str, np.ndarray], kv: str, head_dim: int) -> np.ndarray:
        return bf16_bits_to_f32(parts["x"])


@dataclass(slots=True)
class MicroscaledCodec(KVCodec):
    """Key and value each in bf16 (16 bits) or a 32-element microscaled format (8, 6 or 4 bits)."""

    key_bits: int
    value_bits: int

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"{self.key_bits}/{self.value_bits}"

    def _bits(self, kv: str) -> int:
        return self.key_bits if kv == "k" else self.value_bits

    def parts(self, head_dim: int, kv: str) -> dict[str, tuple[tuple[int, ...], Any]]:
        return quant.kv_storage_parts(self._bits(kv), head_dim)

    def encode(self, x: np.ndarray, kv: str) -> dict[str, np.ndarray]:
        return quant.quantize_kv(x, self._bits(kv))

    def decode(self, parts: dict[str, np.ndarray], kv: str, head_dim: int) -> np.ndarray:
        return quant.dequantize_kv(parts, self._bits(kv), head_dim)


def codec_for(kv_mode: Any, full_dtype: Any = np.float32) -> KVCodec:
    """The codec for a KV mode: None or "32/32" -> full precision, "16/16" -> bf16, "K/V" -> microscaled."""
    if kv_mode is None:
        return F32Codec(full_dtype)
    text = kv_mode if isinstance(kv_mode, str) else getattr(kv_mode, "name", str(kv_mode))
    if text == "32/32":
        return F32Codec(full_dtype)
    if text == "16/16":
        return BF16Codec()
    try:
        kb, vb = (int(p) for p in text.split("/"))
    except ValueError:
        raise ConfigError(f"bad KV mode {text!r}; expected K/V bits such as 6/6, 8/8, 6/4, 4/4, 16/16") from None
    if kb not in (4, 6, 8, 16) or vb not in (4, 6, 8, 16):
        raise ConfigError(f"bad KV mode {text!r}; bits must be 4, 6, 8 or 16")
    return MicroscaledCodec(kb, vb)


def kv_bytes_per_token(cfg: ModelConfig, kv_mode: Any, include_mtp: bool = True) -> int:
    """Bytes one token's keys and values take across every attention layer (the MTP head's included, as the
    caches allocate them; `include_mtp` False: the decoder layers a step reads) under `kv_mode` (None: float32
    pages, the numpy reference's default; "16/16" bf16; "K/V" microscaled with their E8M0 scale bytes): the
    codec's storage parts, so exactly what the KV caches allocate."""
    codec = codec_for(kv_mode, np.float32)
    per_head = sum(math.prod(shape) * np.dtype(dtype).itemsize
                   for kv in ("k", "v") for shape, dtype in codec.parts(cfg.head_dim, kv).values())
    layers = len(cfg.attention_layers) + (cfg.mtp_num_hidden_layers if include_mtp else 0)
    return per_head * cfg.num_key_value_heads * layers
