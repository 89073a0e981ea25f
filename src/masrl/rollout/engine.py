"""Rollout engines: generate token ids and per-token logprobs for a batch of prompts.

``TransformersEngine`` runs batched KV-cache decoding with any transformers causal LM.
Each row has its own temperature, top-p and token budget, so agents that share a policy
(and have different sampling settings) are generated in one batch. Logprobs are
``log_softmax(logits / temperature)`` at the sampled token (top-p does not change them),
which is what the trainer recomputes, so they can serve as the PPO "old" logprobs
(``masrl.rollout.sampling``).

Prefix caching (``prefix_cache=True``, the default): rows with the same prompt in one call (a GRPO
group) are prefilled once, and a prompt that starts with the tokens of a row generated earlier in
the same rollout (a multi-agent workflow's next turn re-reads the conversation so far) reuses that
row's keys and values and prefills only the new tokens. See ``PrefixCache`` and
``masrl.rollout.prefix_reuse``.

The engine itself holds the settings, the precision and attention setup of a decode (autocast, the CPU
decode attention, packed bf16 weights, the fast decode step) and the prefix store; its collaborators decode:
``StaticDecoder`` (one call's batch) and
``ContinuousBatcher`` (the running batch of continuous batching).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

import torch

from masrl.models.cpu_attention import NAME as CPU_ATTENTION, cpu_attention
from masrl.models.fast_decode import FastDecode
from masrl.models.packed_linear import PackedLinears, available as packed_linear_available
from masrl.models.precision import resolve_autocast
from masrl.rollout.base import Engine, GenRequest, GenResult
from masrl.rollout.continuous import ContinuousBatcher
from masrl.rollout.kv_cache import preallocated_cache
from masrl.rollout.prefix_cache import PrefixCache
from masrl.rollout.prefix_reuse import fill_prefixes
from masrl.rollout.sampling import DecodeState, run_decode
from masrl.rollout.sampling import (  # noqa: F401 - also importable from here (tests, benchmarks)
    INVERSE_CDF_MIN_VOCAB, SamplePlan as _SamplePlan, inverse_cdf_sample, sample as _sample)
from masrl.rollout.static_decode import StaticDecoder

__all__ = ["DecodeState", "Engine", "GenRequest", "GenResult", "PrefixCache", "TransformersEngine", "run_decode"]

# `autocast: auto` decodes in bf16 on a CPU only from this hidden size: a decode step of a tiny Llama (4 layers,
# 64 / 16 rows) under bf16 autocast takes 1.15-1.25x the float32 time at 128, 0.97-1.15x at 192, 0.84-1.05x at 256,
# 0.63-0.83x from 384 (benchmarks/autocast_size.py --decode; docs/performance.md, "Precision")
AUTO_BF16_MIN_HIDDEN = 256


def decode_autocast(setting: str | None, device: str | torch.device, hidden: int) -> str | None:
    """The autocast dtype the in-process engine decodes in for ``trainer.autocast`` ``setting`` on ``device``, for a
    model ``hidden`` wide (``AUTO_BF16_MIN_HIDDEN``), or None (float32)."""
    dtype = resolve_autocast(setting, device)
    if setting == "auto" and torch.device(device).type == "cpu" and hidden < AUTO_BF16_MIN_HIDDEN:
        return None  # a narrow model decodes faster in float32 on a CPU (the casts cost more than they save)
    return dtype


def _hidden_size(model: torch.nn.Module) -> int:
    """The width of the model's token embeddings (its hidden size); a large number when it has none."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return int(getattr(embeddings, "embedding_dim", 1 << 30))


class TransformersEngine(Engine):
    """Batched sampling with a KV cache; the model is shared with the trainer (no weight copies).

    The engine holds the settings, the precision and attention setup of a decode and the prefix store; one
    call's batch is decoded by ``StaticDecoder`` (prefix reuse:
    ``masrl.rollout.prefix_reuse``), the running batch of continuous batching is
    ``ContinuousBatcher``.
    """

    shares_training_model = True
    can_batch_continuously = True

    def __init__(self, model: torch.nn.Module, *, eos_token_ids: Sequence[int], pad_token_id: int,
                 max_batch_size: int = 256, seed: int = 0, preallocate_cache: bool = True,
                 autocast: str | torch.dtype | None = None, prefix_cache: bool = True,
                 prefix_cache_mib: float = 1024.0, compact_finished: bool = True,
                 max_running_tokens: int = 65536, decode_attention: bool = True, packed_linear: bool = True,
                 fast_decode: bool = True, max_prefill_tokens: int | None = None,
                 compile_decode: bool = False):
        self.model = model
        # decode steps of plain float32 Llama models computed from the weights, bitwise transformers' forward in
        # about half the operator calls (masrl.models.fast_decode); others keep transformers' forward
        self.fast_decode = fast_decode
        self._fast: FastDecode | None = None  # the last one built (its stacked weights reused while unchanged)
        # the base model's fast steps as one compiled graph (masrl.models.compiled_decode; rollout.compile_decode)
        self.compile_decode = compile_decode
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
        # most prompt tokens (rows x padded length) per prefill forward (rollout.max_prefill_tokens; None: no limit)
        self.max_prefill_tokens = max_prefill_tokens
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
        # rows: max_batch_size)
        self.max_running_tokens = max_running_tokens
        self.readmitted_tokens = 0  # tokens prefilled again for rows carried into a new segment
        # the collaborators: one call's batch from prefill to its last row, and the running batch
        self.decoder = StaticDecoder(self)
        # called after each decoded batch: the trainer's heap trim under trainer.memory_defaults (a call's keys/values
        # and transients leave holes that the next call's, sized otherwise, do not fill; masrl.runtime.malloc)
        self.after_batch: Callable[[], object] | None = None
        self.batcher = ContinuousBatcher(self, self.decoder)

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
        self.batcher.restart()  # rows decoding (a continuous batch beside the update) go on with the new weights
        if base_changed:  # after an adapter update the fast decoder keeps its stacked base weights
            self._fast = None
        if base_changed and self.packed_linears is not None:
            self.packed_linears.clear()

    def release_decode_weights(self) -> None:
        """Drop the copies of the weights only decoding uses (prepacked bf16 Linear weights, the fast decoder's
        stacked weights); the next decode builds them again from the model (the same tokens)."""
        self._fast = None
        if self.packed_linears is not None:
            self.packed_linears.clear()

    def generator_for(self, device: torch.device) -> torch.Generator:
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
            if self.after_batch is not None:
                self.after_batch()
        return out

    def _generate_batch(self, requests: Sequence[GenRequest]) -> list[GenResult]:
        model = self.model
        with self.decoding(model):
            return self._decode(model, requests)

    def _decode(self, model, requests: Sequence[GenRequest]) -> list[GenResult]:
        """One batch, under ``decoding`` (``StaticDecoder.decode``)."""
        return self.decoder.decode(model, requests)

    @contextlib.contextmanager
    def decoding(self, model) -> Iterator[None]:
        """``model`` in eval mode under this engine's precision, attention and packed weights (back to its
        training mode after)."""
        was_training = model.training
        model.eval()
        try:
            with self._precision(model), self._attention(model), self._packed(model):
                yield
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
        dtype = (decode_autocast(self.autocast, device, _hidden_size(model)) if isinstance(self.autocast, str)
                 else self.autocast)
        if not dtype:  # FSDP2 (sharded_model) must not allocate its unsharded weights as inference tensors
            return torch.no_grad() if self.sharded_model else torch.inference_mode()
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        stack = contextlib.ExitStack()
        stack.enter_context(torch.no_grad())
        stack.enter_context(torch.autocast(device.type, dtype=dtype))
        return stack

    def _attention(self, model) -> contextlib.AbstractContextManager:
        """The model's attention while this engine decodes: ``sdpa`` models on CPU switch to
        ``masrl.models.cpu_attention.attention_forward``."""
        return cpu_attention(model) if self.decode_attention else contextlib.nullcontext()

    def _packed(self, model) -> contextlib.AbstractContextManager:
        """bf16 autocast on a CPU: the model's large Linear layers use prepacked weights while this engine decodes
        (``masrl.models.packed_linear.PackedLinears``)."""
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

    def preallocatable(self, model) -> bool:
        """Whether ``model``'s cache can be preallocated (prefix reuse works on those buffers)."""
        key = id(model)
        if getattr(self, "_preallocatable_for", None) != key:
            self._preallocatable_ok = preallocated_cache(model, 1) is not None
            self._preallocatable_for = key
        return self._preallocatable_ok

    def fast_decoder(self, model, cache) -> FastDecode | None:
        """The lean decode step for ``model`` writing into ``cache`` (``masrl.models.fast_decode``), or None
        where it does not apply (transformers' forward then)."""
        # the fast step writes through the preallocated cache's layers (FSDP2 shards also carry hooks, which
        # FastDecode.for_model refuses on its own)
        if (not self.fast_decode or self.sharded_model or cache is None or not self.preallocate_cache
                or not self.preallocatable(model)):
            return None
        self._fast = FastDecode.for_model(model, self._fast, packed=self.packed_linears is not None,
                                          shared_packs=self.packed_linears)
        if self._fast is not None:
            self._fast.compiled = self.compile_decode
        return self._fast

    def cache_dtype(self, model) -> torch.dtype | None:
        """The dtype of the keys/values a decode of ``model`` allocates (``_cache_dtype``)."""
        return self._cache_dtype(model)

    def prefix_store(self, model) -> PrefixCache | None:
        """The prefix store when ``model``'s cache can be preallocated (reuse works on those buffers), else None."""
        return self.prefix_cache if self.preallocatable(model) else None

    _fill_prefixes = staticmethod(fill_prefixes)  # the prefix gather (masrl.rollout.prefix_reuse.fill_prefixes)

    # --- continuous batching (rollout.continuous_batching): the running batch is the batcher's
    # (masrl.rollout.continuous); each step runs under this engine's decoding setup

    @contextlib.contextmanager
    def continuous(self) -> Iterator["TransformersEngine"]:
        with self.batcher.running():
            yield self

    def enqueue(self, request: GenRequest, ticket: Any) -> None:
        self.batcher.enqueue(request, ticket)

    @property
    def busy(self) -> bool:
        return self.batcher.busy

    def step(self) -> list[tuple[Any, GenResult]]:
        model = self.model
        with self.decoding(model):
            return self.batcher.step(model)
