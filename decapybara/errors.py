"""Typed errors shared across the library.

Every error a user can provoke with bad input is a subclass of `DecapybaraError`, so the API layer can map
it to a 4xx in each API's own shape without catching unrelated exceptions.
"""

from __future__ import annotations


class DecapybaraError(Exception):
    """Base class of every error the library raises on purpose."""


class ConfigError(DecapybaraError):
    """A model or engine configuration is invalid (unknown model_type, missing or bad field)."""


class WeightError(DecapybaraError):
    """A checkpoint lacks a tensor the config needs, or a tensor has the wrong shape or dtype."""


class InvalidRequestError(DecapybaraError):
    """A request is malformed: bad sampling values, empty prompt, max_tokens <= 0, ...; `param`, where known,
    names the request field at fault (the API's error body carries it)."""

    def __init__(self, message: str = "", param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self):  # pickled (Ray) with its field
        return type(self), (str(self), self.param)


class ContextOverflowError(InvalidRequestError):
    """The prompt (plus the requested output) can never fit the model's context or the KV pool."""


class CapacityError(DecapybaraError):
    """The engine has no room for this work right now (pool exhausted); the caller may retry or pause."""
