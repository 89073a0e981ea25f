"""Rollout cost of the gateway: one rollout of the same tasks by the built-in quickstart team and by the same team as
an OpenAI-API program (examples/openai_client_team.yaml), each in its own process, alternately (A B A B ...).
Reports wall seconds, process CPU seconds (every thread: the gateway's server threads and the openai client
included), generated tokens and model calls, and the program's CPU per call over the built-in team's.

    PYTHONPATH=src python3 benchmarks/gateway_overhead.py --tasks 64 --repeats 2

Untrained model (no SFT): both arms sample from the same weights; the reply lengths differ between the arms only
by sampling.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

from _benchutil import print_header

ARMS = {"builtin": "examples/quickstart.yaml", "openai_client": "examples/openai_client_team.yaml"}


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def one(arm: str, tasks: int, out: str) -> dict:
    import torch

    from masrl.config import load_config
    from masrl.trainer import Trainer

    torch.set_num_threads(1)
    cfg = load_config(ARMS[arm], ["sft.steps=0", "logging.progress=false", f"output_dir={out}"])
    with Trainer(cfg, progress=False) as tr:
        tr.rollout(tr.source.train[:8], list(range(8)), seed=1)  # warm: imports, the gateway, the program
        t, c = time.perf_counter(), _cpu()
        episodes = tr.rollout(tr.source.train[:tasks], list(range(tasks)), seed=1)
        wall, cpu = time.perf_counter() - t, _cpu() - c
    return {"arm": arm, "wall_s": wall, "cpu_s": cpu, "tokens": sum(len(t.response_ids) for e in episodes for t in e.turns),
            "calls": sum(len(e.turns) for e in episodes), "errors": sum(e.error is not None for e in episodes)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default="/tmp/masrl_gateway_overhead")
    p.add_argument("--one", choices=sorted(ARMS), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.one, args.tasks, f"{args.out}/{args.one}")))
        return 0
    print_header(threads=1)
    results: dict[str, list[dict]] = {a: [] for a in ARMS}
    for _ in range(args.repeats):
        for arm in ARMS:
            got = subprocess.run([sys.executable, __file__, "--one", arm, "--tasks", str(args.tasks), "--out", args.out],
                                 capture_output=True, text=True, check=True)
            results[arm].append(json.loads(got.stdout.strip().splitlines()[-1]))
            r = results[arm][-1]
            print(f"{arm:>13}: wall {r['wall_s']:.2f} s, cpu {r['cpu_s']:.2f} s, {r['tokens']} tokens, {r['calls']} calls, "
                  f"{r['errors']} failed episodes; {1000 * r['cpu_s'] / r['calls']:.1f} ms cpu per call, "
                  f"{r['tokens'] / r['cpu_s']:.0f} tokens per cpu second", flush=True)
    per_call = {a: sum(r["cpu_s"] for r in rs) / sum(r["calls"] for r in rs) for a, rs in results.items()}
    tps = {a: sum(r["tokens"] for r in rs) / sum(r["cpu_s"] for r in rs) for a, rs in results.items()}
    print(f"program cpu per call over the built-in team's: +{1000 * (per_call['openai_client'] - per_call['builtin']):.1f} ms; "
          f"tokens per cpu second, program / built-in: {tps['openai_client'] / tps['builtin']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
