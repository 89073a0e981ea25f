"""``masrl sweep report DIR``: every run's report.json and metrics.jsonl -> tables over seeds and plots.

Per metric: each arm's mean ± 95% t-interval over its seeds (n stated), the paired difference of each
arm against its baseline on the seeds both have (with its interval) and how many seeds favour each
side. Runs that did not finish are listed with their reason, never dropped silently. Writes
``summary.json``, ``summary.md`` and PNGs into DIR. Metric definitions: docs/study.md.

``--prior SUMMARY.json`` (``report(out, priors=[...])``): a sweep continued in another folder or on another machine.
The runs an earlier report of the same sweep counted (its ``per_run``, with their metrics and held-out curves) fill
the (cell, seed) slots that DIR has no finished run for; a run finished in DIR wins. Every run used from a prior is
marked with its source in ``summary.json`` and counted in ``summary.md``.
"""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from masrl.io.atomic import write_text_atomic
from masrl.errors import ConfigError, UserInputError, decode_utf8
from masrl.sweep.run import read_report
from masrl.sweep.spec import MAX_RUNS, MAX_SEEDS, cell_name, parse_cell_name
from masrl.sweep.stats import mean_ci, paired

TRAIN_REWARD_WINDOW = 10  # train_reward_final: mean team/reward over the last 10 RL steps
MAX_MANIFEST_BYTES = 16 << 20  # OUT/sweep.json: 10,000 runs' cell names and the spec take a few MB at most
MAX_PRIOR_BYTES = 256 << 20  # a summary.json of 10,000 runs with ~40 metrics and 11-point curves: ~100 MB


@dataclass
class RunResult:
    cell: str
    labels: tuple[tuple[str, str], ...]
    seed: int
    run_dir: Path
    status: str  # ok | failed | unfinished | missing
    reason: str = ""
    metrics: dict[str, float | None] = field(default_factory=dict)
    eval_curve: list[tuple[int, float]] = field(default_factory=list)  # (step, held-out avg@n in %)
    grad_norms: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # agent -> (step, norm)
    rl_steps: int = 0
    avg_key: str = "avg@n"
    source: str = ""  # "" for a run folder in DIR, else the prior summary.json its metrics come from


@dataclass(frozen=True)
class Metric:
    name: str
    label: str
    better: str | None  # "higher", "lower" or None (no preferred direction)
    unit: str = ""


def read_records(run_dir: Path) -> list[dict]:
    from masrl.monitoring.logger import read_metrics

    return read_metrics(run_dir)


# ---------------------------------------------------------------------- per run

def run_metrics(run_dir: Path, report: dict, records: Sequence[dict]) -> dict[str, float | None]:
    """The scalar metrics of one finished run (accuracies in %; None where the run has no value)."""
    out: dict[str, float | None] = {}
    sft, final = report["eval"].get("sft", {}), report["eval"].get("final", {})
    avg = avg_key(report)
    for key in ["avg@n"] + sorted((k for k in final if k.startswith("pass@")), key=lambda k: int(k[5:])):
        before, after = _pct(sft.get(key)), _pct(final.get(key))
        name = avg if key == "avg@n" else key
        out[f"{name}_sft"], out[f"{name}_rl"] = before, after
        out[f"{name}_gain"] = after - before if before is not None and after is not None else None
    for key in ("heldout_check", "heldout_agreement", "heldout_auc"):  # a judge's rule-based check beside its verdicts
        if key in sft or key in final:
            before, after = _pct(sft.get(key)), _pct(final.get(key))
            out[f"{key}_sft"], out[f"{key}_rl"] = before, after
            out[f"{key}_gain"] = after - before if before is not None and after is not None else None
    evals = [_pct(r.get("eval/test/avg@n")) for r in records if r.get("phase") == "eval"]
    out[f"{avg}_peak"] = max((v for v in evals if v is not None), default=None)
    final_acc = out.get(f"{avg}_rl")
    out[f"{avg}_peak_drop"] = out[f"{avg}_peak"] - final_acc if None not in (out[f"{avg}_peak"], final_acc) else None
    train = [r for r in records if r.get("phase") == "train"]
    rewards = [r.get("team/reward") for r in train[-TRAIN_REWARD_WINDOW:]]
    out["train_reward_final"] = statistics.fmean(rewards) if rewards and None not in rewards else None
    for agent in _agents(train):
        norms = [r.get(f"agent/{agent}/grad_norm") for r in train if f"agent/{agent}/grad_norm" in r]
        ok = [v for v in norms if v is not None and math.isfinite(v) and v > 0]  # 0: no gradient this step
        out[f"grad_norm_max/{agent}"] = max(ok) if ok else None
        out[f"grad_norm_median/{agent}"] = statistics.median(ok) if ok else None
        out[f"spikes/{agent}"] = float(sum(1 for r in train if r.get(f"agent/{agent}/grad_spike")))
        out[f"role_captures/{agent}"] = float(sum(1 for r in train if r.get(f"agent/{agent}/role_capture")))
        drift = [r[f"agent/{agent}/chi2_drift"] for r in train if r.get(f"agent/{agent}/chi2_drift") is not None]
        out[f"chi2_drift_final/{agent}"] = drift[-1] if drift else None
    out["nonfinite_steps"] = float(sum(1 for r in train if _any(r, "nonfinite_skipped")))
    out["skipped_steps"] = float(sum(1 for r in train if _any(r, "_skipped")))
    return out


def avg_key(report: dict) -> str:
    """``avg@<n>``: the held-out accuracy averaged over the n samples per task the run evaluated with."""
    n = next((e.get("n") for e in report["eval"].values() if isinstance(e, dict) and e.get("n")), None)
    return f"avg@{int(n)}" if n else "avg@n"


def _pct(value) -> float | None:
    return 100.0 * value if isinstance(value, (int, float)) and math.isfinite(value) else None


def _agents(records: Sequence[dict]) -> list[str]:
    agents = {k.split("/")[1] for r in records for k in r if k.startswith("agent/") and k.endswith("/grad_norm")}
    return sorted(agents)


def _any(record: dict, suffix: str) -> bool:
    return any(k.startswith("policy/") and k.endswith(suffix) and (v or 0) > 0 for k, v in record.items())


def run_times(run: RunResult, log_path: Path) -> dict[str, float | None]:
    """Wall and CPU seconds (and the peak RSS, where the record has it) from the sweep's record (seed<S>.json);
    else wall from the run folder's file times (config.yaml written at the start, report.json at the end) and no
    CPU time."""
    try:
        rec = json.loads(log_path.with_suffix(".json").read_text())
        times = {"wall_s": float(rec["wall_s"]), "cpu_s": float(rec["cpu_s"])}
        if isinstance(rec.get("peak_rss_mib"), (int, float)) and rec["peak_rss_mib"] > 0:
            times["peak_rss_mib"] = float(rec["peak_rss_mib"])
        return times
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        wall = (run.run_dir / "report.json").stat().st_mtime - (run.run_dir / "config.yaml").stat().st_mtime
    except OSError:
        wall = None
    return {"wall_s": wall, "cpu_s": None}


def load_run(out: Path, labels, seed: int) -> RunResult:
    cell = cell_name(labels)
    run_dir, log = out / cell / f"seed{seed}", out / cell / f"seed{seed}.log"
    run = RunResult(cell, tuple(labels), seed, run_dir, "ok")
    report = read_report(run_dir)
    if report is None:
        run.status, run.reason = _why_not_finished(run_dir, log)
        return run
    records = read_records(run_dir)
    run.metrics = {**run_metrics(run_dir, report, records), **run_times(run, log)}
    run.eval_curve = [(int(r["step"]), _pct(r["eval/test/avg@n"])) for r in records
                      if r.get("phase") == "eval" and _pct(r.get("eval/test/avg@n")) is not None]
    train = [r for r in records if r.get("phase") == "train"]
    run.grad_norms = {a: [(int(r["step"]), r[f"agent/{a}/grad_norm"]) for r in train
                          if r.get(f"agent/{a}/grad_norm")] for a in _agents(train)}  # 0 and None left out
    run.rl_steps, run.avg_key = len(train), avg_key(report)
    return run


def _why_not_finished(run_dir: Path, log: Path) -> tuple[str, str]:
    if not run_dir.exists() and not log.exists():
        return "missing", "not run yet"
    last = _last_line(log)
    try:
        rec = json.loads(log.with_suffix(".json").read_text())
    except (OSError, ValueError):
        return "unfinished", f"no valid report.json and no exit record (still running, or interrupted){last}"
    if rec.get("rc") == 0:
        return "failed", f"exit code 0 but no valid report.json{last}"
    return "failed", f"exit code {rec.get('rc')}{last}"


def _last_line(log: Path) -> str:
    try:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return f"; log {log}: {lines[-1].strip()[:200]!r}" if lines else f"; log {log} is empty"


# ---------------------------------------------------------------------- the grid

def read_manifest(path: Path) -> dict:
    """OUT/sweep.json as ``masrl sweep`` writes it (axes: {axis: [labels]}, seeds: [int], cells: [cell names]),
    or one ``ConfigError`` naming the file and what is wrong with it (truncated, not JSON, wrong types, larger
    than any sweep writes: its size is checked before it is read, its counts before anything is expanded)."""
    def refuse(why: str) -> ConfigError:
        return ConfigError(f"masrl sweep report: {path}: {why}; re-run `masrl sweep SPEC` to rewrite it, or delete it "
                           "to report the run folders found")
    manifest = _read_json(path, MAX_MANIFEST_BYTES, refuse, "sweep manifest",
                          f" (a sweep of {MAX_RUNS:,} runs writes far less)")
    if not isinstance(manifest, dict):
        raise refuse("not a JSON object")
    axes, seeds, cells = manifest.get("axes"), manifest.get("seeds"), manifest.get("cells")
    if isinstance(seeds, list) and isinstance(cells, list) and (
            len(seeds) > MAX_SEEDS or len(seeds) * len(cells) > MAX_RUNS):
        raise refuse(f"{len(cells):,} cells x {len(seeds):,} seeds = {len(cells) * len(seeds):,} runs; the limits are "
                     f"{MAX_RUNS:,} runs and {MAX_SEEDS:,} seeds")
    if not (isinstance(axes, dict) and all(isinstance(v, list) and all(isinstance(x, str) for x in v)
                                           for v in axes.values())):
        raise refuse("'axes' is not a mapping of axis -> list of labels")
    if not (isinstance(seeds, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in seeds)):
        raise refuse("'seeds' is not a list of integers")
    if not (isinstance(cells, list) and all(isinstance(c, str) and parse_cell_name(c) for c in cells)):
        raise refuse("'cells' is not a list of cell names (axis=label__...)")
    if not isinstance(manifest.get("name", ""), str):
        raise refuse("'name' is not a string")
    return manifest


def _read_json(path: Path, limit: int, refuse, what: str, why_limit: str = ""):
    """The JSON value in ``path``, its size checked before it is read; ``refuse(why)`` makes the one error."""
    try:
        size = path.stat().st_size
        if size > limit:
            raise refuse(f"{size:,} bytes; the limit is {limit:,}{why_limit}")
        return json.loads(decode_utf8(path.read_bytes(), path, what))
    except (OSError, ValueError, RecursionError, UserInputError) as e:  # unreadable, not UTF-8/JSON, too deep
        if isinstance(e, ConfigError):
            raise
        raise refuse(f"not a readable JSON file ({e})") from None


def found_runs(out: Path) -> list[tuple[tuple[tuple[str, str], ...], int]]:
    """(labels, seed) of the run folders and records in OUT (``<cell>/seed<S>[.log|.json]``), at most
    ``MAX_RUNS``: a folder holding more is refused before it is all listed."""
    found = []
    for cell_dir in sorted(p for p in out.iterdir() if p.is_dir()):
        labels = parse_cell_name(cell_dir.name)
        if labels is None:
            continue
        seeds = {int(p.name[4:].split(".")[0]) for p in cell_dir.iterdir()
                 if p.name.startswith("seed") and p.name[4:].split(".")[0].isdigit()}
        found += [(labels, s) for s in sorted(seeds)]
        if len(found) > MAX_RUNS:
            raise ConfigError(f"masrl sweep report: {out} holds more than {MAX_RUNS:,} runs (<axis>=<label>__.../"
                              "seed<S>); report a sweep's own output folder, or split it")
    return found


def discover(out: Path) -> tuple[dict[str, list[str]], list[tuple[tuple[tuple[str, str], ...], int]], str]:
    """(axes -> labels in order, expected (labels, seed) runs, sweep name) from sweep.json, else the folders."""
    manifest_path = out / "sweep.json"
    manifest = read_manifest(manifest_path) if manifest_path.is_file() else None  # refused before any listing
    found = found_runs(out)
    if manifest is not None:
        axes = {a: list(labels) for a, labels in manifest["axes"].items()}
        expected = [(parse_cell_name(c), s) for s in manifest["seeds"] for c in manifest["cells"]]
        known = set(expected)
        return axes, expected + [r for r in found if r not in known], manifest.get("name", out.name)
    if not found:
        raise ConfigError(f"masrl sweep report: {out} has no sweep.json and no run folders "
                          "(<axis>=<label>__.../seed<S>); is it a sweep's output folder?")
    axes: dict[str, list[str]] = {}
    for labels, _ in found:
        for axis, label in labels:
            axes.setdefault(axis, [])
            if label not in axes[axis]:
                axes[axis].append(label)
    axes = {a: sorted(labels) for a, labels in axes.items()}
    return axes, found, out.name


def baselines(axes: dict[str, list[str]], chosen: Sequence[str]) -> dict[str, str]:
    """Each axis's baseline label: the first one, or AXIS=LABEL from ``--baseline-arm``."""
    base = {a: labels[0] for a, labels in axes.items()}
    for item in chosen:
        axis, sep, label = item.partition("=")
        if not sep or axis not in axes or label not in axes[axis]:
            raise ConfigError(f"--baseline-arm {item!r}: give AXIS=LABEL with one of "
                              + ", ".join(f"{a}={'|'.join(ls)}" for a, ls in axes.items()))
        base[axis] = label
    return base


def comparisons(cells: dict[str, tuple], axes: dict[str, list[str]], base: dict[str, str]) -> list[tuple[str, str, str]]:
    """(axis, arm cell, baseline cell): each cell against the cell that differs only in that axis's baseline."""
    out = []
    for axis in axes:
        for name, labels in cells.items():
            mine = dict(labels)
            if mine.get(axis) in (None, base[axis]):
                continue
            sibling = cell_name(tuple((a, base[axis] if a == axis else lab) for a, lab in labels))
            if sibling in cells:
                out.append((axis, name, sibling))
    return out


# ---------------------------------------------------------------------- summary

def metric_list(runs: Sequence[RunResult]) -> list[Metric]:
    names = list(dict.fromkeys(k for r in runs if r.status == "ok" for k in r.metrics))
    return [_describe(n) for n in names]


def _describe(name: str) -> Metric:
    stage = {"sft": "after SFT", "rl": "after RL", "gain": "gain (after RL − after SFT)", "peak": "peak over evals",
             "peak_drop": "drop from peak to final (peak − after RL)"}
    if name.startswith(("avg@", "pass@")):
        key, _, when = name.partition("_")
        return Metric(name, f"held-out {key} {stage[when]}", "lower" if when == "peak_drop" else "higher", "%")
    if name.startswith("heldout_"):
        key, _, when = name.rpartition("_")
        what = {"heldout_check": "held-out check (rule, not the judge)",
                "heldout_agreement": "judge agrees with the check",
                "heldout_auc": "AUC of the judge's reward against the check"}[key]
        return Metric(name, f"{what} {stage[when]}", "higher", "%")
    if "/" in name:
        kind, agent = name.split("/", 1)
        label = {"grad_norm_max": "grad-norm max", "grad_norm_median": "grad-norm median",
                 "spikes": "grad spikes (count)", "role_captures": "role-capture events (count)",
                 "chi2_drift_final": "χ² drift at the last RL step"}[kind]
        return Metric(name, f"{agent}: {label}", "lower" if kind in ("grad_norm_max", "spikes") else None)
    labels = {"train_reward_final": (f"train reward, last {TRAIN_REWARD_WINDOW} steps", "higher"),
              "nonfinite_steps": ("steps with a non-finite gradient", "lower"),
              "skipped_steps": ("steps with a skipped update", "lower"), "wall_s": ("wall time", "lower"),
              "cpu_s": ("CPU time", "lower"), "peak_rss_mib": ("peak RSS of the run's process", "lower")}
    label, better = labels.get(name, (name, None))
    return Metric(name, label, better, "s" if name.endswith("_s") else "MiB" if name.endswith("_mib") else "")


def summarize(runs: Sequence[RunResult], axes: dict[str, list[str]], base: dict[str, str], name: str) -> dict:
    ok = [r for r in runs if r.status == "ok"]
    cells = {r.cell: r.labels for r in runs}
    pairs = comparisons({c: l for c, l in cells.items() if any(r.cell == c for r in ok)}, axes, base)
    metrics = {}
    for m in metric_list(runs):
        by_cell = {c: {r.seed: r.metrics.get(m.name) for r in ok if r.cell == c} for c in cells}
        arms = {c: {**mean_ci(list(v.values())).as_dict(), "values": v} for c, v in by_cell.items() if v}
        comps = []
        for axis, arm, baseline in pairs:
            p = paired(by_cell[arm], by_cell[baseline])
            favour = {"higher": (p.arm_higher, p.baseline_higher), "lower": (p.baseline_higher, p.arm_higher)}
            fa, fb = favour.get(m.better, (None, None))
            comps.append({"axis": axis, "arm": arm, "baseline": baseline, **p.as_dict(),
                          "favours_arm": fa, "favours_baseline": fb})
        metrics[m.name] = {"label": m.label, "better": m.better, "unit": m.unit, "arms": arms, "comparisons": comps}
    not_ok = [{"cell": r.cell, "seed": r.seed, "status": r.status, "reason": r.reason} for r in runs
              if r.status != "ok"]
    return {"name": name, "axes": axes, "baselines": base, "confidence": 0.95,
            "runs": {"ok": len(ok), "total": len(runs)}, "not_finished": not_ok, "metrics": metrics,
            "per_run": [{"cell": r.cell, "seed": r.seed, "metrics": r.metrics,
                         "eval_curve": [list(p) for p in r.eval_curve], **({"source": r.source} if r.source else {})}
                        for r in ok]}


def _fmt(v: float | None, unit: str) -> str:
    if v is None:
        return "–"
    if unit == "%":
        return f"{v:.1f}"
    return f"{v:.0f}" if unit in ("s", "MiB") or (abs(v) >= 100 and float(v).is_integer()) else f"{v:.4g}"


def _ci(s: dict, unit: str) -> str:
    if s["mean"] is None:
        return "–"
    return f"{_fmt(s['mean'], unit)} ± {_fmt(s['half_width'], unit)}" if s["half_width"] is not None else \
        f"{_fmt(s['mean'], unit)} (n=1, no CI)"


def to_markdown(summary: dict) -> str:
    lines = [f"# Sweep {summary['name']}: {summary['runs']['ok']} of {summary['runs']['total']} runs finished", "",
             "Each arm: mean ± half-width of the 95% Student-t interval over seeds (n − 1 df; n = seeds with a "
             "value). Comparisons: arm − baseline, paired on the seeds both arms have. Accuracies in %.",
             "Baselines: " + ", ".join(f"{a}={lab}" for a, lab in summary["baselines"].items()), ""]
    lines += _priors_md(summary.get("priors", [])) + _not_finished_md(summary["not_finished"]) + _headline_md(summary)
    for name, m in summary["metrics"].items():
        unit = m["unit"]
        better = f" ({m['better']} is better)" if m["better"] else ""
        lines += [f"## {m['label']}{better}", f"`{name}`", "", "| arm | n | mean ± 95% CI | by seed |", "|---|---|---|---|"]
        for cell, s in m["arms"].items():
            by_seed = ", ".join(f"{seed}: {_fmt(v, unit)}" for seed, v in s["values"].items())
            lines.append(f"| {cell} | {s['n']} | {_ci(s, unit)} | {by_seed} |")
        if m["comparisons"]:
            lines += ["", "| arm − baseline | pairs | difference ± 95% CI | seeds favouring arm / baseline / tie |",
                      "|---|---|---|---|"]
            for c in m["comparisons"]:
                n = len(c["seeds"])
                if c["favours_arm"] is None:
                    fav = f"arm higher {c['arm_higher']}/{n}, baseline higher {c['baseline_higher']}/{n}, tie {c['ties']}/{n}"
                else:
                    fav = f"{c['favours_arm']}/{n} / {c['favours_baseline']}/{n} / {c['ties']}/{n}"
                lines.append(f"| {c['arm']} − {c['baseline']} | {n} | {_ci(c['diff'], unit)} | {fav} |")
        lines.append("")
    return "\n".join(lines)


def _headline_md(summary: dict) -> list[str]:
    """One row per arm: held-out accuracy after RL, its gain, the final train reward (mean ± CI)."""
    names = list(summary["metrics"])
    pick = [n for n in names if n.startswith("avg@") and n.endswith("_rl")]
    pick += [n for n in names if n.startswith("pass@") and n.endswith("_rl")][-1:]
    pick += [n for n in names if n.startswith("avg@") and n.endswith("_gain")] + \
        [n for n in names if n == "train_reward_final"]
    if not pick:
        return []
    ms = [summary["metrics"][n] for n in pick]
    lines = ["## Headline", "", "| arm | " + " | ".join(m["label"] for m in ms) + " |", "|---|" + "---|" * len(ms)]
    for cell in ms[0]["arms"]:
        cells = [_ci(m["arms"][cell], m["unit"]) + (f" (n={m['arms'][cell]['n']})" if m["arms"][cell]["n"] > 1 else "")
                 if cell in m["arms"] else "–" for m in ms]
        lines.append(f"| {cell} | " + " | ".join(cells) + " |")
    return lines + [""]


def _priors_md(priors: list[dict]) -> list[str]:
    if not priors:
        return []
    used = "; ".join(f"{p['runs_used']} from `{p['path']}`" for p in priors)
    return [f"Runs from earlier reports of this sweep (their folders are not in this one): {used}. Their metrics and "
            "held-out curves are the earlier report's; their gradient-norm curves are not plotted.", ""]


def _not_finished_md(rows: list[dict]) -> list[str]:
    if not rows:
        return ["Every run finished.", ""]
    lines = [f"## Runs not in the tables ({len(rows)})", "", "| cell | seed | status | reason |", "|---|---|---|---|"]
    lines += [f"| {r['cell']} | {r['seed']} | {r['status']} | {r['reason'].replace('|', '/')} |" for r in rows]
    return lines + [""]


def read_prior(path: str | Path) -> dict:
    """An earlier ``summary.json`` of a sweep: {"name", "axes", "runs": [RunResult of each finished run],
    "not_finished": [RunResult]}, or one ``ConfigError`` naming the file and what is wrong with it."""
    path = Path(path)

    def refuse(why: str) -> ConfigError:
        return ConfigError(f"masrl sweep report --prior {path}: {why}; pass a summary.json that `masrl sweep report` "
                           "wrote for this sweep")
    data = _read_json(path, MAX_PRIOR_BYTES, refuse, "sweep summary")
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        raise refuse("not a JSON object with a 'name'")
    axes = data.get("axes")
    if not (isinstance(axes, dict) and all(isinstance(v, list) and all(isinstance(x, str) for x in v)
                                           for v in axes.values())):
        raise refuse("'axes' is not a mapping of axis -> list of labels")

    def entry(i: int, item, what: str) -> RunResult:
        where = f"{what}[{i}]"
        if not isinstance(item, dict):
            raise refuse(f"{where} is not an object")
        labels = parse_cell_name(item.get("cell")) if isinstance(item.get("cell"), str) else None
        seed = item.get("seed")
        if labels is None or not isinstance(seed, int) or isinstance(seed, bool):
            raise refuse(f"{where}: 'cell' is not a cell name (axis=label__...) or 'seed' is not an integer")
        unknown = [f"{a}={lab}" for a, lab in labels if lab not in axes.get(a, ())]
        if unknown or {a for a, _ in labels} != set(axes):
            raise refuse(f"{where}: cell {item['cell']!r} does not fit the summary's axes {axes}")
        run = RunResult(item["cell"], labels, seed, path.parent / item["cell"] / f"seed{seed}", "ok", source=str(path))
        if what == "not_finished":
            status, reason = item.get("status"), item.get("reason", "")
            if status not in ("failed", "unfinished", "missing") or not isinstance(reason, str):
                raise refuse(f"{where}: 'status' is not failed/unfinished/missing or 'reason' is not a string")
            run.status, run.reason = status, f"{reason} (in {path})"
            return run
        metrics, curve = item.get("metrics"), item.get("eval_curve", [])
        if not (isinstance(metrics, dict) and all(isinstance(k, str) and (v is None or _number(v))
                                                  for k, v in metrics.items())):
            raise refuse(f"{where}: 'metrics' is not a mapping of name -> number or null")
        if not (isinstance(curve, list) and all(isinstance(p, list) and len(p) == 2 and _number(p[0])
                                                and _number(p[1]) for p in curve)):
            raise refuse(f"{where}: 'eval_curve' is not a list of [step, accuracy %] pairs")
        run.metrics = {k: None if v is None else float(v) for k, v in metrics.items()}
        run.eval_curve = [(int(a), float(b)) for a, b in curve]
        run.avg_key = next((k[:-4] for k in metrics if k.startswith("avg@") and k.endswith("_sft")), "avg@n")
        return run

    lists = {k: data.get(k, []) for k in ("per_run", "not_finished")}
    if not all(isinstance(v, list) for v in lists.values()) or len(lists["per_run"]) + len(lists["not_finished"]) > MAX_RUNS:
        raise refuse(f"'per_run' and 'not_finished' are not lists of at most {MAX_RUNS:,} runs in all")
    counts = data.get("runs")
    if not lists["per_run"] and isinstance(counts, dict) and counts.get("ok"):
        raise refuse("it counts finished runs but has no 'per_run' list (written by an older masrl); re-run "
                     "`masrl sweep report` where its run folders are")
    return {"name": data["name"], "axes": axes, "path": str(path),
            "runs": [entry(i, x, "per_run") for i, x in enumerate(lists["per_run"])],
            "not_finished": [entry(i, x, "not_finished") for i, x in enumerate(lists["not_finished"])]}


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def merge_priors(runs: list[RunResult], axes: dict[str, list[str]], name: str, priors: Sequence[dict]
                 ) -> tuple[list[RunResult], dict[str, list[str]], list[dict]]:
    """``runs`` of DIR with each prior's finished runs in the slots DIR has not finished, the union of the axes (the
    priors' label order first), the runs in axis order; and per prior how many of its runs were used."""
    axes = {a: list(v) for a, v in axes.items()}
    by_key = {(r.cell, r.seed): r for r in runs}
    used = []
    for prior in priors:
        where = prior["path"]
        if prior["name"] != name:
            raise ConfigError(f"masrl sweep report --prior {where}: it summarizes sweep {prior['name']!r}, this folder "
                              f"holds sweep {name!r}; pass a summary of the same sweep")
        if set(prior["axes"]) != set(axes):
            raise ConfigError(f"masrl sweep report --prior {where}: its axes {sorted(prior['axes'])} are not this "
                              f"folder's {sorted(axes)}")
        for a, labels in prior["axes"].items():
            axes[a] = list(labels) + [lab for lab in axes[a] if lab not in labels]
        n = 0
        for run in prior["runs"]:
            mine = by_key.get((run.cell, run.seed))
            if mine is None or mine.status != "ok":
                by_key[(run.cell, run.seed)] = run
                n += 1
        for run in prior["not_finished"]:  # a slot never run here keeps the prior's reason (e.g. its exit code)
            mine = by_key.get((run.cell, run.seed))
            if mine is None or mine.status == "missing":
                by_key[(run.cell, run.seed)] = run
        used.append({"path": where, "runs_used": n})
    order = {a: {lab: i for i, lab in enumerate(v)} for a, v in axes.items()}
    merged = sorted(by_key.values(), key=lambda r: ([order[a][lab] for a, lab in r.labels], r.seed))
    return merged, axes, used


def report(out: str | Path, baseline_arms: Sequence[str] = (), priors: Sequence[str | Path] = ()) -> list[Path]:
    """Summarize the sweep in ``out`` (with the finished runs of earlier summaries ``priors`` where ``out`` has none);
    returns the files written."""
    from masrl.sweep.plots import plot_sweep

    out = Path(out)
    if not out.is_dir():
        raise ConfigError(f"masrl sweep report: {out} is not a folder")
    loaded = [read_prior(p) for p in priors]  # every prior checked before anything is written
    axes, expected, name = discover(out)
    runs = [load_run(out, labels, seed) for labels, seed in expected]
    used: list[dict] = []
    if loaded:
        runs, axes, used = merge_priors(runs, axes, name, loaded)
    base = baselines(axes, baseline_arms)
    summary = summarize(runs, axes, base, name)
    if used:
        summary["priors"] = used
    paths = [_write(out / "summary.json", json.dumps(summary, indent=1, default=str)),
             _write(out / "summary.md", to_markdown(summary))]
    if any(r.status == "ok" for r in runs):
        paths += plot_sweep(out, runs)
    return paths


def _write(path: Path, text: str) -> Path:
    return write_text_atomic(path, text)
