"""The episodes of a verifiers environment, played against masrl's gateway (``workflow: environment``).

``VerifiersPlayer`` runs a v0 environment's own ``run_rollout`` with an ``AsyncOpenAI`` client on the episode's
gateway session; ``V1Player`` runs a v1 ``Env``'s own ``run_episode`` (``setup``, ``run``, ``finalize``), each
role's model calls reaching the gateway through verifiers' interception server with ``model`` = the masrl agent
the role maps to (``masrl.tasks.environments.verifiers_v1``). Both are called by the ``environment`` workflow as
one user-code call per episode (deadline, counted failures, loud stop).
"""
from __future__ import annotations

import contextlib
import copy
import logging
import statistics
from typing import Any

from masrl.tasks.environments.verifiers_env import VerifiersGame
from masrl.usercode.verifiers_v1 import V1Game
from masrl.types import Task

# verifiers' error for a reply that carries nothing (an untrained model's empty reply): the episode is invalid like
# any failed rollout, counted in rollout/empty_replies, and reported in one line per run instead of a traceback
EMPTY_REPLY = "EmptyModelResponseError"


class EnvironmentRolloutError(RuntimeError):
    """The environment's rollout ended with its own error."""


class EmptyReplyError(EnvironmentRolloutError):
    """The environment's rollout ended on an empty model reply (``reason``: counted apart, no traceback)."""

    reason = "empty_reply"


class _QuietEmptyReplies(logging.Filter):
    """Drops verifiers' own per-rollout line for an empty reply (masrl reports those once per run)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.getMessage().startswith("Aborted rollout due to") and EMPTY_REPLY in record.getMessage())


def quiet_empty_replies(env: Any) -> None:
    """On the environment's own logger (where verifiers logs the line)."""
    logger = getattr(env, "logger", None)
    if isinstance(logger, logging.Logger) and not any(isinstance(f, _QuietEmptyReplies) for f in logger.filters):
        logger.addFilter(_QuietEmptyReplies())


def _rollout_input(task: Task) -> dict:
    row = task.meta["row"]
    return {k: row[k] for k in ("prompt", "example_id", "answer", "info", "task") if row.get(k) is not None}


def _answer(completion: Any) -> str | None:
    if isinstance(completion, str):
        return completion
    for message in reversed(completion or []):
        get = message.get if isinstance(message, dict) else lambda key: getattr(message, key, None)
        if get("role") == "assistant":
            content = get("content")
            return content if isinstance(content, str) else str(content or "")
    return None


# what the HTTP status of a ProviderError without a message says (verifiers.v1.errors._provider_status for an httpx
# error in verifiers.v1.clients.eval.EvalClient._request, whose text was empty)
PROVIDER_STATUS = {
    504: "verifiers' client to masrl's gateway timed out (httpx gives its timeouts no text)",
    503: "the connection between verifiers' interception and masrl's gateway was refused, reset or closed (httpx gave "
         "no text)",
}


def patient_provider_clients(interception: Any) -> None:
    """Every model client ``interception`` hands a rollout (``RolloutSession.client``, set when the rollout acquires
    its slot) reaches masrl's gateway without verifiers' 5 s connect bound (``V1Player``): its httpx client's
    timeouts are all lifted; the episode's deadline bounds the call."""
    import httpx

    acquire = interception.acquire

    @contextlib.asynccontextmanager
    async def acquire_patient(session: Any):
        async with acquire(session) as slot:
            http = getattr(session.client, "client", None)
            if isinstance(http, httpx.AsyncClient):
                http.timeout = httpx.Timeout(None)
            yield slot

    interception.acquire = acquire_patient


def numbers(values: dict) -> dict[str, float]:
    return {str(k): float(v) for k, v in (values or {}).items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


class VerifiersPlayer:
    """One episode of a v0 environment: its ``run_rollout`` with a client on the episode's gateway session."""

    def __init__(self, game: VerifiersGame):
        self.env, self.sampling_args = game.env, game.sampling_args
        quiet_empty_replies(game.env)

    async def __call__(self, task: Task, client_kwargs: dict, agent: str) -> dict:
        import openai
        import verifiers as vf

        async with openai.AsyncOpenAI(max_retries=0, timeout=None, **client_kwargs) as raw:
            client = vf.OpenAIChatCompletionsClient(raw)
            output = await self.env.run_rollout(_rollout_input(task), client, agent, dict(self.sampling_args))
        error = output.get("error")
        if error:
            kind = error.get("error") if isinstance(error, dict) else type(error).__name__  # a dict once serialized
            message = error.get("message", error) if isinstance(error, dict) else error
            raise (EmptyReplyError if kind == EMPTY_REPLY else EnvironmentRolloutError)(
                f"the environment's rollout ended with an error: {kind}: {str(message)[:300]}")
        reward = float(output.get("reward") or 0.0)
        threshold = float(getattr(self.env, "pass_threshold", 0.5))  # verifiers' pass@k threshold
        return {"reward": reward, "correct": reward >= threshold, "answer": _answer(output.get("completion")),
                "metrics": numbers(output.get("metrics")),
                "info": {"stop_condition": output.get("stop_condition"),
                         "is_truncated": bool(output.get("is_truncated"))}}


class V1Player:
    """One episode of a v1 ``Env``: ``env.run_episode(task, ctx)`` with the run's client on the episode's gateway
    session, inside the Env's serving resources (its interception server, shared tool servers: ``Env.serving()``),
    entered for the episode on a copy of the Env (nothing outlives the episode or is shared between episodes).

    The interception forwards each model call to masrl's gateway with an httpx client of its own, whose connect
    verifiers bounds at 5 s (``verifiers.v1.clients.base.DEFAULT_TIMEOUT``, to fail fast on an unreachable
    provider). That bound is kept by the Env's event loop, which every concurrent episode of the Env shares
    (``masrl.usercode.calls``): when the loop is busy for longer than 5 s (many episodes' work on a loaded CPU), a
    connect the kernel completed at once is timed out all the same, and the call fails as a ``ProviderError`` with
    an empty message (httpx's ``ConnectTimeout`` has no text), HTTP 504. The gateway is masrl's own, in-process:
    ``patient_provider_clients`` lifts that bound, and the episode's deadline (``workflow.params.timeout_s``)
    bounds the call instead."""

    def __init__(self, game: V1Game):
        self.game = game

    async def __call__(self, task: Task, client_kwargs: dict, agent: str | None) -> dict:
        import verifiers.v1 as vf

        client = vf.EvalClientConfig(base_url=client_kwargs["base_url"], api_key_var="MASRL_GATEWAY_KEY")
        ctx = vf.ModelContext(model=next(iter(self.game.roles.values())), client=client)
        env = copy.copy(self.game.env)
        async with env.serving():
            patient_provider_clients(env._interception)
            episode = await env.run_episode(self.game.task(task.meta["row"]), ctx)
        failed = [(t, e) for t in episode.traces if not t.ok for e in t.errors[-1:]]  # the cause first
        failed += [(None, e) for e in episode.errors]
        if failed or not episode.ok:
            what = self.failure(*failed[0]) if failed else "a trace did not complete"
            raise EnvironmentRolloutError(f"the environment's episode failed: {what[:400]}")
        return self.results(episode)

    def failure(self, trace: Any, error: Any) -> str:
        """One line for the error that ended the episode: the role (and its masrl agent) whose run it ended, and
        the error; an error verifiers recorded without a message (a provider client's timeout or lost connection:
        httpx's text is empty) is said by its HTTP status and how long the failed call took."""
        where = ""
        if trace is not None:
            role = trace.agent.name
            where = f"role {role!r} (agent {self.game.roles.get(role, role)}): "
        if error.message:
            return f"{where}{error.type}: {error.message}"
        call = next((c for c in reversed(trace.calls) if c.error is not None), None) if trace is not None else None
        how = [f"HTTP {error.status_code}"] if error.status_code else []
        how += [f"after {call.time.duration:.1f} s"] if call is not None and call.time.end else []
        how.append(f"no message: {PROVIDER_STATUS.get(error.status_code, 'verifiers recorded none')}")
        return f"{where}{error.type} ({', '.join(how)})"

    def results(self, episode: Any) -> dict:
        """The episode's reward (the mean reward of its trainable traces, of every trace when none is: verifiers'
        own rule), each trace's reward on the turns its model calls made (``turn_rewards``), and every named reward
        and metric per role, averaged over the role's traces."""
        scored = [t for t in episode.traces if t.agent.trainable] or episode.traces
        reward = statistics.fmean(t.reward for t in scored)
        named: dict[str, list[float]] = {}
        turn_rewards: dict[str, float] = {}
        for t in episode.traces:
            agent = self.game.roles.get(t.agent.name, t.agent.name)
            values = {**numbers({k: r.score for k, r in t.rewards.items() if r is not None}), **numbers(t.metrics),
                      "reward": t.reward}
            for name, value in values.items():
                named.setdefault(f"{agent}/{name}", []).append(value)
            if t.agent.trainable and any(r is not None for r in t.rewards.values()):
                turn_rewards.update({rid: float(t.reward) for rid in t.info.get("masrl_response_ids", ())})
        return {"reward": reward, "correct": reward >= self.game.pass_threshold, "answer": scored[-1].last_reply,
                "metrics": {k: statistics.fmean(v) for k, v in named.items()}, "turn_rewards": turn_rewards,
                "info": {"env_traces": len(episode.traces)}}


def player(game: Any) -> Any:
    """The episode function of an environment task's game (the tool environment's is ``ToolPlayer``)."""
    if isinstance(game, VerifiersGame):
        return VerifiersPlayer(game)
    if isinstance(game, V1Game):
        return V1Player(game)
    return game
