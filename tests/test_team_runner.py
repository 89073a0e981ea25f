"""TeamRunner: a tiny team built from a config and evaluated on a benchmark, with no trainer."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from masrl.config import config_from_dict
from masrl.errors import ConfigError
from masrl.team_runner import TeamRunner, check_team, load_tasks
from masrl.types import Task

ROOT = Path(__file__).resolve().parents[1]


def _first_task_right(task, text):
    """Right on arith/test/0 only, whatever the team answers: the summary's numbers are known by hand."""
    right = task.id.endswith("/0")
    return {"reward": 1.0 if right else 0.0, "correct": right, "pred": text}


def test_team_runner_evaluates_a_tiny_team_on_a_bench(tiny_cfg):
    with TeamRunner(config_from_dict(tiny_cfg()), progress=False) as team:
        team.source.score = _first_task_right  # the 'test' bench is scored by the task's own score function
        results = team.evaluate(["test"], ks=[1, 2, 4], n=2, seed=0, limit=3)
        summary = results["test"]
        # 3 tasks x 2 samples; task 0 right both times, tasks 1 and 2 never: avg@n = pass@1 = pass@2 = 1/3
        assert (summary["n_tasks"], summary["n"]) == (3, 2)
        assert summary["avg@n"] == pytest.approx(1 / 3) and summary["pass@1"] == pytest.approx(1 / 3)
        assert summary["pass@2"] == pytest.approx(1 / 3) and "pass@4" not in summary  # k > n is left out
        assert summary["reward_calls"] >= 6 and summary["reward_errors"] == 0

        run, = team.benches(["test"], n=2, seed=0, limit=3)
        assert [t.id for t in run.tasks] == ["arith/test/0", "arith/test/1", "arith/test/2"]
        assert [e.group_id for e in run.episodes] == [0, 0, 1, 1, 2, 2]
        assert [e.correct for e in run.episodes] == [True, True, False, False, False, False]
        again, = team.benches(["test"], n=2, seed=0, limit=3)  # the sampling streams restart from the seed
        texts = [[t.text for t in e.turns] for e in run.episodes]
        assert [[t.text for t in e.turns] for e in again.episodes] == texts
        other, = team.benches(["test"], n=2, seed=1, limit=3, temperature=1.0)
        assert [[t.text for t in e.turns] for e in other.episodes] != texts


def test_fit_skips_tasks_longer_than_the_context_and_refuses_an_empty_bench(tiny_cfg):
    from masrl.ensemble.data import InputError

    with TeamRunner(config_from_dict(tiny_cfg()), progress=False) as team:  # 128 positions
        long = Task(id="long", question="1+" * 200 + "1", answer="201")
        team.source.test = [long, *team.source.test[:2]]
        run, = team.benches(["test"], n=1, seed=0, fit=True)
        assert [t.id for t in run.tasks] == ["arith/test/0", "arith/test/1"] and len(run.episodes) == 2
        assert len(run.skipped) == 1 and run.skipped[0].startswith("long: question of 401 characters")
        team.source.test = [long]
        with pytest.raises(ConfigError, match=r"--bench test: no tasks loaded \(1 skipped: long"):
            next(team.benches(["test"], n=1, seed=0, fit=True))
        team.source.test = []
        with pytest.raises(InputError, match="--bench test: no tasks loaded"):
            next(team.benches(["test"], n=1, seed=0, error=InputError))


def test_check_team_validates_without_loading_data(tiny_cfg, tmp_path):
    missing = tmp_path / "no-such-file.jsonl"
    cfg = config_from_dict(tiny_cfg(**{"task": {"name": "dataset", "params": {"train": str(missing)}}}))
    assert check_team(cfg).agents == ("Solver", "Verifier")  # names and agents only: the file is not read
    with pytest.raises(Exception, match="no-such-file"):
        load_tasks(cfg)
    with pytest.raises(ConfigError, match="workflow.name: .*math_solver_verifier"):
        check_team(config_from_dict(tiny_cfg(**{"workflow.name": "no_such_workflow"})))
    with pytest.raises(ConfigError, match=r"missing \[\] and has unknown \['Critic'\]"):
        check_team(config_from_dict(tiny_cfg(**{"agents.Critic": {"policy": "shared"}})))


def test_commands_that_run_a_team_do_not_import_the_trainer():
    """masrl eval, ensemble collect and serve (and the runner itself) load without masrl.trainer."""
    code = ("import sys, masrl.evaluate, masrl.ensemble.collect, masrl.ensemble.cli, masrl.serve, masrl.team_runner; "
            "print(sorted(m for m in sys.modules if m == 'masrl.trainer'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT / "src")),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
