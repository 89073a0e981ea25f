"""``workflow: {name: external}``: train a program written against the OpenAI API, unchanged.

    workflow:
      name: external
      params: {entry: "mypkg.agent:run"}          # run(task, client_kwargs) -> answer | {"answer"|"reward": ...}
      # or   {command: "python my_agent.py"}      # a subprocess per episode (task JSON on stdin)
    agents:                                       # the names the program puts in `model`
      Planner: {policy: team}
      Writer: {policy: team}

Each episode opens a session on masrl's OpenAI-compatible gateway (``masrl.gateway``) and runs the program
with it: ``entry`` is called with ``{"id", "question", "meta"}`` (``task_payload``) and ``client_kwargs``
(``{"base_url", "api_key"}``: ``openai.OpenAI(**client_kwargs)``), async or not; ``command`` gets the same task as
one JSON line on stdin and ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` (and ``MASRL_EPISODE_KEY``) in its environment,
and prints its result as JSON on its last line of output. Every call the program makes is a turn of the agent its
``model`` names.

The result: a string (or ``{"answer": ...}``) is the episode's answer, scored by the task's reward; a number (or
``{"reward": r, "answer": ...}``) is the episode's reward as the program computed it (finite). A dict result may
name the completions whose replies were malformed, ``"invalid_calls": [response.id, ...]``: those turns are invalid
(the format penalty), as a built-in workflow's ``turn.valid = False``. A program that
raises (``SystemExit`` included), exits non-zero, runs past ``timeout_s`` (the subprocess and its children are
killed; a hung ``entry`` thread is left behind, its session closed so that its calls are refused), makes no model
call or returns anything else fails the episode with ``ExternalAgentError`` naming the reason; the rollout
isolates the episode and counts it (``usercode/program/*``); a rollout whose failed episodes reach
``workflow.params.max_error_share`` of its episodes (1.0: every one) stops the run with one line. Both run through
``masrl.usercode`` (docs/reliability.md, "User code").
"""
from __future__ import annotations

import json
import math
import os
import shlex
import threading
from typing import Any, Awaitable, Callable

from masrl.errors import ConfigError
from masrl.types import Episode, Task
from masrl.usercode.calls import UserCodeTimeout, call_async
from masrl.usercode.command import MAX_OUTPUT, run_command
from masrl.usercode.imports import import_object
from masrl.workflows.base import Team, register_workflow
from masrl.workflows.common import check_params

_GATEWAY: dict[tuple, Any] = {}
_LOCK = threading.Lock()


class ExternalAgentError(RuntimeError):
    """The episode's program failed (what and why); the episode is invalid, the step goes on. ``program_kind``
    (``program``, ``environment``) and ``program_name`` say whose code it was."""

    program_outcome = "error"  # counted in usercode/<kind>/errors
    program_kind, program_name = "program", None


class ProgramTimeout(ExternalAgentError):
    """The episode's program ran past ``timeout_s`` (counted in ``usercode/program/timeouts``)."""

    program_outcome = "timeout"


class NoModelCallError(ExternalAgentError):
    """The episode's program made no model call: nothing of it can be trained, so the episode is invalid
    (counted in ``rollout/episodes_without_calls``; a rollout where no episode made one stops the run)."""

    reason = "no_model_call"


def gateway(host: str, port: int, timeout_s: float):
    """The process's gateway for ``(host, port)``, started on first use and shared by every episode.

    Its clients are the episodes' own programs and environments, whose deadline is ``timeout_s``: a request head
    or body is awaited that long (not less than the gateway's defaults; the longest any team of the process asked
    for). An environment's episodes share one event
    loop (``masrl.usercode.calls``), which on a loaded CPU was seen busy for 40 s between connecting and sending;
    past a 30 s head deadline the gateway closed the connection, and the late request was lost to a reset."""
    from masrl.gateway import Gateway, GatewayLimits

    with _LOCK:
        key = (host, port)
        if key not in _GATEWAY:
            default = GatewayLimits()
            limits = GatewayLimits(header_timeout_s=max(default.header_timeout_s, timeout_s),
                                   body_timeout_s=max(default.body_timeout_s, timeout_s))
            _GATEWAY[key] = Gateway(host, port, request_timeout_s=timeout_s, limits=limits)
        else:  # a later team (an evaluation, another run in this process) may wait longer than the first
            _GATEWAY[key].widen_deadlines(timeout_s)
        return _GATEWAY[key]


def check_limits(p: dict, kind: str = "program") -> None:
    """``timeout_s``, ``port`` and ``max_error_share`` of a program's (or an environment's) episode."""
    timeout = p.get("timeout_s")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 86400:
        raise ConfigError(f"workflow.params.timeout_s must be a number of seconds in (0, 86400], got {timeout!r}")
    port = p.get("port")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigError(f"workflow.params.port must be an integer in 0..65535 (0: any free port), got {port!r}")
    share = p.get("max_error_share", 1.0)
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
        raise ConfigError(f"workflow.params.max_error_share must be a number in (0, 1] (the share of a rollout's "
                          f"{kind} calls whose failure stops the run; 1: when every call fails), got {share!r}")


def _params(team: Team) -> dict:
    check_params(team)
    p = team.params
    entry, command = p.get("entry"), p.get("command")
    if (entry is None) == (command is None):
        raise ConfigError("workflow external: set exactly one of workflow.params.entry ('pkg.module:function' or "
                          "'file.py:function') and workflow.params.command ('python my_agent.py')")
    check_limits(p)
    return p


def task_payload(task: Task) -> dict:
    """What a program is given of its task: ``id``, ``question`` and ``meta`` (the task's row: its source's other
    fields, such as a verifiers row or a tool environment's reset arguments; the gold ``answer`` is not given)."""
    return {"id": task.id, "question": task.question, "meta": dict(task.meta)}


async def call_program(fn: Any, args: tuple, timeout: float, kind: str, what: str) -> Any:
    """``fn(*args)`` through the user-code service: in a thread of its own (an ``async def`` on an event loop of its
    own, in its own thread, shared by the episodes), with a deadline on the whole call; whatever it raises,
    ``SystemExit`` included, fails this episode only (``ExternalAgentError``, ``ProgramTimeout``)."""
    try:
        return await call_async(fn, args, timeout, kind=kind, what=what)
    except UserCodeTimeout:
        raise ProgramTimeout(f"{what} did not return within {timeout:g} s") from None
    except ConfigError:
        raise
    except ExternalAgentError:
        raise
    except Exception as e:  # the program's own error: this episode fails, with its reason
        error = ExternalAgentError(f"{what} raised {type(e).__name__}: {str(e)[:500]}")
        if isinstance(getattr(e, "reason", None), str):  # e.g. empty_reply (masrl.workflows.verifiers_play)
            error.reason = e.reason
        raise error from e


async def _run_entry(spec: str, task: Task, client_kwargs: dict, timeout: float) -> Any:
    """The ``entry`` function (``call_program``), called with ``task_payload(task)`` and ``client_kwargs``."""
    fn = import_object(spec, "workflow.params.entry")
    if not callable(fn):
        raise ConfigError(f"workflow.params.entry {spec!r} is not callable")
    return await call_program(fn, (task_payload(task), dict(client_kwargs)), timeout, "program", spec)


async def _run_command(command: str, task: Task, session: Any, timeout: float, env: dict) -> Any:
    """The ``command`` through the user-code service (``masrl.usercode.command.run_command``): its own
    process group, killed with every child at the end of the episode; done when the program exits; the last
    ``MAX_OUTPUT`` bytes of its output kept."""
    argv = shlex.split(command)
    if not argv:
        raise ConfigError("workflow.params.command is empty")
    child_env = {**os.environ, **{str(k): str(v) for k, v in env.items()}, "OPENAI_BASE_URL": session.base_url,
                 "OPENAI_API_KEY": session.key, "MASRL_EPISODE_KEY": session.key}
    try:
        run = await run_command(argv, json.dumps(task_payload(task), default=str).encode() + b"\n", child_env, timeout,
                                max_output=MAX_OUTPUT)
    except OSError as e:
        raise ConfigError(f"workflow.params.command {command!r} cannot start ({e})") from None
    if run.timed_out:
        raise ProgramTimeout(f"command {argv[0]} did not finish within {timeout:g} s (killed)")
    if run.returncode != 0:
        tail = run.stderr[-500:].decode("utf-8", "replace").strip().splitlines()
        raise ExternalAgentError(f"command {argv[0]} exited with {run.returncode}"
                                 + (f": {tail[-1]}" if tail else ""))
    lines = [line for line in run.stdout.decode("utf-8", "replace").splitlines() if line.strip()]
    if not lines:
        raise ExternalAgentError(f"command {argv[0]} printed no result (its last line must be JSON)")
    try:
        return json.loads(lines[-1])
    except ValueError:
        raise ExternalAgentError(f"command {argv[0]}: its last line is not JSON: {lines[-1][:200]!r}") from None


def _mark_invalid(result: Any, responses: dict, where: str) -> None:
    """``{"invalid_calls": [response id, ...]}``: the program found those replies malformed (no answer in the
    format it asked for); their turns are invalid (``algorithm.format_penalty``), as a built-in workflow's
    ``turn.valid = False``."""
    if not isinstance(result, dict) or "invalid_calls" not in result:
        return
    ids = result["invalid_calls"]
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise ExternalAgentError(f"{where} returned invalid_calls {str(ids)[:100]!r}; expected a list of the "
                                 "response ids (the `id` of each malformed completion)")
    unknown = [i for i in ids if i not in responses]
    if unknown:
        raise ExternalAgentError(f"{where} returned invalid_calls naming {unknown[0][:80]!r}, which is not the id of "
                                 "a completion of this episode")
    for i in ids:
        for turn in responses[i]:
            turn.valid = False


def program_episode(team: Team, result: Any, where: str, responses: dict | None = None) -> Episode:
    """The program's result as the episode: an answer scored by the task, or its own reward (``responses``:
    the session's response id -> turns, for ``invalid_calls``)."""
    _mark_invalid(result, responses or {}, where)
    if isinstance(result, dict) and "reward" in result:
        reward, answer = result["reward"], result.get("answer")
    elif isinstance(result, (int, float)) and not isinstance(result, bool):
        reward, answer = result, None
    else:
        answer = result.get("answer") if isinstance(result, dict) else result
        if not isinstance(answer, str):
            raise ExternalAgentError(f"{where} returned {type(result).__name__} {str(result)[:100]!r}; expected "
                                     "an answer string, {'answer': str}, a reward number or {'reward': r}")
        return team.finish(answer, external_calls=len(team.turns))
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise ExternalAgentError(f"{where} returned the reward {str(reward)[:60]!r}; it must be a finite number")
    return Episode(task=team.task, turns=list(team.turns), reward=float(reward),
                   answer=answer if isinstance(answer, str) else None,
                   info={"reward_from": "program", "external_calls": len(team.turns)})


async def on_gateway(team: Team, run: Callable[[Any], Awaitable[Any]], where: str, kind: str,
                     finish: Callable[[Any, Any], Episode]) -> Episode:
    """``finish(await run(session), session)`` with a session of its own on the process's gateway, closed at the
    end however the call ends; a failure names ``kind`` (``program``, ``environment``: counted in
    ``usercode/<kind>/*``) and ``where``."""
    p = team.params
    gw = gateway(p["host"], p["port"], float(p["timeout_s"]))
    session = gw.open(team)
    try:
        result = await run(session)
        if not team.turns:
            raise NoModelCallError(f"{where} made no model call (no request reached masrl's gateway): the episode "
                                   "has nothing to train; the program must send its chat completions to the "
                                   "base_url it is given, with an agent's name as `model`")
        episode = finish(result, session)
    except ExternalAgentError as e:
        e.program_kind, e.program_name = kind, where
        raise
    finally:
        gw.close(session)
    episode.info.update(program="ok", program_kind=kind, program_name=where)
    return episode


@register_workflow("external", agents=(), prompts={},
                   params={"entry": None, "command": None, "timeout_s": 300.0, "host": "127.0.0.1", "port": 0,
                           "env": {}, "max_error_share": 1.0},
                   check=_params)  # the same check at start (masrl train, masrl config show), before any model
async def external(task: Task, team: Team) -> Episode:
    """External program: an OpenAI-API agent program per episode, served by masrl's gateway (agents: the
    config's; see the module docstring)."""
    p = _params(team)
    timeout = float(p["timeout_s"])
    if p["entry"] is not None:
        where = p["entry"]

        def run(session):
            return _run_entry(where, task, session.client_kwargs, timeout)
    else:
        where = f"command {p['command']!r}"

        def run(session):
            return _run_command(p["command"], task, session, timeout, p.get("env") or {})
    return await on_gateway(team, run, where, "program",
                            lambda result, session: program_episode(team, result, where, session.responses))
