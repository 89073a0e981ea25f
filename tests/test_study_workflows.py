"""Routing and parsing of the study workflows (eval_opt, voting, orch_workers, proposers_summarizer, single)."""
from __future__ import annotations

import pytest

from masrl.types import Task
from masrl.workflows.base import get_workflow
from masrl.workflows.parsing import extract_boxed
from masrl.workflows.common import majority_vote, parse_index, parse_subtasks, parse_verdict
from masrl.workflows.testing import run_scripted

TASK = Task(id="t1", question="Compute 2+3 where a_{n} = n.", answer="5")


def boxed_score(task: Task, answer: str | None) -> dict:
    ok = extract_boxed(answer) == str(task.answer)
    return {"reward": float(ok), "correct": ok}


def run(workflow, replies, **params):
    return run_scripted(workflow, TASK, replies, score=boxed_score, params=params or None)


def agents(ep):
    return [t.agent for t in ep.turns]


def valid(ep, agent):
    return [t.valid for t in ep.turns if t.agent == agent]


def test_study_workflows_are_registered():
    for name, roles in [("eval_opt", ("Generator", "Evaluator")), ("voting", ("Generator", "Aggregator")),
                        ("orch_workers", ("Orchestrator", "Worker", "Synthesizer")),
                        ("proposers_summarizer", ("Proposer", "Summarizer")), ("single", ("Solver",))]:
        spec = get_workflow(name)
        assert spec.agents == roles
        for role in roles:
            assert role in spec.prompts


# ---------------------------------------------------------------- parsers


@pytest.mark.parametrize("text,expected", [
    ("Looks right. \\boxed{Correct}", "correct"),
    ("\\boxed{Incorrect} the sum is wrong", "incorrect"),
    ("\\boxed{\\text{ correct }}.", "correct"),
    ("\\boxed{INCORRECT.}", "incorrect"),
    ("\\boxed{5}", None),
    ("Correct", None),
    ("\\boxed{Correct", None),
    (None, None),
])
def test_parse_verdict(text, expected):
    assert parse_verdict(text) == expected


@pytest.mark.parametrize("text,n,expected", [
    ("\\boxed{2}", 3, 2), ("best is \\boxed{ 3 }", 3, 3), ("\\boxed{\\text{1}}", 3, 1),
    ("\\boxed{Solution 2}", 3, 2), ("\\boxed{#1}", 3, 1),
    ("\\boxed{4}", 3, None), ("\\boxed{0}", 3, None), ("\\boxed{two}", 3, None), ("2", 3, None),
    ("\\boxed{1.5}", 3, None), ("", 3, None),
])
def test_parse_index(text, n, expected):
    assert parse_index(text, n) == expected


def test_parse_subtasks():
    text = ("Plan:\nSUBTASK 1: add 2 and 3\n**SUBTASK 2:** check the sum\n- subtask 3) report\n"
            "SUBTASK 4: too many\nSUBTASK 2: duplicate\nSUBTASK 1:\n")
    assert parse_subtasks(text) == ["add 2 and 3", "check the sum", "report"]
    assert parse_subtasks("SUBTASK 2: b\nSUBTASK 1: a") == ["a", "b"]
    assert parse_subtasks("SUBTASK 3: c", max_subtasks=2) == []
    assert parse_subtasks("no plan here") == []
    assert parse_subtasks(None) == []


def test_majority_vote_ties_and_normalization():
    assert majority_vote(["5", "\\text{6}", "6 "]) == 1
    assert majority_vote(["5", "6"]) == 0  # tie -> earliest
    assert majority_vote([None, "7", None]) == 1
    assert majority_vote([None, None]) is None


# ---------------------------------------------------------------- eval_opt


def test_eval_opt_correct_first_try():
    ep = run("eval_opt", {"Generator": ["2+3 = \\boxed{5}"], "Evaluator": ["\\boxed{Correct} fine"]})
    assert agents(ep) == ["Generator", "Evaluator"]
    assert ep.reward == 1.0 and ep.answer == "2+3 = \\boxed{5}"
    assert ep.info["iterations"] == 1 and ep.info["approved"] and ep.info["verdicts"] == ["correct"]
    ev = ep.turns[1]
    assert ev.valid and ev.info["verdict"] == "correct" and ev.info["judged_correct"] is True
    assert "2+3 = \\boxed{5}" in ev.prompt_text and TASK.question in ev.prompt_text


def test_eval_opt_revises_with_feedback_and_final_is_last_generator():
    ep = run("eval_opt", {"Generator": ["\\boxed{6}", "\\boxed{5}"],
                          "Evaluator": ["\\boxed{Incorrect} the addition is off", "\\boxed{Correct}"]})
    assert agents(ep) == ["Generator", "Evaluator", "Generator", "Evaluator"]
    assert ep.answer == "\\boxed{5}" and ep.reward == 1.0
    revise_prompt = ep.turns[2].prompt_text
    assert "the addition is off" in revise_prompt and "\\boxed{6}" in revise_prompt
    assert [t.info["iteration"] for t in ep.turns] == [1, 1, 2, 2]
    assert [t.info["judged_correct"] for t in ep.turns if t.agent == "Evaluator"] == [False, True]


def test_eval_opt_stops_at_max_iterations():
    ep = run("eval_opt", {"Generator": ["\\boxed{1}", "\\boxed{2}", "\\boxed{3}"],
                          "Evaluator": ["\\boxed{Incorrect}"] * 3})
    assert agents(ep) == ["Generator", "Evaluator"] * 3
    assert ep.answer == "\\boxed{3}" and ep.info["iterations"] == 3
    assert ep.info["stopped_by"] == "max_iterations" and not ep.info["approved"]

    ep = run("eval_opt", {"Generator": ["\\boxed{1}", "\\boxed{2}"], "Evaluator": ["\\boxed{Incorrect}"]},
             max_iterations=2, evaluate_final=False)
    assert agents(ep) == ["Generator", "Evaluator", "Generator"]
    assert ep.answer == "\\boxed{2}"


def test_eval_opt_invalid_verdict_counts_as_incorrect_by_default():
    ep = run("eval_opt", {"Generator": ["\\boxed{5}", "\\boxed{5}"],
                          "Evaluator": ["looks good to me", "\\boxed{Correct}"]})
    assert valid(ep, "Evaluator") == [False, True]
    assert ep.info["verdicts"] == [None, "correct"] and ep.info["iterations"] == 2
    assert ep.turns[1].info["verdict"] == "incorrect"


def test_eval_opt_invalid_verdict_configurable_as_correct():
    ep = run("eval_opt", {"Generator": ["\\boxed{5}"], "Evaluator": ["looks good"]}, invalid_verdict="correct")
    assert agents(ep) == ["Generator", "Evaluator"] and valid(ep, "Evaluator") == [False]
    assert ep.info["approved"]


def test_eval_opt_generator_without_box_is_invalid():
    ep = run("eval_opt", {"Generator": ["the answer is five", "\\boxed{5}"],
                          "Evaluator": ["\\boxed{Incorrect} no box", "\\boxed{Correct}"]})
    assert valid(ep, "Generator") == [False, True]
    assert ep.info["generator_answers"] == [None, "5"]


def test_eval_opt_bad_params_are_clear():
    with pytest.raises(ValueError, match="max_iterations"):
        run("eval_opt", {"Generator": ["\\boxed{5}"]}, max_iterations=0)
    with pytest.raises(ValueError, match="invalid_verdict"):
        run("eval_opt", {"Generator": ["\\boxed{5}"]}, invalid_verdict="maybe")
    with pytest.raises(ValueError, match="max_iteration"):  # typo of max_iterations
        run("eval_opt", {"Generator": ["\\boxed{5}"]}, max_iteration=2)
    with pytest.raises(ValueError, match="unknown param"):
        run("single", {"Solver": ["\\boxed{5}"]}, n_generators=2)


# ---------------------------------------------------------------- voting


def test_voting_aggregator_choice():
    ep = run("voting", {"Generator": ["\\boxed{6}", "\\boxed{5}", "\\boxed{6}"], "Aggregator": ["#2 \\boxed{2}"]})
    assert agents(ep) == ["Generator"] * 3 + ["Aggregator"]
    assert [t.info["slot"] for t in ep.turns] == [0, 1, 2, 0]
    assert ep.answer == "\\boxed{5}" and ep.reward == 1.0
    assert ep.info["choice"] == 2 and ep.info["fallback_used"] is None
    assert ep.info["majority_answer"] == "6" and ep.info["agreement"] == pytest.approx(2 / 3)
    agg_prompt = ep.turns[-1].prompt_text
    assert "Solution 1:\n\\boxed{6}" in agg_prompt and "Solution 3:" in agg_prompt
    # the question's a_{n} must survive although the template has an {n} field
    assert "a_{n}" in agg_prompt and "(1 to 3)" in agg_prompt


@pytest.mark.parametrize("fallback,answer", [("majority", "\\boxed{5}"), ("first", "\\boxed{6}"), ("none", None)])
@pytest.mark.parametrize("bad_reply", ["\\boxed{4}", "I pick the second", "\\boxed{zero}"])
def test_voting_invalid_choice_fallbacks(fallback, answer, bad_reply):
    ep = run("voting", {"Generator": ["\\boxed{6}", "\\boxed{5}", "5 \\boxed{ 5 }"], "Aggregator": [bad_reply]},
             fallback=fallback)
    assert valid(ep, "Aggregator") == [False]
    assert ep.info["choice"] is None and ep.info["fallback_used"] == fallback
    assert ep.answer == answer


def test_voting_majority_ignores_boxless_generators_and_marks_them_invalid():
    ep = run("voting", {"Generator": ["no idea", "\\boxed{5}", "still no idea"], "Aggregator": ["?"]})
    assert valid(ep, "Generator") == [False, True, False]
    assert ep.answer == "\\boxed{5}" and ep.info["chosen_slot"] == 1

    ep = run("voting", {"Generator": ["a", "b", "c"], "Aggregator": ["?"]})
    assert ep.answer is None and ep.reward == 0.0


def test_voting_n_generators_and_scoring_candidates():
    ep = run("voting", {"Generator": ["\\boxed{5}", "\\boxed{7}"], "Aggregator": ["\\boxed{3}"]},
             n_generators=2, score_candidates=True)
    assert agents(ep).count("Generator") == 2 and valid(ep, "Aggregator") == [False]  # 3 > n
    assert ep.info["candidate_correct"] == [True, False]


def test_voting_parallel_calls_record_slot_not_completion_order():
    # replies that depend on which call is made: completion order is the gather order here,
    # but slots must be assigned by position in the gather, whatever turn_index says
    calls = []

    def reply(agent, prompt):
        calls.append(agent)
        return "\\boxed{1}" if agent == "Aggregator" else f"\\boxed{{{len(calls)}}}"

    ep = run_scripted("voting", TASK, reply, score=boxed_score)
    gens = [t for t in ep.turns if t.agent == "Generator"]
    assert sorted(t.info["slot"] for t in gens) == [0, 1, 2]
    assert ep.info["chosen_slot"] == 0


# ---------------------------------------------------------------- orch_workers


def test_orch_workers_happy_path():
    ep = run("orch_workers", {
        "Orchestrator": ["SUBTASK 1: compute 2+3\nSUBTASK 2: double-check the sum"],
        "Worker": ["\\boxed{5}", "\\boxed{ok}"],
        "Synthesizer": ["combining: \\boxed{5}"]})
    assert agents(ep) == ["Orchestrator", "Worker", "Worker", "Synthesizer"]
    assert all(t.valid for t in ep.turns)
    workers = [t for t in ep.turns if t.agent == "Worker"]
    assert [t.info["slot"] for t in workers] == [0, 1]
    assert "compute 2+3" in workers[0].prompt_text and TASK.question not in workers[0].prompt_text
    synth = ep.turns[-1].prompt_text
    assert "Subtask 1: compute 2+3" in synth and "\\boxed{ok}" in synth and TASK.question in synth
    assert ep.answer == "combining: \\boxed{5}" and ep.reward == 1.0
    assert ep.info["n_subtasks"] == 2 and not ep.info["subtask_fallback"]


def test_orch_workers_workers_see_problem():
    ep = run("orch_workers", {"Orchestrator": ["SUBTASK 1: compute"], "Worker": ["\\boxed{5}"],
                              "Synthesizer": ["\\boxed{5}"]}, workers_see_problem=True)
    worker = ep.turns[1]
    assert TASK.question in worker.prompt_text and "compute" in worker.prompt_text


def test_orch_workers_no_subtask_falls_back_to_whole_problem():
    ep = run("orch_workers", {"Orchestrator": ["Let me just think about it."], "Worker": ["\\boxed{5}"],
                              "Synthesizer": ["\\boxed{5}"]})
    assert agents(ep) == ["Orchestrator", "Worker", "Synthesizer"]
    assert valid(ep, "Orchestrator") == [False]
    assert TASK.question in ep.turns[1].prompt_text
    assert ep.info["subtask_fallback"] and ep.reward == 1.0


def test_orch_workers_caps_subtasks_and_invalid_worker_and_synth():
    ep = run("orch_workers", {
        "Orchestrator": ["\n".join(f"SUBTASK {k}: part {k}" for k in range(1, 6))],
        "Worker": ["\\boxed{1}", "no box", "\\boxed{3}"],
        "Synthesizer": ["the answer is 5"]})
    assert agents(ep).count("Worker") == 3
    assert valid(ep, "Worker") == [True, False, True]
    assert valid(ep, "Synthesizer") == [False] and ep.reward == 0.0
    assert ep.info["worker_answers"] == ["1", None, "3"]


# ---------------------------------------------------------------- proposers_summarizer


def test_proposers_summarizer_records_proposals():
    ep = run("proposers_summarizer", {"Proposer": ["\\boxed{5}", "no box", "\\boxed{6}"],
                                      "Summarizer": ["after review \\boxed{5}"]})
    assert agents(ep) == ["Proposer"] * 3 + ["Summarizer"]
    assert ep.info["proposals"] == ["5", None, "6"]
    assert valid(ep, "Proposer") == [True, False, True]
    assert ep.answer == "after review \\boxed{5}" and ep.reward == 1.0
    prompt = ep.turns[-1].prompt_text
    assert "Response 2:\nno box" in prompt and "Response 3:" in prompt


def test_proposers_summarizer_n_and_invalid_summary():
    ep = run("proposers_summarizer", {"Proposer": ["\\boxed{5}"] * 5, "Summarizer": ["five"]},
             n_proposers=5, score_candidates=True)
    assert len(ep.info["proposals"]) == 5 and ep.info["candidate_correct"] == [True] * 5
    assert valid(ep, "Summarizer") == [False] and ep.reward == 0.0 and ep.info["summary_answer"] is None


# ---------------------------------------------------------------- single


def test_single_solver():
    ep = run("single", {"Solver": ["\\boxed{5}"]})
    assert agents(ep) == ["Solver"] and ep.reward == 1.0 and ep.turns[0].valid
    assert TASK.question in ep.turns[0].prompt_text and "{context}" not in ep.turns[0].prompt_text
    ep = run("single", {"Solver": ["five"]})
    assert not ep.turns[0].valid and ep.reward == 0.0


def test_single_prompt_is_configurable():
    ep = run_scripted("single", TASK, {"Solver": ["\\boxed{5}"]}, score=boxed_score,
                      prompts={"Solver": "Q: {question}\nA:"})
    assert ep.turns[0].prompt_text == f"Q: {TASK.question}\nA:"
