"""One reader for data rows: JSON Lines (also ``.gz``), JSON arrays and parquet.

Every loader in masrl (math, code, QA, corpora, ensemble predictions) reads its rows here, so a
malformed row is reported the same way everywhere:

- the row is skipped with a ``MalformedRowWarning`` ``"<file>:<where>: <reason>; row skipped"``
  (``<where>`` is the line number in a JSONL file, ``index N`` in a JSON array, ``row N`` in a
  parquet table); after ``MAX_SHOWN`` such warnings the rest are only counted, and one
  ``"<file>: skipped N malformed rows in all"`` warning closes the read;
- with ``strict=True`` (the CLI's ``--strict``) the first malformed row raises
  ``error("<file>:<where>: <reason>")`` (``MalformedRowError``, a ``ValueError``, unless the
  loader passes its own error class).

A loader supplies a row parser ``parse(obj, pos) -> value | None``: ``obj`` is the decoded row,
``pos`` its ``RowPos``; it raises ``BadRow`` with the reason when the row is malformed
and returns ``None`` to leave a row out silently (e.g. another split)::

    def parse(obj, pos):
        if "question" not in obj:
            raise BadRow("missing field 'question'")
        return Task(id=f"mine/{pos.index}", question=obj["question"], answer=obj.get("answer"))

    tasks, report = read_rows("data.jsonl", parse, strict=False, limit=100)
    print(report.describe())   # "data.jsonl: 100 rows kept, 2 skipped"
"""
from __future__ import annotations

import gzip
import itertools
import json
import warnings
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from masrl.errors import UserInputError
from masrl.io.lines import text_lines

__all__ = ["MAX_SHOWN", "ROW_FORMATS", "BadRow", "MalformedRowError", "MalformedRowWarning", "RowPos",
           "RowReport", "detect_row_format", "iter_parsed", "iter_records", "load_json", "open_text",
           "parse_rows", "read_rows"]

MAX_SHOWN = 10  # malformed rows warned about one by one; the rest are counted in one summary
ROW_FORMATS = ("jsonl", "json", "parquet")


class MalformedRowWarning(UserWarning):
    """A malformed data row was skipped (``strict=False``)."""


class MalformedRowError(UserInputError, ValueError):
    """A malformed data row with ``strict=True``: the message is ``<file>:<where>: <reason>``."""


class BadRow(ValueError):
    """Raised by a row parser: the row is malformed, the message says why."""


@dataclass(frozen=True)
class RowPos:
    """Where a row is: ``where`` as shown in messages (``"12"``, ``"index 3"``, ``"row 7"``),
    ``index`` its 0-based position among the file's rows (blank lines are not rows) and ``line``
    its 1-based line number in line-based files (else ``None``)."""

    where: str
    index: int
    line: int | None = None


@dataclass
class RowReport:
    """What a read did: rows seen, rows kept, and ``(where, reason)`` of every skipped row.

    ``skip`` is the one place a malformed row is reported (warning, or ``error`` when
    ``strict``); ``close`` warns once with the total when more than ``MAX_SHOWN`` were
    skipped.
    """

    source: str
    strict: bool = False
    error: type[Exception] = field(default=MalformedRowError, repr=False)
    rows: int = 0
    kept: int = 0
    skipped: list[tuple[str, str]] = field(default_factory=list)

    def skip(self, pos: RowPos, reason: str) -> None:
        msg = f"{self.source}:{pos.where}: {reason}"
        if self.strict:
            raise self.error(msg)
        self.skipped.append((pos.where, reason))
        if len(self.skipped) <= MAX_SHOWN:
            warnings.warn(f"{msg}; row skipped", MalformedRowWarning, stacklevel=4)

    def close(self) -> None:
        if len(self.skipped) > MAX_SHOWN:
            warnings.warn(f"{self.source}: skipped {len(self.skipped)} malformed rows in all",
                          MalformedRowWarning, stacklevel=3)

    def describe(self) -> str:
        return f"{self.source}: {self.kept} rows kept, {len(self.skipped)} skipped"


@dataclass(frozen=True)
class _Undecodable:
    reason: str


Parser = Callable[[Any, RowPos], Any]


def open_text(path: Path) -> IO[str]:
    """A text handle on ``path`` (``.gz`` files are decompressed; a leading UTF-8 byte-order mark is dropped)."""
    if path.name.lower().endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8-sig")
    return open(path, encoding="utf-8-sig")


def load_json(path: Path, error: type[Exception] = MalformedRowError) -> Any:
    """A whole JSON file; invalid JSON raises ``error("<file>:<line>: invalid JSON (...)")``."""
    try:
        with open_text(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise error(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None
    except UnicodeDecodeError as e:
        raise error(f"{path}: not UTF-8 text ({e.reason}); save it as UTF-8") from None
    except ValueError as e:  # an integer of more than 4,300 digits
        raise error(f"{path}: invalid JSON ({e})") from None
    except RecursionError:
        raise error(f"{path}: JSON nested too deeply") from None
    except (OSError, EOFError, zlib.error) as e:  # unreadable, a truncated or corrupt .gz
        raise error(f"{path}: cannot read ({type(e).__name__}: {e})") from None


def detect_row_format(path: Path) -> str:
    """``jsonl``, ``json`` or ``parquet`` from the file name (``.gz`` allowed for the JSON ones)."""
    name = path.name.lower()
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith((".jsonl", ".jsonl.gz")):
        return "jsonl"
    if name.endswith((".json", ".json.gz")):
        return "json"
    raise MalformedRowError(f"{path}: cannot tell the row format from the name; expected one of {ROW_FORMATS}")


def iter_records(path: str | Path, format: str = "auto", *, blank_lines_are_rows: bool = False,
                 error: type[Exception] = MalformedRowError) -> Iterator[tuple[RowPos, Any]]:
    """``(position, decoded row)`` for each row of ``path``.

    A JSONL line that is not valid JSON (or, with ``blank_lines_are_rows``, a blank line) comes
    back as a marker that ``parse_rows`` reports as malformed; a whole-file problem (a JSON
    file that is not an array, an unreadable parquet file) raises ``error``.
    """
    path = Path(path)
    fmt = detect_row_format(path) if format == "auto" else format
    if fmt == "jsonl":
        yield from _jsonl_records(path, blank_lines_are_rows)
    elif fmt == "json":
        data = load_json(path, error)
        if not isinstance(data, list):
            raise error(f"{path}: expected a JSON array of rows")
        for i, obj in enumerate(data):
            yield RowPos(f"index {i}", i), obj
    elif fmt == "parquet":
        for i, obj in enumerate(_parquet_rows(path, error)):
            yield RowPos(f"row {i}", i), obj
    else:
        raise ValueError(f"unknown row format {format!r}; expected one of {ROW_FORMATS} or 'auto'")


def _jsonl_records(path: Path, blank_lines_are_rows: bool) -> Iterator[tuple[RowPos, Any]]:
    """Lines read a bounded chunk at a time and decoded one by one (``masrl.io.lines``): a line
    that is not UTF-8 or is over ``MAX_LINE_BYTES`` is a malformed row, like one that is not JSON."""
    index = -1
    for lineno, text, reason in text_lines(path):
        if text is not None and not text.strip():
            if blank_lines_are_rows:
                index += 1
                yield RowPos(str(lineno), index, lineno), _Undecodable("empty line")
            continue
        index += 1
        pos = RowPos(str(lineno), index, lineno)
        if text is None:
            yield pos, _Undecodable(reason)
            continue
        try:
            yield pos, json.loads(text)
        except json.JSONDecodeError as e:
            yield pos, _Undecodable(f"invalid JSON ({e.msg} at column {e.colno})")
        except ValueError as e:  # an integer of more than 4,300 digits
            yield pos, _Undecodable(f"invalid JSON ({e})")
        except RecursionError:
            yield pos, _Undecodable("invalid JSON (nested too deeply)")


def _parquet_rows(path: Path, error: type[Exception]) -> list[dict]:
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except Exception as e:  # noqa: BLE001 - any pyarrow failure is one clear line
        raise error(f"{path}: unreadable parquet ({e})") from None


def iter_parsed(records: Iterable[tuple[RowPos, Any]], parse: Parser, report: RowReport, *,
                objects_only: bool = True) -> Iterator[Any]:
    """Lazily parse ``records`` with ``parse``, yielding the non-``None`` values; malformed rows
    (undecodable, not an object when ``objects_only``, or ``BadRow`` from ``parse``) go to
    ``report.skip``. A parser may also call ``report.skip`` itself for part of a row."""
    for pos, obj in records:
        report.rows += 1
        try:
            if isinstance(obj, _Undecodable):
                raise BadRow(obj.reason)
            if objects_only and not isinstance(obj, dict):
                raise BadRow(f"expected a JSON object, got {type(obj).__name__}")
            value = parse(obj, pos)
        except BadRow as e:
            report.skip(pos, str(e))
            continue
        if value is not None:
            report.kept += 1
            yield value


def parse_rows(records: Iterable[tuple[RowPos, Any]], parse: Parser, *, source: str, strict: bool = False,
               limit: int | None = None, objects_only: bool = True,
               error: type[Exception] = MalformedRowError) -> tuple[list, RowReport]:
    """Parse ``records`` (from ``iter_records``, or any ``(RowPos, row)`` pairs) with ``parse``:
    the first ``limit`` parsed values (``None`` results left out) and the ``RowReport``."""
    report = RowReport(source, strict=strict, error=error)
    if limit is not None and limit <= 0:
        return [], report
    values = list(itertools.islice(iter_parsed(records, parse, report, objects_only=objects_only), limit))
    report.close()
    return values, report


def read_rows(path: str | Path, parse: Parser, *, strict: bool = False, limit: int | None = None,
              format: str = "auto", objects_only: bool = True, blank_lines_are_rows: bool = False,
              error: type[Exception] = MalformedRowError) -> tuple[list, RowReport]:
    """Read and parse every row of a JSONL / JSON-array / parquet file: ``(values, report)``.

    A missing file raises ``FileNotFoundError``; see ``parse_rows`` for the rest.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"data file not found: {path}")
    records = iter_records(path, format, blank_lines_are_rows=blank_lines_are_rows, error=error)
    return parse_rows(records, parse, source=str(path), strict=strict, limit=limit,
                      objects_only=objects_only, error=error)
