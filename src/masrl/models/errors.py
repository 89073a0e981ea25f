"""Errors of model loading (shared by the hub resolver and the alias converters)."""
from __future__ import annotations

from masrl.errors import UserInputError


class ModelLoadError(UserInputError, RuntimeError):
    """A model or tokenizer could not be found or loaded; the message is one line."""
