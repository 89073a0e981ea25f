"""benchmarks/overlap_model.py: the rollout/update overlap model from a run's step breakdown (hand-computed)."""
import json

import pytest

from conftest import load_benchmark

om = load_benchmark("overlap_model.py")


def _run(tmp_path, name, steps, k=0):
    run = tmp_path / name
    run.mkdir()
    (run / "config.yaml").write_text(f"rollout: {{max_staleness: {k}}}\n")
    rows = [{"step": 0, "phase": "eval", "eval/test/avg@4": 0.1}]
    for i, (r, u, t, ages) in enumerate(steps, 1):
        rows.append({"step": i, "phase": "train", "perf/rollout_seconds": r, "perf/update_seconds": u,
                     "perf/step_seconds": t, **{f"rollout/staleness_{a}": s for a, s in ages.items()}})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_on_policy_breakdown_and_prediction(tmp_path):
    # the first step (warm-up) is left out; medians of the rest: R 3, U 2, T 5.5 -> O 0.5
    run = _run(tmp_path, "k0", [(30.0, 9.0, 40.0, {}), (3.0, 2.0, 5.5, {}), (4.0, 1.0, 5.5, {}), (2.0, 3.0, 5.5, {})])
    b = om.step_breakdown(run)
    assert (b["R"], b["U"], b["T"], b["O"], b["steps"], b["max_staleness"]) == (3.0, 2.0, 5.5, 0.5, 3, 0)
    p = om.predict(b)
    assert p["own_devices_T"] == 3.5 and p["own_devices_speedup"] == pytest.approx(5.5 / 3.5)
    assert p["fixed_split_T"] == p["shared_devices_T"] == 5.5 and p["rollout_share"] == 0.6


def test_off_policy_run_reports_its_wait_and_mean_age(tmp_path, capsys):
    run = _run(tmp_path, "k1", [(1.0, 2.0, 3.0, {0: 1.0}), (0.5, 2.0, 2.6, {0: 0.25, 1: 0.75}),
                                (0.5, 2.0, 2.6, {1: 1.0})], k=1)
    b = om.step_breakdown(run)
    assert b["max_staleness"] == 1 and b["R"] == 0.5 and b["mean_age"] == pytest.approx((0.75 + 1.0) / 2)
    assert om.main([str(tmp_path), "--json", str(tmp_path / "o.json")]) == 0
    out = capsys.readouterr().out
    assert "| k1 | 1 | 0.50 | 2.00 |" in out.replace(f"{tmp_path.name}/", "")
    assert len(json.loads((tmp_path / "o.json").read_text())) == 1


def test_a_folder_found_without_rl_steps_is_skipped_with_a_line(tmp_path, capsys):
    _run(tmp_path, "k0", [(3.0, 2.0, 5.5, {}), (3.0, 2.0, 5.5, {})])
    (tmp_path / "_stash").mkdir()
    (tmp_path / "_stash" / "metrics.jsonl").write_text(json.dumps({"step": 0, "phase": "eval"}) + "\n")
    assert om.main([str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert "| k0 | 0 |" in captured.out.replace(f"{tmp_path.name}/", "") and "skipped:" in captured.err
    with pytest.raises(ValueError):  # named on the command line: an error
        om.main([str(tmp_path / "_stash")])


def test_too_few_steps_is_one_clear_error(tmp_path):
    run = _run(tmp_path, "short", [(1.0, 1.0, 2.0, {})])
    with pytest.raises(ValueError, match="fewer than 2 RL steps"):
        om.step_breakdown(run)
