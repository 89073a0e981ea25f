"""E3, stability under stress: the math and search teams at 1x, 3x and 10x their shipped learning rate,
grpo vs drmas. Per (task, learning rate, estimator): runs, per-agent flagged spikes per run, max and median per-agent
gradient norm, non-finite and skipped steps, held-out avg@4 after SFT and after RL, and the runs that end below
their after-SFT accuracy; plus a plot of those against the learning rate.

    python benchmarks/study/stress.py runs/study/e3 runs/study/e1 runs/study/e2 [PNG] > stress.md

The 1x arms are E1's ``mapping=shared`` cells (math) and E2's ``estimator=grpo`` / ``estimator=drmas`` cells (search):
same seeds, same code, same spike detector. Every run found is counted (seeds not shared by all arms included)."""
import glob, json, math, os, re, statistics as st, sys
from pathlib import Path

from masrl.sweep.report import read_records, run_metrics

roots, png = [a for a in sys.argv[1:] if not a.endswith(".png")], next((a for a in sys.argv[1:] if a.endswith(".png")), None)
LR = {"1x": 1, "3x": 3, "10x": 10}


def arm(root: str, cell: str):
    """(task, lr multiplier, estimator) of a cell, or None for cells that are not an E3 arm."""
    kv = dict(p.split("=", 1) for p in cell.split("__"))
    est = kv.get("estimator")
    if est not in ("grpo", "drmas"):
        return None
    if "setting" in kv:  # E3: setting=math_lr3x
        task, lr = re.fullmatch(r"(math|search)_lr(\d+x)", kv["setting"]).groups()
        return task, LR[lr], est
    if kv.get("mapping") == "shared":  # E1 math, one shared policy
        return "math", 1, est
    if set(kv) == {"estimator"} and os.path.basename(root.rstrip("/")) == "e2":  # E2 search
        return "search", 1, est
    return None


runs = {}
for root in roots:
    for rep in sorted(glob.glob(f"{root}/*=*/seed*/report.json")):
        run = Path(rep).parent
        key = arm(root, run.parent.name)
        if key is None:
            continue
        m = run_metrics(run, json.load(open(rep)), read_records(run))
        m["seed"] = int(run.name[4:])
        runs.setdefault(key, []).append(m)


def mean(vals, f="{:.2f}"):
    vals = [v for v in vals if v is not None and math.isfinite(v)]
    return "–" if not vals else f.format(st.fmean(vals))


def per_seed(vals, f="{:.0f}"):
    return "/".join("–" if v is None else f.format(v) for v in vals)


agents = {"math": ["Solver", "Verifier"], "search": ["Verifier", "Search", "Answer"]}
print("# E3: stability under stress (learning rate 1x / 3x / 10x), grpo vs drmas\n")
print("Per arm, over its seeds (seed order in the per-seed columns). Spikes: RL steps whose per-agent gradient norm the "
      "monitor flagged (robust z-score > 6 over a 50-step window). Gradient norms: per agent, the max and the median "
      "over RL steps (steps with a gradient), mean over seeds. Below SFT: runs whose held-out avg@4 after RL is below "
      "their own after-SFT avg@4.\n")
for task in ("math", "search"):
    print(f"\n## {task}\n")
    head = ["lr", "estimator", "runs"] + [f"{a} spikes per seed" for a in agents[task]] + \
        [f"{a} grad norm max / median" for a in agents[task]] + ["non-finite / skipped steps", "avg@4 SFT → RL",
                                                                 "RL − SFT per seed", "below SFT"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for lr in (1, 3, 10):
        for est in ("grpo", "drmas"):
            rs = sorted(runs.get((task, lr, est), []), key=lambda m: m["seed"])
            if not rs:
                continue
            gain = [m.get("avg@4_gain") for m in rs]
            row = [f"{lr}x", est, str(len(rs))]
            row += [per_seed([m.get(f"spikes/{a}") for m in rs]) for a in agents[task]]
            row += [mean([m.get(f"grad_norm_max/{a}") for m in rs]) + " / " + mean([m.get(f"grad_norm_median/{a}") for m in rs])
                    for a in agents[task]]
            row += [f"{sum(m['nonfinite_steps'] for m in rs):.0f} / {sum(m['skipped_steps'] for m in rs):.0f}",
                    mean([m.get("avg@4_sft") for m in rs], "{:.1f}") + " → " + mean([m.get("avg@4_rl") for m in rs], "{:.1f}"),
                    per_seed(gain, "{:+.1f}"), f"{sum(1 for g in gain if g is not None and g < 0)} of {len(rs)}"]
            print("| " + " | ".join(row) + " |")

if png:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), constrained_layout=True)
    for col, task in enumerate(("math", "search")):
        for est, color in (("grpo", "tab:blue"), ("drmas", "tab:orange")):
            xs = [lr for lr in (1, 3, 10) if runs.get((task, lr, est))]
            for row, (key, label) in enumerate((("avg@4_gain", "held-out avg@4: RL − SFT (points)"),
                                                 (None, "max per-agent grad norm (max over agents)"))):
                ax = axes[row][col]
                means = []
                for lr in xs:
                    vals = [m.get(key) if key else max((m.get(f"grad_norm_max/{a}") or 0) for a in agents[task])
                            for m in runs[(task, lr, est)]]
                    vals = [v for v in vals if v is not None]
                    ax.scatter([lr * (0.93 if est == "grpo" else 1.07)] * len(vals), vals, color=color, alpha=0.45, s=18)
                    means.append(st.fmean(vals) if vals else float("nan"))
                ax.plot(xs, means, color=color, marker="o", label=est)
                ax.set_xscale("log")
                ax.set_xlim(0.8, 12.5)
                ax.set_xticks([1, 3, 10], ["1x", "3x", "10x"])
                ax.set_title(f"{task}: {label}", fontsize=9)
                if key:
                    ax.axhline(0, color="grey", lw=0.8)
                ax.legend(fontsize=8)
    fig.suptitle("E3: learning-rate stress (dots: seeds; line: mean)")
    fig.savefig(png, dpi=110)
    print(f"\n(plot: {png})")
