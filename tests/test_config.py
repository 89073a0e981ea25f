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


@pytest.mark.parametrize("key,value,known", [
    ("algorithm.loss.loss", "ppo2", "known: gspo, ppo"),
    ("algorithm.loss.agg", "mean", "known: token-mean, seq-mean-token-mean, seq-mean-token-sum-norm"),
    ("algorithm.loss.kl_kind", "k4", "known: k1, k2, k3"),
    ("algorithm.estimator", "gae", "known: dr_grpo, dr_grpo_agentwise, drmas,"),
])
def test_algorithm_choices_come_from_the_registries(tiny_cfg, key, value, known):
    with pytest.raises(ConfigError) as e:
        config_from_dict(tiny_cfg(**{key: value}), "cfg.yaml")
    assert f"cfg.yaml: key '{key}': unknown" in str(e.value) and f"{value!r}; {known}" in str(e.value)


def test_a_registered_loss_and_estimator_are_accepted_by_the_config(tiny_cfg):
    from masrl.algorithms import ADVANTAGE_ESTIMATORS, LOSSES, register_advantage, register_loss

    with pytest.raises(ConfigError, match="unknown loss 'my_loss'"):
        config_from_dict(tiny_cfg(**{"algorithm.loss.loss": "my_loss"}))
    register_loss("my_loss")(LOSSES["ppo"])
    register_advantage("my_estimator")(ADVANTAGE_ESTIMATORS["grpo"])
    try:
        cfg = config_from_dict(tiny_cfg(**{"algorithm.loss.loss": "my_loss", "algorithm.estimator": "my_estimator"}))
        assert cfg.algorithm.loss.loss == "my_loss" and cfg.algorithm.estimator == "my_estimator"
    finally:
        LOSSES.pop("my_loss")
        ADVANTAGE_ESTIMATORS.pop("my_estimator")
