"""A rollout engine that raises while generating a batch (a model error, out of memory, a bad token id): every request
waiting on that batch gets the error at once, never a wait without end. Behind the gateway each waiting HTTP request
is answered a JSON 500 naming the engine's error, the episode whose program fails on it is counted under the
user-code contract (a rollout where every one fails stops with one line), and the scheduler serves later requests.
Both ways the scheduler hands a batch to an engine are covered (a flush, continuous batching), and masrl serve's
batcher."""
import asyncio
import json
import threading

import pytest

from masrl.rollout.continuous import ContinuousBatcher
from masrl.rollout.engine import GenRequest, TransformersEngine
from masrl.rollout.scheduler import RolloutScheduler

pytest.importorskip("fastapi", reason="the gateway runs on the server extra: pip install masrl[server]")

DEADLINE_S = 120  # a rollout that has not ended by then is hung: the test fails instead of waiting

# an OpenAI-API program that keeps what the gateway answered it (status, JSON body) and fails on an error reply
PROGRAM = '''
import itertools, json, threading, urllib.error, urllib.request

REPLIES = []
_LOCK = threading.Lock()
_TURN = itertools.count()


def run(task, client_kwargs):
    with _LOCK:  # the episodes take turns between the two agents
        agent = ("Solver", "Verifier")[next(_TURN) % 2] if AGENTS == "both" else "Solver"
    body = json.dumps({"model": agent, "messages": [{"role": "user", "content": task["question"]}]}).encode()
    request = urllib.request.Request(client_kwargs["base_url"] + "/chat/completions", data=body, method="POST",
                                     headers={"Authorization": "Bearer " + client_kwargs["api_key"],
                                              "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            status, answer = response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        status, answer = e.code, json.loads(e.read())  # an answer that is not JSON fails here
    with _LOCK:
        REPLIES.append((agent, status, answer))
    if status != 200:
        raise RuntimeError(f"the model call failed with {status}: {answer['error']['message']}")
    return answer["choices"][0]["message"]["content"]
'''


def _within_deadline(fn):
    """``fn()`` in a thread, its result or what it raised; a test failure when it has not ended by ``DEADLINE_S``."""
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(DEADLINE_S)
    assert not thread.is_alive(), f"still waiting after {DEADLINE_S} s: a request on the failed batch hangs"
    if "error" in box:
        raise box["error"]
    return box["value"]


def _fails_once(monkeypatch, engine_of, what="the injected engine failure"):
    """The first decode of the engine ``engine_of(self)`` picks raises a RuntimeError; the calls of that decode."""
    original, calls = TransformersEngine._decode, []

    def decode(self, model, requests):
        if engine_of(self):
            calls.append(len(requests))
            if len(calls) == 1:
                raise RuntimeError(what)
        return original(self, model, requests)

    monkeypatch.setattr(TransformersEngine, "_decode", decode)
    return calls


def _program_trainer(tiny_cfg, tmp_path, agents, policies=None):
    from masrl.config import config_from_dict
    from masrl.trainer import Trainer

    (tmp_path / "engine_failure_program.py").write_text(f"AGENTS = {agents!r}\n" + PROGRAM)
    over = {"workflow": {"name": "external", "params": {"entry": f"{tmp_path / 'engine_failure_program.py'}:run",
                                                        "timeout_s": 90}},
            "sft.steps": 0, "trainer.total_steps": 1, "eval.before_after": False, "logging.plots": False}
    if policies:
        over.update(policies)
    return Trainer(config_from_dict(tiny_cfg(**over)))


def _replies():
    import sys

    return next(m for name, m in sys.modules.items() if name.endswith("engine_failure_program")).REPLIES


def test_a_failed_batch_answers_its_gateway_requests_and_the_next_rollout_is_served(tiny_cfg, tmp_path, monkeypatch):
    """Every request of the failed batch gets a JSON 500 naming the engine's error at once; each program fails on
    it, so every episode of the rollout failed: the run stops with one line naming the error. The same gateway and
    scheduler then serve the next rollout."""
    from masrl.rollout.runner import EpisodeError

    calls = _fails_once(monkeypatch, lambda engine: True, "CUDA out of memory (injected)")
    with _program_trainer(tiny_cfg, tmp_path, "Solver") as trainer:
        tasks = trainer.source.train[:4]
        with pytest.raises(EpisodeError) as stop:
            _within_deadline(lambda: trainer.rollout(tasks, [0, 1, 2, 3], seed=1))
        replies = list(_replies())
        episodes = _within_deadline(lambda: trainer.rollout(tasks, [0, 1, 2, 3], seed=2))
    assert "CUDA out of memory (injected)" in str(stop.value) and "\n" not in str(stop.value)
    assert calls[0] == 4 and len(replies) == 4  # one batch of the four calls, each answered
    for _, status, answer in replies:
        assert status == 500 and answer["error"]["code"] == "engine_error"
        assert answer["error"]["type"] == "server_error"
        assert "policy 'shared'" in answer["error"]["message"]
        assert "RuntimeError: CUDA out of memory (injected)" in answer["error"]["message"]
    assert all(not e.error and [t.agent for t in e.turns] == ["Solver"] for e in episodes)


_SMALL = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
          "intermediate_size": 64, "max_position_embeddings": 128}
# two policies, one per agent: the Solver's engine can fail while the Verifier's serves
_TWO_POLICIES = {"policies": {name: {"model": "tiny", "optim": {"lr": 1e-3}, "tiny": _SMALL} for name in ("a", "b")},
                 "agents": {"Solver": {"policy": "a", "max_new_tokens": 8},
                            "Verifier": {"policy": "b", "max_new_tokens": 4}}}


def test_a_failed_batch_fails_only_its_episodes(tiny_cfg, tmp_path, monkeypatch):
    """Two policies generate in one flush; the engine of one fails: the episodes whose call was in its batch fail
    (counted in usercode/program/errors, the rollout goes on), the other policy's batch is answered."""
    from masrl.rollout.runner import rollout_metrics

    holder = {}
    with _program_trainer(tiny_cfg, tmp_path, "both", _TWO_POLICIES) as trainer:
        holder["a"] = trainer.policies["a"].engine
        calls = _fails_once(monkeypatch, lambda engine: engine is holder["a"])
        episodes = _within_deadline(lambda: trainer.rollout(trainer.source.train[:4], [0, 1, 2, 3], seed=1))
    replies = _replies()
    assert calls == [2] and sorted(status for _, status, _ in replies) == [200, 200, 500, 500]
    assert all(status == (500 if agent == "Solver" else 200) for agent, status, _ in replies)
    failed = [e for e in episodes if e.error]
    assert len(failed) == 2 and all("injected engine failure" in e.error for e in failed)
    assert all(e.info["program"] == "error" for e in failed)
    assert all([t.agent for t in e.turns] == ["Verifier"] for e in episodes if not e.error)
    metrics = rollout_metrics(episodes)
    assert metrics["usercode/program/errors"] == 2 and metrics["rollout/episode_errors"] == 2


def test_a_step_counts_its_failed_batches(tiny_cfg, tmp_path, monkeypatch):
    """``rollout/engine_failures``: the batches an engine raised on in the step (0 in a step without one); the
    step trains on the episodes the other policy served."""
    holder = {}
    with _program_trainer(tiny_cfg, tmp_path, "both", _TWO_POLICIES) as trainer:
        holder["a"] = trainer.policies["a"].engine
        calls = _fails_once(monkeypatch, lambda engine: engine is holder["a"])
        first = _within_deadline(trainer.train_step)
        second = _within_deadline(trainer.train_step)
    assert len(calls) == 2 and first["rollout/engine_failures"] == 1.0 and second["rollout/engine_failures"] == 0.0
    assert first["rollout/episode_errors"] == calls[0] and second["rollout/episode_errors"] == 0


@pytest.mark.parametrize("continuous", [False, True])
def test_the_scheduler_fails_the_batch_and_serves_the_next_requests(tiny, monkeypatch, continuous):
    """An engine error reaches every episode waiting on the batch (a flush, or the running batch of continuous
    batching) as an error naming the policy; episodes that call again are served, within the same rollout."""
    model, tok = tiny
    engine = TransformersEngine(model, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id, seed=3)
    if continuous:
        original, state = ContinuousBatcher.advance, {"n": 0}

        def advance(self, model):
            state["n"] += 1
            if state["n"] == 3:  # mid-decode: rows are running
                raise RuntimeError("a bad token id (injected)")
            return original(self, model)

        monkeypatch.setattr(ContinuousBatcher, "advance", advance)
    else:
        _fails_once(monkeypatch, lambda e: True, "a bad token id (injected)")
    scheduler = RolloutScheduler({"p": engine}, continuous=continuous)
    request = GenRequest(tok("Q 7*3\nS ", add_special_tokens=False)["input_ids"], temperature=0.0, max_new_tokens=12)

    async def episode():
        try:
            await scheduler.generate("p", request)
        except Exception as e:  # noqa: BLE001 - the batch's error, handed to the episode
            first = str(e)
        else:
            first = None
        return first, (await scheduler.generate("p", request)).response_ids

    out = _within_deadline(lambda: scheduler.run([episode() for _ in range(3)]))
    expected = TransformersEngine(model, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id,
                                  seed=3).generate([request])[0].response_ids
    for first, ids in out:
        assert first is not None and "policy 'p'" in first and "a bad token id (injected)" in first
        assert ids == expected
    assert not engine.busy


@pytest.mark.parametrize("continuous", [False, True])
def test_a_lost_engine_stops_the_rollout_with_its_own_error(tiny, monkeypatch, continuous):
    """An engine that can serve nothing more (``EngineLost``: a Ray worker died, its group's peers may be blocked in a
    collective) is no batch failure: the rollout stops at once with that error, no episode waits on."""
    from masrl.errors import EngineLost
    from masrl.runtime import WorkerGroupError

    model, tok = tiny
    engine = TransformersEngine(model, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id, seed=3)
    lost = WorkerGroupError("policy 'p': worker 0 died during generation at step 1 (ActorDiedError)")
    assert isinstance(lost, EngineLost)

    def fail(*args, **kwargs):
        raise lost

    monkeypatch.setattr(ContinuousBatcher if continuous else TransformersEngine,
                        "advance" if continuous else "_decode", fail)
    scheduler = RolloutScheduler({"p": engine}, continuous=continuous)
    request = GenRequest(tok("Q 7*3\nS ", add_special_tokens=False)["input_ids"], temperature=0.0, max_new_tokens=4)
    seen = []

    async def episode():
        try:
            return await scheduler.generate("p", request)
        except BaseException as e:  # noqa: BLE001 - what each waiting episode saw
            seen.append(e)
            raise

    with pytest.raises(WorkerGroupError, match="worker 0 died during generation at step 1"):
        _within_deadline(lambda: scheduler.run([episode() for _ in range(3)]))
    assert all(isinstance(e, asyncio.CancelledError) for e in seen) and len(seen) == 3


def test_masrl_serve_batcher_answers_every_request_of_a_short_or_failed_batch():
    """masrl serve's batcher: an engine that returns fewer results than requests, or raises, fails every request of
    the batch with an error naming the policy; the next batch is served."""
    from masrl.rollout.base import GenResult
    from masrl.serve import ServeBatcher

    class _Engine:
        def __init__(self):
            self.batches = 0

        def generate(self, requests):
            self.batches += 1
            if self.batches == 1:
                return [GenResult([1], [-0.1], False)]  # one result for two requests
            if self.batches == 2:
                raise RuntimeError("out of memory (injected)")
            return [GenResult([2], [-0.2], False) for _ in requests]

    batcher = ServeBatcher({"p": _Engine()}, window_s=0.001)

    async def main():
        out = []
        for _ in range(3):
            got = await asyncio.wait_for(asyncio.gather(*(batcher.generate("p", GenRequest([1])) for _ in range(2)),
                                                        return_exceptions=True), 30)
            out.append(got)
        return out

    short, failed, served = asyncio.run(main())
    assert all(isinstance(e, Exception) and "1 results for 2 requests" in str(e) for e in short), short
    assert all(isinstance(e, Exception) and "policy 'p'" in str(e) and "out of memory (injected)" in str(e)
               for e in failed), failed
    assert [r.response_ids for r in served] == [[2], [2]]


def _post(session, timeout=30):
    """A chat request of ``session`` over HTTP: ``(status, JSON body)`` (a body that is not JSON raises)."""
    import urllib.error
    import urllib.request

    body = json.dumps({"model": "Planner", "messages": [{"role": "user", "content": "x"}]}).encode()
    request = urllib.request.Request(session.base_url + "/chat/completions", data=body, method="POST",
                                     headers={"Authorization": f"Bearer {session.key}"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_call_cut_short_is_answered_at_once():
    """A call cancelled on the episode's loop, and a call in flight when its episode ends, are each answered a JSON
    503 ``call_ended`` at once (not at the request's deadline, not a bare 500)."""
    from masrl.gateway import Gateway
    from masrl.types import Task
    from masrl.workflows.base import Team, WorkflowSpec

    started = threading.Event()

    async def never(agent, prompt):  # a call that would never finish
        started.set()
        await asyncio.Event().wait()

    async def cancelled(agent, prompt):
        raise asyncio.CancelledError

    async def fn(task, team):
        raise AssertionError

    def team(backend):
        return Team(Task(id="t", question="q", answer=""), WorkflowSpec("external", fn, ("Planner",), {}), backend,
                    lambda t, a: {"reward": 0.0})

    gateway = Gateway(request_timeout_s=600)

    async def main():
        hung, cut = gateway.open(team(never)), gateway.open(team(cancelled))
        waiting = asyncio.ensure_future(asyncio.to_thread(_post, hung))
        assert await asyncio.to_thread(started.wait, 30), "the call never reached the team"
        gateway.close(hung)  # its episode ends while the call is in flight
        return await asyncio.to_thread(_post, cut), await waiting

    try:
        answers = _within_deadline(lambda: asyncio.run(main()))
    finally:
        gateway.shutdown()
    for status, body in answers:
        assert status == 503 and body["error"]["code"] == "call_ended", body
    assert "cancelled" in answers[0][1]["error"]["message"]
    assert "its episode ended" in answers[1][1]["error"]["message"]


def test_masrl_serve_team_answers_every_request_it_did_not_run_when_it_stops():
    """masrl serve --team stopped (Ctrl-C) during a rollout: the requests of that rollout and those still queued are
    each answered a 503, none left waiting."""
    import time
    from types import SimpleNamespace

    from masrl.gateway.errors import GatewayError
    from masrl.serve_team import TeamServer

    class _Runner:
        cfg = SimpleNamespace(eval=SimpleNamespace(temperature=None), seed=0)

        def rollout(self, tasks, *args, **kwargs):
            queued.append(server.submit("asked while the rollout ran", None))
            raise KeyboardInterrupt

    queued = []
    server = TeamServer(_Runner(), "team")
    running = [server.submit("q1", None), server.submit("q2", None)]
    server.work_until(time.monotonic() + DEADLINE_S)  # returns on the interrupt
    assert len(queued) == 1
    for future in running + queued:
        error = future.exception(timeout=5)
        assert isinstance(error, GatewayError) and error.status == 503 and error.code == "server_stopped"
