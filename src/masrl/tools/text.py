"""Text from outside (tool results, retrieved passages, task strings) made safe for a prompt.

A prompt must be valid UTF-8 for a tokenizer: a lone surrogate (``'\\ud800'``, from a tool that read
bytes with ``surrogateescape`` or a JSON ``"\\ud800"`` escape) makes the Rust tokenizers raise.
``valid_text`` replaces each lone surrogate with U+FFFD (a surrogate pair becomes the character it
encodes); ``safe_str`` turns any object into such a string without ever raising.
"""
from __future__ import annotations

from typing import Any

REPLACEMENT = "\ufffd"


def valid_text(text: str) -> str:
    """``text`` as an exact ``str`` that encodes as UTF-8: lone surrogates become U+FFFD. Never raises on a str
    (a ``str`` subclass with broken methods included); the common case (already valid) costs one encode."""
    if type(text) is not str:
        text = str.__str__(text)  # the characters, as an exact str (no overridden method is called)
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def safe_str(value: Any, limit: int | None = None) -> str:
    """``str(value)`` (``repr`` when that raises, else a placeholder naming the type), at most ``limit``
    characters, as ``valid_text``. Never raises."""
    if isinstance(value, str):
        text = str.__str__(value)
    else:
        text = None
        for show in (str, repr):
            try:
                text = show(value)
                if type(text) is not str:  # __str__ returned a str subclass
                    text = str.__str__(text)
                break
            except Exception:  # noqa: BLE001 - any way an object fails to print
                continue
        if text is None:
            text = f"<{_type_name(value)} object that cannot be printed>"
    if limit is not None and len(text) > limit:
        text = text[:limit]
    return valid_text(text)


def _type_name(value: Any) -> str:
    try:
        return str.__str__(type(value).__name__)
    except Exception:  # noqa: BLE001
        return "an"
