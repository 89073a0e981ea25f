"""``masrl eval``: run the configured team on benchmarks, n samples per task; write eval.json/md + samples."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from masrl.config import load_config
from masrl.errors import ConfigError, UserInputError
from masrl.io.atomic import write_text_atomic
from masrl.paths import check_output_dir
from masrl.training.checkpoint import list_checkpoints


def bench_names(text: str) -> list[str]:
    """``--bench a,b``: the benchmark names, at least one, each once (results are keyed by name)."""
    names = [b.strip() for b in text.split(",") if b.strip()]
    if not names:
        raise ConfigError(f"--bench {text!r}: give at least one benchmark ('test' = the task's held-out split)")
    if len(set(names)) != len(names):
        raise ConfigError(f"--bench {text!r}: give each benchmark once")
    return names


def run_eval(args, prepare=None) -> int:
    """``prepare(cfg)``, when given, runs on the loaded config before anything is built (``masrl eval`` passes
    ``masrl.plan.memory.announce_memory_defaults``: the planner sits above this module)."""
    from rich.console import Console
    from rich.table import Table

    from masrl.team_runner import TeamRunner

    cfg = load_config(args.config, args.overrides)
    if prepare is not None:
        prepare(cfg)
    if (args.n is not None and args.n < 1) or (args.limit is not None and args.limit < 1):
        raise ConfigError(f"--n and --limit must be >= 1, got --n {args.n} --limit {args.limit}")
    n = args.n or cfg.eval.n
    try:
        ks = [int(k) for k in args.k.split(",")] if args.k else list(cfg.eval.k)
    except ValueError:
        raise ConfigError(f"--k must be comma-separated integers, e.g. 1,4; got {args.k!r}") from None
    if any(k < 1 for k in ks):
        raise ConfigError(f"--k values must be >= 1, got {args.k!r}")
    args.bench = bench_names(args.bench)
    ks = sorted({k for k in ks if k <= n})
    source, out = _weights_and_out(args, cfg)
    expected = _expected_step(source)
    print(f"masrl eval: weights: {_weights_line(args, cfg, source, expected)}", flush=True)
    with TeamRunner(cfg, progress=False) as team:  # a Ray runtime's workers end with the evaluation
        ckpt_path = team.load_checkpoint(source) if source else None
        if ckpt_path and ckpt_path != expected:
            print(f"masrl eval: weights: {ckpt_path} ({expected.name if expected else 'the newest'} did not load)",
                  flush=True)
        out.mkdir(parents=True, exist_ok=True)
        results, samples = _eval_benches(args, cfg, team, n, ks)
    weights = str(ckpt_path) if ckpt_path else initial_weights(cfg)
    meta = {"config": str(args.config), "checkpoint": str(ckpt_path) if ckpt_path else None, "weights": weights,
            "n": n, "k": ks}
    write_text_atomic(out / "samples.jsonl", "".join(json.dumps(s) + "\n" for s in samples))
    write_text_atomic(out / "eval.json", json.dumps({"meta": meta, "results": results}, indent=1))
    metric_keys = ["avg@n", *[f"pass@{k}" for k in ks], *[f"maj@{k}" for k in ks]]
    lines = [f"# masrl eval (n={n})", "", f"weights: {weights}", "",
             "| bench | tasks | " + " | ".join(metric_keys) + " |", "|---|---|" + "---|" * len(metric_keys)]
    table = Table(title=f"team accuracy (n={n} samples per task)")
    for col in ["bench", "tasks", *metric_keys]:
        table.add_column(col)
    for bench, s in results.items():
        cells = [f"{100 * s[k]:.1f}%" if k in s else "-" for k in metric_keys]
        lines.append(f"| {bench} | {s['n_tasks']} | " + " | ".join(cells) + " |")
        table.add_row(bench, str(s["n_tasks"]), *cells)
    write_text_atomic(out / "eval.md", "\n".join(lines) + "\n")
    Console().print(table)
    print(f"wrote {out / 'eval.json'}, {out / 'eval.md'}, {out / 'samples.jsonl'}")
    return 0


def _expected_step(source: Path | None) -> Path | None:
    """The checkpoint folder ``source`` names (a step folder, or a run folder's newest step)."""
    if source is None or (source / "manifest.json").is_file():
        return source
    found = list_checkpoints(source)
    return found[-1] if found else None


def _weights_line(args, cfg, source: Path | None, expected: Path | None) -> str:
    """Which weights are evaluated, said before the model is built (the first line of ``masrl eval``)."""
    if source is None:
        why = "--checkpoint none" if args.checkpoint else f"{cfg.run_dir} holds no checkpoint; --checkpoint RUN_DIR " \
                                                          "evaluates a trained run"
        return f"{initial_weights(cfg)} ({why})"
    if args.checkpoint:
        return str(expected or source)
    return f"{expected}, the newest checkpoint of the config's run folder (--checkpoint none: the initial weights)"


def initial_weights(cfg) -> str:
    """What is evaluated without a checkpoint, in words: a tiny model's random init or the pretrained models."""
    models = sorted({p.model for p in cfg.policies.values()})
    if models == ["tiny"]:
        return "a randomly initialised tiny model, never trained (expect about 0% accuracy)"
    return f"the config's models as they load, no checkpoint ({', '.join(models)})"


def _weights_and_out(args, cfg) -> tuple[Path | None, Path]:
    """``(what to load, output folder)``, checked before a model is built. ``--checkpoint`` (``none``: the
    initial weights), else the config's run folder when it holds a checkpoint, else nothing. The output folder:
    ``--out``, else the run folder's ``eval/`` (``runs/eval`` without one); an existing evaluation there is
    kept unless ``--overwrite``."""
    if args.checkpoint and args.checkpoint.lower() == "none":
        source = None
    elif args.checkpoint:
        source = Path(args.checkpoint)
    else:
        source = cfg.run_dir if list_checkpoints(cfg.run_dir) else None
    if source is not None and _expected_step(source) is None:
        raise ConfigError(f"--checkpoint {source}: no checkpoint there (expected RUN_DIR or "
                          "RUN_DIR/checkpoints/step_N)")
    run_dir = None if source is None else (source.parents[1] if (source / "manifest.json").is_file() else source)
    out = Path(args.out) if args.out else (run_dir / "eval" if run_dir else Path("runs/eval"))
    check_output_dir(out, "--out" if args.out else "eval folder")
    if (out / "eval.json").exists() and not getattr(args, "overwrite", False):
        raise UserInputError(f"{out} already holds an evaluation (eval.json); give --overwrite to replace it, "
                          "or --out another folder")
    return source, out


def _eval_benches(args, cfg, team, n: int, ks: list[int]):
    """Run every ``--bench`` with the built team; ``(results, samples)``."""
    results, samples = {}, []
    for run in team.benches(args.bench, n=n, seed=cfg.seed, limit=args.limit or cfg.eval.limit, strict=args.strict,
                            fit=True, show=cfg.logging.progress):
        bench, episodes, skipped = run.bench, run.episodes, run.skipped
        if skipped:
            print(f"masrl eval: {bench}: skipped {len(skipped)} task(s) that cannot fit the model context; "
                  f"first: {skipped[0]}", file=sys.stderr)
        summary = run.summary(ks)
        summary["skipped_over_context"] = len(skipped)
        tokens = {}
        for e in episodes:
            for t in e.turns:
                tokens[t.policy] = tokens.get(t.policy, 0) + len(t.response_ids)
        for policy, count in tokens.items():
            summary[f"policy/{policy}/generated_tokens"] = count
            if policy in cfg.eval.prices:
                summary[f"policy/{policy}/cost_usd"] = count / 1e6 * cfg.eval.prices[policy]
        results[bench] = summary
        for e in episodes:
            samples.append({"bench": bench, "task_id": e.task.id, "group": e.group_id, "reward": e.reward,
                            "correct": e.correct, "answer": e.answer, "pred": e.info.get("pred"),
                            "turns": [{"agent": t.agent, "policy": t.policy, "prompt": t.prompt_text,
                                       "response": t.text, "valid": t.valid, "tokens": len(t.response_ids)}
                                      for t in e.turns],
                            **({"error": e.error} if e.error else {})})  # its workflow raised (invalid episode)
    return results, samples
