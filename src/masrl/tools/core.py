"""Tools: Python functions an agent can call, with the JSON schema chat templates expect.

A tool is a plain function with type hints and a Google-style docstring (``Args:`` describes
every parameter); its schema is the OpenAI / Hugging Face function-calling format that
``tokenizer.apply_chat_template(messages, tools=[...])`` accepts, built by
``transformers.utils.get_json_schema``::

    @tool
    def add(a: int, b: int) -> int:
        \"\"\"Add two integers.

        Args:
            a: The first integer.
            b: The second integer.
        \"\"\"
        return a + b

    add.schema["function"]["parameters"]["required"]  # ['a', 'b']

Arguments parsed from model output are checked against the schema (``check_arguments``)
before the function runs: a wrong type, a missing or an unexpected argument is the model's
format error, never an exception inside the tool.
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Mapping, Sequence

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
    "array": (list,), "object": (dict,), "null": (type(None),),
}


class ToolDefinitionError(ValueError):
    """A function cannot be used as a tool (no docstring for an argument, unsupported type hint, ...)."""


class Tool:
    """A callable tool: ``fn`` with its ``name``, ``schema`` and an optional time limit.

    ``timeout_s`` overrides the executor's default deadline for this tool (a tool that has
    its own limit, like the sandboxed ``python`` tool, sets it a little above that limit).
    """

    def __init__(self, fn: Callable[..., Any], *, name: str | None = None, description: str | None = None,
                 timeout_s: float | None = None):
        from transformers.utils import get_json_schema

        try:
            schema = get_json_schema(fn)
        except Exception as e:  # DocstringParsingException, TypeHintParsingException
            raise ToolDefinitionError(f"tool {getattr(fn, '__name__', fn)!r}: {e}. A tool needs type hints on "
                                      "every argument and a docstring with an 'Args:' line per argument") from e
        schema["function"].pop("return", None)  # not part of the function-calling format
        if name is not None:
            schema["function"]["name"] = name
        if description is not None:
            schema["function"]["description"] = description
        self.fn = fn
        self.schema: dict = schema
        self.timeout_s = timeout_s

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]

    @property
    def parameters(self) -> dict:
        return self.schema["function"]["parameters"]

    def __call__(self, **arguments: Any) -> Any:
        return self.fn(**arguments)

    def __repr__(self) -> str:
        return f"Tool({self.name!r})"


def tool(fn: Callable[..., Any] | None = None, *, name: str | None = None, description: str | None = None,
         timeout_s: float | None = None):
    """Decorator: ``@tool`` or ``@tool(name=..., timeout_s=...)`` turns a function into a ``Tool``."""
    if fn is None:
        return lambda f: Tool(f, name=name, description=description, timeout_s=timeout_s)
    return Tool(fn, name=name, description=description, timeout_s=timeout_s)


def as_tools(tools: Sequence[Tool | Callable] | Mapping[str, Tool] | None) -> dict[str, Tool]:
    """``{name: Tool}`` from tools or plain functions; two tools with one name is an error."""
    if tools is None:
        return {}
    items = tools.values() if isinstance(tools, Mapping) else tools
    out: dict[str, Tool] = {}
    for t in items:
        t = t if isinstance(t, Tool) else Tool(t)
        if t.name in out:
            raise ToolDefinitionError(f"two tools are named {t.name!r}; give one of them another name")
        out[t.name] = t
    return out


def tool_schemas(tools: Mapping[str, Tool]) -> list[dict]:
    """The schemas to pass as ``apply_chat_template(..., tools=...)`` (copies; templates may not mutate ours)."""
    return [copy.deepcopy(t.schema) for t in tools.values()]


def check_arguments(parameters: Mapping, arguments: Any) -> list[str]:
    """Problems of ``arguments`` against a tool's ``parameters`` schema; empty when they are valid.

    Covers what ``get_json_schema`` writes: ``type`` (also a list of types), ``nullable``,
    ``enum``, ``items``, ``properties``, ``required``; arguments the function does not take
    are errors (the call would fail).
    """
    if not isinstance(arguments, dict):
        return [f"arguments must be a JSON object, got {_json_type(arguments)}"]
    props = parameters.get("properties", {})
    errors = [f"missing required argument {k!r}" for k in parameters.get("required", []) if k not in arguments]
    for key, value in arguments.items():
        if key not in props:
            errors.append(f"unexpected argument {key!r} (arguments: {sorted(props)})")
        else:
            errors += _check_value(props[key], value, key)
    return errors


def _check_value(schema: Mapping, value: Any, where: str) -> list[str]:
    if value is None and schema.get("nullable"):
        return []
    kinds = schema.get("type")
    if kinds is not None:
        kinds = [kinds] if isinstance(kinds, str) else list(kinds)
        if not any(_is_type(value, k) for k in kinds):
            return [f"argument {where!r} must be {' or '.join(kinds)}, got {_json_type(value)}"]
    if "enum" in schema and value not in schema["enum"]:
        return [f"argument {where!r} must be one of {schema['enum']}, got {value!r}"[:300]]
    if isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        for i, item in enumerate(value):
            errs = _check_value(schema["items"], item, f"{where}[{i}]")
            if errs:
                return errs
    if isinstance(value, dict) and isinstance(schema.get("properties"), Mapping):
        return check_arguments(schema, value)
    return []


def _is_type(value: Any, kind: str) -> bool:
    if kind in ("integer", "number") and isinstance(value, bool):
        return False
    return isinstance(value, _JSON_TYPES.get(kind, (object,)))


def _json_type(value: Any) -> str:
    for name, types in _JSON_TYPES.items():
        if name not in ("number",) and isinstance(value, types) and not (name == "integer" and isinstance(value, bool)):
            return name
    return "number" if isinstance(value, float) else type(value).__name__
