"""Harness agreement: a trained team scored by `masrl eval`, lm-evaluation-harness and Inspect AI on the same rows.

Given a run folder, this script

1. writes the first ``--rows`` rows of the run's own held-out split (its task from masrl's task registry, e.g.
   the quickstart's arithmetic test split) to ``OUT/rows.jsonl`` (``question``, ``answer`` = the gold number);
2. runs ``masrl eval RUN/config.yaml --checkpoint RUN --bench test --limit ROWS --n 1 eval.temperature=0``:
   the same rows, scored by the run's reward (math-verify on the last ``\\boxed{}``);
3. serves the run with ``masrl serve RUN --team --port 0`` and scores it with lm-eval (``local-chat-completions``,
   the task ``examples/harness/masrl_arithmetic.yaml`` over ``rows.jsonl``) and Inspect AI (its OpenAI provider
   with a base URL, ``examples/harness/inspect_gsm8k.py`` with ``data_file=rows.jsonl``), both at temperature 0;
4. prints the three accuracies, how many harness replies equal `masrl eval`'s answers text for text, and for every
   row where a harness's score differs from `masrl eval`'s, why (a different reply, or the scoring rule: the
   recipes take exact match of the number in the last ``\\boxed{}``, math-verify also accepts ``025`` for ``25``).

    python benchmarks/harness_agreement.py runs/quickstart-drmas-seed0 --rows 100 --out runs/harness_agreement

Writes ``OUT/agreement.json`` (the figures, each row's replies and scores, versions, machine) beside the rows, the
evaluation folder (``OUT/eval``), lm-eval's samples and Inspect's log. Needs the harness extra
(``pip install "masrl[harness]"``). Exit 1 when a row scores differently because a harness's reply differs from
`masrl eval`'s answer (a difference the scoring rule does not explain).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _benchutil import REPO, fmt_table, print_header  # noqa: E402

HARNESS = REPO / "examples" / "harness"
LM_EVAL_TASK = HARNESS / "masrl_arithmetic.yaml"
LM_EVAL_ROWS = "runs/harness_agreement/rows.jsonl"  # the data_files entry of the task file, replaced by OUT's rows
BOXED = re.compile(r"\\boxed\{\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)\s*\}")  # the recipes' pattern


def boxed_number(reply: str | None) -> str | None:
    """The number the recipes score: the last ``\\boxed{number}`` of ``reply``, commas dropped; None without one."""
    found = BOXED.findall(reply or "")
    return found[-1].replace(",", "") if found else None


def recipe_correct(reply: str | None, gold: str) -> bool:
    """The recipes' exact match (lm-eval's filter + exact_match, Inspect's ``boxed_number`` scorer)."""
    return boxed_number(reply) == str(gold).replace(",", "").strip()


def explain(gold: str, masrl_reply: str | None, masrl_correct: bool, reply: str | None, correct: bool) -> str | None:
    """Why a harness scored a row ``correct`` where `masrl eval` scored it ``masrl_correct`` (None: they agree).
    A different reply is named first; with the same reply, the difference is the scoring rule."""
    if bool(correct) == bool(masrl_correct):
        return None
    from masrl.tasks.math_reward import extract_prediction, normalize_number

    if reply != masrl_reply:
        return (f"the reply differs from masrl eval's: boxed {boxed_number(reply)!r} here, "
                f"{extract_prediction(masrl_reply)!r} there (gold {gold!r})")
    pred, box = extract_prediction(reply), boxed_number(reply)
    if masrl_correct and box is None:
        return (f"same reply; math-verify accepts the box {pred!r} for {gold!r}, the recipes' pattern finds no plain "
                "number in a box")
    if masrl_correct and normalize_number(box) == normalize_number(gold):
        return (f"same reply; boxed {box!r}: math-verify's number normalisation makes it {gold!r}, exact match "
                "does not")
    return (f"same reply; math-verify {'accepts' if masrl_correct else 'rejects'} the box {pred!r}, exact match "
            f"{'accepts' if correct else 'rejects'} {box!r} (gold {gold!r})")


def compare(rows: list[dict], masrl: list[dict], harnesses: dict[str, list[dict]]) -> dict[str, Any]:
    """Accuracies, replies equal to `masrl eval`'s and the explained differences. ``rows``: {question, answer};
    ``masrl``: `masrl eval`'s samples in row order ({answer, correct}); ``harnesses``: name -> [{reply, correct}]
    in row order."""
    n = len(rows)
    out: dict[str, Any] = {"rows": n, "accuracy": {"masrl eval": sum(bool(s["correct"]) for s in masrl) / n},
                           "same_reply": {}, "same_score": {}, "differences": [],
                           "masrl_eval_by_exact_match": sum(recipe_correct(s["answer"], r["answer"])
                                                            for r, s in zip(rows, masrl)) / n}
    for name, scored in harnesses.items():
        if len(scored) != n:
            raise SystemExit(f"{name} scored {len(scored)} rows, masrl eval {n}: not the same rows")
        out["accuracy"][name] = sum(bool(h["correct"]) for h in scored) / n
        out["same_reply"][name] = sum(h["reply"] == s["answer"] for h, s in zip(scored, masrl))
        out["same_score"][name] = sum(bool(h["correct"]) == bool(s["correct"]) for h, s in zip(scored, masrl))
        for i, (row, s, h) in enumerate(zip(rows, masrl, scored)):
            why = explain(row["answer"], s["answer"], s["correct"], h["reply"], h["correct"])
            if why:
                out["differences"].append({"row": i, "harness": name, "question": row["question"], "why": why,
                                           "reply_differs": h["reply"] != s["answer"]})
    return out


# ------------------------------------------------------------------------------------------------------------------
# the measurement


def write_rows(run: Path, limit: int, out: Path) -> list[dict]:
    """The first ``limit`` rows of the run's held-out split (its task, from masrl's task registry), as JSONL."""
    from masrl.config import load_config
    from masrl.team_runner import load_tasks

    source = load_tasks(load_config(run / "config.yaml"))
    rows = [{"id": t.id, "question": t.question, "answer": str(t.answer)} for t in source.test[:limit]]
    (out / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def masrl_eval(run: Path, rows: list[dict], out: Path) -> list[dict]:
    """`masrl eval --bench test` on the same rows at temperature 0; its samples in row order."""
    cmd = [sys.executable, "-m", "masrl", "eval", str(run / "config.yaml"), "--checkpoint", str(run), "--bench", "test",
           "--limit", str(len(rows)), "--n", "1", "--k", "1", "--out", str(out / "eval"), "--overwrite",
           "eval.temperature=0", "logging.progress=false"]
    subprocess.run(cmd, check=True, cwd=REPO)
    by_id = {}
    for line in (out / "eval" / "samples.jsonl").read_text().splitlines():
        s = json.loads(line)
        by_id[s["task_id"]] = s
    missing = [r["id"] for r in rows if r["id"] not in by_id]
    if missing:
        raise SystemExit(f"masrl eval skipped {len(missing)} row(s), first {missing[0]}: not the same rows")
    return [by_id[r["id"]] for r in rows]


def serve(run: Path, max_seconds: int) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "masrl", "serve", str(run), "--team", "--port", "0",
                             "--max-seconds", str(max_seconds)], stdout=subprocess.PIPE, text=True, cwd=REPO)
    line = proc.stdout.readline()
    if "-> http://" not in line:
        proc.wait(timeout=30)
        raise SystemExit(f"masrl serve --team did not start (exit {proc.returncode}): {line!r}")
    return proc, line.split("-> ", 1)[1].split(" ", 1)[0]


def lm_eval_scores(url: str, model: str, out: Path) -> list[dict]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    tasks = out / "lm_eval_task"
    tasks.mkdir(exist_ok=True)
    text = LM_EVAL_TASK.read_text().replace("include: masrl_gsm8k.yaml", f"include: {HARNESS / 'masrl_gsm8k.yaml'}")
    (tasks / LM_EVAL_TASK.name).write_text(text.replace(LM_EVAL_ROWS, str(out / "rows.jsonl")))
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    results = lm_eval.simple_evaluate(
        model="local-chat-completions", tasks=["masrl_arithmetic"], apply_chat_template=True, log_samples=True,
        model_args=f"base_url={url}/chat/completions,model={model},num_concurrent=1,max_retries=1,"
                   "tokenized_requests=False", task_manager=TaskManager(include_path=str(tasks), include_defaults=False))
    samples = sorted(results["samples"]["masrl_arithmetic"], key=lambda s: s["doc_id"])
    (out / "lm_eval_samples.jsonl").write_text("".join(json.dumps(s, default=str) + "\n" for s in samples))
    return [{"reply": s["resps"][0][0], "correct": bool(s["exact_match"])} for s in samples]


def inspect_scores(url: str, model: str, out: Path) -> list[dict]:
    from inspect_ai import eval as inspect_eval

    sys.path.insert(0, str(HARNESS))
    from inspect_gsm8k import masrl_gsm8k

    os.environ.setdefault("OPENAI_API_KEY", "unused")
    log = inspect_eval(masrl_gsm8k(data_file=str(out / "rows.jsonl")), model=f"openai/{model}", model_base_url=url,
                       temperature=0, log_dir=str(out / "inspect"), display="none")[0]
    if log.status != "success":
        raise SystemExit(f"Inspect did not finish: {log.error}")
    return [{"reply": s.output.completion, "correct": s.scores["boxed_number"].value == "C"}
            for s in sorted(log.samples, key=lambda s: s.id)]


def report(result: dict[str, Any]) -> str:
    n = result["rows"]
    table = [[name, f"{acc:.1%}", f"{round(acc * n)}/{n}",
              "-" if name == "masrl eval" else f"{result['same_reply'][name]}/{n}",
              "-" if name == "masrl eval" else f"{result['same_score'][name]}/{n}"]
             for name, acc in result["accuracy"].items()]
    lines = [fmt_table(["scorer", "accuracy", "correct", "same reply as masrl eval", "same score"], table),
             f"masrl eval's replies under the recipes' exact match: {result['masrl_eval_by_exact_match']:.1%}"]
    lines += [f"row {d['row']} ({d['harness']}, {d['question']!r}): {d['why']}" for d in result["differences"]]
    if not result["differences"]:
        lines.append("no row scored differently")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="a trained run folder (config.yaml + checkpoints/)")
    ap.add_argument("--rows", type=int, default=100, help="held-out rows, the first ones (default: 100)")
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "harness_agreement", help="output folder")
    ap.add_argument("--max-seconds", type=int, default=3600, help="the server's lifetime bound (default: 3600)")
    args = ap.parse_args(argv)
    import inspect_ai
    import lm_eval

    run, out = args.run.resolve(), args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    info = print_header()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout
    info.update({"lm_eval": lm_eval.__version__, "inspect_ai": inspect_ai.__version__, "commit": commit.strip()})
    print(f"lm-eval {info['lm_eval']}, inspect-ai {info['inspect_ai']}, commit {info['commit']}", flush=True)
    rows = write_rows(run, args.rows, out)
    seconds = {}
    t0 = time.perf_counter()
    masrl = masrl_eval(run, rows, out)
    seconds["masrl eval"] = time.perf_counter() - t0
    from masrl.config import load_config

    model = load_config(run / "config.yaml").name
    proc, url = serve(run, args.max_seconds)
    try:
        t0 = time.perf_counter()
        scored = {"lm-eval": lm_eval_scores(url, model, out)}
        seconds["lm-eval"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        scored["inspect"] = inspect_scores(url, model, out)
        seconds["inspect"] = time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    result = compare(rows, masrl, scored)
    print(report(result))
    print("seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in seconds.items()))
    per_row = [{"row": i, **r, "masrl eval": {"reply": s["answer"], "correct": s["correct"]},
                **{name: scored[name][i] for name in scored}} for i, (r, s) in enumerate(zip(rows, masrl))]
    (out / "agreement.json").write_text(json.dumps({**result, "seconds": seconds, "machine": info,
                                                    "run": str(run), "per_row": per_row}, indent=1, default=str))
    print(f"wrote {out / 'agreement.json'}")
    return 1 if any(d["reply_differs"] for d in result["differences"]) else 0


if __name__ == "__main__":
    sys.exit(main())
