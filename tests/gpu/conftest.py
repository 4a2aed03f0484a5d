"""Shared pieces of the GPU tests (collected, and skipped, on machines without CUDA too: no cupy import here
at module level)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def poison():
    """Fresh device outputs start as NaN / all-ones bits during every GPU test: unwritten elements fail."""
    try:
        from decapybara.backend import cupy_ops as ops
    except ImportError:  # no CuPy: the GPU tests are skipped anyway
        yield
        return
    ops.POISON = True
    yield
    ops.POISON = False
