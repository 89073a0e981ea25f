"""`masrl ensemble collect`: a proposers -> summarizer team's answers as an ensemble predictions file."""
import json

import pytest
import yaml

from masrl.cli import main
from masrl.config import config_from_dict
from masrl.ensemble.collect import episode_rows
from masrl.ensemble.data import load_jsonl
from masrl.tasks.math_reward import math_score
from masrl.tasks.registry import load_task_source
from masrl.types import Task
from masrl.workflows.testing import run_scripted

MOA = {"workflow.name": "proposers_summarizer", "workflow.params": {"n_proposers": 3},
       "workflow.prompts": {"Proposer": "Q {question}\nS ", "Summarizer": "Q {question}\n{proposals}A ",
                            "proposal": "{text}\n"},
       "agents": {"Proposer": {"policy": "shared", "max_new_tokens": 8},
                  "Summarizer": {"policy": "shared", "max_new_tokens": 8}},
       # the untrained tiny model rarely boxes: score its last number so that some answers are right
       "task.params.answer_fallback": "last_number"}
NAMES = ["Proposer#0@shared", "Proposer#1@shared", "Proposer#2@shared"]


def test_collect_writes_a_file_the_ensemble_loader_and_select_accept(tmp_path, tiny_cfg, capsys):
    data_cfg = tiny_cfg(**MOA)
    cfg_path = tmp_path / "moa.yaml"
    cfg_path.write_text(yaml.safe_dump(data_cfg))
    out = tmp_path / "moa.jsonl"
    code = main(["ensemble", "collect", str(cfg_path), "--bench", "test", "--limit", "6", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    assert "ensemble collect: 6 rows, 3 proposers" in capsys.readouterr().out

    cfg = config_from_dict(data_cfg)
    source = load_task_source(cfg.task)
    tasks = source.test[:6]
    data = load_jsonl(out)  # strict: every row valid, correct agrees with answer == label
    assert data.models == NAMES
    assert data.ids == [f"test/{t.id}" for t in tasks]
    assert [data.decode(int(c)) for c in data.labels] == [t.answer for t in tasks]
    assert data.task_names() == ["test"]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["task_id"] for r in rows] == [t.id for t in tasks]
    for task, row in zip(tasks, rows):
        assert list(row["predictions"]) == NAMES
        for pred in row["predictions"].values():
            if pred["answer"] is None:
                assert pred["correct"] == 0
            else:  # the bench's score function agrees with the recorded correctness
                assert source.score(task, str(pred["answer"]))["correct"] == bool(pred["correct"])
        assert row["summarizer_correct"] in (0, 1)
    assert data.correct.shape == (6, 3) and (data.answers >= 0).any()  # the score check above was not vacuous

    # round trip into the selectors
    assert main(["ensemble", "select", "--data", str(out), "--method", "forward", "--k", "2"]) == 0
    assert "forward" in capsys.readouterr().out


def test_rows_use_the_label_as_voting_key_for_right_answers():
    task = Task(id="t", question="half?", answer="\\frac{1}{2}")
    ep = run_scripted("proposers_summarizer", task,
                      {"Proposer": ["so \\boxed{0.5}", "\\boxed{1/2}", "\\boxed{ 3 }"],
                       "Summarizer": ["\\boxed{\\frac12}"]}, score=math_score)
    ep2 = run_scripted("proposers_summarizer", task,
                       {"Proposer": ["no box", "\\boxed{3}", "\\boxed{2}"], "Summarizer": ["\\boxed{3}"]},
                       score=math_score)
    rows, facts = episode_rows([ep, ep2], math_score, bench="mini", n_samples=2)
    names = ["Proposer#0@scripted", "Proposer#1@scripted", "Proposer#2@scripted"]
    assert facts["models"] == names
    assert [r["id"] for r in rows] == ["mini/t#0", "mini/t#1"] and [r["sample"] for r in rows] == [0, 1]
    p = rows[0]["predictions"]
    assert [p[n]["correct"] for n in names] == [1, 1, 0]
    assert [p[n]["answer"] for n in names] == ["\\frac{1}{2}", "\\frac{1}{2}", "3"]
    q = rows[1]["predictions"]
    assert [q[n]["answer"] for n in names] == [None, "3", "2"] and [q[n]["correct"] for n in names] == [0, 0, 0]
    assert rows[0]["summarizer_correct"] == 1 and rows[1]["summarizer_answer"] == "3"

    from masrl.ensemble.data import from_records

    data = from_records(rows)
    assert data.correct.tolist() == [[True, True, False], [False, False, False]]
    assert data.answers[0, 0] == data.answers[0, 1] == data.labels[0]  # equivalent right answers vote together
    assert data.answers[1, 1] == data.answers[0, 2]  # "3" in both rows
    assert list(data.extras["summarizer_correct"]) == [1, 0]


def test_rows_refuse_an_episode_without_proposals():
    ep = run_scripted("single", Task(id="t", question="q", answer="5"), {"Solver": ["\\boxed{5}"]}, score=math_score)
    with pytest.raises(ValueError, match="records no proposals"):
        episode_rows([ep], math_score, bench="b", workflow="single")


def test_collect_refuses_a_workflow_without_proposals(tmp_path, tiny_cfg, capsys):
    cfg_path = tmp_path / "sv.yaml"
    cfg_path.write_text(yaml.safe_dump(tiny_cfg()))  # math_solver_verifier: no proposals
    out = tmp_path / "x.jsonl"
    assert main(["ensemble", "collect", str(cfg_path), "--bench", "test", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("masrl ensemble: error:")
    assert "sv.yaml" in err and "'math_solver_verifier' records no proposals" in err
    assert "workflow.name: proposers_summarizer" in err
    assert not out.exists()
