"""Config errors name the key and the file; the CLI exits 2 on bad input."""
import pytest
import yaml

from masrl.cli import main
from masrl.config import ConfigError, apply_overrides, config_from_dict, load_config


def _write(tmp_path, data, name="cfg.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


def test_unknown_key_names_key_and_file(tmp_path, tiny_cfg):
    data = tiny_cfg()
    data["trainer"]["totl_steps"] = 3
    path = _write(tmp_path, data)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert "trainer.totl_steps" in str(e.value) and str(path) in str(e.value)


def test_wrong_type_names_key(tmp_path, tiny_cfg):
    path = _write(tmp_path, tiny_cfg(**{"trainer.batch_size": "many"}))
    with pytest.raises(ConfigError, match=r"trainer\.batch_size"):
        load_config(path)


def test_missing_file_and_malformed_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    path = _write(tmp_path, "seed: [1, 2\nname: x\n")
    with pytest.raises(ConfigError, match=r"cfg\.yaml:\d+:\d+: malformed YAML"):
        load_config(path)


def test_agent_mapped_to_unknown_policy(tiny_cfg):
    data = tiny_cfg(**{"agents.Verifier.policy": "ghost"})
    with pytest.raises(ConfigError, match="ghost"):
        config_from_dict(data)


def test_lora_on_frozen_policy_conflicts(tiny_cfg):
    data = tiny_cfg(**{"policies.shared.trainable": False, "policies.shared.lora": {"r": 4}})
    with pytest.raises(ConfigError, match="lora"):
        config_from_dict(data)


def test_dotted_overrides_parse_values(tiny_cfg):
    data = apply_overrides(tiny_cfg(), ["trainer.total_steps=7", "algorithm.estimator=grpo", "eval.k=[1,2]"])
    cfg = config_from_dict(data)
    assert cfg.trainer.total_steps == 7 and cfg.algorithm.estimator == "grpo" and cfg.eval.k == [1, 2]


def test_cli_exit_code_2_on_bad_config(tmp_path, tiny_cfg, capsys):
    data = tiny_cfg()
    data["bogus"] = 1
    path = _write(tmp_path, data)
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert "unknown key 'bogus'" in err and err.count("\n") <= 2


def test_cli_unknown_workflow_lists_known(tmp_path, tiny_cfg, capsys):
    path = _write(tmp_path, tiny_cfg(**{"workflow.name": "no_such_flow"}))
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert "no_such_flow" in err and "math_solver_verifier" in err
