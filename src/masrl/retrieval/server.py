"""HTTP retrieval server speaking the Search-R1 API.

``POST /retrieve`` with ``{"queries": [str, ...], "topk": int?, "return_scores": bool?}`` answers
``{"result": [[doc, ...], ...]}``, one list per query, best first, where ``doc`` is
``{"id", "contents"}`` (``contents`` = ``"Title"\\ntext``) or, with ``return_scores: true``,
``{"document": {"id", "contents"}, "score": float}`` -- the shapes of Search-R1's
``retrieval_server.py``. ``GET /health`` answers ``{"status": "ok", ...}``.

Limits: ``topk`` above ``max_topk`` is capped; queries longer than ``max_query_chars`` are
truncated; more than ``max_queries`` queries, or a body above ``max_body_bytes`` (refused from its
``Content-Length`` before it is read, or as soon as a chunked body passes the limit), is refused
with 413. A body that takes longer than ``body_timeout_s`` to arrive is a 408. Below the app
(``masrl.http.guard``, the guard the gateway runs behind too): a connection that has not sent a whole request head within
``header_timeout_s`` is closed (408); at most ``max_connections`` connections are open, at most
``max_connections_per_client`` from one address -- a new one closes the oldest connection still
waiting for its head, or is refused with a 503 when all are serving requests; malformed HTTP is a
400. So half-sent requests cannot hold ``/health`` or anything else. Malformed JSON
(not JSON, not UTF-8, nested too deep, a number too long to convert) is a 400, missing or mistyped
fields a 422, a wrong path or method a 404 / 405, a failure of the retriever a 500. Every error
body is ``{"error": message}``; a client that disconnects mid-request is dropped without a log
traceback.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from masrl.http.guard import API, ConnectionGuard, guarded_protocol
from masrl.http.server import BodyError, HttpLimits, ServerThread, listen
from masrl.http.server import read_body as read_limited_body
from masrl.retrieval.base import Retriever

log = logging.getLogger(__name__)


@dataclass
class ServerLimits:
    default_topk: int = 3
    max_topk: int = 50
    max_queries: int = 512
    max_query_chars: int = 2000
    max_body_bytes: int = 4 * 1024 * 1024
    body_timeout_s: float = 30.0
    max_connections: int = 256
    max_connections_per_client: int = 128
    header_timeout_s: float = 10.0

    def __post_init__(self):
        for name in ("default_topk", "max_topk", "max_queries", "max_query_chars", "max_body_bytes",
                     "max_connections", "max_connections_per_client"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ServerLimits.{name} must be an integer >= 1, got {value!r}")
        for name in ("body_timeout_s", "header_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"ServerLimits.{name} must be a finite number > 0, got {value!r}")

    def http(self) -> HttpLimits:
        """The connection and body limits, for the shared HTTP service (``masrl.http``)."""
        return HttpLimits(header_timeout_s=self.header_timeout_s, body_timeout_s=self.body_timeout_s,
                          max_body_bytes=self.max_body_bytes, max_connections=self.max_connections,
                          max_connections_per_client=self.max_connections_per_client)


ROUTES = API


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
    except RecursionError:
        raise _BadRequest(400, "malformed JSON: nested too deep") from None
    except ValueError as e:  # not JSON, not UTF-8, an integer of more than 4300 digits
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


async def read_body(request: Request, limits: ServerLimits) -> bytes:
    """The request body within ``limits`` (``masrl.http.server.read_body``: 413 over ``max_body_bytes``, 408
    past ``body_timeout_s``). Raises ``_BadRequest`` (or ``ClientDisconnect``)."""
    try:
        return await read_limited_body(request, limits.max_body_bytes, limits.body_timeout_s)
    except BodyError as e:
        raise _BadRequest(e.status, e.message) from None


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

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return JSONResponse({"error": f"{exc.detail}: {request.method} {request.url.path}; {ROUTES}"},
                            status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception):  # a bug or a failing retriever: Starlette logs it
        return JSONResponse({"error": f"internal error: {type(exc).__name__}: {exc}"[:500]}, status_code=500)

    @app.post("/retrieve")
    async def retrieve(request: Request):
        try:
            body = await read_body(request, limits)
        except _BadRequest as e:  # the rest of the body is unread: close the connection after answering
            return JSONResponse({"error": e.message}, status_code=e.status, headers={"Connection": "close"})
        except ClientDisconnect:  # nobody to answer
            return JSONResponse({"error": "client disconnected"}, status_code=400)
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


def uvicorn_options(retriever: Retriever, limits: ServerLimits) -> dict:
    """uvicorn settings serving ``retriever``: the app behind the connection guard, which limits connections
    itself (uvicorn's ``limit_concurrency`` would count connections still waiting for a request head)."""
    guard = ConnectionGuard(max_connections=limits.max_connections, max_per_client=limits.max_connections_per_client,
                            head_timeout_s=limits.header_timeout_s)
    return {"app": create_app(retriever, limits), "http": guarded_protocol(guard),
            "limit_concurrency": None}


def serve(retriever: Retriever, host: str = "127.0.0.1", port: int = 8000, limits: ServerLimits | None = None,
          log_level: str = "info") -> None:
    """Run the server in the foreground until interrupted."""
    import uvicorn

    uvicorn.run(**uvicorn_options(retriever, limits or ServerLimits()), host=host, port=port, log_level=log_level)


class BackgroundServer:
    """The server in a daemon thread on a free loopback port (tests, in-process training runs).

        with BackgroundServer(retriever) as server:
            HttpRetriever(server.url).search(["q"], 3)
    """

    def __init__(self, retriever: Retriever, limits: ServerLimits | None = None, host: str = "127.0.0.1",
                 port: int = 0, startup_timeout: float = 30.0):
        limits = limits or ServerLimits()
        http = limits.http()
        self._server = ServerThread(create_app(retriever, limits), listen(host, port, backlog=http.backlog), http,
                                    name="masrl-retriever")
        self.host, self.port = self._server.address
        self._startup_timeout = startup_timeout

    @property
    def url(self) -> str:
        return self._server.url

    def start(self) -> "BackgroundServer":
        self._server.start(self._startup_timeout)
        return self

    def stop(self) -> None:
        self._server.stop()

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
