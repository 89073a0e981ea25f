"""Running parsed tool calls: a deadline per call, a cap on calls per episode, tool messages.

Pure-Python tools run through the user-code service (``masrl.usercode.calls.call_in_thread``, kind
``tool``): a worker thread of the tool that the caller waits for until the deadline; a tool past its
deadline is reported as a timeout and left to finish in the background (its result is dropped;
``abandoned_tool_threads`` counts those still running, and past the service's bound,
``masrl.usercode.calls.MAX_ABANDONED``, further calls are refused rather than piling up threads), so a
tool must not hold resources it cannot release on its own. ``SystemExit`` or ``KeyboardInterrupt``
raised by a tool is an error observation. Tools that execute untrusted code go through the sandbox
(``masrl.tools.builtin.python_tool``), which enforces its own time and memory limits in a separate
process.

Every way out of a call is a string observation (``ToolBox.run`` never raises): the value is
turned into text in the worker thread too (so a ``__str__`` that hangs is bounded by the
deadline), with ``format_result``; a ``str`` subclass with broken methods, bytes, a result
too large (cut, with a note) and lone surrogates (U+FFFD) all give valid UTF-8 text. A result
(or a part of it) that cannot be printed (its ``str()`` raises) is a tool error, not an ``ok``
observation with a placeholder.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

from masrl.tools.core import Tool, as_tools
from masrl.tools.parsing import CallError, ToolCall
from masrl.tools.text import safe_str, valid_text
from masrl.usercode.calls import MAX_ABANDONED, UserCodeTimeout, abandoned, call_async, call_in_thread

DEFAULT_TIMEOUT_S = 5.0


class UnprintableResult(ValueError):
    """A tool's result (or a value inside it) whose ``str()`` raises: the call is a tool error."""


def abandoned_tool_threads() -> int:
    """Tool threads of this process still running past their deadline (their results will be dropped)."""
    return abandoned("tool")


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


@dataclass
class ToolCounts:
    """Tool calls counted per episode (``Episode.tool_counts``) and per step (``tool/*`` metrics): ``calls``
    run or answered, of which ``errors`` (the tool raised, or its result could not be shown), ``timeouts``
    (past the deadline; the thread is abandoned) and ``invalid`` (malformed, unknown tool, bad arguments);
    ``dropped``: call attempts past the per-reply cap, not read."""

    calls: int = 0
    errors: int = 0
    timeouts: int = 0
    invalid: int = 0
    dropped: int = 0

    def add(self, result: ToolResult) -> None:
        self.calls += 1
        self.errors += result.status == "error"
        self.timeouts += result.status == "timeout"
        self.invalid += result.status == "invalid"

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class ToolBox:
    """The tools an agent may call, with the execution limits.

    ``timeout_s``: default deadline per call (a tool's own ``timeout_s`` wins);
    ``max_result_chars``: longer results are cut, with a note saying so. ``counts``: the calls run so far.
    """

    def __init__(self, tools: Sequence[Tool] | Mapping[str, Tool], *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 max_result_chars: int = 4000):
        if not 0 < timeout_s < float("inf"):
            raise ValueError(f"tool timeout_s must be a finite number > 0, got {timeout_s}")
        self.tools = as_tools(tools)
        self.timeout_s = timeout_s
        self.max_result_chars = max_result_chars
        self.counts = ToolCounts()

    def run(self, call: ToolCall | CallError) -> ToolResult:
        """Execute one parsed call (a ``CallError`` becomes an ``invalid`` result). Never raises."""
        try:
            ready = self._prepare(call)
            if not isinstance(ready, ToolResult):
                t, arguments, timeout_s = ready
                t0 = time.monotonic()
                try:
                    text = call_in_thread(self._observed, (t, arguments), timeout_s, kind="tool",
                                          what=f"tool {t.name}")
                except Exception as e:  # noqa: BLE001 - anything the tool does is reported to the model
                    ready = self._failed(t, e, timeout_s, t0)
                else:
                    ready = ToolResult(t.name, text, "ok", time.monotonic() - t0)
        except Exception as e:  # noqa: BLE001 - a call that cannot even start is an observation too
            ready = self._unstarted(call, e)
        self.counts.add(ready)
        return ready

    async def arun(self, call: ToolCall | CallError) -> ToolResult:
        """``run`` awaited on the running event loop, which keeps running while the tool does (``run``
        keeps the tool's deadline; a worker thread per concurrent call, so no shared pool leaves calls queued)."""
        what = f"tool call {getattr(call, 'name', '')}"
        return await call_async(self.run, (call,), None, kind="tool_runner", what=what)

    def _prepare(self, call: ToolCall | CallError) -> "ToolResult | tuple[Tool, dict, float]":
        """A result already (invalid, unknown, refused), or the tool, its arguments and its deadline."""
        if isinstance(call, CallError):
            return ToolResult(call.name, valid_text(f"Error: {call.message}"), "invalid")
        t = self.tools.get(call.name)
        if t is None:  # parsed without the tool list
            return ToolResult(call.name, valid_text(f"Error: unknown tool {call.name!r}; tools: {sorted(self.tools)}"),
                              "invalid")
        running = abandoned_tool_threads()
        if running >= MAX_ABANDONED:
            return ToolResult(t.name, f"Error: {t.name} was not run: {running} tool calls are still running past "
                                      "their deadline", "error")
        return t, call.arguments, t.timeout_s or self.timeout_s

    def _observed(self, t: Tool, arguments: dict) -> str:
        """The tool's result as text, made in the call's thread (within the deadline)."""
        return self.observe(t(**arguments))

    def _failed(self, t: Tool, error: Exception, timeout_s: float, t0: float) -> ToolResult:
        if isinstance(error, UserCodeTimeout):
            return ToolResult(t.name, f"Error: {t.name} timed out after {timeout_s:g} s", "timeout",
                              time.monotonic() - t0)
        text = self._cut(f"Error: {safe_str(type(error).__name__)}: {safe_str(error, self.max_result_chars)}")
        return ToolResult(t.name, text, "error", time.monotonic() - t0)

    @staticmethod
    def _unstarted(call: ToolCall | CallError, error: Exception) -> ToolResult:
        name = getattr(call, "name", None)
        return ToolResult(safe_str(name, 200) if isinstance(name, str) else None,
                          f"Error: the call could not run ({safe_str(error, 300)})", "error")

    def observe(self, value: Any) -> str:
        """The observation text of a tool's return value: ``format_result``, cut to ``max_result_chars``."""
        return self._cut(format_result(value))

    def _cut(self, text: str) -> str:
        if len(text) <= self.max_result_chars:
            return valid_text(text)
        return valid_text(text[:self.max_result_chars]) + \
            f"\n[cut: {len(text)} characters, showing {self.max_result_chars}]"


def format_result(value: Any) -> str:
    """A tool's return value as message text: strings as they are, bytes as UTF-8 (bad bytes replaced),
    anything else as JSON (what JSON cannot encode by its ``str()``); the text is an exact ``str`` (lone
    surrogates are kept here; ``ToolBox.observe`` replaces them). ``UnprintableResult`` when a value
    of it cannot be printed (its ``str()`` raises): that is the tool's error."""
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).decode("utf-8", "replace")
    try:
        return json.dumps(value, ensure_ascii=False, default=_printed)
    except UnprintableResult:
        raise
    except Exception:  # noqa: BLE001 - keys JSON cannot take, cycles, digits past Python's limit, deep nesting
        return _printed(value)


def _printed(value: Any) -> str:
    """``str(value)`` as an exact ``str``; ``UnprintableResult`` when it raises."""
    try:
        text = str(value)
        return text if type(text) is str else str.__str__(text)
    except Exception as e:  # noqa: BLE001 - any way an object fails to print
        raise UnprintableResult(f"the tool returned a {safe_str(type(value).__name__, 100)} that cannot be shown "
                                f"as text (str() raised {safe_str(type(e).__name__, 100)})") from None
