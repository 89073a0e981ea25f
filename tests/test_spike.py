"""Gradient-spike detector and role-capture monitor."""
from __future__ import annotations

import logging
import math

import numpy as np
import pytest

from masrl.monitoring.spike import RoleCaptureMonitor, SpikeDetector


def _series(shape: str, seed: int, n: int = 400) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(n)
    if shape == "flat":
        level = np.full(n, 1.0)
    elif shape == "rising":      # slow upward drift x3 over the run
        level = 1.0 + 2.0 * t / n
    elif shape == "decaying":    # typical early-training decay
        level = 0.3 + 2.0 * np.exp(-t / 150)
    else:                        # slow oscillation
        level = 1.0 + 0.3 * np.sin(2 * np.pi * t / 200)
    if seed % 2:
        noise = rng.normal(0.0, 0.08, n)                 # gaussian, 8%
        return level * (1.0 + noise)
    return level * np.exp(rng.normal(0.0, 0.06, n))      # multiplicative lognormal


SHAPES = ["flat", "rising", "decaying", "wave"]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_clean_series_has_no_flags(shape, seed):
    det = SpikeDetector()
    flags = [det.check("policy", x, step).is_spike for step, x in enumerate(_series(shape, seed))]
    assert not any(flags)
    assert det.counts.get("policy", 0) == 0 and det.events == []


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_planted_spikes_are_all_flagged(shape, seed):
    series = _series(shape, seed)
    rng = np.random.default_rng(100 + seed)
    planted = sorted(set(rng.choice(np.arange(20, len(series)), size=8, replace=False).tolist()) | {150, 151, 152})
    for i in planted:
        series[i] *= rng.uniform(3.0, 30.0)   # 3x .. 30x the local level
    det = SpikeDetector()
    flagged = [step for step, x in enumerate(series) if det.check("policy", float(x), step).is_spike]
    assert flagged == planted  # every planted spike (incl. a 3-step burst), nothing else
    assert det.counts["policy"] == len(planted)
    assert [e.step for e in det.events] == planted and all(e.key == "policy" for e in det.events)


def test_no_flag_before_min_history_and_keys_are_independent():
    det = SpikeDetector(min_history=10)
    for step in range(9):
        assert not det.check("a", 1.0 + 0.01 * (step % 3), step).is_spike
    assert not det.check("a", 1000.0, 9).is_spike  # only 9 values in the window
    assert det.check("a", 1000.0, 10).is_spike      # 10 values now (the unflagged 1000 is one of them)
    # key "b" has no history: never flagged, z is nan and bound inf
    d = det.check("b", 1e9, 11)
    assert not d.is_spike and math.isnan(d.z) and d.bound == math.inf


def test_z_score_and_bound_formula():
    det = SpikeDetector(window=50, threshold=6.0, min_history=5, rel_floor=0.0)
    hist = [1.0, 2.0, 3.0, 4.0, 5.0]  # median 3, MAD 1
    for step, x in enumerate(hist):
        det.check("k", x, step)
    d = det.check("k", 20.0, 5)
    scale = 1.4826 * 1.0 + 1e-12
    assert d.z == pytest.approx((20.0 - 3.0) / scale)
    assert d.bound == pytest.approx(3.0 + 6.0 * scale)
    assert d.is_spike and d.action == "log" and d.scale == 1.0


def _warm(det, key="k", n=30):
    rng = np.random.default_rng(0)
    for step in range(n):
        det.check(key, 1.0 + 0.05 * rng.standard_normal(), step)


def test_actions():
    log = SpikeDetector(action="log")
    skip = SpikeDetector(action="skip")
    scale = SpikeDetector(action="scale")
    for det in (log, skip, scale):
        _warm(det)
    d = log.check("k", 50.0, 100)
    assert d.is_spike and d.action == "log" and d.scale == 1.0
    d = skip.check("k", 50.0, 100)
    assert d.is_spike and d.action == "skip" and d.scale == 0.0
    d = scale.check("k", 50.0, 100)
    assert d.is_spike and d.action == "scale"
    assert d.scale == pytest.approx(d.bound / 50.0) and 50.0 * d.scale == pytest.approx(d.bound)
    assert 0 < d.scale < 1
    ok = scale.check("k", 1.0, 101)
    assert not ok.is_spike and ok.action == "none" and ok.scale == 1.0
    # the trainer-guard form: None, or (action, scale) at a spike
    assert skip.guard("k", 1.0, 102) is None
    assert skip.guard("k", 50.0, 103) == ("skip", 0.0)
    assert log.guard("k", 50.0, 103) == ("log", 1.0)
    with pytest.raises(ValueError, match="action"):
        SpikeDetector(action="clip")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("action,expected_action,expected_scale", [("log", "log", 1.0), ("skip", "skip", 0.0),
                                                                   ("scale", "skip", 0.0)])
def test_non_finite_is_always_a_spike(value, action, expected_action, expected_scale):
    det = SpikeDetector(action=action)
    d = det.check("k", value, 0)  # even with no history
    assert d.is_spike and d.action == expected_action and d.scale == expected_scale
    assert det.counts["k"] == 1
    _, _, n = det.stats("k")
    assert n == 0  # never enters the window


def test_flagged_values_do_not_enter_the_window():
    det = SpikeDetector(window=20, reset_after=None)
    _warm(det, n=20)
    before = det.stats("k")
    for step in range(15):  # long burst
        assert det.check("k", 40.0, 100 + step).is_spike
    assert det.stats("k") == before


def test_level_shift_is_accepted_after_reset_after():
    det = SpikeDetector(reset_after=5)
    _warm(det)
    flags = [det.check("k", 10.0 * (1 + 0.01 * (i % 3)), 100 + i).is_spike for i in range(12)]
    assert flags[:5] == [True] * 5 and not any(flags[5:])
    assert [e.kind for e in det.events].count("reset") == 1


def test_zero_grad_norm_is_ignored():
    det = SpikeDetector(min_history=3)
    for step in range(20):
        d = det.check("role", 0.0, step)
        assert not d.is_spike
    assert det.stats("role")[2] == 0
    for step in range(20, 40):  # the role starts acting: its real norms are not spikes
        assert not det.check("role", 1.0 + 0.01 * (step % 5), step).is_spike


def test_state_dict_roundtrip_and_metrics():
    det = SpikeDetector(action="skip")
    _warm(det)
    det.check("k", 99.0, 50)
    other = SpikeDetector(action="skip")
    other.load_state_dict(det.state_dict())
    assert other.stats("k") == det.stats("k") and other.counts == det.counts
    d = other.check("k", 99.0, 51)
    assert d.is_spike
    m = other.to_metrics({"k": d, "j": det.check("j", 1.0, 51)})
    assert m["policy/k/grad_spike"] == 1.0 and m["policy/j/grad_spike"] == 0.0
    assert m["policy/k/grad_spikes_total"] == 2.0


# ---------------------------------------------------------------- role capture


def test_role_capture_fires_after_patience_and_not_before(caplog):
    mon = RoleCaptureMonitor(threshold=0.8, patience=4)
    with caplog.at_level(logging.WARNING, logger="masrl.monitoring"):
        for step in range(3):
            assert mon.update(step, {"Worker": 9.0, "Orchestrator": 0.5, "Synthesizer": 0.5}) == []
        assert caplog.records == []
        events = mon.update(3, {"Worker": 9.0, "Orchestrator": 0.5, "Synthesizer": 0.5})
    assert len(events) == 1 and events[0].role == "Worker" and events[0].consecutive == 4
    assert events[0].share == pytest.approx(0.9)
    assert any("Worker" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert mon.to_metrics()["agent/Worker/grad_share"] == pytest.approx(0.9)


def test_role_capture_streak_resets_when_share_drops():
    mon = RoleCaptureMonitor(threshold=0.8, patience=3)
    heavy, balanced = {"A": 9.0, "B": 1.0}, {"A": 1.0, "B": 1.0}
    fired = []
    for step, norms in enumerate([heavy, heavy, balanced, heavy, heavy, heavy, heavy, heavy, heavy]):
        fired += [(step, e.role) for e in mon.update(step, norms)]
    assert fired == [(5, "A"), (8, "A")]  # 3 in a row after the reset, then every further 3
    assert mon.events[0].step == 5


def test_role_capture_skips_degenerate_steps():
    mon = RoleCaptureMonitor(threshold=0.8, patience=1)
    assert mon.update(0, {"A": 1.0}) == []                     # one role: no capture possible
    assert mon.update(1, {"A": 0.0, "B": 0.0}) == []            # no gradient mass
    assert mon.update(2, {"A": float("nan"), "B": 1.0}) == []   # non-finite
    assert [e.role for e in mon.update(3, {"A": 0.0, "B": 1.0})] == ["B"]
    with pytest.raises(ValueError):
        RoleCaptureMonitor(threshold=1.5)


def test_every_monitor_warning_says_what_it_means_and_links_its_doc():
    """A warning a run can print (role capture, spike window reset, collapse, no signal) carries a one-line
    meaning and a link to its section of docs/monitoring.md, and the link's anchor exists there."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    headings = [line.lstrip("#").strip() for line in (root / "docs" / "monitoring.md").read_text().splitlines()
                if line.startswith("#")]
    anchors = {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}
    for name in ("spike.py", "collapse.py", "signal.py"):
        text = (root / "src" / "masrl" / "monitoring" / name).read_text()
        calls = re.findall(r"(?:logger\.warning|_WHERE = )\((.*?)\)\n", text, re.S)
        assert calls, name
        for call in calls:
            links = re.findall(r"docs/monitoring\.md#([\w-]+)", call)
            assert links and set(links) <= anchors, (name, call[:80], links)


def test_role_capture_warning_explains_itself(caplog):
    mon = RoleCaptureMonitor(threshold=0.8, patience=1)
    with caplog.at_level(logging.WARNING, logger="masrl.monitoring"):
        mon.update(0, {"Solver": 9.6, "Verifier": 0.4})
    message = caplog.records[0].getMessage()
    assert "Solver holds 96%" in message and "role-balanced" in message
    assert "docs/monitoring.md#role-capture-rolecapturemonitor" in message
