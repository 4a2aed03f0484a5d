"""HF checkpoint -> .mcapy conversion (`build`), weight formats (the quantisation seam) and loading helpers."""

from __future__ import annotations

from decapybara.builder.build import BuildResult, build
from decapybara.builder.formats import (
           EncodedTensor,
           FloatFormat,
           WeightFormat,
           register_format,
           resolve_format,
)
from decapybara.builder.hf import SourceTensor
from decapybara.builder.load import iter_float32, load_config

__all__ = ["BuildResult", "EncodedTensor", "FloatFormat", "SourceTensor", "WeightFormat", "build",
           "iter_float32", "load_config", "register_format", "resolve_format"]
