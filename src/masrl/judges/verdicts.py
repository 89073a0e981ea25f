"""Reading a judge's verdict from its reply: a score on a stated scale, yes/no, or an A/B preference.

Each parser returns a value in [0, 1] or ``None`` when the reply has no usable verdict (no number, a
number outside the scale, neither yes nor no, neither A nor B): the answer then scores 0 with reason
``judge_unparsed``, counted in ``judge/unparsed``.
"""
from __future__ import annotations

import re

_NUMBER = r"[-+]?\d+(?:\.\d+)?"
_SCORE_LABEL = re.compile(rf"(?i)\b(?:score|rating)\s*[:=]?\s*({_NUMBER})")
_FIRST_NUMBER = re.compile(_NUMBER)
_YES_NO = re.compile(r"(?i)\b(yes|no)\b")
_BRACKETED = re.compile(r"(?i)\[\[\s*(A|B|tie)\s*\]\]")
_BARE_CHOICE = re.compile(r"\b(A|B)\b|(?i:\btie\b)")


def parse_score(text: str, lo: float, hi: float) -> float | None:
    """``Score: N`` (or ``Rating: N``), else the first number in ``text``; mapped from [lo, hi] to [0, 1].
    A number outside [lo, hi] is no verdict."""
    found = _SCORE_LABEL.search(text) or _FIRST_NUMBER.search(text)
    if found is None:
        return None
    value = float(found.group(1) if found.re is _SCORE_LABEL else found.group(0))
    if not lo <= value <= hi:
        return None
    return (value - lo) / (hi - lo)


def parse_yes_no(text: str) -> float | None:
    """1.0 for the first standalone ``yes``, 0.0 for ``no`` (any case), else None."""
    found = _YES_NO.search(text)
    if found is None:
        return None
    return 1.0 if found.group(1).lower() == "yes" else 0.0


def parse_choice(text: str) -> str | None:
    """``"A"``, ``"B"`` or ``"tie"``: a bracketed ``[[A]]`` first, else the first capital A/B standing alone
    (or ``tie``)."""
    found = _BRACKETED.search(text)
    if found is not None:
        choice = found.group(1)
        return "tie" if choice.lower() == "tie" else choice.upper()
    found = _BARE_CHOICE.search(text)
    if found is None:
        return None
    return found.group(1) or "tie"


def pairwise_preference(first: str | None, second: str | None) -> float | None:
    """The answer's preference in [0, 1] from two judgements: ``first`` with the answer as A (reference B),
    ``second`` with the orders swapped; averaged so that a judge that always picks one position scores 0.5.
    None when either reply has no choice."""
    wins = {"A": 1.0, "B": 0.0, "tie": 0.5}
    if first is None or second is None:
        return None
    return (wins[first] + (1.0 - wins[second])) / 2.0
