"""Selectors: hand-made pools with known answers, cost formulas, caching, exhaustive optimality."""
import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from masrl.ensemble import (SELECTORS, Oracle, Plurality, SelectionProblem, Split, SubsetEvaluator, Summarizer,
                            expected_cost, from_records, run_selector, select)
from masrl.ensemble.selectors import baselines, fitness


def corr_data(C, tasks=None):
    """Correctness-only data from a 0/1 matrix (columns = models m0, m1, ...)."""
    C = np.asarray(C)
    rows = []
    for i, c in enumerate(C):
        r = {"id": str(i), "label": None,
             "predictions": {f"m{j}": {"answer": None, "correct": int(v)} for j, v in enumerate(c)}}
        if tasks is not None:
            r["task"] = tasks[i]
        rows.append(r)
    return from_records(rows)


def answer_data(A, y):
    rows = [{"id": str(i), "label": int(y[i]),
             "predictions": {f"m{j}": {"answer": int(a) if a >= 0 else None} for j, a in enumerate(A[i])}}
            for i in range(len(y))]
    return from_records(rows)


def random_answers(seed, n=40, N=5, K=3):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, K, n)
    skill = rng.uniform(0.3, 0.8, N)
    A = np.where(rng.random((n, N)) < skill, y[:, None], rng.integers(0, K, (n, N)))
    return answer_data(A, y)


# A: rows 0-5 (0.6); B: rows 0-4 (0.5); C: rows 6-9 (0.4); D: rows 0,6 (0.2)
COV = np.array([[1, 1, 0, 1], [1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 0, 0],
                [1, 0, 0, 0], [0, 0, 1, 1], [0, 0, 1, 0], [0, 0, 1, 0], [0, 0, 1, 0]])


def problem(d, comb, sel=None, test=None):
    sel = np.arange(d.n) if sel is None else sel
    test = np.arange(d.n) if test is None else test
    return SelectionProblem(d, sel, test, comb)


def test_topk_and_coverage_greedy_hand():
    d = corr_data(COV)
    p = problem(d, Oracle())
    assert select(p, "topk", 2).member_idx == (0, 1)
    r = select(p, "proxy-coverage", 2)
    assert r.member_idx == (0, 2) and r.selection_accuracy == 1.0 and r.cost_calls == 0
    assert select(p, "topk", 2).selection_accuracy == pytest.approx(0.6)


def test_diversity_max_min_hand():
    d = corr_data(COV)
    p = problem(d, Oracle())
    # disagreement: A-C = 1.0 (never agree) is the largest pair; then max-min adds the next
    r = select(p, "diversity", 2)
    assert set(r.member_idx) == {0, 2}
    r3 = select(p, "diversity", 3)
    D = {(0, 1): 0.1, (0, 3): 0.6, (1, 3): 0.5, (2, 1): 0.9, (2, 3): 0.4}
    # candidates: B min(0.1, 0.9)=0.1, D min(0.6, 0.4)=0.4 -> D
    assert r3.member_idx[2] == 3 and D[(2, 3)] == 0.4


def test_focal_and_fitness_proxies_start_from_best():
    d = corr_data(COV)
    p = problem(d, Oracle())
    r = select(p, "proxy-focal", 2)
    assert r.member_idx[0] == 0  # focal diversity undefined for one member: start at the most accurate
    assert fitness(d.correct, None, d.labels, [0]) == -99.0


def test_forward_backward_cost_formulas():
    d = random_answers(0, n=30, N=5)
    p = problem(d, Plurality())
    N, n = 5, 30
    for k in range(1, 5):
        f = select(p, "forward", k)
        assert f.evaluations == k * N - k * (k - 1) // 2
        assert f.cost_calls == n * f.evaluations == expected_cost("forward", N, k, n)
        b = select(p, "backward", k)
        assert b.evaluations == (N * (N + 1) - k * (k + 1)) // 2
        assert b.cost_calls == expected_cost("backward", N, k, n)
        assert len(f.members) == len(b.members) == k
        assert select(p, "loo", k).evaluations == N + 1
        assert select(p, "exhaustive", k).evaluations == math.comb(N, k)
        h = select(p, "hybrid", k)
        M = min(N, k + 1)
        assert h.evaluations == k * M - k * (k - 1) // 2 == expected_cost("hybrid", N, k, 1)
        assert set(h.member_idx) <= set(h.info["shortlist"])
        for m in ("topk", "diversity", "proxy-coverage", "proxy-plurality", "proxy-focal", "proxy-fitness"):
            assert select(p, m, k).cost_calls == 0


def test_evaluator_caches_by_frozenset():
    d = random_answers(1)
    ev = SubsetEvaluator(d, Plurality(), np.arange(d.n))
    v = ev([0, 2])
    assert ev([2, 0]) == v and ev.evaluations == 1 and ev.calls == d.n
    ev([1])
    assert ev.evaluations == 2


def test_summarizer_in_the_loop_cost_equals_real_calls():
    d = random_answers(2, n=25, N=4)
    calls = []

    def first_answer(item_id, proposals):
        calls.append(item_id)
        return sorted(proposals.items())[0][1] if proposals else None

    s = Summarizer(first_answer)
    r = select(problem(d, s, sel=np.arange(20), test=np.arange(20, 25)), "forward", 2)
    # selection-time calls are counted; scoring the final subset (20 + 5 items) is not
    assert r.cost_calls == 20 * (2 * 4 - 1)
    assert len(calls) == r.cost_calls + 20 + 5


def test_forward_min_gain_stops_early():
    d = corr_data(COV)
    r = select(problem(d, Oracle()), "forward", 4, min_gain=1e-9)
    assert r.member_idx == (0, 2)  # coverage is 1.0 after two members; nothing more helps


def test_full_pool_and_k_validation():
    d = random_answers(3, N=4)
    p = problem(d, Plurality())
    assert set(select(p, "forward", 4).member_idx) == {0, 1, 2, 3}
    assert set(select(p, "backward", 4).member_idx) == {0, 1, 2, 3}
    with pytest.raises(ValueError):
        select(p, "forward", 5)
    with pytest.raises(ValueError, match="unknown selector"):
        select(p, "magic", 2)
    with pytest.raises(ValueError, match="exceeds"):
        select(p, "exhaustive", 2, max_subsets=3)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 4))
def test_exhaustive_is_best_on_selection_set(seed, k):
    d = random_answers(seed, n=30, N=5)
    p = problem(d, Plurality())
    best = select(p, "exhaustive", k).selection_accuracy
    brute = max(Plurality().accuracy(d, np.arange(d.n), S) for S in itertools.combinations(range(5), k))
    assert best == pytest.approx(brute)
    for m in SELECTORS:
        assert select(p, m, k).selection_accuracy <= best + 1e-12


def test_run_selector_per_task_and_global():
    C = np.vstack([COV, 1 - COV])
    tasks = ["t1"] * 10 + ["t2"] * 10
    d = corr_data(C, tasks)
    sp = Split(np.r_[0:8, 10:18], np.r_[8:10, 18:20], "manual")
    s = run_selector(d, sp, "forward", 2, "oracle", scope="per-task")
    assert set(s.subsets) == {"t1", "t2"}
    assert s.cost_calls == 8 * 7 + 8 * 7  # per task: n=8, evals = 2*4 - 1
    t1 = s.per_task["t1"]["test_accuracy"]
    t2 = s.per_task["t2"]["test_accuracy"]
    assert s.test_macro == pytest.approx((t1 + t2) / 2)
    assert s.test_pooled == pytest.approx((2 * t1 + 2 * t2) / 4)
    g = run_selector(d, sp, "forward", 2, "oracle", scope="global")
    assert g.cost_calls == 16 * 7 and len(set(g.subsets.values())) == 1
    with pytest.raises(ValueError):
        run_selector(d, sp, "forward", 2, "oracle", scope="sideways")


def test_baselines_keys():
    d = random_answers(4, n=50)
    sp = Split(np.arange(40), np.arange(40, 50), "manual")
    b = baselines(d, sp, "plurality")
    assert "oracle (all models)" in b and "plurality (all models)" in b
    assert b["oracle (all models)"]["pooled"] >= b["plurality (all models)"]["pooled"]
