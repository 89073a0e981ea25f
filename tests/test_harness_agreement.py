"""benchmarks/harness_agreement.py: the recipes' scoring rule and how a row scored differently is explained
(hand-built replies; the measurement itself needs a trained run and the harness extra)."""
from conftest import load_benchmark

ha = load_benchmark("harness_agreement.py")


def test_boxed_number_is_the_recipes_rule():
    assert ha.boxed_number("1+2=3\n\\boxed{3} then \\boxed{ -1,204 }") == "-1204"
    assert ha.boxed_number("\\boxed{x}") is None and ha.boxed_number(None) is None
    assert ha.recipe_correct("\\boxed{12}", "12") and not ha.recipe_correct("\\boxed{012}", "12")
    assert not ha.recipe_correct("12", "12")  # no box, no answer


def test_explain_names_the_reply_before_the_rule():
    assert ha.explain("5", "\\boxed{5}", True, "\\boxed{5}", True) is None
    why = ha.explain("5", "\\boxed{5}", True, "\\boxed{6}", False)
    assert why.startswith("the reply differs") and "'6'" in why
    why = ha.explain("5", "\\boxed{05}", True, "\\boxed{05}", False)
    assert why.startswith("same reply") and "normalisation" in why
    why = ha.explain("5", "\\boxed{\\text{5}}", True, "\\boxed{\\text{5}}", False)
    assert "finds no plain number" in why


def test_compare_counts_accuracies_replies_and_differences():
    rows = [{"question": "1+1", "answer": "2"}, {"question": "2+3", "answer": "5"}, {"question": "9-9", "answer": "0"}]
    masrl = [{"answer": "\\boxed{2}", "correct": True}, {"answer": "\\boxed{05}", "correct": True},
             {"answer": "\\boxed{1}", "correct": False}]
    same = [{"reply": s["answer"], "correct": ha.recipe_correct(s["answer"], r["answer"])} for r, s in zip(rows, masrl)]
    other = [dict(same[0]), dict(same[1]), {"reply": "\\boxed{0}", "correct": True}]
    result = ha.compare(rows, masrl, {"lm-eval": same, "inspect": other})
    assert result["accuracy"] == {"masrl eval": 2 / 3, "lm-eval": 1 / 3, "inspect": 2 / 3}
    assert result["same_reply"] == {"lm-eval": 3, "inspect": 2}
    assert result["same_score"] == {"lm-eval": 2, "inspect": 1}
    assert result["masrl_eval_by_exact_match"] == 1 / 3
    assert [(d["harness"], d["row"], d["reply_differs"]) for d in result["differences"]] == [
        ("lm-eval", 1, False), ("inspect", 1, False), ("inspect", 2, True)]
    assert "row 2 (inspect, '9-9'): the reply differs" in ha.report(result)
