"""masrl command line: thin — parse, call, exit code (0 ok, 1 failure, 2 bad input)."""
from __future__ import annotations

import argparse
import math
import os
import sys
import warnings
from pathlib import Path

from masrl.argtypes import MAX_COUNT, MAX_TOKENS, bounded, shown
from masrl.config import load_config
from masrl.errors import ConfigError, UserInputError, clip_lines, extra_hint
from masrl.paths import check_output_dir, check_path_name


def _cmd_train(args) -> int:
    from masrl.plan.memory import announce_memory_defaults
    from masrl.trainer import Trainer, format_before_after

    if args.config and "=" in args.config:  # `masrl train --resume DIR key=value ...`
        args.overrides, args.config = [args.config, *args.overrides], None
    if args.strict:
        args.overrides = [*args.overrides, "task.strict=true"]
    if args.resume:
        run_dir = Path(args.resume)
        cfg_path = run_dir / "config.yaml"
        if not cfg_path.exists():
            raise ConfigError(f"--resume {run_dir}: no config.yaml there; is it a masrl run folder?")
        if args.config:
            raise ConfigError("masrl train --resume RUN_DIR takes its config from RUN_DIR/config.yaml; "
                              "give overrides only")
        cfg = load_config(cfg_path, args.overrides)
    else:
        if not args.config:
            raise ConfigError("masrl train: give a config file (or --resume RUN_DIR)")
        cfg = load_config(args.config, args.overrides)
        run_dir = Path(args.output_dir) if args.output_dir else cfg.run_dir
    check_before_build(cfg, run_dir, "--output-dir" if args.output_dir else "run folder")
    announce_memory_defaults(cfg)
    with Trainer(cfg, run_dir=run_dir) as trainer:
        report = trainer.fit(resume=bool(args.resume), overwrite=args.overwrite)
    table = format_before_after(trainer.history, cfg)
    if table:
        print(table)
    print(f"run folder: {run_dir}  (report.md, metrics.jsonl, plots/, checkpoints/)")
    if report and report.get("export"):
        print(f"exported: {report['export']}  (Hugging Face / PEFT folders, README.md, config.yaml)")
    return 0 if report else 1


def check_before_build(cfg, run_dir: Path, what: str) -> None:
    """What ``masrl train`` checks before it builds a model, and ``masrl config show`` checks too (the one
    start-time check of both): the run folder can be written and every path derived from the config's names can
    exist (``masrl.paths.check_output_dir``; the policies' checkpoint folders), then registry names, agents,
    prompt templates, the workflow's params and the task's data (``masrl.team_runner``: ``check_team``, then
    ``load_tasks``, as a ``TeamRunner`` starts)."""
    from masrl.team_runner import check_team, load_tasks

    check_output_dir(run_dir, what)
    for policy in cfg.policies:  # checkpoints/step_N/policies/<policy>/
        check_path_name(Path(run_dir, "checkpoints", "step_0", "policies", policy), f"policies.{policy[:40]}")
    check_team(cfg)
    load_tasks(cfg)


def _cmd_config_show(args) -> int:
    """The resolved config (defaults filled in, overrides applied, checked as ``train`` checks it before it
    builds a model: names, agents, prompt templates, the task's params and data) as YAML."""
    from masrl.config import dump_config

    cfg = load_config(args.config, args.overrides)
    check_before_build(cfg, cfg.run_dir, "run folder")
    print(dump_config(_resolved_view(cfg)), end="")
    return 0


def _resolved_view(cfg):
    """The config as the run will use it: the workflow's default prompt templates under the ones the config
    gives, and the trackers in effect in ``logging.report_to``."""
    from masrl.workflows.base import get_workflow

    shown = cfg.model_copy(deep=True)
    shown.workflow.prompts = {**get_workflow(cfg.workflow.name).prompts, **cfg.workflow.prompts}
    shown.logging.report_to = shown.logging.sinks
    return shown


def _cmd_export(args) -> int:
    from masrl.export import export_run

    out = export_run(args.run_dir, args.out, step=args.step, policies=args.policy, merge_lora=args.merge_lora,
                     max_shard_size=args.max_shard_size, overwrite=args.overwrite)
    print(f"exported to {out}  (README.md, config.yaml for `masrl eval`, export.json)")
    return 0


def _cmd_eval(args) -> int:
    from masrl.evaluate import run_eval
    from masrl.plan.memory import announce_memory_defaults

    # trainer.memory_defaults: rows decoded together, cache and allocator as training chose them
    return run_eval(args, prepare=announce_memory_defaults)


def _cmd_plot(args) -> int:
    from masrl.monitoring.plots import plot_training_curves

    from masrl.monitoring.logger import read_metrics

    run_dir = Path(args.run_dir)
    if not (run_dir / "metrics.jsonl").is_file():
        raise ConfigError(f"masrl plot: {run_dir} has no metrics.jsonl; is it a masrl run folder?")
    if not read_metrics(run_dir):
        raise UserInputError(f"masrl plot: {run_dir / 'metrics.jsonl'} holds no metrics records (JSON objects "
                             "with a numeric step, one per line); nothing to plot")
    check_output_dir(run_dir / "plots", "masrl plot: plots folder")
    paths = plot_training_curves(run_dir)
    try:
        from masrl.monitoring.dashboard import plot_dashboard

        paths += plot_dashboard(run_dir)
    except ImportError:
        pass
    for p in paths:
        print(p)
    return 0


def _cmd_plan(args) -> int:
    from masrl.plan import format_plan, plan

    cfg = load_config(args.config, args.overrides)
    report = plan(cfg, devices=args.gpus, device_gib=args.gpu_gib, prompt_tokens=args.prompt_tokens,
                  model_configs=args.model_config)
    print(format_plan(report))
    return 0 if report["fits"] else 1


def _cmd_sweep(args) -> int:
    from masrl.sweep import main as sweep_main

    return sweep_main(args.argv)


_SIZE_UNITS = {"KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12}
MAX_SHARD_BYTES = 10 ** 15
MAX_STEP = 10 ** 9
MAX_DEVICE_GIB = 1e5


def _byte_size(text: str) -> str | int:
    """An argparse type: a size like ``5GB``, ``500MB`` (given on as text) or a byte count (an int), 1 byte to 1PB."""
    number, unit = text.strip().upper(), "B"
    for name in _SIZE_UNITS:
        if number.endswith(name):
            number, unit = number[:-len(name)], name
            break
    try:
        value = float(number) * _SIZE_UNITS.get(unit, 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{shown(text)} is not a size (e.g. 5GB, 500MB, or bytes)") from None
    if not math.isfinite(value) or not 1 <= value <= MAX_SHARD_BYTES:
        raise argparse.ArgumentTypeError(f"{shown(text)} is out of range; give a size from 1 byte to 1000TB")
    return text.strip().upper() if unit != "B" else int(value)


def build_parser() -> argparse.ArgumentParser:
    from masrl import __version__

    parser = argparse.ArgumentParser(prog="masrl", description="Stable RL for teams of LLM agents")
    parser.add_argument("--version", action="version", version=f"masrl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a team (SFT cold start, then RL)")
    train.add_argument("config", nargs="?", help="YAML config file")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.total_steps=50")
    train.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last valid checkpoint")
    train.add_argument("--output-dir", help="run folder (default: output_dir from the config)")
    train.add_argument("--overwrite", action="store_true", help="start over in a run folder that holds a run")
    train.add_argument("--strict", action="store_true", help="stop at the first data row that does not parse "
                                                            "(task.strict=true)")
    train.set_defaults(func=_cmd_train)

    config = sub.add_parser("config", help="inspect a config")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    show = config_sub.add_parser("show", help="print the resolved config (defaults, overrides) as YAML")
    show.add_argument("config", help="YAML config file")
    show.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.total_steps=50")
    show.set_defaults(func=_cmd_config_show)

    ev = sub.add_parser("eval", help="evaluate a team on benchmarks (avg@n, pass@k, maj@k)")
    ev.add_argument("config", help="YAML config of the team (the one it was trained with)")
    ev.add_argument("overrides", nargs="*", help="dotted overrides, e.g. eval.limit=50 (default: none)")
    ev.add_argument("--checkpoint", help="RUN_DIR (its newest checkpoint), RUN_DIR/checkpoints/step_N, or 'none' "
                    "(the config's models as they load) (default: the newest checkpoint of the config's run folder "
                    "when it holds one)")
    ev.add_argument("--bench", default="test", help="comma-separated benchmarks, e.g. test,gsm8k; 'test' = the "
                    "task's held-out split (default: test)")
    ev.add_argument("--n", type=bounded(int, 1, MAX_COUNT), default=None,
                    help="samples per task (default: the config's eval.n)")
    ev.add_argument("--k", default=None, help="comma-separated k values for pass@k and maj@k, each <= n "
                    "(default: the config's eval.k)")
    ev.add_argument("--limit", type=bounded(int, 1, MAX_STEP), default=None,
                    help="tasks per benchmark, the first ones (default: the config's eval.limit; unset: all)")
    ev.add_argument("--out", default=None, help="output folder for eval.json, eval.md, samples.jsonl "
                    "(default: RUN_DIR/eval, or runs/eval without a checkpoint)")
    ev.add_argument("--strict", action="store_true",
                    help="fail on malformed data rows instead of skipping them (default: skip, with a warning)")
    ev.add_argument("--overwrite", action="store_true",
                    help="replace an evaluation already in the output folder (default: refuse)")
    ev.set_defaults(func=_cmd_eval)

    plot = sub.add_parser("plot", help="draw training curves and the per-role dashboard of a run")
    plot.add_argument("run_dir", help="a masrl run folder (its metrics.jsonl); writes RUN_DIR/plots/"
                      "training_curves.png and dashboard.png, replacing earlier ones")
    plot.set_defaults(func=_cmd_plot)

    pl = sub.add_parser("plan", help="memory per device for a config, and whether it fits (docs/scaling.md)")
    pl.add_argument("config")
    pl.add_argument("overrides", nargs="*")
    pl.add_argument("--gpus", type=bounded(int, 1, MAX_COUNT), default=None,
                    help="devices (default: the config's worker groups)")
    pl.add_argument("--gpu-gib", type=bounded(float, 0, MAX_DEVICE_GIB, low_open=True), default=80.0,
                    help="memory of one device in GiB")
    pl.add_argument("--prompt-tokens", type=bounded(int, 0, MAX_TOKENS), default=512,
                    help="assumed longest prompt, in tokens")
    pl.add_argument("--model-config", action="append", default=[], metavar="[POLICY=]PATH",
                    help="a model's config.json (or its folder) for a model masrl plan does not know offline; "
                         "POLICY= for one policy, else every pretrained policy (repeatable)")
    pl.set_defaults(func=_cmd_plan)

    sweep = sub.add_parser("sweep", add_help=False, help="run a grid of configs x seeds (masrl sweep SPEC.yaml), "
                           "summarize it (masrl sweep report DIR)")
    sweep.add_argument("argv", nargs=argparse.REMAINDER)
    sweep.set_defaults(func=_cmd_sweep)

    exp = sub.add_parser("export", help="write trained policies as Hugging Face model / PEFT adapter folders")
    exp.add_argument("run_dir", help="a masrl run folder (config.yaml + checkpoints/)")
    exp.add_argument("--out", required=True, help="folder to create (one sub-folder per policy)")
    exp.add_argument("--step", type=bounded(int, 0, MAX_STEP), default=None, help="checkpoint step (default: the last valid one)")
    exp.add_argument("--policy", action="append", default=None, help="policy to export (repeatable; default: all)")
    exp.add_argument("--merge-lora", action="store_true", help="merge LoRA adapters into full weights")
    exp.add_argument("--max-shard-size", type=_byte_size, default="5GB", help="safetensors shard size (default 5GB)")
    exp.add_argument("--overwrite", action="store_true", help="replace an existing --out folder")
    exp.set_defaults(func=_cmd_export)

    for module in ("masrl.ensemble.cli", "masrl.retrieval.cli", "masrl.catalog", "masrl.examples", "masrl.serve"):
        try:
            mod = __import__(module, fromlist=["register"])
        except ImportError:
            continue
        cmd = mod.register(sub)
        if module == "masrl.retrieval.cli":
            cmd.set_defaults(func=_cmd_serve_retriever)
    return parser


def _cmd_serve_retriever(args: argparse.Namespace) -> int:
    """``masrl serve-retriever`` with the task-defined retriever specs (``--corpus synthetic_kb``) registered."""
    import masrl.tasks.synthetic_kb  # noqa: F401 - registers the "synthetic_kb" retriever spec
    from masrl.retrieval.cli import run_serve_retriever

    return run_serve_retriever(args)


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse ``argv``; dotted overrides (``key=value``) may stand anywhere, before or after options."""
    args, extra = parser.parse_known_args(argv)
    overrides = [a for a in extra if "=" in a and not a.startswith("-")]
    rest = [a for a in extra if a not in overrides]
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if overrides:
        if not hasattr(args, "overrides"):
            parser.error(f"masrl {args.command} takes no key=value overrides: {' '.join(overrides)}")
        args.overrides = [*args.overrides, *overrides]
    return args


def _format_warning(message, category, filename, lineno, line=None, _library=warnings.formatwarning) -> str:
    """masrl's own warnings (a skipped data row, a deprecated key) as one line for the user, without the
    source line of masrl that raised them; other libraries' warnings keep Python's format."""
    if getattr(category, "__module__", "").startswith("masrl"):
        return f"masrl: warning: {clip_lines(str(message))}\n"
    return _library(message, category, filename, lineno, line)


def main(argv: list[str] | None = None) -> int:
    warnings.formatwarning = _format_warning
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["sweep"]:  # its own parsers (masrl.sweep): `masrl sweep SPEC` and `masrl sweep report DIR`
        args = argparse.Namespace(func=_cmd_sweep, argv=argv[1:])
    else:
        args = _parse(parser, argv)
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe fails here, inside the handlers below, not at exit
        return code
    except ConfigError as e:
        print(f"masrl: config error: {e}", file=sys.stderr)
        return 2
    except (UserInputError, FileNotFoundError) as e:  # ModelLoadError, DatasetLoadError, CheckpointError, ...
        print(f"masrl: error: {clip_lines(str(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("masrl: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `masrl data list | head`: the reader left; no traceback (nor a second one at exit)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except ImportError as e:  # an optional extra (ray, vllm, openai in user code) that the run needs
        hint = extra_hint(e)
        if not hint and "pip install" not in str(e):
            raise
        print(f"masrl: error: {clip_lines(str(e))}{': ' + hint if hint else ''}", file=sys.stderr)
        return 2
    except Exception as e:  # a worker group failed (Ray): one line naming policy, worker and step
        from masrl.runtime import WorkerGroupError

        if not isinstance(e, WorkerGroupError):
            raise
        print(f"masrl: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
