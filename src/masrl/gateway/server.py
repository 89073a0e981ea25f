"""The gateway: an HTTP server speaking OpenAI's chat/completions API, backed by live episodes.

Each episode of an ``external`` workflow opens an ``EpisodeSession`` with a key of its own; the program it
runs gets ``base_url = <gateway>/e/<key>/v1`` and ``api_key = <key>`` (either identifies the episode). A request
is handed to the episode's event loop (``asyncio.run_coroutine_threadsafe``) and becomes ``team.call(agent,
ChatPrompt(messages, tools))``, so calls from many episodes are batched by the rollout scheduler exactly like a
built-in workflow's, and every call is a recorded ``masrl.types.Turn`` with the prompt ids the policy's
chat template gave, the sampled ids and their log-probs. The ``model`` field names the agent.

A request that continues the agent's previous call of the same episode (its messages start with that call's
messages and its reply, unchanged) extends that call's token ids instead of re-rendering them
(``masrl.tools.chat_format.ChatPrefix``), as ``team.chat`` does: no re-tokenization drift, and the
rollout engine reuses the earlier keys and values.

Sampling follows the agent's config (``temperature``, ``top_p``, ``max_new_tokens``): the recorded log-probs must
be those of the distribution the update assumes. A request's own ``temperature``/``top_p`` are accepted and
ignored; ``max_tokens``/``max_completion_tokens`` above the agent's ``max_new_tokens`` are capped by it, and
``stop`` is not applied (cutting a reply would make its ids differ from what was sampled). Every field of the
request is checked before anything is rendered (``masrl.gateway.validate``). Errors use OpenAI's
shape ``{"error": {"message", "type", "param", "code"}}``: 401 no live episode, 404 unknown agent or path,
405 a method the path does not serve, 400 a malformed request, 413 a body over 4 MiB, 500 ``engine_error`` a call
whose batch the rollout engine failed on (the message names the policy and the engine's error; later calls are
served), 503 ``call_ended`` a call whose episode or rollout ended before it finished, or that the gateway's shutdown
cut short, 504 a call that did not finish within ``request_timeout_s``. No request waits on a call that can no
longer finish.

The server is the shared HTTP service (``masrl.http``): FastAPI (``masrl.gateway.app``) on uvicorn,
whose loop runs in the gateway's own thread, behind the connection guard (``GatewayLimits``: a deadline on the
whole request head and on the body, connection limits).
"""
from __future__ import annotations

import asyncio
import json
import secrets
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from masrl.errors import EngineFailure
from masrl.gateway import validate
from masrl.gateway.errors import GatewayError, answer
from masrl.tools import parse_tool_calls
from masrl.tools.chat_format import ChatPrefix, ChatPrompt
from masrl.types import Turn

MAX_BODY = 4 * 1024 * 1024
MAX_N = validate.MAX_N


@dataclass
class GatewayLimits:
    """What one connection and one request may take (docs/gateway.md, "Limits"); the deadlines are on the whole
    request head and the whole body, not per read."""

    header_timeout_s: float = 30.0   # a connection that has not sent a whole request head by then is closed (408)
    body_timeout_s: float = 30.0     # a body that has not all arrived by then is a 408
    max_connections: int = 1024      # open connections (every episode of a rollout may connect at once)
    backlog: int = 1024              # connections the kernel queues before they are accepted

    def http(self):
        from masrl.http.server import HttpLimits

        return HttpLimits(header_timeout_s=self.header_timeout_s, body_timeout_s=self.body_timeout_s,
                          max_body_bytes=MAX_BODY, max_connections=self.max_connections,
                          max_connections_per_client=self.max_connections, keep_alive_s=self.header_timeout_s,
                          backlog=self.backlog)


@dataclass
class _Last:
    messages: list[dict]
    turn: Turn


@dataclass
class EpisodeSession:
    """One live episode: its team (``team.call``), the event loop the episode runs in, and its key."""

    team: Any
    loop: asyncio.AbstractEventLoop
    key: str
    base_url: str
    calls: int = 0
    last: dict[str, _Last] = field(default_factory=dict)
    closed: bool = False
    responses: dict[str, list[Turn]] = field(default_factory=dict)  # response id -> its turns (``invalid_calls``)
    standing: bool = False  # masrl serve's one session: no episode result refers to its responses

    @property
    def client_kwargs(self) -> dict[str, str]:
        """What an OpenAI client takes: ``openai.OpenAI(**session.client_kwargs)``."""
        return {"base_url": self.base_url, "api_key": self.key}

    def _prefix(self, agent: str, messages: list[dict]) -> ChatPrefix | None:
        last = self.last.get(agent)
        if last is None:
            return None
        n = len(last.messages)
        if len(messages) <= n or messages[:n] != last.messages:
            return None
        reply = messages[n]
        if reply.get("role") != "assistant" or reply.get("content") != last.turn.text:
            return None
        return ChatPrefix.of(last.turn, n)

    async def chat(self, agent: str, messages: list[dict], tools: list[dict] | None, n: int) -> list[Turn]:
        prefix = self._prefix(agent, messages)
        turns = await asyncio.gather(*(self.team.call(agent, ChatPrompt(list(messages), tools, prefix=prefix,
                                                                        meta={"source": "gateway"}))
                                       for _ in range(n)))
        self.last[agent] = _Last([dict(m) for m in messages], turns[0])
        return list(turns)

    def record(self, prefix: str, turns: list[Turn]) -> str:
        """A new response id for ``turns`` (the ``id`` of the response), kept for the episode's result."""
        rid = f"{prefix}{uuid.uuid4().hex}"
        if not self.standing:
            self.responses[rid] = turns
        return rid

    async def complete(self, agent: str, prompt: str, n: int) -> list[Turn]:
        return list(await asyncio.gather(*(self.team.call(agent, prompt) for _ in range(n))))


class Gateway:
    """The HTTP server (uvicorn's loop in a daemon thread of its own) and its live sessions. ``open`` / ``close``
    one per episode. ``host_setting`` / ``port_setting`` name what the user set, for the one line that says why
    the server cannot listen (``--port`` under ``masrl serve``)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, request_timeout_s: float = 600.0, *,
                 limits: GatewayLimits | None = None, host_setting: str = "workflow.params.host",
                 port_setting: str = "workflow.params.port"):
        try:
            from masrl.gateway.app import API, create_app
            from masrl.gateway.errors import error_body
            from masrl.http.server import ServerThread, listen
        except ImportError as e:
            raise ImportError(f"the gateway needs fastapi and uvicorn ({e}): pip install masrl[server]") from None
        self.request_timeout_s = request_timeout_s
        self.limits = limits or GatewayLimits()
        self.sessions: dict[str, EpisodeSession] = {}
        self._lock = threading.Lock()
        self.refused = 0  # requests that named no live episode
        self.default: EpisodeSession | None = None  # masrl serve: one standing session, no episodes
        self.default_key: str | None = None         # ... that only this key may use (None: any)
        self.max_new_tokens: dict[str, int] = {}    # agent -> its max_new_tokens (bounds max_tokens)
        # calls in flight (on the server's loop only): the future its request awaits -> (its session, its task)
        self._calls: dict[asyncio.Future, tuple[EpisodeSession, list[asyncio.Task]]] = {}
        http = self.limits.http()
        sock = listen(host, port, backlog=http.backlog, host_setting=host_setting, port_setting=port_setting)
        self.server = ServerThread(create_app(self), sock, http, name="masrl-gateway", error_body=error_body, api=API)
        self.server.start()

    @property
    def url(self) -> str:
        return self.server.url

    def open(self, team: Any) -> EpisodeSession:
        """A session for ``team``'s episode; call it from the episode's running event loop."""
        key = "masrl-ep-" + secrets.token_urlsafe(18)
        session = EpisodeSession(team, asyncio.get_running_loop(), key, f"{self.url}/e/{key}/v1")
        with self._lock:
            self.sessions[key] = session
        return session

    def close(self, session: EpisodeSession) -> None:
        """The episode ended: its key is refused from now on, and its calls still in flight are answered 503 (and
        cancelled)."""
        session.closed = True
        with self._lock:
            self.sessions.pop(session.key, None)
        self._end_calls(session, "its episode ended before the call finished")

    def session(self, key: str | None) -> EpisodeSession:
        if self.default is not None:
            if self.default_key is not None and key != self.default_key:
                self.refused += 1
                raise GatewayError(401, "wrong API key for this masrl serve endpoint", "invalid_api_key",
                                   kind="authentication_error")
            return self.default
        with self._lock:
            session = self.sessions.get(key or "")
        if session is None or session.closed:
            self.refused += 1
            raise GatewayError(401, "no live masrl episode has this key: use the base_url and api_key masrl "
                               "handed to the program for this episode", "invalid_api_key",
                               kind="authentication_error")
        return session

    def widen_deadlines(self, timeout_s: float) -> None:
        """A gateway shared by several teams (``masrl.workflows.external.gateway``) awaits a call, a request head
        and a body as long as the longest episode deadline any of them asked for: a team that came later with a
        longer deadline does not get its calls cut short by the first one's (each episode still ends at its own)."""
        with self._lock:
            self.request_timeout_s = max(self.request_timeout_s, timeout_s)
            self.limits.header_timeout_s = max(self.limits.header_timeout_s, timeout_s)
            self.limits.body_timeout_s = max(self.limits.body_timeout_s, timeout_s)
            self.server.guard.head_timeout_s = max(self.server.guard.head_timeout_s, timeout_s)

    def shutdown(self) -> None:
        """Stop serving; calls still in flight are answered 503 first."""
        self._end_calls(None, "the gateway is shutting down")
        self.server.stop()

    def _end_calls(self, session: EpisodeSession | None, why: str) -> None:
        """Answer the calls in flight of ``session`` (None: every one) a 503 ``call_ended`` and cancel them on
        their episode's loop (from any thread; nothing to do once the server's loop has stopped)."""

        def end() -> None:
            for done, (owner, task) in list(self._calls.items()):
                if session is None or owner is session:
                    _cancel(owner.loop, task)
                    if not done.done():
                        done.set_exception(call_ended(why))

        loop = self.server.loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(end)
            except RuntimeError:  # closed meanwhile: no request waits on it any more
                pass

    # ---- request handling (on the server's loop) ----------------------------------------------------------
    async def serve(self, request: Any, route: str, key: str | None) -> Any:
        """The answer to one request on ``route`` (a JSON response; every failure one JSON error)."""

        async def respond(read) -> dict:
            nonlocal key
            if key is None:
                auth = request.headers.get("authorization", "")
                key = auth[7:].strip() if auth[:7].lower() == "bearer " else None
            session = self.session(key)
            if route == "/v1/models":
                return _models(session)
            return await self.handle(session, route, await read())

        return await answer(request, respond, max_body_bytes=MAX_BODY, body_timeout_s=self.limits.body_timeout_s)

    async def handle(self, session: EpisodeSession, route: str, body: bytes) -> dict:
        """The response to a chat or completions request of ``session`` (raises ``GatewayError``)."""
        request = validate.json_object(body)
        chat = route == "/v1/chat/completions"
        validate.known_fields(request, chat)
        agent = request.get("model")
        if not isinstance(agent, str) or agent not in session.team.agents:
            raise GatewayError(404, f"model {str(agent)[:100]!r} is not an agent of this team; the agents are "
                               f"{list(session.team.agents)}", "model_not_found", param="model")
        n = validate.bounded_int(request.get("n", 1), "n", 1, MAX_N)
        budget = self.max_new_tokens.get(agent)
        for name in ("max_tokens", "max_completion_tokens"):
            if request.get(name) is not None:
                validate.bounded_int(request[name], name, 1, budget or 10 ** 7)
        if chat:
            messages, tools = validate.messages(request.get("messages")), validate.tools(request.get("tools"))
            turns = _fitted(await self._run(session, session.chat(agent, messages, tools, n)))
            return _chat_response(session.record("chatcmpl-", turns), agent, turns, bool(tools),
                                  bool(request.get("logprobs")))
        prompt = validate.prompt(request.get("prompt"))
        turns = _fitted(await self._run(session, session.complete(agent, prompt, n)))
        return _completion_response(session.record("cmpl-", turns), agent, turns, request.get("logprobs") is not None)

    async def _run(self, session: EpisodeSession, coro) -> list[Turn]:
        """``coro`` on the episode's loop, within ``request_timeout_s`` (cancelled past it: a 504). The two loops
        hand the call and its result over with ``call_soon_threadsafe`` alone (no concurrent future and its lock).
        Every way the call can end answers the request: its result; the rollout engine's failure on its batch (a
        500 ``engine_error``); its cancellation, its episode's end or the gateway's shutdown (a 503 ``call_ended``);
        any other error (a 500)."""
        here = asyncio.get_running_loop()
        done = here.create_future()
        task: list[asyncio.Task] = []

        def settle(result, error) -> None:
            if not done.done():
                done.set_exception(error) if error is not None else done.set_result(result)

        def hand_back(result, error) -> None:
            try:
                here.call_soon_threadsafe(settle, result, error)
            except RuntimeError:  # the server's loop has stopped: nobody waits for the answer
                pass

        async def call() -> None:
            try:
                result = await coro
            except asyncio.CancelledError:
                hand_back(None, call_ended("it was cancelled before it finished (its episode or rollout ended)"))
                raise
            except BaseException as e:  # noqa: BLE001 - handed back to the request, which answers it
                hand_back(None, e)
                if not isinstance(e, Exception):
                    raise
            else:
                hand_back(result, None)

        def start() -> None:
            if session.closed:  # the episode ended while the request was on its way
                coro.close()
                hand_back(None, call_ended("its episode ended before the call started"))
            else:
                task.append(session.loop.create_task(call()))

        self._calls[done] = (session, task)
        try:
            try:
                session.loop.call_soon_threadsafe(start)
            except RuntimeError:  # the episode's loop is closed: its episode has ended
                coro.close()
                raise call_ended("its episode ended before the call started") from None
            turns = await asyncio.wait_for(done, self.request_timeout_s)
        except asyncio.TimeoutError:
            _cancel(session.loop, task)
            raise GatewayError(504, f"the call did not finish within {self.request_timeout_s:g} s",
                               "timeout", kind="server_error") from None
        except EngineFailure as e:
            raise GatewayError(500, str(e), "engine_error", kind="server_error") from None
        finally:
            self._calls.pop(done, None)
        session.calls += len(turns)
        return turns


def call_ended(why: str) -> GatewayError:
    """The 503 ``call_ended`` of a call cut short (``why``: what ended it)."""
    return GatewayError(503, f"the call was cut short: {why}", "call_ended", kind="server_error")


def _cancel(loop: asyncio.AbstractEventLoop, task: list[asyncio.Task]) -> None:
    """Cancel the call ``task`` holds (once started) on its episode's ``loop``, unless that loop has closed."""
    try:
        loop.call_soon_threadsafe(lambda: task and task[0].cancel())
    except RuntimeError:  # the episode's loop is closed: the call ended with it
        pass


def _models(session: EpisodeSession) -> dict:
    return {"object": "list", "data": [{"id": a, "object": "model", "created": 0, "owned_by": "masrl"}
                                       for a in session.team.agents]}


def _fitted(turns: list[Turn]) -> list[Turn]:
    """The turns of a call, or a 400 when the prompt could not fit the agent's context (the turn is recorded
    invalid, nothing was generated)."""
    refused = next((t for t in turns if "refused" in t.info), None)
    if refused is not None:
        raise GatewayError(400, f"the prompt does not fit: {refused.info['refused']}", "context_length_exceeded",
                           param="messages")
    return turns


def _token_logprobs(turn: Turn) -> list[dict]:
    # tokens as "token_id:<id>" (vLLM's return_tokens_as_token_ids): the ids are what was sampled and trained
    return [{"token": f"token_id:{t}", "logprob": float(lp), "bytes": None, "top_logprobs": []}
            for t, lp in zip(turn.response_ids, turn.logprobs)]


def _finish(turn: Turn, called: bool) -> str:
    return "length" if turn.truncated else ("tool_calls" if called else "stop")


def _usage(turns: list[Turn]) -> dict:
    prompt = len(turns[0].prompt_ids) if turns else 0
    completion = sum(len(t.response_ids) for t in turns)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _chat_response(rid: str, agent: str, turns: list[Turn], with_tools: bool, logprobs: bool) -> dict:
    choices = []
    for i, turn in enumerate(turns):
        message: dict[str, Any] = {"role": "assistant", "content": turn.text}
        calls = parse_tool_calls(turn.text).calls if with_tools else []
        if calls:
            message["tool_calls"] = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                                      "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                                     for c in calls]
        choice = {"index": i, "message": message, "finish_reason": _finish(turn, bool(calls)),
                  "logprobs": {"content": _token_logprobs(turn)} if logprobs else None}
        choices.append(choice)
    return {"id": rid, "object": "chat.completion", "created": int(time.time()),
            "model": agent, "choices": choices, "usage": _usage(turns)}


def _completion_response(rid: str, agent: str, turns: list[Turn], logprobs: bool) -> dict:
    choices = [{"index": i, "text": t.text, "finish_reason": _finish(t, False),
                "logprobs": {"tokens": [f"token_id:{x}" for x in t.response_ids],
                             "token_logprobs": [float(v) for v in t.logprobs]} if logprobs else None}
               for i, t in enumerate(turns)]
    return {"id": rid, "object": "text_completion", "created": int(time.time()),
            "model": agent, "choices": choices, "usage": _usage(turns)}
