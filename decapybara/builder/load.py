"""Reading a built .mcapy back for the model: its config and its float weights as float32."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

from decapybara.dtypes import FLOAT_DTYPES, to_float32
from decapybara.errors import ConfigError, WeightError
from decapybara.mcapy import McapyFile
from decapybara.model.config import ModelConfig


def load_config(f: McapyFile) -> ModelConfig:
    """The `ModelConfig` stored in the metadata (ConfigError when absent or invalid)."""
    d = f.metadata.get("model_config")
    if not isinstance(d, dict):
        raise ConfigError(f"{f.name} has no model_config in its metadata (not built by decapybara?)")
    return ModelConfig.from_dict(d)


def iter_float32(f: McapyFile, names: Iterable[str] | None = None,
                 verify: bool = True) -> Iterator[tuple[str, np.ndarray]]:
    """(name, float32 array) for `names` (default: all, in file order), one at a time. f32 tensors are
    read-only views of the file; bf16/f16/f64 are widened into new arrays. A quantised or integer tensor
    raises WeightError (its codec, not this function, must decode it)."""
    for name in f.names() if names is None else names:
        if name not in f:
            raise WeightError(f"{f.name} has no tensor {name!r}")
        t = f.tensors[name]
        if t.quant is not None or t.dtype not in FLOAT_DTYPES:
            raise WeightError(f"tensor {name!r} is stored as {t.dtype} (quant={t.quant}); "
                              "only plain float tensors load as float32")
        yield name, to_float32(f.tensor(name, verify=verify), t.dtype)
