"""The gateway: a threaded HTTP server speaking OpenAI's chat/completions API, backed by live episodes.

Each episode of an ``external`` workflow opens an ``EpisodeSession`` with a key of its own; the program it
runs gets ``base_url = <gateway>/e/<key>/v1`` and ``api_key = <key>`` (either identifies the episode). A request
is handed to the episode's event loop (``asyncio.run_coroutine_threadsafe``) and becomes ``team.call(agent,
ChatPrompt(messages, tools))``, so calls from many episodes are batched by the rollout scheduler exactly like a
built-in workflow's, and every call is a recorded ``Turn`` with the prompt ids the policy's
chat template gave, the sampled ids and their log-probs. The ``model`` field names the agent.

A request that continues the agent's previous call of the same episode (its messages start with that call's
messages and its reply, unchanged) extends that call's token ids instead of re-rendering them
(``ChatPrefix``), as ``team.chat`` does: no re-tokenization drift, and the
rollout engine reuses the earlier keys and values.

Sampling follows the agent's config (``temperature``, ``top_p``, ``max_new_tokens``): the recorded log-probs must
be those of the distribution the update assumes. A request's own ``temperature``/``top_p`` are accepted and
ignored; ``max_tokens``/``max_completion_tokens`` above the agent's ``max_new_tokens`` are capped by it, and
``stop`` is not applied (cutting a reply would make its ids differ from what was sampled). Errors use OpenAI's
shape ``{"error": {"message", "type", "param", "code"}}``: 401 no live episode, 404 unknown agent or path,
400 a malformed request, 413 a body over 4 MiB, 504 a call that did not finish within ``request_timeout_s``.
"""
from __future__ import annotations

import asyncio
import json
import secrets
import threading
import time
import uuid
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from masrl.errors import UserInputError
from masrl.tools import parse_tool_calls
from masrl.tools.chat_format import ChatPrefix, ChatPrompt
from masrl.types import Turn

MAX_BODY = 4 * 1024 * 1024
MAX_N = 16
ROLES = ("system", "developer", "user", "assistant", "tool")
# OpenAI request fields: served, or accepted and not applied (sampling is the agent's config); others are a 400
_COMMON = {"model", "n", "temperature", "top_p", "max_tokens", "stop", "logprobs", "seed", "presence_penalty",
           "frequency_penalty", "user", "logit_bias", "stream", "stream_options", "metadata", "store", "service_tier"}
CHAT_FIELDS = _COMMON | {"messages", "tools", "tool_choice", "parallel_tool_calls", "top_logprobs",
                         "max_completion_tokens", "response_format", "reasoning_effort", "modalities", "prediction"}
COMPLETION_FIELDS = _COMMON | {"prompt", "suffix", "echo", "best_of"}


class GatewayError(Exception):
    """A request the gateway refuses: an HTTP status, OpenAI's error type and code, and a message."""

    def __init__(self, status: int, message: str, code: str | None = None, kind: str = "invalid_request_error",
                 param: str | None = None):
        super().__init__(message)
        self.status, self.code, self.kind, self.param = status, code, kind, param

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


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
    """The HTTP server (a daemon thread) and its live sessions. ``open`` / ``close`` one per episode."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, request_timeout_s: float = 600.0):
        self.request_timeout_s = request_timeout_s
        self.sessions: dict[str, EpisodeSession] = {}
        self._lock = threading.Lock()
        self.refused = 0  # requests that named no live episode
        self.default: EpisodeSession | None = None  # masrl serve: one standing session, no episodes
        self.default_key: str | None = None         # ... that only this key may use (None: any)
        self.max_new_tokens: dict[str, int] = {}    # agent -> its max_new_tokens (bounds max_tokens)
        gateway = self

        class Handler(_Handler):
            owner = gateway

        try:
            self.server = _Server((host, port), Handler)
        except OSError as e:
            raise UserInputError(f"the gateway cannot listen on {host}:{port} ({e}); set workflow.params.port "
                                 "to a free port, or 0 for any") from None
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, name="masrl-gateway", daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def open(self, team: Any) -> EpisodeSession:
        """A session for ``team``'s episode; call it from the episode's running event loop."""
        key = "masrl-ep-" + secrets.token_urlsafe(18)
        session = EpisodeSession(team, asyncio.get_running_loop(), key, f"{self.url}/e/{key}/v1")
        with self._lock:
            self.sessions[key] = session
        return session

    def close(self, session: EpisodeSession) -> None:
        session.closed = True
        with self._lock:
            self.sessions.pop(session.key, None)

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

    def shutdown(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    # ---- request handling (called on the server's threads) ------------------------------------------------
    def handle(self, method: str, path: str, headers: Any, body: bytes) -> tuple[int, dict]:
        key, route = _split_path(path)
        if key is None:
            auth = headers.get("Authorization", "")
            key = auth[7:].strip() if auth[:7].lower() == "bearer " else None
        session = self.session(key)
        if method == "GET" and route == "/v1/models":
            return 200, {"object": "list", "data": [{"id": a, "object": "model", "created": 0, "owned_by": "masrl"}
                                                    for a in session.team.agents]}
        if method != "POST" or route not in ("/v1/chat/completions", "/v1/completions"):
            raise GatewayError(404, f"no route {method} {route}; the gateway serves POST /v1/chat/completions, "
                               "POST /v1/completions and GET /v1/models", "not_found")
        request = _json_object(body)
        chat = route == "/v1/chat/completions"
        unknown = sorted(set(request) - (CHAT_FIELDS if chat else COMPLETION_FIELDS))
        if unknown:
            raise GatewayError(400, f"unrecognized request argument(s): {', '.join(map(str, unknown))[:200]}",
                               "unknown_parameter", param=str(unknown[0])[:100])
        if request.get("stream"):
            raise GatewayError(400, "stream is not supported by the masrl gateway; send stream: false", param="stream")
        agent = request.get("model")
        if agent not in session.team.agents:
            raise GatewayError(404, f"model {str(agent)[:100]!r} is not an agent of this team; the agents are "
                               f"{list(session.team.agents)}", "model_not_found", param="model")
        n = _bounded_int(request.get("n", 1), "n", 1, MAX_N)
        budget = self.max_new_tokens.get(agent)
        for name in ("max_tokens", "max_completion_tokens"):
            if request.get(name) is not None:
                _bounded_int(request[name], name, 1, budget or 10 ** 7)
        if chat:
            messages, tools = _messages(request.get("messages")), _tools(request.get("tools"))
            turns = _fitted(self._run(session, session.chat(agent, messages, tools, n)))
            return 200, _chat_response(session.record("chatcmpl-", turns), agent, turns, bool(tools),
                                       bool(request.get("logprobs")))
        prompt = request.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise GatewayError(400, "prompt must be a string (one prompt per request)", param="prompt")
        turns = _fitted(self._run(session, session.complete(agent, prompt, n)))
        return 200, _completion_response(session.record("cmpl-", turns), agent, turns,
                                         request.get("logprobs") is not None)

    def _run(self, session: EpisodeSession, coro) -> list[Turn]:
        future = asyncio.run_coroutine_threadsafe(coro, session.loop)
        try:
            turns = future.result(self.request_timeout_s)
        except FutureTimeout:
            future.cancel()
            raise GatewayError(504, f"the call did not finish within {self.request_timeout_s:g} s",
                               "timeout", kind="server_error") from None
        session.calls += len(turns)
        return turns


def _fitted(turns: list[Turn]) -> list[Turn]:
    """The turns of a call, or a 400 when the prompt could not fit the agent's context (the turn is recorded
    invalid, nothing was generated)."""
    refused = next((t for t in turns if "refused" in t.info), None)
    if refused is not None:
        raise GatewayError(400, f"the prompt does not fit: {refused.info['refused']}", "context_length_exceeded",
                           param="messages")
    return turns


def _split_path(path: str) -> tuple[str | None, str]:
    route = path.split("?", 1)[0]
    if route.startswith("/e/"):
        _, _, rest = route.partition("/e/")
        key, _, tail = rest.partition("/")
        return key, "/" + tail
    return None, route


def _json_object(body: bytes) -> dict:
    try:
        request = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise GatewayError(400, f"the body is not JSON ({type(e).__name__})") from None
    if not isinstance(request, dict):
        raise GatewayError(400, "the body must be a JSON object")
    return request


def _bounded_int(value: Any, name: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise GatewayError(400, f"{name} must be an integer in {low}..{high}, got {str(value)[:40]!r}", param=name)
    return value


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and
                                         isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise GatewayError(400, f"{where}.content must be a string or a list of text parts", param=where)


def _messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise GatewayError(400, "messages must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise GatewayError(400, f"messages[{i}] must be an object with a role in {list(ROLES)}",
                               param=f"messages[{i}]")
        msg = {"role": "system" if m["role"] == "developer" else m["role"],
               "content": _content(m.get("content"), f"messages[{i}]")}
        for extra in ("tool_calls", "tool_call_id", "name"):
            if extra in m:
                msg[extra] = m[extra]
        out.append(msg)
    return out


def _tools(tools: Any) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) and isinstance(t.get("function"), dict)
                                              and isinstance(t["function"].get("name"), str) for t in tools):
        raise GatewayError(400, "tools must be a list of {type: function, function: {name, parameters}}",
                           param="tools")
    return tools


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


class _Server(ThreadingHTTPServer):
    # every episode of a rollout may connect at once: socketserver's default backlog (5) drops connections
    # beyond it, which the client sees as connection errors under load
    request_queue_size = 1024


class _Handler(BaseHTTPRequestHandler):
    owner: Gateway
    timeout = 30  # seconds a connection may take to send its request (a half-sent request cannot hold a thread)
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):  # no access log on stderr
        pass

    def _answer(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _serve(self, method: str) -> None:
        try:
            length = int(self.headers.get("Content-Length") or 0)
            if length < 0 or length > MAX_BODY:
                self.close_connection = True
                raise GatewayError(413, f"the body is over {MAX_BODY} bytes", "body_too_large")
            body = self.rfile.read(length) if length else b""
            status, payload = self.owner.handle(method, self.path, self.headers, body)
        except GatewayError as e:
            status, payload = e.status, e.body()
        except ValueError:
            status, payload = 400, GatewayError(400, "malformed Content-Length").body()
        except Exception as e:  # noqa: BLE001 - a failed call is one JSON error, never a dropped connection
            status, payload = 500, GatewayError(500, f"{type(e).__name__}: {str(e)[:500]}", "internal_error",
                                                kind="server_error").body()
        self._answer(status, payload)

    def do_GET(self):  # noqa: N802 - http.server's naming
        self._serve("GET")

    def do_POST(self):  # noqa: N802
        self._serve("POST")
