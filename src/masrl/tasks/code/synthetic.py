"""A synthetic function-writing task a tiny model can learn: short specs, hidden tests, a teacher.

Each task asks for ``def f(xs)`` over a list of small integers, from a template and a constant ``K``:
"sum of the even x in xs", "count of x in xs with x>K", "xs with each x times K", ... The hidden tests
(``assert f([...]) == ...``, ``n_tests`` per task) are computed from the template's reference solution
on random lists; the reward is the share of them passed, run in masrl's sandbox like MBPP
(``masrl.codecheck.scoring``). Held-out tasks are (template, K) pairs that no training task has.

The teacher writes imperfect demonstrations for the cold-start SFT: the reference solution in a fenced
block, with probability ``slip_rate`` one with a wrong constant or comparison; verdicts for an
Evaluator (``\\boxed{Correct}``/``\\boxed{Incorrect}``, flipped with probability ``verifier_noise``),
a choice for a Voting Aggregator, one subtask for an Orchestrator, and the chosen worker's program for a
Synthesizer. A reply is judged correct by the teacher when its code, whitespace removed, is the
reference's (the teacher is only a cold start: the reward runs the tests).
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

from masrl.errors import ConfigError
from masrl.types import Task

# (spec with {K}, body of f with {K}); every body is one `return` line
TEMPLATES: dict[str, tuple[str, str]] = {
    "sum": ("sum of xs", "return sum(xs)"),
    "sum_even": ("sum of the even x in xs", "return sum(x for x in xs if x%2==0)"),
    "sum_odd": ("sum of the odd x in xs", "return sum(x for x in xs if x%2==1)"),
    "max": ("largest x in xs", "return max(xs,default=0)"),
    "min": ("smallest x in xs", "return min(xs,default=0)"),
    "range": ("largest minus smallest x in xs", "return max(xs,default=0)-min(xs,default=0)"),
    "reverse": ("xs reversed", "return xs[::-1]"),
    "len": ("number of x in xs", "return len(xs)"),
    "count_gt": ("count of x in xs with x>{K}", "return sum(1 for x in xs if x>{K})"),
    "count_lt": ("count of x in xs with x<{K}", "return sum(1 for x in xs if x<{K})"),
    "count_eq": ("count of x in xs equal to {K}", "return xs.count({K})"),
    "keep_gt": ("the x in xs with x>{K}", "return [x for x in xs if x>{K}]"),
    "keep_lt": ("the x in xs with x<{K}", "return [x for x in xs if x<{K}]"),
    "add": ("xs with {K} added to each x", "return [x+{K} for x in xs]"),
    "mul": ("xs with each x times {K}", "return [x*{K} for x in xs]"),
    "sum_gt": ("sum of the x in xs with x>{K}", "return sum(x for x in xs if x>{K})"),
    "first": ("the first {K} x of xs", "return xs[:{K}]"),
    "sum_first": ("sum of the first {K} x of xs", "return sum(xs[:{K}])"),
}
FENCE = "```"


@dataclass
class CodeSynthConfig:
    templates: tuple[str, ...] = tuple(TEMPLATES)
    max_k: int = 9              # K in 0..max_k
    test_fraction: float = 0.2  # share of (template, K) pairs held out
    n_tests: int = 5            # hidden tests per task
    train_size: int = 2000      # training tasks (sampled with repeats from the training pairs)
    seed: int = 0

    def __post_init__(self):
        self.templates = tuple(self.templates)
        unknown = sorted(set(self.templates) - set(TEMPLATES))
        if unknown or not self.templates:
            raise ConfigError(f"task.params.templates for code_synth: unknown {unknown}; known: {sorted(TEMPLATES)}")
        for name, value, low, high in (("max_k", self.max_k, 1, 99), ("n_tests", self.n_tests, 1, 50),
                                       ("train_size", self.train_size, 1, 10 ** 6)):
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ConfigError(f"task.params.{name} for code_synth must be an integer in {low}..{high}, "
                                  f"got {value!r}")
        if not isinstance(self.test_fraction, (int, float)) or not 0.0 < self.test_fraction < 1.0:
            raise ConfigError(f"task.params.test_fraction for code_synth must be in (0, 1), got {self.test_fraction!r}")


def reference(template: str, k: int) -> str:
    """The reference program of a (template, K) pair."""
    return f"def f(xs):\n {TEMPLATES[template][1].format(K=k)}"


def _run(program: str, xs: list[int]) -> Any:
    scope: dict[str, Any] = {}
    exec(program, scope)  # noqa: S102 - masrl's own reference programs, not model output
    return scope["f"](list(xs))


def _task(template: str, k: int, cfg: CodeSynthConfig, rng: random.Random) -> Task:
    program = reference(template, k)
    tests = []
    for _ in range(cfg.n_tests):
        xs = [rng.randint(-9, 9) for _ in range(rng.randint(0, 6))]
        tests.append(f"assert f({xs!r}) == {_run(program, xs)!r}")
    spec = TEMPLATES[template][0].format(K=k)
    answer = {"kind": "mbpp", "tests": tests, "setup": "", "entry_point": "f", "remote_names": ["f"],
              "challenge_tests": []}
    return Task(id=f"code_synth/{template}/{k}", question=spec, answer=answer,
                meta={"data_source": "code_synth", "template": template, "k": k, "reference_solution": program,
                      "entry_point": "f", "signature": "def f(xs)"})


def make_code_synth_tasks(cfg: CodeSynthConfig) -> tuple[list[Task], list[Task]]:
    """``(train, test)``: training tasks sampled from the training pairs, one held-out task per held-out pair."""
    rng = random.Random(cfg.seed)
    pairs = sorted({(t, k if "{K}" in TEMPLATES[t][0] else 0) for t in cfg.templates for k in range(cfg.max_k + 1)})
    rng.shuffle(pairs)
    n_test = max(1, round(cfg.test_fraction * len(pairs)))
    test_pairs, train_pairs = pairs[:n_test], pairs[n_test:]
    if not train_pairs:
        raise ConfigError("task code_synth: no training pair is left; lower task.params.test_fraction")
    by_pair = {p: _task(*p, cfg, rng) for p in sorted(train_pairs)}
    train = [by_pair[rng.choice(train_pairs)] for _ in range(cfg.train_size)]
    test = [_task(*p, cfg, rng) for p in sorted(test_pairs)]
    return train, test


def code_synth_score(mode: str = "fraction", timeout_s: float = 1.0, cache_entries: int | None = None):
    """The sandboxed score of ``code_synth``: ``timeout_s`` per hidden test (a reference program takes
    microseconds), ``3 * timeout_s`` for a whole answer, so a looping program costs seconds, not ``n_tests``
    times the MBPP default of 5 s. ``cache_entries``: results kept for identical programs
    (``ScoreCache``; None: its default, 0: none)."""
    from masrl.codecheck.scoring import DEFAULT_CACHE_ENTRIES, make_code_score

    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0.05 <= timeout_s <= 60:
        raise ConfigError(f"task.params.timeout_s for code_synth must be a number of seconds in [0.05, 60], "
                          f"got {timeout_s!r}")
    return make_code_score(mode, timeout_s=float(timeout_s), total_timeout_s=3.0 * float(timeout_s),
                           cache_entries=DEFAULT_CACHE_ENTRIES if cache_entries is None else cache_entries)


def _blocks(prompt: str) -> list[str]:
    """The fenced programs in a prompt, in order."""
    return re.findall(r"```\n(.*?)\n```", prompt, flags=re.S)


def _squash(text: str) -> str:
    return re.sub(r"\s+", "", text)


class CodeSynthTeacher:
    """Demonstrations for every study role on ``code_synth`` (see the module docstring)."""

    def __init__(self, slip_rate: float = 0.0, verifier_noise: float = 0.0, seed: int = 0):
        for name, value in (("slip_rate", slip_rate), ("verifier_noise", verifier_noise)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise ConfigError(f"sft.teacher.{name} must be a number in [0, 1], got {value!r}")
        self.slip_rate, self.verifier_noise = slip_rate, verifier_noise
        self.rng = random.Random(seed)

    def solution(self, task: Task) -> str:
        program = task.meta["reference_solution"]
        if self.rng.random() < self.slip_rate:
            program = self._slip(program)
        return f"{FENCE}\n{program}\n{FENCE}"

    def _slip(self, program: str) -> str:
        """A plausible wrong program: another constant, the other comparison, or another parity."""
        swaps = [(">", "<"), ("<", ">"), ("%2==0", "%2==1"), ("%2==1", "%2==0"), ("max(", "min("), ("min(", "max(")]
        options = [(a, b) for a, b in swaps if a in program]
        numbers = re.findall(r"(?<![\w%])\d+", program.split("\n", 1)[1])
        if numbers and (not options or self.rng.random() < 0.5):
            n = self.rng.choice(numbers)
            return program.replace(n, str(int(n) + self.rng.choice([1, 2])), 1)
        if options:
            a, b = self.rng.choice(options)
            return program.replace(a, b, 1)
        return program.replace("return ", "return 1+", 1) if "[" not in program else program.replace("xs", "xs[1:]", 1)

    @staticmethod
    def _right(code: str, task: Task) -> bool:
        """``code`` is the reference program, whitespace aside."""
        return _squash(code) == _squash(task.meta["reference_solution"])

    def verdict(self, prompt: str, task: Task) -> str:
        blocks = _blocks(prompt)
        ok = bool(blocks) and self._right(blocks[-1], task)
        if self.rng.random() < self.verifier_noise:
            ok = not ok
        return "\\boxed{Correct}" if ok else "\\boxed{Incorrect}"

    def choose(self, prompt: str, task: Task) -> str:
        blocks = _blocks(prompt)
        right = [i for i, b in enumerate(blocks, 1) if self._right(b, task)]
        if right and self.rng.random() >= self.verifier_noise:
            return f"\\boxed{{{right[0]}}}"
        return f"\\boxed{{{self.rng.randint(1, max(len(blocks), 1))}}}"

    def combine(self, prompt: str, task: Task) -> str:
        blocks = _blocks(prompt)
        right = [b for b in blocks if self._right(b, task)]
        chosen = right[0] if right else (blocks[0] if blocks else task.meta["reference_solution"])
        return f"{FENCE}\n{chosen}\n{FENCE}"

    def reply(self, agent: str, prompt: Any, task: Task) -> str:
        if agent == "Orchestrator":
            return f"SUBTASK 1: {task.question}"
        if agent == "Evaluator":
            return self.verdict(str(prompt), task)
        if agent == "Aggregator":
            return self.choose(str(prompt), task)
        if agent == "Synthesizer":
            return self.combine(str(prompt), task)
        return self.solution(task)
