"""The tool-call loop behind ``team.chat``: model -> tool calls -> tool messages -> model ...

    messages = [{"role": "user", "content": task.question}]
    result = await team.chat("Solver", messages, tools=[calculator])
    answer = extract_boxed(result.text)

Each model call is one ``Turn`` (recorded by ``team.call``) whose prompt is
the whole conversation so far, rendered with the policy's chat template (see
``masrl.tools.chat_format``); the reply is appended to ``messages`` (in place, so the
workflow keeps the agent's history across ``chat`` calls) as an assistant message with the
text the model wrote; the next call's prompt ids extend this call's prompt and reply ids token
for token (``ChatPrefix``). When the reply has tool calls they are run in order and each result is
appended as a ``tool`` message, then the model is called again; a reply without a call ends
the loop. Tool output is only ever in later prompts, never in a response, so it is not trained.

A malformed call, an unknown tool or arguments against the schema becomes a tool message
``Error: ...`` and marks the turn invalid (format penalty). A tool that raises or times out
is reported the same way but the turn stays valid (the call was well formed). The deadline
of one call is ``timeout_s``, default ``team.params["tool_timeout_s"]``, else the run's
``tools.timeout_s`` (5 s). Every attempt counts toward the episode's cap (``max_calls``,
default ``team.params["max_tool_calls"]`` or 8); a reply with calls beyond the cap ends the
loop (``stop="call_limit"``) and the calls left over are not run (counted as ``dropped`` in
``team.tool_counts``, with the attempts past the parser's 32 per reply).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from masrl.tools import FORMATS, ToolBox, ToolResult, parse_tool_calls, tool_schemas
from masrl.tools.chat_format import ChatPrefix, ChatPrompt
from masrl.types import Turn

if TYPE_CHECKING:
    from masrl.workflows.base import Team

DEFAULT_MAX_TOOL_CALLS = 8


@dataclass
class ChatResult:
    """What one ``team.chat`` produced. ``stop``: ``answer`` (a reply without calls) or ``call_limit``."""

    text: str
    turns: list[Turn] = field(default_factory=list)
    results: list[ToolResult] = field(default_factory=list)
    stop: str = "answer"

    @property
    def valid(self) -> bool:
        return all(t.valid for t in self.turns)


async def run_chat(team: "Team", agent: str, messages: list[dict], tools: Sequence[Any] | ToolBox = (), *,
                   max_calls: int | None = None, timeout_s: float | None = None,
                   formats: Sequence[str] = FORMATS) -> ChatResult:
    """Run the call loop for ``agent`` on ``messages`` (extended in place); see the module docstring."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"team.chat({agent!r}, messages): messages must be a non-empty list of "
                         "{'role': ..., 'content': ...} dicts")
    box = tools if isinstance(tools, ToolBox) else ToolBox(
        tools, timeout_s=timeout_s or team.params.get("tool_timeout_s", team.tool_timeout_s))
    cap = max_calls if max_calls is not None else team.params.get("max_tool_calls", DEFAULT_MAX_TOOL_CALLS)
    schemas = tool_schemas(box.tools) or None
    out = ChatResult(text="")
    prefix = None
    while True:
        turn = await team.call(agent, ChatPrompt(list(messages), schemas, prefix=prefix))
        out.turns.append(turn)
        out.text = turn.text
        prefix = ChatPrefix.of(turn, len(messages))
        messages.append({"role": "assistant", "content": turn.text})
        parsed = parse_tool_calls(turn.text, box.tools, formats)
        if not parsed.attempted:
            return out
        if parsed.errors:
            turn.valid = False
        attempts = parsed.in_order()
        room = max(0, cap - team.tool_calls)
        team.tool_counts.dropped += parsed.dropped + max(0, len(attempts) - room)
        ran = []
        for attempt in attempts[:room]:
            result = await box.arun(attempt)
            team.tool_calls += 1
            team.tool_counts.add(result)
            ran.append(result)
            messages.append(result.message())
        out.results += ran
        turn.info["tool_calls"] = [{"name": r.name, "status": r.status} for r in ran]
        if len(attempts) > room:
            turn.info["tool_call_limit"] = True
            out.stop = "call_limit"
            return out
