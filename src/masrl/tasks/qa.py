"""Open-domain QA: answer normalization, EM / F1 reward, and dataset loaders.

Scoring (SQuAD-style): lowercase, drop punctuation and the articles a/an/the, collapse
whitespace; exact match (EM) and token F1 take the best over all gold answers.

    score = functools.partial(qa_score, metric="f1")   # a ScoreFn: (task, answer) -> dict

Loaders return ``list[Task]`` with ``answer`` = list of gold strings and
``meta["data_source"]``. Formats: FlashRAG JSONL (``question``, ``golden_answers``),
Search-R1 parquet (``prompt``/``question``, ``reward_model.ground_truth.target``),
``[{question, answer}]`` JSON, raw HotpotQA JSON (``_id``, ``question``, ``answer``,
``supporting_facts``, ``context``). ``load_qa`` picks the reader from the file, or takes a
dataset name (see ``QA_DATASETS``) resolved in the data folders (``masrl.paths.data_roots()``).
"""
from __future__ import annotations

import re
import string
from collections import Counter
from pathlib import Path
from typing import Any, Callable

from masrl.errors import ConfigError, UserInputError
from masrl.catalog import get_hint
from masrl.paths import data_file
from masrl.io.lines import open_binary
from masrl.io.rows import BadRow, MalformedRowWarning, RowPos, read_rows
from masrl.types import Task

QA_METRICS = ("em", "f1", "subem")


class QADataError(UserInputError, ValueError):
    """A QA file is missing or malformed (malformed rows raise only with ``strict=True``)."""


QADataWarning = MalformedRowWarning  # the one warning for a skipped row (masrl.io.rows); old name kept


# ----------------------------------------------------------------------------------------------
# scoring

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalize_answer(text: Any) -> str:
    """SQuAD normalization: lowercase, remove punctuation, remove articles, collapse whitespace."""
    text = str(text).lower().translate(_PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def gold_answers(answer: Any) -> list[str]:
    """Gold answers as a list of strings (a task may hold one string or a list)."""
    if answer is None:
        return []
    if isinstance(answer, (str, int, float)):
        return [str(answer)]
    if isinstance(answer, dict) and "target" in answer:  # Search-R1 ground_truth
        return gold_answers(answer["target"])
    return [str(a) for a in answer if a is not None]


def exact_match(prediction: str | None, golds: Any) -> float:
    if prediction is None:
        return 0.0
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in gold_answers(golds)))


def substring_match(prediction: str | None, golds: Any) -> float:
    """1 when a normalized gold answer occurs inside the normalized prediction (Search-R1 ``subem``)."""
    if prediction is None:
        return 0.0
    pred = normalize_answer(prediction)
    return float(any(normalize_answer(g) and normalize_answer(g) in pred for g in gold_answers(golds)))


def f1_score(prediction: str | None, golds: Any) -> float:
    """Token-level F1 of the normalized strings, best over the gold answers."""
    if prediction is None:
        return 0.0
    pred_tokens = normalize_answer(prediction).split()
    best = 0.0
    for gold in gold_answers(golds):
        gold_tokens = normalize_answer(gold).split()
        if not pred_tokens or not gold_tokens:
            best = max(best, float(pred_tokens == gold_tokens))
            continue
        common = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
        if common:
            precision, recall = common / len(pred_tokens), common / len(gold_tokens)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


def qa_score(task: Task, answer: str | None, metric: str = "em") -> dict:
    """ScoreFn for QA: ``{"reward", "correct", "em", "f1", "pred"}``; ``reward`` is the chosen ``metric``,
    ``pred`` the normalised answer (what maj@k votes on).

    ``correct`` is exact match whatever the reward metric.
    """
    if metric not in QA_METRICS:
        raise ConfigError(f"unknown QA metric {metric!r}; expected one of {QA_METRICS}")
    golds = gold_answers(task.answer)
    em, f1 = exact_match(answer, golds), f1_score(answer, golds)
    reward = {"em": em, "f1": f1}.get(metric)
    if reward is None:
        reward = substring_match(answer, golds)
    pred = normalize_answer(answer) if answer is not None else None  # what maj@k votes on
    return {"reward": float(reward), "correct": em >= 1.0, "em": em, "f1": f1, "pred": pred}


# ----------------------------------------------------------------------------------------------
# loaders

def _source_from_name(path: Path) -> str:
    stem = path.name.split(".")[0]
    for prefix in ("searchr1_", "hipporag_"):
        if stem.startswith(prefix):
            stem = stem[len(prefix):]
    return stem.split("_")[0] or stem


def _make_task(row_id: Any, question: Any, answers: Any, meta: dict) -> Task:
    """A task, or ``BadRow`` with the reason the row is malformed."""
    if not isinstance(question, str) or not question.strip():
        raise BadRow("missing or empty 'question'")
    if hasattr(answers, "tolist"):  # numpy arrays from parquet
        answers = answers.tolist()
    golds = gold_answers(answers) if isinstance(answers, (str, int, float, list, tuple, dict)) else []
    golds = [g for g in golds if g.strip()]
    if not golds:
        raise BadRow("missing or empty gold answer(s)")
    return Task(id=str(row_id), question=question.strip(), answer=golds, meta=meta)


def _read(path: Path, parse: Callable[[dict, RowPos], Task], fmt: str, limit: int | None,
          strict: bool) -> list[Task]:
    tasks, _ = read_rows(path, parse, strict=strict, limit=limit, format=fmt, error=QADataError)
    return tasks


def _check_file(path: str | Path) -> Path:
    path = Path(path).expanduser()
    if not path.is_file():
        raise QADataError(f"QA file not found: {path}")
    return path


def load_flashrag_jsonl(path: str | Path, *, limit: int | None = None, strict: bool = False) -> list[Task]:
    """FlashRAG JSONL: ``{"id"?, "question", "golden_answers": [...], "metadata"?, "data_source"?}``."""
    path = _check_file(path)
    default_source = _source_from_name(path)

    def parse(row: dict, pos: RowPos) -> Task:
        answers = row.get("golden_answers", row.get("answers", row.get("answer")))
        meta = {"data_source": row.get("data_source", default_source), "file": path.name}
        if isinstance(row.get("metadata"), dict):
            meta["metadata"] = row["metadata"]
        return _make_task(row.get("id", f"{default_source}-{pos.line - 1}"), row.get("question"), answers, meta)

    return _read(path, parse, "jsonl", limit, strict)


def load_qa_json(path: str | Path, *, limit: int | None = None, strict: bool = False) -> list[Task]:
    """A JSON array ``[{"question", "answer": str | [str]}]`` (``golden_answers`` also accepted)."""
    path = _check_file(path)
    source = _source_from_name(path)

    def parse(row: dict, pos: RowPos) -> Task:
        answers = row.get("answer", row.get("golden_answers", row.get("answers")))
        meta = {"data_source": row.get("data_source", source), "file": path.name}
        return _make_task(row.get("id", f"{source}-{pos.index}"), row.get("question"), answers, meta)

    return _read(path, parse, "json", limit, strict)


def load_hotpotqa_raw(path: str | Path, *, limit: int | None = None, strict: bool = False) -> list[Task]:
    """Raw HotpotQA: ``meta`` keeps ``type``, ``level`` and the supporting titles."""
    path = _check_file(path)

    def parse(row: dict, pos: RowPos) -> Task:
        facts = row.get("supporting_facts") or []
        titles = sorted({f[0] for f in facts if isinstance(f, (list, tuple)) and f and isinstance(f[0], str)})
        meta = {"data_source": "hotpotqa", "file": path.name, "type": row.get("type"),
                "level": row.get("level"), "supporting_titles": titles}
        return _make_task(row.get("_id", f"hotpotqa-{pos.index}"), row.get("question"), row.get("answer"), meta)

    return _read(path, parse, "json", limit, strict)


def load_searchr1_parquet(path: str | Path, *, limit: int | None = None, strict: bool = False) -> list[Task]:
    """Search-R1 parquet: gold from ``reward_model.ground_truth.target`` (else ``golden_answers``);
    the question from the ``question`` column, else from the prompt after its last ``Question:``."""
    path = _check_file(path)
    source = _source_from_name(path)

    def parse(row: dict, pos: RowPos) -> Task:
        question = row.get("question") or _question_from_prompt(row.get("prompt"))
        answers = None
        rm = row.get("reward_model")
        if isinstance(rm, dict) and isinstance(rm.get("ground_truth"), dict):
            answers = rm["ground_truth"].get("target")
        if answers is None:
            answers = row.get("golden_answers")
        meta = {"data_source": row.get("data_source") or source, "file": path.name}
        if isinstance(row.get("extra_info"), dict):
            meta["extra_info"] = row["extra_info"]
        return _make_task(row.get("id") or f"{source}-{pos.index}", question, answers, meta)

    return _read(path, parse, "parquet", limit, strict)


def _question_from_prompt(prompt: Any) -> str | None:
    if hasattr(prompt, "tolist"):
        prompt = prompt.tolist()
    if isinstance(prompt, list):
        contents = [m.get("content") for m in prompt if isinstance(m, dict) and m.get("role", "user") == "user"]
        prompt = contents[-1] if contents else None
    if not isinstance(prompt, str):
        return None
    _, sep, tail = prompt.rpartition("Question:")
    return tail.strip() if sep else prompt.strip()


# ----------------------------------------------------------------------------------------------
# dispatcher

# name -> path under a data folder (masrl.paths.data_roots(); `masrl data list`)
QA_DATASETS = {
    "bamboogle": "qa/bamboogle_test.jsonl",
    "nq": "qa/nq_test_sub1000.jsonl",
    "triviaqa": "qa/triviaqa_test_sub1000.jsonl",
    "popqa": "qa/popqa_test_sub1000.jsonl",
    "nq_full": "qa/nq_test_full_qa.json",
    "hotpotqa": "qa/hotpotqa_dev_full_qa.json",
    "2wikimultihopqa": "qa/2wikimultihopqa_dev_full_qa.json",
    "musique": "qa/musique_dev_full_qa.json",
    "searchr1_nq_test": "qa/searchr1_nq_search_test.parquet",
    "searchr1_nq_train": "qa/searchr1_nq_search_train5000.parquet",
    "hotpotqa_train100": "corpus/hipporag_hotpotqa_train100.json",
}

QA_FORMATS: dict[str, Callable[..., list[Task]]] = {
    "flashrag_jsonl": load_flashrag_jsonl,
    "searchr1_parquet": load_searchr1_parquet,
    "qa_json": load_qa_json,
    "hotpotqa_raw": load_hotpotqa_raw,
}


def detect_qa_format(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(".parquet"):
        return "searchr1_parquet"
    if name.endswith((".jsonl", ".jsonl.gz")):
        return "flashrag_jsonl"
    if name.endswith((".json", ".json.gz")):
        try:
            with open_binary(path) as f:
                head = f.read(65536).decode("utf-8", errors="replace")
        except (OSError, EOFError) as e:
            raise QADataError(f"{path}: cannot read ({type(e).__name__}: {e})") from None
        return "hotpotqa_raw" if re.search(r'"(supporting_facts|context)"\s*:', head) else "qa_json"
    raise QADataError(f"{path}: cannot tell the QA format from the name; pass format= one of {sorted(QA_FORMATS)}")


def load_qa(path_or_name: str | Path, limit: int | None = None, strict: bool = False,
            format: str = "auto") -> list[Task]:
    """Load QA tasks from a file, a name in ``QA_DATASETS`` or ``synthetic_kb[:train|test]``."""
    text = str(path_or_name)
    if text == "synthetic_kb" or text.startswith("synthetic_kb:"):
        from masrl.tasks.synthetic_kb import synthetic_kb

        split = text.partition(":")[2] or "train"
        tasks, _ = synthetic_kb(split=split)
        return tasks[:limit] if limit is not None else tasks
    if text in QA_DATASETS:
        path = data_file(QA_DATASETS[text])
        if not path.is_file():
            raise QADataError(f"dataset {text!r}: file {QA_DATASETS[text]} not found: {get_hint(QA_DATASETS[text])}")
    else:
        path = Path(text).expanduser()
        if not path.is_file():
            known = ", ".join(sorted(QA_DATASETS))
            raise QADataError(f"QA file or dataset not found: {text!r} (known names: {known}, synthetic_kb)")
    fmt = detect_qa_format(path) if format == "auto" else format
    if fmt not in QA_FORMATS:
        raise QADataError(f"unknown QA format {format!r}; expected one of {sorted(QA_FORMATS)} or 'auto'")
    if limit is not None and limit < 0:
        raise ValueError("limit must be >= 0")
    return QA_FORMATS[fmt](path, limit=limit, strict=strict)
