"""Bad input gives one clear error line and exit code 2 through ``masrl.cli.main``, never a traceback.

Complements tests/test_config.py (which checks the ConfigError messages of load_config itself).
"""
import json
import warnings

import pytest
import yaml

from masrl.cli import main
from masrl.tasks.math_data import MalformedRowWarning, load_gsm8k
from masrl.io.rows import MalformedRowError
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


@pytest.mark.parametrize("overrides, says", [
    (["trainer.group_size=99999999"], "key 'trainer.group_size'"),
    (["agents.Solver.max_new_tokens=999999999"], "key 'agents.Solver.max_new_tokens'"),
    (["eval.n=100000"], "key 'eval.n'"),
    (["trainer.threads=100000000"], "key 'trainer.threads'"),
    (["trainer.batch_size=60000", "trainer.group_size=4000"], "episodes per step"),
])
def test_sizes_that_allocate_up_front_are_bounded(write_cfg, capsys, overrides, says):
    """Sizes the engine allocates for before any progress (KV cache, episodes, threads): one clear error, not an
    out-of-memory kill minutes later."""
    _fails_clearly(["train", write_cfg(), *overrides], capsys, says)


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
    _fails_clearly(["train", path], capsys, "math/gsm8k_test.jsonl", str(empty), "masrl data get gsm8k")


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


@pytest.mark.parametrize("eos", [10**9, -1])
def test_model_stop_token_outside_the_vocabulary(write_cfg, tmp_path, capsys, eos):
    """A model folder whose generation_config names a stop token the model does not have (the stop table is
    sized by the largest id: 10**9 would zero-fill ~1 GB per rollout call) is one error naming the file."""
    from masrl.models.tiny import build_char_tokenizer, build_tiny_model

    folder = tmp_path / "bad_eos"
    tok = build_char_tokenizer()
    model = build_tiny_model(tok, {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                                   "num_key_value_heads": 2, "intermediate_size": 32, "max_position_embeddings": 64})
    model.generation_config.eos_token_id = [tok.eos_token_id, eos]
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    path = write_cfg(**{"policies.shared.model": str(folder)})
    _fails_clearly(["train", path], capsys, "generation_config.eos_token_id", str(eos), "not a token id")


def test_a_stop_token_error_names_a_policy_called_judge_as_a_policy():
    """The error names the model by the caller's label: a policy that happens to be called "judge" is "policy
    judge", the judge backend says "the judge"."""
    from masrl.config import ConfigError, PolicyConfig
    from masrl.models.tiny import build_char_tokenizer, build_tiny_model
    from masrl.rollout.factory import make_engine

    tok = build_char_tokenizer()
    model = build_tiny_model(tok, {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                                   "num_key_value_heads": 2, "intermediate_size": 32, "max_position_embeddings": 64})
    model.generation_config.eos_token_id = [tok.eos_token_id, -1]
    kw = {"policy": PolicyConfig(model="tiny"), "seed": 0, "max_batch_size": 4}
    with pytest.raises(ConfigError, match=r"^policy judge: the model's stop token"):
        make_engine(None, model, tok, name="judge", **kw)
    with pytest.raises(ConfigError, match=r"^the judge: the model's stop token"):
        make_engine(None, model, tok, name="judge", label="the judge", **kw)


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


# ----------------------------------------------------------------------------- the YAML itself

def _with_bomb(cfg: dict, typed: bool, levels: int = 12) -> str:
    """The config with a billion-laughs block in workflow.params (9**levels values once every alias is
    expanded, a few lines on disk); with ``typed`` the top-level ``name`` refers to it too."""
    cfg = dict(cfg)
    workflow, name = cfg.pop("workflow"), cfg.pop("name")
    bomb = ["l0: &l0 [x, x, x, x, x, x, x, x, x]"]
    bomb += [f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, levels)]
    text = yaml.safe_dump(cfg) + f"workflow:\n  name: {workflow['name']}\n  prompts: {json.dumps(workflow['prompts'])}\n"
    text += "  params:\n    max_loops: 2\n    bomb:\n" + "".join(f"      {line}\n" for line in bomb)
    return text + (f"name: *l{levels - 1}\n" if typed else f"name: {name}\n")


@pytest.mark.parametrize("typed", [True, False], ids=["typed_field", "workflow_params"])
def test_yaml_alias_bomb_is_refused(write_cfg, tiny_cfg, capsys, typed):
    """An alias bomb in a typed field (the error message formatted the expanded value) or in
    workflow.params (dump_config expanded it at start) hung the CLI; it is refused while loading."""
    path = write_cfg(_with_bomb(tiny_cfg(**QUICK), typed))
    _fails_clearly(["train", path], capsys, str(path), "YAML refused: aliases expand to more than")


def test_recursive_alias_is_refused(write_cfg, tiny_cfg, capsys):
    text = yaml.safe_dump(tiny_cfg(**QUICK)) + "x_: &p {again: *p}\n"
    path = write_cfg(text)
    _fails_clearly(["train", path], capsys, f"{path}:", "YAML refused: an alias refers to a value that contains it")


def test_harmless_aliases_still_load(write_cfg, tiny_cfg, tmp_path):
    from masrl.config import load_config

    text = yaml.safe_dump(tiny_cfg(**QUICK)).replace("optim:\n      lr: 0.001", "optim: &opt\n      lr: 0.002")
    text += "sft:\n  teacher: {}\n" if "sft:" not in text else ""
    path = write_cfg(text)
    assert load_config(path).policies["shared"].optim.lr == 0.002


def test_deeply_nested_yaml(write_cfg, capsys):
    """20,000 nested lists were a RecursionError traceback (200 KB of stderr)."""
    path = write_cfg("seed: " + "[" * 20_000 + "]" * 20_000 + "\n")
    err = _fails_clearly(["train", path], capsys, str(path), "nested deeper than")
    assert len(err) < 500


def test_deep_override_value(write_cfg, capsys):
    path = write_cfg()
    _fails_clearly(["train", path, "workflow.params.x=" + "[" * 5000 + "]" * 5000], capsys,
                   "workflow.params.x", "nested deeper than")


@pytest.mark.parametrize("field,yaml_bool", [("lr: 0.001", "lr: on"), ("max_new_tokens: 8", "max_new_tokens: yes"),
                                            ("group_size: 4", "group_size: true")])
def test_yaml_booleans_are_not_numbers(write_cfg, tiny_cfg, capsys, field, yaml_bool):
    """YAML 1.1 reads on/yes as booleans; pydantic took them as 1.0 / 1 and training started."""
    text = yaml.safe_dump(tiny_cfg(**QUICK))
    assert field in text
    path = write_cfg(text.replace(field, yaml_bool, 1))
    _fails_clearly(["train", path], capsys, str(path), f"{field.split(':')[0]}'", "boolean")


def test_booleans_in_overrides_and_numbers_still_accepted(write_cfg, capsys):
    from masrl.config import load_config

    path = write_cfg()
    _fails_clearly(["train", path, "trainer.batch_size=yes"], capsys, "trainer.batch_size", "boolean")
    cfg = load_config(path, ["policies.shared.optim.lr=1e-3", "policies.shared.optim.grad_clip=2",
                             "trainer.batch_size=3", "eval.k=[1, 2]"])
    assert cfg.policies["shared"].optim.lr == 1e-3 and cfg.policies["shared"].optim.grad_clip == 2.0
    assert cfg.trainer.batch_size == 3 and cfg.eval.k == [1, 2]


@pytest.mark.parametrize("over,key", [({"seed": 10**30}, "seed"), ({"seed": -1}, "seed"),
                                      ({"policies.shared.optim.lr": float("nan")}, "policies.shared.optim.lr"),
                                      ({"policies.shared.optim.lr": float("inf")}, "policies.shared.optim.lr"),
                                      ({"trainer.threads": -2}, "trainer.threads"),
                                      ({"task.train_limit": -5}, "task.train_limit"),
                                      ({"eval.k": [0, 4]}, "eval.k")])
def test_numbers_out_of_range_name_their_key(write_cfg, capsys, over, key):
    """A huge seed printed "Overflow when unpacking long long" without naming seed; NaN/inf and
    negative counts went through."""
    path = write_cfg(**over)
    _fails_clearly(["train", path], capsys, f"key '{key}", str(path))


# ----------------------------------------------------------------------------- files the CLI reads

def test_config_not_utf8_names_the_file(write_cfg, tmp_path, capsys):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"seed: 0\nname: caf\xe9\n")
    _fails_clearly(["train", path], capsys, str(path), "not UTF-8")


@pytest.mark.parametrize("kind", ["folder", "empty", "binary", "huge"])
def test_config_path_that_is_not_a_config(tmp_path, capsys, kind):
    path = tmp_path / "cfg.yaml"
    if kind == "folder":
        path.mkdir()
    elif kind == "empty":
        path.write_text("")
    elif kind == "binary":
        path.write_bytes(bytes(range(256)) * 4)
    else:
        path.write_text("# padding\n" * 200_000)
    _fails_clearly(["train", path], capsys, str(path))


def test_config_symlink_loop(tmp_path, capsys):
    (tmp_path / "a.yaml").symlink_to(tmp_path / "b.yaml")
    (tmp_path / "b.yaml").symlink_to(tmp_path / "a.yaml")
    _fails_clearly(["train", tmp_path / "a.yaml"], capsys, "a.yaml")


def test_output_dir_naming_an_existing_file(write_cfg, tmp_path, capsys):
    """Was a FileExistsError traceback, exit 1."""
    taken = tmp_path / "a_file"
    taken.write_text("mine\n")
    path = write_cfg()
    _fails_clearly(["train", path, "--output-dir", taken], capsys, str(taken), "not a folder")
    _fails_clearly(["train", path, "--output-dir", taken / "sub"], capsys, str(taken), "not a folder")
    assert taken.read_text() == "mine\n"


def _serve_retriever(corpus, capsys) -> tuple[int, str]:
    """``masrl serve-retriever --corpus FILE --no-cache``: returns before serving when the corpus is bad."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = main(["serve-retriever", "--corpus", str(corpus), "--no-cache", "--port", "1"])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("name", ["corpus.json", "corpus.jsonl"])
def test_serve_retriever_non_utf8_corpus_names_the_file(tmp_path, capsys, name):
    """Printed "'utf-8' codec can't decode ..." with no file name."""
    corpus = tmp_path / name
    row = {"id": "1", "contents": "\"Caf\u00e9\"\nA place for coffee."}
    text = json.dumps([row], ensure_ascii=False) if name.endswith(".json") else json.dumps(row, ensure_ascii=False)
    corpus.write_bytes(text.encode("latin-1"))
    code, err = _serve_retriever(corpus, capsys)
    assert code == 2 and "Traceback" not in err and str(corpus) in err, err


def test_corpus_non_utf8_line_is_one_skipped_row(tmp_path):
    from masrl.retrieval.corpus import CorpusError, CorpusWarning, load_corpus

    corpus = tmp_path / "corpus.jsonl"
    good = json.dumps({"id": "a", "contents": "\"A\"\nfine"}).encode()
    corpus.write_bytes(good + b"\n" + b'{"id": "b", "contents": "caf\xe9"}\n' + good.replace(b'"a"', b'"c"') + b"\n")
    with pytest.warns(CorpusWarning, match=f"{corpus}:2: not UTF-8"):
        assert [p.id for p in load_corpus(corpus)] == ["a", "c"]
    with pytest.raises(CorpusError, match=f"{corpus}:2: not UTF-8"):
        load_corpus(corpus, strict=True)


@pytest.mark.parametrize("content", [b"\xff\xfe garbage \x80\x81\n" * 50, b"[1, 2]\n\"x\"\n{\"step\": \"one\"}\n"],
                         ids=["binary", "json_not_records"])
def test_plot_of_garbage_metrics_names_the_file(tmp_path, capsys, content):
    """Printed "'utf-8' codec can't decode ..." without the file name."""
    (tmp_path / "metrics.jsonl").write_bytes(content)
    _fails_clearly(["plot", tmp_path], capsys, str(tmp_path / "metrics.jsonl"), "no metrics records")


def test_plot_skips_garbage_lines_among_records(tmp_path, capsys):
    lines = [b"\xff\xfe\x80", b"[1]", json.dumps({"step": 1, "team/reward": 0.5}).encode(),
             json.dumps({"step": 2, "team/reward": 0.7}).encode(), b'{"step": 3, "team/rew']
    (tmp_path / "metrics.jsonl").write_bytes(b"\n".join(lines))
    assert main(["plot", str(tmp_path)]) == 0
    assert (tmp_path / "plots" / "training_curves.png").stat().st_size > 0


def test_data_row_over_the_size_bound_is_skipped(tmp_path):
    """Rows are read a bounded chunk at a time: an oversized row is reported, never held whole."""
    from masrl.io.lines import text_lines

    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"q": "' + b"x" * 5000 + b'"}\n{"q": "ok"}\n')
    rows = list(text_lines(path, max_line_bytes=1000))
    assert rows == [(1, None, "row longer than 1,000 bytes"), (2, '{"q": "ok"}\n', "")]


# ----------------------------------------------------------------------------- masrl ensemble

def _ensemble_rows(labels, answers_of=lambda y: [y, y, None]) -> list[dict]:
    return [{"id": str(i), "label": y, "predictions": {f"m{j}": {"answer": a} for j, a in enumerate(answers_of(y))}}
            for i, y in enumerate(labels)]


def _ensemble(argv, capsys) -> tuple[int, str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            code = main(["ensemble", *map(str, argv)])
        except SystemExit as e:  # argparse refuses a bounded option
            code = e.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize("labels,bad_line,kinds", [(["1", "2", 1, "3"], 3, ("number", "string")),
                                                    ([1, 2, True, 1], 3, ("boolean", "number")),
                                                    (["a", "b", "c", ["a"]], 4, ("list", "string"))])
def test_ensemble_compare_refuses_mixed_label_types(tmp_path, capsys, labels, bad_line, kinds):
    """"1", 1 and true were compared as different answers and compare exited 0 with no word."""
    path = tmp_path / "preds.jsonl"
    rows = _ensemble_rows(labels * 5)
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    code, err = _ensemble(["compare", "--data", path, "--k", "2", "--out", tmp_path / "o"], capsys)
    assert code == 2 and "Traceback" not in err, err
    assert f"{path}:{bad_line}:" in err and all(k in err for k in kinds), err


def test_ensemble_mixed_types_within_one_row(tmp_path, capsys):
    path = tmp_path / "preds.jsonl"
    rows = _ensemble_rows(["1", "2"] * 5, answers_of=lambda y: [y, int(y), "x"])
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    code, err = _ensemble(["select", "--data", path, "--k", "2"], capsys)
    assert code == 2 and f"{path}:1:" in err and "answer of 'm1' is a number" in err, err


@pytest.mark.parametrize("content", [b"\xff\xfe\x00\x81" * 100, b""], ids=["binary", "empty"])
def test_ensemble_garbage_or_empty_file(tmp_path, capsys, content):
    path = tmp_path / "preds.jsonl"
    path.write_bytes(content)
    code, err = _ensemble(["compare", "--data", path], capsys)
    assert code == 2 and "Traceback" not in err and str(path) in err, err


# ----------------------------------------------------------------------------- masrl eval

def test_eval_question_over_the_context_is_skipped_not_tokenized(write_cfg, tmp_path, capsys):
    """A 2 MB question (the tiny model's context is 128 tokens) is refused by its length before it is
    tokenized, counted in eval.json and reported; the other task is evaluated."""
    bench = tmp_path / "mine_test.jsonl"
    rows = [{"id": "huge", "question": "What is 1+1? " * 160_000, "golden_answers": ["2"]},
            {"id": "ok", "question": "What is 2+2?", "golden_answers": ["4"]}]
    bench.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "o"
    assert main(["eval", str(write_cfg()), "--bench", str(bench), "--n", "1", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "skipped 1 task(s) that cannot fit the model context" in err and "huge" in err, err
    result = json.loads((out / "eval.json").read_text())["results"][str(bench)]
    assert result["n_tasks"] == 1 and result["skipped_over_context"] == 1


def test_eval_single_50mb_row_is_one_clear_line(write_cfg, tmp_path, capsys):
    """Was 11.7 GB RSS, then the tokenizer aborted (exit 134) with no masrl line."""
    bench = tmp_path / "big_test.jsonl"
    with open(bench, "w") as f:
        f.write('{"question": "' + "x" * (50 << 20) + '", "golden_answers": ["x"]}\n')
    _fails_clearly(["eval", write_cfg(), "--bench", bench, "--n", "1", "--out", tmp_path / "o"], capsys,
                   str(bench))


def test_prompt_over_the_context_is_an_invalid_turn_not_tokenized(tiny_cfg):
    """In training and eval alike, a prompt that cannot fit is refused as an invalid turn (with its
    reason) without being tokenized; the episode goes on."""
    import asyncio

    from masrl.config import config_from_dict
    from masrl.evaluation.summary import agent_facts
    from masrl.rollout.runner import make_call
    from masrl.rollout.scheduler import RolloutScheduler
    from masrl.training.policy import build_policy
    from masrl.types import Episode, Task

    cfg = config_from_dict(tiny_cfg(**QUICK))
    policy = build_policy("shared", cfg.policies["shared"], seed=0, max_rollout_batch=8)
    calls = []
    policy.tokenizer.__class__ = type("CountingTokenizer", (policy.tokenizer.__class__,),
                                      {"__call__": lambda self, *a, **k: calls.append(a) or
                                       super(self.__class__, self).__call__(*a, **k)})
    call = make_call({"shared": policy}, cfg.agents, RolloutScheduler({"shared": policy.engine}))
    turn = asyncio.run(call("Solver", "x" * 100_000))
    assert not turn.valid and turn.response_ids == [] and "cannot fit" in turn.info["refused"]
    assert calls == [] and len(turn.prompt_text) < 3000
    facts = agent_facts([Episode(task=Task(id="t", question="q", answer="a"), turns=[turn], reward=0.0)])
    assert facts["agent/Solver/refused_prompts"] == 1


# ----------------------------------------------------------------------------- bugs stay bugs

def test_a_programming_error_is_not_bad_input(tmp_path, monkeypatch):
    """Every ValueError used to print "masrl: error" and exit 2, hiding bugs; only UserInputError (and
    FileNotFoundError for a path the user gave) means bad input now."""
    import masrl.monitoring.plots as plots

    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "team/reward": 0.5}) + "\n")

    def buggy(run_dir):
        raise ValueError("a bug inside masrl")

    monkeypatch.setattr(plots, "plot_training_curves", buggy)
    with pytest.raises(ValueError, match="a bug inside masrl"):
        main(["plot", str(tmp_path)])


def test_user_input_errors_share_one_type():
    from masrl.config import ConfigError
    from masrl.ensemble.data import InputError
    from masrl.errors import UserInputError
    from masrl.export import ExportError
    from masrl.models.hub import ModelLoadError
    from masrl.tasks.math_data import DatasetLoadError
    from masrl.tasks.qa import QADataError
    from masrl.retrieval.corpus import CorpusError
    from masrl.training.checkpoint import CheckpointError

    for error in (ConfigError, DatasetLoadError, CheckpointError, ModelLoadError, QADataError, CorpusError, InputError,
                  ExportError):
        assert issubclass(error, UserInputError), error


@pytest.mark.parametrize("over,needle", [
    ({"task.params.max_operand": float("nan")}, "task.params.max_operand must be an integer"),
    ({"policies.shared.tiny.num_attention_heads": 3}, "not a multiple of the number of attention heads"),
    ({"policies.shared.tiny.hidden_size": -1}, "must be positive integers"),
    ({"algorithm.estimator": "foo", "trainer.total_steps": 1}, "unknown estimator 'foo'"),
    ({"sft.teacher": {"bogus": 1}, "sft.steps": 1}, "sft.teacher for arithmetic"),
    ({"workflow.params.max_loops": "abc", "trainer.total_steps": 1}, "max_loops must be an integer >= 1"),
], ids=["nan_operand", "tiny_heads", "tiny_size", "estimator", "teacher_key", "max_loops"])
def test_config_values_checked_outside_the_schema(write_cfg, capsys, over, needle):
    """Found by probing: each was a traceback (ValueError, TypeError, a transformers validation error),
    some only after a step had run."""
    path = write_cfg(**over)
    _fails_clearly(["train", path], capsys, needle)


@pytest.mark.parametrize("argv,needle", [
    (["select", "--out", "{data}"], "is a file, not a folder"),
    (["select", "--combiner", "os:system"], "must be a function fn(item_id, proposals)"),
    (["select", "--method", "proxy-fitness", "--weights", "nan,nan,nan"], "finite numbers"),
    (["rl-focal", "--seeds", "1", "--episodes", "-1"], "argument --episodes: '-1' is out of range"),
    (["rl-focal", "--seeds", "1", "--gamma", "5"], "argument --gamma: '5' is out of range; give a finite number in 0..1"),
], ids=["out_is_a_file", "summarizer_signature", "nan_weights", "negative_episodes", "gamma"])
def test_ensemble_options_found_by_probing(tmp_path, capsys, argv, needle):
    """A FileExistsError / TypeError traceback, or exit 0 on nonsense, before."""
    path = tmp_path / "preds.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in _ensemble_rows([0, 1, 2, 1] * 10)) + "\n")
    code, err = _ensemble([argv[0], "--data", path, *[a.replace("{data}", str(path)) for a in argv[1:]]], capsys)
    assert code == 2 and "Traceback" not in err and needle in err, err


# ----------------------------------------------------------------------------- adversarial probe (.ci/probe_cli.py)

BIG = "1" + "0" * 5000  # Python refuses to convert more than 4,300 digits: a ValueError from deep in a parser


@pytest.mark.parametrize("where", ["config_file", "override", "sweep_spec", "config_show"])
def test_number_with_5000_digits_is_one_clear_error(write_cfg, tmp_path, capsys, where):
    """Every YAML a user gives (config, override, sweep spec) goes through one loader: a ValueError traceback."""
    path = write_cfg()
    if where == "config_file":
        path.write_text(path.read_text() + f"trainer_seed_extra: {BIG}\n")
        argv = ["train", path]
    elif where == "override":
        argv = ["train", path, f"seed={BIG}"]
    elif where == "config_show":
        argv = ["config", "show", path, f"trainer.total_steps={BIG}"]
    else:
        spec = tmp_path / "spec.yaml"
        spec.write_text(f"name: s\nbase: {path}\nseeds: [{BIG}]\naxes: {{a: {{key: seed, values: [1]}}}}\n")
        argv = ["sweep", spec, "--dry-run"]
    _fails_clearly(argv, capsys, "4,300 digits")


def test_json_number_with_5000_digits_in_data_is_a_counted_bad_row(tmp_path):
    """The one reader of data rows (io.rows) caught only JSONDecodeError: the ValueError escaped."""
    from masrl.io.rows import iter_records, load_json

    rows = tmp_path / "rows.jsonl"
    rows.write_text(f'{{"question": "q", "answer": {BIG}}}\n{{"question": "q", "answer": 1}}\n')
    records = list(iter_records(rows))
    assert len(records) == 2 and "invalid JSON" in records[0][1].reason and records[1][1]["answer"] == 1
    whole = tmp_path / "rows.json"
    whole.write_text(f"[{BIG}]")
    with pytest.raises(MalformedRowError, match="invalid JSON"):
        load_json(whole)


@pytest.mark.parametrize("manifest", [f'{{"files": {BIG}}}', "[" * 100_000, "\xff"], ids=["bigint", "deep", "binary"])
def test_checkpoint_manifest_that_does_not_parse_is_a_checkpoint_error(tmp_path, manifest):
    from masrl.training.checkpoint import CheckpointError, verify_checkpoint

    (tmp_path / "manifest.json").write_bytes(manifest.encode("latin-1"))
    with pytest.raises(CheckpointError, match="unreadable manifest"):
        verify_checkpoint(tmp_path)


@pytest.mark.parametrize("bench", [",", " , ", "test,test"])
def test_eval_bench_list_that_is_empty_or_repeats_is_refused(write_cfg, tmp_path, capsys, bench):
    """`--bench ,` evaluated nothing and wrote an empty eval.json, exit 0; `test,test` overwrote its own result."""
    out = tmp_path / "eval_out"
    _fails_clearly(["eval", write_cfg(), "--bench", bench, "--out", out], capsys, "--bench")
    assert not out.exists()


@pytest.mark.parametrize("bad", [{"team/reward": "x"}, {"team/reward": [1]}, {"team/reward": True},
                                 {"phase": 3, "team/reward": {"a": 1}}], ids=["str", "list", "bool", "phase_int"])
def test_metrics_values_of_the_wrong_type_are_left_out_not_fatal(tmp_path, capsys, bad):
    """Every reader of metrics.jsonl goes through parse_record; `masrl plot` was a TypeError traceback."""
    from masrl.monitoring.logger import read_metrics

    lines = [{"step": 1, "phase": "train", "team/reward": 0.5}, {"step": 2, "phase": "train", **bad},
             {"step": 3, "phase": "train", "team/reward": 0.7}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3] and "team/reward" not in records[1]
    assert main(["plot", str(tmp_path)]) == 0, capsys.readouterr().err
    assert (tmp_path / "plots" / "training_curves.png").stat().st_size > 0


MOA = {"workflow.name": "proposers_summarizer", "workflow.params": {"n_proposers": 2},
       "workflow.prompts": {"Proposer": "Q {question}\nS ", "Summarizer": "Q {question}\n{proposals}A ",
                            "proposal": "{text}\n"},
       "agents": {"Proposer": {"policy": "shared", "max_new_tokens": 4},
                  "Summarizer": {"policy": "shared", "max_new_tokens": 4}}}


@pytest.mark.parametrize("kind", ["folder", "under_a_file"])
def test_ensemble_collect_out_checked_before_the_team_runs(write_cfg, tmp_path, capsys, kind):
    """A folder as --out failed with IsADirectoryError only after every episode had run (the work lost)."""
    taken = tmp_path / "taken"
    taken.mkdir() if kind == "folder" else taken.write_text("mine\n")
    out = taken if kind == "folder" else taken / "preds.jsonl"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = main(["ensemble", "collect", str(write_cfg(**MOA)), "--bench", "test", "--limit", "2", "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 2 and "Traceback" not in captured.err and str(taken) in captured.err, captured.err
    assert "--out" in captured.err and "ensemble collect:" not in captured.out  # refused before the team ran


def test_outputs_are_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """eval.json, samples.jsonl, ensemble predictions and reports go through write_text_atomic: a disk that
    fills mid-write leaves the previous file whole and no half-written one."""
    from pathlib import Path

    from masrl.io.atomic import write_text_atomic

    target = tmp_path / "eval.json"
    target.write_text('{"old": true}')
    real = Path.write_text

    def half_then_full_disk(self, text, *a, **k):
        real(self, text[: len(text) // 2], *a, **k)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", half_then_full_disk)
    with pytest.raises(OSError, match="No space"):
        write_text_atomic(target, '{"new": "' + "x" * 1000 + '"}')
    monkeypatch.undo()
    assert target.read_text() == '{"old": true}' and [p.name for p in tmp_path.iterdir()] == ["eval.json"]
    write_text_atomic(target, "{}")
    assert target.read_text() == "{}"


@pytest.mark.parametrize("command", ["train", "eval", "sweep", "ensemble", "plot"])
def test_dangling_symlink_where_an_output_folder_goes_is_one_clear_error(write_cfg, tmp_path, capsys, command):
    """mkdir cannot create through a dangling symlink: every command was a FileExistsError traceback (the
    sweep's dry run exited 0). All of them check their output folder with paths.check_output_dir."""
    link = tmp_path / "out"
    link.symlink_to(tmp_path / "nowhere")
    cfg = write_cfg()
    if command == "train":
        argv = ["train", cfg, "--output-dir", link]
    elif command == "eval":
        argv = ["eval", cfg, "--out", link]
    elif command == "sweep":
        spec = tmp_path / "spec.yaml"
        spec.write_text(yaml.safe_dump({"name": "s", "base": str(cfg), "seeds": [0],
                                        "axes": {"a": {"key": "eval.n", "values": [1]}}}))
        argv = ["sweep", spec, "--out", link, "--dry-run"]
    elif command == "ensemble":
        data = tmp_path / "preds.jsonl"
        data.write_text("\n".join(json.dumps(r) for r in _ensemble_rows(["1", "2", "3"] * 5)) + "\n")
        argv = ["ensemble", "select", "--data", data, "--k", "2", "--out", link]
    else:
        run = tmp_path / "run"
        run.mkdir()
        (run / "metrics.jsonl").write_text('{"step": 1, "team/reward": 0.5}\n')
        link.rename(run / "plots")
        link = run / "plots"
        argv = ["plot", run]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert "symlink" in err and str(link) in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "nowhere").exists()
