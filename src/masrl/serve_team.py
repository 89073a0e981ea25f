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
"""
from __future__ import annotations

import json
import queue
import sys
import threading
import time
import uuid
from concurrent.futures import Future
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from masrl.config import load_config
from masrl.errors import UserInputError
from masrl.types import Episode, Task

MAX_BODY = 4 * 1024 * 1024
MAX_BATCH = 64


def load_run(path: Path, overrides: list[str]):
    """``(config, checkpoint folder or None)`` of a run folder or a ``masrl export`` folder."""
    if (path / "export.json").is_file():
        return load_config(path / "config.yaml", overrides), None
    if (path / "config.yaml").is_file():
        return load_config(path / "config.yaml", overrides), path
    raise UserInputError(f"masrl serve {path}: not a run folder (config.yaml + checkpoints/) or a masrl export "
                         "(export.json + config.yaml)")


class RequestError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": "invalid_request_error", "param": self.param, "code": None}}


def question_of(body: dict, chat: bool) -> str:
    """The task's question: the last user message's text (chat) or the prompt (completions)."""
    if not chat:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt.strip():
            raise RequestError(400, "prompt must be one non-empty string (one question = one episode)", "prompt")
        return prompt
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise RequestError(400, "messages must be a list", "messages")
    for message in reversed(messages):
        if isinstance(message, dict) and message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            if isinstance(content, str) and content.strip():
                return content
    raise RequestError(400, "messages hold no user message with text (its text is the team's task)", "messages")


class TeamServer:
    """Episodes on request: a worker thread runs the pending questions as one rollout per ``window_s``."""

    def __init__(self, runner, name: str, window_s: float = 0.005, debug_turns: bool = False):
        self.runner, self.name, self.window_s, self.debug_turns = runner, name, window_s, debug_turns
        self.pending: queue.Queue = queue.Queue()
        self.episodes = 0
        threading.Thread(target=self._work, name="masrl-serve-team", daemon=True).start()

    def episode(self, question: str, temperature: float | None) -> Episode:
        future: Future = Future()
        self.pending.put((question, temperature, future))
        return future.result()

    def _work(self) -> None:
        while True:
            batch = [self.pending.get()]
            deadline = time.monotonic() + self.window_s
            while len(batch) < MAX_BATCH:
                try:
                    batch.append(self.pending.get(timeout=max(deadline - time.monotonic(), 0.0)))
                except queue.Empty:
                    break
            for temperature in dict.fromkeys(t for _, t, _ in batch):
                self._run([b for b in batch if b[1] == temperature], temperature)

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
                future.set_exception(e)
            return
        for (_, _, future), episode in zip(batch, episodes):
            future.set_result(episode)

    def reply(self, body: dict, chat: bool) -> dict:
        question = question_of(body, chat)
        temperature = body.get("temperature")
        if temperature is not None and (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
                                        or temperature < 0):
            raise RequestError(400, f"temperature must be a number >= 0, got {temperature!r}", "temperature")
        if body.get("stream"):
            raise RequestError(400, "stream: true is not served (one reply per episode)", "stream")
        episode = self.episode(question, None if temperature is None else float(temperature))
        if episode.error:
            raise RequestError(500, f"the episode failed: {episode.error}")
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


def _unscored(task: Task, answer: str | None) -> dict:
    """A served question has no gold answer: the harness scores the reply."""
    return {"reward": 0.0, "correct": False}


def _plain(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def _handler(server: TeamServer, api_key: str | None):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):
            pass

        def _answer(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _authorized(self) -> bool:
            if api_key is None or self.headers.get("Authorization", "") == f"Bearer {api_key}":
                return True
            self._answer(401, RequestError(401, "invalid api key").body())
            return False

        def do_GET(self):  # noqa: N802 - http.server's naming
            if not self._authorized():
                return
            if self.path.rstrip("/") == "/v1/models":
                return self._answer(200, {"object": "list", "data": [
                    {"id": server.name, "object": "model", "created": 0, "owned_by": "masrl"}]})
            self._answer(404, RequestError(404, f"no route {self.path}").body())

        def do_POST(self):  # noqa: N802
            if not self._authorized():
                return
            route = self.path.rstrip("/")
            try:
                if route not in ("/v1/chat/completions", "/v1/completions"):
                    raise RequestError(404, f"no route {self.path}")
                length = int(self.headers.get("Content-Length") or 0)
                if length > MAX_BODY:
                    raise RequestError(413, "request body over 4 MiB")
                try:
                    body = json.loads(self.rfile.read(length) or b"{}")
                except ValueError:
                    raise RequestError(400, "the body is not JSON") from None
                if not isinstance(body, dict):
                    raise RequestError(400, "the body must be a JSON object")
                self._answer(200, server.reply(body, chat=route == "/v1/chat/completions"))
            except RequestError as e:
                self._answer(e.status, e.body())
            except Exception as e:  # noqa: BLE001 - one request fails, the server goes on
                self._answer(500, RequestError(500, f"{type(e).__name__}: {str(e)[:500]}").body())

    return Handler


def serve_until(deadline: float | None) -> None:
    """Return at ``deadline`` (``time.monotonic()``; None: never) or on an interrupt (Ctrl-C)."""
    try:
        while deadline is None or time.monotonic() < deadline:
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass


def run_team(args, runner, where) -> int:
    """Serve ``runner``'s team until ``args.max_seconds`` (or an interrupt)."""
    name = runner.cfg.name
    server = TeamServer(runner, name, args.batch_window_ms / 1000, debug_turns=args.debug_turns)
    httpd = ThreadingHTTPServer((args.host, args.port), _handler(server, args.api_key))
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, name="masrl-serve-team-http", daemon=True).start()
    host, port = httpd.server_address[:2]
    print(f"masrl serve --team: {where} -> http://{host}:{port}/v1 (model = {name}: one request = one episode of "
          f"{runner.cfg.workflow.name})", flush=True)
    try:
        serve_until(args.max_seconds)
    finally:
        httpd.shutdown()
    print(f"masrl serve --team: stopped after {server.episodes} episodes", file=sys.stderr)
    return 0
