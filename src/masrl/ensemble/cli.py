"""``masrl ensemble`` commands: ``select``, ``compare``, ``rl-focal``, ``collect``.

The lead's ``masrl.cli`` calls ``register`` on its subparsers and then ``args.func(args)``.
Bad input prints one ``masrl ensemble: error: ...`` line on stderr and returns exit code 2.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

from masrl.argtypes import MAX_COUNT, bounded
from masrl.io.atomic import write_text_atomic

__all__ = ["register", "main"]
MAX_ALPHA = 1e6  # size penalty of RL-Focal
MAX_LIMIT = 10 ** 9  # tasks per benchmark ("at most"; more than the benchmark holds is harmless)
MAX_TEMPERATURE = 100.0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True, help="predictions JSONL (a path, or relative to $MASRL_DATA_DIR/ensembles)")
    p.add_argument("--label-field", default="label", help="gold field (default: label; e.g. label_rlfocal)")
    p.add_argument("--split", default="auto", help="auto | first | field:NAME (default auto: split_rlfocal / "
                                                   "split_routerdc field if present, else first 80%% of each task)")
    p.add_argument("--split-frac", type=bounded(float, 0, 1, low_open=True, high_open=True), default=0.8, help="training fraction for --split first")
    p.add_argument("--models", default=None, help="comma-separated subset of the pool")
    p.add_argument("--lenient", action="store_true", help="skip malformed rows with a warning instead of failing")
    p.add_argument("--out", default=None, help="write markdown + JSON (+ PNG) reports to this folder")


def _selector_opts(p: argparse.ArgumentParser) -> None:
    p.add_argument("--combiner", default="auto",
                   help="plurality | soft | oracle | majority | auto | package.module:function (summarizer); "
                        "auto = plurality with answers, majority for correctness-only data")
    p.add_argument("--scope", choices=("per-task", "global"), default="per-task",
                   help="select one subset per task (default) or one for all tasks")
    p.add_argument("--weights", default="0.5,0.5,0",
                   help="fitness weights focal,vote,fleiss for proxy-fitness (default 0.5,0.5,0)")


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``ensemble`` command (with ``select``, ``compare``, ``rl-focal``, ``collect``) to ``subparsers``."""
    from masrl.ensemble.selectors import SELECTORS

    ens = subparsers.add_parser("ensemble", help="LLM-ensemble selection and RL-Focal on per-model predictions",
                                description="Proposer selection and RL-Focal on per-model prediction files.")
    ens.set_defaults(func=lambda args: (ens.print_help(sys.stderr), 2)[1])
    sub = ens.add_subparsers(dest="ensemble_cmd", metavar="{select,compare,rl-focal,collect}")

    p = sub.add_parser("select", help="run one selector", description="Run one selector and report its subset, "
                       "selection-set and test accuracy and cost in combiner calls.")
    _common(p)
    _selector_opts(p)
    p.add_argument("--method", default="forward", choices=list(SELECTORS))
    p.add_argument("--k", type=bounded(int, 1, MAX_COUNT), default=3)
    p.set_defaults(func=_guard(cmd_select))

    p = sub.add_parser("compare", help="every selector side by side (table + accuracy-vs-cost PNG)")
    _common(p)
    _selector_opts(p)
    p.add_argument("--k", type=bounded(int, 1, MAX_COUNT), nargs="+", default=[2, 3, 4])
    p.add_argument("--methods", default=None, help="comma-separated selectors (default: all that apply)")
    p.set_defaults(func=_guard(cmd_compare), out_default="ensemble_compare")

    p = sub.add_parser("rl-focal", help="train RL-Focal (Decider + Fusion) and evaluate on the test split")
    _common(p)
    p.add_argument("--seeds", type=bounded(int, 1, MAX_COUNT), default=5, help="number of seeds (0..n-1), default 5")
    p.add_argument("--preset", default="auto", help="hyper-parameter preset: bbh | mmlu | gsm8k | gpqa | musr | "
                                                    "none | auto (from the file name)")
    p.add_argument("--alpha", type=bounded(float, -MAX_ALPHA, MAX_ALPHA), default=None, help="size penalty (overrides the preset)")
    p.add_argument("--weights", default=None, help="state fitness weights focal,vote,fleiss (overrides the preset)")
    p.add_argument("--window", type=bounded(int, 1, MAX_COUNT), default=50)
    p.add_argument("--episodes", type=bounded(int, 1, MAX_COUNT), default=20)
    p.add_argument("--algo", choices=("reinforce", "ppo"), default="reinforce")
    p.add_argument("--reward", choices=("spec", "reference"), default="spec")
    p.add_argument("--gamma", type=bounded(float, 0, 1), default=0.0)
    p.add_argument("--test-window", choices=("train", "stream"), default="train")
    p.add_argument("--fusion-loss", choices=("ce", "reinforce"), default="ce")
    p.add_argument("--no-fusion", action="store_true")
    p.add_argument("--global", dest="global_", action="store_true", help="one Decider for all tasks pooled")
    p.set_defaults(func=_guard(cmd_rlfocal))

    p = sub.add_parser("collect", help="run your proposers -> summarizer team on a benchmark and write a "
                       "predictions JSONL (one model per proposer)",
                       description="Run the configured team (built as `masrl eval` builds it) on benchmark tasks "
                       "and write each proposer's answer and correctness as an ensemble predictions file. "
                       "The workflow must record episode.info['proposals'] (e.g. proposers_summarizer).")
    p.add_argument("config", help="YAML run config (the one given to masrl train / masrl eval)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. workflow.params.n_proposers=5")
    p.add_argument("--bench", required=True, help="comma-separated benchmarks; 'test' = the task's held-out split; "
                                                  "each becomes one `task` of the file")
    p.add_argument("--limit", type=bounded(int, 1, MAX_LIMIT), default=None, help="tasks per benchmark (default: eval.limit)")
    p.add_argument("--out", default=None, help="output JSONL (default: RUN_DIR/ensemble/<bench>.jsonl with "
                                               "--checkpoint, else runs/ensemble/<bench>.jsonl)")
    p.add_argument("--checkpoint", default=None, help="RUN_DIR or RUN_DIR/checkpoints/step_N: the trained weights")
    p.add_argument("--n-samples", type=bounded(int, 1, MAX_COUNT), default=1, help="episodes per task, one row each (id suffix #j)")
    p.add_argument("--seed", type=bounded(int, 0, 2 ** 32 - 1), default=None, help="sampling seed (default: the config's seed)")
    p.add_argument("--temperature", type=bounded(float, 0, MAX_TEMPERATURE), default=None,
                   help="sampling temperature (default: eval.temperature, else each agent's)")
    p.add_argument("--strict", action="store_true", help="fail on malformed benchmark rows instead of skipping them")
    p.set_defaults(func=_guard(_cmd_collect))
    return ens


def _guard(fn):
    from masrl.errors import UserInputError

    def run(args) -> int:
        try:
            return fn(args)
        except (UserInputError, FileNotFoundError, IsADirectoryError, PermissionError) as e:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            print(f"masrl ensemble: error: {msg}", file=sys.stderr)
            return 2
    run.__name__ = fn.__name__
    return run


def _weights(text: str) -> tuple[float, float, float]:
    from masrl.ensemble.data import InputError

    try:
        w = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise InputError(f"--weights must be three comma-separated numbers, got {text!r}") from None
    if len(w) != 3 or not all(math.isfinite(x) for x in w):
        raise InputError(f"--weights must be three comma-separated finite numbers, got {text!r}")
    return w  # type: ignore[return-value]


def _load(args):
    import warnings

    from masrl.ensemble.data import load_jsonl, split_indices

    models = [m.strip() for m in args.models.split(",")] if args.models else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        data = load_jsonl(args.data, label_field=args.label_field, strict=not args.lenient, models=models)
    if caught:
        print(f"warning: skipped {len(data.skipped)} malformed row(s); first: line {data.skipped[0][0]}: "
              f"{data.skipped[0][1]}", file=sys.stderr)
    split = split_indices(data, args.split, args.split_frac)
    return data, split


def _out_dir(args) -> Path | None:
    from masrl.paths import check_output_dir

    out = args.out or getattr(args, "out_default", None)
    return check_output_dir(out, "--out") if out else None


def cmd_select(args) -> int:
    from masrl.ensemble import report as rep
    from masrl.ensemble.selectors import run_selector

    out = _out_dir(args)  # checked before any work
    data, split = _load(args)
    s = run_selector(data, split, args.method, args.k, args.combiner, scope=args.scope,
                     fitness_weights=_weights(args.weights))
    multi = len(data.task_names()) > 1
    head, rows = rep.selection_table([s], multi)
    title = f"{args.method} k={args.k} on {Path(data.source).name} ({split.describe()}, combiner {s.combiner}, {args.scope})"
    rep.print_table(title, head, rows)
    if multi:
        th = ["task", "subset", "sel. acc", "test acc"]
        tr = [[t, "+".join(rep.short_model(m) for m in s.subsets[t]), rep.pct(r["selection_accuracy"]),
               rep.pct(r["test_accuracy"])] for t, r in s.per_task.items()]
        rep.print_table("per task", th, tr)
    if out:
        stem = f"select_{args.method}_k{args.k}"
        md = [f"# {title}", "", data.describe(), "", rep.markdown_table(head, rows), ""]
        (out).mkdir(parents=True, exist_ok=True)
        write_text_atomic(out / f"{stem}.md", "\n".join(md))
        rep.write_json({"data": data.source, "split": split.describe(), "result": s.to_dict()}, out / f"{stem}.json")
        print(f"wrote {out / (stem + '.md')} and .json")
    return 0


def cmd_compare(args) -> int:
    from masrl.ensemble import report as rep
    from masrl.ensemble.data import InputError
    from masrl.ensemble.selectors import SELECTORS, baselines

    out = _out_dir(args)  # checked before any work
    data, split = _load(args)
    methods = [m.strip() for m in args.methods.split(",")] if args.methods else None
    for m in methods or []:
        if m not in SELECTORS:
            raise InputError(f"unknown selector {m!r}; use some of {', '.join(SELECTORS)}")
    for k in args.k:
        if not 1 <= k <= data.n_models:
            raise InputError(f"k={k} out of range 1..{data.n_models}")
    t0 = time.time()
    sums = rep.compare_selectors(data, split, methods, args.k, args.combiner, args.scope, _weights(args.weights))
    base = baselines(data, split, args.combiner)
    multi = len(data.task_names()) > 1
    bh, br = rep.baseline_table(base, multi)
    sh, sr = rep.selection_table(sums, multi)
    name = Path(data.source).stem
    rep.print_table(f"reference points: {name} ({split.describe()})", bh, br)
    rep.print_table(f"selectors: {name}, combiner {sums[0].combiner if sums else args.combiner}, {args.scope}", sh, sr)
    if out:
        out.mkdir(parents=True, exist_ok=True)
        png = rep.plot_accuracy_vs_cost(sums, out / f"compare_{name}.png", f"{name}: selectors ({args.scope})", base)
        md = [f"# Selector comparison: {name}", "", data.describe(), f"Split: {split.describe()}.",
              rep.combiner_note(data, args.combiner), "", "## Reference points", "", rep.markdown_table(bh, br), "",
              f"## Selectors ({args.scope})", "", rep.markdown_table(sh, sr), "", f"![accuracy vs cost]({png.name})", ""]
        write_text_atomic(out / f"compare_{name}.md", "\n".join(md))
        rep.write_json({"data": data.source, "split": split.describe(), "models": data.models, "baselines": base,
                        "selectors": [s.to_dict(compact=True) for s in sums], "seconds": time.time() - t0},
                       out / f"compare_{name}.json")
        print(f"wrote {out}/compare_{name}.md, .json, .png")
    return 0


def cmd_rlfocal(args) -> int:
    from masrl.ensemble import report as rep
    from masrl.ensemble.data import InputError
    from masrl.ensemble.rlfocal import PRESETS, RLFocalConfig, train_rl_focal

    out = _out_dir(args)  # checked before any work
    data, split = _load(args)
    preset = args.preset
    if preset == "auto":
        stem = Path(data.source).stem.lower()
        preset = next((k for k in PRESETS if k in stem), "none")
    if preset != "none" and preset not in PRESETS:
        raise InputError(f"unknown preset {preset!r}; use one of {', '.join(PRESETS)}, none, auto")
    kw = dict(PRESETS.get(preset, {}))
    if args.alpha is not None:
        kw["alpha"] = args.alpha
    if args.weights is not None:
        kw["fitness_weights"] = _weights(args.weights)
    # --seeds, --window, --episodes, --gamma and --alpha are bounded by their argparse types
    cfg = RLFocalConfig(window=args.window, episodes=args.episodes, algo=args.algo, reward=args.reward,
                        gamma=args.gamma, test_window=args.test_window, fusion=not args.no_fusion,
                        fusion_loss=args.fusion_loss, **kw)
    res = train_rl_focal(data, split, cfg, seeds=range(args.seeds), per_task=not args.global_)
    multi = len(res.tasks) > 1
    head, rows = rep.rlfocal_table({"RL-Focal": res.to_dict()}, multi)
    name = Path(data.source).stem
    title = f"RL-Focal on {name} ({split.describe()}, preset {preset}, {len(res.seeds)} seeds, mean ± std)"
    rep.print_table(title, head, rows)
    for n in res.notes:
        print(f"note: {n}")
    if out:
        out.mkdir(parents=True, exist_ok=True)
        md = [f"# {title}", "", data.describe(), "", rep.markdown_table(head, rows), "",
              "No test-time updates; test-time state uses "
              + ("the fitness of the last training window." if cfg.test_window == "train"
                 else "a window sliding over already-answered test items."), ""]
        md += [f"- note: {n}" for n in res.notes]
        write_text_atomic(out / f"rlfocal_{name}.md", "\n".join(md) + "\n")
        rep.write_json({"data": data.source, "split": split.describe(), "preset": preset, "result": res.to_dict()},
                       out / f"rlfocal_{name}.json")
        print(f"wrote {out}/rlfocal_{name}.md and .json")
    return 0


def _cmd_collect(args) -> int:
    from masrl.ensemble.collect import cmd_collect

    return cmd_collect(args)


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (``python -m masrl.ensemble.cli ensemble ...``) for testing without ``masrl.cli``."""
    parser = argparse.ArgumentParser(prog="masrl")
    sub = parser.add_subparsers(dest="cmd")
    register(sub)
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help(sys.stderr)
        return 2
    return int(args.func(args))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
