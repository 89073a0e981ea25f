"""What the code reward's result cache saves (``task.params.score_cache``, masrl.codecheck.scoring.ScoreCache).

The code Eval-Opt example (``examples/code_eval_opt_shared.yaml``: Generator -> Evaluator -> Generator on
``code_synth``, every candidate scored in the sandbox) is trained once through its SFT (or ``--from RUN_DIR``
takes a finished run's last checkpoint, e.g. a study run after 100 RL steps); then ``--steps`` RL steps and the
held-out evaluation are resumed from that checkpoint twice per pair, with ``score_cache: 0`` (every program run)
and with the default cache, alternated, each in its own process. Reported per side: wall seconds, the process's
own CPU seconds and its children's (the sandboxed programs), reward calls and distinct (task, program) pairs, and
whether every logged value other than timings is identical between the two sides.

    python benchmarks/code_score_cache.py --pairs 2
    python benchmarks/code_score_cache.py --from runs/study/e5_code/workflow=eval_opt__policy=shared/seed0 --steps 3
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _benchutil import REPO, RESULTS, fmt_table, print_header, spread, write_json  # noqa: E402

EXAMPLE = REPO / "examples" / "code_eval_opt_shared.yaml"

# the resumed run in a fresh process: counts the sandbox runs (score_code calls) and their distinct programs
_WORKER = r"""
import json, resource, sys, threading, time
import masrl.codecheck.scoring as sc
calls, lock, real = [], threading.Lock(), sc.score_code
def counted(task, answer, *a, **k):
    with lock:
        calls.append((json.dumps(task.answer, sort_keys=True, default=repr), str(answer)))
    return real(task, answer, *a, **k)
sc.score_code = counted
from masrl.cli import main
t = time.perf_counter()
rc = main(["train", "--resume", sys.argv[1]])
s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
json.dump({"rc": rc, "wall_s": time.perf_counter() - t, "self_cpu_s": s.ru_utime + s.ru_stime,
           "children_cpu_s": c.ru_utime + c.ru_stime, "sandbox_runs": len(calls),
           "distinct_runs": len(set(calls))}, open(sys.argv[2], "w"))
"""


def _last_checkpoint(run: Path) -> Path:
    steps = sorted((p for p in (run / "checkpoints").glob("step_*") if p.is_dir()), key=lambda p: int(p.name[5:]))
    if not steps:
        sys.exit(f"code_score_cache: no checkpoints/step_* in {run}")
    return steps[-1]


def _prepare(src_run: Path, dst: Path, cache: int | None, steps: int) -> None:
    """A run folder that resumes from ``src_run``'s last checkpoint for ``steps`` more RL steps."""
    import yaml

    ckpt = _last_checkpoint(src_run)
    dst.mkdir(parents=True)
    (dst / "checkpoints").mkdir()
    shutil.copytree(ckpt, dst / "checkpoints" / ckpt.name)
    start = json.loads((ckpt / "trainer_state.json").read_text()).get("step", 0)
    metrics = src_run / "metrics.jsonl"
    if metrics.is_file():
        (dst / "metrics.jsonl").write_text("".join(
            line for line in metrics.read_text().splitlines(keepends=True)
            if line.strip() and json.loads(line).get("step", 0) <= start))
    cfg = yaml.safe_load((src_run / "config.yaml").read_text())
    cfg["trainer"]["total_steps"] = start + steps
    cfg["trainer"]["save_every"] = 0
    cfg["task"].setdefault("params", {})
    if cache is None:
        cfg["task"]["params"].pop("score_cache", None)
    else:
        cfg["task"]["params"]["score_cache"] = cache
    cfg["output_dir"] = str(dst)
    (dst / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))


def _logged(run: Path) -> list[dict]:
    """Every logged value but timings and memory (those differ between any two runs)."""
    out = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        if line.strip():
            out.append({k: v for k, v in json.loads(line).items() if not k.startswith("perf/")})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--from", dest="src", type=Path, help="a finished run folder to resume from (default: train "
                    "the example through SFT first)")
    ap.add_argument("--steps", type=int, default=5, help="RL steps per side")
    ap.add_argument("--pairs", type=int, default=1)
    ap.add_argument("--out", type=Path, default=RESULTS / "code_score_cache.json")
    args = ap.parse_args()
    info = print_header(threads=1)
    work = Path(tempfile.mkdtemp(prefix="masrl-score-cache-"))
    src = args.src
    if src is None:
        src = work / "sft"
        print(f"training {EXAMPLE.name} through its SFT ({src})", flush=True)
        subprocess.run([sys.executable, "-m", "masrl", "train", str(EXAMPLE), "--output-dir", str(src),
                        "trainer.total_steps=0", "trainer.threads=1", "eval.before_after=false",
                        "logging.tensorboard=false", "logging.plots=false", "logging.progress=false"],
                       check=True, cwd=REPO)
    worker = work / "worker.py"
    worker.write_text(_WORKER)
    sides = {"score_cache 0": 0, "default cache": None}
    results: dict[str, list[dict]] = {k: [] for k in sides}
    identical = []
    for pair in range(args.pairs):
        order = list(sides) if pair % 2 == 0 else list(reversed(sides))
        runs = {}
        for name in order:
            run = work / f"pair{pair}_{'off' if sides[name] == 0 else 'on'}"
            _prepare(src, run, sides[name], args.steps)
            out = work / f"{run.name}.json"
            subprocess.run([sys.executable, str(worker), str(run), str(out)], check=True, cwd=REPO,
                           stdout=subprocess.DEVNULL)
            res = json.loads(out.read_text())
            results[name].append(res)
            runs[name] = run
            print(f"pair {pair} {name}: wall {res['wall_s']:.1f} s, CPU {res['self_cpu_s']:.1f} + children "
                  f"{res['children_cpu_s']:.1f} s, sandbox runs {res['sandbox_runs']} "
                  f"({res['distinct_runs']} distinct)", flush=True)
        same = _logged(runs["score_cache 0"]) == _logged(runs["default cache"])
        identical.append(same)
        print(f"pair {pair}: logged values other than perf/* identical: {same}", flush=True)
    rows = []
    for name, rs in results.items():
        cpu = spread([r["self_cpu_s"] + r["children_cpu_s"] for r in rs])
        wall = spread([r["wall_s"] for r in rs])
        rows.append([name, f"{cpu['median']:.1f} ({cpu['min']:.1f}-{cpu['max']:.1f})",
                     f"{wall['median']:.1f} ({wall['min']:.1f}-{wall['max']:.1f})",
                     "/".join(str(r["sandbox_runs"]) for r in rs), "/".join(str(r["distinct_runs"]) for r in rs)])
    print(fmt_table(["side", "CPU s (self + children), median (min-max)", "wall s", "sandbox runs",
                     "distinct programs"], rows))
    ratio = [(a["self_cpu_s"] + a["children_cpu_s"]) / (b["self_cpu_s"] + b["children_cpu_s"])
             for a, b in zip(results["default cache"], results["score_cache 0"])]
    print(f"cached / uncached CPU per pair: {', '.join(f'{r:.3f}' for r in ratio)}; identical logs: {identical}")
    write_json(args.out, {"machine": info, "from": str(args.src or "the example after SFT"), "steps": args.steps,
                          "results": results, "cpu_ratio": ratio, "identical_logs": identical})
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
