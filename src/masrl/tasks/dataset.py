"""``task: {name: dataset}``: your own data and reward from the config alone.

    task:
      name: dataset
      params:
        train: data/train.jsonl          # a file, or hf:ID[:split] (Hugging Face, via `datasets`)
        test: data/test.jsonl            # optional held-out split (or a math benchmark name: math500)
        format: jsonl                    # jsonl | json | parquet | hf (default: from the suffix / hf: prefix)
        fields: {question: problem, answer: solution}   # dotted paths reach nested fields (a.b.c)
        reward: math                     # math | qa_em | qa_f1 | qa_subem | code | a registered name | pkg.module:function | file.py:function
                                         # | {judge: {...}} | {model: {...}} (docs/training.md)

The gold answer is converted for the reward: ``math`` keeps the text after the last ``####``
(GSM8K style) and normalises numbers; ``qa_*`` takes a string or a list of gold strings; ``code``
takes a list of test statements (``assert f(1) == 2``; optional ``fields.setup``). A user's
function receives the raw field value. Rows that do not parse are skipped with a warning naming
the file and line (row for parquet/hf, index for JSON), or stop the run with ``task.strict: true``
(``masrl train --strict``); files are read by the shared row reader (``masrl.io.rows``).
"""
from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, Iterator

from masrl.config import TaskConfig
from masrl.errors import ConfigError, missing_extra
from masrl.tasks.math_data import DatasetLoadError
from masrl.io.rows import BadRow, RowPos, detect_row_format, iter_records, parse_rows
from masrl.types import Task

FORMATS = ("jsonl", "json", "parquet", "hf")
_KNOWN_PARAMS = {"train", "test", "format", "fields", "reward", "answer_fallback", "reward_mode", "score_cache"}


# ----------------------------------------------------------------------------- reading rows

def detect_format(source: str) -> str:
    """``hf`` for ``hf:ID[:split]``, else the file format from its name (masrl.io.rows)."""
    if source.startswith("hf:"):
        return "hf"
    try:
        return detect_row_format(Path(source))
    except ValueError:
        raise ConfigError(f"task.params: cannot tell the format of {source!r} from its suffix; set "
                          f"task.params.format to one of {', '.join(FORMATS)}") from None


def _records(source: str, fmt: str) -> tuple[str, Iterator[tuple[RowPos, Any]]]:
    """``(name shown in messages, (position, row) pairs)``: files through the shared row reader, ``hf:``
    through the datasets library."""
    if fmt not in FORMATS:
        raise ConfigError(f"task.params.format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if fmt == "hf":
        return _hf_records(source)
    path = Path(source).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} not found (relative paths start at the current folder, "
                                f"{Path.cwd()})")
    return str(path), iter_records(path, fmt, error=DatasetLoadError)


def _hf_records(source: str):
    hub_id, _, split = source[3:].partition(":")
    split = split or "train"
    try:
        import datasets
    except ImportError:
        raise missing_extra(f"task.params {source!r}: Hugging Face datasets need the datasets library", "hf") from None
    try:
        ds = datasets.load_dataset(hub_id, split=split)
    except Exception as e:  # noqa: BLE001 - offline, unknown id or split: one clear line
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DatasetLoadError(
            f"cannot load Hugging Face dataset {hub_id!r} split {split!r} ({type(e).__name__}: {first}); "
            f"offline={bool(datasets.config.HF_HUB_OFFLINE)}: without network it must be in the cache "
            f"{datasets.config.HF_DATASETS_CACHE} (set HF_HOME or HF_DATASETS_CACHE to use another)") from None
    return f"{hub_id}[{split}]", ((RowPos(f"row {i}", i), row) for i, row in enumerate(ds))


# ----------------------------------------------------------------------------- rows -> tasks

def _get(row: dict, path: str) -> Any:
    node: Any = row
    for part in path.split("."):
        if hasattr(node, "tolist"):
            node = node.tolist()
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):  # prompt.0.content
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            raise BadRow(f"missing field {path!r} (fields: {', '.join(sorted(row))})")
    if hasattr(node, "tolist"):  # numpy arrays from parquet / datasets
        node = node.tolist()
    return node


def _gold(value: Any, reward: str, setup: str | None) -> Any:
    """The row's answer in the form ``reward`` expects."""
    if value is None or (isinstance(value, (str, list)) and not value):
        raise BadRow("empty answer")
    if reward == "math":
        from masrl.tasks.math_data import normalize_gold  # raises BadRow itself

        if isinstance(value, str) and "####" in value:
            value = value.rsplit("####", 1)[1].replace(",", "").strip()
        return normalize_gold(value)
    if reward in ("qa_em", "qa_f1", "qa_subem"):
        golds = [value] if isinstance(value, (str, int, float)) else value
        if not isinstance(golds, list) or not all(isinstance(g, (str, int, float)) for g in golds):
            raise BadRow(f"a QA answer must be a string or a list of strings, got {type(value).__name__}")
        golds = [str(g).strip() for g in golds if str(g).strip()]
        if not golds:
            raise BadRow("empty answer")
        return golds
    if reward == "code":
        tests = value.splitlines() if isinstance(value, str) else value
        if not isinstance(tests, list) or not all(isinstance(t, str) for t in tests):
            raise BadRow("a code answer must be a list of test statements (or one string of them)")
        tests = [t.strip() for t in tests if t.strip()]
        if not tests:
            raise BadRow("no test statements")
        return {"kind": "mbpp", "tests": tests, "setup": setup or "", "entry_point": None, "remote_names": [],
                "challenge_tests": []}
    return value  # a user's reward reads the raw value


def _has(row: Any, path: str) -> bool:
    try:
        _get(row, path)
    except BadRow:
        return False
    return True


def _check_fields(records, where: str, keys: dict[str, str], peek: int = 20):
    """``records`` ((position, row) pairs) unchanged, after one clear error when none of the first ``peek``
    rows has a field the config maps (a misspelt field name would otherwise skip every row, a warning each)."""
    head = list(itertools.islice(records, peek))
    rows = [row for _, row in head if isinstance(row, dict)]
    for role, key in keys.items():
        if rows and not any(_has(r, key) for r in rows):
            seen = sorted({k for r in rows for k in r})
            raise DatasetLoadError(f"{where}: no row has the {role} field {key!r} (task.params.fields.{role}); "
                                   f"the rows have fields: {', '.join(map(str, seen[:20]))}")
    return itertools.chain(head, records)


def load_rows_as_tasks(source: str, *, fields: dict, reward: str, fmt: str | None = None,
                       limit: int | None = None, strict: bool = False) -> list[Task]:
    """Tasks from ``source`` (a file or ``hf:ID[:split]``); malformed rows warned and skipped (or raised)."""
    qkey, akey = fields.get("question", "question"), fields.get("answer", "answer")
    idkey, setupkey = fields.get("id"), fields.get("setup")
    name = source[3:].split(":")[0].split("/")[-1] if source.startswith("hf:") else Path(source).name.split(".")[0]
    where, records = _records(source, fmt or detect_format(source))
    records = _check_fields(records, where, {"question": qkey, "answer": akey})

    def parse(row: dict, pos: RowPos) -> Task:
        question = _get(row, qkey)
        if not isinstance(question, str) or not question.strip():
            raise BadRow(f"field {qkey!r} is not a non-empty string")
        answer = _gold(_get(row, akey), reward, _get(row, setupkey) if setupkey else None)
        task_id = f"{name}/{_get(row, idkey) if idkey else pos.index}"
        return Task(id=task_id, question=question.strip(), answer=answer,
                    meta={"data_source": name, "where": f"{where}:{pos.where}"})

    tasks, _ = parse_rows(records, parse, source=where, strict=strict, limit=limit, error=DatasetLoadError)
    return tasks


def dataset_source(cfg: TaskConfig, sft_teacher: dict):
    """The ``dataset`` task source (see the module docstring)."""
    from masrl.tasks.source import TaskSource
    from masrl.tasks.rewards import resolve_reward, reward_kind

    params = cfg.params
    unknown = sorted(set(params) - _KNOWN_PARAMS)
    if unknown:
        raise ConfigError(f"task.params for dataset: unknown keys {unknown}; known: {sorted(_KNOWN_PARAMS)}")
    if not params.get("train"):
        raise ConfigError("task dataset: set task.params.train (a jsonl/json/parquet file or hf:ID[:split])")
    fields = params.get("fields") or {}
    if not isinstance(fields, dict) or set(fields) - {"question", "answer", "id", "setup"}:
        raise ConfigError(f"task.params.fields must map question/answer (and optionally id, setup) to field "
                         f"names, got {fields!r}")
    reward = params.get("reward", "math")
    score = resolve_reward(reward, params, cfg.reward_timeout_s, cfg.reward_isolation)
    kind = reward_kind(reward)
    kw = dict(fields=fields, reward=kind, fmt=params.get("format"), strict=cfg.strict)
    train = load_rows_as_tasks(params["train"], limit=cfg.train_limit, **kw)
    return TaskSource("dataset", train, _test_split(params.get("test"), cfg, kw), score)


def _test_split(test: str | None, cfg: TaskConfig, kw: dict) -> list[Task]:
    """The held-out split: a file / hf: source read like the train split, or a registered math benchmark."""
    from masrl.tasks.math_data import BENCHMARKS, load_benchmark

    if not test:
        return []
    if test in BENCHMARKS:
        return load_benchmark(test, limit=cfg.test_limit, strict=cfg.strict)
    return load_rows_as_tasks(test, limit=cfg.test_limit, **kw)
