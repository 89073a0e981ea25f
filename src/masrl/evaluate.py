"""``masrl eval``: run the configured team on benchmarks, n samples per task; write eval.json/md + samples."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from masrl.config import load_config
from masrl.errors import ConfigError
from masrl.io.atomic import write_text_atomic
from masrl.paths import check_output_dir


def bench_names(text: str) -> list[str]:
    """``--bench a,b``: the benchmark names, at least one, each once (results are keyed by name)."""
    names = [b.strip() for b in text.split(",") if b.strip()]
    if not names:
        raise ConfigError(f"--bench {text!r}: give at least one benchmark ('test' = the task's held-out split)")
    if len(set(names)) != len(names):
        raise ConfigError(f"--bench {text!r}: give each benchmark once")
    return names


def run_eval(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from masrl.team_runner import TeamRunner

    cfg = load_config(args.config, args.overrides)
    if (args.n is not None and args.n < 1) or (args.limit is not None and args.limit < 1):
        raise ConfigError(f"--n and --limit must be >= 1, got --n {args.n} --limit {args.limit}")
    n = args.n or cfg.eval.n
    try:
        ks = [int(k) for k in args.k.split(",")] if args.k else list(cfg.eval.k)
    except ValueError:
        raise ConfigError(f"--k must be comma-separated integers, e.g. 1,4; got {args.k!r}") from None
    if any(k < 1 for k in ks):
        raise ConfigError(f"--k values must be >= 1, got {args.k!r}")
    if args.out:
        check_output_dir(args.out, "--out")
    args.bench = bench_names(args.bench)
    ks = sorted({k for k in ks if k <= n})
    with TeamRunner(cfg, progress=False) as team:  # a Ray runtime's workers end with the evaluation
        results, samples, ckpt_path, out = _eval_benches(args, cfg, team, n, ks)
    meta = {"config": str(args.config), "checkpoint": str(ckpt_path) if ckpt_path else None, "n": n, "k": ks}
    write_text_atomic(out / "samples.jsonl", "".join(json.dumps(s) + "\n" for s in samples))
    write_text_atomic(out / "eval.json", json.dumps({"meta": meta, "results": results}, indent=1))
    metric_keys = ["avg@n", *[f"pass@{k}" for k in ks], *[f"maj@{k}" for k in ks]]
    lines = [f"# masrl eval (n={n})", "", "| bench | tasks | " + " | ".join(metric_keys) + " |",
             "|---|---|" + "---|" * len(metric_keys)]
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


def _eval_benches(args, cfg, team, n: int, ks: list[int]):
    """Run every ``--bench`` with the built team; ``(results, samples, checkpoint path, out folder)``."""
    ckpt_path = team.load_checkpoint(args.checkpoint) if args.checkpoint else None
    out = Path(args.out) if args.out else (ckpt_path.parents[1] / "eval" if ckpt_path else Path("runs/eval"))
    check_output_dir(out, "--out" if args.out else "eval folder")
    out.mkdir(parents=True, exist_ok=True)
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
    return results, samples, ckpt_path, out
