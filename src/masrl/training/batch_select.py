"""Which of a step's turns reach the loss: dynamic sampling (filter groups or roles without a learning signal,
refill the batch with further tasks) and overlong handling (mask truncated turns, DAPO's soft length penalty).
``algorithm.dynamic_sampling`` and ``algorithm.overlong`` in the config; docs/algorithms.md. Off (the
defaults), nothing here changes a number: every turn is kept and the scores are returned as they came.
"""
from __future__ import annotations

import sys
from collections import defaultdict
from dataclasses import replace
from typing import Sequence

import torch

from masrl.algorithms import signal_mask, soft_overlong_penalty
from masrl.types import Episode, Turn


def agent_ids(turns: Sequence[Turn], group_by: str) -> list[str]:
    """The agent key of each turn in the advantage statistics: the role, or the role slot (``group_by: slot``:
    parallel same-role agents such as voting generators normalised per slot)."""
    if group_by == "slot":
        return [f"{t.agent}#{t.info.get('slot', 0)}" for t in turns]
    return [t.agent for t in turns]


def shape_scores(cfg, turns: Sequence[Turn], scores: torch.Tensor) -> torch.Tensor:
    """``scores`` plus DAPO's soft overlong penalty of each turn (its agent's ``max_new_tokens`` is the limit)
    when ``algorithm.overlong.soft_penalty`` is set; else ``scores`` itself."""
    soft = cfg.algorithm.overlong.soft_penalty
    if soft is None or not turns:
        return scores
    penalty = soft_overlong_penalty([len(t.response_ids) for t in turns],
                                    [cfg.agents[t.agent].max_new_tokens for t in turns],
                                    buffer_tokens=soft.buffer_tokens, factor=soft.factor)
    return (scores.double() + penalty).to(scores.dtype)


def _seed(base: int, sampling_round: int) -> int:
    return (base * 1_000_003 + sampling_round * 104_729) % (2**63 - 1)


class BatchSelector:
    """One step's batch under ``algorithm.dynamic_sampling`` and ``algorithm.overlong`` (module docstring)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.ds = cfg.algorithm.dynamic_sampling
        self.rounds = 1

    def signal(self, turns: Sequence[Turn], keys, scores: torch.Tensor) -> torch.Tensor:
        """A bool per turn: it has a learning signal under the filter (every turn with ``filter: none``)."""
        a = self.cfg.algorithm
        return signal_mask(scores, group_ids=[k[0] for k in keys], agent_ids=agent_ids(turns, a.group_by),
                           episode_ids=[k[1] for k in keys], estimator=a.estimator, filter=self.ds.filter,
                           turn_index=[t.turn_index for t in turns], singleton=a.singleton)

    def refill(self, trainer, episodes: list[Episode], batch: Sequence, rng, *, seed: int, step: int) -> list[Episode]:
        """``episodes`` plus further rounds of tasks (drawn from ``rng``, tasks not yet used this step first)
        until ``len(batch)`` groups have a signal or ``max_rounds`` rounds are spent. ``trainer`` gives the
        rollout (``trainer.rollout``), the tasks (``trainer.source.train``) and the scoring
        (``trainer.score_turns``). Group and episode ids of later rounds follow those of the earlier ones."""
        self.rounds = 1
        if self.ds.filter == "none" or not self.ds.refill:
            return episodes
        group_size, used = self.cfg.trainer.group_size, {id(t) for t in batch}
        counts = [trainer.team.last_reward_counts]  # every generation's reward calls count in the step's
        while True:
            live = self.live_groups(trainer, episodes)
            short = len(batch) - len(live)
            if short <= 0 or self.rounds >= self.ds.max_rounds:
                break
            pool = [t for t in trainer.source.train if id(t) not in used] or list(trainer.source.train)
            more = rng.sample(pool, min(short, len(pool)))
            used.update(id(t) for t in more)
            first_group = max(e.group_id for e in episodes) + 1
            first_episode = max(e.episode_id for e in episodes) + 1
            tasks = [t for t in more for _ in range(group_size)]
            groups = [first_group + i for i in range(len(more)) for _ in range(group_size)]
            self.rounds += 1
            new = trainer.rollout(tasks, groups, seed=_seed(seed, self.rounds),
                                  where=f"step {step + 1}, generation {self.rounds} of dynamic sampling")
            counts.append(trainer.team.last_reward_counts)
            for e in new:
                e.episode_id += first_episode
                for t in e.turns:  # which generation of the step sampled it (train/sampling_rounds)
                    t.info["generation"] = self.rounds
            episodes = episodes + list(new)
        trainer.team.last_reward_counts = replace(counts[0], **{
            field: sum(getattr(c, field) for c in counts) for field in ("calls", "errors", "timeouts", "abandoned",
                                                                         "cached")})
        if short > 0:
            print(f"[masrl] step {step + 1}: dynamic sampling found {len(live)} of {len(batch)} groups with a "
                  f"learning signal in {self.rounds} rounds (max_rounds); training on those", file=sys.stderr)
        return episodes

    def live_groups(self, trainer, episodes: Sequence[Episode]) -> set:
        turns, keys, scores = trainer.score_turns(episodes)
        if not turns:
            return set()
        return {k[0] for k, live in zip(keys, self.signal(turns, keys, scores).tolist()) if live}

    def select(self, turns: list[Turn], keys, scores: torch.Tensor,
               advantages: torch.Tensor) -> tuple[list[Turn], torch.Tensor, dict[str, float]]:
        """The turns (and their advantages) that reach the loss, and the metrics of the choice: per agent the
        share of its turns filtered for no signal, its truncated turns masked, and the response tokens it
        generated per response token trained; the rounds used. Turns marked ``info["stale"]`` are left out too.
        Everything, and no metrics, when none of that applies."""
        a = self.cfg.algorithm
        stale = [bool(t.info.get("stale")) for t in turns]  # older than rollout.max_staleness (stale: drop)
        if self.ds.filter == "none" and not a.overlong.mask and not any(stale):
            return turns, advantages, {}
        signal = self.signal(turns, keys, scores) if turns else torch.zeros(0, dtype=torch.bool)
        keep = signal & torch.tensor([not (a.overlong.mask and t.truncated) and not old
                                      for t, old in zip(turns, stale)], dtype=torch.bool)
        counts: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0, 0])  # turns, filtered, masked, gen, trained
        for t, kept, live in zip(turns, keep.tolist(), signal.tolist()):
            c = counts[t.agent]
            c[0] += 1
            c[1] += not live
            c[2] += live and t.truncated and a.overlong.mask
            c[3] += len(t.response_ids)
            c[4] += len(t.response_ids) if kept else 0
        rounds = max((t.info.get("generation", 1) for t in turns), default=1)
        metrics = {"train/sampling_rounds": float(rounds),
                   "train/groups_with_signal": float(len({k[0] for k, s in zip(keys, signal.tolist()) if s}))}
        for agent, (n, filtered, masked, generated, trained) in counts.items():
            metrics[f"agent/{agent}/filtered_share"] = filtered / n
            metrics[f"agent/{agent}/overlong_masked"] = float(masked)
            if trained:  # nothing of the agent trained: no ratio
                metrics[f"agent/{agent}/generated_per_trained_token"] = generated / trained
        index = keep.nonzero().flatten()
        return [turns[i] for i in index.tolist()], advantages[index], metrics
