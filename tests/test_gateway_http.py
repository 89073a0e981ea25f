"""The gateway's HTTP conduct (docs/gateway.md, "Limits"): a deadline on the whole request head, JSON errors for
every method and route, chunked bodies decoded with one answer per request, client hang-ups that put nothing on
stderr, IPv6 where asked (or one clear line), a bind failure that names the setting the user gave, and every
message field checked before anything is rendered."""
from __future__ import annotations

import asyncio
import http.client
import json
import socket
import time

import pytest

pytest.importorskip("fastapi", reason="the gateway runs on the server extra: pip install masrl[server]")

from conftest import hang_up, route_answer, two_requests  # noqa: E402
from masrl.errors import UserInputError  # noqa: E402
from masrl.gateway import Gateway  # noqa: E402
from masrl.types import Task, Turn  # noqa: E402
from masrl.workflows.base import Team, WorkflowSpec  # noqa: E402

class _Echo:
    """A team.call backend that records the prompts it was given."""

    def __init__(self):
        self.prompts = []

    async def __call__(self, agent, prompt):
        self.prompts.append(prompt)
        return Turn(agent=agent, policy="p", prompt_ids=[1, 2], response_ids=[3], logprobs=[-0.5], text="ok",
                    prompt_text=str(prompt))


def _team(backend):
    async def fn(task, team):
        raise AssertionError

    return Team(Task(id="t", question="q", answer=""), WorkflowSpec("external", fn, ("Planner",), {}), backend,
                lambda t, a: {"reward": 0.0})


def _drive(gateway, team, client_fn):
    async def main():
        session = gateway.open(team)
        try:
            return await asyncio.to_thread(client_fn, session)
        finally:
            gateway.close(session)

    return asyncio.run(main())


def _address(gw) -> tuple[str, int]:
    host, port = gw.url.split("//", 1)[1].rsplit(":", 1)
    return host.strip("[]"), int(port)


@pytest.fixture
def gateway():
    gw = Gateway()
    yield gw
    gw.shutdown()


def test_a_trickled_request_head_is_closed_at_the_deadline():
    """The deadline is on the whole head, not per read: one header byte every 0.2 s keeps every read short, and
    the connection is still answered 408 and closed at the 1 s deadline."""
    from masrl.gateway import GatewayLimits

    gateway = Gateway(limits=GatewayLimits(header_timeout_s=1.0))
    sock = socket.create_connection(_address(gateway), timeout=10)
    start = time.monotonic()
    sock.sendall(b"GET /v1/models HTTP/1.1\r\n")
    answer = b""
    try:
        for byte in b"X-Slow: " + b"a" * 60:
            sock.sendall(bytes([byte]))
            time.sleep(0.2)
            if time.monotonic() - start > 6:
                break
    except (BrokenPipeError, ConnectionResetError):
        pass
    try:
        while chunk := sock.recv(4096):
            answer += chunk
    except (ConnectionResetError, socket.timeout):
        pass
    elapsed = time.monotonic() - start
    sock.close()
    gateway.shutdown()
    assert elapsed < 4, f"still open after {elapsed:.1f} s"
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    error = json.loads(answer.partition(b"\r\n\r\n")[2])["error"]
    assert error["code"] == "request_timeout" and "1 s" in error["message"]


@pytest.mark.parametrize("method,path,status,allow", [
    ("PUT", "/v1/chat/completions", 405, "POST"), ("DELETE", "/v1/chat/completions", 405, "POST"),
    ("PATCH", "/v1/completions", 405, "POST"), ("OPTIONS", "/v1/chat/completions", 405, "POST"),
    ("HEAD", "/v1/models", 405, "GET"), ("GET", "/v1/chat/completions", 405, "POST"),
    ("POST", "/v1/models", 405, "GET"), ("DELETE", "/e/k/v1/models", 405, "GET"),
    ("GET", "/nowhere", 404, None), ("POST", "/v1/embeddings", 404, None), ("PUT", "/e/k/v2/x", 404, None)])
def test_every_method_and_route_is_answered_in_json(gateway, method, path, status, allow):
    code, response, body = route_answer(_address(gateway), method, path)
    assert code == status
    assert response.getheader("content-type") == "application/json"
    assert response.getheader("allow") == allow
    if method != "HEAD":  # a HEAD answer has no body
        error = json.loads(body)["error"]
        assert error["code"] == ("method_not_allowed" if status == 405 else "not_found")
        assert "POST /v1/chat/completions" in error["message"]


def test_a_chunked_body_is_decoded_and_answered_once(gateway):
    """A ``Transfer-Encoding: chunked`` request is served like any other, and the connection carries exactly one
    answer per request (the next request on it is served too)."""
    backend = _Echo()

    def client(session):
        body = json.dumps({"model": "Planner", "messages": [{"role": "user", "content": "hi"}]}).encode()
        chunks = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 7]), body[i:i + 7]) for i in range(0, len(body), 7))
        path = session.base_url.split("//", 1)[1].split("/", 1)[1]
        return two_requests(_address(gateway), f"POST /{path}/chat/completions HTTP/1.1\r\nHost: x\r\n"
                            f"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
                            + chunks + b"0\r\n\r\n", f"GET /{path}/models HTTP/1.1\r\nHost: x\r\n\r\n".encode())

    first, second, stray = _drive(gateway, _team(backend), client)
    assert first[0] == 200, first
    assert json.loads(first[2])["choices"][0]["message"]["content"] == "ok"
    assert backend.prompts[0].messages == [{"role": "user", "content": "hi"}]
    assert second[0] == 200 and json.loads(second[2])["data"][0]["id"] == "Planner"
    assert stray == b""


class _Slow:
    agents = ("Planner",)

    async def call(self, agent, prompt):
        await asyncio.sleep(0.3)  # the answer comes after the client has gone
        return Turn(agent=agent, policy="p", prompt_ids=[1], response_ids=[2], logprobs=[-1.0], text="ok")


def test_client_hang_ups_put_no_traceback_on_stderr(capfd, caplog):
    """Clients that connect and go away (at once, halfway through the head or the body, or after a whole request
    before its answer; closed or reset) are the server's debug log: nothing on stderr, no log record above debug
    from any logger (uncaptured, those would be printed on the run's stderr)."""
    import logging
    import threading

    from masrl.gateway import EpisodeSession

    caplog.set_level(logging.DEBUG)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    gw = Gateway()
    gw.default = EpisodeSession(_Slow(), loop, key="", base_url=gw.url + "/v1", standing=True)
    try:
        body = json.dumps({"model": "Planner", "messages": [{"role": "user", "content": "hi"}]}).encode()
        whole = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        requests = [b"", b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nCont", whole[:-10], whole]
        for _ in range(8):
            for request in requests:
                for reset in (False, True):
                    hang_up(_address(gw), request, reset)
        time.sleep(0.8)  # the answers to the whole requests are written after their clients left
        conn = http.client.HTTPConnection(*_address(gw), timeout=10)
        conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
        assert conn.getresponse().status == 200  # still serving
        conn.close()
    finally:
        gw.shutdown()
        loop.call_soon_threadsafe(loop.stop)
    assert gw.default.calls >= 9  # at least the calls whose clients closed (not reset), and the last one
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception" not in err, err[-3000:]
    loud = [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno > logging.DEBUG or r.exc_info]
    assert loud == []
    assert any("hung up" in r.getMessage() for r in caplog.records if r.name == "masrl.http")


def _has_ipv6() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _has_ipv6(), reason="this machine has no IPv6 loopback")
def test_an_ipv6_host_is_served():
    gw = Gateway("::1", 0)
    try:
        assert gw.url.startswith("http://[::1]:")
        conn = http.client.HTTPConnection("::1", _address(gw)[1], timeout=10)
        conn.request("GET", "/v1/models")
        response = conn.getresponse()
        assert response.status == 401 and json.loads(response.read())["error"]["code"] == "invalid_api_key"
        conn.close()
    finally:
        gw.shutdown()


def test_an_address_that_cannot_be_bound_is_one_line_naming_the_setting(monkeypatch):
    """A port in use names the setting the user gave (``--port`` for masrl serve); a machine without IPv6 refuses
    an IPv6 host at start, in one line."""
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    try:
        with pytest.raises(UserInputError) as e:
            Gateway("127.0.0.1", busy.getsockname()[1], host_setting="--host", port_setting="--port")
    finally:
        busy.close()
    assert "set --port to a free port" in str(e.value) and "workflow.params" not in str(e.value)
    assert "\n" not in str(e.value)

    import masrl.http.server as http_server

    real = socket.socket

    def no_ipv6(family=socket.AF_INET, *args, **kwargs):
        if family == socket.AF_INET6:
            raise OSError(97, "Address family not supported by protocol")
        return real(family, *args, **kwargs)

    monkeypatch.setattr(http_server.socket, "socket", no_ipv6)
    with pytest.raises(UserInputError, match=r"this machine has no IPv6 .*set --host to 127\.0\.0\.1"):
        Gateway("::1", 0, host_setting="--host", port_setting="--port")


BAD_MESSAGES = [  # (an assistant message or a message list, the param named)
    ({"role": "assistant", "content": "x", "tool_calls": "call add(2, 3)"}, "messages[1].tool_calls"),
    ({"role": "assistant", "content": "x", "tool_calls": {"id": "c", "type": "function"}}, "messages[1].tool_calls"),
    ({"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
                                                            "function": {"name": "add", "arguments": {"a": 1}}}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"role": "assistant", "content": None, "tool_calls": [{"type": "function",
                                                            "function": {"name": "add", "arguments": "{}"}}]},
     "messages[1].tool_calls[0].id"),
    ({"role": "assistant", "content": None, "tool_calls": ["add"]}, "messages[1].tool_calls[0]"),
    ({"role": "assistant", "content": "x", "name": 7}, "messages[1].name"),
    ({"role": "assistant", "content": "x", "function_call": {"name": "add", "arguments": "{}"}},
     "messages[1].function_call"),
    ({"role": "assistant", "content": "x", "weird": 1}, "messages[1].weird"),
    ({"role": "user", "content": "x", "tool_calls": []}, "messages[1].tool_calls"),
    ({"role": "tool", "content": "5", "tool_call_id": 3}, "messages[1].tool_call_id"),
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, "messages[1].content"),
]


def test_every_message_field_is_checked_before_anything_is_rendered(gateway):
    """A malformed field of any message (tool_calls a string or a dict, an argument object, a missing id, a name
    that is no string, an unknown field, ...) is a 400 naming it: nothing is rendered, generated or trained on.
    Fields sent as null count as absent, and a well-formed tool-call conversation is served."""
    import openai

    backend = _Echo()
    team = _team(backend)

    def client(session):
        c = openai.OpenAI(**session.client_kwargs, max_retries=0)
        refused = []
        for message, _ in BAD_MESSAGES:
            try:
                c.chat.completions.create(model="Planner", messages=[{"role": "user", "content": "2+3?"}, message])
            except openai.BadRequestError as e:
                refused.append(e.body["param"])
            else:
                refused.append(None)
        good = [{"role": "user", "content": "2+3?", "name": None},
                {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 2}"}}]},
                {"role": "tool", "content": "5", "tool_call_id": "call_1"}]
        reply = c.chat.completions.create(model="Planner", messages=good)
        return refused, reply

    refused, reply = _drive(gateway, team, client)
    assert refused == [param for _, param in BAD_MESSAGES]
    assert reply.choices[0].message.content == "ok" and len(backend.prompts) == 1 and len(team.turns) == 1
    assert backend.prompts[0].messages[0] == {"role": "user", "content": "2+3?"}
    assert backend.prompts[0].messages[1]["tool_calls"][0]["function"]["name"] == "add"


@pytest.mark.parametrize("team", [[], ["--team"]], ids=["agents", "team"])
def test_masrl_serve_on_a_port_in_use_names_the_flag_before_loading(tiny_cfg, tmp_path, capsys, team):
    """``masrl serve [--team] --port N`` with N taken: exit 2 and one line that names ``--port`` (the flag the user
    gave, not the workflow's setting), said before any model is loaded."""
    import yaml

    from masrl.cli import main

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(tiny_cfg()))
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    try:
        start = time.monotonic()
        assert main(["serve", str(run), *team, "--port", str(busy.getsockname()[1])]) == 2
    finally:
        busy.close()
    err = capsys.readouterr().err.strip()
    assert "set --port to a free port" in err and "workflow.params" not in err and len(err.splitlines()) == 1
    assert time.monotonic() - start < 10
