"""KV-cache modes (key bits / value bits) and the per-vector codecs the paged KV pool stores.

Bits 16 = bfloat16 (round to nearest even from float32): part "codes" uint16 [..., head_dim]. Bits 8/6/4 =
MXFP8 (E4M3) / MXFP6 (E2M3) / MXFP4 (E2M1) along head_dim: part "codes" uint8 [..., Dp * bits / 8] packed as
`QuantTensor.codes`, part "scales" uint8 E8M0 [..., Dp / 32], Dp = head_dim rounded up to 32 (zero padding).
One vector = one token of one KV head.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from decapybara.errors import ConfigError
from decapybara.model.quant.blocks import QuantTensor, dequantize, get_format, quantize
from decapybara.model.quant.elements import bf16_decode, bf16_encode

KV_FORMATS = {16: "bf16", 8: "mxfp8", 6: "mxfp6", 4: "mxfp4"}
KV_MODES = ("16/16", "8/8", "6/6", "6/4", "4/4")


@dataclass(slots=True, frozen=True)
class KVMode:
    """Key and value bits of the KV cache; only the pairs in `KV_MODES` exist."""

    key_bits: int = 16
    value_bits: int = 16

    def __post_init__(self) -> None:
        if str(self) not in KV_MODES:
            raise ConfigError(f"unsupported KV mode {self}; supported: {', '.join(KV_MODES)}")

    def __str__(self) -> str:
        return f"{self.key_bits}/{self.value_bits}"

    @property
    def name(self) -> str:
        return str(self)

    @classmethod
    def parse(cls, text: str) -> KVMode:
        """``"6/4"`` -> KVMode(6, 4); anything else is a `ConfigError`."""
        m = re.fullmatch(r"\s*(\d{1,2})\s*/\s*(\d{1,2})\s*", text) if isinstance(text, str) else None
        if m is None:
            raise ConfigError(f"KV mode must look like 'K/V' (one of {', '.join(KV_MODES)}), got {text!r}")
        return cls(int(m.group(1)), int(m.group(2)))

    @property
    def key_format(self) -> str:
        return KV_FORMATS[self.key_bits]

    @property
    def value_format(self) -> str:
        return KV_FORMATS[self.value_bits]

    @property
    def bytes_per_element(self) -> tuple[float, float]:
        """(key, value) bytes per element, block scales included (head_dim a multiple of 32)."""
        return _element_bytes(self.key_bits), _element_bytes(self.value_bits)


def _element_bytes(bits: int) -> float:
    return 2.0 if bits == 16 else get_format(KV_FORMATS[bits]).bits_per_weight / 8


def kv_storage_parts(bits: int, head_dim: int) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Per-vector storage of `quantize_kv`: part name -> (shape, dtype)."""
    if bits not in KV_FORMATS:
        raise ConfigError(f"unsupported KV bits {bits}; supported: {sorted(KV_FORMATS)}")
    if bits == 16:
        return {"codes": ((head_dim,), np.dtype(np.uint16))}
    f = get_format(KV_FORMATS[bits])
    return {"codes": (f.code_shape((head_dim,)), np.dtype(np.uint8)),
            "scales": (f.scale_shape((head_dim,)), np.dtype(np.uint8))}


def kv_vector_bytes(head_dim: int, bits: int) -> int:
    """Bytes of one [head_dim] vector (codes + scales)."""
    return sum(math.prod(shape) * dt.itemsize for shape, dt in kv_storage_parts(bits, head_dim).values())


def quantize_kv(x: np.ndarray, bits: int) -> dict[str, np.ndarray]:
    """x [..., head_dim] (float32) -> {"codes", "scales"} (bf16: "codes" only), see `kv_storage_parts`."""
    x = np.asarray(x, np.float32)
    spec = kv_storage_parts(bits, x.shape[-1])
    if bits == 16:
        return {"codes": bf16_encode(x)}
    if x.size == 0:  # no vectors: empty arrays of the stored widths
        return {k: np.zeros((*x.shape[:-1], *shape), dt) for k, (shape, dt) in spec.items()}
    q = quantize(x, KV_FORMATS[bits])
    return {"codes": q.codes, "scales": q.scales}


def dequantize_kv(parts: Mapping[str, np.ndarray], bits: int, head_dim: int) -> np.ndarray:
    """Inverse of `quantize_kv`: float32 [..., head_dim]."""
    spec = kv_storage_parts(bits, head_dim)
    if set(parts) != set(spec):
        raise ValueError(f"KV parts for {bits} bits are {sorted(spec)}, got {sorted(parts)}")
    codes = np.asarray(parts["codes"])
    if bits == 16:
        return bf16_decode(codes)
    lead = codes.shape[:-1]
    if math.prod(lead) == 0:
        return np.zeros((*lead, head_dim), np.float32)
    return dequantize(QuantTensor(KV_FORMATS[bits], (*lead, head_dim), codes, np.asarray(parts["scales"])))
