"""Proposer-subset selectors (Work A's family) with cost accounting in combiner calls.

A selector picks ``k`` of the ``N`` pool members using a labeled *selection set* (the
training split). ``U(S)`` = accuracy of the combiner on the selection set with members ``S``;
each uncached evaluation of ``U`` costs ``n`` combiner (summarizer) calls, ``n`` = selection-set
size. Results are cached by ``frozenset(S)``.

=================  ==========================================  ===============================
method             rule                                        summarizer calls
=================  ==========================================  ===============================
topk               k most accurate members                     0
diversity          greedy max-min pairwise disagreement        0
proxy-coverage     forward greedy on oracle coverage           0
proxy-plurality    forward greedy on plurality accuracy        0
proxy-majority     forward greedy on binary-majority accuracy  0
proxy-focal        forward greedy on focal diversity           0
proxy-fitness      forward greedy on RL-Focal's fitness mix    0
forward            forward greedy on U                         n (kN - k(k-1)/2)
backward           backward elimination on U                   n ((N(N+1) - k(k+1)) / 2)
loo                top-k of U(P) - U(P \\ {i})                  n (N + 1)
hybrid             coverage shortlist of M, then forward       n (kM - k(k-1)/2)
exhaustive         best of all C(N, k) subsets                 n C(N, k)
=================  ==========================================  ===============================
"""
from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from masrl.ensemble.combiners import Combiner, Majority, Oracle, Plurality, get_combiner, plurality_correct
from masrl.ensemble.data import EnsembleData, InputError, Split
from masrl.ensemble.metrics import fleiss_kappa, focal_diversity, pairwise_matrix

__all__ = ["SubsetEvaluator", "SelectionProblem", "SelectionResult", "SelectionSummary", "SELECTORS",
           "PROXIES", "select", "run_selector", "expected_cost", "fitness", "DEFAULT_FITNESS_WEIGHTS",
           "baselines", "per_task_accuracy", "USES_COMBINER"]

DEFAULT_FITNESS_WEIGHTS = (0.5, 0.5, 0.0)  # (focal, vote accuracy, Fleiss' kappa): RL-Focal's BBH setting


class SubsetEvaluator:
    """``U(S)`` on fixed rows, cached by ``frozenset(S)``; counts uncached combiner calls."""

    def __init__(self, data: EnsembleData, combiner: Combiner, rows: np.ndarray):
        self.data, self.combiner, self.rows = data, combiner, np.asarray(rows)
        self.cache: dict[frozenset, float] = {}
        self.evaluations = 0

    @property
    def calls(self) -> int:
        return self.evaluations * len(self.rows)

    def __call__(self, members) -> float:
        key = frozenset(int(i) for i in members)
        if key not in self.cache:
            self.evaluations += 1
            self.cache[key] = self.combiner.accuracy(self.data, self.rows, sorted(key)) if key else 0.0
        return self.cache[key]


def fitness(C: np.ndarray, answers: np.ndarray | None, labels: np.ndarray | None, members: Sequence[int],
            weights: Sequence[float] = DEFAULT_FITNESS_WEIGHTS) -> float:
    """RL-Focal's ensemble fitness: w_f d_focal + w_v vote-accuracy + w_k Fleiss-kappa; -99 if |S| < 2.

    Vote accuracy is plurality (expected) when answers are known, else binary majority of
    correctness; Fleiss' kappa is over answers when known, else over correctness.
    """
    members = list(members)
    if len(members) < 2:
        return -99.0
    wf, wv, wk = weights
    sub = C[:, members]
    val = wf * focal_diversity(sub) if wf else 0.0
    has_ans = answers is not None and (answers >= 0).any()
    if wv:
        if has_ans:
            val += wv * float(plurality_correct(answers[:, members], labels).mean())
        else:
            k, m = sub.sum(1), len(members)
            val += wv * float(np.where(2 * k > m, 1.0, np.where(2 * k == m, 0.5, 0.0)).mean())
    if wk:
        val += wk * fleiss_kappa(answers[:, members] if has_ans else sub.astype(int))
    return float(val)


@dataclass
class SelectionProblem:
    """One selection instance: data, selection rows, test rows, combiner (in the loop and for scoring)."""

    data: EnsembleData
    sel_rows: np.ndarray
    test_rows: np.ndarray
    combiner: Combiner
    fitness_weights: tuple = DEFAULT_FITNESS_WEIGHTS

    def __post_init__(self):
        self.sel_rows = np.asarray(self.sel_rows)
        self.test_rows = np.asarray(self.test_rows)
        if len(self.sel_rows) == 0:
            raise ValueError("empty selection set")
        self.C = self.data.correct[self.sel_rows]
        self.acc = self.C.mean(0)
        self.N = self.data.n_models

    def order_key(self, i: int):
        """Tie-break: higher selection accuracy first, then lower index."""
        return (-self.acc[i], i)

    def proxy(self, name: str) -> Callable[[Sequence[int]], float]:
        d, rows = self.data, self.sel_rows
        if name == "coverage":
            return lambda S: float(self.C[:, list(S)].any(1).mean()) if S else 0.0
        if name == "plurality":
            Plurality().check(d)
            A, y = d.answers[rows], d.labels[rows]
            return lambda S: float(plurality_correct(A[:, list(S)], y).mean()) if S else 0.0
        if name == "majority":
            return lambda S: Majority().accuracy(d, rows, list(S)) if S else 0.0
        if name == "focal":
            return lambda S: focal_diversity(self.C, list(S)) if len(S) >= 2 else -99.0
        if name == "fitness":
            A = d.answers[rows] if d.has_answers else None
            y = d.labels[rows]
            return lambda S: fitness(self.C, A, y, list(S), self.fitness_weights)
        raise ValueError(f"unknown proxy {name!r}; use one of {PROXIES}")


PROXIES = ("coverage", "plurality", "majority", "focal", "fitness")


def _argbest(problem: SelectionProblem, cands: Sequence[int], score: Callable[[int], float],
             order: Callable | None = None) -> tuple[int, float]:
    """Candidate with the highest score; ties go to the first in ``order`` (default: most accurate)."""
    best, best_v = None, -math.inf
    for i in sorted(cands, key=order or problem.order_key):
        v = score(i)
        if v > best_v + 1e-12:
            best, best_v = i, v
    return best, best_v


def _greedy_forward(problem: SelectionProblem, cands: Sequence[int], k: int, F: Callable, start: Sequence[int] = (),
                    min_gain: float | None = None) -> tuple[list[int], list[dict]]:
    S = list(start)
    trace = []
    cur = F(S) if S else None
    while len(S) < k:
        rest = [i for i in cands if i not in S]
        if not rest:
            break
        i, v = _argbest(problem, rest, lambda j: F(S + [j]))
        if min_gain is not None and cur is not None and v - cur < min_gain:
            break
        S.append(i)
        trace.append({"add": int(i), "value": v})
        cur = v
    return S, trace


# ------------------------------------------------------------------------------ selectors
def sel_topk(p: SelectionProblem, k: int, **_) -> tuple[list[int], dict]:
    return sorted(range(p.N), key=p.order_key)[:k], {}


def sel_diversity(p: SelectionProblem, k: int, start: str = "pair", **_) -> tuple[list[int], dict]:
    """Greedy max-min over disagreement; ``start='pair'`` (most disagreeing pair) or ``'best'``."""
    D = pairwise_matrix(p.C, "disagreement")
    if k == 1 or start == "best":
        S = [sorted(range(p.N), key=p.order_key)[0]]
    else:
        pairs = sorted(itertools.combinations(range(p.N), 2),
                       key=lambda ij: (-D[ij], -(p.acc[ij[0]] + p.acc[ij[1]]), ij))
        S = list(pairs[0])
    while len(S) < k:
        rest = [i for i in range(p.N) if i not in S]
        i, _ = _argbest(p, rest, lambda j: float(min(D[j, s] for s in S)))
        S.append(i)
    return S[:k], {"start": start}


def _sel_proxy(name: str):
    def fn(p: SelectionProblem, k: int, **_) -> tuple[list[int], dict]:
        F = p.proxy(name)
        # set functions undefined on singletons start from the most accurate member
        start = [sorted(range(p.N), key=p.order_key)[0]] if name in ("focal", "fitness") else []
        S, trace = _greedy_forward(p, range(p.N), k, F, start)
        return S, {"proxy": name, "trace": trace, "proxy_value": F(S)}
    fn.__name__ = f"sel_proxy_{name}"
    return fn


def sel_forward(p: SelectionProblem, k: int, ev: SubsetEvaluator = None, start: str = "empty",
                min_gain: float | None = None, cands: Sequence[int] | None = None, **_) -> tuple[list[int], dict]:
    """Add argmax_i U(S + i) until |S| = k (or the best gain < ``min_gain``)."""
    cands = list(range(p.N)) if cands is None else list(cands)
    S0 = [sorted(cands, key=p.order_key)[0]] if start == "best" else []
    S, trace = _greedy_forward(p, cands, k, ev, S0, min_gain)
    return S, {"trace": trace}


def sel_backward(p: SelectionProblem, k: int, ev: SubsetEvaluator = None, min_gain: float | None = None,
                 **_) -> tuple[list[int], dict]:
    """From the full pool, remove argmax_i U(S - i) until |S| = k (or every removal loses > ``min_gain``)."""
    S = list(range(p.N))
    trace = []
    cur = ev(S) if min_gain is not None else None
    while len(S) > k:
        # ties: remove the least accurate member
        i, v = _argbest(p, S, lambda j: ev([s for s in S if s != j]), order=lambda j: (p.acc[j], -j))
        if min_gain is not None and cur - v > min_gain:
            break
        S.remove(i)
        trace.append({"remove": int(i), "value": v})
        cur = v
    return S, {"trace": trace}


def sel_loo(p: SelectionProblem, k: int, ev: SubsetEvaluator = None, **_) -> tuple[list[int], dict]:
    """Leave-one-out marginal contribution m_i = U(P) - U(P - i); keep the top k."""
    full = list(range(p.N))
    u_all = ev(full)
    m = {i: u_all - ev([j for j in full if j != i]) for i in full}
    S = sorted(full, key=lambda i: (-m[i], -p.acc[i], i))[:k]
    return S, {"marginal": {int(i): float(v) for i, v in m.items()}}


def sel_hybrid(p: SelectionProblem, k: int, ev: SubsetEvaluator = None, shortlist: int | None = None,
               prefilter: str = "coverage", **_) -> tuple[list[int], dict]:
    """Shortlist M = ``shortlist`` (default k + 1) members with a free proxy, then forward greedy on U."""
    M = min(p.N, k + 1 if shortlist is None else max(k, shortlist))
    if prefilter == "topk":
        short = sorted(range(p.N), key=p.order_key)[:M]
    else:
        short, _ = _sel_proxy(prefilter)(p, M)
    S, info = sel_forward(p, k, ev=ev, cands=short)
    return S, {"shortlist": [int(i) for i in short], "prefilter": prefilter, **info}


def sel_exhaustive(p: SelectionProblem, k: int, ev: SubsetEvaluator = None, max_subsets: int = 20000,
                   **_) -> tuple[list[int], dict]:
    n_sub = math.comb(p.N, k)
    if n_sub > max_subsets:
        raise InputError(f"exhaustive search over C({p.N},{k}) = {n_sub} subsets exceeds max_subsets={max_subsets}")
    best, best_v = None, -math.inf
    for S in itertools.combinations(range(p.N), k):
        v = ev(S)
        if v > best_v + 1e-12:
            best, best_v = list(S), v
    return best, {}


SELECTORS: dict[str, Callable] = {
    "topk": sel_topk,
    "diversity": sel_diversity,
    **{f"proxy-{name}": _sel_proxy(name) for name in PROXIES},
    "forward": sel_forward,
    "backward": sel_backward,
    "loo": sel_loo,
    "hybrid": sel_hybrid,
    "exhaustive": sel_exhaustive,
}
USES_COMBINER = {"forward", "backward", "loo", "hybrid", "exhaustive"}


def expected_cost(method: str, N: int, k: int, n: int, shortlist: int | None = None) -> int:
    """Summarizer calls of a selector without early stopping (formula; the run counts actual calls)."""
    if method not in SELECTORS:
        raise ValueError(f"unknown selector {method!r}")
    if method == "forward":
        ev = k * N - k * (k - 1) // 2
    elif method == "backward":
        ev = (N * (N + 1) - k * (k + 1)) // 2
    elif method == "loo":
        ev = N + 1
    elif method == "hybrid":
        M = min(N, k + 1 if shortlist is None else max(k, shortlist))
        ev = k * M - k * (k - 1) // 2
    elif method == "exhaustive":
        ev = math.comb(N, k)
    else:
        ev = 0
    return n * ev


@dataclass
class SelectionResult:
    """One selector run on one selection problem."""

    method: str
    k: int
    members: tuple[str, ...]
    member_idx: tuple[int, ...]
    selection_accuracy: float
    test_accuracy: float
    cost_calls: int
    evaluations: int
    n_selection: int
    n_test: int
    combiner: str
    info: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def select(problem: SelectionProblem, method: str, k: int, **opts) -> SelectionResult:
    """Run one selector; selection/test accuracies are scored with the problem's combiner (uncounted)."""
    if method not in SELECTORS:
        raise InputError(f"unknown selector {method!r}; use one of {', '.join(SELECTORS)}")
    if not 1 <= k <= problem.N:
        raise InputError(f"k must be in 1..{problem.N}, got {k}")
    ev = SubsetEvaluator(problem.data, problem.combiner, problem.sel_rows)
    members, info = SELECTORS[method](problem, k, ev=ev, **opts)
    members = [int(i) for i in members]
    comb, d = problem.combiner, problem.data
    test_acc = comb.accuracy(d, problem.test_rows, members) if len(problem.test_rows) else float("nan")
    return SelectionResult(
        method=method, k=k, members=tuple(d.models[i] for i in members), member_idx=tuple(members),
        selection_accuracy=comb.accuracy(d, problem.sel_rows, members), test_accuracy=test_acc,
        cost_calls=ev.calls, evaluations=ev.evaluations, n_selection=len(problem.sel_rows),
        n_test=len(problem.test_rows), combiner=comb.name, info=info)


@dataclass
class SelectionSummary:
    """A selector over all tasks: per-task results plus macro (mean over tasks) and pooled accuracies.

    ``scope='per-task'`` selects a subset for each task on its own training rows;
    ``scope='global'`` selects one subset on all training rows and scores it on every task.
    """

    method: str
    k: int
    combiner: str
    scope: str
    selection_pooled: float
    selection_macro: float
    test_pooled: float
    test_macro: float
    cost_calls: int
    evaluations: int
    mean_size: float
    subsets: dict[str, tuple[str, ...]]
    per_task: dict[str, dict]

    def to_dict(self, compact: bool = False) -> dict:
        """All fields; ``compact`` (for reports) replaces per-task records by
        ``[sel_acc, test_acc, member indices]`` and drops ``subsets`` and the selectors' traces."""
        if not compact:
            return asdict(self)
        d = {k: v for k, v in asdict(self).items() if k not in ("subsets", "per_task")}
        d["per_task"] = {t: [r["selection_accuracy"], r["test_accuracy"],
                             [int(i) for i in r.get("member_idx", ())] or list(r.get("members", ()))]
                         for t, r in self.per_task.items()}
        return d

    def most_common_subset(self) -> tuple[tuple[str, ...], int]:
        counts: dict[tuple, int] = {}
        for s in self.subsets.values():
            key = tuple(sorted(s))
            counts[key] = counts.get(key, 0) + 1
        best = max(counts.items(), key=lambda kv: kv[1])
        return best


def _agg(vals: dict[str, float], ns: dict[str, int]) -> tuple[float, float]:
    tasks = [t for t in vals if ns[t] > 0]
    if not tasks:
        return float("nan"), float("nan")
    pooled = sum(vals[t] * ns[t] for t in tasks) / sum(ns[t] for t in tasks)
    macro = float(np.mean([vals[t] for t in tasks]))
    return float(pooled), macro


def run_selector(data: EnsembleData, split: Split, method: str, k: int, combiner: str | Combiner = "auto",
                 scope: str = "per-task", fitness_weights: Sequence[float] = DEFAULT_FITNESS_WEIGHTS,
                 **opts) -> SelectionSummary:
    """Run ``method`` at size ``k`` per task (or globally) and aggregate over tasks."""
    comb = get_combiner(combiner, data)
    tasks = data.task_names()
    tr_by = {t: data.task_rows(t, split.train) for t in tasks}
    te_by = {t: data.task_rows(t, split.test) for t in tasks}
    per_task: dict[str, dict] = {}
    subsets: dict[str, tuple[str, ...]] = {}
    cost = evals = 0
    if scope == "per-task":
        for t in tasks:
            if len(tr_by[t]) == 0:
                continue
            res = select(SelectionProblem(data, tr_by[t], te_by[t], comb, tuple(fitness_weights)), method, k, **opts)
            per_task[t] = res.to_dict()
            subsets[t] = res.members
            cost += res.cost_calls
            evals += res.evaluations
    elif scope == "global":
        res = select(SelectionProblem(data, split.train, split.test, comb, tuple(fitness_weights)), method, k, **opts)
        cost, evals = res.cost_calls, res.evaluations
        for t in tasks:
            per_task[t] = {"members": res.members, "member_idx": res.member_idx,
                           "selection_accuracy": comb.accuracy(data, tr_by[t], res.member_idx) if len(tr_by[t]) else float("nan"),
                           "test_accuracy": comb.accuracy(data, te_by[t], res.member_idx) if len(te_by[t]) else float("nan"),
                           "n_selection": len(tr_by[t]), "n_test": len(te_by[t])}
            subsets[t] = res.members
    else:
        raise InputError(f"scope must be 'per-task' or 'global', got {scope!r}")
    if not per_task:
        raise InputError("no task has training rows to select on")
    sel_p, sel_m = _agg({t: r["selection_accuracy"] for t, r in per_task.items()},
                        {t: r["n_selection"] for t, r in per_task.items()})
    te_p, te_m = _agg({t: r["test_accuracy"] for t, r in per_task.items()},
                      {t: r["n_test"] for t, r in per_task.items()})
    return SelectionSummary(method=method, k=k, combiner=comb.name, scope=scope, selection_pooled=sel_p,
                            selection_macro=sel_m, test_pooled=te_p, test_macro=te_m, cost_calls=cost,
                            evaluations=evals, mean_size=float(np.mean([len(s) for s in subsets.values()])),
                            subsets=subsets, per_task=per_task)


def per_task_accuracy(data: EnsembleData, rows: np.ndarray, correct: np.ndarray) -> tuple[float, float]:
    """(pooled, macro) of per-item correctness ``correct`` aligned with ``rows``."""
    vals, ns = {}, {}
    for t in data.task_names():
        m = data.tasks[rows] == t
        if m.any():
            vals[t], ns[t] = float(correct[m].mean()), int(m.sum())
    return _agg(vals, ns)


def baselines(data: EnsembleData, split: Split, combiner: str | Combiner = "auto") -> dict[str, dict[str, Any]]:
    """Reference points on the test split: best single (chosen on train per task and globally; and in
    hindsight), pool oracle, the combiner over the whole pool, soft vote of all (if probs)."""
    comb = get_combiner(combiner, data)
    out: dict[str, dict[str, Any]] = {}
    te = split.test
    N = data.n_models
    acc_te = data.accuracy(te)
    best_h = int(np.argmax(acc_te))
    p, m = per_task_accuracy(data, te, data.correct[te, best_h].astype(float))
    out["best single (hindsight, on test)"] = {"pooled": p, "macro": m, "members": [data.models[best_h]]}
    g = int(np.argmax(data.accuracy(split.train)))
    p, m = per_task_accuracy(data, te, data.correct[te, g].astype(float))
    out["best single (chosen on train, global)"] = {"pooled": p, "macro": m, "members": [data.models[g]]}
    corr = np.zeros(len(te))
    picks = {}
    for t in data.task_names():
        tr_t = data.task_rows(t, split.train)
        if len(tr_t) == 0:
            continue
        b = int(np.argmax(data.accuracy(tr_t)))
        picks[t] = data.models[b]
        mask = data.tasks[te] == t
        corr[mask] = data.correct[te[mask], b]
    p, m = per_task_accuracy(data, te, corr)
    out["best single (chosen on train, per task)"] = {"pooled": p, "macro": m, "members": picks}
    p, m = per_task_accuracy(data, te, Oracle().correct(data, te, range(N)))
    out["oracle (all models)"] = {"pooled": p, "macro": m, "members": list(data.models)}
    p, m = per_task_accuracy(data, te, comb.correct(data, te, range(N)))
    out[f"{comb.name} (all models)"] = {"pooled": p, "macro": m, "members": list(data.models)}
    if data.has_probs and comb.name != "soft":
        p, m = per_task_accuracy(data, te, get_combiner("soft").correct(data, te, range(N)))
        out["soft (all models)"] = {"pooled": p, "macro": m, "members": list(data.models)}
    if data.has_answers and comb.name != "plurality":
        p, m = per_task_accuracy(data, te, get_combiner("plurality").correct(data, te, range(N)))
        out["plurality (all models)"] = {"pooled": p, "macro": m, "members": list(data.models)}
    return out
