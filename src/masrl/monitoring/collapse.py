"""A collapse detector beside the gradient-spike monitor: the team's training reward and each agent's reply
length, entropy and share of invalid turns, each against its own running baseline.

Every RL step, each signal's value is compared with the median of its last ``window`` *accepted* values
(values that breached do not enter the window, so a collapse cannot become its own baseline). Once a signal
has ``min_history`` accepted values, a value *breaches* when

* ``team/reward`` (mean reward of the step's episodes) falls below ``reward_drop x baseline`` — only while the
  baseline is at least ``reward_floor`` (a team that earns nothing yet has nothing to lose);
* ``agent/<a>/length_mean`` leaves ``[baseline / length_ratio, baseline x length_ratio]`` (longer or shorter);
* ``agent/<a>/entropy`` exceeds ``baseline x entropy_ratio`` and ``baseline + entropy_floor`` (mean token
  entropy in nats; the absolute floor keeps a near-deterministic agent's noise from counting);
* ``agent/<a>/invalid_rate`` exceeds ``baseline + invalid_rise``.

``patience`` consecutive breaches raise one ``CollapseEvent`` (logged as ``collapse/<signal>`` = 1 at that
step, and a warning); the signal fires again only after a value back inside its band. The action tells the
trainer what to do on an event: ``log``, ``stop`` (end RL after this step; the final evaluation and checkpoint
follow) or ``rollback`` (end RL and restore the newest checkpoint saved before the first breach, so the final
evaluation, report and export are of the last good weights). Semantics and the E3 evaluation:
docs/monitoring.md.
"""
from __future__ import annotations

import logging
import math
from collections import deque
from statistics import median
from dataclasses import asdict, dataclass
from typing import Any, Mapping

__all__ = ["CollapseEvent", "CollapseMonitor", "ACTIONS"]

logger = logging.getLogger("masrl.monitoring")
ACTIONS = ("log", "stop", "rollback")
_AGENT_SIGNALS = ("length_mean", "entropy", "invalid_rate")


@dataclass(frozen=True)
class CollapseEvent:
    signal: str          # the metric name: team/reward, agent/<a>/length_mean, ...
    step: int            # the step it fired at (the patience-th consecutive breach)
    first_breach: int    # the first step of that run of breaches
    value: float
    baseline: float

    def describe(self) -> str:
        return (f"collapse signal {self.signal}: {self.value:.4g} against its baseline {self.baseline:.4g} for "
                f"{self.step - self.first_breach + 1} steps (steps {self.first_breach}-{self.step})")


class CollapseMonitor:
    """See the module docstring. ``update(step, metrics)`` once per RL step with that step's metrics."""

    def __init__(self, agents: list[str] | tuple[str, ...], *, action: str = "log", window: int = 10,
                 min_history: int = 2, patience: int = 2, reward_drop: float = 0.5, reward_floor: float = 0.05,
                 length_ratio: float = 1.5, entropy_ratio: float = 1.5, entropy_floor: float = 0.05,
                 invalid_rise: float = 0.2):
        if action not in ACTIONS:
            raise ValueError(f"collapse action must be one of {ACTIONS}, got {action!r}")
        self.agents, self.action = list(agents), action
        self.window, self.min_history, self.patience = window, min_history, patience
        self.reward_drop, self.reward_floor = reward_drop, reward_floor
        self.length_ratio, self.entropy_ratio, self.entropy_floor = length_ratio, entropy_ratio, entropy_floor
        self.invalid_rise = invalid_rise
        self.history: dict[str, deque] = {}
        self.streak: dict[str, list[int]] = {}   # signal -> steps of the current run of breaches
        self.fired: set[str] = set()             # signals whose current run has already raised an event
        self.events: list[CollapseEvent] = []
        self.stop_event: CollapseEvent | None = None  # the first event of this process under stop / rollback

    def signals(self) -> list[str]:
        return ["team/reward", *(f"agent/{a}/{s}" for a in self.agents for s in _AGENT_SIGNALS)]

    def breaches(self, signal: str, value: float, baseline: float) -> bool:
        kind = signal.rsplit("/", 1)[-1]
        if kind == "reward":
            return baseline >= self.reward_floor and value < self.reward_drop * baseline
        if kind == "length_mean":
            return baseline > 0 and not baseline / self.length_ratio <= value <= baseline * self.length_ratio
        if kind == "entropy":
            return value > baseline * self.entropy_ratio and value > baseline + self.entropy_floor
        return value > baseline + self.invalid_rise  # invalid_rate

    def update(self, step: int, metrics: Mapping[str, Any]) -> list[CollapseEvent]:
        """The events this step raises (usually none)."""
        new = []
        for signal in self.signals():
            value = metrics.get(signal)
            if value is None or not math.isfinite(float(value)):
                continue
            value = float(value)
            hist = self.history.setdefault(signal, deque(maxlen=self.window))
            baseline = median(hist) if len(hist) >= self.min_history else None
            if baseline is None or not self.breaches(signal, value, baseline):
                hist.append(value)
                self.streak.pop(signal, None)
                self.fired.discard(signal)
                continue
            run = self.streak.setdefault(signal, [])
            run.append(step)
            if len(run) >= self.patience and signal not in self.fired:
                self.fired.add(signal)
                event = CollapseEvent(signal, step, run[0], value, baseline)
                new.append(event)
                logger.warning("step %d: %s (monitoring.collapse.action: %s): the run may be collapsing; compare "
                               "the held-out accuracy (docs/monitoring.md#collapse-detector-collapsepy)",
                               step, event.describe(), self.action)
        self.events.extend(new)
        if new and self.action != "log" and self.stop_event is None:
            self.stop_event = new[0]
        return new

    @property
    def stop_requested(self) -> bool:
        """An event under ``stop``/``rollback`` since this monitor was built or loaded (a resumed run that
        stopped before goes on until a new event)."""
        return self.stop_event is not None

    def first_breach(self) -> int | None:
        """The first step of the breaches that raised the stopping event."""
        return self.stop_event.first_breach if self.stop_event is not None else None

    def state_dict(self) -> dict:
        return {"history": {k: list(v) for k, v in self.history.items()}, "streak": dict(self.streak),
                "fired": sorted(self.fired), "events": [asdict(e) for e in self.events]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.history = {k: deque(v, maxlen=self.window) for k, v in state.get("history", {}).items()}
        self.streak = {k: list(v) for k, v in state.get("streak", {}).items()}
        self.fired = set(state.get("fired", []))
        self.events = [CollapseEvent(**e) for e in state.get("events", [])]


def replay(metrics_rows: list[Mapping[str, Any]], agents: list[str], **kwargs: Any) -> list[CollapseEvent]:
    """Run the monitor over a finished run's ``metrics.jsonl`` train records (the same calls the trainer makes)."""
    monitor = CollapseMonitor(agents, **kwargs)
    for row in metrics_rows:
        if row.get("phase", "train") == "train":
            monitor.update(int(row["step"]), row)
    return monitor.events
