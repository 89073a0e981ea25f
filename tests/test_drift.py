"""Per-role drift metrics on known distributions."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from masrl.monitoring.drift import (
    DriftRecord,
    RoleDriftTracker,
    chi2_drift,
    hedge_count,
    hedging_rate,
    js_divergence,
    length_stats,
    perplexity,
    token_concentration,
    unigram_counts,
    unigram_distribution,
    unigram_entropy,
    verdict_accuracy,
)
from masrl.types import Turn

# ---------------------------------------------------------------- perplexity


def test_perplexity_of_known_logprobs():
    assert perplexity([math.log(0.5)] * 4) == pytest.approx(2.0)
    # token-level pooling over responses: mean NLL of {ln4, ln4, 0} = (2 ln 4) / 3
    assert perplexity([[-math.log(4), -math.log(4)], [0.0]]) == pytest.approx(4 ** (2 / 3))
    assert perplexity(torch.tensor([[-1.0, -1.0], [-1.0, -1.0]])) == pytest.approx(math.e)
    assert perplexity(np.array([0.0, 0.0])) == pytest.approx(1.0)
    assert math.isnan(perplexity([]))
    assert perplexity([-math.inf, -1.0]) == math.inf
    assert perplexity([float("nan"), math.log(0.25)]) == pytest.approx(4.0)


# ---------------------------------------------------------------- unigram / concentration


def test_unigram_counts_accepts_lists_arrays_tensors_and_counts():
    expected = {1: 2, 2: 1, 7: 1}
    assert unigram_counts([1, 2, 1, 7]) == expected
    assert unigram_counts([[1, 2], [1], [7]]) == expected
    assert unigram_counts(np.array([1, 2, 1, 7])) == expected
    assert unigram_counts([torch.tensor([1, 2]), torch.tensor([1, 7])]) == expected
    assert unigram_counts({1: 2, 2: 1, 7: 1, 9: 0}) == expected
    assert unigram_distribution([1, 1, 2, 2]) == {1: 0.5, 2: 0.5}
    assert unigram_counts([]) == {}


def test_token_concentration_uniform_vs_peaked():
    uniform = list(range(100)) * 5           # 100 types, equal counts
    peaked = [0] * 900 + list(range(1, 101))  # one type holds 90%
    assert token_concentration(uniform, k=10) == pytest.approx(0.10)
    assert token_concentration(peaked, k=10) == pytest.approx((900 + 9) / 1000)
    assert token_concentration(peaked, k=1) == pytest.approx(0.9)
    assert token_concentration([3, 3, 4], k=10) == 1.0
    assert math.isnan(token_concentration([]))
    with pytest.raises(ValueError):
        token_concentration([1], k=0)


def test_unigram_entropy():
    assert unigram_entropy(list(range(8))) == pytest.approx(3.0)
    assert unigram_entropy([5, 5, 5]) == pytest.approx(0.0)


# ---------------------------------------------------------------- chi2 / JS


def test_chi2_identical_distributions_is_zero():
    ids = [1, 2, 2, 3, 3, 3]
    assert chi2_drift(ids, ids) == 0.0
    assert chi2_drift(ids, ids * 7) == pytest.approx(0.0, abs=1e-15)  # same distribution, other size
    assert chi2_drift(ids, ids, alpha=0.0) == 0.0
    assert js_divergence(ids, ids * 3) == pytest.approx(0.0, abs=1e-12)


def test_chi2_hand_computed_unsmoothed():
    # p = (3/4, 1/4), q = (1/2, 1/2): (1/4)^2/(1/2) * 2 = 0.25
    assert chi2_drift({1: 3, 2: 1}, {1: 1, 2: 1}, alpha=0.0) == pytest.approx(0.25)
    # a token the reference never emitted: infinite without smoothing
    assert chi2_drift({1: 1, 3: 1}, {1: 1, 2: 1}, alpha=0.0) == math.inf


def test_chi2_hand_computed_smoothed():
    # V = {1, 2, 3}; p = (1/2, 0, 1/2), q = (1/2, 1/2, 0); alpha = 0.1, norm = 1.3
    # p~ = (.6, .1, .6)/1.3, q~ = (.6, .6, .1)/1.3
    # chi2 = [0 + (.5)^2/.6 + (.5)^2/.1] / 1.3 = (0.41666.. + 2.5) / 1.3
    expected = (0.25 / 0.6 + 0.25 / 0.1) / 1.3
    assert chi2_drift([1, 3], [1, 2], alpha=0.1) == pytest.approx(expected)


def test_chi2_grows_with_drift_and_js_bounds():
    ref = [0] * 50 + [1] * 50
    small = [0] * 55 + [1] * 45
    large = [0] * 90 + [1] * 10
    assert 0 < chi2_drift(small, ref) < chi2_drift(large, ref)
    assert js_divergence([1, 1], [2, 2]) == pytest.approx(1.0)
    # JS of (1/2,1/2) vs (1,0): 1/2 KL(p||m) + 1/2 KL(q||m), m = (3/4, 1/4)
    expected = 0.5 * (0.5 * math.log2(0.5 / 0.75) + 0.5 * math.log2(0.5 / 0.25)) + 0.5 * math.log2(1 / 0.75)
    assert js_divergence([0, 1], [0, 0]) == pytest.approx(expected)
    assert math.isnan(chi2_drift([], [1])) and math.isnan(js_divergence([1], []))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=1, max_size=40), st.lists(st.integers(0, 6), min_size=1, max_size=40))
def test_divergence_properties(a, b):
    chi = chi2_drift(a, b)
    js = js_divergence(a, b)
    assert chi >= 0 and 0.0 <= js <= 1.0
    assert js == pytest.approx(js_divergence(b, a), abs=1e-12)
    same = unigram_distribution(a) == pytest.approx(unigram_distribution(b)) and set(a) == set(b)
    if same:
        assert chi == pytest.approx(0.0, abs=1e-12)
    else:
        assert chi > 0 and js > 0


# ---------------------------------------------------------------- length / hedging / verdicts


def test_length_stats():
    out = length_stats(list(range(1, 101)), [False] * 90 + [True] * 10)
    assert out["length_mean"] == pytest.approx(50.5)
    assert out["length_p95"] == pytest.approx(95.05)  # linear interpolation
    assert out["truncation_rate"] == pytest.approx(0.1)
    assert math.isnan(length_stats([])["length_mean"])
    assert math.isnan(length_stats([3])["truncation_rate"])


@pytest.mark.parametrize("text,count", [
    ("I think the answer is 4.", 1),
    ("MAYBE it is 4; perhaps 5.", 2),
    ("I am not sure. It seems right, possibly.", 3),
    ("The value might  be\n4, I believe.", 2),  # any whitespace between the words
    ("Maybelline is a brand; perhapsy is not a word.", 0),  # word boundaries
    ("The probability is 1/2; both are equally likely.", 0),  # math words are not hedges
    ("I thinking about it", 0),
    ("", 0),
])
def test_hedge_count(text, count):
    assert hedge_count(text) == count


def test_hedging_rate_is_fraction_of_responses():
    texts = ["Maybe 4.", "It is 4.", "I think, maybe, perhaps 4.", "\\boxed{4}"]
    assert hedging_rate(texts) == pytest.approx(0.5)
    assert hedging_rate(texts, phrases=("it is",)) == pytest.approx(0.25)
    assert math.isnan(hedging_rate([]))


def test_verdict_accuracy():
    verdicts = ["approve", "approve", "reject", "reject", True, "garbage", None]
    correct = [True, False, False, True, True, True, False]
    out = verdict_accuracy(verdicts, correct)
    # valid pairs: TP=2 (approve/True, True/True), FP=1, TN=1, FN=1
    assert out["n"] == 5
    assert out["accuracy"] == pytest.approx(3 / 5)
    assert out["precision"] == pytest.approx(2 / 3)
    assert out["recall"] == pytest.approx(2 / 3)
    assert out["specificity"] == pytest.approx(1 / 2)
    assert out["approve_rate"] == pytest.approx(3 / 5)
    assert out["invalid_rate"] == pytest.approx(2 / 7)
    rubber_stamp = verdict_accuracy(["Correct"] * 4, [True, False, False, False])
    assert rubber_stamp["specificity"] == 0.0 and rubber_stamp["recall"] == 1.0
    assert math.isnan(verdict_accuracy([], [])["accuracy"])
    with pytest.raises(ValueError):
        verdict_accuracy(["approve"], [])


# ---------------------------------------------------------------- tracker


def test_tracker_reference_is_first_step_and_keys_are_per_role():
    tracker = RoleDriftTracker(top_k=2)
    step0 = [("Generator", [1, 2, 3, 1], [math.log(0.5)] * 4, False, "I think \\boxed{4}"),
             ("Generator", [1, 2], [math.log(0.5)] * 2, True, "\\boxed{4}"),
             ("Aggregator", [9, 9], [0.0, 0.0], False, "\\boxed{1}")]
    m0 = tracker.update(step0, step=0)
    assert m0["agent/Generator/chi2_drift"] == 0.0 and m0["agent/Aggregator/js_drift"] == 0.0
    assert m0["agent/Generator/perplexity"] == pytest.approx(2.0)
    assert m0["agent/Generator/token_concentration"] == pytest.approx(5 / 6)
    assert m0["agent/Generator/length_mean"] == pytest.approx(3.0)
    assert m0["agent/Generator/truncation_rate"] == pytest.approx(0.5)
    assert m0["agent/Generator/hedge_rate"] == pytest.approx(0.5)
    assert m0["agent/Generator/hedges_per_1k_tokens"] == pytest.approx(1000 / 6)
    assert m0["agent/Aggregator/num_responses"] == 1 and m0["agent/Aggregator/num_tokens"] == 2

    # step 1: the generator drifts to new tokens, the aggregator does not
    m1 = tracker.update([("Generator", [7, 7, 7, 1], [-0.1] * 4, False, "x"),
                         ("Aggregator", [9, 9, 9], [0.0] * 3, False, "y")], step=1)
    assert m1["agent/Generator/chi2_drift"] > 100 and m1["agent/Generator/js_drift"] > 0.3
    assert m1["agent/Aggregator/chi2_drift"] == 0.0
    assert tracker.reference_step == {"Generator": 0, "Aggregator": 0}
    assert all(k.startswith("agent/") and k.count("/") == 2 for k in m1)


def test_tracker_accepts_turns_dicts_and_restores_state():
    turn = Turn(agent="Solver", policy="p", prompt_ids=[1], response_ids=[4, 5], logprobs=[-1.0, -1.0],
                text="perhaps", truncated=True)
    tracker = RoleDriftTracker()
    m = tracker.update([turn, {"agent": "Solver", "response_ids": torch.tensor([4]), "logprobs": [-1.0]},
                        DriftRecord("Solver", [5], [-1.0])])
    assert m["agent/Solver/num_responses"] == 3 and m["agent/Solver/hedge_rate"] == pytest.approx(1 / 3)

    restored = RoleDriftTracker()
    restored.load_state_dict(tracker.state_dict())
    later = [("Solver", [4, 4, 5, 6], [-1.0] * 4, False, "")]
    assert restored.update(later)["agent/Solver/chi2_drift"] == tracker.update(later)["agent/Solver/chi2_drift"]
    with pytest.raises(ValueError):
        tracker.update([("Solver", [1])])


def test_tracker_verdict_metrics_keys():
    out = RoleDriftTracker().verdict_metrics("Evaluator", ["correct", "incorrect"], [True, True])
    assert out["agent/Evaluator/verdict_accuracy"] == pytest.approx(0.5)
    assert out["agent/Evaluator/verdict_recall"] == pytest.approx(0.5)
