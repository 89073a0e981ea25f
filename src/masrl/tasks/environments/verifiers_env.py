"""``task: {name: verifiers}``: a verifiers (Prime Intellect) v0 environment as a masrl task.

    task:
      name: verifiers
      params:
        env: my_env                         # an installed environment id (verifiers.load_environment), or
        # env: examples/verifiers_gsm8k.py:load_environment   # a function returning a vf.Environment
        env_args: {num_train_examples: 64}  # keyword arguments of load_environment
    workflow:
      name: environment                     # the episode is the environment's own rollout (below)
    agents:
      Solver: {policy: team}                # the `model` the environment sends

The environment's dataset rows become tasks (``question``: the last user message of the row's prompt;
``answer``; the whole row, with ``prompt``, ``answer``, ``info`` and ``example_id``, kept in ``task.meta["row"]``);
its eval dataset is the held-out split (the train rows when it has none). Each episode runs the environment's own
``run_rollout`` (single-turn, multi-turn and tool environments alike) with an ``AsyncOpenAI`` client on masrl's
gateway and ``model`` = the agent, so every model call is a recorded turn; the rubric's reward is the episode's
reward and each rubric function's score is kept in ``episode.info["env_metrics"]`` (logged as ``env/<name>``); an
episode is correct (accuracy, pass@k) when its reward reaches the environment's ``pass_threshold`` (0.5 by default).
A rollout that ends with the environment's own error (``state["error"]``) fails its episode with that reason.
Built against verifiers 0.3.1 (0.4 requires openai < 3); its v1 ``Env`` is ``task: verifiers_v1``. Environments
that need remote sandboxes (Prime, Modal, Docker) are out of scope: they run only where those services are reachable.
"""
from __future__ import annotations

from typing import Any

from masrl.config import TaskConfig
from masrl.errors import ConfigError
from masrl.tasks.environments import require
from masrl.usercode.teacher import load_teacher
from masrl.tasks.source import TaskSource
from masrl.types import Task

_KNOWN = {"env", "env_args", "sampling_args", "teacher"}


def load_environment(spec: str, env_args: dict) -> Any:
    """The ``vf.Environment`` of ``spec``: ``module:function`` / ``file.py:function`` (called with ``env_args``),
    else an environment id for ``verifiers.load_environment``."""
    vf = require("verifiers", "verifiers", "task verifiers")
    if ":" in spec:
        from masrl.usercode.imports import import_object

        make = import_object(spec, "task.params.env")
        if not callable(make):
            raise ConfigError(f"task.params.env {spec!r} is not callable (a function returning a vf.Environment)")
        env = make(**env_args)
    else:
        try:
            env = vf.load_environment(spec, **env_args)
        except ValueError as e:  # not installed
            raise ConfigError(f"task.params.env {spec!r}: {e}") from None
    if not isinstance(env, vf.Environment):
        raise ConfigError(f"task.params.env {spec!r} returned {type(env).__name__}, not a verifiers Environment")
    return env


def _question(prompt: Any) -> str:
    """The text a person would call the question: the last user message's text (the prompt itself if a string)."""
    if isinstance(prompt, str):
        return prompt
    for message in reversed(prompt or []):
        if isinstance(message, dict) and message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, list):
                return " ".join(p.get("text", "") for p in content if isinstance(p, dict)).strip()
            return str(content or "")
    return ""


def rows_to_tasks(dataset: Any, name: str, limit: int | None = None) -> list[Task]:
    """Tasks from an environment's (formatted) dataset: the row kept whole in ``meta["row"]``."""
    tasks = []
    for i, row in enumerate(dataset):
        if limit is not None and i >= limit:
            break
        row = dict(row)
        tasks.append(Task(id=f"{name}/{row.get('example_id', i)}", question=_question(row.get("prompt")),
                          answer=row.get("answer", ""), meta={"data_source": name, "row": row}))
    return tasks


class VerifiersGame:
    """A v0 environment and the sampling arguments of its rollouts: ``masrl.workflows.verifiers_play`` plays it."""

    def __init__(self, env: Any, sampling_args: dict):
        self.env, self.sampling_args = env, dict(sampling_args)


def _score(task: Task, answer: str | None) -> dict:
    raise ConfigError(f"task verifiers: the environment's rubric scores its episodes; run it with workflow "
                      f"environment (task {task.id})")


def verifiers_source(cfg: TaskConfig, sft_teacher: dict) -> TaskSource:
    params = cfg.params
    unknown = sorted(set(params) - _KNOWN)
    if unknown:
        raise ConfigError(f"task.params for verifiers: unknown keys {unknown}; known: {sorted(_KNOWN)}")
    spec = params.get("env")
    if not isinstance(spec, str) or not spec:
        raise ConfigError("task verifiers: set task.params.env to an environment id or 'module:function'")
    env_args = params.get("env_args") or {}
    if not isinstance(env_args, dict):
        raise ConfigError(f"task.params.env_args must be a mapping of load_environment's arguments, got {env_args!r}")
    require("openai", "verifiers", "task verifiers")  # the episodes' client
    env = load_environment(spec, env_args)
    name = spec.rpartition(":")[0].rsplit("/", 1)[-1].removesuffix(".py") or spec
    train = rows_to_tasks(env.get_dataset(), name, cfg.train_limit)
    try:
        test = rows_to_tasks(env.get_eval_dataset(), name, cfg.test_limit)
    except ValueError:  # no eval dataset
        test = list(train)
    episode = VerifiersGame(env, params.get("sampling_args") or {})
    teacher = load_teacher(params.get("teacher"), sft_teacher)
    return TaskSource("verifiers", train, test, _score, teacher, {"env_episode": episode})
