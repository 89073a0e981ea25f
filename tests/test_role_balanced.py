"""algorithm.loss.agg: role-balanced — every agent (role) gets the same total weight in a shared
policy's loss: token mean within each agent, then the mean over the agents in the policy batch."""
import pytest
import torch

from masrl.algorithms import agg_loss, policy_loss, role_balanced_weights
from masrl.config import AlgorithmConfig, PolicyConfig, TrainerConfig
from masrl.training.policy import build_policy
from masrl.training.update import Row, update_policy_raw, with_trainer_logprobs

TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
        "intermediate_size": 64, "max_position_embeddings": 128}


def test_weights_by_hand():
    # Solver writes 3 + 1 = 4 tokens, Verifier 2, Search 0 (not present): K = 2
    w = role_balanced_weights(["Solver", "Solver", "Verifier", "Search"], [3, 1, 2, 0])
    assert w == {"Solver": 1 / 8, "Verifier": 1 / 4}  # 1 / (K N_k); each role's tokens sum to 1/2


def batch():
    """Rows: Solver (3 tokens, A = 1), Solver (1 token, A = -2), Verifier (2 tokens, A = 0.5); ratio 1."""
    mask = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 1.0], [0.0, 1.0, 1.0]])
    logprobs = torch.tensor([[-1.0, -2.0, -0.5], [0.0, 0.0, -1.5], [0.0, -0.7, -0.2]], requires_grad=True)
    weights = role_balanced_weights(["Solver", "Solver", "Verifier"], [3, 1, 2])
    row_weights = torch.tensor([weights["Solver"], weights["Solver"], weights["Verifier"]])
    return logprobs, torch.tensor([1.0, -2.0, 0.5]), mask, row_weights


def test_loss_and_gradient_by_hand():
    logprobs, adv, mask, row_weights = batch()
    loss, _ = policy_loss(logprobs, logprobs.detach(), adv, mask, agg="role-balanced", row_weights=row_weights)
    # token loss -A at ratio 1: Solver 3 x (1/8)(-1) + 1 x (1/8)(2), Verifier 2 x (1/4)(-0.5) = -0.375
    assert loss.item() == pytest.approx(-0.375)
    loss.backward()
    expected = torch.tensor([[-0.125, -0.125, -0.125], [0.0, 0.0, 0.25], [0.0, -0.125, -0.125]])
    torch.testing.assert_close(logprobs.grad, expected)
    token_mean, _ = policy_loss(logprobs, logprobs.detach(), adv, mask)  # every token 1/6: Solver holds 4/6
    assert token_mean.item() == pytest.approx((-3 + 2 - 1) / 6)


def test_micro_batches_add_up_to_the_whole_batch():
    logprobs, adv, mask, row_weights = batch()
    whole = agg_loss(-adv[:, None] * logprobs, mask, "role-balanced", row_weights=row_weights)
    parts = sum(agg_loss(-adv[rows, None] * logprobs[rows], mask[rows], "role-balanced",
                         row_weights=row_weights[rows]) for rows in ([0], [1, 2]))
    assert parts.item() == pytest.approx(whole.item())
    with pytest.raises(ValueError, match="role-balanced' needs row_weights of shape"):
        agg_loss(logprobs, mask, "role-balanced")


def _rows(policy):
    g = torch.Generator().manual_seed(1)
    rows = []
    for i in range(6):  # Solver: 4 rows of 5-8 tokens; Verifier: 2 rows of 2 tokens
        agent = "Solver" if i < 4 else "Verifier"
        prompt = torch.randint(5, 60, (4 + i % 3,), generator=g).tolist()
        resp = torch.randint(5, 60, (5 + i if agent == "Solver" else 2,), generator=g).tolist()
        rows.append(Row(agent, prompt, resp, [0.0] * len(resp), (-1.0) ** i * (1 + i / 10)))
    exact = with_trainer_logprobs(policy, rows, TrainerConfig(autocast="float32"))  # ratio 1: no clipping
    return [Row(r.agent, r.prompt_ids, r.response_ids, r.old_logprobs, r.advantage) for r in exact]


def _grad(rows, agg: str, micro_batch_tokens: int = 4096) -> torch.Tensor:
    policy = build_policy("p", PolicyConfig(tiny=TINY, optim={"lr": 1e-30, "grad_clip": None}), seed=0,
                          max_rollout_batch=8)
    update_policy_raw(policy, rows, AlgorithmConfig(loss={"agg": agg}), TrainerConfig(
        micro_batch_tokens=micro_batch_tokens, autocast="float32"), step=0, seed=0)
    return torch.cat([p.grad.flatten() for p in policy.trainable_parameters()])


def test_shared_policy_update_gives_each_role_half_the_weight_across_micro_batches():
    rows = _rows(build_policy("p", PolicyConfig(tiny=TINY), seed=0, max_rollout_batch=8))
    solver = _grad([r for r in rows if r.agent == "Solver"], "token-mean")
    verifier = _grad([r for r in rows if r.agent == "Verifier"], "token-mean")
    expected = (solver + verifier) / 2
    tol = {"rtol": 1e-4, "atol": 1e-5 * float(expected.abs().max())}
    torch.testing.assert_close(_grad(rows, "role-balanced"), expected, **tol)
    torch.testing.assert_close(_grad(rows, "role-balanced", micro_batch_tokens=16), expected, **tol)  # 1-2 rows each
    token_mean = _grad(rows, "token-mean")  # Solver's 26 tokens outweigh Verifier's 4
    assert (token_mean - expected).abs().max() > 0.05 * expected.abs().max()
