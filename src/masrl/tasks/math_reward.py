r"""Math answer scoring: last ``\boxed{}`` of the response vs the gold answer, via math-verify.

``math_score(task, answer_text)`` never raises. Order of checks:

1. If the text contains ``</think>``, only the part after the last ``</think>`` is used.
2. The content of the last ``\boxed{...}`` (balanced braces) is the prediction; none -> incorrect.
3. Fast path: when prediction and gold both normalise to plain numbers (``1,000`` -> ``1000``,
   ``27.0`` -> ``27``, ``\$18`` -> ``18``), they are compared exactly without math-verify.
   Equal -> correct; two different integers -> incorrect. Other cases go to math-verify.
   A gold that is a plain number wants a computed answer: a prediction that still holds an operation
   (``3+0``, ``24 + 11``, ``2^{3}``, ``6\times 7``, ``\frac{24+11}{1}``) is incorrect
   (``reason="unevaluated"``) — math-verify would evaluate it, and a policy learns to copy the question
   into the box (seen with SmolLM2 on arithmetic). A plain fraction of two integers (``3/4``) stays an answer.
4. Safety screen: predictions that could make sympy run for minutes (power towers, factorials
   of huge numbers, exponents with 7+ digits, very long text) are marked incorrect
   (``reason="unsafe"``) without parsing. The same screen applies in every thread, so a
   response gets the same reward wherever it is scored.
5. math-verify ``parse`` (gold wrapped as ``\boxed{gold}``, falling back to ``$gold$``) and
   ``verify(gold, pred)``. math-verify's own signal-based timeouts are disabled
   (``parsing_timeout=None``, ``timeout_seconds=None``) because they raise outside the main
   thread. In the main thread we arm our own ``ITIMER_REAL`` alarm (``masrl.usercode.alarm``; ``TIMEOUT_S`` seconds
   for parse + verify, restoring any timer that was already set, e.g. pytest-timeout's); in other
   threads only the safety screen protects against pathological inputs.

Results of (gold, prediction) pairs are memoised (LRU), since a group of samples often
repeats answers.
"""
from __future__ import annotations

import functools
import logging
import re
from decimal import Decimal, InvalidOperation
from typing import Any

from masrl.types import Task
from masrl.tasks.parsing import extract_boxed
from masrl.usercode.alarm import AlarmTimeout, call_with_alarm

__all__ = ["TIMEOUT_S", "MAX_PRED_CHARS", "math_score", "normalize_number", "is_equiv", "extract_prediction"]

log = logging.getLogger(__name__)

TIMEOUT_S = 5.0  # seconds for parse + verify of one (gold, prediction) pair, main thread only
MAX_PRED_CHARS = 400  # longer boxed contents are not parsed (no gold answer in the shipped data exceeds 300)

_THINK_END = "</think>"


# ---------------------------------------------------------------------------------------------
# normalisation and fast path

_THOUSANDS = re.compile(r"^[+-]?\d{1,3}(,\d{3})+(\.\d+)?$")
_NUMBER = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)$")
_TEXT_WRAP = re.compile(r"^\\(?:text|textbf|mathrm|mbox)\{(.*)\}$")


def normalize_number(s: Any) -> str | None:
    r"""Canonical string of a plain number (``"1,000"`` -> ``"1000"``, ``"27.0"`` -> ``"27"``,
    ``"\$18"`` -> ``"18"``, ``"025"`` -> ``"25"``, ``"-0.50"`` -> ``"-0.5"``), else None."""
    if isinstance(s, bool):
        return None
    if isinstance(s, (int, float)):
        s = repr(s)
    if not isinstance(s, str):
        return None
    t = s.strip()
    if len(t) > 64:
        return None
    t = t.strip("$ ").replace("\\$", "").replace("\\!", "").replace("\\,", "").replace("{,}", ",").replace(" ", "")
    m = _TEXT_WRAP.match(t)
    if m:
        t = m.group(1)
    if t.endswith("."):
        t = t[:-1]
    if _THOUSANDS.match(t):
        t = t.replace(",", "")
    if not _NUMBER.match(t):
        return None
    try:
        d = Decimal(t)
    except InvalidOperation:
        return None
    if d == d.to_integral_value():
        return str(int(d))
    out = format(d.normalize(), "f")
    return out


def _fast_compare(gold: str, pred: str) -> bool | None:
    """True/False when decidable without math-verify, else None."""
    g, p = normalize_number(gold), normalize_number(pred)
    if g is None or p is None:
        return None
    if g == p:
        return True
    if "." not in g and "." not in p:
        return False  # two different integers
    return None  # e.g. 3.14159 vs 3.1415926: let math-verify apply its rounding rules


# ---------------------------------------------------------------------------------------------
# safety screen

_BIG_DIGITS = re.compile(r"\d{7,}")
_POW_OPEN = re.compile(r"(\^|\*\*)\s*")


def _exponents(s: str) -> list[str]:
    """The exponent texts of every ``^``/``**`` (a braced group, or the next token)."""
    out = []
    for m in _POW_OPEN.finditer(s):
        i = m.end()
        if i < len(s) and s[i] == "{":
            depth, j = 0, i
            while j < len(s):
                if s[j] == "{":
                    depth += 1
                elif s[j] == "}":
                    depth -= 1
                    if depth == 0:
                        break
                j += 1
            out.append(s[i + 1:j])
        elif i < len(s) and s[i] == "(":
            depth, j = 0, i
            while j < len(s):
                if s[j] == "(":
                    depth += 1
                elif s[j] == ")":
                    depth -= 1
                    if depth == 0:
                        break
                j += 1
            out.append(s[i + 1:j])
        else:
            tok = re.match(r"[+-]?[\w.\\]+", s[i:])
            out.append(tok.group(0) if tok else "")
    return out


def _factorial_operand_unsafe(before: str) -> bool:
    """Whether the operand that ends ``before`` (the text left of a ``!``) could be huge."""
    if not before:
        return False
    if before[-1].isdigit():
        digits = re.search(r"\d+$", before).group(0).lstrip("0")
        return len(digits) >= 5
    if before[-1] in ")}]":
        close = before[-1]
        open_ = {")": "(", "}": "{", "]": "["}[close]
        depth = 0
        for j in range(len(before) - 1, -1, -1):
            if before[j] == close:
                depth += 1
            elif before[j] == open_:
                depth -= 1
                if depth == 0:
                    inner = before[j + 1:-1]
                    return bool("^" in inner or "**" in inner or "!" in inner or re.search(r"\d{5,}", inner))
        return True  # unbalanced
    return False


def _unsafe_reason(pred: str) -> str | None:
    if len(pred) > MAX_PRED_CHARS:
        return f"prediction longer than {MAX_PRED_CHARS} characters"
    exps = _exponents(pred)
    for e in exps:
        if "^" in e or "**" in e:
            return "nested exponent"
        if _BIG_DIGITS.search(e):
            return "exponent with 7+ digits"
    bang = pred.replace("\\!", "").replace("!=", "")
    for m in re.finditer("!", bang):
        if _factorial_operand_unsafe(bang[:m.start()].rstrip()):
            return "factorial of a large or composite number"
    return None


# ---------------------------------------------------------------------------------------------
# math-verify with our own timeout

_MV: Any = None


def _math_verify():
    global _MV
    if _MV is None:
        import math_verify
        import math_verify.grader
        import math_verify.parser

        # we disable math-verify's signal timeouts on purpose and provide our own: silence its
        # one-time "Timeout is disabled" warnings
        for mod in (math_verify.parser, math_verify.grader):
            if hasattr(mod, "TIMEOUT_WARNING_SHOWN"):
                mod.TIMEOUT_WARNING_SHOWN = True
        _MV = math_verify
    return _MV


@functools.lru_cache(maxsize=8192)
def _parse_gold(gold: str):
    mv = _math_verify()
    if "\\boxed" in gold:
        candidates = [gold]
    else:
        candidates = [f"\\boxed{{{gold}}}", f"${gold}$"]
    parsed: list = []
    for c in candidates:
        parsed = mv.parse(c, parsing_timeout=None)
        if any(not isinstance(x, str) for x in parsed):
            return parsed
    return parsed


def _verify(gold: str, pred: str) -> tuple[bool, str]:
    mv = _math_verify()
    gold_parsed = _parse_gold(gold)
    if not gold_parsed:
        return False, "gold_unparsable"
    pred_parsed = mv.parse(f"\\boxed{{{pred}}}", parsing_timeout=None)
    if not pred_parsed:
        return False, "pred_unparsable"
    ok = mv.verify(gold_parsed, pred_parsed, timeout_seconds=None)
    return bool(ok), ("verified" if ok else "mismatch")


_OPERATION = re.compile(r"[\d)}.]\s*(?:[-+*/×÷^]|\\times|\\div|\\cdot|\\pm)\s*[\d({\\.]")
_INT_FRACTION = re.compile(r"^[+-]?\d+/\d+$")


def unevaluated(pred: str) -> bool:
    """The prediction still holds an arithmetic operation between operands (``3+0``, ``2^{3}``,
    ``6\\times 7``); a leading sign and a plain fraction of two integers (``-3/4``) do not count."""
    t = pred.replace(" ", "").strip("$")
    return not _INT_FRACTION.match(t) and _OPERATION.search(t) is not None


@functools.lru_cache(maxsize=65536)
def is_equiv(gold: str, pred: str) -> tuple[bool, str]:
    """``(correct, reason)`` for a gold answer and an extracted prediction. Never raises."""
    try:
        fast = _fast_compare(gold, pred)
        if fast is not None:
            return fast, ("fast_match" if fast else "fast_mismatch")
        unsafe = _unsafe_reason(pred)
        if unsafe:
            return False, f"unsafe: {unsafe}"
        if normalize_number(gold) is not None and unevaluated(pred):
            return False, "unevaluated"
        _math_verify()  # the first call imports math-verify and sympy (seconds): not on the timeout's clock
        return call_with_alarm(lambda: _verify(gold, pred), TIMEOUT_S)
    except AlarmTimeout:
        return False, "timeout"
    except RecursionError:
        return False, "error: RecursionError"
    except Exception as e:  # noqa: BLE001 - scoring must never raise
        return False, f"error: {type(e).__name__}"


_LAST_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def extract_prediction(text: Any, fallback: str = "none") -> str | None:
    r"""Last ``\boxed{}`` content of ``text`` (after the last ``</think>`` when present).

    ``fallback="last_number"``: with no box, the last number of the text (the lenient
    extraction GSM8K harnesses use for small models that do not box); ``"none"`` (default):
    no box, no prediction.
    """
    if not isinstance(text, str):
        return None
    idx = text.rfind(_THINK_END)
    if idx != -1:
        text = text[idx + len(_THINK_END):]
    boxed = extract_boxed(text)
    if boxed is None and fallback == "last_number":
        numbers = _LAST_NUMBER.findall(text[-2000:])
        return numbers[-1].rstrip(".,").replace(",", "") if numbers else None
    return boxed


def _gold_text(answer: Any) -> str | None:
    if answer is None or isinstance(answer, bool):
        return None
    if isinstance(answer, (list, tuple)):
        answer = answer[0] if answer else None
        if answer is None:
            return None
    if isinstance(answer, float) and answer.is_integer():
        answer = int(answer)
    s = str(answer).strip()
    if len(s) >= 2 and s.startswith("$") and s.endswith("$"):
        s = s.strip("$").strip()
    return s or None


def math_score(task: Task, answer_text: str | None, fallback: str = "none") -> dict:
    r"""Score a response: ``{"reward": 1.0|0.0, "correct": bool, "pred": str|None, "reason": str}``.

    ``answer_text`` is the full model response; the answer is the last ``\boxed{}`` (or, with
    ``fallback="last_number"``, the last number when nothing is boxed).
    Never raises: any failure gives ``correct=False`` with the cause in ``reason``.
    """
    try:
        pred = extract_prediction(answer_text, fallback)
        if pred is None:
            reason = "no_answer" if not isinstance(answer_text, str) or not answer_text.strip() else "no_boxed"
            return {"reward": 0.0, "correct": False, "pred": None, "reason": reason}
        if not pred.strip():
            return {"reward": 0.0, "correct": False, "pred": pred, "reason": "empty_boxed"}
        gold = _gold_text(getattr(task, "answer", None))
        if gold is None:
            return {"reward": 0.0, "correct": False, "pred": pred, "reason": "no_gold"}
        correct, reason = is_equiv(gold, pred)
        return {"reward": 1.0 if correct else 0.0, "correct": bool(correct), "pred": pred, "reason": reason}
    except Exception as e:  # noqa: BLE001
        return {"reward": 0.0, "correct": False, "pred": None, "reason": f"error: {type(e).__name__}"}
