"""``workflow: {name: environment}``: one episode of an environment task (``task.name: verifiers`` or ``tool_env``).

    workflow:
      name: environment
      params: {timeout_s: 300}     # agent: the config's agent that plays (default: the only one)

The task source (``masrl.tasks.environments``) hands this workflow the function that plays one episode
against an OpenAI-compatible endpoint. The episode runs as a ``workflow: external`` program does
(``masrl.workflows.external.external``: a gateway session of its own, the program's deadline, its failure
failing only its episode, its calls recorded as turns of the agent their ``model`` names); the environment's
reward is the episode's reward, and its named scores (a verifiers rubric's functions, a tool environment's
``metrics``) are kept in ``episode.info["env_metrics"]``, logged per step as ``env/<name>``.
"""
from __future__ import annotations

import dataclasses
import json
from contextvars import ContextVar
from typing import Any

from masrl.errors import ConfigError
from masrl.tasks.environments import agent_param
from masrl.tasks.environments.tool_env import ToolGame
from masrl.types import Episode, Task
from masrl.usercode.calls import call_async
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
    return {k: result[k] for k in ("reward", "answer", "invalid_calls") if k in result}  # what external takes


@register_workflow("environment", agents=(), prompts={},
                   params={"timeout_s": 300.0, "host": "127.0.0.1", "port": 0, "agent": None, "env_episode": None})
async def environment(task: Task, team: Team) -> Episode:
    """Environment: an episode of a verifiers or tool environment task, played through masrl's gateway (agents:
    the config's)."""
    check_params(team)
    run = team.params.get("env_episode")
    if isinstance(run, ToolGame):
        run = ToolPlayer(run, team.tool_timeout_s)
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


class ToolPlayer:
    """An episode of a tool environment (``ToolGame``) as an OpenAI-API
    program: the agent is called with the environment's tools until it answers without a call, the environment
    is done, or ``max_turns`` calls were made; each call runs through masrl's ``ToolBox`` (a
    deadline per call, errors answered to the model, counted)."""

    def __init__(self, game: ToolGame, timeout_s: float):
        self.game, self.timeout_s = game, timeout_s

    def toolbox(self, env: Any):
        from masrl.tools import Tool, ToolBox

        tools = []
        for name, (fn, schema) in self.game.tools(env).items():
            if schema is None:
                tools.append(Tool(fn, name=name))
            else:  # an MCP tool: the schema the environment lists
                t = object.__new__(Tool)
                t.fn, t.schema, t.timeout_s = fn, schema, None
                tools.append(t)
        return ToolBox(tools, timeout_s=self.timeout_s)

    async def _converse(self, env: Any, box, messages: list[dict], client_kwargs: dict, agent: str) -> str | None:
        """Call the agent with the tools until it answers without a call, the environment is done or
        ``max_turns`` calls were made; its last reply."""
        import openai

        from masrl.tools import ToolCall, tool_schemas

        answer = None
        async with openai.AsyncOpenAI(max_retries=0, timeout=None, **client_kwargs) as client:
            for _ in range(self.game.max_turns):
                response = await client.chat.completions.create(model=agent, messages=messages,
                                                                tools=tool_schemas(box.tools) or None)
                message = response.choices[0].message
                answer = message.content or ""
                calls = message.tool_calls or []
                messages.append({"role": "assistant", "content": answer,
                                 **({"tool_calls": [c.model_dump() for c in calls]} if calls else {})})
                if not calls:
                    break
                for call in calls:
                    arguments = json.loads(call.function.arguments or "{}")
                    result = await box.arun(ToolCall(call.function.name, arguments))
                    messages.append({"role": "tool", "tool_call_id": call.id, "name": result.name or "",
                                     "content": result.content})
                if (await self._env(self.game.outcome, env))[1]:
                    break
        return answer

    async def _env(self, fn, *args):
        """The environment's own code off the rollout's loop, through the user-code service (a thread of its own;
        what it raises, SystemExit included, fails the episode); no deadline of its own yet."""
        what = f"environment {getattr(fn, '__qualname__', fn)}"
        return await call_async(fn, args, None, kind="environment", what=what)

    async def __call__(self, task: Task, client_kwargs: dict, agent: str) -> dict:
        env, first = await self._env(self.game.start, dict(task.meta.get("row") or {}))
        try:
            box = await self._env(self.toolbox, env)
            messages = [{"role": "user", "content": task.question + (f"\n\n{first}" if first else "")}]
            answer = await self._converse(env, box, messages, client_kwargs, agent)
            reward, done = await self._env(self.game.outcome, env)
        finally:
            await self._env(self.game.close, env)
        counts = box.counts.as_dict()
        return {"reward": reward, "answer": answer,
                "metrics": {"tool_calls": float(counts["calls"]), "tool_errors": float(counts["errors"]),
                            "done": float(done)}}

