"""Per-model predictions on a labeled set: the data model, JSONL loader and train/test splits.

One JSON object per line::

    {"id": "bbh/navigate/0", "label": 1, "task": "navigate",
     "predictions": {"<model>": {"answer": 0, "probs": [0.7, 0.3]}, ...}, ...extra fields}

* ``answer`` may be ``null`` (an abstention, or unknown in correctness-only files);
* ``probs`` (optional) are per-choice probabilities; then answers and labels are choice indices;
* ``correct`` (optional, 0/1) gives correctness directly (correctness-only files such as
  RouterDC have no answers or labels); without it, correct = ``answer == label`` and a ``null``
  label counts as wrong;
* extra top-level scalar fields (``split_rlfocal``, ``label_rlfocal``, ``doc_id`` ...) are kept in
  ``EnsembleData.extras``; ``task`` groups rows (default: one task named after the file).

Answers are stored as integer codes: the raw values when every answer and label is a
non-negative int (choice indices), otherwise indices into ``EnsembleData.vocab``. ``-1``
means abstain / unknown.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from masrl.errors import UserInputError
from masrl.io.rows import BadRow, MalformedRowWarning, RowPos, iter_records, parse_rows

__all__ = ["EnsembleData", "MalformedRowWarning", "load_jsonl", "from_records", "resolve_data_path",
           "split_indices", "Split"]


@dataclass
class EnsembleData:
    """Predictions of ``N`` models on ``n`` labeled items (numpy arrays, row-aligned)."""

    ids: list[str]
    models: list[str]
    answers: np.ndarray            # (n, N) int64 answer codes, -1 = abstain / unknown
    labels: np.ndarray             # (n,) int64 label codes, -1 = no label
    correct: np.ndarray            # (n, N) bool
    tasks: np.ndarray              # (n,) str
    probs: np.ndarray | None = None      # (n, N, K) float32 per-choice probabilities, zero-padded
    n_choices: np.ndarray | None = None  # (n,) int, number of choices of each row (0 = unknown)
    vocab: list | None = None            # code -> raw answer value (None: codes are the raw ints)
    extras: dict[str, np.ndarray] = field(default_factory=dict)  # per-row extra scalar fields
    source: str = ""
    skipped: list[tuple[int, str]] = field(default_factory=list)  # (line, reason) of skipped rows

    # ------------------------------------------------------------------ shape helpers
    @property
    def n(self) -> int:
        return len(self.ids)

    @property
    def n_models(self) -> int:
        return len(self.models)

    @property
    def has_answers(self) -> bool:
        """True when the file carries answers (plurality voting is possible)."""
        return bool((self.answers >= 0).any())

    @property
    def has_labels(self) -> bool:
        return bool((self.labels >= 0).any())

    @property
    def has_probs(self) -> bool:
        return self.probs is not None

    def task_names(self) -> list[str]:
        """Tasks in order of first appearance."""
        seen: dict[str, None] = {}
        for t in self.tasks.tolist():
            seen.setdefault(t, None)
        return list(seen)

    def task_rows(self, task: str, rows: np.ndarray | None = None) -> np.ndarray:
        """Indices of ``task``'s rows (restricted to ``rows`` if given), in file order."""
        idx = np.flatnonzero(self.tasks == task)
        if rows is not None:
            idx = np.intersect1d(idx, rows)
        return idx

    def accuracy(self, rows: np.ndarray | None = None) -> np.ndarray:
        """Per-model accuracy (mean correctness) on ``rows`` (default: all)."""
        c = self.correct if rows is None else self.correct[rows]
        return c.mean(axis=0) if len(c) else np.zeros(self.n_models)

    def model_index(self, names: Iterable[str]) -> list[int]:
        out = []
        for name in names:
            if name not in self.models:
                raise InputError(f"unknown model {name!r}; models are {self.models}")
            out.append(self.models.index(name))
        return out

    def decode(self, code: int) -> Any:
        """Raw answer value of an answer/label code (``None`` for -1)."""
        if code < 0:
            return None
        return self.vocab[code] if self.vocab is not None else int(code)

    def take(self, rows: Sequence[int] | np.ndarray) -> "EnsembleData":
        """Row subset (a copy)."""
        rows = np.asarray(rows, dtype=np.int64)
        return EnsembleData(
            ids=[self.ids[i] for i in rows], models=list(self.models), answers=self.answers[rows],
            labels=self.labels[rows], correct=self.correct[rows], tasks=self.tasks[rows],
            probs=None if self.probs is None else self.probs[rows],
            n_choices=None if self.n_choices is None else self.n_choices[rows],
            vocab=self.vocab, extras={k: v[rows] for k, v in self.extras.items()}, source=self.source)

    def select_models(self, names: Sequence[str]) -> "EnsembleData":
        """Model (column) subset, in the given order."""
        idx = self.model_index(names)
        return EnsembleData(
            ids=list(self.ids), models=[self.models[i] for i in idx], answers=self.answers[:, idx],
            labels=self.labels, correct=self.correct[:, idx], tasks=self.tasks,
            probs=None if self.probs is None else self.probs[:, idx], n_choices=self.n_choices,
            vocab=self.vocab, extras=dict(self.extras), source=self.source)

    def describe(self) -> str:
        kinds = ["answers" if self.has_answers else "correctness only"]
        if self.has_probs:
            kinds.append("probs")
        return (f"{self.source or 'data'}: {self.n} items, {self.n_models} models, "
                f"{len(self.task_names())} task(s), {' + '.join(kinds)}")


# ---------------------------------------------------------------------------------- loading
class InputError(UserInputError, ValueError):
    """Bad ensemble input (a predictions file, a model or selector name, an option): one line, exit 2."""


def _kind(v: Any) -> str | None:
    """The JSON type of an answer or label: 1 and "1" and true are different kinds (never compared)."""
    if v is None:
        return None
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    return {str: "string", list: "list", dict: "object"}.get(type(v), type(v).__name__)


def _row_kind(row: dict, label_field: str) -> tuple[str, str] | None:
    """(kind, what) of the row's label and answers; raises BadRow when they mix kinds."""
    found = [(_kind(row["label"]), label_field)] + [(_kind(p[0]), f"answer of {m!r}") for m, p in row["preds"].items()]
    found = [(k, what) for k, what in found if k is not None]
    for k, what in found[1:]:
        if k != found[0][0]:
            raise BadRow(f"{what} is a {k} but {found[0][1]} is a {found[0][0]}; labels and answers must "
                         "have one JSON type (all strings, all numbers or all booleans)")
    return found[0] if found else None

def _is_index(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def answer_key(v: Any) -> Any:
    """Hashable key for an answer value (lists/dicts by their canonical JSON)."""
    if isinstance(v, (list, dict)):
        return ("json", json.dumps(v, sort_keys=True))
    if isinstance(v, float) and v.is_integer():
        return int(v)  # 3.0 and 3 are the same answer
    return (type(v).__name__, v) if isinstance(v, bool) else v


def _parse_row(obj: Any, label_field: str, models_ref: list[str] | None) -> dict:
    """Validate one decoded JSON line; return a normalised dict or raise BadRow."""
    if not isinstance(obj, dict):
        raise BadRow(f"expected a JSON object, got {type(obj).__name__}")
    if "id" not in obj:
        raise BadRow("missing 'id'")
    if "predictions" not in obj:
        raise BadRow("missing 'predictions'")
    if label_field not in obj:
        raise BadRow(f"missing label field {label_field!r}")
    preds = obj["predictions"]
    if not isinstance(preds, dict) or not preds:
        raise BadRow("'predictions' must be a non-empty object {model: {...}}")
    if models_ref is not None and list(preds) != models_ref:
        missing = [m for m in models_ref if m not in preds]
        extra = [m for m in preds if m not in models_ref]
        if missing or extra:
            raise BadRow(f"model set differs from the first row (missing {missing}, unexpected {extra})")
    label = obj[label_field]
    if isinstance(label, float) and not math.isfinite(label):
        raise BadRow(f"{label_field} is not finite")
    row_choices = obj.get("choices")
    n_choices = len(row_choices) if isinstance(row_choices, list) else 0
    out_preds = {}
    n_probs = None
    for model, p in preds.items():
        if not isinstance(p, dict):
            raise BadRow(f"prediction of {model!r} must be an object, got {type(p).__name__}")
        if "answer" not in p and "correct" not in p:
            raise BadRow(f"prediction of {model!r} has neither 'answer' nor 'correct'")
        ans = p.get("answer")
        corr = p.get("correct")
        if corr is not None:
            if isinstance(corr, str) or corr not in (0, 1):
                raise BadRow(f"'correct' of {model!r} must be 0/1/true/false, got {corr!r}")
            corr = bool(corr)
        probs = p.get("probs")
        if probs is not None:
            if not isinstance(probs, list) or not probs or not all(
                    isinstance(x, (int, float)) and not isinstance(x, bool) for x in probs):
                raise BadRow(f"'probs' of {model!r} must be a non-empty list of numbers")
            arr = np.asarray(probs, dtype=np.float64)
            if not np.isfinite(arr).all() or (arr < 0).any():
                raise BadRow(f"'probs' of {model!r} has negative or non-finite values")
            if abs(arr.sum() - 1.0) > 0.01:
                raise BadRow(f"'probs' of {model!r} sum to {arr.sum():.4f}, not 1")
            if n_probs is None:
                n_probs = len(probs)
            elif len(probs) != n_probs:
                raise BadRow(f"'probs' of {model!r} has {len(probs)} entries, other models {n_probs}")
            if ans is not None and (not _is_index(ans) or ans >= len(probs)):
                raise BadRow(f"answer {ans!r} of {model!r} is not a choice index into its {len(probs)} probs")
        if n_choices and ans is not None and _is_index(ans) and ans >= n_choices and "choices" in obj:
            raise BadRow(f"answer {ans!r} of {model!r} is out of range for {n_choices} choices")
        if corr is not None and ans is not None and label is not None:
            same = answer_key(ans) == answer_key(label)
            if same != corr:
                raise BadRow(f"'correct' of {model!r} is {int(corr)} but answer {ans!r} "
                                f"{'==' if same else '!='} label {label!r}")
        out_preds[model] = (ans, probs, corr)
    if n_probs is not None and label is not None and (not _is_index(label) or label >= n_probs):
        raise BadRow(f"label {label!r} is not a choice index into {n_probs} probs")
    extras = {k: v for k, v in obj.items()
              if k not in ("id", "predictions", label_field, "task") and (v is None or isinstance(v, (str, int, float, bool)))}
    task = obj.get("task")
    if task is not None and not isinstance(task, str):
        raise BadRow("'task' must be a string")
    return {"id": str(obj["id"]), "label": label, "task": task, "preds": out_preds,
            "n_choices": max(n_choices, n_probs or 0), "has_probs": n_probs is not None, "extras": extras}


def from_records(records: Iterable[Any], *, label_field: str = "label", strict: bool = True,
                 source: str = "<records>", default_task: str | None = None,
                 models: Sequence[str] | None = None, line_offset: int = 1) -> EnsembleData:
    """Build ``EnsembleData`` from decoded rows (see module doc for the schema).

    ``strict=True`` raises ``ValueError("<source>:<line>: <what is wrong>")`` at the first
    malformed row; ``strict=False`` skips such rows with a ``MalformedRowWarning`` each (the
    first 10, then a count: ``masrl.io.rows``) and records them all in ``.skipped``.
    ``models`` keeps only those models (in that order).
    """
    positioned = ((RowPos(str(i + line_offset), i, i + line_offset), obj) for i, obj in enumerate(records))
    return _from_positioned(positioned, label_field=label_field, strict=strict, source=source,
                            default_task=default_task, models=models)


def _from_positioned(records: Iterable[tuple[RowPos, Any]], *, label_field: str, strict: bool, source: str,
                     default_task: str | None, models: Sequence[str] | None) -> EnsembleData:
    """The stages of a load: validate the rows, pick the models, encode answers, collect extras."""
    rows, skipped, schema_probs = _validate_rows(records, label_field, strict, source)
    models_ref = _pick_models(list(rows[0]["preds"]), models, source)
    answers, labels, correct, probs, vocab = _encode(rows, models_ref, schema_probs, source)
    n_choices = np.array([r["n_choices"] for r in rows], dtype=np.int64)
    base_task = default_task or "all"
    tasks = np.array([r["task"] if r["task"] is not None else base_task for r in rows], dtype=object)
    return EnsembleData(ids=[r["id"] for r in rows], models=models_ref, answers=answers, labels=labels,
                        correct=correct, tasks=tasks, probs=probs,
                        n_choices=n_choices if n_choices.any() else None, vocab=vocab, extras=_extras(rows),
                        source=source, skipped=skipped)


def _validate_rows(records: Iterable[tuple[RowPos, Any]], label_field: str, strict: bool,
                   source: str) -> tuple[list[dict], list[tuple[int, str]], bool]:
    """Rows checked one by one and against the first row (model set, probs or not), ids unique.

    Returns the rows (each with its ``line``), the skipped ``(line, reason)`` and whether the
    rows carry probs. No valid row at all is an error."""
    models_ref: list[str] | None = None
    seen_ids: set[str] = set()
    schema_probs: bool | None = None
    kind_ref: tuple[str, str, int | None] | None = None  # (JSON type, what, line) of the first typed row

    def parse(obj: Any, pos: RowPos) -> dict:
        nonlocal models_ref, schema_probs, kind_ref
        row = _parse_row(obj, label_field, models_ref)
        if row["id"] in seen_ids:
            raise BadRow(f"duplicate id {row['id']!r}")
        if schema_probs is None:
            schema_probs = row["has_probs"]
        elif schema_probs and not row["has_probs"]:
            raise BadRow("no 'probs' although earlier rows have them")
        elif not schema_probs and row["has_probs"]:
            raise BadRow("has 'probs' although the first row has none")
        kind = _row_kind(row, label_field)
        if kind is not None and kind_ref is not None and kind[0] != kind_ref[0]:
            raise BadRow(f"{kind[1]} is a {kind[0]} but line {kind_ref[2]} has {kind_ref[0]}s; labels and "
                         "answers must have one JSON type in the whole file")
        if kind is not None and kind_ref is None:
            kind_ref = (*kind, pos.line)
        if models_ref is None:
            models_ref = list(row["preds"])
        seen_ids.add(row["id"])
        row["line"] = pos.line
        return row

    rows, report = parse_rows(records, parse, source=source, strict=strict, error=InputError)
    skipped = [(int(where), reason) for where, reason in report.skipped]
    if not rows:
        raise InputError(f"{source}: no valid rows" + (f" ({len(skipped)} malformed)" if skipped else ""))
    return rows, skipped, bool(schema_probs)


def _pick_models(models_ref: list[str], models: Sequence[str] | None, source: str) -> list[str]:
    if models is None:
        return models_ref
    unknown = [m for m in models if m not in models_ref]
    if unknown:
        raise InputError(f"{source}: unknown model(s) {unknown}; the file has {models_ref}")
    return list(models)


def _encode(rows: list[dict], models_ref: list[str], schema_probs: bool,
            source: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None, list | None]:
    """Answer/label codes, correctness and probs: raw choice indices if possible, else a vocabulary."""
    values = [r["label"] for r in rows] + [p[0] for r in rows for p in r["preds"].values()]
    index_mode = all(v is None or _is_index(v) for v in values)
    if schema_probs and not index_mode:  # cannot happen after _parse_row checks, kept for safety
        raise InputError(f"{source}: probs need integer choice-index answers and labels")
    vocab: list | None = None if index_mode else []
    vocab_index: dict[Any, int] = {}

    def code(v: Any) -> int:
        if v is None:
            return -1
        if index_mode:
            return int(v)
        key = answer_key(v)
        if key not in vocab_index:
            vocab_index[key] = len(vocab)  # type: ignore[arg-type]
            vocab.append(v)  # type: ignore[union-attr]
        return vocab_index[key]

    n, nm = len(rows), len(models_ref)
    answers = np.full((n, nm), -1, dtype=np.int64)
    labels = np.full(n, -1, dtype=np.int64)
    correct = np.zeros((n, nm), dtype=bool)
    width = max(1, max(r["n_choices"] for r in rows))
    probs = np.zeros((n, nm, width), dtype=np.float32) if schema_probs else None
    for r_i, r in enumerate(rows):
        labels[r_i] = code(r["label"])
        for m_i, m in enumerate(models_ref):
            ans, pr, corr = r["preds"][m]
            answers[r_i, m_i] = code(ans)
            if corr is not None:
                correct[r_i, m_i] = corr
            else:
                correct[r_i, m_i] = ans is not None and r["label"] is not None and labels[r_i] == answers[r_i, m_i]
            if probs is not None and pr is not None:
                probs[r_i, m_i, :len(pr)] = pr
    return answers, labels, correct, probs, vocab


def _extras(rows: list[dict]) -> dict[str, np.ndarray]:
    """Per-row extra scalar fields (in order of first appearance) and ``_line``, the file line."""
    extra_keys: dict[str, None] = {}
    for r in rows:
        for k in r["extras"]:
            extra_keys.setdefault(k, None)
    extras = {k: np.array([r["extras"].get(k) for r in rows], dtype=object) for k in extra_keys}
    extras["_line"] = np.array([r["line"] for r in rows], dtype=np.int64)
    return extras


def resolve_data_path(path: str | Path) -> Path:
    """``path`` if it exists, else the same relative path under ``ensembles/`` of a data folder (or the folder)."""
    p = Path(path).expanduser()
    if p.exists():
        return p
    from masrl.catalog import DataNotFoundError, get_hint
    from masrl.paths import data_file

    for cand in (data_file(Path("ensembles") / p), data_file(p)):
        if cand.exists():
            return cand
    raise DataNotFoundError(f"data file not found: {path} (also under ensembles/ of the data folders: "
                            f"{get_hint(str(Path('ensembles') / p))})")


def load_jsonl(path: str | Path, *, label_field: str = "label", strict: bool = True,
               models: Sequence[str] | None = None) -> EnsembleData:
    """Load a predictions JSONL file (see module doc).

    ``label_field`` picks the gold field (e.g. ``"label_rlfocal"`` to reproduce RL-Focal's
    buggy BBH labels). Malformed rows raise ``ValueError("<file>:<line>: ...")`` unless
    ``strict=False``, which skips them with a warning. Blank lines count as malformed.
    """
    p = resolve_data_path(path)
    if p.is_dir():
        raise InputError(f"{p} is a directory; pass a .jsonl file")
    records = iter_records(p, "jsonl", blank_lines_are_rows=True)
    return _from_positioned(records, label_field=label_field, strict=strict, source=str(p),
                            default_task=p.stem, models=models)


# ---------------------------------------------------------------------------------- splits
@dataclass
class Split:
    train: np.ndarray
    test: np.ndarray
    how: str

    def describe(self) -> str:
        return f"{self.how}: {len(self.train)} train / {len(self.test)} test"


_SPLIT_FIELDS = ("split_rlfocal", "split_routerdc", "split")


def split_indices(data: EnsembleData, how: str = "auto", frac: float = 0.8) -> Split:
    """Train/test row indices.

    * ``"first"``: RL-Focal's split — the first ``int(frac * n_t)`` rows of each task (file
      order) train, the rest test;
    * ``"field:NAME"``: rows whose ``NAME`` is ``"train"`` train, ``"test"`` test (others, e.g.
      ``ood_test``, are left out);
    * ``"auto"``: the first of the fields ``split_rlfocal``, ``split_routerdc``, ``split``
      present in the data, else ``"first"``.
    """
    if how == "auto":
        for f in _SPLIT_FIELDS:
            if f in data.extras:
                how = f"field:{f}"
                break
        else:
            how = "first"
    if how == "first":
        if not 0.0 < frac < 1.0:
            raise InputError(f"split fraction must be in (0, 1), got {frac}")
        train, test = [], []
        for t in data.task_names():
            idx = data.task_rows(t)
            cut = int(frac * len(idx))
            train.append(idx[:cut])
            test.append(idx[cut:])
        tr, te = np.sort(np.concatenate(train)), np.sort(np.concatenate(test))
        if len(tr) == 0 or len(te) == 0:
            raise InputError(f"split 'first' with fraction {frac} gives {len(tr)} train and {len(te)} test rows")
        return Split(tr, te, f"first {frac:.0%} of each task")
    if how.startswith("field:"):
        name = how.split(":", 1)[1]
        if name not in data.extras:
            raise InputError(f"split field {name!r} not in data (extra fields: {sorted(k for k in data.extras if not k.startswith('_'))})")
        vals = data.extras[name]
        tr = np.flatnonzero(vals == "train")
        te = np.flatnonzero(vals == "test")
        if len(tr) == 0 or len(te) == 0:
            raise InputError(f"split field {name!r} gives {len(tr)} train and {len(te)} test rows")
        return Split(tr, te, f"field {name}")
    raise InputError(f"unknown split {how!r}: use 'auto', 'first' or 'field:NAME'")
