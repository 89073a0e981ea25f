"""Orch-Workers (study, arXiv 2605.24202): the Orchestrator splits, Workers solve parts, the Synthesizer combines."""
from __future__ import annotations

from masrl.types import Episode, Task
from masrl.workflows.base import Team, register_workflow
from masrl.workflows.common import check_params, numbered, parallel_calls, parse_subtasks, positive_int, require_answer

ORCH_PROMPTS = {
    "Orchestrator": (
        "You coordinate a team that solves a math problem. Break the problem into at most "
        "{max_subtasks} self-contained subtasks that workers can solve independently. Write each "
        "subtask on its own line, in the form\nSUBTASK 1: <description>\nSUBTASK 2: <description>\n"
        "Do not solve the problem yourself.\n\nProblem: {question}"),
    "Worker": ("Solve the following task. Reason step by step, and put your result within \\boxed{}."
               "\n\nTask: {subtask}"),
    "Worker_with_problem": (
        "You are helping to solve this math problem:\n{question}\n\nYour assigned subtask: {subtask}\n\n"
        "Solve only this subtask. Reason step by step, and put your result within \\boxed{}."),
    "Synthesizer": (
        "Problem: {question}\n\nThe problem was split into subtasks, each solved by a worker:\n\n"
        "{results}Using these results (and checking them), solve the problem. Put your final answer "
        "within \\boxed{}."),
    "result": "Subtask {index}: {subtask}\nWorker result:\n{text}\n\n",
}


@register_workflow("orch_workers", agents=("Orchestrator", "Worker", "Synthesizer"), prompts=ORCH_PROMPTS,
                   params={"max_subtasks": 3, "workers_see_problem": False, "answer_format": "boxed"},
                   check=check_params)
async def orch_workers(task: Task, team: Team) -> Episode:
    """Orch-Workers: Orchestrator writes ``SUBTASK k: ...`` lines, Workers solve them in parallel,
    the Synthesizer combines their results into the final ``\\boxed{}``.

    No parsable subtask -> invalid Orchestrator turn, and one Worker gets the whole problem.
    Workers see only their subtask unless ``workers_see_problem: true``. Worker and Synthesizer
    turns without ``\\boxed{}`` (with ``answer_format: code``, without a fenced code block) are invalid.
    Final answer: the Synthesizer text.
    """
    check_params(team)
    max_subtasks = positive_int(team, "max_subtasks")
    see_problem = bool(team.params.get("workers_see_problem", False))
    orchestrator = await team.call("Orchestrator", team.render(
        "Orchestrator", max_subtasks=max_subtasks, question=task.question))
    orchestrator.info["slot"] = 0
    subtasks = parse_subtasks(orchestrator.text, max_subtasks)
    orchestrator.valid = bool(subtasks)
    fallback_used = not subtasks
    if fallback_used:
        subtasks = [task.question]
    orchestrator.info["n_subtasks"] = 0 if fallback_used else len(subtasks)

    template = "Worker_with_problem" if see_problem and not fallback_used else "Worker"
    workers = await parallel_calls(team, "Worker", [team.render(template, subtask=s, question=task.question)
                                               for s in subtasks])
    worker_answers = [require_answer(team, t) for t in workers]
    results = numbered(team, "result", [t.text for t in workers], subtask=subtasks)
    synthesizer = await team.call("Synthesizer", team.render("Synthesizer", results=results,
                                                             question=task.question))
    synthesizer.info["slot"] = 0
    require_answer(team, synthesizer)
    return team.finish(synthesizer.text, subtasks=subtasks, n_subtasks=len(subtasks),
                       subtask_fallback=fallback_used, worker_answers=worker_answers)
