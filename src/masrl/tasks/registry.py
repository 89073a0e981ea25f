"""Task sources: a train split, a held-out split, the score function and an optional teacher."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from masrl.config import TaskConfig
from masrl.types import Task
from masrl.workflows.base import ScoreFn

# (agent, prompt, task) -> demonstration text, for cold-start SFT
Teacher = Callable[[str, str, Task], str]


@dataclass
class TaskSource:
    name: str
    train: list[Task]
    test: list[Task]
    score: ScoreFn
    teacher: Teacher | None = None
    workflow_params: dict[str, Any] = field(default_factory=dict)  # runtime objects (e.g. a retriever)


def _arithmetic(cfg: TaskConfig, sft_teacher: dict) -> TaskSource:
    from masrl.tasks.arithmetic import ArithmeticConfig, ArithmeticTeacher, make_arithmetic_tasks
    from masrl.tasks.math_reward import math_score

    try:
        acfg = ArithmeticConfig(**cfg.params)
    except TypeError as e:
        raise ValueError(f"task.params for arithmetic: {e}; known: {sorted(ArithmeticConfig.__dataclass_fields__)}")
    train, test = make_arithmetic_tasks(acfg)
    teacher = ArithmeticTeacher(**sft_teacher)
    return TaskSource("arithmetic", train, test, math_score, teacher.reply)


def _math_benchmark(cfg: TaskConfig, sft_teacher: dict) -> TaskSource:
    from masrl.tasks.math_data import load_benchmark
    from masrl.tasks.math_reward import math_score

    train_name = cfg.params.get("train", cfg.name)
    test_name = cfg.params.get("test", cfg.name)
    train = load_benchmark(train_name, limit=cfg.train_limit)
    test = load_benchmark(test_name, limit=cfg.test_limit)
    return TaskSource(cfg.name, train, test, math_score)


SOURCES: dict[str, Callable[[TaskConfig, dict], TaskSource]] = {"arithmetic": _arithmetic}


def load_task_source(cfg: TaskConfig, sft_teacher: dict | None = None) -> TaskSource:
    if cfg.name in SOURCES:
        source = SOURCES[cfg.name](cfg, sft_teacher or {})
    else:
        try:
            from masrl.tasks.math_data import BENCHMARKS
        except ImportError:
            BENCHMARKS = {}
        if cfg.name in BENCHMARKS or cfg.params.get("train") in BENCHMARKS:
            source = _math_benchmark(cfg, sft_teacher or {})
        else:
            known = sorted(set(SOURCES) | set(BENCHMARKS))
            raise ValueError(f"unknown task {cfg.name!r}; known tasks: {', '.join(known)}")
    if cfg.train_limit is not None:
        source.train = source.train[:cfg.train_limit]
    if cfg.test_limit is not None:
        source.test = source.test[:cfg.test_limit]
    if not source.train:
        raise ValueError(f"task {cfg.name!r}: the training split is empty")
    return source
