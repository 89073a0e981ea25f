"""Study workflows on code: eval_opt and single with fenced programs, scored in the sandbox."""
import pytest

from masrl.paths import data_dir
from masrl.tasks.code import load_mbpp, make_code_score
from masrl.workflows.testing import run_scripted

pytestmark = pytest.mark.skipif(not (data_dir() / "code" / "mbpp.jsonl").is_file(), reason="MBPP data not found")


@pytest.fixture(scope="module")
def task():
    return load_mbpp(split="test", limit=1)[0]  # task 11: remove first and last occurrence of a char


GOOD = "```python\ndef remove_Occ(s, ch):\n    s = s.replace(ch, '', 1)\n    i = s.rfind(ch)\n    return s if i < 0 else s[:i] + s[i+1:]\n```"
BAD = "```python\ndef remove_Occ(s, ch):\n    return s\n```"


def test_eval_opt_revises_a_program_after_incorrect_verdict(task):
    assert "remove_Occ" in str(task.meta.get("entry_point", "")) or "remove_Occ" in task.question
    ep = run_scripted("eval_opt", task, {"Generator": [BAD, GOOD],
                                         "Evaluator": ["\\boxed{Incorrect} it returns s unchanged", "\\boxed{Correct}"]},
                      score=make_code_score("all"), params={"answer_format": "code", "judge_verdicts": True})
    assert [t.agent for t in ep.turns] == ["Generator", "Evaluator", "Generator", "Evaluator"]
    assert all(t.valid for t in ep.turns)
    assert ep.turns[1].info["judged_correct"] is False and ep.turns[3].info["judged_correct"] is True
    assert ep.reward == 1.0


def test_single_on_code_marks_missing_block_invalid(task):
    ep = run_scripted("single", task, {"Solver": ["def remove_Occ(s, ch): return s"]},
                      score=make_code_score("fraction"), params={"answer_format": "code"})
    assert not ep.turns[0].valid
    ep = run_scripted("single", task, {"Solver": [GOOD]}, score=make_code_score("fraction"),
                      params={"answer_format": "code"})
    assert ep.turns[0].valid and ep.reward == 1.0
