"""The collapse detector on E3's math team: when it fires against when the held-out accuracy shows the drop,
and how often it fires on runs that do not collapse.

    python benchmarks/study/collapse_eval.py runs/study/e3_collapse [runs/study/e3_collapse_holdout ...]
        [--out benchmarks/study/e3_collapse_detector]

For every run (``<sweep>/<cell>/seed<k>/metrics.jsonl``) the detector (masrl.monitoring.collapse, its defaults)
is replayed over the train records — the calls the trainer makes; a run trained with the monitor on logs
``collapse/<signal>`` at the same steps, which is checked where present. The *accuracy drop* is the first held-out
evaluation whose avg@n is below half of the evaluation before RL; *lead* is (that evaluation's step) minus
(the step the detector first fires): positive means the alarm came before the evaluation showed the drop.
A *false alarm* is an event in a run whose accuracy never drops. Writes ``<out>.json`` and ``<out>.md``.
"""
from __future__ import annotations

import argparse
import json
import sys
from datetime import date
from pathlib import Path

from masrl.monitoring.collapse import replay
from masrl.versions import git_sha

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _benchutil import cpu_model  # noqa: E402


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _agents(rows: list[dict]) -> list[str]:
    return sorted({k.split("/")[1] for r in rows for k in r if k.startswith("agent/") and k.endswith("/entropy")})


def evaluate_run(metrics: Path) -> dict:
    rows = _rows(metrics)
    train = [r for r in rows if r.get("phase") == "train"]
    evals = [(r["step"], r["eval/test/avg@n"]) for r in rows if r.get("phase") == "eval" and "eval/test/avg@n" in r]
    events = replay(train, _agents(rows))
    logged = sorted({(k[len("collapse/"):], r["step"]) for r in train for k, v in r.items()
                     if k.startswith("collapse/") and v == 1.0})
    start = evals[0][1] if evals else None
    drop = next((s for s, v in evals[1:] if start is not None and v < 0.5 * start), None)
    first = min((e.step for e in events), default=None)
    reward = min((e.step for e in events if e.signal == "team/reward"), default=None)
    drift = min((e.step for e in events if e.signal != "team/reward"), default=None)
    return {"run": str(metrics.parent), "steps": len(train), "eval": evals, "drop_eval_step": drop,
            "first_event": first, "first_reward_event": reward, "first_drift_event": drift,
            "lead": (drop - first) if drop is not None and first is not None else None,
            "events": [[e.signal, e.first_breach, e.step] for e in events],
            "logged_by_trainer": [list(x) for x in logged] or None,
            "replay_matches_trainer": (sorted((e.signal, e.step) for e in events) == logged) if logged else None}


def summarize(results: list[dict]) -> dict:
    collapsed = [r for r in results if r["drop_eval_step"] is not None]
    stable = [r for r in results if r["drop_eval_step"] is None]
    return {"runs": len(results), "collapsed": len(collapsed),
            "detected": sum(r["first_event"] is not None for r in collapsed),
            "leads": [r["lead"] for r in collapsed],
            "stable": len(stable), "stable_runs_with_alarms": sum(bool(r["events"]) for r in stable),
            "false_alarm_events": sum(len(r["events"]) for r in stable),
            "stable_steps": sum(r["steps"] for r in stable)}


def write(results: list[dict], out: Path, sweeps: list[str]) -> None:
    summary = summarize(results)
    meta = {"command": "python benchmarks/study/collapse_eval.py " + " ".join(sweeps),
            "commit": (git_sha() or "unknown")[:7], "date": date.today().isoformat(), "cpu": cpu_model()}
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "summary": summary, "runs": results}, indent=1))
    lines = [f"# Collapse detector on E3 ({', '.join(sweeps)})", "",
             f"`{meta['command']}` — masrl {meta['commit']}, {meta['date']}, {meta['cpu']}", "",
             f"{summary['collapsed']} of {summary['runs']} runs drop (held-out avg@n below half of before RL); "
             f"the detector fires in {summary['detected']} of them; lead (eval step of the drop minus first alarm): "
             f"{summary['leads']}. Runs without a drop: {summary['stable']}, {summary['stable_runs_with_alarms']} "
             f"with an alarm ({summary['false_alarm_events']} events in {summary['stable_steps']} steps).", "",
             "| run | held-out avg@n by step | drop at eval | first alarm (reward / drift) | lead | events |",
             "|---|---|---|---|---|---|"]
    for r in results:
        curve = " ".join(f"{s}:{100 * v:.0f}" for s, v in r["eval"])
        events = "; ".join(f"{s} {a}-{b}" for s, a, b in r["events"][:4]) + (" ..." if len(r["events"]) > 4 else "")
        lines.append(f"| {Path(r['run']).parent.name}/{Path(r['run']).name} | {curve} | {r['drop_eval_step']} | "
                     f"{r['first_event']} ({r['first_reward_event']} / {r['first_drift_event']}) | {r['lead']} | "
                     f"{events or '-'} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("sweeps", nargs="+", help="sweep output folders (runs/study/e3_collapse ...)")
    p.add_argument("--out", default="benchmarks/study/e3_collapse_detector", help="output path without suffix")
    args = p.parse_args(argv)
    results = [evaluate_run(m) for sweep in args.sweeps for m in sorted(Path(sweep).glob("*/seed*/metrics.jsonl"))]
    if not results:
        p.error(f"no <cell>/seed<k>/metrics.jsonl under {args.sweeps}")
    write(results, Path(args.out), args.sweeps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
