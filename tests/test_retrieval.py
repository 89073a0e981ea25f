"""Corpus readers, BM25 / hybrid retrievers, the on-disk cache and build_retriever."""
from __future__ import annotations

import gzip
import json
import warnings

import pytest

from masrl.paths import data_dir
from masrl.retrieval import (BM25Retriever, CorpusError, CorpusWarning, HybridRetriever, Passage,
                                   Retriever, build_retriever, format_passages, load_corpus, resolve_retriever)
from masrl.retrieval.base import split_contents

CORPUS = [
    ("Marie Curie", "Marie Curie was a physicist and chemist who conducted research on radioactivity."),
    ("Albert Einstein", "Albert Einstein developed the theory of relativity, one of the pillars of physics."),
    ("Python (programming language)", "Python is a high-level programming language created by Guido van Rossum."),
    ("Mount Everest", "Mount Everest is Earth's highest mountain above sea level, in the Himalayas."),
    ("Amazon River", "The Amazon River in South America is the largest river by discharge volume."),
    ("Great Wall of China", "The Great Wall of China is a series of fortifications built across northern China."),
    ("Photosynthesis", "Photosynthesis is the process by which plants convert light energy into chemical energy."),
    ("Leonardo da Vinci", "Leonardo da Vinci was an Italian polymath of the High Renaissance, painter of the Mona Lisa."),
]


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("MASRL_CACHE_DIR", str(tmp_path / "cache"))


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture
def jsonl_corpus(tmp_path):
    rows = [{"id": str(i), "contents": f'"{t}"\n{x}'} for i, (t, x) in enumerate(CORPUS)]
    return write_jsonl(tmp_path / "corpus.jsonl", rows)


def test_passage_contents_roundtrip():
    p = Passage("7", "Mount Everest", "Highest mountain.")
    assert p.contents == '"Mount Everest"\nHighest mountain.'
    assert Passage.from_contents("7", p.contents) == p
    assert p.to_document() == {"id": "7", "contents": p.contents}
    assert split_contents("no title line here") == ("", "no title line here")
    assert split_contents("Absalon\nunquoted title line") == ("Absalon", "unquoted title line")
    assert Passage("1", "", "plain").contents == "plain"


def test_format_passages_numbering_and_no_rescan():
    ps = [Passage("a", "T1", "text {rank} stays"), Passage("b", "", "second")]
    out = format_passages(ps, "Doc {rank}: {title}|{text}")
    assert out == "Doc 1: T1|text {rank} stays\nDoc 2: |second"


@pytest.mark.parametrize("title,text", CORPUS)
def test_bm25_exact_title_query_ranks_gold_first(title, text):
    retriever = BM25Retriever([Passage(str(i), t, x) for i, (t, x) in enumerate(CORPUS)])
    [top] = retriever.search([title], topk=3)
    assert top[0].title == title
    assert top[0].score > 0
    assert [p.score for p in top] == sorted((p.score for p in top), reverse=True)


def test_bm25_batch_topk_and_no_match():
    retriever = BM25Retriever([Passage(str(i), t, x) for i, (t, x) in enumerate(CORPUS)])
    assert isinstance(retriever, Retriever)
    results = retriever.search(["river discharge", "zzzunknownword", "", "the of a"], topk=2)
    assert len(results) == 4
    assert results[0][0].title == "Amazon River" and len(results[0]) <= 2
    assert results[1] == [] and results[2] == [] and results[3] == []  # zero-score passages are dropped
    assert retriever.search([], topk=3) == []
    assert len(retriever.search(["physics"], topk=100)[0]) <= len(CORPUS)  # topk above corpus size is fine


def test_load_corpus_formats(tmp_path, jsonl_corpus):
    from_jsonl = load_corpus(jsonl_corpus)
    assert [(p.title, p.text) for p in from_jsonl] == CORPUS

    gz = tmp_path / "corpus.jsonl.gz"
    gz.write_bytes(gzip.compress(jsonl_corpus.read_bytes()))
    assert [(p.title, p.text) for p in load_corpus(gz)] == CORPUS

    lst = tmp_path / "list.json"
    lst.write_text(json.dumps([{"title": t, "text": x} for t, x in CORPUS]))
    assert [(p.title, p.text) for p in load_corpus(lst)] == CORPUS

    titles = tmp_path / "titles.json"
    titles.write_text(json.dumps({t: [x[:10], x[10:]] for t, x in CORPUS}))
    assert [(p.title, p.text) for p in load_corpus(titles)] == CORPUS

    hotpot = tmp_path / "hotpot.json"
    hotpot.write_text(json.dumps([{"question": "q1", "context": [[t, [x]] for t, x in CORPUS[:5]]},
                                  {"question": "q2", "context": [[t, [x]] for t, x in CORPUS[3:]]}]))
    assert [(p.title, p.text) for p in load_corpus(hotpot)] == CORPUS  # distinct paragraphs only


def test_load_corpus_malformed_rows_warn_with_line_or_raise(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [
        {"id": "0", "contents": '"A"\nalpha'}, "{not json", {"id": "2", "contents": 5},
        {"id": "3", "title": "B", "text": "beta"}, "[1, 2]"])
    with pytest.warns(CorpusWarning) as record:
        passages = load_corpus(path)
    assert [p.title for p in passages] == ["A", "B"]
    messages = [str(w.message) for w in record]
    assert any("bad.jsonl:2:" in m and "invalid JSON" in m for m in messages)
    assert any("bad.jsonl:3:" in m for m in messages) and any("bad.jsonl:5:" in m for m in messages)
    with pytest.raises(CorpusError, match=r"bad.jsonl:2: invalid JSON"):
        load_corpus(path, strict=True)


def test_load_corpus_errors(tmp_path):
    with pytest.raises(CorpusError, match="not found"):
        load_corpus(tmp_path / "missing.jsonl")
    (tmp_path / "c.txt").write_text("x")
    with pytest.raises(CorpusError, match="cannot tell the corpus format"):
        load_corpus(tmp_path / "c.txt")
    (tmp_path / "broken.json").write_text('[{"title": "a", "text": ')
    with pytest.raises(CorpusError, match="broken.json:1: invalid JSON"):
        load_corpus(tmp_path / "broken.json")
    write_jsonl(tmp_path / "empty.jsonl", [])
    with pytest.raises(CorpusError, match="no passages"):
        load_corpus(tmp_path / "empty.jsonl")


def test_duplicate_ids_made_unique(tmp_path):
    path = write_jsonl(tmp_path / "dup.jsonl", [{"id": "x", "contents": "one"}, {"id": "x", "contents": "two"}])
    ids = [p.id for p in load_corpus(path)]
    assert len(set(ids)) == 2 and ids[0] == "x"


def test_bm25_index_cached_on_disk_and_invalidated_by_changes(tmp_path, jsonl_corpus, monkeypatch):
    first = BM25Retriever.from_corpus(jsonl_corpus)
    cached = list((tmp_path / "cache" / "retrieval").glob("bm25-corpus.jsonl-*"))
    assert len(cached) == 1 and (cached[0] / "meta.json").is_file()

    import bm25s

    def no_build(*a, **k):
        raise AssertionError("index was rebuilt instead of loaded from the cache")

    with monkeypatch.context() as m:
        m.setattr(bm25s.BM25, "index", no_build)
        second = BM25Retriever.from_corpus(jsonl_corpus)
    q = ["theory of relativity"]
    assert [p.id for p in second.search(q, 3)[0]] == [p.id for p in first.search(q, 3)[0]]
    assert second.build_seconds == 0.0

    BM25Retriever.from_corpus(jsonl_corpus, k1=1.2)  # other settings -> another index
    with jsonl_corpus.open("a") as f:  # the corpus changes -> another index
        f.write(json.dumps({"id": "99", "contents": '"Zebra"\nStriped horse.'}) + "\n")
    third = BM25Retriever.from_corpus(jsonl_corpus)
    assert third.search(["Zebra"], 1)[0][0].id == "99"
    assert len(list((tmp_path / "cache" / "retrieval").glob("bm25-*"))) == 3


def test_damaged_cache_is_rebuilt(tmp_path, jsonl_corpus):
    BM25Retriever.from_corpus(jsonl_corpus)
    [folder] = (tmp_path / "cache" / "retrieval").glob("bm25-*")
    for f in (folder / "index").iterdir():
        f.write_bytes(b"garbage")
    retriever = BM25Retriever.from_corpus(jsonl_corpus)
    assert retriever.search(["Mount Everest"], 1)[0][0].title == "Mount Everest"
    assert retriever.build_seconds > 0  # rebuilt ...
    again = BM25Retriever.from_corpus(jsonl_corpus)
    assert again.build_seconds == 0.0  # ... and the repaired cache is used next time


class _Fixed:
    """A retriever with a fixed ranking (for fusion tests)."""

    def __init__(self, ids):
        self.ids = ids

    def search(self, queries, topk):
        return [[Passage(i, "", f"text {i}", 1.0) for i in self.ids[:topk]] for _ in queries]


def test_hybrid_reciprocal_rank_fusion():
    hybrid = HybridRetriever([_Fixed(["a", "b", "c"]), _Fixed(["c", "b", "d"])], k=60)
    [fused] = hybrid.search(["q"], topk=4)
    ids = [p.id for p in fused]
    assert ids == ["c", "b", "a", "d"]  # in both lists first; rank 1 in one list beats rank 3
    assert fused[0].score == pytest.approx(1 / 63 + 1 / 61)
    assert fused[1].score == pytest.approx(2 / 62)
    weighted = HybridRetriever([_Fixed(["a"]), _Fixed(["d"])], weights=[1.0, 3.0])
    assert [p.id for p in weighted.search(["q"], 2)[0]] == ["d", "a"]


def test_build_retriever_specs(tmp_path, jsonl_corpus):
    fixed = _Fixed(["a"])
    assert build_retriever(fixed) is fixed
    from masrl.retrieval import HttpRetriever

    http = build_retriever("http://127.0.0.1:9/")
    assert isinstance(http, HttpRetriever) and http.url == "http://127.0.0.1:9/retrieve"
    assert isinstance(build_retriever(str(jsonl_corpus)), BM25Retriever)
    bm25 = build_retriever({"type": "bm25", "corpus": str(jsonl_corpus), "k1": 1.2, "cache": False})
    assert bm25.settings["k1"] == 1.2
    import masrl.tasks.synthetic_kb  # noqa: F401 - registers the synthetic_kb type

    assert resolve_retriever({"type": "synthetic_kb", "seed": 3}) is resolve_retriever({"seed": 3, "type": "synthetic_kb"})
    assert isinstance(build_retriever("synthetic_kb"), BM25Retriever)
    with pytest.raises(ValueError, match="unknown retriever type"):
        build_retriever({"type": "faiss"})
    with pytest.raises(ValueError, match="needs 'corpus'"):
        build_retriever({"type": "bm25"})
    with pytest.raises(ValueError, match="needs 'url'"):
        build_retriever({"type": "http"})


def test_build_retriever_takes_a_catalogue_name(tmp_path, jsonl_corpus, monkeypatch):
    """A corpus by its `masrl data` name, found in the data folder; a missing one names the get line."""
    data = tmp_path / "data"
    (data / "corpus").mkdir(parents=True)
    (data / "corpus" / "flashrag_wiki18_sample1000.jsonl").write_bytes(jsonl_corpus.read_bytes())
    monkeypatch.setenv("MASRL_DATA_DIR", str(data))
    bm25 = build_retriever("wiki18_sample1000")
    assert isinstance(bm25, BM25Retriever) and bm25.search(["Amazon River"], 1)[0][0].title == "Amazon River"
    assert isinstance(build_retriever({"type": "bm25", "corpus": "wiki18_sample1000"}), BM25Retriever)
    monkeypatch.setenv("MASRL_DATA_DIR", str(tmp_path / "empty"))
    with pytest.raises(CorpusError, match="masrl data get wiki18_sample1000"):
        build_retriever("wiki18_sample1000")


# ---- real corpora from ../shared/data (skipped when absent) ---------------------------------

CORPUS_FILES = {
    "corpus/flashrag_wiki18_sample1000.jsonl": 1000,
    "corpus/searchr1_example_corpus.jsonl": 10,
    "corpus/hipporag_2wikimultihopqa_corpus.json": 6119,
    "corpus/hipporag_hotpotqa_train100_corpus.json": 994,
}


@pytest.mark.parametrize("rel,count", sorted(CORPUS_FILES.items()))
def test_real_corpus_files(rel, count):
    path = data_dir() / rel
    if not path.is_file():
        pytest.skip(f"{path} absent")
    with warnings.catch_warnings():
        warnings.simplefilter("error", CorpusWarning)
        passages = load_corpus(path)
    assert len(passages) == count
    assert all(p.text for p in passages)
    assert all(p.title for p in passages)
    if rel.endswith(".jsonl"):
        assert passages[0].title == "Evan Morris"
        [top] = BM25Retriever(passages).search([passages[5].title], 3)
        assert passages[5].title in [p.title for p in top]


def test_real_hotpotqa_bm25_gold_recall():
    qpath = data_dir() / "corpus/hipporag_hotpotqa_train100.json"
    cpath = data_dir() / "corpus/hipporag_hotpotqa_train100_corpus.json"
    if not (qpath.is_file() and cpath.is_file()):
        pytest.skip("HotpotQA-100 files absent")
    retriever = BM25Retriever.from_corpus(cpath)
    questions = json.loads(qpath.read_text())
    results = retriever.search([q["question"] for q in questions], topk=5)
    recall = []
    for q, top in zip(questions, results):
        gold = {t for t, _ in q["supporting_facts"]}
        recall.append(len(gold & {p.title for p in top}) / len(gold))
    assert sum(recall) / len(recall) > 0.6  # measured 0.76 with bm25s 0.3.16


def test_a_registered_retriever_type_is_built_from_a_spec(monkeypatch):
    import masrl.retrieval as retrieval

    monkeypatch.setattr(retrieval, "_REGISTERED", {})
    monkeypatch.setattr(retrieval, "_SHORTHANDS", set())
    made = []

    def build(**opts):
        made.append(opts)
        return _Fixed(["x"])

    with pytest.raises(ValueError, match=r"unknown retriever type 'mine'.*synthetic_kb comes with masrl.tasks"):
        build_retriever({"type": "mine"})
    retrieval.register_retriever_type("mine", build, shorthand=True)
    assert retrieval.retriever_types() == ("bm25", "dense", "hybrid", "http", "mine")
    assert isinstance(build_retriever({"type": "mine", "size": 3}), _Fixed)
    assert isinstance(build_retriever("mine"), _Fixed)
    assert made == [{"size": 3}, {}]
    with pytest.raises(ValueError, match="built in"):
        retrieval.register_retriever_type("bm25", build)


def test_passage_index_front_caps_topk_and_hands_text_queries():
    """The search front BM25 and dense share: no queries, no results; topk 0 gives empty lists; topk is
    capped to the corpus; queries reach top() as text."""
    from masrl.retrieval import PassageIndex

    class Echo(PassageIndex):
        def __init__(self, n):
            self.passages = [Passage(str(i), "", f"p{i}") for i in range(n)]
            self.calls = []

        def top(self, queries, k):
            self.calls.append((queries, k))
            return [self.passages[:k] for _ in queries]

    index = Echo(3)
    assert index.search([], 5) == [] and index.calls == []
    assert index.search(["a", "b"], 0) == [[], []] and index.calls == []
    assert [len(r) for r in index.search(["a", 7], 10)] == [3, 3]
    assert index.calls == [(["a", "7"], 3)]
    assert len(index) == 3
