"""Passage corpus readers.

Formats (picked from the file, ``format="auto"``):

- ``jsonl``: one JSON object per line, Search-R1 / FlashRAG style ``{"id", "contents": "\\"Title\\"\\ntext"}``
  or ``{"id"?, "title", "text"}``; ``.jsonl.gz`` is read too.
- ``json_list``: a JSON array ``[{"title", "text"}, ...]`` (HippoRAG corpora).
- ``json_titles``: a JSON object ``{title: [sentence, ...]}`` (HotpotQA context paragraphs).
- ``hotpotqa``: raw HotpotQA questions ``[{"question", "context": [[title, [sentences]], ...]}]``;
  the corpus is every distinct context paragraph.

Malformed entries are skipped with a warning naming the file and line (or index), or raise
``CorpusError`` with ``strict=True``.
"""
from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any, Iterator

from masrl.catalog import CATALOG, get_hint, resolve
from masrl.errors import UserInputError
from masrl.io.lines import open_binary
from masrl.io.rows import BadRow, MalformedRowWarning, RowPos, RowReport, iter_parsed, iter_records, load_json
from masrl.retrieval.base import Passage, split_contents

CORPUS_FORMATS = ("jsonl", "json_list", "json_titles", "hotpotqa")


class CorpusError(UserInputError, ValueError):
    """A corpus file is missing, unreadable or has a malformed entry (with ``strict=True``)."""


CorpusWarning = MalformedRowWarning  # the one warning for a skipped row (masrl.io.rows); old name kept


def corpus_path(path: str | Path) -> Path:
    """The corpus file ``path`` names (a path, a catalogue name, or a path under a data folder); one
    CorpusError saying how to get it when there is none."""
    named = str(path)
    found = resolve(path)
    if not found.is_file():
        hint = f": {get_hint(CATALOG[named].files[0].rel)}" if named in CATALOG else ""
        raise CorpusError(f"corpus file not found: {found}" + (" (a folder)" if found.is_dir() else hint))
    return found


def load_corpus(path: str | Path, format: str = "auto", *, strict: bool = False,
                limit: int | None = None) -> list[Passage]:
    """Read a passage corpus (a path, a catalogue name such as ``wiki18_sample1000``, or a path under a data
    folder such as ``corpus/x.jsonl``); see the module docstring for the formats."""
    path = corpus_path(path)
    fmt = detect_corpus_format(path) if format == "auto" else format
    if fmt not in CORPUS_FORMATS:
        raise CorpusError(f"{path}: unknown corpus format {format!r}; expected one of {CORPUS_FORMATS} or 'auto'")
    reader = {"jsonl": _read_jsonl, "json_list": _read_json_list, "json_titles": _read_json_titles,
              "hotpotqa": _read_hotpotqa}[fmt]
    report = RowReport(str(path), strict=strict, error=CorpusError)
    passages = []
    try:
        for p in reader(path, report):
            passages.append(p)
            if limit is not None and len(passages) >= limit:
                break
    except (OSError, EOFError, zlib.error) as e:  # unreadable, a truncated or corrupt .gz
        raise CorpusError(f"{path}: cannot read ({type(e).__name__}: {e})") from None
    report.close()
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
            head = f.read(4096).decode("utf-8", errors="replace").lstrip("\ufeff \t\r\n")
    except (OSError, EOFError, zlib.error) as e:
        raise CorpusError(f"{path}: cannot read ({type(e).__name__}: {e})") from None
    if head.startswith("{"):
        return "json_titles"
    if head.startswith("["):
        data = load_json(path, CorpusError)
        first = next((row for row in data if isinstance(row, dict)), {})
        return "hotpotqa" if "context" in first else "json_list"
    raise CorpusError(f"{path}: not a JSON array or object")


def _passage_from_row(row: dict, default_id: str) -> Passage:
    """A passage, or ``BadRow`` with the reason the row is malformed."""
    pid = row.get("id", row.get("_id", default_id))
    if "contents" in row:
        if not isinstance(row["contents"], str) or not row["contents"].strip():
            raise BadRow("'contents' must be a non-empty string")
        title, text = split_contents(row["contents"])
        return Passage(str(pid), title, text)
    title, text = row.get("title", ""), row.get("text", row.get("content"))
    if isinstance(text, list):
        text = "".join(s for s in text if isinstance(s, str))
    if not isinstance(text, str) or not isinstance(title, str) or not (text.strip() or title.strip()):
        raise BadRow("needs 'contents' or 'text' (+ optional 'title') strings")
    return Passage(str(pid), title.strip(), text.strip())


def _read_jsonl(path: Path, report: RowReport) -> Iterator[Passage]:
    return iter_parsed(iter_records(path, "jsonl"), lambda row, pos: _passage_from_row(row, str(pos.line - 1)),
                       report)


def _read_json_list(path: Path, report: RowReport) -> Iterator[Passage]:
    data = load_json(path, CorpusError)
    if not isinstance(data, list):
        raise CorpusError(f"{path}: expected a JSON array of passages")
    records = ((RowPos(f"index {i}", i), row) for i, row in enumerate(data))
    return iter_parsed(records, lambda row, pos: _passage_from_row(row, str(pos.index)), report)


def _read_json_titles(path: Path, report: RowReport) -> Iterator[Passage]:
    data = load_json(path, CorpusError)
    if not isinstance(data, dict):
        raise CorpusError(f"{path}: expected a JSON object {{title: [sentences]}}")

    def parse(item: tuple[str, Any], pos: RowPos) -> Passage:
        title, sentences = item
        if isinstance(sentences, str):
            sentences = [sentences]
        if not isinstance(sentences, list) or not all(isinstance(s, str) for s in sentences):
            raise BadRow("expected a list of sentence strings")
        return Passage(str(pos.index), title.strip(), "".join(sentences).strip())

    records = ((RowPos(f"key {title!r}", i), (title, sentences)) for i, (title, sentences) in enumerate(data.items()))
    return iter_parsed(records, parse, report, objects_only=False)


def _read_hotpotqa(path: Path, report: RowReport) -> Iterator[Passage]:
    data = load_json(path, CorpusError)
    if not isinstance(data, list):
        raise CorpusError(f"{path}: expected a JSON array of HotpotQA questions")

    def parse(row: Any, pos: RowPos) -> list[tuple[str, str]]:
        context = row.get("context") if isinstance(row, dict) else None
        if not isinstance(context, list):
            raise BadRow("expected an object with a 'context' list")
        paragraphs = []
        for item in context:
            if (not isinstance(item, (list, tuple)) or len(item) != 2 or not isinstance(item[0], str)
                    or not isinstance(item[1], list)):
                report.skip(pos, "context items must be [title, [sentences]]")
                continue
            paragraphs.append((item[0].strip(), "".join(s for s in item[1] if isinstance(s, str)).strip()))
        return paragraphs

    records = ((RowPos(f"index {i}", i), row) for i, row in enumerate(data))
    seen: set[tuple[str, str]] = set()
    for paragraphs in iter_parsed(records, parse, report, objects_only=False):
        for title, text in paragraphs:
            if (title, text) not in seen:
                seen.add((title, text))
                yield Passage(str(len(seen) - 1), title, text)
