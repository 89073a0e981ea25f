"""What a new user meets first: overrides anywhere on the command line, `config show` spelling out the
defaults in effect, one line for a misspelt data field, masrl's warnings as one line, a report that states
what was evaluated, one name per evaluation stage."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from masrl.cli import _parse, build_parser, main

ROOT = Path(__file__).resolve().parents[1]
SINGLE = ["workflow={name: single, params: {}}", "agents={Solver: {policy: team}}"]


def test_overrides_after_options():
    args = _parse(build_parser(), ["train", "c.yaml", "a=1", "--output-dir", "X", "seed=2", "--overwrite", "b=3"])
    assert (args.config, args.overrides, args.output_dir, args.overwrite) == ("c.yaml", ["a=1", "seed=2", "b=3"],
                                                                              "X", True)
    args = _parse(build_parser(), ["eval", "c.yaml", "--n", "2", "seed=3"])
    assert args.overrides == ["seed=3"] and args.n == 2


def test_unknown_option_is_still_refused(capsys):
    try:
        _parse(build_parser(), ["train", "c.yaml", "--output-dri", "X"])
    except SystemExit as e:
        assert e.code == 2
    assert "unrecognized arguments: --output-dri" in capsys.readouterr().err


def test_config_show_spells_out_default_prompts_and_trackers(capsys):
    assert main(["config", "show", str(ROOT / "examples/voting_shared.yaml"), *SINGLE]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    from masrl.workflows.single import SINGLE_PROMPTS

    assert shown["workflow"]["prompts"] == SINGLE_PROMPTS
    assert shown["logging"]["report_to"] == ["tensorboard"]
    # what it prints is a config that trains the same way
    assert main(["config", "show", str(ROOT / "examples/quickstart.yaml"), "logging.tensorboard=false"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["logging"]["report_to"] == []


def _data(tmp_path: Path, rows: list[dict]) -> Path:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _dataset_cfg(tmp_path: Path, data: Path, fields: str) -> list[str]:
    return ["config", "show", str(ROOT / "examples/dataset_jsonl.yaml"), f"task.params.train={data}",
            f"task.params.test={data}", f"task.params.fields={fields}"]


def test_misspelt_field_is_one_line(tmp_path):
    data = _data(tmp_path, [{"q": f"{i}+1", "a": i + 1} for i in range(30)])
    out = subprocess.run([sys.executable, "-m", "masrl", *_dataset_cfg(tmp_path, data, "{question: question, answer: a}")],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert "no row has the question field 'question' (task.params.fields.question)" in lines[0]
    assert "fields: a, q" in lines[0]


def test_masrl_warnings_are_one_line_each(tmp_path):
    rows = [{"q": f"{i}+1", "a": i + 1} for i in range(30)] + [{"a": 1}]
    data = _data(tmp_path, rows)
    out = subprocess.run([sys.executable, "-m", "masrl", *_dataset_cfg(tmp_path, data, "{question: q, answer: a}")],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    warned = [line for line in out.stderr.splitlines() if "missing field" in line]
    assert warned and all(line.startswith("masrl: warning: ") for line in warned), out.stderr
    assert "parse_rows(" not in out.stderr  # no source line of masrl's own code


def test_report_states_what_was_evaluated(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", str(ROOT / "examples/voting_shared.yaml"), *SINGLE, "--output-dir", str(run),
                 "trainer.total_steps=1", "trainer.batch_size=2", "trainer.group_size=2", "sft.steps=2",
                 "eval.limit=6", "eval.n=2", "eval.k=[1,2]", "logging.progress=false", "logging.plots=false"]) == 0
    report = (run / "report.md").read_text()
    assert "eval n=2 on 6 held-out tasks" in report, report
    assert "| after SFT |" in report and "| after RL |" in report
    printed = capsys.readouterr().out
    assert "after SFT" in printed and "after RL" in printed


def test_stage_names_agree():
    from masrl.evaluation.metrics import stage_name

    assert [stage_name(s, 10) for s in ("sft", "final", "step_10")] == ["after SFT", "after RL", "step_10"]
    assert stage_name("sft", 0) == "before RL"


def test_progress_eta():
    from masrl.monitoring.progress import Progress

    rl = Progress(False, "RL", 100, completed=60)  # a resumed run: 60 steps done before this process
    rl.done = 70
    assert rl.eta(rl.start + 50.0) == 150.0  # 10 steps in 50 s -> 30 left take 150 s (not 60/70 of the time)
    ev = Progress(False, "eval test", 200)
    ev.done = 150
    assert ev.eta(ev.start + 10.0) is None  # episodes finish in bursts: no linear guess
    again = Progress(False, "eval test", 200, expected_s=80.0)
    again.done = 150
    assert again.eta(again.start + 30.0) == 50.0
    again.done = 200
    assert again.eta(again.start + 99.0) == 0.0


def test_output_cut_short_by_a_pipe_is_no_traceback():
    """`masrl data list | head -1`: the reader leaves before masrl writes; masrl stops without a traceback."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    proc = subprocess.Popen([sys.executable, "-m", "masrl", "data", "list"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)
    proc.stdout.close()  # the reader is gone before the first line
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 1 and "Traceback" not in err and "BrokenPipe" not in err, err
