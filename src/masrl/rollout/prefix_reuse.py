"""Prefix reuse for the in-process engine: how one call's prompts enter the model, and the keys/values it
takes from and gives back to the prefix store (``masrl.rollout.prefix_cache.PrefixCache``).

Rows with the same prompt in one call (a GRPO group) are prefilled once ("unique rows"), and a prompt that
starts with the tokens of a row generated earlier in the same rollout reuses that row's keys and values
(``fill_prefixes``) and prefills only the new tokens. Rows leave their keys/values in the store when they
finish (``store_rows``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from masrl.rollout.base import GenRequest
from masrl.rollout.prefix_cache import PrefixCache, StoredBatch
from masrl.rollout.sampling import DecodeState

__all__ = ["PromptLayout", "fill_prefixes", "store_rows"]


@dataclass
class PromptLayout:
    """How one call's prompts enter the model: distinct prompts ("unique rows") once, each with the prefix it
    reuses; row ``i`` decodes from unique row ``inverse[i]``."""

    adapters: list[str | None]                   # per row
    uniq: list[tuple[str | None, tuple[int, ...]]]  # per unique row: (adapter, prompt tokens)
    inverse: list[int]
    hits: list                                   # per unique row: (stored batch, row, reused length) or None
    reuse: list[int]
    lengths: list[int]
    suffix: list[int]                            # prompt tokens left to prefill
    prefix_width: int
    width: int
    input_ids: torch.Tensor
    attention: torch.Tensor
    positions: torch.Tensor

    @classmethod
    def plan(cls, model, requests: Sequence[GenRequest], store: PrefixCache | None,
             pad_token_id: int) -> "PromptLayout":
        """Distinct prompts ("unique rows", prefilled once), their reused prefixes and the padded inputs
        (``store`` None: every row on its own, nothing reused)."""
        batch = len(requests)
        adapters = [r.adapter for r in requests]
        prompts = [tuple(r.prompt_ids) for r in requests]
        # distinct prompts ("unique rows") are prefilled once; `inverse[i]`: row i's unique row
        if store is not None:
            store.check_weights(model)
            first: dict[tuple, int] = {}
            inverse = [first.setdefault((adapters[i], prompts[i]), len(first)) for i in range(batch)]
            uniq = list(first)
        else:
            inverse, uniq = list(range(batch)), [(adapters[i], prompts[i]) for i in range(batch)]
        n_uniq = len(uniq)
        # reused prefix of every unique row (keys/values of an earlier row of this rollout)
        hits = [store.lookup(tokens, adapter) if store is not None and len(tokens) > store.block else None
                for adapter, tokens in uniq]
        reuse = [h[2] if h is not None else 0 for h in hits]
        lengths = [len(tokens) for _, tokens in uniq]
        suffix = [n - r for n, r in zip(lengths, reuse)]
        if store is not None:  # unique rows by the length left to prefill, for prefill chunks
            order = sorted(range(n_uniq), key=lambda u: suffix[u])
            rank = {u: i for i, u in enumerate(order)}
            uniq, hits, reuse, lengths, suffix = ([seq[u] for u in order] for seq in (uniq, hits, reuse, lengths, suffix))
            inverse = [rank[u] for u in inverse]
        if store is not None:
            store.prompt_tokens += sum(lengths)
            store.reused_tokens += sum(reuse)
        return cls.build(adapters, uniq, inverse, hits, reuse, lengths, suffix, pad_token_id)

    @classmethod
    def build(cls, adapters, uniq, inverse, hits, reuse, lengths, suffix, pad_token_id: int) -> "PromptLayout":
        n_uniq = len(uniq)
        prefix_width, suffix_width = max(reuse), max(suffix)
        width = prefix_width + suffix_width
        # layout of unique row u: reused prefix right-aligned to `prefix_width`, a masked gap, then its
        # remaining prompt tokens right-aligned to `width` (left padding when nothing is reused)
        input_ids = torch.full((n_uniq, suffix_width), pad_token_id, dtype=torch.long)
        attention = torch.zeros((n_uniq, width), dtype=torch.long)
        positions = torch.zeros((n_uniq, suffix_width), dtype=torch.long)
        for u, (_, tokens) in enumerate(uniq):
            r, n = reuse[u], suffix[u]
            input_ids[u, suffix_width - n:] = torch.tensor(tokens[r:], dtype=torch.long)
            attention[u, prefix_width - r:prefix_width] = 1
            attention[u, width - n:] = 1
            positions[u, suffix_width - n:] = torch.arange(r, r + n)
        return cls(adapters, uniq, inverse, hits, reuse, lengths, suffix, prefix_width, width, input_ids,
                   attention, positions)


def fill_prefixes(cache, hits, reuse, prefix_width: int, capacity: int, device) -> None:
    """Start every layer of ``cache`` from new buffers holding each unique row's reused prefix."""
    sources: dict[int, tuple[StoredBatch, list[int], list[int], list[list[int]]]] = {}
    for u, hit in enumerate(hits):
        if hit is None:
            continue
        stored, row, n = hit
        entry = sources.setdefault(id(stored), (stored, [], [], []))
        slots = stored.slots[row][:n].tolist()
        entry[1].append(u)
        entry[2].append(row)
        entry[3].append([slots[0]] * (prefix_width - n) + slots)  # the gap repeats a slot (masked)
    n_uniq, first = len(hits), next(iter(sources.values()))[0]
    # per source: a flat index into its buffers viewed as [rows * heads * capacity, dim], made once per buffer
    # shape (every layer's, in practice), so that a layer's prefixes are one gather and one copy
    plans = [(stored, None if us == list(range(n_uniq)) else torch.tensor(us, device=device),
              torch.tensor(rows)[:, None], torch.tensor(slots), {}) for stored, us, rows, slots in sources.values()]
    for li, layer in enumerate(cache.layers):
        k_src, v_src = first.keys[li], first.values[li]
        k = k_src.new_zeros((n_uniq, k_src.shape[1], capacity, k_src.shape[3]))
        v = v_src.new_zeros((n_uniq, v_src.shape[1], capacity, v_src.shape[3]))
        for stored, dest, src_rows, src_slots, flat in plans:
            for buf, src in ((k, stored.keys[li]), (v, stored.values[li])):
                _, heads, cap, dim = src.shape
                if (heads, cap) not in flat:
                    base = (src_rows * heads + torch.arange(heads)) * cap  # [rows, heads]
                    flat[heads, cap] = (base[:, :, None] + src_slots[:, None, :]).flatten().to(device)
                # [rows * heads * prefix, dim] -> [rows, heads, prefix, dim]
                got = src.reshape(-1, dim).index_select(0, flat[heads, cap]).view(len(src_rows), heads,
                                                                                   prefix_width, dim)
                if dest is None:
                    buf[:, :, :prefix_width].copy_(got)
                else:
                    buf[dest, :, :prefix_width] = got
        layer.prefill(k, v, prefix_width)


def store_rows(store: PrefixCache, cache, rows: Sequence[int], live: torch.Tensor | None,
               layout: PromptLayout, state: DecodeState) -> None:
    """Keep ``rows``' keys/values (prompt + fed response tokens) in ``store``; ``live``: the batch rows
    the cache buffers hold now (None: all)."""
    if not rows:
        return
    tokens_out, n_emitted = state.tokens_out, state.n_emitted
    prefix_width, width = layout.prefix_width, layout.width
    local = torch.tensor(rows) if live is None else torch.searchsorted(live, torch.tensor(rows))
    in_batch = tokens_out.shape[0] if live is None else live.numel()
    index = None if len(rows) == in_batch else local.to(cache.layers[0]._k.device)
    keys = [layer._k if index is None else layer._k.index_select(0, index) for layer in cache.layers]
    values = [layer._v if index is None else layer._v.index_select(0, index) for layer in cache.layers]
    tokens, slots, adapters = [], [], []
    for i in rows:
        u = layout.inverse[i]
        adapter, prompt = layout.uniq[u]
        n = int(n_emitted[i])
        fed = tokens_out[i, :max(n - 1, 0)].tolist()  # the last sampled token was never fed back
        tokens.append(prompt + tuple(fed))
        slots.append(torch.cat([torch.arange(prefix_width - layout.reuse[u], prefix_width),
                                torch.arange(width - layout.suffix[u], width + len(fed))]))
        adapters.append(adapter)
    nbytes = sum(t.numel() * t.element_size() for t in keys + values)
    store.add(StoredBatch(keys, values, tokens, slots, adapters, nbytes))
