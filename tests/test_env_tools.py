"""Tool environments (task: tool_env, workflow: environment): one instance per episode, reset(**row), public
methods as tools through masrl's tool calling on the gateway, the reward read from the instance, done ending the
episode; an OpenEnv MCP environment in-process (skipped without openenv-core: pip install masrl[openenv])."""
import asyncio
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import GatheringScheduler

from masrl.types import Task, Turn

pytest.importorskip("openai", reason="the episode's client is the openai package: pip install masrl[openai]")
EXAMPLES = Path(__file__).parents[1] / "examples"


class _Scripted:
    """A team.call backend that guesses 1, 2, 3, ... with hermes tool calls, then answers plainly."""

    def __init__(self, stop_after=20):
        self.prompts, self.stop_after = [], stop_after

    async def __call__(self, agent, prompt):
        self.prompts.append(prompt)
        n = len(self.prompts)
        text = (f'<tool_call>{{"name": "guess", "arguments": {{"n": {n}}}}}</tool_call>' if n <= self.stop_after
                else "I give up")
        return Turn(agent=agent, policy="p", prompt_ids=[1, 2, n], response_ids=[7, n], logprobs=[-0.5, -0.25],
                    text=text, prompt_text=str(prompt))


def _play(params, row, scripted, agents=("Player",)):
    """One episode of workflow environment on a task of ``tool_env`` built from ``params``."""
    from masrl.config import TaskConfig
    from masrl.tasks.environments.tool_env import tool_env_source
    from masrl.workflows.base import Team, get_workflow
    from masrl.workflows.environment import environment

    source = tool_env_source(TaskConfig(name="tool_env", params=params), {})
    task = next(t for t in source.train if t.meta["row"] == row) if row else source.train[0]
    spec = get_workflow("environment")
    import dataclasses
    spec = dataclasses.replace(spec, agents=agents)
    team = Team(task, spec, scripted, lambda t, a: {"reward": 0.0}, params={**spec.params, **source.workflow_params})
    return asyncio.run(environment(task, team))


GUESS = {"env": f"{EXAMPLES / 'tool_env_guess.py'}:GuessNumber", "train": f"{EXAMPLES / 'tool_env_guess.py'}:test_rows",
         "max_turns": 6}


def test_public_methods_are_tools_and_the_instance_gives_reward_and_done():
    scripted = _Scripted()
    row = {"prompt": "Find the hidden number. Call guess(n).", "target": 3, "id": 3}
    ep = _play(GUESS, row, scripted)
    assert ep.error is None and ep.reward == 1.0 and len(ep.turns) == 3  # done after "correct": no 4th call
    assert ep.info["env_metrics"] == {"tool_calls": 3.0, "tool_errors": 0.0, "done": 1.0}
    first = scripted.prompts[0]
    assert [t["function"]["name"] for t in first.tools] == ["guess"]
    assert first.messages[0]["content"].endswith("between 1 and 9.")  # reset's text follows the prompt
    last = scripted.prompts[-1].messages
    assert [m["content"] for m in last if m["role"] == "tool"] == ["higher", "higher"]


def test_an_episode_that_runs_out_of_turns_scores_the_instance_reward():
    ep = _play(GUESS, {"prompt": "Find the hidden number. Call guess(n).", "target": 9, "id": 9}, _Scripted())
    assert ep.error is None and ep.reward == 0.0 and len(ep.turns) == 6
    assert ep.info["env_metrics"]["done"] == 0.0


def test_a_tool_error_is_answered_to_the_model(tmp_path):
    (tmp_path / "env.py").write_text('''
class Broken:
    reward = 0.5

    def reset(self, **row):
        return None

    def guess(self, n: int) -> str:
        """Guess.

        Args:
            n: the guess
        """
        raise ValueError("no guessing today")


def rows():
    return [{"question": "go"}]
''')
    scripted = _Scripted(stop_after=1)
    ep = _play({"env": f"{tmp_path / 'env.py'}:Broken", "train": f"{tmp_path / 'env.py'}:rows"}, None, scripted)
    assert ep.reward == 0.5 and ep.answer == "I give up" and ep.info["env_metrics"]["tool_errors"] == 1.0
    tool_msg = [m for m in scripted.prompts[-1].messages if m["role"] == "tool"][0]
    assert "no guessing today" in tool_msg["content"]


def test_bad_tool_env_params_are_one_clear_error(tmp_path):
    from masrl.config import TaskConfig
    from masrl.errors import ConfigError
    from masrl.tasks.environments.tool_env import tool_env_source

    with pytest.raises(ConfigError, match="unknown keys"):
        tool_env_source(TaskConfig(name="tool_env", params={**GUESS, "turns": 3}), {})
    with pytest.raises(ConfigError, match="max_turns"):
        tool_env_source(TaskConfig(name="tool_env", params={**GUESS, "max_turns": 0}), {})
    with pytest.raises(ConfigError, match="not a class with a reset"):
        tool_env_source(TaskConfig(name="tool_env", params={**GUESS, "env": f"{EXAMPLES / 'tool_env_guess.py'}:train_rows"}), {})
    with pytest.raises(ConfigError, match="set task.params.train"):
        tool_env_source(TaskConfig(name="tool_env", params={"env": GUESS["env"]}), {})


OPENENV_MODULE = '''
from fastmcp import FastMCP
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.types import Observation, State


class Guess(MCPEnvironment):
    def __init__(self):
        mcp = FastMCP("guess")
        self.target = 0

        @mcp.tool
        def guess(n: int) -> str:
            """Guess the number."""
            if n == self.target:
                self.found = True
                return "correct"
            return "higher" if n < self.target else "lower"

        super().__init__(mcp)
        self.found = False

    def reset(self, seed=None, episode_id=None, target=0, **kw):
        self.target, self.found = int(target), False
        return Observation(done=False, reward=0.0)

    def _step_impl(self, action, timeout_s=None, **kw):
        return Observation(done=False, reward=0.0)

    @property
    def state(self):
        return State()


def found(env):
    return 1.0 if env.found else 0.0


def rows():
    return [{"question": "find it", "target": 2}]
'''


def test_an_openenv_mcp_environment_in_process(tmp_path):
    pytest.importorskip("openenv.core.env_server", reason="openenv-core is not installed: pip install masrl[openenv]")
    (tmp_path / "oe.py").write_text(OPENENV_MODULE)
    scripted = _Scripted(stop_after=3)
    ep = _play({"env": f"{tmp_path / 'oe.py'}:Guess", "train": f"{tmp_path / 'oe.py'}:rows",
                "reward": f"{tmp_path / 'oe.py'}:found", "max_turns": 3}, None, scripted)
    assert ep.error is None and ep.reward == 1.0
    assert [t["function"]["name"] for t in scripted.prompts[0].tools] == ["guess"]
    assert [m["content"] for m in scripted.prompts[1].messages if m["role"] == "tool"] == ["higher"]


def test_a_missing_extra_is_one_install_line(monkeypatch):
    from masrl.config import TaskConfig
    from masrl.tasks.registry import load_task_source

    monkeypatch.setitem(sys.modules, "verifiers", None)  # as if not installed
    with pytest.raises(ImportError, match=r"pip install 'masrl\[verifiers\]'"):
        load_task_source(TaskConfig(name="verifiers", params={"env": "anything"}))
    monkeypatch.setitem(sys.modules, "openai", None)
    with pytest.raises(ImportError, match=r"pip install 'masrl\[openai\]'"):
        load_task_source(TaskConfig(name="tool_env", params=GUESS))


def test_an_openenv_server_through_its_mcp_client(tmp_path):
    """The same environment behind OpenEnv's own FastAPI server, played by URL (one WebSocket session per episode)."""
    pytest.importorskip("openenv.core.env_server", reason="openenv-core is not installed: pip install masrl[openenv]")
    import socket
    import threading
    import time

    import uvicorn
    from openenv.core.env_server import create_fastapi_app
    from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation

    sys.path.insert(0, str(tmp_path))
    (tmp_path / "oe_server.py").write_text(OPENENV_MODULE)
    import oe_server

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = create_fastapi_app(oe_server.Guess, CallToolAction, CallToolObservation)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        for _ in range(100):
            if server.started:
                break
            time.sleep(0.05)
        scripted = _Scripted(stop_after=2)
        ep = _play({"url": f"http://127.0.0.1:{port}", "train": f"{tmp_path / 'oe_server.py'}:rows", "max_turns": 3},
                   None, scripted)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sys.path.remove(str(tmp_path))
    assert ep.error is None, ep.error
    assert [t["function"]["name"] for t in scripted.prompts[0].tools] == ["guess"]
    assert [m["content"] for m in scripted.prompts[1].messages if m["role"] == "tool"] == ["higher"]
    assert ep.info["env_metrics"]["tool_calls"] == 2.0


# ----------------------------------------------------------------------------- environments are user code

def _rollout(env_episode, n=2, seen=None, **params):
    """``n`` episodes of workflow environment playing ``env_episode`` (its params over the defaults); each episode
    also goes to ``seen`` as it ends."""
    import dataclasses

    from masrl.rollout.runner import run_episodes
    from masrl.workflows.base import get_workflow

    spec = dataclasses.replace(get_workflow("environment"), agents=("Player",))
    tasks = [Task(id=f"t{i}", question="go", answer=None, meta={"data_source": "probe", "row": {}}) for i in range(n)]
    return run_episodes(spec, tasks, list(range(n)), call=_Scripted(stop_after=0), scheduler=GatheringScheduler(),
                        score=lambda t, a: {"reward": 0.0}, prompts={}, format_penalty=0.0,
                        params={**spec.params, "env_episode": env_episode, **params},
                        on_episode=None if seen is None else seen.append)


async def _one_call(client_kwargs, agent):
    """What an environment's rollout does: one chat completion on the episode's endpoint."""
    import openai

    async with openai.AsyncOpenAI(max_retries=0, **client_kwargs) as client:
        reply = await client.chat.completions.create(model=agent, messages=[{"role": "user", "content": "go"}])
    return reply.choices[0].message.content


def _failed(error):
    from masrl.rollout.runner import failed_episode

    return failed_episode(Task(id="t", question="go", answer=None), SimpleNamespace(turns=[]), error)


ENV_EXITS = '''
import sys


class Leaves:
    def reset(self, **row):
        sys.exit(0)


def rows():
    return [{"question": "go"}]
'''


def test_an_environment_whose_reset_calls_sys_exit_fails_its_episode_counted_as_environment(tmp_path):
    from masrl.rollout.runner import rollout_metrics
    from masrl.workflows.external import ExternalAgentError

    (tmp_path / "env.py").write_text(ENV_EXITS)
    with pytest.raises(ExternalAgentError, match=r"sys\.exit\(0\)") as err:
        _play({"env": f"{tmp_path / 'env.py'}:Leaves", "train": f"{tmp_path / 'env.py'}:rows"}, None, _Scripted())
    assert err.value.program_kind == "environment" and err.value.program_outcome == "error"
    metrics = rollout_metrics([_failed(err.value)])
    assert metrics["usercode/environment/errors"] == 1.0 and metrics["usercode/environment/calls"] == 1.0
    assert "usercode/program/calls" not in metrics


def test_an_async_environment_that_blocks_times_out_at_its_deadline_and_is_counted():
    import time

    from masrl.rollout.runner import EpisodeError, rollout_metrics

    async def rollout(task, client_kwargs, agent):
        answer = await _one_call(client_kwargs, agent)
        time.sleep(4)  # a blocking call inside the environment's async rollout
        return {"reward": 1.0, "answer": answer}

    start = time.monotonic()
    seen = []
    with pytest.raises(EpisodeError) as err:
        _rollout(rollout, n=1, seen=seen, timeout_s=1.0)
    assert time.monotonic() - start < 3.0  # the deadline fired: the rollout's loop was never blocked
    assert "environment probe failed on 1 of 1 calls in the rollout (1 timeout; first: ProgramTimeout: environment " \
           "probe did not return within 1 s" in str(err.value)
    metrics = rollout_metrics(seen)
    assert (metrics["usercode/environment/calls"], metrics["usercode/environment/timeouts"]) == (1.0, 1.0)


def test_an_environment_that_fails_on_every_episode_stops_the_run_with_one_line():
    from masrl.errors import UserInputError
    from masrl.rollout.runner import EpisodeError

    async def broken(task, client_kwargs, agent):
        await _one_call(client_kwargs, agent)
        raise ValueError("the environment is broken")

    with pytest.raises(EpisodeError) as err:
        _rollout(broken, n=3)
    message = str(err.value)
    assert isinstance(err.value, UserInputError)  # exit 2 at the CLI
    assert message.startswith("environment probe failed on 3 of 3 calls in the rollout (3 errors; first: ")
    assert "the environment is broken" in message and "fix the environment" in message and "\n" not in message


def test_the_failure_share_of_an_environment_is_configurable():
    from masrl.rollout.runner import EpisodeError

    async def half(task, client_kwargs, agent):
        answer = await _one_call(client_kwargs, agent)
        if task.id in ("t0", "t1"):
            raise ValueError("half of them fail")
        return {"reward": 1.0, "answer": answer}

    episodes = _rollout(half, n=4)  # the default, 1.0: the run goes on
    assert [e.valid for e in episodes] == [False, False, True, True]
    with pytest.raises(EpisodeError, match=r"failed on 2 of 4 calls .*max_error_share \(now 0.5\)"):
        _rollout(half, n=4, max_error_share=0.5)
