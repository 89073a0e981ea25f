"""``masrl ensemble`` CLI through ``register(subparsers)``: commands, reports, one-line errors."""
import argparse
import json

import numpy as np
import pytest

from masrl.ensemble.cli import register


def parser():
    p = argparse.ArgumentParser(prog="masrl")
    sub = p.add_subparsers(dest="cmd")
    register(sub)
    return p


def run(argv):
    args = parser().parse_args(argv)
    return args.func(args)


@pytest.fixture()
def data_file(tmp_path):
    rng = np.random.default_rng(0)
    lines = []
    for t, n in (("t1", 30), ("t2", 20)):
        for i in range(n):
            y = int(rng.integers(0, 3))
            preds = {}
            for j, skill in enumerate((0.8, 0.6, 0.5, 0.4)):
                p = np.full(3, 0.1)
                a = y if rng.random() < skill else int(rng.integers(0, 3))
                p[a] = 0.8
                preds[f"org/m{j}"] = {"answer": a, "probs": p.round(6).tolist()}
            lines.append(json.dumps({"id": f"{t}/{i}", "task": t, "label": y, "predictions": preds}))
    path = tmp_path / "tiny.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_select_writes_reports(data_file, tmp_path, capsys):
    out = tmp_path / "out"
    rc = run(["ensemble", "select", "--data", str(data_file), "--method", "forward", "--k", "2",
              "--combiner", "plurality", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "forward" in text and "t1" in text
    res = json.loads((out / "select_forward_k2.json").read_text())["result"]
    assert res["k"] == 2 and res["cost_calls"] == (24 + 16) * (2 * 4 - 1)
    assert (out / "select_forward_k2.md").read_text().startswith("# forward k=2")


def test_compare_table_and_png(data_file, tmp_path, capsys):
    out = tmp_path / "cmp"
    rc = run(["ensemble", "compare", "--data", str(data_file), "--k", "2", "3", "--out", str(out),
              "--combiner", "soft", "--scope", "global"])
    assert rc == 0
    assert (out / "compare_tiny.png").stat().st_size > 1000
    js = json.loads((out / "compare_tiny.json").read_text())
    methods = {s["method"] for s in js["selectors"]}
    assert {"topk", "forward", "backward", "loo", "hybrid", "exhaustive", "proxy-focal"} <= methods
    assert "proxy-majority" not in methods  # the data has answers
    assert "| method |" in (out / "compare_tiny.md").read_text()
    assert "exhaustive" in capsys.readouterr().out


def test_rl_focal_command(data_file, tmp_path):
    out = tmp_path / "rl"
    rc = run(["ensemble", "rl-focal", "--data", str(data_file), "--seeds", "2", "--episodes", "2",
              "--window", "5", "--out", str(out)])
    assert rc == 0
    js = json.loads((out / "rlfocal_tiny.json").read_text())
    assert js["result"]["summary"]["decider_pooled"]["n"] == 2
    assert js["result"]["summary"]["fusion_pooled"]["mean"] is not None
    assert "Decider + Fusion" in (out / "rlfocal_tiny.md").read_text()


@pytest.mark.parametrize("argv,msg", [
    (["ensemble", "select", "--data", "/no/such/file.jsonl"], "data file not found"),
    (["ensemble", "select", "--k", "9"], "k must be in 1..4"),
    (["ensemble", "select", "--combiner", "nope"], "unknown combiner"),
    (["ensemble", "compare", "--methods", "topk,bogus"], "unknown selector 'bogus'"),
    (["ensemble", "rl-focal", "--weights", "1,2"], "--weights"),
    (["ensemble", "rl-focal", "--preset", "imagenet"], "unknown preset"),
    (["ensemble", "select", "--split", "field:zzz"], "split field 'zzz'"),
])
def test_bad_input_one_line_exit_2(data_file, argv, msg, capsys):
    if "--data" not in argv:
        argv = argv[:2] + ["--data", str(data_file)] + argv[2:]
    rc = run(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert err[0].startswith("masrl ensemble: error:") and msg in err[0]


def test_malformed_file_error_names_line(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": "a", "label": 0, "predictions": {"m": {"answer": 0}}}\n{oops\n')
    assert run(["ensemble", "select", "--data", str(path), "--k", "1"]) == 2
    err = capsys.readouterr().err
    assert f"{path}:2: invalid JSON" in err
    # --lenient skips it (and warns), then fails cleanly because one row cannot be split
    assert run(["ensemble", "select", "--data", str(path), "--k", "1", "--lenient"]) == 2


def test_ensemble_without_subcommand_returns_2(capsys):
    assert run(["ensemble"]) == 2
