"""What rollouts ahead of the update (``rollout.max_staleness``) can buy, from a run's measured step breakdown.

A model, not a measurement: it reads the RL steps of runs' ``metrics.jsonl`` (``perf/rollout_seconds`` R,
``perf/update_seconds`` U, ``perf/step_seconds`` T; the first RL step is left out as warm-up) and states, for an
on-policy run (``max_staleness: 0``):

* **own devices** (rollouts on devices the update does not use: a second core here, an inference pool beside the
  trainers on a cluster): a step takes ``max(R, U) + O`` with O = T - R - U (scoring, advantages, logging), so
  the bound on the speed-up is ``T / (max(R, U) + O)``, at most 2, reached when R = U;
* **a fixed pool split** between rollout and update (G devices, g of them generating, both sides scaling
  linearly): ``max(R G / g, U G / (G - g))`` is smallest at g / G = R / (R + U), where it equals R + U: no gain.
  What overlap buys on a fixed cluster then comes from what the linear model leaves out: decoding that scales
  worse than linearly with devices (it is bound by memory bandwidth per device) and the tail of long episodes
  (a synchronous batch waits for its longest episode; partial rollouts fill that wait);
* **shared devices** (both sides on the same saturated devices: this 2-core machine when each side wants both
  cores, a colocated GPU): T stays R + U + O; the overlap only fills what either side leaves idle.

For runs with ``max_staleness >= 1`` it prints the measured T, the time a step still waited for its batch (R:
what the overlap did not hide) and the update U beside the on-policy arm's prediction. Usage::

    python benchmarks/overlap_model.py runs/study/e7b            # every run below, grouped by cell
    python benchmarks/overlap_model.py RUN_DIR [RUN_DIR ...] --json out.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def step_breakdown(run_dir: Path) -> dict[str, float]:
    """Medians over the RL steps after the first: R, U, T, O and the staleness histogram's mean age."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in rows if r.get("phase") == "train" and "perf/step_seconds" in r]
    if len(train) < 2:
        raise ValueError(f"{run_dir}: fewer than 2 RL steps with perf/step_seconds in metrics.jsonl")
    train = train[1:]
    med = {key: statistics.median(r[f"perf/{key}_seconds"] for r in train) for key in ("rollout", "update", "step")}
    ages = [sum(int(k.rsplit("_", 1)[1]) * v for k, v in r.items()
                if k.startswith("rollout/staleness_") and k.rsplit("_", 1)[1].isdigit()) for r in train]
    return {"R": med["rollout"], "U": med["update"], "T": med["step"],
            "O": max(med["step"] - med["rollout"] - med["update"], 0.0),
            "mean_age": statistics.mean(ages) if ages else 0.0, "steps": len(train),
            "max_staleness": _max_staleness(run_dir)}


def _max_staleness(run_dir: Path) -> int:
    cfg = run_dir / "config.yaml"
    if cfg.exists():
        import yaml

        return int(((yaml.safe_load(cfg.read_text()) or {}).get("rollout") or {}).get("max_staleness", 0) or 0)
    return 0


def predict(b: dict[str, float]) -> dict[str, float]:
    """The model's step times for an on-policy breakdown ``b``."""
    own = max(b["R"], b["U"]) + b["O"]
    return {"own_devices_T": own, "own_devices_speedup": b["T"] / own if own else float("nan"),
            "fixed_split_T": b["R"] + b["U"] + b["O"], "shared_devices_T": b["R"] + b["U"] + b["O"],
            "rollout_share": b["R"] / (b["R"] + b["U"]) if b["R"] + b["U"] else float("nan")}


def runs_under(paths: list[Path]) -> list[tuple[Path, bool]]:
    """(run folder, named on the command line); a folder named that is not a run is searched for runs."""
    found = []
    for p in paths:
        if (p / "metrics.jsonl").exists():
            found.append((p, True))
        else:
            found.extend((m.parent, False) for m in sorted(p.rglob("metrics.jsonl")))
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", type=Path, help="run folders or a sweep's output folder")
    ap.add_argument("--json", type=Path, help="write the per-run breakdowns and predictions here")
    args = ap.parse_args(argv)
    runs = runs_under(args.paths)
    if not runs:
        print(f"no metrics.jsonl under {', '.join(map(str, args.paths))}", file=sys.stderr)
        return 2
    out = []
    print("| run | k | R s | U s | O s | T s measured | rollout share | T s predicted, own devices | bound |")
    print("|---|---|---|---|---|---|---|---|---|")
    for run, named in runs:
        try:
            b = step_breakdown(run)
        except ValueError as e:  # a folder found by the search that holds no RL steps (yet): say so, go on
            if named:
                raise
            print(f"skipped: {e}", file=sys.stderr)
            continue
        p = predict(b) if b["max_staleness"] == 0 else {}
        out.append({"run": str(run), **b, **p})
        name = f"{run.parent.name}/{run.name}" if run.parent.name else run.name
        pred = (f"{p['rollout_share']:.2f} | {p['own_devices_T']:.2f} | {p['own_devices_speedup']:.2f}x" if p
                else f"(waited {b['R']:.2f} s; mean age {b['mean_age']:.2f}) | | ")
        print(f"| {name} | {b['max_staleness']} | {b['R']:.2f} | {b['U']:.2f} | {b['O']:.2f} | {b['T']:.2f} | {pred} |")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
