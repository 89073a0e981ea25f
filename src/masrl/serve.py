"""``masrl serve RUN_DIR|EXPORT_DIR``: the gateway's OpenAI-compatible endpoint for a trained team, outside
training, so that the program the team was trained in (or any OpenAI client) can use what it learned.

    masrl serve runs/my-team-seed0 --port 8000            # the run's newest checkpoint that loads
    masrl serve exported/ --port 8000 --api-key secret     # a `masrl export` folder
    # then: openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="secret")  model = an agent's name

Requests arriving within ``--batch-window-ms`` of each other are generated as one batch per policy; each agent
samples with its configured settings and adapter, as in training (docs/gateway.md).
"""
from __future__ import annotations

import asyncio
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Mapping

from masrl.errors import UserInputError
from masrl.serve_team import load_run as _load
from masrl.serve_team import serve_until


class ServeBatcher:
    """``scheduler.generate`` for a standing server: requests within ``window_s`` of the first pending one go to
    their policy's engine together; one engine call at a time (engines are not thread-safe). A batch the engine
    raises on (or returns too few results for) fails each of its requests with an ``EngineFailure`` (the gateway's
    500 ``engine_error``) and the next batch is served; a flush that is cancelled cancels the requests it holds."""

    def __init__(self, engines: Mapping, window_s: float = 0.005):
        self.engines, self.window_s = dict(engines), window_s
        self.pending: list = []
        self._scheduled = False
        self._lock: asyncio.Lock | None = None
        self.batches: list[int] = []

    async def generate(self, policy: str, request):
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.pending.append((policy, request, future))
        if not self._scheduled:
            self._scheduled = True
            loop.call_later(self.window_s, lambda: asyncio.ensure_future(self._flush()))
        return await future

    async def _flush(self) -> None:
        from masrl.rollout.base import complete_batch

        self._lock = self._lock or asyncio.Lock()
        async with self._lock:
            self._scheduled = False
            batch, self.pending = self.pending, []
            try:
                for policy in dict.fromkeys(p for p, _, _ in batch):
                    items = [(r, f) for p, r, f in batch if p == policy and not f.done()]
                    if not items:  # every request of it gave up (past the gateway's deadline)
                        continue
                    self.batches.append(len(items))
                    try:
                        outcome = await asyncio.to_thread(self.engines[policy].generate, [r for r, _ in items])
                    except Exception as e:  # noqa: BLE001 - each waiting request gets the error, the next batch goes on
                        outcome = e
                    complete_batch([f for _, f in items], policy, outcome)
            finally:  # cancelled mid-batch (the server stops): no request is left waiting
                for _, _, future in batch:
                    future.cancel()


class _StandingTeam:
    """What the gateway needs of a team: its agents and ``call``."""

    def __init__(self, agents, call):
        self.agents, self._call = tuple(agents), call

    async def call(self, agent: str, prompt):
        return await self._call(agent, prompt)


LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")


def run_serve(args) -> int:
    if args.host not in LOCAL_HOSTS and not args.api_key:
        raise UserInputError(f"masrl serve --host {args.host}: a non-local address needs --api-key (clients must "
                             "send it); the default 127.0.0.1 serves this machine only")
    from masrl.gateway import EpisodeSession, Gateway
    from masrl.team_runner import TeamRunner

    cfg, checkpoint = _load(Path(args.path), args.overrides)
    if getattr(args, "team", False):  # the whole team as one model (masrl.serve_team)
        from masrl.serve_team import bind, run_team

        sock = bind(args)  # listen before loading the models: an address that cannot be used is said at once
        try:
            with TeamRunner(cfg, progress=False) as runner:
                where = runner.load_checkpoint(checkpoint) if checkpoint is not None else Path(args.path)
                return run_team(args, runner, where, sock)
        finally:
            sock.close()
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, name="masrl-serve-loop", daemon=True).start()
    ready: Future = Future()  # the team's call, once its models are loaded: calls that come earlier wait for it

    async def call(agent: str, prompt):
        return await (await asyncio.wrap_future(ready))(agent, prompt)

    # listen before loading the models: an address that cannot be used is said at once, naming the flag
    gateway = Gateway(args.host, args.port, request_timeout_s=args.request_timeout, host_setting="--host",
                      port_setting="--port")
    gateway.default = EpisodeSession(_StandingTeam(cfg.agents, call), loop, key=args.api_key or "",
                                     base_url=f"{gateway.url}/v1", standing=True)
    gateway.default_key = args.api_key
    gateway.max_new_tokens = {a: c.max_new_tokens for a, c in cfg.agents.items()}
    try:
        with TeamRunner(cfg, progress=False) as runner:
            where = runner.load_checkpoint(checkpoint) if checkpoint is not None else Path(args.path)
            batcher = ServeBatcher({n: p.engine for n, p in runner.policies.items()}, args.batch_window_ms / 1000)
            ready.set_result(runner.call(batcher))
            print(f"masrl serve: {where} -> {gateway.url}/v1 (model = an agent: {', '.join(cfg.agents)})", flush=True)
            serve_until(args.max_seconds)
    finally:
        if not ready.done():
            ready.set_exception(RuntimeError("masrl serve stopped before its models were loaded"))
        gateway.shutdown()
        loop.call_soon_threadsafe(loop.stop)
    print(f"masrl serve: stopped after {gateway.default.calls} calls", file=sys.stderr)
    return 0


def register(sub) -> None:
    from masrl.argtypes import bounded

    p = sub.add_parser("serve", help="serve a trained team (a run folder or an export) as an OpenAI-compatible "
                                     "endpoint: model = an agent's name")
    p.add_argument("path", help="a run folder (its newest checkpoint that loads) or a masrl export folder; "
                                "key=value overrides may follow (agents.Solver.temperature=0)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=bounded(int, 0, 65535), default=8000, help="0: any free port")
    p.add_argument("--api-key", default=None, help="the key clients must send (default: any)")
    p.add_argument("--batch-window-ms", type=bounded(float, 0.0, 1000.0), default=5.0,
                   help="requests within this window are generated together (default 5)")
    p.add_argument("--request-timeout", type=bounded(float, 1.0, 86400.0), default=600.0,
                   help="seconds per call (default 600)")
    p.add_argument("--max-seconds", type=bounded(float, 0.0, 1e7), default=None,
                   help="stop after this many seconds (default: serve until interrupted)")
    p.add_argument("--team", action="store_true",
                   help="serve the whole team as one model: each request is one episode of the workflow (the last "
                        "user message is the task, the final answer the reply; docs/harnesses.md)")
    p.add_argument("--debug-turns", action="store_true",
                   help="with --team: each reply also carries the agents' turns (masrl.turns)")
    p.set_defaults(func=_cmd_serve, overrides=[])


def _cmd_serve(args) -> int:
    if args.max_seconds is not None:
        args.max_seconds = time.monotonic() + args.max_seconds
    return run_serve(args)
