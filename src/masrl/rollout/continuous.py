"""Continuous batching for the in-process engine (``rollout.continuous_batching``): one running batch that
admits requests between decode steps (``ContinuousBatcher``).

An admission ends the running segment: its rows' keys/values go to the prefix store, and the rows still
decoding are carried into the new segment as requests whose prompt is prompt + emitted tokens, so the store
gives them back everything but the last sampled token, which the new prefill feeds (what their next decode
step would have fed); the admitted requests are prefilled beside them, with prefix reuse.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

import torch

from masrl.rollout.base import GenRequest, GenResult
from masrl.rollout.prefix_cache import PrefixCache
from masrl.rollout.prefix_reuse import PromptLayout, store_rows
from masrl.rollout.sampling import DecodeState
from masrl.rollout.static_decode import LiveRows, StaticDecoder, route_live_rows

if TYPE_CHECKING:
    from masrl.rollout.engine import TransformersEngine

__all__ = ["ContinuousBatcher", "Entry", "Segment"]


@dataclass
class Entry:
    """A request of the continuous batch, with what it emitted in earlier segments (a row carried over)."""

    request: GenRequest
    ticket: Any
    tokens: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)

    def carried(self) -> GenRequest:
        """The request that continues this row: its prompt + every token emitted so far (the last one not fed
        yet: the new segment prefills it), with the budget that is left."""
        r = self.request
        return GenRequest(list(r.prompt_ids) + self.tokens, r.temperature, r.top_p,
                          r.max_new_tokens - len(self.tokens), r.adapter)

    @property
    def extent(self) -> int:
        """The most positions the row can fill: prompt + budget."""
        return len(self.request.prompt_ids) + self.request.max_new_tokens


@dataclass
class Segment:
    """The running batch of continuous batching between two admissions: one prefill, then decode steps."""

    entries: list[Entry]
    layout: PromptLayout
    state: DecodeState
    rows: LiveRows
    logits: torch.Tensor
    delivered: torch.Tensor  # rows whose result went back
    step: int = 0


class ContinuousBatcher:
    """The engine's running batch: queued requests (``enqueue``) join it between decode steps (``step``).
    Prefill and compaction are the static decoder's; admission limits are the engine's ``max_batch_size`` and
    ``max_running_tokens``."""

    def __init__(self, engine: "TransformersEngine", decoder: StaticDecoder):
        self.engine, self.decoder = engine, decoder
        self.queue: list[Entry] = []
        self.segment: Segment | None = None

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """One rollout of continuous batching; on exit, rows still queued or decoding are dropped."""
        device = next(self.engine.model.parameters()).device
        # each step enters autocast anew; an open outer autocast keeps its cast weights between steps
        outer = torch.autocast(device.type, enabled=False) if self.engine.autocast else contextlib.nullcontext()
        try:
            with outer:
                yield
        finally:
            self.queue, self.segment = [], None

    def enqueue(self, request: GenRequest, ticket: Any) -> None:
        self.queue.append(Entry(request, ticket))

    @property
    def busy(self) -> bool:
        return bool(self.queue) or self.segment is not None

    def step(self, model) -> list[tuple[Any, GenResult]]:
        """Admit queued requests when it pays, then one decode step (call under the engine's decoding setup)."""
        if self.queue:
            self.admit(model)
        return self.advance(model)

    def admit(self, model) -> None:
        """Start a new segment with the running rows and the queued requests that fit, once the queue holds a
        quarter of the rows still decoding (each admission copies the running rows' keys/values twice)."""
        engine, seg = self.engine, self.segment
        going = [] if seg is None else [seg.entries[i] for i in (~seg.state.done).nonzero().squeeze(1).tolist()]
        if len(self.queue) < max(1, len(going) // 4):
            return
        taken = self.take_admissible(going)
        if not taken:
            return
        store = engine.prefix_store(model)
        if seg is not None:
            self.carry(seg, store)
        entries = going + taken
        requests = [e.carried() for e in entries]
        device = next(model.parameters()).device
        layout = self.decoder.layout(model, requests, store)
        carried = sum(layout.suffix[u] for u in {layout.inverse[i] for i in range(len(going))})
        engine.prefill_tokens -= carried  # counted apart: a carried row's first token is its next decode step's
        engine.readmitted_tokens += carried
        state = DecodeState(requests, eos=engine.eos, pad_token_id=engine.pad_token_id, device=device,
                            generator=engine.generator_for(torch.device(device)))
        _, logits, rows = self.decoder.start(model, layout, state.max_new, device, store)
        self.segment = Segment(entries, layout, state, rows, logits, torch.zeros(len(entries), dtype=torch.bool))

    def take_admissible(self, going: list[Entry]) -> list[Entry]:
        """Queued requests, first come first served, while the batch stays within ``max_batch_size`` rows and
        ``max_running_tokens`` (rows x the longest prompt + budget); an empty batch admits at least one."""
        longest = max((e.extent for e in going), default=0)
        taken: list[Entry] = []
        for entry in self.queue:
            rows, extent = len(going) + len(taken) + 1, max(longest, entry.extent)
            if (going or taken) and (rows > self.engine.max_batch_size
                                     or rows * extent > self.engine.max_running_tokens):
                break
            taken.append(entry)
            longest = extent
        self.queue = self.queue[len(taken):]
        return taken

    def restart(self) -> int:
        """New weights between two decode steps (``rollout.max_staleness``): the running segment ends without
        storing its keys/values (the old weights'), and its rows still decoding go back to the front of the queue
        with what they emitted, so the next step prefills them again with the new weights; the rows carried."""
        seg = self.segment
        if seg is None:
            return 0
        going = [seg.entries[i] for i in (~seg.state.done).nonzero().squeeze(1).tolist()]
        self.carry(seg, None)
        self.queue = going + self.queue
        return len(going)

    def carry(self, seg: Segment, store: PrefixCache | None) -> None:
        """End ``seg``: its rows' keys/values go to the prefix store, rows still decoding keep what they emitted."""
        state, rows = seg.state, seg.rows
        for i in (~state.done).nonzero().squeeze(1).tolist():
            n = int(state.n_emitted[i])
            seg.entries[i].tokens += state.tokens_out[i, :n].tolist()
            seg.entries[i].logps += state.logps_out[i, :n].tolist()
        if store is not None:
            kept = list(range(len(seg.entries))) if rows.live is None else rows.live.tolist()
            store_rows(store, rows.cache, kept, rows.live, seg.layout, state)
        self.segment = None

    def advance(self, model) -> list[tuple[Any, GenResult]]:
        """One decode step of the running segment (the rows' next tokens); the results of rows that stopped."""
        engine, seg = self.engine, self.segment
        if seg is None:
            return []
        state, rows, layout = seg.state, seg.rows, seg.layout
        all_done = state.sample(seg.step, seg.logits)
        finished = self.deliver(seg)
        store = engine.prefix_store(model)
        if all_done:
            self.carry(seg, store)
            return finished
        if engine.compact_finished and engine.preallocate_cache and engine.preallocatable(model) \
                and rows.should_compact(state.done):
            with contextlib.ExitStack() as routing:  # the routing compact() installs is entered again below
                self.decoder.compact(model, rows, state, layout, store, routing)
        with route_live_rows(model, rows):
            seg.logits = rows.forward(model, state.feed(), seg.logits, layout.width + seg.step + 1)
        seg.step += 1
        return finished

    def deliver(self, seg: Segment) -> list[tuple[Any, GenResult]]:
        """``(ticket, result)`` of the rows that stopped since the last call."""
        state = seg.state
        newly = (state.done & ~seg.delivered).nonzero().squeeze(1).tolist()
        seg.delivered |= state.done
        out = []
        for i in newly:
            entry, n = seg.entries[i], int(state.n_emitted[i])
            tokens = entry.tokens + state.tokens_out[i, :n].tolist()
            logps = entry.logps + state.logps_out[i, :n].tolist()
            self.engine.tokens_generated += len(tokens)
            out.append((entry.ticket, GenResult(tokens, logps, truncated=not bool(state.stopped[i]))))
        return out
