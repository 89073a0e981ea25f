"""Ensemble diversity metrics on oracle (correctness) outputs and on categorical answers.

Notation: ``C`` is an ``(n, M)`` 0/1 correctness matrix of the ``M`` members on ``n`` items;
for a pair (i, j), ``N11`` counts items both get right, ``N00`` both wrong, ``N10`` only i right,
``N01`` only j right. Formulas are in docs/ensembles.md. Degenerate cases: Q and correlation
are ``nan`` when their denominator is 0; Cohen's and Fleiss' kappa are 1.0 when chance
agreement is 1 (every rating in one category); focal / generalized diversity are 1.0 when no
member fails.
"""
from __future__ import annotations

import itertools
from typing import Callable, Sequence

import numpy as np

__all__ = [
    "pair_counts", "q_statistic", "correlation", "disagreement", "double_fault", "cohen_kappa", "kw_kappa",
    "pairwise_matrix", "mean_pairwise", "fleiss_kappa", "binary_entropy", "kuncheva_entropy",
    "generalized_diversity", "focal_diversity", "focal_lambdas", "diversity_summary", "PAIRWISE",
]


def _bin(x) -> np.ndarray:
    a = np.asarray(x)
    if a.dtype != bool:
        if not np.isin(a, (0, 1)).all():
            raise ValueError("correctness vectors must be 0/1")
        a = a.astype(bool)
    return a


def pair_counts(ci, cj) -> tuple[int, int, int, int]:
    """``(N11, N10, N01, N00)`` of two 0/1 correctness vectors."""
    a, b = _bin(ci), _bin(cj)
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch {a.shape} vs {b.shape}")
    return (int((a & b).sum()), int((a & ~b).sum()), int((~a & b).sum()), int((~a & ~b).sum()))


def q_statistic(ci, cj) -> float:
    """Yule's Q = (N11 N00 - N01 N10) / (N11 N00 + N01 N10); in [-1, 1], low = diverse."""
    n11, n10, n01, n00 = pair_counts(ci, cj)
    den = n11 * n00 + n01 * n10
    return float("nan") if den == 0 else (n11 * n00 - n01 * n10) / den


def correlation(ci, cj) -> float:
    """Phi correlation of the two correctness vectors (nan if either is constant)."""
    n11, n10, n01, n00 = pair_counts(ci, cj)
    den = (n11 + n10) * (n01 + n00) * (n11 + n01) * (n10 + n00)
    return float("nan") if den == 0 else (n11 * n00 - n01 * n10) / float(np.sqrt(den))


def disagreement(ci, cj) -> float:
    """Fraction of items where exactly one of the two is correct: (N01 + N10) / n."""
    n11, n10, n01, n00 = pair_counts(ci, cj)
    n = n11 + n10 + n01 + n00
    return 0.0 if n == 0 else (n01 + n10) / n


def double_fault(ci, cj) -> float:
    """Fraction of items both get wrong: N00 / n."""
    n11, n10, n01, n00 = pair_counts(ci, cj)
    n = n11 + n10 + n01 + n00
    return 0.0 if n == 0 else n00 / n


def cohen_kappa(a, b) -> float:
    """Cohen's kappa of two raters over categorical ratings (answers or 0/1 correctness).

    ``(p_o - p_e) / (1 - p_e)``, p_o = observed agreement, p_e = sum_c p_a(c) p_b(c).
    On 0/1 correctness it equals 2 (N11 N00 - N01 N10) / ((N11+N10)(N10+N00) + (N11+N01)(N01+N00))
    (compare ``kw_kappa``, whose denominator pairs the marginals differently).
    """
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError("cohen_kappa needs two 1-D rating vectors of equal length")
    if len(a) == 0:
        return float("nan")
    po = float((a == b).mean())
    cats = np.union1d(a, b)
    pe = float(sum((a == c).mean() * (b == c).mean() for c in cats))
    return 1.0 if pe >= 1.0 else (po - pe) / (1.0 - pe)


def kw_kappa(ci, cj) -> float:
    """Kuncheva & Whitaker's pairwise kappa (RL-Focal's ``kappa_statistics``) on 0/1 correctness:
    2 (N11 N00 - N01 N10) / ((N11+N10)(N01+N00) + (N11+N01)(N10+N00)).

    Equals Cohen's kappa only when both members have the same accuracy; nan if the denominator is 0.
    """
    n11, n10, n01, n00 = pair_counts(ci, cj)
    den = (n11 + n10) * (n01 + n00) + (n11 + n01) * (n10 + n00)
    return float("nan") if den == 0 else 2 * (n11 * n00 - n01 * n10) / den


PAIRWISE: dict[str, Callable] = {
    "q_statistic": q_statistic,
    "correlation": correlation,
    "disagreement": disagreement,
    "double_fault": double_fault,
    "cohen_kappa": lambda a, b: cohen_kappa(_bin(a).astype(int), _bin(b).astype(int)),
    "kw_kappa": kw_kappa,
}


def pairwise_matrix(C, stat: str | Callable = "disagreement") -> np.ndarray:
    """``(M, M)`` matrix of a pairwise statistic over the columns of ``C`` (diagonal included)."""
    fn = PAIRWISE[stat] if isinstance(stat, str) else stat
    C = np.asarray(C)
    m = C.shape[1]
    out = np.empty((m, m))
    for i in range(m):
        for j in range(i, m):
            out[i, j] = out[j, i] = fn(C[:, i], C[:, j])
    return out


def mean_pairwise(C, stat: str | Callable = "disagreement", members: Sequence[int] | None = None) -> float:
    """Mean of a pairwise statistic over all unordered pairs of ``members`` (nan pairs skipped)."""
    C = np.asarray(C)
    members = list(range(C.shape[1])) if members is None else list(members)
    fn = PAIRWISE[stat] if isinstance(stat, str) else stat
    vals = [fn(C[:, i], C[:, j]) for i, j in itertools.combinations(members, 2)]
    vals = [v for v in vals if not np.isnan(v)]
    return float(np.mean(vals)) if vals else float("nan")


def fleiss_kappa(ratings) -> float:
    """Fleiss' kappa of ``M`` raters over ``n`` items; ``ratings`` is ``(n, M)`` categorical.

    P_i = sum_c n_ic (n_ic - 1) / (M (M - 1)),  P_bar = mean_i P_i,
    p_c = sum_i n_ic / (n M),  P_e = sum_c p_c^2,  kappa = (P_bar - P_e) / (1 - P_e).
    Use answers (as RL-Focal does) or 0/1 correctness (Kuncheva's interrater agreement).
    """
    R = np.asarray(ratings)
    if R.ndim != 2 or R.shape[1] < 2:
        raise ValueError("fleiss_kappa needs an (n, M) rating matrix with M >= 2")
    n, m = R.shape
    if n == 0:
        return float("nan")
    _, inv = np.unique(R, return_inverse=True)
    inv = inv.reshape(n, m)
    counts = np.zeros((n, int(inv.max()) + 1))
    np.add.at(counts, (np.repeat(np.arange(n), m), inv.ravel()), 1.0)
    p_i = (counts * (counts - 1)).sum(1) / (m * (m - 1))
    p_c = counts.sum(0) / (n * m)
    pe = float((p_c ** 2).sum())
    pbar = float(p_i.mean())
    return 1.0 if pe >= 1.0 - 1e-12 else (pbar - pe) / (1.0 - pe)


def binary_entropy(C) -> float:
    """Mean over items of the Shannon entropy (bits) of the correct/incorrect split of the members.

    H(x) = -q log2 q - (1-q) log2 (1-q) with q = l(x)/M, l(x) = number of members correct on x.
    0 when all members agree on every item, 1 when they always split half/half.
    """
    C = _bin(C)
    q = C.mean(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        h = -(np.where(q > 0, q * np.log2(q), 0.0) + np.where(q < 1, (1 - q) * np.log2(1 - q), 0.0))
    return float(h.mean()) if len(h) else float("nan")


def kuncheva_entropy(C) -> float:
    """Kuncheva & Whitaker's entropy E = mean_x min(l(x), M - l(x)) / (M - ceil(M/2))."""
    C = _bin(C)
    m = C.shape[1]
    if m < 2:
        return float("nan")
    l = C.sum(axis=1)
    return float((np.minimum(l, m - l) / (m - np.ceil(m / 2))).mean()) if len(l) else float("nan")


def generalized_diversity(C) -> float:
    """Partridge & Krzanowski's generalized diversity 1 - p(2)/p(1) on all rows of ``C``.

    p_j = fraction of items on which exactly j of the M members fail, j = 0..M;
    p(1) = sum_j (j/M) p_j, p(2) = sum_j j(j-1)/(M(M-1)) p_j; 1.0 when p(1) = 0.
    """
    C = _bin(C)
    n, m = C.shape
    if m < 2:
        raise ValueError("generalized diversity needs at least 2 members")
    if n == 0:
        return 1.0
    f = (~C).sum(axis=1).astype(float)
    p1 = (f / m).mean()
    p2 = (f * (f - 1) / (m * (m - 1))).mean()
    return 1.0 if p1 == 0 else float(1.0 - p2 / p1)


def focal_lambdas(C, members: Sequence[int] | None = None) -> np.ndarray:
    """Per-focal-member generalized diversity lambda_i on the focal member's failures.

    For focal i: Neg_i = items where member i fails; p_j = fraction of Neg_i where exactly j
    members of the set fail (j >= 1); lambda_i = 1 - p(2)/p(1), or 1 when Neg_i is empty.
    """
    C = _bin(C)
    if members is not None:
        C = C[:, list(members)]
    n, m = C.shape
    if m < 2:
        raise ValueError("focal diversity needs at least 2 members")
    fail = ~C
    f = fail.sum(axis=1).astype(float)  # members failing on each item
    s1 = (fail * f[:, None]).sum(axis=0)             # sum over Neg_i of f
    s2 = (fail * (f * (f - 1))[:, None]).sum(axis=0)  # sum over Neg_i of f(f-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        lam = np.where(s1 > 0, 1.0 - s2 / ((m - 1) * s1), 1.0)
    return lam


def focal_diversity(C, members: Sequence[int] | None = None) -> float:
    """Focal diversity d(S) = mean over members i of lambda_i (see ``focal_lambdas``)."""
    return float(focal_lambdas(C, members).mean())


def diversity_summary(C, members: Sequence[int] | None = None, answers=None) -> dict[str, float]:
    """All metrics for one set: pairwise ones averaged over pairs, plus the set-level ones.

    Fleiss' kappa is over ``answers`` when given (RL-Focal's choice), else over correctness.
    """
    C = np.asarray(C)
    members = list(range(C.shape[1])) if members is None else list(members)
    sub = C[:, members]
    out = {name: mean_pairwise(sub, name) for name in PAIRWISE}
    out["fleiss_kappa"] = fleiss_kappa(np.asarray(answers)[:, members] if answers is not None else sub)
    out["binary_entropy"] = binary_entropy(sub)
    out["kuncheva_entropy"] = kuncheva_entropy(sub)
    out["generalized_diversity"] = generalized_diversity(sub)
    out["focal_diversity"] = focal_diversity(sub)
    return out
