"""Static decode for the in-process engine: one call's batch is laid out, prefilled and decoded until every
row is done (``StaticDecoder``); rows that finish early leave the model's batch (``LiveRows``).

The decoder is a collaborator of ``masrl.rollout.engine.TransformersEngine``: it reads the engine's
settings (padding, stop tokens, cache preallocation, compaction) and its precision setup (the cache dtype,
the fast decode step, the sampling generator), and counts prefill and generated tokens on the engine.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Sequence

import torch

from masrl.models.fast_decode import FastDecode
from masrl.rollout.base import GenRequest, GenResult
from masrl.rollout.kv_cache import output_cache, preallocated_cache, with_cache
from masrl.rollout.prefix_cache import PrefixCache
from masrl.rollout.prefix_reuse import PromptLayout, fill_prefixes, store_rows
from masrl.rollout.sampling import DecodeState, run_decode

if TYPE_CHECKING:
    from masrl.rollout.engine import TransformersEngine

__all__ = ["LiveRows", "StaticDecoder", "route_live_rows", "route_rows"]


class LiveRows:
    """The rows still in the model's batch (``live``: None = all) with their cache, mask and next positions.
    Finished rows may leave it (``keep``); sampling always covers every row."""

    def __init__(self, cache, mask: torch.Tensor, pos: torch.Tensor, batch: int, device,
                 fast: FastDecode | None = None, adapters: Sequence[str | None] = ()):
        self.cache, self.mask, self.pos, self.batch, self.device = cache, mask, pos, batch, device
        self.fast = fast  # decode steps without transformers' forward (masrl.models.fast_decode), or None
        self.live: torch.Tensor | None = None
        self.live_dev: torch.Tensor | None = None
        # each row's LoRA adapter (None: the base model) while any row names one, else None (PEFT's own forward)
        self.adapters = tuple(adapters) if any(a is not None for a in adapters) else None
        self.routes = self.adapters  # those of the rows in the batch

    def should_compact(self, done: torch.Tensor) -> bool:
        """A quarter of the rows in the model's batch are done."""
        in_batch = self.batch if self.live is None else self.live.numel()
        return in_batch - int((~done).sum()) >= max(1, in_batch // 4)

    def keep(self, local: torch.Tensor, keep_rows: torch.Tensor) -> None:
        """Keep only ``keep_rows`` (``local``: their index among the rows in the batch now)."""
        local_dev = local.to(self.device)
        for layer in self.cache.layers:
            layer.select_rows(local_dev)
        self.mask, self.pos = self.mask.index_select(0, local_dev), self.pos.index_select(0, local_dev)
        self.live, self.live_dev = keep_rows, keep_rows.to(self.device)
        if self.adapters is not None:
            self.routes = tuple(self.adapters[i] for i in keep_rows.tolist())

    def forward(self, model, feed: torch.Tensor, logits: torch.Tensor, mask_len: int) -> torch.Tensor:
        """One decode step on the rows in the batch; returns every row's next logits."""
        feed = (feed if self.live is None else feed.index_select(0, self.live)).to(self.device)
        if self.fast is not None:
            new = self.fast.step(feed, self.mask[:, :mask_len], self.pos, self.cache, self.routes)
        else:
            out = model(input_ids=feed[:, None], attention_mask=self.mask[:, :mask_len],
                        position_ids=self.pos[:, None], use_cache=True, **with_cache(self.cache))
            self.cache, new = output_cache(out), out.logits[:, -1, :]
        logits = new if self.live is None else logits.index_copy(0, self.live_dev, new)
        self.pos = self.pos + 1
        return logits


def route_rows(model, adapters: Sequence[str | None] | None) -> contextlib.AbstractContextManager:
    """Per-row LoRA adapters for the forwards inside (``mixed_adapters``), or nothing (``adapters`` None, or
    None for every row)."""
    if adapters is None or all(a is None for a in adapters):
        return contextlib.nullcontext()
    from masrl.models.lora import mixed_adapters

    return mixed_adapters(model, list(adapters))


def route_live_rows(model, rows: LiveRows) -> contextlib.AbstractContextManager:
    """The adapters of the rows in the batch (``rows.routes``; a row left with base rows only stays routed:
    the base model, not PEFT's active adapter), or nothing when no row of the batch named one or the fast
    decode step runs (it routes the rows itself; the prefill checked the names)."""
    if rows.routes is None or rows.fast is not None:
        return contextlib.nullcontext()
    from masrl.models.lora import mixed_adapters

    return mixed_adapters(model, list(rows.routes))


class StaticDecoder:
    """One batch from prefill to its last row: lay out the prompts (reusing stored prefixes), prefill them,
    then sample until every row is done; finished rows leave the batch once a quarter of it is done."""

    def __init__(self, engine: "TransformersEngine"):
        self.engine = engine

    def decode(self, model, requests: Sequence[GenRequest]) -> list[GenResult]:
        """Lay out the prompts, prefill them (reusing stored prefixes), then sample until every row is done."""
        engine = self.engine
        device = next(model.parameters()).device
        store = engine.prefix_store(model)
        layout = self.layout(model, requests, store)
        state = DecodeState(requests, eos=engine.eos, pad_token_id=engine.pad_token_id, device=device,
                            generator=engine.generator_for(torch.device(device)))
        cache, logits, rows = self.start(model, layout, state.max_new, device, store)
        with contextlib.ExitStack() as routing:
            routing.enter_context(route_rows(model, layout.adapters))
            compact = engine.compact_finished and engine.preallocate_cache and engine.preallocatable(model)

            def forward(step: int, logits: torch.Tensor) -> torch.Tensor:
                if compact and rows.should_compact(state.done):
                    self.compact(model, rows, state, layout, store, routing)
                return rows.forward(model, state.feed(), logits, layout.width + step + 1)

            run_decode(state, logits, forward)
        results = state.results()
        engine.tokens_generated += sum(len(r.response_ids) for r in results)
        if store is not None:
            kept = list(range(len(requests))) if rows.live is None else rows.live.tolist()
            store_rows(store, rows.cache, kept, rows.live, layout, state)
        return results

    def layout(self, model, requests: Sequence[GenRequest], store: PrefixCache | None) -> PromptLayout:
        """The call's ``PromptLayout``; the prompt tokens it leaves to prefill are counted on the engine."""
        layout = PromptLayout.plan(model, requests, store, self.engine.pad_token_id)
        self.engine.prefill_tokens += sum(layout.suffix)
        return layout

    def start(self, model, layout: PromptLayout, max_new: int, device, store: PrefixCache | None):
        """Prefill every unique row and give each row its unique row's cache: (cache, first logits, rows)."""
        engine = self.engine
        batch, width = len(layout.inverse), layout.width
        input_ids, positions = layout.input_ids.to(device), layout.positions.to(device)
        cache = (preallocated_cache(model, width + max_new, engine.cache_dtype(model)) if engine.preallocate_cache
                 else None)
        if layout.prefix_width:
            fill_prefixes(cache, layout.hits, layout.reuse, layout.prefix_width, width + max_new, device)
        cache, logits = self.prefill(model, cache, input_ids, layout.attention.to(device), positions, layout.uniq,
                                     layout.suffix, layout.prefix_width, chunked=store is not None)
        attention, next_pos = layout.attention, torch.tensor(layout.lengths, dtype=torch.long)
        if layout.inverse != list(range(batch)):  # every row of a group gets its unique row's cache and first logits
            rows = torch.tensor(layout.inverse, dtype=torch.long, device=device)
            for layer in cache.layers:
                layer.select_rows(rows)
            logits, attention = logits.index_select(0, rows), attention[layout.inverse]
            next_pos = next_pos[layout.inverse]
        next_pos = next_pos.to(device)
        # the mask for prompt + every decode step, allocated once (sliced per step)
        full_mask = torch.cat([attention, torch.ones((batch, max_new), dtype=attention.dtype)], 1).to(device)
        return cache, logits, LiveRows(cache, full_mask, next_pos, batch, device, engine.fast_decoder(model, cache),
                                       layout.adapters)

    def compact(self, model, rows: LiveRows, state: DecodeState, layout: PromptLayout,
                store: PrefixCache | None, routing: contextlib.ExitStack) -> None:
        """A quarter of the batch has finished: drop those rows (their keys/values go to the prefix store)
        instead of decoding padding for them until the longest row ends."""
        done, live = state.done, rows.live
        keep_rows = (~done).nonzero().squeeze(1)
        local = keep_rows if live is None else torch.searchsorted(live, keep_rows)
        if store is not None:
            batch = done.numel()
            gone = done.clone() if live is None else torch.zeros(batch, dtype=torch.bool).index_fill_(0, live, True) & done
            store_rows(store, rows.cache, gone.nonzero().squeeze(1).tolist(), live, layout, state)
        rows.keep(local, keep_rows)
        routing.enter_context(route_live_rows(model, rows))

    def prefill(self, model, cache, input_ids, attention, positions, uniq, suffix, prefix_width: int,
                chunked: bool):
        """Run the prompts' remaining tokens; returns (cache, logits of each row's last prompt token).

        ``chunked``: rows (sorted by ``suffix``, the tokens each still needs) are run in up to 4 row
        ranges, each padded only to its own longest suffix, when that saves at least a quarter of the
        padded tokens; every range writes its rows of the same cache buffers (its suffixes end at the
        same position, the gap before them stays masked). With the engine's ``max_prefill_tokens`` every range is
        split further (``within_tokens``), with or without ``chunked``, where the cache is preallocated.
        """
        width, n_rows = attention.shape[1], len(uniq)
        bounds = self.prefill_chunks(suffix) if chunked else [(0, n_rows)]
        if cache is not None:  # row ranges write into the preallocated buffers: rollout.max_prefill_tokens
            bounds = self.within_tokens(bounds, suffix, self.engine.max_prefill_tokens)
        if len(bounds) == 1:
            with route_rows(model, [a for a, _ in uniq]):  # the prompt's last position only: no prefill logits
                out = model(input_ids=input_ids, attention_mask=attention, position_ids=positions,
                            use_cache=True, logits_to_keep=1, **with_cache(cache))
            return output_cache(out), out.logits[:, -1, :]
        logits = {}
        # each range padded to its longest suffix (its last row's when sorted: prefix reuse sorts them)
        spans = [(start, end, max(suffix[start:end])) for start, end in bounds]
        for start, end, span in sorted(spans, key=lambda r: -r[2]):  # the longest first: it allocates
            for layer in cache.layers:
                layer.focus(slice(start, end), width - span, n_rows)
            with route_rows(model, [a for a, _ in uniq[start:end]]):
                out = model(input_ids=input_ids[start:end, -span:], attention_mask=attention[start:end],
                            position_ids=positions[start:end, -span:], use_cache=True, logits_to_keep=1,
                            **with_cache(cache))
            logits[start] = out.logits[:, -1, :]
        for layer in cache.layers:
            layer.focus(slice(None), width, n_rows)
        return cache, torch.cat([logits[start] for start in sorted(logits)])

    @staticmethod
    def within_tokens(bounds: list[tuple[int, int]], suffix: Sequence[int],
                      budget: int | None) -> list[tuple[int, int]]:
        """``bounds`` with every row range split into consecutive ranges of at most ``budget`` tokens, rows x the
        range's longest ``suffix`` (at least one row each; None: unchanged)."""
        if budget is None:
            return bounds
        out = []
        for a, b in bounds:
            start = a
            while start < b:
                end, longest = start + 1, suffix[start]
                while end < b and (end + 1 - start) * max(longest, suffix[end]) <= budget:
                    longest = max(longest, suffix[end])
                    end += 1
                out.append((start, end))
                start = end
        return out

    @staticmethod
    def prefill_chunks(suffix: Sequence[int], max_chunks: int = 4) -> list[tuple[int, int]]:
        """Row ranges of sorted ``suffix`` lengths: split where it saves the most padding, while a split
        saves at least a quarter of the padded tokens (each extra forward has a fixed cost)."""
        bounds = [(0, len(suffix))]
        while len(bounds) < max_chunks:
            best = None
            for bi, (a, b) in enumerate(bounds):
                for cut in range(a + 1, b):
                    if suffix[cut - 1] == suffix[cut]:
                        continue
                    saved = (cut - a) * (suffix[b - 1] - suffix[cut - 1])
                    if best is None or saved > best[0]:
                        best = (saved, bi, cut)
            padded = sum((b - a) * suffix[b - 1] for a, b in bounds)
            if best is None or best[0] < 0.25 * padded:
                break
            _, bi, cut = best
            a, b = bounds[bi]
            bounds[bi:bi + 1] = [(a, cut), (cut, b)]
        return bounds
