"""Dr. MAS math team: Solver -> Verifier -> Solver ..., up to ``max_loops`` Solver turns."""
from __future__ import annotations

from masrl.errors import ConfigError
from masrl.types import Episode, Task
from masrl.workflows.base import Team, register_workflow
from masrl.workflows.parsing import extract_boxed, parse_choice

TEAM_INTRO = ("You are a member of an expert multi-agent team tasked with solving the math problem.\n"
              "The team's math problem is: {question}\n")

MATH_PROMPTS = {
    "Solver": TEAM_INTRO + "{context}\nYou are the \"Solver Agent\". Solve the problem step by step, "
              "taking the team's previous outputs into account, and give the final answer within \\boxed{}.",
    "Verifier": TEAM_INTRO + "{context}\nYou are the \"Verifier Agent\". Critically review the most recent "
                "solution. If it is correct, reply <verify>approve</verify>; otherwise reply "
                "<verify>reject</verify> and say briefly why.",
    "context": "\nThe output of \"{agent}\": {text}\n",
    # transcript mode (params.transcript: true): the text that hands the running transcript to the next agent
    "Verifier_cue": "\n\nYou are the \"Verifier Agent\". Critically review the most recent solution above. If it "
                    "is correct, reply <verify>approve</verify>; otherwise reply <verify>reject</verify> and say "
                    "briefly why.\n",
    "Solver_cue": "\n\nYou are the \"Solver Agent\". Taking the team's previous outputs into account, solve the "
                  "problem again step by step, and give the final answer within \\boxed{}.\n",
}


@register_workflow("math_solver_verifier", agents=("Solver", "Verifier"), prompts=MATH_PROMPTS,
                   params={"max_loops": 2, "untagged_verdict": "reject", "verifier_reward": "team",
                           "transcript": False})
async def math_solver_verifier(task: Task, team: Team) -> Episode:
    """Solver answers; Verifier approves (stop) or rejects (Solver retries), up to max_loops Solver turns.

    A Solver turn without ``\\boxed{}`` is invalid. A Verifier turn without
    ``<verify>approve|reject</verify>`` is invalid and counts as ``untagged_verdict``
    (default reject; the Dr. MAS reference silently approves).
    ``verifier_reward: verdict`` gives each Verifier turn its own reward, 1 when its verdict is right
    (approve a correct solution, reject a wrong one) else 0; it takes effect with
    ``algorithm.reward: per_turn`` (default ``team``: every turn scores the team reward, as in Dr. MAS).
    ``verifier_reward: balanced``: the same verdict reward, and each Verifier turn is labelled by the class of the
    answer it judged (``info["reward_class"]``: ``right_answer`` / ``wrong_answer``), so the trainer weights the
    two classes equally within a step (``masrl.trainer.Trainer.score_turns``): a Verifier that approves
    everything scores 0.5 however many answers are right, instead of the share of right answers.
    ``transcript: true``: the episode is one running transcript. The first Solver prompt is rendered as
    usual (empty ``context``); every later turn continues the previous turn's token ids
    (``team.extend``) with the next agent's cue, ``Verifier_cue`` / ``Solver_cue`` (fields: ``question``),
    so the rollout engine reuses the keys/values of everything before. Needs a plain-text prompt format
    (see ``masrl.workflows.base.Continuation``).
    """
    max_loops = team.params["max_loops"]
    if type(max_loops) is not int or max_loops < 1:
        raise ConfigError(f"math_solver_verifier: workflow.params.max_loops must be an integer >= 1, got {max_loops!r}")
    untagged = team.params["untagged_verdict"]
    if untagged not in ("approve", "reject"):
        raise ConfigError(f"math_solver_verifier: untagged_verdict must be approve or reject, got {untagged!r}")
    verifier_reward = team.params["verifier_reward"]
    if verifier_reward not in ("team", "verdict", "balanced"):
        raise ConfigError(f"math_solver_verifier: workflow.params.verifier_reward must be team, verdict or balanced, "
                          f"got {verifier_reward!r}")
    transcript = team.params["transcript"]
    if type(transcript) is not bool:
        raise ConfigError(f"math_solver_verifier: workflow.params.transcript must be true or false, got {transcript!r}")

    def prompt(agent: str, last):
        if transcript and last is not None:  # continue the previous turn's ids with this agent's cue
            return team.extend(last, team.render(f"{agent}_cue", question=task.question))
        return team.render(agent, question=task.question, context=context)

    context, answer, verdicts, verifier = "", None, [], None
    for loop in range(max_loops):
        solver = await team.call("Solver", prompt("Solver", verifier))
        solver.valid = extract_boxed(solver.text) is not None
        answer = solver.text
        context += team.render("context", agent="Solver", text=solver.text)
        if loop == max_loops - 1:
            break
        verifier = await team.call("Verifier", prompt("Verifier", solver))
        verdict = parse_choice(verifier.text, "verify", ("approve", "reject"))
        verifier.valid = verdict is not None
        verdict = verdict or untagged
        verifier.info["verdict"] = verdict
        verifier.info["judged_correct"] = team.score(solver.text)["correct"]
        if verifier_reward in ("verdict", "balanced"):
            verifier.reward = float((verdict == "approve") == bool(verifier.info["judged_correct"]))
        if verifier_reward == "balanced":
            verifier.info["reward_class"] = "right_answer" if verifier.info["judged_correct"] else "wrong_answer"
        verdicts.append(verdict)
        context += team.render("context", agent="Verifier", text=verifier.text)
        if verdict == "approve":
            break
    return team.finish(answer, loops=sum(t.agent == "Solver" for t in team.turns), verdicts=verdicts)
