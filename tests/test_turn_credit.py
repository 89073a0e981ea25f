"""Turn-level credit when the policy decides how many turns an episode has (docs/algorithms.md, "Variable
numbers of turns"). Exact expectations by enumerating every outcome of a group on an Eval-Opt loop:

    Generator (turn 0) -> Evaluator (turn 1): approve (stop, probability p) or reject ->
    Generator (turn 2) -> Evaluator (turn 3, approves)

The team reward is 1 when the last answer is right: the first with probability q1, the second with q2. The
Evaluator's decision at turn 1 is the policy's choice of length; with θ = logit(p), d log π / dθ is 1 - p for
approve and -p for reject. The true gradient of the expected reward per episode is p (1 - p) (q1 - q2).
"""
import itertools

import pytest
import torch

from masrl.algorithms import compute_advantages

OUTCOMES = ("stop", 1), ("stop", 0), ("continue", 1), ("continue", 0)


def _group(combo):
    scores, agents, episodes, index, score_fn = [], [], [], [], []
    for e, (kind, reward) in enumerate(combo):
        turns = [("Generator", 0), ("Evaluator", 1)] + ([("Generator", 2), ("Evaluator", 3)] * (kind == "continue"))
        for agent, t in turns:
            scores.append(float(reward)), agents.append(agent), episodes.append(e), index.append(t)
            score_fn.append((agent, t, kind))
    return scores, agents, episodes, index, score_fn


def expected_gradient(estimator, p, q1, q2, G=3):
    """E[Σ_i A_i d log π(a_i)/dθ] over every outcome of a group of G episodes (exact)."""
    prob = {("stop", 1): p * q1, ("stop", 0): p * (1 - q1), ("continue", 1): (1 - p) * q2,
            ("continue", 0): (1 - p) * (1 - q2)}
    total = 0.0
    for combo in itertools.product(OUTCOMES, repeat=G):
        scores, agents, episodes, index, where = _group(combo)
        adv = compute_advantages(torch.tensor(scores, dtype=torch.float64), group_ids=[0] * len(scores),
                                 agent_ids=agents, episode_ids=episodes, turn_index=index, estimator=estimator)
        grad = [(1 - p if kind == "stop" else -p) if (agent, t) == ("Evaluator", 1) else 0.0
                for agent, t, kind in where]
        weight = 1.0
        for outcome in combo:
            weight *= prob[outcome]
        total += weight * float((adv * torch.tensor(grad, dtype=torch.float64)).sum())
    return total


@pytest.mark.parametrize("estimator", ["drmas_turnwise", "grpo", "dr_grpo", "rloo", "dr_grpo_agentwise"])
@pytest.mark.parametrize("p, q", [(0.3, 0.8), (0.7, 0.8), (0.3, 0.2)])
def test_no_hidden_bonus_for_another_turn(estimator, p, q):
    """A second attempt that is no better (q1 = q2): the true gradient is 0, and so is these estimators'."""
    assert expected_gradient(estimator, p, q, q) == pytest.approx(0.0, abs=1e-12)


def test_turnwise_points_the_right_way_and_the_centred_estimators_are_exact():
    true = 3 * 0.3 * 0.7 * (0.8 - 0.4)  # G episodes, each p (1 - p) (q1 - q2)
    assert expected_gradient("rloo", 0.3, 0.8, 0.4) == pytest.approx(true, rel=1e-12)  # leave-one-out: unbiased
    assert expected_gradient("dr_grpo", 0.3, 0.8, 0.4) == pytest.approx(true * 2 / 3, rel=1e-12)  # (1 - 1/G)
    for q1, q2 in ((0.8, 0.4), (0.4, 0.8)):
        assert expected_gradient("drmas_turnwise", 0.3, q1, q2) * (q1 - q2) > 0


def test_agent_wise_sigma_over_every_turn_prefers_length():
    """drmas pools the Evaluator's turns at 1 and 3: an episode that continues weighs twice in σ_{g,k}. With a
    second attempt that is no better, the expected gradient is not 0: towards more turns when the team mostly
    succeeds (here -0.016 on θ = logit(stop), against a true 0), towards fewer when it mostly fails."""
    mostly_right, mostly_wrong = expected_gradient("drmas", 0.3, 0.8, 0.8), expected_gradient("drmas", 0.3, 0.2, 0.2)
    assert mostly_right == pytest.approx(-0.01595, abs=1e-5)
    assert mostly_wrong == pytest.approx(-mostly_right, abs=1e-12)
