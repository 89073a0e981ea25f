"""Bad input gives one clear error line and exit code 2 through ``masrl.cli.main``, never a traceback.

Complements tests/test_config.py (which checks the ConfigError messages of load_config itself).
"""
import json
import warnings

import pytest
import yaml

from masrl.cli import main
from masrl.tasks.math_data import MalformedRowWarning, load_gsm8k
from masrl.tasks.qa import QADataError, QADataWarning, load_qa

# errors happen before training; should one not, the run is still instant
QUICK = {"sft.steps": 0, "trainer.total_steps": 0, "eval.before_after": False,
         "logging.tensorboard": False, "logging.plots": False, "logging.progress": False}


@pytest.fixture
def write_cfg(tmp_path, tiny_cfg):
    def write(text=None, name="cfg.yaml", **over):
        path = tmp_path / name
        path.write_text(text if text is not None else yaml.safe_dump(tiny_cfg(**{**QUICK, **over})))
        return path
    return write


def _fails_clearly(argv, capsys, *needles):
    """Run the CLI; assert exit 2, one ``masrl:`` error line naming every needle, no traceback."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("masrl:")]
    assert len(errors) == 1, err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


# ----------------------------------------------------------------------------- the config file

def test_malformed_yaml(write_cfg, capsys):
    path = write_cfg("seed: 0\nagents: {Solver: {policy: shared}\npolicies: [\n")
    _fails_clearly(["train", path], capsys, str(path), "malformed YAML")


def test_unknown_nested_key(write_cfg, capsys):
    path = write_cfg(**{"policies.shared.optim.learning_rate": 1e-3})
    _fails_clearly(["train", path], capsys, "unknown key 'policies.shared.optim.learning_rate'", str(path))


def test_unknown_key_in_override(write_cfg, capsys):
    path = write_cfg()
    _fails_clearly(["train", path, "trainer.totl_steps=3"], capsys, "trainer.totl_steps")


def test_override_without_value(write_cfg, capsys):
    path = write_cfg()
    _fails_clearly(["train", path, "trainer.total_steps"], capsys, "key.path=value")


@pytest.mark.parametrize("key,value", [("trainer.group_size", "eight"), ("agents.Solver.temperature", -1.0),
                                       ("policies.shared.dtype", "float8"), ("eval.k", "1,4")])
def test_wrong_types_and_ranges(write_cfg, capsys, key, value):
    path = write_cfg(**{key: value})
    _fails_clearly(["train", path], capsys, f"key '{key}", str(path))


def test_config_file_missing(tmp_path, capsys):
    _fails_clearly(["train", tmp_path / "nope.yaml"], capsys, "nope.yaml", "does not exist")


def test_resume_of_a_folder_that_is_not_a_run(tmp_path, capsys):
    _fails_clearly(["train", "--resume", tmp_path], capsys, "no config.yaml")


# ----------------------------------------------------------------------------- data

def test_missing_benchmark_file(write_cfg, tmp_path, monkeypatch, capsys):
    empty = tmp_path / "data"
    empty.mkdir()
    monkeypatch.setenv("MASRL_DATA_DIR", str(empty))
    path = write_cfg(**{"task.name": "gsm8k", "task.params": {}})
    _fails_clearly(["train", path], capsys, str(empty / "math" / "gsm8k_test.jsonl"), "MASRL_DATA_DIR")


def test_missing_qa_dataset(write_cfg, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MASRL_DATA_DIR", str(tmp_path))
    path = write_cfg(**{"task.name": "nq", "task.params": {"retriever": "synthetic_kb"}})
    _fails_clearly(["train", path], capsys, "'nq'", "not found", "MASRL_DATA_DIR")


def test_unknown_task_lists_known(write_cfg, capsys):
    path = write_cfg(**{"task.name": "gsm9k"})
    _fails_clearly(["train", path], capsys, "unknown task 'gsm9k'", "gsm8k", "arithmetic")


@pytest.mark.parametrize("over,hint", [({"task.train_limit": 0}, "train_limit is 0"),
                                       ({"task.params.train_size": 0}, "train_size")])
def test_empty_training_split(write_cfg, capsys, over, hint):
    path = write_cfg(**over)
    _fails_clearly(["train", path], capsys, "'arithmetic'", "training split is empty", hint)


def test_empty_benchmark_file(write_cfg, tmp_path, monkeypatch, capsys):
    (tmp_path / "data" / "math").mkdir(parents=True)
    (tmp_path / "data" / "math" / "gsm8k_test.jsonl").write_text("\n")
    monkeypatch.setenv("MASRL_DATA_DIR", str(tmp_path / "data"))
    path = write_cfg(**{"task.name": "gsm8k", "task.params": {}})
    _fails_clearly(["train", path], capsys, "'gsm8k'", "training split is empty")


GOOD_GSM8K = {"question": "What is 2+3?", "answer": "2+3=5\n#### 5"}


@pytest.mark.parametrize("bad,reason", [({"question": "What is 1+1?"}, "missing field 'answer'"),
                                        ({"answer": "#### 4"}, "missing field 'question'"),
                                        ({"question": "Q?", "answer": "four"}, "####"),
                                        ("[1, 2]", "expected a JSON object"),
                                        ('{"question": "Q?", "answer": ', "invalid JSON")])
def test_math_row_missing_fields_reports_file_and_line(tmp_path, bad, reason):
    path = tmp_path / "gsm8k_test.jsonl"
    lines = [json.dumps(GOOD_GSM8K), "", json.dumps(GOOD_GSM8K), bad if isinstance(bad, str) else json.dumps(bad)]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError) as e:
        load_gsm8k(path, strict=True)
    assert f"{path}:4:" in str(e.value) and reason in str(e.value)
    with pytest.warns(MalformedRowWarning, match=f"{path}:4:"):  # lenient: skipped with a warning
        assert len(load_gsm8k(path)) == 2


@pytest.mark.parametrize("bad,reason", [({"id": "x", "golden_answers": ["a"]}, "'question'"),
                                        ({"question": "Who?", "golden_answers": []}, "gold answer"),
                                        ({"question": "Who?"}, "gold answer"),
                                        ({"question": "   ", "golden_answers": ["a"]}, "'question'")])
def test_qa_row_missing_fields_reports_file_and_line(tmp_path, bad, reason):
    path = tmp_path / "nq_test.jsonl"
    good = {"question": "Who wrote Hamlet?", "golden_answers": ["Shakespeare"]}
    path.write_text("\n".join(json.dumps(r) for r in (good, bad, good)) + "\n")
    with pytest.raises(QADataError) as e:
        load_qa(path, strict=True)
    assert f"{path}:2:" in str(e.value) and reason in str(e.value)
    with pytest.warns(QADataWarning, match=r"nq_test\.jsonl:2:"):
        assert len(load_qa(path)) == 2


def test_eval_strict_bad_row_exits_2(write_cfg, tmp_path, capsys):
    bench = tmp_path / "mine_test.jsonl"
    bench.write_text(json.dumps({"question": "Who?", "golden_answers": ["x"]}) + "\n"
                     + json.dumps({"golden_answers": ["y"]}) + "\n")
    path = write_cfg()
    _fails_clearly(["eval", path, "--bench", bench, "--strict", "--out", tmp_path / "o"], capsys,
                   f"{bench}:2:", "'question'")


# ----------------------------------------------------------------------------- models

def test_model_path_that_does_not_exist(write_cfg, capsys):
    path = write_cfg(**{"policies.shared.model": "/nonexistent/path"})
    _fails_clearly(["train", path], capsys, "/nonexistent/path", "does not exist")


def test_model_folder_that_is_not_a_model(write_cfg, tmp_path, capsys):
    folder = tmp_path / "empty_model"
    folder.mkdir()
    path = write_cfg(**{"policies.shared.model": str(folder)})
    _fails_clearly(["train", path], capsys, str(folder), "cannot load model")


@pytest.fixture(scope="module")
def model_without_chat_template(tmp_path_factory):
    from masrl.models.tiny import build_char_tokenizer, build_tiny_model

    folder = tmp_path_factory.mktemp("no_chat_template")
    tok = build_char_tokenizer()
    tok.chat_template = None
    model = build_tiny_model(tok, {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                                   "num_key_value_heads": 2, "intermediate_size": 32, "max_position_embeddings": 64})
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def test_tokenizer_without_chat_template(write_cfg, model_without_chat_template, capsys):
    path = write_cfg(**{"policies.shared.model": str(model_without_chat_template)})
    _fails_clearly(["train", path], capsys, str(model_without_chat_template), "no chat template")


def test_separate_tokenizer_that_does_not_exist(write_cfg, model_without_chat_template, tmp_path, capsys):
    path = write_cfg(**{"policies.shared.model": str(model_without_chat_template),
                        "policies.shared.tokenizer": str(tmp_path / "no_tokenizer_here")})
    _fails_clearly(["train", path], capsys, "policy tokenizer", "no_tokenizer_here", "does not exist")


# ----------------------------------------------------------------------------- workflows and conflicts

def test_workflow_module_that_does_not_exist(write_cfg, capsys):
    path = write_cfg(**{"workflow.name": "no_such_pkg.flows:solve"})
    _fails_clearly(["train", path], capsys, "no_such_pkg.flows:solve", "cannot import module")


def test_workflow_name_typo_lists_known(write_cfg, capsys):
    path = write_cfg(**{"workflow.name": "math_solver_verifer"})
    _fails_clearly(["train", path], capsys, "'math_solver_verifer'", "math_solver_verifier", "voting", "single")


def test_lora_on_non_trainable_policy(write_cfg, capsys):
    path = write_cfg(**{"policies.shared.trainable": False, "policies.shared.lora": {"r": 4}})
    _fails_clearly(["train", path], capsys, "policies.shared", "lora", "trainable")


def test_agents_do_not_match_workflow_roles(write_cfg, capsys):
    path = write_cfg(**{"workflow.name": "single", "workflow.prompts": {}})
    _fails_clearly(["train", path], capsys, "'single'", "Solver", "Verifier")


def test_unused_policy(write_cfg, tiny_cfg, capsys):
    data = tiny_cfg(**QUICK)
    data["policies"]["spare"] = dict(data["policies"]["shared"])
    path = write_cfg(yaml.safe_dump(data))
    _fails_clearly(["train", path], capsys, "spare", "not used by any agent")
