"""masrl's HTTP service (``masrl.http``) on each request parser it runs on: h11 on asyncio's loop (the fallback)
and httptools on uvloop (where installed, the default). Each conduct the gateway, ``masrl serve --team`` and the
retrieval server rely on holds on both: a deadline on the whole request head, a bound on its size, malformed
HTTP as a JSON 400, chunked and pipelined requests answered once each, JSON 404/405/500, path parameters."""
from __future__ import annotations

import json
import logging
import socket
import time

import pytest

pytest.importorskip("fastapi", reason="masrl's servers run on the server extra: pip install masrl[server]")

from conftest import drip, read_response  # noqa: E402
from masrl.http import guard as guard_module  # noqa: E402
from masrl.http.app import add_route, json_app  # noqa: E402
from masrl.http.server import HttpLimits, ServerThread, listen, read_body  # noqa: E402


def _installed(name: str) -> bool:
    try:
        __import__(name)
        return True
    except ImportError:
        return False


STACKS = [pytest.param(("h11", "asyncio"), id="h11-asyncio"),
          pytest.param(("httptools", "uvloop"), id="httptools-uvloop", marks=pytest.mark.skipif(
              not (_installed("httptools") and _installed("uvloop")), reason="httptools or uvloop not installed"))]


API = "the API is POST /echo/{key}"


def _app():
    from starlette.responses import JSONResponse

    app = json_app("test server", api=API)

    async def echo(request):
        body = await read_body(request, 1024, 5.0)
        return JSONResponse({"key": request.path_params["key"], "body": body.decode()})

    async def broken(request):
        raise RuntimeError("the endpoint broke")

    add_route(app, "/echo/{key}", echo, "POST")
    add_route(app, "/broken", broken, "GET")
    return app


@pytest.fixture(params=STACKS)
def server(request):
    http, loop = request.param
    srv = ServerThread(_app(), listen("127.0.0.1", 0), HttpLimits(header_timeout_s=1.0), name="test-http",
                       api=API, http=http, loop=loop).start()
    yield srv
    srv.stop()


def _connect(srv) -> socket.socket:
    return socket.create_connection(srv.address, timeout=10)


def _all(sock) -> bytes:
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (ConnectionResetError, socket.timeout):
        pass
    return data


def _post(key: str, body: bytes, close: bool = False) -> bytes:
    return (b"POST /echo/%s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n%s\r\n%s"
            % (key.encode(), len(body), b"Connection: close\r\n" if close else b"", body))


def test_auto_picks_httptools_where_installed():
    chosen = guard_module.guarded_protocol(guard_module.ConnectionGuard(
        max_connections=1, max_per_client=1, head_timeout_s=1.0)).func
    assert chosen is (guard_module.GuardedHttpToolsProtocol if _installed("httptools")
                      else guard_module.GuardedH11Protocol)
    with pytest.raises(ValueError, match="h11"):
        guard_module.guarded_protocol(None, "h2")


def test_a_route_gets_its_path_parameter_and_body(server):
    with _connect(server) as sock:
        sock.sendall(_post("k1", b"hello"))
        status, _, body = read_response(sock)
    assert status == 200 and json.loads(body) == {"key": "k1", "body": "hello"}


def test_a_trickled_head_is_closed_at_the_deadline(server):
    with _connect(server) as sock:
        start = time.monotonic()
        sock.sendall(b"POST /echo/k HTTP/1.1\r\n")
        reply = drip(sock, b"X-Slow: " + b"a" * 30, 0.2)
    assert 0.9 <= time.monotonic() - start < 3, time.monotonic() - start
    assert reply.startswith(b"HTTP/1.1 408") and b"did not arrive within 1 s" in reply, reply


def test_a_head_over_the_bound_is_a_json_400(server):
    with _connect(server) as sock:
        head = b"POST /echo/k HTTP/1.1\r\nHost: x\r\n" + b"X-Big: %s\r\n" % (b"a" * 1000) * 20
        try:
            sock.sendall(head)
        except (BrokenPipeError, ConnectionResetError):
            pass
        reply = _all(sock)
    assert reply.startswith(b"HTTP/1.1 400"), reply[:200]
    assert json.loads(reply.partition(b"\r\n\r\n")[2])["error"].startswith("malformed HTTP request")


def test_malformed_http_is_a_json_400(server):
    with _connect(server) as sock:
        sock.sendall(b"NOT HTTP AT ALL\x00\r\n\r\n")
        reply = _all(sock)
    assert reply.startswith(b"HTTP/1.1 400") and b"application/json" in reply, reply[:300]
    assert "POST /echo/{key}" in json.loads(reply.partition(b"\r\n\r\n")[2])["error"]


def test_chunked_and_pipelined_requests_are_answered_once_each(server):
    chunked = (b"POST /echo/c HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
    with _connect(server) as sock:
        sock.sendall(chunked + _post("p", b"xyz") + _post("q", b"!", close=True))  # three requests, one write
        replies = _all(sock)
    answers = [json.loads(part.partition(b"\r\n\r\n")[2] or b"null")
               for part in replies.split(b"HTTP/1.1 ")[1:]]
    assert [a["key"] for a in answers] == ["c", "p", "q"]
    assert [a["body"] for a in answers] == ["abcde", "xyz", "!"]


def test_a_keep_alive_connection_with_half_a_head_is_answered_408(server):
    with _connect(server) as sock:
        sock.sendall(_post("k", b"1"))
        assert read_response(sock)[0] == 200
        sock.sendall(b"POST /ec")
        start = time.monotonic()
        reply = _all(sock)
    assert 0.9 <= time.monotonic() - start < 3 and reply.startswith(b"HTTP/1.1 408"), reply[:200]


@pytest.mark.parametrize("request_line,status,allow", [(b"GET /echo/k", 405, "POST"), (b"HEAD /broken", 405, "GET"),
                                                       (b"POST /nowhere", 404, None)])
def test_other_methods_and_paths_are_json_errors(server, request_line, status, allow):
    with _connect(server) as sock:
        sock.sendall(request_line + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        reply = _all(sock)
    head, _, body = reply.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    assert lines[0].startswith(f"HTTP/1.1 {status}") and headers["content-type"] == "application/json"
    assert headers.get("allow") == allow
    if not request_line.startswith(b"HEAD"):
        assert "POST /echo/{key}" in json.loads(body)["error"]


def test_an_endpoint_that_raises_is_a_json_500_and_an_error_line(server, caplog):
    caplog.set_level(logging.ERROR, logger="masrl.http")
    with _connect(server) as sock:
        sock.sendall(b"GET /broken HTTP/1.1\r\nHost: x\r\n\r\n")
        status, _, body = read_response(sock)
        sock.sendall(_post("after", b"ok"))  # the connection still serves
        assert read_response(sock)[0] == 200
    assert status == 500 and json.loads(body)["error"] == "RuntimeError: the endpoint broke"
    assert any("GET /broken failed" in r.getMessage() for r in caplog.records)
