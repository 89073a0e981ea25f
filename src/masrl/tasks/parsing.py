"""Answer parsers the reward functions share (model output -> answer). They never raise: garbage gives ``None``.

Workflows' tag parsers (``<verify>``, ``<answer>``, ...) are in ``masrl.workflows.parsing``, which
re-exports ``extract_boxed``.
"""
from __future__ import annotations

import re

MAX_SCAN = 200_000  # characters; longer outputs are scanned from their tail

_BRACE = re.compile(r"[{}]")
_BOXED = re.compile(r"\\boxed")
_YES_NO = re.compile(r"(?i)\b(yes|no)\b")


def extract_boxed(text: object) -> str | None:
    r"""Content of the last ``\boxed{...}`` (balanced braces), or None.

    Linear time: one pass pairs every ``{`` with its closing ``}``, then the ``\boxed`` markers
    are tried from the last one back (a degenerate ``\boxed{\boxed{\boxed{...`` output must not
    cost a quadratic rescan per marker).
    """
    if not isinstance(text, str):
        return None
    text = text[-MAX_SCAN:]
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


def parse_yes_no(text: object) -> float | None:
    """1.0 for the first standalone ``yes``, 0.0 for ``no`` (any case), else None (a judge's yes/no verdict)."""
    found = _YES_NO.search(text) if isinstance(text, str) else None
    if found is None:
        return None
    return 1.0 if found.group(1).lower() == "yes" else 0.0
