"""The one index-cache step of the retrievers (retrieval/cache.py: cached_index)."""
from __future__ import annotations

import json
import logging

import pytest

from masrl.retrieval.cache import cached_index


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"id": str(i), "contents": f'"T{i}"\nword{i} shared text'}) + "\n"
                            for i in range(4)))
    return path


def _cache(tmp_path, corpus, builds, *, n=4, load_n=None):
    def build():
        builds.append(1)
        return {"n": n}

    def save(index, tmp):
        (tmp / "index.json").write_text(json.dumps(index))
        return {"n": index["n"]}

    def load(folder, meta):
        index = json.loads((folder / "index.json").read_text())
        return index if meta["n"] == (load_n if load_n is not None else n) else None

    return cached_index("toy", corpus, {"k": 1}, cache_root=tmp_path / "cache", load=load, build=build, save=save)


def test_built_once_then_loaded_and_stale_or_damaged_rebuilt(tmp_path, corpus, caplog):
    builds: list[int] = []
    assert _cache(tmp_path, corpus, builds) == {"n": 4} and len(builds) == 1
    [folder] = (tmp_path / "cache").glob("toy-c.jsonl-*")
    assert json.loads((folder / "meta.json").read_text()) == {"n": 4}
    assert _cache(tmp_path, corpus, builds) == {"n": 4} and len(builds) == 1  # loaded, not rebuilt
    with caplog.at_level(logging.WARNING, logger="masrl.retrieval.cache"):
        _cache(tmp_path, corpus, builds, load_n=5)  # load says "does not match" -> rebuilt
        (folder / "index.json").write_text("garbage")
        _cache(tmp_path, corpus, builds)  # unreadable -> rebuilt
    assert len(builds) == 3
    messages = [r.getMessage() for r in caplog.records]
    assert any("does not match the corpus; rebuilding" in m for m in messages)
    assert any("unreadable" in m and "rebuilding" in m for m in messages)
    assert _cache(tmp_path, corpus, builds) == {"n": 4} and len(builds) == 3  # the repaired cache is used


def test_dense_embeddings_cached_with_a_real_tiny_encoder(tmp_path, corpus, monkeypatch):
    torch = pytest.importorskip("torch")
    from transformers import BertConfig, BertModel, BertTokenizer

    from masrl.retrieval.dense import DenseRetriever, SentenceEncoder

    model_dir = tmp_path / "tiny-bert"
    model_dir.mkdir()
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "shared", "text", "t"] + [f"word{i}" for i in range(4)]
    (model_dir / "vocab.txt").write_text("\n".join(words) + "\n")
    BertTokenizer(str(model_dir / "vocab.txt")).save_pretrained(str(model_dir))
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=len(words), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32)).save_pretrained(str(model_dir))
    encoder = SentenceEncoder(model_dir)
    first = DenseRetriever.from_corpus(corpus, encoder=encoder, cache_root=tmp_path / "cache")
    assert first.build_seconds > 0 and len(list((tmp_path / "cache").glob("dense-c.jsonl-*"))) == 1

    calls = []
    real_encode = encoder.encode
    monkeypatch.setattr(encoder, "encode", lambda texts: calls.append(len(texts)) or real_encode(texts))
    second = DenseRetriever.from_corpus(corpus, encoder=encoder, cache_root=tmp_path / "cache")
    assert calls == [] and second.build_seconds == 0.0  # loaded: no passage was encoded
    assert torch.equal(second.embeddings, first.embeddings)
    assert [p.id for p in second.search(["word2"], 4)[0]] == [p.id for p in first.search(["word2"], 4)[0]]
