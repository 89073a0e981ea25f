"""Proposers -> Summarizer (MoA ensemble): n Proposers answer in parallel, the Summarizer synthesizes."""
from __future__ import annotations

from typing import Any

from masrl.types import Episode, Task
from masrl.workflows.base import Team, register_workflow
from masrl.workflows.common import (SOLVE_PROMPT, check_params, judge_correct, majority_vote, numbered, parallel_calls,
                                    positive_int, require_box)

MOA_PROMPTS = {
    "Proposer": SOLVE_PROMPT,
    "Summarizer": (
        "You have been given responses from several models to the math problem below. Some of them "
        "may be wrong. Critically evaluate them and synthesize a single, correct solution; do not "
        "simply copy one response.\n\nProblem: {question}\n\n{proposals}Reason step by step, and put "
        "your final answer within \\boxed{}."),
    "proposal": "Response {index}:\n{text}\n\n",
}


@register_workflow("proposers_summarizer", agents=("Proposer", "Summarizer"), prompts=MOA_PROMPTS,
                   params={"n_proposers": 3, "score_candidates": False}, check=check_params)
async def proposers_summarizer(task: Task, team: Team) -> Episode:
    """MoA: ``n_proposers`` answer in parallel; the Summarizer synthesizes the final ``\\boxed{}``.

    Proposer and Summarizer turns without ``\\boxed{}`` are invalid (every proposal is still shown
    to the Summarizer). ``episode.info["proposals"]`` holds each proposer's boxed answer (None if
    none) in slot order, for ensemble analysis. Final answer: the Summarizer text.
    """
    check_params(team)
    n = positive_int(team, "n_proposers")
    proposers = await parallel_calls(team, "Proposer", [team.render("Proposer", question=task.question)] * n)
    proposals = [require_box(t) for t in proposers]
    summarizer = await team.call("Summarizer", team.render(
        "Summarizer", n=n, proposals=numbered(team, "proposal", [t.text for t in proposers]),
        question=task.question))
    summarizer.info["slot"] = 0
    summary = require_box(summarizer)
    info: dict[str, Any] = {}
    if team.params.get("score_candidates"):
        info["candidate_correct"] = [judge_correct(team, t.text) for t in proposers]
    majority = majority_vote(proposals)
    return team.finish(summarizer.text, proposals=proposals, summary_answer=summary,
                       majority_answer=proposals[majority] if majority is not None else None, **info)
