"""Combiners: turn the selected members' outputs on an item into one answer.

Every combiner gives per-item correctness for a member set (``correct``) or for per-item
member masks (``correct_masked``, vectorised; used by RL-Focal), and answers (``predict``).
Accuracy of plurality voting is its *expected* value under uniform tie-breaking by default
(exact, noise-free); ``Plurality(tie_break="random", seed=...)`` samples ties with a seeded RNG.
"""
from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from masrl.ensemble.data import EnsembleData, InputError

__all__ = ["Combiner", "Plurality", "SoftVote", "Oracle", "Majority", "Summarizer", "get_combiner",
           "plurality_correct", "plurality_predict", "soft_vote_predict", "COMBINER_NAMES"]


# ------------------------------------------------------------------------ vectorised cores
def _mask2d(mask, shape) -> np.ndarray:
    n, m = shape
    if mask is None:
        return np.ones((n, m), dtype=bool)
    mask = np.asarray(mask, dtype=bool)
    return np.broadcast_to(mask, (n, m)) if mask.ndim == 1 else mask


def _vote_counts(answers: np.ndarray, mask: np.ndarray):
    valid = (answers >= 0) & mask
    eq = (answers[:, :, None] == answers[:, None, :]) & valid[:, :, None] & valid[:, None, :]
    cnt = eq.sum(-1)  # members agreeing with member j (incl. j); 0 for invalid j
    return valid, cnt


def plurality_correct(answers: np.ndarray, labels: np.ndarray, mask=None) -> np.ndarray:
    """Expected correctness of plurality voting per item (uniform tie-breaking, abstentions ignored).

    ``answers`` (n, M) codes with -1 = abstain; ``mask`` (M,) or (n, M) selects members. An item
    with no votes or no label scores 0; with t answers tied at the top it scores 1/t if the
    label is one of them.
    """
    mask = _mask2d(mask, answers.shape)
    valid, cnt = _vote_counts(answers, mask)
    top = cnt.max(-1)
    n_top_members = ((cnt == top[:, None]) & valid).sum(-1)
    n_tied = np.where(top > 0, n_top_members / np.maximum(top, 1), 1)
    label_cnt = ((answers == labels[:, None]) & valid).sum(-1)
    hit = (top > 0) & (labels >= 0) & (label_cnt == top)
    return hit / n_tied


def plurality_predict(answers: np.ndarray, mask=None, rng: np.random.Generator | None = None) -> np.ndarray:
    """Plurality answer per item, ties broken uniformly at random (``rng``), -1 when no votes."""
    rng = rng if rng is not None else np.random.default_rng(0)
    mask = _mask2d(mask, answers.shape)
    valid, cnt = _vote_counts(answers, mask)
    top = cnt.max(-1)
    cand = (cnt == top[:, None]) & valid
    # each tied answer has exactly `top` candidate members, so a uniform member is a uniform answer
    score = np.where(cand, rng.random(answers.shape), -1.0)
    pick = score.argmax(-1)
    out = answers[np.arange(len(answers)), pick]
    return np.where(top > 0, out, -1)


def soft_vote_predict(probs: np.ndarray, mask=None) -> np.ndarray:
    """argmax of the summed member probabilities (first index wins ties), -1 when no members."""
    n, m, _ = probs.shape
    mask = _mask2d(mask, (n, m))
    s = (probs * mask[:, :, None]).sum(1)
    return np.where(mask.any(1), s.argmax(-1), -1)


# ------------------------------------------------------------------------ combiner classes
class Combiner:
    """Base class. ``requires`` is one of ``answers``, ``probs``, ``correct``."""

    name = "combiner"
    requires = "correct"

    def check(self, data: EnsembleData) -> None:
        """Raise ``ValueError`` if this combiner cannot run on ``data``."""
        if self.requires == "answers" and not data.has_answers:
            raise InputError(f"combiner {self.name!r} needs answers, but {data.source or 'this data'} has "
                             "correctness only; use 'majority' or 'oracle'")
        if self.requires == "probs" and not data.has_probs:
            raise InputError(f"combiner {self.name!r} needs per-choice probs, which {data.source or 'this data'} "
                             "does not have")
        if self.requires in ("answers", "probs") and not data.has_labels:
            raise InputError(f"combiner {self.name!r} needs labels to score its answers")

    def correct_masked(self, data: EnsembleData, rows: np.ndarray, masks) -> np.ndarray:
        """Per-item correctness (in [0, 1]) for member masks ``(len(rows), N)`` or ``(N,)``."""
        raise NotImplementedError

    def correct(self, data: EnsembleData, rows: np.ndarray, members: Sequence[int]) -> np.ndarray:
        mask = np.zeros(data.n_models, dtype=bool)
        mask[list(members)] = True
        return self.correct_masked(data, np.asarray(rows), mask)

    def accuracy(self, data: EnsembleData, rows: np.ndarray, members: Sequence[int]) -> float:
        rows = np.asarray(rows)
        return float(self.correct(data, rows, members).mean()) if len(rows) else float("nan")

    def predict(self, data: EnsembleData, rows: np.ndarray, members: Sequence[int],
                rng: np.random.Generator | None = None) -> np.ndarray:
        """Answer codes per item (-1 = none)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Plurality(Combiner):
    """Most frequent answer among the members; abstentions ignored; ties uniform at random."""

    name = "plurality"
    requires = "answers"

    def __init__(self, tie_break: str = "expected", seed: int = 0):
        if tie_break not in ("expected", "random"):
            raise ValueError("tie_break must be 'expected' or 'random'")
        self.tie_break, self.seed = tie_break, seed

    def correct_masked(self, data, rows, masks):
        a, y = data.answers[rows], data.labels[rows]
        if self.tie_break == "expected":
            return plurality_correct(a, y, masks)
        pred = plurality_predict(a, masks, np.random.default_rng(self.seed))
        return ((pred == y) & (y >= 0)).astype(float)

    def predict(self, data, rows, members, rng=None):
        mask = np.zeros(data.n_models, dtype=bool)
        mask[list(members)] = True
        return plurality_predict(data.answers[rows], mask, rng if rng is not None else np.random.default_rng(self.seed))


class SoftVote(Combiner):
    """argmax of the mean of the members' per-choice probabilities."""

    name = "soft"
    requires = "probs"

    def correct_masked(self, data, rows, masks):
        pred = soft_vote_predict(data.probs[rows], masks)
        y = data.labels[rows]
        return ((pred == y) & (y >= 0)).astype(float)

    def predict(self, data, rows, members, rng=None):
        mask = np.zeros(data.n_models, dtype=bool)
        mask[list(members)] = True
        return soft_vote_predict(data.probs[rows], mask)


class Oracle(Combiner):
    """Upper bound: correct whenever any member is correct."""

    name = "oracle"
    requires = "correct"

    def correct_masked(self, data, rows, masks):
        c = data.correct[rows]
        return (c & _mask2d(masks, c.shape)).any(1).astype(float)

    def predict(self, data, rows, members, rng=None):
        c = data.correct[rows][:, list(members)].any(1)
        fallback = Plurality().predict(data, rows, members, rng) if data.has_answers else np.full(len(rows), -1)
        return np.where(c, data.labels[rows], fallback)


class Majority(Combiner):
    """Binary majority of correctness (Kuncheva's majority vote of oracle outputs).

    For correctness-only data, where answers are unknown: correct if more than half of the
    members are correct, 1/2 on an exact tie, else 0. Strict majority correct implies plurality
    correct, so this is a lower bound on plurality voting with ties counted half.
    """

    name = "majority"
    requires = "correct"

    def correct_masked(self, data, rows, masks):
        c = data.correct[rows]
        mask = _mask2d(masks, c.shape)
        k = (c & mask).sum(1)
        m = mask.sum(1)
        return np.where(m == 0, 0.0, np.where(2 * k > m, 1.0, np.where(2 * k == m, 0.5, 0.0)))

    def predict(self, data, rows, members, rng=None):
        raise ValueError("majority-of-correctness gives correctness, not answers")


class Summarizer(Combiner):
    """Any function of the selected proposers' answers — an LLM summarizer in practice.

    ``fn(item_id, proposals) -> answer`` where ``proposals`` maps model name to its raw answer
    (abstentions left out). The returned answer is compared with the raw label. One call per
    item per subset evaluation.
    """

    requires = "answers"

    def __init__(self, fn: Callable[[str, Mapping[str, Any]], Any], name: str = "summarizer"):
        if not callable(fn):
            raise TypeError("Summarizer needs a callable fn(item_id, proposals) -> answer")
        self.fn, self.name = fn, name
        self.calls = 0

    def correct_masked(self, data, rows, masks):
        rows = np.asarray(rows)
        mask = _mask2d(masks, (len(rows), data.n_models))
        out = np.zeros(len(rows))
        for i, r in enumerate(rows):
            proposals = {data.models[j]: data.decode(int(data.answers[r, j]))
                         for j in np.flatnonzero(mask[i]) if data.answers[r, j] >= 0}
            ans = self.fn(data.ids[r], proposals)
            self.calls += 1
            lab = data.decode(int(data.labels[r]))
            out[i] = float(lab is not None and ans is not None and ans == lab)
        return out

    def predict(self, data, rows, members, rng=None):
        raise NotImplementedError("Summarizer answers are raw values; call fn directly")

    def __repr__(self) -> str:
        return f"Summarizer({getattr(self.fn, '__name__', self.fn)!r})"


COMBINER_NAMES = ("auto", "plurality", "soft", "oracle", "majority")


def get_combiner(spec: str | Combiner, data: EnsembleData | None = None, *, seed: int = 0) -> Combiner:
    """Combiner from a name: ``plurality`` (alias ``vote``), ``soft`` (``soft_vote``), ``oracle``,
    ``majority``, ``auto`` (plurality if the data has answers, else majority), or
    ``package.module:function`` for a ``Summarizer`` callable ``fn(item_id, proposals)``.
    With ``data``, checks that the combiner can run on it.
    """
    if isinstance(spec, Combiner):
        comb = spec
    else:
        name = spec.strip().lower()
        if name == "auto":
            if data is None:
                raise ValueError("combiner 'auto' needs the data to decide")
            name = "plurality" if data.has_answers else "majority"
        if name in ("plurality", "vote", "plurality_vote"):
            comb = Plurality(seed=seed)
        elif name in ("soft", "soft_vote", "softvote"):
            comb = SoftVote()
        elif name == "oracle":
            comb = Oracle()
        elif name in ("majority", "majority_correct"):
            comb = Majority()
        elif ":" in spec:
            mod_name, _, attr = spec.partition(":")
            try:
                fn = getattr(importlib.import_module(mod_name), attr)
            except (ImportError, AttributeError) as e:
                raise InputError(f"cannot load summarizer {spec!r}: {e}") from None
            if inspect.isclass(fn):
                fn = fn()
            try:
                inspect.signature(fn).bind("item_id", [])
            except TypeError as e:  # not callable, or not fn(item_id, proposals)
                raise InputError(f"summarizer {spec!r} must be a function fn(item_id, proposals) -> answer "
                                 f"({e})") from None
            except ValueError:  # a builtin without a signature: let it run
                pass
            comb = Summarizer(fn, name=spec)
        else:
            raise InputError(f"unknown combiner {spec!r}; use one of {', '.join(COMBINER_NAMES)} "
                             "or package.module:function")
    if data is not None:
        comb.check(data)
    return comb
