"""The policy-sharing study's per-cell quantities (E5) from a sweep's run folders: peak and final
held-out accuracy, cliffs, and per role the gradient share, token share, role-capture events, χ² drift and
perplexity; plus a plot of each role's gradient share over RL steps (mean over seeds), one panel per cell.

    python benchmarks/study/roles.py runs/study/e5 [PNG] > roles.md   # the plot: PNG, default runs/study/e5/grad_share.png

A cliff: the final held-out avg@n is >= CLIFF points below the run's peak over its evals (eval.every=10)."""
import glob, json, math, os, statistics as st, sys
from pathlib import Path

from masrl.monitoring.logger import read_metrics
CLIFF = 10.0
root = sys.argv[1]

def pct(x):
    return 100.0 * x if isinstance(x, (int, float)) and math.isfinite(x) else None

def run_row(d):
    rep = json.load(open(f"{d}/report.json"))
    recs = read_metrics(Path(d))
    evals = [(r.get("step"), pct(r.get("eval/test/avg@n"))) for r in recs if r.get("phase") == "eval"]
    eval_steps = [step for step, v in evals if v is not None]
    evals = [v for _, v in evals if v is not None]
    sft, final = pct(rep["eval"]["sft"]["avg@n"]), pct(rep["eval"]["final"]["avg@n"])
    peak = max(evals + [final])
    train = [r for r in recs if r.get("phase") == "train"]
    roles = sorted({k.split("/")[1] for r in train for k in r if k.startswith("agent/") and k.endswith("/grad_share")})
    per = {}
    for a in roles:
        gs = [r[f"agent/{a}/grad_share"] for r in train if isinstance(r.get(f"agent/{a}/grad_share"), (int, float))]
        tok = [r.get(f"agent/{a}/num_tokens") or 0 for r in train]
        caps = sum(1 for r in train if r.get(f"agent/{a}/role_capture"))
        chi = [r[f"agent/{a}/chi2_drift"] for r in train if isinstance(r.get(f"agent/{a}/chi2_drift"), (int, float))]
        ppl = [r[f"agent/{a}/perplexity"] for r in train if isinstance(r.get(f"agent/{a}/perplexity"), (int, float))]
        per[a] = dict(grad_share=st.fmean(gs) if gs else None, tokens=sum(tok), captures=caps,
                      chi2_final=chi[-1] if chi else None, ppl_first=ppl[0] if ppl else None, ppl_final=ppl[-1] if ppl else None)
    tot = sum(p["tokens"] for p in per.values()) or 1
    for p in per.values():
        p["token_share"] = p["tokens"] / tot
    curves = {a: [r.get(f"agent/{a}/grad_share") for r in train] for a in roles}
    return dict(sft=sft, peak=peak, final=final, drop=peak - final, cliff=peak - final >= CLIFF, evals=evals,
                eval_steps=eval_steps, roles=per,
                curves=curves)

def fmt(v, f="{:.1f}"):
    return "–" if v is None else f.format(v)

def ms(vals, f="{:.1f}"):
    vals = [v for v in vals if v is not None]
    if not vals:
        return "–"
    return f.format(st.fmean(vals)) + (" (" + " / ".join(f.format(v) for v in vals) + ")" if len(vals) > 1 else "")

cells = {}
for d in sorted(glob.glob(f"{root}/*=*/seed*/report.json")):
    run = os.path.dirname(d)
    cell = os.path.basename(os.path.dirname(run))
    cells.setdefault(cell, {})[int(os.path.basename(run)[4:])] = run_row(run)

print(f"# E5 per cell: peak, final, cliffs (final >= {CLIFF:.0f} points below peak), per-role telemetry\n")
steps = sorted({st for runs in cells.values() for row in runs.values() for st in row["eval_steps"]})
print("Accuracies: held-out avg@4 in %, mean over seeds (per seed in brackets, seed order). Peak: the best of the "
      f"held-out evaluations (logged at steps {', '.join(map(str, steps))}; step 0 is after SFT) and the final one. Gradient share: the role's share of the shared policy's gradient norm "
      "(`agent/<role>/grad_share`), mean over RL steps; token share: the role's share of trained tokens.\n")
print("| cell | seeds | after SFT | peak | final | peak − final | cliffs |")
print("|---|---|---|---|---|---|---|")
for cell, runs in cells.items():
    s = sorted(runs)
    R = [runs[i] for i in s]
    print(f"| {cell} | {','.join(map(str, s))} | {ms([r['sft'] for r in R])} | {ms([r['peak'] for r in R])} | "
          f"{ms([r['final'] for r in R])} | {ms([r['drop'] for r in R])} | {sum(r['cliff'] for r in R)}/{len(R)} |")
print("\n| cell | role | gradient share | token share | role-capture events (sum over seeds) | χ² drift, last step | perplexity first → last step |")
print("|---|---|---|---|---|---|---|")
for cell, runs in cells.items():
    R = [runs[i] for i in sorted(runs)]
    for a in sorted(R[0]["roles"]):
        p = [r["roles"].get(a, {}) for r in R]
        print(f"| {cell} | {a} | {ms([x.get('grad_share') for x in p], '{:.2f}')} | {ms([x.get('token_share') for x in p], '{:.2f}')} | "
              f"{sum(x.get('captures', 0) for x in p)} | {ms([x.get('chi2_final') for x in p], '{:.3g}')} | "
              f"{ms([x.get('ppl_first') for x in p], '{:.2f}')} → {ms([x.get('ppl_final') for x in p], '{:.2f}')} |")


def plot(cells, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(cells)
    cols = 3
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 2.8 * rows), sharey=True, squeeze=False)
    for ax, cell in zip(axes.flat, names):
        runs = [cells[cell][s] for s in sorted(cells[cell])]
        for a in sorted(runs[0]["curves"]):
            series = [r["curves"].get(a, []) for r in runs]
            steps = min(len(s) for s in series)
            mean = [st.fmean([s[i] for s in series if s[i] is not None] or [float("nan")]) for i in range(steps)]
            ax.plot(range(1, steps + 1), mean, label=a)
        ax.axhline(0.8, color="grey", lw=0.6, ls="--")  # the role-capture monitor's threshold
        ax.set_title(cell.replace("workflow=", "").replace("__policy=", " / "), fontsize=9)
        ax.legend(fontsize=7, loc="center right")
        ax.set_ylim(0, 1)
    for ax in axes.flat[len(names):]:
        ax.axis("off")
    fig.supxlabel("RL step")
    fig.supylabel("gradient share (mean over seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


plot(cells, os.path.join(root, "grad_share.png") if len(sys.argv) < 3 else sys.argv[2])
