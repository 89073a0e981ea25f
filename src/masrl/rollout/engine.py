"""Rollout engines: generate token ids and per-token logprobs for a batch of prompts.

``TransformersEngine`` runs batched KV-cache decoding with any transformers causal LM.
Each row has its own temperature, top-p and token budget, so agents that share a policy
(and have different sampling settings) are generated in one batch. Logprobs are
``log_softmax(logits / temperature)`` at the sampled token (top-p does not change them),
which is what the trainer recomputes, so they can serve as the PPO "old" logprobs.

Prefix caching (``prefix_cache=True``, the default): rows with the same prompt in one call (a GRPO
group) are prefilled once, and a prompt that starts with the tokens of a row generated earlier in
the same rollout (a multi-agent workflow's next turn re-reads the conversation so far) reuses that
row's keys and values and prefills only the new tokens. See :class:`PrefixCache`.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch


@dataclass
class GenRequest:
    prompt_ids: list[int]
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    adapter: str | None = None  # LoRA adapter this row decodes with (per-agent adapters)


@dataclass
class GenResult:
    response_ids: list[int]
    logprobs: list[float]
    truncated: bool  # hit max_new_tokens without emitting a stop token


class Engine(Protocol):
    def generate(self, requests: Sequence[GenRequest]) -> list[GenResult]: ...


def _sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
            generator: torch.Generator | None, *,
            plan: "_SamplePlan | None" = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; returns (tokens, logprob of each token under logits/T).

    ``plan``: the batch's sampling settings digested once per batch (see :class:`_SamplePlan`); the
    result is identical with and without it.
    """
    if plan is None:
        plan = _SamplePlan(temperature, top_p)
    logits = logits.float()
    if plan.temp_col is not None:  # dividing by 1.0 is exact, so an all-1 batch skips it
        logits = logits / plan.temp_col
    logp = torch.log_softmax(logits, dim=-1)
    probs = logp.exp()
    if plan.any_top_p:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        cum = sorted_p.cumsum(-1)
        drop = (cum - sorted_p) >= top_p[:, None]  # keep the smallest prefix with mass >= top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    if plan.any_greedy:
        tokens = torch.where(plan.greedy, logp.argmax(-1), tokens)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


class _SamplePlan:
    """Per-batch constants of :func:`_sample` (computed once, not once per decode step)."""

    def __init__(self, temperature: torch.Tensor, top_p: torch.Tensor):
        self.greedy = temperature <= 0
        self.any_greedy = bool(self.greedy.any())
        temp = torch.where(self.greedy, torch.ones_like(temperature), temperature)
        self.temp_col = None if bool((temp == 1.0).all()) else temp[:, None]
        self.any_top_p = bool((top_p < 1.0).any())


class _PreallocatedLayer:
    """Factory of the preallocated cache layer class (built lazily: transformers is imported on use)."""

    cls = None

    @classmethod
    def get(cls):
        if cls.cls is None:
            from transformers.cache_utils import DynamicLayer

            class PreallocatedLayer(DynamicLayer):
                """Keys/values written in place into ``[batch, heads, capacity, head_dim]`` buffers.

                ``prefill(keys, values, filled)`` starts the layer from buffers whose first ``filled``
                positions are already set (reused prefixes); otherwise the first update allocates them.
                """

                def __init__(self, capacity: int):
                    super().__init__()
                    self.capacity = capacity
                    self._filled = 0
                    self._rows = slice(None)  # the batch rows the next forward covers (prefill chunks)
                    self._total_rows: int | None = None

                def prefill(self, keys: torch.Tensor, values: torch.Tensor, filled: int) -> None:
                    self._k, self._v, self._filled = keys, values, filled
                    self.dtype, self.device = keys.dtype, keys.device
                    self.keys, self.values = keys[:, :, :filled], values[:, :, :filled]
                    self.is_initialized = True

                def focus(self, rows: slice, filled: int, total_rows: int) -> None:
                    """The next forward covers batch ``rows`` only, after ``filled`` positions."""
                    self._rows, self._filled, self._total_rows = rows, filled, total_rows
                    if self.is_initialized:
                        self.keys, self.values = self._k[rows, :, :filled], self._v[rows, :, :filled]

                def update(self, key_states, value_states, *args, **kwargs):
                    if not self.is_initialized:
                        self.dtype, self.device = key_states.dtype, key_states.device
                        b, h, _, d = key_states.shape
                        b = self._total_rows or b
                        self._k = key_states.new_zeros((b, h, self.capacity, d))
                        self._v = value_states.new_zeros((b, h, self.capacity, value_states.shape[-1]))
                        self.is_initialized = True
                    start, end = self._filled, self._filled + key_states.shape[-2]
                    if end > self._k.shape[-2]:  # longer than planned: grow (never happens in _decode)
                        grow = max(end, 2 * self._k.shape[-2]) - self._k.shape[-2]
                        self._k = torch.cat([self._k, self._k.new_empty((*self._k.shape[:2], grow, self._k.shape[-1]))], -2)
                        self._v = torch.cat([self._v, self._v.new_empty((*self._v.shape[:2], grow, self._v.shape[-1]))], -2)
                    rows = self._rows
                    self._k[rows, :, start:end].copy_(key_states)
                    self._v[rows, :, start:end].copy_(value_states)
                    self._filled = end
                    self.keys, self.values = self._k[rows, :, :end], self._v[rows, :, :end]
                    return self.keys, self.values

                def select_rows(self, index: torch.Tensor) -> None:
                    """Keep/duplicate batch rows (``index`` into the current rows)."""
                    self._k, self._v = self._k.index_select(0, index), self._v.index_select(0, index)
                    self.keys, self.values = self._k[:, :, :self._filled], self._v[:, :, :self._filled]

            cls.cls = PreallocatedLayer
        return cls.cls


def _preallocated_cache(model: torch.nn.Module, capacity: int):
    """A transformers ``DynamicCache`` whose layers write into buffers of ``capacity`` positions.

    The default dynamic cache grows every layer's keys and values by ``torch.cat`` at every decode
    step (a copy of the whole cache per step: O(length^2) traffic, the largest rollout op on small
    models). Here each layer allocates ``[batch, heads, capacity, head_dim]`` once, writes new
    positions in place and hands attention the view of the filled prefix: the same values, so the
    same logits. Returns None (the model builds its default cache) unless every layer of the
    model's default cache is a plain full-attention ``DynamicLayer``.
    """
    try:
        from transformers.cache_utils import DynamicCache, DynamicLayer
    except ImportError:  # pragma: no cover - other transformers versions
        return None
    config = getattr(model, "config", None)
    if config is None:
        return None
    try:
        cache = DynamicCache(config=config)
    except Exception:  # noqa: BLE001 - unusual configs: keep the model's own cache
        return None
    if not cache.layers or any(type(layer) is not DynamicLayer for layer in cache.layers):
        return None
    layer_cls = _PreallocatedLayer.get()
    cache.layers = [layer_cls(capacity) for _ in cache.layers]
    return cache


@dataclass
class _StoredBatch:
    """One earlier engine call's cache buffers (per layer ``[rows, heads, capacity, head_dim]``)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    tokens: list[tuple[int, ...]]     # row -> the tokens whose keys/values are in the buffers, in order
    slots: list[torch.Tensor]         # row -> buffer position of each of those tokens
    adapters: list[str | None]
    nbytes: int


class PrefixCache:
    """Keys and values of the rows generated since the last :meth:`clear`, found again by token prefix.

    A stored row covers its prompt and every response token that was fed back (all but the last).
    Lookup walks a chain of hashes over blocks of ``block`` tokens (like vLLM's automatic prefix
    caching), checks the match token by token, and extends it past the last full block; only rows
    decoded with the same adapter match. Keys and values only depend on the tokens, their positions
    (kept: reused rows keep their true position ids) and the weights, so the cache is dropped when
    the weights change (:meth:`check_weights`, and :func:`masrl.training.policy.after_update`) and at the end
    of every rollout. ``max_bytes`` bounds the stored buffers (oldest calls are dropped first).
    """

    def __init__(self, max_bytes: int = 1 << 30, block: int = 16):
        self.max_bytes, self.block = max_bytes, block
        self.batches: list[_StoredBatch] = []
        self._index: dict[int, list[tuple[_StoredBatch, int]]] = {}  # block-chain hash -> rows with it
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

    def lookup(self, tokens: tuple[int, ...], adapter: str | None) -> tuple[_StoredBatch, int, int] | None:
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

    def add(self, batch: _StoredBatch) -> None:
        if batch.nbytes > self.max_bytes:
            return
        self.batches.append(batch)
        if self.nbytes <= self.max_bytes:
            self._add_to_index(batch)
            return
        while self.nbytes > self.max_bytes:
            self.batches.pop(0)
        self._reindex()

    def _add_to_index(self, batch: _StoredBatch) -> None:
        for row, tokens in enumerate(batch.tokens):
            for _, h in self._chain(tokens, batch.adapters[row]):
                self._index.setdefault(h, []).append((batch, row))

    def _reindex(self) -> None:
        self._index = {}
        for batch in self.batches:
            self._add_to_index(batch)


class TransformersEngine:
    """Batched sampling with a KV cache; the model is shared with the trainer (no weight copies)."""

    def __init__(self, model: torch.nn.Module, *, eos_token_ids: Sequence[int], pad_token_id: int,
                 max_batch_size: int = 256, seed: int = 0, preallocate_cache: bool = True,
                 autocast: str | torch.dtype | None = None, prefix_cache: bool = True,
                 prefix_cache_mib: float = 1024.0, compact_finished: bool = True):
        self.model = model
        # mixed-precision decoding ("bfloat16"): use the trainer's `trainer.autocast` so that rollout and
        # training log-probs are computed in the same precision
        self.autocast = autocast
        self.preallocate_cache = preallocate_cache  # KV cache written in place instead of grown by torch.cat
        # prefill each distinct prompt once and reuse earlier rows' keys/values (needs the preallocated cache)
        self.prefix_cache = PrefixCache(int(prefix_cache_mib * 2**20)) if prefix_cache and preallocate_cache else None
        # finished rows leave the model's batch once a quarter of it is done (sampling still draws for
        # every row, so the random stream, and hence the samples, do not depend on it)
        self.compact_finished = compact_finished
        self.eos = torch.tensor(sorted(set(eos_token_ids)), dtype=torch.long)
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self.generator = torch.Generator().manual_seed(seed)
        self.seed = seed
        self._device_generators: dict[str, torch.Generator] = {}  # sampling on an accelerator needs its own
        self.sharded_model = False  # set by masrl.training.fsdp.shard_policy
        self.tokens_generated = 0
        self.prefill_tokens = 0  # prompt tokens actually run through the model (after reuse)

    def reseed(self, seed: int) -> None:
        self.generator.manual_seed(seed)
        self.seed = seed
        self._device_generators.clear()

    def clear_prefix_cache(self) -> None:
        """Free the stored keys/values (end of a rollout; the weights are about to change)."""
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    def _generator(self, device: torch.device) -> torch.Generator:
        """The CPU generator, or one on ``device`` (seeded alike) when the logits live there."""
        if device.type == "cpu":
            return self.generator
        key = str(device)
        if key not in self._device_generators:
            self._device_generators[key] = torch.Generator(device=device).manual_seed(self.seed)
        return self._device_generators[key]

    def generate(self, requests: Sequence[GenRequest]) -> list[GenResult]:
        out: list[GenResult] = []
        for start in range(0, len(requests), self.max_batch_size):
            out.extend(self._generate_batch(requests[start:start + self.max_batch_size]))
        return out

    def _generate_batch(self, requests: Sequence[GenRequest]) -> list[GenResult]:
        model = self.model
        was_training = model.training
        model.eval()
        try:
            with self._precision(model):
                return self._decode(model, requests)
        finally:
            model.train(was_training)

    def _precision(self, model) -> contextlib.AbstractContextManager:
        """``inference_mode``, or ``no_grad`` + ``autocast`` when ``self.autocast`` is set.

        ``no_grad`` rather than ``inference_mode`` under autocast: autocast reuses its low-precision
        copy of a weight (its cast cache) only outside inference mode, so each weight is cast once per
        batch instead of once per decode step (a 49k x 576 LM head on 8 rows: 8.5 ms with the cache,
        44 ms without, 20 ms in float32).
        """
        if not self.autocast:  # FSDP2 (sharded_model) must not allocate its unsharded weights as inference tensors
            return torch.no_grad() if self.sharded_model else torch.inference_mode()
        dtype = getattr(torch, self.autocast) if isinstance(self.autocast, str) else self.autocast
        stack = contextlib.ExitStack()
        stack.enter_context(torch.no_grad())
        stack.enter_context(torch.autocast(next(model.parameters()).device.type, dtype=dtype))
        return stack

    def _preallocatable(self, model) -> bool:
        """Whether ``model``'s cache can be preallocated (prefix reuse works on those buffers)."""
        key = id(model)
        if getattr(self, "_preallocatable_for", None) != key:
            self._preallocatable_ok = _preallocated_cache(model, 1) is not None
            self._preallocatable_for = key
        return self._preallocatable_ok

    @staticmethod
    def _routing(model, adapters: Sequence[str | None]) -> contextlib.AbstractContextManager:
        """Per-row LoRA adapters for the forwards inside (``mixed_adapters``), or nothing."""
        if all(a is None for a in adapters):
            return contextlib.nullcontext()
        from masrl.models.lora import mixed_adapters

        return mixed_adapters(model, list(adapters))

    def _decode(self, model, requests: Sequence[GenRequest]) -> list[GenResult]:
        device = next(model.parameters()).device
        batch = len(requests)
        adapters = [r.adapter for r in requests]
        prompts = [tuple(r.prompt_ids) for r in requests]
        store = self.prefix_cache if self._preallocatable(model) else None
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
        if store is not None:  # unique rows by the length left to prefill, for prefill chunks (below)
            order = sorted(range(n_uniq), key=lambda u: suffix[u])
            rank = {u: i for i, u in enumerate(order)}
            uniq, hits, reuse, lengths, suffix = ([seq[u] for u in order] for seq in (uniq, hits, reuse, lengths, suffix))
            inverse = [rank[u] for u in inverse]
        prefix_width, suffix_width = max(reuse), max(suffix)
        width = prefix_width + suffix_width
        # layout of unique row u: reused prefix right-aligned to `prefix_width`, a masked gap, then its
        # remaining prompt tokens right-aligned to `width` (left padding when nothing is reused)
        input_ids = torch.full((n_uniq, suffix_width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((n_uniq, width), dtype=torch.long)
        positions = torch.zeros((n_uniq, suffix_width), dtype=torch.long)
        for u, (_, tokens) in enumerate(uniq):
            r, n = reuse[u], suffix[u]
            input_ids[u, suffix_width - n:] = torch.tensor(tokens[r:], dtype=torch.long)
            attention[u, prefix_width - r:prefix_width] = 1
            attention[u, width - n:] = 1
            positions[u, suffix_width - n:] = torch.arange(r, r + n)
        if store is not None:
            store.prompt_tokens += sum(lengths)
            store.reused_tokens += sum(reuse)
        self.prefill_tokens += sum(suffix)
        temperature = torch.tensor([r.temperature for r in requests], dtype=torch.float32)
        top_p = torch.tensor([r.top_p for r in requests], dtype=torch.float32)
        budget = torch.tensor([r.max_new_tokens for r in requests], dtype=torch.long)
        max_new = int(budget.max())
        input_ids, positions = input_ids.to(device), positions.to(device)
        is_eos = torch.zeros(int(self.eos.max()) + 2, dtype=torch.bool)  # token id -> stop token? (CPU lookup)
        is_eos[self.eos] = True
        eos_limit = is_eos.numel() - 1  # ids past the table (never stop tokens) are clamped onto a False entry
        temperature, top_p = temperature.to(device), top_p.to(device)  # sampling runs where the logits are
        plan = _SamplePlan(temperature, top_p)
        generator = self._generator(torch.device(device))
        cache = _preallocated_cache(model, width + max_new) if self.preallocate_cache else None
        if prefix_width:
            self._fill_prefixes(cache, hits, reuse, prefix_width, width + max_new, device)

        cache, logits = self._prefill(model, cache, input_ids, attention.to(device), positions, uniq, suffix,
                                      prefix_width, chunked=store is not None)
        next_pos = torch.tensor(lengths, dtype=torch.long)
        if inverse != list(range(batch)):  # every row of a group gets its unique row's cache and first logits
            rows = torch.tensor(inverse, dtype=torch.long, device=device)
            for layer in cache.layers:
                layer.select_rows(rows)
            logits, attention = logits.index_select(0, rows), attention[inverse]
            next_pos = next_pos[inverse]
        next_pos = next_pos.to(device)
        # the mask for prompt + every decode step, allocated once (sliced per step)
        full_mask = torch.cat([attention, torch.ones((batch, max_new), dtype=attention.dtype)], 1).to(device)
        tokens_out = torch.full((batch, max_new), self.pad_token_id, dtype=torch.long)
        logps_out = torch.zeros((batch, max_new), dtype=torch.float32)
        n_emitted = torch.zeros(batch, dtype=torch.long)
        stopped = torch.zeros(batch, dtype=torch.bool)   # emitted a stop token
        done = budget <= 0
        pad = torch.full((batch,), self.pad_token_id, dtype=torch.long)
        zero = torch.zeros((), dtype=torch.float32)
        compact = self.compact_finished and self.preallocate_cache and self._preallocatable(model)
        live = None  # the rows still in the model's batch (None: all); sampling always covers every row
        live_dev, mask, pos = None, full_mask, next_pos
        with contextlib.ExitStack() as routing:
            routing.enter_context(self._routing(model, adapters))
            for step in range(max_new):
                tok, lp = _sample(logits, temperature, top_p, generator, plan=plan)
                tok, lp = tok.cpu(), lp.cpu()
                active = ~done
                tokens_out[:, step] = torch.where(active, tok, pad)
                logps_out[:, step] = torch.where(active, lp, zero)
                n_emitted += active
                hit_eos = is_eos[tok.clamp(max=eos_limit)] & active
                stopped |= hit_eos
                done |= hit_eos | (n_emitted >= budget)
                if bool(done.all()):
                    break
                in_batch = batch if live is None else live.numel()
                if compact and in_batch - int((~done).sum()) >= max(1, in_batch // 4):
                    # a quarter of the batch has finished: drop those rows (their keys/values go to the
                    # prefix store) instead of decoding padding for them until the longest row ends
                    keep_rows = (~done).nonzero().squeeze(1)
                    local = keep_rows if live is None else torch.searchsorted(live, keep_rows)
                    if store is not None:
                        gone = done.clone() if live is None else torch.zeros(batch, dtype=torch.bool).index_fill_(0, live, True) & done
                        self._store_rows(store, cache, gone.nonzero().squeeze(1).tolist(), live, uniq, inverse,
                                         reuse, suffix, prefix_width, width, tokens_out, n_emitted)
                    local_dev = local.to(device)
                    for layer in cache.layers:
                        layer.select_rows(local_dev)
                    mask, pos = mask.index_select(0, local_dev), pos.index_select(0, local_dev)
                    live, live_dev = keep_rows, keep_rows.to(device)
                    if any(a is not None for a in adapters):  # route the remaining rows (even if all base)
                        from masrl.models.lora import mixed_adapters

                        routing.enter_context(mixed_adapters(model, [adapters[i] for i in live.tolist()]))
                feed = torch.where(done, pad, tok)
                feed = (feed if live is None else feed.index_select(0, live)).to(device)
                out = model(input_ids=feed[:, None], attention_mask=mask[:, :width + step + 1],
                            position_ids=pos[:, None], past_key_values=cache, use_cache=True)
                cache = out.past_key_values
                logits = out.logits[:, -1, :] if live is None else logits.index_copy(0, live_dev, out.logits[:, -1, :])
                pos = pos + 1
        results = []
        for i in range(batch):
            n = int(n_emitted[i])
            self.tokens_generated += n
            results.append(GenResult(tokens_out[i, :n].tolist(), logps_out[i, :n].tolist(),
                                     truncated=not bool(stopped[i])))
        if store is not None:
            rows = list(range(batch)) if live is None else live.tolist()
            self._store_rows(store, cache, rows, live, uniq, inverse, reuse, suffix, prefix_width, width,
                             tokens_out, n_emitted)
        return results

    def _prefill(self, model, cache, input_ids, attention, positions, uniq, suffix, prefix_width: int,
                 chunked: bool):
        """Run the prompts' remaining tokens; returns (cache, logits of each row's last prompt token).

        ``chunked``: rows (sorted by ``suffix``, the tokens each still needs) are run in up to 4 row
        ranges, each padded only to its own longest suffix, when that saves at least a quarter of the
        padded tokens; every range writes its rows of the same cache buffers (its suffixes end at the
        same position, the gap before them stays masked).
        """
        width, n_rows = attention.shape[1], len(uniq)
        bounds = self._prefill_chunks(suffix) if chunked else [(0, n_rows)]
        if len(bounds) == 1:
            with self._routing(model, [a for a, _ in uniq]):  # the prompt's last position only: no prefill logits
                out = model(input_ids=input_ids, attention_mask=attention, position_ids=positions,
                            use_cache=True, past_key_values=cache, logits_to_keep=1)
            return out.past_key_values, out.logits[:, -1, :]
        logits = {}
        for start, end in sorted(bounds, key=lambda b: -suffix[b[1] - 1]):  # the longest first: it allocates
            span = suffix[end - 1]
            for layer in cache.layers:
                layer.focus(slice(start, end), width - span, n_rows)
            with self._routing(model, [a for a, _ in uniq[start:end]]):
                out = model(input_ids=input_ids[start:end, -span:], attention_mask=attention[start:end],
                            position_ids=positions[start:end, -span:], use_cache=True, past_key_values=cache,
                            logits_to_keep=1)
            logits[start] = out.logits[:, -1, :]
        for layer in cache.layers:
            layer.focus(slice(None), width, n_rows)
        return cache, torch.cat([logits[start] for start in sorted(logits)])

    @staticmethod
    def _prefill_chunks(suffix: Sequence[int], max_chunks: int = 4) -> list[tuple[int, int]]:
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

    @staticmethod
    def _fill_prefixes(cache, hits, reuse, prefix_width: int, capacity: int, device) -> None:
        """Start every layer of ``cache`` from new buffers holding each unique row's reused prefix."""
        sources: dict[int, tuple[_StoredBatch, list[int], list[int], list[list[int]]]] = {}
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
        for li, layer in enumerate(cache.layers):
            k_src, v_src = first.keys[li], first.values[li]
            k = k_src.new_zeros((n_uniq, k_src.shape[1], capacity, k_src.shape[3]))
            v = v_src.new_zeros((n_uniq, v_src.shape[1], capacity, v_src.shape[3]))
            for stored, us, rows, slots in sources.values():
                dest = torch.tensor(us, device=device)
                src_rows = torch.tensor(rows, device=device)[:, None]
                src_slots = torch.tensor(slots, device=device)
                # [rows, prefix, heads, dim] (advanced indices first) -> [rows, heads, prefix, dim]
                k[dest, :, :prefix_width] = stored.keys[li][src_rows, :, src_slots].permute(0, 2, 1, 3)
                v[dest, :, :prefix_width] = stored.values[li][src_rows, :, src_slots].permute(0, 2, 1, 3)
            layer.prefill(k, v, prefix_width)

    @staticmethod
    def _store_rows(store: PrefixCache, cache, rows: Sequence[int], live: torch.Tensor | None, uniq, inverse,
                    reuse, suffix, prefix_width: int, width: int, tokens_out: torch.Tensor,
                    n_emitted: torch.Tensor) -> None:
        """Keep ``rows``' keys/values (prompt + fed response tokens) in ``store``; ``live``: the batch rows
        the cache buffers hold now (None: all)."""
        if not rows:
            return
        local = torch.tensor(rows) if live is None else torch.searchsorted(live, torch.tensor(rows))
        in_batch = tokens_out.shape[0] if live is None else live.numel()
        index = None if len(rows) == in_batch else local.to(cache.layers[0]._k.device)
        keys = [layer._k if index is None else layer._k.index_select(0, index) for layer in cache.layers]
        values = [layer._v if index is None else layer._v.index_select(0, index) for layer in cache.layers]
        tokens, slots, adapters = [], [], []
        for i in rows:
            u = inverse[i]
            adapter, prompt = uniq[u]
            n = int(n_emitted[i])
            fed = tokens_out[i, :max(n - 1, 0)].tolist()  # the last sampled token was never fed back
            tokens.append(prompt + tuple(fed))
            slots.append(torch.cat([torch.arange(prefix_width - reuse[u], prefix_width),
                                    torch.arange(width - suffix[u], width + len(fed))]))
            adapters.append(adapter)
        nbytes = sum(t.numel() * t.element_size() for t in keys + values)
        store.add(_StoredBatch(keys, values, tokens, slots, adapters, nbytes))
