"""Numbers from user code and remote models made safe: finite or an error naming them, and transforms that
cannot overflow (a logprob of 1000, a logit of -1000)."""
from __future__ import annotations

import math
import numbers
from typing import Any

MAX_EXP_ARG = 709.0  # math.exp overflows a float a little above 709.78
LOGPROB_SLACK = 1e-4  # a log-probability a little above 0 is rounding (taken as 0); more is not a logprob


def finite(value: Any, what: str) -> float:
    """``value`` as a finite float; a non-number, a bool or NaN/inf is a ``ValueError`` naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{what} must be a number, got {type(value).__name__} {str(value)[:80]!r}")
    try:
        number = float(value)
    except (OverflowError, ValueError) as e:  # an int past float's range
        raise ValueError(f"{what} is not a float-sized number ({type(e).__name__})") from None
    if not math.isfinite(number):
        raise ValueError(f"{what} is {number}, not a finite number")
    return number


def safe_exp(x: float) -> float:
    """``exp(x)`` that never overflows (inf only for +inf; capped at ``exp(709)``)."""
    return math.exp(min(x, MAX_EXP_ARG))


def sigmoid(x: float) -> float:
    """``1 / (1 + exp(-x))`` for any finite ``x`` without overflow: ~0 for -1000, ~1 for 1000."""
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)  # underflows to 0.0, never overflows
    return e / (1.0 + e)


def probability_of_logprob(value: Any, what: str) -> float:
    """The probability of a log-probability from a model's reply: ``exp(logprob)`` in [0, 1]; a value that is not
    a finite number at most 0 (beyond rounding) is a ``ValueError`` naming ``what`` (a logprob of 1000 is a broken
    reply, not a probability of e^1000)."""
    logprob = finite(value, what)
    if logprob > LOGPROB_SLACK:
        raise ValueError(f"{what} is {logprob:g}; a log-probability is at most 0")
    return safe_exp(min(logprob, 0.0))
