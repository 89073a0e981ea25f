"""Workflows of the policy-sharing study (arXiv 2605.24202), the MoA ensemble, and the single-agent baseline.

========================  ======================================  ==============================
workflow                  agents                                  protocol
========================  ======================================  ==============================
``eval_opt``              Generator, Evaluator                    solve -> judge -> revise, loop
``voting``                Generator (x n), Aggregator             n parallel answers -> pick one
``orch_workers``          Orchestrator, Worker (x <=3),           split -> solve parts -> combine
                          Synthesizer
``proposers_summarizer``  Proposer (x n), Summarizer              n parallel answers -> synthesize
``single``                Solver                                  one answer (SA-RL baseline)
========================  ======================================  ==============================

Every turn records its *slot* in ``turn.info["slot"]``: the index of a parallel same-role agent
(generator 0/1/2, worker 0/1/2, proposer 0/1/2), 0 for roles that act alone. ``Team.call`` numbers
turns in completion order, so the slot is what tells parallel agents apart; the trainer groups
advantages per role (``agent``) or per role slot (``f"{agent}#{slot}"``).

The final answer handed to ``team.finish`` is always the raw text of the deciding turn (the score
function extracts the box itself). Malformed turns are marked ``turn.valid = False``; the episode
goes on with the fallback documented per workflow. See docs/workflows.md.

Prompt fields are passed scalar fields first and model/task text last: ``render`` substitutes one
field after another, so a placeholder name inside an already inserted text (``a_{n}`` in a
question) would otherwise be substituted too.
"""
from __future__ import annotations

import asyncio
import re
from collections import Counter
from typing import Any

from masrl.errors import ConfigError
from masrl.types import Episode, Task, Turn
from masrl.workflows.base import Team, register_workflow
from masrl.workflows.parsing import extract_boxed

# --------------------------------------------------------------------------- prompts

SOLVE_PROMPT = ("Solve the following math problem. Reason step by step, and put your final answer "
                "within \\boxed{}.\n\nProblem: {question}")

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

VOTING_PROMPTS = {
    "Generator": SOLVE_PROMPT,
    "Aggregator": (
        "You are given a math problem and {n} candidate solutions written independently.\n\n"
        "Problem: {question}\n\n{solutions}Compare the candidates and check their reasoning. "
        "Decide which solution is most likely correct. Give a brief justification, then the number "
        "of the best solution (1 to {n}) within \\boxed{}."),
    "solution": "Solution {index}:\n{text}\n\n",
}

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

MOA_PROMPTS = {
    "Proposer": SOLVE_PROMPT,
    "Summarizer": (
        "You have been given responses from several models to the math problem below. Some of them "
        "may be wrong. Critically evaluate them and synthesize a single, correct solution; do not "
        "simply copy one response.\n\nProblem: {question}\n\n{proposals}Reason step by step, and put "
        "your final answer within \\boxed{}."),
    "proposal": "Response {index}:\n{text}\n\n",
}


def _solver_prompt() -> str:
    """The first role (Solver) of the math solver-verifier workflow, so that SA-RL matches it."""
    try:
        from masrl.workflows.math import MATH_PROMPTS
        return str(MATH_PROMPTS["Solver"])
    except (ImportError, KeyError, TypeError):  # pragma: no cover - depends on the sibling module
        return SOLVE_PROMPT


SINGLE_PROMPTS = {"Solver": _solver_prompt()}

# --------------------------------------------------------------------------- helpers


def _strip_latex_text(s: str) -> str:
    r"""``\text{Correct}`` / ``\textbf{ 2 }`` / ``\mathrm{x}`` -> their content; other text unchanged."""
    prev = None
    while prev != s:
        prev = s
        s = re.sub(r"\\(?:text|textbf|textit|mathrm|mathbf|mbox)\s*\{([^{}]*)\}", r"\1", s)
    return s.strip()


def parse_verdict(text: object) -> str | None:
    r"""``"correct"`` / ``"incorrect"`` from the last ``\boxed{...}``, or None when unparsable.

    Case-insensitive; ``\text{}`` wrappers, spaces and trailing punctuation are ignored.
    """
    boxed = extract_boxed(text)
    if boxed is None:
        return None
    word = _strip_latex_text(boxed).strip().strip(".!*").strip().lower()
    return word if word in ("correct", "incorrect") else None


def parse_index(text: object, n: int) -> int | None:
    r"""The 1-based choice in the last ``\boxed{...}`` if it is an integer in 1..n, else None.

    Accepts ``\boxed{2}``, ``\boxed{\text{2}}``, ``\boxed{Solution 2}``, ``\boxed{#2}``.
    """
    boxed = extract_boxed(text)
    if boxed is None:
        return None
    m = re.fullmatch(r"(?:(?:solution|response|candidate)\s*)?#?\s*(\d+)\s*\.?", _strip_latex_text(boxed),
                     flags=re.IGNORECASE)
    if m is None:
        return None
    index = int(m.group(1))
    return index if 1 <= index <= n else None


_SUBTASK_LINE = re.compile(r"^[\s>*_#-]*SUBTASK\s*(\d+)\s*[*_]*\s*[:.)\-]\s*[*_]*\s*(.*?)\s*$", re.IGNORECASE)


def parse_subtasks(text: object, max_subtasks: int = 3) -> list[str]:
    """Subtasks from lines ``SUBTASK k: description`` (k = 1..max_subtasks), in the order of k.

    Case-insensitive; markdown bullets/bold around the label are tolerated. The description is the
    rest of that line. Lines with k outside 1..max_subtasks, empty descriptions and repeated k
    (after the first) are ignored. Never raises; garbage gives ``[]``.
    """
    if not isinstance(text, str):
        return []
    found: dict[int, str] = {}
    for line in text[-200_000:].splitlines():
        m = _SUBTASK_LINE.match(line)
        if m is None:
            continue
        k, desc = int(m.group(1)), m.group(2).strip()
        if 1 <= k <= max_subtasks and desc and k not in found:
            found[k] = desc
    return [found[k] for k in sorted(found)]


def normalize_answer(answer: str | None) -> str | None:
    r"""A light normal form for voting: no spaces, no ``\text{}``/``\left``/``\right``/``$``, lowercase."""
    if answer is None:
        return None
    s = _strip_latex_text(answer)
    s = re.sub(r"\\left|\\right|\$|\s+", "", s).rstrip(".").lower()
    return s or None


def majority_vote(answers: list[str | None]) -> int | None:
    """Index of the first answer of the most common (normalized) non-None answer; ties -> earliest."""
    normal = [normalize_answer(a) for a in answers]
    counts = Counter(a for a in normal if a is not None)
    if not counts:
        return None
    top = max(counts.values())
    for i, a in enumerate(normal):
        if a is not None and counts[a] == top:
            return i
    return None  # pragma: no cover


def _require_box(turn: Turn) -> str | None:
    """Mark ``turn`` invalid when it has no ``\\boxed{}``; return the boxed content."""
    answer = extract_boxed(turn.text)
    turn.valid = answer is not None
    turn.info["answer"] = answer
    return answer


def _require_answer(team: Team, turn: Turn) -> str | None:
    """``answer_format: boxed`` (math) needs ``\\boxed{}``; ``code`` needs a fenced code block."""
    fmt = _choice_param(team, "answer_format", ("boxed", "code"))
    if fmt == "boxed":
        return _require_box(turn)
    from masrl.tasks.code.extract import extract_code

    has_block = isinstance(turn.text, str) and "```" in turn.text
    turn.valid = has_block
    turn.info["answer"] = extract_code(turn.text) if has_block else None
    return turn.info["answer"]


def _check_params(team: Team) -> None:
    """Unknown parameter names are an error (a typo must not silently fall back to a default)."""
    unknown = sorted(set(team.params) - set(team.spec.params))
    if unknown:
        raise ConfigError(f"workflow {team.spec.name!r}: unknown param(s) {unknown}; "
                          f"known: {sorted(team.spec.params)}")


def _positive_int(team: Team, key: str, low: int = 1, high: int | None = None) -> int:
    value = team.params.get(key)
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"workflow {team.spec.name!r}: param {key!r} must be an integer, got {value!r}") from None
    if n < low or (high is not None and n > high):
        bound = f"{low}..{high}" if high is not None else f">= {low}"
        raise ConfigError(f"workflow {team.spec.name!r}: param {key!r} must be {bound}, got {n}")
    return n


def _choice_param(team: Team, key: str, choices: tuple[str, ...]) -> str:
    value = str(team.params.get(key)).lower()
    if value not in choices:
        raise ConfigError(f"workflow {team.spec.name!r}: param {key!r} must be one of {list(choices)}, "
                          f"got {team.params.get(key)!r}")
    return value


def _judge(team: Team, text: str | None) -> bool | None:
    """Ground-truth correctness of an intermediate answer (for verdict accuracy), if the team can score."""
    score = getattr(team, "score", None)
    if score is None:
        return None
    result = score(text)
    return bool(result["correct"]) if "correct" in result else float(result["reward"]) >= 1.0


async def _parallel(team: Team, agent: str, prompts: list[str]) -> list[Turn]:
    """Call ``agent`` once per prompt concurrently; turn i gets ``info["slot"] = i``."""
    turns = await asyncio.gather(*(team.call(agent, p) for p in prompts))
    for slot, turn in enumerate(turns):
        turn.info["slot"] = slot
    return list(turns)


def _numbered(team: Team, template: str, texts: list[str], **extra: Any) -> str:
    return "".join(team.render(template, index=i + 1, **{k: v[i] for k, v in extra.items()}, text=t)
                   for i, t in enumerate(texts))


# --------------------------------------------------------------------------- workflows


@register_workflow("eval_opt", agents=("Generator", "Evaluator"), prompts=EVAL_OPT_PROMPTS,
                   params={"max_iterations": 3, "invalid_verdict": "incorrect", "evaluate_final": True,
                           "judge_verdicts": True, "answer_format": "boxed"})
async def eval_opt(task: Task, team: Team) -> Episode:
    """Eval-Opt: Generator solves, Evaluator says Correct/Incorrect; on Incorrect the Generator revises.

    One iteration = one Generator turn followed by one Evaluator turn; at most ``max_iterations``
    (math 3, code 2). Stops at the first Correct verdict. ``evaluate_final: false`` skips the
    Evaluator after the last allowed Generator turn (its verdict cannot change the answer).
    A Generator turn without ``\\boxed{}`` is invalid; an Evaluator turn without
    ``\\boxed{Correct|Incorrect}`` is invalid and counts as ``invalid_verdict`` (default incorrect).
    Final answer: the last Generator text.
    """
    _check_params(team)
    max_iterations = _positive_int(team, "max_iterations")
    invalid_verdict = _choice_param(team, "invalid_verdict", ("incorrect", "correct"))
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
        answers.append(_require_answer(team, generator))
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
            evaluator.info["judged_correct"] = _judge(team, solution)
        feedback = evaluator.text
        history += f"Review {iteration + 1}:\n{feedback}\n\n"
        if effective == "correct":
            stopped_by = "approved"
            break
    return team.finish(solution, iterations=len(answers), verdicts=verdicts,
                       approved=stopped_by == "approved", stopped_by=stopped_by, generator_answers=answers)


@register_workflow("voting", agents=("Generator", "Aggregator"), prompts=VOTING_PROMPTS,
                   params={"n_generators": 3, "fallback": "majority", "score_candidates": False})
async def voting(task: Task, team: Team) -> Episode:
    """Voting: ``n_generators`` answer in parallel; the Aggregator picks one with ``\\boxed{i}`` (1-based).

    Generator turns without ``\\boxed{}`` are invalid. An unparsable or out-of-range choice makes the
    Aggregator turn invalid and applies ``fallback``: ``majority`` (most common boxed answer among
    the generators, earliest on ties), ``first`` (generator 1) or ``none`` (no answer).
    Final answer: the chosen generator's text.
    """
    _check_params(team)
    n = _positive_int(team, "n_generators")
    fallback = _choice_param(team, "fallback", ("majority", "first", "none"))
    prompt = team.render("Generator", question=task.question)
    generators = await _parallel(team, "Generator", [prompt] * n)
    answers = [_require_box(t) for t in generators]
    texts = [t.text for t in generators]

    aggregator = await team.call("Aggregator", team.render(
        "Aggregator", n=n, solutions=_numbered(team, "solution", texts), question=task.question))
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
        info["candidate_correct"] = [_judge(team, t) for t in texts]
    agree = sum(normalize_answer(a) == normalize_answer(answers[majority]) for a in answers) if majority is not None else 0
    return team.finish(final, choice=choice, chosen_slot=chosen, fallback_used=fallback_used,
                       generator_answers=answers, majority_slot=majority,
                       majority_answer=answers[majority] if majority is not None else None,
                       agreement=agree / n, **info)


@register_workflow("orch_workers", agents=("Orchestrator", "Worker", "Synthesizer"), prompts=ORCH_PROMPTS,
                   params={"max_subtasks": 3, "workers_see_problem": False})
async def orch_workers(task: Task, team: Team) -> Episode:
    """Orch-Workers: Orchestrator writes ``SUBTASK k: ...`` lines, Workers solve them in parallel,
    the Synthesizer combines their results into the final ``\\boxed{}``.

    No parsable subtask -> invalid Orchestrator turn, and one Worker gets the whole problem.
    Workers see only their subtask unless ``workers_see_problem: true``. Worker and Synthesizer
    turns without ``\\boxed{}`` are invalid. Final answer: the Synthesizer text.
    """
    _check_params(team)
    max_subtasks = _positive_int(team, "max_subtasks")
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
    workers = await _parallel(team, "Worker", [team.render(template, subtask=s, question=task.question)
                                               for s in subtasks])
    worker_answers = [_require_box(t) for t in workers]
    results = _numbered(team, "result", [t.text for t in workers], subtask=subtasks)
    synthesizer = await team.call("Synthesizer", team.render("Synthesizer", results=results,
                                                             question=task.question))
    synthesizer.info["slot"] = 0
    _require_box(synthesizer)
    return team.finish(synthesizer.text, subtasks=subtasks, n_subtasks=len(subtasks),
                       subtask_fallback=fallback_used, worker_answers=worker_answers)


@register_workflow("proposers_summarizer", agents=("Proposer", "Summarizer"), prompts=MOA_PROMPTS,
                   params={"n_proposers": 3, "score_candidates": False})
async def proposers_summarizer(task: Task, team: Team) -> Episode:
    """MoA: ``n_proposers`` answer in parallel; the Summarizer synthesizes the final ``\\boxed{}``.

    Proposer and Summarizer turns without ``\\boxed{}`` are invalid (every proposal is still shown
    to the Summarizer). ``episode.info["proposals"]`` holds each proposer's boxed answer (None if
    none) in slot order, for ensemble analysis. Final answer: the Summarizer text.
    """
    _check_params(team)
    n = _positive_int(team, "n_proposers")
    proposers = await _parallel(team, "Proposer", [team.render("Proposer", question=task.question)] * n)
    proposals = [_require_box(t) for t in proposers]
    summarizer = await team.call("Summarizer", team.render(
        "Summarizer", n=n, proposals=_numbered(team, "proposal", [t.text for t in proposers]),
        question=task.question))
    summarizer.info["slot"] = 0
    summary = _require_box(summarizer)
    info: dict[str, Any] = {}
    if team.params.get("score_candidates"):
        info["candidate_correct"] = [_judge(team, t.text) for t in proposers]
    majority = majority_vote(proposals)
    return team.finish(summarizer.text, proposals=proposals, summary_answer=summary,
                       majority_answer=proposals[majority] if majority is not None else None, **info)


@register_workflow("single", agents=("Solver",), prompts=SINGLE_PROMPTS, params={"answer_format": "boxed"})
async def single(task: Task, team: Team) -> Episode:
    """Single-agent baseline: one Solver turn, same prompt as the math solver-verifier's Solver.

    A turn without ``\\boxed{}`` (or, with ``answer_format: code``, without a fenced code block)
    is invalid. Final answer: the Solver text.
    """
    _check_params(team)
    solver = await team.call("Solver", team.render("Solver", context="", question=task.question))
    solver.info["slot"] = 0
    _require_answer(team, solver)
    return team.finish(solver.text)
