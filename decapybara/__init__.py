"""Decapybara: an LLM inference server on Ray for many coding agents on one big GPU."""

from __future__ import annotations

__version__ = "0.1.0"
