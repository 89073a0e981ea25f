"""The synthetic code domain (masrl.tasks.code.synthetic): tasks and hidden tests, the teacher, the
sandboxed reward on good and bad programs, and the study workflows with ``answer_format: code``."""
import pytest

from masrl.errors import ConfigError
from masrl.tasks.code.synthetic import (TEMPLATES, CodeSynthConfig, CodeSynthTeacher, code_synth_score,
                                        make_code_synth_tasks, reference)
from masrl.workflows.testing import run_scripted

SCORE = code_synth_score("fraction", timeout_s=1.0)  # what task code_synth scores with


def _pair(task):
    return task.meta["template"], task.meta["k"]


def test_tasks_are_deterministic_and_held_out_pairs_are_disjoint():
    cfg = CodeSynthConfig(train_size=300, seed=3)
    train, test = make_code_synth_tasks(cfg)
    train2, test2 = make_code_synth_tasks(CodeSynthConfig(train_size=300, seed=3))
    assert [(t.id, t.answer["tests"]) for t in train] == [(t.id, t.answer["tests"]) for t in train2]
    assert [(t.id, t.answer["tests"]) for t in test] == [(t.id, t.answer["tests"]) for t in test2]
    assert len(train) == 300 and len({_pair(t) for t in test}) == len(test)
    assert not {_pair(t) for t in train} & {_pair(t) for t in test}
    # every template without a constant is one pair (K=0), the others one per K in 0..max_k
    n_pairs = sum(1 if "{K}" not in spec else cfg.max_k + 1 for spec, _ in TEMPLATES.values())
    assert len({_pair(t) for t in train} | {_pair(t) for t in test}) <= n_pairs
    assert len(test) == round(cfg.test_fraction * n_pairs)
    other = make_code_synth_tasks(CodeSynthConfig(train_size=300, seed=4))[1]
    assert {_pair(t) for t in other} != {_pair(t) for t in test}


def test_hidden_tests_follow_the_reference_program():
    task = next(t for t in make_code_synth_tasks(CodeSynthConfig(train_size=50))[0] if t.meta["template"] == "count_gt")
    k = task.meta["k"]
    assert task.question == f"count of x in xs with x>{k}"
    assert task.meta["reference_solution"] == reference("count_gt", k)
    for line in task.answer["tests"]:
        xs, expected = line[len("assert f("):].split(") == ")
        assert eval(expected) == sum(1 for x in eval(xs) if x > k)  # noqa: S307 - our own generated test line


def test_reference_passes_its_hidden_tests_in_the_sandbox():
    train, test = make_code_synth_tasks(CodeSynthConfig(train_size=20, seed=1))
    teacher = CodeSynthTeacher(slip_rate=0.0)
    for task in test[:6]:
        result = SCORE(task, teacher.solution(task))
        assert result["reward"] == 1.0 and result["correct"] and result["reason"] == "ok", (task.id, result)


def test_teacher_slips_are_wrong_programs():
    _, test = make_code_synth_tasks(CodeSynthConfig(train_size=20, seed=1, n_tests=10))
    teacher = CodeSynthTeacher(slip_rate=1.0, seed=0)
    rewards = [SCORE(t, teacher.solution(t))["reward"] for t in test[:8]]
    assert all(r < 1.0 for r in rewards[:8] if r is not None) and sum(rewards) < 0.8 * len(rewards), rewards


def test_teacher_roles():
    task = make_code_synth_tasks(CodeSynthConfig(train_size=5))[1][0]
    teacher = CodeSynthTeacher()
    good, bad = teacher.solution(task), CodeSynthTeacher(slip_rate=1.0).solution(task)
    assert teacher.reply("Orchestrator", "", task) == f"SUBTASK 1: {task.question}"
    assert teacher.reply("Evaluator", f"Program:\n{good}\nVerdict:", task) == "\\boxed{Correct}"
    assert teacher.reply("Evaluator", f"Program:\n{bad}\nVerdict:", task) == "\\boxed{Incorrect}"
    assert teacher.reply("Aggregator", f"1\n{bad}\n2\n{good}\n", task) == "\\boxed{2}"
    assert teacher.reply("Synthesizer", f"{bad}\n{good}\n", task) == good


@pytest.mark.parametrize("answer, reason", [
    ("", "no_code"),
    ("I think the answer is sum(xs).", "syntax_error"),  # unfenced text is read as the program
    ("```\ndef f(xs):\n return sum(xs\n```", "syntax_error"),
    ("```\ndef f(xs):\n while True: pass\n```", "timeout"),
    ("```\ndef f(xs):\n print('x' * 10**8)\n return 0\n```", None),
    ("```\ndef f(xs):\n return 'x' * 10**9\n```", None),
])
def test_bad_programs_score_zero_with_a_reason(answer, reason):
    task = make_code_synth_tasks(CodeSynthConfig(train_size=5, seed=2))[1][0]
    result = SCORE(task, answer)
    assert result["reward"] == 0.0 and not result["correct"], result
    assert result["reason"] != "ok" and (reason is None or reason in (result["reason"], result["detail"])), result
    assert result["duration_s"] < 10, result  # a looping program is bounded by 3 x timeout_s, not 5 s per test


def test_bad_params_are_one_config_error():
    with pytest.raises(ConfigError, match="unknown \\['nope'\\]"):
        CodeSynthConfig(templates=("sum", "nope"))
    with pytest.raises(ConfigError, match="max_k"):
        CodeSynthConfig(max_k=0)
    with pytest.raises(ConfigError, match="test_fraction"):
        CodeSynthConfig(test_fraction=1.0)


def _replies(good, bad):
    def reply(agent, prompt):
        return {"Generator": bad if "first" not in prompt else good, "Aggregator": "\\boxed{2}",
                "Orchestrator": "SUBTASK 1: write it", "Worker": good, "Synthesizer": good}[agent]
    return reply


def test_voting_on_code_scores_the_chosen_program():
    task = make_code_synth_tasks(CodeSynthConfig(train_size=5))[1][0]
    teacher = CodeSynthTeacher()
    good, bad = teacher.solution(task), CodeSynthTeacher(slip_rate=1.0).solution(task)
    replies = {"Generator": [bad, good, "no code here"], "Aggregator": ["\\boxed{2}"]}
    ep = run_scripted("voting", task, replies, score=SCORE, params={"answer_format": "code"})
    assert ep.reward == 1.0
    assert [t.valid for t in ep.turns if t.agent == "Generator"] == [True, True, False]
    replies = {"Generator": [bad, good, good], "Aggregator": ["\\boxed{1}"]}
    assert run_scripted("voting", task, replies, score=SCORE, params={"answer_format": "code"}).reward < 1.0
    # the boxed format (math) refuses the same code replies
    ep = run_scripted("voting", task, {"Generator": [good] * 3, "Aggregator": ["\\boxed{1}"]}, score=SCORE)
    assert not any(t.valid for t in ep.turns if t.agent == "Generator")


def test_orch_workers_and_eval_opt_on_code():
    task = make_code_synth_tasks(CodeSynthConfig(train_size=5))[1][0]
    good = CodeSynthTeacher().solution(task)
    ep = run_scripted("orch_workers", task, {"Orchestrator": ["SUBTASK 1: write f"], "Worker": [good],
                                             "Synthesizer": [good]}, score=SCORE, params={"answer_format": "code"})
    assert ep.reward == 1.0 and all(t.valid for t in ep.turns)
    ep = run_scripted("orch_workers", task, {"Orchestrator": ["SUBTASK 1: write f"], "Worker": [good],
                                             "Synthesizer": ["just use sum"]}, score=SCORE,
                      params={"answer_format": "code"})
    assert ep.reward == 0.0 and not ep.turns[-1].valid
