"""Core records that flow through one training step: Task -> Episode(Turns) -> TurnBatch.

Vocabulary (see docs/design.md): a *task* is one problem, an *episode* is one run of a
workflow on one task, a *turn* is one LLM call by one *agent*, a *group* is the G episodes
sampled for the same task.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class Task:
    """One problem from a dataset.

    ``answer`` is the ground truth in whatever form the task's reward function expects
    (a string for math, a list of gold strings for QA, a test program for code).
    """

    id: str
    question: str
    answer: Any
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class Turn:
    """One LLM call by one agent.

    ``logprobs`` are the rollout log-probabilities of ``response_ids`` under the policy that
    generated them (temperature-scaled logits, no top-p truncation), one per response token.
    """

    agent: str
    policy: str
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    text: str
    prompt_text: str = ""
    valid: bool = True
    truncated: bool = False
    turn_index: int = 0  # order of this call among all calls of the episode
    info: dict[str, Any] = field(default_factory=dict)
    reward: float | None = None  # a per-turn reward set by a user reward; used when algorithm.reward: per_turn

    @property
    def num_response_tokens(self) -> int:
        return len(self.response_ids)


@dataclass
class Episode:
    """One run of a workflow on one task: its turns and the team reward (outcome).

    ``error``: why the episode is invalid (its workflow raised: ``"KeyError: ..."``); an invalid episode
    has reward 0, no turns (nothing of it is trained) and counts as wrong. ``tool_counts``: its tool calls
    (``masrl.tools.execute.ToolCounts`` as a dict).
    """

    task: Task
    turns: list[Turn]
    reward: float
    answer: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
    group_id: int = 0
    episode_id: int = 0
    error: str | None = None
    tool_counts: dict[str, int] = field(default_factory=dict)

    @property
    def valid(self) -> bool:
        return self.error is None

    @property
    def correct(self) -> bool:
        """Team-level success; ``info['correct']`` when a workflow sets it, else reward >= 1."""
        if "correct" in self.info:
            return bool(self.info["correct"])
        return self.reward >= 1.0


# (task, final answer text) -> {"reward": float, "correct": bool, ...}: a task's reward function
ScoreFn = Callable[[Task, str | None], dict]
