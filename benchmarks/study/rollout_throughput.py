"""Rollout throughput per arm of a sweep: the median over RL steps of ``perf/rollout_tokens_per_s`` (tokens
generated in the step's rollout / its wall seconds, program and HTTP time included) of every run, and each arm's
ratio to the baseline arm, paired by seed.

    python3 benchmarks/study/rollout_throughput.py runs/study/gateway_vs_builtin --baseline team=builtin
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

FIELD = "perf/rollout_tokens_per_s"


def run_medians(root: Path) -> dict[str, dict[str, float]]:
    """``{arm: {seed folder: median of FIELD over the run's RL steps}}``."""
    out: dict[str, dict[str, float]] = {}
    for metrics in sorted(root.glob("*/seed*/metrics.jsonl")):
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        values = [r[FIELD] for r in rows if r.get("phase") == "train" and FIELD in r]
        if values:
            out.setdefault(metrics.parent.parent.name, {})[metrics.parent.name] = statistics.median(values)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("root", type=Path, help="the sweep's output folder")
    p.add_argument("--baseline", required=True, help="the baseline arm's folder name, e.g. team=builtin")
    args = p.parse_args(argv)
    medians = run_medians(args.root)
    if args.baseline not in medians:
        raise SystemExit(f"no arm {args.baseline!r} with finished steps under {args.root}; arms: {sorted(medians)}")
    base = medians[args.baseline]
    print(f"median {FIELD} over RL steps, per run")
    print("| arm | by seed | mean | ratio to baseline, paired by seed |")
    print("|---|---|---|---|")
    for arm, seeds in medians.items():
        ratios = [seeds[s] / base[s] for s in seeds if s in base]
        ratio = (f"{statistics.mean(ratios):.3f} (seeds: {', '.join(f'{r:.3f}' for r in ratios)})"
                 if arm != args.baseline and ratios else "")
        print(f"| {arm} | {', '.join(f'{s}: {v:.0f}' for s, v in seeds.items())} | "
              f"{statistics.mean(seeds.values()):.0f} | {ratio} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
