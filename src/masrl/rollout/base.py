"""The rollout engine contract: requests, results and the ``Engine`` protocol.

Everything outside ``rollout/`` (the scheduler's callers, the per-policy update, the runtimes)
talks to an engine only through the methods below; none of them asks which backend it holds.
A new backend subclasses ``Engine`` (the defaults fit an engine that needs nothing at that
point), implements ``generate`` and ``reseed``, and is built by ``masrl.rollout.factory.make_engine``.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import torch

from masrl.errors import EngineFailure


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
    version: int | None = None  # the weights' version that sampled it (rollout.max_staleness; None: on-policy)


def complete_batch(futures: Sequence[asyncio.Future], policy: str,
                   outcome: Sequence[GenResult] | BaseException) -> BaseException | None:
    """Every request of a batch gets its outcome: its result (``outcome``: one per future, in order), or, when the
    engine raised (``outcome``: the exception) or returned another number of results, an ``EngineFailure`` naming
    ``policy`` and the error. A future already done (a call cancelled while it waited) is skipped. The engine's
    error, or None when the batch was generated."""
    if not isinstance(outcome, BaseException) and len(outcome) != len(futures):
        outcome = RuntimeError(f"the engine returned {len(outcome)} results for {len(futures)} requests")
    if isinstance(outcome, BaseException):
        what = f"{type(outcome).__name__}: {str(outcome)[:500]}"
        for future in futures:
            if not future.done():  # an error of its own: each waiter raises it with its own traceback
                error = EngineFailure(policy, len(futures), what)
                error.__cause__ = outcome
                future.set_exception(error)
        return outcome
    for future, result in zip(futures, outcome):
        if not future.done():
            future.set_result(result)
    return None


class Engine(Protocol):
    """A policy's rollout backend.

    ``shares_training_model``: the engine decodes with the trainer's own model object (no weight
    copy): it must be on the device to generate, and its log-probs are computed as the trainer
    computes them. ``can_sleep``: ``sleep`` frees accelerator memory for the update.
    """

    shares_training_model: bool = False
    can_sleep: bool = False
    # continuous batching (``rollout.continuous_batching``): the engine keeps a running decode batch that
    # admits requests between decode steps (``enqueue``, ``step``); engines without it are flushed
    can_batch_continuously: bool = False

    def generate(self, requests: Sequence[GenRequest]) -> list[GenResult]:
        """One result per request, in order."""
        ...

    def reseed(self, seed: int) -> None:
        """Restart the sampling stream (the same seed gives the same samples)."""
        ...

    def submit(self, requests: Sequence[GenRequest]) -> Any:
        """Start generating; ``collect`` returns the results. Engines that generate elsewhere
        (a worker group) start here, so several policies generate at once; by default nothing starts
        before ``collect``."""
        return requests

    def collect(self, handle: Any) -> list[GenResult]:
        """The results of a ``submit``."""
        return self.generate(handle)

    def continuous(self) -> Any:
        """A context manager around one rollout of continuous batching (only when ``can_batch_continuously``):
        inside it ``enqueue`` and ``step`` serve requests; on exit, rows still queued or decoding are
        dropped (a failed rollout leaves nothing behind)."""
        raise NotImplementedError(f"{type(self).__name__} does not batch continuously")

    def enqueue(self, request: GenRequest, ticket: Any) -> None:
        """Queue ``request`` for the running batch; ``step`` returns its result with ``ticket``."""
        raise NotImplementedError(f"{type(self).__name__} does not batch continuously")

    def step(self) -> list[tuple[Any, GenResult]]:
        """Admit queued requests when it pays, run one decode step, return ``(ticket, result)`` of every
        request that finished in it."""
        raise NotImplementedError(f"{type(self).__name__} does not batch continuously")

    @property
    def busy(self) -> bool:
        """Requests are queued or decoding (continuous batching)."""
        return False

    def clear_prefix_cache(self) -> None:
        """Drop keys/values kept for reuse (end of a rollout; device memory about to be freed)."""

    def sleep(self, level: int) -> None:
        """Free accelerator memory while the trainer updates (only called when ``can_sleep``)."""

    def wake_up(self) -> None:
        """Take the memory back (``generate`` also does it)."""

    def release_decode_weights(self) -> None:
        """Drop copies of the weights only decoding uses, rebuilt by the next decode (an engine that keeps none: nothing
        to do; ``rollout.keep_decode_weights: false``)."""

    def weights_changed(self, model: torch.nn.Module, *, base_changed: bool) -> None:
        """The trainer changed ``model`` (an update, SFT, a restored checkpoint): serve the new weights
        from now on. ``base_changed``: the base weights changed too, not only LoRA adapters."""

    def model_sharded(self) -> None:
        """The training model this engine shares was sharded in place (FSDP2, ``runtime.strategy: fsdp``):
        decode through the sharded module from now on. Engines with their own weights ignore it."""

    def close(self) -> None:
        """Release what the engine holds."""
