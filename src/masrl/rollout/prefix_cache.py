"""The in-process engine's prefix store: keys/values of earlier rows of a rollout, found again by token prefix."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass
class StoredBatch:
    """One earlier engine call's cache buffers (per layer ``[rows, heads, capacity, head_dim]``)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    tokens: list[tuple[int, ...]]     # row -> the tokens whose keys/values are in the buffers, in order
    slots: list[torch.Tensor]         # row -> buffer position of each of those tokens
    adapters: list[str | None]
    nbytes: int


class PrefixCache:
    """Keys and values of the rows generated since the last ``clear``, found again by token prefix.

    A stored row covers its prompt and every response token that was fed back (all but the last).
    Lookup walks a chain of hashes over blocks of ``block`` tokens (like vLLM's automatic prefix
    caching), checks the match token by token, and extends it past the last full block; only rows
    decoded with the same adapter match. Keys and values only depend on the tokens, their positions
    (kept: reused rows keep their true position ids) and the weights, so the cache is dropped when
    the weights change (``check_weights``, and ``masrl.rollout.base.Engine.weights_changed``) and at the end
    of every rollout. ``max_bytes`` bounds the stored buffers (oldest calls are dropped first).
    """

    def __init__(self, max_bytes: int = 1 << 30, block: int = 16):
        self.max_bytes, self.block = max_bytes, block
        self.batches: list[StoredBatch] = []
        self._index: dict[int, list[tuple[StoredBatch, int]]] = {}  # block-chain hash -> rows with it
        self._weights: tuple | None = None
        self.lookups = self.hits = self.reused_tokens = self.prompt_tokens = 0

    def clear(self) -> None:
        self.batches, self._index = [], {}

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.batches)

    def check_weights(self, model: torch.nn.Module) -> None:
        """Drop everything if any parameter was replaced or changed in place since the last call."""
        try:
            key = tuple((p.data_ptr(), p._version) for p in model.parameters())
        except RuntimeError:  # inference tensors have no version counter: never trust stored rows
            key = None
        if key is None or key != self._weights:
            self.clear()
            self._weights = key

    def _chain(self, tokens: Sequence[int], adapter: str | None):
        h = hash(("masrl-prefix", adapter))
        for k in range(len(tokens) // self.block):
            h = hash((h, tuple(tokens[k * self.block:(k + 1) * self.block])))
            yield (k + 1) * self.block, h

    def lookup(self, tokens: tuple[int, ...], adapter: str | None) -> tuple[StoredBatch, int, int] | None:
        """(stored batch, row, reused length) of the longest stored prefix of ``tokens[:-1]``, or None."""
        self.lookups += 1
        deepest, n = None, 0
        for length, h in self._chain(tokens[:-1], adapter):
            rows = self._index.get(h)
            if rows is None:
                break
            deepest, n = rows, length
        if deepest is None:
            return None
        limit = len(tokens) - 1  # the last prompt token is always fed (its logits start decoding)
        best = None
        for batch, row in reversed(deepest):  # rows sharing the deepest block: the longest match wins
            source = batch.tokens[row]
            if source[:n] != tokens[:n]:  # a hash collision: not this row
                continue
            m, end = n, min(len(source), limit)
            while m < end and source[m] == tokens[m]:
                m += 1
            if best is None or m > best[2]:
                best = (batch, row, m)
        if best is not None:
            self.hits += 1
        return best

    def add(self, batch: StoredBatch) -> None:
        if batch.nbytes > self.max_bytes:
            return
        self.batches.append(batch)
        if self.nbytes <= self.max_bytes:
            self._add_to_index(batch)
            return
        while self.nbytes > self.max_bytes:
            self.batches.pop(0)
        self._reindex()

    def _add_to_index(self, batch: StoredBatch) -> None:
        for row, tokens in enumerate(batch.tokens):
            for _, h in self._chain(tokens, batch.adapters[row]):
                self._index.setdefault(h, []).append((batch, row))

    def _reindex(self) -> None:
        self._index = {}
        for batch in self.batches:
            self._add_to_index(batch)
