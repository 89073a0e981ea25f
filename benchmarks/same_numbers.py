"""Same numbers: a fixed list of short runs at two commits, every logged value compared.

A change that should not change what masrl computes (a refactor, a move) is checked by running the same
short runs before and after it and comparing every value they log, timing fields excluded:

* the quickstart (``examples/quickstart.yaml``) with ``seed=0`` and ``seed=1``;
* one study example per tiny-model workflow family (``voting_shared``, ``eval_opt_shared``,
  ``orch_workers_shared``);
* when ``--only`` names them, runs of user code: a reward function (``examples/dataset_jsonl.yaml``), tools
  (``examples/tools_calculator.yaml``) and an OpenAI-API program (``examples/openai_client_team.yaml``);
* the export round trip of the quickstart's seed-0 run: ``masrl export``, ``masrl eval`` of the export's
  ``config.yaml``, and ``masrl eval --checkpoint`` of the run folder.

Every run is shortened (:data:`SHORT`: 20 SFT steps, 3 RL steps of 4 tasks x 4 samples, evaluation of 8
held-out tasks x 2 samples before, at step 2 and after RL) and single-threaded (``trainer.threads=1``), so the
whole check takes a few CPU-minutes per commit. Compared: every value of ``metrics.jsonl`` (SFT, RL and
evaluation records), ``eval.json``'s results and ``samples.jsonl`` (each episode's prompts and responses).

    python benchmarks/same_numbers.py                        # main vs this working tree
    python benchmarks/same_numbers.py --base v0.3 --head HEAD~1
    python benchmarks/same_numbers.py --base /path/to/a/checkout --only quickstart-seed0

``--base`` / ``--head``: a commit (checked out in a temporary ``git worktree``) or a folder holding a masrl
checkout (used as it is; default head: the working tree this script is in). Prints one table row per run and
every difference; exits 1 when a value differs, a value is missing on one side, or a run fails.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _benchutil import REPO, command_line, cpu_model  # noqa: E402

#: the overrides that shorten every run (and keep it on one thread, without plots or TensorBoard)
SHORT = ["trainer.threads=1", "sft.steps=20", "sft.batch_size=16", "trainer.total_steps=3", "trainer.batch_size=4",
         "trainer.group_size=4", "trainer.save_every=0", "eval.limit=8", "eval.n=2", "eval.k=[1,2]", "eval.every=2",
         "logging.progress=false", "logging.plots=false", "logging.tensorboard=false"]

#: (name, example config, extra overrides) of the training runs
TRAIN_RUNS = [
    ("quickstart-seed0", "examples/quickstart.yaml", ["seed=0"]),
    ("quickstart-seed1", "examples/quickstart.yaml", ["seed=1"]),
    ("voting", "examples/voting_shared.yaml", ["seed=0"]),
    ("eval_opt", "examples/eval_opt_shared.yaml", ["seed=0"]),
    ("orch_workers", "examples/orch_workers_shared.yaml", ["seed=0"]),
]
#: runs of user code (a reward function, tools, an OpenAI-API program), run when ``--only`` names them
USER_CODE_RUNS = [
    ("user_reward", "examples/dataset_jsonl.yaml", ["seed=0", "logging.report_to=[]", "sft.steps=0"]),
    ("tools", "examples/tools_calculator.yaml", ["seed=0"]),
    ("openai_client", "examples/openai_client_team.yaml", ["seed=0"]),
]
EVAL_ARGS = ["--bench", "test", "--limit", "8", "--n", "2", "--k", "1,2"]
EVAL_OVERRIDES = ["trainer.threads=1", "logging.progress=false"]
ROUND_TRIP = "quickstart-seed0"  # the run exported and evaluated

#: values that measure time, speed or memory, not what was computed
TIMING = re.compile(r"(^|/)perf/|seconds|_s$|tokens_per_s|rss|judge_share"
                    r"|(^|[/_])(time|timestamp|wall|elapsed|duration)($|[/_])")


def is_timing(key: str) -> bool:
    return bool(TIMING.search(key))


# ---------------------------------------------------------------------- the runs

def environment(checkout: Path) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(checkout / "src"), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
                PYTHONHASHSEED="0", TOKENIZERS_PARALLELISM="false")


def check_source(checkout: Path) -> None:
    """The checkout's own masrl is the one its runs import (not an installed copy)."""
    where = subprocess.run([sys.executable, "-c", "import masrl; print(masrl.__file__)"], cwd=checkout,
                           env=environment(checkout), capture_output=True, text=True, check=True).stdout.strip()
    if not Path(where).resolve().is_relative_to((checkout / "src").resolve()):
        raise SystemExit(f"same_numbers: {checkout} imports masrl from {where}, not from its src/")


def masrl(checkout: Path, args: list[str], log: Path) -> float:
    """``python -m masrl ARGS`` with ``checkout``'s source, in ``checkout``, at ``nice 10``; its CPU seconds.
    Raises ``RuntimeError`` with the log's tail when it fails. With no checkout (``--compare-only``): nothing
    runs, the outputs already there are compared."""
    if checkout is None:
        return 0.0
    env = environment(checkout)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(log, "a") as out:
        out.write(f"$ masrl {' '.join(args)}\n")
        out.flush()
        rc = subprocess.run(["nice", "-n", "10", sys.executable, "-m", "masrl", *args], cwd=checkout, env=env,
                            stdout=out, stderr=subprocess.STDOUT).returncode
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    if rc != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-15:])
        raise RuntimeError(f"masrl {' '.join(args[:2])} exited {rc}; {log}:\n{tail}")
    return cpu


def run_all(checkout: Path | None, out: Path, only: set[str] | None) -> dict[str, dict]:
    """Every run of the list in ``checkout``, written under ``out``; ``{run: {"files": ..., "cpu_s": ...,
    "error": ...}}``."""
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    for name, config, extra in TRAIN_RUNS + [r for r in USER_CODE_RUNS if only and r[0] in only]:
        if only and name not in only and not (name == ROUND_TRIP and only & {"export-eval", "checkpoint-eval"}):
            continue
        run_dir = out / name
        try:
            cpu = masrl(checkout, ["train", config, *SHORT, *extra, "--output-dir", str(run_dir), "--overwrite"],
                        out / f"{name}.log")
            results[name] = {"files": {"metrics.jsonl": run_dir / "metrics.jsonl"}, "cpu_s": cpu}
        except RuntimeError as e:
            results[name] = {"error": str(e), "cpu_s": 0.0}
    if ROUND_TRIP in results and "error" not in results[ROUND_TRIP]:
        run_dir = out / ROUND_TRIP
        steps = [
            ("export-eval", [["export", str(run_dir), "--out", str(out / "export"), "--overwrite"],
                             ["eval", str(out / "export" / "config.yaml"), *EVAL_OVERRIDES, *EVAL_ARGS,
                              "--out", str(out / "export-eval")]]),
            ("checkpoint-eval", [["eval", str(run_dir / "config.yaml"), *EVAL_OVERRIDES, "--checkpoint", str(run_dir),
                                  *EVAL_ARGS, "--out", str(out / "checkpoint-eval")]]),
        ]
        for name, commands in steps:
            if only and name not in only:
                continue
            try:
                cpu = sum(masrl(checkout, args, out / f"{name}.log") for args in commands)
                results[name] = {"files": {"eval.json": out / name / "eval.json",
                                           "samples.jsonl": out / name / "samples.jsonl"}, "cpu_s": cpu}
            except RuntimeError as e:
                results[name] = {"error": str(e), "cpu_s": 0.0}
    if only:
        results = {k: v for k, v in results.items() if k in only}
    return results


# ---------------------------------------------------------------------- the values

def flatten(value: Any, prefix: str) -> Iterable[tuple[str, Any]]:
    if isinstance(value, dict):
        for k, v in value.items():
            yield from flatten(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from flatten(v, f"{prefix}[{i}]")
    else:
        yield prefix, value


def values(kind: str, path: Path) -> dict[str, Any]:
    """Every logged value of one output file, by a stable key; timing fields left out."""
    if kind == "metrics.jsonl":
        out = {}
        for i, line in enumerate(path.read_text().splitlines()):
            record = json.loads(line)
            where = f"{i}:{record.get('phase')}@{record.get('step')}"
            for key, v in record.items():
                if not is_timing(key):
                    out[f"{where} {key}"] = v
        return out
    if kind == "eval.json":
        results = json.loads(path.read_text())["results"]
        return {k: v for k, v in flatten(results, "") if not is_timing(k)}
    if kind == "samples.jsonl":
        out = {}
        for i, line in enumerate(path.read_text().splitlines()):
            out.update({f"{i} {k}": v for k, v in flatten(json.loads(line), "") if not is_timing(k)})
        return out
    raise ValueError(kind)


def same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def compare(base: dict, head: dict) -> tuple[list[list[str]], list[str]]:
    """Table rows (run, values compared, differing, missing, CPU s base / head) and one line per difference."""
    rows, diffs = [], []
    for run in dict.fromkeys([*base, *head]):
        b, h = base.get(run, {"error": "not run"}), head.get(run, {"error": "not run"})
        cpu = f"{b.get('cpu_s', 0):.0f} / {h.get('cpu_s', 0):.0f}"
        if "error" in b or "error" in h:
            for side, r in (("base", b), ("head", h)):
                if "error" in r:
                    diffs.append(f"{run}: {side} failed: {r['error']}")
            rows.append([run, "-", "-", "-", cpu, "FAILED"])
            continue
        n = differ = missing = 0
        for kind in b["files"]:
            try:
                vb = values(kind, b["files"][kind])
                vh = values(kind, h["files"][kind])
            except (OSError, ValueError, KeyError) as e:
                diffs.append(f"{run}: {kind}: cannot read ({type(e).__name__}: {e})")
                missing += 1
                continue
            for key in dict.fromkeys([*vb, *vh]):
                n += 1
                if key not in vb or key not in vh:
                    missing += 1
                    diffs.append(f"{run}: {kind} {key}: only in {'head' if key in vh else 'base'} "
                                 f"({vh.get(key, vb.get(key))!r})")
                elif not same(vb[key], vh[key]):
                    differ += 1
                    diffs.append(f"{run}: {kind} {key}: base {vb[key]!r} != head {vh[key]!r}")
        rows.append([run, str(n), str(differ), str(missing), cpu, "same" if differ == missing == 0 else "DIFFERENT"])
    return rows, diffs


# ---------------------------------------------------------------------- checkouts

def git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


def checkout(spec: str | None, tmp: Path, label: str) -> tuple[Path, str, bool]:
    """``(folder, description, made here)`` for a commit (a detached worktree under ``tmp``) or a folder."""
    if spec is None:
        dirty = " + uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else ""
        return REPO, f"working tree {REPO} (HEAD {git('rev-parse', '--short=12', 'HEAD')}{dirty})", False
    if Path(spec).is_dir():
        folder = Path(spec).resolve()
        return folder, f"folder {folder} (HEAD {git('rev-parse', '--short=12', 'HEAD', cwd=folder)})", False
    sha = git("rev-parse", "--verify", f"{spec}^{{commit}}")
    folder = tmp / f"{label}-{sha[:12]}"
    git("worktree", "add", "--detach", str(folder), sha)
    return folder, f"commit {spec} ({sha[:12]})", True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="main", help="commit or checkout folder (default: main)")
    ap.add_argument("--head", default=None, help="commit or checkout folder (default: this working tree)")
    ap.add_argument("--work", default=None, help="where the runs write (default: a new temporary folder, kept)")
    ap.add_argument("--compare-only", action="store_true",
                    help="run nothing: compare the outputs already in --work (of an earlier run of this script)")
    ap.add_argument("--only", default=None, help="comma-separated run names (default: all): "
                    + ", ".join([n for n, _, _ in TRAIN_RUNS] + ["export-eval", "checkpoint-eval"])
                    + "; and, only when named: " + ", ".join(n for n, _, _ in USER_CODE_RUNS))
    a = ap.parse_args(argv)
    only = {s.strip() for s in a.only.split(",") if s.strip()} if a.only else None
    if a.compare_only and not a.work:
        ap.error("--compare-only needs --work (the folder of an earlier run)")
    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="masrl-same-numbers-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"command: {command_line()}")
    print(f"machine: {cpu_model()}, {os.cpu_count()} logical CPUs, load avg {os.getloadavg()[0]:.2f} at start, "
          f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
    print(f"runs: {', '.join(n for n, _, _ in TRAIN_RUNS)} + export round trip; shortened by {' '.join(SHORT)}")
    made: list[Path] = []
    outputs = {}
    t0 = time.perf_counter()
    try:
        for label, spec in (("base", a.base), ("head", a.head)):
            if a.compare_only:
                outputs[label] = run_all(None, work / f"{label}-runs", only)
                continue
            folder, what, new = checkout(spec, work, label)
            if new:
                made.append(folder)
            print(f"{label}: {what}", flush=True)
            check_source(folder)
            outputs[label] = run_all(folder, work / f"{label}-runs", only)
    finally:
        for folder in made:
            subprocess.run(["git", "worktree", "remove", "--force", str(folder)], cwd=REPO, capture_output=True)
    rows, diffs = compare(outputs["base"], outputs["head"])
    head = ["run", "values compared", "differing", "missing", "CPU s base / head", "result"]
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, ["-" * w for w in widths], *rows]:
        print("| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |")
    for line in diffs[:200]:
        print(line)
    if len(diffs) > 200:
        print(f"... and {len(diffs) - 200} more")
    total_cpu = sum(r.get("cpu_s", 0.0) for side in outputs.values() for r in side.values())
    print(f"outputs: {work}; {total_cpu / 60:.1f} CPU-minutes, {(time.perf_counter() - t0) / 60:.1f} minutes wall")
    ok = not diffs
    print("SAME NUMBERS" if ok else f"DIFFERENT: {len(diffs)} difference(s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
