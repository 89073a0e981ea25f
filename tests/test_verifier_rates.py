"""benchmarks/study/verifier_rates.py: the confusion table of a Verifier's verdicts recovered from the
three rates older runs log (hand-computed counts)."""
import json

import pytest

from conftest import load_benchmark

vr = load_benchmark("study/verifier_rates.py")
K = "eval/test/agent/Verifier/"


def test_rates_from_accuracy_precision_recall():
    # TP 3, FP 5, TN 1, FN 1 of 10 judged turns: accuracy 0.4, precision 3/8, recall 3/4
    got = vr.rates({K + "verdict_accuracy": 0.4, K + "approve_precision": 3 / 8, K + "approve_recall": 0.75}, "Verifier")
    assert got["approve_correct"] == pytest.approx(0.75)
    assert got["approve_wrong"] == pytest.approx(5 / 6)
    assert got["correct_share"] == pytest.approx(0.4)


def test_direct_rate_and_edge_cases():
    row = {K + "verdict_accuracy": 0.9, K + "approve_recall": 1.0, K + "approve_rate_wrong": 0.25}
    assert vr.rates(row, "Verifier")["approve_wrong"] == 0.25
    # no approvals: no precision logged; approves nothing
    assert vr.rates({K + "verdict_accuracy": 0.7, K + "approve_recall": 0.0}, "Verifier")["approve_wrong"] == 0.0
    assert vr.rates({}, "Verifier") is None


def test_table_over_a_sweep(tmp_path, capsys):
    run = tmp_path / "estimator=drmas" / "seed0"
    run.mkdir(parents=True)
    sft = {"phase": "eval", "step": 0, "eval/test/avg@n": 0.3, K + "verdict_accuracy": 0.4,
           K + "approve_precision": 3 / 8, K + "approve_recall": 0.75}
    rl = {"phase": "eval", "step": 20, "eval/test/avg@n": 0.5, K + "verdict_accuracy": 0.8,
          K + "approve_recall": 0.5, K + "approve_rate_wrong": 0.1}
    (run / "metrics.jsonl").write_text(json.dumps(sft) + "\n" + json.dumps(rl) + "\n")
    (run / "report.json").write_text("{}")
    assert vr.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| estimator=drmas/seed0 | 30.0 | 50.0 | 75.0 → 50.0 | 83.3 → 10.0 | 40.0 → 80.0 |" in out


def test_agent_facts_give_the_confusion_rates():
    """Hand-counted verdicts: TP 3, FP 5, TN 1, FN 1 -> accuracy 0.4, precision 3/8, recall 3/4, wrong approved 5/6."""
    from masrl.evaluation.summary import agent_facts
    from masrl.types import Episode, Task, Turn

    cells = [("approve", True)] * 3 + [("approve", False)] * 5 + [("reject", False)] + [("reject", True)]
    episodes = [Episode(task=Task(id=str(i), question="q", answer="a"), reward=0.0,
                        turns=[Turn(agent="Verifier", policy="p", prompt_ids=[1], response_ids=[2], logprobs=[0.0],
                                    text="", info={"verdict": v, "judged_correct": ok})])
                for i, (v, ok) in enumerate(cells)]
    facts = agent_facts(episodes)
    assert facts["agent/Verifier/verdict_accuracy"] == pytest.approx(0.4)
    assert facts["agent/Verifier/approve_precision"] == pytest.approx(3 / 8)
    assert facts["agent/Verifier/approve_recall"] == pytest.approx(0.75)
    assert facts["agent/Verifier/approve_rate_wrong"] == pytest.approx(5 / 6)
    # the three older rates give the same answer through the script's derivation
    row = {f"eval/test/{k}": v for k, v in facts.items()}
    assert vr.rates(row, "Verifier")["approve_wrong"] == pytest.approx(5 / 6)
    del row[K + "approve_rate_wrong"]
    assert vr.rates(row, "Verifier")["approve_wrong"] == pytest.approx(5 / 6)
