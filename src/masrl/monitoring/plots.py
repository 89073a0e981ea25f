"""Training curves (PNG) from metrics.jsonl: team reward/accuracy, per-agent reward, grad norms, eval."""
from __future__ import annotations

import math
from pathlib import Path

from masrl.monitoring.logger import read_metrics


def _series(records, key, phase="train"):
    xs, ys = [], []
    for r in records:
        if r.get("phase", "train") == phase and isinstance(r.get(key), (int, float)) and math.isfinite(r[key]):
            xs.append(r["step"])
            ys.append(r[key])
    return xs, ys


def plot_training_curves(run_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    keys = {k for r in records for k in r}
    agents = sorted({k.split("/")[1] for k in keys if k.startswith("agent/")})
    panels = [("team reward / accuracy", [("team/reward", "reward"), ("team/accuracy", "accuracy")], "train"),
              ("agent reward", [(f"agent/{a}/reward_mean", a) for a in agents], "train"),
              ("agent grad norm", [(f"agent/{a}/grad_norm", a) for a in agents], "train"),
              ("agent response length", [(f"agent/{a}/response_length", a) for a in agents], "train"),
              ("held-out team accuracy", [(k, k.split("/")[-1]) for k in sorted(keys)
                                          if k.startswith("eval/") and ("avg@" in k or "pass@" in k)], "eval")]
    panels = [p for p in panels if any(_series(records, k, p[2])[0] for k, _ in p[1])]
    if not panels:
        return []
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    for ax, (title, lines, phase) in zip(axes[0], panels):
        for key, label in lines:
            xs, ys = _series(records, key, phase)
            if xs:
                ax.plot(xs, ys, marker="o" if phase == "eval" else None, label=label, lw=1.4)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    out_dir = Path(run_dir) / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "training_curves.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


__all__ = ["plot_training_curves"]
