"""Check the harness on the datasets' own reference solutions.

    python -m masrl.tasks.code.verify [--mbpp-split all] [--limit N] [--workers 4] [--mode all]

Every reference solution should pass all of its tests; the command prints the pass rates,
the time taken and the failures (with their reasons).
"""
from __future__ import annotations

import argparse
import json
import time

from masrl.sandbox import Sandbox
from masrl.tasks.code.data import load_humaneval, load_mbpp
from masrl.codecheck.scoring import score_many


def verify(tasks, sandbox: Sandbox, mode: str = "all", timeout_s: float = 10.0) -> dict:
    t0 = time.monotonic()
    answers = [t.meta.get("reference_solution", "") for t in tasks]
    results = score_many(tasks, answers, mode=mode, sandbox=sandbox, timeout_s=timeout_s, extract=False)
    failures = [{"id": t.id, "reason": r["reason"], "detail": r["detail"][:200]}
                for t, r in zip(tasks, results) if not r["correct"]]
    n = len(tasks)
    return {"n": n, "passed": n - len(failures), "pass_rate": (n - len(failures)) / n if n else 0.0,
            "seconds": round(time.monotonic() - t0, 2), "failures": failures}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mbpp-split", default="all")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--mode", default="all", choices=["all", "fraction"])
    ap.add_argument("--isolation", default="auto")
    ap.add_argument("--skip-mbpp", action="store_true")
    ap.add_argument("--skip-humaneval", action="store_true")
    args = ap.parse_args(argv)
    sb = Sandbox(max_workers=args.workers, isolation=args.isolation)
    report = {"sandbox": sb.describe()["isolation"]}
    if not args.skip_mbpp:
        report["mbpp"] = verify(load_mbpp(split=args.mbpp_split, limit=args.limit), sb, args.mode)
    if not args.skip_humaneval:
        report["humaneval"] = verify(load_humaneval(limit=args.limit), sb, args.mode)
    sb.close()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
