"""A FastAPI app served by uvicorn in a thread of its own, behind the connection guard (``masrl.http.guard``).

    limits = HttpLimits(header_timeout_s=30)
    sock = listen("127.0.0.1", 0, host_setting="--host", port_setting="--port")   # one clear line if it cannot
    server = ServerThread(app, sock, limits, error_body=..., api="...", name="my-server").start()
    ...
    server.stop()

- ``listen`` binds IPv4 or IPv6 as the host asks (``::1``, ``[::1]``, a name) with a listen backlog of
  ``backlog``; an address it cannot use is one ``masrl.errors.UserInputError`` naming the setting the
  user gave (``--port``, ``workflow.params.port``) and what to do.
- ``ServerThread`` runs uvicorn's loop (uvloop's where installed) in a daemon thread, httptools parsing requests
  where it is installed (h11 otherwise): uvicorn installs no signal handler and does not
  configure logging (its own logs go to the ``uvicorn`` loggers at ``warning``, the guard's to ``masrl.http``).
- ``read_body`` reads a request's body (``Content-Length`` or chunked) within a size and a deadline on the
  whole body.
"""
from __future__ import annotations

import asyncio
import errno
import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import uvicorn
from starlette.requests import Request

from masrl.errors import UserInputError
from masrl.http.guard import API, ConnectionGuard, guarded_protocol, plain_error

log = logging.getLogger("masrl.http")


@dataclass
class HttpLimits:
    """What one connection and one request may take. The deadlines are on the whole head and the whole body
    (not per read): a client that trickles bytes is closed at them all the same."""

    header_timeout_s: float = 10.0   # the request head (request line and headers), from connect or the last answer
    body_timeout_s: float = 30.0     # the body, once its head arrived
    max_body_bytes: int = 4 * 1024 * 1024
    max_connections: int = 256
    max_connections_per_client: int = 128
    keep_alive_s: float = 5.0        # an idle keep-alive connection is closed after this
    backlog: int = 1024              # connections the kernel queues before they are accepted

    def __post_init__(self):
        for name in ("max_body_bytes", "max_connections", "max_connections_per_client", "backlog"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{type(self).__name__}.{name} must be an integer >= 1, got {value!r}")
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"{type(self).__name__}.{name} must be a finite number > 0, got {value!r}")


class BodyError(Exception):
    """A body refused: 413 (over the limit) or 408 (past the deadline)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


async def read_body(request: Request, max_bytes: int, timeout_s: float) -> bytes:
    """The request body (``Content-Length`` or chunked, decoded by the parser), never holding more than ``max_bytes``
    of it: a declared length over the limit is refused before reading (413), a chunked body as soon as it passes
    the limit (413), a body that has not all arrived within ``timeout_s`` is a 408. Raises ``BodyError``
    (or starlette's ``ClientDisconnect`` when the client hangs up)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise BodyError(413, f"request body of {int(declared)} bytes exceeds {max_bytes}")

    async def collect() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise BodyError(413, f"request body exceeds {max_bytes} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        if _timeout is None:  # Python 3.10
            return await asyncio.wait_for(collect(), timeout_s)
        async with _timeout(timeout_s):  # no task of its own per request
            return await collect()
    except asyncio.TimeoutError:
        raise BodyError(408, f"the request body did not arrive within {timeout_s:g} s") from None


_timeout = getattr(asyncio, "timeout", None)


def format_host(host: str) -> str:
    """``host`` as it goes in a URL: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def listen(host: str, port: int, *, backlog: int = 1024, host_setting: str = "host",
           port_setting: str = "port") -> socket.socket:
    """A listening TCP socket on ``host:port`` (IPv6 for an IPv6 address or a name that resolves to one only).
    What cannot be bound is one ``UserInputError`` that names ``host_setting`` / ``port_setting`` (what the
    user set: ``--port``, ``workflow.params.port``) and what to do."""
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    where = f"{format_host(bare)}:{port}"
    try:
        infos = socket.getaddrinfo(bare or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        if ":" in bare:
            raise UserInputError(f"cannot listen on {where}: this machine has no IPv6 ({e.strerror}); set "
                                 f"{host_setting} to an IPv4 address such as 127.0.0.1") from None
        raise UserInputError(f"cannot listen on {where}: {host_setting} {bare!r} is not an address or a name "
                             f"this machine resolves ({e.strerror})") from None
    family, _, _, _, address = infos[0]
    try:
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as e:
        raise UserInputError(f"cannot listen on {where}: this machine has no "
                             f"{'IPv6' if family == socket.AF_INET6 else 'IPv4'} ({e.strerror}); set {host_setting} "
                             f"to {'127.0.0.1' if family == socket.AF_INET6 else '::1'}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
        sock.listen(backlog)
    except OSError as e:
        sock.close()
        raise UserInputError(f"cannot listen on {where}: {_bind_advice(e, host_setting, port_setting)}") from None
    sock.setblocking(False)
    return sock


def _bind_advice(error: OSError, host_setting: str, port_setting: str) -> str:
    if error.errno == errno.EADDRINUSE:
        return f"the port is in use; set {port_setting} to a free port, or 0 for any"
    if error.errno == errno.EACCES:
        return f"permission denied (ports below 1024 need privileges); set {port_setting} to a port above 1023, or 0"
    if error.errno == errno.EADDRNOTAVAIL:
        return f"not an address of this machine; set {host_setting} to one of its addresses (127.0.0.1: this machine)"
    return f"{error.strerror or error}; check {host_setting} and {port_setting}"


HTTP = "auto"  # ServerThread's request parser: auto (httptools where installed, else h11), httptools, h11
LOOP = "auto"  # ServerThread's event loop: auto (uvloop where installed, else asyncio), uvloop, asyncio


def event_loop_runner(loop: str = "auto") -> Callable[[Any], Any]:
    """``asyncio.run``, on uvloop's loop where ``loop`` is ``uvloop`` or ``auto`` and uvloop is installed."""
    if loop not in ("auto", "uvloop", "asyncio"):
        raise ValueError(f"loop must be auto, uvloop or asyncio, got {loop!r}")
    if loop == "asyncio":
        return asyncio.run
    try:
        import uvloop
    except ImportError:
        if loop == "uvloop":
            raise ImportError("uvloop is not installed: pip install masrl[server]") from None
        return asyncio.run
    return uvloop.run


class ServerThread:
    """``app`` served by uvicorn on ``sock`` in a daemon thread named ``name``, behind the connection guard
    (``masrl.http.guard.guarded_protocol``) with ``limits``; its errors in ``error_body``'s shape.

    ``http`` picks the request parser (``auto``: httptools where installed, else h11), ``loop`` the event loop
    (``auto``: uvloop where installed, else asyncio's); ``HTTP`` and ``LOOP`` are the defaults."""

    def __init__(self, app: Any, sock: socket.socket, limits: HttpLimits, *, name: str,
                 error_body: Callable[[int, str], Any] = plain_error, api: str = API, http: str | None = None,
                 loop: str | None = None):
        guard = ConnectionGuard(max_connections=limits.max_connections,
                                max_per_client=limits.max_connections_per_client,
                                head_timeout_s=limits.header_timeout_s, error_body=error_body, api=api)
        self.guard = guard  # its open and waiting connections (read by tests; changed only in the server's loop)
        # uvicorn's limit_concurrency would count connections still waiting for a request head: the guard limits
        # them; no proxy headers are read (the servers are called directly), no access log is written
        config = uvicorn.Config(app, http=guarded_protocol(guard, http or HTTP), limit_concurrency=None,
                                lifespan="off", log_config=None, log_level="warning", access_log=False,
                                proxy_headers=False, timeout_keep_alive=limits.keep_alive_s,
                                timeout_graceful_shutdown=2, backlog=limits.backlog)
        self.sock, self.name = sock, name
        self.address = sock.getsockname()[:2]
        self.server = uvicorn.Server(config)
        self.loop: asyncio.AbstractEventLoop | None = None  # the server's loop, once it runs
        self.thread = threading.Thread(target=event_loop_runner(loop or LOOP), args=(self._serve(),), name=name,
                                       daemon=True)

    async def _serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        await self.server.serve(sockets=[self.sock])

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://{format_host(host)}:{port}"

    def start(self, timeout_s: float = 30.0) -> "ServerThread":
        """Start the thread; return once uvicorn listens (or raise when it cannot start)."""
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError(f"{self.name} on {self.url} exited during startup")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.name} on {self.url} did not start in {timeout_s:g} s")
            time.sleep(0.005)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop serving: open connections are closed, requests in progress get 2 s to finish."""
        self.server.should_exit = True
        if self.thread.is_alive():
            self.thread.join(timeout=timeout_s)
        self.sock.close()
