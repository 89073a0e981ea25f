"""Parsers of model output. They never raise: garbage gives ``None`` ("invalid")."""
from __future__ import annotations

import re

_MAX_SCAN = 200_000  # characters; longer outputs are scanned from their tail


_BRACE = re.compile(r"[{}]")
_BOXED = re.compile(r"\\boxed")


def extract_boxed(text: object) -> str | None:
    r"""Content of the last ``\boxed{...}`` (balanced braces), or None.

    Linear time: one pass pairs every ``{`` with its closing ``}``, then the ``\boxed`` markers
    are tried from the last one back (a degenerate ``\boxed{\boxed{\boxed{...`` output must not
    cost a quadratic rescan per marker).
    """
    if not isinstance(text, str):
        return None
    text = text[-_MAX_SCAN:]
    markers = [m.end() for m in _BOXED.finditer(text)]
    if not markers:
        return None
    closing: dict[int, int] = {}  # position of "{" -> position of its matching "}"
    stack: list[int] = []
    for m in _BRACE.finditer(text):
        if m.group() == "{":
            stack.append(m.start())
        elif stack:
            closing[stack.pop()] = m.start()
    for i in reversed(markers):
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{" and i in closing:
            return text[i + 1:closing[i]].strip()
    return None


def extract_tag(text: object, tag: str) -> str | None:
    """Content of the last ``<tag>...</tag>``, stripped, or None.

    Same pairing as ``re.findall(r"<tag>(.*?)</tag>", text, re.DOTALL)`` (each opening tag pairs
    with the first closing tag after it; the scan resumes after that), but in linear time: the
    regex rescans to the end from every unclosed ``<tag>``.
    """
    if not isinstance(text, str) or not isinstance(tag, str) or not tag:
        return None
    text = text[-_MAX_SCAN:]
    open_, close = f"<{tag}>", f"</{tag}>"
    last, pos = None, 0
    while True:
        a = text.find(open_, pos)
        if a == -1:
            break
        b = text.find(close, a + len(open_))
        if b == -1:
            break
        last, pos = (a + len(open_), b), b + len(close)
    return text[last[0]:last[1]].strip() if last else None


def parse_choice(text: object, tag: str, choices: tuple[str, ...]) -> str | None:
    """The last ``<tag>choice</tag>`` if its content (case-insensitive) is one of ``choices``."""
    content = extract_tag(text, tag)
    if content is None:
        return None
    content = content.strip().lower()
    return content if content in choices else None
