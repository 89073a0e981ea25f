"""Voting (study, arXiv 2605.24202): n Generators answer in parallel, the Aggregator picks one."""
from __future__ import annotations

from typing import Any

from masrl.types import Episode, Task
from masrl.workflows.base import Team, register_workflow
from masrl.workflows.common import (SOLVE_PROMPT, check_params, choice_param, judge_correct, majority_vote,
                                    normalize_answer, numbered, parallel_calls, parse_index, positive_int, require_answer)

VOTING_PROMPTS = {
    "Generator": SOLVE_PROMPT,
    "Aggregator": (
        "You are given a math problem and {n} candidate solutions written independently.\n\n"
        "Problem: {question}\n\n{solutions}Compare the candidates and check their reasoning. "
        "Decide which solution is most likely correct. Give a brief justification, then the number "
        "of the best solution (1 to {n}) within \\boxed{}."),
    "solution": "Solution {index}:\n{text}\n\n",
}


@register_workflow("voting", agents=("Generator", "Aggregator"), prompts=VOTING_PROMPTS,
                   params={"n_generators": 3, "fallback": "majority", "score_candidates": False,
                           "answer_format": "boxed"}, check=check_params)
async def voting(task: Task, team: Team) -> Episode:
    """Voting: ``n_generators`` answer in parallel; the Aggregator picks one with ``\\boxed{i}`` (1-based).

    Generator turns without ``\\boxed{}`` (with ``answer_format: code``, without a fenced code block) are
    invalid. An unparsable or out-of-range choice makes the
    Aggregator turn invalid and applies ``fallback``: ``majority`` (most common boxed answer among
    the generators, earliest on ties), ``first`` (generator 1) or ``none`` (no answer).
    Final answer: the chosen generator's text.
    """
    check_params(team)
    n = positive_int(team, "n_generators")
    fallback = choice_param(team, "fallback", ("majority", "first", "none"))
    prompt = team.render("Generator", question=task.question)
    generators = await parallel_calls(team, "Generator", [prompt] * n)
    answers = [require_answer(team, t) for t in generators]
    texts = [t.text for t in generators]

    aggregator = await team.call("Aggregator", team.render(
        "Aggregator", n=n, solutions=numbered(team, "solution", texts), question=task.question))
    aggregator.info["slot"] = 0
    choice = parse_index(aggregator.text, n)
    aggregator.valid = choice is not None
    aggregator.info["choice"] = choice

    majority = majority_vote(answers)
    fallback_used = None
    if choice is not None:
        chosen = choice - 1
    else:
        fallback_used = fallback
        chosen = majority if fallback == "majority" else 0 if fallback == "first" else None
    final = texts[chosen] if chosen is not None else None
    info: dict[str, Any] = {}
    if team.params.get("score_candidates"):
        info["candidate_correct"] = [judge_correct(team, t) for t in texts]
    agree = sum(normalize_answer(a) == normalize_answer(answers[majority]) for a in answers) if majority is not None else 0
    return team.finish(final, choice=choice, chosen_slot=chosen, fallback_used=fallback_used,
                       generator_answers=answers, majority_slot=majority,
                       majority_answer=answers[majority] if majority is not None else None,
                       agreement=agree / n, **info)
