"""The CUDA backend the server runs: `cuda_backend(dtype)` -> a `CupyPackedBackend`, i.e. `CupyBackend` with
`PackedWeightsMixin` (kernel-ready quantised weights stay packed and go to the mx_gemv kernels; everything
else as CupyBackend). Its `name` stays "cupy", so the engine treats it as the cupy backend (CUDA graphs).

CuPy is imported on first use only: importing this module works on a CPU-only machine, and
`from decapybara.backend.cuda_factory import CupyPackedBackend` defines the class then.
"""

from __future__ import annotations

from typing import Any

_CLASS: type | None = None


def packed_backend_class() -> type:
    """The CupyPackedBackend class (defined once, on the first call; imports cupy)."""
    global _CLASS
    if _CLASS is None:
        from decapybara.backend.cupy_backend import CupyBackend
        from decapybara.backend.cupy_ops_extra import PackedWeightsMixin

        class CupyPackedBackend(PackedWeightsMixin, CupyBackend):
            """CupyBackend whose kernel-ready quantised weights stay packed (see PackedWeightsMixin)."""

            name = "cupy"

        CupyPackedBackend.__module__, CupyPackedBackend.__qualname__ = __name__, "CupyPackedBackend"
        _CLASS = CupyPackedBackend
    return _CLASS


def cuda_backend(dtype: str = "bf16", attention_splits: int | None = None) -> Any:
    """A CupyPackedBackend: `dtype` "bf16" (serving) or "fp32" (the reference function, tests);
    `attention_splits` forces split-K attention (tests). Raises ImportError without CuPy."""
    return packed_backend_class()(dtype, attention_splits)


def __getattr__(name: str) -> Any:
    if name == "CupyPackedBackend":
        return packed_backend_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
