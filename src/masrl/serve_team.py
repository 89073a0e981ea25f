"""``masrl serve RUN --team``: the whole team as one model behind an OpenAI-compatible endpoint, so that an external
harness (lm-evaluation-harness, Inspect AI, any OpenAI client) can score a trained team.

    masrl serve runs/my-team-seed0 --team --port 8000
    # POST /v1/chat/completions  {"model": "<run name>", "messages": [..., {"role": "user", "content": QUESTION}]}
    # POST /v1/completions       {"model": ..., "prompt": QUESTION}

Each request is one episode of the run's workflow: the last user message (or the prompt) is the task's question,
the workflow's final answer is the reply, and ``usage`` counts every agent's prompt and generated tokens. A
request's ``temperature`` applies to every agent (0: greedy, the same reply for the same question); without one,
the agents sample as the config's ``eval.temperature`` (or each agent's own) says. Requests that arrive within
``--batch-window-ms`` of each other run as one rollout (their agent calls batched per policy). With
``--debug-turns`` a reply also carries ``masrl: {turns: [{agent, prompt, text, valid}], reward}``. Other request
fields (``max_tokens``, ``stop``, ``seed``, ...) are accepted and not applied: the agents' settings hold.

The server is the shared HTTP service (``masrl.http``), as the gateway's: FastAPI on uvicorn in a thread of its own,
behind the connection guard (a deadline on the whole request head and on the body, connection limits, chunked
bodies, every error in OpenAI's JSON shape, hang-ups at debug level). It listens before the team is loaded; the
episodes run in the thread that loaded it.
"""
from __future__ import annotations

import asyncio
import json
import queue
import sys
import time
import uuid
from concurrent.futures import Future, InvalidStateError
from pathlib import Path
from typing import Any

from masrl.config import load_config
from masrl.errors import UserInputError
from masrl.gateway.errors import GatewayError, answer, error_body
from masrl.gateway.validate import json_object
from masrl.types import Episode, Task

MAX_BODY = 4 * 1024 * 1024
MAX_BATCH = 64
CHAT, COMPLETIONS, MODELS = "/v1/chat/completions", "/v1/completions", "/v1/models"
API = f"masrl serve --team serves POST {CHAT}, POST {COMPLETIONS} and GET {MODELS}"


def load_run(path: Path, overrides: list[str]):
    """``(config, checkpoint folder or None)`` of a run folder or a ``masrl export`` folder."""
    if (path / "export.json").is_file():
        return load_config(path / "config.yaml", overrides), None
    if (path / "config.yaml").is_file():
        return load_config(path / "config.yaml", overrides), path
    raise UserInputError(f"masrl serve {path}: not a run folder (config.yaml + checkpoints/) or a masrl export "
                         "(export.json + config.yaml)")


def question_of(body: dict, chat: bool) -> str:
    """The task's question: the last user message's text (chat) or the prompt (completions)."""
    if not chat:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt.strip():
            raise GatewayError(400, "prompt must be one non-empty string (one question = one episode)",
                               param="prompt")
        return prompt
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise GatewayError(400, "messages must be a list", param="messages")
    for message in reversed(messages):
        if isinstance(message, dict) and message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            if isinstance(content, str) and content.strip():
                return content
    raise GatewayError(400, "messages hold no user message with text (its text is the team's task)",
                       param="messages")


class TeamServer:
    """Episodes on request. The HTTP server's requests queue their questions; the thread that calls ``work_until``
    (``run_team``: the main thread, where the team was loaded) runs the pending questions as one rollout per
    ``window_s``, one rollout at a time."""

    def __init__(self, runner, name: str, window_s: float = 0.005, debug_turns: bool = False,
                 api_key: str | None = None, body_timeout_s: float = 30.0):
        self.runner, self.name, self.window_s, self.debug_turns = runner, name, window_s, debug_turns
        self.api_key, self.body_timeout_s = api_key, body_timeout_s
        self.pending: queue.Queue = queue.Queue()
        self.episodes = 0

    def submit(self, question: str, temperature: float | None) -> Future:
        """The future of ``question``'s episode, run by the next batch."""
        future: Future = Future()
        self.pending.put((question, temperature, future))
        return future

    def work_until(self, deadline: float | None) -> None:
        """Run the pending questions, batch by batch, until ``deadline`` (``time.monotonic()``; None: never) or an
        interrupt (Ctrl-C); then every question not answered yet (the batch running, those queued) is answered
        a 503."""
        batch: list = []
        try:
            while deadline is None or time.monotonic() < deadline:
                wait = 0.2 if deadline is None else min(0.2, max(deadline - time.monotonic(), 0.0))
                try:
                    batch = [self.pending.get(timeout=wait)]
                except queue.Empty:
                    continue
                self._gather(batch)
                for temperature in dict.fromkeys(t for _, t, _ in batch):
                    self._run([b for b in batch if b[1] == temperature], temperature)
        except KeyboardInterrupt:
            pass
        finally:
            while True:
                try:
                    batch.append(self.pending.get_nowait())
                except queue.Empty:
                    break
            stopped = GatewayError(503, "masrl serve --team stopped before this request's episode finished",
                                   "server_stopped", kind="server_error")
            for _, _, future in batch:
                _settle(future, error=stopped)

    def _gather(self, batch: list) -> None:
        """Add to ``batch`` what arrives within ``window_s`` of its first question."""
        deadline = time.monotonic() + self.window_s
        while len(batch) < MAX_BATCH:
            try:
                batch.append(self.pending.get(timeout=max(deadline - time.monotonic(), 0.0)))
            except queue.Empty:
                break

    def _run(self, batch: list, temperature: float | None) -> None:
        tasks = [Task(id=f"request-{self.episodes + i}", question=q, answer=None) for i, (q, _, _) in enumerate(batch)]
        self.episodes += len(batch)
        if temperature is None:
            temperature = self.runner.cfg.eval.temperature
        try:
            episodes = self.runner.rollout(tasks, list(range(len(tasks))), temperature=temperature,
                                           seed=self.runner.cfg.seed, score=_unscored, where="masrl serve --team")
        except Exception as e:  # noqa: BLE001 - every request of the batch gets the error
            for _, _, future in batch:
                _settle(future, error=e)
            return
        for (_, _, future), episode in zip(batch, episodes):
            _settle(future, episode)

    async def reply(self, body: dict, chat: bool) -> dict:
        """The response to one request's ``body``: its episode's answer (raises ``GatewayError``)."""
        question = question_of(body, chat)
        temperature = body.get("temperature")
        if temperature is not None and (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
                                        or temperature < 0):
            raise GatewayError(400, f"temperature must be a number >= 0, got {temperature!r}", param="temperature")
        if body.get("stream"):
            raise GatewayError(400, "stream: true is not served (one reply per episode)", param="stream")
        future = self.submit(question, None if temperature is None else float(temperature))
        episode: Episode = await asyncio.wrap_future(future)
        if episode.error:
            raise GatewayError(500, f"the episode failed: {episode.error}", kind="server_error")
        return self._response(episode, chat)

    def _response(self, episode: Episode, chat: bool) -> dict:
        text = episode.answer or ""
        prompt_tokens = sum(len(t.prompt_ids) for t in episode.turns)
        completion_tokens = sum(len(t.response_ids) for t in episode.turns)
        choice: dict[str, Any] = {"index": 0, "finish_reason": "stop", "logprobs": None}
        choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
        out = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
               "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
               "model": self.name, "choices": [choice],
               "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                         "total_tokens": prompt_tokens + completion_tokens}}
        if self.debug_turns:
            out["masrl"] = {"turns": [{"agent": t.agent, "prompt": t.prompt_text, "text": t.text, "valid": t.valid}
                                      for t in episode.turns], "info": _plain(episode.info)}
        return out

    async def serve(self, request: Any, route: str) -> Any:
        """The answer to one request on ``route`` (a JSON response; every failure one JSON error)."""

        async def respond(read) -> dict:
            if self.api_key is not None and request.headers.get("authorization", "") != f"Bearer {self.api_key}":
                raise GatewayError(401, "wrong API key for this masrl serve --team endpoint", "invalid_api_key",
                                   kind="authentication_error")
            if route == MODELS:
                return {"object": "list", "data": [
                    {"id": self.name, "object": "model", "created": 0, "owned_by": "masrl"}]}
            return await self.reply(json_object(await read()), chat=route == CHAT)

        return await answer(request, respond, max_body_bytes=MAX_BODY, body_timeout_s=self.body_timeout_s)


def _settle(future: Future, value: Any = None, error: BaseException | None = None) -> None:
    """``future``'s outcome, unless it has one (answered, or cancelled: its request was cut short)."""
    if future.done():
        return
    try:
        future.set_exception(error) if error is not None else future.set_result(value)
    except InvalidStateError:  # cancelled meanwhile, from the server's thread
        pass


def _unscored(task: Task, answer: str | None) -> dict:
    """A served question has no gold answer: the harness scores the reply."""
    return {"reward": 0.0, "correct": False}


def _plain(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def create_app(server: TeamServer):
    """The team server's FastAPI app: its three routes, and every other answer in OpenAI's error shape (a JSON 404
    for an unknown path, a JSON 405 with ``Allow`` for a method a route does not serve)."""
    from masrl.http.app import add_route, json_app

    app = json_app("masrl serve --team", error_body, API)
    for route, method in ((CHAT, "POST"), (COMPLETIONS, "POST"), (MODELS, "GET")):
        add_route(app, route, _endpoint(server, route), method)
    return app


def _endpoint(server: TeamServer, route: str):
    async def endpoint(request):
        return await server.serve(request, route)

    return endpoint


def http_limits():
    """What one connection and one request to the team server may take (docs/harnesses.md)."""
    from masrl.http.server import HttpLimits

    return HttpLimits(header_timeout_s=30.0, body_timeout_s=30.0, max_body_bytes=MAX_BODY)


def bind(args):
    """The team server's listening socket on ``--host``/``--port``, taken before the team is loaded: an address
    that cannot be used is one ``UserInputError`` naming the flag, at once."""
    try:
        from masrl.http.server import listen
    except ImportError as e:
        raise UserInputError(f"masrl serve --team needs fastapi and uvicorn ({e}): pip install masrl[server]") from None
    return listen(args.host, args.port, backlog=http_limits().backlog, host_setting="--host", port_setting="--port")


def serve_until(deadline: float | None) -> None:
    """Return at ``deadline`` (``time.monotonic()``; None: never) or on an interrupt (Ctrl-C)."""
    try:
        while deadline is None or time.monotonic() < deadline:
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass


def run_team(args, runner, where, sock) -> int:
    """Serve ``runner``'s team on the socket ``bind(args)`` gave until ``args.max_seconds`` (or an interrupt); the
    episodes run in the calling thread."""
    from masrl.http.server import ServerThread

    name = runner.cfg.name
    limits = http_limits()
    server = TeamServer(runner, name, args.batch_window_ms / 1000, debug_turns=args.debug_turns,
                        api_key=args.api_key, body_timeout_s=limits.body_timeout_s)
    http = ServerThread(create_app(server), sock, limits, name="masrl-serve-team", error_body=error_body,
                        api=API).start()
    print(f"masrl serve --team: {where} -> {http.url}/v1 (model = {name}: one request = one episode of "
          f"{runner.cfg.workflow.name})", flush=True)
    try:
        server.work_until(args.max_seconds)
    finally:
        http.stop()
    print(f"masrl serve --team: stopped after {server.episodes} episodes", file=sys.stderr)
    return 0
