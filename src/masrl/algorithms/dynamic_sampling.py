"""Dynamic sampling (DAPO): which turns carry a learning signal, so that the rest stay out of the loss.

A GRPO-style advantage is 0 for every row of a statistic set whose values are all equal (σ = 0, or a
constant baseline set), and for a one-value set under ``singleton="zero"``. Such rows take batch slots and,
under a token mean, dilute every other row's gradient. ``signal_mask`` says which turns are kept:

* ``"none"``: every turn;
* ``"group"``: the turns of every group that gives at least one turn a signal (a group in which every
  set is dead is dropped whole; DAPO's "all rewards equal" filter);
* ``"role"``: the turns of the live sets only, under the estimator's own grouping: per (group, agent) for
  the agent-wise estimators, per (group, turn index, agent) for ``drmas_turnwise``, per group for the
  episode-level ones (where ``role`` equals ``group``). A group can be dead for one role and live for
  another.

Which set decides an estimator's signal is ``SIGNAL_GROUPING[estimator]``: a tuple of groupings; a row is
dead when any of them is dead for it (``drmas_mean_only`` divides the agent-wise deviation by the group's σ,
so it needs both). Every dead turn has advantage exactly 0 under its estimator (tested for every built-in).
"""
from __future__ import annotations

from typing import Hashable, Sequence

import torch
from torch import Tensor

from masrl.algorithms.advantages import AdvantageGroups, check_scores, encode_ids, episode_values, group_stats

FILTERS = ("none", "group", "role")

# estimator -> the groupings whose constant sets give A = 0: "episode" (the G episode values of a group),
# "agent" ((group, agent) turns), "turn" ((group, turn index, agent) turns), "group_turns" (all turns of a group)
SIGNAL_GROUPING: dict[str, tuple[str, ...]] = {
    "grpo": ("episode",), "dr_grpo": ("episode",), "rloo": ("episode",), "reinforce_pp_baseline": ("episode",),
    "drmas": ("agent",), "drmas_std_only": ("agent",), "drmas_mean_only": ("agent", "episode"),
    "dr_grpo_agentwise": ("agent",), "rloo_agentwise": ("agent",), "reinforce_pp_baseline_agentwise": ("agent",),
    "drmas_turnwise": ("turn",), "grpo_per_turn": ("group_turns",),
}


def register_signal_grouping(estimator: str, groupings: Sequence[str]) -> None:
    """Name the groupings (see ``SIGNAL_GROUPING``) whose constant sets give your estimator A = 0, so that
    ``algorithm.dynamic_sampling`` can filter its batches."""
    unknown = sorted(set(groupings) - {"episode", "agent", "turn", "group_turns"})
    if unknown or not groupings:
        raise ValueError(f"unknown signal groupings {unknown or list(groupings)}; known: episode, agent, turn, "
                         "group_turns")
    SIGNAL_GROUPING[estimator] = tuple(groupings)


def _dead(scores: Tensor, groups: AdvantageGroups, grouping: str, singleton: str) -> Tensor:
    """Per turn: its set under ``grouping`` carries no signal (all values equal; one value under "zero")."""
    if grouping == "episode":
        values, key = episode_values(scores, groups), groups.episode_group()
        stats = group_stats(values, key)
        dead_episode = stats.constant[key] & ((stats.count[key] > 1) | (singleton == "zero"))
        return dead_episode[groups.episode]
    if grouping == "turn" and groups.turn is None:
        raise ValueError("the 'turn' signal grouping needs turn_index (one per turn)")
    key = {"agent": lambda: groups.group_agent, "group_turns": lambda: groups.group,
           "turn": lambda: groups.combine(groups.group, groups.turn, groups.agent)}[grouping]()
    stats = group_stats(scores, key)
    return stats.constant[key] & ((stats.count[key] > 1) | (singleton == "zero"))


def signal_mask(scores: Tensor | Sequence[float], *, group_ids: Sequence[Hashable], agent_ids: Sequence[Hashable],
                episode_ids: Sequence[Hashable], estimator: str, filter: str,
                turn_index: Sequence[Hashable] | None = None, singleton: str = "zero") -> Tensor:
    """A bool per turn: True where the turn reaches the loss under ``filter`` (module docstring). The
    arguments are those of :func:`~masrl.algorithms.compute_advantages` (same validation)."""
    if filter not in FILTERS:
        raise ValueError(f"filter must be one of {', '.join(FILTERS)}; got {filter!r}")
    scores = check_scores(scores)
    if filter == "none":
        return torch.ones(len(scores), dtype=torch.bool)
    if estimator not in SIGNAL_GROUPING:
        raise ValueError(f"dynamic sampling does not know which sets give estimator {estimator!r} a zero "
                         "advantage; name them with masrl.algorithms.register_signal_grouping")
    groups = encode_ids(len(scores), scores.device, group_ids=group_ids, agent_ids=agent_ids,
                         episode_ids=episode_ids, turn_index=turn_index, turn_ids=None)
    work = scores.detach().to(torch.float64)
    dead = torch.zeros(len(scores), dtype=torch.bool, device=scores.device)
    for grouping in SIGNAL_GROUPING[estimator]:
        dead |= _dead(work, groups, grouping, singleton)
    if filter == "role":
        return ~dead
    num_groups = int(groups.group.max()) + 1 if len(scores) else 0
    live_rows = torch.zeros(num_groups, dtype=torch.long, device=scores.device).index_add(
        0, groups.group, (~dead).long())
    return live_rows[groups.group] > 0
