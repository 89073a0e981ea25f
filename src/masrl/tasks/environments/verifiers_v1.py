"""``task: {name: verifiers_v1}``: a verifiers v1 ``Env`` (tasksets, one or several agents) as a masrl task.

    task:
      name: verifiers_v1
      params:
        env: examples/verifiers_v1_arith.py:load_environment   # module:function -> a vf.v1 Env, or a taskset id
        env_args: {num_train: 400}          # the function's keyword arguments (with an id: the EnvConfig's fields)
        test_env_args: {split: test}        # merged over env_args for the held-out rows (default: the train rows)
        agents: {solver: Solver}            # role (the AgentConfig field) -> masrl agent (default: the same name)

Each role is played as its masrl agent (``masrl.usercode.verifiers_v1``): its calls are that agent's turns. A role
the Env marks ``trainable = False`` must be served by a policy with ``trainable: false`` (checked at start).
"""
from __future__ import annotations

from masrl.config import TaskConfig
from masrl.errors import ConfigError
from masrl.tasks.environments import require
from masrl.tasks.source import TaskSource
from masrl.types import Task
from masrl.usercode.verifiers_v1 import load_env, load_game

_KNOWN = {"env", "env_args", "test_env_args", "agents", "pass_threshold", "teacher"}


def _tasks(env, name: str, limit: int | None) -> list[Task]:
    tasks = []
    for i, t in enumerate(env.taskset):
        if limit is not None and i >= limit:
            break
        row = t.data.model_dump(mode="json", exclude_none=True)
        tasks.append(Task(id=f"{name}/{t.data.idx if t.data.idx is not None else i}", question=t.data.prompt_text,
                          answer=getattr(t.data, "answer", "") or "", meta={"data_source": name, "row": row}))
    return tasks


def verifiers_v1_source(cfg: TaskConfig, sft_teacher: dict) -> TaskSource:
    from masrl.usercode.teacher import load_teacher

    params = cfg.params
    unknown = sorted(set(params) - _KNOWN)
    if unknown:
        raise ConfigError(f"task.params for verifiers_v1: unknown keys {unknown}; known: {sorted(_KNOWN)}")
    spec, rename = params.get("env"), params.get("agents") or {}
    if not isinstance(spec, str) or not spec:
        raise ConfigError("task verifiers_v1: set task.params.env to a taskset / env id or 'module:function'")
    env_args, test_args = params.get("env_args") or {}, params.get("test_env_args")
    if not isinstance(env_args, dict) or not isinstance(test_args or {}, dict) or not isinstance(rename, dict):
        raise ConfigError("task.params.env_args, test_env_args and agents must be mappings")
    require("openai", "verifiers", "task verifiers_v1")
    vf = require("verifiers.v1", "verifiers", "task verifiers_v1")
    game = load_game(vf, spec, env_args, rename, float(params.get("pass_threshold", 0.5)))
    name = spec.rpartition(":")[0].rsplit("/", 1)[-1].removesuffix(".py") or spec
    train = _tasks(game.env, name, cfg.train_limit)
    test = _tasks(load_env(vf, spec, {**env_args, **test_args}), name, cfg.test_limit) if test_args else list(train)
    teacher = load_teacher(params.get("teacher"), sft_teacher)
    agents = {agent: agent not in game.frozen for agent in game.roles.values()}
    return TaskSource("verifiers_v1", train, test, _score, teacher, {"env_episode": game}, agents=agents)


def _score(task: Task, answer: str | None) -> dict:
    raise ConfigError(f"task verifiers_v1: the Env scores its episodes; run it with workflow environment ({task.id})")
