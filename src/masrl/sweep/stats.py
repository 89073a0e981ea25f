"""Statistics over seeds: mean with a Student-t confidence interval, and paired differences between arms.

    mean ± t_{1-α/2, n-1} · s / √n,   s = sample standard deviation (n − 1)

n = 1 has no interval (``half_width`` None). Non-finite values (a metric a run did not produce) are left
out and ``n`` says how many values remain. The t quantile is computed here (regularized incomplete beta,
then bisection) so that masrl needs no SciPy.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Mapping, Sequence


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz; Numerical Recipes 6.4)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 1000):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The p-quantile of Student's t with ``df`` degrees of freedom (p in (0, 1))."""
    if not 0.0 < p < 1.0 or df <= 0:
        raise ValueError(f"t_quantile: need 0 < p < 1 and df > 0, got p={p}, df={df}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        lo, hi = hi, hi * 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


@dataclass(frozen=True)
class Summary:
    """Mean over seeds with its t-interval; ``half_width``/``low``/``high`` are None when n < 2."""

    n: int
    mean: float | None
    sd: float | None
    half_width: float | None
    low: float | None
    high: float | None

    def as_dict(self) -> dict:
        return asdict(self)


def finite(values: Sequence[float | None]) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(v)]


def mean_ci(values: Sequence[float | None], level: float = 0.95) -> Summary:
    xs = finite(values)
    n = len(xs)
    if n == 0:
        return Summary(0, None, None, None, None, None)
    mean = math.fsum(xs) / n
    if n == 1:
        return Summary(1, mean, None, None, None, None)
    sd = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / (n - 1))
    half = t_quantile(0.5 + level / 2.0, n - 1) * sd / math.sqrt(n)
    return Summary(n, mean, sd, half, mean - half, mean + half)


@dataclass(frozen=True)
class Paired:
    """arm − baseline on the seeds both have a finite value for; how many seeds each side is ahead."""

    seeds: list[int]
    diffs: list[float]
    summary: Summary
    arm_higher: int
    baseline_higher: int
    ties: int

    def as_dict(self) -> dict:
        return {"seeds": self.seeds, "diffs": self.diffs, "diff": self.summary.as_dict(),
                "arm_higher": self.arm_higher, "baseline_higher": self.baseline_higher, "ties": self.ties}


def paired(arm: Mapping[int, float | None], baseline: Mapping[int, float | None], level: float = 0.95) -> Paired:
    seeds = sorted(s for s in arm.keys() & baseline.keys() if finite([arm[s]]) and finite([baseline[s]]))
    diffs = [float(arm[s]) - float(baseline[s]) for s in seeds]
    return Paired(seeds, diffs, mean_ci(diffs, level), sum(d > 0 for d in diffs), sum(d < 0 for d in diffs),
                  sum(d == 0 for d in diffs))
