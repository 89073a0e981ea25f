"""End to end on CPU: SFT + 2 RL steps of a two-agent team, shared and separate policies; resume."""
import json
import math

import pytest
import torch
from safetensors.torch import load_file

from masrl.config import config_from_dict
from masrl.trainer import Trainer
from masrl.training.checkpoint import list_checkpoints


def _records(run_dir, phase="train"):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["phase"] == phase]


@pytest.mark.parametrize("mapping", ["shared", "separate"])
def test_two_agent_team_trains_and_writes_run_folder(tiny_cfg, tmp_path, mapping):
    data = tiny_cfg()
    if mapping == "separate":
        small = data["policies"]["shared"]
        data["policies"] = {"solver": dict(small), "verifier": {**small, "optim": {"lr": 5e-4}}}
        data["agents"]["Solver"]["policy"] = "solver"
        data["agents"]["Verifier"]["policy"] = "verifier"
    for pol in data["policies"].values():
        pol["optim"]["weight_decay"] = 0.0  # no parameter moves without a gradient
    cfg = config_from_dict(data)
    Trainer(cfg).fit()
    ckpts = cfg.run_dir / "checkpoints"
    for name in cfg.policies:  # step_0 is saved right after SFT, step_2 after RL
        before = load_file(str(ckpts / "step_0" / "policies" / name / "model.safetensors"))
        after = load_file(str(ckpts / "step_2" / "policies" / name / "model.safetensors"))
        changed = sum(not torch.equal(before[k], after[k]) for k in before)
        assert changed > 0, f"policy {name} did not change during RL"
    records = _records(cfg.run_dir)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        for key, value in r.items():
            if isinstance(value, float):
                assert math.isfinite(value), key
        assert "agent/Solver/grad_norm" in r and "agent/Verifier/reward_mean" in r
    moved = [r for r in records if max(r.get(f"policy/{p}/grad_norm", 0.0) for p in cfg.policies) > 0]
    assert moved, "no RL step had a non-zero gradient"
    if mapping == "shared":  # per-agent shares of the shared policy's gradient norm add up to 1
        assert any(r["agent/Solver/grad_share"] > 0 for r in moved)
        for r in moved:
            assert abs(r["agent/Solver/grad_share"] + r["agent/Verifier/grad_share"] - 1) < 1e-6
    run = cfg.run_dir
    for rel in ["config.yaml", "report.md", "report.json", "plots/training_curves.png", "checkpoints/step_2"]:
        assert (run / rel).exists(), rel
    assert list((run / "tensorboard").iterdir())
    report = json.loads((run / "report.json").read_text())
    assert {"sft", "final"} <= set(report["eval"]) and "pass@2" in report["eval"]["final"]


def test_resume_reproduces_uninterrupted_run(tiny_cfg, tmp_path):
    full = config_from_dict(tiny_cfg(**{"trainer.total_steps": 3, "output_dir": str(tmp_path / "full")}))
    Trainer(full).fit()
    part = config_from_dict(tiny_cfg(**{"trainer.total_steps": 2, "output_dir": str(tmp_path / "part")}))
    Trainer(part).fit()
    part.trainer.total_steps = 3
    Trainer(part).fit(resume=True)
    a = {r["step"]: r for r in _records(tmp_path / "full")}
    b = {r["step"]: r for r in _records(tmp_path / "part")}
    assert sorted(b) == [1, 2, 3]
    for step in (1, 2, 3):
        for key, value in a[step].items():
            if key.startswith(("team/", "agent/", "policy/")):
                assert b[step][key] == pytest.approx(value, rel=1e-5, abs=1e-7), (step, key)


def test_new_run_refuses_a_used_run_folder(tiny_cfg):
    cfg = config_from_dict(tiny_cfg(**{"trainer.total_steps": 1, "sft.steps": 0, "eval.before_after": False}))
    Trainer(cfg).fit()
    with pytest.raises(ValueError, match="already holds a run"):
        Trainer(cfg).fit()
    Trainer(cfg).fit(overwrite=True)  # starts over: one record per step, no mixing
    assert [r["step"] for r in _records(cfg.run_dir)] == [1]


def test_isolated_lora_policies_train_in_one_mixed_step(tiny_cfg, tmp_path):
    """Isolated-Policy: one adapter per agent over a frozen base, one optimizer step per RL step.

    The tiny base starts random, so SFT trains it (sft.train_base); RL must leave it untouched.
    """
    data = tiny_cfg(**{"trainer.total_steps": 2, "algorithm.loss.kl_coef": 0.01, "sft.train_base": True})
    data["policies"]["shared"]["lora"] = {"r": 4, "alpha": 8, "per_agent": True,
                                          "target_modules": ["q_proj", "v_proj"]}
    data["policies"]["shared"]["optim"]["weight_decay"] = 0.0
    cfg = config_from_dict(data)
    Trainer(cfg).fit()
    ckpts = cfg.run_dir / "checkpoints"
    after_sft = load_file(str(ckpts / "step_0" / "policies" / "shared" / "model.safetensors"))
    after_rl = load_file(str(ckpts / "step_2" / "policies" / "shared" / "model.safetensors"))
    assert set(after_sft) == set(after_rl)
    base = [k for k in after_sft if "lora_" not in k]
    lora = [k for k in after_sft if "lora_" in k]
    assert base and all(torch.equal(after_sft[k], after_rl[k]) for k in base), "RL changed the frozen base"
    for agent in ("Solver", "Verifier"):
        assert any(f".{agent}." in k for k in lora)
    assert any(not torch.equal(after_sft[k], after_rl[k]) for k in lora)
    records = _records(cfg.run_dir)
    assert all(math.isfinite(r["agent/Verifier/kl_ref"]) for r in records)
    assert any(r["agent/Solver/grad_norm"] > 0 for r in records)
    cfg.trainer.total_steps = 3  # resume restores the SFT-trained base and the adapters
    Trainer(cfg).fit(resume=True)
    assert [r["step"] for r in _records(cfg.run_dir)] == [1, 2, 3]


def test_per_role_monitoring_metrics_are_logged(tiny_cfg):
    cfg = config_from_dict(tiny_cfg(**{"monitoring.kl_to_base": True}))
    Trainer(cfg).fit()
    records = _records(cfg.run_dir)
    for agent in ("Solver", "Verifier"):
        for metric in ("chi2_drift", "token_concentration", "perplexity", "hedge_rate", "kl_ref", "length_p95"):
            assert math.isfinite(records[-1][f"agent/{agent}/{metric}"]), (agent, metric)
    assert records[0]["agent/Solver/chi2_drift"] == 0.0  # step 0 is the reference
    assert "agent/Verifier/verdict_accuracy" in records[-1]


def test_group_by_slot_separates_parallel_same_role_agents(tiny_cfg):
    from masrl.types import Turn

    trainer = Trainer(config_from_dict(tiny_cfg(**{"algorithm.group_by": "slot"})))
    turns = [Turn("Solver", "shared", [], [1], [0.0], "", info={"slot": s}) for s in (0, 1, 0, 1)]
    keys = [(0, 0), (0, 0), (0, 1), (0, 1)]
    for i, t in enumerate(turns):
        t.turn_index = i % 2
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0])
    by_slot = trainer.advantages(turns, keys, scores)
    assert by_slot[1] == 0 and by_slot[3] == 0  # slot 1 scored 0 in both episodes: no signal
    trainer.cfg.algorithm.group_by = "agent"
    pooled = trainer.advantages(turns, keys, scores)
    assert pooled[1] < 0  # pooled with slot 0's success, slot 1's failure is below the mean


def test_tensorboard_shows_each_step_once_after_a_resume(tiny_cfg, tmp_path):
    """A crash after step 3 was logged but before its checkpoint: the resumed run redoes step 3, and
    TensorBoard (which keeps every event file) shows it once; SFT points live in their own run."""
    import shutil

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = config_from_dict(tiny_cfg(**{"trainer.total_steps": 3, "trainer.save_every": 2, "sft.steps": 12,
                                       "eval.before_after": False, "logging.plots": False}))
    Trainer(cfg).fit()
    shutil.rmtree(cfg.run_dir / "checkpoints" / "step_3")  # as if the process died before saving it
    Trainer(cfg).fit(resume=True)
    rl = EventAccumulator(str(cfg.run_dir / "tensorboard"))
    rl.Reload()
    assert [e.step for e in rl.Scalars("team/reward")] == [1, 2, 3]
    sft = EventAccumulator(str(cfg.run_dir / "tensorboard" / "sft"))
    sft.Reload()
    assert [e.step for e in sft.Scalars("sft/shared/loss")] == [0, 10, 11]


@pytest.mark.parametrize("save_every", [1, 0])
def test_resuming_a_finished_run_logs_no_second_final_evaluation(tiny_cfg, save_every):
    """save_every 1: the last checkpoint is saved before the final evaluation (it is redone, its record
    replaced); 0: after it (kept). Either way metrics.jsonl holds one final evaluation record."""
    cfg = config_from_dict(tiny_cfg(**{"trainer.total_steps": 2, "sft.steps": 0, "trainer.save_every": save_every}))
    Trainer(cfg).fit()
    Trainer(cfg).fit(resume=True)
    evals = [r["step"] for r in _records(cfg.run_dir, "eval")]
    assert evals == [0, 2], evals


def test_checkpoints_are_saved_periodically_by_default(tiny_cfg):
    """trainer.save_every defaults to 10: a run killed midway keeps its RL; the newest 2 are kept."""
    cfg = config_from_dict(tiny_cfg(**{"trainer.total_steps": 11, "trainer.batch_size": 1, "trainer.group_size": 2,
                                       "sft.steps": 0, "eval.before_after": False, "logging.plots": False}))
    assert cfg.trainer.save_every == 10 and cfg.trainer.keep_checkpoints == 2
    saved = []
    with Trainer(cfg) as trainer:
        real_save = trainer.save
        trainer.save = lambda step: saved.append(step) or real_save(step)
        trainer.fit()
    assert saved == [0, 10, 11]
    assert [p.name for p in list_checkpoints(cfg.run_dir)] == ["step_10", "step_11"]
