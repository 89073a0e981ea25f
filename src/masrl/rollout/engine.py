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
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

from masrl.models.cpu_attention import NAME as CPU_ATTENTION, cpu_attention
from masrl.models.fast_decode import FastDecode
from masrl.models.packed_linear import PackedLinears, available as packed_linear_available
from masrl.models.precision import resolve_autocast
from masrl.rollout.base import Engine, GenRequest, GenResult
from masrl.rollout.kv_cache import output_cache, preallocated_cache, with_cache
from masrl.rollout.prefix_cache import PrefixCache, StoredBatch

__all__ = ["DecodeState", "Engine", "GenRequest", "GenResult", "PrefixCache", "TransformersEngine", "run_decode"]


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
        if plan.inverse_cdf(sorted_p):  # draw in sorted order, then map back to token ids
            tokens = order.gather(-1, plan.draw(sorted_p, generator)[:, None]).squeeze(-1)
        else:
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
            tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    elif plan.inverse_cdf(probs):
        tokens = plan.draw(probs, generator)
    else:
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    if plan.any_greedy:
        tokens = torch.where(plan.greedy, logp.argmax(-1), tokens)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


# From this vocabulary size on, a row's token is drawn by inverse CDF (one uniform per row) instead of
# ``torch.multinomial`` (one exponential per vocabulary entry: 8.7 ms per step for 8 rows x 49,152 tokens on
# one Zen 4 core, vs 0.5 ms). Below it multinomial costs little and keeps the small models' (the quickstart's,
# the study's) sampled tokens, and so their published results, as they were.
INVERSE_CDF_MIN_VOCAB = 4096


def inverse_cdf_sample(probs: torch.Tensor, generator: torch.Generator | None,
                       cum: torch.Tensor | None = None) -> torch.Tensor:
    """One draw per row of ``probs`` (``[rows, V]``, non-negative, each row with a positive sum; need not sum
    to 1), with probability ``probs[i, j] / probs[i].sum()`` exactly up to float64 rounding.

    The float64 cumulative sum ``c`` (written into ``cum`` when given) and one uniform ``U`` in [0, 1) per
    row give ``u = (1 - U) * c[-1]`` in (0, c[-1]]; the token is the first ``j`` with ``c[j] >= u``.
    A zero-probability token ``j`` has ``c[j] == c[j - 1]`` (or ``c[0] == 0 < u``), so it is never drawn,
    and ``u <= c[-1]`` always finds a token (no out-of-range last bucket).
    """
    cum = torch.cumsum(probs, -1, dtype=torch.float64, out=cum)
    uniform = torch.rand((probs.shape[0], 1), dtype=torch.float64, device=probs.device, generator=generator)
    return torch.searchsorted(cum, (1.0 - uniform) * cum[:, -1:]).squeeze(-1)


class _SamplePlan:
    """Per-batch constants of :func:`_sample` (computed once, not once per decode step)."""

    def __init__(self, temperature: torch.Tensor, top_p: torch.Tensor):
        self.greedy = temperature <= 0
        self.any_greedy = bool(self.greedy.any())
        temp = torch.where(self.greedy, torch.ones_like(temperature), temperature)
        self.temp_col = None if bool((temp == 1.0).all()) else temp[:, None]
        self.any_top_p = bool((top_p < 1.0).any())
        self._cum: torch.Tensor | None = None  # the inverse-CDF sampler's float64 buffer, reused every step

    @staticmethod
    def inverse_cdf(probs: torch.Tensor) -> bool:
        """Whether :func:`inverse_cdf_sample` draws from ``probs`` (large vocabularies, float64-capable devices)."""
        return probs.shape[-1] >= INVERSE_CDF_MIN_VOCAB and probs.device.type != "mps"

    def draw(self, probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        if self._cum is None or self._cum.shape != probs.shape or self._cum.device != probs.device:
            # a fresh [rows, V] float64 tensor every step costs page faults (3.8 vs 0.5 ms for 8 x 49,152)
            self._cum = torch.empty(probs.shape, dtype=torch.float64, device=probs.device)
        return inverse_cdf_sample(probs, generator, self._cum)




class DecodeState:
    """What every decode step of one batch reads and writes: per-row sampling settings, the tokens and
    log-probs emitted so far, and which rows are done (a stop token or the row's token budget)."""

    def __init__(self, requests: Sequence[GenRequest], *, eos: torch.Tensor, pad_token_id: int, device,
                 generator: torch.Generator):
        batch = len(requests)
        temperature = torch.tensor([r.temperature for r in requests], dtype=torch.float32)
        top_p = torch.tensor([r.top_p for r in requests], dtype=torch.float32)
        self.budget = torch.tensor([r.max_new_tokens for r in requests], dtype=torch.long)
        self.max_new = int(self.budget.max())
        self.is_eos = torch.zeros(int(eos.max()) + 2, dtype=torch.bool)  # token id -> stop token? (CPU lookup)
        self.is_eos[eos] = True
        self.eos_limit = self.is_eos.numel() - 1  # ids past the table (never stop tokens) are clamped onto a False entry
        self.temperature, self.top_p = temperature.to(device), top_p.to(device)  # sampling runs where the logits are
        self.plan = _SamplePlan(self.temperature, self.top_p)
        self.generator = generator
        self.tokens_out = torch.full((batch, self.max_new), pad_token_id, dtype=torch.long)
        self.logps_out = torch.zeros((batch, self.max_new), dtype=torch.float32)
        self.n_emitted = torch.zeros(batch, dtype=torch.long)
        self.stopped = torch.zeros(batch, dtype=torch.bool)   # emitted a stop token
        self.done = self.budget <= 0
        self.pad = torch.full((batch,), pad_token_id, dtype=torch.long)
        self.zero = torch.zeros((), dtype=torch.float32)
        self.last: torch.Tensor | None = None  # the tokens sampled at the last step (every row)

    def sample(self, step: int, logits: torch.Tensor) -> bool:
        """Sample token ``step`` of every row from ``logits`` and record it for the rows still going;
        True when every row is done."""
        tok, lp = _sample(logits, self.temperature, self.top_p, self.generator, plan=self.plan)
        tok, lp = tok.cpu(), lp.cpu()
        active = ~self.done
        self.tokens_out[:, step] = torch.where(active, tok, self.pad)
        self.logps_out[:, step] = torch.where(active, lp, self.zero)
        self.n_emitted += active
        hit_eos = self.is_eos[tok.clamp(max=self.eos_limit)] & active
        self.stopped |= hit_eos
        self.done |= hit_eos | (self.n_emitted >= self.budget)
        self.last = tok
        return bool(self.done.all())

    def feed(self) -> torch.Tensor:
        """The tokens the next forward reads (every row, on the CPU): the last sample, padding once done."""
        return torch.where(self.done, self.pad, self.last)

    def results(self) -> list[GenResult]:
        results = []
        for i in range(self.done.numel()):
            n = int(self.n_emitted[i])
            results.append(GenResult(self.tokens_out[i, :n].tolist(), self.logps_out[i, :n].tolist(),
                                     truncated=not bool(self.stopped[i])))
        return results


def run_decode(state: DecodeState, logits: torch.Tensor,
               forward: Callable[[int, torch.Tensor], torch.Tensor]) -> None:
    """The decode loop: sample every row from ``logits``; until every row is done, ``forward(step, logits)``
    runs the model on :meth:`DecodeState.feed` and returns the next logits of every row."""
    for step in range(state.max_new):
        if state.sample(step, logits):
            break
        logits = forward(step, logits)


@dataclass
class _PromptLayout:
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
    def build(cls, adapters, uniq, inverse, hits, reuse, lengths, suffix, pad_token_id: int) -> "_PromptLayout":
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


# `autocast: auto` decodes in bf16 on a CPU only from this hidden size: a decode step of a tiny Llama (4 layers,
# 64 / 16 rows) under bf16 autocast takes 1.15-1.25x the float32 time at 128, 0.97-1.15x at 192, 0.84-1.05x at 256,
# 0.63-0.83x from 384 (benchmarks/autocast_size.py --decode; docs/performance.md, "Precision")
AUTO_BF16_MIN_HIDDEN = 256


def _hidden_size(model: torch.nn.Module) -> int:
    """The width of the model's token embeddings (its hidden size); a large number when it has none."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return int(getattr(embeddings, "embedding_dim", 1 << 30))


class _LiveRows:
    """The rows still in the model's batch (``live``: None = all) with their cache, mask and next positions.
    Finished rows may leave it (:meth:`keep`); sampling always covers every row."""

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


@dataclass
class _Entry:
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
class _Segment:
    """The running batch of continuous batching between two admissions: one prefill, then decode steps."""

    entries: list[_Entry]
    layout: _PromptLayout
    state: DecodeState
    rows: _LiveRows
    logits: torch.Tensor
    delivered: torch.Tensor  # rows whose result went back
    step: int = 0


class TransformersEngine(Engine):
    """Batched sampling with a KV cache; the model is shared with the trainer (no weight copies)."""

    shares_training_model = True
    can_batch_continuously = True

    def __init__(self, model: torch.nn.Module, *, eos_token_ids: Sequence[int], pad_token_id: int,
                 max_batch_size: int = 256, seed: int = 0, preallocate_cache: bool = True,
                 autocast: str | torch.dtype | None = None, prefix_cache: bool = True,
                 prefix_cache_mib: float = 1024.0, compact_finished: bool = True,
                 max_running_tokens: int = 65536, decode_attention: bool = True, packed_linear: bool = True,
                 fast_decode: bool = True):
        self.model = model
        # decode steps of plain float32 Llama models computed from the weights, bitwise transformers' forward in
        # about half the operator calls (masrl.models.fast_decode); others keep transformers' forward
        self.fast_decode = fast_decode
        self._fast: FastDecode | None = None  # the last one built (its stacked weights reused while unchanged)
        # CPU attention while decoding (masrl.models.cpu_attention): 1-token queries as float32 matmuls over the
        # cache, prompts under autocast in float32
        self.decode_attention = decode_attention
        # bf16 decoding on CPU: large Linear weights prepacked for oneDNN once per weight version
        # (masrl.models.packed_linear; bitwise autocast's results)
        self.packed_linears = PackedLinears() if packed_linear and packed_linear_available() else None
        # mixed-precision decoding ("bfloat16", or "auto" resolved for the model's device): the trainer's
        # `trainer.autocast`, so that rollout and training run in the same precision
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
        self.sharded_model = False  # set by model_sharded() (masrl.training.fsdp.shard_policy)
        self.tokens_generated = 0
        self.prefill_tokens = 0  # prompt tokens actually run through the model (after reuse)
        # continuous batching: admission limit of the running batch (rows x their longest prompt + budget;
        # rows: max_batch_size), the requests waiting for admission and the running batch
        self.max_running_tokens = max_running_tokens
        self.readmitted_tokens = 0  # tokens prefilled again for rows carried into a new segment
        self._queue: list[_Entry] = []
        self._segment: _Segment | None = None

    def reseed(self, seed: int) -> None:
        self.generator.manual_seed(seed)
        self.seed = seed
        self._device_generators.clear()

    def model_sharded(self) -> None:
        """FSDP2 sharded the model in place: decode under ``no_grad`` (its unsharded weights must not be
        allocated as inference tensors)."""
        self.sharded_model = True

    def clear_prefix_cache(self) -> None:
        """Free the stored keys/values (end of a rollout; the weights are about to change)."""
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    def weights_changed(self, model: torch.nn.Module, *, base_changed: bool) -> None:
        """The engine decodes with the trainer's model, so it serves new weights as they are; the keys/values
        kept for prefix reuse belong to the old ones, and so do packed copies of changed base weights (dropped
        before the update needs the memory; they would be repacked anyway), and the fast decoder's stacked
        weights."""
        self.clear_prefix_cache()
        if base_changed:  # after an adapter update the fast decoder keeps its stacked base weights
            self._fast = None
        if base_changed and self.packed_linears is not None:
            self.packed_linears.clear()

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
            with self._precision(model), self._attention(model), self._packed(model):
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
        device = next(model.parameters()).device
        dtype = resolve_autocast(self.autocast, device) if isinstance(self.autocast, str) else self.autocast
        if self.autocast == "auto" and device.type == "cpu" and _hidden_size(model) < AUTO_BF16_MIN_HIDDEN:
            dtype = None  # a narrow model decodes faster in float32 on a CPU (the casts cost more than they save)
        if not dtype:  # FSDP2 (sharded_model) must not allocate its unsharded weights as inference tensors
            return torch.no_grad() if self.sharded_model else torch.inference_mode()
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        stack = contextlib.ExitStack()
        stack.enter_context(torch.no_grad())
        stack.enter_context(torch.autocast(device.type, dtype=dtype))
        return stack

    def _attention(self, model) -> contextlib.AbstractContextManager:
        """The model's attention while this engine decodes: ``sdpa`` models on CPU switch to
        :func:`masrl.models.cpu_attention.attention_forward`."""
        return cpu_attention(model) if self.decode_attention else contextlib.nullcontext()

    def _packed(self, model) -> contextlib.AbstractContextManager:
        """bf16 autocast on a CPU: the model's large Linear layers use prepacked weights while this engine decodes
        (:class:`masrl.models.packed_linear.PackedLinears`)."""
        if (self.packed_linears is None or not torch.is_autocast_enabled("cpu")
                or torch.get_autocast_dtype("cpu") != torch.bfloat16):
            return contextlib.nullcontext()
        return self.packed_linears.active(model)

    @staticmethod
    def _cache_dtype(model) -> torch.dtype | None:
        """float32 keys/values for a float32 model decoding under autocast with the CPU decode attention
        (which attends in float32): the cache holds the bf16 keys exactly (the same results) and the attention
        reads it in place instead of converting the whole cache at every step. None: the keys' own dtype."""
        if (getattr(getattr(model, "config", None), "_attn_implementation", None) != CPU_ATTENTION
                or not torch.is_autocast_enabled("cpu")):
            return None
        return torch.float32 if next(model.parameters()).dtype == torch.float32 else None

    def _preallocatable(self, model) -> bool:
        """Whether ``model``'s cache can be preallocated (prefix reuse works on those buffers)."""
        key = id(model)
        if getattr(self, "_preallocatable_for", None) != key:
            self._preallocatable_ok = preallocated_cache(model, 1) is not None
            self._preallocatable_for = key
        return self._preallocatable_ok

    @staticmethod
    def _routing(model, adapters: Sequence[str | None] | None) -> contextlib.AbstractContextManager:
        """Per-row LoRA adapters for the forwards inside (``mixed_adapters``), or nothing (``adapters`` None, or
        None for every row)."""
        if adapters is None or all(a is None for a in adapters):
            return contextlib.nullcontext()
        from masrl.models.lora import mixed_adapters

        return mixed_adapters(model, list(adapters))

    @staticmethod
    def _row_routing(model, rows: "_LiveRows") -> contextlib.AbstractContextManager:
        """The adapters of the rows in the batch (``rows.routes``; a row left with base rows only stays routed:
        the base model, not PEFT's active adapter), or nothing when no row of the batch named one or the fast
        decode step runs (it routes the rows itself; the prefill checked the names)."""
        if rows.routes is None or rows.fast is not None:
            return contextlib.nullcontext()
        from masrl.models.lora import mixed_adapters

        return mixed_adapters(model, list(rows.routes))

    def _decode(self, model, requests: Sequence[GenRequest]) -> list[GenResult]:
        """Lay out the prompts, prefill them (reusing stored prefixes), then sample until every row is done."""
        device = next(model.parameters()).device
        store = self.prefix_cache if self._preallocatable(model) else None
        layout = self._layout(model, requests, store)
        state = DecodeState(requests, eos=self.eos, pad_token_id=self.pad_token_id, device=device,
                            generator=self._generator(torch.device(device)))
        cache, logits, rows = self._start(model, layout, state.max_new, device, store)
        with contextlib.ExitStack() as routing:
            routing.enter_context(self._routing(model, layout.adapters))
            compact = self.compact_finished and self.preallocate_cache and self._preallocatable(model)

            def forward(step: int, logits: torch.Tensor) -> torch.Tensor:
                if compact and rows.should_compact(state.done):
                    self._compact(model, rows, state, layout, store, routing)
                return rows.forward(model, state.feed(), logits, layout.width + step + 1)

            run_decode(state, logits, forward)
        results = state.results()
        self.tokens_generated += sum(len(r.response_ids) for r in results)
        if store is not None:
            kept = list(range(len(requests))) if rows.live is None else rows.live.tolist()
            self._store_rows(store, rows.cache, kept, rows.live, layout, state)
        return results

    def _layout(self, model, requests: Sequence[GenRequest], store: PrefixCache | None) -> "_PromptLayout":
        """Distinct prompts ("unique rows", prefilled once), their reused prefixes and the padded inputs."""
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
        if store is not None:  # unique rows by the length left to prefill, for prefill chunks (below)
            order = sorted(range(n_uniq), key=lambda u: suffix[u])
            rank = {u: i for i, u in enumerate(order)}
            uniq, hits, reuse, lengths, suffix = ([seq[u] for u in order] for seq in (uniq, hits, reuse, lengths, suffix))
            inverse = [rank[u] for u in inverse]
        if store is not None:
            store.prompt_tokens += sum(lengths)
            store.reused_tokens += sum(reuse)
        self.prefill_tokens += sum(suffix)
        return _PromptLayout.build(adapters, uniq, inverse, hits, reuse, lengths, suffix, self.pad_token_id)

    def _start(self, model, layout: "_PromptLayout", max_new: int, device, store: PrefixCache | None):
        """Prefill every unique row and give each row its unique row's cache: (cache, first logits, rows)."""
        batch, width = len(layout.inverse), layout.width
        input_ids, positions = layout.input_ids.to(device), layout.positions.to(device)
        cache = preallocated_cache(model, width + max_new, self._cache_dtype(model)) if self.preallocate_cache else None
        if layout.prefix_width:
            self._fill_prefixes(cache, layout.hits, layout.reuse, layout.prefix_width, width + max_new, device)
        cache, logits = self._prefill(model, cache, input_ids, layout.attention.to(device), positions, layout.uniq,
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
        return cache, logits, _LiveRows(cache, full_mask, next_pos, batch, device, self._fast_decoder(model, cache),
                                        layout.adapters)

    def _fast_decoder(self, model, cache) -> FastDecode | None:
        """The lean decode step for ``model`` writing into ``cache`` (:mod:`masrl.models.fast_decode`), or None
        where it does not apply (transformers' forward then)."""
        # the fast step writes through the preallocated cache's layers (FSDP2 shards also carry hooks, which
        # FastDecode.for_model refuses on its own)
        if (not self.fast_decode or self.sharded_model or cache is None or not self.preallocate_cache
                or not self._preallocatable(model)):
            return None
        self._fast = FastDecode.for_model(model, self._fast)
        return self._fast

    def _compact(self, model, rows: "_LiveRows", state: "DecodeState", layout: "_PromptLayout",
                 store: PrefixCache | None, routing: contextlib.ExitStack) -> None:
        """A quarter of the batch has finished: drop those rows (their keys/values go to the prefix store)
        instead of decoding padding for them until the longest row ends."""
        done, live = state.done, rows.live
        keep_rows = (~done).nonzero().squeeze(1)
        local = keep_rows if live is None else torch.searchsorted(live, keep_rows)
        if store is not None:
            batch = done.numel()
            gone = done.clone() if live is None else torch.zeros(batch, dtype=torch.bool).index_fill_(0, live, True) & done
            self._store_rows(store, rows.cache, gone.nonzero().squeeze(1).tolist(), live, layout, state)
        rows.keep(local, keep_rows)
        routing.enter_context(self._row_routing(model, rows))

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
                            use_cache=True, logits_to_keep=1, **with_cache(cache))
            return output_cache(out), out.logits[:, -1, :]
        logits = {}
        for start, end in sorted(bounds, key=lambda b: -suffix[b[1] - 1]):  # the longest first: it allocates
            span = suffix[end - 1]
            for layer in cache.layers:
                layer.focus(slice(start, end), width - span, n_rows)
            with self._routing(model, [a for a, _ in uniq[start:end]]):
                out = model(input_ids=input_ids[start:end, -span:], attention_mask=attention[start:end],
                            position_ids=positions[start:end, -span:], use_cache=True, logits_to_keep=1,
                            **with_cache(cache))
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

    @staticmethod
    def _store_rows(store: PrefixCache, cache, rows: Sequence[int], live: torch.Tensor | None,
                    layout: "_PromptLayout", state: DecodeState) -> None:
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

    # --- continuous batching (rollout.continuous_batching): one running batch that admits requests between
    # decode steps. An admission ends the running segment: its rows' keys/values go to the prefix store, and the
    # rows still decoding are carried into the new segment as requests whose prompt is prompt + emitted tokens,
    # so the store gives them back everything but the last sampled token, which the new prefill feeds (what their
    # next decode step would have fed); the admitted requests are prefilled beside them, with prefix reuse.

    @contextlib.contextmanager
    def continuous(self) -> Iterator["TransformersEngine"]:
        device = next(self.model.parameters()).device
        # each step enters autocast anew; an open outer autocast keeps its cast weights between steps
        outer = torch.autocast(device.type, enabled=False) if self.autocast else contextlib.nullcontext()
        try:
            with outer:
                yield self
        finally:
            self._queue, self._segment = [], None

    def enqueue(self, request: GenRequest, ticket: Any) -> None:
        self._queue.append(_Entry(request, ticket))

    @property
    def busy(self) -> bool:
        return bool(self._queue) or self._segment is not None

    def step(self) -> list[tuple[Any, GenResult]]:
        model = self.model
        was_training = model.training
        model.eval()
        try:
            with self._precision(model), self._attention(model), self._packed(model):
                if self._queue:
                    self._admit(model)
                return self._advance(model)
        finally:
            model.train(was_training)

    def _admit(self, model) -> None:
        """Start a new segment with the running rows and the queued requests that fit, once the queue holds a
        quarter of the rows still decoding (each admission copies the running rows' keys/values twice)."""
        seg = self._segment
        going = [] if seg is None else [seg.entries[i] for i in (~seg.state.done).nonzero().squeeze(1).tolist()]
        if len(self._queue) < max(1, len(going) // 4):
            return
        taken = self._take_admissible(going)
        if not taken:
            return
        store = self.prefix_cache if self._preallocatable(model) else None
        if seg is not None:
            self._carry(seg, store)
        entries = going + taken
        requests = [e.carried() for e in entries]
        device = next(model.parameters()).device
        layout = self._layout(model, requests, store)
        carried = sum(layout.suffix[u] for u in {layout.inverse[i] for i in range(len(going))})
        self.prefill_tokens -= carried  # counted apart: a carried row's first token is its next decode step's
        self.readmitted_tokens += carried
        state = DecodeState(requests, eos=self.eos, pad_token_id=self.pad_token_id, device=device,
                            generator=self._generator(torch.device(device)))
        _, logits, rows = self._start(model, layout, state.max_new, device, store)
        self._segment = _Segment(entries, layout, state, rows, logits, torch.zeros(len(entries), dtype=torch.bool))

    def _take_admissible(self, going: list[_Entry]) -> list[_Entry]:
        """Queued requests, first come first served, while the batch stays within ``max_batch_size`` rows and
        ``max_running_tokens`` (rows x the longest prompt + budget); an empty batch admits at least one."""
        longest = max((e.extent for e in going), default=0)
        taken: list[_Entry] = []
        for entry in self._queue:
            rows, extent = len(going) + len(taken) + 1, max(longest, entry.extent)
            if (going or taken) and (rows > self.max_batch_size or rows * extent > self.max_running_tokens):
                break
            taken.append(entry)
            longest = extent
        self._queue = self._queue[len(taken):]
        return taken

    def _carry(self, seg: _Segment, store: PrefixCache | None) -> None:
        """End ``seg``: its rows' keys/values go to the prefix store, rows still decoding keep what they emitted."""
        state, rows = seg.state, seg.rows
        for i in (~state.done).nonzero().squeeze(1).tolist():
            n = int(state.n_emitted[i])
            seg.entries[i].tokens += state.tokens_out[i, :n].tolist()
            seg.entries[i].logps += state.logps_out[i, :n].tolist()
        if store is not None:
            kept = list(range(len(seg.entries))) if rows.live is None else rows.live.tolist()
            self._store_rows(store, rows.cache, kept, rows.live, seg.layout, state)
        self._segment = None

    def _advance(self, model) -> list[tuple[Any, GenResult]]:
        """One decode step of the running segment (the rows' next tokens); the results of rows that stopped."""
        seg = self._segment
        if seg is None:
            return []
        state, rows, layout = seg.state, seg.rows, seg.layout
        all_done = state.sample(seg.step, seg.logits)
        finished = self._deliver(seg)
        store = self.prefix_cache if self._preallocatable(model) else None
        if all_done:
            self._carry(seg, store)
            return finished
        if self.compact_finished and self.preallocate_cache and self._preallocatable(model) \
                and rows.should_compact(state.done):
            with contextlib.ExitStack() as routing:  # the routing _compact installs is entered again below
                self._compact(model, rows, state, layout, store, routing)
        with self._row_routing(model, rows):
            seg.logits = rows.forward(model, state.feed(), seg.logits, layout.width + seg.step + 1)
        seg.step += 1
        return finished

    def _deliver(self, seg: _Segment) -> list[tuple[Any, GenResult]]:
        """``(ticket, result)`` of the rows that stopped since the last call."""
        state = seg.state
        newly = (state.done & ~seg.delivered).nonzero().squeeze(1).tolist()
        seg.delivered |= state.done
        out = []
        for i in newly:
            entry, n = seg.entries[i], int(state.n_emitted[i])
            tokens = entry.tokens + state.tokens_out[i, :n].tolist()
            logps = entry.logps + state.logps_out[i, :n].tolist()
            self.tokens_generated += len(tokens)
            out.append((entry.ticket, GenResult(tokens, logps, truncated=not bool(state.stopped[i]))))
        return out
