"""Advantage estimators pinned by hand-computed numbers and invariance properties."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from masrl.algorithms import ADVANTAGE_ESTIMATORS, compute_advantages, register_advantage

# Worked example (DESIGN.md): one group of G=4 math episodes, Solver (S) and Verifier (V).
#   e0: S✓ V          -> every turn scores 1
#   e1: S✗ V S✗       -> 0
#   e2: S✗ V S✓       -> final answer right, every turn scores 1
#   e3: S✗ V (approved, wrong) -> 0
WORKED = dict(
    scores=torch.tensor([1, 1, 0, 0, 0, 1, 1, 1, 0, 0], dtype=torch.float32),
    group_ids=["q"] * 10,
    agent_ids=["S", "V", "S", "V", "S", "S", "V", "S", "S", "V"],
    episode_ids=[0, 0, 1, 1, 1, 2, 2, 2, 3, 3],
    turn_index=[0, 1, 0, 1, 2, 0, 1, 2, 0, 1],
)
SOLVER_ROWS = [0, 2, 4, 5, 7, 8]
VERIFIER_ROWS = [1, 3, 6, 9]

# Penalty example: group q1 (3 episodes) with agent A acting twice in e1 (second turn invalid,
# penalty 1) and B penalised in e2; group q2 (2 episodes).
#   q1 e0: A 1, B 1      s = 1
#   q1 e1: A 0, B 0, A -1  s = -1/3
#   q1 e2: A 1, B 0      s = 1/2
#   q2 e3: A 0, B 0      s = 0
#   q2 e4: A 1, B 1      s = 1
PENALTY = dict(
    scores=torch.tensor([1, 1, 0, 0, -1, 1, 0, 0, 0, 1, 1], dtype=torch.float64),
    group_ids=["q1"] * 7 + ["q2"] * 4,
    agent_ids=["A", "B", "A", "B", "A", "A", "B", "A", "B", "A", "B"],
    episode_ids=[0, 0, 1, 1, 1, 2, 2, 3, 3, 4, 4],
    turn_index=[0, 1, 0, 1, 2, 0, 1, 0, 1, 0, 1],
)
# Hand statistics of q1:
MU_G, SIGMA_G = 7 / 18, math.sqrt(147) / 18          # episode values {1, -1/3, 1/2}
MU_A, SIGMA_A = 1 / 4, math.sqrt(11 / 12)             # A turns {1, 0, -1, 1}
MU_B, SIGMA_B = 1 / 3, math.sqrt(1 / 3)               # B turns {1, 0, 0}
Q2 = 1 / 2 / math.sqrt(1 / 2)                         # q2: every set is {0, 1} -> ±0.7071


def adv(example: dict, estimator: str, **kw) -> torch.Tensor:
    return compute_advantages(**example, estimator=estimator, **kw)


def close(actual: torch.Tensor, expected: list[float], tol: float = 1e-5) -> None:
    torch.testing.assert_close(actual.double(), torch.tensor(expected, dtype=torch.float64), atol=tol, rtol=0)


# --------------------------------------------------------------------------- worked example


def test_worked_example_drmas_solver_and_verifier():
    a = adv(WORKED, "drmas")
    assert a.dtype == torch.float32 and a.shape == (10,)
    # Solver {1,0,0,1,1,0}: μ = 0.5, σ = sqrt(0.3) -> ±0.913; Verifier {1,0,1,0}: σ = sqrt(1/3) -> ±0.866
    close(a[SOLVER_ROWS], [0.9129, -0.9129, -0.9129, 0.9129, 0.9129, -0.9129], tol=1e-3)
    close(a[VERIFIER_ROWS], [0.8660, -0.8660, 0.8660, -0.8660], tol=1e-3)
    assert abs(float(a[0]) - 0.5 / math.sqrt(0.3)) < 1e-5


def test_worked_example_vanilla_grpo_gives_every_turn_0866():
    a = adv(WORKED, "grpo")
    sign = torch.tensor([1, 1, -1, -1, -1, 1, 1, 1, -1, -1], dtype=torch.float64)
    close(a, (0.8660 * sign).tolist(), tol=1e-3)


def test_worked_example_grpo_per_turn_pools_every_turn_of_the_group():
    # all 10 turns {1,0,0,1,1,0, 1,0,1,0}: μ = 0.5, σ = sqrt(2.5 / 9) -> ±0.9487, each turn by its own score
    a = adv(WORKED, "grpo_per_turn")
    sign = torch.tensor([1, 1, -1, -1, -1, 1, 1, 1, -1, -1], dtype=torch.float64)  # the rows' scores 1 / 0
    close(a, (0.5 / math.sqrt(2.5 / 9) * sign).tolist(), tol=1e-5)
    # per-turn scores (the Verifier's turn of e0 scores 0 instead of 1): each turn keeps its own, unlike grpo
    per_turn = adv({**WORKED, "scores": WORKED["scores"].clone().index_fill_(0, torch.tensor([1]), 0.0)}, "grpo_per_turn")
    mu, sd = 0.4, math.sqrt(4 * 0.36 / 9 + 6 * 0.16 / 9)
    close(per_turn[:2], [(1 - mu) / sd, (0 - mu) / sd], tol=1e-5)


def test_worked_example_population_std():
    # σ with N: Solver σ = 0.5, Verifier σ = 0.5 -> every advantage is ±1
    a = adv(WORKED, "drmas", unbiased_std=False)
    close(a.abs(), [1.0] * 10, tol=1e-5)


# --------------------------------------------------------------------------- every estimator by hand


def test_drmas_by_hand():
    close(adv(PENALTY, "drmas"), [
        (1 - MU_A) / SIGMA_A, (1 - MU_B) / SIGMA_B, (0 - MU_A) / SIGMA_A, (0 - MU_B) / SIGMA_B,
        (-1 - MU_A) / SIGMA_A, (1 - MU_A) / SIGMA_A, (0 - MU_B) / SIGMA_B,
        -Q2, -Q2, Q2, Q2])


def test_grpo_by_hand():
    s = [(1 - MU_G) / SIGMA_G, (-1 / 3 - MU_G) / SIGMA_G, (1 / 2 - MU_G) / SIGMA_G]
    close(adv(PENALTY, "grpo"), [s[0], s[0], s[1], s[1], s[1], s[2], s[2], -Q2, -Q2, Q2, Q2])


def test_drmas_mean_only_by_hand():
    # (r_i - μ_{g,k}) / (σ_g + ε), σ_g over the episode values
    close(adv(PENALTY, "drmas_mean_only"), [
        (1 - MU_A) / SIGMA_G, (1 - MU_B) / SIGMA_G, (0 - MU_A) / SIGMA_G, (0 - MU_B) / SIGMA_G,
        (-1 - MU_A) / SIGMA_G, (1 - MU_A) / SIGMA_G, (0 - MU_B) / SIGMA_G,
        -Q2, -Q2, Q2, Q2])


def test_drmas_std_only_by_hand():
    # (r_i - μ_g) / (σ_{g,k} + ε), μ_g over the episode values
    close(adv(PENALTY, "drmas_std_only"), [
        (1 - MU_G) / SIGMA_A, (1 - MU_G) / SIGMA_B, (0 - MU_G) / SIGMA_A, (0 - MU_G) / SIGMA_B,
        (-1 - MU_G) / SIGMA_A, (1 - MU_G) / SIGMA_A, (0 - MU_G) / SIGMA_B,
        -Q2, -Q2, Q2, Q2])


def test_drmas_turnwise_by_hand():
    # keys (g, turn, k): q1 (0,A) {1,0,1}; (1,B) {1,0,0}; (2,A) {-1} is a singleton
    mu, sigma = 2 / 3, math.sqrt(1 / 3)
    expected = [(1 - mu) / sigma, (1 - MU_B) / SIGMA_B, (0 - mu) / sigma, (0 - MU_B) / SIGMA_B,
                0.0, (1 - mu) / sigma, (0 - MU_B) / SIGMA_B, -Q2, -Q2, Q2, Q2]
    close(adv(PENALTY, "drmas_turnwise"), expected)
    expected[4] = -1.0  # raw: the lone turn keeps its score
    close(adv(PENALTY, "drmas_turnwise", singleton="raw"), expected)


def test_drmas_turnwise_needs_turn_index():
    example = {k: v for k, v in PENALTY.items() if k != "turn_index"}
    with pytest.raises(ValueError, match="turn_index"):
        compute_advantages(**example, estimator="drmas_turnwise")


def test_dr_grpo_by_hand():
    s = [11 / 18, -13 / 18, 2 / 18]
    close(adv(PENALTY, "dr_grpo"), [s[0], s[0], s[1], s[1], s[1], s[2], s[2], -.5, -.5, .5, .5])
    close(adv(PENALTY, "dr_grpo_agentwise"),
          [3 / 4, 2 / 3, -1 / 4, -1 / 3, -5 / 4, 3 / 4, -1 / 3, -.5, -.5, .5, .5])


def test_rloo_by_hand():
    # episode level: s_e - mean of the other episodes
    s = [1 - (-1 / 3 + 1 / 2) / 2, -1 / 3 - (1 + 1 / 2) / 2, 1 / 2 - (1 - 1 / 3) / 2]
    close(adv(PENALTY, "rloo"), [s[0], s[0], s[1], s[1], s[1], s[2], s[2], -1, -1, 1, 1])
    # agent-wise: A turns {1,0,-1,1} (sum 1), B turns {1,0,0} (sum 1)
    close(adv(PENALTY, "rloo_agentwise"),
          [1 - 0 / 3, 1 - 0 / 2, 0 - 1 / 3, 0 - 1 / 2, -1 - 2 / 3, 1 - 0 / 3, 0 - 1 / 2, -1, -1, 1, 1])


def test_reinforce_pp_baseline_by_hand():
    # centred episode values {11/18, -13/18, 2/18, -1/2, 1/2}; whiten by their batch std
    centred = [11 / 18, -13 / 18, 2 / 18, -1 / 2, 1 / 2]
    std = math.sqrt(sum(c * c for c in centred) / 4)
    c = [x / std for x in centred]
    close(adv(PENALTY, "reinforce_pp_baseline"), [c[0], c[0], c[1], c[1], c[1], c[2], c[2], c[3], c[3], c[4], c[4]])


def test_reinforce_pp_baseline_agentwise_by_hand():
    centred = [3 / 4, 2 / 3, -1 / 4, -1 / 3, -5 / 4, 3 / 4, -1 / 3, -1 / 2, -1 / 2, 1 / 2, 1 / 2]
    std = math.sqrt(sum(c * c for c in centred) / 10)   # batch mean is 0
    close(adv(PENALTY, "reinforce_pp_baseline_agentwise"), [x / std for x in centred])


# --------------------------------------------------------------------------- edge rules


def test_singleton_zero_and_raw():
    example = dict(scores=torch.tensor([0.7, 0.3, 1.0]), group_ids=["a", "b", "b"],
                   agent_ids=["S", "S", "V"], episode_ids=[0, 1, 1])
    # group a has one episode; in group b each agent acts once
    for est in ("grpo", "drmas", "rloo", "dr_grpo", "rloo_agentwise", "dr_grpo_agentwise"):
        close(adv(example, est), [0.0, 0.0, 0.0])
    close(adv(example, "drmas", singleton="raw"), [0.7, 0.3, 1.0])
    close(adv(example, "dr_grpo_agentwise", singleton="raw"), [0.7, 0.3, 1.0])
    close(adv(example, "grpo", singleton="raw"), [0.7, 0.65, 0.65])


def test_all_equal_values_give_zero():
    example = dict(scores=torch.tensor([0.3, 0.3, 0.3, 0.3]), group_ids=[0] * 4,
                   agent_ids=["S"] * 4, episode_ids=[0, 1, 2, 3])
    for est in ADVANTAGE_ESTIMATORS:
        if est != "drmas_turnwise":
            assert torch.equal(adv(example, est), torch.zeros(4)), est


def test_constant_sigma_set_gives_zero_in_ablations():
    # episode values are all 0.5 (σ_g = 0) while agent deviations are not zero
    example = dict(scores=torch.tensor([1.0, 0.0, 0.0, 1.0, 0.9, 0.1]), group_ids=[0] * 6,
                   agent_ids=["S", "V"] * 3, episode_ids=[0, 0, 1, 1, 2, 2])
    assert torch.equal(adv(example, "drmas_mean_only"), torch.zeros(6))
    assert torch.equal(adv(example, "grpo"), torch.zeros(6))


def test_drmas_each_group_agent_set_has_mean_0_std_1():
    gen = torch.Generator().manual_seed(0)
    n = 400
    groups = torch.randint(0, 10, (n,), generator=gen)
    agents = torch.randint(0, 3, (n,), generator=gen)
    scores = torch.randint(0, 5, (n,), generator=gen).double() - 0.3 * torch.rand(n, generator=gen, dtype=torch.float64)
    a = compute_advantages(scores, group_ids=groups, agent_ids=agents,
                           episode_ids=list(range(n)), estimator="drmas")
    for g in range(10):
        for k in range(3):
            sel = (groups == g) & (agents == k)
            if sel.sum() >= 2 and scores[sel].unique().numel() >= 2:
                assert abs(float(a[sel].mean())) < 1e-9
                assert abs(float(a[sel].std()) - 1) < 1e-5


def test_one_agent_one_turn_per_episode_grpo_equals_drmas():
    gen = torch.Generator().manual_seed(1)
    scores = torch.rand(48, generator=gen)
    kw = dict(group_ids=[i // 8 for i in range(48)], agent_ids=["Solver"] * 48, episode_ids=list(range(48)))
    assert torch.equal(compute_advantages(scores, estimator="grpo", **kw),
                       compute_advantages(scores, estimator="drmas", **kw))


def test_dtype_device_and_empty():
    a = compute_advantages(torch.tensor([1.0, 0.0], dtype=torch.float64), group_ids=[0, 0],
                           agent_ids=[0, 0], episode_ids=[0, 1], estimator="drmas")
    assert a.dtype == torch.float64
    empty = compute_advantages(torch.zeros(0), group_ids=[], agent_ids=[], episode_ids=[], estimator="grpo")
    assert empty.shape == (0,)


def test_scores_requiring_grad_are_detached():
    scores = torch.tensor([1.0, 0.0, 0.5], requires_grad=True)
    a = compute_advantages(scores, group_ids=[0] * 3, agent_ids=[0] * 3, episode_ids=[0, 1, 2], estimator="grpo")
    assert not a.requires_grad


# --------------------------------------------------------------------------- bad input


def test_duplicate_turns_are_rejected():
    with pytest.raises(ValueError, match="turn_index"):
        compute_advantages(torch.tensor([1.0, 1.0, 0.0]), group_ids=[0] * 3, agent_ids=["S"] * 3,
                           episode_ids=[0, 0, 1], turn_index=[0, 0, 0], estimator="drmas")
    with pytest.raises(ValueError, match="turn_ids"):
        compute_advantages(torch.tensor([1.0, 1.0, 0.0]), group_ids=[0] * 3, agent_ids=["S"] * 3,
                           episode_ids=[0, 0, 1], turn_ids=["a", "a", "b"], estimator="drmas")


def test_episode_in_two_groups_is_rejected():
    with pytest.raises(ValueError, match="episode_id 0"):
        compute_advantages(torch.tensor([1.0, 0.0]), group_ids=["a", "b"], agent_ids=["S", "V"],
                           episode_ids=[0, 0], estimator="grpo")


@pytest.mark.parametrize("name", ["group_ids", "agent_ids", "episode_ids", "turn_index", "turn_ids"])
def test_mismatched_lengths_name_the_argument(name):
    kw = dict(group_ids=[0, 0], agent_ids=[0, 0], episode_ids=[0, 1], turn_index=[0, 0], turn_ids=[0, 1])
    kw[name] = [0, 1, 2]
    with pytest.raises(ValueError, match=name):
        compute_advantages(torch.tensor([1.0, 0.0]), estimator="drmas", **kw)


def test_unknown_estimator_lists_known_ones():
    with pytest.raises(ValueError, match="unknown estimator 'gae'.*drmas.*grpo.*rloo"):
        compute_advantages(torch.tensor([1.0]), group_ids=[0], agent_ids=[0], episode_ids=[0], estimator="gae")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_scores_are_rejected(bad):
    with pytest.raises(ValueError, match="scores"):
        compute_advantages(torch.tensor([1.0, bad]), group_ids=[0, 0], agent_ids=[0, 0],
                           episode_ids=[0, 1], estimator="grpo")


def test_other_bad_arguments():
    kw = dict(group_ids=[0, 0], agent_ids=[0, 0], episode_ids=[0, 1], estimator="grpo")
    with pytest.raises(ValueError, match="singleton"):
        compute_advantages(torch.tensor([1.0, 0.0]), singleton="keep", **kw)
    with pytest.raises(ValueError, match="scores must be 1-D"):
        compute_advantages(torch.ones(2, 1), **kw)
    with pytest.raises(ValueError, match="group_ids must hold hashable"):
        compute_advantages(torch.tensor([1.0, 0.0]), **{**kw, "group_ids": [[0], [0]]})
    with pytest.raises(ValueError, match="agent_ids .*string"):
        compute_advantages(torch.tensor([1.0, 0.0]), **{**kw, "agent_ids": "SV"})


# --------------------------------------------------------------------------- registry


def test_register_custom_estimator():
    @register_advantage("test_raw_scores")
    def raw_scores(scores, groups, *, eps, unbiased_std, singleton):
        return scores * 2

    try:
        a = compute_advantages(torch.tensor([1.0, 0.5]), group_ids=[0, 0], agent_ids=[0, 0],
                               episode_ids=[0, 1], estimator="test_raw_scores")
        close(a, [2.0, 1.0])
        with pytest.raises(ValueError, match="already registered"):
            register_advantage("test_raw_scores")(raw_scores)
    finally:
        ADVANTAGE_ESTIMATORS.pop("test_raw_scores")


# --------------------------------------------------------------------------- properties


@st.composite
def batches(draw):
    """Random groups of episodes; each episode has 1-4 turns by 1-3 agents; integer scores."""
    scores, group_ids, agent_ids, episode_ids, turn_index = [], [], [], [], []
    episode = 0
    for g in range(draw(st.integers(1, 3))):
        for _ in range(draw(st.integers(2, 4))):
            for t in range(draw(st.integers(1, 4))):
                scores.append(float(draw(st.integers(-2, 3))))
                group_ids.append(g)
                agent_ids.append(draw(st.sampled_from("SVA")))
                episode_ids.append(episode)
                turn_index.append(t)
            episode += 1
    return dict(scores=torch.tensor(scores, dtype=torch.float64), group_ids=group_ids,
                agent_ids=agent_ids, episode_ids=episode_ids, turn_index=turn_index)


SCALE_INVARIANT = ["grpo", "drmas", "drmas_mean_only", "drmas_std_only", "drmas_turnwise",
                   "reinforce_pp_baseline", "reinforce_pp_baseline_agentwise"]
SCALE_EQUIVARIANT = ["rloo", "rloo_agentwise", "dr_grpo", "dr_grpo_agentwise"]


@settings(max_examples=40, deadline=None)
@given(batch=batches(), scale=st.floats(0.1, 50.0), shift=st.floats(-10.0, 10.0))
def test_scaling_and_shifting_scores(batch, scale, shift):
    for est in SCALE_INVARIANT + SCALE_EQUIVARIANT:
        base = adv(batch, est)
        factor = 1.0 if est in SCALE_INVARIANT else scale
        scaled = adv({**batch, "scores": batch["scores"] * scale}, est)
        torch.testing.assert_close(scaled, base * factor, rtol=1e-3, atol=1e-3, msg=f"{est} scale {scale}")
        shifted = adv({**batch, "scores": batch["scores"] + shift}, est)
        torch.testing.assert_close(shifted, base, rtol=1e-6, atol=1e-6, msg=f"{est} shift {shift}")


@settings(max_examples=25, deadline=None)
@given(batch=batches(), seed=st.integers(0, 2**16))
def test_row_order_does_not_matter(batch, seed):
    perm = torch.randperm(len(batch["scores"]), generator=torch.Generator().manual_seed(seed))
    permuted = {k: (v[perm] if isinstance(v, torch.Tensor) else [v[i] for i in perm]) for k, v in batch.items()}
    for est in ADVANTAGE_ESTIMATORS:
        torch.testing.assert_close(adv(permuted, est), adv(batch, est)[perm], rtol=1e-9, atol=1e-9, msg=est)
