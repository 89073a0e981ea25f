r"""Math benchmark loaders: one JSON Lines format per benchmark -> ``list[Task]``.

Files live under ``math/`` of a data folder (``masrl.paths.data_roots()``; ``masrl data list``):

=================  ==========================  ===============================================
name               file                        gold answer
=================  ==========================  ===============================================
gsm8k              gsm8k_test.jsonl            ``answer`` after ``####``, commas removed
gsm8k_train        gsm8k_train.jsonl           same
math500            math500_test.jsonl          ``answer``
aime24             aime24_test.jsonl           ``answer`` (leading zeros dropped: ``025`` -> ``25``)
aime25             aime25_test.jsonl           same
amc23              amc23_test.jsonl            ``answer`` (``27.0`` -> ``27``)
olympiadbench      olympiadbench_test.jsonl    ``final_answer[0]`` with every ``$`` removed
minerva            minerva_math_test.jsonl     last ``\boxed{}`` of ``solution`` (stray ``$`` removed)
=================  ==========================  ===============================================

``Task.id`` is ``f"{name}/{row}"`` with ``row`` the 0-based index of the non-blank line in the
file, so ids stay stable even when malformed rows are skipped. ``Task.meta`` always has
``data_source`` and ``benchmark`` (both the registry name) and ``source_id`` when the row has one.
Malformed rows (bad JSON, missing/empty fields) are skipped with a warning naming
``file:line``, or raise ``ValueError`` with ``strict=True``.
"""
from __future__ import annotations

import ast
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from masrl.errors import ConfigError, UserInputError, missing_extra
from masrl.catalog import DataNotFoundError, get_hint
from masrl.paths import data_file
from masrl.io.rows import BadRow, MalformedRowWarning, RowPos, parse_rows, read_rows
from masrl.types import Task
from masrl.tasks.parsing import extract_boxed

__all__ = [
    "BENCHMARKS",
    "DatasetLoadError",
    "MalformedRowWarning",
    "load_aime",
    "load_amc",
    "load_benchmark",
    "load_gsm8k",
    "load_hf_dataset",
    "load_math500",
    "load_minerva",
    "load_olympiadbench",
    "normalize_gold",
]


class DatasetLoadError(UserInputError, RuntimeError):
    """A dataset could not be loaded (library missing, hub unreachable, bad split or fields)."""


# ---------------------------------------------------------------------------------------------
# helpers

def normalize_gold(value: Any) -> str:
    """Gold answer as a clean string: floats with integer value lose ``.0``, plain integers
    lose thousands separators and leading zeros, surrounding whitespace is stripped."""
    if isinstance(value, bool):
        raise BadRow(f"answer is a boolean ({value!r})")
    if isinstance(value, float):
        if value != value:  # NaN
            raise BadRow("answer is NaN")
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, int):
        return str(value)
    if not isinstance(value, str):
        raise BadRow(f"answer has type {type(value).__name__}")
    s = value.strip()
    plain = s.replace(",", "") if _is_thousands(s) else s
    body = plain[1:] if plain[:1] in "+-" else plain
    if body.isdigit():
        return ("-" if plain.startswith("-") else "") + str(int(body))
    if _is_decimal(plain):
        try:
            f = float(plain)
        except ValueError:
            return s
        if f.is_integer():
            return str(int(f))
    return s


def _is_thousands(s: str) -> bool:
    body = s[1:] if s[:1] in "+-" else s
    parts = body.split(",")
    return (len(parts) > 1 and parts[0].isdigit() and 1 <= len(parts[0]) <= 3
            and all(len(p) == 3 and p.isdigit() for p in parts[1:]))


def _is_decimal(s: str) -> bool:
    body = s[1:] if s[:1] in "+-" else s
    head, dot, tail = body.partition(".")
    return bool(dot) and head.isdigit() and (tail.isdigit() or tail == "")


def _strip_dollars(s: str) -> str:
    """Remove math-mode ``$`` delimiters (a literal ``\\$`` stays)."""
    return s.replace("\\$", "\x00").replace("$", "").replace("\x00", "\\$").strip()


def _field(row: dict, *names: str) -> Any:
    """First present, non-empty field among ``names``."""
    for n in names:
        v = row.get(n)
        if v is not None and not (isinstance(v, str) and not v.strip()):
            return v
    raise BadRow(f"missing field {' / '.join(repr(n) for n in names)}")


def _text(row: dict, *names: str) -> str:
    v = _field(row, *names)
    if not isinstance(v, str):
        raise BadRow(f"field {names[0]!r} is not a string ({type(v).__name__})")
    return v.strip()


RowFn = Callable[[dict], tuple[str, str, dict]]


def _load_jsonl(path: str | Path, bench: str, row_fn: RowFn, limit: int | None, strict: bool) -> list[Task]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"benchmark file {path} not found")

    def parse(obj: dict, pos: RowPos) -> Task:
        question, answer, meta = row_fn(obj)
        full_meta = {"data_source": bench, "benchmark": bench}
        if "id" in obj or "idx" in obj or "unique_id" in obj:
            full_meta["source_id"] = str(obj.get("id", obj.get("idx", obj.get("unique_id"))))
        full_meta.update(meta)
        return Task(id=f"{bench}/{pos.index}", question=question, answer=answer, meta=full_meta)

    tasks, _ = read_rows(path, parse, strict=strict, limit=limit, format="jsonl")
    return tasks


# ---------------------------------------------------------------------------------------------
# one row converter per format

def _gsm8k_row(obj: dict) -> tuple[str, str, dict]:
    question = _text(obj, "question")
    raw = _text(obj, "answer")
    if "####" not in raw:
        raise BadRow("answer has no '#### <number>' line")
    gold = raw.rsplit("####", 1)[1].strip().replace(",", "").replace("$", "").strip()
    if not gold:
        raise BadRow("empty answer after '####'")
    return question, normalize_gold(gold), {}


def _math500_row(obj: dict) -> tuple[str, str, dict]:
    meta = {k: obj[k] for k in ("subject", "level") if k in obj}
    return _text(obj, "problem"), normalize_gold(_text(obj, "answer")), meta


def _aime_row(obj: dict) -> tuple[str, str, dict]:
    meta = {"url": obj["url"]} if "url" in obj else {}
    return _text(obj, "problem", "question"), normalize_gold(_field(obj, "answer")), meta


def _amc_row(obj: dict) -> tuple[str, str, dict]:
    meta = {"url": obj["url"]} if "url" in obj else {}
    return _text(obj, "problem", "question"), normalize_gold(_field(obj, "answer")), meta


def _olympiad_row(obj: dict) -> tuple[str, str, dict]:
    question = _text(obj, "question", "problem")
    ctx = obj.get("context")
    if isinstance(ctx, str) and ctx.strip() and ctx.strip() != "None":
        question = ctx.strip() + "\n\n" + question
    fa = _field(obj, "final_answer")
    if isinstance(fa, str):
        s = fa.strip()
        if s.startswith("["):
            try:
                fa = ast.literal_eval(s)
            except (ValueError, SyntaxError) as e:
                raise BadRow(f"final_answer is not a list literal ({e})") from None
        else:
            fa = [s]
    if not isinstance(fa, (list, tuple)) or not fa or not isinstance(fa[0], str):
        raise BadRow("final_answer is not a non-empty list of strings")
    gold = _strip_dollars(fa[0])
    if not gold:
        raise BadRow("final_answer is empty")
    meta: dict[str, Any] = {}
    for k in ("answer_type", "unit", "subfield", "is_multiple_answer"):
        v = obj.get(k)
        if v is not None and v != "None":
            meta[k] = v
    return question, normalize_gold(gold), meta


def _minerva_row(obj: dict) -> tuple[str, str, dict]:
    question = _text(obj, "problem")
    gold = extract_boxed(_text(obj, "solution"))
    gold = _strip_dollars(gold) if gold else gold
    if not gold:
        raise BadRow("solution has no \\boxed{} answer")
    meta = {"type": obj["type"]} if "type" in obj else {}
    return question, normalize_gold(gold), meta


def load_gsm8k(path: str | Path, bench: str = "gsm8k", limit: int | None = None, strict: bool = False) -> list[Task]:
    """GSM8K: ``question``; gold = text after the last ``####`` with commas removed."""
    return _load_jsonl(path, bench, _gsm8k_row, limit, strict)


def load_math500(path: str | Path, bench: str = "math500", limit: int | None = None, strict: bool = False) -> list[Task]:
    """MATH-500: ``problem``, ``answer`` (meta: subject, level)."""
    return _load_jsonl(path, bench, _math500_row, limit, strict)


def load_aime(path: str | Path, bench: str = "aime24", limit: int | None = None, strict: bool = False) -> list[Task]:
    """AIME 2024/2025: ``problem`` (or ``question``), ``answer`` (integer, leading zeros dropped)."""
    return _load_jsonl(path, bench, _aime_row, limit, strict)


def load_amc(path: str | Path, bench: str = "amc23", limit: int | None = None, strict: bool = False) -> list[Task]:
    """AMC 2023: ``problem``/``question``, ``answer`` such as ``27.0`` -> ``27``."""
    return _load_jsonl(path, bench, _amc_row, limit, strict)


def load_olympiadbench(path: str | Path, bench: str = "olympiadbench", limit: int | None = None,
                       strict: bool = False) -> list[Task]:
    """OlympiadBench: ``question`` (``context`` prepended when present), gold = first element of
    ``final_answer`` (a list, or a list written as a string) with ``$`` removed."""
    return _load_jsonl(path, bench, _olympiad_row, limit, strict)


def load_minerva(path: str | Path, bench: str = "minerva", limit: int | None = None, strict: bool = False) -> list[Task]:
    r"""Minerva math: ``problem``; gold = last ``\boxed{}`` of ``solution``."""
    return _load_jsonl(path, bench, _minerva_row, limit, strict)


Loader = Callable[..., list[Task]]

# name -> (file relative to a data folder, loader)
BENCHMARKS: dict[str, tuple[str, Loader]] = {
    "gsm8k": ("math/gsm8k_test.jsonl", load_gsm8k),
    "gsm8k_train": ("math/gsm8k_train.jsonl", load_gsm8k),
    "math500": ("math/math500_test.jsonl", load_math500),
    "aime24": ("math/aime24_test.jsonl", load_aime),
    "aime25": ("math/aime25_test.jsonl", load_aime),
    "amc23": ("math/amc23_test.jsonl", load_amc),
    "olympiadbench": ("math/olympiadbench_test.jsonl", load_olympiadbench),
    "minerva": ("math/minerva_math_test.jsonl", load_minerva),
}


def load_benchmark(name: str, limit: int | None = None, strict: bool = False,
                   root: str | Path | None = None) -> list[Task]:
    """Tasks of a registered benchmark (see ``BENCHMARKS``), the first ``limit`` when given.

    ``root`` overrides the data folders (default: the first of ``masrl.paths.data_roots()`` that holds the file).
    """
    if name not in BENCHMARKS:
        raise ConfigError(f"unknown benchmark {name!r}; known: {', '.join(sorted(BENCHMARKS))}")
    rel, loader = BENCHMARKS[name]
    path = Path(root) / rel if root is not None else data_file(rel)
    if root is None and not path.is_file():
        raise DataNotFoundError(f"benchmark {name!r}: file {rel} not found: {get_hint(rel)}")
    return loader(path, bench=name, limit=limit, strict=strict)


def load_hf_dataset(
    hub_id: str,
    split: str,
    question_field: str,
    answer_field: str,
    *,
    config: str | None = None,
    limit: int | None = None,
    bench: str | None = None,
    answer_fn: Callable[[Any], Any] | None = None,
    strict: bool = False,
) -> list[Task]:
    """Tasks from a Hugging Face dataset (needs the optional ``datasets`` library and either the
    hub or a local cache). ``answer_fn`` converts the raw answer field (default:
    ``normalize_gold``; for GSM8K-style answers pass e.g. ``lambda a: a.split('####')[-1]``).

    Raises ``DatasetLoadError`` with one clear line when ``datasets`` is missing, the hub is
    unreachable/offline, or the fields are absent.
    """
    try:
        from datasets import load_dataset
    except ImportError:
        raise missing_extra(f"cannot load {hub_id!r}: the 'datasets' library is not installed", "hf") from None
    try:
        ds = load_dataset(hub_id, config, split=split) if config else load_dataset(hub_id, split=split)
    except Exception as e:  # noqa: BLE001 - network, offline mode, missing split: one clear message
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DatasetLoadError(
            f"cannot load {hub_id!r} split {split!r} from the Hugging Face Hub (offline, unreachable, "
            f"or not cached; HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE', '0')}): "
            f"{type(e).__name__}: {first}") from None
    name = bench or hub_id.split("/")[-1]
    conv = answer_fn or normalize_gold
    meta = {"data_source": name, "benchmark": name, "hub_id": hub_id, "split": split}

    def parse(row: dict, pos: RowPos) -> Task:
        if question_field not in row or answer_field not in row:
            raise BadRow(f"missing field {question_field!r} or {answer_field!r} "
                         f"(fields: {', '.join(sorted(row))})")
        question = row[question_field]
        if not isinstance(question, str) or not question.strip():
            raise BadRow(f"empty or non-string {question_field!r}")
        try:
            answer = conv(row[answer_field])
        except BadRow:
            raise
        except Exception as e:  # noqa: BLE001 - a user answer_fn failing on one row
            raise BadRow(f"answer_fn failed ({type(e).__name__}: {e})") from None
        if isinstance(answer, str):
            answer = answer.strip()
        if answer is None or answer == "":
            raise BadRow(f"empty {answer_field!r}")
        return Task(id=f"{name}/{pos.index}", question=question.strip(), answer=answer, meta=dict(meta))

    records = ((RowPos(str(i), i), row) for i, row in enumerate(ds))
    tasks, _ = parse_rows(records, parse, source=f"{hub_id}[{split}]", strict=strict, limit=limit)
    return tasks
