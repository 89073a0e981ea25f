"""The contract every reward function runs under (docs/reliability.md, "User code: rewards").

* It never takes a step down: ``GuardedScore`` turns an exception, a result without a numeric
  ``reward`` or a non-finite reward into reward 0 (``reason="score_error"``), and counts it.
* A user's reward has a deadline (``call_with_deadline``): it runs in a worker thread of masrl and a
  call still running after ``task.reward_timeout_s`` scores 0 (``reason="reward_timeout"``). Python
  cannot stop a thread, so the hung call's thread is abandoned (a daemon thread: it never keeps the
  process alive); once ``MAX_ABANDONED`` such threads are still running, further calls are not made
  and the run stops.
* Every call, error and timeout is counted in a ``RewardLedger``; the trainer takes the counts after
  each rollout (``reward/calls``, ``reward/errors``, ``reward/timeouts``, and ``reward/cached``: calls a reward
  answered from its own cache, in metrics.jsonl) and
  ``check_failures`` stops the run (``RewardError``, exit 2) when a rollout's calls fail on at
  least ``task.reward_max_error_share`` of them. The first failure of a run is logged with its
  traceback; later ones are one summary line per step.
* A finite reward larger than ``MAX_ABS_REWARD`` in magnitude is clipped to it (one warning per
  reward), so that no reward overflows the float32 scores and the advantage statistics.
"""
from __future__ import annotations

import logging
import math
import threading
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from masrl.usercode.calls import UserCodeRefused, UserCodeTimeout, abandoned, call_in_thread
from masrl.usercode.ledger import UserCodeError, check_share, failure_line, usercode_metrics
from masrl.usercode.numbers import finite

log = logging.getLogger(__name__)

MAX_ABS_REWARD = 1e6  # |reward| above this is clipped (float32 scores, advantage statistics)
MAX_ABANDONED = 8  # user reward calls still running past their deadline before the run stops
_MASRL_DIR = str(Path(__file__).resolve().parents[1])


class RewardTimeout(Exception):
    """A user reward call ran past its deadline (scored 0, counted in ``reward/timeouts``)."""


class RewardProcessError(RuntimeError):
    """A call of a reward run in its own process (``masrl.usercode.process``) failed: it raised there
    (``description``: ``Type: message in FILE line N``; ``remote_traceback``: the worker's traceback), returned
    what cannot be sent back, or the worker died during the call or could not load the function."""

    def __init__(self, description: str, remote_traceback: str = ""):
        super().__init__(description)
        self.description = description
        self.remote_traceback = remote_traceback


class RewardError(UserCodeError):
    """A reward function failed on too many calls of a rollout: the run stops (exit 2). ``counts``: the
    rollout's ``RewardCounts``."""

    def __init__(self, message: str, counts: "RewardCounts"):
        super().__init__(message)
        self.counts = counts


class RewardWarning(UserWarning):
    """Some reward calls of a rollout failed (one line per rollout), or a reward was clipped."""


# ----------------------------------------------------------------------------- the deadline

def abandoned_calls() -> int:
    """User reward calls (threads) still running past their deadline, in this process (the service's count of
    kind ``reward``)."""
    return abandoned("reward")


def call_with_deadline(name: str, fn: Callable, args: tuple, timeout_s: float) -> Any:
    """``fn(*args)`` in reward ``name``'s worker thread (``masrl.usercode.calls.call_in_thread``: the same thread
    for its calls one after another); ``RewardTimeout`` after ``timeout_s`` seconds (the call's thread is
    abandoned), or at once when ``MAX_ABANDONED`` calls are still running."""
    try:
        return call_in_thread(fn, args, timeout_s, kind="reward", what=f"reward {name}", max_abandoned=MAX_ABANDONED)
    except UserCodeRefused as e:
        raise RewardTimeout(str(e)) from None
    except UserCodeTimeout:
        raise RewardTimeout(f"reward {name} ran past its deadline of {timeout_s:g} s (task.reward_timeout_s); "
                            "its call was abandoned") from None


# ----------------------------------------------------------------------------- values

_CLIPPED: set[str] = set()


def checked_reward(value: Any, what: str, warn_key: str | None = None) -> float:
    """``value`` as a finite float, clipped to ``±MAX_ABS_REWARD`` (one warning per ``warn_key``, default
    ``what``); a non-number or a NaN/infinite value is a ``ValueError`` naming ``what``."""
    number = finite(value, what)
    if abs(number) > MAX_ABS_REWARD:
        if (warn_key or what) not in _CLIPPED:
            _CLIPPED.add(warn_key or what)
            warnings.warn(f"{what} is {number:g}; rewards are clipped to ±{MAX_ABS_REWARD:g} (later values too)",
                          RewardWarning, stacklevel=2)
        number = math.copysign(MAX_ABS_REWARD, number)
    return number


# ----------------------------------------------------------------------------- counting

def describe_error(error: BaseException) -> str:
    """``Type: message in FILE line N`` (the deepest frame outside masrl), one line."""
    if isinstance(error, RewardProcessError):  # described where it was raised, in the reward's process
        return error.description
    text = " ".join(f"{type(error).__name__}: {error}".split())[:300]
    frames = [f for f in traceback.extract_tb(error.__traceback__) if not f.filename.startswith(_MASRL_DIR)]
    return f"{text} in {frames[-1].filename} line {frames[-1].lineno}" if frames else text


def user_frames(tb):
    """The traceback from its first frame outside masrl (the whole traceback when every frame is masrl's)."""
    start = tb
    while start is not None and start.tb_frame.f_code.co_filename.startswith(_MASRL_DIR):
        start = start.tb_next
    return start or tb


@dataclass
class RewardCounts:
    """Reward calls of one rollout: how many, how many raised (or returned no valid reward), how many timed
    out; ``name`` and ``first``: the reward that failed first and that failure, one line."""

    calls: int = 0
    errors: int = 0
    timeouts: int = 0
    name: str | None = None
    first: str | None = None
    abandoned: int = 0  # calls still running past their deadline when the counts were taken
    cached: int = 0  # calls answered from the reward's own cache (a result with ``cached: True``: the code reward)

    @property
    def failed(self) -> int:
        return self.errors + self.timeouts

    def metrics(self) -> dict[str, float]:
        return {"reward/calls": float(self.calls), "reward/errors": float(self.errors),
                "reward/timeouts": float(self.timeouts), "reward/cached": float(self.cached),
                **usercode_metrics("reward", self.calls, self.errors, self.timeouts)}

    def summary(self) -> dict[str, int]:
        """For an evaluation's results (``reward_calls``, ``reward_errors``, ``reward_timeouts``)."""
        return {"reward_calls": self.calls, "reward_errors": self.errors, "reward_timeouts": self.timeouts}

    def describe(self, where: str) -> str:
        return failure_line(f"reward {self.name}", self.calls, self.errors, self.timeouts, self.first, where)


class RewardLedger:
    """Counts reward calls until ``take``; logs the traceback of each reward's first failure only."""

    def __init__(self):
        self._lock = threading.Lock()
        self._counts = RewardCounts()
        self._shown: set[str] = set()

    def record(self, name: str, task: Any, error: BaseException | None, cached: bool = False) -> None:
        with self._lock:
            counts = self._counts
            counts.calls += 1
            if error is None:
                counts.cached += bool(cached)
                return
            if isinstance(error, RewardTimeout):
                counts.timeouts += 1
            else:
                counts.errors += 1
            if counts.first is None:
                counts.name, counts.first = name, describe_error(error)
            first_of_reward = name not in self._shown
            self._shown.add(name)
        if first_of_reward:
            remote = isinstance(error, RewardProcessError)
            with_trace = not isinstance(error, (RecursionError, RewardTimeout)) and not remote
            log.warning("reward function failed on task %r (scored 0): %s: %s; later failures are counted "
                        "(reward/errors, reward/timeouts) and summarised once per rollout%s",
                        getattr(task, "id", task), name, describe_error(error),
                        f"\n{error.remote_traceback.rstrip()}" if remote and error.remote_traceback else "",
                        exc_info=(type(error), error, user_frames(error.__traceback__)) if with_trace else None)

    def take(self) -> RewardCounts:
        """The counts since the last take (and the calls still running past their deadline)."""
        with self._lock:
            counts, self._counts = self._counts, RewardCounts()
        counts.abandoned = abandoned_calls()
        return counts


def check_failures(counts: RewardCounts, max_error_share: float, where: str) -> None:
    """Stop the run (``RewardError``) when the calls of ``where`` failed on at least ``max_error_share``
    of them, or when ``MAX_ABANDONED`` calls hang; warn in one line when some failed."""
    if counts.abandoned >= MAX_ABANDONED:
        raise RewardError(f"{counts.abandoned} reward calls are still running past their deadline (hung threads "
                          f"cannot be stopped); {counts.describe(where)}; fix the function or raise "
                          "task.reward_timeout_s", counts)
    hint = "" if max_error_share >= 1 else f" or raise task.reward_max_error_share (now {max_error_share:g})"
    check_share(f"reward {counts.name}", counts.calls, counts.errors, counts.timeouts, counts.first, max_error_share,
                where, f"fix the function{hint}", RewardError, counts=counts)
    if counts.failed:
        warnings.warn(f"{counts.describe(where)}; those calls scored 0", RewardWarning, stacklevel=2)


class GuardedScore:
    """``score`` that never raises (see the module docstring); counts go to ``ledger`` (a new one if None)."""

    def __init__(self, score: Callable, ledger: RewardLedger | None = None):
        self.score = score.score if isinstance(score, GuardedScore) else score
        self.ledger = ledger if ledger is not None else RewardLedger()
        self.name = reward_name(self.score)
        self.__name__ = self.name
        self.takes_episode = getattr(self.score, "takes_episode", False)  # a user reward sees the episode
        if callable(getattr(self.score, "score_batch", None)):  # a judge, a reward model: scored in batches
            self.score_batch = self._score_batch

    def __call__(self, task: Any, *args: Any, **kwargs: Any) -> dict:
        try:
            out = self._checked(self.score(task, *args, **kwargs))
        except Exception as e:  # noqa: BLE001 - any failure of a reward scores 0 and is counted
            return self._failed(task, e)
        self.ledger.record(self.name, task, None, cached=out.get("cached") is True)
        return out

    def _checked(self, result: Any) -> dict:
        reward = checked_reward(result["reward"], f"reward {self.name}: the reward", self.name)
        out = {**result, "reward": reward}
        out.setdefault("correct", out["reward"] >= 1.0)  # as Episode.correct reads an episode without it
        return out

    def _failed(self, task: Any, error: Exception) -> dict:
        self.ledger.record(self.name, task, error)
        reason = "reward_timeout" if isinstance(error, RewardTimeout) else "score_error"
        return {"reward": 0.0, "correct": False, "reason": reason, "detail": describe_error(error)}

    def _score_batch(self, pairs: list) -> list[dict]:
        """The inner ``score_batch`` under the same contract, result by result (a call that raises, or returns
        the wrong number of results, scores every answer of the batch 0 and counts each)."""
        try:
            results = list(self.score.score_batch(pairs))
            if len(results) != len(pairs):
                raise ValueError(f"score_batch returned {len(results)} results for {len(pairs)} answers")
        except Exception as e:  # noqa: BLE001
            return [self._failed(task, e) for task, _ in pairs]
        out = []
        for (task, _), result in zip(pairs, results):
            try:
                out.append(self._checked(result))
            except Exception as e:  # noqa: BLE001
                out.append(self._failed(task, e))
                continue
            self.ledger.record(self.name, task, None, cached=out[-1].get("cached") is True)
        return out


def reward_name(score: Callable) -> str:
    """What a message calls ``score``: a user reward's ``file.py:function``, else the function's name."""
    inner = getattr(score, "func", score)  # functools.partial
    return str(getattr(score, "name", None) or getattr(inner, "__name__", None) or type(score).__name__)
