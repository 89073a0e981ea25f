"""BM25 retrieval with the ``bm25s`` library; indexes of corpus files are cached on disk."""
from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from masrl.retrieval.base import Passage, PassageIndex
from masrl.retrieval.cache import cached_index
from masrl.retrieval.corpus import load_corpus


class BM25Retriever(PassageIndex):
    """Sparse lexical retrieval over ``passages`` (title and text are indexed together).

    Passages with a zero score (no query term in common) are not returned, so a result
    can hold fewer than ``topk`` passages.
    """

    name = "bm25"

    def __init__(self, passages: Sequence[Passage], *, k1: float = 1.5, b: float = 0.75,
                 method: str = "lucene", stopwords: str | None = "en", _index: Any = None):
        import bm25s

        if not passages:
            raise ValueError("BM25Retriever needs at least one passage")
        self.passages = list(passages)
        self.settings = {"k1": k1, "b": b, "method": method, "stopwords": stopwords, "fields": "title+text"}
        self.build_seconds = 0.0
        self._lock = threading.Lock()
        if _index is None:
            start = time.perf_counter()
            tokens = bm25s.tokenize([_index_text(p) for p in self.passages], stopwords=stopwords,
                                    show_progress=False)
            _index = bm25s.BM25(k1=k1, b=b, method=method)
            _index.index(tokens, show_progress=False)
            self.build_seconds = time.perf_counter() - start
        self._index = _index

    @classmethod
    def from_corpus(cls, path: str | Path, *, format: str = "auto", cache: bool = True,
                    cache_root: str | Path | None = None, strict: bool = False, **settings: Any) -> "BM25Retriever":
        """Read a corpus file and index it, or load its index from the cache.

        The cache key is the corpus path, size and mtime plus the BM25 settings; the cache lives
        under ``masrl.paths.cache_dir()/retrieval`` unless ``cache_root`` is given.
        """
        import bm25s

        passages = load_corpus(path, format, strict=strict)
        defaults = {"k1": 1.5, "b": 0.75, "method": "lucene", "stopwords": "en"}
        full = {**defaults, **settings}
        key_settings = {**full, "fields": "title+text", "format": format, "n": len(passages),
                        "bm25s": getattr(bm25s, "__version__", "?")}
        if not cache:
            return cls(passages, **full)

        def load(folder: Path, meta: dict) -> "BM25Retriever | None":
            index = bm25s.BM25.load(str(folder / "index"), load_corpus=False, show_progress=False)
            return cls(passages, **full, _index=index) if meta.get("n") == len(passages) else None

        def save(retriever: "BM25Retriever", tmp: Path) -> dict:
            retriever._index.save(str(tmp / "index"), show_progress=False)
            return {"n": len(passages), "settings": key_settings, "build_seconds": retriever.build_seconds}

        return cached_index("bm25", path, key_settings, cache_root=cache_root, load=load,
                            build=lambda: cls(passages, **full), save=save)

    def top(self, queries: list[str], k: int) -> list[list[Passage]]:
        import bm25s

        tokens = bm25s.tokenize(queries, stopwords=self.settings["stopwords"],
                                return_ids=False, show_progress=False)
        with self._lock:
            doc_ids, scores = self._index.retrieve(tokens, k=k, show_progress=False, n_threads=0)
        out = []
        for row_ids, row_scores in zip(np.asarray(doc_ids), np.asarray(scores)):
            out.append([self.passages[int(i)].with_score(float(s))
                        for i, s in zip(row_ids, row_scores) if s > 0])
        return out


def _index_text(p: Passage) -> str:
    return f"{p.title} {p.text}" if p.title else p.text
