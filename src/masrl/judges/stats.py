"""Per-step judge counters and the guards against judge hacking (length bias, a rule-based check).

``judge/calls``, ``judge/errors`` (calls that got no reply: timeouts, HTTP errors, an exhausted call
budget), ``judge/unparsed`` (replies with no verdict), ``perf/judge_seconds``; ``judge/length_corr``
(Pearson) and ``judge/length_spearman`` of judged reward vs answer length in characters over the step's
samples with a verdict; ``judge/score`` (the mean judged reward of those samples); ``judge/heldout_check``
(the rule-based check's accuracy on every answer of the step, those without a verdict included) and
``judge/heldout_agreement`` (how often the judge's correct flag, False without a verdict, equals the check's),
``judge/approve_rate`` (its share of correct flags) and ``judge/heldout_agreement_right`` / ``_wrong`` (its
approvals among the answers the check passes, its rejections among those it fails: a constant judge scores 1 on
one and 0 on the other);
``judge/heldout_auc`` (how well the judged reward ranks the answers the check passes above those it fails,
over the samples with a verdict: 1 perfect, 0.5 chance; a step where the check passes all or none has none).
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

from masrl.errors import UserInputError
from masrl.evaluation.metrics import auc, judge_agreement, ranks
from masrl.usercode.ledger import check_share, usercode_metrics


class JudgeWarning(UserWarning):
    """Every judged answer of a step had no verdict (reward 0 everywhere: check the template and verdict)."""


class JudgeFailedError(UserInputError):
    """Every judge call of a step failed: the run stops (one line naming the endpoint and the first error)."""


def pearson(xs: list[float], ys: list[float]) -> float | None:
    """The Pearson correlation, or None with fewer than 3 points or a constant series."""
    n = len(xs)
    if n < 3:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    sxx, syy = sum((x - mx) ** 2 for x in xs), sum((y - my) ** 2 for y in ys)
    if sxx <= 0 or syy <= 0:
        return None
    return sxy / math.sqrt(sxx * syy)


def spearman(xs: list[float], ys: list[float]) -> float | None:
    return pearson(ranks(xs), ranks(ys)) if len(xs) >= 3 else None


@dataclass
class JudgeStats:
    """What the judge did since the last ``pop`` (one training step)."""

    endpoint: str
    kind: str = "judge"  # the user-code kind its calls are counted as: judge | reward_model
    max_share: float = 1.0  # the options' max_error_share: failed calls of a step that stop the run
    calls: int = 0
    errors: int = 0
    timeouts: int = 0  # of the errors: calls that got no reply within their deadline
    unparsed: int = 0
    seconds: float = 0.0
    first_error: str | None = None
    first_unparsed: str | None = None
    rewards: list[float] = field(default_factory=list)
    lengths: list[float] = field(default_factory=list)
    checks: list[tuple[bool, bool]] = field(default_factory=list)  # (judge's correct, rule's correct)
    ranked: list[tuple[float, bool]] = field(default_factory=list)  # (judged reward, rule's correct)

    def no_verdict(self, reply: str) -> None:
        self.unparsed += 1
        self.first_unparsed = reply if self.first_unparsed is None else self.first_unparsed

    def error(self, message: str, timeout: bool = False) -> None:
        self.errors += 1
        self.timeouts += timeout
        self.first_error = self.first_error or message

    def sample(self, reward: float, answer: str | None, judged_correct: bool, check: bool | None) -> None:
        self.rewards.append(reward)
        self.lengths.append(float(len(answer or "")))
        if check is not None:
            self.checks.append((judged_correct, check))
            self.ranked.append((reward, check))

    def pop(self) -> dict[str, float]:
        """The step's metrics, then reset; ``JudgeFailedError`` when the step's failed calls reach ``max_share``."""
        failed = "every judge call of the step failed" if self.max_share >= 1.0 else \
            f"at least {self.max_share:g} of the judge calls of the step failed (max_error_share)"
        check_share(f"{failed}: the judge at {self.endpoint}", self.calls,
                    self.errors - self.timeouts, self.timeouts, self.first_error, self.max_share, "the step",
                    "check the endpoint (or the judge's model)", JudgeFailedError)
        if self.unparsed and not self.rewards:
            warnings.warn(f"{self.endpoint}: no judge reply of the step had a verdict ({self.unparsed} answers scored 0, "
                          f"reason judge_unparsed); first reply: {self.first_unparsed[:200]!r}; check the judge's "
                          "template, verdict and max_new_tokens", JudgeWarning, stacklevel=2)
        out = {"judge/calls": float(self.calls), "judge/errors": float(self.errors),
               "judge/unparsed": float(self.unparsed), "perf/judge_seconds": self.seconds,
               **usercode_metrics(self.kind, self.calls, self.errors - self.timeouts, self.timeouts)}
        if self.rewards:
            out["judge/score"] = sum(self.rewards) / len(self.rewards)
        for name, fn in (("judge/length_corr", pearson), ("judge/length_spearman", spearman)):
            value = fn(self.rewards, self.lengths)
            if value is not None:
                out[name] = value
        if self.checks:
            out["judge/heldout_check"] = sum(c for _, c in self.checks) / len(self.checks)
            agree = judge_agreement([j for j, _ in self.checks], [c for _, c in self.checks])
            out["judge/approve_rate"], out["judge/heldout_agreement"] = agree["approve_rate"], agree["agreement"]
            out.update({f"judge/heldout_{k}": v for k, v in agree.items() if k.startswith("agreement_")})
        value = auc([r for r, _ in self.ranked], [c for _, c in self.ranked])
        if value is not None:
            out["judge/heldout_auc"] = value
        self.__init__(self.endpoint, self.kind)
        return out


def rule_check(check, task, answer: str | None) -> bool | None:
    """The rule-based check's verdict on an answer (None without a check; an episode with no answer fails it)."""
    if check is None:
        return None
    return False if answer is None else bool(check(task, answer)["correct"])


def unjudged(stats: JudgeStats, check, task, answer: str | None, reason: str, **extra) -> dict:
    """Reward 0 for an answer with no verdict (``reason``: no_answer, judge_error, judge_unparsed); the
    rule-based check still counts it (the judge's correct flag is False), so ``judge/heldout_check`` and
    ``judge/heldout_agreement`` are over every answer of the step, as avg@n is."""
    out = {"reward": 0.0, "correct": False, "reason": reason, **extra}
    rule = rule_check(check, task, answer)
    if rule is not None:
        out["heldout_correct"] = rule
        stats.checks.append((False, rule))
    return out


def judged(stats: JudgeStats, check, task, answer: str, value: float, threshold: float) -> dict:
    """The result of a judged answer (``correct``: ``value >= threshold``), with the rule-based check's
    ``heldout_correct`` when the judge has one; recorded in ``stats``."""
    out = {"reward": value, "correct": value >= threshold}
    rule = rule_check(check, task, answer)
    if rule is not None:
        out["heldout_correct"] = rule
    stats.sample(value, answer, out["correct"], rule)
    return out
