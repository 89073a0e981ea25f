"""Rollout correction in the update: with a separate rollout engine (vLLM) the trainer's own
log-probs are the PPO "old" ones, and algorithm.rollout_is weights each token by
min(exp(logp_train - logp_engine), cap). Pinned with a constant engine gap of 0.5 nats."""
import math

import pytest
import torch

from masrl.config import AlgorithmConfig, PolicyConfig, TrainerConfig
from masrl.rollout.base import Engine
from masrl.training.policy import build_policy
from masrl.training.update import Row, summarize_update, update_policy_raw, with_trainer_logprobs

TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
        "intermediate_size": 64, "max_position_embeddings": 128}
GAP = 0.5


class SeparateEngine(Engine):  # stands for vLLM: not the trainer's model
    def generate(self, requests):
        raise AssertionError("not used")


def _policy(separate: bool):
    policy = build_policy("p", PolicyConfig(tiny=TINY, optim={"lr": 1e-30, "grad_clip": None}), seed=0,
                          max_rollout_batch=8)
    if separate:
        policy.engine = SeparateEngine()
    return policy


def _rows(policy):
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(6):
        prompt = torch.randint(5, 60, (4 + i % 3,), generator=g).tolist()
        resp = torch.randint(5, 60, (2 + i % 4,), generator=g).tolist()
        rows.append(Row("A", prompt, resp, [0.0] * len(resp), (-1.0) ** i * (1 + i / 10)))
    exact = with_trainer_logprobs(policy, rows, TrainerConfig(autocast="float32"))
    return [Row(r.agent, r.prompt_ids, r.response_ids, r.old_logprobs, r.advantage) for r in exact]


def _grads(separate: bool, shift: float, **ris):
    policy = _policy(separate)
    rows = [Row(r.agent, r.prompt_ids, r.response_ids, [x - shift for x in r.old_logprobs], r.advantage)
            for r in _rows(policy)]
    algo = AlgorithmConfig(rollout_is=ris) if ris else AlgorithmConfig()
    raw = update_policy_raw(policy, rows, algo, TrainerConfig(autocast="float32"), step=0, seed=0)
    grads = torch.cat([p.grad.flatten() for p in policy.trainable_parameters()])
    return grads, summarize_update(raw, policy, rows)


def test_trainer_logprobs_replace_the_engines_and_keep_them():
    policy = _policy(True)
    rows = _rows(policy)
    shifted = [Row(r.agent, r.prompt_ids, r.response_ids, [x - GAP for x in r.old_logprobs], r.advantage)
               for r in rows]
    out = with_trainer_logprobs(policy, shifted, TrainerConfig(micro_batch_tokens=20, autocast="float32"))
    for r, s, o in zip(rows, shifted, out):
        assert o.old_logprobs == pytest.approx(r.old_logprobs, abs=1e-5)
        assert o.rollout_logprobs == s.old_logprobs
    assert shifted[0].rollout_logprobs is None  # inputs untouched


def test_separate_engine_trains_on_the_trainers_logprobs():
    on_policy, _ = _grads(False, 0.0)  # shared engine, exact old log-probs: ratio 1
    separate, _ = _grads(True, GAP)    # engine off by 0.5 nats: ignored without rollout_is
    assert on_policy.abs().sum() > 0
    torch.testing.assert_close(separate, on_policy, rtol=1e-4, atol=1e-5 * float(on_policy.abs().max()))


@pytest.mark.parametrize("cap,mode,scale", [(2.0, "truncate", math.exp(GAP)), (1.5, "truncate", 1.5),
                                             (1.5, "mask", 0.0)])
def test_truncated_is_scales_every_token_by_its_capped_weight(cap, mode, scale):
    on_policy, _ = _grads(False, 0.0)
    weighted, metrics = _grads(True, GAP, enabled=True, cap=cap, mode=mode)
    torch.testing.assert_close(weighted, scale * on_policy, rtol=1e-4, atol=1e-5 * float(on_policy.abs().max()))
    assert metrics["policy/p/rollout_is/is_weight_mean"] == pytest.approx(scale, rel=1e-4)  # after the cap
    assert metrics["policy/p/rollout_is/is_capped_frac"] == pytest.approx(0.0 if cap > math.exp(GAP) else 1.0)
