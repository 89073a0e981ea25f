"""Gradient-spike detection per policy or role, and a role-capture indicator for shared policies.

``SpikeDetector`` scores each new grad norm against a running window of the key's recent
*accepted* values with a robust z-score::

    z     = (x − median) / scale,   scale = max(1.4826·MAD, rel_floor·|median|) + tiny
    bound = median + threshold · scale

and flags ``z > threshold`` once the key has ``min_history`` accepted values (non-finite values
are always spikes). The configured action tells the trainer what to do: ``log`` (nothing),
``skip`` (skip that policy's optimizer step) or ``scale`` (multiply the gradients by
``bound / x``, i.e. clip the norm to the running bound).

Flagged values never enter the window, so a burst of spikes cannot inflate the median/MAD and
hide the spikes that follow. A genuine level shift would then be flagged forever; after
``reset_after`` consecutive flagged finite values the detector accepts the new level (the window
is replaced by those values, an event of kind ``"reset"`` is recorded).

``RoleCaptureMonitor`` watches each role's share of the per-step gradient mass under a shared
policy (arXiv 2605.24202: the role with dominant gradient mass "captures" the shared policy) and
warns when one role's share stays above ``threshold`` for ``patience`` consecutive steps.
Math and semantics: docs/monitoring.md.
"""
from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

__all__ = ["CaptureEvent", "RoleCaptureMonitor", "SpikeDecision", "SpikeDetector", "SpikeEvent"]

logger = logging.getLogger("masrl.monitoring")

MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution times this = its standard deviation
ACTIONS = ("log", "skip", "scale")


@dataclass(frozen=True)
class SpikeDecision:
    """Outcome of one check.

    ``action`` is what the trainer should do now: ``"none"`` when not a spike, else the detector's
    action (``"skip"`` instead of ``"scale"`` for a non-finite value, which cannot be rescaled).
    ``scale`` multiplies the gradients: ``bound / grad_norm`` for ``scale``, 0.0 for ``skip``,
    1.0 otherwise. ``z`` is nan and ``bound`` inf while the key has no history.
    """

    is_spike: bool
    z: float
    bound: float
    action: str
    scale: float


@dataclass(frozen=True)
class SpikeEvent:
    step: int
    key: str
    value: float
    z: float
    kind: str = "spike"  # "spike" or "reset" (level shift accepted)


@dataclass
class _KeyState:
    history: deque
    pending: list = field(default_factory=list)  # consecutive flagged finite values


class SpikeDetector:
    """Robust z-score spike detector, one running window per key (a policy or a role).

    ``SpikeDetector(window=50, threshold=6.0, min_history=10, action="log")``;
    ``check(key, grad_norm, step) -> SpikeDecision``. ``counts[key]`` = spikes so far,
    ``events`` = list of ``SpikeEvent``. Zero grad norms (no turns for that key at this
    step) are ignored when ``ignore_zero`` (default): not flagged, not added to the window.
    """

    def __init__(self, window: int = 50, threshold: float = 6.0, min_history: int = 10, action: str = "log",
                 *, rel_floor: float = 1e-3, reset_after: int | None = 20, ignore_zero: bool = True,
                 tiny: float = 1e-12):
        if action not in ACTIONS:
            raise ValueError(f"SpikeDetector: action must be one of {list(ACTIONS)}, got {action!r}")
        if window < 2:
            raise ValueError(f"SpikeDetector: window must be >= 2, got {window}")
        if not 1 <= min_history <= window:
            raise ValueError(f"SpikeDetector: min_history must be in 1..window ({window}), got {min_history}")
        if threshold <= 0:
            raise ValueError(f"SpikeDetector: threshold must be > 0, got {threshold}")
        if reset_after is not None and reset_after < 1:
            raise ValueError(f"SpikeDetector: reset_after must be >= 1 or None, got {reset_after}")
        self.window, self.threshold, self.min_history, self.action = window, float(threshold), min_history, action
        self.rel_floor, self.reset_after, self.ignore_zero, self.tiny = rel_floor, reset_after, ignore_zero, tiny
        self._state: dict[str, _KeyState] = {}
        self.counts: dict[str, int] = {}
        self.events: list[SpikeEvent] = []

    def _key(self, key: str) -> _KeyState:
        if key not in self._state:
            self._state[key] = _KeyState(deque(maxlen=self.window))
        return self._state[key]

    def stats(self, key: str) -> tuple[float, float, int]:
        """(median, scale, history length) of ``key``'s window; nan when empty."""
        hist = self._state[key].history if key in self._state else ()
        if not hist:
            return math.nan, math.nan, 0
        values = np.fromiter(hist, dtype=np.float64)
        median = float(np.median(values))
        mad = float(np.median(np.abs(values - median)))
        scale = max(MAD_TO_SIGMA * mad, self.rel_floor * abs(median)) + self.tiny
        return median, scale, len(values)

    def check(self, key: str, grad_norm: float, step: int) -> SpikeDecision:
        """Score ``grad_norm`` for ``key`` at ``step``; record it (if accepted) and any event."""
        state = self._key(key)
        x = float(grad_norm)
        median, scale, n = self.stats(key)
        bound = median + self.threshold * scale if n else math.inf
        if not math.isfinite(x):
            action = "skip" if self.action == "scale" else self.action
            self._flag(key, x, math.inf if not math.isnan(x) else math.nan, step)
            return SpikeDecision(True, math.nan if math.isnan(x) else math.inf, bound, action,
                                 0.0 if action == "skip" else 1.0)
        z = (x - median) / scale if n else math.nan
        if x == 0.0 and self.ignore_zero:
            return SpikeDecision(False, z, bound, "none", 1.0)
        if n >= self.min_history and z > self.threshold:
            self._flag(key, x, z, step)
            state.pending.append(x)
            if self.reset_after is not None and len(state.pending) >= self.reset_after:
                state.history.clear()
                state.history.extend(state.pending)
                state.pending.clear()
                self.events.append(SpikeEvent(step, key, x, z, "reset"))
                logger.warning("grad-spike detector: %s flagged %d steps in a row; accepting the new level "
                               "(window reset at step %d): its gradient norm moved for good, a concern only if "
                               "accuracy falls with it (docs/monitoring.md#gradient-spike-detector-spikepy)",
                               key, self.reset_after, step)
            if self.action == "scale":
                return SpikeDecision(True, z, bound, "scale", min(1.0, bound / x))
            return SpikeDecision(True, z, bound, self.action, 0.0 if self.action == "skip" else 1.0)
        state.pending.clear()
        state.history.append(x)
        return SpikeDecision(False, z, bound, "none", 1.0)

    def guard(self, key: str, grad_norm: float, step: int) -> tuple[str, float] | None:
        """``check`` as a trainer guard: None (go on) or ``(action, scale)`` at a spike.

        Pass ``detector.guard`` as ``update_policy(..., guard=...)``; ``("log", 1.0)`` means
        "record the spike, update as usual".
        """
        d = self.check(key, grad_norm, step)
        return (d.action, d.scale) if d.is_spike else None

    def _flag(self, key: str, value: float, z: float, step: int) -> None:
        self.counts[key] = self.counts.get(key, 0) + 1
        self.events.append(SpikeEvent(step, key, value, z))
        logger.info("grad-spike: %s at step %d: grad norm %.4g (z = %.3g)", key, step, value, z)

    def to_metrics(self, decisions: Mapping[str, SpikeDecision], prefix: str = "policy") -> dict[str, float]:
        """``{prefix}/<key>/grad_spike`` (1.0/0.0), ``grad_spike_z`` and ``grad_spikes_total`` per key."""
        out: dict[str, float] = {}
        for key, d in decisions.items():
            out[f"{prefix}/{key}/grad_spike"] = 1.0 if d.is_spike else 0.0
            out[f"{prefix}/{key}/grad_spike_z"] = float(d.z)
            out[f"{prefix}/{key}/grad_spikes_total"] = float(self.counts.get(key, 0))
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"history": {k: list(s.history) for k, s in self._state.items()},
                "pending": {k: list(s.pending) for k, s in self._state.items()},
                "counts": dict(self.counts)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._state = {k: _KeyState(deque(v, maxlen=self.window), list(state.get("pending", {}).get(k, [])))
                       for k, v in state["history"].items()}
        self.counts = dict(state.get("counts", {}))


@dataclass(frozen=True)
class CaptureEvent:
    step: int
    role: str
    share: float
    consecutive: int


class RoleCaptureMonitor:
    """Warn when one role's gradient-mass share stays above ``threshold`` for ``patience`` steps.

    ``update(step, grad_norms)`` takes each role's gradient norm on the shared policy at this step
    (``||g_r||``, from per-role backward passes or micro-batches), computes shares
    ``s_r = ||g_r|| / Σ_r' ||g_r'||`` (in ``last_shares``) and returns the capture events of this
    step. A role's streak counts consecutive steps with ``s_r > threshold``; the event fires when
    the streak reaches ``patience`` and again every further ``patience`` steps of the same streak.
    Steps with fewer than two roles, a non-finite norm, or zero total mass are skipped (streaks
    neither grow nor reset).
    """

    def __init__(self, threshold: float = 0.8, patience: int = 10):
        if not 0 < threshold < 1:
            raise ValueError(f"RoleCaptureMonitor: threshold must be in (0, 1), got {threshold}")
        if patience < 1:
            raise ValueError(f"RoleCaptureMonitor: patience must be >= 1, got {patience}")
        self.threshold, self.patience = threshold, patience
        self.streak: dict[str, int] = {}
        self.events: list[CaptureEvent] = []
        self.last_shares: dict[str, float] = {}

    def update(self, step: int, grad_norms: Mapping[str, float]) -> list[CaptureEvent]:
        norms = {r: float(v) for r, v in grad_norms.items()}
        total = sum(norms.values())
        if len(norms) < 2 or not all(math.isfinite(v) and v >= 0 for v in norms.values()) or total <= 0:
            return []
        self.last_shares = {r: v / total for r, v in norms.items()}
        fired: list[CaptureEvent] = []
        for role, share in self.last_shares.items():
            if share > self.threshold:
                self.streak[role] = self.streak.get(role, 0) + 1
                if self.streak[role] % self.patience == 0:
                    event = CaptureEvent(step, role, share, self.streak[role])
                    fired.append(event)
                    logger.warning("role capture: %s holds %.0f%% of the shared policy's gradient mass "
                                   "for %d consecutive steps (step %d): its updates steer the policy the roles share, "
                                   "the others' barely move it; common with a role that writes most tokens, a "
                                   "concern only if accuracy falls; algorithm.loss.agg: role-balanced evens it "
                                   "(docs/monitoring.md#role-capture-rolecapturemonitor)",
                                   role, 100 * share, event.consecutive, step)
            else:
                self.streak[role] = 0
        self.events.extend(fired)
        return fired

    def to_metrics(self, prefix: str = "agent") -> dict[str, float]:
        """``{prefix}/<role>/grad_share`` of the last update."""
        return {f"{prefix}/{role}/grad_share": s for role, s in self.last_shares.items()}
