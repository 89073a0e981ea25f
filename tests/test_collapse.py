"""The collapse detector (masrl.monitoring.collapse): hand-computed breaches, bands in both directions, the
floors, patience and re-arming, resume state, and the trainer's log / stop / rollback actions."""
import json

import pytest
import torch

from masrl.config import config_from_dict
from masrl.monitoring.collapse import CollapseMonitor, replay
from masrl.trainer import Trainer
from masrl.training import checkpoint as ckpt


def _feed(monitor, rows, start=1):
    events = []
    for i, row in enumerate(rows, start):
        events += monitor.update(i, row)
    return events


def test_reward_drop_against_the_median_of_accepted_steps():
    m = CollapseMonitor(["A"], min_history=2, patience=2, reward_drop=0.5)
    rows = [{"team/reward": r} for r in (0.4, 0.3, 0.5, 0.1, 0.12, 0.2)]
    events = _feed(m, rows)
    # baseline after steps 1-3: median(0.4, 0.3, 0.5) = 0.4; 0.1 and 0.12 < 0.2 breach (steps 4, 5) -> event at 5;
    # the breaching values stay out of the window, so step 6 (0.2, not < 0.2) is judged against 0.4 still
    assert [(e.signal, e.first_breach, e.step, e.value, e.baseline) for e in events] == [
        ("team/reward", 4, 5, 0.12, 0.4)]
    assert list(m.history["team/reward"]) == [0.4, 0.3, 0.5, 0.2]


def test_patience_rearm_and_one_event_per_run_of_breaches():
    m = CollapseMonitor(["A"], min_history=1, patience=2)
    rows = [{"team/reward": r} for r in (0.5, 0.1, 0.1, 0.1, 0.5, 0.1, 0.5, 0.1, 0.1)]
    events = _feed(m, rows)
    assert [(e.first_breach, e.step) for e in events] == [(2, 3), (8, 9)]  # step 6 alone: no event


def test_reward_floor_length_band_entropy_floor_and_invalid_rise():
    m = CollapseMonitor(["A"], min_history=1, patience=1, reward_floor=0.05, length_ratio=1.5, entropy_ratio=1.5,
                        entropy_floor=0.05, invalid_rise=0.2)
    assert not m.breaches("team/reward", 0.0, 0.04)           # a team that earns nothing has nothing to lose
    assert m.breaches("team/reward", 0.02, 0.05)
    assert m.breaches("agent/A/length_mean", 15.1, 10) and m.breaches("agent/A/length_mean", 6.6, 10)
    assert not m.breaches("agent/A/length_mean", 15.0, 10) and not m.breaches("agent/A/length_mean", 6.7, 10)
    assert not m.breaches("agent/A/entropy", 0.07, 0.03)       # 2.3x, but only +0.04 nats
    assert m.breaches("agent/A/entropy", 0.20, 0.10) and not m.breaches("agent/A/entropy", 0.149, 0.10)
    assert m.breaches("agent/A/invalid_rate", 0.31, 0.1) and not m.breaches("agent/A/invalid_rate", 0.29, 0.1)
    events = _feed(m, [{"agent/A/length_mean": 10.0, "agent/A/entropy": float("nan")},
                       {"agent/A/length_mean": 30.0}])
    assert [(e.signal, e.step) for e in events] == [("agent/A/length_mean", 2)]


def test_state_dict_resumes_exactly():
    rows = [{"team/reward": r, "agent/A/length_mean": n} for r, n in
            zip((0.4, 0.3, 0.5, 0.1, 0.12, 0.5, 0.1, 0.1), (10, 11, 10, 30, 31, 10, 10, 10))]
    whole = CollapseMonitor(["A"])
    expected = _feed(whole, rows)
    first = CollapseMonitor(["A"])
    _feed(first, rows[:4])
    state = json.loads(json.dumps(first.state_dict()))  # as the checkpoint stores it
    second = CollapseMonitor(["A"])
    second.load_state_dict(state)
    _feed(second, rows[4:], start=5)
    assert second.events == expected and second.state_dict() == whole.state_dict()
    assert replay([{"step": i, "phase": "train", **r} for i, r in enumerate(rows, 1)], ["A"]) == expected


def _run(tiny_cfg, monkeypatch, action, **over):
    """A tiny run whose team reward breaches from step 2 on (forced: the trainer's actions are under test)."""
    real = CollapseMonitor.update

    def update(self, step, metrics):
        metrics = dict(metrics)
        if step >= 2:
            metrics["team/reward"] = -1.0
        else:
            metrics["team/reward"] = 1.0
        return real(self, step, metrics)

    monkeypatch.setattr(CollapseMonitor, "update", update)
    cfg = config_from_dict(tiny_cfg(**{"sft.steps": 0, "trainer.total_steps": 5, "trainer.batch_size": 2,
                                       "trainer.group_size": 2, "eval.limit": 2, "logging.plots": False,
                                       "monitoring.collapse.action": action, "monitoring.collapse.min_history": 1,
                                       **over}))
    with Trainer(cfg) as trainer:
        report = trainer.fit()
    rows = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    return cfg, trainer, report, rows


def test_log_action_trains_every_step_and_logs_the_event(tiny_cfg, monkeypatch):
    cfg, trainer, report, rows = _run(tiny_cfg, monkeypatch, "log")
    train = [r for r in rows if r["phase"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5]
    assert [r["step"] for r in train if r.get("collapse/team/reward") == 1.0] == [3]
    assert report["collapse"]["events"][0] == {"signal": "team/reward", "step": 3, "first_breach": 2,
                                               "value": -1.0, "baseline": 1.0}
    assert "step 3: collapse signal team/reward" in (cfg.run_dir / "report.md").read_text()


def test_stop_action_ends_rl_after_the_event(tiny_cfg, monkeypatch, capsys):
    cfg, trainer, report, rows = _run(tiny_cfg, monkeypatch, "stop")
    assert trainer.step == 3 and report["steps"] == 3
    assert [r["step"] for r in rows if r["phase"] == "train"] == [1, 2, 3]
    assert any(r["phase"] == "eval" and r["step"] == 3 for r in rows)  # the final evaluation still runs
    assert [p.name for p in ckpt.list_checkpoints(cfg.run_dir)][-1] == "step_3"
    assert "RL ends at step 3 of 5" in capsys.readouterr().err


def test_rollback_restores_the_last_checkpoint_before_the_first_breach(tiny_cfg, monkeypatch, capsys):
    cfg, trainer, report, rows = _run(tiny_cfg, monkeypatch, "rollback", **{"trainer.save_every": 1})
    assert trainer.step == 3 and report["collapse"]["rolled_back_to"] == 1
    assert "rolled back to the weights of step 1" in capsys.readouterr().err
    saved = {p.name for p in ckpt.list_checkpoints(cfg.run_dir)}
    assert "step_1" in saved
    reference = Trainer(cfg)
    ckpt.load_checkpoint(cfg.run_dir / "checkpoints" / "step_1", reference.policies, load_optimizer=False)
    mine, theirs = ckpt.trainable_state(trainer.policies["shared"]), ckpt.trainable_state(reference.policies["shared"])
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    step2 = ckpt.trainable_state(Trainer(cfg).policies["shared"])  # a fresh model differs: the check can fail
    assert not all(torch.equal(mine[k], step2[k]) for k in mine)


def test_bad_action_is_a_config_error(tiny_cfg):
    with pytest.raises(Exception, match="monitoring.collapse.action"):
        config_from_dict(tiny_cfg(**{"monitoring.collapse.action": "panic"}))


def test_a_resumed_monitor_stops_only_on_a_new_event():
    m = CollapseMonitor(["A"], action="stop", min_history=1, patience=1)
    _feed(m, [{"team/reward": 0.5}, {"team/reward": 0.1}])
    assert m.stop_requested and m.first_breach() == 2
    resumed = CollapseMonitor(["A"], action="stop", min_history=1, patience=1)
    resumed.load_state_dict(json.loads(json.dumps(m.state_dict())))
    assert not resumed.stop_requested and len(resumed.events) == 1
    _feed(resumed, [{"team/reward": 0.5}, {"team/reward": 0.5}, {"team/reward": 0.1}], start=3)
    assert resumed.stop_requested and resumed.first_breach() == 5


def test_rollback_with_rollouts_ahead_serves_the_restored_weights(tiny_cfg, monkeypatch, capsys):
    """Under ``rollout.max_staleness`` the engines decode with copies of the weights: after a rollback the copy
    (which the final evaluation decodes with) holds the restored checkpoint, and the producer is stopped."""
    cfg, trainer, report, rows = _run(tiny_cfg, monkeypatch, "rollback",
                                      **{"trainer.save_every": 1, "rollout.max_staleness": 1})
    assert trainer.step == 3 and report["collapse"]["rolled_back_to"] == 1
    assert trainer.ahead.closed and not trainer.ahead.thread.is_alive()
    reference = Trainer(cfg)
    ckpt.load_checkpoint(cfg.run_dir / "checkpoints" / "step_1", reference.policies, load_optimizer=False)
    restored = reference.policies["shared"].model.state_dict()
    served = trainer.policies["shared"].engine.inner.model.state_dict()
    assert served.keys() == restored.keys() and all(torch.equal(served[k], restored[k]) for k in served)
