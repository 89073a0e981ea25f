"""Running parsed tool calls: a deadline per call, a cap on calls per episode, tool messages.

Pure-Python tools run in a daemon thread that the caller waits for until the deadline; a tool
past its deadline is reported as a timeout and left to finish in the background (its result
is dropped), so a tool must not hold resources it cannot release on its own. Tools that
execute untrusted code go through the sandbox (:func:`masrl.tools.builtin.python_tool`),
which enforces its own time and memory limits in a separate process.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from masrl.tools.core import Tool, as_tools
from masrl.tools.parsing import CallError, ToolCall


@dataclass
class ToolResult:
    """The outcome of one call. ``status``: ok | error (the tool raised) | timeout | invalid
    (malformed call, unknown tool, bad arguments) | limit (over the per-episode cap)."""

    name: str | None
    content: str
    status: str = "ok"
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def message(self) -> dict:
        """The chat message that carries this result (role ``tool``)."""
        return {"role": "tool", "name": self.name or "unknown", "content": self.content}


class ToolBox:
    """The tools an agent may call, with the execution limits.

    ``timeout_s``: default deadline per call (a tool's own ``timeout_s`` wins);
    ``max_result_chars``: longer results are cut, with a note saying so.
    """

    def __init__(self, tools: Sequence[Tool] | Mapping[str, Tool], *, timeout_s: float = 10.0,
                 max_result_chars: int = 4000):
        if timeout_s <= 0:
            raise ValueError(f"tool timeout_s must be > 0, got {timeout_s}")
        self.tools = as_tools(tools)
        self.timeout_s = timeout_s
        self.max_result_chars = max_result_chars

    def run(self, call: ToolCall | CallError) -> ToolResult:
        """Execute one parsed call (a :class:`CallError` becomes an ``invalid`` result). Never raises."""
        if isinstance(call, CallError):
            return ToolResult(call.name, f"Error: {call.message}", "invalid")
        t = self.tools.get(call.name)
        if t is None:  # parsed without the tool list
            return ToolResult(call.name, f"Error: unknown tool {call.name!r}; tools: {sorted(self.tools)}", "invalid")
        return self._run_with_deadline(t, call.arguments, t.timeout_s or self.timeout_s)

    def _run_with_deadline(self, t: Tool, arguments: dict, timeout_s: float) -> ToolResult:
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["value"] = t(**arguments)
            except BaseException as e:  # noqa: BLE001 - anything the tool does is reported to the model
                box["error"] = e

        t0 = time.monotonic()
        worker = threading.Thread(target=target, name=f"tool-{t.name}", daemon=True)
        worker.start()
        worker.join(timeout_s)
        duration = time.monotonic() - t0
        if worker.is_alive():
            return ToolResult(t.name, f"Error: {t.name} timed out after {timeout_s:g} s", "timeout", duration)
        if "error" in box:
            e = box["error"]
            return ToolResult(t.name, self._cut(f"Error: {type(e).__name__}: {e}"), "error", duration)
        return ToolResult(t.name, self._cut(format_result(box.get("value"))), "ok", duration)

    def _cut(self, text: str) -> str:
        if len(text) <= self.max_result_chars:
            return text
        return text[:self.max_result_chars] + f"\n[cut: {len(text)} characters, showing {self.max_result_chars}]"


def format_result(value: Any) -> str:
    """A tool's return value as message text: strings as they are, anything else as JSON."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        try:
            return str(value)
        except ValueError as e:  # e.g. an integer over Python's digit limit
            return f"Error: the result cannot be shown ({e})"
