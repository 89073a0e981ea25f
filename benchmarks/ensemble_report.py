"""Ensemble-selection and RL-Focal report on the real prediction data.

    python benchmarks/ensemble_report.py                    # all datasets, 5 seeds
    python benchmarks/ensemble_report.py --datasets bbh --seeds 3

Writes benchmarks/ensemble_results/{bbh,mmlu,gsm8k}.{md,json}, accuracy-vs-cost PNGs and a
README.md with the headline numbers. Data: $MASRL_DATA_DIR/ensembles (see masrl.paths.data_dir).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from masrl.ensemble import load_jsonl, split_indices
from masrl.ensemble import report as rep
from masrl.ensemble.rlfocal import PRESETS, RLFocalConfig, train_rl_focal
from masrl.ensemble.selectors import baselines
from masrl.paths import data_dir

DATASETS = {
    # name: (file, label field, selector combiners [(combiner, scope)], RL preset, window)
    "bbh": ("rlfocal_bbh/bbh.jsonl", "label",
            [("plurality", "per-task"), ("soft", "per-task"), ("plurality", "global")], "bbh", 50),
    "mmlu": ("routerdc_7models/mmlu.jsonl", "label", [("majority", "global"), ("oracle", "global")], "mmlu", 500),
    "gsm8k": ("routerdc_7models/gsm8k.jsonl", "label", [("majority", "global"), ("oracle", "global")], "gsm8k", 500),
}


FUSION_ONLY = ("RL-Focal, reference-style REINFORCE Fusion",)  # same Decider as "RL-Focal": show its Fusion only


def rl_variants(name: str, has_probs: bool, quick: bool, ablations: bool = True) -> dict[str, RLFocalConfig]:
    preset = dict(PRESETS[DATASETS[name][3]])
    common = dict(window=DATASETS[name][4], episodes=4 if quick else 20)
    out = {"RL-Focal": RLFocalConfig(**preset, **common)}
    if not ablations:
        return out
    out["RL-Focal α=0"] = RLFocalConfig(**{**preset, "alpha": 0.0}, **common, fusion=False)
    if has_probs:
        out["RL-Focal, reference-style REINFORCE Fusion"] = RLFocalConfig(**preset, **common, fusion_loss="reinforce")
        out["Fusion only"] = RLFocalConfig(**preset, **common, decider=False)
    return out


def run_dataset(name: str, out: Path, seeds: int, quick: bool, command: str, ablations: bool = True) -> dict:
    path, label_field, combos, preset, window = DATASETS[name]
    full = data_dir() / "ensembles" / path
    if not full.exists():
        print(f"skip {name}: {full} not found", file=sys.stderr)
        return {}
    t0 = time.time()
    data = load_jsonl(full, label_field=label_field)
    split = split_indices(data)
    multi = len(data.task_names()) > 1
    ks = (2, 3, 4)
    base_comb = combos[0][0]
    base = baselines(data, split, base_comb)
    md = [f"# Ensemble selection and RL-Focal: {name}", "",
          f"Command: `{command}`", "",
          f"Data: `{path}` — {data.describe().split(': ', 1)[1]}; labels: `{label_field}`; "
          f"split: {split.describe()}.", ""]
    if multi:
        md += ["Accuracies in %. *Macro* = mean over tasks of per-task test accuracy; *pooled* = over all "
               "test items. Selectors run on each task's training rows (*per-task*) or once on all training "
               "rows (*global*).", ""]
    md += ["Cost = combiner calls during selection: every uncached subset evaluation costs n calls "
           "(n = selection-set size), i.e. what an LLM summarizer in the loop would cost. No LLM is run "
           "here: the combiner in the loop is the vote named in each table.", ""]
    bh, br = rep.baseline_table(base, multi)
    md += ["## Reference points (test split)", "", rep.markdown_table(bh, br), ""]
    result = {"dataset": name, "file": path, "label_field": label_field, "split": split.describe(),
              "models": data.models,
              "baselines": base, "selectors": {}, "rl_focal": {}}

    # ---- RL-Focal first (its numbers also go on the plots)
    rl_results = {}
    for label, cfg in rl_variants(name, data.has_probs, quick, ablations).items():
        r = train_rl_focal(data, split, cfg, seeds=range(seeds))
        rl_results[label] = r.to_dict()
        s = r.summary
        print(f"[{name}] {label}: decider {rep.pm(s['decider_pooled'])} fusion {rep.pm(s['fusion_pooled'])} "
              f"size {s['mean_size']['mean']:.2f} ({r.seconds:.0f}s)", flush=True)
    result["rl_focal"] = rl_results
    extra = {}
    for label, r in rl_results.items():
        s = r["summary"]
        key = "pooled"
        if r["config"].get("decider", True) and s["decider_pooled"]["mean"] is not None and label == "RL-Focal":
            extra[f"{label}: Decider + {r['combiner']}"] = s[f"decider_{key}"]["mean"]
        if label == "RL-Focal" and s["fusion_pooled"]["mean"] is not None:
            extra[f"{label}: Decider + Fusion"] = s[f"fusion_{key}"]["mean"]

    # ---- selectors
    for comb, scope in combos:
        sums = rep.compare_selectors(data, split, None, ks, comb, scope, PRESETS[preset]["fitness_weights"])
        sh, sr = rep.selection_table(sums, multi)
        tag = f"{comb}_{scope}"
        png = rep.plot_accuracy_vs_cost(sums, out / f"{name}_{tag}.png",
                                        f"{name}: selectors, combiner {comb}, {scope}", base, extra_points=extra)
        md += [f"## Selectors — combiner **{comb}**, {scope}", "", rep.markdown_table(sh, sr), "",
               f"![accuracy vs cost]({png.name})", ""]
        result["selectors"][tag] = [s.to_dict(compact=True) for s in sums]
        print(f"[{name}] selectors {tag}: {len(sums)} runs", flush=True)

    # ---- RL-Focal table
    head, rows = rep.rlfocal_table(rl_results, multi, fusion_only=FUSION_ONLY)
    cfg0 = rl_results["RL-Focal"]["config"]
    md += [f"## RL-Focal ({seeds} seeds, mean ± std)", "", rep.markdown_table(head, rows), "",
           f"Preset `{preset}`: α = {cfg0['alpha']}, state fitness weights (focal, vote, Fleiss) = "
           f"{tuple(cfg0['fitness_weights'])}, window {cfg0['window']}, {cfg0['episodes']} episodes × "
           f"{cfg0['rollouts']} parallel rollouts, REINFORCE (γ = {cfg0['gamma']}), reward "
           f"`(2c − 1) − α·|b|/N`. " + ("One Decider (+ Fusion) per task, trained on that task's training "
                                        "rows." if multi else "") +
           " **No test-time updates**; the test-time state uses the fitness of the last training window "
           "(no test labels are read). Variants: *α=0* removes the size penalty; *reference-style "
           "REINFORCE Fusion* trains the Fusion MLP with the reference's ±1-reward policy gradient instead "
           "of cross-entropy; *Fusion only* feeds all models to the Fusion MLP (no Decider).", ""]
    notes = sorted({n for r in rl_results.values() for n in r["notes"]})
    md += [f"- {n}" for n in notes]
    md += ["", f"_Generated in {time.time() - t0:.0f} s._", ""]
    (out / f"{name}.md").write_text("\n".join(md))
    rep.write_json(result, out / f"{name}.json", indent=None)
    print(f"wrote {out / name}.md/.json ({time.time() - t0:.0f}s)", flush=True)
    return result


def headline(results: dict[str, dict], command: str) -> str:
    lines = ["# Ensemble report — headline numbers", "", f"Command: `{command}`", "",
             "Test accuracy (%), pooled over test items (macro over tasks in brackets for BBH). "
             "Selector rows: k = 2 / 3 / 4, tagged [combiner_scope]: per-task selection for BBH with plurality and "
             "with soft vote as the combiner in the loop; global for MMLU/GSM8K with binary majority of "
             "correctness and with the oracle (= coverage). Global-scope BBH results: bbh.md.", ""]
    for name, res in results.items():
        if not res:
            continue
        multi = name == "bbh"
        lines += [f"## {name} ({res['split']})", ""]
        rows = []
        for k, v in res["baselines"].items():
            rows.append([k, f"{rep.pct(v['pooled'])}" + (f" ({rep.pct(v['macro'])})" if multi else ""), ""])
        for tag in list(res["selectors"])[:2]:
            by = {}
            for s in res["selectors"][tag]:
                by.setdefault(s["method"], {})[s["k"]] = s
            for m, ks in by.items():
                acc = " / ".join(rep.pct(ks[k]["test_pooled"]) + (f" ({rep.pct(ks[k]['test_macro'])})" if multi else "")
                                 for k in sorted(ks))
                cost = " / ".join(f"{ks[k]['cost_calls']:,}" for k in sorted(ks))
                rows.append([f"{m} [{tag}]", acc, cost])
        for label, r in res["rl_focal"].items():
            s = r["summary"]
            if r["config"].get("decider", True) and label not in FUSION_ONLY:
                rows.append([f"{label}: Decider + {r['combiner']}",
                             rep.pm(s["decider_pooled"]) + (f" ({rep.pm(s['decider_macro'])})" if multi else ""),
                             f"mean size {s['mean_size']['mean']:.2f}"])
            if s["fusion_pooled"]["mean"] is not None:
                name_f = f"{label}: Decider + Fusion" if r["config"].get("decider", True) else label
                rows.append([name_f, rep.pm(s["fusion_pooled"]) + (f" ({rep.pm(s['fusion_macro'])})" if multi else ""),
                             ""])
        lines += [rep.markdown_table(["method", "test acc", "selection cost (calls)"], rows), ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--datasets", default="bbh,mmlu,gsm8k")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "ensemble_results"))
    ap.add_argument("--quick", action="store_true", help="4 RL episodes (smoke test)")
    ap.add_argument("--no-ablations", action="store_true", help="only the main RL-Focal variant (about half the time)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/ensemble_report.py" + (f" --datasets {args.datasets}" if args.datasets != "bbh,mmlu,gsm8k" else "") \
        + (f" --seeds {args.seeds}" if args.seeds != 5 else "") + (" --quick" if args.quick else "") + (" --no-ablations" if args.no_ablations else "")
    results = {}
    for name in args.datasets.split(","):
        name = name.strip()
        if name not in DATASETS:
            print(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)}", file=sys.stderr)
            return 2
        results[name] = run_dataset(name, out, args.seeds, args.quick, command, not args.no_ablations)
    if set(results) == set(DATASETS):
        (out / "README.md").write_text(headline(results, command))
        print(f"wrote {out / 'README.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
