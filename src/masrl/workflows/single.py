"""Single-agent baseline (SA-RL): one Solver turn with the math solver-verifier's Solver prompt."""
from __future__ import annotations

from masrl.types import Episode, Task
from masrl.workflows.base import Team, register_workflow
from masrl.workflows.common import SOLVE_PROMPT, check_params, require_answer


def _solver_prompt() -> str:
    """The first role (Solver) of the math solver-verifier workflow, so that SA-RL matches it."""
    try:
        from masrl.workflows.math import MATH_PROMPTS
        return str(MATH_PROMPTS["Solver"])
    except (ImportError, KeyError, TypeError):  # pragma: no cover - depends on the sibling module
        return SOLVE_PROMPT


SINGLE_PROMPTS = {"Solver": _solver_prompt()}


@register_workflow("single", agents=("Solver",), prompts=SINGLE_PROMPTS, params={"answer_format": "boxed"},
                   check=check_params)
async def single(task: Task, team: Team) -> Episode:
    """Single-agent baseline: one Solver turn, same prompt as the math solver-verifier's Solver.

    A turn without ``\\boxed{}`` (or, with ``answer_format: code``, without a fenced code block)
    is invalid. Final answer: the Solver text.
    """
    check_params(team)
    solver = await team.call("Solver", team.render("Solver", context="", question=task.question))
    solver.info["slot"] = 0
    require_answer(team, solver)
    return team.finish(solver.text)
