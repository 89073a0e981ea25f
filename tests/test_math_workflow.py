"""math_solver_verifier routing with scripted agent replies."""
from masrl.types import Task
from masrl.workflows.testing import run_scripted

TASK = Task("t", "2+3", "5")


def score(task, answer):
    from masrl.tasks.math_reward import math_score

    return math_score(task, answer)


def test_approve_stops_after_one_loop():
    ep = run_scripted("math_solver_verifier", TASK, {"Solver": ["2+3=5 \\boxed{5}"],
                                                     "Verifier": ["<verify>approve</verify>"]}, score=score)
    assert [t.agent for t in ep.turns] == ["Solver", "Verifier"]
    assert ep.reward == 1.0 and all(t.valid for t in ep.turns)
    assert ep.turns[1].info["judged_correct"] is True


def test_reject_gives_solver_a_second_turn_with_context():
    ep = run_scripted("math_solver_verifier", TASK,
                      {"Solver": ["\\boxed{6}", "\\boxed{5}"], "Verifier": ["<verify>reject</verify>"]}, score=score)
    assert [t.agent for t in ep.turns] == ["Solver", "Verifier", "Solver"]
    assert "\\boxed{6}" in ep.turns[2].prompt_text and "reject" in ep.turns[2].prompt_text
    assert ep.reward == 1.0 and ep.info["verdicts"] == ["reject"]


def test_untagged_verdict_is_invalid_and_rejects_by_default():
    ep = run_scripted("math_solver_verifier", TASK,
                      {"Solver": ["\\boxed{5}", "no box"], "Verifier": ["looks fine"]}, score=score)
    assert not ep.turns[1].valid and ep.turns[1].info["verdict"] == "reject"
    assert not ep.turns[2].valid  # final solver turn has no box
    assert ep.reward == 0.0


def test_untagged_verdict_approve_option_and_max_loops():
    ep = run_scripted("math_solver_verifier", TASK, {"Solver": ["\\boxed{5}"], "Verifier": ["??"]},
                      score=score, params={"untagged_verdict": "approve"})
    assert len(ep.turns) == 2 and ep.reward == 1.0
    ep = run_scripted("math_solver_verifier", TASK,
                      {"Solver": ["\\boxed{1}"] * 3, "Verifier": ["<verify>reject</verify>"] * 2},
                      score=score, params={"max_loops": 3})
    assert [t.agent for t in ep.turns] == ["Solver", "Verifier", "Solver", "Verifier", "Solver"]
    assert [t.turn_index for t in ep.turns] == [0, 1, 2, 3, 4]


def test_verifier_reward_verdict_scores_the_verdict_not_the_team():
    right_reject = run_scripted("math_solver_verifier", TASK,
                                {"Solver": ["\\boxed{6}", "\\boxed{6}"], "Verifier": ["<verify>reject</verify>"]},
                                score=score, params={"verifier_reward": "verdict"})
    assert right_reject.reward == 0.0 and right_reject.turns[1].reward == 1.0
    wrong_approve = run_scripted("math_solver_verifier", TASK,
                                 {"Solver": ["\\boxed{6}"], "Verifier": ["<verify>approve</verify>"]},
                                 score=score, params={"verifier_reward": "verdict"})
    assert wrong_approve.turns[1].reward == 0.0
    untagged = run_scripted("math_solver_verifier", TASK, {"Solver": ["\\boxed{5}", "\\boxed{5}"],
                                                           "Verifier": ["??"]},
                            score=score, params={"verifier_reward": "verdict"})
    assert untagged.turns[1].reward == 0.0           # counted as reject (default) of a right answer
    default = run_scripted("math_solver_verifier", TASK, {"Solver": ["\\boxed{6}", "\\boxed{6}"],
                                                          "Verifier": ["<verify>reject</verify>"]}, score=score)
    assert default.turns[1].reward is None           # team reward unless asked
    import pytest

    from masrl.errors import ConfigError
    with pytest.raises(ConfigError, match="verifier_reward"):
        run_scripted("math_solver_verifier", TASK, {"Solver": ["\\boxed{5}"], "Verifier": ["x"]},
                     score=score, params={"verifier_reward": "judge"})
