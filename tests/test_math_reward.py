"""math_score: boxed extraction, fast path, math-verify equivalence, never raising, threads."""
from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from masrl.tasks import math_reward
from masrl.tasks.math_reward import extract_prediction, math_score, normalize_number
from masrl.types import Task


def score(gold, text):
    return math_score(Task(id="t/0", question="q", answer=gold), text)


@pytest.mark.parametrize("gold,text", [
    ("12", "so the answer is \\boxed{12}"),
    ("12", "\\boxed{12.0}"),
    ("1000", "\\boxed{1,000}"),
    ("1,000", "\\boxed{1000}"),
    ("18", "\\boxed{\\$18}"),
    ("25", "\\boxed{025}"),
    ("0.5", "\\boxed{\\frac{1}{2}}"),
    ("\\frac{1}{2}", "\\boxed{0.5}"),
    ("\\frac{1}{2}", "\\boxed{\\dfrac{1}{2}}"),
    ("1+x", "\\boxed{x+1}"),
    ("\\frac{14}{3}", "\\boxed{14/3}"),
    ("3\\sqrt{13}", "\\boxed{\\sqrt{117}}"),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "\\boxed{(3, \\frac{\\pi}{2})}"),
    ("\\{1,2\\}", "\\boxed{\\{2, 1\\}}"),
    ("\\text{Evelyn}", "\\boxed{\\text{Evelyn}}"),
    ("90^\\circ", "\\boxed{90}"),
    ("2^{1009}", "\\boxed{2^{1009}}"),
    ("\\frac{100!}{2^{50}}", "\\boxed{\\frac{100!}{2^{50}}}"),
    (27.0, "\\boxed{27}"),  # a non-string gold
    ("$2n$", "\\boxed{2n}"),
    ("0.75", "\\boxed{3/4}"),  # a plain fraction of two integers is an answer, not an operation
    ("-0.75", "\\boxed{-3/4}"),
    ("-5", "\\boxed{-5}"),
])
def test_correct_cases(gold, text):
    r = score(gold, text)
    assert r["correct"] is True and r["reward"] == 1.0, r


@pytest.mark.parametrize("gold,text,reason", [
    ("12", "\\boxed{13}", "fast_mismatch"),
    ("12", "the answer is 12", "no_boxed"),
    ("12", "", "no_answer"),
    ("12", None, "no_answer"),
    ("12", 12, "no_answer"),
    ("12", "\\boxed{}", "empty_boxed"),
    ("12", "\\boxed{12", "no_boxed"),
    ("\\frac{1}{2}", "\\boxed{\\frac{1}{3}}", "mismatch"),
    ("x+1", "\\boxed{x-1}", "mismatch"),
    ("12", "\\boxed{9^{9^{9^{9}}}}", None),
    ("12", "\\boxed{(10^{7})!}", None),
    ("12", "\\boxed{2^{12345678}}", None),
    (None, "\\boxed{12}", "no_gold"),
    # a numeric gold wants the computed number, not the question copied into the box (a SmolLM2 reward hack)
    ("3", "\\boxed{3+0}", "unevaluated"),
    ("35", "\\boxed{24 + 11}", "unevaluated"),
    ("1", "\\boxed{20-19}", "unevaluated"),
    ("8", "\\boxed{2^{3}}", "unevaluated"),
    ("42", "\\boxed{6\\times 7}", "unevaluated"),
    ("35", "\\boxed{\\frac{24+11}{1}}", "unevaluated"),
    ("3", "\\boxed{(1+2)}", "unevaluated"),
])
def test_incorrect_cases(gold, text, reason):
    r = score(gold, text)
    assert r["correct"] is False and r["reward"] == 0.0, r
    if reason is not None:
        assert r["reason"] == reason
    else:
        assert r["reason"].startswith("unsafe")


def test_garbage_never_raises():
    for text in ["\\boxed{\\frac{", "\\boxed{}}}}{{{", "\\boxed{\\\\\\}", "\\boxed{@#$%^&*}", "\\boxed{" + "(" * 500 + "}",
                 "\\boxed{\\begin{pmatrix} 1 \\\\ 2", "\x00\\boxed{\x00}", "\\boxed{" + "x" * 5000 + "}",
                 "\\boxed{\\sqrt[}{]}", "\\boxed{1/0}", "\\boxed{\\infty - \\infty}"]:
        r = score("\\frac{1}{2}", text)
        assert set(r) >= {"reward", "correct", "pred", "reason"}
        assert r["correct"] is False


def test_nested_braces_and_last_box():
    text = "first \\boxed{1} then \\boxed{\\frac{\\sqrt{4}}{\\{2\\}}} and finally \\boxed{\\frac{1}{\\sqrt{4}}}"
    assert extract_prediction(text) == "\\frac{1}{\\sqrt{4}}"
    assert score("\\frac{1}{2}", text)["correct"] is True


def test_think_block_is_ignored():
    assert score("9", "<think>maybe \\boxed{7}</think> so \\boxed{9}")["correct"] is True
    assert score("7", "<think>maybe \\boxed{7}</think> so \\boxed{9}")["correct"] is False
    # a box only inside the thinking does not count
    r = score("7", "<think>\\boxed{7}</think> I am not sure")
    assert r["correct"] is False and r["reason"] == "no_boxed"


def test_fast_path_does_not_call_math_verify(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("math-verify called")

    monkeypatch.setattr(math_reward, "_verify", boom)
    math_reward.is_equiv.cache_clear()
    assert score("1,234", "\\boxed{1234}")["reason"] == "fast_match"
    assert score("27.0", "\\boxed{27}")["reason"] == "fast_match"
    assert score("5", "\\boxed{6}")["reason"] == "fast_mismatch"


def test_internal_error_is_caught(monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("sympy exploded")

    monkeypatch.setattr(math_reward, "_verify", boom)
    math_reward.is_equiv.cache_clear()
    r = score("x+1", "\\boxed{x+2}")
    assert r["correct"] is False and r["reason"].startswith("error")
    math_reward.is_equiv.cache_clear()


def test_timeout_in_main_thread_restores_previous_timer(monkeypatch):
    def slow(gold, pred):
        time.sleep(3)
        return True, "verified"

    monkeypatch.setattr(math_reward, "_verify", slow)
    monkeypatch.setattr(math_reward, "TIMEOUT_S", 0.2)
    math_reward.is_equiv.cache_clear()
    fired = []
    old = signal.signal(signal.SIGALRM, lambda *a: fired.append(1))
    signal.setitimer(signal.ITIMER_REAL, 30.0)
    try:
        t0 = time.monotonic()
        r = score("x", "\\boxed{y+1}")
        assert time.monotonic() - t0 < 2.0
        assert r["correct"] is False and r["reason"] == "timeout"
        remaining, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 25.0 < remaining <= 30.0  # the outer timer is still armed
        assert signal.getsignal(signal.SIGALRM) is not None and not fired
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        math_reward.is_equiv.cache_clear()


def test_works_in_worker_threads():
    cases = [("0.5", "\\boxed{\\frac{1}{2}}", True), ("x+1", "\\boxed{1+x}", True),
             ("3", "\\boxed{4}", False), ("\\sqrt{2}", "\\boxed{\\sqrt{3}}", False)] * 5
    math_reward.is_equiv.cache_clear()
    with ThreadPoolExecutor(4) as pool:
        out = list(pool.map(lambda c: score(c[0], c[1]), cases))
    assert [r["correct"] for r in out] == [c[2] for c in cases]
    assert all(not r["reason"].startswith("error") for r in out)
    assert threading.current_thread() is threading.main_thread()


@settings(max_examples=200, deadline=None)
@given(st.integers(-10**9, 10**9), st.integers(-10**9, 10**9))
def test_integer_fast_path_property(a, b):
    r = score(str(a), f"\\boxed{{{b}}}")
    assert r["correct"] == (a == b)


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=60))
def test_arbitrary_text_never_raises(text):
    r = score("\\frac{1}{2}", "\\boxed{" + text + "}")
    assert isinstance(r["correct"], bool) and r["reward"] in (0.0, 1.0)


def test_normalize_number():
    assert normalize_number("1,000") == "1000"
    assert normalize_number("27.0") == "27"
    assert normalize_number("-0.50") == "-0.5"
    assert normalize_number("\\$18") == "18"
    assert normalize_number("025") == "25"
    assert normalize_number("1,2") is None
    assert normalize_number("x") is None
    assert normalize_number(3.0) == "3"


def test_last_number_fallback_only_when_asked():
    from masrl.tasks.math_reward import math_score
    from masrl.types import Task

    task = Task("t", "q", "1200")
    text = "Step 1: 1,000 + 200 = 1,200.\nThe final answer is 1,200."
    assert math_score(task, text)["pred"] is None  # strict by default: no box, no answer
    scored = math_score(task, text, fallback="last_number")
    assert scored["correct"] and scored["pred"] == "1200"
    assert math_score(task, "\\boxed{7} and later 1200", fallback="last_number")["pred"] == "7"  # a box wins
    assert math_score(task, "no digits here", fallback="last_number")["pred"] is None
