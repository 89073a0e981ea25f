"""Tool calls in model output: parse them (never raising, linear time) and render them.

Formats (``formats=`` of ``parse_tool_calls``, tried in this order):

- ``hermes`` (Hermes, Qwen2.5/Qwen3, SmolLM3 templates): one or more
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks anywhere in the reply.
- ``json`` (Llama-3.1/3.2 style and bare JSON): the whole reply (after an optional
  ``<|python_tag|>`` and a code fence) is a call object ``{"name": ..., "arguments": {...}}``
  or ``{"name": ..., "parameters": {...}}``, several of them separated by ``;`` or
  whitespace, or a JSON list of them. Only a reply that starts with ``{`` or ``[`` and
  contains ``"name"`` counts as an attempt, so ordinary answers are not read as calls.

A reply either has no call attempt (``attempted`` is False: a final answer), or every
attempt becomes a ``ToolCall`` or a ``CallError`` (malformed JSON, no name,
arguments that are not an object, an unknown tool, arguments against the schema). At most
``MAX_ATTEMPTS`` attempts are read from one reply, in every format (``<tool_call>`` blocks, a
sequence of JSON objects, the items of a JSON list): past it one error says how many more there
were (``ParsedCalls.dropped``; for a sequence of JSON objects at least 1: the rest is not read).
Scanning uses ``str.find`` and ``json`` decoding only, so the time is linear in the text.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from masrl.tools.core import Tool, check_arguments

FORMATS = ("hermes", "json")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_RAW_LIMIT = 200  # characters of the offending text kept in an error
MAX_ATTEMPTS = 32  # call attempts read from one reply; more is one error and the rest is not read


@dataclass
class ToolCall:
    """One well-formed call: the tool's name and its arguments (``position``: offset in the reply)."""

    name: str
    arguments: dict[str, Any]
    position: int = 0


@dataclass
class CallError:
    """One call attempt that cannot run; ``message`` is what the model is told."""

    message: str
    raw: str = ""
    position: int = 0
    name: str | None = None


@dataclass
class ParsedCalls:
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[CallError] = field(default_factory=list)
    format: str | None = None  # the format the attempts were read in
    dropped: int = 0  # call attempts past MAX_ATTEMPTS, not read

    @property
    def attempted(self) -> bool:
        return bool(self.calls or self.errors)

    def in_order(self) -> list[ToolCall | CallError]:
        """Calls and errors in the order they appear in the reply."""
        return sorted([*self.calls, *self.errors], key=lambda c: c.position)


def parse_tool_calls(text: Any, tools: Mapping[str, Tool] | None = None,
                     formats: Sequence[str] = FORMATS) -> ParsedCalls:
    """The tool calls in ``text``; with ``tools``, names and arguments are checked against them.

    Never raises on any ``text`` (non-strings have no calls).
    """
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise ValueError(f"unknown tool-call formats {unknown}; known: {list(FORMATS)}")
    if not isinstance(text, str):
        return ParsedCalls()
    for fmt in formats:
        found = _hermes(text) if fmt == "hermes" else _bare_json(text)
        if found.attempted:
            found.format = fmt
            if tools is not None:
                _check_against(found, tools)
            return found
    return ParsedCalls()


def _hermes(text: str) -> ParsedCalls:
    out = ParsedCalls()
    pos = text.find(HERMES_OPEN)
    while pos >= 0:
        if _too_many(out, pos, text.count(HERMES_OPEN, pos)):
            break
        start = pos + len(HERMES_OPEN)
        end = text.find(HERMES_CLOSE, start)
        if end < 0:
            out.errors.append(CallError(f"{HERMES_OPEN} without {HERMES_CLOSE}", text[start:start + _RAW_LIMIT], pos))
            break
        _add(out, text[start:end], pos)
        pos = text.find(HERMES_OPEN, end + len(HERMES_CLOSE))
    return out


def _bare_json(text: str) -> ParsedCalls:
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].strip()
    if body.startswith("```"):
        body = body[3:].removeprefix("json").strip().removesuffix("```").strip()
    out = ParsedCalls()
    if not body.startswith(("{", "[")) or '"name"' not in body:
        return out
    decoder = json.JSONDecoder()
    pos = 0
    while pos < len(body):
        if _too_many(out, pos, 1, "the rest of the reply was not read"):
            break
        try:
            value, end = decoder.raw_decode(body, pos)
        except (ValueError, RecursionError) as e:
            out.errors.append(CallError(f"malformed JSON: {_short(e)}", body[pos:pos + _RAW_LIMIT], pos))
            return out
        items = value if isinstance(value, list) else [value]
        for i, item in enumerate(items):
            if _too_many(out, pos, len(items) - i):
                return out
            _add_value(out, item, body[pos:end], pos)
        pos = _skip_separators(body, end)
    return out


def _too_many(out: ParsedCalls, position: int, left: int, note: str = "") -> bool:
    """Whether the reply is at its cap; then one error says so and ``left`` attempts count as dropped."""
    if len(out.calls) + len(out.errors) < MAX_ATTEMPTS:
        return False
    out.dropped += left
    what = note or f"{left} more {'was' if left == 1 else 'were'} dropped"
    out.errors.append(CallError(f"more than {MAX_ATTEMPTS} tool calls in one reply: the first {MAX_ATTEMPTS} "
                                f"were read, {what}", position=position))
    return True


def _skip_separators(body: str, pos: int) -> int:
    n = len(body)
    while pos < n and (body[pos].isspace() or body[pos] == ";"):
        pos += 1
    return pos


def _add(out: ParsedCalls, raw: str, position: int) -> None:
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError) as e:
        out.errors.append(CallError(f"malformed JSON: {_short(e)}", raw[:_RAW_LIMIT], position))
        return
    _add_value(out, value, raw, position)


def _add_value(out: ParsedCalls, value: Any, raw: str, position: int) -> None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        out.errors.append(CallError('a call must be a JSON object {"name": ..., "arguments": {...}}',
                                    raw[:_RAW_LIMIT], position))
        return
    key = "arguments" if "arguments" in value else "parameters" if "parameters" in value else None
    args = value.get(key, {}) if key else {}
    if isinstance(args, str):  # some templates write the arguments as a JSON string
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            pass
    if not isinstance(args, dict):
        out.errors.append(CallError(f"the arguments of {value['name']!r} must be a JSON object",
                                    raw[:_RAW_LIMIT], position, value["name"]))
        return
    out.calls.append(ToolCall(value["name"], args, position))


def _check_against(found: ParsedCalls, tools: Mapping[str, Tool]) -> None:
    keep = []
    for call in found.calls:
        t = tools.get(call.name)
        if t is None:
            found.errors.append(CallError(f"unknown tool {call.name!r}; tools: {sorted(tools)}"[:300],
                                          position=call.position, name=call.name))
            continue
        problems = check_arguments(t.parameters, call.arguments)
        if problems:
            found.errors.append(CallError(f"bad arguments for {call.name!r}: " + "; ".join(problems)[:300],
                                          position=call.position, name=call.name))
            continue
        keep.append(call)
    found.calls = keep


def _short(e: Exception) -> str:
    return (str(e) or type(e).__name__)[:120]


def render_tool_call(name: str, arguments: Mapping[str, Any], fmt: str = "hermes") -> str:
    """The text of one call in ``fmt``: ``hermes``, ``json`` (``"arguments"``) or ``llama`` (``"parameters"``)."""
    if fmt == "hermes":
        return f"{HERMES_OPEN}\n{json.dumps({'name': name, 'arguments': dict(arguments)})}\n{HERMES_CLOSE}"
    if fmt == "json":
        return json.dumps({"name": name, "arguments": dict(arguments)})
    if fmt == "llama":
        return json.dumps({"name": name, "parameters": dict(arguments)})
    raise ValueError(f"unknown tool-call format {fmt!r}; known: hermes, json, llama")
