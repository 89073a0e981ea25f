"""Retrieval for search workflows: passages, the ``Retriever`` protocol, BM25 / dense / hybrid
retrievers over local corpora, an HTTP client and server speaking the Search-R1 API.

A service below the tasks and tools (the search task, ``tools.search_tool`` and ``masrl
serve-retriever`` use it); it imports nothing above ``masrl.catalog`` and ``masrl.io``.

A workflow gets its retriever from ``team.params["retriever"]``: either an object with
``search(queries, topk)`` or a spec that ``build_retriever`` understands, e.g.
``{"type": "bm25", "corpus": "path/corpus.jsonl"}`` or ``"http://127.0.0.1:8000"``.
"""
from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, Callable, Mapping

from masrl.errors import ConfigError
from masrl.retrieval.base import Passage, PassageIndex, Retriever, RetrieverError, format_passages
from masrl.retrieval.bm25 import BM25Retriever
from masrl.retrieval.corpus import CorpusError, CorpusWarning, load_corpus
from masrl.retrieval.http import HttpRetriever
from masrl.retrieval.hybrid import HybridRetriever

__all__ = ["Passage", "PassageIndex", "Retriever", "RetrieverError", "format_passages", "BM25Retriever",
           "DenseRetriever", "HybridRetriever", "HttpRetriever", "load_corpus", "CorpusError", "CorpusWarning",
           "build_retriever", "resolve_retriever", "register_retriever_type", "retriever_types", "RETRIEVER_TYPES"]

RETRIEVER_TYPES = ("bm25", "dense", "hybrid", "http")  # built in; register_retriever_type adds more
_REGISTERED: dict[str, Callable[..., Retriever]] = {}
_SHORTHANDS: set[str] = set()


def register_retriever_type(name: str, build: Callable[..., Retriever], *, shorthand: bool = False) -> None:
    """Add a retriever ``type`` to ``build_retriever``: the spec ``{"type": name, **opts}`` builds
    ``build(**opts)``; with ``shorthand`` the bare string ``name`` is that spec with no options.

    The search task registers ``synthetic_kb`` this way (``masrl.tasks.synthetic_kb``); a user package
    registers its own retriever the same way when it is imported.
    """
    if name in RETRIEVER_TYPES:
        raise ValueError(f"retriever type {name!r} is built in; choose another name")
    _REGISTERED[name] = build
    if shorthand:
        _SHORTHANDS.add(name)


def retriever_types() -> tuple[str, ...]:
    """Every retriever ``type`` a spec may name: the built-in ones, then the registered ones."""
    return RETRIEVER_TYPES + tuple(sorted(_REGISTERED))


def __getattr__(name: str):  # DenseRetriever imports torch/transformers lazily
    if name == "DenseRetriever":
        from masrl.retrieval.dense import DenseRetriever

        return DenseRetriever
    raise AttributeError(name)


def build_retriever(spec: Any) -> Retriever:
    """Make a retriever from a config value.

    - an object with ``.search`` is returned as it is;
    - ``"http://host:port[/retrieve]"`` -> ``HttpRetriever``;
    - the name of a type registered with ``shorthand=True`` (``"synthetic_kb"``: BM25 over the
      synthetic knowledge base, seed 0) -> that type with no options;
    - any other string is a corpus file -> ``BM25Retriever`` (index cached on disk);
    - a mapping ``{"type": "bm25" | "dense" | "hybrid" | "http" | a registered type, ...}``, where
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
        if text in _SHORTHANDS:
            spec = {"type": text}
        else:
            spec = {"type": "bm25", "corpus": text}
    if not isinstance(spec, Mapping):
        raise ConfigError(f"retriever spec must be an object with .search, a URL, a corpus path or a mapping "
                          f"with 'type'; got {type(spec).__name__}")
    opts = dict(spec)
    kind = opts.pop("type", "bm25")
    if kind in _REGISTERED:
        return _REGISTERED[kind](**opts)
    if kind not in RETRIEVER_TYPES:
        raise ConfigError(f"unknown retriever type {kind!r}; expected one of {retriever_types()} (a type that a "
                          f"package registers is known once the package is imported: synthetic_kb comes with "
                          f"masrl.tasks.synthetic_kb)")
    if kind == "http":
        if "url" not in opts:
            raise ConfigError("retriever type 'http' needs 'url'")
        return HttpRetriever(opts.pop("url"), **opts)
    if "corpus" not in opts:
        raise ConfigError(f"retriever type {kind!r} needs 'corpus' (a corpus file path)")
    corpus = opts.pop("corpus")
    if isinstance(corpus, (str, Path)):  # a catalogue name (wiki18_sample1000) or a path, checked before indexing
        from masrl.retrieval.corpus import corpus_path

        corpus = corpus_path(corpus)
    common = {k: opts.pop(k) for k in ("format", "cache", "cache_root", "strict") if k in opts}
    if kind == "bm25":
        return BM25Retriever.from_corpus(corpus, **common, **opts)
    from masrl.retrieval.dense import DenseRetriever, SentenceEncoder

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
    """``build_retriever``, memoized per spec so that episodes share one index (thread-safe)."""
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
