"""How close masrl's training update gets to the machine's matmul peak (CPU roofline).

1. Matmul peak: ``torch.mm`` of square ``n x n`` matrices in float32 and bfloat16 for a few ``n``;
   GFLOP/s = 2 n^3 / time (median of ``--reps``), peak = max over sizes.
2. Achieved: masrl ``Trainer.train_step()`` on SmolLM2-135M-Instruct (``single`` workflow, GRPO,
   ``--B`` prompts x ``--G`` samples, ``--max-new-tokens``), after ``--warmup`` steps. The update
   time is ``perf/update_seconds`` (forward + backward + AdamW, all micro-batches); the trained
   tokens are prompt + response tokens of every row (no padding). FLOPs use the usual
   approximation ``6 * N * T`` (2 forward + 4 backward FLOPs per parameter per token) with
   N = all parameters (tied embedding counted once) and T = trained tokens. Because the trainer
   runs the LM head only on the response (+1) positions (``logits_to_keep``) and the embedding
   lookup costs no FLOPs, the report also gives a refined count: ``6 * N_body * T +
   6 * V * d * (response + 1 per row)`` + attention ``12 * layers * d * sum(L^2)/2`` (causal).
   utilization = achieved / peak of the dtype the update's matmuls run in: bfloat16 under
   ``trainer.autocast`` (``--autocast``, default ``auto``: the shipped default, bfloat16 on a CPU
   with native bf16) or with ``--dtype bfloat16``, else float32.

Each measurement runs in its own subprocess (peak RSS reported).

    python benchmarks/roofline.py
    python benchmarks/roofline.py --threads 2 --B 2 --G 4 --max-new-tokens 32 --dtype bfloat16
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _benchutil import (print_header, RESULTS, command_line, fmt, fmt_table,  # noqa: E402
                        peak_rss_mib, run_worker, set_threads, write_json)

SIZES = [256, 512, 1024, 2048]
TASK_PARAMS = {"train_size": 2000, "test_size": 200, "min_terms": 2, "max_terms": 3, "max_operand": 30}


def matmul_peak(dtype_name: str, sizes, reps: int) -> dict:
    import torch

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
    out = {}
    for n in sizes:
        a = torch.randn(n, n).to(dtype)
        b = torch.randn(n, n).to(dtype)
        torch.mm(a, b)  # warm-up (oneDNN primitive creation)
        inner = max(1, int(2e9 // (2 * n ** 3)))  # ~2 GFLOP per timed sample
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            for _ in range(inner):
                torch.mm(a, b)
            times.append((time.perf_counter() - t) / inner)
        out[n] = 2 * n ** 3 / statistics.median(times) / 1e9
    return {"gflops_by_size": out, "peak_gflops": max(out.values())}


def count_flops(model, rows) -> dict:
    """6·N·T and a refined count for the rows of one update."""
    cfg = model.config
    n_all = sum(p.numel() for p in model.parameters())
    d, layers, vocab = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
    n_embed = vocab * d
    n_body = n_all - n_embed  # tied: the LM head is the embedding matrix
    tokens = sum(len(p) + len(r) for p, r in rows)
    scored = sum(len(r) + 1 for _, r in rows)
    attn_pairs = sum((len(p) + len(r)) ** 2 / 2 for p, r in rows)
    # QK^T and AV: 2 matmuls x 2 FLOPs x d per (query, key) pair, x3 for forward+backward
    attention = 3 * 2 * 2 * layers * d * attn_pairs
    return {"params": n_all, "params_body": n_body, "tokens": tokens, "scored_positions": scored,
            "flops_6NT": 6 * n_all * tokens,
            "flops_refined": 6 * n_body * tokens + 6 * n_embed * scored + attention}


def worker_update(a) -> dict:
    import torch

    from masrl.config import config_from_dict
    from masrl.trainer import Trainer
    from masrl.workflows.single import SINGLE_PROMPTS

    cfg = config_from_dict({
        "name": "bench-roofline", "seed": 0, "output_dir": str(Path(tempfile.gettempdir()) / "masrl-bench-unused"),
        "task": {"name": "arithmetic", "params": TASK_PARAMS},
        "workflow": {"name": "single", "prompts": {"Solver": SINGLE_PROMPTS["Solver"]}},
        "agents": {"Solver": {"policy": "policy", "max_new_tokens": a.max_new_tokens}},
        "policies": {"policy": {"model": a.model, "dtype": a.dtype, "optim": {"lr": 1e-6, "weight_decay": 0.0}}},
        "algorithm": {"estimator": "grpo", "format_penalty": 0.0},
        "trainer": {"batch_size": a.B, "group_size": a.G, "threads": a.threads, "autocast": a.autocast},
        "eval": {"before_after": False},
        "logging": {"tensorboard": False, "progress": False, "plots": False},
    })
    trainer = Trainer(cfg, progress=False)
    model = trainer.policies["policy"].model
    captured = []
    inner_update = trainer.update

    def update(turns, advantages):  # record the rows the update trains on (read only)
        captured.append([(t.prompt_ids, t.response_ids) for t in turns if t.response_ids])
        return inner_update(turns, advantages)

    trainer.update = update
    steps = []
    for i in range(a.warmup + a.steps):
        m = trainer.train_step()
        trainer.step += 1
        fl = count_flops(model, captured[-1])
        steps.append({"warmup": i < a.warmup, "update_s": m["perf/update_seconds"],
                      "rollout_s": m["perf/rollout_seconds"], **fl})
    from masrl.models.precision import resolve_autocast

    compute = resolve_autocast(a.autocast, "cpu") or a.dtype
    return {"steps": steps, "dtype": a.dtype, "compute_dtype": compute, "threads": torch.get_num_threads(),
            "peak_rss_mib": peak_rss_mib()}


def worker_main(a) -> None:
    set_threads(a.threads)
    if a.worker == "matmul":
        res = {d: matmul_peak(d, SIZES, a.reps) for d in ("float32", "bfloat16")}
    else:
        res = worker_update(a)
    Path(a.worker_json).write_text(json.dumps(res))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="masrl model name (alias, folder, 'tiny')")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="policy dtype for the update")
    ap.add_argument("--autocast", default="auto", choices=["auto", "bfloat16", "float32"], help="trainer.autocast")
    ap.add_argument("--B", type=int, default=2)
    ap.add_argument("--G", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=2, help="timed train steps (after --warmup)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5, help="matmul timing repetitions per size")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--worker", choices=["matmul", "update"], help=argparse.SUPPRESS)
    ap.add_argument("--worker-json", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        return worker_main(a)

    info = print_header(a.threads)
    common = ["--threads", str(a.threads), "--reps", str(a.reps), "--model", a.model, "--dtype", a.dtype,
              "--autocast", a.autocast, "--B", str(a.B), "--G", str(a.G), "--max-new-tokens", str(a.max_new_tokens),
              "--steps", str(a.steps), "--warmup", str(a.warmup)]
    # alternate: matmul, update, matmul (the peak is the max of the two matmul runs)
    mm1 = run_worker(Path(__file__), ["--worker", "matmul", *common])
    upd = run_worker(Path(__file__), ["--worker", "update", *common])
    mm2 = run_worker(Path(__file__), ["--worker", "matmul", *common])
    peaks = {}
    for d in ("float32", "bfloat16"):
        by_size = {int(n): max(mm1[d]["gflops_by_size"][n], mm2[d]["gflops_by_size"][n]) for n in mm1[d]["gflops_by_size"]}
        peaks[d] = {"gflops_by_size": by_size, "peak_gflops": max(by_size.values())}
    timed = [s for s in upd["steps"] if not s["warmup"]]
    upd_s = sum(s["update_s"] for s in timed)
    achieved_6nt = sum(s["flops_6NT"] for s in timed) / upd_s / 1e9
    achieved_ref = sum(s["flops_refined"] for s in timed) / upd_s / 1e9
    compute = upd.get("compute_dtype", a.dtype)
    peak = peaks[compute]["peak_gflops"]
    res = {"command": command_line(), "machine": info, "matmul": peaks, "update": upd,
           "achieved_gflops_6NT": achieved_6nt, "achieved_gflops_refined": achieved_ref,
           "utilization_6NT": achieved_6nt / peak, "utilization_refined": achieved_ref / peak}

    print("\n### matmul peak (GFLOP/s, torch.mm n x n, median of reps, best of 2 runs)\n")
    print(fmt_table(["dtype"] + [str(n) for n in SIZES] + ["peak"],
                    [[d] + [fmt(peaks[d]["gflops_by_size"][n]) for n in SIZES] + [fmt(peaks[d]["peak_gflops"])]
                     for d in ("float32", "bfloat16")]))
    s0 = timed[0]
    print(f"\n### masrl update on {a.model} ({a.dtype} weights, {compute} matmuls), B={a.B} x G={a.G}, max_new_tokens={a.max_new_tokens}\n")
    rows = [["parameters N (all / body)", f"{s0['params'] / 1e6:.1f}M / {s0['params_body'] / 1e6:.1f}M"],
            ["trained tokens per step (prompt + response)", fmt(statistics.fmean(s['tokens'] for s in timed))],
            ["update seconds per step (perf/update_seconds)", fmt(upd_s / len(timed))],
            ["achieved GFLOP/s, 6·N·T", fmt(achieved_6nt)],
            ["achieved GFLOP/s, refined (LM head on scored positions + attention)", fmt(achieved_ref)],
            [f"utilization vs {compute} matmul peak ({fmt(peak)} GFLOP/s), 6·N·T", f"{100 * achieved_6nt / peak:.1f}%"],
            [f"utilization vs {compute} matmul peak, refined", f"{100 * achieved_ref / peak:.1f}%"],
            ["peak RSS of the update run (MiB)", fmt(upd["peak_rss_mib"])]]
    print(fmt_table(["quantity", "value"], rows))
    path = RESULTS / f"roofline_{Path(a.model).name}_{a.dtype}.json"
    write_json(path, res)
    print(f"\nwritten {path}")


if __name__ == "__main__":
    main()
