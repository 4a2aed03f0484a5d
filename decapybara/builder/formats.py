"""Weight formats: how each canonical tensor is encoded into one or more stored tensors.

This is the seam for quantisation. A `WeightFormat` turns one `SourceTensor` into `EncodedTensor`s; the
float formats store one tensor each, a quantised format (registered later by decapybara.model.quant with
`register_format`) may store ``name:codes``, ``name:scales``... with a `quant` dict describing them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from decapybara.builder.hf import SourceTensor
from decapybara.errors import ConfigError
from decapybara.model.weights import Shape


@dataclass(slots=True, frozen=True)
class EncodedTensor:
    """A tensor to store: `chunks` are C-order pieces in the storage dtype (bf16 as uint16)."""

    name: str
    dtype: str
    shape: Shape
    chunks: Iterable[np.ndarray]
    quant: dict[str, Any] | None = None


class WeightFormat(Protocol):
    """Contract: `encode` is called once per canonical tensor, in order, and may read it lazily
    (`tensor.blocks(dtype)`) or whole (`tensor.float32()`); `info()` becomes metadata["weights"].
    A format may also define `prepare(config, tensors)`: `build` then calls it once, with the checkpoint's
    `ModelConfig` and the list of `SourceTensor`s, before `info()` and the first `encode`."""

    name: str

    def info(self) -> dict[str, Any]: ...

    def encode(self, tensor: SourceTensor) -> Iterable[EncodedTensor]: ...


@dataclass(slots=True, frozen=True)
class FloatFormat:
    """Matrices (ndim >= 2) as `matrix_dtype`; vectors (norms, A_log, dt_bias, biases) as `vector_dtype`."""

    name: str
    matrix_dtype: str
    vector_dtype: str = "f32"

    def info(self) -> dict[str, Any]:
        return {"format": self.name, "matrix_dtype": self.matrix_dtype, "vector_dtype": self.vector_dtype}

    def encode(self, tensor: SourceTensor) -> Iterable[EncodedTensor]:
        dtype = self.vector_dtype if len(tensor.shape) <= 1 else self.matrix_dtype
        yield EncodedTensor(tensor.name, dtype, tensor.shape, tensor.blocks(dtype))


_FORMATS: dict[str, Callable[[], WeightFormat]] = {
    "bf16": lambda: FloatFormat("bf16", "bf16"),
    "fp32": lambda: FloatFormat("fp32", "f32"),
}


def register_format(name: str, factory: Callable[[], WeightFormat]) -> None:
    """Make `build(..., weights=name)` use `factory()` (quantisation presets plug in here)."""
    _FORMATS[name] = factory


def _register_presets() -> None:
    """The size presets (tiny ... xxl) live in decapybara.builder.quant_formats; imported on first use."""
    from decapybara.builder.quant_formats import QUANT_PRESETS, PresetFormat

    for name in QUANT_PRESETS:
        if name not in _FORMATS:
            register_format(name, lambda name=name: PresetFormat(name))


def format_names() -> list[str]:
    _register_presets()
    return list(_FORMATS)


def resolve_format(weights: str | WeightFormat) -> WeightFormat:
    """A format by name, or the given format object; ConfigError naming the known formats otherwise."""
    if not isinstance(weights, str):
        return weights
    _register_presets()
    try:
        return _FORMATS[weights]()
    except KeyError:
        raise ConfigError(f"unknown weight format {weights!r}; known: {', '.join(_FORMATS)}") from None
