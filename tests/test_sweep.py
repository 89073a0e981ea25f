"""masrl sweep: spec validation, grid expansion, resumability, the statistics, the report, one real sweep."""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from masrl.cli import main as cli_main
from masrl.config import ConfigError, dump_config, load_config
from masrl.sweep import run as sweep_run
from masrl.sweep.report import report
from masrl.sweep.spec import SweepSpec, expand_cells, expand_runs, load_spec, parse_cell_name
from masrl.sweep.stats import mean_ci, paired, t_quantile

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = "examples/quickstart.yaml"
SEPARATE = ["agents.Verifier.policy=verifier", "policies.verifier={model: tiny, tiny: {hidden_size: 32}}"]


def spec_dict(**over) -> dict:
    spec = {"name": "e1", "base": QUICKSTART, "out": "runs/sweeps/e1", "seeds": [0, 1],
            "overrides": ["trainer.threads=1"],
            "axes": {"estimator": {"key": "algorithm.estimator", "values": ["grpo", "drmas"]},
                     "mapping": {"shared": [], "separate": SEPARATE}}}
    spec.update(over)
    return spec


def write_spec(tmp_path: Path, **over) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec_dict(**over), sort_keys=False))
    return path


# ---------------------------------------------------------------------- spec

@pytest.mark.parametrize("over, needle", [
    ({"axis": {}}, "unknown key 'axis'"),
    ({"seeds": []}, "key 'seeds'"),
    ({"seeds": [0, 0]}, "seeds repeat"),
    ({"axes": {"estimator": {"key": "algorithm.estimator"}}}, "key 'axes.estimator'"),
    ({"axes": {"estimator": {"key": "algorithm.estimator", "values": ["a/b"]}}}, "label 'a/b'"),
    ({"axes": {"est__x": {"key": "algorithm.estimator", "values": ["grpo"]}}}, "axis name 'est__x'"),
    ({"axes": {"m": {"shared": {"overrides": [], "bsae": "x.yaml"}}}}, "unknown key 'axes.m.shared.bsae'"),
    ({"axes": {"m": {"shared": ["trainer.threads"]}}}, "axes.m.shared: override 'trainer.threads'"),
    ({"overrides": ["seed=3"]}, "'seed' is set by the sweep"),
    ({"axes": {"k": {"key": "eval.k", "values": [[1, 2]]}}}, "value [1, 2] is not a string, number"),
    ({"axes": {"m": {"shared": "trainer.threads=1"}}}, "label 'shared': give a list of overrides"),
])
def test_spec_errors_name_the_key(tmp_path, over, needle):
    with pytest.raises(ConfigError) as e:
        load_spec(write_spec(tmp_path, **over))
    assert needle in str(e.value) and "spec.yaml" in str(e.value)


def test_spec_cli_errors_exit_2(tmp_path, capsys):
    assert cli_main(["sweep", str(write_spec(tmp_path, seeds="zero"))]) == 2
    assert "key 'seeds'" in capsys.readouterr().err
    assert cli_main(["sweep", str(tmp_path / "nope.yaml")]) == 2
    assert cli_main(["sweep", str(write_spec(tmp_path, base="missing.yaml")), "--dry-run"]) == 2
    assert "base config 'missing.yaml' does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # argparse: the option's type is bounded
        cli_main(["sweep", str(write_spec(tmp_path)), "--jobs", "0"])
    assert e.value.code == 2 and "argument --jobs: '0' is out of range" in capsys.readouterr().err
    assert cli_main(["sweep", str(write_spec(tmp_path)), "--gpus-per-run", "1"]) == 2
    assert "--gpus-per-run needs --ray" in capsys.readouterr().err
    assert cli_main(["sweep", "report", str(tmp_path)]) == 2
    assert "no sweep.json and no run folders" in capsys.readouterr().err
    bad = write_spec(tmp_path, axes={"lr": {"key": "policies.shared.optim.lr", "values": ["fast"]}})
    assert cli_main(["sweep", str(bad), "--dry-run", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "cell lr=fast (seed 0)" in err and "policies.shared.optim.lr" in err


def test_spec_and_options_refuse_booleans_and_impossible_values(tmp_path, capsys):
    """`seeds: [true]` is not seed 1; seeds past 2**32, --nice 100, --gpus-per-run nan and an --out
    that is a file are one line and exit 2 before anything runs."""
    assert cli_main(["sweep", str(write_spec(tmp_path, seeds=[True])), "--dry-run"]) == 2
    assert "key 'seeds.0'" in capsys.readouterr().err
    assert cli_main(["sweep", str(write_spec(tmp_path, seeds=[2 ** 40])), "--dry-run"]) == 2
    assert "seeds must be in 0..4294967295" in capsys.readouterr().err
    spec = str(write_spec(tmp_path))
    for args, needle in ((["--nice", "100"], "argument --nice: '100' is out of range; give an integer in -20..19"),
                         (["--ray", "local", "--gpus-per-run", "nan"], "argument --gpus-per-run: 'nan' is out of range"),
                         (["--out", spec], "is a file")):
        try:
            code = cli_main(["sweep", spec, "--dry-run", *args])
        except SystemExit as e:  # argparse refuses a bounded option
            code = e.code
        assert code == 2
        assert needle in capsys.readouterr().err


@pytest.mark.parametrize("text, needle", [
    ("a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\n" + "".join(
        f"{c}: &{c} [{', '.join(['*' + p] * 10)}]\n" for p, c in zip("abcdefg", "bcdefgh")), "alias"),
    ("x: " + "[" * 20000 + "]" * 20000 + "\n", "nest"),
    (b"name: \xff\xfe\n", "utf-8"),
], ids=["alias-bomb", "deep-nesting", "not-utf8"])
def test_spec_files_are_read_with_the_config_limits(tmp_path, capsys, text, needle):
    """An alias bomb, 20,000-deep nesting or a non-UTF-8 spec: one line naming the file, exit 2, at once."""
    spec = tmp_path / "spec.yaml"
    spec.write_bytes(text if isinstance(text, bytes) else text.encode())
    start = time.perf_counter()
    assert cli_main(["sweep", str(spec), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert time.perf_counter() - start < 10 and str(spec) in err and needle in err.lower() and len(err) < 2000


def test_two_bases_in_one_cell_is_an_error():
    spec = SweepSpec.model_validate(spec_dict(axes={
        "a": {"x": {"base": "one.yaml", "overrides": []}}, "b": {"y": {"base": "two.yaml"}}}))
    with pytest.raises(ConfigError, match="a=x__b=y: two axes set a base config"):
        expand_cells(spec)


# ---------------------------------------------------------------------- grid

def test_grid_expansion_cell_names_and_argv(tmp_path):
    spec = SweepSpec.model_validate(spec_dict(axes={
        "estimator": {"key": "algorithm.estimator", "values": ["grpo", "drmas"]},
        "lr": {"key": "policies.shared.optim.lr", "values": [1e-4, 3e-4]},
        "mapping": {"shared": [], "separate": {"overrides": SEPARATE, "base": "other.yaml"}}}))
    cells = expand_cells(spec)
    assert [c.name for c in cells][:3] == ["estimator=grpo__lr=0.0001__mapping=shared",
                                           "estimator=grpo__lr=0.0001__mapping=separate",
                                           "estimator=grpo__lr=0.0003__mapping=shared"]
    assert len(cells) == 8 and cells[1].base == "other.yaml" and cells[0].base == QUICKSTART
    assert cells[1].overrides == ("algorithm.estimator=grpo", "policies.shared.optim.lr=0.0001", *SEPARATE)
    assert parse_cell_name(cells[1].name) == cells[1].labels
    runs = expand_runs(spec, tmp_path / "out")
    assert [(r.seed, r.cell.name) for r in runs[7:9]] == [(0, cells[7].name), (1, cells[0].name)]  # seed-major
    argv = runs[1].argv("python")
    assert argv == ["python", "-m", "masrl.cli", "train", "other.yaml", "seed=0", "logging.progress=false",
                    "trainer.threads=1", "algorithm.estimator=grpo", "policies.shared.optim.lr=0.0001", *SEPARATE,
                    "--output-dir", str(tmp_path / "out" / cells[1].name / "seed0"), "--overwrite"]


def test_value_axis_overrides_read_back_as_the_value(tmp_path):
    spec = SweepSpec.model_validate(spec_dict(axes={
        "lr": {"key": "policies.shared.optim.lr", "values": [1e-4]},
        "drift": {"key": "monitoring.drift", "values": [False]}}))
    run = expand_runs(spec, tmp_path)[0]
    assert run.cell.name == "lr=0.0001__drift=False"
    cfg = run.config()
    assert cfg.policies["shared"].optim.lr == 1e-4 and cfg.monitoring.drift is False and cfg.seed == 0


def test_dry_run_prints_every_argv(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert cli_main(["sweep", str(write_spec(tmp_path)), "--dry-run", "--nice", "10",
                     "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith("nice -n 10 ")]
    assert len(lines) == 8 and "seed=1" in lines[-1] and "--overwrite" in lines[-1]
    assert "# estimator=drmas__mapping=separate seed 1 (to run)" in out
    assert not (tmp_path / "o").exists()  # a dry run writes nothing


def test_seeds_option_runs_only_those_seeds(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    spec = str(write_spec(tmp_path, seeds=[0, 1, 2]))
    assert cli_main(["sweep", spec, "--dry-run", "--seeds", "2,0", "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    seeds = [ln.split(" seed ")[1].split()[0] for ln in out.splitlines() if ln.startswith("# ")]
    assert seeds == ["0"] * 4 + ["2"] * 4  # the spec's order, seed 1 left out
    for value, needle in (("3", "--seeds 3: not among the seeds of"), ("1,x", "seeds must be whole numbers"),
                          ("1,1", "seeds repeat")):
        try:
            code = cli_main(["sweep", spec, "--dry-run", "--seeds", value])
        except SystemExit as e:  # argparse refuses the value
            code = e.code
        assert code == 2 and needle in capsys.readouterr().err


def test_a_seed_subset_sweep_runs_those_and_lists_all_seeds(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    spec = SweepSpec.model_validate(spec_dict(seeds=[0, 1, 2]))
    started = []

    def fake_execute(argv, log_path, cwd, env=None, nice=0):
        run = next(r for r in expand_runs(spec, tmp_path) if str(r.log_path) == log_path)
        started.append(run.seed)
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        finish_run(run)
        return {"argv": argv, "rc": 0, "wall_s": 1.0, "cpu_s": 1.0}

    monkeypatch.setattr(sweep_run, "execute", fake_execute)
    assert sweep_run.sweep(spec, tmp_path, seeds=[1]) == 0
    assert started == [1, 1, 1, 1] and "4 cells x 1 of 3 seeds = 4 runs" in capsys.readouterr().out
    assert json.loads((tmp_path / "sweep.json").read_text())["seeds"] == [0, 1, 2]


def test_shipped_example_spec_expands(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    spec = load_spec("examples/sweeps/quickstart_estimators.yaml")
    runs = expand_runs(spec, tmp_path)
    assert len(runs) == 20 and runs[1].cell.name == "estimator=grpo__mapping=separate"
    cfg = runs[1].config()
    assert cfg.agents["Verifier"].policy == "verifier" and set(cfg.policies) == {"shared", "verifier"}
    assert cfg.trainer.threads == 1 and cfg.algorithm.estimator == "grpo"


@pytest.mark.parametrize("path", sorted(p.relative_to(REPO).as_posix()
                                         for p in (REPO / "benchmarks" / "study").glob("*.yaml")))
def test_every_study_spec_expands_to_valid_configs(path, tmp_path, monkeypatch):
    """The study's specs are the commands docs/study.md publishes: each expands and every run's config loads."""
    monkeypatch.chdir(REPO)
    spec = load_spec(path)
    base = str(spec.base)
    if base.startswith("runs/") and not (REPO / base).exists():  # an earlier sweep's export
        pytest.skip(f"{path}: its base {base} is made by an earlier sweep")
    runs = expand_runs(spec, tmp_path)
    assert runs
    for run in runs:
        assert run.config().trainer.threads is None or run.config().trainer.threads >= 1


# ---------------------------------------------------------------------- resumability

def finish_run(run, steps: int | None = None, report_text: str | None = None) -> None:
    """Make ``run``'s folder look like a finished ``masrl train`` run (its real config.yaml)."""
    cfg = run.config()
    run.run_dir.mkdir(parents=True, exist_ok=True)
    (run.run_dir / "config.yaml").write_text(dump_config(cfg))
    report = {"steps": cfg.trainer.total_steps if steps is None else steps, "eval": {}}
    (run.run_dir / "report.json").write_text(report_text if report_text is not None else json.dumps(report))


def test_plan_skips_finished_runs_and_reruns_broken_ones(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    runs = expand_runs(SweepSpec.model_validate(spec_dict()), tmp_path)
    finish_run(runs[0])
    finish_run(runs[1], report_text='{"steps": 40, "ev')  # cut off mid-write
    finish_run(runs[2], steps=12)  # stopped early
    todo, done = sweep_run.plan(runs)
    assert done == [runs[0]] and todo == runs[1:]
    (runs[0].run_dir / "config.yaml").write_text(
        (runs[0].run_dir / "config.yaml").read_text().replace("lr: 0.0001", "lr: 0.0002"))
    with pytest.raises(ConfigError, match="(?s)another config than the spec asks for.*optim.lr: 0.0002 -> 0.0001"):
        sweep_run.plan(runs)


def test_sweep_runs_only_unfinished_runs_and_reports_failures(tmp_path, monkeypatch, capsys):
    """The orchestration with the process replaced: which runs start, records, progress, exit code."""
    monkeypatch.chdir(REPO)
    spec = SweepSpec.model_validate(spec_dict())
    runs = expand_runs(spec, tmp_path)
    finish_run(runs[0])
    started = []

    def fake_execute(argv, log_path, cwd, env=None, nice=0):
        run = next(r for r in runs if str(r.log_path) == log_path)
        started.append(run)
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        Path(log_path).write_text("boom\n" if run is runs[3] else "ok\n")
        if run is not runs[3]:
            finish_run(run)
        return {"argv": argv, "rc": 1 if run is runs[3] else 0, "wall_s": 2.0, "cpu_s": 1.5}

    monkeypatch.setattr(sweep_run, "execute", fake_execute)
    assert sweep_run.sweep(spec, tmp_path, jobs=2) == 1
    out = capsys.readouterr().out
    assert sorted(map(id, started)) == sorted(map(id, runs[1:])) and "1 finished (skipped), 7 to run" in out
    assert f"{runs[3].cell.name} seed {runs[3].seed}: rc 1" in out and "FAILED" in out
    assert out.count("ETA") == 7 and "1 of 7 runs failed" in out
    assert json.loads(runs[3].log_path.with_suffix(".json").read_text())["rc"] == 1
    started.clear()
    assert sweep_run.sweep(spec, tmp_path, jobs=1) == 1 and started == [runs[3]]  # only the failed one again
    assert json.loads((tmp_path / "sweep.json").read_text())["axes"] == {"estimator": ["grpo", "drmas"],
                                                                         "mapping": ["shared", "separate"]}
    held = sweep_run._lock(tmp_path)  # another sweep on the same folder
    with pytest.raises(ConfigError, match="another masrl sweep is running on"):
        sweep_run.sweep(spec, tmp_path)
    held.close()


def _sleeping_runs(tmp_path, monkeypatch):
    """(spec, runs) of a sweep whose every run is a 60 s sleep."""
    monkeypatch.chdir(REPO)
    spec = SweepSpec.model_validate(spec_dict())
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    monkeypatch.setattr(sweep_run, "run_argv", lambda run, nice: sleeper)
    return spec, expand_runs(spec, tmp_path)


def test_interrupted_sweep_starts_no_further_run_and_terminates_the_running_ones(tmp_path, monkeypatch):
    spec, runs = _sleeping_runs(tmp_path, monkeypatch)
    real_wait = sweep_run.wait

    def interrupt(pending, return_when):  # Ctrl-C once the first run is under way
        while not sweep_run._RUNNING:
            real_wait(pending, timeout=0.05)
        raise KeyboardInterrupt

    monkeypatch.setattr(sweep_run, "wait", interrupt)
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        sweep_run.sweep(spec, tmp_path, jobs=1)
    assert time.monotonic() - t0 < 30 and not sweep_run._RUNNING  # the 60 s run was terminated
    assert runs[0].log_path.exists() and not any(r.log_path.exists() for r in runs[1:])  # nothing else started


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_terminated_sweep_terminates_its_running_runs(tmp_path, monkeypatch, signum):
    """``kill`` (SIGTERM) or a closed terminal (SIGHUP) stops the sweep as Ctrl-C does: the running run is
    terminated, no further run starts, and the sweep's handlers are gone afterwards."""
    spec, runs = _sleeping_runs(tmp_path, monkeypatch)
    real_wait = sweep_run.wait
    seen = []

    def unhandled(sig, frame):  # what runs if the sweep installed no handler of its own
        raise RuntimeError("the sweep did not handle the signal")

    def signal_once_running(pending, return_when):
        while not sweep_run._RUNNING:
            real_wait(pending, timeout=0.05)
        seen.extend(sweep_run._RUNNING)
        os.kill(os.getpid(), signum)
        return real_wait(pending, return_when=return_when)

    old = signal.signal(signum, unhandled)
    try:
        monkeypatch.setattr(sweep_run, "wait", signal_once_running)
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt, match=signal.Signals(signum).name):
            sweep_run.sweep(spec, tmp_path, jobs=1)
        assert signal.getsignal(signum) is unhandled  # restored
    finally:
        signal.signal(signum, old)
    assert time.monotonic() - t0 < 30 and not sweep_run._RUNNING
    assert seen and seen[0].wait(timeout=10) is not None  # the 60 s run was terminated
    assert not any(r.log_path.exists() for r in runs[1:])  # nothing else started


def test_execute_records_the_peak_rss_of_the_run(tmp_path):
    """``ru_maxrss`` from ``wait4``: a child that writes 600 MiB peaks above that, one that does nothing far below.
    Both also count the launcher's high-water mark at the fork (Linux keeps it across exec), so the two runs are
    launched from a small Python process, not from this (pytest, torch imported) one."""
    launcher = ("import json, sys; from masrl.sweep.run import execute\n"
                "big = execute([sys.executable, '-c', \"b = b'x' * (600 << 20)\"], sys.argv[1] + '/big.log', sys.argv[1])\n"
                "small = execute([sys.executable, '-c', 'pass'], sys.argv[1] + '/small.log', sys.argv[1])\n"
                "print(json.dumps([big, small]))")
    out = subprocess.run([sys.executable, "-c", launcher, str(tmp_path)], capture_output=True, text=True, check=True)
    big, small = json.loads(out.stdout.splitlines()[-1])
    assert big["rc"] == small["rc"] == 0
    assert big["peak_rss_mib"] >= 600 and 0 < small["peak_rss_mib"] < big["peak_rss_mib"] - 250
    run = expand_runs(SweepSpec.model_validate(spec_dict()), tmp_path)[0]
    sweep_run.Progress(total=1, parallel=1).done(run, big, ok=True)  # the progress line prints it


# ---------------------------------------------------------------------- statistics

def test_t_quantiles_match_the_table():
    for df, table in [(1, 12.706), (2, 4.303), (4, 2.776), (9, 2.262), (30, 2.042)]:
        assert t_quantile(0.975, df) == pytest.approx(table, abs=5e-4)
    assert t_quantile(0.025, 4) == pytest.approx(-2.776, abs=5e-4)


def test_mean_ci_by_hand():
    # mean 0.35; squared deviations .0025 .0001 .0004 .0036 0 -> s^2 = .0066 / 4 = .00165, s = .040620;
    # s / sqrt(5) = .018166; t(0.975, 4) = 2.776445 -> half-width .050437
    s = mean_ci([0.30, 0.36, 0.33, 0.41, 0.35])
    assert s.n == 5 and s.mean == pytest.approx(0.35)
    assert s.sd == pytest.approx(0.040620, abs=1e-6) and s.half_width == pytest.approx(0.050437, abs=1e-6)
    assert (s.low, s.high) == (pytest.approx(0.299563, abs=1e-6), pytest.approx(0.400437, abs=1e-6))
    one = mean_ci([0.4, None, float("nan")])  # missing values are left out; n says so
    assert one.n == 1 and one.mean == 0.4 and one.half_width is None and one.low is None
    assert mean_ci([]).n == 0


def test_paired_difference_by_hand():
    # common seeds 0-3 (seed 4 has no arm value): diffs .10 .02 -.02 .04 -> mean .035;
    # squared deviations .004225 .000225 .003025 .000025 -> s^2 = .0075 / 3 = .0025, s = .05, se = .025;
    # t(0.975, 3) = 3.182446 -> half-width .079561
    p = paired({0: .40, 1: .38, 2: .35, 3: .45}, {0: .30, 1: .36, 2: .37, 3: .41, 4: .50})
    assert p.seeds == [0, 1, 2, 3] and p.summary.mean == pytest.approx(0.035)
    assert p.summary.half_width == pytest.approx(0.079561, abs=1e-6)
    assert (p.arm_higher, p.baseline_higher, p.ties) == (3, 1, 0)


# ---------------------------------------------------------------------- report

def fabricate(out: Path, cell: str, seed: int, sft: float, rl: float, norms: list[float], spikes: list[int],
              rc: int | None = 0, mid: float | None = None) -> None:
    """A run folder as ``masrl train`` writes it (report.json, metrics.jsonl, config.yaml) and its record."""
    run_dir = out / cell / f"seed{seed}"
    run_dir.mkdir(parents=True)
    (out / cell / f"seed{seed}.log").write_text("...\nmasrl: error: out of memory\n" if rc else "done\n")
    (out / cell / f"seed{seed}.json").write_text(json.dumps({"rc": rc, "wall_s": 100.0 + seed, "cpu_s": 90.0,
                                                                 "peak_rss_mib": 2000.0 + 10 * seed}))
    if rc:
        return
    steps = len(norms)
    (run_dir / "config.yaml").write_text(dump_config(load_config(REPO / QUICKSTART,
                                                                 [f"trainer.total_steps={steps}"])))
    ev = {"sft": {"n": 4, "avg@n": sft, "pass@4": sft + 0.1}, "final": {"n": 4, "avg@n": rl, "pass@4": rl + 0.1}}
    (run_dir / "report.json").write_text(json.dumps({"steps": steps, "eval": ev}))
    records = [{"step": 0, "phase": "eval", "eval/test/avg@n": sft}]
    for i, (g, s) in enumerate(zip(norms, spikes), start=1):
        records.append({"step": i, "phase": "train", "team/reward": 0.5 + 0.01 * i, "agent/Solver/grad_norm": g,
                        "agent/Solver/chi2_drift": 0.1 * i, **({"agent/Solver/grad_spike": 1.0} if s else {}),
                        **({"agent/Solver/role_capture": 1.0} if s else {}),
                        **({"policy/shared/nonfinite_skipped": 1.0} if g is None else {})})
        if i == 1 and mid is not None:
            records.append({"step": i, "phase": "eval", "eval/test/avg@n": mid})
    records.append({"step": steps, "phase": "eval", "eval/test/avg@n": rl})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_report_on_fabricated_runs(tmp_path):
    out = tmp_path / "sweep"
    (out).mkdir()
    (out / "sweep.json").write_text(json.dumps({"name": "t", "seeds": [0, 1, 2, 3], "axes": {"est": ["grpo", "drmas"]},
                                                "cells": ["est=grpo", "est=drmas"]}))
    fabricate(out, "est=grpo", 0, 0.30, 0.40, [1.0, 3.0, 2.0], [0, 1, 0], mid=0.55)
    fabricate(out, "est=grpo", 1, 0.32, 0.36, [1.0, 1.0, 0.0], [0, 0, 0])
    fabricate(out, "est=grpo", 2, 0.30, 0.41, [2.0, None, 4.0], [0, 0, 0])
    fabricate(out, "est=drmas", 0, 0.30, 0.45, [1.0, 1.5, 2.0], [0, 0, 0])
    fabricate(out, "est=drmas", 1, 0.32, 0.44, [1.0, 1.0, 1.0], [0, 0, 0])
    fabricate(out, "est=drmas", 2, 0, 0, [], [], rc=1)  # failed: listed, never dropped
    (out / "est=grpo" / "seed3").mkdir()  # still running (or killed): no report.json, no exit record
    (out / "est=grpo" / "seed3.log").write_text("[RL 3/40] reward 0.41\n")
    paths = report(out)
    assert {p.name for p in paths} == {"summary.json", "summary.md", "heldout_accuracy.png", "grad_norms.png",
                                       "spike_rate.png"}
    s = json.loads((out / "summary.json").read_text())
    rl = s["metrics"]["avg@4_rl"]
    grpo = rl["arms"]["est=grpo"]
    assert grpo["n"] == 3 and grpo["mean"] == pytest.approx(39.0)  # (40 + 36 + 41) / 3
    # sd of (40, 36, 41) = sqrt(7) = 2.6458; t(0.975, 2) = 4.302653 -> half-width 6.5723
    assert grpo["half_width"] == pytest.approx(4.302653 * math.sqrt(7) / math.sqrt(3), abs=1e-4)
    (comp,) = rl["comparisons"]
    assert comp["arm"] == "est=drmas" and comp["baseline"] == "est=grpo" and comp["seeds"] == [0, 1]
    assert comp["diffs"] == [pytest.approx(5.0), pytest.approx(8.0)] and comp["favours_arm"] == 2
    gain = s["metrics"]["avg@4_gain"]["arms"]["est=grpo"]["values"]
    assert gain == {"0": pytest.approx(10.0), "1": pytest.approx(4.0), "2": pytest.approx(11.0)}
    solver_max = s["metrics"]["grad_norm_max/Solver"]["arms"]["est=grpo"]["values"]
    assert solver_max == {"0": 3.0, "1": 1.0, "2": 4.0}
    assert s["metrics"]["grad_norm_median/Solver"]["arms"]["est=grpo"]["values"]["1"] == 1.0  # the 0 left out
    assert s["metrics"]["spikes/Solver"]["arms"]["est=grpo"]["values"] == {"0": 1.0, "1": 0.0, "2": 0.0}
    assert s["metrics"]["nonfinite_steps"]["arms"]["est=grpo"]["values"]["2"] == 1.0
    assert s["metrics"]["avg@4_peak_drop"]["arms"]["est=grpo"]["values"] == {"0": pytest.approx(15.0), "1": 0.0,
                                                                            "2": 0.0}
    assert s["metrics"]["role_captures/Solver"]["arms"]["est=grpo"]["values"]["0"] == 1.0
    assert s["metrics"]["chi2_drift_final/Solver"]["arms"]["est=drmas"]["values"]["0"] == pytest.approx(0.3)
    assert s["metrics"]["train_reward_final"]["arms"]["est=drmas"]["mean"] == pytest.approx(0.52)
    assert s["metrics"]["wall_s"]["arms"]["est=drmas"]["values"] == {"0": 100.0, "1": 101.0}
    assert s["metrics"]["peak_rss_mib"]["arms"]["est=drmas"]["values"] == {"0": 2000.0, "1": 2010.0}
    assert s["metrics"]["peak_rss_mib"]["unit"] == "MiB" and s["metrics"]["peak_rss_mib"]["better"] == "lower"
    failed, missing, unfinished = sorted(s["not_finished"], key=lambda r: r["status"])
    assert (unfinished["cell"], unfinished["seed"], unfinished["status"]) == ("est=grpo", 3, "unfinished")
    assert "still running, or interrupted" in unfinished["reason"] and "[RL 3/40]" in unfinished["reason"]
    assert (missing["cell"], missing["seed"], missing["status"], missing["reason"]) == ("est=drmas", 3, "missing",
                                                                                        "not run yet")
    assert s["runs"] == {"ok": 5, "total": 8}
    assert (failed["cell"], failed["seed"], failed["status"]) == ("est=drmas", 2, "failed")
    assert "exit code 1" in failed["reason"] and "masrl: error: out of memory" in failed["reason"]
    md = (out / "summary.md").read_text()
    assert "| est=drmas | 2 | failed | exit code 1" in md
    assert "| est=grpo | 3 | 39.0 ± 6.6 |" in md and "| est=drmas − est=grpo | 2 | 6.5 ± 19.1 | 2/2 / 0/2 / 0/2 |" in md
    report(out, ["est=drmas"])  # the other baseline: the difference flips sign
    flipped = json.loads((out / "summary.json").read_text())["metrics"]["avg@4_rl"]["comparisons"][0]
    assert flipped["arm"] == "est=grpo" and flipped["diff"]["mean"] == pytest.approx(-6.5)
    with pytest.raises(ConfigError, match="--baseline-arm 'est=ppo'"):
        report(out, ["est=ppo"])


def test_report_gives_a_judges_heldout_check_after_sft_and_after_rl(tmp_path):
    out = tmp_path / "sweep"
    out.mkdir()
    (out / "sweep.json").write_text(json.dumps({"name": "t", "seeds": [0, 1], "axes": {"judge": ["smol"]},
                                                "cells": ["judge=smol"]}))
    for seed, (before, after) in enumerate([(0.20, 0.50), (0.30, 0.40)]):
        # a gradient at step 1 in one seed, at step 2 in the other: no step in common, nothing on the log axis
        fabricate(out, "judge=smol", seed, 0.6, 0.9, [1.0, 0.0] if seed == 0 else [0.0, 1.0], [0, 0])
        path = out / "judge=smol" / f"seed{seed}" / "report.json"
        rep = json.loads(path.read_text())
        rep["eval"]["sft"].update(heldout_check=before, heldout_agreement=0.5)
        rep["eval"]["final"].update(heldout_check=after, heldout_agreement=0.25)
        path.write_text(json.dumps(rep))
    paths = report(out)  # the plots are still written
    assert any(p.name == "grad_norms.png" for p in paths)
    m = json.loads((out / "summary.json").read_text())["metrics"]
    assert m["heldout_check_sft"]["arms"]["judge=smol"]["values"] == {"0": pytest.approx(20.0), "1": pytest.approx(30.0)}
    assert m["heldout_check_gain"]["arms"]["judge=smol"]["mean"] == pytest.approx(20.0)  # (30 + 10) / 2
    assert m["heldout_agreement_rl"]["arms"]["judge=smol"]["mean"] == pytest.approx(25.0)
    assert m["heldout_check_rl"]["label"] == "held-out check (rule, not the judge) after RL"
    assert "held-out check (rule, not the judge) after SFT" in (out / "summary.md").read_text()

# ---------------------------------------------------------------------- end to end

def test_quick_sweep_end_to_end(tmp_path, monkeypatch, capsys):
    """A real 2-arm x 1-seed --quick sweep (two masrl train processes), then a rerun that skips, then the report."""
    monkeypatch.chdir(REPO)
    spec = write_spec(tmp_path, seeds=[0], axes={"estimator": {"key": "algorithm.estimator",
                                                               "values": ["grpo", "drmas"]}})
    out = tmp_path / "out"
    argv = ["sweep", str(spec), "--quick", "--jobs", "2", "--out", str(out)]
    rc = cli_main(argv)
    printed = capsys.readouterr().out
    logs = "".join(p.read_text() for p in out.glob("*/seed0.log"))
    assert rc == 0, printed + logs
    assert "[sweep 2/2]" in printed and "rc 0" in printed
    for est in ("grpo", "drmas"):
        run_dir = out / f"estimator={est}" / "seed0"
        assert json.loads((run_dir / "report.json").read_text())["steps"] == 2
        assert load_config(run_dir / "config.yaml").algorithm.estimator == est
    assert cli_main(argv) == 0 and "2 finished (skipped), 0 to run" in capsys.readouterr().out
    assert cli_main(["sweep", "report", str(out)]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["runs"] == {"ok": 2, "total": 2} and s["not_finished"] == []
    assert s["metrics"]["avg@2_rl"]["comparisons"][0]["arm"] == "estimator=drmas"
    assert (out / "grad_norms.png").stat().st_size > 0


@pytest.mark.slow
def test_quick_sweep_on_a_local_ray_cluster(tmp_path, monkeypatch):
    """--ray local: each run is a Ray task (1 CPU) starting the same masrl train process; a failing run is
    reported and does not stop the other."""
    pytest.importorskip("ray")
    monkeypatch.chdir(REPO)
    spec = write_spec(tmp_path, seeds=[0], axes={"task": {"ok": [], "broken": ["task.name=no_such_task"]}})
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "masrl.cli", "sweep", str(spec), "--quick", "--ray", "local", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "task=ok seed 0: rc 0" in proc.stdout and "1 of 2 runs failed" in proc.stdout
    assert json.loads((out / "task=ok" / "seed0" / "report.json").read_text())["steps"] == 2
    assert json.loads((out / "task=broken" / "seed0.json").read_text())["rc"] == 2  # unknown task: a runtime error
    assert "no_such_task" in (out / "task=broken" / "seed0.log").read_text()


# ---------------------------------------------------------------------- hostile input (.ci/probe_cli.py)

def _fails_with_one_line(argv, capsys, *needles) -> str:
    code = cli_main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert len([ln for ln in err.splitlines() if ln.startswith("masrl:")]) == 1, err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


@pytest.mark.parametrize("axes", [
    {"a" * 200: {"b" * 60: []}},  # one axis: name + label over 255 bytes
    {f"axis{i}": {"x" * 40: []} for i in range(6)},  # six short axes that add up
    {"a": {"x" * 254: []}},  # a=<254 characters>: 256 bytes
], ids=["one_long_axis", "many_axes", "one_byte_over"])
def test_cell_folder_name_over_the_file_system_limit_is_refused(tmp_path, monkeypatch, capsys, axes):
    """Was an OSError "File name too long" traceback when the sweep made the cell's folder."""
    monkeypatch.chdir(REPO)
    spec = write_spec(tmp_path, axes=axes)
    _fails_with_one_line(["sweep", spec, "--out", tmp_path / "out"], capsys, "255")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("out", ["file", "under_file"])
def test_sweep_out_that_is_or_lies_under_a_file_is_refused_even_in_a_dry_run(tmp_path, monkeypatch, capsys, out):
    monkeypatch.chdir(REPO)
    taken = tmp_path / "taken"
    taken.write_text("mine\n")
    target = taken if out == "file" else taken / "sub"
    _fails_with_one_line(["sweep", write_spec(tmp_path), "--out", target, "--dry-run"], capsys, str(taken))
    assert taken.read_text() == "mine\n"


@pytest.mark.parametrize("manifest", ['{"name": "t", "axes": [', "[1, 2]", '{"axes": {"a": "x"}, "seeds": [0], "cells": []}',
                                      '{"axes": {"a": ["1"]}, "seeds": ["zero"], "cells": ["a=1"]}',
                                      '{"axes": {"a": ["1"]}, "seeds": [0], "cells": [7]}', "\xff\xfe"],
                         ids=["truncated", "list", "axes_wrong", "seeds_wrong", "cells_wrong", "binary"])
def test_sweep_report_of_a_damaged_sweep_json_is_one_clear_error(tmp_path, capsys, manifest):
    """Was a JSONDecodeError / KeyError / AttributeError traceback."""
    (tmp_path / "sweep.json").write_bytes(manifest.encode("latin-1"))
    _fails_with_one_line(["sweep", "report", tmp_path], capsys, str(tmp_path / "sweep.json"))
    assert not (tmp_path / "summary.json").exists()


@pytest.mark.parametrize("damage", [
    ("report.json", '{"steps": 3, "eval": {"sft": "x", "final": {"avg@n": "hi"}}}'),
    ("report.json", '{"steps": 3, "eval": {"final": [0.4]}}'),
    ("metrics.jsonl", '{"step": 1, "phase": "train", "team/reward": "x", "agent/Solver/grad_norm": "big"}\n'
                      '{"step": 2, "phase": ["eval"], "eval/test/avg@n": {"a": 1}}\n'),
], ids=["eval_entry_str", "eval_entry_list", "metric_values_wrong_types"])
def test_sweep_report_tolerates_damaged_runs_and_counts_them(tmp_path, damage):
    """Was an AttributeError / TypeError traceback: a damaged report.json makes the run 'failed' (listed,
    counted); metric values of the wrong type are left out of their record (masrl.monitoring.logger)."""
    out = tmp_path / "sweep"
    out.mkdir()
    (out / "sweep.json").write_text(json.dumps({"name": "t", "seeds": [0, 1], "axes": {"est": ["a", "b"]},
                                                "cells": ["est=a", "est=b"]}))
    for cell in ("est=a", "est=b"):
        for seed in (0, 1):
            fabricate(out, cell, seed, 0.30, 0.40, [1.0, 2.0, 3.0], [0, 0, 0])
    name, content = damage
    (out / "est=a" / "seed0" / name).write_text(content)
    report(out)
    runs = json.loads((out / "summary.json").read_text())["runs"]
    assert runs["total"] == 4 and runs["ok"] == (3 if name == "report.json" else 4)


def _manifest(out: Path, seeds: list[int], cells: list[str], name: str = "t") -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps({"name": name, "seeds": seeds, "axes": {"est": ["grpo", "drmas"]},
                                                "cells": cells}))


def test_report_with_a_prior_summary_fills_the_runs_the_folder_lacks(tmp_path, capsys):
    """A sweep continued on another machine: seeds 0-1 were reported there (their folders are gone), seed 2 and a
    re-run of (grpo, 1) finished here. The summary counts all three seeds, the folder's own run wins its slot, and
    every run taken from the prior says so."""
    first = tmp_path / "first"
    _manifest(first, [0, 1], ["est=grpo", "est=drmas"])
    fabricate(first, "est=grpo", 0, 0.30, 0.40, [1.0, 2.0], [0, 0], mid=0.50)
    fabricate(first, "est=grpo", 1, 0.30, 0.20, [1.0, 2.0], [0, 0])
    fabricate(first, "est=drmas", 0, 0.30, 0.46, [1.0, 2.0], [0, 0])
    fabricate(first, "est=drmas", 1, 0, 0, [], [], rc=1)
    report(first)
    prior = tmp_path / "committed_summary.json"
    shutil.copy(first / "summary.json", prior)
    shutil.rmtree(first)

    here = tmp_path / "here"
    _manifest(here, [1, 2], ["est=grpo", "est=drmas"])
    fabricate(here, "est=grpo", 1, 0.30, 0.36, [1.0, 2.0], [0, 0])  # wins over the prior's 20.0
    fabricate(here, "est=grpo", 2, 0.30, 0.41, [1.0, 2.0], [0, 0])
    fabricate(here, "est=drmas", 2, 0.30, 0.50, [1.0, 2.0], [0, 0])
    assert cli_main(["sweep", "report", str(here), "--prior", str(prior)]) == 0
    s = json.loads((here / "summary.json").read_text())
    rl = s["metrics"]["avg@4_rl"]
    assert rl["arms"]["est=grpo"]["values"] == {"0": pytest.approx(40.0), "1": pytest.approx(36.0),
                                                "2": pytest.approx(41.0)}
    assert rl["arms"]["est=drmas"]["values"] == {"0": pytest.approx(46.0), "2": pytest.approx(50.0)}
    assert rl["comparisons"][0]["seeds"] == [0, 2] and rl["comparisons"][0]["diffs"] == [pytest.approx(6.0),
                                                                                       pytest.approx(9.0)]
    assert s["metrics"]["avg@4_peak"]["arms"]["est=grpo"]["values"]["0"] == pytest.approx(50.0)
    assert s["runs"] == {"ok": 5, "total": 6} and s["priors"] == [{"path": str(prior), "runs_used": 2}]
    (failed,) = s["not_finished"]  # the prior's failed run, still not finished here: listed with its source
    assert (failed["cell"], failed["seed"], failed["status"]) == ("est=drmas", 1, "failed")
    assert "exit code 1" in failed["reason"] and str(prior) in failed["reason"]
    sources = {(r["cell"], r["seed"]): r.get("source") for r in s["per_run"]}
    assert sources == {("est=grpo", 0): str(prior), ("est=grpo", 1): None, ("est=grpo", 2): None,
                       ("est=drmas", 0): str(prior), ("est=drmas", 2): None}
    curve = next(r["eval_curve"] for r in s["per_run"] if (r["cell"], r["seed"]) == ("est=grpo", 0))
    assert curve == [[0, pytest.approx(30.0)], [1, pytest.approx(50.0)], [2, pytest.approx(40.0)]]
    assert f"2 from `{prior}`" in (here / "summary.md").read_text()
    assert (here / "heldout_accuracy.png").stat().st_size > 0

    again = tmp_path / "again"  # the merged summary is itself a prior: a third machine continues from it
    _manifest(again, [3], ["est=grpo", "est=drmas"])
    fabricate(again, "est=drmas", 3, 0.30, 0.44, [1.0], [0])
    report(again, priors=[here / "summary.json"])
    s3 = json.loads((again / "summary.json").read_text())
    assert s3["metrics"]["avg@4_rl"]["arms"]["est=drmas"]["values"] == {
        "0": pytest.approx(46.0), "2": pytest.approx(50.0), "3": pytest.approx(44.0)}
    assert s3["runs"]["ok"] == 6

    other = tmp_path / "other"
    _manifest(other, [0], ["est=grpo"], name="another")
    fabricate(other, "est=grpo", 0, 0.30, 0.40, [1.0], [0])
    _fails_with_one_line(["sweep", "report", other, "--prior", prior], capsys, "summarizes sweep 't'", "'another'")


@pytest.mark.parametrize("content", ['{"name": "t", "axes": {"est": ["a"]}, "per_run": [{"cell": "est=b", "seed": 0, '
                                     '"metrics": {}}]}',
                                     '{"name": "t", "axes": {"est": ["a"]}, "per_run": [{"cell": "est=a", "seed": 0, '
                                     '"metrics": {"avg@4_rl": "high"}}]}',
                                     '{"name": "t", "axes": {"est": ["a"]}, "runs": {"ok": 3}}', "[]", "{\"name\": "],
                         ids=["cell_off_axes", "metric_not_number", "no_per_run", "list", "truncated"])
def test_report_refuses_a_damaged_prior_before_writing(tmp_path, capsys, content):
    out = tmp_path / "sweep"
    _manifest(out, [0], ["est=grpo"])
    fabricate(out, "est=grpo", 0, 0.30, 0.40, [1.0], [0])
    prior = tmp_path / "prior.json"
    prior.write_text(content)
    _fails_with_one_line(["sweep", "report", out, "--prior", prior], capsys, f"--prior {prior}")
    assert not (out / "summary.json").exists()


@pytest.mark.skipif(not sweep_run.autogroup_enabled(), reason="Linux autogroup scheduling is off here")
def test_nice_reaches_the_runs_autogroup_where_autogroup_scheduling_is_on(tmp_path):
    """Under autogroup, `nice -n 7` alone ranks a run only within the sweep's own session; the run gets a session
    whose autogroup has the level, so it yields to other sessions' work too. The child waits (5 s deadline) for
    the parent to set it, then prints what it sees."""
    child = ("import time; t = time.monotonic() + 5\n"
             "while 'nice 7' not in open('/proc/self/autogroup').read() and time.monotonic() < t: time.sleep(0.01)\n"
             "import os; print(open('/proc/self/autogroup').read().strip(), os.getsid(0) == os.getpid())")
    log, ours = tmp_path / "run.log", Path("/proc/self/autogroup").read_text()
    rec = sweep_run.execute(["nice", "-n", "7", sys.executable, "-c", child], str(log), str(tmp_path), None, 7)
    assert rec["rc"] == 0, log.read_text()
    group, own_session = log.read_text().split()[-3:-1], log.read_text().split()[-1]
    assert group == ["nice", "7"] and own_session == "True"
    assert Path("/proc/self/autogroup").read_text() == ours  # the sweep's own session keeps its level
