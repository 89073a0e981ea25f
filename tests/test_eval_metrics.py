"""Evaluation metrics: pass@k against brute force, avg@n, maj@k, per-benchmark summaries."""
from __future__ import annotations

import itertools
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from masrl.evaluation.metrics import (
    TaskResult,
    avg_at_n,
    maj_at_k,
    majority_answer,
    pass_at_k,
    summarize_groups,
)
from masrl.types import Episode, Task


def brute_pass_at_k(flags: list[bool], k: int) -> float:
    subsets = list(itertools.combinations(range(len(flags)), k))
    return sum(any(flags[i] for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_matches_enumeration_exhaustive():
    for n in range(1, 9):
        for c in range(0, n + 1):
            flags = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(flags, k), abs=1e-12), (n, c, k)


def test_pass_at_k_matches_enumeration_random_orders():
    rng = random.Random(1234)
    for _ in range(200):
        n = rng.randint(1, 8)
        flags = [rng.random() < 0.4 for _ in range(n)]
        k = rng.randint(1, n)
        assert pass_at_k(n, sum(flags), k) == pytest.approx(brute_pass_at_k(flags, k), abs=1e-12)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 400).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_pass_at_k_closed_form_and_range(nck):
    n, c, k = nck
    p = pass_at_k(n, c, k)
    assert 0.0 <= p <= 1.0
    exact = 1.0 - math.comb(n - c, k) / math.comb(n, k)
    assert p == pytest.approx(exact, abs=1e-9)
    if k < n:  # monotone in k
        assert pass_at_k(n, c, k + 1) >= p - 1e-12


def test_pass_at_k_special_values():
    assert pass_at_k(10, 0, 5) == 0.0
    assert pass_at_k(10, 10, 1) == 1.0
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(5, 2, 4) == 1.0  # n - c < k
    assert pass_at_k(1000, 1, 1000) == 1.0


@pytest.mark.parametrize("n,c,k", [(4, 1, 5), (4, 1, 0), (4, 5, 1), (4, -1, 1), (0, 0, 1), (4, 1, 1.5)])
def test_pass_at_k_rejects_bad_arguments(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_avg_at_n():
    assert avg_at_n([True, False, True, True]) == 0.75
    assert avg_at_n([1, 0]) == 0.5
    assert avg_at_n([0.5, 1.0]) == 0.75
    with pytest.raises(ValueError):
        avg_at_n([])


def test_maj_at_k_basic_and_normalizer():
    answers = ["12", " 12 ", "13", "$12$", "13"]
    gold = {"12"}
    assert maj_at_k(answers, lambda a: a.strip().strip("$") in gold, k=5) == 1.0
    # only the first k samples vote
    assert maj_at_k(["13", "13", "12", "12", "12"], lambda a: a == "12", k=2) == 0.0
    assert maj_at_k(["13", "13", "12", "12", "12"], lambda a: a == "12", k=5) == 1.0
    # "27.0" and "27" are one answer under the default normaliser
    assert majority_answer(["27.0", "26", "27"]) == (0, "27")


def test_maj_at_k_ties_go_to_first_seen():
    # 2 votes each for "a" and "b": "b" appears first
    assert majority_answer(["b", "a", "a", "b"]) == (0, "b")
    assert maj_at_k(["b", "a", "a", "b"], {"a": True, "b": False}, k=4) == 0.0
    assert maj_at_k(["a", "b", "b", "a"], {"a": True, "b": False}, k=4) == 1.0


def test_maj_at_k_none_answers_do_not_vote():
    assert maj_at_k([None, None, "5"], lambda a: a == "5", k=3) == 1.0
    assert maj_at_k([None, None], lambda a: True, k=2) == 0.0
    assert majority_answer([None]) is None


def test_maj_at_k_with_per_sample_flags():
    answers = ["x", "y", "y"]
    flags = [False, True, True]
    assert maj_at_k(answers, flags, k=3) == 1.0
    assert maj_at_k(answers, flags, k=1) == 0.0
    with pytest.raises(ValueError):
        maj_at_k(answers, flags, k=4)
    with pytest.raises(ValueError):
        maj_at_k(answers, flags, k=0)


def test_maj_at_k_without_normalizer_is_exact():
    assert majority_answer(["1", " 1", " 1"], normalizer=None) == (1, " 1")


def test_summarize_groups_per_benchmark():
    results = [
        {"benchmark": "gsm8k", "task_id": "gsm8k/0", "correct": [True, False, False, False],
         "answers": ["1", "2", "2", "3"]},
        {"benchmark": "gsm8k", "task_id": "gsm8k/1", "correct": [True, True, False, True],
         "answers": ["5", "5", "4", "5"]},
        TaskResult("aime24/0", "aime24", [False, False], answers=[None, "7"], rewards=[0.0, 0.0]),
    ]
    out = summarize_groups(results, ks=[1, 2, 4])
    g = out["gsm8k"]
    assert g["n_tasks"] == 2 and g["n"] == 4
    assert g["avg@n"] == pytest.approx((0.25 + 0.75) / 2)
    assert g["pass@1"] == pytest.approx(g["avg@n"])
    assert g["pass@2"] == pytest.approx((pass_at_k(4, 1, 2) + pass_at_k(4, 3, 2)) / 2)
    assert g["pass@4"] == pytest.approx(1.0)
    # task 0: majority "2" (wrong); task 1: majority "5" (right)
    assert g["maj@4"] == pytest.approx(0.5)
    assert g["maj@1"] == 1.0  # maj@1 = correctness of the first sample (both first samples are right)
    a = out["aime24"]
    assert a["n"] == 2 and "pass@4" not in a and a["pass@2"] == 0.0
    assert a["maj@2"] == 0.0 and a["mean_reward"] == 0.0


def test_summarize_groups_from_episodes_counts_episodes_not_turns():
    task = Task(id="math500/3", question="q", answer="4", meta={"data_source": "math500"})
    # an episode's turns never enter the metric: one flag per episode
    eps = [Episode(task=task, turns=[], reward=r, answer=a, info={"correct": r >= 1.0})
           for r, a in [(1.0, "4"), (0.0, "5"), (1.0, "4")]]
    out = summarize_groups({"math500/3": eps}, ks=[1, 3])
    row = out["math500"]
    assert row["n_tasks"] == 1 and row["n"] == 3
    assert row["avg@n"] == pytest.approx(2 / 3)
    assert row["pass@3"] == 1.0
    assert row["maj@3"] == 1.0
    assert row["mean_reward"] == pytest.approx(2 / 3)


def test_summarize_groups_errors():
    with pytest.raises(ValueError):
        summarize_groups([{"benchmark": "x", "correct": []}], ks=[1])
    with pytest.raises(ValueError):
        summarize_groups([{"benchmark": "x"}], ks=[1])
    with pytest.raises(ValueError):
        summarize_groups([{"benchmark": "x", "correct": [True]}], ks=[0])
