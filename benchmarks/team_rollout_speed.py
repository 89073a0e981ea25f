"""Rollout tokens per process-CPU second of a team run, this code against another checkout, alternated.

Each invocation of a side is a fresh process (``PYTHONPATH=<src>``) running ``masrl train CONFIG`` with the given
overrides (default: the SmolLM2 LoRA team example, 10 SFT steps so that the adapters are not zero, 2 RL steps, no
evaluation, one thread). Inside it every ``TransformersEngine.generate`` call is timed (process CPU time) and its
response tokens counted: the figure is tokens / CPU seconds over the RL steps' engine calls (prefill, decode,
sampling; not the workflow, the scorer or the update). Sides alternate (ABBA...) ``--pairs`` times; the sampled
tokens need not be the same on both sides (another decode path may round differently), which is why the rate is
per token.

    python benchmarks/team_rollout_speed.py --base-src /path/to/old/checkout/src --pairs 2

Writes ``benchmarks/results/team_rollout_speed/<name>.json`` with every invocation and the median ratio
(this code / base).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _benchutil import RESULTS, command_line, machine_info, write_json  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OVERRIDES = ["sft.steps=10", "sft.warmup_steps=2", "trainer.total_steps=2", "eval.before_after=false",
                     "eval.every=0", "trainer.threads=1", "logging.progress=false"]


def worker(config: str, overrides: list[str], out: str) -> None:
    """In the measured process: run the training, timing every engine call of the RL steps."""
    import time

    from masrl.cli import main as cli_main
    from masrl.rollout.engine import TransformersEngine

    calls = {"cpu_s": 0.0, "tokens": 0, "calls": 0}
    generate = TransformersEngine.generate

    def timed(self, requests, *args, **kwargs):
        start = time.process_time()
        results = generate(self, requests, *args, **kwargs)
        calls["cpu_s"] += time.process_time() - start
        calls["tokens"] += sum(len(r.response_ids) for r in results)
        calls["calls"] += 1
        return results

    TransformersEngine.generate = timed
    with tempfile.TemporaryDirectory() as run_dir:
        rc = cli_main(["train", config, *overrides, "--output-dir", run_dir, "--overwrite"])
    from masrl.versions import git_sha

    Path(out).write_text(json.dumps({"rc": rc, **calls, "tokens_per_cpu_s": calls["tokens"] / max(calls["cpu_s"], 1e-9),
                                     "commit": git_sha(), "masrl": __import__("masrl").__file__}))


def run_side(src: str, config: str, overrides: list[str]) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        env = {**os.environ, "PYTHONPATH": src}
        proc = subprocess.run([sys.executable, __file__, "--worker", "--config", config, "--out", out.name,
                               *[f"--override={o}" for o in overrides]], env=env, cwd=REPO, capture_output=True,
                              text=True)
        if proc.returncode != 0:
            raise SystemExit(f"side {src} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return json.loads(Path(out.name).read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-src", help="the other checkout's src folder (the code to compare against)")
    ap.add_argument("--config", default="examples/smollm2_arith_team.yaml")
    ap.add_argument("--override", action="append", default=[], help="dotted override for both sides (repeatable)")
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--name", default="smollm2_arith_team")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    overrides = DEFAULT_OVERRIDES + args.override
    if args.worker:
        return worker(args.config, args.override, args.out)
    if not args.base_src:
        ap.error("--base-src is required")
    sides = {"this": str(REPO / "src"), "base": str(Path(args.base_src).resolve())}
    info = {**machine_info(1), "command": command_line(), "config": args.config, "overrides": overrides,
            "loadavg_at_start": [round(x, 2) for x in os.getloadavg()]}
    print(f"command: {info['command']}\nmachine: {info['cpu']}, load {info['loadavg_at_start']}", flush=True)
    runs = []
    for pair in range(args.pairs):
        order = ["this", "base"] if pair % 2 == 0 else ["base", "this"]
        for side in order:
            rec = {"side": side, "pair": pair, **run_side(sides[side], args.config, overrides),
                   "loadavg": [round(x, 2) for x in os.getloadavg()]}
            runs.append(rec)
            print(f"pair {pair} {side:4s} ({rec['commit']}): {rec['tokens']} tokens in {rec['cpu_s']:.1f} CPU s "
                  f"= {rec['tokens_per_cpu_s']:.1f} tok/CPU-s over {rec['calls']} engine calls", flush=True)
    ratios = [next(r for r in runs if r["pair"] == p and r["side"] == "this")["tokens_per_cpu_s"]
              / next(r for r in runs if r["pair"] == p and r["side"] == "base")["tokens_per_cpu_s"]
              for p in range(args.pairs)]
    info["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    data = {"runs": runs, "ratio_this_over_base": ratios, "median_ratio": statistics.median(ratios), "machine": info}
    path = RESULTS / "team_rollout_speed" / f"{args.name}.json"
    write_json(path, data)
    print(f"this / base rollout tokens per CPU second: median {statistics.median(ratios):.2f} "
          f"({min(ratios):.2f}-{max(ratios):.2f}); wrote {path}")


if __name__ == "__main__":
    main()
