"""Workflow API: a workflow is plain Python for one episode, calling agents by name.

    @register_workflow("my_flow", agents=("Solver",), prompts={"Solver": "{question}"})
    async def my_flow(task: Task, team: Team) -> Episode:
        turn = await team.call("Solver", team.render("Solver", question=task.question))
        return team.finish(answer=turn.text)

``team.call`` sends the request to the rollout scheduler, which batches the pending
requests of every running episode per policy; it returns the recorded :class:`Turn`.
Workflows mark malformed turns with ``turn.valid = False`` (a format penalty applies).
"""
from __future__ import annotations

import functools
import importlib
import inspect
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping

from masrl.errors import ConfigError
from masrl.types import Episode, Task, Turn

WorkflowFn = Callable[[Task, "Team"], Awaitable[Episode]]
# (agent, prompt_text) -> Turn ; the scheduler fills in ids and logprobs
CallFn = Callable[[str, str], Awaitable[Turn]]
# (task, final answer text) -> {"reward": float, "correct": bool, ...}
ScoreFn = Callable[[Task, str | None], dict]
log = logging.getLogger(__name__)


@dataclass
class WorkflowSpec:
    name: str
    fn: WorkflowFn
    agents: tuple[str, ...]
    prompts: dict[str, str]
    params: dict[str, Any] = field(default_factory=dict)
    description: str = ""


WORKFLOWS: dict[str, WorkflowSpec] = {}


def register_workflow(name: str, *, agents, prompts: Mapping[str, str], params: Mapping[str, Any] | None = None):
    """Register ``fn`` under ``name`` with its agent roles, default prompt templates and parameters."""

    def deco(fn: WorkflowFn) -> WorkflowFn:
        if not inspect.iscoroutinefunction(fn):
            raise TypeError(f"workflow {name!r} must be an async function")
        WORKFLOWS[name] = WorkflowSpec(name, fn, tuple(agents), dict(prompts), dict(params or {}),
                                       (fn.__doc__ or "").strip().split("\n")[0])
        return fn

    return deco


def get_workflow(name: str) -> WorkflowSpec:
    """Look a workflow up by registry name, or import ``package.module:function``."""
    _load_builtin()
    if name in WORKFLOWS:
        return WORKFLOWS[name]
    if ":" in name:
        mod_name, _, attr = name.partition(":")
        try:
            mod = importlib.import_module(mod_name)
        except ImportError as e:
            raise ConfigError(f"workflow {name!r}: cannot import module {mod_name!r} ({e})") from e
        obj = getattr(mod, attr, None)
        if obj is None:
            raise ConfigError(f"workflow {name!r}: module {mod_name!r} has no attribute {attr!r}")
        if isinstance(obj, WorkflowSpec):
            return obj
        for spec in WORKFLOWS.values():  # registered by the import
            if spec.fn is obj:
                return spec
        if not inspect.iscoroutinefunction(obj):
            raise ConfigError(f"workflow {name!r} must be an async function (task, team) -> Episode")
        agents = getattr(obj, "agents", None)
        if not agents:
            raise ConfigError(f"workflow {name!r}: register it with @register_workflow(..., agents=...) "
                              "or set a function attribute `agents = (...)`")
        return WorkflowSpec(name, obj, tuple(agents), dict(getattr(obj, "prompts", {})), {})
    known = ", ".join(sorted(WORKFLOWS))
    raise ConfigError(f"unknown workflow {name!r}; known workflows: {known} (or use 'package.module:function')")


def _load_builtin() -> None:
    from masrl.workflows import builtin  # noqa: F401  (registers the built-in workflows)


def render(template: str, **fields: Any) -> str:
    """Fill ``{name}`` placeholders in one pass; other braces (``\\boxed{}``) are left as they are.

    One pass means a field's value is never searched for placeholders itself (a question
    containing ``a_{n}`` stays intact).
    """
    if not fields:
        return template
    pattern = re.compile("{(" + "|".join(re.escape(k) for k in fields) + ")}")
    return pattern.sub(lambda m: str(fields[m.group(1)]), template)


def never_raises(score: ScoreFn) -> ScoreFn:
    """``score`` that cannot take a training step down: an exception (or a result without a
    numeric ``reward``) becomes reward 0 with ``reason="score_error"``, logged per episode."""

    @functools.wraps(score)
    def guarded(task: Task, *args: Any, **kwargs: Any) -> dict:
        try:
            result = score(task, *args, **kwargs)
            return {**result, "reward": float(result["reward"])}
        except Exception as e:
            log.warning("reward function failed on task %r (scored 0): %s: %s", getattr(task, "id", task),
                        type(e).__name__, str(e)[:500], exc_info=not isinstance(e, RecursionError))
            return {"reward": 0.0, "correct": False, "reason": "score_error",
                    "detail": f"{type(e).__name__}: {str(e)[:500]}"}

    return guarded


class Team:
    """What a workflow sees for one episode: call agents, render prompts, score the answer."""

    def __init__(self, task: Task, spec: WorkflowSpec, call: CallFn, score: ScoreFn,
                 prompts: Mapping[str, str] | None = None, params: Mapping[str, Any] | None = None,
                 format_penalty: float = 0.0):
        self.task = task
        self.spec = spec
        self._call = call
        self._score = never_raises(score)
        self.prompts = {**spec.prompts, **(prompts or {})}
        self.params = {**spec.params, **(params or {})}
        self.turns: list[Turn] = []
        self.format_penalty = format_penalty

    @property
    def agents(self) -> tuple[str, ...]:
        return self.spec.agents

    def render(self, agent_or_template: str, **fields: Any) -> str:
        template = self.prompts.get(agent_or_template)
        if template is None:
            raise KeyError(f"workflow {self.spec.name!r} has no prompt template {agent_or_template!r}; "
                           f"templates: {sorted(self.prompts)}")
        return render(template, **fields)

    async def call(self, agent: str, prompt: str) -> Turn:
        if agent not in self.spec.agents:
            raise ValueError(f"workflow {self.spec.name!r} called unknown agent {agent!r}; "
                             f"its agents are {list(self.spec.agents)}")
        turn = await self._call(agent, prompt)
        turn.turn_index = len(self.turns)
        self.turns.append(turn)
        return turn

    def score(self, answer: str | None) -> dict:
        """The task's score of ``answer`` (``{"reward", "correct", ...}``), e.g. to judge a verdict."""
        if getattr(self._score, "takes_episode", False):  # a user reward sees the turns so far
            return self._score(self.task, Episode(task=self.task, turns=list(self.turns), reward=0.0, answer=answer))
        return self._score(self.task, answer)

    def finish(self, answer: str | None, **info: Any) -> Episode:
        """Score the final answer and return the episode (team reward = task outcome)."""
        result = self.score(answer)
        reward = float(result["reward"])
        info = {**{k: v for k, v in result.items() if k != "reward"}, **info}
        return Episode(task=self.task, turns=list(self.turns), reward=reward, answer=answer, info=info)
