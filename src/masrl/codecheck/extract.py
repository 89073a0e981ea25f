"""Pull the program out of a model's reply."""
from __future__ import annotations

import re

# an opening fence, then an info string without backticks whose first word is the language;
# matched in two steps (two overlapping starred classes in one pattern backtrack quadratically
# on a long line ending in a backtick)
_FENCE = re.compile(r"[ \t]{0,3}(`{3,}|~{3,})")
_LANG = re.compile(r"[ \t]*([^\s`]*)")
_PYTHON_TAGS = {"python", "py", "python3", "py3", "pycon", "ipython", "{.python}", "{python}"}


def _blocks(text: str) -> list[tuple[str, str]]:
    """Fenced blocks as (language tag, body); an unclosed last block runs to the end."""
    blocks: list[tuple[str, str]] = []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m or "`" in lines[i][m.end():]:
            i += 1
            continue
        fence, lang = m.group(1), _LANG.match(lines[i], m.end()).group(1).lower()
        body: list[str] = []
        j = i + 1
        closed = False
        while j < len(lines):
            stripped = lines[j].strip()
            if stripped.startswith(fence[0] * len(fence)) and set(stripped) <= {fence[0]}:
                closed = True
                break
            body.append(lines[j])
            j += 1
        blocks.append((lang, "\n".join(body)))
        i = j + 1 if closed else len(lines)
    return blocks


def extract_code(text: object) -> str:
    """The code in a model reply: the last ```python block, else the last block without a
    language tag, else the whole text. Never raises.

    ``<think>...</think>`` sections are dropped first when a reply has text after them.
    """
    try:
        if text is None:
            return ""
        if not isinstance(text, str):
            text = str(text)
        text = text.replace("\r\n", "\n")
        if "</think>" in text:
            tail = text.rsplit("</think>", 1)[1]
            if tail.strip():
                text = tail
        blocks = _blocks(text)
        if not blocks:
            return text.strip("\n")
        py = [body for lang, body in blocks if lang in _PYTHON_TAGS]
        if py:
            return py[-1].strip("\n")
        untagged = [body for lang, body in blocks if not lang]
        if untagged:
            return untagged[-1].strip("\n")
        return text.strip("\n")
    except Exception:  # pragma: no cover - defensive: extraction must never fail
        return text if isinstance(text, str) else ""
