"""``workflow: {name: environment}``: one episode of an environment task (``task.name: verifiers`` or ``tool_env``).

    workflow:
      name: environment
      params: {timeout_s: 300}     # agent: the config's agent that plays (default: the only one)

The task source (:mod:`masrl.tasks.environments`) hands this workflow the function that plays one episode
against an OpenAI-compatible endpoint. The episode runs as a ``workflow: external`` program does
(:func:`masrl.workflows.external.external`: a gateway session of its own, the program's deadline, its failure
failing only its episode, its calls recorded as turns of the agent their ``model`` names); the environment's
reward is the episode's reward, and its named scores (a verifiers rubric's functions, a tool environment's
``metrics``) are kept in ``episode.info["env_metrics"]``, logged per step as ``env/<name>``.
"""
from __future__ import annotations

import dataclasses
from contextvars import ContextVar
from typing import Any

from masrl.errors import ConfigError
from masrl.tasks.environments import agent_param
from masrl.types import Episode, Task
from masrl.workflows.base import Team, get_workflow, register_workflow
from masrl.workflows.common import check_params

ENTRY = "masrl.workflows.environment:play"
_EPISODE: ContextVar[tuple] = ContextVar("masrl_environment_episode")


async def play(payload: dict, client_kwargs: dict) -> dict:
    """The ``entry`` the external runner calls: the current episode's environment function, whose extra results
    (``metrics``, ``info``) are kept for the workflow."""
    run, task, agent, kept = _EPISODE.get()
    result = await run(task, client_kwargs, agent)
    kept.update(result)
    return {k: result[k] for k in ("reward", "answer", "invalid_calls") if k in result}


@register_workflow("environment", agents=(), prompts={},
                   params={"timeout_s": 300.0, "host": "127.0.0.1", "port": 0, "agent": None, "env_episode": None})
async def environment(task: Task, team: Team) -> Episode:
    """Environment: an episode of a verifiers or tool environment task, played through masrl's gateway (agents:
    the config's)."""
    check_params(team)
    run = team.params.get("env_episode")
    if not callable(run):
        raise ConfigError("workflow environment plays the episodes of an environment task: set task.name to "
                          "verifiers or tool_env")
    agent = agent_param(team.params, team.agents)
    external = get_workflow("external")
    kept: dict[str, Any] = {}
    own_spec, own_params = team.spec, team.params
    team.spec = dataclasses.replace(external, agents=own_spec.agents)
    team.params = {**external.params, **{k: own_params[k] for k in ("timeout_s", "host", "port")}, "entry": ENTRY}
    token = _EPISODE.set((run, task, agent, kept))
    try:
        episode = await external.fn(task, team)
    finally:
        _EPISODE.reset(token)
        team.spec, team.params = own_spec, own_params
    episode.info.update(kept.get("info") or {})
    episode.info["env_metrics"] = dict(kept.get("metrics") or {})
    if "correct" in kept:
        episode.info["correct"] = bool(kept["correct"])
    return episode
