"""Math benchmark loaders: formats, malformed rows, registry, HF error paths, real data."""
from __future__ import annotations

import json
import sys
import types
import warnings

import pytest

from masrl.paths import data_dir
from masrl.tasks import math_data
from masrl.tasks.math_data import (
    BENCHMARKS,
    DatasetLoadError,
    MalformedRowWarning,
    load_aime,
    load_amc,
    load_benchmark,
    load_gsm8k,
    load_hf_dataset,
    load_math500,
    load_minerva,
    load_olympiadbench,
    normalize_gold,
)

MATH_DIR = data_dir() / "math"
needs_data = pytest.mark.skipif(not MATH_DIR.is_dir(), reason=f"benchmark data not found at {MATH_DIR}")


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as fh:
        for r in rows:
            fh.write(r if isinstance(r, str) else json.dumps(r))
            fh.write("\n")
    return path


def test_gsm8k_format(tmp_path):
    p = write_jsonl(tmp_path / "g.jsonl", [
        {"question": "How many?", "answer": "work <<1+1=2>>\n#### 1,234"},
        {"question": "Neg?", "answer": "x\n#### -5"},
    ])
    tasks = load_gsm8k(p)
    assert [t.answer for t in tasks] == ["1234", "-5"]
    assert tasks[0].id == "gsm8k/0" and tasks[0].question == "How many?"
    assert tasks[0].meta["data_source"] == "gsm8k"


def test_math500_aime_amc_formats(tmp_path):
    m = load_math500(write_jsonl(tmp_path / "m.jsonl", [
        {"problem": "P", "answer": "\\frac{1}{2}", "subject": "Algebra", "level": 3, "unique_id": "test/a/1.json"}]))
    assert m[0].answer == "\\frac{1}{2}" and m[0].meta["subject"] == "Algebra"
    assert m[0].meta["source_id"] == "test/a/1.json"
    a = load_aime(write_jsonl(tmp_path / "a.jsonl", [
        {"id": 60, "question": "Q only", "answer": "025"}, {"problem": "P", "answer": 7}]), bench="aime25")
    assert [t.answer for t in a] == ["25", "7"] and a[0].question == "Q only" and a[1].id == "aime25/1"
    c = load_amc(write_jsonl(tmp_path / "c.jsonl", [
        {"problem": "P", "answer": 27.0}, {"question": "Q", "answer": "27.0"}, {"problem": "P", "answer": 2.5}]))
    assert [t.answer for t in c] == ["27", "27", "2.5"]


def test_olympiadbench_format(tmp_path):
    p = write_jsonl(tmp_path / "o.jsonl", [
        {"question": "Q1", "final_answer": "['$2^{1009}$']", "answer_type": "Numerical", "unit": None},
        {"question": "Q2", "final_answer": ["$69$,$84$"], "context": "Setup.", "is_multiple_answer": True},
        {"question": "Q3", "final_answer": "['1,3,5']"},
        {"question": "Q4", "final_answer": ["\\$5"]},
    ])
    t = load_olympiadbench(p)
    assert [x.answer for x in t] == ["2^{1009}", "69,84", "1,3,5", "\\$5"]
    assert t[1].question.startswith("Setup.") and t[1].meta["is_multiple_answer"] is True
    assert "unit" not in t[0].meta and t[0].meta["answer_type"] == "Numerical"


def test_minerva_format(tmp_path):
    p = write_jsonl(tmp_path / "v.jsonl", [
        {"problem": "P", "solution": "so $x=\\boxed{1.6}$ cm, not \\boxed{2}? no: final \\boxed{\\frac{a}{b}}", "idx": "0"}])
    t = load_minerva(p)
    assert t[0].answer == "\\frac{a}{b}" and t[0].meta["source_id"] == "0"


def test_malformed_rows_warn_with_file_line_and_keep_stable_ids(tmp_path):
    p = write_jsonl(tmp_path / "bad.jsonl", [
        {"question": "ok", "answer": "#### 1"},
        "{not json",
        "",
        {"question": "no answer"},
        {"question": "no hashes", "answer": "42"},
        "[1, 2]",
        {"question": "ok2", "answer": "#### 2"},
    ])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tasks = load_gsm8k(p)
    msgs = [str(w.message) for w in caught if issubclass(w.category, MalformedRowWarning)]
    assert len(msgs) == 4
    assert f"{p}:2" in msgs[0] and "invalid JSON" in msgs[0]
    assert f"{p}:4" in msgs[1] and "'answer'" in msgs[1]
    assert f"{p}:5" in msgs[2]
    assert f"{p}:6" in msgs[3]
    # the blank line is not a row; ids are row positions, so skipping does not shift later ids
    assert [(t.id, t.answer) for t in tasks] == [("gsm8k/0", "1"), ("gsm8k/5", "2")]


def test_strict_raises(tmp_path):
    p = write_jsonl(tmp_path / "bad.jsonl", [{"question": "ok", "answer": "#### 1"}, "{oops"])
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        load_gsm8k(p, strict=True)
    p2 = write_jsonl(tmp_path / "bad2.jsonl", [{"problem": "P", "solution": "no box here"}])
    with pytest.raises(ValueError, match="boxed"):
        load_minerva(p2, strict=True)


def test_limit_and_registry(tmp_path):
    (tmp_path / "math").mkdir()
    write_jsonl(tmp_path / "math" / "amc23_test.jsonl", [{"problem": f"P{i}", "answer": float(i)} for i in range(5)])
    assert len(load_benchmark("amc23", root=tmp_path)) == 5
    t = load_benchmark("amc23", limit=2, root=tmp_path)
    assert [x.id for x in t] == ["amc23/0", "amc23/1"] and t[1].answer == "1"
    assert load_benchmark("amc23", limit=0, root=tmp_path) == []
    with pytest.raises(ValueError, match="unknown benchmark"):
        load_benchmark("nope")
    with pytest.raises(FileNotFoundError):
        load_benchmark("aime24", root=tmp_path)
    assert set(BENCHMARKS) == {"gsm8k", "gsm8k_train", "math500", "aime24", "aime25", "amc23",
                               "olympiadbench", "minerva"}


def test_normalize_gold():
    assert normalize_gold("1,000") == "1000"
    assert normalize_gold("007") == "7"
    assert normalize_gold("-3.0") == "-3"
    assert normalize_gold(" x+1 ") == "x+1"
    assert normalize_gold("1,2") == "1,2"
    assert normalize_gold(4.0) == "4"


# --- load_hf_dataset: no network, ever --------------------------------------------------------

def test_hf_dataset_missing_library(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(ImportError, match=r"pip install 'masrl\[hf\]'"):
        load_hf_dataset("openai/gsm8k", "test", "question", "answer")


def fake_datasets(monkeypatch, load_dataset):
    mod = types.ModuleType("datasets")
    mod.load_dataset = load_dataset
    monkeypatch.setitem(sys.modules, "datasets", mod)


def test_hf_dataset_unreachable_hub(monkeypatch):
    def load_dataset(*a, **k):
        raise ConnectionError("Couldn't reach 'x/y' on the Hub (LocalEntryNotFoundError)\nlong traceback text")

    fake_datasets(monkeypatch, load_dataset)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DatasetLoadError) as ei:
        load_hf_dataset("x/y", "test", "question", "answer")
    msg = str(ei.value)
    assert "\n" not in msg and "'x/y'" in msg and "HF_HUB_OFFLINE=1" in msg and "ConnectionError" in msg


def test_hf_dataset_rows(monkeypatch):
    rows = [{"q": "A?", "a": "#### 3"}, {"q": "", "a": "#### 4"}, {"q": "B?", "a": "#### 1,000"}]
    seen = {}

    def load_dataset(hub_id, *args, split=None):
        seen.update(hub_id=hub_id, args=args, split=split)
        return rows

    fake_datasets(monkeypatch, load_dataset)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tasks = load_hf_dataset("openai/gsm8k", "test", "q", "a", config="main",
                                answer_fn=lambda a: a.split("####")[-1].replace(",", ""))
    assert seen == {"hub_id": "openai/gsm8k", "args": ("main",), "split": "test"}
    assert [(t.id, t.answer) for t in tasks] == [("gsm8k/0", "3"), ("gsm8k/2", "1000")]
    assert tasks[0].meta["data_source"] == "gsm8k" and tasks[0].meta["hub_id"] == "openai/gsm8k"
    assert any("openai/gsm8k[test]:1" in str(w.message) for w in caught)
    with pytest.raises(ValueError, match="missing field"):
        load_hf_dataset("openai/gsm8k", "test", "question", "a", strict=True)


# --- real data -------------------------------------------------------------------------------

EXPECTED_COUNTS = {"gsm8k": 1319, "gsm8k_train": 7473, "math500": 500, "aime24": 30, "aime25": 30,
                   "amc23": 40, "olympiadbench": 675, "minerva": 272}


@needs_data
@pytest.mark.parametrize("name", sorted(EXPECTED_COUNTS))
def test_real_benchmarks_load_cleanly(name):
    path = data_dir() / BENCHMARKS[name][0]
    if not path.is_file():
        pytest.skip(f"{path} missing")
    with warnings.catch_warnings():
        warnings.simplefilter("error", MalformedRowWarning)
        tasks = load_benchmark(name, strict=True)
    assert len(tasks) == EXPECTED_COUNTS[name]
    assert len({t.id for t in tasks}) == len(tasks)
    assert all(t.id == f"{name}/{i}" for i, t in enumerate(tasks))
    assert all(isinstance(t.answer, str) and t.answer and "$" not in t.answer.replace("\\$", "") for t in tasks)
    assert all(t.question.strip() and t.meta["data_source"] == name for t in tasks)


@needs_data
def test_real_gold_answers_spot_checks():
    gsm = load_benchmark("gsm8k", limit=1)
    assert gsm[0].answer == "18"
    amc = load_benchmark("amc23", limit=1)
    assert amc[0].answer == "27"
    ob = load_benchmark("olympiadbench", limit=2)
    assert ob[0].answer == "2" and ob[1].answer == "\\frac{1}{2 n+2}"
    aime = load_benchmark("aime24")
    assert all(a.answer.isdigit() and not (len(a.answer) > 1 and a.answer.startswith("0")) for a in aime)


@needs_data
def test_real_gold_answers_score_themselves():
    """Every gold answer of the small benchmarks, boxed, is judged correct by math_score."""
    from masrl.tasks.math_reward import math_score

    for name in ("aime24", "aime25", "amc23", "math500"):
        for t in load_benchmark(name, limit=120):
            r = math_score(t, f"Final: \\boxed{{{t.answer}}}")
            assert r["correct"], (t.id, t.answer, r)


def test_module_has_no_network_imports():
    # loading a benchmark must not pull in the HF datasets library
    assert "datasets" not in math_data.__dict__
