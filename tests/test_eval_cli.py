"""`masrl eval` on a trained tiny checkpoint writes the console table, eval.json, eval.md and samples."""
import json
import re

import yaml

from masrl.cli import main
from masrl.config import config_from_dict
from masrl.trainer import Trainer


def test_eval_of_tiny_checkpoint_writes_all_outputs(tmp_path, tiny_cfg, capsys):
    data = tiny_cfg(**{"trainer.total_steps": 1})
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(data))
    Trainer(config_from_dict(data)).fit()
    out = tmp_path / "eval"
    code = main(["eval", str(cfg_path), "--checkpoint", data["output_dir"], "--bench", "test",
                 "--n", "3", "--k", "1,2", "--limit", "4", "--out", str(out)])
    assert code == 0
    result = json.loads((out / "eval.json").read_text())
    test = result["results"]["test"]
    assert test["n_tasks"] == 4 and test["n"] == 3
    assert 0.0 <= test["avg@n"] <= test["pass@2"] <= 1.0
    assert result["meta"]["checkpoint"].endswith("step_1")
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 12 and all(s["turns"] and s["turns"][0]["agent"] == "Solver" for s in samples)
    assert "pass@2" in (out / "eval.md").read_text()
    assert "team accuracy" in capsys.readouterr().out


def test_eval_unknown_bench_is_a_clear_error(tmp_path, tiny_cfg, capsys):
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(tiny_cfg()))
    assert main(["eval", str(cfg_path), "--bench", "nosuchbench", "--out", str(tmp_path / "o")]) == 2
    assert "unknown benchmark 'nosuchbench'" in capsys.readouterr().err


def test_periodic_eval_covers_extra_benches(tiny_cfg, tmp_path):
    """eval.every + eval.benches: the training loop logs eval/<bench>/... with the same code as masrl eval."""
    from masrl.paths import data_dir

    if not (data_dir() / "math" / "gsm8k_test.jsonl").is_file():
        import pytest

        pytest.skip("GSM8K data not found (MASRL_DATA_DIR)")
    data = tiny_cfg(**{"trainer.total_steps": 2, "eval.every": 1, "eval.benches": ["gsm8k"], "eval.limit": 2})
    cfg = config_from_dict(data)
    Trainer(cfg).fit()
    records = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["phase"] == "eval"]
    assert [r["step"] for r in evals] == [0, 1, 2]
    assert all("eval/gsm8k/pass@2" in r and "eval/test/avg@n" in r for r in evals)


def test_eval_shows_progress_and_accuracy_so_far(tmp_path, tiny_cfg, capsys):
    """A long evaluation prints progress lines (not a terminal: one line per 5%, at most one a second, and the
    last); the last line's correct count is the evaluation's own avg@n x episodes."""
    data = tiny_cfg(**{"logging.progress": True})
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(data))
    out = tmp_path / "eval"
    assert main(["eval", str(cfg_path), "--n", "3", "--k", "1", "--limit", "5", "--out", str(out)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[eval test ")]
    assert lines, "no progress line"
    assert re.fullmatch(r"\[eval test 0/15 +\d+s\] (1 agent turn|\d+ agent turns) generated", lines[0]), lines[0]
    assert not re.search(r"\b1 agent turns\b", "\n".join(lines))  # singular for one turn
    last = re.fullmatch(r"\[eval test 15/15 eta +0s\] correct (\d+)/15", lines[-1])
    assert last, lines[-1]
    avg = json.loads((out / "eval.json").read_text())["results"]["test"]["avg@n"]
    assert int(last.group(1)) == round(avg * 15)


def test_eval_without_checkpoint_uses_the_runs_newest_and_says_so(tmp_path, tiny_cfg, capsys):
    """No --checkpoint: the config's run folder's newest checkpoint is evaluated (first line and eval.md say
    which); a second evaluation into the same folder is refused without --overwrite."""
    data = tiny_cfg(**{"trainer.total_steps": 1})
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(data))
    Trainer(config_from_dict(data)).fit()
    capsys.readouterr()
    argv = ["eval", str(cfg_path), "--n", "1", "--k", "1", "--limit", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("masrl eval: weights: ") and "step_1" in out[0] and "newest checkpoint" in out[0]
    eval_dir = config_from_dict(data).run_dir / "eval"
    assert json.loads((eval_dir / "eval.json").read_text())["meta"]["checkpoint"].endswith("step_1")
    assert re.search(r"^weights: .*step_1$", (eval_dir / "eval.md").read_text(), re.M)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "already holds an evaluation" in err and "--overwrite" in err
    assert main([*argv, "--overwrite"]) == 0


def test_eval_of_a_run_folder_without_checkpoint_says_the_model_is_untrained(tmp_path, tiny_cfg, capsys):
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(tiny_cfg()))
    assert main(["eval", str(cfg_path), "--n", "1", "--k", "1", "--limit", "1", "--out", str(tmp_path / "o")]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("masrl eval: weights: a randomly initialised tiny model, never trained"), first
    assert "holds no checkpoint" in first
    assert "randomly initialised" in (tmp_path / "o" / "eval.md").read_text()


def test_eval_and_plot_help_describe_every_argument_with_its_default():
    import argparse

    from masrl.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name in ("eval", "plot"):
        for action in sub.choices[name]._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help, (name, action.dest)
            if action.option_strings:  # an option: its default is said
                assert "default" in action.help, (name, action.dest)
