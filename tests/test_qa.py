"""QA answer normalization, EM / F1 scoring and the dataset loaders."""
from __future__ import annotations

import functools
import json
import warnings

import pytest

from masrl.paths import data_dir
from masrl.tasks.qa import (QA_DATASETS, QADataError, QADataWarning, exact_match, f1_score, gold_answers,
                            load_flashrag_jsonl, load_qa, normalize_answer, qa_score, substring_match)
from masrl.types import Task


@pytest.mark.parametrize("raw,norm", [
    ("The Eiffel Tower", "eiffel tower"),
    ("  a   cat, an apple; THE end!  ", "cat apple end"),
    ("U.S.A.", "usa"),
    ("Theatre", "theatre"),            # 'the' inside a word stays
    ("anthem of a nation", "anthem of nation"),
    ("Wilhelm Conrad Röntgen", "wilhelm conrad röntgen"),
    ("", ""),
    (1999, "1999"),
])
def test_normalize_answer(raw, norm):
    assert normalize_answer(raw) == norm


def test_exact_match_any_gold():
    assert exact_match("the Beatles", ["Rolling Stones", "Beatles"]) == 1.0
    assert exact_match("Beatles!", "The Beatles") == 1.0
    assert exact_match("Beatles band", ["Beatles"]) == 0.0
    assert exact_match(None, ["x"]) == 0.0
    assert exact_match("", [""]) == 1.0 and exact_match("x", []) == 0.0


def test_f1_token_overlap():
    assert f1_score("Barack Obama", ["Obama"]) == pytest.approx(2 / 3)
    assert f1_score("president Barack Obama", ["Barack Obama", "Obama"]) == pytest.approx(0.8)  # best gold
    assert f1_score("the the", ["a"]) == 1.0  # both normalize to empty
    assert f1_score("cat", ["dog"]) == 0.0
    assert f1_score("x y y", ["y y z"]) == pytest.approx(2 / 3)  # multiset overlap: 2 of 3 each way
    assert f1_score("a b b", ["b b c"]) == pytest.approx(0.8)  # the article is dropped first
    assert f1_score(None, ["x"]) == 0.0


def test_substring_match():
    assert substring_match("It was Barack Obama.", ["Barack Obama"]) == 1.0
    assert substring_match("Obama", ["Barack Obama"]) == 0.0


def test_gold_answers_forms():
    assert gold_answers("x") == ["x"]
    assert gold_answers(["a", None, 3]) == ["a", "3"]
    assert gold_answers({"target": ["t"]}) == ["t"]
    assert gold_answers(None) == []


def test_qa_score_metrics_and_scorefn_signature():
    task = Task("1", "Who?", ["Barack Obama"])
    em = qa_score(task, "barack obama")
    assert em == {"reward": 1.0, "correct": True, "em": 1.0, "f1": 1.0, "pred": "barack obama"}
    f1_fn = functools.partial(qa_score, metric="f1")
    partial_credit = f1_fn(task, "Obama")
    assert partial_credit["reward"] == pytest.approx(2 / 3) and partial_credit["correct"] is False
    assert partial_credit["em"] == 0.0
    assert qa_score(task, None) == {"reward": 0.0, "correct": False, "em": 0.0, "f1": 0.0, "pred": None}
    # maj@k votes on the normalised prediction: "The Obama." and "obama" are one answer
    assert qa_score(task, "The Obama.")["pred"] == qa_score(task, "obama")["pred"] == "obama"
    assert qa_score(Task("2", "q", "Paris"), "paris")["correct"]
    assert qa_score(task, "It is Barack Obama", metric="subem")["reward"] == 1.0
    with pytest.raises(ValueError, match="unknown QA metric"):
        qa_score(task, "x", metric="bleu")


# ---- loaders on small files with malformed rows ---------------------------------------------

def test_flashrag_jsonl_malformed_rows(tmp_path):
    path = tmp_path / "mini_test.jsonl"
    path.write_text("\n".join([
        json.dumps({"id": "a", "question": "Q1?", "golden_answers": ["A1", "a one"]}),
        "{broken",
        json.dumps({"id": "c", "question": "", "golden_answers": ["x"]}),
        json.dumps({"id": "d", "question": "Q4?", "golden_answers": []}),
        "",
        json.dumps({"question": "Q6?", "golden_answers": "single"}),
    ]) + "\n")
    with pytest.warns(QADataWarning) as record:
        tasks = load_flashrag_jsonl(path)
    assert [t.question for t in tasks] == ["Q1?", "Q6?"]
    assert tasks[0].answer == ["A1", "a one"] and tasks[1].answer == ["single"]
    assert tasks[0].meta["data_source"] == "mini" and tasks[1].id == "mini-5"
    messages = " ".join(str(w.message) for w in record)
    assert "mini_test.jsonl:2: invalid JSON" in messages
    assert ":3: missing or empty 'question'" in messages and ":4: missing or empty gold" in messages
    with pytest.raises(QADataError, match=r"mini_test.jsonl:2:"):
        load_flashrag_jsonl(path, strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert len(load_qa(path, limit=1)) == 1 and load_qa(path, limit=0) == []


def test_qa_json_and_hotpotqa_raw(tmp_path):
    qa = tmp_path / "toy_dev.json"
    qa.write_text(json.dumps([{"question": "Q?", "answer": "yes"}, {"question": "R?", "answer": ["a", "b"]},
                              "oops", {"answer": "x"}]))
    with pytest.warns(QADataWarning) as record:
        tasks = load_qa(qa)
    messages = [str(w.message) for w in record]
    assert any("toy_dev.json:index 2: expected a JSON object" in m for m in messages)
    assert any("toy_dev.json:index 3: missing or empty 'question'" in m for m in messages)
    assert [t.answer for t in tasks] == [["yes"], ["a", "b"]]
    raw = tmp_path / "hp.json"
    raw.write_text(json.dumps([{"_id": "x1", "question": "Who?", "answer": "Bob", "type": "bridge", "level": "easy",
                                "supporting_facts": [["T1", 0], ["T2", 1], ["T1", 2]],
                                "context": [["T1", ["s."]], ["T2", ["t."]]]}]))
    [task] = load_qa(raw)
    assert task.id == "x1" and task.answer == ["Bob"]
    assert task.meta["supporting_titles"] == ["T1", "T2"] and task.meta["data_source"] == "hotpotqa"


def test_searchr1_parquet_question_from_prompt(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"data_source": "nq", "prompt": [{"role": "user", "content": "Answer it. Question: who won?\n"}],
             "reward_model": {"ground_truth": {"target": ["Bob", "Robert"]}, "style": "rule"}},
            {"data_source": "nq", "prompt": [{"role": "user", "content": "Question: bad row"}],
             "reward_model": {"ground_truth": {"target": []}, "style": "rule"}}]
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.warns(QADataWarning, match=r"train.parquet:row 1: missing or empty gold"):
        [task] = load_qa(path)
    assert task.question == "who won?" and task.answer == ["Bob", "Robert"] and task.meta["data_source"] == "nq"


def test_load_qa_errors(tmp_path):
    with pytest.raises(QADataError, match="not found"):
        load_qa(tmp_path / "nope.jsonl")
    with pytest.raises(QADataError, match="known names"):
        load_qa("not_a_dataset")
    (tmp_path / "x.csv").write_text("q,a")
    with pytest.raises(QADataError, match="cannot tell the QA format"):
        load_qa(tmp_path / "x.csv")
    (tmp_path / "obj.json").write_text('{"question": "q"}')
    with pytest.raises(QADataError, match="expected a JSON array"):
        load_qa(tmp_path / "obj.json")


def test_load_qa_synthetic_kb():
    train = load_qa("synthetic_kb")
    test = load_qa("synthetic_kb:test", limit=5)
    assert len(test) == 5 and all(t.meta["data_source"] == "synthetic_kb" for t in train + test)
    assert not {t.id for t in train} & {t.id for t in test}


# ---- every QA file present in ../shared/data ------------------------------------------------

EXPECTED = {  # name -> (count, data_source, gold answer of the first task)
    "bamboogle": (125, "bamboogle", ["james madison"]),
    "nq": (1000, "nq", None),
    "triviaqa": (1000, "triviaqa", None),
    "popqa": (1000, "popqa", None),
    "nq_full": (3610, "nq", ["14 December 1972 UTC", "December 1972"]),
    "hotpotqa": (7405, "hotpotqa", ["yes"]),
    "2wikimultihopqa": (12576, "2wikimultihopqa", None),
    "musique": (2417, "musique", ["Miquette Giraudy"]),
    "searchr1_nq_test": (3610, "nq", ["Wilhelm Conrad Röntgen"]),
    "searchr1_nq_train": (5000, "nq", None),
    "hotpotqa_train100": (100, "hotpotqa", ["a spirit"]),
}


@pytest.mark.parametrize("name", sorted(QA_DATASETS))
def test_real_qa_files(name):
    path = data_dir() / QA_DATASETS[name]
    if not path.is_file():
        pytest.skip(f"{path} absent")
    with warnings.catch_warnings():
        warnings.simplefilter("error", QADataWarning)  # the shipped files have no malformed rows
        tasks = load_qa(name)
    count, source, first_gold = EXPECTED[name]
    assert len(tasks) == count
    assert all(t.question and t.answer and all(isinstance(a, str) for a in t.answer) for t in tasks)
    assert {t.meta["data_source"] for t in tasks} == {source}
    if first_gold is not None:
        assert tasks[0].answer == first_gold
    assert len({t.id for t in tasks}) == count
    assert load_qa(path, limit=3) == tasks[:3]  # by path too


from hypothesis import given
from hypothesis import strategies as st


@given(st.text(max_size=40), st.lists(st.text(max_size=20), max_size=3))
def test_scores_are_bounded_and_em_implies_f1(pred, golds):
    assert normalize_answer(normalize_answer(pred)) == normalize_answer(pred)
    em, f1 = exact_match(pred, golds), f1_score(pred, golds)
    assert 0.0 <= f1 <= 1.0 and em in (0.0, 1.0)
    if em:
        assert f1 == 1.0
