"""Tools and function calling for agents: declare tools, parse calls from model output, run them.

Layering: this package sits at the ``tasks`` level (it may use ``masrl.tasks``: the sandbox and
the retrievers); workflows use it. See docs/workflows.md, "Agents with tools".
"""
from masrl.tools.builtin import CalculatorError, calculator, evaluate_arithmetic, python_tool, search_tool
from masrl.tools.core import Tool, ToolDefinitionError, as_tools, check_arguments, tool, tool_schemas
from masrl.tools.execute import ToolBox, ToolResult, format_result
from masrl.tools.parsing import FORMATS, CallError, ParsedCalls, ToolCall, parse_tool_calls, render_tool_call

__all__ = ["Tool", "ToolDefinitionError", "tool", "as_tools", "tool_schemas", "check_arguments", "ToolBox",
           "ToolResult", "format_result", "FORMATS", "ToolCall", "CallError", "ParsedCalls", "parse_tool_calls",
           "render_tool_call", "calculator", "evaluate_arithmetic", "CalculatorError", "python_tool", "search_tool"]
