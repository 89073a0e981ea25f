"""Workflow API: a workflow is plain Python for one episode, calling agents by name.

    @register_workflow("my_flow", agents=("Solver",), prompts={"Solver": "{question}"})
    async def my_flow(task: Task, team: Team) -> Episode:
        turn = await team.call("Solver", team.render("Solver", question=task.question))
        return team.finish(answer=turn.text)

``team.call`` sends the request to the rollout scheduler, which batches the pending
requests of every running episode per policy; it returns the recorded ``Turn``.
Workflows mark malformed turns with ``turn.valid = False`` (a format penalty applies).
``team.extend(turn, text)`` is a prompt that continues an earlier turn token for token (a running
transcript: ``Continuation``).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import re
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping

from masrl.errors import ConfigError
from masrl.registry import Registry
from masrl.usercode.guard import GuardedScore
from masrl.usercode.imports import import_failure
from masrl.tools.chat_format import ChatPrompt
from masrl.tools.execute import DEFAULT_TIMEOUT_S, ToolCounts
from masrl.tools.text import valid_text
from masrl.types import Episode, ScoreFn, Task, Turn

WorkflowFn = Callable[[Task, "Team"], Awaitable[Episode]]
# (agent, prompt) -> Turn ; the scheduler fills in ids and logprobs. The prompt is a string (one
# user message), a ``Continuation`` (``team.extend``) or, from ``team.chat``, a
# ``masrl.tools.chat_format.ChatPrompt`` (messages + tools)
CallFn = Callable[[str, Any], Awaitable[Turn]]


@dataclass
class WorkflowSpec:
    name: str
    fn: WorkflowFn
    agents: tuple[str, ...]
    prompts: dict[str, str]
    params: dict[str, Any] = field(default_factory=dict)
    description: str = ""
    # the workflow's check of its params, ``check(team)`` raising ConfigError: run at start (masrl train and
    # masrl config show, through team_runner.check_team) on a team that has no task, as well as by the workflow
    check: Callable[["Team"], Any] | None = None


def _load_builtin() -> None:
    from masrl.workflows import builtin  # noqa: F401  (registers the built-in workflows)


WORKFLOWS: Registry[WorkflowSpec] = Registry("workflow", group="masrl.workflows", preload=_load_builtin,
                                             hint="(or use 'package.module:function')",
                                             definition=lambda spec: spec.fn)


def register_workflow(name: str, *, agents, prompts: Mapping[str, str], params: Mapping[str, Any] | None = None,
                      overwrite: bool = False, check: Callable[["Team"], Any] | None = None):
    """Register ``fn`` under ``name`` with its agent roles, default prompt templates and parameters; the
    config's ``workflow.name`` picks it. A name that is taken is an error unless ``overwrite``. A package
    registers its own through the ``masrl.workflows`` entry-point group (``masrl.registry``). ``check(team)``,
    the workflow's check of ``team.params`` (raising ``ConfigError``), also runs when a run starts
    (``check_workflow_params``), so that ``masrl config show`` and ``masrl train`` refuse the same params
    before any model is built."""

    def deco(fn: WorkflowFn) -> WorkflowFn:
        if not inspect.iscoroutinefunction(fn):
            raise TypeError(f"workflow {name!r} must be an async function")
        WORKFLOWS.register(name, WorkflowSpec(name, fn, tuple(agents), dict(prompts), dict(params or {}),
                                              (fn.__doc__ or "").strip().split("\n")[0], check), overwrite=overwrite)
        return fn

    return deco


def get_workflow(name: str) -> WorkflowSpec:
    """Look a workflow up by registry name, or import ``package.module:function``."""
    if not isinstance(name, str) or ":" not in name or name in WORKFLOWS:
        return WORKFLOWS.get(name)
    return _import_workflow(name)


def _import_workflow(name: str) -> WorkflowSpec:
    """The workflow ``package.module:function`` (registered by its import, or a function with ``agents``)."""
    mod_name, _, attr = name.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ConfigError(f"workflow {name!r}: cannot import module {mod_name!r} ({e})") from e
    except BaseException as e:  # noqa: BLE001 - the module fails (or exits) when imported: say which and why
        raise ConfigError(f"workflow {name!r}: importing module {mod_name!r} failed ({import_failure(e)})") \
            from None
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
    """``score`` that cannot take a training step down (``masrl.usercode.guard.GuardedScore``): an
    exception, a result without a numeric ``reward`` or a non-finite one becomes reward 0 with
    ``reason="score_error"`` (a user reward past its deadline: ``"reward_timeout"``), counted; the first
    failure is logged with its traceback. A score that is guarded already (the trainer's, whose counts it
    reads after each rollout) is used as it is."""
    return score if isinstance(score, GuardedScore) else GuardedScore(score)


@dataclass
class Continuation:
    """A prompt that continues ``turn`` (an earlier turn of the episode) with ``text``: its token ids are
    ``turn.prompt_ids + turn.response_ids + ids(text)``, ``ids(text)`` encoded without inserting any
    special token, so the earlier prompt and reply are a token prefix of this prompt (the rollout
    engine reuses their keys/values; see ``masrl.training.policy.PolicyText.encode_prompt``).

    * The earlier reply always ends with its end-of-turn token: the stop token the model emitted, or,
      when the reply was cut at ``max_new_tokens`` (``turn.truncated``), the policy's end-of-sequence
      token appended, as a chat template closes every assistant message (``team.chat`` does the same)
      and as SFT targets end (reply + end-of-sequence).
    * The continuing agent's prompt format must be plain text: its policy's chat template renders a
      lone user message as the message itself (the tiny models' template, a base model's) and the agent
      has no ``system_prompt``. An instruct model's template wraps every string prompt in chat markers,
      so a continuation there raises ``ConfigError`` (use ``team.chat`` with messages instead).
    * The earlier turn's ids are continued as that turn's prompt was given to the model: a prompt that was
      cut to fit the context stays cut; a prompt longer than the context is cut again (its end kept,
      ``info["prompt_truncated_from"]``); continuing a refused turn gives a refused turn.
    * Turns of another policy can be continued only when both policies have the same vocabulary.
    """

    turn: Turn
    text: str

    def transcript(self) -> str:
        """The readable text: the earlier prompt, its reply (special tokens skipped), ``text``."""
        return self.turn.prompt_text + self.turn.text + self.text


class Team:
    """What a workflow sees for one episode: call agents, render prompts, score the answer."""

    def __init__(self, task: Task, spec: WorkflowSpec, call: CallFn, score: ScoreFn,
                 prompts: Mapping[str, str] | None = None, params: Mapping[str, Any] | None = None,
                 format_penalty: float = 0.0, defer_score: bool = False,
                 tool_timeout_s: float = DEFAULT_TIMEOUT_S):
        self.task = task
        # finish() leaves the final answer's score to one batch after the rollout (masrl.workflows.batch_score)
        self.defer_score = defer_score
        self.spec = spec
        self._call = call
        self._score = never_raises(score)
        self.prompts = {**spec.prompts, **(prompts or {})}
        self.params = {**spec.params, **(params or {})}
        self.turns: list[Turn] = []
        self.format_penalty = format_penalty
        self.tool_calls = 0  # tool calls made in this episode (team.chat's cap counts them)
        self.task_supplies: tuple[str, ...] | None = None  # the start check: params the task supplies (None: unsaid)
        self.tool_counts = ToolCounts()  # their outcomes (Episode.tool_counts, tool/* metrics)
        self.tool_timeout_s = tool_timeout_s  # team.chat's default deadline per tool call (tools.timeout_s)

    @property
    def agents(self) -> tuple[str, ...]:
        return self.spec.agents

    def render(self, agent_or_template: str, **fields: Any) -> str:
        template = self.prompts.get(agent_or_template)
        if template is None:
            raise KeyError(f"workflow {self.spec.name!r} has no prompt template {agent_or_template!r}; "
                           f"templates: {sorted(self.prompts)}")
        return render(template, **fields)

    async def call(self, agent: str, prompt: Any) -> Turn:
        if agent not in self.spec.agents:
            raise ValueError(f"workflow {self.spec.name!r} called unknown agent {agent!r}; "
                             f"its agents are {list(self.spec.agents)}")
        turn = await self._call(agent, valid_prompt(prompt))
        turn.turn_index = len(self.turns)
        self.turns.append(turn)
        return turn

    def extend(self, turn: Turn, text: str) -> Continuation:
        """A prompt that continues ``turn``'s prompt and reply token for token with ``text`` (see ``Continuation``)."""
        if not isinstance(turn, Turn) or not isinstance(text, str):
            raise TypeError(f"team.extend(turn, text) takes a Turn and a str, got {type(turn).__name__} and "
                            f"{type(text).__name__}")
        return Continuation(turn, text)

    async def chat(self, agent: str, messages: list[dict], tools=(), **options: Any):
        """Converse with ``agent`` and run its tool calls until it answers; ``messages`` grows in place.

        Returns a ``masrl.workflows.chat.ChatResult``; options: ``max_calls``, ``timeout_s``,
        ``formats`` (see ``masrl.workflows.chat.run_chat``).
        """
        from masrl.workflows.chat import run_chat

        return await run_chat(self, agent, messages, tools, **options)

    def score(self, answer: str | None) -> dict:
        """The task's score of ``answer`` (``{"reward", "correct", ...}``), e.g. to judge a verdict."""
        if getattr(self._score, "takes_episode", False):  # a user reward sees the turns so far
            return self._score(self.task, Episode(task=self.task, turns=list(self.turns), reward=0.0, answer=answer))
        return self._score(self.task, answer)

    def finish(self, answer: str | None, **info: Any) -> Episode:
        """Score the final answer and return the episode (team reward = task outcome)."""
        if self.defer_score:
            return Episode(task=self.task, turns=list(self.turns), reward=0.0, answer=answer,
                           info={**info, "score_pending": True})
        result = self.score(answer)
        reward = float(result["reward"])
        info = {**{k: v for k, v in result.items() if k != "reward"}, **info}
        return Episode(task=self.task, turns=list(self.turns), reward=reward, answer=answer, info=info,
                       tool_counts=self.tool_counts.as_dict())


def valid_prompt(prompt: Any) -> Any:
    """``prompt`` with its text valid UTF-8 (lone surrogates as U+FFFD: ``masrl.tools.text.valid_text``):
    every prompt passes here on its way to a tokenizer, so task strings, retrieved passages and tool
    results of any source are covered. Text that is valid already is kept as it is."""
    if isinstance(prompt, str):
        return valid_text(prompt)
    if isinstance(prompt, Continuation):
        return Continuation(prompt.turn, valid_text(prompt.text))
    if isinstance(prompt, ChatPrompt):
        return dataclasses.replace(prompt, messages=_valid_values(prompt.messages), tools=_valid_values(prompt.tools))
    return prompt


def _valid_values(value: Any) -> Any:
    """Strings inside lists and dicts (chat messages, content parts, tool schemas) as valid UTF-8."""
    if isinstance(value, str):
        return valid_text(value)
    if isinstance(value, list):
        return [_valid_values(v) for v in value]
    if isinstance(value, dict):
        return {k: _valid_values(v) for k, v in value.items()}
    return value


class TaskSupplied:
    """The start check's stand-in for a workflow param the task supplies at run time (a retriever, an
    environment's episode): set, but not there yet."""

    def __repr__(self) -> str:
        return "<supplied by the task>"


TASK_SUPPLIED = TaskSupplied()


def check_workflow_params(spec: WorkflowSpec, params: Mapping[str, Any], prompts: Mapping[str, str] | None = None,
                          supplied: tuple[str, ...] | None = ()) -> None:
    """The workflow's own check of its params (``spec.check``), run at start on a team that has no task to run:
    its agents cannot be called and it scores nothing. ``supplied``: the params the task hands the workflow at run
    time (``TASK_SUPPLIED`` stands in for each; ``team.task_supplies``), None when the task does not say."""
    if spec.check is None:
        return

    async def no_call(agent: str, prompt: Any) -> Turn:
        raise RuntimeError(f"workflow {spec.name!r}: its params check called agent {agent!r}")

    team = Team(Task(id="start-check", question="", answer=""), spec, no_call, lambda task, answer: {"reward": 0.0},
                prompts=prompts, params={**params, **{key: TASK_SUPPLIED for key in supplied or ()}})
    team.task_supplies = supplied
    spec.check(team)
