"""algorithm.overlong: truncated turns masked from the loss, DAPO's soft overlong penalty (hand-computed values)."""
from types import SimpleNamespace

import pytest
import torch

from masrl.algorithms import soft_overlong_penalty
from masrl.config import config_from_dict
from masrl.trainer import Trainer
from masrl.training.batch_select import BatchSelector
from masrl.types import Episode, Task, Turn


def test_soft_penalty_by_hand():
    # L_max = 10, L_cache = 4: free up to 6 tokens, then -1/4 per token, -1 at the limit and beyond
    lengths = [0, 5, 6, 7, 8, 9, 10, 11]
    got = soft_overlong_penalty(lengths, [10] * 8, buffer_tokens=4).tolist()
    assert got == [0.0, 0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0]
    assert soft_overlong_penalty([8, 10], [10, 10], buffer_tokens=4, factor=0.5).tolist() == [-0.25, -0.5]


def test_soft_penalty_per_agent_limit_and_long_buffer():
    # the same 8 tokens: -0.5 under a limit of 10, nothing under 20; a buffer longer than the limit is the limit
    assert soft_overlong_penalty([8, 8], [10, 20], buffer_tokens=4).tolist() == [-0.5, 0.0]
    assert soft_overlong_penalty([2, 4], [4, 4], buffer_tokens=100).tolist() == [-0.5, -1.0]
    with pytest.raises(ValueError, match="buffer_tokens"):
        soft_overlong_penalty([1], [4], buffer_tokens=0)


def _cfg(tiny_cfg, **over):
    return config_from_dict(tiny_cfg(**{"sft.steps": 0, "eval.before_after": False, "logging.plots": False,
                                        "logging.tensorboard": False, **over}))


def _episodes():
    """Group 0: ep0 Solver 8 tokens (its limit: truncated) + Verifier 2 tokens; ep1 Solver 5 + Verifier 4
    (the Verifier's limit: truncated). Team rewards 1 and 0."""
    def turn(agent, n, index, truncated):
        return Turn(agent, "shared", [1, 2], list(range(n)), [0.0] * n, "x", turn_index=index, truncated=truncated)
    task = Task("t", "q", "a")
    return [Episode(task, [turn("Solver", 8, 0, True), turn("Verifier", 2, 1, False)], 1.0, group_id=0, episode_id=0),
            Episode(task, [turn("Solver", 5, 0, False), turn("Verifier", 4, 1, True)], 0.0, group_id=0, episode_id=1)]


def test_trainer_scores_carry_the_penalty_of_each_agents_limit(tiny_cfg):
    # Solver limit 8, Verifier limit 4 (conftest), buffer 4 (clamped to 4 for the Verifier), factor 0.5:
    #   Solver 8 tokens: (4 - 8)/4 * .5 = -0.5; Verifier 2: (0 - 2)/4 * .5 = -0.25
    #   Solver 5 tokens: (4 - 5)/4 * .5 = -0.125; Verifier 4: -0.5
    cfg = _cfg(tiny_cfg, **{"algorithm.overlong.soft_penalty": {"buffer_tokens": 4, "factor": 0.5}})
    _, _, scores = Trainer.score_turns(SimpleNamespace(cfg=cfg), _episodes())
    assert scores.tolist() == [1 - 0.5, 1 - 0.25, 0 - 0.125, 0 - 0.5]
    plain = _cfg(tiny_cfg)
    assert Trainer.score_turns(SimpleNamespace(cfg=plain), _episodes())[2].tolist() == [1.0, 1.0, 0.0, 0.0]


def test_mask_leaves_truncated_turns_out_and_counts_them(tiny_cfg):
    cfg = _cfg(tiny_cfg, **{"algorithm.overlong.mask": True})
    trainer = SimpleNamespace(cfg=cfg)
    turns, keys, scores = Trainer.score_turns(trainer, _episodes())
    advantages = Trainer.advantages(trainer, turns, keys, scores)
    kept, kept_adv, metrics = BatchSelector(cfg).select(turns, keys, scores, advantages)
    assert kept == [turns[1], turns[2]] and kept_adv.tolist() == [advantages[1].item(), advantages[2].item()]
    assert advantages.abs().min().item() > 0  # the masked turns had a signal: masked, not filtered
    assert metrics["agent/Solver/overlong_masked"] == 1.0 and metrics["agent/Verifier/overlong_masked"] == 1.0
    assert metrics["agent/Solver/filtered_share"] == 0.0
    assert metrics["agent/Solver/generated_per_trained_token"] == 13 / 5


def test_overlong_config_errors(tiny_cfg):
    from masrl.errors import ConfigError

    with pytest.raises((ConfigError, ValueError), match="buffer_tokens"):
        _cfg(tiny_cfg, **{"algorithm.overlong.soft_penalty": {"buffer_tokens": 0}})
    from masrl.algorithms import ADVANTAGE_ESTIMATORS, register_advantage

    register_advantage("ds_probe")(lambda scores, groups, **kw: torch.zeros_like(scores))
    try:  # an estimator without a signal grouping: the filter cannot know its dead sets
        with pytest.raises((ConfigError, ValueError), match="register_signal_grouping"):
            _cfg(tiny_cfg, **{"algorithm.estimator": "ds_probe", "algorithm.dynamic_sampling.filter": "role"})
    finally:
        ADVANTAGE_ESTIMATORS.unregister("ds_probe")
