"""Loss masks for conversations: tool-output tokens contribute zero gradient, and an agent's later turn
merged into its earlier one (one sequence, masked gap) gives the gradient of the separate rows."""
import pytest
import torch

from masrl.config import AlgorithmConfig, PolicyConfig, TrainerConfig
from masrl.training.conversation import merge_extending_rows
from masrl.training.policy import build_policy
from masrl.training.update import Row, update_policy_raw, with_trainer_logprobs

TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
        "intermediate_size": 64, "max_position_embeddings": 128}


def _policy():
    return build_policy("p", PolicyConfig(tiny=TINY, optim={"lr": 1e-30, "grad_clip": None}), seed=0,
                        max_rollout_batch=8)


def _ids(n, seed):
    return torch.randint(5, 60, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _separate_rows(policy):
    """Agent A's two turns of one conversation (b's prompt = a's prompt + response + tool output) and
    an unrelated row of agent B; old log-probs are the policy's own."""
    prompt, resp_a, tool_out, resp_b = _ids(6, 1), _ids(4, 2), _ids(5, 3), _ids(3, 4)
    rows = [Row("A", prompt, resp_a, [0.0] * 4, 1.0), Row("B", _ids(7, 5), _ids(4, 6), [0.0] * 4, -0.5),
            Row("A", prompt + resp_a + tool_out, resp_b, [0.0] * 3, 1.0)]
    return with_trainer_logprobs(policy, rows, TrainerConfig(autocast="float32"))


def _grads(rows):
    policy = _policy()
    update_policy_raw(policy, rows, AlgorithmConfig(), TrainerConfig(autocast="float32"), step=0, seed=0)
    return torch.cat([p.grad.flatten() for p in policy.trainable_parameters()])


def test_merge_makes_one_sequence_with_the_tool_output_masked():
    rows = _separate_rows(_policy())
    merged = merge_extending_rows(rows)
    assert [r.agent for r in merged] == ["A", "B"]
    a = merged[0]
    assert a.prompt_ids == rows[0].prompt_ids and a.prompt_ids + a.response_ids == rows[2].prompt_ids + rows[2].response_ids
    assert a.loss_mask == [1] * 4 + [0] * 5 + [1] * 3 and a.num_loss_tokens == 7
    assert a.old_logprobs == rows[0].old_logprobs + [0.0] * 5 + rows[2].old_logprobs
    # no merge across agents / advantages, nor when the prefix differs by one token
    other = Row("A", rows[2].prompt_ids[:-1] + [61], rows[2].response_ids, rows[2].old_logprobs, 1.0)
    assert len(merge_extending_rows([rows[0], other])) == 2
    assert len(merge_extending_rows([rows[0], Row("A", rows[2].prompt_ids, [7], [0.0], 0.5)])) == 2


def test_merged_rows_give_the_gradient_of_the_separate_rows():
    rows = _separate_rows(_policy())
    separate, merged = _grads(rows), _grads(merge_extending_rows(rows))
    assert separate.abs().max() > 1e-4
    torch.testing.assert_close(merged, separate, rtol=1e-4, atol=1e-7)


def test_masked_tool_tokens_contribute_zero_gradient():
    rows = _separate_rows(_policy())
    merged = merge_extending_rows(rows)
    a = merged[0]
    masked = _grads(merged)
    # the old log-probs of the tool tokens do not matter when masked ...
    noisy = Row(a.agent, a.prompt_ids, a.response_ids, [x if m else 2.0 for x, m in zip(a.old_logprobs, a.loss_mask)],
                a.advantage, loss_mask=a.loss_mask)
    assert torch.equal(_grads([noisy, merged[1]]), masked)
    # ... and they would if the tool tokens were trained (the check above can fail)
    trained = Row(a.agent, a.prompt_ids, a.response_ids, noisy.old_logprobs, a.advantage)
    assert (_grads([trained, merged[1]]) - masked).abs().max() > 1e-4


def test_merge_conversations_config_needs_token_mean_ppo():
    from masrl.config import RunConfig

    base = {"agents": {"A": {"policy": "p"}}, "policies": {"p": {"model": "tiny"}},
            "trainer": {"merge_conversations": True}}
    assert RunConfig(**base).trainer.merge_conversations
    with pytest.raises(ValueError, match="merge_conversations needs algorithm.loss.loss: ppo and agg: token-mean"):
        RunConfig(**base, algorithm={"loss": {"agg": "seq-mean-token-mean"}})
    with pytest.raises(ValueError, match="merge_conversations needs"):
        RunConfig(**base, algorithm={"loss": {"loss": "gspo"}})
