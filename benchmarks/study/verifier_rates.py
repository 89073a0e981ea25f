"""How often a Verifier approves correct and wrong answers, after SFT and after RL, per run of a sweep.

Reads each run's held-out evaluations (metrics.jsonl, phase "eval"): the first one (after SFT, before RL)
and the last one (after RL). Runs that log ``approve_rate_wrong`` are read directly; older runs log only
``verdict_accuracy``, ``approve_precision`` and ``approve_recall`` of the Verifier's judged turns, from which
the four cells of the confusion table follow exactly (shares of judged turns, c = share of correct answers):
    TP = recall * c,  FP = TP * (1/precision - 1),  TN = accuracy - TP,  FN = c - TP,
    with FP + TN = 1 - c, so  c = (1 - accuracy) / (recall/precision - 2*recall + 1).
A Verifier that approves wrong answers as often as correct ones has learnt nothing from its verdict.

    python benchmarks/study/verifier_rates.py runs/study/e1bc_smollm2 [--agent Verifier] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def rates(row: dict, agent: str, bench: str = "test") -> dict | None:
    """approve rate on correct / on wrong answers and the share of correct judged answers, or None."""
    key = f"eval/{bench}/agent/{agent}/"
    acc = row.get(key + "verdict_accuracy")
    if acc is None:
        return None
    recall, precision = row.get(key + "approve_recall"), row.get(key + "approve_precision")
    if key + "approve_rate_wrong" in row:
        return {"approve_correct": recall, "approve_wrong": row[key + "approve_rate_wrong"],
                "verdict_accuracy": acc}
    if precision is None:  # no approvals at all
        return {"approve_correct": 0.0 if recall is not None else None, "approve_wrong": 0.0, "verdict_accuracy": acc}
    if recall is None:  # no correct answer judged
        return {"approve_correct": None, "approve_wrong": 1.0 - acc, "verdict_accuracy": acc}
    if recall == 0:  # no true positive: precision is 0 and every approval is of a wrong answer
        return None
    c = (1 - acc) / (recall / precision - 2 * recall + 1)
    tp = recall * c
    fp, tn = tp * (1 / precision - 1), acc - tp
    wrong = fp + tn
    return {"approve_correct": recall, "approve_wrong": fp / wrong if wrong > 1e-12 else None,
            "verdict_accuracy": acc, "correct_share": c}


def run_rates(run: Path, agent: str) -> dict | None:
    evals = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row.get("phase") == "eval":
            evals.append(row)
    if len(evals) < 2 or not (run / "report.json").exists():
        return None
    first, last = rates(evals[0], agent), rates(evals[-1], agent)
    return {"after_sft": first, "after_rl": last, "avg_sft": evals[0].get("eval/test/avg@n"),
            "avg_rl": evals[-1].get("eval/test/avg@n")}


def fmt(x) -> str:
    return "—" if x is None else f"{100 * x:.1f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("sweep", type=Path)
    ap.add_argument("--agent", default="Verifier")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    rows = {}
    for metrics in sorted(args.sweep.glob("*/seed*/metrics.jsonl")):
        run = metrics.parent
        got = run_rates(run, args.agent)
        if got is not None:
            rows[f"{run.parent.name}/{run.name}"] = got
    if not rows:
        print(f"no finished run with {args.agent} verdicts under {args.sweep}", file=sys.stderr)
        return 1
    print(f"| run | avg@4 after SFT | after RL | {args.agent} approves correct: SFT → RL | approves wrong: SFT → RL "
          "| verdict accuracy: SFT → RL |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        s, l = r["after_sft"] or {}, r["after_rl"] or {}
        print(f"| {name} | {fmt(r['avg_sft'])} | {fmt(r['avg_rl'])} | {fmt(s.get('approve_correct'))} → "
              f"{fmt(l.get('approve_correct'))} | {fmt(s.get('approve_wrong'))} → {fmt(l.get('approve_wrong'))} | "
              f"{fmt(s.get('verdict_accuracy'))} → {fmt(l.get('verdict_accuracy'))} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
