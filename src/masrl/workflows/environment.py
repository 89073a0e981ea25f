"""``workflow: {name: environment}``: one episode of an environment task (``task.name: verifiers`` or ``tool_env``).

    workflow:
      name: environment
      params: {timeout_s: 300}     # agent: the config's agent that plays (default: the only one)

The task source (``masrl.tasks.environments``) hands this workflow the function that plays one episode
against an OpenAI-compatible endpoint. The environment's code is user code (docs/reliability.md, "User code"):
the whole episode (reset, rollout, rubric, tool methods, MCP calls) is one call through ``masrl.usercode`` with
``workflow.params.timeout_s`` as its deadline, on an event loop of its own in a thread of its own (an environment
that blocks cannot freeze the rollout), whatever it raises (``SystemExit`` included) failing its episode only,
counted in ``usercode/environment/calls|errors|timeouts``; a rollout whose failed episodes reach
``workflow.params.max_error_share`` (1.0: every one) stops the run with one line. It runs as a ``workflow:
external`` program does (``masrl.workflows.external.on_gateway``: a gateway session of its own, its calls recorded
as turns of the agent their ``model`` names); the environment's reward is the episode's reward, and its named
scores (a verifiers rubric's functions, a tool environment's ``metrics``) are kept in
``episode.info["env_metrics"]``, logged per step as ``env/<name>``.
"""
from __future__ import annotations

import json
from typing import Any

from masrl.errors import ConfigError
from masrl.tasks.environments.tool_env import ToolGame
from masrl.types import Episode, Task
from masrl.usercode.calls import call_async
from masrl.workflows.base import Team, register_workflow
from masrl.workflows.common import check_params
from masrl.workflows.external import (ExternalAgentError, call_program, check_limits, on_gateway,
                                      program_episode)
from masrl.workflows.verifiers_play import V1Game, player


def agent_param(params: dict, agents: tuple[str, ...], key: str = "agent") -> str:
    """The agent that plays a single-agent environment: ``workflow.params.agent``, or the config's only agent."""
    agent = params.get(key)
    if agent is None:
        if len(agents) != 1:
            raise ConfigError(f"the environment has one player and the config names agents {list(agents)}: set "
                              f"workflow.params.{key} to the one that plays it")
        return agents[0]
    if agent not in agents:
        raise ConfigError(f"workflow.params.{key} {agent!r} is not one of the config's agents {list(agents)}")
    return agent


def _check(team: Team) -> None:
    check_params(team)
    check_limits(team.params, "environment")
    if team.task_supplies is not None and team.params.get("env_episode") is None:  # at start: the task says
        raise ConfigError("workflow environment plays the episodes of an environment task: set task.name to "
                          "verifiers, verifiers_v1 or tool_env")


@register_workflow("environment", agents=(), prompts={},
                   params={"timeout_s": 300.0, "host": "127.0.0.1", "port": 0, "agent": None, "env_episode": None,
                           "max_error_share": 1.0},
                   check=_check)  # the same check at start (masrl train, masrl config show)
async def environment(task: Task, team: Team) -> Episode:
    """Environment: an episode of a verifiers or tool environment task, played through masrl's gateway (agents:
    the config's)."""
    _check(team)
    game = team.params.get("env_episode")
    run = ToolPlayer(game, team.tool_timeout_s) if isinstance(game, ToolGame) else player(game)
    if not callable(run):
        raise ConfigError("workflow environment plays the episodes of an environment task: set task.name to "
                          "verifiers, verifiers_v1 or tool_env")
    agent = None if isinstance(game, V1Game) else agent_param(team.params, team.agents)  # v1: each role its own
    timeout = float(team.params["timeout_s"])
    where = f"environment {task.meta.get('data_source') or type(run).__name__}"

    async def play(client_kwargs: dict) -> dict:  # the environment's whole episode, on a loop of its own
        kept = await run(task, client_kwargs, agent)
        if not isinstance(kept, dict):
            raise ExternalAgentError(f"{where} returned {type(kept).__name__}, not a dict of the episode's results")
        return kept

    def call(session: Any):
        return call_program(play, (dict(session.client_kwargs),), timeout, "environment", where)

    def finish(kept: dict, session: Any) -> Episode:
        taken = {k: kept[k] for k in ("reward", "answer", "invalid_calls") if k in kept}
        episode = program_episode(team, taken, where, session.responses)
        for response_id, reward in (kept.get("turn_rewards") or {}).items():  # a v1 trace's own reward
            for turn in session.responses.get(response_id, ()):
                turn.reward = float(reward)
        episode.info.update(kept.get("info") or {})
        episode.info["env_metrics"] = dict(kept.get("metrics") or {})
        if "correct" in kept:
            episode.info["correct"] = bool(kept["correct"])
        return episode

    return await on_gateway(team, call, where, "environment", finish)


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
        """The environment's own code off the episode's loop, through the user-code service (a thread of its own;
        what it raises, SystemExit included, fails the episode); bounded by the episode's deadline (past it, this
        call is cancelled with the episode and its thread abandoned)."""
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

