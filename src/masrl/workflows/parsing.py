"""Parsers of model output. They never raise: garbage gives ``None`` ("invalid")."""
from __future__ import annotations


from masrl.tasks.parsing import MAX_SCAN, extract_boxed  # noqa: F401  (extract_boxed: re-exported)


def extract_tag(text: object, tag: str) -> str | None:
    """Content of the last ``<tag>...</tag>``, stripped, or None.

    Same pairing as ``re.findall(r"<tag>(.*?)</tag>", text, re.DOTALL)`` (each opening tag pairs
    with the first closing tag after it; the scan resumes after that), but in linear time: the
    regex rescans to the end from every unclosed ``<tag>``.
    """
    if not isinstance(text, str) or not isinstance(tag, str) or not tag:
        return None
    text = text[-MAX_SCAN:]
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
