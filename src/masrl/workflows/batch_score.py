"""Final answers scored in one batch after the rollout, for score functions that judge many at once.

A score function with ``score_batch(pairs) -> results`` (an LLM judge, a reward model: masrl.judges)
is not called by ``team.finish``: the team marks the episode ``score_pending`` and, once every episode
of the rollout is done, ``score_pending`` scores all pending final answers with one call, so
judging never serializes the rollout. ``team.score`` mid-episode still calls the judge for one answer.
"""
from __future__ import annotations

from typing import Sequence

from masrl.types import Episode, ScoreFn


def scores_in_batches(score: ScoreFn) -> bool:
    """``score`` judges many answers in one call (``score_batch``) and sees only the answer, not the turns."""
    return callable(getattr(score, "score_batch", None)) and not getattr(score, "takes_episode", False)


def score_pending(episodes: Sequence[Episode], score: ScoreFn) -> None:
    """Fill in the reward and score info of every episode marked ``score_pending``, in one ``score_batch``."""
    pending = [e for e in episodes if e.info.get("score_pending")]
    if not pending:
        return
    results = score.score_batch([(e.task, e.answer) for e in pending])
    for episode, result in zip(pending, results):
        del episode.info["score_pending"]
        episode.reward = float(result["reward"])
        episode.info = {**{k: v for k, v in result.items() if k != "reward"}, **episode.info}
