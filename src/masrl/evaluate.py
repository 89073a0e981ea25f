"""``masrl eval``: run the configured team on benchmarks, n samples per task; write eval.json/md + samples."""
from __future__ import annotations

import json
from pathlib import Path

from masrl.config import ConfigError, load_config


def run_eval(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from masrl.trainer import Trainer

    cfg = load_config(args.config, args.overrides)
    n = args.n or cfg.eval.n
    ks = [int(k) for k in args.k.split(",")] if args.k else list(cfg.eval.k)
    ks = sorted({k for k in ks if k <= n})
    with Trainer(cfg, progress=False) as trainer:  # a Ray runtime's workers end with the evaluation
        results, samples, ckpt_path, out = _eval_benches(args, cfg, trainer, n, ks)
    meta = {"config": str(args.config), "checkpoint": str(ckpt_path) if ckpt_path else None, "n": n, "k": ks}
    (out / "eval.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    with open(out / "samples.jsonl", "w") as f:
        for s in samples:
            f.write(json.dumps(s) + "\n")
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
    (out / "eval.md").write_text("\n".join(lines) + "\n")
    Console().print(table)
    print(f"wrote {out / 'eval.json'}, {out / 'eval.md'}, {out / 'samples.jsonl'}")
    return 0


def _eval_benches(args, cfg, trainer, n: int, ks: list[int]):
    """Run every ``--bench`` with the built team; ``(results, samples, checkpoint path, out folder)``."""
    from masrl.evaluation.runner import summarize_episodes
    from masrl.rollout.runner import repeat_tasks
    from masrl.tasks.registry import load_bench_tasks
    from masrl.training.checkpoint import load_checkpoint, resolve_checkpoint

    ckpt_path = None
    if args.checkpoint:
        ckpt_path = resolve_checkpoint(args.checkpoint)
        load_checkpoint(ckpt_path, trainer.policies, load_optimizer=False)
    out = Path(args.out) if args.out else (ckpt_path.parents[1] / "eval" if ckpt_path else Path("runs/eval"))
    out.mkdir(parents=True, exist_ok=True)
    results, samples = {}, []
    for bench in [b.strip() for b in args.bench.split(",") if b.strip()]:
        tasks, score = load_bench_tasks(bench, trainer.source, cfg.task, args.limit or cfg.eval.limit, args.strict)
        if not tasks:
            raise ConfigError(f"--bench {bench}: no tasks loaded")
        rep, groups = repeat_tasks(tasks, n)
        episodes = trainer.rollout(rep, groups, temperature=cfg.eval.temperature, seed=cfg.seed, score=score)
        summary = summarize_episodes(episodes, ks, bench=bench)
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
                                      for t in e.turns]})
    return results, samples, ckpt_path, out
