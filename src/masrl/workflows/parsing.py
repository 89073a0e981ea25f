"""Parsers of model output. They never raise: garbage gives ``None`` ("invalid")."""
from __future__ import annotations

import re

_MAX_SCAN = 200_000  # characters; longer outputs are scanned from their tail


def extract_boxed(text: object) -> str | None:
    r"""Content of the last ``\boxed{...}`` (balanced braces), or None."""
    if not isinstance(text, str):
        return None
    text = text[-_MAX_SCAN:]
    start = text.rfind("\\boxed")
    while start != -1:
        i = start + len("\\boxed")
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            depth, j = 0, i
            while j < len(text):
                c = text[j]
                if c == "{":
                    depth += 1
                elif c == "}":
                    depth -= 1
                    if depth == 0:
                        return text[i + 1:j].strip()
                j += 1
        start = text.rfind("\\boxed", 0, start)
    return None


def extract_tag(text: object, tag: str) -> str | None:
    """Content of the last ``<tag>...</tag>``, stripped, or None."""
    if not isinstance(text, str) or not tag:
        return None
    text = text[-_MAX_SCAN:]
    matches = re.findall(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", text, flags=re.DOTALL)
    return matches[-1].strip() if matches else None


def parse_choice(text: object, tag: str, choices: tuple[str, ...]) -> str | None:
    """The last ``<tag>choice</tag>`` if its content (case-insensitive) is one of ``choices``."""
    content = extract_tag(text, tag)
    if content is None:
        return None
    content = content.strip().lower()
    return content if content in choices else None
