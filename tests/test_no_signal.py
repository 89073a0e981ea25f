"""Steps without a learning signal (masrl.monitoring.signal): every advantage 0 for ``patience`` steps warns (or, with
``action: stop``, ends the run with exit 2); a run whose every RL step scored 0 ends with a warning and says so in
report.json / report.md; the per-step shares are logged; the state survives a resume."""
import json
import warnings

import pytest
import torch
import yaml

from masrl.cli import main
from masrl.monitoring.signal import NoSignalWarning, SignalMonitor
from masrl.types import Episode, Task


def _episodes(rewards_by_group):
    task = Task(id="t", question="1+1", answer="2")
    return [Episode(task=task, turns=[], reward=r, group_id=g)
            for g, rewards in enumerate(rewards_by_group) for r in rewards]


def test_shares_of_flat_groups_and_zero_advantages():
    mon = SignalMonitor(patience=2)
    metrics = mon.update(1, _episodes([[0.0, 0.0], [1.0, 0.0], [1.0, 1.0]]),
                         torch.tensor([0.0, 0.0, 0.7, -0.7, 0.0, 0.0, 0.0, 0.0]))
    assert metrics == {"team/flat_group_share": 2 / 3, "team/zero_advantage_share": 6 / 8}
    assert mon.no_signal_steps == 0 and mon.zero_reward_steps == 0 and not mon.warnings


def test_patience_steps_without_signal_warn_once_per_run_of_them():
    mon = SignalMonitor(patience=2)
    zero, flat = _episodes([[0.0, 0.0], [0.0, 0.0]]), torch.zeros(4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mon.update(1, zero, flat)
        assert not caught  # one step is not yet patience
        mon.update(2, zero, flat)
        mon.update(3, zero, flat)  # the same run of steps: no second warning
        mon.update(4, _episodes([[1.0, 0.0], [0.0, 0.0]]), torch.tensor([0.7, -0.7, 0.0, 0.0]))  # signal again
        mon.update(5, _episodes([[1.0, 1.0], [1.0, 1.0]]), flat)
        mon.update(6, _episodes([[1.0, 1.0], [0.5, 0.5]]), flat)
    messages = [str(w.message) for w in caught if w.category is NoSignalWarning]
    assert len(messages) == 2, messages
    assert "steps 1-2" in messages[0] and "every episode's team reward was 0" in messages[0]
    assert "task.params.reward" in messages[0] and "monitoring.no_signal" in messages[0]
    assert "steps 5-6" in messages[1] and "scored the same team reward (values seen: 0.5, 1)" in messages[1]
    assert mon.summary() == {"action": "log", "patience": 2, "steps": 6, "no_signal_steps": 5, "zero_reward_steps": 3}
    assert mon.final_warning() is None  # steps 4-6 had rewards other than 0


def test_stop_asks_to_end_the_run_after_patience_steps_only():
    mon = SignalMonitor(action="stop", patience=3)
    for step in (1, 2):
        mon.update(step, _episodes([[0.0, 0.0]]), torch.zeros(2))
        assert mon.stop_message is None
    mon.update(3, _episodes([[0.0, 0.0]]), torch.zeros(2))
    assert "no learning signal for 3 RL steps (steps 1-3)" in mon.stop_message
    assert mon.final_warning().startswith("every episode of all 3 RL steps scored a team reward of 0")
    with pytest.raises(ValueError, match="action"):
        SignalMonitor(action="rollback")


def test_state_round_trips():
    mon = SignalMonitor(patience=4)
    for step in (1, 2):
        mon.update(step, _episodes([[0.0, 0.0]]), torch.zeros(2))
    again = SignalMonitor(patience=4)
    again.load_state_dict(json.loads(json.dumps(mon.state_dict())))
    assert again.state_dict() == mon.state_dict() == {"streak": [1, 2], "no_signal_steps": 2,
                                                       "zero_reward_steps": 2, "steps": 2}


FAST = {"sft.steps": 0, "eval.before_after": False, "trainer.total_steps": 3, "trainer.batch_size": 2,
        "trainer.group_size": 2, "logging.tensorboard": False, "logging.plots": False, "logging.progress": False,
        "monitoring.no_signal.patience": 2}


def _train(tmp_path, tiny_cfg, **over):
    """``masrl train`` on a dataset task whose reward is 0 for every answer."""
    (tmp_path / "zero.py").write_text("def reward(task, episode):\n    return 0.0\n")
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i}+1", "answer": str(i + 1)}) + "\n" for i in range(6)))
    cfg = tiny_cfg(**{**FAST, "task": {"name": "dataset", "params": {
        "train": str(data), "test": str(data), "reward": f"{tmp_path / 'zero.py'}:reward"}}, **over})
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return main(["train", str(path)])


def _train_records(run_dir):
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["phase"] == "train"]


def test_a_run_whose_rewards_are_all_zero_does_not_end_silently(tmp_path, tiny_cfg, capsys):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _train(tmp_path, tiny_cfg) == 0
    messages = [str(w.message) for w in caught if w.category is NoSignalWarning]
    assert len(messages) == 2, messages
    assert messages[0].startswith("no learning signal for 2 RL steps (steps 1-2): every episode's team reward was 0")
    assert messages[1].startswith("every episode of all 3 RL steps scored a team reward of 0")
    run = tmp_path / "run"
    records = _train_records(run)
    assert [r["team/flat_group_share"] for r in records] == [1.0, 1.0, 1.0]
    assert [r["team/zero_advantage_share"] for r in records] == [1.0, 1.0, 1.0]
    report = json.loads((run / "report.json").read_text())
    assert report["no_signal"] == {"action": "log", "patience": 2, "steps": 3, "no_signal_steps": 3,
                                   "zero_reward_steps": 3}
    assert "no learning signal (every advantage 0) in 3 of 3 RL steps; every episode" in (run / "report.md").read_text()


def test_action_stop_ends_the_run_with_one_line_after_logging_the_step(tmp_path, tiny_cfg, capsys):
    code = _train(tmp_path, tiny_cfg, **{"monitoring.no_signal.action": "stop"})
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("masrl: error:")]
    assert code == 2 and len(errors) == 1, errors
    assert "no learning signal for 2 RL steps (steps 1-2)" in errors[0] and "action: stop" in errors[0]
    assert [r["step"] for r in _train_records(tmp_path / "run")] == [1, 2]  # step 2 logged, step 3 never run
