"""Lines of a data file (JSONL, optionally gzipped), each bounded in size and decoded on its own.

A line that is not UTF-8 or is longer than ``MAX_LINE_BYTES`` is handed back with the reason instead
of its text, so the caller reports it as a malformed row (``FILE:LINE: reason``) and goes on; a
50 MB row is never held whole in memory.
"""
from __future__ import annotations

import gzip
from pathlib import Path
from typing import BinaryIO, Iterator

MAX_LINE_BYTES = 8 << 20  # one row of a data file; a benchmark question or a passage is far smaller


def open_binary(path: Path) -> BinaryIO:
    return gzip.open(path, "rb") if path.name.lower().endswith(".gz") else open(path, "rb")


def text_lines(path: str | Path, max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[tuple[int, str | None, str]]:
    """``(line number, text or None, reason when None)`` for every line of ``path``."""
    with open_binary(Path(path)) as f:
        lineno = 0
        while raw := f.readline(max_line_bytes + 1):
            lineno += 1
            if len(raw) > max_line_bytes:
                while raw and not raw.endswith(b"\n"):  # skip the rest of the line, a chunk at a time
                    raw = f.readline(1 << 20)
                yield lineno, None, f"row longer than {max_line_bytes:,} bytes"
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield lineno, None, f"not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1})"
                continue
            # a byte-order mark on the first line (some Windows editors write one) is dropped
            yield lineno, text.removeprefix("\ufeff") if lineno == 1 else text, ""
