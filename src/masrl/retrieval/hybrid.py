"""Hybrid retrieval: reciprocal rank fusion (RRF) of several retrievers over the same corpus."""
from __future__ import annotations

from typing import Sequence

from masrl.retrieval.base import Passage, Retriever


class HybridRetriever:
    """Fuse rankings with RRF: ``score(p) = sum_r weight_r / (k + rank_r(p))`` (rank from 1).

    Each retriever is asked for ``depth`` passages (at least ``topk``); passages are matched by id,
    so the retrievers must index the same corpus.
    """

    name = "hybrid"

    def __init__(self, retrievers: Sequence[Retriever], *, k: int = 60, depth: int = 20,
                 weights: Sequence[float] | None = None):
        if not retrievers:
            raise ValueError("HybridRetriever needs at least one retriever")
        self.retrievers = list(retrievers)
        self.k, self.depth = k, depth
        self.weights = list(weights) if weights is not None else [1.0] * len(self.retrievers)
        if len(self.weights) != len(self.retrievers):
            raise ValueError("one weight per retriever")

    def search(self, queries: list[str], topk: int) -> list[list[Passage]]:
        if not queries:
            return []
        depth = max(self.depth, int(topk))
        rankings = [r.search(queries, depth) for r in self.retrievers]
        out = []
        for qi in range(len(queries)):
            fused: dict[str, float] = {}
            first_seen: dict[str, Passage] = {}
            for weight, ranking in zip(self.weights, rankings):
                for rank, p in enumerate(ranking[qi], start=1):
                    fused[p.id] = fused.get(p.id, 0.0) + weight / (self.k + rank)
                    first_seen.setdefault(p.id, p)
            best = sorted(fused, key=lambda pid: -fused[pid])[:max(0, int(topk))]
            out.append([first_seen[pid].with_score(fused[pid]) for pid in best])
        return out
