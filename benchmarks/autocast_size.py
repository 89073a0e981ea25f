"""bf16 autocast vs float32 by model width: where does ``trainer.autocast: bfloat16`` start to pay on this CPU?

The vs_trl tiny workload (single-agent GRPO on synthetic arithmetic, B=8 prompts x G=8, 40 new tokens, the
quickstart's terse prompt, character tokenizer) on tiny Llamas of hidden size 128 / 256 / 384 / 576 (4 layers,
head dim 64 as SmolLM2 — 2 / 4 / 6 / 9 heads, 3 key/value heads where the heads divide by 3 —, MLP 8/3 x the
width), each configuration in its own process, ``trainer.autocast`` float32 and bfloat16 alternated per
width. Reports process CPU seconds per RL step (median of the timed steps, after one warm-up step), rollout
and update separately, and the bf16 / float32 ratio. The result decides ``trainer.autocast: auto``'s size
rule (masrl.models.precision).

    python benchmarks/autocast_size.py                    # 4 widths, 3 timed steps each
    python benchmarks/autocast_size.py --hidden 128 576 --steps 2 --repeats 2
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _benchutil import (RESULTS, command_line, fmt, fmt_table, print_header, run_worker,  # noqa: E402
                        set_threads, spread, write_json)
from vs_trl import TASK_PARAMS, TERSE_SOLVER  # noqa: E402


def arch(hidden: int) -> dict:
    heads = hidden // 64
    return {"hidden_size": hidden, "num_hidden_layers": 4, "num_attention_heads": heads,
            "num_key_value_heads": 3 if heads % 3 == 0 else heads, "intermediate_size": hidden * 8 // 3}


def worker(a) -> dict:
    from masrl.config import config_from_dict
    from masrl.trainer import Trainer

    cfg = config_from_dict({
        "name": "bench-autocast-size", "seed": 0, "output_dir": str(Path(tempfile.gettempdir()) / "masrl-bench-unused"),
        "task": {"name": "arithmetic", "params": TASK_PARAMS},
        "workflow": {"name": "single", "prompts": {"Solver": TERSE_SOLVER}},
        "agents": {"Solver": {"policy": "policy", "temperature": 1.0, "top_p": 1.0, "max_new_tokens": 40}},
        "policies": {"policy": {"tiny": arch(a.hidden_size), "optim": {"lr": 1e-4, "weight_decay": 0.0}}},
        "algorithm": {"estimator": "grpo", "format_penalty": 0.0},
        "sft": {"steps": 0},
        "trainer": {"total_steps": 1 + a.steps, "batch_size": 8, "group_size": 8, "threads": 1,
                    "autocast": a.autocast},
        "eval": {"before_after": False},
        "logging": {"tensorboard": False, "progress": False, "plots": False},
    })
    trainer = Trainer(cfg, progress=False)
    steps = []
    for i in range(1 + a.steps):
        c = time.process_time()
        m = trainer.train_step()
        cpu = time.process_time() - c
        trainer.step += 1
        if i:  # the first step warms up
            steps.append({"cpu_s": cpu, "rollout_s": m["perf/rollout_seconds"], "update_s": m["perf/update_seconds"],
                          "step_s": m["perf/step_seconds"]})
    params = sum(p.numel() for p in trainer.policies["policy"].model.parameters())
    return {"steps": steps, "params": params}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, nargs="+", default=[128, 256, 384, 576])
    ap.add_argument("--steps", type=int, default=3, help="timed steps per run (after one warm-up step)")
    ap.add_argument("--repeats", type=int, default=1, help="runs per (width, precision), alternated")
    ap.add_argument("--worker-json", help=argparse.SUPPRESS)
    ap.add_argument("--hidden-size", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--autocast", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker_json:
        set_threads(1)
        Path(a.worker_json).write_text(json.dumps(worker(a)))
        return
    info = print_header(1)
    rows, raw = [], {}
    for hidden in a.hidden:
        runs = {"float32": [], "bfloat16": []}
        for _ in range(a.repeats):
            for precision in runs:
                out = run_worker(Path(__file__), ["--hidden-size", str(hidden), "--autocast", precision,
                                                  "--steps", str(a.steps)])
                runs[precision].append(out)
        raw[hidden] = runs
        med = {p: {k: spread([s[k] for r in rs for s in r["steps"]])["median"] for k in ("cpu_s", "rollout_s", "update_s")}
               for p, rs in runs.items()}
        rows.append([hidden, f"{runs['float32'][0]['params'] / 1e6:.2f}M",
                     *(fmt(med[p][k]) for p in ("float32", "bfloat16") for k in ("cpu_s", "rollout_s", "update_s")),
                     fmt(med["bfloat16"]["cpu_s"] / med["float32"]["cpu_s"])])
        print(f"  hidden {hidden}: {rows[-1]}", flush=True)
    print()
    print(fmt_table(["hidden", "params", "fp32 CPU s/step", "fp32 rollout s", "fp32 update s",
                     "bf16 CPU s/step", "bf16 rollout s", "bf16 update s", "bf16 / fp32 CPU"], rows))
    path = RESULTS / "autocast_size.json"
    write_json(path, {"command": command_line(), "machine": info, "runs": raw, "rows": rows})
    print(f"\nwritten {path}")


if __name__ == "__main__":
    main()
