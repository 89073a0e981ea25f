"""Side-by-side selector comparison and report writers (markdown, JSON, accuracy-vs-cost PNG)."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from masrl.ensemble.combiners import get_combiner
from masrl.ensemble.data import EnsembleData, Split
from masrl.ensemble.selectors import SELECTORS, SelectionSummary, run_selector
from masrl.io.atomic import write_text_atomic

__all__ = ["compare_selectors", "default_methods", "selection_table", "baseline_table", "rlfocal_table",
           "plot_accuracy_vs_cost", "write_json", "short_model", "pct", "pm"]


def short_model(name: str) -> str:
    return name.split("/")[-1]


def pct(x: float | None, nd: int = 2) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.{nd}f}"


def pm(stat: dict | None, nd: int = 2) -> str:
    if not stat or stat.get("mean") is None:
        return "n/a"
    return f"{100 * stat['mean']:.{nd}f} ± {100 * stat['std']:.{nd}f}"


def default_methods(data: EnsembleData) -> list[str]:
    """Every selector that can run on ``data`` (no plurality proxy without answers)."""
    out = []
    for m in SELECTORS:
        if m == "proxy-plurality" and not data.has_answers:
            continue
        if m == "proxy-majority" and data.has_answers:
            continue
        out.append(m)
    return out


def compare_selectors(data: EnsembleData, split: Split, methods: Sequence[str] | None = None,
                      ks: Sequence[int] = (2, 3, 4), combiner: str = "auto", scope: str = "per-task",
                      fitness_weights: Sequence[float] = (0.5, 0.5, 0.0)) -> list[SelectionSummary]:
    methods = list(methods) if methods else default_methods(data)
    out = []
    for m in methods:
        for k in ks:
            if k > data.n_models:
                continue
            out.append(run_selector(data, split, m, k, combiner, scope=scope, fitness_weights=fitness_weights))
    return out


def _subset_label(s: SelectionSummary) -> str:
    members, count = s.most_common_subset()
    label = "+".join(short_model(m) for m in members)
    n_tasks = len(s.subsets)
    return label if n_tasks == 1 else f"{label} ({count}/{n_tasks} tasks)"


def selection_table(summaries: Sequence[SelectionSummary], multi_task: bool = True) -> tuple[list[str], list[list[str]]]:
    """Header and rows (strings) for a selector table."""
    if multi_task:
        head = ["method", "k", "sel. acc (pooled)", "test macro", "test pooled", "cost (calls)", "U evals",
                "most common subset"]
    else:
        head = ["method", "k", "sel. acc", "test acc", "cost (calls)", "U evals", "subset"]
    rows = []
    for s in summaries:
        r = [s.method, str(s.k), pct(s.selection_pooled)]
        r += [pct(s.test_macro), pct(s.test_pooled)] if multi_task else [pct(s.test_pooled)]
        r += [f"{s.cost_calls:,}", str(s.evaluations), _subset_label(s)]
        rows.append(r)
    return head, rows


def baseline_table(base: dict[str, dict[str, Any]], multi_task: bool = True) -> tuple[list[str], list[list[str]]]:
    head = ["reference point", "test macro", "test pooled"] if multi_task else ["reference point", "test acc"]
    rows = []
    for name, v in base.items():
        rows.append([name, pct(v["macro"]), pct(v["pooled"])] if multi_task else [name, pct(v["pooled"])])
    return head, rows


def rlfocal_table(results: dict[str, Any], multi_task: bool = True,
                  fusion_only: Sequence[str] = ()) -> tuple[list[str], list[list[str]]]:
    """``results``: label -> RLFocalResult.to_dict(); labels in ``fusion_only`` show only their Fusion row."""
    head = ["variant", "combiner", "test macro", "test pooled", "mean size", "seeds", "seconds"]
    rows = []
    for label, r in results.items():
        s = r["summary"]
        for key, comb in (("decider", r["combiner"]), ("fusion", "fusion MLP")):
            if s.get(f"{key}_pooled", {}).get("mean") is None:
                continue
            name = f"{label}: Decider + {comb}" if key == "decider" else f"{label}: Decider + Fusion"
            if not r["config"].get("decider", True):
                name = f"{label}: Fusion (all models, no Decider)"
                if key == "decider":
                    continue
            if key == "decider" and label in fusion_only:
                continue
            rows.append([name, comb, pm(s[f"{key}_macro"]), pm(s[f"{key}_pooled"]),
                         f"{s['mean_size']['mean']:.2f}", str(len(r["seeds"])), f"{r['seconds']:.0f}"])
    if not multi_task:
        head = [h for h in head if h != "test macro"]
        rows = [[c for i, c in enumerate(row) if i != 2] for row in rows]
    return head, rows


def markdown_table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def print_table(title: str, head: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Console table (rich if available)."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # pragma: no cover
        print(title)
        print(markdown_table(head, rows))
        return
    t = Table(title=title, show_lines=False)
    for h in head:
        t.add_column(h, overflow="fold")
    for r in rows:
        t.add_row(*r)
    Console(width=200).print(t)


def plot_accuracy_vs_cost(summaries: Sequence[SelectionSummary], path: str | Path, title: str,
                          base: dict[str, dict[str, Any]] | None = None, metric: str = "test_pooled",
                          extra_points: dict[str, float] | None = None) -> Path:
    """Test accuracy vs selection cost (summarizer calls, log x; free selectors at the left, jittered).

    Reference points are horizontal lines; the pool oracle is given in the title (it would squash
    the axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9.5, 5.5), dpi=100)
    methods = list(dict.fromkeys(s.method for s in summaries))
    cmap = plt.get_cmap("tab20")
    markers = {1: "v", 2: "o", 3: "s", 4: "^", 5: "D"}
    positive = [s.cost_calls for s in summaries if s.cost_calls > 0]
    x_free = 10 ** (math.floor(math.log10(min(positive))) - 1) if positive else 1.0
    free_methods = [m for m in methods if all(s.cost_calls == 0 for s in summaries if s.method == m)]
    for mi, m in enumerate(methods):
        first = True
        for s in summaries:
            if s.method != m:
                continue
            if s.cost_calls > 0:
                x = s.cost_calls
            else:  # spread the free selectors around x_free so they do not hide each other
                j = free_methods.index(m) if m in free_methods else 0
                x = x_free * 10 ** (0.5 * (j - (len(free_methods) - 1) / 2) / max(1, len(free_methods)))
            ax.scatter(x, 100 * getattr(s, metric), color=cmap(mi % 20), marker=markers.get(s.k, "x"), s=50,
                       edgecolor="black", linewidth=0.4, label=m if first else None, zorder=3)
            first = False
    key = "pooled" if metric.endswith("pooled") else "macro"
    styles = ["--", ":", "-.", (0, (1, 1)), (0, (5, 2)), (0, (3, 1, 1, 1))]
    oracle = None
    i = 0
    for name, v in (base or {}).items():
        if v.get(key) is None:
            continue
        if name.startswith("oracle"):
            oracle = v[key]
            continue
        ax.axhline(100 * v[key], color="gray", linestyle=styles[i % len(styles)], linewidth=1, label=name)
        i += 1
    for i, (name, v) in enumerate((extra_points or {}).items()):
        ax.axhline(100 * v, color=("tab:red", "tab:purple", "tab:green")[i % 3], linestyle="-", linewidth=1.3,
                   label=name)
    ax.set_xscale("log")
    ticks = [t for t in ax.get_xticks() if t > x_free * 3]
    ax.set_xticks([x_free] + ticks)
    ax.set_xticklabels(["free"] + [f"{int(t):,}" if t >= 1 else f"{t:g}" for t in ticks])
    lo = min(x_free / 3, min(positive) / 3) if positive else x_free / 3
    ax.set_xlim(lo, (max(positive) * 3) if positive else x_free * 10)
    ax.set_xlabel("selection cost (combiner / summarizer calls)")
    ax.set_ylabel(f"test accuracy, {key} (%)")
    sub = f"; pool oracle {100 * oracle:.1f}%" if oracle is not None else ""
    ax.set_title(f"{title}\nmarkers: o k=2, s k=3, ^ k=4{sub}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating, float)):
        v = float(x)
        return None if math.isnan(v) else round(v, 6)
    if isinstance(x, np.ndarray):
        return _jsonable(x.tolist())
    return x


def write_json(obj: Any, path: str | Path, indent: int | None = 1) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    seps = (",", ":") if indent is None else None
    write_text_atomic(path, json.dumps(_jsonable(obj), indent=indent, separators=seps) + "\n")
    return path


def combiner_note(data: EnsembleData, combiner: str) -> str:
    name = get_combiner(combiner, data).name
    return (f"Combiner in the loop and for scoring: **{name}** (no LLM summarizer is run; each subset "
            f"evaluation is costed as n summarizer calls, n = selection-set size).")
