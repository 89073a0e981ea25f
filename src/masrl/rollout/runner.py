"""Run a workflow over many tasks concurrently; agent calls go through the rollout scheduler.

Episodes are isolated: an exception inside one episode's workflow (a tool, a parser, tokenization,
user code) makes that episode invalid (``Episode.error``, reward 0, no turns: nothing of it is
trained) and the others go on. The first failure seen by a scheduler is logged with its traceback,
later ones as one line per rollout; ``rollout/episode_errors`` counts them per step. When every
episode of a rollout fails there is nothing to learn from: ``EpisodeError`` stops the run
with the first error. A ``UserInputError`` (a config problem such as an
unknown workflow param) is not an episode's failure and stops the run as it is.
"""
from __future__ import annotations

import logging
from collections import Counter
from dataclasses import fields
from typing import Callable, Mapping, Sequence

from masrl.config import AgentConfig
from masrl.errors import ConfigError, UserInputError
from masrl.rollout.engine import GenRequest
from masrl.rollout.scheduler import RolloutScheduler
from masrl.tools.chat_format import same_vocabulary
from masrl.tools.execute import DEFAULT_TIMEOUT_S, ToolCounts, abandoned_tool_threads
from masrl.tools.text import safe_str, valid_text
from masrl.types import Episode, Task, Turn
from masrl.usercode.ledger import check_share, usercode_metrics
from masrl.workflows.base import Continuation, ScoreFn, Team, WorkflowSpec
from masrl.workflows.batch_score import score_pending, scores_in_batches

log = logging.getLogger(__name__)


class EpisodeError(UserInputError):
    """Every episode of a rollout failed (its workflow raised): the run stops, naming the first error."""


def repeat_tasks(tasks: Sequence[Task], n: int) -> tuple[list[Task], list[int]]:
    """Each task n times in a row; the group id is the task's index."""
    return [t for t in tasks for _ in range(n)], [i for i in range(len(tasks)) for _ in range(n)]


def make_call(policies: Mapping, agents: Mapping[str, AgentConfig], scheduler: RolloutScheduler,
              temperature: float | None = None):
    """The ``team.call`` backend: chat-encode the prompt, generate with the agent's policy."""

    async def call(agent: str, prompt) -> Turn:  # a string, a Continuation (team.extend) or a ChatPrompt (team.chat)
        acfg = agents[agent]
        policy = policies[acfg.policy]
        if isinstance(prompt, Continuation):
            check_continuation(policies, agent, acfg.policy, prompt)
            if "refused" in prompt.turn.info:
                return refused_turn(agent, acfg.policy, prompt.transcript(), "continues a refused turn: "
                                    + prompt.turn.info["refused"])
        room = policy.max_positions - acfg.max_new_tokens
        limit = max(room, 0) * max_token_chars(policy.tokenizer)
        system = valid_text(acfg.system_prompt) if acfg.system_prompt else None  # (the prompt was made valid by team.call)
        text = prompt if isinstance(prompt, str) else policy.render_prompt(prompt, system)
        size = len(text) + (len(system or "") if isinstance(prompt, str) else 0)
        if size > limit:  # refused before tokenizing it
            return refused_turn(agent, acfg.policy, text, f"prompt of {size:,} characters cannot fit the "
                                f"{policy.max_positions}-token context of policy {acfg.policy!r} with "
                                f"max_new_tokens {acfg.max_new_tokens} (at most {limit:,} characters)")
        try:
            prompt_ids = policy.encode_prompt(prompt, system)
        except ConfigError as e:  # a continuation in a chat format: say which agent
            raise ConfigError(f"agent {agent!r}: {e}") from None
        info = {}
        if len(prompt_ids) > room:  # keep the end of an over-long prompt, and say so
            info["prompt_truncated_from"] = len(prompt_ids)
            prompt_ids = prompt_ids[-room:]
        temp = acfg.temperature if temperature is None else temperature
        info["temperature"] = temp
        result = await scheduler.generate(acfg.policy, GenRequest(prompt_ids, temp, acfg.top_p, acfg.max_new_tokens,
                                                                       policy.adapter(agent)))
        if result.version is not None:  # sampled by a rollout copy of the weights (rollout.max_staleness)
            info["policy_version"] = result.version
        return Turn(agent=agent, policy=acfg.policy, prompt_ids=prompt_ids, response_ids=result.response_ids,
                    logprobs=result.logprobs, text=policy.decode(result.response_ids),
                    prompt_text=text,
                    truncated=result.truncated, info=info)

    return call


_MAX_TOKEN_CHARS: dict[int, int] = {}


def max_token_chars(tokenizer) -> int:
    """The most characters one token of ``tokenizer`` can stand for (its longest vocabulary entry; byte-level
    entries spell one character per byte, so this bounds decoded characters too). A text of more than
    ``n * max_token_chars`` characters needs more than ``n`` tokens: longer prompts are refused untokenized."""
    key = id(tokenizer)
    if key not in _MAX_TOKEN_CHARS:
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        _MAX_TOKEN_CHARS[key] = max((len(t) for t in vocab), default=64) or 64
    return _MAX_TOKEN_CHARS[key]


def refused_turn(agent: str, policy: str, prompt: str, reason: str) -> Turn:
    """An invalid turn that generated nothing: its prompt could not fit the model (``info["refused"]``)."""
    shown = prompt if len(prompt) <= 2000 else prompt[:2000] + f"... [{len(prompt):,} characters]"
    return Turn(agent=agent, policy=policy, prompt_ids=[], response_ids=[], logprobs=[], text="", prompt_text=shown,
                valid=False, info={"refused": reason})


def check_continuation(policies: Mapping, agent: str, policy: str, prompt: Continuation) -> None:
    """A turn of another policy can be continued only with the same token ids (the same vocabulary)."""
    earlier = prompt.turn.policy
    if earlier != policy and earlier in policies and \
            not same_vocabulary(policies[earlier].tokenizer, policies[policy].tokenizer):
        raise ConfigError(f"agent {agent!r} (policy {policy!r}) continues a turn of policy {earlier!r} "
                          "(team.extend; workflow.params.transcript: true), but the two policies' tokenizers "
                          "differ, so its token ids mean other tokens; map both agents to policies with one "
                          "tokenizer, or use transcript: false")


def run_episodes(spec: WorkflowSpec, tasks: Sequence[Task], group_ids: Sequence[int], *, call,
                 scheduler: RolloutScheduler, score: ScoreFn, prompts: Mapping[str, str],
                 params: Mapping, format_penalty: float, tool_timeout_s: float = DEFAULT_TIMEOUT_S,
                 on_episode: Callable[[Episode], None] | None = None,
                 on_turn: Callable[[Turn], None] | None = None) -> list[Episode]:
    """One episode per task (tasks repeat G times for a group); results in input order.

    An episode whose workflow raises is invalid on its own (see the module docstring); when all of them
    fail, ``EpisodeError``. ``on_episode`` / ``on_turn``: called with each episode / agent turn as it
    finishes (progress of a long evaluation: a workflow's episodes finish together in its last round, its
    turns once per round)."""
    if on_turn is not None:
        inner = call

        async def call(agent: str, prompt) -> Turn:
            turn = await inner(agent, prompt)
            on_turn(turn)
            return turn

    defer = scores_in_batches(score)  # a judge: every final answer scored in one batch after the rollout
    failures: list[tuple[Episode, BaseException]] = []

    async def one(index: int, task: Task) -> Episode:
        team = Team(task, spec, call, score, prompts=prompts, params=params, format_penalty=format_penalty,
                    defer_score=defer, tool_timeout_s=tool_timeout_s)
        try:
            episode = await spec.fn(task, team)
            if not isinstance(episode, Episode):
                raise TypeError(f"workflow {spec.name!r} returned {safe_str(type(episode).__name__)}, not an "
                                "Episode (end it with `return team.finish(answer)`)")
        except UserInputError:
            raise
        except Exception as e:  # noqa: BLE001 - this episode's failure, not the rollout's
            episode = failed_episode(task, team, e)
            failures.append((episode, e))
        episode.group_id = group_ids[index]
        episode.episode_id = index
        episode.tool_counts = team.tool_counts.as_dict()
        if on_episode is not None and not defer:
            on_episode(episode)
        return episode

    episodes = scheduler.run([one(i, t) for i, t in enumerate(tasks)])
    report_failures(spec, episodes, failures, scheduler, error_share(params))
    if defer:
        score_pending(episodes, score)
        for episode in episodes if on_episode is not None else ():
            on_episode(episode)
    return episodes


def failed_episode(task: Task, team: Team, error: BaseException) -> Episode:
    """The invalid episode of a workflow that raised ``error``: reward 0, wrong, no turns (none is trained).
    ``info["reason"]``: the error's own ``reason`` (``no_model_call``: an agent program that called no model), else
    ``episode_error``; ``info["program"]``: ``error`` / ``timeout`` when an agent program or an environment failed
    (``info["program_kind"]``: ``program`` or ``environment``; ``info["program_name"]``: which)."""
    info = {"correct": False, "reason": str(getattr(error, "reason", "episode_error")),
            "turns_before_error": len(team.turns)}
    if getattr(error, "program_outcome", None):
        info["program"], info["program_kind"] = error.program_outcome, getattr(error, "program_kind", "program")
        info["program_name"] = getattr(error, "program_name", None)
    return Episode(task=task, turns=[], reward=0.0, answer=None, info=info,
                   error=f"{safe_str(type(error).__name__)}: {safe_str(error, 500)}")


def report_failures(spec: WorkflowSpec, episodes: Sequence[Episode], failures: list[tuple[Episode, BaseException]],
                    scheduler: RolloutScheduler, max_share: float = 1.0) -> None:
    """Log the rollout's failed episodes (the scheduler's first one with its traceback); raise
    ``EpisodeError`` when every episode failed, or when the failed calls of an agent program or an environment
    reach ``max_share`` (``workflow.params.max_error_share``) of its calls (``check_share``)."""
    if not failures:
        return
    failures = sorted(failures, key=lambda f: f[0].episode_id)
    def where_of(e: Episode) -> str:
        return f"episode {e.episode_id} (task {safe_str(e.task.id, 100)!r}) of workflow {spec.name!r}"

    first, error = failures[0]
    empties = [e for e, _ in failures if e.info.get("reason") == "empty_reply"]
    others = [(e, x) for e, x in failures if e.info.get("reason") != "empty_reply"]
    empty = len(empties)
    if others:  # the first failure that is not an empty reply is the one to show (and to name below)
        first, error = others[0]
    where = where_of(first)
    if empty and not scheduler.stats.empty_replies:  # an untrained model's empty reply: one line per run
        log.warning("%d of %d episodes ended with an empty model reply (%s); they are invalid (reward 0, not trained) "
                    "and counted in rollout/empty_replies, without a traceback", empty, len(episodes),
                    empties[0].error)
    if scheduler.stats.episode_errors == scheduler.stats.empty_replies and others:
        log.error("%s raised; the episode is invalid (reward 0, not trained), the other episodes go on; later "
                  "failures are counted in rollout/episode_errors without a traceback", where, exc_info=error)
    scheduler.stats.empty_replies += empty
    scheduler.stats.episode_errors += len(failures)
    if len(failures) == len(episodes) and all(e.info.get("reason") == "no_model_call" for e, _ in failures):
        raise EpisodeError(f"no episode of the rollout made a model call ({len(failures)} of {len(episodes)} counted "
                           f"in rollout/episodes_without_calls), so there is nothing to train on; the first: "
                           f"{first.error} in {where}")
    check_programs(episodes, spec, max_share)
    if len(failures) == len(episodes):
        raise EpisodeError(f"every episode of the rollout failed ({len(failures)} of {len(episodes)}), so there is "
                           f"nothing to train on; the first: {first.error} in {where}; fix the workflow "
                           "(the traceback of the first failure is logged above)")
    if empty < len(failures):
        log.warning("%d of %d episodes failed and are invalid (reward 0, not trained); the first: %s in %s",
                    len(failures), len(episodes), first.error, where)


def program_counts(episodes: Sequence[Episode]) -> dict[str, Counter]:
    """``{kind: Counter(ok=, error=, timeout=)}`` of the rollout's agent programs and environments."""
    counts: dict[str, Counter] = {}
    for e in episodes:
        if e.info.get("program") in ("ok", "error", "timeout"):
            counts.setdefault(e.info.get("program_kind") or "program", Counter())[e.info["program"]] += 1
    return counts


def error_share(params: Mapping) -> float:
    """``workflow.params.max_error_share`` (agent programs, environments; checked at start), 1.0 when unset."""
    share = params.get("max_error_share", 1.0)
    return float(share) if isinstance(share, (int, float)) and not isinstance(share, bool) else 1.0


def check_programs(episodes: Sequence[Episode], spec: WorkflowSpec, max_share: float, scope: str = "the rollout",
                   label: str = "episode") -> None:
    """The loud stop of ``masrl.usercode`` for agent programs and environments: ``EpisodeError`` (one line) when a
    kind's failed episodes reach ``max_share`` of its episodes in ``scope`` (the rollout, the SFT demonstrations;
    ``label`` names an episode there)."""
    for kind, n in program_counts(episodes).items():
        failed = [e for e in episodes if e.info.get("program_kind") == kind and e.info["program"] != "ok"]
        if not failed:
            continue
        first = failed[0]
        where = f"{label} {first.episode_id} (task {safe_str(first.task.id, 100)!r}) of workflow {spec.name!r}"
        hint = "" if max_share >= 1 else f" or raise workflow.params.max_error_share (now {max_share:g})"
        code = "agent program" if kind == "program" else "environment"
        check_share(str(first.info.get("program_name") or code), n["ok"] + n["error"] + n["timeout"], n["error"],
                    n["timeout"], f"{first.error} in {where}", max_share, scope,
                    f"fix the {code}{hint} (the traceback of the first failure is logged above)", EpisodeError)


def rollout_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """Per-rollout counts: ``rollout/episode_errors`` (invalid episodes), ``rollout/episodes_without_calls``
    (agent programs that called no model), ``rollout/empty_replies`` (an environment's rollouts that ended on an
    empty model reply), ``tool/<count>`` summed over the episodes' tool calls
    (``ToolCounts``) and ``tool/abandoned_threads`` (tool threads still running past
    their deadline); the same counts as ``usercode/tool/*`` and, for agent programs, ``usercode/program/*``."""
    tools: Counter = Counter()
    for e in episodes:
        tools.update(e.tool_counts)
    out = {"rollout/episode_errors": float(sum(not e.valid for e in episodes)),
           "rollout/episodes_without_calls": float(sum(e.info.get("reason") == "no_model_call" for e in episodes)),
           "rollout/empty_replies": float(sum(e.info.get("reason") == "empty_reply" for e in episodes))}
    out.update({f"tool/{f.name}": float(tools[f.name]) for f in fields(ToolCounts)})
    out["tool/abandoned_threads"] = float(abandoned_tool_threads())
    out.update(usercode_metrics("tool", tools["calls"], tools["errors"], tools["timeouts"]))
    for kind, n in program_counts(episodes).items():
        out.update(usercode_metrics(kind, n["ok"] + n["error"] + n["timeout"], n["error"], n["timeout"]))
    return out
