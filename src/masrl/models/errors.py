"""Errors of model loading (shared by the hub resolver and the alias converters)."""
from __future__ import annotations


class ModelLoadError(RuntimeError):
    """A model or tokenizer could not be found or loaded; the message is one line."""
