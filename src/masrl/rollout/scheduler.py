"""Rollout scheduler: runs many episodes concurrently and batches their agent calls per policy.

Every episode is an asyncio task. An agent call enqueues a request and waits. When every
unfinished episode is waiting, the scheduler flushes: the pending requests are put in episode
order (then each episode's call order), grouped by policy (whatever agent made them) and each
group is generated in one engine call. This gives the largest possible batches with a
deterministic order, even when episodes await threads (retrievers) that finish in any order,
and nothing reloads weights per agent call.

With ``continuous=True`` (``rollout.continuous_batching``) there is no barrier for engines that batch
continuously (the in-process engine): each request goes to its policy's engine as its episode makes it,
the scheduler runs one decode step of every busy engine at a time and hands each finished row back to its
episode at once, so an episode's next call joins the running batch while other rows still decode.
Requests are admitted in arrival order (deterministic unless episodes await threads); other engines
(vLLM, Ray worker groups) are still flushed when every episode waits.

An engine that raises while generating (a model error, out of memory, a bad token id) fails that batch only: every
request waiting on it gets an ``EngineFailure`` naming the policy and the error at once (the episode's workflow
raises it, so the episode fails and is counted; through the gateway the program's request is answered a 500), the
engine's reused keys/values are dropped and, under continuous batching, its running batch starts afresh; later
requests are served. A rollout that ends otherwise (an error that stops it) cancels every request still waiting:
no request is left waiting for a batch that will never come.
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Mapping, Sequence

from masrl.errors import EngineLost
from masrl.rollout.base import complete_batch
from masrl.rollout.engine import Engine, GenRequest, GenResult

log = logging.getLogger(__name__)


@dataclass
class RolloutStats:
    flushes: int = 0
    engine_calls: int = 0
    requests: int = 0
    generated_tokens: int = 0
    generate_seconds: float = 0.0
    batch_sizes: list[int] = field(default_factory=list)
    decode_steps: int = 0  # continuous batching: engine steps (each admits, decodes one token per row)
    episode_errors: int = 0  # episodes whose workflow raised (masrl.rollout.runner.run_episodes)
    empty_replies: int = 0  # of which an environment's rollout ended on an empty model reply (logged once)
    engine_failures: int = 0  # batches (or continuous steps) an engine raised on: their requests failed


# (episode index, calls so far) of the episode whose code is running; asyncio tasks that an episode
# starts (e.g. parallel agent calls under gather) inherit it
_EPISODE: contextvars.ContextVar[tuple[int, list[int]] | None] = contextvars.ContextVar("masrl_episode", default=None)


class RolloutScheduler:
    def __init__(self, engines: Mapping[str, Engine], *, continuous: bool = False):
        self.engines = dict(engines)
        self.continuous = continuous
        self.stats = RolloutStats()
        self._pending: list[tuple[tuple[int, int], str, GenRequest, asyncio.Future]] = []
        self._active = 0
        self._wake: asyncio.Event | None = None
        self._streaming: list[str] = []  # policies whose engine batches continuously in this rollout
        self._rows: dict[str, set[asyncio.Future]] = {}  # the requests in each of those engines, not returned yet
        self._sessions: dict[str, contextlib.AbstractContextManager] = {}  # their continuous() sessions

    @property
    def _in_engines(self) -> int:
        return sum(len(rows) for rows in self._rows.values())

    async def generate(self, policy: str, request: GenRequest) -> GenResult:
        if policy not in self.engines:
            raise KeyError(f"no rollout engine for policy {policy!r}; policies: {sorted(self.engines)}")
        future = asyncio.get_running_loop().create_future()
        episode = _EPISODE.get()
        if episode is None:
            key = (len(self._pending), 0)
        else:
            key = (episode[0], episode[1][0])
            episode[1][0] += 1
        if policy in self._streaming:
            self.engines[policy].enqueue(request, future)
            self._rows[policy].add(future)
            self._wake.set()
        else:
            self._pending.append((key, policy, request, future))
            self._maybe_wake()
        return await future

    def run(self, coroutines: Sequence[Awaitable]) -> list:
        """Run the episodes' coroutines to completion; results in input order."""
        return asyncio.run(self._run(list(coroutines)))

    async def _run(self, coroutines: list[Awaitable]) -> list:
        self._wake = asyncio.Event()
        self._active = len(coroutines)
        self._pending = []

        async def wrapped(index, coro):
            _EPISODE.set((index, [0]))
            try:
                return await coro
            finally:
                self._active -= 1
                self._maybe_wake()

        tasks = [asyncio.ensure_future(wrapped(i, c)) for i, c in enumerate(coroutines)]
        try:
            if self.continuous:
                for name, engine in self.engines.items():
                    if engine.can_batch_continuously:
                        self._open(name)
                        self._streaming.append(name)
            while self._active > 0:
                busy = [name for name in self._streaming if self.engines[name].busy]
                if busy:
                    self._step(busy)
                    await asyncio.sleep(0)  # the episodes whose rows finished run on to their next call
                else:
                    await self._wake.wait()
                    self._wake.clear()
                if self._pending and len(self._pending) + self._in_engines >= self._active:
                    self._flush()
                failed = next((t for t in tasks if t.done() and t.exception() is not None), None)
                if failed is not None:
                    raise failed.exception()
            return [t.result() for t in tasks]
        finally:
            for t in tasks:
                t.cancel()
            # requests still waiting (a rollout stopped by an error) are cancelled: whoever awaits one (an episode,
            # a gateway request's call) ends now, not at a batch that will never come
            waiting = [future for _, _, _, future in self._pending] + [f for rows in self._rows.values() for f in rows]
            for future in waiting:
                future.cancel()
            self._pending = []
            for name in list(self._sessions):  # rows still queued or decoding are dropped
                self._close(name)
            self._streaming, self._rows = [], {}
            for engine in self.engines.values():  # reused keys/values live for one rollout
                engine.clear_prefix_cache()

    def _open(self, name: str) -> None:
        """Start continuous batching on ``name``'s engine (its session lasts until ``_close``)."""
        session = self.engines[name].continuous()
        session.__enter__()
        self._sessions[name], self._rows[name] = session, set()

    def _close(self, name: str) -> None:
        self._sessions.pop(name).__exit__(None, None, None)

    def _failed(self, name: str, requests: int, error: BaseException) -> None:
        """``name``'s engine failed on a batch of ``requests`` (each got an ``EngineFailure``: ``complete_batch``):
        its reused keys/values (perhaps half written) are dropped; the scheduler's first failure is logged with
        its traceback, later ones in one line."""
        self.stats.engine_failures += 1
        self.engines[name].clear_prefix_cache()
        if self.stats.engine_failures == 1:
            log.error("the rollout engine of policy %r raised on a batch of %d requests: they fail (their episodes "
                      "are invalid), later requests are served; later engine failures are logged in one line",
                      name, requests, exc_info=error)
        else:
            log.warning("the rollout engine of policy %r raised on a batch of %d requests: %s: %s", name,
                        requests, type(error).__name__, str(error)[:300])

    def _step(self, policies: list[str]) -> None:
        """One continuous-batching step of each engine; finished rows go back to their episodes (a cancelled
        episode's result is dropped)."""
        start = time.perf_counter()
        for name in policies:
            try:
                finished = self.engines[name].step()
            except EngineLost:  # nothing more can be served: the rollout stops
                raise
            except Exception as e:  # noqa: BLE001 - the engine's error fails the rows it held, not the rollout
                rows = list(self._rows[name])
                error = complete_batch(rows, name, e)
                self._close(name)  # its running batch is dropped; the next request starts a fresh one
                self._open(name)
                self._failed(name, len(rows), error)
                continue
            self.stats.decode_steps += 1
            for future, result in finished:
                self._rows[name].discard(future)
                self.stats.requests += 1
                self.stats.generated_tokens += len(result.response_ids)
                if not future.done():
                    future.set_result(result)
        self.stats.generate_seconds += time.perf_counter() - start

    def _maybe_wake(self) -> None:
        if self._wake is not None and (len(self._pending) >= self._active or self._active == 0):
            self._wake.set()

    def _flush(self) -> None:
        # in episode order, not arrival order: episodes that await a thread (a retriever call) arrive in
        # whatever order the threads finish, and the batch order decides which rows get which random draws
        pending, self._pending = sorted(self._pending, key=lambda item: item[0]), []
        by_policy: dict[str, list[tuple[GenRequest, asyncio.Future]]] = defaultdict(list)
        for _, policy, request, future in pending:
            if not future.done():  # a call cancelled while it waited (a gateway request past its deadline)
                by_policy[policy].append((request, future))
        self.stats.flushes += 1
        start = time.perf_counter()
        try:
            self._generate(by_policy)
        finally:  # an error that stops the rollout (not an engine's Exception) leaves no request of the flush waiting
            for _, _, _, future in pending:
                future.cancel()
        self.stats.generate_seconds += time.perf_counter() - start

    def _generate(self, by_policy: dict[str, list[tuple[GenRequest, asyncio.Future]]]) -> None:
        """Each policy's batch through its engine; every request gets its result or its batch's ``EngineFailure``."""
        # remote engines (Ray worker groups) generate concurrently: submit every policy's batch first
        handles: dict[str, object] = {}
        for policy, items in by_policy.items():
            try:
                handles[policy] = self.engines[policy].submit([r for r, _ in items])
            except EngineLost:
                raise
            except Exception as e:  # noqa: BLE001 - the batch fails, the other policies' go on
                handles[policy] = _Raised(e)
        for policy, items in by_policy.items():
            handle = handles[policy]
            try:
                outcome = handle.error if isinstance(handle, _Raised) else self.engines[policy].collect(handle)
            except EngineLost:  # a dead worker: the rollout stops (its requests are cancelled)
                raise
            except Exception as e:  # noqa: BLE001 - the batch fails, the other policies' go on
                outcome = e
            self.stats.engine_calls += 1
            self.stats.requests += len(items)
            self.stats.batch_sizes.append(len(items))
            error = complete_batch([future for _, future in items], policy, outcome)
            if error is not None:
                self._failed(policy, len(items), error)
            else:
                self.stats.generated_tokens += sum(len(result.response_ids) for result in outcome)


class _Raised:
    """A batch whose ``submit`` raised ``error``."""

    def __init__(self, error: Exception):
        self.error = error


EngineFactory = Callable[[str], Engine]
