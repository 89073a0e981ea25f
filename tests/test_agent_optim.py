"""agents.<A>.optim: per-agent AdamW settings for one-LoRA-adapter-per-role policies (parameter groups)."""
import pytest
import torch

from masrl.config import ConfigError, config_from_dict
from masrl.models.lora import adapter_parameters
from masrl.training import checkpoint as ckpt
from masrl.training.trainer import Trainer


def _cfg(tiny_cfg, tmp_path):
    return config_from_dict(tiny_cfg(**{
        "sft.steps": 0, "policies.shared.lora": {"r": 4, "alpha": 8.0, "per_agent": True},
        "policies.shared.optim": {"lr": 1e-3, "weight_decay": 0.0, "grad_clip": None},
        "agents.Solver.optim": {"lr": 1e-2}, "agents.Verifier.optim": {"lr": 1e-4, "betas": [0.8, 0.99]}}))


def test_two_adapters_move_by_their_own_learning_rates(tiny_cfg, tmp_path):
    cfg = _cfg(tiny_cfg, tmp_path)
    with Trainer(cfg, progress=False) as trainer:
        policy = trainer.policies["shared"]
        groups = {g["name"]: g for g in policy.optimizer.param_groups}
        assert set(groups) == {"agent/Solver", "agent/Verifier"}  # every trainable parameter is an adapter's
        assert groups["agent/Solver"]["lr"] == 1e-2 and groups["agent/Solver"]["betas"] == (0.9, 0.999)
        assert groups["agent/Verifier"]["lr"] == 1e-4 and groups["agent/Verifier"]["betas"] == (0.8, 0.99)
        before = {a: [p.detach().clone() for p in adapter_parameters(policy.model, a)] for a in ("Solver", "Verifier")}
        episodes = trainer.rollout(trainer.source.train[:4], [0, 1, 2, 3], seed=1)
        turns, _, _ = trainer.score_turns(episodes)
        advantages = torch.tensor([1.0 if i % 2 else -1.0 for i in range(len(turns))])
        assert {t.agent for t in turns} == {"Solver", "Verifier"}
        trainer.update(turns, advantages)
        moved = {a: max((p.detach() - b).abs().max().item() for p, b in zip(adapter_parameters(policy.model, a), bs))
                 for a, bs in before.items()}
        # AdamW's first step moves each parameter with a nonzero gradient by lr (m/sqrt(v) = sign(g))
        assert moved["Solver"] == pytest.approx(1e-2, rel=1e-3)
        assert moved["Verifier"] == pytest.approx(1e-4, rel=1e-3)
        path = trainer.save(1)
    with Trainer(cfg, progress=False) as again:  # the groups survive a checkpoint round trip
        ckpt.load_checkpoint(path, again.policies)
        assert [g["lr"] for g in again.policies["shared"].optimizer.param_groups] == [1e-2, 1e-4]


def test_agent_optim_needs_an_adapter_of_its_own(tiny_cfg):
    with pytest.raises(ConfigError, match=r"agents.Solver.optim needs parameters of its own.*lora.per_agent"):
        config_from_dict(tiny_cfg(**{"agents.Solver.optim": {"lr": 1e-2}}))
