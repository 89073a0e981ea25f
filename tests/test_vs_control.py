"""benchmarks/study/vs_control.py: a control sweep's arm against every team arm, paired on seeds
(hand-computed intervals)."""
import json

import pytest

from conftest import load_benchmark

vc = load_benchmark("study/vs_control.py")


def summary(name: str, arms: dict[str, dict[str, list[float]]]) -> dict:
    metrics = {}
    for stage in ("sft", "rl", "gain"):
        metrics[f"avg@4_{stage}"] = {"arms": {arm: {"values": {str(s): v for s, v in enumerate(by[stage])}}
                                              for arm, by in arms.items()}}
    return {"name": name, "metrics": metrics}


TEAM = summary("team", {"policy=shared": {"sft": [29.0, 29.0, 28.5], "rl": [39.0, 40.5, 36.5],
                                          "gain": [10.0, 11.5, 8.0]}})
CONTROL = summary("ctl", {"workflow=single": {"sft": [28.0, 31.0, 33.5], "rl": [39.0, 43.5, 46.5],
                                              "gain": [11.0, 12.5, 13.0]}})


def test_paired_control_minus_team_by_hand():
    # after RL, control − team per seed: 0, 3, 10 -> mean 13/3, sd sqrt(79/3), t(0.975, 2) = 4.3027:
    # half-width 4.3027 * 5.1316 / sqrt(3) = 12.75; seeds: 2 ahead, 0 behind, 1 tied
    text = vc.table(TEAM, CONTROL)
    assert ("| policy=shared | after RL | 38.7 ± 5.0 (n = 3) | 43.0 ± 9.4 (n = 3) | +4.3 ± 12.7 (n = 3) | 2 / 0 / 1 |"
            in text)
    # gain: 1, 1, 5 -> mean 7/3, sd sqrt(16/3) = 2.309, half-width 5.74
    assert ("| policy=shared | RL gain | 9.8 ± 4.4 (n = 3) | 12.2 ± 2.6 (n = 3) | +2.3 ± 5.7 (n = 3) | 3 / 0 / 0 |"
            in text)


def test_one_seed_has_no_interval():
    """A cell with one finished seed shows its value without an interval, not "± 0.0"."""
    team = summary("team", {"policy=isolated": {"sft": [29.0], "rl": [36.0], "gain": [7.0]}})
    text = vc.table(team, CONTROL)
    assert ("| policy=isolated | after RL | 36.0 (no interval) (n = 1) | 43.0 ± 9.4 (n = 3) | "
            "+3.0 (no interval) (n = 1) | 1 / 0 / 0 |") in text


def test_a_missing_summary_or_arm_is_one_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="no summary; run `masrl sweep report"):
        vc.main([str(tmp_path), str(tmp_path)])
    with pytest.raises(SystemExit, match="control arm 'workflow=multi' is not in the control sweep"):
        vc.table(TEAM, CONTROL, "workflow=multi")


def test_main_reads_the_two_folders(tmp_path, capsys):
    for name, s in (("team", TEAM), ("ctl", CONTROL)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps(s))
    assert vc.main([str(tmp_path / "team"), str(tmp_path / "ctl")]) == 0
    assert "+4.3 ± 12.7" in capsys.readouterr().out
