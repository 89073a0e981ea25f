"""Bounded input on the command line: numeric options, `masrl plan`'s model shapes, sweep grid and manifest sizes.

Every refusal is one error line naming the option or key, the value and what is allowed (exit 2), and comes
at once: no traceback, no verdict computed from a value out of range, no hang on a huge grid or manifest.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from masrl.cli import main

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = str(REPO / "examples" / "quickstart.yaml")
HETERO = str(REPO / "examples" / "gpu" / "search_drmas_hetero_7b_3b.yaml")
BIG = "1" + "0" * 400  # 10^400: an int Python holds, too large for a float


def run_cli(argv) -> int:
    try:
        return main([str(a) for a in argv])
    except SystemExit as e:  # argparse refuses an option value
        return e.code


def one_error(argv, capsys, *needles) -> str:
    code = run_cli(argv)
    captured = capsys.readouterr()
    err = captured.err
    assert code == 2 and "Traceback" not in err, (code, err, captured.out)
    lines = [ln for ln in err.splitlines() if "error" in ln and ln.startswith("masrl")]
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


# ---------------------------------------------------------------------- masrl plan: options

@pytest.mark.parametrize("option,value,allowed", [
    ("--prompt-tokens", BIG, "0..10,000,000"),
    ("--prompt-tokens", "1e400", "0..10,000,000"),
    ("--prompt-tokens", "10000001", "0..10,000,000"),
    ("--gpu-gib", "1e308", "<= 100000"),
    ("--gpu-gib", "inf", "<= 100000"),
    ("--gpu-gib", "100001", "<= 100000"),
    ("--gpus", "1000001", "1..1,000,000"),
    ("--gpus", "nan", "1..1,000,000"),
], ids=["tokens_10^400", "tokens_1e400", "tokens_over", "gib_1e308", "gib_inf", "gib_over", "gpus_over", "gpus_nan"])
def test_plan_option_out_of_range_is_one_line_naming_option_and_range(capsys, option, value, allowed):
    """10^400 tokens was an OverflowError traceback; 1e308 GiB printed 'inf GiB -> fits'."""
    line = one_error(["plan", QUICKSTART, option, value], capsys, option, allowed)
    assert len(line) < 300  # the value is truncated


def test_plan_config_number_out_of_range_is_one_line(capsys):
    one_error(["plan", QUICKSTART, f"trainer.micro_batch_tokens={BIG}"], capsys, "trainer.micro_batch_tokens",
              "0..10,000,000")


# ---------------------------------------------------------------------- masrl plan: model shapes

@pytest.mark.parametrize("override,needle", [
    ("policies.shared.tiny.num_attention_heads=0", "num_attention_heads"),
    ("policies.shared.tiny.hidden_size=-64", "hidden_size"),
    ("policies.shared.tiny.num_attention_heads=5", "does not divide hidden_size"),
    ("policies.shared.tiny.num_key_value_heads=3", "does not divide num_attention_heads"),
    ("policies.shared.tiny.num_hidden_layers=0", "num_hidden_layers"),
], ids=["zero_heads", "negative_hidden", "heads_do_not_divide", "kv_heads_do_not_divide", "zero_layers"])
def test_plan_refuses_an_impossible_model_shape(capsys, override, needle):
    """Zero heads was a ZeroDivisionError; a negative hidden size 'fit' at -0.00 GiB."""
    one_error(["plan", QUICKSTART, override], capsys, needle, "policy shared")


def test_plan_unknown_model_offline_is_one_line_suggesting_model_config(capsys, monkeypatch):
    """Was a ValueError traceback (exit 1) after half a minute of hub retries."""
    import huggingface_hub

    class Offline:
        def get(self, *args, **kwargs):
            raise OSError("[Errno -2] Name or service not known")

    monkeypatch.setattr(huggingface_hub, "get_session", lambda: Offline())
    t0 = time.monotonic()
    line = one_error(["plan", QUICKSTART, "policies.shared.model=acme/no-such-model-7b"], capsys,
                     "acme/no-such-model-7b", "--model-config PATH", "Qwen/Qwen2.5-3B")
    assert time.monotonic() - t0 < 10 and "Name or service not known" in line


def _example_models() -> set[str]:
    models = set()
    for path in sorted((REPO / "examples").rglob("*.yaml")):
        doc = yaml.safe_load(path.read_text()) or {}
        for policy in (doc.get("policies") or {}).values():
            if isinstance(policy, dict) and policy.get("model", "tiny") != "tiny":
                models.add(policy["model"])
    return models


def test_every_model_of_the_examples_is_planned_offline():
    """Qwen/Qwen2.5-3B (three GPU examples) was missing from the table: the plan asked the hub."""
    from masrl.plan.shapes import KNOWN

    models = _example_models()
    assert "Qwen/Qwen2.5-3B" in models and len(models) >= 4
    known = {m.lower() for m in KNOWN}
    assert not [m for m in models if m.lower() not in known]


@pytest.mark.parametrize("model,params_b", [
    ("Qwen/Qwen2.5-3B", 3.09), ("Qwen/Qwen2.5-7B", 7.62), ("Qwen/Qwen2.5-0.5B-Instruct", 0.49),
    ("Qwen/Qwen2.5-1.5B", 1.54), ("Qwen/Qwen3-0.6B", 0.60), ("Qwen/Qwen3-1.7B", 1.72), ("Qwen/Qwen3-4B", 4.02),
    ("Qwen/Qwen3-8B", 8.19), ("HuggingFaceTB/SmolLM2-135M-Instruct", 0.1345)])
def test_known_shapes_give_the_published_parameter_counts(model, params_b):
    from masrl.plan.shapes import KNOWN, shape_from_fields

    assert shape_from_fields(model, KNOWN[model]).params / 1e9 == pytest.approx(params_b, rel=0.01)


def test_qwen25_3b_shape_is_the_published_config():
    from masrl.plan.shapes import KNOWN, shape_from_fields

    s = shape_from_fields("Qwen/Qwen2.5-3B", KNOWN["Qwen/Qwen2.5-3B"])
    assert (s.hidden, s.layers, s.heads, s.kv_heads, s.intermediate, s.vocab, s.tied, s.qkv_bias) == \
        (2048, 36, 16, 2, 11008, 151936, True, True)


def test_shipped_hetero_example_is_planned_offline(capsys):
    """examples/gpu/search_drmas_hetero_7b_3b.yaml was the same ValueError traceback offline."""
    code = run_cli(["plan", HETERO])
    out = capsys.readouterr().out
    assert code in (0, 1), out  # a verdict either way
    assert "policy search: Qwen/Qwen2.5-3B 3.09B params" in out and "policy verifier: Qwen/Qwen2.5-7B 7.62B" in out


def _config_json(tmp_path, **fields) -> Path:
    base = {"model_type": "llama", "hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 16,
            "num_key_value_heads": 4, "intermediate_size": 4096, "vocab_size": 32000, "tie_word_embeddings": False}
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**base, **fields}))
    return path


def test_model_config_gives_the_shape_of_an_unknown_model(tmp_path, capsys):
    from masrl.plan.shapes import read_model_config, shape_from_fields

    path = _config_json(tmp_path)
    expected = shape_from_fields("acme/m", read_model_config(path)).params
    for given in (str(path), f"shared={path}", str(tmp_path)):  # a file, POLICY=file, the model's folder
        code = run_cli(["plan", QUICKSTART, "policies.shared.model=acme/m", "--model-config", given])
        out = capsys.readouterr().out
        assert code == 0 and f"acme/m {expected / 1e9:.3g}B params" in out, out


@pytest.mark.parametrize("given,needle", [
    ("nobody={path}", "no policy 'nobody'"), ("{missing}", "does not exist"), ("{bad_json}", "not JSON"),
    ("{bad_heads}", "does not divide"), ("{float_hidden}", "hidden_size must be an integer")])
def test_model_config_problems_are_one_line(tmp_path, capsys, given, needle):
    path = _config_json(tmp_path)
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "h").mkdir()
    heads = _config_json(tmp_path / "h", num_attention_heads=6)
    floats = tmp_path / "float.json"
    floats.write_text(json.dumps({**json.loads(path.read_text()), "hidden_size": 1024.5}))
    given = given.format(path=path, missing=tmp_path / "nope.json", bad_json=tmp_path / "bad.json", bad_heads=heads,
                         float_hidden=floats)
    one_error(["plan", QUICKSTART, "policies.shared.model=acme/m", "--model-config", given], capsys, needle)


# ---------------------------------------------------------------------- masrl sweep: grid and manifest sizes

def _spec(tmp_path, axes, seeds=(0,)) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({"name": "s", "base": QUICKSTART, "seeds": list(seeds), "axes": axes}))
    return path


@pytest.mark.parametrize("axes,seeds,needle", [
    ({f"a{i}": {"key": "eval.n", "values": list(range(1, 101))} for i in range(3)}, [0],
     "100 x 100 x 100 = 1,000,000 cells x 1 seeds = 1,000,000 runs; the limit is 10,000"),
    ({"a": {"key": "eval.n", "values": list(range(1, 101))}}, list(range(101)), "10,100 runs; the limit is 10,000"),
    ({"a": {"key": "eval.n", "values": [1]}}, list(range(5000)), "5,000 seeds; the limit is 1,000"),
], ids=["million_cells", "cells_x_seeds", "seeds"])
def test_sweep_grid_over_the_cap_is_refused_before_expanding(tmp_path, capsys, axes, seeds, needle):
    """A 10^6-cell grid's dry run built a million configs (it hung)."""
    t0 = time.monotonic()
    one_error(["sweep", _spec(tmp_path, axes, seeds), "--dry-run", "--out", tmp_path / "out"], capsys, needle)
    assert time.monotonic() - t0 < 10 and not (tmp_path / "out").exists()


def _manifest(out: Path, seeds, cells=("a=1",)) -> Path:
    out.mkdir()
    (out / "sweep.json").write_text(json.dumps({"name": "s", "axes": {"a": ["1"]}, "seeds": list(seeds),
                                                "cells": list(cells)}))
    return out


@pytest.mark.parametrize("what", ["seeds", "runs", "bytes"])
def test_sweep_report_refuses_a_manifest_larger_than_any_sweep_writes(tmp_path, capsys, what):
    """An 8 MB sweep.json naming 10^6 seeds: the report listed a million runs (it hung)."""
    out = tmp_path / "sw"
    if what == "seeds":
        _manifest(out, range(10 ** 6))  # 7.9 MB
        needle = "1,000,000 seeds = 1,000,000 runs"
    elif what == "runs":
        _manifest(out, range(100), [f"a={i}" for i in range(101)])
        needle = "101 cells x 100 seeds = 10,100 runs"
    else:
        out.mkdir()
        (out / "sweep.json").write_bytes(b" " * (17 << 20))
        needle = "17,825,792 bytes; the limit is 16,777,216"
    t0 = time.monotonic()
    one_error(["sweep", "report", out], capsys, needle, "sweep.json")
    assert time.monotonic() - t0 < 10 and not (out / "summary.md").exists()


# ---------------------------------------------------------------------- numeric options of the other subcommands

@pytest.mark.parametrize("argv,option", [
    (["eval", QUICKSTART, "--n", "nan"], "--n"),
    (["eval", QUICKSTART, "--limit", BIG], "--limit"),
    (["export", "run", "--out", "x", "--step", "inf"], "--step"),
    (["export", "run", "--out", "x", "--max-shard-size", "1e400GB"], "--max-shard-size"),
    (["sweep", "spec.yaml", "--jobs", "nan"], "--jobs"),
    (["sweep", "spec.yaml", "--jobs", "1000001"], "--jobs"),
    (["sweep", "spec.yaml", "--gpus-per-run", "inf"], "--gpus-per-run"),
    (["ensemble", "select", "--data", "p.jsonl", "--k", BIG], "--k"),
    (["ensemble", "select", "--data", "p.jsonl", "--split-frac", "inf"], "--split-frac"),
    (["ensemble", "rl-focal", "--data", "p.jsonl", "--episodes", "1e400"], "--episodes"),
    (["ensemble", "rl-focal", "--data", "p.jsonl", "--gamma", "nan"], "--gamma"),
    (["ensemble", "collect", QUICKSTART, "--bench", "test", "--temperature", "inf"], "--temperature"),
    (["serve-retriever", "--corpus", "synthetic_kb", "--topk", "nan"], "--topk"),
    (["serve-retriever", "--corpus", "synthetic_kb", "--max-queries", BIG], "--max-queries"),
], ids=lambda v: v if isinstance(v, str) else "-".join(v[:1] + v[-2:-1] + [v[-1][:8]]))
def test_numeric_option_out_of_range_is_one_argparse_line(tmp_path, monkeypatch, capsys, argv, option):
    """nan / inf / 10^400 reached the command (a traceback, a hang or a run with a nonsense value) before."""
    monkeypatch.chdir(tmp_path)
    line = one_error(argv, capsys, f"argument {option}", "give ")
    assert len(line) < 300


def test_model_config_that_no_policy_uses_is_still_read(tmp_path, capsys):
    """A mistyped path is not ignored because every policy is tiny."""
    one_error(["plan", QUICKSTART, "--model-config", tmp_path / "nope.json"], capsys, "does not exist")
    one_error(["plan", QUICKSTART, "--model-config", _config_json(tmp_path)], capsys, "every policy", "POLICY=PATH")
