"""Where masrl writes: every folder or file the user chooses passes ``masrl.paths.check_output_dir`` /
``check_output_file`` before any work (a dangling symlink anywhere on the path, a final symlink to a file,
a file where a folder goes, an unwritable parent: one error line, exit 2, nothing written); what it reads
back: damaged checkpoints fall back to the previous step (or are one line with an explicit step), user text
with a UTF-8 byte-order mark loads, and an error quoting a huge value stays short."""
import json
import os
import shutil
import warnings
from pathlib import Path

import pytest
import yaml

from masrl.cli import main
from masrl.errors import UserInputError
from masrl.paths import check_output_dir, check_output_file, sha256_file
from masrl.training.checkpoint import verify_checkpoint
from test_export import _fake_run

QUICK = {"sft.steps": 0, "trainer.total_steps": 0, "eval.before_after": False,
         "logging.tensorboard": False, "logging.plots": False, "logging.progress": False}


def _cli(argv, capsys):
    """``(exit code, stderr)`` of ``masrl argv``."""
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        code = main([str(a) for a in argv])
    return code, capsys.readouterr().err


def _one_line_error(code, err, *needles):
    assert code == 2 and "Traceback" not in err, err
    lines = [line for line in err.strip().splitlines() if line.startswith("masrl:")]
    assert len(lines) == 1 and len(err.strip().splitlines()) == 1, err
    for needle in needles:
        assert str(needle) in lines[0], (needle, err)


@pytest.fixture
def write_cfg(tmp_path, tiny_cfg):
    def write(name="cfg.yaml", **over):
        path = tmp_path / name
        path.write_text(yaml.safe_dump(tiny_cfg(**{**QUICK, **over})))
        return path
    return write


# ---------------------------------------------------------------------------- output paths

def _dangling(tmp_path, name="out"):
    link = tmp_path / name
    link.symlink_to(tmp_path / "elsewhere" / "target")
    (tmp_path / "elsewhere").mkdir()
    return link


@pytest.mark.parametrize("tail", ["", "sub/deeper"])
def test_export_out_through_a_dangling_symlink_is_refused_and_nothing_is_written(tmp_path, tiny_cfg, capsys,
                                                                                 tail):
    """``export --out LINK`` resolved the link first and wrote 11 files at its target."""
    _, run = _fake_run(tmp_path, tiny_cfg, "run")
    link = _dangling(tmp_path)
    out = link / tail if tail else link
    _one_line_error(*_cli(["export", run, "--out", out], capsys), "symlink", link)
    assert list((tmp_path / "elsewhere").iterdir()) == []


@pytest.mark.parametrize("via", ["config", "--output-dir"])
def test_train_run_folder_under_a_dangling_symlink_is_refused(tmp_path, write_cfg, capsys, via):
    link = _dangling(tmp_path)
    run_dir = link / "run"
    if via == "config":
        argv = ["train", write_cfg(output_dir=str(run_dir))]
    else:
        argv = ["train", write_cfg(), "--output-dir", run_dir]
    _one_line_error(*_cli(argv, capsys), "symlink", link)
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_check_output_dir_rules(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "to_dir").symlink_to(real)
    assert check_output_dir(tmp_path / "to_dir") == tmp_path / "to_dir"  # a symlink to a folder: that folder
    assert check_output_dir(tmp_path / "to_dir" / "new" / "sub")
    (tmp_path / "file").write_text("x")
    (tmp_path / "to_file").symlink_to(tmp_path / "file")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    cases = {tmp_path / "to_file": "symlink to the file", tmp_path / "file": "is a file",
             tmp_path / "file" / "sub": "is a file", tmp_path / "to_file" / "sub": "is a file",
             tmp_path / "loop" / "x": "loop"}
    for path, needle in cases.items():
        with pytest.raises(UserInputError, match=needle):
            check_output_dir(path, "--out")
    with pytest.raises(UserInputError, match="is a folder"):
        check_output_file(real, "--out")
    with pytest.raises(UserInputError, match="symlink"):
        check_output_file(tmp_path / "to_file", "--out")
    assert check_output_file(real / "preds.jsonl") == real / "preds.jsonl"


def test_unwritable_parent_is_one_line(tmp_path, monkeypatch):
    """The nearest existing folder is asked (``os.access``), so the test holds when it runs as root too."""
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != locked and real_access(p, mode))
    with pytest.raises(UserInputError, match="locked is not writable"):
        check_output_dir(locked / "run" / "sub", "run folder")
    assert check_output_dir(tmp_path / "free")


def test_config_show_refuses_the_run_folder_train_refuses(tmp_path, write_cfg, capsys):
    link = _dangling(tmp_path)
    _one_line_error(*_cli(["config", "show", write_cfg(output_dir=str(link / "run"))], capsys), "symlink", link)
    (tmp_path / "afile").write_text("x")
    _one_line_error(*_cli(["config", "show", write_cfg(output_dir=str(tmp_path / "afile"))], capsys), "afile")


# ---------------------------------------------------------------------------- checkpoints read back

def _run_with_damaged_newest(tmp_path, tiny_cfg):
    """A run whose newest checkpoint (step_4) has a damaged safetensors header that its manifest vouches for."""
    _, run = _fake_run(tmp_path, tiny_cfg, "run", **{"sft.steps": 0, "eval.before_after": False})
    newest = run / "checkpoints" / "step_4"
    shutil.copytree(run / "checkpoints" / "step_3", newest)
    weights = newest / "policies" / "shared" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:8] + b"{garbage" + data[16:])
    manifest = json.loads((newest / "manifest.json").read_text())
    manifest["files"] = {rel: sha256_file(newest / rel) for rel in manifest["files"]}
    (newest / "manifest.json").write_text(json.dumps(manifest))
    verify_checkpoint(newest)
    return run, weights


def test_export_falls_back_past_a_damaged_header_and_an_explicit_step_is_one_line(tmp_path, tiny_cfg, capsys):
    run, damaged = _run_with_damaged_newest(tmp_path, tiny_cfg)
    with pytest.warns(UserWarning, match=r"step_4/policies/shared/model.safetensors.*falling back") as caught:
        assert main(["export", str(run), "--out", str(tmp_path / "exp")]) == 0
    assert len(caught) == 1 and "\n" not in str(caught[0].message)
    assert json.loads((tmp_path / "exp" / "export.json").read_text())["step"] == 3
    capsys.readouterr()  # the export's own progress lines
    _one_line_error(*_cli(["export", run, "--out", tmp_path / "exp4", "--step", "4"], capsys), "--step 4", damaged)
    assert not (tmp_path / "exp4").exists()


def test_eval_falls_back_past_a_damaged_header_and_an_explicit_step_is_one_line(tmp_path, tiny_cfg, capsys):
    run, damaged = _run_with_damaged_newest(tmp_path, tiny_cfg)
    out = tmp_path / "eval"
    argv = ["eval", run / "config.yaml", "--n", "1", "--limit", "1", "--out", out, "--checkpoint"]
    with pytest.warns(UserWarning, match=r"step_4/policies/shared/model.safetensors.*falling back"):
        assert main([str(a) for a in [*argv, run]]) == 0
    assert json.loads((out / "eval.json").read_text())["meta"]["checkpoint"].endswith("step_3")
    capsys.readouterr()
    _one_line_error(*_cli([*argv, run / "checkpoints" / "step_4", "--overwrite"], capsys), damaged)


# ---------------------------------------------------------------------------- messages and text

@pytest.mark.parametrize("key", ["workflow.name", "trainer.group_size", "task.name"])
def test_a_huge_value_gives_a_short_error_line(write_cfg, tmp_path, capsys, key):
    huge = "x" * 500_000  # the config file limit is 1 MiB
    code, err = _cli(["config", "show", write_cfg(**{key: huge})], capsys)
    _one_line_error(code, err, key.split(".")[0], "characters")
    assert len(err) < 2500, len(err)


def test_a_huge_override_gives_a_short_error_line(write_cfg, capsys):
    code, err = _cli(["config", "show", write_cfg(), "x" * (1 << 20)], capsys)
    _one_line_error(code, err, "override", "characters")
    assert len(err) < 2500, len(err)


def test_skipped_checkpoint_warning_prints_as_one_line(tmp_path, tiny_cfg):
    import subprocess
    import sys

    run, damaged = _run_with_damaged_newest(tmp_path, tiny_cfg)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    proc = subprocess.run([sys.executable, "-m", "masrl", "export", str(run), "--out", str(tmp_path / "exp")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "skipping checkpoint" in line]
    assert len(lines) == 1 and lines[0].startswith("masrl: warning:") and str(damaged) in lines[0], proc.stderr
    assert "warnings.warn" not in proc.stderr


BOM = "\ufeff"


def test_a_config_and_a_sweep_spec_with_a_byte_order_mark_load(tmp_path, tiny_cfg, capsys):
    from masrl.config import load_config
    from masrl.io.bounded_yaml import read_yaml_file

    path = tmp_path / "bom.yaml"
    path.write_text(BOM + yaml.safe_dump(tiny_cfg(**QUICK)), encoding="utf-8")
    assert load_config(path).name == "test"
    assert main(["config", "show", str(path)]) == 0
    assert "name: test" in capsys.readouterr().out
    spec = tmp_path / "spec.yaml"
    spec.write_text(BOM + "name: s\nseeds: [0]\n", encoding="utf-8")
    assert read_yaml_file(spec, "sweep spec") == {"name": "s", "seeds": [0]}


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".jsonl.gz"])
def test_data_rows_with_a_byte_order_mark_load(tmp_path, suffix):
    import gzip

    from masrl.io.rows import iter_records

    rows = [{"question": "1+1", "answer": "2"}, {"question": "2+2", "answer": "4"}]
    text = json.dumps(rows) if suffix == ".json" else "".join(json.dumps(r) + "\n" for r in rows)
    path = tmp_path / f"rows{suffix}"
    data = (BOM + text).encode("utf-8")
    path.write_bytes(gzip.compress(data) if suffix.endswith(".gz") else data)
    assert [row for _, row in iter_records(path)] == rows


def test_ensemble_predictions_with_a_byte_order_mark_load(tmp_path):
    from masrl.ensemble.data import load_jsonl

    rows = [{"id": str(i), "label": "1", "predictions": {"a": {"answer": "1"}, "b": {"answer": "2"}}}
            for i in range(3)]
    path = tmp_path / "preds.jsonl"
    path.write_text(BOM + "".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    data = load_jsonl(path)
    assert data.models == ["a", "b"] and len(data.accuracy()) == 2


def test_data_get_dir_and_cache_dir_under_a_dangling_symlink_are_refused(tmp_path, capsys, monkeypatch):
    from masrl.paths import cache_dir

    link = _dangling(tmp_path)
    _one_line_error(*_cli(["data", "get", "gsm8k", "--dir", link / "data"], capsys), "--dir", "symlink", link)
    monkeypatch.setenv("MASRL_DATA_DIR", str(link))
    _one_line_error(*_cli(["data", "get", "gsm8k"], capsys), "data folder", "symlink", link)
    monkeypatch.setenv("MASRL_CACHE_DIR", str(link / "cache"))
    with pytest.raises(UserInputError, match=r"\$MASRL_CACHE_DIR.*symlink"):
        cache_dir()
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_every_file_of_a_run_folder_gets_the_umask_mode(tiny_cfg):
    """Checkpoint weights (safetensors writes 0600) and plots (written through a temporary file) come out as any
    other file of the run: 0644 under umask 022, 0640 under 027."""
    import os
    import stat

    from masrl.config import config_from_dict
    from masrl.io.atomic import write_file_atomic
    from masrl.monitoring.dashboard import plot_dashboard
    from masrl.trainer import Trainer

    cfg = config_from_dict(tiny_cfg(**{"sft.steps": 0, "trainer.total_steps": 1, "trainer.batch_size": 1,
                                       "trainer.group_size": 2, "eval.before_after": False}))
    old = os.umask(0o022)
    try:
        with Trainer(cfg) as trainer:
            trainer.fit()
        plot_dashboard(cfg.run_dir)
        modes = {str(p.relative_to(cfg.run_dir)): oct(stat.S_IMODE(p.stat().st_mode))
                 for p in cfg.run_dir.rglob("*") if p.is_file()}
        assert any(k.endswith("model.safetensors") for k in modes) and "plots/dashboard.png" in modes
        assert {k: v for k, v in modes.items() if v != "0o644"} == {}
        os.umask(0o027)
        written = write_file_atomic(cfg.run_dir / "x.bin", lambda tmp: tmp.write_bytes(b"x"))
        assert stat.S_IMODE(written.stat().st_mode) == 0o640
    finally:
        os.umask(old)
