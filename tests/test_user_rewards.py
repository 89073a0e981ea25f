"""User rewards (``task.params.reward: file.py:function``) run under a contract (docs/reliability.md,
"User code: rewards"): a deadline on every call, failures counted per step in metrics.jsonl, a run that
stops with one line (exit 2) when every call of a step fails, non-finite rewards refused and huge ones
clipped, and a module that exits on import or a function with the wrong signature refused at load."""
import json
import logging
import math
import time
import warnings

import pytest
import torch
import yaml

from masrl.cli import main
from masrl.tasks.rewards import resolve_reward
from masrl.types import Episode, Task, Turn

FAST = {"sft.steps": 0, "eval.before_after": False, "trainer.total_steps": 2, "trainer.batch_size": 2,
        "trainer.group_size": 2, "logging.tensorboard": False,
        "logging.plots": False, "logging.progress": False}


@pytest.fixture
def release(tmp_path):
    """A flag file a hanging reward waits for: created at teardown, so the abandoned threads end."""
    flag = tmp_path / "release"
    yield flag
    flag.touch()
    _wait_for_abandoned_calls()


def _wait_for_abandoned_calls(timeout_s=10.0):
    from masrl.usercode.guard import abandoned_calls

    deadline = time.monotonic() + timeout_s
    while abandoned_calls() and time.monotonic() < deadline:
        time.sleep(0.02)


def _tracebacks(caplog) -> int:
    """Log records showing a traceback: attached (a reward run in a thread) or as text (from a reward's process)."""
    return sum(r.exc_info is not None or "Traceback (most recent call last)" in r.getMessage() for r in caplog.records)


def _reward_file(tmp_path, body: str, name="my_reward.py"):
    path = tmp_path / name
    path.write_text(body)
    return f"{path}:reward"


def _run(tmp_path, tiny_cfg, reward: str, *argv, command="train", **over):
    """``masrl COMMAND cfg.yaml`` on a dataset task scored by ``reward``; ``(exit code, stderr lines)``."""
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i}+1", "answer": str(i + 1)}) + "\n" for i in range(6)))
    cfg = tiny_cfg(**{**FAST, "task": {"name": "dataset", "params": {"train": str(data), "test": str(data),
                                                                     "reward": reward}}, **over})
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return main([command, str(path), *map(str, argv)])


def _metrics(tmp_path):
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["phase"] == "train"]


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("masrl:") and "warning" not in line]


# ----------------------------------------------------------------------------- the deadline

HANG = '''
import os, time
FLAG = {flag!r}

def reward(task, episode):
    for turn in episode.turns:
        turn.reward = 5.0
    while not os.path.exists(FLAG):   # a call that does not return (until the test releases it)
        time.sleep(0.02)
    for turn in episode.turns:
        turn.reward = 7.0              # after its deadline: must not reach the real turns
    return 1.0
'''


@pytest.mark.parametrize("isolation", ["process", "thread"])
def test_a_hung_reward_call_returns_at_its_deadline_and_cannot_touch_the_turns(tmp_path, release, isolation):
    from masrl.usercode.guard import GuardedScore

    score = GuardedScore(resolve_reward(_reward_file(tmp_path, HANG.format(flag=str(release))), {}, timeout_s=0.5,
                                        isolation=isolation))
    assert score.score.isolation == isolation
    task = Task("t/1", "q", "1")
    turn = Turn("Solver", "p", [1], [2], [0.0], "x")
    t0 = time.monotonic()
    result = score(task, Episode(task, [turn], 0.0, "1"))
    assert time.monotonic() - t0 < 3
    assert result["reward"] == 0.0 and result["reason"] == "reward_timeout" and "deadline of 0.5 s" in result["detail"]
    counts = score.ledger.take()
    assert (counts.calls, counts.errors, counts.timeouts) == (1, 0, 1)
    if isolation == "process":  # its worker was stopped
        assert score.score.process.proc is None
    release.touch()
    _wait_for_abandoned_calls()
    assert turn.reward is None  # the late call set 5.0, then 7.0, on copies only


@pytest.mark.parametrize("isolation", ["process", "thread"])
def test_a_hung_reward_stops_training_within_a_few_deadlines(tmp_path, tiny_cfg, release, capsys, isolation):
    reward = _reward_file(tmp_path, HANG.format(flag=str(release)))
    t0 = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = _run(tmp_path, tiny_cfg, reward, **{"task.reward_timeout_s": 0.5, "task.reward_isolation": isolation})
    elapsed = time.monotonic() - t0
    errors = _error_lines(capsys.readouterr().err)
    assert code == 2 and len(errors) == 1, errors
    assert "my_reward.py:reward" in errors[0] and "step 1" in errors[0] and "timeout" in errors[0]
    assert elapsed < 30  # at most MAX_ABANDONED deadlines of 0.5 s, then every call is refused at once
    assert _metrics(tmp_path)[-1]["reward/timeouts"] >= 1


# ----------------------------------------------------------------------------- failures

RAISE_ALWAYS = '''
def reward(task, episode):
    return 1 / 0
'''

RAISE_SOMETIMES = '''
CALLS = [0]

def reward(task, episode):
    CALLS[0] += 1
    if CALLS[0] % 2:
        raise KeyError("no such field")
    return 1.0
'''


def test_a_reward_that_always_raises_stops_the_run_with_one_line(tmp_path, tiny_cfg, capsys, caplog):
    reward = _reward_file(tmp_path, RAISE_ALWAYS)
    with caplog.at_level(logging.WARNING), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = _run(tmp_path, tiny_cfg, reward)
    err = capsys.readouterr().err
    errors = _error_lines(err)
    assert code == 2 and len(errors) == 1, err
    line = errors[0]
    assert "my_reward.py:reward failed on" in line and "in step 1" in line
    failed, calls = line.split("failed on ")[1].split(" calls")[0].split(" of ")
    assert failed == calls and int(calls) >= 4
    assert "ZeroDivisionError" in line and "my_reward.py line 3" in line and "fix the function" in line
    assert "Traceback" not in err
    assert _tracebacks(caplog) == 1  # the first failure's traceback, once
    assert _metrics(tmp_path)[-1]["reward/errors"] == int(calls)


def test_a_reward_that_sometimes_raises_is_counted_and_the_run_finishes(tmp_path, tiny_cfg, capsys, caplog):
    reward = _reward_file(tmp_path, RAISE_SOMETIMES, name="sometimes.py")
    with caplog.at_level(logging.WARNING), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code = _run(tmp_path, tiny_cfg, reward)
    assert code == 0, capsys.readouterr().err
    records = _metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert 0 < r["reward/errors"] < r["reward/calls"] and r["reward/timeouts"] == 0
    assert _tracebacks(caplog) == 1
    summaries = [str(w.message) for w in caught if w.category.__name__ == "RewardWarning"]
    assert any("in step 2" in s and "KeyError" in s for s in summaries), summaries


def test_the_error_share_is_configurable(tmp_path, tiny_cfg, capsys):
    reward = _reward_file(tmp_path, RAISE_SOMETIMES, name="sometimes.py")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = _run(tmp_path, tiny_cfg, reward, **{"task.reward_max_error_share": 0.25})
    errors = _error_lines(capsys.readouterr().err)
    assert code == 2 and len(errors) == 1 and "task.reward_max_error_share (now 0.25)" in errors[0], errors


def test_evaluation_reports_reward_errors(tmp_path, tiny_cfg, capsys):
    reward = _reward_file(tmp_path, RAISE_SOMETIMES, name="sometimes.py")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = _run(tmp_path, tiny_cfg, reward, "--n", "2", "--limit", "3", "--out", tmp_path / "ev", command="eval")
    assert code == 0, capsys.readouterr().err
    test = json.loads((tmp_path / "ev" / "eval.json").read_text())["results"]["test"]
    assert 0 < test["reward_errors"] < test["reward_calls"] and test["reward_timeouts"] == 0


# ----------------------------------------------------------------------------- values

HUGE = '''
CALLS = [0]

def reward(task, episode):
    CALLS[0] += 1
    return 1e300 if CALLS[0] == 1 else float(CALLS[0] % 2)
'''

NAN = '''
CALLS = [0]

def reward(task, episode):
    CALLS[0] += 1
    for turn in episode.turns:
        turn.reward = float("nan") if {per_turn} and CALLS[0] % 2 else 0.5
    return float("nan") if not {per_turn} and CALLS[0] % 2 else 1.0
'''


def test_a_huge_finite_reward_is_clipped_and_the_run_finishes(tmp_path, tiny_cfg, capsys):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code = _run(tmp_path, tiny_cfg, _reward_file(tmp_path, HUGE, name="huge.py"))
    assert code == 0, capsys.readouterr().err
    records = _metrics(tmp_path)
    assert all(r["reward/errors"] == 0 for r in records)
    assert all(math.isfinite(r["team/reward"]) and abs(r["team/reward"]) <= 1e6 for r in records)
    clipped = [w for w in caught if "clipped" in str(w.message)]
    assert len(clipped) == 1 and "1e+300" in str(clipped[0].message)


@pytest.mark.parametrize("per_turn", [False, True])
def test_a_nan_reward_is_refused_and_counted(tmp_path, tiny_cfg, capsys, caplog, per_turn):
    reward = _reward_file(tmp_path, NAN.format(per_turn=per_turn), name=f"nan_{per_turn}.py")
    with caplog.at_level(logging.WARNING), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = _run(tmp_path, tiny_cfg, reward, **({"algorithm.reward": "per_turn"} if per_turn else {}))
    assert code == 0, capsys.readouterr().err
    records = _metrics(tmp_path)
    assert all(r["reward/errors"] > 0 for r in records)
    first = next(r.getMessage() for r in caplog.records if "failed on task" in r.getMessage())
    assert "nan, not a finite number" in first
    assert ("turn.reward of turn 0" if per_turn else "the team reward for task") in first


def test_advantages_of_huge_finite_scores_are_normalised():
    scores = torch.tensor([1e300, 0.0, -1e300, 5.0], dtype=torch.float64)
    from masrl.algorithms import compute_advantages

    adv = compute_advantages(scores, group_ids=[0] * 4, agent_ids=["a"] * 4, episode_ids=[0, 1, 2, 3],
                             estimator="drmas")
    small = compute_advantages(scores / 1e299, group_ids=[0] * 4, agent_ids=["a"] * 4, episode_ids=[0, 1, 2, 3],
                               estimator="drmas")
    assert torch.isfinite(adv).all() and torch.allclose(adv, small)
    assert adv[0] > 0.5 and adv[2] < -0.5


# ----------------------------------------------------------------------------- at load

EXITS = '''
import sys
sys.exit(0)

def reward(task, episode):
    return 1.0
'''


@pytest.mark.parametrize("command", ["train", "config"])
@pytest.mark.parametrize("body, needles", [
    (EXITS, ["called sys.exit(0) on import"]),
    ("raise KeyboardInterrupt\n", ["KeyboardInterrupt"]),
    ("def reward(task):\n    return 1.0\n", ["cannot be called as reward(task, episode)", "(task)"]),
    ("def reward(task, episode, scale):\n    return 1.0\n", ["cannot be called as reward(task, episode)"]),
    ("async def reward(task, episode):\n    return 1.0\n", ["async function"]),
    ("reward = 3\n", ["not callable"]),
])
def test_a_reward_that_cannot_load_is_one_line_at_load(tmp_path, tiny_cfg, capsys, command, body, needles):
    reward = _reward_file(tmp_path, body, name="bad_reward.py")
    argv = ["show"] if command == "config" else []
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"question": "1+1", "answer": "2"}) + "\n")
    cfg = tiny_cfg(**{**FAST, "task": {"name": "dataset", "params": {"train": str(data), "reward": reward}}})
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    code = main([command, *argv, str(path)])
    err = capsys.readouterr().err
    errors = _error_lines(err)
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert "bad_reward.py:reward" in errors[0]
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    assert not (tmp_path / "run").exists()


def test_a_builtin_score_is_counted_and_its_first_failure_logged_once(caplog):
    from masrl.usercode.guard import GuardedScore, RewardLedger

    ledger = RewardLedger()
    score = GuardedScore(lambda task, answer: {"reward": 1 / 0}, ledger)
    with caplog.at_level(logging.WARNING):
        results = [score(Task(f"t/{i}", "q", "a"), "x") for i in range(5)]
    assert all(r["reward"] == 0.0 and r["reason"] == "score_error" for r in results)
    assert [r.exc_info is not None for r in caplog.records] == [True]
    counts = ledger.take()
    assert (counts.calls, counts.errors) == (5, 5) and "ZeroDivisionError" in counts.first
    assert ledger.take().calls == 0


TURN_REWARDS = '''
def reward(task, episode):
    turns = list(episode.turns)
    episode.turns.reverse()            # reordering the list does not move rewards between turns
    turns[0].reward = 1e300
    turns[1].reward = -2.0
    return 0.5
'''


def test_turn_rewards_go_back_to_their_turns_and_are_clipped_with_one_warning(tmp_path):
    score = resolve_reward(_reward_file(tmp_path, TURN_REWARDS, name="turns.py"), {}, timeout_s=5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(3):
            task = Task(f"t/{i}", "q", "1")
            turns = [Turn(agent, "p", [1], [2], [0.0], "x") for agent in ("Solver", "Verifier")]
            assert score(task, Episode(task, turns, 0.0, "1"))["reward"] == 0.5
            assert [t.reward for t in turns] == [1e6, -2.0]
    assert len([w for w in caught if "clipped" in str(w.message)]) == 1


@pytest.mark.parametrize("body, needle", [(EXITS, "called sys.exit(0) on import"), ("1 / 0\n", "ZeroDivisionError")])
def test_a_workflow_module_that_fails_on_import_is_one_line(tmp_path, tiny_cfg, capsys, monkeypatch, body, needle):
    (tmp_path / "exiting_flow.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(tiny_cfg(**{**FAST, "workflow.name": "exiting_flow:flow"})))
    code = main(["config", "show", str(path)])
    errors = _error_lines(capsys.readouterr().err)
    assert code == 2 and len(errors) == 1 and "exiting_flow" in errors[0] and needle in errors[0], errors
