"""Long arithmetic with a calculator tool: the experiment where tools matter.

One Solver converses through ``team.chat``. With ``params.tools: calculator`` it sees the
calculator's schema and may call it (``<tool_call>{"name": "calculator", "arguments":
{"expression": ...}}</tool_call>``); the result comes back as a tool message and the Solver
answers ``\\boxed{N}``. With ``tools: none`` the same Solver, prompt and task answer directly:
the baseline. Long expressions (``task.params``: 4-6 terms, operands up to 99) are beyond what a
tiny model computes reliably in its head, and trivial for the tool.

A final reply without ``\\boxed{}`` is invalid (format penalty), as is a malformed call
(``team.chat``'s rules). ``episode.info``: ``stop`` (``answer`` or ``call_limit``) and
``tool_calls`` (calls run). See examples/tools_calculator.yaml and docs/workflows.md.
"""
from __future__ import annotations

from masrl.tools import calculator
from masrl.types import Episode, Task
from masrl.workflows.base import Team, register_workflow
from masrl.workflows.common import check_params, choice_param
from masrl.workflows.parsing import extract_boxed

CALCULATOR_PROMPTS = {"Solver": "Q {question}\n"}
TOOL_CHOICES = ("calculator", "none")


@register_workflow("calculator_math", agents=("Solver",), prompts=CALCULATOR_PROMPTS,
                   params={"tools": "calculator", "max_tool_calls": 2}, check=check_params)
async def calculator_math(task: Task, team: Team) -> Episode:
    """The Solver answers ``task.question``, with the calculator tool or (``tools: none``) without."""
    check_params(team)
    tools = [calculator] if choice_param(team, "tools", TOOL_CHOICES) == "calculator" else []
    messages = [{"role": "user", "content": team.render("Solver", question=task.question)}]
    result = await team.chat("Solver", messages, tools=tools)
    last = result.turns[-1]
    if result.stop == "answer" and extract_boxed(result.text) is None:
        last.valid = False
    return team.finish(result.text, stop=result.stop, tool_calls=len(result.results))
