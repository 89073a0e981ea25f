"""``masrl serve RUN --team`` on masrl's HTTP service (docs/harnesses.md): one request = one episode, ``usage``
over every agent, ``--api-key``; and the HTTP conduct the gateway has (tests/test_gateway_http.py): JSON 405 / 404
for every method and route, a chunked body answered once, client hang-ups with nothing on stderr, a malformed
body a JSON 400 naming the field (a port in use: tests/test_gateway_http.py). The team is a scripted runner (no
model): what is tested is the server."""
from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
import time
from argparse import Namespace
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi", reason="the team server runs on the server extra: pip install masrl[server]")

from conftest import hang_up, route_answer, two_requests  # noqa: E402
from masrl import serve_team  # noqa: E402
from masrl.types import Episode, Turn  # noqa: E402


class _Runner:
    """What ``TeamServer`` needs of a ``TeamRunner``: ``cfg`` and ``rollout``. Each episode has two agents' turns;
    its answer names the question and the temperature."""

    def __init__(self, delay_s: float = 0.0):
        self.cfg = SimpleNamespace(name="my-team", seed=0, eval=SimpleNamespace(temperature=0.7),
                                   workflow=SimpleNamespace(name="scripted"))
        self.delay_s, self.batches = delay_s, []

    def rollout(self, tasks, group_ids, *, temperature, seed, score, where):
        time.sleep(self.delay_s)
        self.batches.append(len(tasks))
        return [Episode(task=t, reward=0.0, answer=f"{t.question} @ {temperature:g}",
                        turns=[Turn(agent="Solver", policy="p", prompt_ids=[1, 2, 3], response_ids=[4, 5],
                                    logprobs=[-1.0, -1.0], text="s", prompt_text=t.question),
                               Turn(agent="Verifier", policy="p", prompt_ids=[1] * 7, response_ids=[6],
                                    logprobs=[-1.0], text="v")])
                for t in tasks]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(runner, **flags) -> tuple[str, int]:
    """``run_team`` for ``runner`` in a thread of its own (it serves for 30 s); the address it listens on."""
    args = Namespace(host="127.0.0.1", port=_free_port(), api_key=None, batch_window_ms=5.0, debug_turns=False,
                     max_seconds=time.monotonic() + 30)
    vars(args).update(flags)
    sock = serve_team.bind(args)
    threading.Thread(target=serve_team.run_team, args=(args, runner, "a scripted team", sock), daemon=True).start()
    deadline = time.monotonic() + 10
    while True:  # the socket listens at once; the app may take a moment to answer
        try:
            conn = http.client.HTTPConnection("127.0.0.1", args.port, timeout=10)
            conn.request("GET", "/v1/models", headers={"Authorization": f"Bearer {args.api_key}"})
            conn.getresponse().read()
            conn.close()
            return "127.0.0.1", args.port
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@pytest.fixture
def team():
    return _serve(_Runner())


def _post(address, path: str, body, headers=None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection(*address, timeout=10)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    response = conn.getresponse()
    status, payload = response.status, json.loads(response.read())
    conn.close()
    return status, payload


def test_one_request_is_one_episode_with_every_agents_tokens():
    address = _serve(_Runner(), debug_turns=True, api_key="secret")
    auth = {"Authorization": "Bearer secret"}
    status, reply = _post(address, "/v1/chat/completions", {"model": "my-team", "temperature": 0, "messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "2+3?"}]}, auth)
    assert status == 200 and reply["model"] == "my-team" and reply["object"] == "chat.completion"
    assert reply["choices"][0]["message"]["content"] == "2+3? @ 0"
    assert reply["usage"] == {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}
    assert [t["agent"] for t in reply["masrl"]["turns"]] == ["Solver", "Verifier"]
    status, reply = _post(address, "/v1/completions", {"model": "my-team", "prompt": ["4+4?"]}, auth)
    assert status == 200 and reply["choices"][0]["text"] == "4+4? @ 0.7"  # eval.temperature without one
    status, reply = _post(address, "/v1/completions", {"model": "my-team", "prompt": "1?"}, {"Authorization": "x"})
    assert status == 401 and reply["error"]["type"] == "authentication_error"


@pytest.mark.parametrize("method,path,status,allow", [
    ("PUT", "/v1/chat/completions", 405, "POST"), ("DELETE", "/v1/chat/completions", 405, "POST"),
    ("PATCH", "/v1/completions", 405, "POST"), ("OPTIONS", "/v1/chat/completions", 405, "POST"),
    ("POST", "/v1/models", 405, "GET"), ("GET", "/nowhere", 404, None), ("POST", "/v1/embeddings", 404, None),
    ("PUT", "/v2/x", 404, None)])
def test_every_method_and_route_is_answered_in_json(team, method, path, status, allow):
    code, response, body = route_answer(team, method, path)
    assert code == status
    assert response.getheader("content-type") == "application/json"
    assert response.getheader("allow") == allow
    error = json.loads(body)["error"]
    assert error["code"] == ("method_not_allowed" if status == 405 else "not_found")
    assert "POST /v1/chat/completions" in error["message"]


def test_a_chunked_body_is_decoded_and_answered_once(team):
    body = json.dumps({"model": "my-team", "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}).encode()
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 7]), body[i:i + 7]) for i in range(0, len(body), 7))
    first, second, stray = two_requests(
        team, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n", b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
    assert first[0] == 200, first
    assert json.loads(first[2])["choices"][0]["message"]["content"] == "hi @ 0"
    assert second[0] == 200 and json.loads(second[2])["data"][0]["id"] == "my-team"
    assert stray == b""


@pytest.mark.parametrize("body,param", [
    ({"messages": "hi"}, "messages"), ({"messages": [{"role": "assistant", "content": "x"}]}, "messages"),
    ({"prompt": 3}, "prompt"), ({"messages": [{"role": "user", "content": "q"}], "temperature": -1}, "temperature"),
    ({"messages": [{"role": "user", "content": "q"}], "temperature": "hot"}, "temperature"),
    ({"prompt": "q", "stream": True}, "stream"), (b"{not json", None), (b"[" * 100000, None), (b"\xff\xfe", None),
    (b"[1, 2]", None)], ids=["messages-str", "no-user", "prompt-int", "temperature-neg", "temperature-str", "stream",
                             "not-json", "deep", "not-utf8", "array"])
def test_a_malformed_body_is_a_json_400_naming_the_field(team, body, param):
    path = "/v1/completions" if isinstance(body, dict) and "prompt" in body else "/v1/chat/completions"
    status, reply = _post(team, path, body)
    assert status == 400, reply
    assert reply["error"]["type"] == "invalid_request_error" and reply["error"]["param"] == param
    if param is None:
        assert "JSON" in reply["error"]["message"]


def test_client_hang_ups_put_no_traceback_on_stderr(capfd, caplog):
    """Clients that go away (at once, halfway through the head or the body, or after a whole request before its
    episode ends; closed or reset) put nothing on stderr and no log record above debug; the server goes on."""
    caplog.set_level(logging.DEBUG)
    runner = _Runner(delay_s=0.05)  # the answers come after their clients have gone
    address = _serve(runner)
    body = json.dumps({"model": "my-team", "messages": [{"role": "user", "content": "hi"}]}).encode()
    whole = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    for _ in range(4):
        for request in (b"", b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nCont", whole[:-10], whole):
            for reset in (False, True):
                hang_up(address, request, reset)
    time.sleep(0.8)
    assert _post(address, "/v1/chat/completions", body)[0] == 200  # still serving
    assert sum(runner.batches) >= 5  # the whole requests whose clients closed, and the last one
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Error" not in err, err[-3000:]
    loud = [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno > logging.DEBUG or r.exc_info]
    assert loud == []
