"""Page faults and time with glibc's malloc defaults vs masrl's settings (``masrl.runtime.malloc``).

Every measurement runs in its own process (the settings are process-wide and cannot be undone), alternating
``default``, ``tuned``, ``default``, ``tuned``, ...; process CPU time and minor page faults
(``getrusage``) per operation:

* ``op``: ``y = x.pow(2); z = y * x`` on a float32 ``[8, 132, 576]`` activation (SmolLM2-135M's width,
  2.4 MB), 400 ops;
* ``big``: a float32 ``[49152, 576]`` clone (SmolLM2's LM head, 113 MB), 5 clones;
* ``update`` (``--update``, needs the SmolLM2 copy): masrl updates of SmolLM2-135M-Instruct, 8 rows of 100
  prompt + 32 response tokens, bf16 autocast, one warm-up update and ``--updates`` timed ones.

    python benchmarks/malloc_faults.py                 # op + big, 3 processes per setting
    python benchmarks/malloc_faults.py --update --repeats 2 --updates 5
"""
from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _benchutil import RESULTS, command_line, print_header, run_worker, set_threads, write_json  # noqa: E402


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _measure(fn, n: int) -> dict:
    fn()
    f, c = _faults(), time.process_time()
    for _ in range(n):
        fn()
    return {"cpu_ms": (time.process_time() - c) / n * 1e3, "faults": (_faults() - f) / n}


def worker(a) -> dict:
    if a.malloc == "tuned":
        from masrl.runtime.malloc import tune_malloc

        tune_malloc()
    set_threads(1)
    import torch

    out = {}
    if a.section == "micro":
        x = torch.randn(8, 132, 576)
        w = torch.randn(49152, 576)

        def op():
            y = x.pow(2)
            y.mul(x)

        out["op"] = _measure(op, 400)
        out["big"] = _measure(lambda: w.clone(), 5)
        return out
    from masrl.config import AlgorithmConfig, PolicyConfig, TrainerConfig
    from masrl.models.smollm import smollm2_path
    from masrl.training.policy import build_policy
    from masrl.training.update import Row, update_policy

    policy = build_policy("p", PolicyConfig(model=str(smollm2_path()), optim={"lr": 1e-6, "fused": True}),
                          seed=0, max_rollout_batch=64)
    rng = random.Random(0)
    rows = [Row("A", [rng.randrange(10, 40000) for _ in range(100)], [rng.randrange(10, 40000) for _ in range(32)],
                [-1.0] * 32, rng.choice([-1.0, 1.0]), 1.0, policy="p") for _ in range(8)]
    trainer, algo = TrainerConfig(autocast="bfloat16"), AlgorithmConfig(estimator="grpo")
    update_policy(policy, rows, algo, trainer, step=0, seed=0)
    per = []
    for s in range(1, a.updates + 1):
        f, c = _faults(), time.process_time()
        update_policy(policy, rows, algo, trainer, step=s, seed=0)
        per.append({"cpu_s": time.process_time() - c, "faults": _faults() - f})
    out["update"] = {"cpu_s": statistics.median(p["cpu_s"] for p in per),
                     "faults": statistics.median(p["faults"] for p in per), "each": per}
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="processes per setting (alternated)")
    ap.add_argument("--update", action="store_true", help="also SmolLM2-135M updates (slow: ~1 min per process)")
    ap.add_argument("--updates", type=int, default=5)
    ap.add_argument("--worker-json", help=argparse.SUPPRESS)
    ap.add_argument("--malloc", choices=["default", "tuned"], help=argparse.SUPPRESS)
    ap.add_argument("--section", choices=["micro", "update"], help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker_json:
        Path(a.worker_json).write_text(json.dumps(worker(a)))
        return
    print_header(1)
    sections = ["micro"] + (["update"] if a.update else [])
    runs = {(s, m): [] for s in sections for m in ("default", "tuned")}
    for _ in range(a.repeats):
        for s in sections:
            for m in ("default", "tuned"):
                runs[s, m].append(run_worker(Path(__file__), ["--malloc", m, "--section", s,
                                                              "--updates", str(a.updates)]))
    rows, result = [], {"command": command_line(), "runs": {f"{s}/{m}": r for (s, m), r in runs.items()}}
    for s in sections:
        for key in (["op", "big"] if s == "micro" else ["update"]):
            unit = "cpu_s" if key == "update" else "cpu_ms"
            cell = {}
            for m in ("default", "tuned"):
                vals = [r[key][unit] for r in runs[s, m]]
                faults = [r[key]["faults"] for r in runs[s, m]]
                cell[m] = (f"{statistics.median(vals):.3g} ({min(vals):.3g}-{max(vals):.3g})",
                           f"{statistics.median(faults):,.0f}")
            rows.append(f"| {key} ({unit.replace('_', ' ')}) | {cell['default'][0]} | {cell['default'][1]} | "
                        f"{cell['tuned'][0]} | {cell['tuned'][1]} |")
    print("\n| per operation (median of processes, min-max) | glibc defaults | minor faults | tuned | minor faults |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))
    write_json(RESULTS / "malloc_faults.json", result)
    print(f"\nwritten {RESULTS / 'malloc_faults.json'}")


if __name__ == "__main__":
    main()
