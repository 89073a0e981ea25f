"""The config at load: registry names checked with the known names listed, `masrl config show`,
`masrl --version`, a description on every field and docs/config.md generated from the schema."""
import typing
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from masrl import __version__
from masrl.cli import main
from masrl.config import RunConfig, config_from_dict, load_config
from masrl.config_docs import DOC_PATH, render


def _write(tmp_path, data):
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("override, key, known", [
    ("algorithm.estimator=foo", "algorithm.estimator", "drmas_mean_only"),
    ("workflow.name=nope", "workflow.name", "math_solver_verifier"),
    ("task.name=nope", "task.name", "gsm8k_train"),
    ("task.params.reward=bogus", "task.params.reward", "qa_f1"),
    ("task.params.reward=no_such_pkg.mod:fn", "task.params.reward", "cannot import module 'no_such_pkg.mod'"),
])
def test_unknown_registry_name_fails_at_load_listing_known(tmp_path, tiny_cfg, capsys, override, key, known):
    data = tiny_cfg()
    if "reward" in override:
        data["task"] = {"name": "dataset", "params": {"train": str(tmp_path / "x.jsonl")}}
    path = _write(tmp_path, data)
    assert main(["config", "show", str(path), override]) == 2
    err = capsys.readouterr().err
    assert key in err and known in err


def test_unknown_estimator_stops_train_before_sft(tmp_path, tiny_cfg, capsys):
    data = tiny_cfg(**{"sft.steps": 100000})  # would take minutes if SFT started
    path = _write(tmp_path, data)
    assert main(["train", str(path), "algorithm.estimator=foo"]) == 2
    assert "unknown estimator 'foo'" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_config_show_prints_the_resolved_config(tmp_path, tiny_cfg, capsys):
    path = _write(tmp_path, tiny_cfg())
    assert main(["config", "show", str(path), "trainer.total_steps=7", "algorithm.estimator=grpo"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["trainer"]["total_steps"] == 7 and shown["algorithm"]["estimator"] == "grpo"
    assert shown["trainer"]["group_size"] == 4  # from the file
    assert shown["algorithm"]["eps"] == 1e-6  # a default filled in
    from masrl.cli import _resolved_view

    loaded = load_config(path, ["trainer.total_steps=7", "algorithm.estimator=grpo"])
    assert config_from_dict(shown) == _resolved_view(loaded)  # defaults in effect spelled out
    assert _resolved_view(config_from_dict(shown)) == config_from_dict(shown)  # and nothing else changes


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"masrl {__version__}"


def _fields(model, prefix=""):
    for name, field in model.model_fields.items():
        yield f"{prefix}{name}", field
        args = [field.annotation, *typing.get_args(field.annotation)]
        args += [a for t in list(args) for a in typing.get_args(t)]
        for sub in {a for a in args if isinstance(a, type) and issubclass(a, BaseModel)}:
            yield from _fields(sub, f"{prefix}{name}.")


def test_every_config_field_has_a_description():
    fields = dict(_fields(RunConfig))
    assert len(fields) > 100 and "agents.optim.lr" in fields and "policies.lora.r" in fields
    assert [k for k, f in fields.items() if not (f.description or "").strip()] == []


def test_docs_config_md_is_generated_from_the_schema():
    assert DOC_PATH.read_text() == render(), "docs/config.md is stale: run python -m masrl.config_docs"
    text = render()
    assert "| `logging.report_to` |" in text and "| `agents.<name>.optim.lr` |" in text


@pytest.mark.parametrize("override, says", [
    ("task.params.train_size=-3", "train_size"),  # the task's own params
    ("task.params.max_operand=1", "cannot draw"),  # params that cannot give the data
    ("workflow.prompts.Nobody=hi", "unknown template"),
])
def test_config_show_refuses_what_train_refuses(tmp_path, tiny_cfg, capsys, override, says):
    """`config show` runs the checks `train` runs before it builds a model: what it prints, `train` starts."""
    path = _write(tmp_path, tiny_cfg())
    assert main(["config", "show", str(path), override]) == 2
    shown = capsys.readouterr()
    assert says in shown.err and shown.out == ""
    assert main(["train", str(path), override, "--output-dir", str(tmp_path / "run")]) == 2
    assert says in capsys.readouterr().err and not (tmp_path / "run").exists()


QUICKSTART = Path(__file__).resolve().parents[1] / "examples" / "quickstart.yaml"


@pytest.mark.parametrize("override,suggested", [("trainer.totl_steps=3", "trainer.total_steps"), ("sedd=1", "seed"),
                                                ("agents.Solver.max_new_token=3", "agents.Solver.max_new_tokens"),
                                                ("policies.shared.optm.lr=1", "policies.shared.optim")])
def test_an_override_typo_is_blamed_on_the_override_with_did_you_mean(override, suggested, capsys):
    assert main(["config", "show", str(QUICKSTART), override]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"masrl: config error: override '{override}': unknown key"), err
    assert f"did you mean '{suggested}'" in err and "quickstart.yaml" not in err


def test_a_yaml_typo_gets_did_you_mean_and_names_the_file(tmp_path, capsys):
    import yaml

    path = tmp_path / "c.yaml"
    data = yaml.safe_load(QUICKSTART.read_text())
    data["trainer"]["bach_size"] = 4
    path.write_text(yaml.safe_dump(data))
    assert main(["config", "show", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}: unknown key 'trainer.bach_size' (did you mean 'trainer.batch_size'?" in err
