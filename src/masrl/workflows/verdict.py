"""One Judge turn on the task's prompt as it is: a judge trained with masrl (the ``kb_fact_check`` task).

The task's question is the whole judge prompt (the judge template, rendered), so the Judge sees exactly
what ``task.params.reward.judge`` will show it once exported: one user message through the chat template.
The final answer is the reply; a reply without a standalone yes or no is an invalid turn (format penalty).
"""
from __future__ import annotations

from masrl.tasks.parsing import parse_yes_no
from masrl.types import Episode, Task
from masrl.workflows.base import Team, register_workflow
from masrl.workflows.common import check_params

VERDICT_PROMPTS = {"Judge": "{question}"}


@register_workflow("verdict", agents=("Judge",), prompts=VERDICT_PROMPTS, params={}, check=check_params)
async def verdict(task: Task, team: Team) -> Episode:
    """One Judge turn on the task's question; the reply is the answer, invalid without a yes/no verdict."""
    check_params(team)
    turn = await team.call("Judge", team.render("Judge", question=task.question))
    turn.info["slot"] = 0
    turn.valid = parse_yes_no(turn.text) is not None
    return team.finish(turn.text)
