"""Adversarial probe of the masrl CLI: run many hostile argument lists, flag the bad outcomes.

    PYTHONPATH=src nice -n 5 python .ci/probe_cli.py [--subprocess] [-k SUBSTRING]

Flags a case that ends with a traceback, hangs (60 s), exits 0 on garbage, exits 2 without exactly one
``masrl`` error line, or writes outside its scratch folder. By default each case runs in a forked child
of one process that imported masrl once (cheap on a loaded machine); ``--subprocess`` runs
``python -m masrl.cli`` for each case instead (what a user sees, slower).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import tiny_config_dict  # noqa: E402

QUICK = {"sft.steps": 0, "trainer.total_steps": 0, "eval.before_after": False,
         "logging.tensorboard": False, "logging.plots": False, "logging.progress": False}


def _snapshot(root: Path) -> set[str]:
    return {str(p) for p in root.rglob("*")}


def make_fixtures(d: Path) -> dict:
    """Files the cases point at: a good config, garbage files, a folder, a symlink loop."""
    f = {}
    cfg = tiny_config_dict(d, **QUICK)
    f["cfg"] = d / "cfg.yaml"
    f["cfg"].write_text(yaml.safe_dump(cfg))
    for name, data in {"empty": b"", "binary": bytes(range(256)) * 4, "latin1": "seed: caf\xe9\n".encode("latin-1"),
                       "list": b"- 1\n- 2\n", "scalar": b"42\n", "null": b"null\n", "nul": b"seed: 0\x00\n",
                       "huge": b"#" * (2 << 20), "tab": b"seed:\t0\n\tx: 1\n", "dupkey": b"seed: 0\nseed: 1\n",
                       "bigint": b"seed: 1" + b"0" * 5000 + b"\n", "tag": b"seed: !!python/object:os.system x\n",
                       "deep": b"a: " + b"[" * 5000 + b"]" * 5000 + b"\n",
                       "jsonl_bad": b'{"step": 1, "x": 1}\n{"step": \n[1,2]\n{"step": "NaN"}\n{"step": 1e999}\n'}.items():
        f[name] = d / f"{name}.yaml"
        f[name].write_bytes(data)
    f["dir"] = d / "adir"
    f["dir"].mkdir()
    f["loop"] = d / "loop.yaml"
    os.symlink(f["loop"], f["loop"])
    return f


def cases(f: dict, d: Path) -> list[tuple[str, list[str], str]]:
    """(name, argv, expect) with expect 'error' (exit 2, one error line) or 'any' (no traceback/hang)."""
    c = []
    for kind in ("empty", "binary", "latin1", "list", "scalar", "null", "nul", "huge", "tab", "dupkey", "bigint",
                 "tag", "deep", "dir", "loop"):
        for cmd in (["config", "show"], ["train"], ["plan"], ["eval"]):
            c.append((f"{cmd[0]}-{kind}", [*cmd, str(f[kind])], "error"))
    for over in ["a..b=1", "=1", "__class__=1", "seed.__class__=1", ".seed=1", "seed.=1", "é=1", "x" * 5000 + "=1",
                 "seed=nan", "seed=inf", "seed=-5", "seed=1e400", "seed=" + "9" * 5000, "trainer.total_steps=1e18",
                 "trainer.group_size=0", "agents.Solver.temperature=nan", "policies=1", "agents=[]", "task=null",
                 "trainer=x", "seed", "seed==1", "agents.Solver.max_new_tokens=-1", "policies.shared.optim.lr=-1",
                 "output_dir=", "output_dir=/dev/null", "workflow.params=[1,2]", "eval.k=[0]", "eval.k=[]",
                 "trainer.batch_size=99999999999", "name=../../x", "name=a/b", "seed=[", "seed={a: *b}",
                 "task.params.train_size=-3", "\udcff=1"]:
        # `config show` prints what it resolves; some values are only refused when a run is built (train-* below)
        lenient = over.startswith(("output_dir=", "eval.k=", "trainer.batch_size=", "name=", "task.params."))
        c.append((f"override {over[:40]!r}", ["config", "show", str(f["cfg"]), over], "any" if lenient else "error"))
    c += [
        ("train-out-is-file", ["train", str(f["cfg"]), "--output-dir", str(f["empty"])], "error"),
        ("train-out-under-file", ["train", str(f["cfg"]), "--output-dir", str(f["empty"]) + "/x"], "error"),
        ("train-resume-missing", ["train", "--resume", str(d / "nope")], "error"),
        ("train-resume-file", ["train", "--resume", str(f["empty"])], "error"),
        ("train-resume-dir-cfg-list", ["train", "--resume", str(d / "resume_list")], "error"),
        ("plot-missing", ["plot", str(d / "nope")], "error"),
        ("plot-file", ["plot", str(f["empty"])], "error"),
        ("plot-badmetrics", ["plot", str(d / "badrun")], "any"),
        ("export-missing", ["export", str(d / "nope"), "--out", str(d / "exp1")], "error"),
        ("export-file", ["export", str(f["empty"]), "--out", str(d / "exp2")], "error"),
        ("export-nockpt", ["export", str(d / "badrun"), "--out", str(d / "exp3")], "error"),
        ("export-step-neg", ["export", str(d / "badrun"), "--out", str(d / "exp4"), "--step", "-1"], "error"),
        ("export-shard", ["export", str(d / "badrun"), "--out", str(d / "exp5"), "--max-shard-size", "nanGB"], "error"),
        ("plan-gpus0", ["plan", str(f["cfg"]), "--gpus", "0"], "error"),
        ("plan-gib-nan", ["plan", str(f["cfg"]), "--gpu-gib", "nan"], "error"),
        ("plan-prompt-huge", ["plan", str(f["cfg"]), "--prompt-tokens", "9" * 30], "any"),
        ("eval-n0", ["eval", str(f["cfg"]), "--n", "0"], "error"),
        ("eval-k-junk", ["eval", str(f["cfg"]), "--k", "a,b"], "error"),
        ("eval-k-neg", ["eval", str(f["cfg"]), "--k", "-1"], "error"),
        ("eval-limit-neg", ["eval", str(f["cfg"]), "--limit", "-1"], "error"),
        ("eval-bench-unknown", ["eval", str(f["cfg"]), "--bench", "../../etc/passwd"], "error"),
        ("eval-bench-empty", ["eval", str(f["cfg"]), "--bench", ","], "error"),
        ("eval-ckpt-missing", ["eval", str(f["cfg"]), "--checkpoint", str(d / "nope")], "error"),
        ("eval-ckpt-file", ["eval", str(f["cfg"]), "--checkpoint", str(f["empty"])], "error"),
        ("eval-ckpt-badrun", ["eval", str(f["cfg"]), "--checkpoint", str(d / "badrun")], "error"),
        ("eval-out-file", ["eval", str(f["cfg"]), "--out", str(f["empty"])], "error"),
        ("sweep-missing", ["sweep", str(d / "nope.yaml")], "error"),
        ("sweep-binary", ["sweep", str(f["binary"])], "error"),
        ("sweep-list", ["sweep", str(f["list"])], "error"),
        ("sweep-dir", ["sweep", str(f["dir"])], "error"),
        ("sweep-jobs0", ["sweep", str(d / "spec_ok.yaml"), "--jobs", "0"], "error"),
        ("sweep-longname", ["sweep", str(d / "spec_long.yaml"), "--out", str(d / "sw1")], "error"),
        ("sweep-dupes", ["sweep", str(d / "spec_dupe.yaml"), "--out", str(d / "sw2"), "--dry-run"], "error"),
        ("sweep-dotdot", ["sweep", str(d / "spec_dotdot.yaml"), "--out", str(d / "sw3"), "--dry-run"], "error"),
        ("sweep-out-file", ["sweep", str(d / "spec_ok.yaml"), "--out", str(f["empty"]) + "/x", "--dry-run"], "error"),
        ("sweep-report-missing", ["sweep", "report", str(d / "nope")], "error"),
        ("sweep-report-file", ["sweep", "report", str(f["empty"])], "error"),
        ("sweep-report-empty", ["sweep", "report", str(f["dir"])], "error"),
        ("sweep-report-corrupt", ["sweep", "report", str(d / "swc")], "any"),
        ("ens-missing", ["ensemble", "select", "--data", str(d / "nope.jsonl")], "error"),
        ("ens-dir", ["ensemble", "select", "--data", str(f["dir"])], "error"),
        ("ens-binary", ["ensemble", "select", "--data", str(f["binary"])], "error"),
        ("ens-list", ["ensemble", "select", "--data", str(d / "ens_list.jsonl")], "error"),
        ("ens-nan", ["ensemble", "select", "--data", str(d / "ens_nan.jsonl")], "error"),
        ("ens-shape", ["ensemble", "select", "--data", str(d / "ens_shape.jsonl")], "error"),
        ("ens-k0", ["ensemble", "select", "--data", str(d / "ens_ok.jsonl"), "--k", "0"], "error"),
        ("ens-k99", ["ensemble", "select", "--data", str(d / "ens_ok.jsonl"), "--k", "99"], "error"),
        ("ens-kneg", ["ensemble", "compare", "--data", str(d / "ens_ok.jsonl"), "--k", "-2"], "error"),
        ("ens-splitfrac", ["ensemble", "select", "--data", str(d / "ens_ok.jsonl"), "--split", "first",
                           "--split-frac", "nan"], "error"),
        ("ens-splitfrac2", ["ensemble", "select", "--data", str(d / "ens_ok.jsonl"), "--split", "first",
                            "--split-frac", "1.5"], "error"),
        ("ens-split-field", ["ensemble", "select", "--data", str(d / "ens_ok.jsonl"), "--split", "field:nope"], "error"),
        ("ens-split-junk", ["ensemble", "select", "--data", str(d / "ens_ok.jsonl"), "--split", "junk"], "error"),
        ("ens-models-unknown", ["ensemble", "select", "--data", str(d / "ens_ok.jsonl"), "--models", "zz"], "error"),
        ("ens-models-empty", ["ensemble", "select", "--data", str(d / "ens_ok.jsonl"), "--models", ","], "error"),
        ("ens-combiner", ["ensemble", "select", "--data", str(d / "ens_ok.jsonl"), "--combiner", "os:system"], "error"),
        ("ens-combiner2", ["ensemble", "select", "--data", str(d / "ens_ok.jsonl"), "--combiner", "nope.mod:f"], "error"),
        ("ens-weights", ["ensemble", "select", "--data", str(d / "ens_ok.jsonl"), "--weights", "inf,1,1"], "error"),
        ("ens-rlf-seeds", ["ensemble", "rl-focal", "--data", str(d / "ens_ok.jsonl"), "--seeds", "0"], "error"),
        ("ens-rlf-alpha", ["ensemble", "rl-focal", "--data", str(d / "ens_ok.jsonl"), "--alpha", "nan"], "error"),
        ("ens-out-file", ["ensemble", "select", "--data", str(d / "ens_ok.jsonl"), "--out", str(f["empty"])], "error"),
        ("ens-label-field", ["ensemble", "select", "--data", str(d / "ens_ok.jsonl"), "--label-field", "zz"], "error"),
        ("ens-empty", ["ensemble", "select", "--data", str(f["empty"])], "error"),
        ("ens-collect-missing", ["ensemble", "collect", str(d / "nope.yaml"), "--bench", "test"], "error"),
        ("ens-collect-n0", ["ensemble", "collect", str(f["cfg"]), "--bench", "test", "--n-samples", "0"], "error"),
        ("ens-collect-temp", ["ensemble", "collect", str(f["cfg"]), "--bench", "test", "--temperature", "nan"], "error"),
        ("ens-collect-out-dir", ["ensemble", "collect", str(f["cfg"]), "--bench", "test", "--out", str(f["dir"])], "error"),
        ("ens-probs-shape", ["ensemble", "select", "--data", str(d / "ens_probs.jsonl")], "any"),
        ("ens-one-model-k2", ["ensemble", "compare", "--data", str(d / "ens_one_model.jsonl")], "error"),
        ("ens-one-model-rlf", ["ensemble", "rl-focal", "--data", str(d / "ens_one_model.jsonl"), "--seeds", "1",
                               "--episodes", "1"], "any"),
        ("ens-two-rows", ["ensemble", "select", "--data", str(d / "ens_two_rows.jsonl")], "any"),
        ("ens-two-rows-rlf", ["ensemble", "rl-focal", "--data", str(d / "ens_two_rows.jsonl"), "--seeds", "1",
                              "--episodes", "1"], "any"),
        ("ens-bigint-lenient", ["ensemble", "select", "--data", str(d / "ens_bigint.jsonl"), "--lenient"], "any"),
        ("ens-bigint", ["ensemble", "select", "--data", str(d / "ens_bigint.jsonl")], "error"),
        ("ens-window-huge", ["ensemble", "rl-focal", "--data", str(d / "ens_ok.jsonl"), "--seeds", "1",
                             "--window", "1000000", "--episodes", "1"], "any"),
        ("ens-k-huge-compare", ["ensemble", "compare", "--data", str(d / "ens_ok.jsonl"), "--k", "2", "99"], "error"),
        ("ens-methods-bad", ["ensemble", "compare", "--data", str(d / "ens_ok.jsonl"), "--methods", ",,"], "error"),
        ("train-out-devnull", ["train", str(f["cfg"]), "output_dir=/dev/null"], "error"),
        ("train-bs-huge", ["train", str(f["cfg"]), "trainer.batch_size=99999999999"], "any"),  # capped by the data
        ("train-out-dangling", ["train", str(f["cfg"]), "--output-dir", str(d / "dangling")], "error"),
        ("eval-out-dangling", ["eval", str(f["cfg"]), "--out", str(d / "dangling")], "error"),
        ("export-out-dangling", ["export", str(d / "badrun"), "--out", str(d / "dangling")], "error"),
        ("sweep-out-dangling", ["sweep", str(d / "spec_ok.yaml"), "--out", str(d / "dangling"), "--dry-run"], "error"),
        ("ens-out-dangling", ["ensemble", "select", "--data", str(d / "ens_ok.jsonl"), "--out", str(d / "dangling")],
         "error"),
        ("plot-plots-dangling", ["plot", str(d / "plotdangling")], "error"),
        ("train-size-neg", ["train", str(f["cfg"]), "task.params.train_size=-3"], "error"),
        ("train-evalk-empty", ["train", str(f["cfg"]), "eval.k=[]", "--output-dir", str(d / "r_k")], "any"),
        ("train-resume-badrun", ["train", "--resume", str(d / "badrun")], "error"),
        ("train-resume-with-cfg", ["train", "--resume", str(d / "badrun"), str(f["cfg"])], "error"),
        ("train-into-run", ["train", str(f["cfg"]), "--output-dir", str(d / "badrun")], "error"),
        ("plot-plots-is-file", ["plot", str(d / "plotfile")], "error"),
        ("serve-bigint", ["serve-retriever", "--corpus", str(d / "ens_bigint.jsonl"), "--format", "jsonl"], "error"),
        ("serve-missing", ["serve-retriever", "--corpus", str(d / "nope.jsonl")], "error"),
        ("serve-dir", ["serve-retriever", "--corpus", str(f["dir"])], "error"),
        ("serve-binary", ["serve-retriever", "--corpus", str(f["binary"]), "--format", "jsonl"], "error"),
        ("serve-empty", ["serve-retriever", "--corpus", str(f["empty"]), "--format", "jsonl"], "error"),
        ("serve-list", ["serve-retriever", "--corpus", str(d / "ens_list.jsonl"), "--format", "json_list"], "error"),
        ("serve-port", ["serve-retriever", "--corpus", "synthetic_kb", "--port", "70000"], "error"),
        ("serve-topk", ["serve-retriever", "--corpus", "synthetic_kb", "--topk", "0"], "error"),
        # masrl plan: numbers out of range, impossible model shapes, models not known offline
        ("plan-hetero-example", ["plan", str(EXAMPLES / "gpu" / "search_drmas_hetero_7b_3b.yaml")], "any"),
        ("plan-unknown-model", ["plan", str(f["cfg"]), "policies.shared.model=acme/no-such-model"], "error"),
        ("plan-model-config-missing", ["plan", str(f["cfg"]), "--model-config", str(d / "nope.json")], "error"),
        ("plan-model-config-binary", ["plan", str(f["cfg"]), "policies.shared.model=acme/m", "--model-config",
                                      str(f["binary"])], "error"),
        ("plan-model-config-list", ["plan", str(f["cfg"]), "policies.shared.model=acme/m", "--model-config",
                                    str(f["list"])], "error"),
        ("plan-model-config-policy", ["plan", str(f["cfg"]), "--model-config", "nobody=x.json"], "error"),
        ("plan-model-config-shape", ["plan", str(f["cfg"]), "policies.shared.model=acme/m", "--model-config",
                                     str(d / "shape_bad.json")], "error"),
        ("plan-mbt-huge", ["plan", str(f["cfg"]), "trainer.micro_batch_tokens=" + "9" * 400], "error"),
    ]
    for key, value in [("num_attention_heads", "0"), ("hidden_size", "-64"), ("num_attention_heads", "5"),
                       ("num_key_value_heads", "3"), ("num_hidden_layers", "0"), ("intermediate_size", "1e400")]:
        c.append((f"plan-tiny-{key}={value}", ["plan", str(f["cfg"]), f"policies.shared.tiny.{key}={value}"], "error"))
    numbers = ["nan", "inf", "-inf", "1e400", "9" * 400, "-1", "0", "1e308", "abc", ""]
    for name, argv in [("plan", ["plan", str(f["cfg"])]), ("eval", ["eval", str(f["cfg"])]),
                       ("export", ["export", str(d / "badrun"), "--out", str(d / "expn")]),
                       ("sweep", ["sweep", str(d / "spec_ok.yaml"), "--dry-run", "--out", str(d / "swn")]),
                       ("ens", ["ensemble", "rl-focal", "--data", str(d / "ens_ok.jsonl")]),
                       ("ens-collect", ["ensemble", "collect", str(f["cfg"]), "--bench", "test"]),
                       ("serve", ["serve-retriever", "--corpus", "synthetic_kb"])]:
        for option in NUMERIC_OPTIONS[name]:
            for value in numbers:
                if value in OK_VALUES.get(option, ()):
                    continue
                c.append((f"num {name} {option} {value[:12]!r}", [*argv, option, value], "error"))
    c += [
        ("sweep-grid-million", ["sweep", str(d / "spec_million.yaml"), "--dry-run", "--out", str(d / "swm")], "error"),
        ("sweep-seeds-many", ["sweep", str(d / "spec_seeds.yaml"), "--dry-run", "--out", str(d / "sws")], "error"),
        ("sweep-report-million", ["sweep", "report", str(d / "sw_million")], "error"),
        ("sweep-report-huge", ["sweep", "report", str(d / "sw_huge")], "error"),
        ("data-path-unknown", ["data", "path", "no_such_set"], "error"),
        ("data-path-dotdot", ["data", "path", "../../etc/passwd"], "error"),
        ("data-verify-unknown", ["data", "verify", "no_such_set"], "error"),
        ("data-get-unknown", ["data", "get", "no_such_set", "--dir", str(d / "datadir")], "error"),
    ]
    return c


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
# every numeric option of each subcommand (the probe feeds each one nan, inf, 10^400, negatives, zero, junk)
NUMERIC_OPTIONS = {"plan": ["--gpus", "--gpu-gib", "--prompt-tokens"], "eval": ["--n", "--limit"],
                   "export": ["--step", "--max-shard-size"], "sweep": ["--jobs", "--nice", "--gpus-per-run"],
                   "ens": ["--seeds", "--window", "--episodes", "--gamma", "--alpha", "--split-frac"],
                   "ens-collect": ["--limit", "--n-samples", "--seed", "--temperature"],
                   "serve": ["--port", "--topk", "--max-topk", "--max-queries", "--max-query-chars"]}
# values that are in range for an option (not refused; left out of the cases above)
OK_VALUES = {"--prompt-tokens": ("0",), "--step": ("0",), "--nice": ("-1", "0"), "--gpus-per-run": ("0",),
             "--gamma": ("0",), "--alpha": ("-1", "0"), "--seed": ("0",), "--temperature": ("0",)}


def more_fixtures(f: dict, d: Path) -> None:
    (d / "resume_list").mkdir()
    (d / "resume_list" / "config.yaml").write_text("- 1\n")
    (d / "badrun").mkdir()
    (d / "badrun" / "config.yaml").write_text(f["cfg"].read_text())
    (d / "badrun" / "metrics.jsonl").write_bytes(f["jsonl_bad"].read_bytes())
    (d / "badrun" / "checkpoints").mkdir()
    base = str(f["cfg"])
    spec = {"name": "s", "base": base, "seeds": [0], "axes": {"a": {"key": "seed", "values": [1]}}}
    (d / "spec_ok.yaml").write_text(yaml.safe_dump({**spec, "axes": {"lr": {"key": "policies.shared.optim.lr",
                                                                            "values": [0.1]}}}))
    (d / "spec_long.yaml").write_text(yaml.safe_dump({**spec, "axes": {"a" * 200: {"x" * 200: ["trainer.total_steps=0"]}}}))
    (d / "spec_dupe.yaml").write_text(yaml.safe_dump({**spec, "axes": {"a": {"key": "eval.n", "values": [1, "1"]}}}))
    (d / "spec_dotdot.yaml").write_text(yaml.safe_dump({**spec, "axes": {"a": {"..": ["eval.n=1"]}}}))
    os.symlink(d / "nowhere", d / "dangling")
    (d / "plotdangling").mkdir()
    (d / "plotdangling" / "metrics.jsonl").write_text('{"step": 1, "team/reward": 0.5}\n')
    os.symlink(d / "nowhere", d / "plotdangling" / "plots")
    (d / "plotfile").mkdir()
    (d / "plotfile" / "metrics.jsonl").write_text('{"step": 1, "team/reward": 0.5}\n')
    (d / "plotfile" / "plots").write_text("mine\n")
    (d / "swc").mkdir()
    (d / "swc" / "sweep.json").write_text('{"name": 1, "axes": [')
    cell = d / "swc" / "a=1" / "seed0"
    cell.mkdir(parents=True)
    (cell / "report.json").write_text('{"final": "x", "metrics": [1,2]}')
    (cell / "metrics.jsonl").write_text('{"step": "a"}\n{"step": 1, "team/reward": "x"}\n')
    ok = [{"id": f"q{i}", "task": "t", "label": str(i % 3), "predictions": {m: {"answer": str((i + j) % 3)}
           for j, m in enumerate("abcd")}} for i in range(30)]
    (d / "ens_ok.jsonl").write_text("\n".join(json.dumps(r) for r in ok) + "\n")
    (d / "ens_list.jsonl").write_text("[1, 2, 3]\n[4]\n")
    nan = [dict(r, label=float("nan")) for r in ok]
    (d / "ens_nan.jsonl").write_text("\n".join(json.dumps(r) for r in nan) + "\n")
    shape = [dict(r, predictions={"a": r["predictions"]["a"]} if i % 2 else r["predictions"])
             for i, r in enumerate(ok)]
    probs = [dict(r, label=i % 2, predictions={m: {"answer": 0, "probs": [0.5, 0.5, 0.0][: 2 + (i % 2)]}
                                               for m in "abc"}) for i, r in enumerate(ok)]
    (d / "ens_probs.jsonl").write_text("\n".join(json.dumps(r) for r in probs) + "\n")
    (d / "ens_one_model.jsonl").write_text("\n".join(json.dumps(dict(r, predictions={"a": r["predictions"]["a"]}))
                                                     for r in ok) + "\n")
    (d / "ens_two_rows.jsonl").write_text("\n".join(json.dumps(r) for r in ok[:2]) + "\n")
    (d / "ens_bigint.jsonl").write_text("\n".join(json.dumps(r) for r in ok) + '\n{"id": 1' + "0" * 5000 + "}\n")
    (d / "ens_shape.jsonl").write_text("\n".join(json.dumps(r) for r in shape) + "\n")
    (d / "shape_bad.json").write_text(json.dumps({"hidden_size": 1000, "num_hidden_layers": 2, "num_attention_heads": 7,
                                                  "intermediate_size": 64, "vocab_size": 100}))
    values = list(range(1, 101))
    (d / "spec_million.yaml").write_text(yaml.safe_dump({**spec, "axes": {f"a{i}": {"key": "eval.n", "values": values}
                                                                          for i in range(3)}}))
    (d / "spec_seeds.yaml").write_text(yaml.safe_dump({**spec, "seeds": list(range(5000))}))
    (d / "sw_million").mkdir()
    (d / "sw_million" / "sweep.json").write_text(json.dumps({"name": "m", "axes": {"a": ["1"]}, "seeds": list(range(10 ** 6)),
                                                             "cells": ["a=1"]}))
    (d / "sw_huge").mkdir()
    (d / "sw_huge" / "sweep.json").write_bytes(b" " * (17 << 20))


def run_forked(argv: list[str], cwd: Path, timeout: float) -> tuple[int | str, str]:
    err = tempfile.TemporaryFile(mode="w+b")
    pid = os.fork()
    if pid == 0:  # child
        try:
            os.chdir(cwd)
            os.dup2(err.fileno(), 2)
            os.dup2(err.fileno(), 1)
            sys.stderr = os.fdopen(2, "w", buffering=1)
            sys.stdout = os.fdopen(1, "w", buffering=1)
            from masrl.cli import main
            code = main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(code if isinstance(code, int) else 1)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            status = None
            break
        time.sleep(0.05)
    err.seek(0)
    text = err.read().decode("utf-8", "replace")
    return ("hang" if status is None else os.waitstatus_to_exitcode(status)), text


def run_subprocess(argv: list[str], cwd: Path, timeout: float) -> tuple[int | str, str]:
    try:
        p = subprocess.run([sys.executable, "-m", "masrl.cli", *argv], cwd=cwd, capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "hang", ""
    return p.returncode, (p.stdout + p.stderr).decode("utf-8", "replace")


def verdict(code, out: str, expect: str) -> str | None:
    if code == "hang":
        return "HANG"
    if "Traceback" in out:
        return "TRACEBACK"
    if expect == "error":
        if code == 0:
            return "EXIT 0 ON GARBAGE"
        lines = [ln for ln in out.splitlines() if "error" in ln.lower() and ("masrl" in ln or ln.startswith("error"))]
        if code != 2:
            return f"EXIT {code} (expected 2)"
        if len(lines) != 1:
            return f"{len(lines)} error lines"
    return None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--subprocess", action="store_true")
    ap.add_argument("-k", default="")
    ap.add_argument("--timeout", type=float, default=60)
    ap.add_argument("-v", action="store_true")
    args = ap.parse_args()
    if not args.subprocess:
        import importlib  # import once; children fork from here
        for mod in ("masrl.cli", "masrl.trainer", "masrl.evaluate", "masrl.registry_names", "masrl.sweep.run",
                    "masrl.sweep.report", "masrl.ensemble.cli", "masrl.ensemble.selectors", "masrl.export",
                    "masrl.plan", "masrl.monitoring.plots", "masrl.retrieval.server"):
            importlib.import_module(mod)
    bad = 0
    with tempfile.TemporaryDirectory() as top:
        outer = Path(top)
        d = outer / "scratch"
        d.mkdir()
        f = make_fixtures(d)
        more_fixtures(f, d)
        for name, argv, expect in cases(f, d):
            if args.k not in name:
                continue
            before = _snapshot(outer)
            t0 = time.monotonic()
            code, out = (run_subprocess if args.subprocess else run_forked)(argv, d, args.timeout)
            outside = sorted(p for p in _snapshot(outer) - before if not p.startswith(str(d)))
            v = verdict(code, out, expect) or (f"WROTE OUTSIDE {outside[:3]}" if outside else None)
            last = out.strip().splitlines()[-1][:200] if out.strip() else ""
            if v:
                bad += 1
                print(f"[{v}] {name}: exit {code} ({time.monotonic() - t0:.1f}s)\n    {last}")
            elif args.v:
                print(f"[ok] {name}: exit {code}: {last}")
    print(f"{bad} flagged")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
