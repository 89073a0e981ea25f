"""Crash safety: kill -9 mid-run then --resume, corrupt/partial checkpoints, interrupted saves.

See docs/reliability.md for the design these tests pin down.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import yaml

from conftest import tiny_config_dict
from masrl.cli import main
from masrl.config import config_from_dict
from masrl.monitoring.logger import read_metrics
from masrl.paths import sha256_file
from masrl.training import checkpoint as ckpt
from masrl.training.checkpoint import (CheckpointError, latest_valid_checkpoint, list_checkpoints,
                                       verify_checkpoint)
from masrl.trainer import Trainer

# fast runs: no SFT, no before/after evaluation, no TensorBoard/plots, one thread
FAST = {"sft.steps": 0, "eval.before_after": False, "logging.tensorboard": False, "logging.plots": False,
        "logging.progress": False, "trainer.threads": 1}
KEYS = ("team/", "agent/", "policy/")  # metrics that a deterministic step reproduces


def _train_steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir) if r.get("phase") == "train"]


def _flip_byte(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if offset is None else offset
    data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _subprocess_env() -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "") if env.get("PYTHONPATH") else src
    return env


# ----------------------------------------------------------------------------- kill -9, then resume

def test_kill_9_mid_run_then_resume_completes(tmp_path):
    total = 20
    run = tmp_path / "run"
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(tiny_config_dict(tmp_path, **FAST, **{"trainer.total_steps": total})))
    env = _subprocess_env()
    log = open(tmp_path / "first.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "masrl", "train", str(cfg_path), "trainer.save_every=1",
                             "logging.progress=false"], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:  # poll (with a deadline) until two checkpoints exist, then kill -9 while it is still training
        deadline = time.monotonic() + 240
        while len(list_checkpoints(run)) < 2:
            if proc.poll() is not None:
                pytest.fail(f"the run exited (rc {proc.returncode}) before 2 checkpoints appeared:\n"
                            + (tmp_path / "first.log").read_text()[-3000:])
            if time.monotonic() > deadline:
                pytest.fail("no 2 checkpoints within the deadline")
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed; raise total_steps"

    before = {r["step"]: r for r in read_metrics(run) if r.get("phase") == "train"}
    with warnings.catch_warnings():  # a checkpoint being pruned at the kill may be skipped, with a warning
        warnings.simplefilter("ignore")
        resume_from = latest_valid_checkpoint(run)
    assert resume_from is not None and resume_from.name.startswith("step_")
    k = int(resume_from.name[5:])
    assert k < total
    # a leftover temporary folder (what a kill during a save leaves) must never be taken as a checkpoint,
    # even one that holds a complete, verifiable checkpoint with a higher step number
    planted = run / "checkpoints" / f".step_{total + 99}.tmp-1"
    shutil.copytree(resume_from, planted)
    assert planted not in list_checkpoints(run)
    # a partial last line, as a kill during a metrics write leaves
    with open(run / "metrics.jsonl", "a", encoding="utf-8") as f:
        f.write('{"step": 999, "phase": "train", "team/rew')

    done = subprocess.run([sys.executable, "-m", "masrl", "train", "--resume", str(run), "logging.progress=false"],
                          env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"resumed from {resume_from} (step {k})" in done.stdout

    found = list_checkpoints(run)
    assert [p.name for p in found] == [f"step_{total - 1}", f"step_{total}"]  # keep_checkpoints: 2
    for p in found:
        verify_checkpoint(p)
    assert all(not p.name.startswith(".") for p in found)
    lines = (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    records = [json.loads(line) for line in lines]  # the partial line is gone: every line parses
    assert [r["step"] for r in records if r["phase"] == "train"] == list(range(1, total + 1))
    # steps logged before the kill but after the checkpoint were dropped and redone identically
    after = {r["step"]: r for r in records if r["phase"] == "train"}
    for step in sorted(s for s in before if s > k):
        for key, value in before[step].items():
            if key.startswith(KEYS) and isinstance(value, float):
                assert after[step][key] == pytest.approx(value, rel=1e-5, abs=1e-7), (step, key)


# ----------------------------------------------------------------------------- corrupt / partial checkpoints

@pytest.fixture(scope="module")
def pristine_run(tmp_path_factory):
    """A finished 2-step run with checkpoints step_0, step_1, step_2 (trained once per module)."""
    base = tmp_path_factory.mktemp("pristine")
    cfg = config_from_dict(tiny_config_dict(base, **FAST, **{"trainer.total_steps": 2, "trainer.save_every": 1,
                                                             "trainer.keep_checkpoints": 3}))
    Trainer(cfg).fit()
    assert [p.name for p in list_checkpoints(cfg.run_dir)] == ["step_0", "step_1", "step_2"]
    return cfg.run_dir


@pytest.fixture
def run_copy(pristine_run, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(pristine_run, dst)
    cfg = yaml.safe_load((dst / "config.yaml").read_text())
    cfg["output_dir"] = str(dst)
    (dst / "config.yaml").write_text(yaml.safe_dump(cfg))
    return dst


def test_corrupt_newest_checkpoint_falls_back_and_resume_continues(run_copy, capsys):
    run = run_copy
    step2_before = next(r for r in read_metrics(run) if r.get("phase") == "train" and r["step"] == 2)
    _flip_byte(run / "checkpoints" / "step_2" / "policies" / "shared" / "model.safetensors")
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        verify_checkpoint(run / "checkpoints" / "step_2")
    with pytest.warns(UserWarning, match=r"step_2.*checksum mismatch.*falling back"):
        assert latest_valid_checkpoint(run) == run / "checkpoints" / "step_1"

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["train", "--resume", str(run), "trainer.total_steps=3"]) == 0
    out = capsys.readouterr().out
    assert f"resumed from {run / 'checkpoints' / 'step_1'} (step 1)" in out
    assert _train_steps(run) == [1, 2, 3]
    # step 2 was logged before, dropped on resume from step_1, and redone identically
    step2_after = next(r for r in read_metrics(run) if r.get("phase") == "train" and r["step"] == 2)
    compared = [k for k, v in step2_before.items() if k.startswith(KEYS) and isinstance(v, float)]
    assert compared
    for key in compared:
        assert step2_after[key] == pytest.approx(step2_before[key], rel=1e-5, abs=1e-7), key
    found = list_checkpoints(run)
    assert [p.name for p in found] == ["step_1", "step_2", "step_3"]
    for p in found:  # step_2 was redone and rewritten: it verifies again
        verify_checkpoint(p)


def _no_manifest(step_dir: Path) -> None:
    (step_dir / "manifest.json").unlink()


def _binary_manifest(step_dir: Path) -> None:
    (step_dir / "manifest.json").write_bytes(b"\xff\xfe\x00garbage\x80")


def _truncated_manifest(step_dir: Path) -> None:
    path = step_dir / "manifest.json"
    path.write_bytes(path.read_bytes()[:20])


def _manifest_not_an_object(step_dir: Path) -> None:
    (step_dir / "manifest.json").write_text("[1, 2, 3]")


def _manifest_without_files(step_dir: Path) -> None:
    (step_dir / "manifest.json").write_text(json.dumps({"format_version": 1, "step": 3}))


def _missing_weights(step_dir: Path) -> None:
    (step_dir / "policies" / "shared" / "optimizer.safetensors").unlink()


def _truncated_state(step_dir: Path) -> None:
    path = step_dir / "trainer_state.json"
    path.write_bytes(path.read_bytes()[:-10])


@pytest.mark.parametrize("damage", [_no_manifest, _binary_manifest, _truncated_manifest, _manifest_not_an_object,
                                    _manifest_without_files, _missing_weights, _truncated_state],
                         ids=lambda f: f.__name__.strip("_"))
def test_partial_or_damaged_newest_checkpoint_is_skipped(run_copy, damage):
    run = run_copy
    newest = run / "checkpoints" / "step_3"  # a newer, damaged checkpoint beside the good ones
    shutil.copytree(run / "checkpoints" / "step_2", newest)
    damage(newest)
    assert newest in list_checkpoints(run)
    with pytest.raises(CheckpointError):
        verify_checkpoint(newest)
    with pytest.warns(UserWarning, match="step_3"):
        assert latest_valid_checkpoint(run) == run / "checkpoints" / "step_2"


def test_no_valid_checkpoint_is_a_clear_resume_error(run_copy, capsys):
    for p in list_checkpoints(run_copy):
        (p / "manifest.json").unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["train", "--resume", str(run_copy)]) == 2
    err = capsys.readouterr().err
    assert "no valid checkpoint" in err and "Traceback" not in err


def _rehash(step_dir: Path) -> None:
    """Re-checksum every file into the manifest: the damage below passes verification."""
    manifest = json.loads((step_dir / "manifest.json").read_text())
    manifest["files"] = {rel: sha256_file(step_dir / rel) for rel in manifest["files"]}
    (step_dir / "manifest.json").write_text(json.dumps(manifest))


def _garbage_safetensors_header(step_dir: Path) -> None:
    path = step_dir / "policies" / "shared" / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:8] + b"{garbage" + data[16:])


def _huge_safetensors_header_length(step_dir: Path) -> None:
    path = step_dir / "policies" / "shared" / "optimizer.safetensors"
    path.write_bytes((2**62).to_bytes(8, "little") + path.read_bytes()[8:])


def _optimizer_json_not_an_object(step_dir: Path) -> None:
    (step_dir / "policies" / "shared" / "optimizer.json").write_text('"adam"')


def _optimizer_state_of_another_shape(step_dir: Path) -> None:
    path = step_dir / "policies" / "shared" / "optimizer.json"
    meta = json.loads(path.read_text())
    meta["param_groups"] = meta["param_groups"] * 2  # two groups for one: does not fit the optimizer
    path.write_text(json.dumps(meta))


def _state_without_step(step_dir: Path) -> None:
    (step_dir / "trainer_state.json").write_text('{"rng": {}}')


def _weights_of_another_shape(step_dir: Path) -> None:
    from safetensors.torch import load_file, save_file

    path = step_dir / "policies" / "shared" / "model.safetensors"
    weights = load_file(str(path))
    name = next(iter(weights))
    weights[name] = weights[name].reshape(-1)[:3].clone()
    save_file(weights, str(path))


@pytest.mark.parametrize("damage", [_garbage_safetensors_header, _huge_safetensors_header_length,
                                    _optimizer_json_not_an_object, _optimizer_state_of_another_shape,
                                    _state_without_step, _weights_of_another_shape],
                         ids=lambda f: f.__name__.strip("_"))
def test_hashed_but_unloadable_checkpoint_falls_back_on_resume(run_copy, damage, capsys):
    """A file that passes its checksum but does not load (it was damaged before it was hashed) is
    skipped like a checksum mismatch: --resume goes on from the previous checkpoint."""
    run = run_copy
    newest = run / "checkpoints" / "step_3"
    shutil.copytree(run / "checkpoints" / "step_2", newest)
    damage(newest)
    _rehash(newest)
    verify_checkpoint(newest)  # the manifest vouches for it
    with pytest.warns(UserWarning, match=r"step_3.*falling back"):
        assert main(["train", "--resume", str(run), "trainer.total_steps=2"]) == 0
    captured = capsys.readouterr()
    assert f"resumed from {run / 'checkpoints' / 'step_2'} (step 2)" in captured.out, captured
    assert "Traceback" not in captured.err


def test_eval_of_a_run_falls_back_past_an_unloadable_checkpoint(run_copy, tmp_path):
    """``masrl eval --checkpoint RUN_DIR`` picked the newest checksummed checkpoint, then failed to load it."""
    run = run_copy
    newest = run / "checkpoints" / "step_3"
    shutil.copytree(run / "checkpoints" / "step_2", newest)
    _garbage_safetensors_header(newest)
    _rehash(newest)
    out = tmp_path / "eval"
    with pytest.warns(UserWarning, match=r"step_3.*falling back"):
        assert main(["eval", str(run / "config.yaml"), "--checkpoint", str(run), "--n", "1", "--limit", "2",
                     "--out", str(out)]) == 0
    assert json.loads((out / "eval.json").read_text())["meta"]["checkpoint"] == str(run / "checkpoints" / "step_2")


# ----------------------------------------------------------------------------- atomic writes

def test_interrupted_save_leaves_previous_checkpoints_intact(tmp_path, monkeypatch):
    cfg = config_from_dict(tiny_config_dict(tmp_path, **FAST, **{"trainer.total_steps": 0}))
    trainer = Trainer(cfg)
    run = cfg.run_dir
    trainer.save(0)
    before = list_checkpoints(run)
    assert [p.name for p in before] == ["step_0"]
    manifest_before = (before[0] / "manifest.json").read_text()

    real_save_file = ckpt.save_file
    calls = {"n": 0}

    def failing_save_file(tensors, filename, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:  # model.safetensors is written, optimizer.safetensors is not
            raise OSError("disk full (simulated)")
        return real_save_file(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(ckpt, "save_file", failing_save_file)
    with pytest.raises(OSError, match="simulated"):
        trainer.save(1)
    assert list_checkpoints(run) == before
    assert not (run / "checkpoints" / "step_1").exists()
    leftovers = [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".step_1.tmp-")]
    assert leftovers, "the half-written checkpoint should sit under a temporary name"

    # re-saving an existing step that fails midway keeps the old copy, byte for byte
    calls["n"] = 0
    with pytest.raises(OSError, match="simulated"):
        trainer.save(0)
    assert list_checkpoints(run) == before
    assert (before[0] / "manifest.json").read_text() == manifest_before
    verify_checkpoint(before[0])

    # once the disk is back, the next save of that step replaces the temporary folder and succeeds
    monkeypatch.setattr(ckpt, "save_file", real_save_file)
    trainer.save(1)
    assert [p.name for p in list_checkpoints(run)] == ["step_0", "step_1"]
    verify_checkpoint(run / "checkpoints" / "step_1")
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".step_1.tmp-")]
