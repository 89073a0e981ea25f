"""The OpenAI-compatible gateway (masrl.gateway) and the external workflow: the official openai client against a
live episode, agent routing by `model`, recorded turns, id extension across a conversation, OpenAI error shapes,
and a training run of an unchanged OpenAI-API program (entry function and subprocess)."""
import asyncio
import json
import sys
import textwrap
import urllib.error
import urllib.request

import pytest

from masrl.gateway import Gateway
from masrl.types import Task, Turn
from masrl.workflows.base import Team, WorkflowSpec

openai = pytest.importorskip("openai")


def _spec(agents=("Planner", "Writer")):
    async def fn(task, team):  # never run: the tests drive the team through the gateway
        raise AssertionError

    return WorkflowSpec("external", fn, tuple(agents), {})


class _Scripted:
    """A team.call backend: the reply names the agent and counts calls; ids are made up but consistent."""

    def __init__(self):
        self.prompts = []

    async def __call__(self, agent, prompt):
        self.prompts.append(prompt)
        n = len(self.prompts)
        text = f"{agent} reply {n}"
        return Turn(agent=agent, policy="p", prompt_ids=[1, 2, 3 + n], response_ids=[7, 8, n], logprobs=[-0.5, -0.25, -1.0],
                    text=text, prompt_text=str(prompt))


def _drive(gateway, team, client_fn):
    """Open a session for ``team`` on the running loop and run ``client_fn(session)`` in a thread."""
    async def main():
        session = gateway.open(team)
        try:
            return session, await asyncio.to_thread(client_fn, session)
        finally:
            gateway.close(session)

    return asyncio.run(main())


@pytest.fixture
def gateway():
    gw = Gateway()
    yield gw
    gw.shutdown()


def test_chat_completions_with_the_openai_client_are_recorded_turns(gateway):
    backend = _Scripted()
    team = Team(Task(id="t", question="q", answer=""), _spec(), backend, lambda t, a: {"reward": 0.0})

    def client(session):
        c = openai.OpenAI(**session.client_kwargs)
        models = [m.id for m in c.models.list()]
        first = c.chat.completions.create(model="Planner", messages=[{"role": "user", "content": "plan it"}],
                                          logprobs=True)
        second = c.chat.completions.create(model="Writer", n=2, messages=[
            {"role": "system", "content": "you write"}, {"role": "user", "content": first.choices[0].message.content}])
        return models, first, second

    session, (models, first, second) = _drive(gateway, team, client)
    assert models == ["Planner", "Writer"]
    assert first.model == "Planner" and first.choices[0].message.content == "Planner reply 1"
    assert [t.logprob for t in first.choices[0].logprobs.content] == [-0.5, -0.25, -1.0]
    assert [t.token for t in first.choices[0].logprobs.content] == ["token_id:7", "token_id:8", "token_id:1"]
    assert first.usage.prompt_tokens == 3 and first.usage.completion_tokens == 3
    assert len(second.choices) == 2 and {c.message.content for c in second.choices} == {"Writer reply 2",
                                                                                         "Writer reply 3"}
    assert [t.agent for t in team.turns] == ["Planner", "Writer", "Writer"]  # every call is a turn of its agent
    assert backend.prompts[1].messages[0] == {"role": "system", "content": "you write"}
    assert session.calls == 3


def test_a_continued_conversation_extends_the_previous_call_ids(gateway):
    backend = _Scripted()
    team = Team(Task(id="t", question="q", answer=""), _spec(), backend, lambda t, a: {"reward": 0.0})

    def client(session):
        c = openai.OpenAI(**session.client_kwargs)
        msgs = [{"role": "user", "content": "step 1"}]
        r1 = c.chat.completions.create(model="Planner", messages=msgs)
        msgs += [{"role": "assistant", "content": r1.choices[0].message.content}, {"role": "user", "content": "go on"}]
        c.chat.completions.create(model="Planner", messages=msgs)
        edited = [msgs[0], {"role": "assistant", "content": "something else"}, msgs[2]]
        c.chat.completions.create(model="Planner", messages=edited)  # not a continuation: rendered afresh

    _drive(gateway, team, client)
    first, second, third = backend.prompts
    assert first.prefix is None and third.prefix is None
    assert second.prefix.n_messages == 1 and second.prefix.prompt_ids == [1, 2, 4]
    assert second.prefix.response_ids == [7, 8, 1]


def test_errors_have_openai_shapes(gateway):
    team = Team(Task(id="t", question="q", answer=""), _spec(), _Scripted(), lambda t, a: {"reward": 0.0})

    def client(session):
        c = openai.OpenAI(**session.client_kwargs, max_retries=0)
        out = {}
        try:
            c.chat.completions.create(model="Nobody", messages=[{"role": "user", "content": "x"}])
        except openai.NotFoundError as e:
            out["unknown_agent"] = e.body
        try:
            c.chat.completions.create(model="Planner", messages=[])
        except openai.BadRequestError as e:
            out["no_messages"] = e.body
        bad = openai.OpenAI(base_url=session.base_url.split("/e/")[0] + "/v1", api_key="masrl-ep-nope", max_retries=0)
        try:
            bad.chat.completions.create(model="Planner", messages=[{"role": "user", "content": "x"}])
        except openai.AuthenticationError as e:
            out["no_episode"] = e.body
        request = urllib.request.Request(session.base_url + "/chat/completions", data=b"{not json", method="POST")
        try:
            urllib.request.urlopen(request)
        except urllib.error.HTTPError as e:
            out["not_json"] = (e.code, json.loads(e.read()))
        return out

    _, out = _drive(gateway, team, client)
    assert out["unknown_agent"]["code"] == "model_not_found" and "Planner" in out["unknown_agent"]["message"]
    assert out["no_messages"]["param"] == "messages"
    assert out["no_episode"]["code"] == "invalid_api_key"
    assert out["not_json"][0] == 400 and "not JSON" in out["not_json"][1]["error"]["message"]
    assert team.turns == []  # nothing refused became a turn
    assert gateway.refused == 1


AGENT_PROGRAM = '''
import openai


def run(task, client_kwargs):
    """An unchanged OpenAI-API program: a planner and a writer, the writer's reply is the answer."""
    client = openai.OpenAI(**client_kwargs)
    plan = client.chat.completions.create(model="Solver", messages=[{"role": "user", "content": task["question"]}])
    final = client.chat.completions.create(model="Verifier", messages=[
        {"role": "user", "content": task["question"] + " " + plan.choices[0].message.content}])
    return final.choices[0].message.content
'''

COMMAND_PROGRAM = '''
import json, os, sys
import openai

task = json.loads(sys.stdin.readline())
client = openai.OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY from masrl
reply = client.chat.completions.create(model="Solver", messages=[{"role": "user", "content": task["question"]}])
print("some log line")
print(json.dumps({"reward": 1.0 if reply.choices[0].message.content else 0.0, "answer": reply.choices[0].message.content}))
'''


def _external_cfg(tiny_cfg, tmp_path, params):
    return tiny_cfg(**{"workflow": {"name": "external", "params": params}, "sft.steps": 0,
                       "trainer.total_steps": 1, "trainer.batch_size": 2, "trainer.group_size": 2,
                       "eval.before_after": False, "logging.plots": False})


def test_training_an_openai_program_by_entry(tiny_cfg, tmp_path, monkeypatch):
    from masrl.config import config_from_dict
    from masrl.trainer import Trainer

    (tmp_path / "my_agent.py").write_text(AGENT_PROGRAM)
    cfg = config_from_dict(_external_cfg(tiny_cfg, tmp_path, {"entry": f"{tmp_path / 'my_agent.py'}:run",
                                                               "timeout_s": 120}))
    with Trainer(cfg) as trainer:
        episodes = trainer.rollout(trainer.source.train[:2], [0, 1], seed=1)
        assert all([t.agent for t in ep.turns] == ["Solver", "Verifier"] for ep in episodes)
        for ep in episodes:
            for turn in ep.turns:
                assert turn.prompt_ids and len(turn.response_ids) == len(turn.logprobs) > 0
                assert turn.text == trainer.policies["shared"].decode(turn.response_ids)
            assert ep.answer == ep.turns[-1].text  # the program's answer, scored by the task's reward
        trainer.fit()
    rows = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["phase"] == "train"]
    assert len(train) == 1 and train[0]["agent/Solver/num_responses"] > 0 and train[0]["agent/Verifier/num_responses"] > 0


def test_training_an_openai_program_as_a_command(tiny_cfg, tmp_path):
    from masrl.config import config_from_dict
    from masrl.trainer import Trainer

    (tmp_path / "agent_cmd.py").write_text(COMMAND_PROGRAM)
    cfg = config_from_dict(_external_cfg(tiny_cfg, tmp_path, {"command": f"{sys.executable} {tmp_path / 'agent_cmd.py'}",
                                                               "timeout_s": 120}))
    cfg.agents = {"Solver": cfg.agents["Solver"]}
    with Trainer(cfg) as trainer:
        episodes = trainer.rollout(trainer.source.train[:2], [0, 1], seed=1)
    for ep in episodes:
        assert [t.agent for t in ep.turns] == ["Solver"] and ep.info["reward_from"] == "program"
        assert ep.reward == (1.0 if ep.turns[0].text else 0.0) and ep.answer == ep.turns[0].text


def test_program_failures_name_the_reason(tmp_path):
    from masrl.workflows.external import ExternalAgentError, program_episode as _finish

    team = Team(Task(id="t", question="q", answer=""), _spec(), _Scripted(), lambda t, a: {"reward": 1.0})
    with pytest.raises(ExternalAgentError, match="finite number"):
        _finish(team, {"reward": float("nan")}, "prog")
    with pytest.raises(ExternalAgentError, match="expected an answer string"):
        _finish(team, [1, 2], "prog")
    assert _finish(team, "42", "prog").reward == 1.0 and _finish(team, 0.25, "prog").reward == 0.25


@pytest.mark.parametrize("body, reason", [
    ("import sys\nsys.exit(3)\n", "exited with 3"),
    ("import time\ntime.sleep(60)\n", r"did not finish within 1 s \(killed\)"),
    ("print('not json')\n", "last line is not JSON"),
])
def test_a_failing_command_is_an_external_agent_error(tmp_path, body, reason):
    from masrl.workflows.external import ExternalAgentError, _run_command

    (tmp_path / "p.py").write_text(textwrap.dedent(body))

    class _Session:
        base_url, key = "http://127.0.0.1:9/v1", "k"

    with pytest.raises(ExternalAgentError, match=reason):
        asyncio.run(_run_command(f"{sys.executable} {tmp_path / 'p.py'}", Task(id="t", question="q", answer=""),
                                 _Session(), 1.0, {}))


def test_external_needs_one_of_entry_and_command(tiny_cfg, tmp_path):
    from masrl.config import config_from_dict
    from masrl.errors import ConfigError
    from masrl.team_runner import check_team

    with pytest.raises(ConfigError, match="exactly one of"):  # at start (masrl train and masrl config show)
        check_team(config_from_dict(_external_cfg(tiny_cfg, tmp_path, {})))
    spec = check_team(config_from_dict(_external_cfg(tiny_cfg, tmp_path, {"command": "python my_agent.py"})))
    assert spec.agents == ("Solver", "Verifier")
    from masrl.workflows.external import _params

    with pytest.raises(ConfigError, match="exactly one of"):
        _params(Team(Task(id="t", question="q", answer=""), spec, _Scripted(), lambda t, a: {}, params={}))


def test_masrl_serve_a_run_folder(tiny_cfg, tmp_path):
    """Train one step, serve the run, talk to it with the openai client; greedy replies repeat."""
    import subprocess

    import yaml

    from masrl.config import config_from_dict
    from masrl.trainer import Trainer

    cfg = config_from_dict(tiny_cfg(**{"sft.steps": 0, "trainer.total_steps": 1, "trainer.batch_size": 2,
                                       "trainer.group_size": 2, "eval.before_after": False, "logging.plots": False}))
    with Trainer(cfg) as trainer:
        trainer.fit()
    proc = subprocess.Popen([sys.executable, "-m", "masrl", "serve", str(cfg.run_dir), "--port", "0",
                             "--api-key", "k1", "--max-seconds", "120", "agents.Solver.temperature=0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "-> http://" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
        url = line.split("-> ", 1)[1].split(" ", 1)[0]
        client = openai.OpenAI(base_url=url, api_key="k1", max_retries=0)
        messages = [{"role": "user", "content": "Q 2+3=\nS "}]
        a = client.chat.completions.create(model="Solver", messages=messages)
        b = client.chat.completions.create(model="Solver", messages=messages)
        assert a.choices[0].message.content == b.choices[0].message.content
        assert a.usage.completion_tokens > 0
        assert [m.id for m in client.models.list()] == ["Solver", "Verifier"]
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert yaml.safe_load((cfg.run_dir / "config.yaml").read_text())["name"] == "test"


def test_a_failing_program_fails_only_its_episode(tiny_cfg, tmp_path):
    """The rollout isolates an episode whose program raises: invalid with the reason, the others go on."""
    from masrl.config import config_from_dict
    from masrl.trainer import Trainer

    (tmp_path / "flaky.py").write_text(AGENT_PROGRAM + '''

calls = {"n": 0}


def flaky(task, client_kwargs):
    calls["n"] += 1
    if calls["n"] == 1:
        raise RuntimeError("the program broke")
    return run(task, client_kwargs)
''')
    cfg = config_from_dict(_external_cfg(tiny_cfg, tmp_path, {"entry": f"{tmp_path / 'flaky.py'}:flaky",
                                                               "timeout_s": 120}))
    with Trainer(cfg) as trainer:
        episodes = trainer.rollout(trainer.source.train[:3], [0, 1, 2], seed=1)
    failed = [e for e in episodes if e.error]
    assert len(failed) == 1 and "the program broke" in failed[0].error and failed[0].reward == 0.0
    assert all(len(e.turns) == 2 for e in episodes if not e.error)


def test_tool_call_round_trip_and_request_bounds(gateway):
    """A reply with a call comes back as tool_calls; the tool's answer goes into the next prompt as a tool
    message; unknown fields, streaming and n out of range are 400s that make no turn."""
    call_text = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'

    class _Tooly(_Scripted):
        async def __call__(self, agent, prompt):
            turn = await super().__call__(agent, prompt)
            turn.text = call_text if len(self.prompts) == 1 else "5"
            return turn

    backend = _Tooly()
    team = Team(Task(id="t", question="q", answer=""), _spec(), backend, lambda t, a: {"reward": 0.0})
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]

    def client(session):
        c = openai.OpenAI(**session.client_kwargs, max_retries=0)
        msgs = [{"role": "user", "content": "2+3?"}]
        first = c.chat.completions.create(model="Planner", messages=msgs, tools=tools)
        call = first.choices[0].message.tool_calls[0]
        msgs += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "5"}]
        second = c.chat.completions.create(model="Planner", messages=msgs, tools=tools)
        errors = {}
        for name, kwargs in {"unknown": {"extra_body": {"frobnicate": 1}}, "stream": {"extra_body": {"stream": True}},
                             "n": {"n": 99}}.items():
            try:
                c.chat.completions.create(model="Planner", messages=[{"role": "user", "content": "x"}], **kwargs)
            except openai.BadRequestError as e:
                errors[name] = e.body
        return first, call, second, errors

    _, (first, call, second, errors) = _drive(gateway, team, client)
    assert first.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 2, "b": 3}
    assert second.choices[0].message.content == "5" and second.choices[0].finish_reason == "stop"
    assert backend.prompts[1].messages[-1] == {"role": "tool", "content": "5", "tool_call_id": call.id}
    assert backend.prompts[1].prefix is not None  # the call's ids are extended, not re-rendered
    assert backend.prompts[1].tools == tools
    assert errors["unknown"]["code"] == "unknown_parameter" and errors["n"]["param"] == "n"
    assert "stream" in errors["stream"]["message"]
    assert len(team.turns) == 2


def test_a_burst_of_connections_waits_in_the_backlog():
    """Every episode of a rollout may connect at once: with the server not accepting yet (its loop busy), 64
    connections are queued by the kernel (a 5-deep backlog would leave the later ones timing out) and all are
    then answered."""
    import socket
    import time

    import threading

    gw = Gateway()
    socks, busy = [], threading.Event()
    try:  # stop accepting: the connections wait in the backlog while the server's loop is held
        gw.server.loop.call_soon_threadsafe(lambda: (busy.set(), time.sleep(2)))
        assert busy.wait(10), "the gateway's loop never ran the call that holds it"
        for _ in range(64):
            socks.append(socket.create_connection(gw.server.address, timeout=0.5))
        for s in socks:
            s.settimeout(30)
            s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert s.recv(64).startswith(b"HTTP/1.1 401")  # no key: refused, but served
    finally:
        for s in socks:
            s.close()
        gw.shutdown()


def test_invalid_calls_mark_the_named_completions_invalid(gateway):
    """A program's result may list the ids of completions it found malformed: exactly their turns are invalid
    (the format penalty); an id that is not this episode's, or a list of something else, fails the episode."""
    from masrl.workflows.external import ExternalAgentError, program_episode as _finish

    team = Team(Task(id="t", question="q", answer="Writer reply 2"), _spec(), _Scripted(),
                lambda t, a: {"reward": float(a == t.answer), "correct": a == t.answer})

    def client(session):
        c = openai.OpenAI(**session.client_kwargs, max_retries=0)
        return [c.chat.completions.create(model=m, messages=[{"role": "user", "content": "x"}]).id
                for m in ("Planner", "Writer")]

    session, ids = _drive(gateway, team, client)
    ep = _finish(team, {"answer": "Writer reply 2", "invalid_calls": [ids[0]]}, "prog", session.responses)
    assert [t.valid for t in ep.turns] == [False, True] and ep.reward == 1.0
    with pytest.raises(ExternalAgentError, match="not the id of a completion of this episode"):
        _finish(team, {"answer": "a", "invalid_calls": ["chatcmpl-other"]}, "prog", session.responses)
    with pytest.raises(ExternalAgentError, match="expected a list of the response ids"):
        _finish(team, {"answer": "a", "invalid_calls": ids[0]}, "prog", session.responses)


def test_sync_entries_of_a_rollout_run_at_once(tmp_path):
    """A sync `entry` runs in a thread of its own per episode: more episodes than the default executor has
    workers (cpu + 4, at most 32), each waiting for all the others (a barrier), finish."""
    import os

    from masrl.workflows.external import _run_entry

    n = min(32, (os.cpu_count() or 1) + 4) + 2
    (tmp_path / "barrier_agent.py").write_text(textwrap.dedent(f'''
        import threading
        BARRIER = threading.Barrier({n}, timeout=20)

        def run(task, client_kwargs):
            BARRIER.wait()
            return task["question"]
    '''))

    async def main():
        tasks = [Task(id=str(i), question=f"q{i}", answer="") for i in range(n)]
        return await asyncio.gather(*(_run_entry(f"{tmp_path / 'barrier_agent.py'}:run", t, {}, 60.0) for t in tasks))

    assert asyncio.run(main()) == [f"q{i}" for i in range(n)]


def test_the_shared_workflow_gateway_waits_as_long_as_its_longest_team_asks():
    """The process's workflow gateway for a host and port is shared by every team (training, then an evaluation, or
    two runs in one process): a later team with a longer episode deadline widens the gateway's call, head and body
    deadlines to it; a shorter one never narrows them."""
    from masrl.workflows import external

    key = ("localhost", 0)  # a gateway of this test's own (the other tests share 127.0.0.1's)
    assert key not in external._GATEWAY
    try:
        first = external.gateway(*key, 40.0)
        assert first.request_timeout_s == 40.0 and first.server.guard.head_timeout_s == 40.0
        later = external.gateway(*key, 500.0)
        shorter = external.gateway(*key, 5.0)
        assert first is later is shorter
        assert first.request_timeout_s == 500.0 and first.limits.header_timeout_s == 500.0
        assert first.limits.body_timeout_s == 500.0 and first.server.guard.head_timeout_s == 500.0
    finally:
        gw = external._GATEWAY.pop(key, None)
        if gw is not None:
            gw.shutdown()
