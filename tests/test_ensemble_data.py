"""Loader, validation errors (file:line), lenient mode, encodings, splits; real data when present."""
import json
import warnings

import pytest

from masrl.ensemble import MalformedRowWarning, from_records, load_jsonl, split_indices
from masrl.paths import data_dir


def row(i, label, answers, probs=None, task=None, **extra):
    preds = {}
    for m, a in answers.items():
        p = {"answer": a}
        if probs is not None:
            p["probs"] = probs[m]
        preds[m] = p
    r = {"id": f"q{i}", "label": label, "predictions": preds, **extra}
    if task is not None:
        r["task"] = task
    return r


def write(tmp_path, rows, name="d.jsonl"):
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_load_basic_index_answers(tmp_path):
    rows = [row(0, 1, {"a": 1, "b": 0}, {"a": [0.2, 0.8], "b": [0.9, 0.1]}, task="t1", split_x="train"),
            row(1, 0, {"a": 1, "b": None}, {"a": [0.4, 0.6], "b": [0.5, 0.5]}, task="t2", split_x="test")]
    d = load_jsonl(write(tmp_path, rows))
    assert d.models == ["a", "b"] and d.n == 2
    assert d.answers.tolist() == [[1, 0], [1, -1]]
    assert d.labels.tolist() == [1, 0]
    assert d.correct.tolist() == [[True, False], [False, False]]
    assert d.probs.shape == (2, 2, 2) and d.probs[0, 1, 0] == pytest.approx(0.9)
    assert d.task_names() == ["t1", "t2"]
    assert d.extras["split_x"].tolist() == ["train", "test"]
    assert d.vocab is None and d.has_probs and d.has_answers
    assert d.accuracy().tolist() == [0.5, 0.0]


def test_load_string_answers_use_vocab(tmp_path):
    rows = [row(0, "42", {"a": "42", "b": "41", "c": None}),
            row(1, "7", {"a": "8", "b": "7", "c": "7"}),
            row(2, None, {"a": "1", "b": "1", "c": "1"})]
    d = load_jsonl(write(tmp_path, rows))
    assert d.vocab is not None
    assert d.decode(int(d.labels[0])) == "42" and d.decode(-1) is None
    assert d.correct.tolist() == [[True, False, False], [False, True, True], [False, False, False]]
    assert d.labels[2] == -1  # null label: every model counts as wrong
    assert d.task_names() == ["d"]  # default task: file stem


def test_correctness_only_rows(tmp_path):
    rows = [{"id": "x", "label": None, "predictions": {"a": {"answer": None, "correct": 1, "score": 0.7},
                                                       "b": {"answer": None, "correct": 0}}}]
    d = load_jsonl(write(tmp_path, rows))
    assert d.correct.tolist() == [[True, False]]
    assert not d.has_answers and not d.has_labels and not d.has_probs


def test_label_field_option(tmp_path):
    rows = [row(0, 1, {"a": 0, "b": 1}, label_rlfocal=0)]
    d = load_jsonl(write(tmp_path, rows), label_field="label_rlfocal")
    assert d.correct.tolist() == [[True, False]]
    assert "label" in d.extras  # the other label is kept as an extra field


BAD = [
    ("not json {", "invalid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ({"label": 0, "predictions": {"a": {"answer": 0}, "b": {"answer": 0}}}, "missing 'id'"),
    ({"id": "z", "label": 0}, "missing 'predictions'"),
    ({"id": "z", "predictions": {"a": {"answer": 0}, "b": {"answer": 0}}}, "missing label field 'label'"),
    ({"id": "z", "label": 0, "predictions": {}}, "non-empty object"),
    ({"id": "z", "label": 0, "predictions": {"a": {"answer": 0}}}, "model set differs"),
    ({"id": "z", "label": 0, "predictions": {"a": {"answer": 0}, "b": 3}}, "must be an object"),
    ({"id": "z", "label": 0, "predictions": {"a": {"answer": 0}, "b": {"x": 1}}}, "neither 'answer' nor 'correct'"),
    ({"id": "z", "label": 0, "predictions": {"a": {"answer": 0}, "b": {"answer": 0, "correct": 2}}}, "'correct'"),
    ({"id": "z", "label": 0, "predictions": {"a": {"answer": 0}, "b": {"answer": 1, "correct": 1}}},
     "'correct' of 'b' is 1 but answer 1 != label 0"),
    ({"id": "q0", "label": 0, "predictions": {"a": {"answer": 0}, "b": {"answer": 0}}}, "duplicate id"),
    ({"id": "z", "label": 0, "predictions": {"a": {"answer": 0, "probs": [0.5, 0.4]}, "b": {"answer": 0}}},
     "sum to 0.9000"),
]


@pytest.mark.parametrize("bad,msg", BAD)
def test_malformed_rows_name_file_and_line(tmp_path, bad, msg):
    good = row(0, 0, {"a": 0, "b": 1})
    path = write(tmp_path, [good, bad])
    with pytest.raises(ValueError) as e:
        load_jsonl(path)
    assert f"{path}:2:" in str(e.value) and msg in str(e.value)


def test_probs_checks(tmp_path):
    ok = row(0, 0, {"a": 0, "b": 1}, {"a": [0.6, 0.4], "b": [0.3, 0.7]})
    cases = [
        (row(1, 0, {"a": 2, "b": 1}, {"a": [0.6, 0.4], "b": [0.3, 0.7]}), "not a choice index"),
        (row(1, 5, {"a": 0, "b": 1}, {"a": [0.6, 0.4], "b": [0.3, 0.7]}), "label 5 is not a choice index"),
        (row(1, 0, {"a": 0, "b": 1}, {"a": [0.6, 0.4], "b": [0.2, 0.3, 0.5]}), "has 3 entries"),
        (row(1, 0, {"a": 0, "b": 1}, {"a": [1.2, -0.2], "b": [0.3, 0.7]}), "negative"),
        (row(1, 0, {"a": 0, "b": 1}), "no 'probs' although earlier rows have them"),
    ]
    for bad, msg in cases:
        path = write(tmp_path, [ok, bad])
        with pytest.raises(ValueError, match=msg):
            load_jsonl(path)


def test_lenient_skips_with_warning(tmp_path):
    rows = [row(0, 0, {"a": 0, "b": 1}), "garbage", row(2, 1, {"a": 1, "b": 1}), "",
            {"id": "q3", "label": 0, "predictions": {"a": {"answer": 0}}}]
    path = write(tmp_path, rows)
    with pytest.raises(ValueError, match=r":2: invalid JSON"):
        load_jsonl(path)
    with pytest.warns(MalformedRowWarning) as rec:
        d = load_jsonl(path, strict=False)
    assert d.n == 2 and [s[0] for s in d.skipped] == [2, 4, 5]
    assert len(rec) == 3 and f"{path}:4:" in str(rec[1].message)


def test_all_malformed_is_an_error(tmp_path):
    path = write(tmp_path, ["nope"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="no valid rows"):
            load_jsonl(path, strict=False)


def test_missing_file_and_models_option(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_jsonl(tmp_path / "none.jsonl")
    path = write(tmp_path, [row(0, 0, {"a": 0, "b": 1, "c": 0})])
    d = load_jsonl(path, models=["c", "a"])
    assert d.models == ["c", "a"] and d.answers.tolist() == [[0, 0]]
    with pytest.raises(ValueError, match="unknown model"):
        load_jsonl(path, models=["zz"])


def test_take_and_select_models():
    d = from_records([row(i, i % 2, {"a": i % 2, "b": 0, "c": 1}) for i in range(6)])
    sub = d.take([1, 3])
    assert sub.ids == ["q1", "q3"] and sub.labels.tolist() == [1, 1]
    s2 = d.select_models(["c"])
    assert s2.models == ["c"] and s2.correct[:, 0].tolist() == [False, True] * 3


def test_split_first_per_task():
    rows = [row(i, 0, {"a": 0, "b": 0}, task="A" if i < 10 else "B") for i in range(15)]
    d = from_records(rows)
    sp = split_indices(d, "first")
    assert sp.train.tolist() == list(range(8)) + [10, 11, 12, 13]  # int(0.8*10)=8, int(0.8*5)=4
    assert sp.test.tolist() == [8, 9, 14]
    assert split_indices(d).how.startswith("first")  # auto without split fields
    with pytest.raises(ValueError):
        split_indices(d, "first", frac=1.5)


def test_split_field():
    rows = [row(i, 0, {"a": 0, "b": 0}, split_routerdc=s) for i, s in enumerate(["train", "test", "ood_test", "train"])]
    d = from_records(rows)
    sp = split_indices(d)
    assert sp.train.tolist() == [0, 3] and sp.test.tolist() == [1]
    with pytest.raises(ValueError, match="not in data"):
        split_indices(d, "field:nope")
    with pytest.raises(ValueError, match="unknown split"):
        split_indices(d, "random")


# ------------------------------------------------------------------------------ real data
BBH = data_dir() / "ensembles" / "rlfocal_bbh" / "bbh.jsonl"
MMLU = data_dir() / "ensembles" / "routerdc_7models" / "mmlu.jsonl"


@pytest.fixture(scope="module")
def bbh():
    if not BBH.exists():
        pytest.skip(f"real data not found at {BBH}")
    return load_jsonl(BBH)


def test_real_bbh_matches_stats(bbh):
    from masrl.ensemble import get_combiner
    assert bbh.n == 5761 and bbh.n_models == 5 and len(bbh.task_names()) == 24
    sp = split_indices(bbh)
    assert (len(sp.train), len(sp.test)) == (4607, 1154)
    assert split_indices(bbh, "first").train.tolist() == sp.train.tolist()  # split_rlfocal == first 80%
    acc = dict(zip(bbh.models, bbh.accuracy(sp.test)))
    assert acc["mistralai/Mixtral-8x7B-Instruct-v0.1"] == pytest.approx(0.5087, abs=1e-4)
    allm = range(5)
    assert get_combiner("plurality").accuracy(bbh, sp.test, allm) == pytest.approx(0.5086, abs=1e-4)
    assert get_combiner("soft").accuracy(bbh, sp.test, allm) == pytest.approx(0.5217, abs=1e-4)
    assert get_combiner("oracle").accuracy(bbh, sp.test, allm) == pytest.approx(0.8293, abs=1e-4)


def test_real_routerdc_correctness_only():
    if not MMLU.exists():
        pytest.skip(f"real data not found at {MMLU}")
    d = load_jsonl(MMLU)
    assert d.n == 6213 and d.n_models == 7 and not d.has_answers
    assert d.accuracy().max() == pytest.approx(0.6491, abs=1e-4)
    sp = split_indices(d)
    assert (len(sp.train), len(sp.test)) == (2000, 4213)
