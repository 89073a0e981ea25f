"""``trainer.compile``: the update with compiled decoder layers vs eager, alternated in one process.

Measures, on the quickstart's tiny model (or ``--model smollm2``-shaped random weights, ``--hidden`` etc.), with
rows shaped like a quickstart step (``--rows`` rows, prompts 12-60 and responses 4-40 tokens, fresh lengths
every update):

* exactness: the update's token log-probs and loss, compiled vs eager, on the same weights and rows;
* compile time: the first two compiled updates (the static graph, then the shape-generic one) minus two
  steady ones (cold: a fresh inductor cache folder unless ``--cache-dir``);
* steady process CPU seconds per update (load-resistant), eager and compiled alternated (E C E C ...), and the
  break-even number of updates
  (compile seconds / seconds saved per update).

    nice -n 10 python benchmarks/compile_layers.py --updates 6
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _rows(seed: int, n: int):
    from masrl.training.update import Row

    r = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [r.randrange(20, 100) for _ in range(r.randint(12, 60))]
        resp = [r.randrange(20, 100) for _ in range(r.randint(4, 40))]
        out.append(Row("Solver", prompt, resp, [-3.0] * len(resp), 1.0 if i % 2 else -1.0, policy="shared"))
    return out


def _policy(arch: dict, compile_setting: str, autocast: str = "float32"):
    from masrl.config import config_from_dict
    from masrl.training.policy import build_policy

    cfg = config_from_dict({"task": {"name": "arithmetic"}, "workflow": {"name": "math_solver_verifier"},
                            "agents": {"Solver": {"policy": "shared"}, "Verifier": {"policy": "shared"}},
                            "policies": {"shared": {"model": "tiny", "tiny": arch,
                                                    "optim": {"lr": 1e-4, "weight_decay": 0.0}}},
                            "trainer": {"compile": compile_setting, "autocast": autocast,
                                        "logprob_chunk_tokens": 0, "total_steps": 10_000}})
    return cfg, build_policy("shared", cfg.policies["shared"], seed=0, max_rollout_batch=8)


def compiled_vs_eager(policy, trainer, chunk) -> dict:
    """One micro-batch through the trainer's forward and backward, eager then compiled: the largest log-prob
    difference, both losses, and the largest gradient difference relative to the gradient's largest entry."""
    from masrl.training.update import pack_rows, policy_logprobs, trainer_forward

    batch = pack_rows(chunk, 0)
    got = {}
    for mode in (False, True):
        policy.compile_layers = mode
        with trainer_forward(policy, chunk):
            logp, _ = policy_logprobs(policy, batch, trainer, entropy_grad=False)
        loss = (logp * batch.response_mask).sum()
        policy.model.zero_grad()
        loss.backward()
        got[mode] = (logp.detach(), loss.item(), [p.grad.clone() for p in policy.model.parameters()])
    mask = batch.response_mask.bool()
    return {"max_abs_logprob_diff": float((got[True][0] - got[False][0])[mask].abs().max()),
            "loss_eager": got[False][1], "loss_compiled": got[True][1],
            "max_rel_grad_diff": max(float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))
                                     for a, b in zip(got[True][2], got[False][2]))}


def exactness(arch: dict, autocast: str, seed: int = 0) -> dict:
    from masrl.training.update import micro_batches

    cfg, policy = _policy(arch, "on", autocast)
    parts = [compiled_vs_eager(policy, cfg.trainer, chunk)
             for chunk in micro_batches(_rows(seed, 48), cfg.trainer.micro_batch_tokens)[:3]]
    return {key: max(part[key] for part in parts) if key.startswith("max") else parts[-1][key] for key in parts[0]}


def timing(arch: dict, updates: int, rows: int, autocast: str) -> dict:
    from masrl.training.update import update_policy

    cfg, eager = _policy(arch, "off", autocast)
    cfg_on, comp = _policy(arch, "on", autocast)  # its own trainer.compile: on (the update resolves it from there)
    first, first_wall = [], []
    for i in range(2):  # cold, then a second shape (the shape-generic graph)
        t, w = time.process_time(), time.perf_counter()
        update_policy(comp, _rows(100 + i, rows), cfg.algorithm, cfg_on.trainer, step=i, seed=0)
        first.append(time.process_time() - t)
        first_wall.append(time.perf_counter() - w)
    times = {"eager": [], "compiled": []}
    for i in range(updates):
        for name, policy, trainer in (("eager", eager, cfg.trainer), ("compiled", comp, cfg_on.trainer)):
            t = time.process_time()
            update_policy(policy, _rows(200 + i, rows), cfg.algorithm, trainer, step=i, seed=0)
            times[name].append(time.process_time() - t)
    e, c = statistics.median(times["eager"]), statistics.median(times["compiled"])
    compile_s = sum(first) - 2 * c
    return {"first_two_compiled_updates_s": first, "first_two_compiled_updates_wall_s": first_wall,
            "eager_s": times["eager"], "compiled_s": times["compiled"],
            "median_eager_s": e, "median_compiled_s": c, "ratio": c / e, "compile_s": compile_s,
            "break_even_updates": compile_s / (e - c) if e > c else None}


def main() -> None:
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--updates", type=int, default=6)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--autocast", default="float32", choices=["float32", "bfloat16"],
                    help="trainer.autocast of both policies (bfloat16: CPU autocast, on a CPU with native bf16)")
    ap.add_argument("--cache-dir", default=None, help="inductor cache folder (default: a fresh one: cold)")
    ap.add_argument("--out", default="benchmarks/results/compile_layers.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = args.cache_dir or tempfile.mkdtemp(prefix="inductor-")
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # compile in this process: its CPU time counts
    arch = {"hidden_size": args.hidden, "num_hidden_layers": args.layers, "num_attention_heads": 4,
            "intermediate_size": 3 * args.hidden}
    print("command:", " ".join(sys.argv), "| load before:", os.getloadavg(), flush=True)
    result = {"command": " ".join(sys.argv), "arch": arch, "threads": args.threads, "clock": "process CPU s",
              "autocast": args.autocast,
              "load_before": os.getloadavg(), "timing": timing(arch, args.updates, args.rows, args.autocast)}
    result["exact"] = exactness(arch, args.autocast)
    print("exact:", result["exact"], flush=True)
    result["load_after"] = os.getloadavg()
    print(json.dumps(result["timing"], indent=1), "| load after:", result["load_after"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
