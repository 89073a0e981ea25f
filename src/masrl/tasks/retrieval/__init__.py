"""Deprecated: retrieval moved to ``masrl.retrieval`` (the synthetic knowledge base to
``masrl.tasks.synthetic_kb``). This package re-exports it for one release and warns on import;
import from ``masrl.retrieval`` instead."""
import warnings

from masrl.retrieval import (RETRIEVER_TYPES, BM25Retriever, CorpusError, CorpusWarning, HttpRetriever,
                             HybridRetriever, Passage, Retriever, RetrieverError, build_retriever, format_passages,
                             load_corpus, resolve_retriever)

__all__ = ["Passage", "Retriever", "RetrieverError", "format_passages", "BM25Retriever", "DenseRetriever",
           "HybridRetriever", "HttpRetriever", "load_corpus", "CorpusError", "CorpusWarning",
           "build_retriever", "resolve_retriever", "RETRIEVER_TYPES"]

warnings.warn("masrl.tasks.retrieval is deprecated: import from masrl.retrieval (this path goes away in the "
              "next release)", DeprecationWarning, stacklevel=2)


def __getattr__(name: str):  # DenseRetriever imports torch/transformers lazily
    if name == "DenseRetriever":
        from masrl.retrieval.dense import DenseRetriever

        return DenseRetriever
    raise AttributeError(name)
