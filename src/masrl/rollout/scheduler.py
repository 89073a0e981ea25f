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
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Mapping, Sequence

from masrl.rollout.engine import Engine, GenRequest, GenResult


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
        self._in_engines = 0  # requests in those engines, not returned yet

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
            self._in_engines += 1
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
        sessions = contextlib.ExitStack()
        try:
            if self.continuous:
                for name, engine in self.engines.items():
                    if engine.can_batch_continuously:
                        sessions.enter_context(engine.continuous())
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
            sessions.close()  # rows still queued or decoding are dropped
            self._streaming, self._in_engines = [], 0
            for engine in self.engines.values():  # reused keys/values live for one rollout
                engine.clear_prefix_cache()

    def _step(self, policies: list[str]) -> None:
        """One continuous-batching step of each engine; finished rows go back to their episodes (a cancelled
        episode's result is dropped)."""
        start = time.perf_counter()
        for name in policies:
            finished = self.engines[name].step()
            self.stats.decode_steps += 1
            for future, result in finished:
                self._in_engines -= 1
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
            by_policy[policy].append((request, future))
        self.stats.flushes += 1
        start = time.perf_counter()
        # remote engines (Ray worker groups) generate concurrently: submit every policy's batch first
        handles = {policy: self.engines[policy].submit([r for r, _ in items]) for policy, items in by_policy.items()}
        for policy, items in by_policy.items():
            results = self.engines[policy].collect(handles[policy])
            self.stats.engine_calls += 1
            self.stats.requests += len(items)
            self.stats.batch_sizes.append(len(items))
            for (_, future), result in zip(items, results):
                self.stats.generated_tokens += len(result.response_ids)
                future.set_result(result)
        self.stats.generate_seconds += time.perf_counter() - start


EngineFactory = Callable[[str], Engine]
