"""Rollouts beside the update (``rollout.max_staleness > 0``): an engine that decodes with its own copy of a
policy's weights, replaced only at a version boundary, and a producer that generates the batches of later steps
while the trainer updates, never further ahead than the staleness bound allows.

``VersionedEngine`` wraps a policy's engine. ``generate`` holds a lock for one batch, so every turn of the
batch is sampled by one version of the weights and carries it (``GenResult.version``, then
``turn.info["policy_version"]``). ``weights_changed`` (the trainer's update, SFT, a restored checkpoint) takes the
same lock, brings the new weights to the engine and counts a new version: an episode in flight continues with
the new weights from its next call (a partial rollout), each turn keeping its own version. An in-process engine
(which decodes with the trainer's own model) is moved onto a copy of the model that shares every frozen
parameter (the base under LoRA adapters) and copies only the trainable ones; an engine with its own weights
(vLLM) keeps them and receives the new ones through its own weight sync. Each runtime wraps its engines
(``version_rollouts``): the local runtime in this process, the Ray runtime in every rank of a worker group, whose
actor then generates in one thread while it updates in another.

``RolloutsAhead`` runs ``produce(step)`` for the coming steps in a thread. The bound (``k`` =
``max_staleness``):

* ``stale: wait``: the batch of step s starts only once the trainer has finished the updates of steps < s - k.
  Its turns are sampled by weights at most k versions older than those that train on them: a guarantee (no
  timing involved), checked again when a batch is taken.
* ``stale: drop``: the batch of step s starts as soon as step s - k - 1's batch was taken, one batch further
  ahead (the producer idles less); turns more than k versions old when their step trains (those sampled before
  the update of step s - k - 1 ended) are marked ``info["stale"]`` and left out of the loss.
"""
from __future__ import annotations

import contextlib
import copy
import threading
from collections import Counter
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from masrl.rollout.base import Engine, GenResult


class VersionedEngine:
    """``inner`` behind a version counter. ``training_model``: the trainer's model that ``inner`` (an in-process
    engine) decodes with, replaced by ``rollout_copy(training_model)``; None: ``inner`` holds its own weights."""

    shares_training_model = False  # the trainer recomputes old log-probs with its own (current) weights

    def __init__(self, inner: Engine, training_model: torch.nn.Module | None = None):
        self.inner = inner
        self.lock = threading.Lock()
        self.version = 0
        self.queued: dict[Any, int] = {}  # continuous batching: each queued row's version when it was queued
        self.copies = training_model is not None
        if self.copies:
            inner.model = rollout_copy(training_model)
            inner.weights_changed(inner.model, base_changed=True)

    def __getattr__(self, name: str) -> Any:  # everything else is the inner engine's
        return getattr(self.inner, name)

    def generate(self, requests) -> list[GenResult]:
        with self.lock:
            results = self.inner.generate(requests)
            for result in results:
                result.version = self.version
            return results

    def submit(self, requests):
        return requests

    def collect(self, handle) -> list[GenResult]:
        return self.generate(handle)

    # continuous batching: the lock is held for one decode step; a version boundary between two steps carries
    # the rows decoding onto the new weights (``ContinuousBatcher.restart``). Such a row is stamped with the
    # version current when it was queued, the oldest that can have sampled one of its tokens: its age is never
    # under-counted, and its per-token behaviour log-probs are each its own version's.
    @property
    def can_batch_continuously(self) -> bool:
        return bool(getattr(self.inner, "can_batch_continuously", False))

    @contextlib.contextmanager
    def continuous(self) -> Iterator["VersionedEngine"]:
        session = self.inner.continuous()
        with self.lock:
            session.__enter__()
        try:
            yield self
        finally:
            with self.lock:
                session.__exit__(None, None, None)
                self.queued.clear()

    def enqueue(self, request, ticket) -> None:
        with self.lock:
            self.inner.enqueue(request, ticket)
            self.queued[ticket] = self.version

    def step(self) -> list:
        with self.lock:
            finished = self.inner.step()
            for ticket, result in finished:
                result.version = self.queued.pop(ticket, self.version)
            return finished

    def weights_changed(self, model: torch.nn.Module, *, base_changed: bool) -> None:
        """The version boundary, between two batches: the trainer's weights into the copy (only the tensors it
        does not share), or into the engine's own weights by its weight sync."""
        with self.lock, torch.no_grad():
            if self.copies:
                copy_unshared(model, self.inner.model)
                self.inner.weights_changed(self.inner.model, base_changed=base_changed)
            else:
                self.inner.weights_changed(model, base_changed=base_changed)
            self.version += 1


def versioned(engine: Engine, model: torch.nn.Module) -> VersionedEngine:
    """``engine`` (the rollout engine of the policy whose training model is ``model``) behind a version
    counter: onto a copy of the weights when it decodes with ``model`` itself."""
    if isinstance(engine, VersionedEngine):
        return engine
    return VersionedEngine(engine, model if getattr(engine, "shares_training_model", False) else None)


def rollout_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` that shares its frozen parameters (no second copy of a LoRA base) and owns the
    trainable ones, every LoRA adapter (frozen or not: PEFT switches adapters' ``requires_grad``) and every
    buffer."""
    frozen = {id(p): p for name, p in model.named_parameters() if not p.requires_grad and "lora_" not in name}
    return copy.deepcopy(model, memo=frozen)


def copy_unshared(source: torch.nn.Module, target: torch.nn.Module) -> int:
    """``source``'s state into ``target``, tensor by tensor, skipping the tensors both share; the bytes copied."""
    into = target.state_dict()
    copied = 0
    for key, value in source.state_dict().items():
        if into[key].data_ptr() != value.data_ptr():
            into[key].copy_(value)
            copied += value.numel() * value.element_size()
    return copied


def staleness(turns: Sequence, versions: Mapping[str, int]) -> list[int | None]:
    """Versions between the weights that sampled each turn and the current ones (None: not versioned)."""
    out = []
    for t in turns:
        v = t.info.get("policy_version")
        out.append(None if v is None or t.policy not in versions else versions[t.policy] - v)
    return out


class RolloutsAhead:
    """``produce(step)`` for steps ``first_step`` .. ``last_step - 1`` in a thread, at most ``max_staleness``
    steps ahead of the trainer (module docstring). ``versions()``: the current version of each policy."""

    def __init__(self, produce: Callable[[int], Any], *, first_step: int, last_step: int, max_staleness: int,
                 stale: str, versions: Callable[[], Mapping[str, int]]):
        if max_staleness < 1 or stale not in ("wait", "drop"):
            raise ValueError(f"max_staleness must be >= 1 and stale wait or drop; got {max_staleness}, {stale!r}")
        self.produce, self.k, self.wait, self.versions = produce, max_staleness, stale == "wait", versions
        self.last_step = last_step
        self.cond = threading.Condition()
        self.updated = first_step  # steps whose update the trainer finished
        self.taken = first_step  # steps whose batch the trainer took
        self.results: dict[int, tuple[bool, Any]] = {}
        self.paused = self.busy = self.closed = False
        self.thread = threading.Thread(target=self._run, args=(first_step,), name="masrl-rollouts-ahead",
                                       daemon=True)
        self.thread.start()

    def may_start(self, step: int) -> bool:
        """The bound: may the batch of ``step`` be generated now?"""
        return step - (self.updated if self.wait else self.taken) <= self.k

    def _run(self, step: int) -> None:
        while step < self.last_step:
            with self.cond:
                self.cond.wait_for(lambda: self.closed or (not self.paused and self.may_start(step)))
                if self.closed:
                    return
                self.busy = True
            try:
                result = (True, self.produce(step))
            except BaseException as e:  # handed to the trainer by take()
                result = (False, e)
            with self.cond:
                self.results[step], self.busy = result, False
                self.cond.notify_all()
            if not result[0]:
                return
            step += 1

    def take(self, step: int) -> Any:
        """The batch of ``step`` (waits for it); a failure of its production is raised here."""
        with self.cond:
            self.cond.wait_for(lambda: step in self.results)
            ok, value = self.results.pop(step)
            self.taken = step + 1
            self.cond.notify_all()
        if not ok:
            raise value
        return value

    def check(self, turns: Sequence) -> dict[str, float]:
        """Before the update of the step whose batch ``turns`` are: mark turns more than k versions old
        (``drop``) or refuse them (``wait``: the bound guarantees none), and the staleness histogram."""
        ages = staleness(turns, self.versions())
        counts = Counter(a for a in ages if a is not None)
        old = [t for t, a in zip(turns, ages) if a is not None and a > self.k]
        if old and self.wait:
            raise RuntimeError(f"{len(old)} turns are more than {self.k} versions old under rollout.stale: wait")
        for t in old:
            t.info["stale"] = True
        total = max(sum(counts.values()), 1)
        metrics = {f"rollout/staleness_{a}": n / total for a, n in sorted(counts.items())}
        metrics["rollout/staleness_max"] = float(max(counts, default=0))
        metrics["rollout/stale_dropped"] = float(len(old))
        return metrics

    def finished_update(self, step: int) -> None:
        """The trainer finished the update of ``step``."""
        with self.cond:
            self.updated = step + 1
            self.cond.notify_all()

    def pause(self) -> "_Paused":
        """``with ahead.pause():`` no batch is being generated inside (an evaluation uses the engines)."""
        return _Paused(self)

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        self.thread.join()


class _Paused:
    def __init__(self, ahead: RolloutsAhead):
        self.ahead = ahead

    def __enter__(self) -> None:
        with self.ahead.cond:
            self.ahead.paused = True
            self.ahead.cond.wait_for(lambda: not self.ahead.busy)

    def __exit__(self, *exc) -> None:
        with self.ahead.cond:
            self.ahead.paused = False
            self.ahead.cond.notify_all()
