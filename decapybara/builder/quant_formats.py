"""Weight presets (tiny ... xxl) as `WeightFormat`s, and the same weights materialised in memory.

Per tensor, `storage_format` decides what a build with ``--weights PRESET`` stores: ``f32``, ``bf16`` or a block
format from `preset_formats` (docs/quant.md). A block-quantised tensor is written as the raw parts
``name:codes``, ``name:scales`` (and ``name:tensor_scale``); the ``:codes`` entry carries
``quant = {"format", "shape", "method"}``, which is what `decapybara.model.load` reads back as a `QuantTensor`.

`Quantizer` picks the method per tensor: GPTQ where a calibration Hessian is known and the format has at most
`gptq_max_bits` bits (default 8: every block format), round-to-nearest otherwise (an untied embedding table and
the MTP head, which the calibration forward never multiplies).
Stacked MoE experts [E, N, K] are quantised expert by expert, each under its own Hessian (see
`decapybara.builder.calibrate`). Results are cached per (tensor, format), so a build that measures every preset
and then writes one quantises each pair once.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from decapybara.builder.formats import EncodedTensor
from decapybara.builder.hf import SourceTensor, plan_tensors, read_checkpoint
from decapybara.dtypes import bf16_to_f32, f32_to_bf16
from decapybara.errors import ConfigError
from decapybara.model.config import ModelConfig
from decapybara.model.quant import (
    QuantTensor,
    format_nbytes,
    get_format,
    gptq_quantize,
    preset_formats,
    quantize,
)
from decapybara.model.quant.presets import PRESETS
from decapybara.model.weights import Shape, expected_tensors

QUANT_PRESETS = tuple(p for p in PRESETS if p != "bf16")  # tiny, small, medium, large, xxl
WEIGHT_PRESETS = (*QUANT_PRESETS, "bf16", "fp32")  # every value of ``--weights``, smallest first
# NOTE: GPTQ on every block format by default. Measured on a small trained qwen3_5_text (4,096 held-out tokens,
# two seeds), KL against RTN: tiny -15 / -35 %, small -31 / -43 %, medium -28 / -42 % (4- and 6-bit tensors), and
# at 8 bits too: large -14 / -22 %, xxl -22 / -36 %. The random test model gains less (isotropic activations).
GPTQ_MAX_BITS = 8


def storage_format(preset: str, name: str, shape: Shape, cfg: ModelConfig) -> str:
    """What ``--weights preset`` stores tensor `name` as: ``f32``, ``bf16`` or a block format name.

    ``fp32`` keeps everything float32; ``bf16`` is the plain float build (every tensor of ndim >= 2 in bf16,
    conv1d included, vectors float32); the quantised presets follow `preset_formats`."""
    if preset == "fp32":
        return "f32"
    if preset == "bf16":
        return "f32" if len(shape) <= 1 else "bf16"
    if preset not in QUANT_PRESETS:
        raise ConfigError(f"unknown weight preset {preset!r}; known: {', '.join(WEIGHT_PRESETS)}")
    return preset_formats(preset, name, cfg)


def weights_bytes(preset: str, cfg: ModelConfig) -> int:
    """Bytes of every weight of `cfg` (MTP included when the config has it) stored under `preset`."""
    return sum(format_nbytes(storage_format(preset, name, shape, cfg), shape)
               for name, shape in expected_tensors(cfg).items())


@dataclass(slots=True)
class Quantizer:
    """Block-quantises one tensor: GPTQ under `hessians[name]` when known and the format has at most
    `gptq_max_bits` bits, else round-to-nearest. `hessians` maps a weight name to H = sum x x^T of its input,
    [K, K] (stacked experts: [E, K, K]); None means round-to-nearest everywhere. Results are cached by
    (name, format, method): use one Quantizer per float source."""

    hessians: Mapping[str, np.ndarray] | None = None
    gptq_max_bits: int = GPTQ_MAX_BITS
    damp: float = 0.01
    _cache: dict[tuple[str, str, str], QuantTensor] = field(default_factory=dict, init=False, repr=False)

    def method(self, name: str, fmt: str) -> str:
        """``gptq`` or ``rtn``: what `quantize(name, ..., fmt)` will do."""
        use = (self.hessians is not None and name in self.hessians and get_format(fmt).bits <= self.gptq_max_bits
               and not get_format(fmt).tensor_scale)  # NVFP4 would need one tensor scale across experts
        return "gptq" if use else "rtn"

    def quantize(self, name: str, w: np.ndarray, fmt: str) -> QuantTensor:
        """`w` (float32, the tensor named `name`) in block format `fmt`; cached per (name, fmt, method)."""
        method = self.method(name, fmt)
        key = (name, fmt, method)
        q = self._cache.get(key)
        if q is None:
            q = self._gptq(name, w, fmt) if method == "gptq" else quantize(w, fmt)
            self._cache[key] = q
        return q

    def _gptq(self, name: str, w: np.ndarray, fmt: str) -> QuantTensor:
        h = self.hessians[name]
        if w.ndim == 2:
            return gptq_quantize(w, h, fmt, damp=self.damp)
        # Stacked experts [E, N, K]: one GPTQ per expert, under that expert's Hessian [E, K, K].
        per = [gptq_quantize(w[e], h[e], fmt, damp=self.damp) for e in range(w.shape[0])]
        return QuantTensor(fmt, w.shape, np.stack([q.codes for q in per]), np.stack([q.scales for q in per]))

    def info(self) -> dict[str, Any]:
        if self.hessians is None:
            return {"method": "rtn"}
        return {"method": "gptq", "gptq_max_bits": self.gptq_max_bits, "damp": self.damp}


def materialize(preset: str, cfg: ModelConfig, tensors: Mapping[str, np.ndarray],
                quantizer: Quantizer | None = None) -> Iterator[tuple[str, np.ndarray | QuantTensor]]:
    """(name, value) of every tensor as a ``--weights preset`` file would load it: float32 arrays (bf16 ones
    already rounded) and `QuantTensor`s, bit-identical to what `build` writes with the same `quantizer`."""
    quantizer = quantizer or Quantizer()
    for name, w in tensors.items():
        fmt = storage_format(preset, name, w.shape, cfg)
        if fmt == "f32":
            yield name, w
        elif fmt == "bf16":
            yield name, bf16_to_f32(f32_to_bf16(w))
        else:
            yield name, quantizer.quantize(name, w, fmt)


@dataclass(slots=True)
class PresetFormat:
    """The `WeightFormat` of a size preset. `prepare` (called by `build` with the checkpoint's config) must run
    before `encode`; the quantizer decides RTN or GPTQ per tensor."""

    name: str
    quantizer: Quantizer = field(default_factory=Quantizer)
    config: ModelConfig | None = None
    calibration: dict[str, Any] | None = None  # described in metadata["weights"] (no paths, no times)

    def __post_init__(self) -> None:
        if self.name not in WEIGHT_PRESETS:
            raise ConfigError(f"unknown weight preset {self.name!r}; known: {', '.join(WEIGHT_PRESETS)}")

    def prepare(self, config: ModelConfig, tensors: Iterable[SourceTensor]) -> None:
        self.config = config

    def info(self) -> dict[str, Any]:
        out: dict[str, Any] = {"format": self.name, "preset": self.name, **self.quantizer.info()}
        if self.calibration is not None:
            out["calibration"] = dict(self.calibration)
        return out

    def encode(self, tensor: SourceTensor) -> Iterator[EncodedTensor]:
        if self.config is None:
            raise ConfigError(f"weight preset {self.name!r}: prepare(config, tensors) was not called")
        fmt = storage_format(self.name, tensor.name, tensor.shape, self.config)
        if fmt in ("f32", "bf16"):
            yield EncodedTensor(tensor.name, fmt, tensor.shape, tensor.blocks(fmt))
            return
        q = self.quantizer.quantize(tensor.name, tensor.float32(), fmt)
        method = self.quantizer.method(tensor.name, fmt)
        for part, arr in q.to_parts().items():
            quant = {"format": fmt, "shape": list(q.shape), "method": method} if part == "codes" else None
            dtype = "f32" if part == "tensor_scale" else "u8"
            yield EncodedTensor(f"{tensor.name}:{part}", dtype, arr.shape, [arr], quant)


def read_source(src: str | Path) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """The checkpoint's config (as `build` sees it) and every canonical tensor as float32, in order."""
    ckpt = read_checkpoint(src)
    try:
        plan = plan_tensors(ckpt)
        return ckpt.config, {t.name: t.float32() for t in plan}
    finally:
        ckpt.close()
