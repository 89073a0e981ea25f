"""The judged search team (benchmarks/study/judge_kb.yaml): the judge's verdicts against the exact-match check it
never sees, after SFT and after RL, over seeds; and the two over RL steps.

    python benchmarks/study/judge_kb_summary.py runs/study/judge_kb [--out benchmarks/study/judge_kb]
    python benchmarks/study/judge_kb_summary.py runs/study/judge_kb_trained --out benchmarks/study/judge_kb_trained \
        --judge "the trained SmolLM2 judge" \
        --command "masrl sweep benchmarks/study/judge_kb_trained.yaml --jobs 1 --nice 10"

For every run (``<sweep>/<cell>/seed<k>/``): ``report.json`` gives the held-out evaluations (after SFT = before RL,
and after RL): ``avg@n`` is the share of sampled answers the judge calls correct, ``heldout_check`` the share exact
match calls correct on the same samples, ``heldout_agreement`` how often the two agree; and the run's judge totals
(calls, unparsed replies, share of the step time, length correlation); the judge's approve rate and its agreement
on the answers exact match passes and on those it fails; the sweep's record (``<cell>/seed<k>.json``) the run's wall
time. ``metrics.jsonl`` gives the same pair per RL step on the training samples (``team/accuracy``: judged correct;
``judge/heldout_check``). Mean ± half-width of the 95% Student-t interval over seeds (± sd with ``--sd``). Writes
``summary.json``, ``summary.md`` and ``judge_vs_check.png`` under ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

from masrl.monitoring.logger import read_metrics
from masrl.sweep.stats import mean_ci
from masrl.versions import git_sha

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _benchutil import cpu_model  # noqa: E402

STAGES = (("sft", "sft"), ("final", "rl"))  # report.json's label, the suffix of a metric
EVAL_KEYS = (("avg@n", "judge accuracy"), ("heldout_check", "held-out check (exact match)"),
             ("heldout_agreement", "judge agrees with exact match"), ("judge_approve_rate", "judge approve rate"),
             ("heldout_agreement_right", "agreement on answers exact match passes"),
             ("heldout_agreement_wrong", "agreement on answers exact match fails"))


def load(sweep: Path) -> dict[int, dict]:
    runs = {}
    for report in sorted(sweep.glob("*/seed*/report.json")):
        seed = int(report.parent.name.removeprefix("seed"))
        record = report.parent.with_suffix(".json")  # the sweep's record of the run: its wall time
        wall = json.loads(record.read_text()).get("wall_s") if record.is_file() else None
        runs[seed] = {"report": json.loads(report.read_text()), "records": read_metrics(report.parent),
                      "cell": report.parent.parent.name, "wall_s": wall}
    if not runs:
        raise SystemExit(f"{sweep}: no finished run (no */seed*/report.json)")
    return runs


def mean_sd(values: list[float]) -> dict:
    ci = mean_ci(values)
    return {"n": len(values), "mean": statistics.fmean(values),
            "sd": statistics.stdev(values) if len(values) > 1 else None, "half_width_95": ci.half_width,
            "values": values}


def summarize(runs: dict[int, dict]) -> dict:
    per_seed, table = {}, {}
    for seed, run in runs.items():
        ev, judge = run["report"]["eval"], run["report"].get("judge") or {}
        row = {f"{key}_{suffix}": 100 * ev[stage][key] for stage, suffix in STAGES for key, _ in EVAL_KEYS
               if key in ev.get(stage, {})}
        row.update({"judge_calls": judge.get("calls"), "judge_unparsed": judge.get("unparsed"),
                    "judge_errors": judge.get("errors"),
                    "judge_share_pct": 100 * judge["share_of_step_time"] if judge.get("share_of_step_time") else None,
                    "length_corr_mean": judge.get("length_corr_mean"), "rl_steps": run["report"]["steps"],
                    "wall_s": run["wall_s"]})
        per_seed[seed] = row
    for name in next(iter(per_seed.values())):
        values = [row[name] for row in per_seed.values() if row.get(name) is not None]
        if values:
            table[name] = mean_sd(values)
    return {"seeds": sorted(runs), "per_seed": per_seed, "metrics": table}


def curves(runs: dict[int, dict]) -> dict[str, dict[int, list[tuple[int, float]]]]:
    out = {"judge": {}, "check": {}}
    for seed, run in runs.items():
        train = [r for r in run["records"] if r.get("phase") == "train"]
        out["judge"][seed] = [(r["step"], 100 * r["team/accuracy"]) for r in train if r.get("team/accuracy") is not None]
        out["check"][seed] = [(r["step"], 100 * r["judge/heldout_check"]) for r in train
                              if r.get("judge/heldout_check") is not None]
    return out


def plot(runs: dict[int, dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = curves(runs)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, label, color in (("judge", "judged correct (the reward)", "C0"),
                               ("check", "exact match (held-out check)", "C1")):
        by_seed = series[name]
        steps = sorted(set.intersection(*[{s for s, _ in pts} for pts in by_seed.values()]))
        values = [[dict(pts)[s] for pts in by_seed.values()] for s in steps]
        ax.plot(steps, [statistics.fmean(v) for v in values], color=color, label=f"train samples: {label}")
        ax.fill_between(steps, [min(v) for v in values], [max(v) for v in values], color=color, alpha=0.15)
        key = "avg@n" if name == "judge" else "heldout_check"
        last = max(steps) if steps else 1
        for seed, run in runs.items():
            ev = run["report"]["eval"]
            ax.plot([0, last], [100 * ev["sft"][key], 100 * ev["final"][key]], "o--", color=color, alpha=0.6,
                    label=f"held-out eval: {label}" if seed == min(runs) else None)
    ax.set_xlabel("RL step (0: after SFT)")
    ax.set_ylabel("% of sampled answers")
    ax.set_title(f"judge vs exact match, {len(runs)} seeds (mean line, min-max band; dots: held-out evaluation)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


SPREAD = "half_width_95"  # or "sd" (--sd)


def fmt(m: dict | None, digits: int = 1) -> str:
    if m is None:
        return "–"
    spread = m.get(SPREAD)
    return f"{m['mean']:.{digits}f}" + ("" if spread is None else f" ± {spread:.{digits}f}")


def to_markdown(summary: dict, meta: dict) -> str:
    m, seeds = summary["metrics"], summary["seeds"]
    spread = "half-width of the 95% Student-t interval" if SPREAD == "half_width_95" else "sd"
    lines = [f"# Judged search team on the synthetic knowledge base ({len(seeds)} seeds)", "",
             f"Command: `{meta['command']}`, then `{meta['summary_command']}`.",
             f"masrl commit `{meta['commit']}`, {meta['date']}, CPU: {meta['cpu']}, load average at the end "
             f"{meta['loadavg']}.", "",
             f"Held-out evaluation (after SFT = before RL, and after RL): the share of sampled answers {meta['judge']} "
             "calls correct (the reward), the share exact match calls correct (never seen by the judge), how often "
             "the two agree (overall, on the answers exact match passes and on those it fails) and the judge's "
             f"approve rate. Mean ± {spread} over seeds, in %.", "",
             "| metric | after SFT | after RL | change |", "|---|---|---|---|"]
    for key, label in EVAL_KEYS:
        before, after = m.get(f"{key}_sft"), m.get(f"{key}_rl")
        diffs = [summary["per_seed"][s][f"{key}_rl"] - summary["per_seed"][s][f"{key}_sft"] for s in seeds
                 if f"{key}_rl" in summary["per_seed"][s] and f"{key}_sft" in summary["per_seed"][s]]
        lines.append(f"| {label} | {fmt(before)} | {fmt(after)} | {fmt(mean_sd(diffs) if diffs else None)} |")
    if m.get("wall_s"):
        lines += ["", f"Wall time per run (RL and both evaluations): {fmt(m['wall_s'], 0)} s."]
    lines += ["", "Per seed (after SFT → after RL, %):", "",
              "| seed | judge accuracy | exact match | agreement | judge calls | unparsed | judge share of step time | length corr |",
              "|---|---|---|---|---|---|---|---|"]
    for s in seeds:
        r = summary["per_seed"][s]

        def pair(key):
            return f"{r.get(key + '_sft', float('nan')):.1f} → {r.get(key + '_rl', float('nan')):.1f}"

        share = "–" if r["judge_share_pct"] is None else f"{r['judge_share_pct']:.1f}%"
        corr = "–" if r["length_corr_mean"] is None else f"{r['length_corr_mean']:.3f}"
        lines.append(f"| {s} | {pair('avg@n')} | {pair('heldout_check')} | {pair('heldout_agreement')} | "
                     f"{r['judge_calls']:.0f} | {r['judge_unparsed']:.0f} | {share} | {corr} |")
    lines += ["", "![judge vs exact match](judge_vs_check.png)", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep", type=Path)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/study/judge_kb"))
    parser.add_argument("--command", default="masrl sweep benchmarks/study/judge_kb.yaml --jobs 1 --nice 19")
    parser.add_argument("--judge", default="the frozen SmolLM2-135M-Instruct judge", help="the judge, in words")
    parser.add_argument("--sd", action="store_true", help="± sd over seeds instead of the 95%% t half-width")
    args = parser.parse_args()
    global SPREAD
    SPREAD = "sd" if args.sd else "half_width_95"
    runs = load(args.sweep)
    summary = summarize(runs)
    meta = {"command": args.command, "summary_command": "python " + shlex.join(sys.argv), "judge": args.judge,
            "commit": git_sha() or "unknown", "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "cpu": cpu_model(), "loadavg": " ".join(f"{x:.1f}" for x in os.getloadavg())}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps({**meta, **summary}, indent=1) + "\n")
    plot(runs, args.out / "judge_vs_check.png")
    (args.out / "summary.md").write_text(to_markdown(summary, meta))
    print((args.out / "summary.md").read_text())


if __name__ == "__main__":
    main()
