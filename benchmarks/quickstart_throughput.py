"""Throughput of the quickstart RL step (examples/quickstart.yaml) on CPU.

The quickstart config with SFT skipped (``sft.steps=0``), no evaluation and no logging; the
model is the untrained tiny model, so turns run to their token budget more often than after SFT
(the report gives the turns per episode and tokens per step actually measured). Each run:
build the Trainer, ``--warmup`` untimed ``train_step()`` calls, then ``--steps`` timed ones.

Reported per run (median over its timed steps) and over ``--repeats`` runs (each its own
subprocess, peak RSS = ``ru_maxrss`` of that process):

* seconds per RL step (wall time of ``train_step``; and its process CPU time, which other jobs on a
  shared machine inflate less), split into rollout and update
  (``perf/rollout_seconds``, ``perf/update_seconds``);
* rollout tokens/s: generated tokens / rollout seconds (``perf/rollout_tokens_per_s``: the whole
  rollout phase, workflows and scoring included) and generated tokens / engine seconds;
* training tokens/s: prompt + response tokens of all turns / update seconds
  (``perf/train_tokens_per_s``);
* engine calls per step and their batch sizes (how well the scheduler batches).

    python benchmarks/quickstart_throughput.py
    python benchmarks/quickstart_throughput.py --steps 5 --repeats 3 --threads 2
    python benchmarks/quickstart_throughput.py --override trainer.batch_size=8   # any config override
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _benchutil import (print_header, REPO, RESULTS, command_line, fmt, fmt_table,  # noqa: E402
                        peak_rss_mib, run_worker, set_threads, spread, write_json)

BASE_OVERRIDES = ["sft.steps=0", "eval.before_after=false", "eval.every=0", "trainer.save_every=0",
                  "logging.tensorboard=false", "logging.progress=false", "logging.plots=false"]


def measure_steps(trainer, warmup: int, steps: int) -> list[dict]:
    """Run warm-up + timed ``train_step`` calls; per step: perf metrics, engine stats, workload."""
    stats = trainer.scheduler.stats
    rollout_cpu = _time_rollout_cpu(trainer)
    out = []
    for i in range(warmup + steps):
        before = (stats.generated_tokens, stats.generate_seconds, stats.engine_calls, len(stats.batch_sizes),
                  stats.decode_steps)
        prefilled = _prefill_tokens(trainer)
        t, c = time.perf_counter(), time.process_time()
        m = trainer.train_step()
        wall, cpu = time.perf_counter() - t, time.process_time() - c
        trainer.step += 1
        out.append({
            "warmup": i < warmup, "step_s": wall, "cpu_s": cpu, "rollout_s": m["perf/rollout_seconds"],
            "update_s": m["perf/update_seconds"], "generate_s": stats.generate_seconds - before[1],
            "generated_tokens": stats.generated_tokens - before[0],
            "trained_tokens": m["perf/train_tokens_per_s"] * m["perf/update_seconds"],
            "engine_calls": stats.engine_calls - before[2], "batch_sizes": stats.batch_sizes[before[3]:],
            "decode_steps": stats.decode_steps - before[4],  # rollout.continuous_batching: engine steps
            "turns_per_episode": m.get("team/turns_per_episode", float("nan")),
            "reward": m.get("team/reward", float("nan")),
            "prefill_tokens": _prefill_tokens(trainer) - prefilled, "rollout_cpu_s": rollout_cpu.pop()})
    return out


def _time_rollout_cpu(trainer) -> list[float]:
    """Record the process CPU seconds of each ``trainer.rollout`` call (wall time is not comparable on a
    shared, loaded machine; with one thread, CPU time is the work done)."""
    seconds: list[float] = []
    rollout = trainer.rollout

    def timed(*args, **kwargs):
        c = time.process_time()
        try:
            return rollout(*args, **kwargs)
        finally:
            seconds.append(time.process_time() - c)

    trainer.rollout = timed
    return seconds


def _prefill_tokens(trainer) -> int:
    """Prompt tokens the in-process engines ran through the model (after prefix reuse); 0 for other engines."""
    return sum(getattr(p.engine, "prefill_tokens", 0) for p in trainer.policies.values())


def summarize(steps: list[dict]) -> dict:
    timed = [s for s in steps if not s["warmup"]]
    med = lambda k: statistics.median(s[k] for s in timed)  # noqa: E731
    tot = lambda k: sum(s[k] for s in timed)  # noqa: E731
    return {"step_s": med("step_s"), "cpu_s": med("cpu_s"), "rollout_s": med("rollout_s"), "update_s": med("update_s"),
            "generate_s": med("generate_s"),
            "rollout_tok_s": tot("generated_tokens") / tot("rollout_s"),
            "rollout_tok_cpu_s": tot("generated_tokens") / tot("rollout_cpu_s") if all(
                "rollout_cpu_s" in s for s in timed) else float("nan"),
            "rollout_cpu_s": med("rollout_cpu_s") if all("rollout_cpu_s" in s for s in timed) else float("nan"),
            "engine_tok_s": tot("generated_tokens") / tot("generate_s"),
            "train_tok_s": tot("trained_tokens") / tot("update_s"),
            "generated_tokens_per_step": tot("generated_tokens") / len(timed),
            "trained_tokens_per_step": tot("trained_tokens") / len(timed),
            "engine_calls_per_step": tot("engine_calls") / len(timed),
            "prefill_tokens_per_step": sum(s.get("prefill_tokens", 0) for s in timed) / len(timed),
            # continuous batching makes no batched engine calls: no batch sizes, decode steps instead
            "mean_batch": statistics.fmean(b for s in timed for b in s["batch_sizes"]) if any(
                s["batch_sizes"] for s in timed) else float("nan"),
            "decode_steps_per_step": sum(s.get("decode_steps", 0) for s in timed) / len(timed),
            "turns_per_episode": statistics.fmean(s["turns_per_episode"] for s in timed)}


def worker_main(a) -> None:
    set_threads(a.threads)
    from masrl.config import load_config
    from masrl.trainer import Trainer

    cfg = load_config(a.config, BASE_OVERRIDES + [f"trainer.threads={a.threads}"] + a.override)
    t = time.perf_counter()
    trainer = Trainer(cfg, progress=False)
    load_s = time.perf_counter() - t
    steps = measure_steps(trainer, a.warmup, a.steps)
    Path(a.worker_json).write_text(json.dumps({"steps": steps, "load_s": load_s, "peak_rss_mib": peak_rss_mib(),
                                               "episodes_per_step": cfg.trainer.batch_size * cfg.trainer.group_size}))


ROWS = [("step_s", "seconds per RL step"), ("cpu_s", "  process CPU seconds per RL step (robust to load)"),
        ("rollout_s", "  rollout seconds"), ("update_s", "  update seconds"),
        ("generate_s", "  engine (generation) seconds"), ("rollout_tok_s", "rollout tokens/s (whole rollout phase)"),
        ("engine_tok_s", "rollout tokens/s (engine only)"), ("train_tok_s", "training tokens/s (prompt+response)"),
        ("peak_rss_mib", "peak RSS MiB"), ("generated_tokens_per_step", "generated tokens per step"),
        ("trained_tokens_per_step", "trained tokens per step"), ("engine_calls_per_step", "engine calls per step"),
        ("mean_batch", "mean engine batch (rows)"), ("turns_per_episode", "turns per episode")]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(REPO / "examples" / "quickstart.yaml"))
    ap.add_argument("--override", action="append", default=[], help="extra dotted config override (repeatable)")
    ap.add_argument("--steps", type=int, default=3, help="timed RL steps per run")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2, help="runs (each a fresh process)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker-json", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        return worker_main(a)

    info = print_header(a.threads)
    args = ["--config", a.config, "--steps", str(a.steps), "--warmup", str(a.warmup), "--threads", str(a.threads)]
    for o in a.override:
        args += ["--override", o]
    runs = []
    for r in range(a.repeats):
        run = run_worker(Path(__file__), ["--worker", *args])
        run["summary"] = {**summarize(run["steps"]), "peak_rss_mib": run["peak_rss_mib"]}
        runs.append(run)
        s = run["summary"]
        print(f"  run {r + 1}/{a.repeats}: {s['step_s']:.2f} s/step (cpu {s['cpu_s']:.2f}, rollout {s['rollout_s']:.2f}, update "
              f"{s['update_s']:.2f}), {s['rollout_tok_s']:.0f} rollout tok/s, {s['train_tok_s']:.0f} train tok/s, "
              f"peak RSS {s['peak_rss_mib']:.0f} MiB", flush=True)
    table = {k: spread([r["summary"][k] for r in runs]) for k, _ in ROWS}
    res = {"command": command_line(), "machine": info, "config": a.config, "overrides": BASE_OVERRIDES + a.override,
           "episodes_per_step": runs[0]["episodes_per_step"], "runs": runs, "table": table}
    print(f"\n### quickstart RL step ({runs[0]['episodes_per_step']} episodes/step, SFT skipped), "
          f"{a.steps} timed steps x {a.repeats} runs\n")
    print(fmt_table(["quantity", "median", "min", "max"],
                    [[label, fmt(table[k]["median"]), fmt(table[k]["min"]), fmt(table[k]["max"])] for k, label in ROWS]))
    path = RESULTS / "quickstart_throughput.json"
    write_json(path, res)
    print(f"\nwritten {path}")


if __name__ == "__main__":
    main()
