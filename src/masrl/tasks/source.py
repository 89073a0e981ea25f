"""A task source: the train and held-out splits, the score function and an optional SFT teacher."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from masrl.types import ScoreFn, Task

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
    agents: dict[str, bool] | None = None  # an environment's agents -> may it train them (checked at start)
