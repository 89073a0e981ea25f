"""math_solver_verifier routing with scripted agent replies."""
import pytest

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


def test_verifier_reward_balanced_labels_the_class_of_the_judged_answer():
    right_approve = run_scripted("math_solver_verifier", TASK, {"Solver": ["\\boxed{5}"],
                                                                "Verifier": ["<verify>approve</verify>"]},
                                 score=score, params={"verifier_reward": "balanced"})
    assert right_approve.turns[1].reward == 1.0 and right_approve.turns[1].info["reward_class"] == "right_answer"
    wrong_approve = run_scripted("math_solver_verifier", TASK, {"Solver": ["\\boxed{6}"],
                                                                "Verifier": ["<verify>approve</verify>"]},
                                 score=score, params={"verifier_reward": "balanced"})
    assert wrong_approve.turns[1].reward == 0.0 and wrong_approve.turns[1].info["reward_class"] == "wrong_answer"
    assert "reward_class" not in wrong_approve.turns[0].info and wrong_approve.turns[0].reward is None


def _turn(agent, reward=None, cls=None, valid=True):
    from masrl.types import Turn

    return Turn(agent, "p", [1], [2], [-1.0], "x", valid=valid, reward=reward,
                info={} if cls is None else {"reward_class": cls})


def test_class_weights_by_hand():
    from masrl.trainer import class_weights

    # Verifier: 3 turns judged right answers (rewards 1, 1, 0), 1 judged a wrong one (reward 1): n = 4, K = 2,
    # w_right = 4 / (2 * 3) = 2/3, w_wrong = 4 / (2 * 1) = 2; mean weighted reward (2/3 + 2/3 + 0 + 2) / 4 = 5/6,
    # the mean of the per-class means (2/3 + 1) / 2
    v = [_turn("Verifier", 1.0, "right_answer"), _turn("Verifier", 1.0, "right_answer"),
         _turn("Verifier", 0.0, "right_answer"), _turn("Verifier", 1.0, "wrong_answer")]
    solver = _turn("Solver")                       # no own reward: not weighted
    other = [_turn("Judge", 1.0, "a"), _turn("Judge", 0.0, "a")]   # one class only: weight 1
    w = class_weights([solver, *v, *other])
    assert [w[id(t)] for t in v] == pytest.approx([2 / 3, 2 / 3, 2 / 3, 2.0])
    assert id(solver) not in w and [w[id(t)] for t in other] == [1.0, 1.0]
    assert sum(t.reward * w[id(t)] for t in v) / 4 == pytest.approx(5 / 6)


def test_score_turns_balanced_approve_everything_scores_one_half():
    """A Verifier that approves every answer: its step mean reward is the share of right answers under
    ``verdict`` (here 3 of 4) and 0.5 under ``balanced``, whatever that share; Solver turns keep the team reward
    and the format penalty still applies."""
    from types import SimpleNamespace

    from masrl.config import load_config
    from masrl.trainer import Trainer
    from masrl.types import Episode

    cfg = load_config("examples/quickstart.yaml", ["algorithm.reward=per_turn", "algorithm.format_penalty=0.1"])
    episodes = []
    for i, right in enumerate([True, True, True, False]):
        turns = [_turn("Solver", valid=i != 0), _turn("Verifier", 1.0 if right else 0.0,
                                                      "right_answer" if right else "wrong_answer")]
        episodes.append(Episode(TASK, turns, 1.0 if right else 0.0, group_id=0, episode_id=i))
    _, _, scores = Trainer.score_turns(SimpleNamespace(cfg=cfg), episodes)
    verifier = scores[1::2].tolist()
    assert verifier == pytest.approx([2 / 3, 2 / 3, 2 / 3, 0.0]) and sum(verifier) / 4 == pytest.approx(0.5)
    assert scores[0::2].tolist() == pytest.approx([0.9, 1.0, 1.0, 0.0])
