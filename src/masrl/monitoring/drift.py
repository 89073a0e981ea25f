"""Per-role drift metrics: pure functions on token ids, logprobs and texts (no model code).

The study of policy sharing (arXiv 2605.24202) shows that aggregate accuracy hides role drift:
one role's emitted distribution moves (χ² and perplexity climb) while the others stay put. These
functions measure that per role; ``RoleDriftTracker`` keeps each role's step-0 reference
distribution and returns ``agent/<role>/<metric>`` numbers for one training step.

Inputs may be python lists, numpy arrays or torch tensors; token sequences may be flat (one
response) or nested (several responses, pooled at token level). Empty input gives ``nan``.
Formulas and their meaning: docs/monitoring.md.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

__all__ = [
    "HEDGING_PHRASES", "DriftRecord", "RoleDriftTracker", "chi2_drift", "hedge_count", "hedging_rate",
    "js_divergence", "length_stats", "perplexity", "token_concentration", "unigram_counts",
    "unigram_distribution", "unigram_entropy", "verdict_accuracy",
]

NAN = float("nan")

#: Fixed hedging lexicon (matched case-insensitively, on word boundaries, any whitespace between words).
#: Chosen to avoid math vocabulary: no "likely" ("equally likely"), no "could be" (case analysis).
HEDGING_PHRASES: tuple[str, ...] = (
    "i think", "i believe", "i guess", "i suppose", "maybe", "perhaps", "possibly", "probably",
    "not sure", "not certain", "unsure", "it seems", "seems like", "it appears", "might be",
    "if i recall",
)

APPROVE_WORDS = frozenset({"approve", "approved", "accept", "accepted", "correct", "yes", "pass", "true"})
REJECT_WORDS = frozenset({"reject", "rejected", "incorrect", "wrong", "no", "fail", "false"})


# --------------------------------------------------------------------------- input coercion


def _to_python(x: Any) -> Any:
    """torch tensors / numpy arrays -> (nested) python lists; anything else unchanged."""
    if hasattr(x, "detach"):  # torch.Tensor
        x = x.detach().cpu()
    if hasattr(x, "tolist") and not isinstance(x, (list, tuple)):
        return x.tolist()
    return x


def _flatten(x: Any) -> list:
    """One level or several levels of sequences -> one flat list of scalars."""
    x = _to_python(x)
    if not isinstance(x, (list, tuple)):
        return [x]
    out: list = []
    for item in x:
        item = _to_python(item)
        if isinstance(item, (list, tuple)):
            out.extend(_flatten(item))
        else:
            out.append(item)
    return out


def unigram_counts(tokens: Any) -> dict[int, int]:
    """Token id -> count over ``tokens`` (one sequence, several sequences, or already a count mapping)."""
    if isinstance(tokens, Mapping):
        return {int(k): int(v) for k, v in tokens.items() if v > 0}
    flat = _flatten(tokens)
    if not flat:
        return {}
    ids, counts = np.unique(np.asarray(flat, dtype=np.int64), return_counts=True)
    return dict(zip(ids.tolist(), counts.tolist()))


def unigram_distribution(tokens: Any) -> dict[int, float]:
    """Token id -> relative frequency (sums to 1); ``{}`` for no tokens."""
    counts = unigram_counts(tokens)
    total = sum(counts.values())
    return {k: v / total for k, v in counts.items()} if total else {}


def _aligned(current: Any, reference: Any) -> tuple[np.ndarray, np.ndarray]:
    """Relative frequencies of both inputs over their union vocabulary (same order)."""
    cur, ref = unigram_counts(current), unigram_counts(reference)
    vocab = sorted(set(cur) | set(ref))
    p = np.array([cur.get(v, 0) for v in vocab], dtype=np.float64)
    q = np.array([ref.get(v, 0) for v in vocab], dtype=np.float64)
    if p.sum() > 0:
        p /= p.sum()
    if q.sum() > 0:
        q /= q.sum()
    return p, q


# --------------------------------------------------------------------------- metrics


def perplexity(logprobs: Any) -> float:
    """exp(mean NLL) of emitted tokens: ``exp(-mean_t log p(y_t))``, pooled over all tokens.

    ``logprobs`` is one sequence or several (token-level pooling: long responses weigh more).
    NaN entries are ignored; a ``-inf`` log-probability gives ``inf``. No tokens -> nan.
    """
    values = np.asarray(_flatten(logprobs), dtype=np.float64)
    values = values[~np.isnan(values)]
    if values.size == 0:
        return NAN
    with np.errstate(over="ignore"):
        return float(np.exp(-values.mean()))


def token_concentration(tokens: Any, k: int = 10) -> float:
    """Share of emitted tokens that are one of the ``k`` most frequent token ids: sum top-k counts / N.

    1.0 = the role emits at most k distinct tokens; k/V for a uniform distribution over V types.
    """
    if k < 1:
        raise ValueError(f"token_concentration: k must be >= 1, got {k}")
    counts = sorted(unigram_counts(tokens).values(), reverse=True)
    total = sum(counts)
    return sum(counts[:k]) / total if total else NAN


def unigram_entropy(tokens: Any) -> float:
    """Shannon entropy (bits) of the unigram distribution of emitted tokens."""
    p = np.array(list(unigram_distribution(tokens).values()), dtype=np.float64)
    if p.size == 0:
        return NAN
    return float(-(p * np.log2(p)).sum())


def chi2_drift(current: Any, reference: Any, alpha: float = 1e-5) -> float:
    """Pearson χ² drift of the current unigram distribution from a reference, per token.

    Over the union vocabulary V (ids seen in either input), with relative frequencies p (current)
    and q (reference) and add-α smoothing in probability space applied to both,
    ``p̃_v = (p_v + α) / (1 + α|V|)`` and ``q̃_v = (q_v + α) / (1 + α|V|)``::

        chi2_drift = Σ_v (p̃_v − q̃_v)² / q̃_v

    This is the Pearson statistic Σ (O_v − E_v)² / E_v of the current N tokens against the counts
    expected under the reference (E_v = N q̃_v), divided by N, so it does not grow with the number
    of tokens logged at a step. Identical distributions give 0 (also with different counts);
    tokens absent from the reference dominate (their term is ≈ p_v² / α). ``alpha = 0`` gives the
    unsmoothed value (``inf`` when the current step emits a token the reference never did).
    Sampling noise alone gives about (|V| − 1) / N, so compare steps with similar token counts.
    """
    if alpha < 0:
        raise ValueError(f"chi2_drift: alpha must be >= 0, got {alpha}")
    p, q = _aligned(current, reference)
    if p.sum() == 0 or q.sum() == 0:
        return NAN
    norm = 1.0 + alpha * p.size
    p_s, q_s = (p + alpha) / norm, (q + alpha) / norm
    diff2 = (p_s - q_s) ** 2
    if np.any((q_s == 0) & (diff2 > 0)):
        return math.inf
    mask = q_s > 0
    return float((diff2[mask] / q_s[mask]).sum())


def js_divergence(current: Any, reference: Any) -> float:
    """Jensen–Shannon divergence (base 2, in [0, 1]) between two unigram distributions.

    JS = ½ KL(p ‖ m) + ½ KL(q ‖ m), m = (p + q) / 2. Symmetric, bounded, needs no smoothing:
    0 for identical distributions, 1 for disjoint supports.
    """
    p, q = _aligned(current, reference)
    if p.sum() == 0 or q.sum() == 0:
        return NAN
    m = (p + q) / 2

    def kl(a: np.ndarray) -> float:
        nz = a > 0
        return float((a[nz] * np.log2(a[nz] / m[nz])).sum())

    return min(max(0.5 * kl(p) + 0.5 * kl(q), 0.0), 1.0)


def length_stats(lengths: Any, truncated: Any = None) -> dict[str, float]:
    """``length_mean``, ``length_p95`` (linear-interpolated 95th percentile) and ``truncation_rate``.

    ``lengths`` are emitted tokens per response; ``truncated`` flags responses cut at the length
    limit (``truncation_rate`` is nan when not given).
    """
    values = np.asarray(_flatten(lengths), dtype=np.float64)
    out = {"length_mean": NAN, "length_p95": NAN, "truncation_rate": NAN}
    if values.size:
        out["length_mean"] = float(values.mean())
        out["length_p95"] = float(np.percentile(values, 95))
    if truncated is not None:
        flags = _flatten(truncated)
        if flags:
            out["truncation_rate"] = float(np.mean([bool(f) for f in flags]))
    return out


def _phrase_pattern(phrases: Sequence[str]) -> re.Pattern:
    alternatives = sorted((r"\s+".join(re.escape(w) for w in p.split()) for p in phrases if p.strip()),
                          key=len, reverse=True)
    return re.compile(r"(?<!\w)(?:" + "|".join(alternatives) + r")(?!\w)", re.IGNORECASE)


_DEFAULT_HEDGE_RE = _phrase_pattern(HEDGING_PHRASES)


def _hedge_re(phrases: Sequence[str] | None) -> re.Pattern:
    return _DEFAULT_HEDGE_RE if phrases is None or tuple(phrases) == HEDGING_PHRASES else _phrase_pattern(phrases)


def hedge_count(text: str, phrases: Sequence[str] | None = None) -> int:
    """Number of hedging-phrase occurrences in ``text`` (case-insensitive, word-boundary aware)."""
    if not isinstance(text, str) or not text:
        return 0
    return len(_hedge_re(phrases).findall(text))


def hedging_rate(texts: Iterable[str], phrases: Sequence[str] | None = None) -> float:
    """Fraction of responses containing at least one hedging phrase; nan for no responses."""
    texts = list(texts)
    if not texts:
        return NAN
    pattern = _hedge_re(phrases)
    return sum(bool(isinstance(t, str) and pattern.search(t)) for t in texts) / len(texts)


def _verdict_bool(v: Any) -> bool | None:
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    if isinstance(v, str):
        word = v.strip().lower()
        if word in APPROVE_WORDS:
            return True
        if word in REJECT_WORDS:
            return False
    return None


def verdict_accuracy(verdicts: Sequence[Any], correct: Sequence[Any]) -> dict[str, float]:
    """How well approve/reject verdicts match the ground-truth correctness of the judged answers.

    ``verdicts``: True/"approve"/"correct"/"yes"/... (approve) or False/"reject"/"incorrect"/"no"/...
    (reject); anything else (None, garbage) counts in ``invalid_rate`` and is left out of the rest.
    ``correct``: whether each judged answer was right (None = unknown, left out). "Positive" = approve:
    ``precision`` = right answers among approvals, ``recall`` = approvals among right answers,
    ``specificity`` = rejections among wrong answers (low = rubber stamp), ``accuracy``, ``approve_rate``.
    """
    if len(verdicts) != len(correct):
        raise ValueError(f"verdict_accuracy: {len(verdicts)} verdicts but {len(correct)} correctness labels")
    pairs = [(_verdict_bool(v), c) for v, c in zip(verdicts, correct) if c is not None]
    n_invalid = sum(v is None for v, _ in pairs)
    valid = [(v, bool(c)) for v, c in pairs if v is not None]
    tp = sum(v and c for v, c in valid)
    fp = sum(v and not c for v, c in valid)
    tn = sum(not v and not c for v, c in valid)
    fn = sum(not v and c for v, c in valid)

    def ratio(a: int, b: int) -> float:
        return a / b if b else NAN

    return {"accuracy": ratio(tp + tn, len(valid)), "precision": ratio(tp, tp + fp),
            "recall": ratio(tp, tp + fn), "specificity": ratio(tn, tn + fp),
            "approve_rate": ratio(tp + fp, len(valid)), "invalid_rate": ratio(n_invalid, len(pairs)),
            "n": float(len(valid))}


# --------------------------------------------------------------------------- tracker


@dataclass
class DriftRecord:
    """One emitted response of one role (a ``Turn`` carries the same fields)."""

    role: str
    response_ids: Any
    logprobs: Any
    truncated: bool = False
    text: str = ""


def _record(r: Any) -> DriftRecord:
    if isinstance(r, DriftRecord):
        return r
    if isinstance(r, Mapping):
        role = r.get("role", r.get("agent"))
        return DriftRecord(str(role), r.get("response_ids", []), r.get("logprobs", []),
                           bool(r.get("truncated", False)), r.get("text", "") or "")
    if isinstance(r, (tuple, list)):
        if len(r) != 5:
            raise ValueError(f"drift record must be (role, response_ids, logprobs, truncated, text), got {len(r)} fields")
        return DriftRecord(str(r[0]), r[1], r[2], bool(r[3]), r[4] or "")
    role = getattr(r, "role", None) or getattr(r, "agent", None)
    if role is None:
        raise TypeError(f"drift record of type {type(r).__name__} has no role/agent")
    return DriftRecord(str(role), r.response_ids, r.logprobs, bool(getattr(r, "truncated", False)),
                       getattr(r, "text", "") or "")


class RoleDriftTracker:
    """Per-role drift metrics for one step at a time, against each role's first-step distribution.

    ``update(records)`` takes (role, response_ids, logprobs, truncated, text) records — tuples,
    dicts, ``DriftRecord`` or ``Turn`` objects (role = ``turn.agent``) — and
    returns ``{"agent/<role>/<metric>": float}``. The first step in which a role appears becomes its
    reference (drift 0 there); keep the tracker's ``state_dict`` in checkpoints so that a
    resumed run keeps measuring against step 0.

    Metrics per role: perplexity, token_concentration (top ``top_k``), unigram_entropy,
    chi2_drift (smoothing ``alpha``), js_drift, length_mean, length_p95, truncation_rate,
    hedge_rate, hedges_per_1k_tokens, num_responses, num_tokens.
    """

    def __init__(self, top_k: int = 10, alpha: float = 1e-5, hedging_phrases: Sequence[str] | None = None,
                 prefix: str = "agent"):
        self.top_k = top_k
        self.alpha = alpha
        self.hedging_phrases = tuple(hedging_phrases) if hedging_phrases is not None else HEDGING_PHRASES
        self.prefix = prefix
        self.reference: dict[str, dict[int, int]] = {}
        self.reference_step: dict[str, int | None] = {}

    def set_reference(self, role: str, tokens: Any, step: int | None = None) -> None:
        """Use ``tokens`` (sequences or a count mapping) as ``role``'s reference distribution."""
        self.reference[role] = unigram_counts(tokens)
        self.reference_step[role] = step

    def role_metrics(self, records: Sequence[DriftRecord]) -> dict[str, float]:
        """The metric dict (unprefixed) of one role's records; sets no reference."""
        ids = [_flatten(r.response_ids) for r in records]
        counts = unigram_counts(ids)
        role = records[0].role if records else ""
        n_tokens = sum(len(x) for x in ids)
        ref = self.reference.get(role)
        texts = [r.text for r in records]
        pattern = _hedge_re(self.hedging_phrases)
        hedges = sum(len(pattern.findall(t)) for t in texts if isinstance(t, str))
        out = {
            "perplexity": perplexity([r.logprobs for r in records]),
            "token_concentration": token_concentration(counts, self.top_k) if counts else NAN,
            "unigram_entropy": unigram_entropy(counts),
            "chi2_drift": chi2_drift(counts, ref, self.alpha) if ref else NAN,
            "js_drift": js_divergence(counts, ref) if ref else NAN,
            **length_stats([len(x) for x in ids], [r.truncated for r in records]),
            "hedge_rate": hedging_rate(texts, self.hedging_phrases),
            "hedges_per_1k_tokens": 1000.0 * hedges / n_tokens if n_tokens else NAN,
            "num_responses": float(len(records)),
            "num_tokens": float(n_tokens),
        }
        return out

    def update(self, records: Iterable[Any], step: int | None = None) -> dict[str, float]:
        """Metrics of one step, ``{f"{prefix}/{role}/{metric}": value}``, for every role in ``records``."""
        by_role: dict[str, list[DriftRecord]] = {}
        for r in records:
            rec = _record(r)
            by_role.setdefault(rec.role, []).append(rec)
        out: dict[str, float] = {}
        for role, recs in by_role.items():
            if role not in self.reference:
                tokens = [_flatten(r.response_ids) for r in recs]
                if any(tokens):
                    self.set_reference(role, tokens, step)
            for name, value in self.role_metrics(recs).items():
                out[f"{self.prefix}/{role}/{name}"] = value
        return out

    def verdict_metrics(self, role: str, verdicts: Sequence[Any], correct: Sequence[Any]) -> dict[str, float]:
        """``verdict_accuracy`` under ``agent/<role>/verdict_<name>``."""
        return {f"{self.prefix}/{role}/verdict_{k}": v for k, v in verdict_accuracy(verdicts, correct).items()}

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state (the reference counts); restore with ``load_state_dict``."""
        return {"reference": {role: {str(k): v for k, v in c.items()} for role, c in self.reference.items()},
                "reference_step": dict(self.reference_step)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.reference = {role: {int(k): int(v) for k, v in c.items()} for role, c in state["reference"].items()}
        self.reference_step = dict(state.get("reference_step", {}))
