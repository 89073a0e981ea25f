"""Process CPU of one masrl update on SmolLM2-135M under three variants, each in its own process, alternated:

* ``autocast``: the shipped path (float32 weights, bf16 autocast: every weight and activation cast per forward);
* ``bf16-weights``: the model in bf16 without autocast (no float32<->bf16 copies; fused AdamW on bf16 weights);
* ``compile-mlp``: the shipped path with ``torch.compile`` (inductor, ``dynamic=True``) on every layer's MLP and two
  RMSNorms (fused elementwise kernels; not bitwise).

8 rows of 100 random prompt tokens + 32 response tokens (as ``profile_update_smollm2.py``), GRPO/PPO token-mean
loss; one untimed update (it compiles), then ``--updates`` timed ones. Not wired into masrl: a measurement of what
the update's remaining time is made of (benchmarks/RESULTS.md, "masrl vs TRL").

    python benchmarks/update_variants_smollm2.py --rounds 2
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _benchutil import REPO, print_header, set_threads  # noqa: E402

VARIANTS = ("autocast", "bf16-weights", "compile-mlp")


def worker(variant: str, updates: int) -> dict:
    set_threads(1)
    import torch

    from masrl.config import AlgorithmConfig, PolicyConfig, TrainerConfig
    from masrl.models.smollm import smollm2_path
    from masrl.training.policy import build_policy
    from masrl.training.update import Row, update_policy

    policy = build_policy("p", PolicyConfig(model=str(smollm2_path()), optim={"lr": 1e-6, "fused": True}),
                          seed=0, max_rollout_batch=64)
    if variant == "bf16-weights":
        policy.model.to(torch.bfloat16)
        policy.optimizer = torch.optim.AdamW(policy.model.parameters(), lr=1e-6, fused=True)
    if variant == "compile-mlp":
        for layer in policy.model.model.layers:
            for module in (layer.mlp, layer.input_layernorm, layer.post_attention_layernorm):
                module.forward = torch.compile(module.forward, dynamic=True)
    rng = random.Random(0)
    rows = [Row("A", [rng.randrange(10, 40000) for _ in range(100)], [rng.randrange(10, 40000) for _ in range(32)],
                [-1.0] * 32, rng.choice([-1.0, 1.0]), 1.0, policy="p") for _ in range(8)]
    trainer = TrainerConfig(autocast="float32" if variant == "bf16-weights" else "bfloat16")
    algo = AlgorithmConfig(estimator="grpo")
    update_policy(policy, rows, algo, trainer, step=0, seed=0)
    times = []
    for i in range(updates):
        c = time.process_time()
        update_policy(policy, rows, algo, trainer, step=1 + i, seed=0)
        times.append(time.process_time() - c)
    return {"variant": variant, "update_cpu_s": times}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2, help="invocations per variant, alternated")
    ap.add_argument("--updates", type=int, default=3, help="timed updates per invocation")
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    ap.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.updates)))
        return
    print_header(threads=1)
    results = {v: [] for v in args.variants}
    for r in range(args.rounds):
        for v in args.variants:
            out = subprocess.run([sys.executable, __file__, "--worker", v, "--updates", str(args.updates)],
                                 capture_output=True, text=True, cwd=REPO, check=True)
            times = json.loads(out.stdout.strip().splitlines()[-1])["update_cpu_s"]
            results[v].extend(times)
            print(f"round {r} {v:13s} update CPU s: {', '.join(f'{t:.2f}' for t in times)}", flush=True)
    for v, ts in results.items():
        print(f"{v:13s} min {min(ts):.2f}  median {sorted(ts)[len(ts) // 2]:.2f}  max {max(ts):.2f} s CPU ({len(ts)} updates)")


if __name__ == "__main__":
    main()
