"""Dashboard PNG from a synthetic metrics.jsonl (incl. a half-written last line)."""
from __future__ import annotations

import json

import pytest

from masrl.monitoring.dashboard import PANELS, load_metrics, plot_dashboard

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _rows(n=30):
    rows = []
    for step in range(n):
        row = {"step": step, "team/accuracy": 0.3 + 0.01 * step, "team/reward": 0.3 + 0.01 * step}
        for role, k in (("Generator", 1.0), ("Aggregator", 0.5)):
            row[f"agent/{role}/reward"] = 0.2 * k + 0.01 * step
            row[f"agent/{role}/length_mean"] = 200 * k + step
            row[f"agent/{role}/length_p95"] = 400 * k + step
            row[f"agent/{role}/chi2_drift"] = 0.0 if step == 0 else 0.05 * k * step
            row[f"agent/{role}/perplexity"] = 1.5 + 0.01 * step
        for policy in ("gen", "agg"):
            row[f"policy/{policy}/grad_norm"] = 1.0 + 0.1 * (step % 3)
            row[f"policy/{policy}/kl"] = 0.001 * step
            row[f"policy/{policy}/entropy"] = 1.0 - 0.01 * step
        if step % 10 == 0:
            row["eval/arith/avg@4"] = 0.25 + 0.02 * step
        rows.append(row)
    rows[12]["policy/gen/grad_norm"] = 55.0
    rows[12]["policy/gen/grad_spike"] = 1.0
    rows[20]["policy/agg/grad_spike"] = 1.0  # spike whose grad norm is missing (non-finite -> dropped)
    rows[20]["policy/agg/grad_norm"] = float("nan")
    rows[5]["agent/Generator/chi2_drift"] = float("inf")
    return rows


def _write(path, rows, tail=""):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")  # json.dumps writes NaN/Infinity, as Python sinks do
        f.write(tail)


def _is_png(path):
    data = path.read_bytes()
    return data[:8] == PNG_MAGIC and data[12:16] == b"IHDR" and len(data) > 1000


def test_dashboard_writes_a_valid_png(tmp_path):
    _write(tmp_path / "metrics.jsonl", _rows())
    paths = plot_dashboard(tmp_path)
    assert paths == [tmp_path / "plots" / "dashboard.png"]
    assert _is_png(paths[0])
    assert not [p for p in (tmp_path / "plots").iterdir() if p.name.startswith(".")]  # no temp file left


def test_dashboard_tolerates_truncated_last_line_and_garbage(tmp_path):
    rows = _rows(24)
    _write(tmp_path / "metrics.jsonl", rows[:6], tail='not json\n[1, 2]\n{"team/accuracy": 0.5}\n\n')
    with open(tmp_path / "metrics.jsonl", "a") as f:
        for r in rows[6:]:
            f.write(json.dumps(r) + "\n")
        f.write('{"step": 24, "team/accuracy": 0.9, "agent/Gen')  # partial write, no newline
    series = load_metrics(tmp_path / "metrics.jsonl")
    assert [s for s, _ in series["team/accuracy"]] == list(range(24))  # garbage + partial line skipped
    paths = plot_dashboard(tmp_path)
    assert len(paths) == 1 and _is_png(paths[0])


def test_load_metrics_drops_non_finite_and_non_numeric(tmp_path):
    _write(tmp_path / "metrics.jsonl", [
        {"step": 1, "a": float("nan"), "b": 2, "c": "text", "d": True, "e": float("inf")},
        {"step": None, "a": 1.0},
        {"step": 0, "a": 3.0},
        {"step": 1, "b": 5.0},  # step logged again (resume): last value wins
    ])
    series = load_metrics(tmp_path / "metrics.jsonl")
    assert series == {"b": [(1.0, 5.0)], "a": [(0.0, 3.0)]}


def test_dashboard_with_few_keys_and_no_data(tmp_path):
    _write(tmp_path / "metrics.jsonl", [{"step": 0, "agent/Solver/length_mean": 12.0}])
    assert _is_png(plot_dashboard(tmp_path)[0])

    empty = tmp_path / "empty"
    empty.mkdir()
    _write(empty / "metrics.jsonl", [{"step": 0, "something/else": 1.0}])
    assert plot_dashboard(empty) == [] and not (empty / "plots").exists()

    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        plot_dashboard(tmp_path / "missing")


@pytest.mark.parametrize("name,panel,label", [
    ("team/accuracy", "accuracy", "team (train)"),
    ("eval/aime25/avg@16", "accuracy", "eval/aime25 avg@16"),
    ("agent/Verifier/reward", "reward", "agent/Verifier"),
    ("policy/shared/grad_norm", "grad norm (x = spike)", "policy/shared"),
    ("agent/Worker/grad_norm", "grad norm (x = spike)", "agent/Worker"),
    ("policy/p/kl", "KL to reference", "policy/p"),
    ("agent/Solver/kl_ref", "KL to reference", "agent/Solver"),
    ("policy/p/approx_kl", "update size (approx_kl, rollout vs updated policy)", "policy/p"),
    ("policy/p/entropy", "entropy", "policy/p"),
    ("agent/Generator/length_p95", "response length (tokens)", "agent/Generator p95"),
    ("agent/Generator/chi2_drift", "unigram drift (chi2 vs step 0)", "agent/Generator"),
])
def test_panel_matching(name, panel, label):
    matches = {p.title: p.match(name) for p in PANELS}
    assert matches[panel] == label
    assert sum(v is not None for v in matches.values()) == 1
    assert all(p.match("eval/aime25/pass@16") is None for p in PANELS)
