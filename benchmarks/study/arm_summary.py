"""Per arm of a sweep, mean ± sd over seeds: held-out avg@n after SFT (the evaluation before RL) and after RL (the
last evaluation), and rollout throughput, the median over RL steps of ``perf/rollout_tokens_per_s`` (tokens
generated in the step's rollout / its wall seconds, program and HTTP time included), with each arm's throughput
ratio to the baseline arm paired by seed.

    python3 benchmarks/study/arm_summary.py runs/study/gateway_vs_builtin --baseline team=builtin
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

FIELD = "perf/rollout_tokens_per_s"
ACCURACY = "eval/test/avg@n"


def run_figures(metrics: Path) -> dict[str, float]:
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    evals = [r[ACCURACY] for r in rows if r.get("phase") == "eval" and ACCURACY in r]
    speeds = [r[FIELD] for r in rows if r.get("phase") == "train" and FIELD in r]
    out = {}
    if len(evals) >= 2:
        out["sft"], out["rl"] = 100 * evals[0], 100 * evals[-1]
    if speeds:
        out["tps"] = statistics.median(speeds)
    return out


def _ms(values: list[float], digits: int = 1) -> str:
    if not values:
        return "-"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.{digits}f} ± {sd:.{digits}f} ({', '.join(f'{v:.{digits}f}' for v in values)})"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("root", type=Path, help="the sweep's output folder")
    p.add_argument("--baseline", required=True, help="the baseline arm's folder name, e.g. team=builtin")
    args = p.parse_args(argv)
    arms: dict[str, dict[str, dict[str, float]]] = {}
    for metrics in sorted(args.root.glob("*/seed*/metrics.jsonl")):
        figures = run_figures(metrics)
        if "rl" in figures and "tps" in figures:  # a finished run
            arms.setdefault(metrics.parent.parent.name, {})[metrics.parent.name] = figures
    if args.baseline not in arms:
        raise SystemExit(f"no finished run of arm {args.baseline!r} under {args.root}; arms: {sorted(arms)}")
    base = arms[args.baseline]
    print(f"{args.root}: mean ± sd over seeds (per seed); accuracy {ACCURACY} in %, throughput: median {FIELD} "
          "over RL steps")
    print("| arm | seeds | held-out avg@n after SFT | after RL | rollout tokens/s | throughput / baseline (paired) |")
    print("|---|---|---|---|---|---|")
    for arm, seeds in arms.items():
        ratios = [seeds[s]["tps"] / base[s]["tps"] for s in seeds if s in base]
        ratio = _ms(ratios, 2) if arm != args.baseline else ""
        print(f"| {arm} | {', '.join(seeds)} | {_ms([v['sft'] for v in seeds.values()])} | "
              f"{_ms([v['rl'] for v in seeds.values()])} | {_ms([v['tps'] for v in seeds.values()], 0)} | {ratio} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
