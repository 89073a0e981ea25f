"""Reward functions by name: ``math``, ``qa_em``, ``qa_f1``, ``qa_subem``, ``code``, the ``judge`` / ``model``
rewards (``masrl.judges``), one registered with ``register_reward`` (or by an installed package,
entry-point group ``masrl.rewards``), or a user's ``pkg.module:function``.

A built-in reward is a ``ScoreFn`` ``(task, answer) -> {"reward", "correct", ...}``. A user's
reward receives the whole episode::

    def my_reward(task: Task, episode: Episode) -> float | dict:
        # episode.turns: every turn so far (all of them when the workflow finishes), episode.answer
        for turn in episode.turns:          # optional per-turn rewards, used when
            if turn.agent == "Verifier":    # algorithm.reward: per_turn
                turn.reward = 1.0 if ... else 0.0
        return 1.0 if ... else 0.0          # the team reward (or {"reward": r, "correct": bool, ...})

It is called by ``team.finish`` (the team reward) and by ``team.score`` (a workflow judging a
verdict on the turns so far). ``path/to/file.py:function`` works too.

A user's reward runs under the contract of ``masrl.usercode`` (``masrl.usercode.reward``): it is imported and its
signature checked when the config is (one ``ConfigError`` line otherwise); each call runs with a deadline
(``task.reward_timeout_s``) in a worker process of its own (``task.reward_isolation: auto`` / ``process``,
``masrl.usercode.process``) or in a worker thread (``thread``; ``auto`` for a function a separate
process cannot import: one defined in ``__main__`` or inside a function) and sees copies of the turns, whose
``reward`` values are taken back only from a call that returned in time; rewards must be finite and are clipped
to ``±MAX_ABS_REWARD``; failures are counted and a rollout where they reach ``task.reward_max_error_share``
stops the run.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Mapping

from masrl.errors import ConfigError
from masrl.registry import Registry
from masrl.usercode.imports import import_object
from masrl.usercode.reward import DEFAULT_TIMEOUT_S, EpisodeReward, check_reward_signature, process_load

BUILTIN_REWARDS = ("math", "qa_em", "qa_f1", "qa_subem", "code")  # rewards whose gold answers dataset tasks parse
ISOLATIONS = ("auto", "process", "thread")  # task.reward_isolation


@dataclass(frozen=True)
class RewardSpec:
    """A registered reward: ``fn`` and how it is called (``form``).

    ``episode``: ``fn(task, episode) -> float | dict``, a reward with the user-function contract (run
    guarded, ``EpisodeReward``); ``builder``: ``fn(task_params) -> ScoreFn`` (``reward: name``);
    ``options``: ``fn(options, task_params) -> ScoreFn``, given as a one-key mapping ``reward: {name: {...}}``
    (the ``judge`` and ``model`` rewards, registered by ``masrl.judges``, which sits above tasks)."""

    name: str
    fn: Callable[..., Any]
    form: str = "episode"


REWARDS: Registry[RewardSpec] = Registry("reward", group="masrl.rewards", definition=lambda spec: spec.fn,
                                         hint="(or a user function 'pkg.module:function' or 'file.py:function')")


def register_reward(name: str, fn: Callable[..., Any] | None = None, *, builder: bool = False,
                    options: bool = False, overwrite: bool = False):
    """Register a reward under ``name`` (``task.params.reward: name``); a decorator without ``fn``, which
    returns the function unchanged. By default ``fn`` is a reward ``(task, episode) -> float | dict`` (the
    module docstring's contract, run as a user function is). ``builder=True``: ``fn(task_params)`` returns
    the ``ScoreFn``; ``options=True``: ``fn(options, task_params)`` does, and the config gives the reward as
    ``{name: {options}}``. A package registers its own through the ``masrl.rewards`` entry-point group
    (``masrl.registry``)."""
    form = "options" if options else "builder" if builder else "episode"

    def deco(f: Callable[..., Any]) -> Callable[..., Any]:
        if form == "episode":
            check_reward_signature(f, name)
        REWARDS.register(name, RewardSpec(name, f, form), overwrite=overwrite)
        return f

    return deco if fn is None else deco(fn)


def register_reward_kind(kind: str, builder: Callable[[Mapping[str, Any], Mapping[str, Any]], Any]) -> None:
    """``reward: {kind: {...}}`` is built by ``builder(options, task_params)`` (``register_reward(kind, builder,
    options=True)``)."""
    register_reward(kind, builder, options=True)


def reward_kind(reward: Any) -> str:
    """How a task's gold answers are read for ``reward``: its name, ``user`` for a user function, or the
    ``check`` reward a judge names (else ``user``: the raw value) for a mapping."""
    if isinstance(reward, Mapping):
        options = next(iter(reward.values()), None) if len(reward) == 1 else None
        check = options.get("check") if isinstance(options, Mapping) else None
        return str(check) if check in BUILTIN_REWARDS else "user"
    return reward if ":" not in str(reward) else "user"


def _resolve_mapping(reward: Mapping, params: Mapping[str, Any]):
    with_options = [n for n, spec in REWARDS.items() if spec.form == "options"]
    if len(reward) != 1:
        raise ConfigError(f"reward {dict(reward)!r}: a reward mapping has one key, one of "
                          f"{', '.join(sorted(with_options)) or 'judge, model'}")
    (kind, options), = reward.items()
    spec = REWARDS.get(kind)
    if spec.form != "options":
        raise ConfigError(f"reward {kind!r} takes no options: write reward: {kind} (rewards given as a mapping: "
                          f"{', '.join(sorted(with_options)) or 'none registered'})")
    if not isinstance(options, Mapping):
        raise ConfigError(f"reward.{kind} must be a mapping of options, got {type(options).__name__}")
    return spec.fn(options, params)


# --------------------------------------------------------------------------- the built-in rewards


@register_reward("math", builder=True)
def _math(params: Mapping[str, Any]):
    """math-verify on the boxed answer; ``task.params.answer_fallback: last_number`` for models that do not box."""
    from masrl.tasks.math_reward import math_score

    fallback = params.get("answer_fallback", "none")
    if fallback not in ("none", "last_number"):
        raise ConfigError(f"task.params.answer_fallback must be none or last_number, got {fallback!r}")
    return partial(math_score, fallback=fallback) if fallback != "none" else math_score


def _qa(metric: str):
    def build(params: Mapping[str, Any]):
        from masrl.tasks.qa import qa_score

        return partial(qa_score, metric=metric)

    build.__qualname__ = build.__name__ = f"_qa_{metric}"
    build.__doc__ = f"QA reward: the {metric} of the answer against the gold strings."
    return build


for _metric in ("em", "f1", "subem"):
    register_reward(f"qa_{_metric}", _qa(_metric), builder=True)


@register_reward("code", builder=True)
def _code(params: Mapping[str, Any]):
    """The sandboxed tests' pass fraction (``task.params.reward_mode``: fraction or binary; ``score_cache``:
    results kept for identical programs, 0 for none)."""
    from masrl.codecheck.scoring import cache_entries_param, make_code_score

    return make_code_score(params.get("reward_mode", "fraction"), cache_entries=cache_entries_param(params))


def resolve_reward(name: str | Mapping[str, Any], params: Mapping[str, Any] | None = None,
                   timeout_s: float | None = DEFAULT_TIMEOUT_S, isolation: str = "auto"):
    """The score function for reward ``name`` (see the module docstring): a name in ``REWARDS``, a user
    function ``pkg.module:function`` / ``file.py:function``, or a mapping ``{judge: {...}}`` /
    ``{model: {...}}`` built by its registered reward (``register_reward`` with ``options=True``).
    ``params``: the task's params (``answer_fallback`` for math, ``reward_mode`` for code); ``timeout_s``: the
    deadline of each call of a user reward; ``isolation``: where its calls run (``task.reward_isolation``:
    auto, process, thread)."""
    params = params or {}
    if isolation not in ISOLATIONS:
        raise ConfigError(f"task.reward_isolation must be one of {', '.join(ISOLATIONS)}, got {isolation!r}")
    if isinstance(name, Mapping):
        return _resolve_mapping(name, params)
    if isinstance(name, str) and ":" in name and name not in REWARDS:
        fn = import_object(name, "reward")
        check_reward_signature(fn, name)
        return EpisodeReward(fn, name, timeout_s, process_load(name, fn, isolation))
    spec = REWARDS.get(name)
    if spec.form == "options":
        raise ConfigError(f"reward {name!r} takes options: write reward: {{{name}: {{...}}}} (docs/training.md)")
    if spec.form == "builder":
        return spec.fn(params)
    return EpisodeReward(spec.fn, name, timeout_s, process_load(None, spec.fn, isolation))


def qa_reward_name(params: Mapping[str, Any]) -> str:
    """The QA reward a search task's ``task.params.reward_metric`` (em, f1, subem; default em) names."""
    metric = params.get("reward_metric", "em")
    if metric not in ("em", "f1", "subem"):
        raise ConfigError(f"task.params.reward_metric must be em, f1 or subem, got {metric!r}")
    return f"qa_{metric}"
