"""What the gateway accepts of a request, checked before anything is rendered or generated: every field of every
message (role, content, name, tool_calls, tool_call_id, ...), the tools, the numbers. A request that breaks a rule
is a ``masrl.gateway.errors.GatewayError`` 400 naming the field (``param``), so nothing malformed is ever
rendered into a chat template or trained on."""
from __future__ import annotations

import json
from typing import Any

from masrl.gateway.errors import GatewayError

MAX_N = 16
ROLES = ("system", "developer", "user", "assistant", "tool")
# OpenAI request fields: served, or accepted and not applied (sampling is the agent's config); others are a 400
_COMMON = {"model", "n", "temperature", "top_p", "max_tokens", "stop", "logprobs", "seed", "presence_penalty",
           "frequency_penalty", "user", "logit_bias", "stream", "stream_options", "metadata", "store", "service_tier"}
CHAT_FIELDS = _COMMON | {"messages", "tools", "tool_choice", "parallel_tool_calls", "top_logprobs",
                         "max_completion_tokens", "response_format", "reasoning_effort", "modalities", "prediction"}
COMPLETION_FIELDS = _COMMON | {"prompt", "suffix", "echo", "best_of"}
# the fields OpenAI defines for a message of each role; a field given as null counts as absent
MESSAGE_FIELDS = {"system": {"role", "content", "name"}, "developer": {"role", "content", "name"},
                  "user": {"role", "content", "name"},
                  "assistant": {"role", "content", "name", "tool_calls", "refusal", "function_call", "audio"},
                  "tool": {"role", "content", "tool_call_id", "name"}}  # name: the tool's, as vLLM, TRL and verifiers send


def json_object(body: bytes) -> dict:
    try:
        request = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise GatewayError(400, f"the body is not JSON ({type(e).__name__})") from None
    if not isinstance(request, dict):
        raise GatewayError(400, "the body must be a JSON object")
    return request


def known_fields(request: dict, chat: bool) -> None:
    unknown = sorted(map(str, set(request) - (CHAT_FIELDS if chat else COMPLETION_FIELDS)))
    if unknown:
        raise GatewayError(400, f"unrecognized request argument(s): {', '.join(unknown)[:200]}",
                           "unknown_parameter", param=unknown[0][:100])
    if request.get("stream"):
        raise GatewayError(400, "stream is not supported by the masrl gateway; send stream: false", param="stream")


def bounded_int(value: Any, name: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise GatewayError(400, f"{name} must be an integer in {low}..{high}, got {str(value)[:40]!r}", param=name)
    return value


def _bad(where: str, what: str) -> GatewayError:
    return GatewayError(400, f"{where} {what}", param=where)


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and
                                         isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise _bad(f"{where}.content", "must be a string or a list of text parts ({\"type\": \"text\", \"text\": ...})")


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise _bad(where, f"must be a string, got {type(value).__name__}")
    return value


def _tool_calls(calls: Any, where: str) -> list[dict]:
    """OpenAI's ``tool_calls``: a list of ``{"id": str, "type": "function", "function": {"name": str,
    "arguments": str}}`` (the arguments a JSON text, as the API sends them)."""
    if not isinstance(calls, list):
        raise _bad(where, f"must be a list of tool calls, got {type(calls).__name__}")
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        if not isinstance(call, dict):
            raise _bad(at, f"must be an object {{id, type, function}}, got {type(call).__name__}")
        extra = sorted(map(str, set(call) - {"id", "type", "function"}))
        if extra:
            raise _bad(f"{at}.{extra[0][:60]}", "is not a field of a tool call (id, type, function)")
        _string(call.get("id"), f"{at}.id")
        if call.get("type", "function") != "function":
            raise _bad(f"{at}.type", "must be \"function\"")
        function = call.get("function")
        if not isinstance(function, dict) or set(function) - {"name", "arguments"}:
            raise _bad(f"{at}.function", "must be an object {name, arguments}")
        if not _string(function.get("name"), f"{at}.function.name"):
            raise _bad(f"{at}.function.name", "must not be empty")
        _string(function.get("arguments"), f"{at}.function.arguments")
    return calls


def _message(m: Any, i: int) -> dict:
    where = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise GatewayError(400, f"{where} must be an object with a role in {list(ROLES)}", param=where)
    role = m["role"]
    given = {k: v for k, v in m.items() if v is not None}
    unknown = sorted(map(str, set(given) - MESSAGE_FIELDS[role]))
    if unknown:
        raise _bad(f"{where}.{unknown[0][:60]}", f"is not a field of a {role} message (its fields: "
                                                 f"{', '.join(sorted(MESSAGE_FIELDS[role]))})")
    for unsupported, instead in (("function_call", "send tool_calls"), ("audio", "send text content")):
        if unsupported in given:
            raise _bad(f"{where}.{unsupported}", f"is not supported by the masrl gateway; {instead}")
    msg = {"role": "system" if role == "developer" else role, "content": _content(m.get("content"), where)}
    for name in ("name", "tool_call_id", "refusal"):
        if name in given:
            _string(given[name], f"{where}.{name}")
    for name in ("name", "tool_call_id"):
        if name in given:
            msg[name] = given[name]
    if "tool_calls" in given:
        msg["tool_calls"] = _tool_calls(given["tool_calls"], f"{where}.tool_calls")
    return msg


def messages(value: Any) -> list[dict]:
    """The conversation, every field of every message checked (a 400 naming the first bad one); ``developer``
    becomes ``system``, content parts are joined."""
    if not isinstance(value, list) or not value:
        raise GatewayError(400, "messages must be a non-empty list", param="messages")
    return [_message(m, i) for i, m in enumerate(value)]


def tools(value: Any) -> list[dict] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(t, dict) and isinstance(t.get("function"), dict)
                                              and isinstance(t["function"].get("name"), str) for t in value):
        raise GatewayError(400, "tools must be a list of {type: function, function: {name, parameters}}",
                           param="tools")
    for i, t in enumerate(value):
        function = t["function"]
        if t.get("type", "function") != "function":
            raise _bad(f"tools[{i}].type", "must be \"function\"")
        if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
            raise _bad(f"tools[{i}].function.parameters", "must be a JSON schema object")
        if function.get("description") is not None:
            _string(function["description"], f"tools[{i}].function.description")
    return value


def prompt(value: Any) -> str:
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if not isinstance(value, str):
        raise GatewayError(400, "prompt must be a string (one prompt per request)", param="prompt")
    return value
