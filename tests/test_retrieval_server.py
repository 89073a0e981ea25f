"""The retrieval server over real HTTP on loopback, and the HTTP client retriever."""
from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from conftest import drip
from masrl.retrieval import BM25Retriever, HttpRetriever, Passage, RetrieverError
from masrl.retrieval.server import BackgroundServer, ServerLimits

PASSAGES = [Passage(str(i), f"Topic {name}", f"{name} is a common word about {name} things.")
            for i, name in enumerate(["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"])]
LIMITS = ServerLimits(default_topk=2, max_topk=5, max_queries=4, max_query_chars=50)


def wait_until_answers(url: str, timeout: float = 30.0) -> dict:
    """Poll GET /health until the server answers (no fixed sleeps)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return httpx.get(url + "/health", timeout=2.0).json()
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@pytest.fixture(scope="module")
def server():
    with BackgroundServer(BM25Retriever(PASSAGES), LIMITS) as srv:
        wait_until_answers(srv.url)
        yield srv


def post(server, payload=None, *, content=None):
    body = content if content is not None else json.dumps(payload)
    return httpx.post(server.url + "/retrieve", content=body, headers={"Content-Type": "application/json"},
                      timeout=10.0)


def test_health_and_loopback_binding(server):
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["passages"] == len(PASSAGES) and health["max_topk"] == 5
    assert server.host == "127.0.0.1"


def test_retrieve_search_r1_shapes(server):
    r = post(server, {"queries": ["Topic delta", "golf things"], "topk": 3, "return_scores": True})
    assert r.status_code == 200
    result = r.json()["result"]
    assert len(result) == 2
    first = result[0][0]
    assert set(first) == {"document", "score"} and set(first["document"]) == {"id", "contents"}
    assert first["document"]["contents"] == '"Topic delta"\ndelta is a common word about delta things.'
    assert result[1][0]["document"]["id"] == "6"
    assert isinstance(first["score"], float) and len(result[0]) <= 3

    bare = post(server, {"queries": ["Topic delta"], "topk": 1}).json()["result"]
    assert bare == [[{"id": "3", "contents": first["document"]["contents"]}]]  # return_scores defaults to false
    default_k = post(server, {"queries": ["common word"]}).json()["result"]
    assert len(default_k[0]) == LIMITS.default_topk
    assert post(server, {"queries": []}).json() == {"result": []}


def test_huge_topk_is_capped(server):
    r = post(server, {"queries": ["common word"], "topk": 10**9, "return_scores": False})
    assert r.status_code == 200
    assert len(r.json()["result"][0]) == LIMITS.max_topk


def test_long_query_is_truncated_not_fatal(server):
    r = post(server, {"queries": ["Topic echo " + "x" * 100_000], "topk": 1})
    assert r.status_code == 200
    assert r.json()["result"][0][0]["id"] == "4"


@pytest.mark.parametrize("content,status,needle", [
    ("{not json", 400, "malformed JSON"),
    ("", 400, "malformed JSON"),
    ('"just a string"', 422, "JSON object"),
    ('{"topk": 3}', 422, "missing field 'queries'"),
    ('{"queries": "alpha"}', 422, "list of strings"),
    ('{"queries": ["alpha", 3]}', 422, "list of strings"),
    ('{"queries": ["alpha"], "topk": "3"}', 422, "'topk' must be an integer"),
    ('{"queries": ["alpha"], "topk": 2.5}', 422, "'topk' must be an integer"),
    ('{"queries": ["alpha"], "topk": true}', 422, "'topk' must be an integer"),
    ('{"queries": ["alpha"], "topk": 0}', 422, ">= 1"),
    ('{"queries": ["alpha"], "return_scores": "yes"}', 422, "return_scores"),
    ('{"queries": ["a", "b", "c", "d", "e"]}', 413, "limit is 4"),
])
def test_malformed_requests_get_4xx_with_message(server, content, status, needle):
    r = post(server, content=content)
    assert r.status_code == status
    assert needle in r.json()["error"]


def test_server_survives_bad_requests(server):
    post(server, content="{oops")
    assert post(server, {"queries": ["Topic alpha"], "topk": 1}).json()["result"][0][0]["id"] == "0"


def test_http_retriever_roundtrip(server):
    client = HttpRetriever(server.url, timeout=5, retries=0, max_batch=3)
    local = BM25Retriever(PASSAGES)
    queries = ["Topic bravo", "hotel things", "nothing matches zzz"]
    remote = client.search(queries, topk=3)
    expected = local.search(queries, topk=3)
    assert [[p.id for p in row] for row in remote] == [[p.id for p in row] for row in expected]
    assert remote[0][0] == expected[0][0]  # title, text and score survive the trip
    many = client.search([f"Topic {n}" for n in ["alpha", "bravo", "charlie", "delta", "echo", "golf"]], topk=1)
    assert [row[0].id for row in many] == ["0", "1", "2", "3", "4", "6"]  # two requests of 3 (server limit: 4)
    client.close()


def test_http_retriever_rejected_request_is_clear(server):
    client = HttpRetriever(server.url, timeout=5, retries=0, max_batch=10)
    with pytest.raises(RetrieverError, match="rejected the request: HTTP 413"):
        client.search(["a"] * 6, topk=1)  # more than the server's max_queries=4 in one request


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_http_retriever_unreachable_error_names_url():
    url = f"http://127.0.0.1:{_free_port()}"
    client = HttpRetriever(url, timeout=1, retries=1, backoff=0.01)
    with pytest.raises(RetrieverError, match=r"127\.0\.0\.1:\d+/retrieve unreachable after 2 attempt"):
        client.search(["q"], 3)


def test_cli_serve_retriever_subprocess(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(p.to_document()) + "\n" for p in PASSAGES))
    port = _free_port()
    code = ("import argparse, sys; from masrl.retrieval.cli import register; "
            "p = argparse.ArgumentParser(); sub = p.add_subparsers(); register(sub); "
            "a = p.parse_args(sys.argv[1:]); sys.exit(a.func(a))")
    env = {**os.environ, "MASRL_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.Popen([sys.executable, "-c", code, "serve-retriever", "--corpus", str(corpus),
                             "--port", str(port), "--log-level", "warning", "--header-timeout", "1"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.communicate()[1]
            try:
                httpx.get(url + "/health", timeout=2.0)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "server did not come up"
                time.sleep(0.05)
        [top] = HttpRetriever(url, retries=0).search(["Topic foxtrot"], 1)
        assert top[0].id == "5"
        with socket.create_connection(("127.0.0.1", port), timeout=5) as stalled:  # --header-timeout reaches the server
            stalled.sendall(b"GET /hea")
            assert b"did not arrive within 1 s" in stalled.recv(65536)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_masrl_serve_retriever_knows_the_synthetic_kb_in_a_fresh_process(tmp_path):
    """``masrl serve-retriever --corpus synthetic_kb``: the spec a task registers is known to the command (a
    fresh interpreter, so nothing else imported the task); the port is taken, so it stops after indexing."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**os.environ, "MASRL_CACHE_DIR": str(tmp_path / "cache")}
        result = subprocess.run([sys.executable, "-m", "masrl", "serve-retriever", "--corpus", "synthetic_kb",
                                 "--port", str(port), "--log-level", "critical"],
                                env=env, capture_output=True, text=True, timeout=300)
    assert "index over 60 passages ready" in result.stderr, result.stderr[-2000:]
    assert result.returncode == 1 and "cannot serve" in result.stderr


def test_cli_missing_corpus_is_one_clear_line(tmp_path, capsys):
    import argparse

    from masrl.retrieval.cli import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["serve-retriever", "--corpus", str(tmp_path / "nope.jsonl")])
    assert args.func(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: corpus file not found") and "\n" not in err


class _FlakyRetriever:
    """Fails its first call (the server answers 500), then works."""

    def __init__(self):
        self.calls = 0

    def search(self, queries, topk):
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("transient failure")
        return [[Passage("1", "T", "ok", 1.0)] for _ in queries]


def test_http_retriever_retries_server_errors():
    flaky = _FlakyRetriever()
    with BackgroundServer(flaky) as srv:
        wait_until_answers(srv.url)
        client = HttpRetriever(srv.url, retries=2, backoff=0.01)
        assert client.search(["q"], 1)[0][0].text == "ok"
        assert flaky.calls == 2


from hypothesis import given, settings
from hypothesis import strategies as st

from masrl.retrieval.server import _BadRequest, parse_retrieve_request

_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                     max_leaves=12)
_requests = st.fixed_dictionaries({}, optional={"queries": _json | st.lists(st.text(), max_size=6),
                                                "topk": _json, "return_scores": _json})


@settings(max_examples=300, deadline=None)
@given(body=st.one_of(st.binary(max_size=64), _json.map(lambda v: json.dumps(v).encode()),
                      _requests.map(lambda v: json.dumps(v).encode())))
def test_request_parser_accepts_or_refuses_with_4xx(body):
    try:
        queries, topk, return_scores = parse_retrieve_request(body, LIMITS)
    except _BadRequest as e:
        assert 400 <= e.status < 500 and e.message
        return
    assert all(isinstance(q, str) and len(q) <= LIMITS.max_query_chars for q in queries)
    assert len(queries) <= LIMITS.max_queries and 1 <= topk <= LIMITS.max_topk
    assert isinstance(return_scores, bool)


# ------------------------------------------------------------------ hostile clients (raw sockets: what httpx won't send)

def _raw(server, data: bytes, timeout: float = 10.0) -> tuple[int, dict]:
    """Send raw bytes, read the reply until the server closes; (status, JSON body). Never half-closes."""
    with socket.create_connection((server.host, server.port), timeout=timeout) as s:
        try:
            s.sendall(data)
        except ConnectionResetError:  # the server answered early and closed; the reply is still readable
            pass
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def _request(method: str, path: str, body: bytes = b"", headers: str = "") -> bytes:
    return (f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{headers}"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


@pytest.mark.parametrize("content", [
    b'{"queries": ["alpha"], "topk": 1' + b"0" * 5000 + b"}",  # an integer Python refuses to convert
    b'{"queries": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",  # nesting deeper than the JSON parser recurses
    b'{"queries": ["alpha"], "topk": ' + b"-" * 10 + b"1}",
    b"\xef\xbb\xbf\xff\xfe",
], ids=["int_over_4300_digits", "nested_100k_deep", "dashes", "bom_then_garbage"])
def test_every_malformed_json_is_a_400_not_a_500(server, content):
    r = post(server, content=content)
    assert r.status_code == 400, r.text
    assert r.json()["error"].startswith("malformed JSON")


@pytest.mark.parametrize("method,path,status", [("GET", "/retrieve", 405), ("PUT", "/retrieve", 405),
                                                ("DELETE", "/health", 405), ("GET", "/nope", 404),
                                                ("POST", "/retrieve/../etc/passwd", 404)])
def test_wrong_method_or_path_is_a_json_error_naming_the_api(server, method, path, status):
    code, body = _raw(server, _request(method, path))
    assert code == status
    assert set(body) == {"error"} and "POST /retrieve" in body["error"] and method in body["error"]


@pytest.fixture(scope="module")
def small_server():
    limits = ServerLimits(max_body_bytes=1000, body_timeout_s=1.0)
    with BackgroundServer(BM25Retriever(PASSAGES), limits) as srv:
        wait_until_answers(srv.url)
        yield srv


def _chunked(payload: bytes, chunk: int = 400) -> bytes:
    parts = [b"%x\r\n%s\r\n" % (len(payload[i:i + chunk]), payload[i:i + chunk]) for i in range(0, len(payload), chunk)]
    return (b"POST /retrieve HTTP/1.1\r\nHost: x\r\nConnection: close\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"".join(parts) + b"0\r\n\r\n")


@pytest.mark.parametrize("how", ["declared", "chunked", "declared_then_nothing"])
def test_body_over_the_limit_is_refused_before_it_is_held(small_server, how):
    big = json.dumps({"queries": ["x" * 5000]}).encode()
    if how == "declared":
        data = _request("POST", "/retrieve", big)
    elif how == "chunked":
        data = _chunked(big)
    else:  # a Content-Length of 1 GB and one byte: answered at once, not after waiting for the rest
        data = b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000\r\n\r\n{"
    start = time.monotonic()
    code, body = _raw(small_server, data, timeout=5)
    assert code == 413 and "exceeds 1000" in body["error"]
    assert time.monotonic() - start < 0.9  # before the body timeout: refused, not timed out
    assert post(small_server, {"queries": ["Topic alpha"], "topk": 1}).json()["result"][0][0]["id"] == "0"


def test_chunked_body_under_the_limit_is_served(small_server):
    code, body = _raw(small_server, _chunked(json.dumps({"queries": ["Topic golf"], "topk": 1}).encode(), chunk=7))
    assert code == 200 and body["result"][0][0]["id"] == "6"


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records = []

    def emit(self, record):
        self.records.append(record)


def test_slow_clients_time_out_and_do_not_block_others(small_server):
    logged = _Records()
    logging.getLogger("uvicorn.error").addHandler(logged)  # where uvicorn logs an application's exception
    slow = [socket.create_connection((small_server.host, small_server.port)) for _ in range(20)]
    try:
        for s in slow:  # headers promise 100 bytes; one arrives
            s.sendall(b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        start = time.monotonic()
        assert post(small_server, {"queries": ["Topic hotel"], "topk": 1}).json()["result"][0][0]["id"] == "7"
        assert time.monotonic() - start < 0.9  # served while the 20 slow bodies are pending
        slow[0].settimeout(10)
        reply = b""
        while chunk := slow[0].recv(65536):  # the head and the body may come in separate reads; it closes
            reply += chunk
        assert b" 408 " in reply.split(b"\r\n")[0] and b"did not arrive within 1 s" in reply
    finally:
        for s in slow[1:]:  # these hang up mid-body: dropped without a logged traceback
            s.close()
        slow[0].close()
    deadline = time.monotonic() + 5.0  # every hang-up handled (and any traceback of it logged) before the checks
    while _open(small_server._server.guard):
        assert time.monotonic() < deadline, "the server still counts a slow client's connection open after 5 s"
        time.sleep(0.01)
    assert post(small_server, {"queries": ["Topic alpha"], "topk": 1}).status_code == 200
    logging.getLogger("uvicorn.error").removeHandler(logged)
    assert not [r for r in logged.records if r.exc_info], [r.getMessage() for r in logged.records]


@pytest.mark.parametrize("field,value", [("max_topk", 0), ("max_queries", -1), ("max_body_bytes", 1.5),
                                         ("body_timeout_s", float("nan")), ("max_connections", True),
                                         ("max_connections_per_client", 0), ("header_timeout_s", 0),
                                         ("header_timeout_s", float("inf"))])
def test_server_limits_refuse_nonsense(field, value):
    with pytest.raises(ValueError, match=field):
        ServerLimits(**{field: value})


# Below the app: request-head timeout, connection limits, JSON errors for malformed HTTP.

HEAD_LIMITS = ServerLimits(header_timeout_s=1.0, body_timeout_s=1.0)  # default connection limits (256, 128 per client)


@pytest.fixture(scope="module")
def head_server():
    with BackgroundServer(BM25Retriever(PASSAGES), HEAD_LIMITS) as srv:
        wait_until_answers(srv.url)
        yield srv


def _stall(server, data: bytes = b"GET /hea") -> socket.socket:
    s = socket.create_connection((server.host, server.port))
    s.sendall(data)
    return s


def _until_closed(socks: list[socket.socket], timeout: float) -> dict[socket.socket, tuple[float, bytes]]:
    """Read every socket until the server closes it (or ``timeout`` passes): {socket: (monotonic close time, reply)}."""
    import selectors

    replies, closed = {s: b"" for s in socks}, {}
    with selectors.DefaultSelector() as sel:
        for s in socks:
            sel.register(s, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        while len(closed) < len(socks) and time.monotonic() < deadline:
            for key, _ in sel.select(timeout=max(0.0, deadline - time.monotonic())):
                try:
                    chunk = key.fileobj.recv(65536)
                except ConnectionResetError:
                    chunk = b""
                replies[key.fileobj] += chunk
                if not chunk:
                    closed[key.fileobj] = (time.monotonic(), replies[key.fileobj])
                    sel.unregister(key.fileobj)
    return closed


def _status_and_error(reply: bytes) -> tuple[int, str]:
    head, _, body = reply.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower(), reply
    return int(head.split()[1]), json.loads(body)["error"]


def test_half_sent_request_lines_cannot_hold_health(head_server):
    start = time.monotonic()
    stalled = [_stall(head_server) for _ in range(300)]  # more than max_connections, all from 127.0.0.1
    try:
        asked = time.monotonic()
        health = httpx.get(head_server.url + "/health", timeout=5.0)
        assert health.status_code == 200 and health.json()["status"] == "ok", health.text
        assert time.monotonic() - asked < 0.9  # served at once, not after the stalled heads time out
        closed = _until_closed(stalled, timeout=5.0)
        assert len(closed) == len(stalled)  # every stalled connection is closed by the server
        statuses = {}
        for at, reply in closed.values():
            status, error = _status_and_error(reply)
            statuses[status] = statuses.get(status, 0) + 1
            if status == 408:  # kept until the head timeout, then closed
                assert at - start >= 0.95 and "did not arrive within 1 s" in error
            else:  # closed to make room for newer connections
                assert status == 503 and "closed to make room" in error and "limit of 128" in error
        assert statuses.get(408, 0) >= 100 and statuses.get(503, 0) >= 100, statuses
    finally:
        for s in stalled:
            s.close()
    assert httpx.get(head_server.url + "/health", timeout=5.0).status_code == 200


def test_a_dripping_head_times_out_from_its_start(head_server):
    s = _stall(head_server, b"G")
    try:
        start = time.monotonic()
        reply = drip(s, b"ET /health HTTP/1.1\r\n", 0.25)  # one byte every 0.25 s: never a whole head within 1 s
        assert 0.9 <= time.monotonic() - start < 1.6
        assert _status_and_error(reply)[0] == 408
    finally:
        s.close()


def test_a_keep_alive_connection_with_half_a_second_request_is_closed(head_server):
    s = _stall(head_server, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    try:
        s.settimeout(5)
        first = s.recv(65536)
        assert b" 200 " in first.split(b"\r\n")[0]
        s.sendall(b"GET /hea")  # the next request head never completes
        start = time.monotonic()
        closed = _until_closed([s], timeout=4.0)
        assert s in closed, "the stalled keep-alive connection stayed open"
        at, reply = closed[s]
        assert 0.9 <= at - start < 2.0 and _status_and_error(reply)[0] == 408
    finally:
        s.close()


def _open(guard) -> int:
    """Connections the guard counts open (read from the test's thread: retried if the server's loop changes the
    sets meanwhile)."""
    while True:
        try:
            return sum(len(c) for c in list(guard.per_peer.values()))
        except RuntimeError:
            continue


def _serving(guard) -> int:
    """Connections the guard counts open and not waiting for a request head."""
    return _open(guard) - len(guard.waiting)


@pytest.mark.parametrize("limits,needle", [
    (ServerLimits(max_connections_per_client=2, body_timeout_s=5.0), "the limit per client is 2"),
    (ServerLimits(max_connections=2, body_timeout_s=5.0), "the server limit is 2")])
def test_connections_over_the_limit_while_all_serve_are_refused(limits, needle):
    with BackgroundServer(BM25Retriever(PASSAGES), limits) as srv:
        wait_until_answers(srv.url)
        busy = [_stall(srv, b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{") for _ in range(2)]
        try:
            deadline = time.monotonic() + 4.0  # both heads are in: these two are serving (their bodies are awaited)
            while _serving(srv._server.guard) < 2:
                assert time.monotonic() < deadline, "the two request heads were not read within 4 s"
                time.sleep(0.01)
            extra = _stall(srv, b"")
            closed = _until_closed([extra], timeout=4.0)  # refused at once, before the body timeout frees one
            extra.close()
            assert extra in closed
            status, error = _status_and_error(closed[extra][1])
            assert status == 503 and needle in error and "retry when one finishes" in error
        finally:
            for s in busy:
                s.close()
        deadline = time.monotonic() + 5
        while (r := httpx.get(srv.url + "/health", timeout=5.0)).status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.05)  # the server notices the closed connections
        assert r.status_code == 200


def test_malformed_http_is_a_json_400(head_server):
    code, body = _raw(head_server, b"NOT HTTP AT ALL\x00\r\n\r\n", timeout=5)
    assert code == 400 and body["error"].startswith("malformed HTTP request") and "POST /retrieve" in body["error"]
