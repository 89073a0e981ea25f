"""Built-in tools: ``calculator`` (safe arithmetic), ``python`` (the code sandbox), ``search`` (a retriever).

``calculator`` is a ready ``Tool``; ``python_tool(...)`` and ``search_tool(retriever)`` make
tools with their limits / retriever bound.
"""
from __future__ import annotations

import ast
import math
import operator
from typing import Any

from masrl.tools.core import Tool

MAX_EXPRESSION_CHARS = 500
MAX_INT_BITS = 4096   # results and operands of * and ** stay below 2**4096 (about 1233 digits)
MAX_EXPONENT = 1000

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """An expression the calculator does not evaluate (the message says why)."""


def evaluate_arithmetic(expression: str) -> int | float:
    """Evaluate ``+ - * / // % **`` and parentheses over int and float literals, without ``eval``.

    The expression is parsed with ``ast`` and only the nodes above are evaluated; anything
    else (names, calls, attributes, strings, comparisons) is a ``CalculatorError``, as are
    expressions over ``MAX_EXPRESSION_CHARS`` characters, exponents over ``MAX_EXPONENT`` and
    integers over ``MAX_INT_BITS`` bits.
    """
    if not isinstance(expression, str):
        raise CalculatorError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression too long ({len(expression)} > {MAX_EXPRESSION_CHARS} characters)")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise CalculatorError(f"not an arithmetic expression: {getattr(e, 'msg', e)}") from None
    return _eval(tree.body)


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant):
        if type(node.value) not in (int, float):
            raise CalculatorError(f"only numbers are allowed, got {node.value!r}"[:120])
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        _check_sizes(node.op, left, right)
        try:
            return _bounded(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("result too large") from None
    raise CalculatorError(f"not allowed in an arithmetic expression: {type(node).__name__}")


def _check_sizes(op: ast.operator, left: int | float, right: int | float) -> None:
    if isinstance(op, ast.Pow):
        if abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponent too large (|{right}| > {MAX_EXPONENT})")
        if isinstance(left, int) and isinstance(right, int) and right > 0 and \
                max(left.bit_length(), 1) * right > MAX_INT_BITS * 2:
            raise CalculatorError("result too large")
    if isinstance(op, ast.Mult) and isinstance(left, int) and isinstance(right, int) and \
            left.bit_length() + right.bit_length() > MAX_INT_BITS * 2:
        raise CalculatorError("result too large")


def _bounded(value: Any) -> int | float:
    if isinstance(value, complex):  # (-8) ** 0.5
        raise CalculatorError("the result is not a real number")
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise CalculatorError("result too large")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("result too large")
    return value


def format_number(value: int | float) -> str:
    """Integers as digits; floats with an integral value below 1e15 without ``.0``; others by ``repr``."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly (integers) or in floating point (with / or non-integers).

    Args:
        expression: Numbers, parentheses and the operators + - * / // % **, e.g. "(12+30)*7".
    """
    return format_number(evaluate_arithmetic(expression))


calculator = Tool(calculator)


def python_tool(*, timeout_s: float = 5.0, memory_mb: int = 512, max_output_chars: int = 4000,
                sandbox: Any = None) -> Tool:
    """A ``python`` tool: runs code in the sandbox (separate process, no network, time/memory limits)."""
    from masrl.sandbox import run_python

    def python(code: str) -> str:
        """Run a Python program in a sandbox and return what it printed (stdout; stderr on an error).

        Args:
            code: A complete Python program; use print() to show results.
        """
        result = run_python(code, timeout_s=timeout_s, memory_mb=memory_mb, sandbox=sandbox,
                            max_output_bytes=max_output_chars * 4)
        out = result.stdout[-max_output_chars:]
        if result.ok:
            return out
        detail = result.stderr.strip()[-max_output_chars:] or result.detail
        return f"{out}[{result.status}] {detail}".strip()

    return Tool(python, timeout_s=timeout_s + 5.0)


def search_tool(retriever: Any, *, topk: int = 3, doc_format: str = "Doc {rank}: {contents}",
                name: str = "search") -> Tool:
    """A ``search`` tool over ``retriever`` (an object with ``search(queries, topk)`` or a spec for
    ``masrl.retrieval.build_retriever``: a corpus path, ``"synthetic_kb"``, a URL, ...)."""
    import masrl.tasks.synthetic_kb  # noqa: F401 - registers the "synthetic_kb" retriever spec
    from masrl.retrieval import format_passages, resolve_retriever

    index = resolve_retriever(retriever)

    def search(query: str) -> str:
        """Search the knowledge base and return the best matching passages.

        Args:
            query: What to search for.
        """
        results = index.search([query], topk)
        passages = list(results[0]) if results else []
        return format_passages(passages, doc_format) if passages else "No results."

    return Tool(search, name=name)
