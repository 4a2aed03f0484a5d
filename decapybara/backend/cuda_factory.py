"""The CUDA backend the server runs: `cuda_backend(dtype)` -> a `CupyPackedBackend`, i.e. `CupyBackend` with
`PackedWeightsMixin` (kernel-ready quantised weights stay packed and go to the mx_gemv kernels; everything
else as CupyBackend). Its `name` is CupyBackend's "cupy", so the engine treats it as the cupy backend (CUDA
graphs). Importing this module imports CuPy: the GPU actor imports it only when it has a device.
"""

from __future__ import annotations

from decapybara.backend.cupy_backend import CupyBackend
from decapybara.backend.cupy_ops_extra import PackedWeightsMixin


class CupyPackedBackend(PackedWeightsMixin, CupyBackend):
    """CupyBackend whose kernel-ready quantised weights stay packed (see PackedWeightsMixin)."""


def cuda_backend(dtype: str = "bf16", attention_splits: int | None = None,
                 prefill_weights: str = "packed") -> CupyPackedBackend:
    """A CupyPackedBackend: `dtype` "bf16" (serving) or "fp32" (the reference function, tests);
    `attention_splits` forces split-K attention (tests); `prefill_weights` "bf16": the quantised product
    weights it loads also keep their bf16 values for prompt chunks (`PackedWeightsMixin.dense_prefill`), "packed"
    not. Raises ImportError without CuPy (at import)."""
    if prefill_weights not in ("packed", "bf16"):
        raise ValueError(f"prefill_weights {prefill_weights!r}: packed or bf16")
    backend = CupyPackedBackend(dtype, attention_splits)
    backend.dense_prefill = prefill_weights == "bf16"
    return backend
