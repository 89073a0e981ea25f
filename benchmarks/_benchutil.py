"""Shared helpers for the masrl performance benchmarks (not a benchmark itself).

* ``machine_info()``: CPU model, cores, torch/transformers versions, threads, date, load average;
* ``peak_rss_mib()``: peak resident set size of *this* process (``ru_maxrss``), so every measured
  configuration runs in its own subprocess (``run_worker``) and reports its own peak;
* ``spread()``: min / median / max of a list, ``fmt_table``: a markdown table;
* ``command_line()``: the exact command that produced a report (printed at the top of each report).
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"


def command_line() -> str:
    return "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:])


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return platform.processor() or platform.machine()


def machine_info(threads: int | None = None) -> dict[str, Any]:
    import torch
    import transformers

    info = {
        "cpu": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "threads": threads,
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "loadavg_1m_at_start": round(os.getloadavg()[0], 2),
    }
    try:
        import trl

        info["trl"] = trl.__version__
    except ImportError:
        pass
    return info


def machine_line(info: dict) -> str:
    parts = [f"CPU {info['cpu']} ({info['logical_cpus']} logical CPUs)", f"torch {info['torch']}",
             f"transformers {info['transformers']}"]
    if "trl" in info:
        parts.append(f"trl {info['trl']}")
    parts += [f"threads {info['threads']}", f"load avg {info['loadavg_1m_at_start']} at start", info["date"]]
    return ", ".join(parts)


def print_header(threads: int | None = None) -> dict[str, Any]:
    """Print the command line and the machine line every report starts with; returns the machine info."""
    info = machine_info(threads)
    print(f"command: {command_line()}")
    print(f"machine: {machine_line(info)}", flush=True)
    return info


def peak_rss_mib() -> float:
    """Peak RSS of this process in MiB (Linux reports ``ru_maxrss`` in KiB, macOS in bytes)."""
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r / (1024 * 1024) if sys.platform == "darwin" else r / 1024


def current_rss_mib() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return float("nan")


def set_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set (or parallel work has started)
        pass


def spread(values: Sequence[float]) -> dict[str, float]:
    vals = [float(v) for v in values if v == v]
    if not vals:
        return {"min": float("nan"), "median": float("nan"), "max": float("nan"), "n": 0}
    return {"min": min(vals), "median": statistics.median(vals), "max": max(vals), "n": len(vals)}


def fmt(x: float, digits: int = 3) -> str:
    if x != x:
        return "n/a"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    if abs(x) >= 100:
        return f"{x:.1f}"
    return f"{x:.{digits}g}"


def fmt_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        lines.append("| " + " | ".join(str(c) for c in r) + " |")
    return "\n".join(lines)


def run_worker(script: Path, args: Sequence[str], timeout: float | None = None) -> dict:
    """Run ``python script --worker-json OUT args...`` in a fresh process; return the JSON it wrote."""
    with tempfile.TemporaryDirectory(prefix="masrl-bench-") as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, str(script), "--worker-json", str(out), *args]
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore"}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
        if proc.returncode != 0 or not out.is_file():
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-30:])
            raise RuntimeError(f"worker failed (rc {proc.returncode}): {' '.join(cmd)}\n{tail}")
        return json.loads(out.read_text())


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=float) + "\n")


def ab(variants: dict, reps: int, clock=time.perf_counter) -> dict:
    """Time every variant alternately ``reps`` times (after one untimed call each); ``clock``: wall time, or
    ``time.process_time`` (process CPU, less inflated by other jobs on a shared machine)."""
    for fn in variants.values():
        fn()
    times = {k: [] for k in variants}
    for _ in range(reps):
        for k, fn in variants.items():
            t = clock()
            fn()
            times[k].append(clock() - t)
    base = next(iter(variants))
    return {k: {"median_s": statistics.median(v), "min_s": min(v), "times": v,
                "ratio_to_first": statistics.median(v) / statistics.median(times[base])} for k, v in times.items()}
