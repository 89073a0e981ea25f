"""Run a sweep: every cell x seed as its own ``masrl train`` process, ``--jobs`` at a time or as Ray tasks.

Layout (docs/study.md)::

    OUT/sweep.json              the expanded spec (cells, seeds, axes), read by ``masrl sweep report``
    OUT/<cell>/seed<S>/         the run folder (``masrl train ... --output-dir``); finished = valid report.json
    OUT/<cell>/seed<S>.log      the run's stdout and stderr
    OUT/<cell>/seed<S>.json     argv, exit code, wall and CPU seconds (written when the process ends)

Resumable: a finished run is skipped (after checking that its config.yaml is the one the spec asks for
now); any other run starts over from scratch with ``--overwrite``. A partial run is not resumed from its
checkpoint: every run of a comparison is then produced the same way, uninterrupted.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Callable, Sequence

from masrl.io.atomic import write_text_atomic
from masrl.config import RunConfig, load_config
from masrl.errors import ConfigError, missing_extra
from masrl.sweep.spec import Run, SweepSpec, check_bases, expand_cells, expand_runs


def quick_overrides(cfg: RunConfig) -> list[str]:
    """``--quick``: 2 RL steps on small batches, a few SFT steps, a tiny eval (a smoke test, not a result)."""
    out = ["trainer.total_steps=2", "trainer.batch_size=2", "trainer.group_size=2", "eval.n=2", "eval.k=[1,2]",
           "eval.limit=4", f"task.train_limit={min(64, cfg.task.train_limit or 64)}", "logging.tensorboard=false",
           "logging.plots=false"]
    if cfg.sft.steps:
        out += ["sft.steps=2", "sft.batch_size=8"]
    if cfg.eval.every:
        out.append("eval.every=1")
    return out


def read_report(run_dir: Path) -> dict | None:
    """The run's report.json if it is a finished run (valid JSON, every configured RL step done), else None."""
    try:
        report = json.loads((run_dir / "report.json").read_text())
        steps = load_config(run_dir / "config.yaml").trainer.total_steps
    except (OSError, ValueError):  # missing, partial, unreadable (ConfigError is a ValueError)
        return None
    if not isinstance(report, dict) or not isinstance(report.get("eval"), dict) or report.get("steps") != steps:
        return None
    if not all(isinstance(k, str) and isinstance(v, dict) for k, v in report["eval"].items()):
        return None  # a damaged file: each evaluation ("sft", "final", ...) is an object of metrics
    return report


def config_diff(run_dir: Path, cfg: RunConfig) -> list[str]:
    """Dotted keys whose value in ``run_dir/config.yaml`` differs from ``cfg`` (empty: the same run)."""
    try:
        old = load_config(run_dir / "config.yaml").model_dump(mode="json")
    except ConfigError as e:
        return [f"config.yaml no longer loads: {e}"]
    old, new = _flat(old), _flat(cfg.model_dump(mode="json"))
    return [f"{k}: {old.get(k)!r} -> {v!r}" for k, v in new.items() if old.get(k) != v] + \
        [f"{k}: removed" for k in old if k not in new]


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def plan(runs: Sequence[Run]) -> tuple[list[Run], list[Run]]:
    """(to run, finished). Every run's config is built first: a bad override fails before any run starts."""
    todo, done, changed = [], [], []
    for run in runs:
        try:
            cfg = run.config()
        except ConfigError as e:
            raise ConfigError(f"cell {run.cell.name} (seed {run.seed}): {e}") from None
        if read_report(run.run_dir) is None:
            todo.append(run)
            continue
        diff = config_diff(run.run_dir, cfg)
        if diff:
            changed.append((run, diff))
        else:
            done.append(run)
    if changed:
        lines = [f"  {run.run_dir}: {'; '.join(diff[:3])}{' ...' if len(diff) > 3 else ''}" for run, diff in changed]
        raise ConfigError("finished runs were made with another config than the spec asks for now:\n"
                          + "\n".join(lines) + "\nmove those run folders away (or use another --out) to rerun them")
    return todo, done


def run_argv(run: Run, nice: int) -> list[str]:
    return (["nice", "-n", str(nice)] if nice else []) + run.argv(sys.executable)


_RUNNING: set[subprocess.Popen] = set()  # this process's runs in flight (terminated when the sweep is interrupted)


def autogroup_enabled() -> bool:
    """Linux's autogroup scheduling is on: the CPU is shared between sessions first, and a process's nice value
    ranks it only within its own session (``nice -n 10`` alone then takes nothing back from another session)."""
    try:
        return Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"
    except OSError:
        return False


def execute(argv: list[str], log_path: str, cwd: str, env: dict | None = None, nice: int = 0) -> dict:
    """Run one process, stdout+stderr to ``log_path``; its exit code, wall and CPU seconds, and its peak resident
    set (``ru_maxrss`` from ``wait4``: the largest of the process and the children it waited for; Linux keeps the
    high-water mark across exec, so it is at least this process's resident set at the fork).

    ``nice`` (the argv already starts with ``nice -n``): under autogroup scheduling the run gets a session of its own
    whose autogroup is given the same level, so that it yields to (or takes from) other sessions' work as asked."""
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    started, t0 = time.time(), time.monotonic()
    own_group = bool(nice) and autogroup_enabled()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=cwd,
                                env={**os.environ, **(env or {})}, start_new_session=own_group)
        if own_group:
            try:
                Path(f"/proc/{proc.pid}/autogroup").write_text(str(nice))
            except OSError as e:  # a lower level needs CAP_SYS_NICE; the nice level alone still applies
                print(f"[masrl] sweep: could not set the run's autogroup to nice {nice} ({e}); "
                      f"it competes with other sessions at the default level", file=sys.stderr, flush=True)
        _RUNNING.add(proc)
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            _RUNNING.discard(proc)
        proc.returncode = os.waitstatus_to_exitcode(status)
    return {"argv": argv, "rc": proc.returncode, "wall_s": round(time.monotonic() - t0, 2),
            "cpu_s": round(usage.ru_utime + usage.ru_stime, 2), "peak_rss_mib": round(maxrss_mib(usage.ru_maxrss), 1),
            "started": started, "finished": time.time(), "host": socket.gethostname()}


def maxrss_mib(ru_maxrss: int) -> float:
    """``ru_maxrss`` in MiB: Linux reports KiB, macOS bytes."""
    return ru_maxrss / (2**20 if sys.platform == "darwin" else 2**10)


def record_path(run: Run) -> Path:
    return run.log_path.with_suffix(".json")


class Progress:
    """One line per finished run: cell, seed, exit code, wall time, and the ETA of the rest."""

    def __init__(self, total: int, parallel: int):
        self.total, self.parallel, self.walls, self.failed = total, parallel, [], []

    def done(self, run: Run, rec: dict, ok: bool) -> None:
        self.walls.append(rec["wall_s"])
        left = self.total - len(self.walls)
        eta = sum(self.walls) / len(self.walls) * left / max(1, min(self.parallel, left or 1))
        status = "ok" if ok else f"FAILED (log: {run.log_path})"
        if not ok:
            self.failed.append(run)
        print(f"[sweep {len(self.walls)}/{self.total}] {run.cell.name} seed {run.seed}: rc {rec['rc']}, "
              f"{_fmt_s(rec['wall_s'])} wall, {_fmt_s(rec['cpu_s'])} CPU{_fmt_rss(rec)}, {status}; "
              f"ETA {_fmt_s(eta) if left else 'done'}", flush=True)


def _fmt_rss(rec: dict) -> str:
    rss = rec.get("peak_rss_mib")
    return f", peak RSS {rss / 1024:.1f} GiB" if isinstance(rss, (int, float)) and rss > 0 else ""


def _fmt_s(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else \
        f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def _finish(run: Run, rec: dict, progress: Progress) -> None:
    record_path(run).parent.mkdir(parents=True, exist_ok=True)  # a task that never started made none
    record_path(run).write_text(json.dumps({"cell": run.cell.name, "seed": run.seed, **rec}, indent=1))
    progress.done(run, rec, rec["rc"] == 0 and read_report(run.run_dir) is not None)


@contextlib.contextmanager
def stop_on_termination():
    """SIGTERM and SIGHUP (``kill``, a batch scheduler's preemption, a closed terminal) stop the sweep as Ctrl-C
    does: no further run starts and the running ones are terminated. Left running, a sweep's runs would go on
    writing into the folders the next ``masrl sweep`` starts over. (A sweep started in the background of a
    non-interactive shell ignores SIGINT; these still reach it.) Main thread only; the old handlers come back."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise KeyboardInterrupt(f"masrl sweep: {signal.Signals(signum).name}")

    old = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def run_local(runs: Sequence[Run], jobs: int, nice: int, progress: Progress) -> None:
    """``jobs`` runs at a time. Interrupted (Ctrl-C), no further run starts and the running ones are
    terminated: they are partial runs, started over by the next ``masrl sweep``."""
    pool = ThreadPoolExecutor(max_workers=jobs)
    try:
        pending = {}
        for run in runs:
            record_path(run).unlink(missing_ok=True)
            pending[pool.submit(execute, run_argv(run, nice), str(run.log_path), os.getcwd(), None, nice)] = run
        while pending:
            finished, _ = wait(pending, return_when=FIRST_COMPLETED)
            for fut in finished:
                _finish(pending.pop(fut), _result(fut.result), progress)
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        for proc in list(_RUNNING):
            proc.terminate()
        raise
    finally:
        pool.shutdown(wait=True)


def run_ray(runs: Sequence[Run], address: str, gpus: float, nice: int, progress: Progress) -> None:
    """Each run is a Ray task (1 CPU, ``gpus`` GPUs) on the cluster at ``address`` ('local' starts one here).

    The task starts the same ``masrl train`` process as a local run; OUT must be on a filesystem every
    node sees, and every node needs masrl installed.
    """
    try:
        import ray
    except ImportError:
        raise missing_extra("masrl sweep --ray needs Ray", "ray") from None
    ray.init(address=None if address == "local" else address, ignore_reinit_error=True, log_to_driver=False)
    slots = ray.cluster_resources().get("GPU", 0) / gpus if gpus else ray.cluster_resources().get("CPU", 1)
    progress.parallel = max(1, int(slots))
    task = ray.remote(execute).options(num_cpus=1, num_gpus=gpus, max_retries=0)
    env = {"PYTHONPATH": os.environ["PYTHONPATH"]} if os.environ.get("PYTHONPATH") else None
    pending = {}
    for run in runs:
        record_path(run).unlink(missing_ok=True)
        pending[task.remote(run_argv(run, nice), str(run.log_path.resolve()), os.getcwd(), env, nice)] = run
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1)
        for ref in ready:
            _finish(pending.pop(ref), _result(lambda: ray.get(ref)), progress)


def _result(get: Callable[[], dict]) -> dict:
    """A task's record; a task that raised (could not start the process) counts as a failed run."""
    try:
        return get()
    except Exception as e:  # noqa: BLE001 — reported as a failed run, never stops the others
        return {"argv": [], "rc": -1, "wall_s": 0.0, "cpu_s": 0.0, "error": f"{type(e).__name__}: {e}"}


def _lock(out: Path):
    """An exclusive lock on OUT/.sweep.lock: two sweeps writing the same runs would overwrite each other."""
    import fcntl

    out.mkdir(parents=True, exist_ok=True)
    handle = open(out / ".sweep.lock", "w")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise ConfigError(f"another masrl sweep is running on {out}; wait for it, or use another --out") from None
    return handle


def write_manifest(spec: SweepSpec, out: Path, quick: bool) -> None:
    """OUT/sweep.json: what ``masrl sweep report`` expects to find (cells in axis order, seeds)."""
    out.mkdir(parents=True, exist_ok=True)
    manifest = {"name": spec.name, "quick": quick, "seeds": spec.seeds,
                "axes": {name: list(axis.arms) for name, axis in spec.axes.items()},
                "cells": [c.name for c in expand_cells(spec)], "spec": spec.model_dump(mode="json")}
    write_text_atomic(out / "sweep.json", json.dumps(manifest, indent=1))


def sweep(spec: SweepSpec, out: Path, *, jobs: int = 1, nice: int = 0, ray_address: str | None = None,
          gpus: float = 0.0, quick: bool = False, dry_run: bool = False, seeds: Sequence[int] | None = None) -> int:
    """Run every unfinished run of ``spec`` (of ``seeds`` only, when given: a subset of the spec's); 0 if all
    finished, 1 if any failed. OUT/sweep.json lists all the spec's seeds either way."""
    cells = expand_cells(spec)
    check_bases(cells)
    runs = expand_runs(spec, out)
    if seeds is not None:
        runs = [r for r in runs if r.seed in set(seeds)]
    if quick:  # per base config: only what it has (an SFT stage, periodic eval) is made smaller
        extra = {base: quick_overrides(load_config(base)) for base in {c.base for c in cells}}
        for run in runs:
            run.extra = extra[run.cell.base]
    todo, done = plan(runs)
    if dry_run:
        for run in runs:
            state = "finished, skipped" if run in done else "to run"
            print(f"# {run.cell.name} seed {run.seed} ({state})\n{subprocess.list2cmdline(run_argv(run, nice))}")
        return 0
    lock = _lock(out)  # noqa: F841 — held until this function returns (the process ends)
    write_manifest(spec, out, quick)
    parallel = jobs if ray_address is None else len(todo)
    n_seeds = len(spec.seeds) if seeds is None else f"{len(seeds)} of {len(spec.seeds)}"
    print(f"[sweep] {spec.name}: {len(cells)} cells x {n_seeds} seeds = {len(runs)} runs; "
          f"{len(done)} finished (skipped), {len(todo)} to run "
          f"{'on Ray' if ray_address else f'{jobs} at a time'}; out {out}", flush=True)
    progress = Progress(len(todo), parallel)
    with stop_on_termination():
        if ray_address is None:
            run_local(todo, jobs, nice, progress)
        else:
            run_ray(todo, ray_address, gpus, nice, progress)
    if progress.failed:
        print(f"[sweep] {len(progress.failed)} of {len(todo)} runs failed: "
              + ", ".join(f"{r.cell.name}/seed{r.seed}" for r in progress.failed), flush=True)
        return 1
    print(f"[sweep] all {len(runs)} runs finished; summarize with: masrl sweep report {out}", flush=True)
    return 0
