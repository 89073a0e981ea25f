"""Environments written for other frameworks, as masrl tasks: ``verifiers`` (Prime Intellect's verifiers v0
environments) and ``tool_env`` (a class per episode whose public methods are tools: TRL's ``environment_factory``
shape, and OpenEnv ``Environment`` classes run in-process or reached by URL).

Each builds a :class:`~masrl.tasks.source.TaskSource` whose tasks keep the environment's row (prompt, answer, info)
in ``task.meta``, and hands the ``environment`` workflow (:mod:`masrl.workflows.environment`) the function that plays
one episode against masrl's OpenAI-compatible gateway: the episode is an agent program run like ``workflow:
external``'s, so every model call is a recorded turn of the agent its ``model`` names.
"""
from __future__ import annotations

import importlib
from typing import Any

EXTRAS = {"verifiers": "verifiers", "openenv": "openenv", "openai": "openai"}


def require(module: str, extra: str, what: str) -> Any:
    """``import module``, or one ImportError line saying which extra installs it (the CLI prints it, exit 2)."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"{what} needs the package {module!r} ({e}): pip install masrl[{extra}]") from None


def agent_param(params: dict, agents: tuple[str, ...], key: str = "agent") -> str:
    """The agent that plays a single-agent environment: ``workflow.params.agent``, or the config's only agent."""
    from masrl.errors import ConfigError

    agent = params.get(key)
    if agent is None:
        if len(agents) != 1:
            raise ConfigError(f"the environment has one player and the config names agents {list(agents)}: set "
                              f"workflow.params.{key} to the one that plays it")
        return agents[0]
    if agent not in agents:
        raise ConfigError(f"workflow.params.{key} {agent!r} is not one of the config's agents {list(agents)}")
    return agent
