"""Tools and function calling (masrl.tools): schemas, argument checks, call parsing (fuzzed, linear
time), execution limits and the built-in tools (calculator, sandboxed python, search)."""
import json
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from masrl.tools import (CalculatorError, Tool, ToolBox, ToolDefinitionError, as_tools, calculator, check_arguments,
                         evaluate_arithmetic, parse_tool_calls, python_tool, render_tool_call, search_tool, tool)

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FEW = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@tool
def lookup(key: str, limit: int = 3, exact: bool | None = None, tags: list[str] | None = None) -> str:
    """Look a key up.

    Args:
        key: The key.
        limit: How many results (choices: [1, 3, 5])
        exact: Exact matching only.
        tags: Tags to filter by.
    """
    return f"{key}:{limit}"


TOOLS = as_tools([calculator, lookup])


# ---------------------------------------------------------------------------------- schemas
def test_schema_from_type_hints_and_docstring():
    f = lookup.schema["function"]
    assert lookup.schema["type"] == "function" and f["name"] == "lookup" and f["description"] == "Look a key up."
    props = f["parameters"]["properties"]
    assert props["key"] == {"type": "string", "description": "The key."}
    assert props["limit"]["type"] == "integer" and props["limit"]["enum"] == [1, 3, 5]
    assert props["tags"]["type"] == "array" and props["tags"]["items"] == {"type": "string"}
    assert f["parameters"]["required"] == ["key"]
    assert "return" not in f  # not part of the function-calling format


def test_a_function_without_argument_docs_is_one_clear_error():
    def bad(x: int) -> int:
        """No Args section."""
        return x

    with pytest.raises(ToolDefinitionError, match=r"tool 'bad'.*'Args:' line per argument"):
        Tool(bad)
    with pytest.raises(ToolDefinitionError, match="two tools are named 'calculator'"):
        as_tools([calculator, calculator])


@pytest.mark.parametrize("args, problem", [
    ({"key": "a"}, None),
    ({"key": "a", "limit": 5, "exact": None, "tags": ["x"]}, None),
    ({}, "missing required argument 'key'"),
    ({"key": 3}, "argument 'key' must be string, got integer"),
    ({"key": "a", "limit": True}, "argument 'limit' must be integer, got boolean"),
    ({"key": "a", "limit": 2.5}, "argument 'limit' must be integer, got number"),
    ({"key": "a", "limit": 2}, "must be one of [1, 3, 5]"),
    ({"key": "a", "tags": ["x", 1]}, "argument 'tags[1]' must be string"),
    ({"key": "a", "other": 1}, "unexpected argument 'other'"),
    (["a"], "arguments must be a JSON object, got array"),
])
def test_arguments_are_checked_against_the_schema(args, problem):
    errors = check_arguments(lookup.parameters, args)
    assert (errors == []) if problem is None else any(problem in e for e in errors), errors


# ---------------------------------------------------------------------------------- parsing
def test_hermes_several_calls_and_errors_in_order():
    text = ('Let me compute. <tool_call>\n{"name": "calculator", "arguments": {"expression": "2*21"}}\n</tool_call>'
            '<tool_call>{"name": "lookup", "arguments": {"key": "k", "limit": 5}}</tool_call> '
            '<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>'
            '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "lookup", "arguments": {"key": 1}}</tool_call>')
    parsed = parse_tool_calls(text, TOOLS)
    assert parsed.format == "hermes" and parsed.attempted
    assert [(c.name, c.arguments) for c in parsed.calls] == [("calculator", {"expression": "2*21"}),
                                                              ("lookup", {"key": "k", "limit": 5})]
    messages = [getattr(x, "message", x.name) for x in parsed.in_order()]
    assert messages[:2] == ["calculator", "lookup"]
    assert messages[2].startswith("malformed JSON")
    assert messages[3].startswith("unknown tool 'nope'; tools: ['calculator', 'lookup']")
    assert messages[4] == "bad arguments for 'lookup': argument 'key' must be string, got integer"


@pytest.mark.parametrize("text, calls", [
    ('{"name": "calculator", "arguments": {"expression": "1+2"}}', [("calculator", {"expression": "1+2"})]),
    ('<|python_tag|>{"name": "lookup", "parameters": {"key": "x"}}', [("lookup", {"key": "x"})]),
    ('```json\n{"name": "lookup", "parameters": {"key": "x"}}\n```', [("lookup", {"key": "x"})]),
    ('{"name": "lookup", "parameters": {"key": "a"}}; {"name": "lookup", "parameters": {"key": "b"}}',
     [("lookup", {"key": "a"}), ("lookup", {"key": "b"})]),
    ('[{"name": "lookup", "arguments": {"key": "a"}}]', [("lookup", {"key": "a"})]),
    ('{"name": "lookup", "arguments": "{\\"key\\": \\"s\\"}"}', [("lookup", {"key": "s"})]),
])
def test_bare_json_and_llama_calls(text, calls):
    parsed = parse_tool_calls(text, TOOLS)
    assert parsed.format == "json" and not parsed.errors
    assert [(c.name, c.arguments) for c in parsed.calls] == calls


@pytest.mark.parametrize("text", ["The answer is \\boxed{42}.", "{1, 2, 3}", "[1, 2]", '{"answer": 3}', "", "name"])
def test_plain_answers_are_not_call_attempts(text):
    assert not parse_tool_calls(text, TOOLS).attempted


@pytest.mark.parametrize("text, message", [
    ('{"name": "calculator", "arguments": {"expression": "1"', "malformed JSON"),
    ('<tool_call>{"name": "calculator"', "<tool_call> without </tool_call>"),
    ('<tool_call>["calculator"]</tool_call>', 'a call must be a JSON object {"name"'),
    ('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>', "the arguments of 'calculator' must be a JSON"),
    ('<tool_call>' + "[" * 100_000 + '</tool_call>', "malformed JSON"),  # deep nesting: RecursionError
])
def test_malformed_calls_are_errors(text, message):
    parsed = parse_tool_calls(text, TOOLS)
    assert not parsed.calls and len(parsed.errors) == 1 and parsed.errors[0].message.startswith(message)


FRAGMENTS = ["<tool_call>", "</tool_call>", "<tool_call", "tool_call>", "{", "}", "[", "]", '"name"', '"arguments"',
             '"parameters"', ":", ",", '"', "\\", "calculator", "lookup", "<|python_tag|>", "```", ";", " ", "\n", "1",
             "null", "é", "\x00", "🙂"]
garbage = st.one_of(st.text(), st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=3)), max_size=40)
                    .map("".join))
json_args = st.dictionaries(st.text(max_size=8), st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8), max_size=4)
names = st.text(min_size=1, max_size=12)


@FUZZ
@given(garbage, st.sampled_from([("hermes",), ("json",), ("hermes", "json")]), st.booleans())
def test_any_text_never_raises(text, formats, with_tools):
    parsed = parse_tool_calls(text, TOOLS if with_tools else None, formats)
    if with_tools:
        assert all(c.name in TOOLS for c in parsed.calls)


@FEW
@given(names, json_args, st.text().filter(lambda s: "<tool_call>" not in s and "</tool_call>" not in s),
       st.text().filter(lambda s: "<tool_call>" not in s))
def test_rendered_hermes_call_parses_back_in_any_text(name, args, before, after):
    parsed = parse_tool_calls(before + render_tool_call(name, args, "hermes") + after, formats=("hermes",))
    assert [(c.name, c.arguments) for c in parsed.calls] == [(name, args)] and not parsed.errors


@FEW
@given(names, json_args, st.sampled_from(["json", "llama"]), st.sampled_from(["", " ", "\n", "<|python_tag|>"]))
def test_rendered_json_call_parses_back(name, args, fmt, prefix):
    parsed = parse_tool_calls(prefix + render_tool_call(name, args, fmt) + "\n", formats=("json",))
    assert [(c.name, c.arguments) for c in parsed.calls] == [(name, args)] and not parsed.errors


@pytest.mark.parametrize("piece", ["<tool_call>", "<tool_call>{", "<tool_call>[", "{", '{"name":', '[{"name": "a"},',
                                   '{"name": "lookup", "arguments": {"key": "a"}} ', "</tool_call><tool_call>"])
def test_parsing_is_linear_on_adversarial_megabyte(piece):
    text = (piece * (1_000_000 // len(piece) + 1))[:1_000_000]
    for candidate in (text, '{"name": ' + text, "<tool_call>" + text + "</tool_call>"):
        t0 = time.perf_counter()
        parsed = parse_tool_calls(candidate, TOOLS)
        assert time.perf_counter() - t0 < 1.0
        assert len(parsed.calls) + len(parsed.errors) <= 33  # MAX_ATTEMPTS, then one error saying so


def test_too_many_calls_in_one_reply_is_one_error():
    parsed = parse_tool_calls(render_tool_call("lookup", {"key": "a"}) * 40, TOOLS)
    assert len(parsed.calls) == 32 and [e.message for e in parsed.errors] == [
        "more than 32 tool calls in one reply: the first 32 were read, 8 more were dropped"]
    assert parsed.dropped == 8


# ---------------------------------------------------------------------------------- execution
def test_execution_timeout_error_invalid_and_cut():
    def slow(seconds: float) -> str:
        """Sleep.

        Args:
            seconds: How long.
        """
        time.sleep(seconds)
        return "done"

    def boom(x: int) -> str:
        """Fail.

        Args:
            x: Anything.
        """
        raise KeyError(x)

    box = ToolBox([Tool(slow), Tool(boom), lookup], timeout_s=0.2, max_result_chars=5)
    run = lambda text: [box.run(c) for c in parse_tool_calls(text, box.tools).in_order()]  # noqa: E731
    t0 = time.perf_counter()
    [r] = run('{"name": "slow", "arguments": {"seconds": 5}}')
    assert r.status == "timeout" and r.content == "Error: slow timed out after 0.2 s" and time.perf_counter() - t0 < 2
    [r] = run('{"name": "slow", "arguments": {"seconds": 0}}')
    assert r.ok and r.content == "done" and r.message() == {"role": "tool", "name": "slow", "content": "done"}
    [r] = run('{"name": "boom", "arguments": {"x": 7}}')
    assert r.status == "error" and r.content.startswith("Error")
    [r] = run('{"name": "slow", "arguments": {"seconds": "x"}}')
    assert r.status == "invalid" and "must be number, got string" in r.content
    [r] = run('{"name": "lookup", "arguments": {"key": "abcdefgh"}}')
    assert r.content.startswith("abcde\n[cut: 10 characters")


# ---------------------------------------------------------------------------------- built-in tools
@pytest.mark.parametrize("expr, value", [("(12+30)*7", "294"), ("7/2", "3.5"), ("6/3", "2"), ("-2**10", "-1024"),
                                         ("17//5 + 17%5", "5"), ("2**0.5", repr(2 ** 0.5)), ("10**100", str(10**100))])
def test_calculator_values(expr, value):
    assert calculator(expression=expr) == value


@pytest.mark.parametrize("expr, why", [
    ("__import__('os').system('true')", "not allowed"), ("x + 1", "not allowed"), ("(1).real", "not allowed"),
    ("'a' * 3", "only numbers"), ("1 < 2", "not allowed"), ("True + 1", "only numbers"), ("2 ** 100000", "exponent"),
    ("(2**1000)**1000", "result too large"), ("99**999 * 99**999 * 99**999", "too large"), ("1/0", "division by zero"),
    ("1e308 * 10", "too large"), ("(-8) ** 0.5", "not a real number"), ("1+" * 300 + "1", "too long"), ("1 +", "not an"),
    ("lambda: 1", "not allowed"), ("[1]", "not allowed"),
])
def test_calculator_refuses_what_is_not_bounded_arithmetic(expr, why):
    with pytest.raises(CalculatorError, match=why):
        evaluate_arithmetic(expr)


@FUZZ
@given(st.text(alphabet="0123456789+-*/%().e ", max_size=60) | st.text(max_size=40))
def test_calculator_never_raises_anything_else(expr):
    t0 = time.perf_counter()
    try:
        evaluate_arithmetic(expr)
    except CalculatorError:
        pass
    assert time.perf_counter() - t0 < 1.0


def test_python_tool_runs_in_the_sandbox_with_its_limits():
    py = python_tool(timeout_s=1.0, memory_mb=256)
    assert py.name == "python" and py.timeout_s == 6.0
    assert py(code="print(6 * 7)").strip() == "42"
    out = py(code="import time\nprint('start', flush=True)\ntime.sleep(30)")
    assert out.startswith("start") and "[timeout]" in out
    assert "ZeroDivisionError" in py(code="1/0")


def test_search_tool_over_a_bm25_retriever():
    from masrl.retrieval import BM25Retriever, Passage

    index = BM25Retriever([Passage("1", "Paris", "Paris is the capital of France."),
                           Passage("2", "Berlin", "Berlin is the capital of Germany.")])
    search = search_tool(index, topk=1)
    assert search.schema["function"]["parameters"]["required"] == ["query"]
    assert search(query="capital of Germany") == 'Doc 1: "Berlin"\nBerlin is the capital of Germany.'
    assert json.dumps(search.schema)  # serializable, as chat templates need
