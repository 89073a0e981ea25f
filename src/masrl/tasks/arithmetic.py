"""Synthetic multi-step integer arithmetic: a CPU-sized math task with a held-out test split.

A task is an expression such as ``23+45-17``. A solution evaluates it left to right, one
step per line, then boxes the result::

    23+45=68
    68-17=51
    \\boxed{51}

``ArithmeticTeacher`` writes cold-start demonstrations in these formats. They are
deliberately imperfect, like real teacher traces: an arithmetic mistake per step
(``error_rate``), a transcription slip that boxes a wrong number after correct steps
(``slip_rate``), a wrong verdict (``verifier_noise``). SFT teaches the formats and the
skill; RL has to learn from outcomes to stop imitating the mistakes.

In a conversation with tools (the ``calculator_math`` workflow, ``team.chat``) the teacher's
trace calls the calculator with the question's expression, then boxes the tool's result; a
trace skips the tool and boxes the answer directly with probability ``skip_rate``, and boxes a
wrong number with probability ``slip_rate`` (a copying slip). Without tools it boxes the answer
directly, with the same ``slip_rate``: the no-tools baseline sees equally noisy answers.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

from masrl.errors import ConfigError
from masrl.types import Task
from masrl.tasks.parsing import extract_boxed


@dataclass
class ArithmeticConfig:
    train_size: int = 2000
    test_size: int = 200
    min_terms: int = 2
    max_terms: int = 3
    max_operand: int = 30
    ops: str = "+-"
    seed: int = 1234  # data seed, independent of the training seed

    def __post_init__(self):
        for name, kind in (("train_size", int), ("test_size", int), ("min_terms", int), ("max_terms", int),
                           ("max_operand", int), ("ops", str), ("seed", int)):
            value = getattr(self, name)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ConfigError(f"task.params.{name} must be {'an integer' if kind is int else 'a string'}, "
                                  f"got {value!r}")
        if min(self.train_size, self.test_size, self.max_operand, self.seed) < 0:
            raise ConfigError("task.params train_size, test_size, max_operand and seed must be >= 0")
        if not 1 <= self.min_terms <= self.max_terms:
            raise ConfigError(f"task.params: need 1 <= min_terms <= max_terms, got {self.min_terms}, {self.max_terms}")
        if not self.ops or set(self.ops) - set("+-*"):
            raise ConfigError(f"task.params.ops must be made of + - *, got {self.ops!r}")


def _expression(rng: random.Random, cfg: ArithmeticConfig) -> tuple[str, int]:
    n = rng.randint(cfg.min_terms, cfg.max_terms)
    terms = [rng.randint(0, cfg.max_operand) for _ in range(n)]
    ops = [rng.choice(cfg.ops) for _ in range(n - 1)]
    text = str(terms[0]) + "".join(op + str(t) for op, t in zip(ops, terms[1:]))
    value = terms[0]
    for op, t in zip(ops, terms[1:]):
        value = _apply(value, op, t)
    return text, value


def _apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def make_arithmetic_tasks(cfg: ArithmeticConfig) -> tuple[list[Task], list[Task]]:
    """(train, test): disjoint sets of distinct expressions, deterministic in ``cfg.seed``."""
    rng = random.Random(cfg.seed)
    seen: set[str] = set()
    out: list[Task] = []
    target = cfg.train_size + cfg.test_size
    attempts = 0
    while len(out) < target:
        attempts += 1
        if attempts > 50 * target:
            raise ConfigError(f"arithmetic task: cannot draw {target} distinct expressions with "
                              f"max_operand={cfg.max_operand}, terms {cfg.min_terms}..{cfg.max_terms}; "
                              "lower train_size/test_size or widen the ranges")
        text, value = _expression(rng, cfg)
        if text in seen:
            continue
        seen.add(text)
        split = "test" if len(out) < cfg.test_size else "train"
        out.append(Task(id=f"arith/{split}/{len(out)}", question=text, answer=str(value),
                        meta={"data_source": "arithmetic", "split": split}))
    return out[cfg.test_size:], out[:cfg.test_size]


def _terms(question: str) -> tuple[list[int], list[str]]:
    """``23+45-17`` -> ([23, 45, 17], ['+', '-'])."""
    steps = solve_steps(question)
    if not steps:
        return [int(question)], []
    return [steps[0][0]] + [rhs for _, _, rhs, _ in steps], [op for _, op, _, _ in steps]


def solve_steps(question: str) -> list[tuple[int, str, int, int]]:
    """Parse ``a op b op c`` into left-to-right steps (lhs, op, rhs, result)."""
    tokens, num = [], ""
    for ch in question:
        if ch.isdigit():
            num += ch
        else:
            tokens.append(int(num))
            tokens.append(ch)
            num = ""
    tokens.append(int(num))
    steps, value = [], tokens[0]
    for i in range(1, len(tokens), 2):
        op, rhs = tokens[i], tokens[i + 1]
        result = _apply(value, op, rhs)
        steps.append((value, op, rhs, result))
        value = result
    return steps


class ArithmeticTeacher:
    """Writes imperfect demonstrations for the Solver and Verifier roles (cold-start SFT)."""

    def __init__(self, error_rate: float = 0.0, slip_rate: float = 0.0, verifier_noise: float = 0.0,
                 seed: int = 0, skip_rate: float = 0.0):
        for name, value in (("error_rate", error_rate), ("slip_rate", slip_rate), ("verifier_noise", verifier_noise),
                            ("skip_rate", skip_rate)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise ConfigError(f"sft.teacher.{name} must be a number in [0, 1], got {value!r}")
        self.error_rate = error_rate
        self.slip_rate = slip_rate
        self.verifier_noise = verifier_noise
        self.skip_rate = skip_rate
        self.rng = random.Random(seed)

    def solution(self, question: str) -> str:
        lines, carry = [], None
        for lhs, op, rhs, _ in solve_steps(question):
            lhs = lhs if carry is None else carry
            result = _apply(lhs, op, rhs)
            if self.rng.random() < self.error_rate:
                result += self.rng.choice([-10, -2, -1, 1, 2, 10])
            lines.append(f"{lhs}{op}{rhs}={result}")
            carry = result
        boxed = carry if carry is not None else int(question)  # a single number: nothing to compute
        if self.rng.random() < self.slip_rate:
            boxed += self.rng.choice([-10, -2, -1, 1, 2, 10])
        lines.append(f"\\boxed{{{boxed}}}")
        return "\n".join(lines)

    def verdict(self, solution_text: str, answer: str) -> str:
        ok = extract_boxed(solution_text) == answer
        if self.rng.random() < self.verifier_noise:
            ok = not ok
        return "<verify>approve</verify>" if ok else "<verify>reject</verify>"

    def choose(self, prompt: str, answer: str) -> str:
        """Aggregator: the 1-based index of a candidate whose box is right (boxes in prompt order)."""
        import re

        boxes = re.findall(r"\\boxed\{(-?\d+)\}", prompt)
        right = [i for i, b in enumerate(boxes, 1) if b == answer]
        if right and self.rng.random() >= self.verifier_noise:
            return f"\\boxed{{{right[0]}}}"
        return f"\\boxed{{{self.rng.randint(1, max(len(boxes), 1))}}}"

    def _slipped(self, value: int) -> int:
        return value + self.rng.choice([-10, -2, -1, 1, 2, 10]) if self.rng.random() < self.slip_rate else value

    def chat_reply(self, messages: list[dict], tools: list[dict] | None, task: Task) -> str:
        """The next message of a conversation: a calculator call, or ``\\boxed{}`` with the tool's result
        (or, skipping the tool or without it, the answer), noisy as described in the module docstring."""
        last = messages[-1] if messages else {}
        if last.get("role") == "tool":
            try:
                return f"\\boxed{{{self._slipped(int(last.get('content', '')))}}}"
            except ValueError:  # the tool failed: answer directly
                pass
        elif any(t.get("function", {}).get("name") == "calculator" for t in tools or ()) and \
                self.rng.random() >= self.skip_rate:
            return calculator_call(left_to_right(task.question))
        return f"\\boxed{{{self._slipped(int(task.answer))}}}"

    def subtasks(self, question: str, max_subtasks: int = 2) -> str:
        """Orchestrator: ``SUBTASK k: <expression>`` lines that split a sum into independent parts.

        With only ``+``/``-`` the terms split into up to ``max_subtasks`` consecutive chunks; a chunk
        that starts with ``-t`` is written ``0-t...`` so that every subtask is an expression of its
        own and the chunk results add up to the answer. A product (left to right) or a two-term
        expression is one subtask: the whole question.
        """
        terms, ops = _terms(question)
        if "*" in ops or len(terms) < 3:
            return f"SUBTASK 1: {question}"
        n = min(max_subtasks, len(terms) - 1)
        bounds = [round(i * len(terms) / n) for i in range(n + 1)]
        lines = []
        for k, (lo, hi) in enumerate(zip(bounds, bounds[1:]), 1):
            head = str(terms[lo]) if lo == 0 or ops[lo - 1] == "+" else f"0-{terms[lo]}"
            lines.append(f"SUBTASK {k}: {head}" + "".join(ops[i - 1] + str(terms[i]) for i in range(lo + 1, hi)))
        return "\n".join(lines)

    def combine(self, prompt: str) -> str:
        """Synthesizer: adds the workers' boxed results (in prompt order), one line, then the box."""
        import re

        parts = [int(b) for b in re.findall(r"\\boxed\{(-?\d+)\}", prompt)]
        total = sum(parts)
        if self.rng.random() < self.slip_rate:
            total += self.rng.choice([-10, -2, -1, 1, 2, 10])
        if len(parts) < 2:
            return f"\\boxed{{{total}}}"
        expr = str(parts[0]) + "".join(f"+{v}" if v >= 0 else f"-{-v}" for v in parts[1:])
        return f"{expr}={total}\n\\boxed{{{total}}}"

    def reply(self, agent: str, prompt: Any, task: Task) -> str:
        """Demonstration for a role: the next message of a conversation (``team.chat``: ``prompt`` has
        ``messages`` and ``tools``), Verifier/Evaluator verdicts, Aggregator choices, Orchestrator splits,
        Worker solutions of the last expression in the prompt (its subtask), Synthesizer sums, else a solution."""
        if hasattr(prompt, "messages"):
            return self.chat_reply(prompt.messages, getattr(prompt, "tools", None), task)
        if agent == "Orchestrator":
            return self.subtasks(task.question)
        if agent == "Worker":
            import re

            expressions = re.findall(r"\d+(?:[-+*]\d+)*", prompt)
            return self.solution(expressions[-1] if expressions else task.question)
        if agent == "Synthesizer":
            return self.combine(prompt)
        if agent == "Verifier":
            return self.verdict(prompt, str(task.answer))
        if agent == "Evaluator":
            ok = "approve" in self.verdict(prompt, str(task.answer))
            return "\\boxed{Correct}" if ok else "\\boxed{Incorrect}"
        if agent == "Aggregator":
            return self.choose(prompt, str(task.answer))
        return self.solution(task.question)


def left_to_right(question: str) -> str:
    """The question as the calculator (usual precedence) must read it to give the task's left-to-right
    value: unchanged unless a ``*`` follows a ``+``/``-``, which is then parenthesised
    (``3+4*5`` -> ``(3+4)*5``; ``2*3+4`` and every 2-term question stay as they are)."""
    terms, ops = _terms(question)
    expr, additive = str(terms[0]), False
    for op, t in zip(ops, terms[1:]):
        expr = f"({expr})*{t}" if op == "*" and additive else f"{expr}{op}{t}"
        additive |= op != "*"
    return expr


def calculator_call(expression: str) -> str:
    """A Hermes-format call of the calculator tool (what ``masrl.tools.render_tool_call`` writes)."""
    return "<tool_call>\n" + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + \
        "\n</tool_call>"
