"""`masrl config show` and `masrl train` run one start-time check (`masrl.cli.check_before_build`): what one
refuses, the other refuses, with exit 2 and one line, before any model is built: a workflow's params (the
external workflow's timeout, port, entry / command), and every path derived from the config's names (a
component over the filesystem's NAME_MAX, a path over PATH_MAX, a control character)."""
from __future__ import annotations

import pytest
import yaml

from masrl.cli import main


def _write(tmp_path, data):
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _external(tiny_cfg, tmp_path):
    (tmp_path / "prog.py").write_text("def run(task, client_kwargs):\n    return 'x'\n")
    return tiny_cfg(**{"workflow": {"name": "external", "params": {"entry": f"{tmp_path / 'prog.py'}:run"}}})


def _both_refuse(tmp_path, path, overrides, capsys) -> str:
    """``config show`` and ``train`` with ``overrides``: both exit 2 with the same one line, and train built
    nothing (no run folder under ``tmp_path``)."""
    assert main(["config", "show", str(path), *overrides]) == 2
    shown = capsys.readouterr()
    assert shown.out == "" and len(shown.err.strip().splitlines()) == 1, shown.err
    assert main(["train", str(path), *overrides]) == 2
    assert capsys.readouterr().err == shown.err
    assert {p.name for p in tmp_path.iterdir()} <= {"cfg.yaml", "prog.py"}
    return shown.err


@pytest.mark.parametrize("overrides, says", [
    (["workflow.params.timeout_s=-1"], "workflow.params.timeout_s must be a number of seconds"),
    (["workflow.params.port=99999"], "workflow.params.port must be an integer in 0..65535"),
    (["workflow.params.command=python prog.py"], "set exactly one of workflow.params.entry"),
    (["workflow.params.bogus=1"], "unknown param(s) ['bogus']"),
])
def test_a_workflows_params_are_refused_by_config_show_as_by_train(tmp_path, tiny_cfg, capsys, overrides, says):
    path = _write(tmp_path, _external(tiny_cfg, tmp_path))
    assert says in _both_refuse(tmp_path, path, overrides, capsys)


def test_a_built_in_workflows_unknown_param_is_refused_at_start(tmp_path, tiny_cfg, capsys):
    path = _write(tmp_path, tiny_cfg(**{"workflow": {"name": "single"}, "agents": {"Solver": {"policy": "shared", "max_new_tokens": 8}}}))
    assert "unknown param(s) ['max_loop']" in _both_refuse(tmp_path, path, ["workflow.params.max_loop=3"], capsys)


def test_a_good_external_config_is_shown(tmp_path, tiny_cfg, capsys):
    assert main(["config", "show", str(_write(tmp_path, _external(tiny_cfg, tmp_path)))]) == 0
    assert "entry:" in capsys.readouterr().out


@pytest.mark.parametrize("override, says", [
    ("name=" + "r" * 300, "is 3"),  # a run name that makes the folder's name longer than NAME_MAX (255)
    ("output_dir={root}/" + "/".join(["d" * 200] * 20), "passes this filesystem's limit"),  # PATH_MAX
    ("name=a\tb", "control character"),
], ids=["name-over-NAME_MAX", "output_dir-over-PATH_MAX", "control-character"])
def test_a_path_that_cannot_exist_is_refused_at_start(tmp_path, tiny_cfg, capsys, override, says):
    """Before: `config show` accepted the run name and `train` died with `OSError: [Errno 36]` (exit 1)."""
    path = _write(tmp_path, tiny_cfg(**{"output_dir": str(tmp_path / "runs" / "{name}-seed{seed}")}))
    err = _both_refuse(tmp_path, path, [override.replace("{root}", str(tmp_path))], capsys)
    assert says in err and "Errno" not in err


def test_a_policy_name_that_cannot_name_its_checkpoint_folder_is_refused(tmp_path, tiny_cfg, capsys):
    data = tiny_cfg()
    long = "p" * 300
    data["policies"] = {long: data["policies"]["shared"]}
    data["agents"] = {a: {**c, "policy": long} for a, c in data["agents"].items()}
    err = _both_refuse(tmp_path, _write(tmp_path, data), [], capsys)
    assert "policies.ppp" in err and "allows 255 per name" in err


def _search(tiny_cfg, task):
    agents = {a: {"policy": "shared", "max_new_tokens": 8} for a in ("Verifier", "Search", "Answer")}
    return tiny_cfg(**{"workflow": {"name": "search_verifier_router"}, "task": task, "agents": agents})


def test_the_start_check_knows_which_workflow_params_the_task_supplies(tmp_path, tiny_cfg, capsys):
    """A task declares the workflow params it hands the workflow (``register_task(..., supplies=...)``): a search
    workflow on a task that supplies no retriever, and an environment workflow on a task that is no environment,
    are one line at start; a task that supplies the retriever (synthetic_kb) passes without one in the config."""
    from masrl.config import config_from_dict
    from masrl.errors import ConfigError
    from masrl.team_runner import check_team

    path = _write(tmp_path, _search(tiny_cfg, {"name": "arithmetic"}))
    assert "search_verifier_router needs params['retriever']" in _both_refuse(tmp_path, path, [], capsys)
    check_team(config_from_dict(_search(tiny_cfg, {"name": "synthetic_kb"})))  # the task supplies it
    assert main(["config", "show", str(path), "workflow.params.retriever=synthetic_kb"]) == 0  # the config sets it
    capsys.readouterr()
    env = tiny_cfg(**{"workflow": {"name": "environment"}, "task": {"name": "arithmetic"},
                      "agents": {"Player": {"policy": "shared", "max_new_tokens": 8}}})
    with pytest.raises(ConfigError, match="set task.name to verifiers, verifiers_v1 or tool_env"):
        check_team(config_from_dict(env))
