"""algorithm.role_stages: groups of agents take turns at training (staged updates, a remedy for capture of a
shared policy by the role with the most gradient mass: docs/algorithms.md)."""
import pytest

from masrl.config import config_from_dict
from masrl.errors import ConfigError
from masrl.monitoring.logger import read_metrics
from masrl.trainer import Trainer, role_stage, training_agents


def _cfg(tiny_cfg, **over):
    return config_from_dict(tiny_cfg(**{"sft.steps": 4, "eval.before_after": False, "logging.plots": False,
                                        "logging.tensorboard": False, **over}))


@pytest.mark.parametrize("stages, needle", [
    ([["Solver"], ["Critic"]], "names unknown agents ['Critic']"),
    ([["Solver"]], "leaves agents ['Verifier'] out of every stage"),
    ([["Solver", "Verifier"], []], "non-empty lists"),
    ([], "non-empty lists"),
])
def test_stages_must_name_every_agent_and_only_agents(tiny_cfg, stages, needle):
    with pytest.raises((ConfigError, ValueError), match=needle.replace("[", r"\[").replace("]", r"\]")):
        _cfg(tiny_cfg, **{"algorithm.role_stages": stages})


def test_the_schedule_cycles_through_the_groups(tiny_cfg):
    algo = _cfg(tiny_cfg, **{"algorithm.role_stages": [["Solver"], ["Verifier"], ["Solver", "Verifier"]],
                             "algorithm.role_stage_steps": 2}).algorithm
    assert [role_stage(algo, step) for step in range(1, 9)] == [0, 0, 1, 1, 2, 2, 0, 0]
    assert training_agents(algo, 3) == {"Verifier"} and training_agents(algo, 5) == {"Solver", "Verifier"}
    plain = _cfg(tiny_cfg).algorithm
    assert role_stage(plain, 1) is None and training_agents(plain, 1) is None


def test_each_step_trains_only_its_groups_turns(tiny_cfg, monkeypatch):
    cfg = _cfg(tiny_cfg, **{"algorithm.role_stages": [["Solver"], ["Verifier"]], "trainer.total_steps": 2})
    seen = []
    with Trainer(cfg, progress=False) as trainer:
        real = trainer.runtime.update

        def recording(policies, rows, **kwargs):
            seen.append(sorted({r.agent for prows in rows.values() for r in prows}))
            return real(policies, rows, **kwargs)

        monkeypatch.setattr(trainer.runtime, "update", recording)
        trainer.fit()
    assert seen == [["Solver"], ["Verifier"]]
    train = [r for r in read_metrics(cfg.run_dir) if r["phase"] == "train"]
    assert [r["train/role_stage"] for r in train] == [0.0, 1.0]
    # the per-agent gradient norm of the shared policy is logged for the agent that trained, not the other
    assert "agent/Solver/grad_norm" in train[0] and "agent/Verifier/grad_norm" not in train[0]
    assert "agent/Verifier/grad_norm" in train[1] and "agent/Solver/grad_norm" not in train[1]
    # both agents still play and are scored every step
    assert all(r["agent/Solver/turns"] > 0 and r["agent/Verifier/turns"] > 0 for r in train)
