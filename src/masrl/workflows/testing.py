"""Run a workflow with scripted agent replies (no model): for routing and parsing tests."""
from __future__ import annotations

import asyncio
from typing import Any, Callable, Mapping, Sequence

from masrl.types import Episode, Task, Turn
from masrl.workflows.base import ScoreFn, Team, get_workflow


def exact_match_score(task: Task, answer: str | None) -> dict:
    ok = answer is not None and str(answer).strip() == str(task.answer).strip()
    return {"reward": float(ok), "correct": ok}


def run_scripted(workflow: str, task: Task,
                 replies: Mapping[str, Sequence[str]] | Callable[[str, str], str],
                 *, score: ScoreFn = exact_match_score, params: Mapping[str, Any] | None = None,
                 prompts: Mapping[str, str] | None = None) -> Episode:
    """Run ``workflow`` on ``task``; each agent call returns the next scripted reply.

    ``replies`` maps agent -> list of replies consumed in order, or is a function
    ``(agent, prompt) -> reply``. Running out of replies raises ``AssertionError``.
    """
    spec = get_workflow(workflow)
    queues = {a: list(r) for a, r in replies.items()} if not callable(replies) else None

    async def call(agent: str, prompt) -> Turn:  # a string, or a ChatPrompt from team.chat
        if queues is None:
            text = replies(agent, prompt)  # type: ignore[operator]
        else:
            assert queues.get(agent), f"no scripted reply left for agent {agent!r}"
            text = queues[agent].pop(0)
        return Turn(agent=agent, policy="scripted", prompt_ids=[], response_ids=[], logprobs=[],
                    text=text, prompt_text=prompt if isinstance(prompt, str) else prompt.transcript())

    team = Team(task, spec, call, score, prompts=prompts, params=params)
    return asyncio.run(spec.fn(task, team))
