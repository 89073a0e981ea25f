"""Environments written for other frameworks, as masrl tasks: ``verifiers`` (Prime Intellect's verifiers v0
environments), ``verifiers_v1`` (its v1 ``Env``: tasksets, several agents) and ``tool_env`` (a class per episode whose public methods are tools: TRL's ``environment_factory``
shape, and OpenEnv ``Environment`` classes run in-process or reached by URL).

Each builds a ``TaskSource`` whose tasks keep the environment's row (prompt, answer, info)
in ``task.meta``, and hands the ``environment`` workflow (``masrl.workflows.environment``) the function that plays
one episode against masrl's OpenAI-compatible gateway: the episode is an agent program run like ``workflow:
external``'s, so every model call is a recorded turn of the agent its ``model`` names.
"""
from __future__ import annotations

import importlib
from typing import Any

from masrl.errors import missing_extra

EXTRAS = {"verifiers": "verifiers", "openenv": "openenv", "openai": "openai"}


def require(module: str, extra: str, what: str) -> Any:
    """``import module``, or one ImportError line saying which extra installs it (the CLI prints it, exit 2)."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise missing_extra(f"{what} needs the package {module!r} ({e})", extra) from None
