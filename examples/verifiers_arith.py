"""A verifiers (v0) environment over the quickstart's arithmetic rows, written as for the Environments Hub (no masrl
in the environment), and the teacher that writes its cold-start demonstrations.

`load_environment(...)` returns a `vf.SingleTurnEnv`: each row is an expression such as `7-3+2` evaluated left to
right (the quickstart's task: 2-3 terms, operands 0-9, + and -); the rubric's `correct_answer` (weight 1) compares
the number in the last \\boxed{} with the answer, `boxed_format` (weight 0) is logged, not rewarded.
`teacher(...)` answers like a diligent but careless student: one line per left-to-right step, then the boxed
result, a wrong number boxed after correct steps with probability `slip_rate` (masrl's `task.params.teacher`;
docs/environments.md). masrl trains a team on it with examples/verifiers_arith.yaml.
"""
import random
import re

import verifiers as vf
from datasets import Dataset


def _steps(question: str) -> list[tuple[int, str, int, int]]:
    """``7-3+2`` -> [(7, '-', 3, 4), (4, '+', 2, 6)] (left to right)."""
    numbers = [int(n) for n in re.findall(r"\d+", question)]
    ops = re.findall(r"[-+*]", question)
    steps, value = [], numbers[0]
    for op, rhs in zip(ops, numbers[1:]):
        result = value + rhs if op == "+" else value - rhs if op == "-" else value * rhs
        steps.append((value, op, rhs, result))
        value = result
    return steps


def arithmetic_rows(n: int, seed: int, max_operand: int = 9, ops: str = "+-", skip: set | None = None) -> list[dict]:
    """``n`` distinct ``{"question", "answer"}`` rows: 2-3 terms, operands 0..max_operand, none in ``skip``."""
    rng, rows, seen = random.Random(seed), [], set(skip or ())
    while len(rows) < n:
        terms = [rng.randint(0, max_operand) for _ in range(rng.randint(2, 3))]
        question = str(terms[0]) + "".join(rng.choice(ops) + str(t) for t in terms[1:])
        if question in seen:
            continue
        seen.add(question)
        steps = _steps(question)
        rows.append({"question": question, "answer": str(steps[-1][3])})
    return rows


def load_environment(num_train: int = 2000, num_eval: int = 200, seed: int = 1234) -> vf.Environment:
    parser = vf.Parser(extract_fn=vf.extract_boxed_answer)

    def correct_answer(completion, answer, **kwargs) -> float:
        return 1.0 if (parser.parse_answer(completion) or "").strip() == str(answer) else 0.0

    def boxed_format(completion, **kwargs) -> float:
        text = completion[-1]["content"] if isinstance(completion, list) and completion else str(completion)
        return 1.0 if "\\boxed{" in (text or "") else 0.0

    rubric = vf.Rubric(funcs=[correct_answer, boxed_format], weights=[1.0, 0.0], parser=parser)
    test = arithmetic_rows(num_eval, seed)
    train = arithmetic_rows(num_train, seed + 1, skip={r["question"] for r in test})
    return vf.SingleTurnEnv(dataset=Dataset.from_list(train), eval_dataset=Dataset.from_list(test),
                            parser=parser, rubric=rubric)


def teacher(agent, messages, row, rng, slip_rate: float = 0.0):
    """A demonstration: the left-to-right steps, then the boxed result (a slip boxes a near miss)."""
    steps = _steps(row["question"])
    result = steps[-1][3]
    if rng.random() < slip_rate:
        result += rng.choice([-10, -2, -1, 1, 2, 10])
    return "\n".join(f"{a}{op}{b}={c}" for a, op, b, c in steps) + f"\n\\boxed{{{result}}}"
