"""The judge section of a run's report (report.md, report.json ``judge``), for runs rewarded by a judge or a
reward model: what the judge did over the RL steps (calls, errors, unparsed replies, its share of the step
time), its length bias, and its score beside the rule-based check it never sees (``check:``), after SFT and
after RL and over the first and last RL steps. Built from the ``judge/*`` records of metrics.jsonl and the
held-out evaluations; empty for a run with a rule-based reward.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from masrl.evaluation.metrics import stage_name

WINDOW = 5  # RL steps averaged at the start and at the end of the run


def _mean(values: Sequence[Any]) -> float | None:
    ok = [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return sum(ok) / len(ok) if ok else None


def judge_summary(records: Sequence[Mapping[str, Any]], history: Mapping[str, Mapping[str, float]]) -> dict | None:
    """The judge's totals and comparisons of one run, or None when no RL step called a judge.

    ``records``: metrics.jsonl records (a step logged twice, after a resume, counts once: its last record);
    ``history``: the held-out evaluations by label (``sft``, ``final``), as ``Trainer.history``.
    """
    by_step: dict[int, Mapping[str, Any]] = {}
    for r in records:
        if r.get("phase") == "train" and "judge/calls" in r:
            by_step[int(r["step"])] = r
    if not by_step:
        return None
    steps = [by_step[s] for s in sorted(by_step)]

    def total(key: str) -> float:
        return float(sum(r.get(key) or 0.0 for r in steps))

    judge_s, step_s = total("perf/judge_seconds"), total("perf/step_seconds")
    window = min(WINDOW, max(len(steps) // 2, 1))
    keys = {"score": "judge/score", "heldout_check": "judge/heldout_check", "approve_rate": "judge/approve_rate",
            "heldout_agreement": "judge/heldout_agreement", "heldout_agreement_right": "judge/heldout_agreement_right",
            "heldout_agreement_wrong": "judge/heldout_agreement_wrong", "heldout_auc": "judge/heldout_auc",
            "length_corr": "judge/length_corr"}
    out: dict[str, Any] = {
        "steps": len(steps), "calls": total("judge/calls"), "errors": total("judge/errors"),
        "unparsed": total("judge/unparsed"), "judge_seconds": judge_s,
        "share_of_step_time": judge_s / step_s if step_s > 0 else None,
        "length_corr_mean": _mean([r.get("judge/length_corr") for r in steps]),
        "length_spearman_mean": _mean([r.get("judge/length_spearman") for r in steps]),
        "window": window,
        "first_steps": {name: _mean([r.get(k) for r in steps[:window]]) for name, k in keys.items()},
        "last_steps": {name: _mean([r.get(k) for r in steps[-window:]]) for name, k in keys.items()},
        "eval": {},
    }
    for label in ("sft", "final"):
        summary = history.get(label)
        if summary and "heldout_check" in summary:
            out["eval"][label] = {"judge_accuracy": summary.get("avg@n"), "judge_score": summary.get("judge_score"),
                                  "heldout_check": summary["heldout_check"],
                                  "approve_rate": summary.get("judge_approve_rate"),
                                  "heldout_agreement": summary.get("heldout_agreement"),
                                  "heldout_agreement_right": summary.get("heldout_agreement_right"),
                                  "heldout_agreement_wrong": summary.get("heldout_agreement_wrong"),
                                  "heldout_auc": summary.get("heldout_auc")}
    out["constant"] = constant_judge(out)
    return out


def constant_judge(summary: Mapping[str, Any]) -> str | None:
    """A plain warning when the judge approved everything or nothing (in a held-out evaluation, else over the last
    RL steps): its agreement with the check then only counts the answers on its one side; None otherwise."""
    seen = [(f"the {label} evaluation", e.get("approve_rate")) for label, e in summary["eval"].items()]
    seen.append((f"the last {summary['window']} RL steps", summary["last_steps"].get("approve_rate")))
    for where, rate in seen:
        if rate in (0.0, 1.0):
            verb = "approved every answer" if rate else "approved no answer"
            return (f"Warning: the judge {verb} in {where}: it is constant, so it gives the team no signal to learn "
                    f"from, and its agreement with the check is just the share of {'right' if rate else 'wrong'} "
                    "answers. Check its prompt, verdict format and max_new_tokens, or use a better judge "
                    "(docs/judges.md).")
    return None


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{100 * v:.1f}%"


def _num(v: float | None, digits: int = 3) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def judge_report_lines(summary: Mapping[str, Any] | None, sft_steps: int) -> list[str]:
    """The markdown of ``judge_summary`` (no lines for None)."""
    if not summary:
        return []
    share = summary["share_of_step_time"]
    lines = ["", "## Judge", "", *([f"**{summary['constant']}**", ""] if summary.get("constant") else []),
             "| RL steps | judge calls | errors | unparsed | judge time | share of step time | length corr (Pearson / Spearman, mean over steps) |",
             "|---|---|---|---|---|---|---|",
             f"| {summary['steps']} | {summary['calls']:.0f} | {summary['errors']:.0f} | {summary['unparsed']:.0f} | "
             f"{summary['judge_seconds']:.1f} s | {_pct(share)} | {_num(summary['length_corr_mean'])} / "
             f"{_num(summary['length_spearman_mean'])} |"]
    if summary["eval"]:
        lines += ["", "Held-out evaluation: the judge's accuracy (avg@n) and mean score beside the rule-based check it "
                  "never sees; approves: the judge's share of approvals; agrees on right / on wrong: its approvals "
                  "among the answers the check passes, its rejections among those it fails; AUC: how well the "
                  "judge's score ranks the answers the check passes above the others.", "",
                  "| stage | judge accuracy | judge score | held-out check | approves | agrees | agrees on right | "
                  "agrees on wrong | AUC vs check |", "|---|---|---|---|---|---|---|---|---|"]
        for label, e in summary["eval"].items():
            lines.append(f"| {stage_name(label, sft_steps)} | {_pct(e['judge_accuracy'])} | {_num(e.get('judge_score'))} | "
                         f"{_pct(e['heldout_check'])} | {_pct(e.get('approve_rate'))} | {_pct(e['heldout_agreement'])} | "
                         f"{_pct(e.get('heldout_agreement_right'))} | {_pct(e.get('heldout_agreement_wrong'))} | "
                         f"{_num(e.get('heldout_auc'))} |")
    w = summary["window"]
    lines += ["", f"Training samples, mean over the first and the last {w} RL steps.", "",
              "| RL steps | judge score | held-out check | approves | agrees | agrees on right | agrees on wrong | "
              "AUC vs check | length corr |", "|---|---|---|---|---|---|---|---|---|"]
    for name, where in ((f"first {w}", "first_steps"), (f"last {w}", "last_steps")):
        s = summary[where]
        lines.append(f"| {name} | {_num(s['score'])} | {_pct(s['heldout_check'])} | {_pct(s.get('approve_rate'))} | "
                     f"{_pct(s['heldout_agreement'])} | {_pct(s.get('heldout_agreement_right'))} | "
                     f"{_pct(s.get('heldout_agreement_wrong'))} | {_num(s.get('heldout_auc'))} | "
                     f"{_num(s['length_corr'])} |")
    return lines
