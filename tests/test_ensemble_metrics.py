"""Diversity metrics pinned on hand-computed cases, plus property checks against direct definitions."""
import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from masrl.ensemble import metrics as M

# ci = [1,1,0,0,1], cj = [1,0,1,0,0]: N11=1 (item 0), N10=2 (items 1,4), N01=1 (item 2), N00=1 (item 3)
CI, CJ = [1, 1, 0, 0, 1], [1, 0, 1, 0, 0]


def test_pair_counts():
    assert M.pair_counts(CI, CJ) == (1, 2, 1, 1)


def test_q_statistic_hand():
    # (1*1 - 1*2) / (1*1 + 1*2)
    assert M.q_statistic(CI, CJ) == pytest.approx(-1 / 3)
    assert M.q_statistic([1, 0], [1, 0]) == 1.0
    assert M.q_statistic([1, 0], [0, 1]) == -1.0
    assert math.isnan(M.q_statistic([1, 1], [1, 1]))  # N00 = N01 = N10 = 0


def test_correlation_hand():
    # (1 - 2) / sqrt((1+2)(1+1)(1+1)(2+1)) = -1/6
    assert M.correlation(CI, CJ) == pytest.approx(-1 / 6)
    assert M.correlation([1, 0, 1], [1, 0, 1]) == pytest.approx(1.0)
    assert math.isnan(M.correlation([1, 1, 1], [1, 0, 1]))


def test_disagreement_and_double_fault_hand():
    assert M.disagreement(CI, CJ) == pytest.approx(3 / 5)
    assert M.double_fault(CI, CJ) == pytest.approx(1 / 5)
    assert M.disagreement([], []) == 0.0


def test_cohen_kappa_hand():
    # p_o = 2/5; p_e = (3/5)(2/5) + (2/5)(3/5) = 12/25; kappa = (10/25 - 12/25) / (13/25) = -2/13
    assert M.cohen_kappa(CI, CJ) == pytest.approx(-2 / 13)
    # categorical: a = [0,1,2,2], b = [0,1,2,1]: p_o = 3/4; p_e = (1/4)(1/4) + (1/4)(2/4) + (2/4)(1/4) = 5/16
    assert M.cohen_kappa([0, 1, 2, 2], [0, 1, 2, 1]) == pytest.approx((3 / 4 - 5 / 16) / (11 / 16))
    assert M.cohen_kappa([1, 1], [1, 1]) == 1.0  # chance agreement 1 -> defined as 1


def test_kw_kappa_differs_from_cohen_when_accuracies_differ():
    # 2 (1*1 - 1*2) / ((1+2)(1+1) + (1+1)(2+1)) = -2/12
    assert M.kw_kappa(CI, CJ) == pytest.approx(-1 / 6)
    same_acc_a, same_acc_b = [1, 1, 0, 0], [1, 0, 1, 0]
    assert M.kw_kappa(same_acc_a, same_acc_b) == pytest.approx(M.cohen_kappa(same_acc_a, same_acc_b))


def test_fleiss_kappa_hand():
    # P_i = 1, 1/3, 1/3 -> P_bar = 5/9 ; p = (2/3, 1/3) -> P_e = 5/9 -> kappa 0
    assert M.fleiss_kappa([[0, 0, 0], [0, 0, 1], [1, 1, 0]]) == pytest.approx(0.0)
    assert M.fleiss_kappa([[0, 0], [1, 1]]) == pytest.approx(1.0)
    assert M.fleiss_kappa([[0, 1], [1, 0]]) == pytest.approx(-1.0)
    assert M.fleiss_kappa([["a", "a"], ["a", "a"]]) == 1.0
    # 4 items, 3 raters, 3 categories: counts (3,0,0) (1,1,1) (0,2,1) (0,0,3)
    # P_i = 1, 0, 1/3, 1 -> P_bar = 7/12 ; p = (4,3,5)/12 -> P_e = 50/144
    r = [[0, 0, 0], [0, 1, 2], [1, 1, 2], [2, 2, 2]]
    assert M.fleiss_kappa(r) == pytest.approx((7 / 12 - 50 / 144) / (1 - 50 / 144))
    with pytest.raises(ValueError):
        M.fleiss_kappa([[0], [1]])


def test_entropies_hand():
    C = [[1, 1], [1, 0]]
    assert M.binary_entropy(C) == pytest.approx(0.5)      # H(1)=0, H(1/2)=1
    assert M.kuncheva_entropy(C) == pytest.approx(0.5)    # min(l, M-l)/(M - ceil(M/2)) = 0, 1
    C3 = [[1, 1, 0], [0, 0, 0]]
    h = -(2 / 3 * math.log2(2 / 3) + 1 / 3 * math.log2(1 / 3))
    assert M.binary_entropy(C3) == pytest.approx(h / 2)
    assert M.kuncheva_entropy(C3) == pytest.approx(0.5)   # (1/1 + 0)/2


def test_generalized_diversity_hand():
    # failures per item f = 0,1,2,3 of M=3: p(1) = mean(f/3) = 1/2, p(2) = mean(f(f-1)/6) = 1/3
    C = [[1, 1, 1], [0, 1, 1], [0, 0, 1], [0, 0, 0]]
    assert M.generalized_diversity(C) == pytest.approx(1 - (1 / 3) / (1 / 2))
    assert M.generalized_diversity([[1, 1], [1, 1]]) == 1.0


def test_focal_diversity_hand():
    # rows: only m0 fails; m0,m1 fail; only m2 fails; none fail
    C = [[0, 1, 1], [0, 0, 1], [1, 1, 0], [1, 1, 1]]
    # focal m0: Neg={r0,r1}, f=(1,2): p1=(1/3+2/3)/2=1/2, p2=(0+2/6)/2=1/6 -> 2/3
    # focal m1: Neg={r1}, f=2: p1=2/3, p2=1/3 -> 1/2 ; focal m2: Neg={r2}, f=1: p2=0 -> 1
    assert M.focal_lambdas(C) == pytest.approx([2 / 3, 1 / 2, 1.0])
    assert M.focal_diversity(C) == pytest.approx(13 / 18)
    # members (0,1): focal m0 Neg={r0,r1}, f=(1,2) of M=2: p1=(1/2+1)/2=3/4, p2=(0+1)/2=1/2 -> 1/3;
    # focal m1 Neg={r1}, f=2: p1=1, p2=1 -> 0
    assert M.focal_lambdas(C, [0, 1]) == pytest.approx([1 / 3, 0.0])
    assert M.focal_diversity(C, members=[0, 1]) == pytest.approx(1 / 6)
    with pytest.raises(ValueError):
        M.focal_diversity(C, members=[0])


def test_focal_all_correct_is_one():
    assert M.focal_diversity(np.ones((5, 3), dtype=int)) == 1.0


def _focal_direct(C):
    """Literal definition: per focal i, p_j over its failures, j = 1..M."""
    C = np.asarray(C, dtype=int)
    n, m = C.shape
    lams = []
    for i in range(m):
        neg = C[C[:, i] == 0]
        if len(neg) == 0:
            lams.append(1.0)
            continue
        fails = (1 - neg).sum(1)
        p = [np.mean(fails == j) for j in range(1, m + 1)]
        p1 = sum(j / m * p[j - 1] for j in range(1, m + 1))
        p2 = sum(j * (j - 1) / (m * (m - 1)) * p[j - 1] for j in range(1, m + 1))
        lams.append(1.0 if p1 == 0 else 1 - p2 / p1)
    return float(np.mean(lams))


binmat = st.integers(2, 5).flatmap(lambda m: arrays(np.int8, st.tuples(st.integers(0, 30), st.just(m)),
                                                    elements=st.integers(0, 1)))


@settings(max_examples=60, deadline=None)
@given(binmat)
def test_focal_matches_definition(C):
    assert M.focal_diversity(C) == pytest.approx(_focal_direct(C))
    assert 0.0 <= M.focal_diversity(C) <= 1.0 + 1e-12


@settings(max_examples=60, deadline=None)
@given(binmat)
def test_pairwise_properties(C):
    for i, j in itertools.combinations(range(C.shape[1]), 2):
        a, b = C[:, i], C[:, j]
        n11, n10, n01, n00 = M.pair_counts(a, b)
        assert n11 + n10 + n01 + n00 == len(a)
        assert M.disagreement(a, b) == pytest.approx(M.disagreement(b, a))
        q = M.q_statistic(a, b)
        assert math.isnan(q) or -1 - 1e-12 <= q <= 1 + 1e-12
        if len(a):
            # binary Cohen kappa == 2(ad - bc) / (p_a q_b + p_b q_a)
            den = (n11 + n10) * (n10 + n00) + (n11 + n01) * (n01 + n00)
            if den:
                assert M.cohen_kappa(a, b) == pytest.approx(2 * (n11 * n00 - n01 * n10) / den)


@settings(max_examples=40, deadline=None)
@given(binmat)
def test_fleiss_two_raters_is_scotts_pi(C):
    # Fleiss with 2 raters is Scott's pi: (p_o - p_e) / (1 - p_e), p_e from pooled marginals
    if len(C) == 0:
        return
    a, b = C[:, 0], C[:, 1]
    po = float((a == b).mean())
    p1 = (a.sum() + b.sum()) / (2 * len(a))
    pe = p1 ** 2 + (1 - p1) ** 2
    expected = 1.0 if pe >= 1 else (po - pe) / (1 - pe)
    assert M.fleiss_kappa(C[:, :2]) == pytest.approx(expected)


def test_pairwise_matrix_and_summary():
    C = np.array([[1, 1, 0], [1, 0, 1], [0, 1, 1], [1, 1, 1]])
    D = M.pairwise_matrix(C, "disagreement")
    assert D.shape == (3, 3) and np.allclose(np.diag(D), 0) and np.allclose(D, D.T)
    assert D[0, 1] == pytest.approx(0.5)
    assert M.mean_pairwise(C, "disagreement") == pytest.approx(np.mean([D[0, 1], D[0, 2], D[1, 2]]))
    s = M.diversity_summary(C)
    assert set(s) >= {"q_statistic", "correlation", "disagreement", "cohen_kappa", "fleiss_kappa",
                      "binary_entropy", "focal_diversity", "generalized_diversity"}
    with pytest.raises(ValueError):
        M.pair_counts([0, 2], [1, 0])
