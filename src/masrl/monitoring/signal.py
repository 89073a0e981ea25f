"""No learning signal: RL steps in which every advantage is 0, so the update has nothing to follow.

Group-relative estimators centre each group's scores, so a group whose episodes all scored the same (all 0 on
tasks too hard for the model, all 1 on tasks too easy, a reward function that returns one constant) gives each of
its turns advantage 0. When that holds for every group of a step, the step trains nothing the rewards asked for.
A run that only ever sees such steps looks like a run that merely did not improve, while the usual cause is a bug
upstream: a reward that never matches (an answer format the reward does not parse, a wrong ground-truth field), a
``max_new_tokens`` that cuts every answer, a reward function that returns 0 on every input.

Per RL step ``SignalMonitor`` logs ``team/flat_group_share`` (share of the step's groups whose episodes all
scored the same team reward) and ``team/zero_advantage_share`` (share of the step's turns whose advantage is
exactly 0). ``patience`` consecutive steps with every advantage 0 raise one warning that says what the rewards
were (all 0, or all equal within each group) and where to look; the warning comes again only after a step with
signal. With ``action: stop`` the run ends instead after that step (logged first), with ``NoSignalError``
(exit 2). At the end of a run the
trainer writes the counts to report.json and report.md, and a run none of whose RL steps had a reward other than 0
ends with a warning line: it is never finished silently.
"""
from __future__ import annotations

import warnings
from collections import defaultdict
from typing import Sequence

import torch

from masrl.errors import UserInputError
from masrl.types import Episode

__all__ = ["NoSignalError", "NoSignalWarning", "SignalMonitor", "ACTIONS"]

ACTIONS = ("log", "stop")
_WHERE = ("check the reward (task.params.reward or the task's own), the answer format it parses, and each agent's "
          "max_new_tokens; monitoring.no_signal sets the patience and the action "
          "(docs/monitoring.md#no-learning-signal-signalpy)")


class NoSignalError(UserInputError):
    """``monitoring.no_signal.action: stop`` and ``patience`` steps without a learning signal."""


class NoSignalWarning(UserWarning):
    """``patience`` steps without a learning signal (``action: log``); ``masrl: warning: ...`` on the command line."""


class SignalMonitor:
    """See the module docstring. ``update(step, episodes, advantages)`` once per RL step (``step``: the number
    metrics.jsonl gives it)."""

    def __init__(self, *, action: str = "log", patience: int = 5):
        if action not in ACTIONS:
            raise ValueError(f"no_signal action must be one of {ACTIONS}, got {action!r}")
        self.action, self.patience = action, patience
        self.streak: list[int] = []      # steps of the current run of steps without signal
        self.no_signal_steps = 0         # steps without signal, all runs of them
        self.zero_reward_steps = 0       # steps whose episodes all scored a team reward of 0
        self.steps = 0
        self.warnings: list[str] = []
        self.stop_message: str | None = None  # action stop: why the run ends after this step

    def update(self, step: int, episodes: Sequence[Episode], advantages: torch.Tensor) -> dict[str, float]:
        groups: dict[int, set[float]] = defaultdict(set)
        for e in episodes:
            groups[e.group_id].add(float(e.reward))
        zero = advantages == 0
        metrics = {"team/flat_group_share": sum(len(r) == 1 for r in groups.values()) / max(len(groups), 1),
                   "team/zero_advantage_share": float(zero.float().mean()) if zero.numel() else 1.0}
        self.steps += 1
        all_zero_reward = all(float(e.reward) == 0.0 for e in episodes)
        self.zero_reward_steps += all_zero_reward
        if not bool(zero.all()):
            self.streak = []
            return metrics
        self.no_signal_steps += 1
        self.streak.append(step)
        if len(self.streak) == self.patience:
            self._raise(all_zero_reward, sorted(groups.values(), key=len))
        return metrics

    def _raise(self, all_zero_reward: bool, groups: list[set[float]]) -> None:
        if all_zero_reward:
            what = "every episode's team reward was 0"
        else:
            values = sorted({v for g in groups for v in g})
            what = ("every group's episodes scored the same team reward (values seen: "
                    + ", ".join(f"{v:g}" for v in values[:5]) + (", ..." if len(values) > 5 else "") + ")")
        message = (f"no learning signal for {self.patience} RL steps (steps {self.streak[0]}-{self.streak[-1]}): "
                   f"{what}, so every advantage was 0 and the update had nothing to follow; {_WHERE}")
        if self.action == "stop":
            self.stop_message = f"{message} (monitoring.no_signal.action: stop)"
            return
        self.warnings.append(message)
        warnings.warn(message, NoSignalWarning, stacklevel=3)

    def summary(self) -> dict:
        return {"action": self.action, "patience": self.patience, "steps": self.steps,
                "no_signal_steps": self.no_signal_steps, "zero_reward_steps": self.zero_reward_steps}

    def final_warning(self) -> str | None:
        """The end-of-run line for a run that never had a reward other than 0 (None otherwise)."""
        if self.steps and self.zero_reward_steps == self.steps:
            return (f"every episode of all {self.steps} RL steps scored a team reward of 0: the run learned nothing "
                    f"from its rewards; {_WHERE}")
        return None

    def state_dict(self) -> dict:
        return {"streak": list(self.streak), "no_signal_steps": self.no_signal_steps,
                "zero_reward_steps": self.zero_reward_steps, "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.streak = [int(s) for s in state.get("streak", [])]
        self.no_signal_steps = int(state.get("no_signal_steps", 0))
        self.zero_reward_steps = int(state.get("zero_reward_steps", 0))
        self.steps = int(state.get("steps", 0))
