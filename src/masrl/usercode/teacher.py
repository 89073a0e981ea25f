"""Cold-start demonstrations for an environment task (``verifiers``, ``tool_env``): a teacher written beside the
environment, answering the agent's calls while the environment's own episodes run through the gateway.

    task:
      name: tool_env                                   # or verifiers
      params:
        teacher: examples/tool_env_guess.py:teacher    # module:function or file.py:function
    sft: {steps: 300, batch_size: 32, teacher: {slip_rate: 0.2, seed: 0}}   # the function's options; seed: its rng

``function(agent, messages, row, rng, **options)`` returns the agent's next message:

* ``agent``: the masrl agent called (an environment's ``model``); ``row``: the task's environment row (the
  verifiers row with ``prompt``, ``answer``, ``info``; the tool environment's row);
* ``messages``: the conversation so far as chat messages (a conversation with tools: the tool results included);
  a call without tools shows the prompt as the model reads it, as one user message;
* ``rng``: a ``random.Random`` for the teacher's deliberate noise (seeded by ``sft.teacher.seed``; one stream per
  task when demonstrations are collected concurrently, so the rows do not depend on timing);
* ``options``: ``sft.teacher`` without ``seed``.

It returns the text to write, or one tool call ``{"name": ..., "arguments": {...}}`` (written in the Hermes
format the gateway parses). Demonstrations, as with every teacher, are one SFT row per agent call. The function is
user code: each reply runs in a worker of the service with a deadline (``TIMEOUT_S``), and what it raises,
``SystemExit`` included, fails that demonstration episode only.
"""
from __future__ import annotations

import inspect
import json
import random
from typing import Any, Callable

from masrl.errors import ConfigError
from masrl.types import Task
from masrl.usercode.calls import call_in_thread
from masrl.usercode.imports import import_object

TIMEOUT_S = 60.0  # one reply of the teacher (the episode it answers has its own deadline, workflow.params.timeout_s)


class EnvTeacher:
    """A teacher function of an environment task as masrl's ``Teacher`` (``reply(agent, prompt, task)``)."""

    def __init__(self, fn: Callable, options: dict, what: str):
        options = dict(options)
        seed = options.pop("seed", 0)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ConfigError(f"sft.teacher.seed must be an integer, got {seed!r}")
        try:
            inspect.signature(fn).bind("agent", [], {}, None, **options)
        except TypeError as e:
            raise ConfigError(f"{what}: the teacher must take (agent, messages, row, rng, **options) with the options "
                              f"of sft.teacher {sorted(options)}: {e}") from None
        except ValueError:  # no signature to read (a builtin): called as it is
            pass
        self.fn, self.options, self.what = fn, options, what
        self.rng = random.Random(seed)

    def reply(self, agent: str, prompt: Any, task: Task) -> str:
        messages = prompt.messages if hasattr(prompt, "messages") else [{"role": "user", "content": str(prompt)}]
        row = dict(task.meta.get("row") or {})
        # user code: in a worker of the service (its exceptions, SystemExit included, come back as errors)
        out = call_in_thread(lambda: self.fn(agent, [dict(m) for m in messages], row, self.rng, **self.options), (),
                             TIMEOUT_S, kind="environment", what=self.what)
        if isinstance(out, dict) and isinstance(out.get("name"), str):
            # the Hermes format (as masrl.tools.render_tool_call writes it: tasks sit below tools)
            return "<tool_call>\n" + json.dumps({"name": out["name"], "arguments": dict(out.get("arguments") or {})}) \
                + "\n</tool_call>"
        if not isinstance(out, str):
            raise ConfigError(f"{self.what}: the teacher returned {type(out).__name__}; expected the message text or "
                              "a tool call {'name': ..., 'arguments': {...}}")
        return out


def load_teacher(spec: Any, options: dict, what: str = "task.params.teacher") -> Callable | None:
    """The ``Teacher`` of ``task.params.teacher`` (None when unset)."""
    if spec is None:
        return None
    if not isinstance(spec, str) or ":" not in spec:
        raise ConfigError(f"{what} must be 'module:function' or 'file.py:function', got {spec!r}")
    fn = import_object(spec, what)
    if not callable(fn):
        raise ConfigError(f"{what} {spec!r} is not callable")
    return EnvTeacher(fn, options, what).reply
