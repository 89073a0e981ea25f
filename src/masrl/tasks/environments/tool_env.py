"""``task: {name: tool_env}``: a tool environment, one instance per episode, as a masrl task.

    task:
      name: tool_env
      params:
        env: examples/tool_env_guess.py:GuessNumber   # module:Class (file.py:Class); or url: http://HOST:PORT
        train: examples/tool_env_guess.py:train_rows  # rows: a JSON Lines file or a function returning a list of dicts
        test: examples/tool_env_guess.py:test_rows    # optional (default: the train rows)
        max_turns: 8                                  # model calls per episode at most
        reward: null                                  # optional module:function(env) -> float (default: env.reward)
    workflow:
      name: environment

Two shapes of class are played:

* **TRL's ``environment_factory``** (also what the OpenReward and Harbor integrations expose): a class with a
  no-argument ``__init__`` and ``reset(self, **row) -> str | None``; every other public method is a tool (its
  type hints and docstring ``Args:`` give the schema); the reward is ``env.reward`` (an attribute, or a method
  called with no argument) or the ``reward`` function's value; ``env.done`` (when it is there and true) ends the
  episode.
* **An OpenEnv ``Environment``** (``openenv-core``; in-process, no Docker: the server-side class is plain Python)
  whose tools are MCP tools (an ``MCPEnvironment``): ``reset(**row)`` starts the episode, the tools are those
  ``ListToolsAction`` lists, each call a ``CallToolAction``; the reward is the last ``Observation.reward`` that
  was not None, and an observation with ``done`` ends the episode.

The row's ``prompt`` (a string or chat messages) or ``question`` is the agent's first message, followed by the text
``reset`` returns. A tool that raises answers the model with the error (as in TRL). With ``url: http://HOST:PORT``
instead of ``env``, an OpenEnv server is played through its MCP tool client (HTTP/WebSocket, one session per
episode): ``reset(**row)``, its listed tools, each call a ``CallToolAction`` whose result carries reward and done.
Environments that need remote sandboxes (Docker, Modal, Prime) are not started here.
"""
from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any, Callable

from masrl.config import TaskConfig
from masrl.errors import ConfigError
from masrl.tasks.source import TaskSource
from masrl.types import Task

_KNOWN = {"env", "url", "train", "test", "max_turns", "reward", "teacher"}
_NOT_TOOLS = {"reset", "step", "state", "close", "reward", "done"}


class ToolGame:
    """One environment class and how an episode of it is played: ``start`` (a fresh instance and its first
    observation), ``tools`` (``{name: (function, schema or None)}``), ``outcome`` (reward, done)."""

    def __init__(self, cls: type | None, reward: Callable | None = None, max_turns: int = 8, url: str | None = None):
        self.cls, self.reward_fn, self.max_turns, self.url = cls, reward, max_turns, url
        self.openenv = url is not None or _is_openenv(cls)

    def start(self, row: dict) -> tuple[Any, str | None]:
        env = self._connect() if self.url else self.cls()
        env._masrl_outcome = [None, False]  # the last reward seen and done (OpenEnv observations)
        fields = {k: v for k, v in row.items() if k not in ("prompt", "question")}
        first = env.reset(**fields)
        if self.openenv:
            self._observe(env, first)
            return env, _observation_text(getattr(first, "observation", first))
        return env, None if first is None else str(first)

    def _connect(self) -> Any:
        """An OpenEnv server's MCP tool client (HTTP/WebSocket), connected: one session per episode."""
        from openenv.core.mcp_client import MCPToolClient

        client = MCPToolClient(base_url=self.url).sync()
        client.connect()
        return client

    def close(self, env: Any) -> None:
        """End the episode's instance (a remote session is closed; an in-process OpenEnv environment too)."""
        if self.openenv and callable(getattr(env, "close", None)):
            env.close()

    def tools(self, env: Any) -> dict[str, tuple[Callable, dict | None]]:
        if self.openenv:
            from openenv.core.env_server.mcp_types import ListToolsAction

            listed = env.list_tools() if self.url else env.step(ListToolsAction()).tools
            return {t.name: (self._mcp_call(env, t.name), {"type": "function", "function": {
                "name": t.name, "description": t.description, "parameters": t.input_schema}}) for t in listed}
        return {name: (getattr(env, name), None) for name, member in inspect.getmembers(type(env))
                if not name.startswith("_") and name not in _NOT_TOOLS and inspect.isfunction(member)}

    def _mcp_call(self, env: Any, name: str) -> Callable:
        from openenv.core.env_server.mcp_types import CallToolAction

        def call(**arguments: Any) -> Any:
            step = env.step(CallToolAction(tool_name=name, arguments=arguments))
            self._observe(env, step)
            obs = getattr(step, "observation", step)  # a client's StepResult, or the observation in-process
            if getattr(obs, "error", None) is not None:
                raise RuntimeError(obs.error.message if hasattr(obs.error, "message") else str(obs.error))
            return _tool_value(obs.result)

        return call

    @staticmethod
    def _observe(env: Any, obs: Any) -> None:
        if getattr(obs, "reward", None) is not None:
            env._masrl_outcome[0] = float(obs.reward)
        env._masrl_outcome[1] = env._masrl_outcome[1] or bool(getattr(obs, "done", False))

    def outcome(self, env: Any) -> tuple[float, bool]:
        """``(reward, done)`` of the episode so far."""
        if self.reward_fn is not None:
            reward = self.reward_fn(env)
        elif self.openenv:
            reward = env._masrl_outcome[0]
        else:
            reward = getattr(env, "reward", None)
            reward = reward() if callable(reward) else reward
        done = env._masrl_outcome[1] if self.openenv else bool(getattr(env, "done", False))
        return float(reward or 0.0), done


def _tool_value(result: Any) -> Any:
    """An MCP tool result's value: fastmcp's ``CallToolResult`` in-process, its JSON form from a server."""
    if isinstance(result, dict) and "data" in result:
        if result.get("is_error"):
            raise RuntimeError(str(result.get("content") or result["data"]))
        return result["data"]
    return getattr(result, "data", result)


def _is_openenv(cls: type | None) -> bool:
    if cls is None:
        return False
    try:
        from openenv.core.env_server.interfaces import Environment
    except ImportError:
        return False
    return issubclass(cls, Environment)


def _observation_text(obs: Any) -> str | None:
    """An OpenEnv observation's own fields (not done / reward / metadata) as text, or None."""
    if obs is None:
        return None
    fields = obs.model_dump(exclude={"done", "reward", "metadata"})
    return json.dumps(fields, ensure_ascii=False, default=str) if fields else None


def _rows(spec: Any, what: str) -> list[dict]:
    """A list of dicts from ``module:function`` / ``file.py:function`` or a JSON Lines file."""
    from masrl.usercode.imports import import_object

    if isinstance(spec, str) and ":" in spec and not Path(spec).is_file():
        make = import_object(spec, what)
        rows = make() if callable(make) else make
    elif isinstance(spec, str):
        from masrl.io.rows import iter_records

        path = Path(spec).expanduser()
        if not path.is_file():
            raise ConfigError(f"{what}: {spec!r} is neither a file nor 'module:function'")
        rows = [row for _, row in iter_records(path, "jsonl")]
    else:
        raise ConfigError(f"{what} must be a JSON Lines file or 'module:function', got {spec!r}")
    rows = list(rows)
    if not rows or not all(isinstance(r, dict) for r in rows):
        raise ConfigError(f"{what} {spec!r}: expected a non-empty list of dicts (rows), got {str(rows)[:100]}")
    return rows


def row_tasks(rows: list[dict], name: str) -> list[Task]:
    tasks = []
    for i, row in enumerate(rows):
        prompt = row.get("prompt", row.get("question"))
        if isinstance(prompt, list):
            prompt = next((m.get("content") for m in reversed(prompt) if m.get("role") == "user"), "")
        if not isinstance(prompt, str) or not prompt.strip():
            raise ConfigError(f"task tool_env: row {i} has no prompt (a 'prompt' or 'question' string)")
        tasks.append(Task(id=f"{name}/{row.get('id', i)}", question=prompt, answer=row.get("answer"),
                          meta={"data_source": name, "row": dict(row)}))
    return tasks


def _score(task: Task, answer: str | None) -> dict:
    raise ConfigError(f"task tool_env: the environment gives the reward; run it with workflow environment ({task.id})")


def tool_env_source(cfg: TaskConfig, sft_teacher: dict) -> TaskSource:
    from masrl.usercode.imports import import_object

    from masrl.tasks.environments import require
    from masrl.usercode.teacher import load_teacher

    require("openai", "openai", "task tool_env")  # the episodes' client
    params = cfg.params
    unknown = sorted(set(params) - _KNOWN)
    if unknown:
        raise ConfigError(f"task.params for tool_env: unknown keys {unknown}; known: {sorted(_KNOWN)}")
    if (params.get("env") is None) == (params.get("url") is None):
        raise ConfigError("task tool_env: set exactly one of task.params.env ('module:Class' or 'file.py:Class') and "
                          "task.params.url (an OpenEnv server: http://HOST:PORT)")
    cls = None
    if params.get("url") is not None:
        require("openenv.core.mcp_client", "openenv", "task tool_env with a url")
    else:
        cls = import_object(str(params["env"]), "task.params.env")
        if not inspect.isclass(cls) or not callable(getattr(cls, "reset", None)):
            raise ConfigError(f"task.params.env {params['env']!r} is not a class with a reset method")
    if "train" not in params:
        raise ConfigError("task tool_env: set task.params.train (a JSON Lines file or 'module:function' of rows)")
    reward = import_object(params["reward"], "task.params.reward") if params.get("reward") else None
    max_turns = params.get("max_turns", 8)
    if isinstance(max_turns, bool) or not isinstance(max_turns, int) or not 1 <= max_turns <= 1000:
        raise ConfigError(f"task.params.max_turns must be an integer in 1..1000, got {max_turns!r}")
    name = str(params["env"]).rpartition(":")[2] if cls is not None else "openenv"
    train = row_tasks(_rows(params["train"], "task.params.train"), name)
    test = row_tasks(_rows(params["test"], "task.params.test"), name) if params.get("test") else list(train)
    teacher = load_teacher(params.get("teacher"), sft_teacher)
    return TaskSource("tool_env", train, test, _score, teacher,
                      {"env_episode": ToolGame(cls, reward, max_turns, params.get("url"))})
