"""verifiers v1 Envs as masrl tasks (task: verifiers_v1, workflow: environment): a two-role Env written against the
real verifiers.v1 API (a Solver and a frozen Checker) runs its episodes through its own run/finalize, every role's
model calls reaching masrl's gateway as turns of the masrl agent the role maps to; the frozen role's policy is not
trained; the traces' rewards reach the batch; a raising Env is counted and stops the run by the share rule.
Skipped without the verifiers extra (pip install masrl[verifiers])."""
import contextlib
import json
import sys

import pytest

vf = pytest.importorskip("verifiers.v1", reason="the verifiers extra is not installed: pip install masrl[verifiers]")
pytest.importorskip("openai", reason="the environment's client is the openai package: pip install masrl[openai]")

ENV_MODULE = '''
import verifiers.v1 as vf


class SumData(vf.TaskData):
    answer: str = ""


class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, task, trace) -> float:
        return float(trace.last_reply.strip() == task.answer)

    @vf.reward(weight=0.5)
    async def brevity(self, task, trace) -> float:
        return 1.0 / (1.0 + len(trace.last_reply))

    @vf.metric
    async def length(self, task, trace) -> float:
        return float(len(trace.last_reply))


class SumTaskset(vf.Taskset[SumTask, vf.TasksetConfig]):
    def load(self):
        for i in range(4):
            yield SumTask(SumData(idx=i, prompt=f"{i}+{i}=", answer=str(2 * i)), self.config.task)


class CheckConfig(vf.EnvConfig):
    solver: vf.AgentConfig = vf.AgentConfig()
    checker: vf.AgentConfig = vf.AgentConfig()
    fail: bool = False
    fail_rows: list[int] = []


ON_RUN = []  # functions a test calls on the Env's event loop as each episode starts


class SolveAndCheck(vf.Env[CheckConfig]):
    """The solver answers; the checker (frozen) reads the answer; finalize records the checker's verdict."""

    async def setup(self, agents):
        agents.checker.trainable = False

    async def run(self, task, agents):
        for hook in ON_RUN:
            hook()
        if self.config.fail or task.data.idx in self.config.fail_rows:
            raise RuntimeError("broken environment")
        solution = await agents.solver.run(task)
        question = f"{task.data.prompt}{solution.last_reply} ok?"
        await agents.checker.run(SumTask(SumData(prompt=question, answer="yes")))

    async def finalize(self, task, episode):
        by_agent = {t.agent.name: t for t in episode.traces}
        by_agent["solver"].record_metric("checker_said_yes", float(by_agent["checker"].last_reply == "yes"))


__all__ = ["SumTaskset", "SolveAndCheck"]


def load_environment(fail=False, fail_rows=()):
    return SolveAndCheck(CheckConfig(taskset={"id": __name__}, fail=fail, fail_rows=list(fail_rows)))


def teacher(agent, messages, row, rng):
    return "yes" if agent == "Checker" else row["answer"]
'''


def _cfg(tiny_cfg, tmp_path, **over):
    from masrl.config import config_from_dict

    (tmp_path / "two_roles.py").write_text(ENV_MODULE)
    d = tiny_cfg(**{"task": {"name": "verifiers_v1", "params": {
                        "env": f"{tmp_path / 'two_roles.py'}:load_environment",
                        "agents": {"solver": "Solver", "checker": "Checker"}}},
                    "workflow": {"name": "environment", "params": {"timeout_s": 120}}, "sft.steps": 0,
                    "trainer.total_steps": 1, "trainer.batch_size": 2, "trainer.group_size": 2,
                    "eval.before_after": False, "logging.plots": False, **over})
    d["agents"] = {"Solver": {"policy": "shared", "max_new_tokens": 6},
                   "Checker": {"policy": "judge", "max_new_tokens": 4}}
    d["policies"]["judge"] = {**d["policies"]["shared"], "trainable": False}
    return config_from_dict(d)


def test_roles_play_as_masrl_agents_and_the_frozen_role_is_not_trained(tiny_cfg, tmp_path):
    import torch

    from masrl.trainer import Trainer

    cfg = _cfg(tiny_cfg, tmp_path)
    with Trainer(cfg) as trainer:
        task = trainer.source.train[1]
        assert (task.question, task.answer, task.meta["row"]["idx"]) == ("1+1=", "2", 1)
        episodes = trainer.rollout(trainer.source.train[:2], [0, 1], seed=1)
        for ep in episodes:
            assert ep.error is None and [t.agent for t in ep.turns] == ["Solver", "Checker"]
            solver, checker = ep.turns
            assert solver.policy == "shared" and checker.policy == "judge"
            assert len(solver.response_ids) == len(solver.logprobs) > 0
            reply = solver.text.strip()
            reward = float(reply == ep.task.answer) + 0.5 / (1.0 + len(reply))
            # the episode's reward is the trainable (solver) trace's: the Env's own weighted reward functions over
            # the sampled text; the frozen checker's turn carries no reward of its own; finalize read its reply
            assert ep.reward == pytest.approx(reward) and solver.reward == pytest.approx(reward)
            assert checker.reward is None
            metrics = ep.info["env_metrics"]
            assert metrics["Solver/length"] == len(reply)
            assert metrics["Solver/brevity"] == pytest.approx(1 / (1 + len(reply)))
            assert metrics["Solver/checker_said_yes"] == float(checker.text == "yes")
            assert "Checker/correct" in metrics and ep.answer == solver.text.strip()
        frozen = {k: v.clone() for k, v in trainer.policies["judge"].model.state_dict().items()}
        trained = {k: v.clone() for k, v in trainer.policies["shared"].model.state_dict().items()}
        trainer.fit()
        assert all(torch.equal(v, trainer.policies["judge"].model.state_dict()[k]) for k, v in frozen.items())
        assert any(not torch.equal(v, trainer.policies["shared"].model.state_dict()[k]) for k, v in trained.items())
    rows = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["phase"] == "train"]
    assert len(train) == 1 and "env/Solver/correct" in train[0] and "env/Solver/checker_said_yes" in train[0]
    assert "agent/Checker/reward_mean" in train[0]


def test_a_frozen_role_on_a_trainable_policy_and_unknown_roles_are_refused_at_start(tiny_cfg, tmp_path):
    from masrl.errors import ConfigError
    from masrl.team_runner import load_tasks

    cfg = _cfg(tiny_cfg, tmp_path)
    cfg.agents["Checker"].policy = "shared"
    with pytest.raises(ConfigError, match=r"marks agent\(s\) \['Checker'\] frozen.*trainable: false"):
        load_tasks(cfg)
    with pytest.raises(ConfigError, match="does not declare; its roles: \\['solver', 'checker'\\]"):
        load_tasks(_cfg(tiny_cfg, tmp_path, **{"task.params.agents": {"judge": "Checker"}}))
    with pytest.raises(ConfigError, match="environment's agents are \\['Solver', 'checker'\\]"):
        load_tasks(_cfg(tiny_cfg, tmp_path, **{"task.params.agents": {"solver": "Solver"}}))
    with pytest.raises(ConfigError, match="not a verifiers.v1 Env"):
        load_tasks(_cfg(tiny_cfg, tmp_path, **{"task.params.env": f"{tmp_path / 'two_roles.py'}:SumData"}))


def test_a_raising_env_fails_its_episodes_counted_and_stops_the_run_by_the_share_rule(tiny_cfg, tmp_path):
    from masrl.rollout.runner import EpisodeError
    from masrl.trainer import Trainer

    cfg = _cfg(tiny_cfg, tmp_path, **{"task.params.env_args": {"fail": True}})
    with Trainer(cfg) as trainer:
        with pytest.raises(EpisodeError, match="broken environment"):
            trainer.rollout(trainer.source.train[:2], [0, 1], seed=1)


@contextlib.contextmanager
def _gateway_held(port: int = 0):
    """The workflow's gateway (``masrl.workflows.external.gateway`` with the workflow's host, ``port`` and timeout)
    with its loop held until ``release`` is set (at the latest on leaving): a connection waits in the backlog."""
    import threading

    from masrl.workflows.external import gateway

    gw = gateway("127.0.0.1", port, 120.0)
    held, release = threading.Event(), threading.Event()
    gw.server.loop.call_soon_threadsafe(lambda: (held.set(), release.wait(90)))
    assert held.wait(10), "the gateway's loop never ran the call that holds it"
    try:
        yield gw, release
    finally:
        release.set()


def _busy_while_connecting(trainer, gw, release, busy_s: float, accept_first: bool) -> None:
    """On the Env's event loop as an episode starts (the Env module's ``ON_RUN``): once the call's connection waits
    in the held gateway's backlog, the loop is busy for ``busy_s`` (it stands for the other episodes' work: the loop
    runs nothing else meanwhile); the gateway is let go after that, or before it (``accept_first``: the gateway
    accepts the connection while the loop is busy)."""
    import asyncio
    import select
    import time

    def busy():
        loop, deadline = asyncio.get_running_loop(), time.monotonic() + 60

        def watch():  # once per pass of the loop
            if select.select([gw.server.sock], [], [], 0)[0]:  # the call's connection is in the backlog
                if accept_first:
                    release.set()
                time.sleep(busy_s)
                release.set()
            elif time.monotonic() > deadline:
                release.set()
            else:
                loop.call_soon(watch)

        loop.call_soon(watch)

    sys.modules[type(trainer.params["env_episode"].env).__module__].ON_RUN.append(busy)


def test_a_call_connecting_while_the_env_loop_is_busy_past_verifiers_connect_bound_is_not_lost(tiny_cfg, tmp_path):
    """verifiers' interception reaches the gateway with an httpx client whose connect it bounds at 5 s, a bound
    kept by the Env's event loop, which every concurrent episode of the Env shares: a loop busy for longer (the
    other episodes' work on a loaded CPU) while a call was connecting timed the connect out though the kernel had
    completed it, and the episode failed with a ProviderError without a message. Here the Env's loop is kept busy
    past the bound from the moment the call's connection waits in the gateway's backlog: the episode completes."""
    from verifiers.v1.clients.base import DEFAULT_TIMEOUT

    from masrl.trainer import Trainer

    with Trainer(_cfg(tiny_cfg, tmp_path)) as trainer, _gateway_held() as (gw, release):
        _busy_while_connecting(trainer, gw, release, DEFAULT_TIMEOUT.connect + 1.0, accept_first=False)
        [episode] = trainer.rollout(trainer.source.train[:1], [0], seed=1)
        assert release.is_set()
    assert episode.error is None and [t.agent for t in episode.turns] == ["Solver", "Checker"]


def test_a_request_the_env_loop_holds_back_past_the_gateways_default_head_deadline_is_served(tiny_cfg, tmp_path):
    """The gateway awaits an episode's request as long as the episode's deadline (workflow.params.timeout_s): at its
    30 s default, an Env's loop busy for longer between connecting and sending (seen at 40 s on a loaded CPU) had
    the gateway close the connection, and the late request was lost to a reset (a ProviderError, HTTP 503, without
    a message). Here the gateway accepts the call's connection while the Env's loop is busy past that default."""
    import socket

    from masrl.gateway import GatewayLimits
    from masrl.trainer import Trainer

    with socket.socket() as probe:  # a gateway of this test's own (the process's is shared by (host, port))
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    cfg = _cfg(tiny_cfg, tmp_path, **{"workflow.params.port": port})
    with Trainer(cfg) as trainer, _gateway_held(port) as (gw, release):
        _busy_while_connecting(trainer, gw, release, GatewayLimits().header_timeout_s + 1.0, accept_first=True)
        [episode] = trainer.rollout(trainer.source.train[:1], [0], seed=1)
    assert episode.error is None and [t.agent for t in episode.turns] == ["Solver", "Checker"]


def test_a_call_that_fails_without_a_message_fails_its_episode_with_a_line_that_says_what_happened(tiny_cfg,
                                                                                                   tmp_path):
    """verifiers records a provider call that httpx lost without text (a reset connection, a timeout) as a
    ProviderError with an empty message: the episode's error names the role, its agent, the HTTP status, how long
    the call took and what that status means, not 'ProviderError: '. Here the call's connection is taken from the
    gateway's backlog and reset once its request has arrived."""
    import select
    import socket
    import struct
    import threading

    from masrl.rollout.runner import EpisodeError
    from masrl.trainer import Trainer

    with Trainer(_cfg(tiny_cfg, tmp_path)) as trainer, _gateway_held() as (gw, release):
        def reset_the_call():
            try:
                if select.select([gw.server.sock], [], [], 60)[0]:
                    conn, _ = gw.server.sock.accept()
                    conn.settimeout(30)
                    head = b""
                    while b"\r\n\r\n" not in head and (chunk := conn.recv(65536)):
                        head += chunk
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close: a reset
                    conn.close()
            finally:
                release.set()

        resetter = threading.Thread(target=reset_the_call, daemon=True)
        resetter.start()
        with pytest.raises(EpisodeError) as failed:
            trainer.rollout(trainer.source.train[:1], [0], seed=1)
        resetter.join(60)
    message = str(failed.value)
    assert "role 'solver' (agent Solver): ProviderError (HTTP 503, after " in message, message
    assert ("s, no message: the connection between verifiers' interception and masrl's gateway was refused, reset or "
            "closed") in message, message


def _teacher_cfg(tiny_cfg, tmp_path, **over):
    return _cfg(tiny_cfg, tmp_path, **{"task.params.teacher": f"{tmp_path / 'two_roles.py'}:teacher",
                                       "sft.teacher": {"seed": 0}, "sft.steps": 4, "sft.batch_size": 4, **over})


def test_demonstrations_go_on_past_a_failed_episode_and_stop_loudly_at_the_rollouts_budget(tiny_cfg, tmp_path):
    """The cold start's demonstrations run the Env's own episodes with the teacher answering: an episode that fails
    gives no demonstrations and the others go on, under the budget of a rollout's episodes
    (workflow.params.max_error_share); past it, and when every episode fails, the run stops with one line."""
    from masrl.rollout.runner import EpisodeError
    from masrl.trainer import Trainer, demonstrations

    with Trainer(_teacher_cfg(tiny_cfg, tmp_path, **{"task.params.env_args": {"fail_rows": [1]}})) as trainer:
        rows = demonstrations(trainer)
        decode = {name: p.tokenizer.decode for name, p in trainer.policies.items()}
        written = sorted((r.agent, decode[r.policy](r.response_ids, skip_special_tokens=True)) for r in rows)
    assert written == [("Checker", "yes")] * 3 + [("Solver", "0"), ("Solver", "4"), ("Solver", "6")]  # not row 1
    over = {"task.params.env_args": {"fail_rows": [1]}, "workflow.params.max_error_share": 0.25}
    with Trainer(_teacher_cfg(tiny_cfg, tmp_path, **over)) as trainer:
        with pytest.raises(EpisodeError, match=r"failed on 1 of 4 calls in the SFT demonstrations \(1 error; first: "
                                               r".*broken environment.* in demonstration episode 1 .*"
                                               r"max_error_share \(now 0.25\)"):
            demonstrations(trainer)
    with Trainer(_teacher_cfg(tiny_cfg, tmp_path, **{"task.params.env_args": {"fail": True}})) as trainer:
        with pytest.raises(EpisodeError, match=r"failed on 4 of 4 calls in the SFT demonstrations"):
            demonstrations(trainer)
