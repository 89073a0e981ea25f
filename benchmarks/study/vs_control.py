"""Every arm of a team sweep against a control sweep's arm (the single-agent RL run of the same size), paired
on seeds: held-out avg@n after SFT, after RL and the RL gain, control − team, mean ± 95% t-interval, and how
many seeds favour each side. Reads the summaries ``masrl sweep report`` wrote (``summary.json``).

    masrl sweep report runs/study/e5_smollm2 && masrl sweep report runs/study/e5_smollm2_controls
    python benchmarks/study/vs_control.py runs/study/e5_smollm2 runs/study/e5_smollm2_controls \
        > benchmarks/study/e5_smollm2_controls/vs_team.md
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from masrl.sweep.stats import mean_ci, paired


def _metric(summary: dict, suffix: str) -> str:
    names = [n for n in summary["metrics"] if n.startswith("avg@") and n.endswith(suffix)]
    if len(names) != 1:
        raise SystemExit(f"expected one avg@N{suffix} metric in the summary, found {names or 'none'}")
    return names[0]


def _values(summary: dict, name: str, arm: str) -> dict[int, float]:
    return {int(s): v for s, v in summary["metrics"][name]["arms"][arm]["values"].items() if v is not None}


def _fmt(stat: dict, sign: str = "+") -> str:
    """mean ± half-width of the 95% t-interval; with one value, no interval (not ± 0)."""
    hw = stat.get("half_width")
    return f"{stat['mean']:{sign}.1f} ± {hw:.1f}" if hw is not None else f"{stat['mean']:{sign}.1f} (no interval)"


def table(team: dict, control: dict, control_arm: str | None = None) -> str:
    arms = list(control["metrics"][_metric(control, "_rl")]["arms"])
    arm = control_arm or arms[0]
    if arm not in arms:
        raise SystemExit(f"control arm {arm!r} is not in the control sweep (arms: {', '.join(arms)})")
    lines = [f"Control: `{arm}` of sweep `{control.get('name', '?')}`; teams: sweep `{team.get('name', '?')}`. "
             "Held-out avg@N in %; control − team paired on seeds, mean ± 95% t-interval; seeds: control ahead / "
             "team ahead / tied.", "",
             "| team arm | stage | team (mean ± 95% t) | control | control − team | seeds |", "|---|---|---|---|---|---|"]
    for suffix, stage in (("_sft", "after SFT"), ("_rl", "after RL"), ("_gain", "RL gain")):
        t_name, c_name = _metric(team, suffix), _metric(control, suffix)
        c = _values(control, c_name, arm)
        for team_arm in team["metrics"][t_name]["arms"]:
            t = _values(team, t_name, team_arm)
            p = paired(c, t)
            tc, cc = mean_ci(list(t.values())).as_dict(), mean_ci(list(c.values())).as_dict()
            lines.append(f"| {team_arm} | {stage} | {_fmt(tc, '')} (n = {len(t)}) | {_fmt(cc, '')} (n = {len(c)}) | "
                         f"{_fmt(p.as_dict()['diff'])} (n = {len(p.seeds)}) | {p.arm_higher} / {p.baseline_higher} / "
                         f"{p.ties} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("team", type=Path, help="the team sweep's folder (summary.json from masrl sweep report)")
    ap.add_argument("control", type=Path, help="the control sweep's folder")
    ap.add_argument("--control-arm", help="the control sweep's arm (default: its only or first arm)")
    a = ap.parse_args(argv)
    summaries = []
    for folder in (a.team, a.control):
        path = folder / "summary.json"
        if not path.is_file():
            raise SystemExit(f"{path}: no summary; run `masrl sweep report {folder}` first")
        summaries.append(json.loads(path.read_text()))
    sys.stdout.write(table(*summaries, a.control_arm))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
