"""Reading a judge's verdict from its reply: a score on a stated scale, yes/no, the probability of yes, or an
A/B preference.

Each parser returns a value in [0, 1] or ``None`` when the reply has no usable verdict (no number, a
number outside the scale, neither yes nor no, neither A nor B): the answer then scores 0 with reason
``judge_unparsed``, counted in ``judge/unparsed``.
"""
from __future__ import annotations

import re
from typing import Iterable

from masrl.tasks.parsing import parse_yes_no  # noqa: F401  (a judge verdict; the fact-check task reads it too)
from masrl.usercode.numbers import probability_of_logprob

YES_WORDS = ("yes", "Yes", "YES")
NO_WORDS = ("no", "No", "NO")

_NUMBER = r"[-+]?\d+(?:\.\d+)?"
_SCORE_LABEL = re.compile(rf"(?i)\b(?:score|rating)\s*[:=]?\s*({_NUMBER})")
_FIRST_NUMBER = re.compile(_NUMBER)
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


def verdict_token_ids(tokenizer) -> tuple[list[int], list[int]]:
    """The token ids a ``yes_prob`` judge reads at its first reply position: ``(yes ids, no ids)``.

    The words yes/Yes/YES and no/No/NO, with and without a leading space, each tokenised alone: the ones that
    are one token, when both words have such variants (a word-piece tokenizer); else the first token of every
    variant (a character-level tokenizer: y/Y against n/N). A token on both sides (a leading space) is dropped.
    Raises ValueError when either side is left empty."""
    def firsts(words: Iterable[str], single: bool) -> set[int]:
        out = set()
        for word in words:
            for variant in (word, " " + word):
                ids = tokenizer.encode(variant, add_special_tokens=False)
                if ids and (len(ids) == 1 or not single):
                    out.add(int(ids[0]))
        return out

    yes, no = firsts(YES_WORDS, True), firsts(NO_WORDS, True)
    if not yes or not no:
        yes, no = firsts(YES_WORDS, False), firsts(NO_WORDS, False)
    both = yes & no
    yes, no = sorted(yes - both), sorted(no - both)
    if not yes or not no:
        raise ValueError("the judge's tokenizer has no token that starts yes but not no (or the reverse); "
                         "use verdict: yes_no")
    return yes, no


def yes_share(p_yes: float, p_no: float, min_mass: float) -> float | None:
    """P(yes) / (P(yes) + P(no)), or None when the two hold less than ``min_mass`` of the probability (the judge
    is not answering yes or no)."""
    mass = p_yes + p_no
    if mass <= 0 or mass < min_mass:
        return None
    return p_yes / mass


def top_logprob_masses(top: list[dict]) -> tuple[float, float]:
    """``(P(yes), P(no))`` from an OpenAI ``top_logprobs`` list (``[{"token": ..., "logprob": ...}, ...]``): the
    probabilities of the tokens that are yes/Yes/YES or no/No/NO once stripped of spaces, summed. A ``logprob``
    that is not a finite number at most 0 (a logprob of 1000) is a ``ValueError`` naming the token, never an
    overflow."""
    p_yes = p_no = 0.0
    for entry in top:
        token = str(entry.get("token", "")).strip()
        p = probability_of_logprob(entry["logprob"], f"the logprob of token {token[:20]!r}")
        if token in YES_WORDS:
            p_yes += p
        elif token in NO_WORDS:
            p_no += p
    return p_yes, p_no
