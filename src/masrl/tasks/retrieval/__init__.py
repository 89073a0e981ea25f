"""Retrieval for search workflows: passages, the ``Retriever`` protocol, BM25 / dense / hybrid
retrievers over local corpora, an HTTP client and server speaking the Search-R1 API.

A workflow gets its retriever from ``team.params["retriever"]``: either an object with
``search(queries, topk)`` or a spec that :func:`build_retriever` understands, e.g.
``{"type": "bm25", "corpus": "path/corpus.jsonl"}`` or ``"http://127.0.0.1:8000"``.
"""
from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, Mapping

from masrl.errors import ConfigError
from masrl.tasks.retrieval.base import Passage, Retriever, RetrieverError, format_passages
from masrl.tasks.retrieval.bm25 import BM25Retriever
from masrl.tasks.retrieval.corpus import CorpusError, CorpusWarning, load_corpus
from masrl.tasks.retrieval.http import HttpRetriever
from masrl.tasks.retrieval.hybrid import HybridRetriever

__all__ = ["Passage", "Retriever", "RetrieverError", "format_passages", "BM25Retriever", "DenseRetriever",
           "HybridRetriever", "HttpRetriever", "load_corpus", "CorpusError", "CorpusWarning",
           "build_retriever", "resolve_retriever", "RETRIEVER_TYPES"]

RETRIEVER_TYPES = ("bm25", "dense", "hybrid", "http", "synthetic_kb")


def __getattr__(name: str):  # DenseRetriever imports torch/transformers lazily
    if name == "DenseRetriever":
        from masrl.tasks.retrieval.dense import DenseRetriever

        return DenseRetriever
    raise AttributeError(name)


def build_retriever(spec: Any) -> Retriever:
    """Make a retriever from a config value.

    - an object with ``.search`` is returned as it is;
    - ``"http://host:port[/retrieve]"`` -> :class:`HttpRetriever`;
    - ``"synthetic_kb"`` -> BM25 over the synthetic knowledge base (seed 0);
    - any other string is a corpus file -> :class:`BM25Retriever` (index cached on disk);
    - a mapping ``{"type": "bm25" | "dense" | "hybrid" | "http" | "synthetic_kb", ...}``, where
      ``corpus`` (and ``format``, ``cache``) name the corpus for bm25/dense/hybrid, ``url``,
      ``timeout``, ``retries`` configure http, and the other keys go to the constructor
      (BM25: ``k1``, ``b``, ``method``, ``stopwords``; hybrid: ``rrf_k``, ``depth``;
      synthetic_kb: the generator's arguments, e.g. ``seed``).
    """
    if hasattr(spec, "search") and callable(spec.search):
        return spec
    if isinstance(spec, (str, Path)):
        text = str(spec)
        if text.startswith(("http://", "https://")):
            return HttpRetriever(text)
        if text == "synthetic_kb":
            spec = {"type": "synthetic_kb"}
        else:
            spec = {"type": "bm25", "corpus": text}
    if not isinstance(spec, Mapping):
        raise ConfigError(f"retriever spec must be an object with .search, a URL, a corpus path or a mapping "
                          f"with 'type'; got {type(spec).__name__}")
    opts = dict(spec)
    kind = opts.pop("type", "bm25")
    if kind not in RETRIEVER_TYPES:
        raise ConfigError(f"unknown retriever type {kind!r}; expected one of {RETRIEVER_TYPES}")
    if kind == "http":
        if "url" not in opts:
            raise ConfigError("retriever type 'http' needs 'url'")
        return HttpRetriever(opts.pop("url"), **opts)
    if kind == "synthetic_kb":
        from masrl.tasks.retrieval.synthetic_kb import synthetic_kb_retriever

        return synthetic_kb_retriever(**opts)
    if "corpus" not in opts:
        raise ConfigError(f"retriever type {kind!r} needs 'corpus' (a corpus file path)")
    corpus = opts.pop("corpus")
    if isinstance(corpus, (str, Path)):  # a catalogue name (wiki18_sample1000) or a path, checked before indexing
        from masrl.tasks.retrieval.corpus import corpus_path

        corpus = corpus_path(corpus)
    common = {k: opts.pop(k) for k in ("format", "cache", "cache_root", "strict") if k in opts}
    if kind == "bm25":
        return BM25Retriever.from_corpus(corpus, **common, **opts)
    from masrl.tasks.retrieval.dense import DenseRetriever, SentenceEncoder

    encoder_opts = {k: opts.pop(k) for k in ("model_path", "device", "max_length", "batch_size") if k in opts}
    dense = DenseRetriever.from_corpus(corpus, encoder=SentenceEncoder(**encoder_opts), **common)
    if kind == "dense":
        return dense
    bm25_opts = {k: opts.pop(k) for k in ("k1", "b", "method", "stopwords") if k in opts}
    bm25 = BM25Retriever.from_corpus(corpus, **common, **bm25_opts)
    return HybridRetriever([bm25, dense], k=opts.pop("rrf_k", 60), **opts)


_RESOLVED: dict[str, Retriever] = {}
_RESOLVE_LOCK = threading.Lock()


def resolve_retriever(spec: Any) -> Retriever:
    """:func:`build_retriever`, memoized per spec so that episodes share one index (thread-safe)."""
    if hasattr(spec, "search") and callable(spec.search):
        return spec
    try:
        key = json.dumps(spec, sort_keys=True, default=str)
    except TypeError:
        return build_retriever(spec)
    with _RESOLVE_LOCK:
        if key not in _RESOLVED:
            _RESOLVED[key] = build_retriever(spec)
        return _RESOLVED[key]
