"""HTTP retrieval server speaking the Search-R1 API.

``POST /retrieve`` with ``{"queries": [str, ...], "topk": int?, "return_scores": bool?}`` answers
``{"result": [[doc, ...], ...]}``, one list per query, best first, where ``doc`` is
``{"id", "contents"}`` (``contents`` = ``"Title"\\ntext``) or, with ``return_scores: true``,
``{"document": {"id", "contents"}, "score": float}`` -- the shapes of Search-R1's
``retrieval_server.py``. ``GET /health`` answers ``{"status": "ok", ...}``.

Limits: ``topk`` above ``max_topk`` is capped; queries longer than ``max_query_chars`` are
truncated; more than ``max_queries`` queries, or a body above ``max_body_bytes``, is refused
with 413. Malformed JSON is a 400, missing or mistyped fields a 422; errors are
``{"error": message}``.
"""
from __future__ import annotations

import json
import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from masrl.tasks.retrieval.base import Retriever

log = logging.getLogger(__name__)


@dataclass
class ServerLimits:
    default_topk: int = 3
    max_topk: int = 50
    max_queries: int = 512
    max_query_chars: int = 2000
    max_body_bytes: int = 4 * 1024 * 1024


class _BadRequest(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def parse_retrieve_request(body: bytes, limits: ServerLimits) -> tuple[list[str], int, bool]:
    """Validate a ``/retrieve`` body; returns (queries, topk, return_scores) or raises _BadRequest."""
    if len(body) > limits.max_body_bytes:
        raise _BadRequest(413, f"request body of {len(body)} bytes exceeds {limits.max_body_bytes}")
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _BadRequest(400, f"malformed JSON: {e}") from None
    if not isinstance(data, dict):
        raise _BadRequest(422, 'the body must be a JSON object {"queries": [...], "topk": k, "return_scores": bool}')
    if "queries" not in data:
        raise _BadRequest(422, "missing field 'queries' (a list of strings)")
    queries = data["queries"]
    if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
        raise _BadRequest(422, "'queries' must be a list of strings")
    if len(queries) > limits.max_queries:
        raise _BadRequest(413, f"{len(queries)} queries in one request; the limit is {limits.max_queries}")
    topk = data.get("topk")
    if topk is None:
        topk = limits.default_topk
    if isinstance(topk, bool) or not isinstance(topk, int):
        raise _BadRequest(422, "'topk' must be an integer")
    if topk < 1:
        raise _BadRequest(422, f"'topk' must be >= 1, got {topk}")
    return_scores = data.get("return_scores", False)
    if not isinstance(return_scores, bool):
        raise _BadRequest(422, "'return_scores' must be true or false")
    queries = [q[:limits.max_query_chars] for q in queries]
    return queries, min(topk, limits.max_topk), return_scores


def create_app(retriever: Retriever, limits: ServerLimits | None = None):
    """The FastAPI application serving ``retriever``."""
    limits = limits or ServerLimits()
    app = FastAPI(title="masrl retriever", docs_url=None, redoc_url=None)
    app.state.retriever, app.state.limits = retriever, limits

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok", "retriever": getattr(retriever, "name", type(retriever).__name__),
                "passages": len(retriever) if hasattr(retriever, "__len__") else None,
                "max_topk": limits.max_topk, "max_queries": limits.max_queries}

    @app.post("/retrieve")
    async def retrieve(request: Request):
        body = await request.body()
        try:
            queries, topk, return_scores = parse_retrieve_request(body, limits)
        except _BadRequest as e:
            return JSONResponse({"error": e.message}, status_code=e.status)
        results = await run_in_threadpool(retriever.search, queries, topk) if queries else []
        if return_scores:
            payload = [[{"document": p.to_document(), "score": p.score} for p in row] for row in results]
        else:
            payload = [[p.to_document() for p in row] for row in results]
        return {"result": payload}

    return app


def serve(retriever: Retriever, host: str = "127.0.0.1", port: int = 8000, limits: ServerLimits | None = None,
          log_level: str = "info") -> None:
    """Run the server in the foreground until interrupted."""
    import uvicorn

    uvicorn.run(create_app(retriever, limits), host=host, port=port, log_level=log_level)


class BackgroundServer:
    """The server in a daemon thread on a free loopback port (tests, in-process training runs).

        with BackgroundServer(retriever) as server:
            HttpRetriever(server.url).search(["q"], 3)
    """

    def __init__(self, retriever: Retriever, limits: ServerLimits | None = None, host: str = "127.0.0.1",
                 port: int = 0, startup_timeout: float = 30.0):
        import uvicorn

        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host, self.port = host, self._sock.getsockname()[1]
        config = uvicorn.Config(create_app(retriever, limits), log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)
        self._startup_timeout = startup_timeout

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "BackgroundServer":
        self._thread.start()
        deadline = time.monotonic() + self._startup_timeout
        while not self._server.started:  # poll until uvicorn reports it is listening
            if not self._thread.is_alive():
                raise RuntimeError(f"retrieval server on {self.url} exited during startup")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"retrieval server on {self.url} did not start in {self._startup_timeout:g} s")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self._sock.close()

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
