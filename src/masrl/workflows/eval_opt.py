"""Eval-Opt (study, arXiv 2605.24202): Generator solves, Evaluator judges, the Generator revises, in a loop."""
from __future__ import annotations

from masrl.types import Episode, Task
from masrl.workflows.base import Team, register_workflow
from masrl.workflows.common import (SOLVE_PROMPT, check_params, choice_param, judge_correct, parse_verdict,
                                    positive_int, require_answer)

EVAL_OPT_PROMPTS = {
    "Generator": SOLVE_PROMPT,
    "Generator_revise": (
        "Solve the following math problem. Reason step by step, and put your final answer within "
        "\\boxed{}.\n\nProblem: {question}\n\nA previous attempt:\n{previous_solution}\n\n"
        "A reviewer judged this attempt incorrect, with this feedback:\n{feedback}\n\n"
        "Solve the problem again from scratch, using a different approach where the previous attempt "
        "went wrong and addressing the feedback. Put your final answer within \\boxed{}."),
    "Evaluator": (
        "You are reviewing a proposed solution to a math problem.\n\nProblem: {question}\n\n"
        "Proposed solution:\n{solution}\n\nCheck the reasoning and the final answer carefully. "
        "Reply with \\boxed{Correct} if the final answer is correct or \\boxed{Incorrect} if it is not, "
        "followed by a brief reason (one or two sentences). Do not reveal the correct answer."),
}


@register_workflow("eval_opt", agents=("Generator", "Evaluator"), prompts=EVAL_OPT_PROMPTS,
                   params={"max_iterations": 3, "invalid_verdict": "incorrect", "evaluate_final": True,
                           "judge_verdicts": True, "answer_format": "boxed"}, check=check_params)
async def eval_opt(task: Task, team: Team) -> Episode:
    """Eval-Opt: Generator solves, Evaluator says Correct/Incorrect; on Incorrect the Generator revises.

    One iteration = one Generator turn followed by one Evaluator turn; at most ``max_iterations``
    (math 3, code 2). Stops at the first Correct verdict. ``evaluate_final: false`` skips the
    Evaluator after the last allowed Generator turn (its verdict cannot change the answer).
    A Generator turn without ``\\boxed{}`` is invalid; an Evaluator turn without
    ``\\boxed{Correct|Incorrect}`` is invalid and counts as ``invalid_verdict`` (default incorrect).
    Final answer: the last Generator text.
    """
    check_params(team)
    max_iterations = positive_int(team, "max_iterations")
    invalid_verdict = choice_param(team, "invalid_verdict", ("incorrect", "correct"))
    evaluate_final = bool(team.params.get("evaluate_final", True))
    judge = bool(team.params.get("judge_verdicts", True))

    verdicts: list[str | None] = []  # parsed verdicts (None = unparsable)
    answers: list[str | None] = []   # each Generator turn's boxed answer
    history = ""
    solution = feedback = ""
    stopped_by = "max_iterations"
    for iteration in range(max_iterations):
        if iteration == 0:
            prompt = team.render("Generator", question=task.question)
        else:
            prompt = team.render("Generator_revise", iteration=iteration + 1, previous_solution=solution,
                                 feedback=feedback, history=history, question=task.question)
        generator = await team.call("Generator", prompt)
        generator.info.update(slot=0, iteration=iteration + 1)
        answers.append(require_answer(team, generator))
        solution = generator.text
        history += f"Attempt {iteration + 1}:\n{solution}\n\n"
        if iteration == max_iterations - 1 and not evaluate_final:
            break
        evaluator = await team.call("Evaluator", team.render(
            "Evaluator", iteration=iteration + 1, solution=solution, history=history, question=task.question))
        verdict = parse_verdict(evaluator.text)
        evaluator.valid = verdict is not None
        verdicts.append(verdict)
        effective = verdict or invalid_verdict
        evaluator.info.update(slot=0, iteration=iteration + 1, verdict=effective, parsed_verdict=verdict)
        if judge:
            evaluator.info["judged_correct"] = judge_correct(team, solution)
        feedback = evaluator.text
        history += f"Review {iteration + 1}:\n{feedback}\n\n"
        if effective == "correct":
            stopped_by = "approved"
            break
    return team.finish(solution, iterations=len(answers), verdicts=verdicts,
                       approved=stopped_by == "approved", stopped_by=stopped_by, generator_answers=answers)
