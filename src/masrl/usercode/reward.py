"""A user's reward function under the user-code contract: its signature checked at load
(``check_reward_signature``), each call with a deadline in a worker process (``masrl.usercode.process.RewardProcess``) or a worker thread
(``masrl.usercode.guard.call_with_deadline``), on copies of the turns, its values checked
(``EpisodeReward``); ``process_load`` decides where it can run (``task.reward_isolation``)."""
from __future__ import annotations

import copy
import importlib.util
import inspect
import pickle
from pathlib import Path
from typing import Any, Callable, Mapping

from masrl.errors import ConfigError
from masrl.types import Episode, Task, Turn
from masrl.usercode.guard import call_with_deadline, checked_reward, reward_name

DEFAULT_TIMEOUT_S = 10.0  # task.reward_timeout_s's default


def check_reward_signature(fn: Any, name: str) -> None:
    """``fn`` can be called as masrl calls a user reward, ``fn(task, episode)``: one ConfigError otherwise."""
    expected = "def reward(task, episode) -> float | dict"
    if not callable(fn):
        raise ConfigError(f"reward {name!r} is not callable ({type(fn).__name__}); expected a function {expected}")
    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None)):
        raise ConfigError(f"reward {name!r} is an async function; masrl calls it without awaiting it: "
                          f"expected a plain function {expected}")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: it is called as it is
        return
    try:
        signature.bind(None, None)
    except TypeError as e:
        raise ConfigError(f"reward {name!r} cannot be called as {getattr(fn, '__name__', 'reward')}(task, episode): "
                          f"its signature is {signature} ({e}); expected {expected}") from None


class EpisodeReward:
    """A user's ``(task, episode) -> float | dict`` reward used as the task's score function.

    Called with an answer string (as a ``ScoreFn``) it sees an episode with no turns. Each call runs with a
    deadline of ``timeout_s`` seconds (None: in the caller's thread, no deadline) on copies of the turns;
    the ``reward`` the function sets on a turn is checked (finite, clipped) and copied back when it returns.
    """

    def __init__(self, fn: Callable[[Task, Episode], Any], name: str, timeout_s: float | None = DEFAULT_TIMEOUT_S,
                 load: tuple[str, Any] | None = None):
        self.fn, self.name, self.timeout_s = fn, name, timeout_s
        self.__name__ = name
        self.takes_episode = True  # read by Team.score: a user reward sees the turns so far
        self.process = None  # its worker process (isolation process), started at the first call
        if load is not None and timeout_s is not None:
            from masrl.usercode.process import RewardProcess

            self.process = RewardProcess(name, load)

    @property
    def isolation(self) -> str:
        """Where the calls run: ``process`` (a worker process), ``thread`` (a worker thread), ``none`` (the
        caller's thread, no deadline)."""
        return "none" if self.timeout_s is None else "process" if self.process is not None else "thread"

    def __call__(self, task: Task, answer_or_episode: Episode | str | None) -> dict:
        episode = answer_or_episode
        if not isinstance(episode, Episode):
            episode = Episode(task=task, turns=[], reward=0.0, answer=answer_or_episode)
        pairs = [(turn, copy.copy(turn)) for turn in episode.turns]  # a late (timed-out) call cannot touch the turns
        view = copy.copy(episode)
        view.turns = [mine for _, mine in pairs]
        if self.timeout_s is None:
            result = self.fn(task, view)
        elif self.process is not None:
            result, values = self.process.call(task, view, self.timeout_s)
            for mine, value in zip(view.turns, values):
                mine.reward = value
        else:
            result = call_with_deadline(self.name, self.fn, (task, view), self.timeout_s)
        out = self._team_reward(result, task)
        turn_rewards = [self._turn_reward(mine, i, task) for i, (_, mine) in enumerate(pairs)]
        for (turn, _), value in zip(pairs, turn_rewards):
            turn.reward = value
        return out

    def _team_reward(self, result: Any, task: Task) -> dict:
        if isinstance(result, Mapping):
            if "reward" not in result:
                raise ValueError(f"reward {self.name}: returned a dict without 'reward' (keys: {sorted(result)})")
            out = dict(result)
        elif isinstance(result, (int, float)) and not isinstance(result, bool):
            out = {"reward": result}
        else:
            raise ValueError(f"reward {self.name}: must return a number or a dict with 'reward', "
                             f"got {type(result).__name__}")
        out["reward"] = checked_reward(out["reward"], f"reward {self.name}: the team reward for task {task.id!r}",
                                       self.name)
        return out

    def _turn_reward(self, turn: Turn, index: int, task: Task) -> float | None:
        if turn.reward is None:
            return None
        return checked_reward(turn.reward, f"reward {self.name}: turn.reward of turn {index} ({turn.agent}) for "
                                           f"task {task.id!r}", self.name)


def process_load(spec: str | None, fn: Callable, isolation: str) -> tuple[str, Any] | None:
    """How a worker process loads the reward (``masrl.usercode.process.RewardProcess``), or None to
    run it in a thread: ``thread``, or ``auto`` for a function a separate process cannot import (``process``
    then is one ConfigError line saying why)."""
    if isolation == "thread":
        return None
    if spec is not None:  # file.py:function (made absolute: the worker imports it again) or pkg.module:function
        module, _, attr = spec.rpartition(":")
        return ("spec", f"{Path(module).expanduser().resolve()}:{attr}" if module.endswith(".py") else spec)
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    why = None
    if module in (None, "__main__") or "<locals>" in qualname or "<lambda>" in qualname:
        why = f"it is defined in {'a function' if module not in (None, '__main__') else 'the script being run'}"
    else:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            why = f"its module {module!r} cannot be imported by name"
    if why is None:
        try:
            return ("pickle", pickle.dumps(fn))
        except Exception as e:  # noqa: BLE001 - a callable object that does not pickle
            why = f"it cannot be pickled ({type(e).__name__}: {e})"
    if isolation == "process":
        raise ConfigError(f"reward {reward_name(fn)!r} cannot run in a process of its own (task.reward_isolation: "
                          f"process): {why}; define it at the top level of an importable module, or set "
                          "task.reward_isolation: thread")
    return None
