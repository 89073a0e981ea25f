"""Passage corpus readers.

Formats (picked from the file, ``format="auto"``):

- ``jsonl``: one JSON object per line, Search-R1 / FlashRAG style ``{"id", "contents": "\\"Title\\"\\ntext"}``
  or ``{"id"?, "title", "text"}``; ``.jsonl.gz`` is read too.
- ``json_list``: a JSON array ``[{"title", "text"}, ...]`` (HippoRAG corpora).
- ``json_titles``: a JSON object ``{title: [sentence, ...]}`` (HotpotQA context paragraphs).
- ``hotpotqa``: raw HotpotQA questions ``[{"question", "context": [[title, [sentences]], ...]}]``;
  the corpus is every distinct context paragraph.

Malformed entries are skipped with a warning naming the file and line (or index), or raise
:class:`CorpusError` with ``strict=True``.
"""
from __future__ import annotations

import gzip
import json
import warnings
import zlib
from pathlib import Path
from typing import Any, Iterator

from masrl.errors import UserInputError
from masrl.tasks.lines import open_binary, text_lines
from masrl.tasks.retrieval.base import Passage, split_contents

CORPUS_FORMATS = ("jsonl", "json_list", "json_titles", "hotpotqa")


class CorpusError(UserInputError, ValueError):
    """A corpus file is missing, unreadable or has a malformed entry (with ``strict=True``)."""


class CorpusWarning(UserWarning):
    """A malformed corpus entry was skipped."""


def load_corpus(path: str | Path, format: str = "auto", *, strict: bool = False,
                limit: int | None = None) -> list[Passage]:
    """Read a passage corpus; see the module docstring for the formats."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise CorpusError(f"corpus file not found: {path}" + (" (a folder)" if path.is_dir() else ""))
    fmt = detect_corpus_format(path) if format == "auto" else format
    if fmt not in CORPUS_FORMATS:
        raise CorpusError(f"{path}: unknown corpus format {format!r}; expected one of {CORPUS_FORMATS} or 'auto'")
    reader = {"jsonl": _read_jsonl, "json_list": _read_json_list, "json_titles": _read_json_titles,
              "hotpotqa": _read_hotpotqa}[fmt]
    issues = _Issues(path, strict)
    passages = []
    try:
        for p in reader(path, issues):
            passages.append(p)
            if limit is not None and len(passages) >= limit:
                break
    except (OSError, EOFError, zlib.error) as e:  # unreadable, a truncated or corrupt .gz
        raise CorpusError(f"{path}: cannot read ({type(e).__name__}: {e})") from None
    issues.summarize()
    if not passages:
        raise CorpusError(f"{path}: no passages read (format {fmt})")
    seen: set[str] = set()
    for i, p in enumerate(passages):  # ids must be unique: they identify passages in results
        if p.id in seen:
            p.id = f"{p.id}#{i}"
        seen.add(p.id)
    return passages


def detect_corpus_format(path: Path) -> str:
    name = path.name.lower()
    if name.endswith((".jsonl", ".jsonl.gz")):
        return "jsonl"
    if not name.endswith((".json", ".json.gz")):
        raise CorpusError(f"{path}: cannot tell the corpus format from the name; "
                          f"pass format= one of {CORPUS_FORMATS}")
    try:
        with open_binary(path) as f:
            head = f.read(4096).lstrip().decode("utf-8", errors="replace")
    except (OSError, EOFError, zlib.error) as e:
        raise CorpusError(f"{path}: cannot read ({type(e).__name__}: {e})") from None
    if head.startswith("{"):
        return "json_titles"
    if head.startswith("["):
        data = _load_json(path)
        first = next((row for row in data if isinstance(row, dict)), {})
        return "hotpotqa" if "context" in first else "json_list"
    raise CorpusError(f"{path}: not a JSON array or object")


class _Issues:
    """Collects malformed entries: warn (a few individually, then a count) or raise when strict."""

    MAX_SHOWN = 10

    def __init__(self, path: Path, strict: bool, *, what: str = "corpus entry",
                 error: type[Exception] = CorpusError, warning: type[Warning] = CorpusWarning):
        self.path, self.strict, self.count = path, strict, 0
        self.what, self.error, self.warning = what, error, warning

    def report(self, where: str, reason: str) -> None:
        msg = f"{self.path}:{where}: {reason}"
        if self.strict:
            raise self.error(msg)
        self.count += 1
        if self.count <= self.MAX_SHOWN:
            warnings.warn(f"skipped malformed {self.what} {msg}", self.warning, stacklevel=4)

    def summarize(self) -> None:
        if self.count > self.MAX_SHOWN:
            warnings.warn(f"{self.path}: skipped {self.count} malformed {self.what}s in all", self.warning,
                          stacklevel=3)


def _open_text(path: Path):
    if path.name.lower().endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def _load_json(path: Path) -> Any:
    try:
        with _open_text(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise CorpusError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None
    except UnicodeDecodeError as e:
        raise CorpusError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start} of a chunk); save it as UTF-8") from None
    except RecursionError:
        raise CorpusError(f"{path}: JSON nested too deeply") from None


def _passage_from_row(row: Any, default_id: str) -> Passage | str:
    """A passage, or the reason the row is malformed."""
    if not isinstance(row, dict):
        return f"expected a JSON object, got {type(row).__name__}"
    pid = row.get("id", row.get("_id", default_id))
    if "contents" in row:
        if not isinstance(row["contents"], str) or not row["contents"].strip():
            return "'contents' must be a non-empty string"
        title, text = split_contents(row["contents"])
        return Passage(str(pid), title, text)
    title, text = row.get("title", ""), row.get("text", row.get("content"))
    if isinstance(text, list):
        text = "".join(s for s in text if isinstance(s, str))
    if not isinstance(text, str) or not isinstance(title, str) or not (text.strip() or title.strip()):
        return "needs 'contents' or 'text' (+ optional 'title') strings"
    return Passage(str(pid), title.strip(), text.strip())


def _read_jsonl(path: Path, issues: _Issues) -> Iterator[Passage]:
    for lineno, line, reason in text_lines(path):
        if line is None:
            issues.report(str(lineno), reason)
            continue
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            issues.report(str(lineno), f"invalid JSON ({e.msg})")
            continue
        except RecursionError:
            issues.report(str(lineno), "JSON nested too deeply")
            continue
        p = _passage_from_row(row, str(lineno - 1))
        if isinstance(p, str):
            issues.report(str(lineno), p)
        else:
            yield p


def _read_json_list(path: Path, issues: _Issues) -> Iterator[Passage]:
    data = _load_json(path)
    if not isinstance(data, list):
        raise CorpusError(f"{path}: expected a JSON array of passages")
    for i, row in enumerate(data):
        p = _passage_from_row(row, str(i))
        if isinstance(p, str):
            issues.report(f"index {i}", p)
        else:
            yield p


def _read_json_titles(path: Path, issues: _Issues) -> Iterator[Passage]:
    data = _load_json(path)
    if not isinstance(data, dict):
        raise CorpusError(f"{path}: expected a JSON object {{title: [sentences]}}")
    for i, (title, sentences) in enumerate(data.items()):
        if isinstance(sentences, str):
            sentences = [sentences]
        if not isinstance(sentences, list) or not all(isinstance(s, str) for s in sentences):
            issues.report(f"key {title!r}", "expected a list of sentence strings")
            continue
        yield Passage(str(i), title.strip(), "".join(sentences).strip())


def _read_hotpotqa(path: Path, issues: _Issues) -> Iterator[Passage]:
    data = _load_json(path)
    if not isinstance(data, list):
        raise CorpusError(f"{path}: expected a JSON array of HotpotQA questions")
    seen: set[tuple[str, str]] = set()
    for i, row in enumerate(data):
        context = row.get("context") if isinstance(row, dict) else None
        if not isinstance(context, list):
            issues.report(f"index {i}", "expected an object with a 'context' list")
            continue
        for item in context:
            if (not isinstance(item, (list, tuple)) or len(item) != 2 or not isinstance(item[0], str)
                    or not isinstance(item[1], list)):
                issues.report(f"index {i}", "context items must be [title, [sentences]]")
                continue
            title, text = item[0].strip(), "".join(s for s in item[1] if isinstance(s, str)).strip()
            if (title, text) not in seen:
                seen.add((title, text))
                yield Passage(str(len(seen) - 1), title, text)
