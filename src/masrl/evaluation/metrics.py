"""Team-level evaluation metrics: avg@n, unbiased pass@k, maj@k, and per-benchmark summaries.

Every metric counts *episodes* (one team answer per sampled run of a workflow on a task),
never turns: a multi-agent episode with five LLM calls contributes one correctness flag.

Definitions (``n`` samples per task, ``c`` of them correct):

* ``avg@n``  = c / n, averaged over tasks (mean accuracy of one sample).
* ``pass@k`` = 1 - C(n-c, k) / C(n, k), averaged over tasks: the probability that at least one
  of ``k`` samples drawn without replacement from the ``n`` is correct (Chen et al. 2021,
  unbiased estimator). Computed as the product 1 - prod_{i=n-c+1}^{n} (1 - k/i), which never
  forms large binomials.
* ``maj@k``  = 1 if the most frequent (normalised) answer among the *first* ``k`` samples is
  correct, else 0, averaged over tasks. The expectation over all k-subsets is not computed
  (it is exponential in general); "majority over the first k samples" is the common practice.
  Samples without an answer (``None``) do not vote. Ties go to the answer whose first
  occurrence comes earliest among the k samples, so the result is deterministic.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "TaskResult",
    "avg_at_n",
    "default_answer_normalizer",
    "auc",
    "judge_agreement",
    "maj_at_k",
    "majority_answer",
    "pass_at_k",
    "ranks",
    "summarize_groups",
]


def stage_name(label: str, sft_steps: int) -> str:
    """The name every report gives an evaluation stage: ``sft`` is "after SFT" (or "before RL" when the run
    had no SFT cold start), ``final`` is "after RL", a step label is kept as it is."""
    return {"sft": "after SFT" if sft_steps else "before RL", "final": "after RL"}.get(label, label)


def ranks(values: list[float]) -> list[float]:
    """1-based ranks, ties given their average rank."""
    order = sorted(range(len(values)), key=values.__getitem__)
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def auc(scores: list[float], labels: list[bool]) -> float | None:
    """The probability that a positive's score exceeds a negative's (ties count half): the area under the ROC
    curve, by ranks (Mann-Whitney); None without both a positive and a negative."""
    n_pos = sum(bool(v) for v in labels)
    n_neg = len(labels) - n_pos
    if not n_pos or not n_neg:
        return None
    rank_sum = sum(r for r, v in zip(ranks(scores), labels) if v)
    return (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def judge_agreement(judged: Sequence[bool], checked: Sequence[bool]) -> dict[str, float]:
    """A judge's verdicts (``judged``: its correct flags) beside a rule-based check's on the same answers:
    ``approve_rate`` (its share of correct flags), ``agreement`` (flags equal), ``agreement_right`` (approvals
    among the answers the check passes) and ``agreement_wrong`` (rejections among those it fails), each of
    the last two only when there are such answers. A constant judge agrees on one side only, however high
    ``agreement`` is."""
    pairs = list(zip(judged, checked))
    if not pairs:
        return {}
    right = [j for j, c in pairs if c]
    wrong = [j for j, c in pairs if not c]
    out = {"approve_rate": sum(map(bool, judged)) / len(pairs), "agreement": sum(j == c for j, c in pairs) / len(pairs)}
    if right:
        out["agreement_right"] = sum(map(bool, right)) / len(right)
    if wrong:
        out["agreement_wrong"] = sum(not j for j in wrong) / len(wrong)
    return out


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one task with ``n`` samples of which ``c`` are correct.

    ``1 - C(n-c, k) / C(n, k)`` in the stable product form. Raises ``ValueError`` unless
    ``0 <= c <= n`` and ``1 <= k <= n``.
    """
    for name, v in (("n", n), ("c", c), ("k", k)):
        if isinstance(v, bool) or not isinstance(v, int):
            if isinstance(v, float) and v.is_integer():
                continue
            raise ValueError(f"pass_at_k: {name} must be an integer, got {v!r}")
    n, c, k = int(n), int(c), int(k)
    if n < 1:
        raise ValueError(f"pass_at_k: n must be >= 1, got {n}")
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n, got c={c}, n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:  # every k-subset contains a correct sample
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def avg_at_n(correct_flags: Iterable[Any]) -> float:
    """Mean of the per-sample correctness flags (bools or rewards in [0, 1]) of one task."""
    flags = [float(bool(f)) if isinstance(f, bool) else float(f) for f in correct_flags]
    if not flags:
        raise ValueError("avg_at_n: no samples")
    return sum(flags) / len(flags)


def default_answer_normalizer(answer: str) -> str:
    r"""Light normalisation for voting: drop whitespace, surrounding ``$``, ``\left``/``\right``,
    ``\dfrac``/``\tfrac`` -> ``\frac``, a trailing ``.`` and trailing zeros of a decimal (``27.0`` -> ``27``)."""
    s = "".join(str(answer).split())
    s = s.strip("$").rstrip(".")
    s = s.replace("\\left", "").replace("\\right", "").replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    if s.startswith("\\text{") and s.endswith("}"):
        s = s[len("\\text{"):-1]
    if _is_plain_decimal(s) and "." in s:
        s = s.rstrip("0").rstrip(".") or "0"
    return s


def _is_plain_decimal(s: str) -> bool:
    if not s:
        return False
    body = s[1:] if s[0] in "+-" else s
    if not body or body.count(".") > 1:
        return False
    return all(ch.isdigit() or ch == "." for ch in body) and any(ch.isdigit() for ch in body)


def majority_answer(
    answers: Sequence[str | None],
    normalizer: Callable[[str], str] | None = default_answer_normalizer,
) -> tuple[int, str] | None:
    """``(index of the first sample with the winning answer, normalised winner)``, or None when
    no sample has an answer. Ties: the answer seen first wins."""
    norm = normalizer or (lambda a: a)
    counts: dict[str, int] = {}
    first: dict[str, int] = {}
    for i, a in enumerate(answers):
        if a is None:
            continue
        key = norm(a)
        counts[key] = counts.get(key, 0) + 1
        first.setdefault(key, i)
    if not counts:
        return None
    best = min(counts, key=lambda key: (-counts[key], first[key]))
    return first[best], best


def maj_at_k(
    answers: Sequence[str | None],
    correct_of_answer: Callable[[str], bool] | Mapping[str, bool] | Sequence[bool],
    k: int,
    normalizer: Callable[[str], str] | None = default_answer_normalizer,
) -> float:
    """maj@k of one task: 1.0 if the majority answer of the first ``k`` samples is correct.

    ``correct_of_answer`` tells whether the winning answer is correct. It may be a callable
    ``raw_answer -> bool``, a mapping ``raw_answer -> bool``, or a sequence of per-sample
    correctness flags aligned with ``answers`` (the flag of the winner's first sample is used).
    Samples whose answer is ``None`` do not vote; if no sample of the first k has an answer the
    result is 0.0. Ties: the answer whose first occurrence is earliest wins.
    """
    if isinstance(k, bool) or int(k) != k or k < 1:
        raise ValueError(f"maj_at_k: k must be a positive integer, got {k!r}")
    k = int(k)
    if k > len(answers):
        raise ValueError(f"maj_at_k: k={k} > number of samples {len(answers)}")
    won = majority_answer(list(answers[:k]), normalizer)
    if won is None:
        return 0.0
    idx, _ = won
    raw = answers[idx]
    if isinstance(correct_of_answer, Mapping):
        return float(bool(correct_of_answer.get(raw, False)))
    if callable(correct_of_answer):
        return float(bool(correct_of_answer(raw)))
    flags = list(correct_of_answer)
    if len(flags) < k:
        raise ValueError(f"maj_at_k: {len(flags)} correctness flags for {k} samples")
    return float(bool(flags[idx]))


@dataclass
class TaskResult:
    """The ``n`` sampled episodes of one task, reduced to what the metrics need."""

    task_id: str
    benchmark: str
    correct: list[bool]
    answers: list[str | None] | None = None
    rewards: list[float] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _benchmark_of_task(task: Any) -> str:
    meta = getattr(task, "meta", None) or {}
    bench = meta.get("benchmark") or meta.get("data_source")
    if bench:
        return str(bench)
    tid = str(getattr(task, "id", ""))
    return tid.split("/", 1)[0] if "/" in tid else "default"


def _as_task_result(item: Any, key: Any = None) -> TaskResult:
    if isinstance(item, TaskResult):
        return item
    if isinstance(item, Mapping):
        if "correct" not in item:
            raise ValueError(f"summarize_groups: result {key!r} has no 'correct' list")
        correct = [bool(c) for c in item["correct"]]
        answers = item.get("answers")
        rewards = item.get("rewards")
        return TaskResult(
            task_id=str(item.get("task_id", key if key is not None else "")),
            benchmark=str(item.get("benchmark") or item.get("data_source") or "default"),
            correct=correct,
            answers=list(answers) if answers is not None else None,
            rewards=[float(r) for r in rewards] if rewards is not None else None,
        )
    # a group of Episode objects (masrl.types.Episode): one flag per episode
    episodes = list(item)
    if not episodes or not all(hasattr(e, "task") and hasattr(e, "correct") for e in episodes):
        raise ValueError(f"summarize_groups: cannot read result {key!r}: expected TaskResult, "
                         "a mapping with 'correct', or a list of Episode")
    task = episodes[0].task
    return TaskResult(
        task_id=str(task.id),
        benchmark=_benchmark_of_task(task),
        correct=[bool(e.correct) for e in episodes],
        answers=[e.answer for e in episodes],
        rewards=[float(e.reward) for e in episodes],
    )


def summarize_groups(
    per_task_results: Iterable[Any] | Mapping[str, Any],
    ks: Sequence[int] = (1,),
    normalizer: Callable[[str], str] | None = default_answer_normalizer,
) -> dict[str, dict[str, float]]:
    """Per-benchmark team-level metrics from the sampled episodes of each task.

    ``per_task_results`` holds one entry per task: a ``TaskResult``, a mapping with keys
    ``correct`` (list of bools, one per episode) and optionally ``benchmark``, ``task_id``,
    ``answers``, ``rewards``, or a list of ``masrl.types.Episode`` (benchmark read from
    ``task.meta['benchmark']``/``['data_source']``). A mapping ``task_id -> entry`` also works.

    Returns ``{benchmark: {"n_tasks", "n" (min samples per task), "n_max", "avg@n",
    "pass@k" for every k in ks with k <= n, "maj@k" for the same ks and for n (when answers
    are given), "mean_reward" (when rewards are given)}}``. Metrics are macro-averaged over
    tasks. A k larger than some task's sample count is skipped for that benchmark.
    """
    if isinstance(per_task_results, Mapping):
        items = [_as_task_result(v, key) for key, v in per_task_results.items()]
    else:
        items = [_as_task_result(v, i) for i, v in enumerate(per_task_results)]
    ks = sorted({int(k) for k in ks})
    if any(k < 1 for k in ks):
        raise ValueError(f"summarize_groups: every k must be >= 1, got {ks}")

    by_bench: dict[str, list[TaskResult]] = {}
    for r in items:
        if not r.correct:
            raise ValueError(f"summarize_groups: task {r.task_id!r} has no episodes")
        by_bench.setdefault(r.benchmark, []).append(r)

    out: dict[str, dict[str, float]] = {}
    for bench in sorted(by_bench):
        rs = by_bench[bench]
        n_min = min(len(r.correct) for r in rs)
        n_max = max(len(r.correct) for r in rs)
        row: dict[str, float] = {"n_tasks": len(rs), "n": n_min, "n_max": n_max}
        row["avg@n"] = _mean(avg_at_n(r.correct) for r in rs)
        usable = [k for k in ks if k <= n_min]
        for k in usable:
            row[f"pass@{k}"] = _mean(pass_at_k(len(r.correct), sum(r.correct), k) for r in rs)
        if all(r.answers is not None and len(r.answers) == len(r.correct) for r in rs):
            for k in sorted(set(usable) | {n_min}):
                row[f"maj@{k}"] = _mean(maj_at_k(r.answers, r.correct, k, normalizer) for r in rs)
        if all(r.rewards is not None for r in rs):
            row["mean_reward"] = _mean(sum(r.rewards) / len(r.rewards) for r in rs if r.rewards)
        out[bench] = row
    return out


def _mean(values: Iterable[float]) -> float:
    vals = list(values)
    return math.fsum(vals) / len(vals) if vals else float("nan")
