"""torch.profiler trace of one masrl update on SmolLM2-135M: where the update time goes.

8 rows of 100 random prompt tokens + 32 response tokens, GRPO/PPO token-mean loss, fused AdamW,
one warm-up update, then one profiled update. ``--autocast bfloat16`` runs it under
``trainer.autocast``.

    python benchmarks/profile_update_smollm2.py --autocast bfloat16
    python benchmarks/profile_update_smollm2.py            # float32
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _benchutil import print_header, set_threads  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--autocast", choices=["bfloat16"], default=None)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=100)
    ap.add_argument("--response-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--top", type=int, default=20)
    a = ap.parse_args(argv)
    set_threads(a.threads)
    print_header(a.threads)
    from torch.profiler import ProfilerActivity, profile

    from masrl.config import AlgorithmConfig, PolicyConfig, TrainerConfig
    from masrl.models.smollm import smollm2_path
    from masrl.training.policy import build_policy
    from masrl.training.update import Row, update_policy

    policy = build_policy("p", PolicyConfig(model=str(smollm2_path()), optim={"lr": 1e-6, "fused": True}),
                          seed=0, max_rollout_batch=64)
    rng = random.Random(0)
    rows = [Row("A", [rng.randrange(10, 40000) for _ in range(a.prompt_len)],
                [rng.randrange(10, 40000) for _ in range(a.response_len)], [-1.0] * a.response_len,
                rng.choice([-1.0, 1.0]), 1.0, policy="p") for _ in range(a.rows)]
    trainer, algo = TrainerConfig(autocast=a.autocast), AlgorithmConfig(estimator="grpo")
    update_policy(policy, rows, algo, trainer, step=0, seed=0)
    t, c = time.perf_counter(), time.process_time()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        update_policy(policy, rows, algo, trainer, step=1, seed=0)
    print(f"\nprofiled update: {time.perf_counter() - t:.2f} s wall, {time.process_time() - c:.2f} s CPU "
          f"({a.rows} rows x {a.prompt_len + a.response_len} tokens, autocast {a.autocast})\n")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.top))


if __name__ == "__main__":
    main()
