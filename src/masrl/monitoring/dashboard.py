"""Per-role training dashboard: ``run_dir/metrics.jsonl`` -> ``run_dir/plots/dashboard.png``.

Each panel draws one line per role / policy / benchmark found in the metrics; panels without data
are left out. Reading is forgiving: unparsable lines (e.g. a half-written last line of a running
job), rows without a step, non-numeric and non-finite values are skipped.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from masrl.io.atomic import write_file_atomic

__all__ = ["PANELS", "Panel", "load_metrics", "plot_dashboard"]

Series = dict[str, list[tuple[float, float]]]  # metric name -> [(step, value)]


@dataclass(frozen=True)
class Panel:
    """A dashboard panel: the metric names it shows (``match`` returns a line label or None)."""

    title: str
    match: Callable[[str], str | None]
    log_y: bool = False


def _entity_metric(pattern: str, kinds: tuple[str, ...] = ("agent", "policy", "team")) -> Callable[[str], str | None]:
    """Match ``agent/<a>/<m>``, ``policy/<p>/<m>`` or ``team/<m>`` where ``<m>`` fullmatches ``pattern``."""
    metric_re = re.compile(pattern)

    def match(name: str) -> str | None:
        parts = name.split("/")
        if len(parts) == 3 and parts[0] in kinds and parts[0] != "team" and metric_re.fullmatch(parts[2]):
            return f"{parts[0]}/{parts[1]}" if not parts[2].endswith("p95") else f"{parts[0]}/{parts[1]} p95"
        if len(parts) == 2 and parts[0] == "team" and "team" in kinds and metric_re.fullmatch(parts[1]):
            return "team"
        return None

    return match


def _accuracy(name: str) -> str | None:
    if name == "team/accuracy":
        return "team (train)"
    m = re.fullmatch(r"eval/([^/]+)/(avg@\d+)", name)
    return f"eval/{m.group(1)} {m.group(2)}" if m else None


PANELS: tuple[Panel, ...] = (
    Panel("accuracy", _accuracy),
    Panel("reward", _entity_metric(r"(mean_)?reward(_mean)?")),
    Panel("grad norm (x = spike)", _entity_metric(r"grad_norm", ("agent", "policy")), log_y=True),
    # the reference KL is logged only with algorithm.loss.kl_coef > 0 or monitoring.kl_to_base; approx_kl always
    Panel("KL to reference", _entity_metric(r"kl(_ref|_k[0-9]+)?")),
    Panel("update size (approx_kl, rollout vs updated policy)", _entity_metric(r"approx_kl")),
    Panel("entropy", _entity_metric(r"entropy(_mean)?")),
    Panel("response length (tokens)", _entity_metric(r"(response_)?length(_mean|_p95)?")),
    Panel("unigram drift (chi2 vs step 0)", _entity_metric(r"chi2(_drift)?", ("agent", "policy")), log_y=True),
    Panel("perplexity", _entity_metric(r"perplexity", ("agent", "policy"))),
)


def load_metrics(path: str | os.PathLike) -> Series:
    """``{metric: [(step, value), ...]}`` from a metrics.jsonl, sorted by step, finite values only.

    A step logged twice (e.g. re-logged after a resume) keeps its last value.
    """
    by_step: dict[str, dict[float, float]] = {}
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except ValueError:
                continue  # truncated or corrupt line
            if not isinstance(row, dict):
                continue
            step = row.get("step")
            if isinstance(step, bool) or not isinstance(step, (int, float)) or not math.isfinite(step):
                continue
            for name, value in row.items():
                if name == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
                    continue
                if math.isfinite(value):
                    by_step.setdefault(name, {})[float(step)] = float(value)
    return {name: sorted(points.items()) for name, points in by_step.items()}


def _spike_steps(series: Series, label: str) -> list[float]:
    """Steps where ``<label>/grad_spike`` >= 0.5 (label = ``agent/<a>`` or ``policy/<p>``)."""
    return [s for s, v in series.get(f"{label}/grad_spike", []) if v >= 0.5]


def _write_atomic(fig, path: Path) -> None:
    write_file_atomic(path, lambda tmp: fig.savefig(tmp, format="png", dpi=100), suffix=".png")


def plot_dashboard(run_dir: str | os.PathLike, out_name: str = "dashboard.png") -> list[Path]:
    """Draw the per-role dashboard of ``run_dir`` into ``run_dir/plots/<out_name>``; return the written paths.

    Panels: accuracy (``team/accuracy``, ``eval/<bench>/avg@k``), reward, grad norm (spikes marked
    with x from ``.../grad_spike``), KL to the reference (when logged), update size (``approx_kl``), entropy, length (mean, p95 dashed), χ² drift, perplexity;
    one line per role / policy. Returns ``[]`` (and writes nothing) when there is nothing to plot.
    Raises ``FileNotFoundError`` when ``run_dir/metrics.jsonl`` is missing.
    """
    run_dir = Path(run_dir)
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        raise FileNotFoundError(f"no metrics.jsonl in {run_dir}")
    series = load_metrics(metrics_path)

    panels: list[tuple[Panel, dict[str, list[tuple[float, float]]]]] = []
    for panel in PANELS:
        lines: dict[str, list[tuple[float, float]]] = {}
        for name in sorted(series):
            label = panel.match(name)
            if label is not None and series[name]:
                lines[label] = series[name]
        if lines:
            panels.append((panel, lines))
    if not panels:
        return []

    import matplotlib
    from matplotlib.figure import Figure  # no pyplot: renders with Agg, whatever the global backend
    from matplotlib.transforms import blended_transform_factory

    ncols = 2 if len(panels) > 1 else 1
    nrows = math.ceil(len(panels) / ncols)
    fig = Figure(figsize=(6.5 * ncols, 3.4 * nrows))
    colors = matplotlib.rcParams["axes.prop_cycle"].by_key().get("color", ["C0"])
    entity_color: dict[str, str] = {}
    for i, (panel, lines) in enumerate(panels):
        ax = fig.add_subplot(nrows, ncols, i + 1)
        positive = True
        for label, points in lines.items():
            entity = label.removesuffix(" p95")
            color = entity_color.setdefault(entity, colors[len(entity_color) % len(colors)])
            steps = [s for s, _ in points]
            values = [v for _, v in points]
            positive = positive and all(v > 0 for v in values)
            dashed = label.endswith(" p95")
            ax.plot(steps, values, color=color, lw=1.0 if dashed else 1.4, ls="--" if dashed else "-",
                    marker="o" if len(points) == 1 else None, ms=3, label=label)
            if panel.title.startswith("grad norm"):
                spikes = set(_spike_steps(series, entity))
                at = dict(points)
                marks = [(s, at[s]) for s in sorted(spikes) if s in at]
                if marks:
                    ax.scatter([s for s, _ in marks], [v for _, v in marks], marker="x", s=40, color="red",
                               zorder=3, label=f"{entity} spike")
                unplotted = [s for s in sorted(spikes) if s not in at]  # e.g. a non-finite grad norm
                if unplotted:
                    ax.scatter(unplotted, [0.97] * len(unplotted), marker="x", s=40, color="red", zorder=3,
                               transform=blended_transform_factory(ax.transData, ax.transAxes),
                               label=None if marks else f"{entity} spike")
        if panel.log_y and positive:
            ax.set_yscale("log")
        ax.set_title(panel.title, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    fig.suptitle(f"masrl run: {run_dir.resolve().name}", fontsize=11)
    fig.tight_layout()
    out = run_dir / "plots" / out_name
    _write_atomic(fig, out)
    return [out]
