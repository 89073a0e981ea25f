"""``masrl sweep``: grids of runs over seeds (run.py) and an honest summary of them (report.py).

Sits just below the CLI: it may import anything in masrl; nothing but ``masrl.cli`` imports it.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from masrl.argtypes import MAX_COUNT, bounded

MAX_GPUS_PER_RUN = 1024
USAGE = ("masrl sweep SPEC.yaml [options]  |  masrl sweep report DIR [--baseline-arm AXIS=LABEL ...] "
         "[--prior SUMMARY.json ...]")


def run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="masrl sweep", description="run every cell x seed of a sweep spec "
                                "(resumable: finished runs are skipped); docs/study.md",
                                epilog="summarize with: masrl sweep report DIR")
    p.add_argument("spec", help="sweep spec (YAML): name, base, out, seeds, overrides, axes")
    p.add_argument("--out", help="output folder (default: the spec's 'out')")
    p.add_argument("--jobs", type=bounded(int, 1, MAX_COUNT), default=1, help="runs at a time (default 1)")
    p.add_argument("--nice", type=bounded(int, -20, 19), default=0,
                   help="start each run under `nice -n N` (-20..19, what nice accepts); under Linux's autogroup "
                        "scheduling each run also gets a session of its own at that level")
    p.add_argument("--ray", metavar="ADDRESS", help="run each run as a Ray task on this cluster "
                   "('auto', 'ray://host:10001', or 'local' to start one here)")
    p.add_argument("--gpus-per-run", type=bounded(float, 0, MAX_GPUS_PER_RUN), default=0.0, help="with --ray: GPUs each run's task asks for")
    p.add_argument("--quick", action="store_true", help="2 RL steps, tiny SFT and eval: a smoke test, not a result")
    p.add_argument("--dry-run", action="store_true", help="print every run's command line and whether it is "
                   "finished, run nothing")
    p.add_argument("--seeds", type=_seed_list, metavar="S[,S...]",
                   help="run only these of the spec's seeds (e.g. to share a sweep between machines, or to run the "
                   "seeds an earlier folder lacks; `masrl sweep report --prior` joins the parts)")
    return p


def _seed_list(text: str) -> list[int]:
    try:
        seeds = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"seeds must be whole numbers separated by commas, got {text!r}") from None
    if len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"seeds repeat: {text!r}")
    return seeds


def report_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="masrl sweep report", description="tables over seeds (mean ± 95% CI, "
                                "paired differences) and plots of a sweep's runs: summary.md, summary.json, PNGs")
    p.add_argument("dir", help="the sweep's output folder")
    p.add_argument("--baseline-arm", action="append", default=[], metavar="AXIS=LABEL",
                   help="the arm the others are compared with on that axis (default: the axis's first label)")
    p.add_argument("--prior", action="append", default=[], metavar="SUMMARY.json",
                   help="an earlier report's summary.json of the same sweep (e.g. the committed one, when the run "
                   "folders are on another machine): its finished runs fill the slots DIR has not finished")
    return p


def main(argv: list[str]) -> int:
    from masrl.errors import ConfigError
    from masrl.paths import check_output_dir

    if argv[:1] == ["report"]:
        args = report_parser().parse_args(argv[1:])
        from masrl.sweep.report import report

        paths = report(args.dir, args.baseline_arm, args.prior)
        for p in paths:
            print(p)
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        run_parser().print_help()
        print(f"\nusage: {USAGE}")
        return 0 if argv else 2
    args = run_parser().parse_args(argv)
    if args.gpus_per_run and not args.ray:
        raise ConfigError("--gpus-per-run needs --ray (local runs use the devices their config names)")
    from masrl.sweep.run import sweep
    from masrl.sweep.spec import load_spec

    spec = load_spec(args.spec)
    out = args.out or spec.out
    if not out:
        raise ConfigError(f"{args.spec}: no output folder: set 'out:' in the spec or pass --out")
    check_output_dir(out, "--out" if args.out else f"{args.spec}: out")
    if args.seeds is not None:
        missing = [s for s in args.seeds if s not in spec.seeds]
        if missing:
            raise ConfigError(f"--seeds {','.join(map(str, missing))}: not among the seeds of {args.spec} "
                              f"({', '.join(map(str, spec.seeds))})")
    return sweep(spec, Path(out), jobs=args.jobs, nice=args.nice, ray_address=args.ray, gpus=args.gpus_per_run,
                 quick=args.quick, dry_run=args.dry_run, seeds=args.seeds)
