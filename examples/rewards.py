"""A user reward for examples/dataset_jsonl.yaml, given in the config as `examples/rewards.py:solver_verifier`.

masrl calls it with the task and the episode (all its turns) and uses the returned team reward;
with `algorithm.reward: per_turn` the per-turn rewards it sets are used instead for those turns.
"""
from masrl.tasks.math_reward import math_score


def solver_verifier(task, episode):
    """Team reward: the final answer is right (math-verify). Verifier turns: rewarded for a correct verdict
    (approve a right solution, reject a wrong one), whatever the final outcome."""
    result = math_score(task, episode.answer)
    solution = None
    for turn in episode.turns:
        if turn.agent == "Solver":
            solution = turn.text
        elif turn.agent == "Verifier" and solution is not None:
            approved = turn.info.get("verdict") == "approve"
            turn.reward = float(approved == math_score(task, solution)["correct"])
    return result
