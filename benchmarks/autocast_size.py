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

``--decode``: the in-process engine's decode step alone, bf16 autocast vs float32, tiny Llamas of
hidden 128 / 192 / 256 / 384 / 576 (4 layers, 32-wide heads, MLP 3x), 64 and 16 rows, prompts of 18/24 tokens, 40
new tokens; process CPU, median of 5 alternated engine calls. It sets ``AUTO_BF16_MIN_HIDDEN`` (rollout/engine.py):
under ``auto`` narrower models decode in float32.

    python benchmarks/autocast_size.py --decode
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _benchutil import (RESULTS, ab, command_line, fmt, fmt_table, print_header, run_worker,  # noqa: E402
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


def decode_by_width(widths=(128, 192, 256, 384, 576), rows_list=(64, 16), reps: int = 5) -> None:
    """Engine calls (40 new tokens, no stop token) under bf16 autocast vs float32 on tiny Llamas by width."""
    import torch

    from masrl.models.tiny import build_char_tokenizer, build_tiny_model
    from masrl.rollout.engine import GenRequest, TransformersEngine

    set_threads(1)
    info = print_header(1)
    tok = build_char_tokenizer()
    g = torch.Generator().manual_seed(0)
    table, raw = [], []
    for hidden in widths:
        heads = hidden // 32
        model = build_tiny_model(tok, {"hidden_size": hidden, "num_hidden_layers": 4, "num_attention_heads": heads,
                                       "num_key_value_heads": heads, "intermediate_size": 3 * hidden}, seed=0).eval()
        for rows in rows_list:
            reqs = [GenRequest(torch.randint(10, 100, (18 + (i % 2) * 6,), generator=g).tolist(), 1.0, 1.0, 40)
                    for i in range(rows)]
            engines = {p: TransformersEngine(model, eos_token_ids=[10**6], pad_token_id=2, autocast=p)
                       for p in ("float32", "bfloat16")}
            res = ab({p: (lambda e=e: e.generate(reqs)) for p, e in engines.items()}, reps, clock=time.process_time)
            med = {p: 1000 * v["median_s"] / 40 for p, v in res.items()}
            table.append([hidden, rows, fmt(med["float32"]), fmt(med["bfloat16"]), fmt(med["bfloat16"] / med["float32"])])
            raw.append({"hidden": hidden, "rows": rows, "times": {p: v["times"] for p, v in res.items()}})
            print(f"  hidden {hidden} rows {rows}: {table[-1]}", flush=True)
    print()
    print(fmt_table(["hidden", "rows", "float32 ms / decode step", "bf16 ms / decode step", "bf16 / float32"], table))
    path = RESULTS / "autocast_size_decode.json"
    write_json(path, {"command": command_line(), "machine": info, "runs": raw, "rows": table})
    print(f"\nwritten {path}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, nargs="+", default=[128, 256, 384, 576])
    ap.add_argument("--steps", type=int, default=3, help="timed steps per run (after one warm-up step)")
    ap.add_argument("--repeats", type=int, default=1, help="runs per (width, precision), alternated")
    ap.add_argument("--worker-json", help=argparse.SUPPRESS)
    ap.add_argument("--hidden-size", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--autocast", help=argparse.SUPPRESS)
    ap.add_argument("--decode", action="store_true", help="the engine's decode step alone, by width")
    a = ap.parse_args(argv)
    if a.decode:
        decode_by_width()
        return
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
