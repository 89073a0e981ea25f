"""What oneDNN's kernel caches hold over a run's RL steps, and what capping them costs in step time.

    python benchmarks/primitive_cache.py CONFIG.yaml [--capacity default 64 16 ...] [--steps N] [--rounds R]
        [--out FILE.json] [OVERRIDES ...]

Each capacity runs in its own process (the libraries read it before their first product): the team of ``CONFIG``
with the memory defaults ``masrl train`` would choose, no SFT and no evaluations, ``--steps`` RL steps (default 6);
the capacity goes to ``trainer.primitive_cache`` (``default``: null, the libraries' 1024 entries each; the
environment's own capacity variables are removed for every arm). After each step the heap's free memory is handed
back (``malloc_trim(0)``) and one line gives the step's wall and process-CPU seconds, the resident set and glibc's
live bytes (``mallinfo2``: ``uordblks + hblkhd``): what stays between steps. ``--rounds R`` runs the capacities
R times, alternated. Linux with glibc only.

    python benchmarks/primitive_cache.py examples/smollm2_arith_team.yaml --capacity default 64 --steps 6 \\
        trainer.threads=1

``python benchmarks/primitive_cache.py --cycle [--capacity default 16 ...] [--shapes N]`` times what an eviction
costs instead: N bf16 products ``[64 + 7 i, 576] @ [576, 1536]`` (default 64 shapes), cycled 20 times after one
untimed pass, each capacity its own process; ms per product and what glibc's live bytes grew by (the
kernels the caches keep).
"""
from __future__ import annotations

import ctypes
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from masrl.runtime.malloc import PRIMITIVE_CACHE_VARS

HERE = Path(__file__).resolve().parent


def _libc():
    """glibc, with ``mallinfo2`` typed (``eval_memory._MallInfo2``, this folder)."""
    sys.path.insert(0, str(HERE))
    from eval_memory import _MallInfo2

    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = _MallInfo2
    return libc


def _live_mib(libc) -> float:
    """glibc's live bytes in MiB: ``uordblks + hblkhd``."""
    info = libc.mallinfo2()
    return (info.uordblks + info.hblkhd) / 2**20


def _arm(config: str, capacity: str, steps: int, overrides: list[str]) -> list[dict]:
    """One capacity in this process: the steps' lines."""
    sys.path.insert(0, str(HERE))
    from phase_memory import _status
    from masrl.config import load_config
    from masrl.plan.memory import announce_memory_defaults
    from masrl.trainer import Trainer

    libc = _libc()
    cache = "null" if capacity == "default" else capacity
    cfg = load_config(config, ["sft.steps=0", "logging.progress=false", "eval.before_after=false",
                               f"trainer.total_steps={steps}", f"trainer.primitive_cache={cache}", *overrides])
    announce_memory_defaults(cfg)
    trainer = Trainer(cfg, progress=False)
    step, lines = trainer.train_step, []

    def timed():
        wall, cpu = time.perf_counter(), time.process_time()
        out = step()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        libc.malloc_trim(ctypes.c_size_t(0))
        line = {"capacity": capacity, "step": len(lines) + 1, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
                "rss_mib": round(_status("VmRSS")), "live_mib": round(_live_mib(libc))}
        print(json.dumps(line), flush=True)
        lines.append(line)
        return out

    trainer.train_step = timed
    trainer.fit(overwrite=True)  # each arm its own run in the same folder
    return lines


def _cycle(capacity: str, shapes: int) -> dict:
    """One capacity in this process: ms per bf16 product over ``shapes`` shapes cycled 20 times."""
    if capacity != "default":
        from masrl.runtime.malloc import cap_primitive_caches

        cap_primitive_caches(int(capacity))
    import torch

    libc = _libc()
    torch.set_num_threads(1)
    w = torch.randn(576, 1536, dtype=torch.bfloat16)
    xs = [torch.randn(64 + 7 * i, 576, dtype=torch.bfloat16) for i in range(shapes)]
    before = _live_mib(libc)
    for x in xs:
        x @ w
    start = time.perf_counter()
    for _ in range(20):
        for x in xs:
            x @ w
    ms = (time.perf_counter() - start) / 20 / shapes * 1e3
    return {"capacity": capacity, "shapes": shapes, "ms_per_product": round(ms, 3),
            "kernels_mib": round(_live_mib(libc) - before, 1)}


def _machine() -> dict:
    """Where and when: the CPU, torch, masrl's commit (where this is a git checkout), the date, the load."""
    import platform

    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True)
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__,
            "commit": commit.stdout.strip() or None, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "load": os.getloadavg()[0]}


def _values(args: list[str]) -> list[str]:
    """The capacities at the start of ``args``: up to the next option or ``key=value`` override."""
    return list(itertools.takewhile(lambda v: not v.startswith("-") and "=" not in v, args))


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--cycle-arm":
        print(json.dumps(_cycle(argv[1], int(argv[2]))))
        return 0
    if argv and argv[0] == "--cycle":
        capacities, shapes = ["default", "16"], 64
        rest = argv[1:]
        for i, arg in enumerate(rest):
            if arg == "--shapes":
                shapes = int(rest[i + 1])
            elif arg == "--capacity":
                capacities = _values(rest[i + 1:])
        env = {k: v for k, v in os.environ.items() if k not in PRIMITIVE_CACHE_VARS}
        for capacity in capacities:
            proc = subprocess.run([sys.executable, __file__, "--cycle-arm", capacity, str(shapes)], env=env,
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                print(proc.stderr[-3000:], file=sys.stderr)
                return proc.returncode
            print(proc.stdout.strip().splitlines()[-1], flush=True)
        return 0
    if argv and argv[0] == "--arm":
        _, config, capacity, steps, *overrides = argv
        _arm(config, capacity, int(steps), overrides)
        return 0
    config, *rest = argv
    capacities, steps, rounds, out, overrides = ["default", "64"], 6, 1, None, []
    i = 0
    while i < len(rest):
        arg = rest[i]
        if arg == "--capacity":
            capacities = _values(rest[i + 1:])
            i += len(capacities)
        elif arg in ("--steps", "--rounds", "--out"):
            value, i = rest[i + 1], i + 1
            if arg == "--out":
                out = value
            elif arg == "--steps":
                steps = int(value)
            else:
                rounds = int(value)
        else:
            overrides.append(arg)
        i += 1
    env = {k: v for k, v in os.environ.items() if k not in PRIMITIVE_CACHE_VARS}
    results = []
    for r in range(rounds):
        for capacity in capacities:
            proc = subprocess.run([sys.executable, __file__, "--arm", config, capacity, str(steps), *overrides],
                                  env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                print(proc.stderr[-3000:], file=sys.stderr)
                return proc.returncode
            lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith('{"capacity"')]
            for line in lines:
                line["round"] = r + 1
                print(json.dumps(line), flush=True)
            results += lines
    for capacity in capacities:
        mine = [x for x in results if x["capacity"] == capacity]
        print(f"{capacity:>8}: live after the steps {min(x['live_mib'] for x in mine)}-"
              f"{max(x['live_mib'] for x in mine)} MiB, resident {min(x['rss_mib'] for x in mine)}-"
              f"{max(x['rss_mib'] for x in mine)} MiB, CPU s per step {sum(x['cpu_s'] for x in mine) / len(mine):.1f}")
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps({"command": " ".join(["python", "benchmarks/primitive_cache.py", *argv]),
                                         "machine": _machine(), "steps": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
