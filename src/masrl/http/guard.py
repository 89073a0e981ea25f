"""Connection limits below a server's app, in uvicorn's HTTP protocol (masrl.http's servers): httptools' parser
where it is installed, h11's otherwise (``guarded_protocol``).

uvicorn has no timeout on the request head, and its ``limit_concurrency`` counts every open
connection -- so a few hundred connections that each send half a request line and wait turn every
request, ``/health`` included, into a 503 for as long as they stay open. Here a connection is
*waiting* from the moment it opens (or finishes a response, on keep-alive) until its next request
head is complete, and:

- a waiting connection is closed after ``head_timeout_s``, with a JSON 408 (silently when it is an
  idle keep-alive connection, as uvicorn's keep-alive timeout does);
- at most ``max_connections`` connections are open, at most ``max_per_client`` from one peer
  address: a connection over a limit closes the oldest waiting connection (of that peer, or any)
  to make room, and is refused with a JSON 503 only when every connection it competes with is
  serving a request.

So stalled connections can delay nobody: a client with a whole request is served at once. The deadline is
on the whole head: a client that trickles its header one byte at a time is closed at ``head_timeout_s`` all
the same. A request whose body is slow is the app's to time out (``masrl.http.server.read_body``). Malformed
HTTP, and a request head over ``MAX_HEAD_BYTES``, is answered with a JSON 400 in the server's own error shape
(``error_body``). What uvicorn's protocol
reports of a client's conduct (malformed HTTP, an upgrade it does not serve) and every hang-up is logged at
debug level on ``masrl.http``: a client that goes away never puts a line on the server's stderr.
"""
from __future__ import annotations

import asyncio
import functools
import json
import logging
from http import HTTPStatus
from typing import Any, Callable

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("masrl.http")
API = "the API is POST /retrieve and GET /health"  # the retrieval server's (its default hint)
MAX_HEAD_BYTES = 16 * 1024  # a request line and headers (h11's own bound, applied to httptools too)


def plain_error(status: int, message: str) -> dict:
    """``{"error": message}``: the retrieval server's error body."""
    return {"error": message}


class _ClientConduct(logging.LoggerAdapter):
    """uvicorn's protocol logger, with its warnings about what a client sent (malformed HTTP, an upgrade it does
    not serve) at debug level: the client's affair, answered to the client. Errors of the app stay errors."""

    @property
    def level(self) -> int:  # uvicorn reads its logger's level (trace logging)
        return self.logger.level

    def log(self, level, msg, *args, **kwargs):
        super().log(logging.DEBUG if level == logging.WARNING else level, msg, *args, **kwargs)


def write_error_and_close(transport: asyncio.Transport, status: int, message: str,
                          error_body: Callable[[int, str], Any] = plain_error) -> None:
    """Answer ``error_body(status, message)`` as JSON outside h11 (no request may have been read) and close."""
    body = json.dumps(error_body(status, message)).encode()
    head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode()
    transport.write(head + body)
    transport.close()


class ConnectionGuard:
    """The open connections of one server: per peer address, and which are waiting for a request head.

    ``error_body(status, message)`` is the JSON the guard answers in (the server's own error shape), ``api`` the
    hint a malformed request gets (the server's routes)."""

    def __init__(self, *, max_connections: int, max_per_client: int, head_timeout_s: float,
                 error_body: Callable[[int, str], Any] = plain_error, api: str = API):
        self.max_connections, self.max_per_client, self.head_timeout_s = max_connections, max_per_client, head_timeout_s
        self.error_body, self.api = error_body, api
        self.per_peer: dict[str, set] = {}
        self.waiting: dict = {}  # connection -> None, oldest first

    @property
    def open_count(self) -> int:
        return sum(len(conns) for conns in self.per_peer.values())

    def admit(self, conn: "GuardedH11Protocol") -> str | None:
        """Count ``conn`` in; make room by closing the oldest waiting connection, or return why ``conn`` is refused."""
        peers = self.per_peer.setdefault(conn.peer, set())
        peers.add(conn)
        if len(peers) > self.max_per_client:
            victim = self._oldest_waiting(conn, conn.peer)
            if victim is None:
                return (f"{len(peers) - 1} connections from {conn.peer} are serving requests; the limit per client is "
                        f"{self.max_per_client}: retry when one finishes")
            victim.drop(503, f"closed to make room: {conn.peer} holds its limit of {self.max_per_client} connections "
                             "and this one had not sent a whole request")
        elif self.open_count > self.max_connections:
            victim = self._oldest_waiting(conn, None)
            if victim is None:
                return (f"{self.open_count - 1} connections are serving requests; the server limit is "
                        f"{self.max_connections}: retry when one finishes")
            victim.drop(503, f"closed to make room: the server holds its limit of {self.max_connections} connections "
                             "and this one had not sent a whole request")
        return None

    def _oldest_waiting(self, newcomer, peer: str | None):
        return next((c for c in self.waiting if c is not newcomer and (peer is None or c.peer == peer)), None)

    def set_waiting(self, conn, waiting: bool) -> None:
        """Mark ``conn`` waiting (keeping its place if it already was: dripping bytes does not make it younger)."""
        if not waiting:
            self.waiting.pop(conn, None)
        elif conn not in self.waiting:
            self.waiting[conn] = None

    def forget(self, conn) -> None:
        self.waiting.pop(conn, None)
        peers = self.per_peer.get(conn.peer)
        if peers is not None:
            peers.discard(conn)
            if not peers:
                del self.per_peer[conn.peer]


class _Guarded:
    """The guard's part of a uvicorn HTTP protocol (mixed in before uvicorn's ``H11Protocol`` or
    ``HttpToolsProtocol``): a request-head timeout, connection limits and JSON errors. A subclass says when the
    connection waits for a request head (``_head_pending``) and whether part of the next head has arrived
    (``_head_begun``)."""

    def __init__(self, *args, guard: ConnectionGuard, **kwargs):
        super().__init__(*args, **kwargs)
        self.logger = _ClientConduct(log, {})
        self.guard, self.peer = guard, ""
        self._head_timer: asyncio.TimerHandle | None = None
        self._kept_alive = False  # has answered a request and waits for the next

    def _head_pending(self) -> bool:
        raise NotImplementedError

    def _head_begun(self) -> bool:
        raise NotImplementedError

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.peer = self.client[0] if self.client else ""
        refusal = self.guard.admit(self)
        if refusal is not None:
            self.drop(503, refusal)
            return
        self._track_head()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.cycle is not None and not self.cycle.response_complete:
            log.debug("%s hung up before its answer (%s)", self.peer or "a client", exc or "closed")
        self._set_head_timer(False)
        self.guard.forget(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._track_head()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._kept_alive = True
        self._track_head()

    def send_400_response(self, msg: str) -> None:
        if self.cycle is not None and self.cycle.response_started:  # too late for an answer: just close
            self.transport.close()
            return
        write_error_and_close(self.transport, 400, f"malformed HTTP request; {self.guard.api}", self.guard.error_body)

    def drop(self, status: int, message: str) -> None:
        """Close a connection that has no request in progress, answering a JSON ``status`` unless it is an idle
        keep-alive connection: an answer there could be read as the answer to a request being sent this moment."""
        self._set_head_timer(False)
        self.guard.forget(self)
        if self.transport.is_closing():
            return
        if self._head_begun() or not self._kept_alive:
            write_error_and_close(self.transport, status, message, self.guard.error_body)
        else:
            self.transport.close()

    def _track_head(self) -> None:
        """Waiting for a request head: while none of this cycle's request head is complete, and the line is open."""
        waiting = self._head_pending() and not self.transport.is_closing()
        self._set_head_timer(waiting)
        self.guard.set_waiting(self, waiting)

    def _set_head_timer(self, waiting: bool) -> None:
        if waiting and self._head_timer is None:
            self._head_timer = self.loop.call_later(self.guard.head_timeout_s, self._head_timed_out)
        elif not waiting and self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        self.drop(408, f"the request head did not arrive within {self.guard.head_timeout_s:g} s")


class GuardedH11Protocol(_Guarded, H11Protocol):
    """uvicorn's h11 protocol behind the guard (pure Python: the fallback where httptools is not installed).

    Build with ``functools.partial(GuardedH11Protocol, guard=ConnectionGuard(...))`` as uvicorn's ``http``."""

    def _head_pending(self) -> bool:
        return self.conn.their_state is h11.IDLE  # h11 holds a head until it is whole

    def _head_begun(self) -> bool:
        return bool(self.conn.trailing_data[0])


def _httptools_protocol() -> type | None:
    """``GuardedHttpToolsProtocol``: uvicorn's httptools protocol (a C parser) behind the guard, with the request
    head bounded at ``MAX_HEAD_BYTES`` as h11 bounds it; None when httptools is not installed."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return None

    class GuardedHttpToolsProtocol(_Guarded, HttpToolsProtocol):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._head_bytes = 0
            self._in_head = False  # between the first byte of a request and the end of its head

        def _head_pending(self) -> bool:
            return self.cycle is None or self.cycle.response_complete  # the newest request head: none, or answered

        def _head_begun(self) -> bool:
            return self._in_head

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._head_bytes, self._in_head = 0, True

        def on_url(self, url: bytes) -> None:
            self._count_head(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count_head(len(name) + len(value) + 4)
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._in_head = False
            super().on_headers_complete()

        def _count_head(self, size: int) -> None:
            self._head_bytes += size
            if self._head_bytes > MAX_HEAD_BYTES:  # the parser turns it into an error: a JSON 400, then closed
                raise ValueError(f"request head over {MAX_HEAD_BYTES} bytes")

    return GuardedHttpToolsProtocol


GuardedHttpToolsProtocol = _httptools_protocol()


def guarded_protocol(guard: ConnectionGuard, http: str = "auto") -> Callable[..., asyncio.Protocol]:
    """uvicorn's ``http`` setting behind ``guard``: httptools' parser where it is installed (``auto``,
    ``httptools``), else h11's (``h11``, or ``auto`` without httptools)."""
    if http not in ("auto", "httptools", "h11"):
        raise ValueError(f"http must be auto, httptools or h11, got {http!r}")
    if http == "httptools" and GuardedHttpToolsProtocol is None:
        raise ImportError("httptools is not installed: pip install masrl[server]")
    protocol = GuardedH11Protocol if http == "h11" or GuardedHttpToolsProtocol is None else GuardedHttpToolsProtocol
    return functools.partial(protocol, guard=guard)
