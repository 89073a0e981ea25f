"""The sweep report's PNGs: held-out accuracy, per-agent gradient norms, spike rates (one colour per arm)."""
from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path
from typing import Sequence


def plot_sweep(out: Path, runs: Sequence) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    ok = [r for r in runs if r.status == "ok"]
    arms = list(dict.fromkeys(r.cell for r in ok))
    colors = {arm: f"C{i % 10}" for i, arm in enumerate(arms)}
    return [plot_accuracy(out, ok, arms, colors), plot_grad_norms(out, ok, arms, colors),
            plot_spike_rate(out, ok, arms, colors)]


def _band(series: Sequence[Sequence[tuple[int, float]]]) -> tuple[list[int], list[float], list[float], list[float]]:
    """Steps every seed has, with the median and the min-max over seeds at each."""
    common = set.intersection(*[{s for s, _ in points} for points in series]) if series else set()
    steps = sorted(common)
    values = [[dict(points)[s] for points in series] for s in steps]
    return steps, [statistics.median(v) for v in values], [min(v) for v in values], [max(v) for v in values]


def plot_accuracy(out: Path, runs, arms, colors) -> Path:
    """Held-out avg@n vs RL step (median line, min-max band over seeds) when runs evaluated in between;
    else after SFT and after RL, one dot per seed, joined per seed."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    curves = any(len(r.eval_curve) > 2 for r in runs)
    for i, arm in enumerate(arms):
        mine = [r for r in runs if r.cell == arm and (r.eval_curve or not curves)]  # a prior's run may have no curve
        if curves:
            if not mine:
                continue
            steps, med, lo, hi = _band([r.eval_curve for r in mine])
            ax.plot(steps, med, color=colors[arm], label=f"{arm} (n={len(mine)})")
            ax.fill_between(steps, lo, hi, color=colors[arm], alpha=0.2)
        else:
            for j, r in enumerate(mine):
                ys = [r.metrics.get(f"{r.avg_key}_sft"), r.metrics.get(f"{r.avg_key}_rl")]
                ax.plot([2 * i, 2 * i + 1], ys, "o-", color=colors[arm], alpha=0.7,
                        label=f"{arm} (n={len(mine)})" if j == 0 else None)
    if curves:
        ax.set_xlabel("RL step")
    else:
        ax.set_xticks([x for i in range(len(arms)) for x in (2 * i, 2 * i + 1)],
                      ["SFT", "RL"] * len(arms))
        ax.set_xlabel("each arm: after SFT -> after RL, one line per seed")
    ax.set_ylabel(f"held-out {'/'.join(sorted({r.avg_key for r in runs}))} (%)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return _save(fig, out / "heldout_accuracy.png")


def plot_grad_norms(out: Path, runs, arms, colors) -> Path:
    """Per-agent gradient norm vs step: median over seeds with a min-max band, log scale."""
    import matplotlib.pyplot as plt

    agents = sorted({a for r in runs for a in r.grad_norms})
    fig, axes = plt.subplots(len(agents) or 1, 1, figsize=(8, 2.8 * max(1, len(agents))), squeeze=False)
    for ax, agent in zip(axes[:, 0], agents):
        positive = False  # a log axis needs a value > 0 (every norm is 0 when no advantage was ever non-zero)
        for arm in arms:
            series = [r.grad_norms[agent] for r in runs if r.cell == arm and r.grad_norms.get(agent)]
            if not series:
                continue
            steps, med, lo, hi = _band(series)
            ax.plot(steps, med, color=colors[arm], label=f"{arm} (n={len(series)})", lw=1)
            ax.fill_between(steps, lo, hi, color=colors[arm], alpha=0.15)
            positive = positive or any(v > 0 for v in hi)
        if positive:
            ax.set_yscale("log")
        ax.set_title(f"{agent}: grad norm (median, min-max over seeds)", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[-1, 0].set_xlabel("RL step")
    return _save(fig, out / "grad_norms.png")


def plot_spike_rate(out: Path, runs, arms, colors) -> Path:
    """Gradient spikes per 100 RL steps, per agent and arm: mean bar, one dot per seed."""
    import matplotlib.pyplot as plt

    agents = sorted({a for r in runs for a in r.grad_norms})
    rates: dict[tuple[str, str], list[float]] = defaultdict(list)
    for r in runs:
        for agent in agents:
            spikes = r.metrics.get(f"spikes/{agent}")
            if spikes is not None and r.rl_steps:
                rates[(r.cell, agent)].append(100.0 * spikes / r.rl_steps)
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(1, len(arms))
    for i, arm in enumerate(arms):
        for j, agent in enumerate(agents):
            values = rates.get((arm, agent), [])
            x = j + (i - (len(arms) - 1) / 2) * width
            ax.bar(x, statistics.fmean(values) if values else 0.0, width, color=colors[arm],
                   label=arm if j == 0 else None, alpha=0.6)
            ax.plot([x] * len(values), values, "k.", ms=4)
    ax.set_xticks(range(len(agents)), agents)
    ax.set_ylabel("grad spikes per 100 RL steps")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, out / "spike_rate.png")


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
