"""Advantage estimators: one score per turn in, one advantage per turn out.

Every estimator is a small pure function on tensors, registered by name in
``ADVANTAGE_ESTIMATORS``. ``compute_advantages`` validates the inputs once, turns the ids
into integer codes (:class:`AdvantageGroups`) and calls the estimator. Formulas, grouping
keys and sources are in ``docs/algorithms.md``.

Notation: a turn i has score r_i (team reward minus penalty), group g, agent k, episode e.
"Episode value" s_e is the mean score over all turns of episode e. μ_g, σ_g are over the G
episode values of group g; μ_{g,k}, σ_{g,k} over all turns of agent k in group g (an agent
acting twice in an episode contributes two values).

Rules shared by every built-in estimator:

* σ is unbiased (N-1) unless ``unbiased_std=False``; ε is added to σ.
* σ = 0 (every value of the set that defines σ is equal, up to EQUAL_RTOL x the largest
  |value| being grouped, which absorbs rounding) gives A = 0. Estimators without σ
  (rloo, dr_grpo) give A = 0 when every value of their baseline set is equal.
* A statistic set with a single value: ``singleton="zero"`` gives A = 0 for the rows that
  use it; ``singleton="raw"`` uses mean 0, std 1 for that set (the reference's behaviour,
  so a lone turn gets its raw score).
* Statistics are computed in float64 over the rows given, once each: a turn passed twice
  (same (episode_id, turn_index), or same ``turn_ids``) is an error, never padding.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Hashable, NamedTuple, Protocol, Sequence

import torch
from torch import Tensor

from masrl.registry import Registry

SINGLETON_MODES = ("zero", "raw")
EQUAL_RTOL = 1e-6  # values closer than this x the largest |value| count as equal (σ = 0)
HUGE = 2.0 ** 500  # statistics of larger values are computed on values / 2**k (no overflow)


# --------------------------------------------------------------------------- groups


@dataclass(frozen=True)
class AdvantageGroups:
    """Integer codes (int64, 0..n-1, on the scores' device) of each turn's ids.

    ``turn`` holds codes of ``turn_index`` values (equal indices share a code), or None when
    no turn index was given.
    """

    group: Tensor
    agent: Tensor
    episode: Tensor
    turn: Tensor | None = None

    def combine(self, *codes: Tensor) -> Tensor:
        """Dense codes of the tuple key (codes[0][i], codes[1][i], ...) of each turn."""
        key = codes[0]
        for code in codes[1:]:  # mixed radix: (a, b) -> a * (max b + 1) + b, then densify
            radix = int(code.max()) + 1 if code.numel() else 1
            key = key * radix + code
        return torch.unique(key, return_inverse=True)[1]

    @property
    def group_agent(self) -> Tensor:
        """Codes of the (group, agent) key."""
        return self.combine(self.group, self.agent)

    def episode_group(self) -> Tensor:
        """Group code of each episode code (shape [num_episodes])."""
        num_episodes = int(self.episode.max()) + 1 if self.episode.numel() else 0
        out = torch.zeros(num_episodes, dtype=torch.long, device=self.group.device)
        return out.scatter_(0, self.episode, self.group)


class SetStats(NamedTuple):
    """Statistics of the values of each set (index = set code)."""

    mean: Tensor
    std: Tensor
    count: Tensor
    constant: Tensor  # bool: every value of the set is equal (σ = 0)


def group_stats(values: Tensor, keys: Tensor, *, unbiased_std: bool = True) -> SetStats:
    """Mean, std, count and "all equal" of ``values`` per set code in ``keys``.

    Values above HUGE in magnitude (whose squares, or sums, would overflow) are divided by a power of two
    first and the statistics scaled back: exact, and finite for finite values up to ~1e307."""
    scale = _pow2_scale(values)
    if scale != 1.0:
        small = group_stats(values / scale, keys, unbiased_std=unbiased_std)
        return SetStats(small.mean * scale, small.std * scale, small.count, small.constant)
    num_sets = int(keys.max()) + 1 if keys.numel() else 0
    zeros = values.new_zeros(num_sets)
    count = zeros.index_add(0, keys, torch.ones_like(values))
    mean = zeros.index_add(0, keys, values) / count.clamp(min=1)
    squared_dev = zeros.index_add(0, keys, (values - mean[keys]) ** 2)
    dof = count - 1 if unbiased_std else count
    std = (squared_dev / dof.clamp(min=1)).sqrt()
    vmax = values.new_full((num_sets,), -math.inf).scatter_reduce(0, keys, values, "amax")
    vmin = values.new_full((num_sets,), math.inf).scatter_reduce(0, keys, values, "amin")
    return SetStats(mean, std, count, _all_equal(vmin, vmax, values))


def _pow2_scale(values: Tensor) -> float:
    """1.0, or the power of two above the largest |value| when that exceeds HUGE (dividing by it is exact)."""
    top = float(values.abs().max()) if values.numel() else 0.0
    return 2.0 ** math.frexp(top)[1] if top > HUGE else 1.0


def _all_equal(vmin: Tensor, vmax: Tensor, values: Tensor) -> Tensor:
    """True where a set's max and min differ by at most EQUAL_RTOL x the largest |value|.

    Rewards that are equal on paper can differ after rounding (0.9 + 0.1 in float32, episode
    means summed in another order). Such a set must count as σ = 0, or an estimator dividing
    another set's deviation by it (the ablations) would return values of order 1/ε.
    """
    scale = values.abs().max() if values.numel() else values.new_zeros(())
    return (vmax - vmin) <= EQUAL_RTOL * scale


def episode_values(scores: Tensor, groups: AdvantageGroups) -> Tensor:
    """s_e: the mean score over the turns of each episode (shape [num_episodes])."""
    return group_stats(scores, groups.episode).mean


def _standardise(values: Tensor, center: SetStats, center_key: Tensor,
                 scale: SetStats | None, scale_key: Tensor | None,
                 *, eps: float, singleton: str) -> Tensor:
    """(values - μ) / (σ + ε) row-wise, μ from ``center``, σ from ``scale`` (None: no division).

    Applies the shared rules: σ = 0 (or, without σ, a constant baseline set) gives 0; a
    singleton set gives 0 ("zero") or uses mean 0 / std 1 ("raw").
    """
    mean = center.mean[center_key]
    center_single = center.count[center_key] == 1
    if singleton == "raw":
        mean = torch.where(center_single, 0.0, mean)
    advantages = values - mean
    single = center_single
    constant = center.constant[center_key] & ~center_single
    if scale is not None:
        std = scale.std[scale_key]
        scale_single = scale.count[scale_key] == 1
        if singleton == "raw":
            std = torch.where(scale_single, 1.0, std)
        advantages = advantages / (std + eps)
        single = single | scale_single
        constant = scale.constant[scale_key] & ~scale_single
    advantages = torch.where(constant, 0.0, advantages)
    if singleton == "zero":
        advantages = torch.where(single, 0.0, advantages)
    return advantages


def _leave_one_out(values: Tensor, keys: Tensor, *, singleton: str) -> Tensor:
    """values - mean of the other members of the same set (RLOO)."""
    stats = group_stats(values, keys)
    count = stats.count[keys]
    total = (stats.mean * stats.count)[keys]
    advantages = values - (total - values) / (count - 1).clamp(min=1)
    advantages = torch.where(stats.constant[keys], 0.0, advantages)
    lone = values if singleton == "raw" else torch.zeros_like(values)
    return torch.where(count == 1, lone, advantages)


def _batch_whiten(centred: Tensor, included: Tensor, *, eps: float, unbiased_std: bool) -> Tensor:
    """centred / (std over the whole batch of the included centred values + ε)."""
    population = centred[included]
    if population.numel() < 2 or bool(_all_equal(population.min(), population.max(), population)):
        return torch.zeros_like(centred)
    scale = _pow2_scale(population)  # 1.0 unless squares of the values would overflow
    std = (population / scale).std(correction=1 if unbiased_std else 0) * scale
    return centred / (std + eps)


# --------------------------------------------------------------------------- registry


class AdvantageEstimator(Protocol):
    """``fn(scores, groups, *, eps, unbiased_std, singleton) -> advantages``.

    ``scores`` is a validated 1-D float64 tensor (float32 on MPS); return a tensor of
    the same shape. ``singleton`` is "zero" or "raw".
    """

    def __call__(self, scores: Tensor, groups: AdvantageGroups, *, eps: float,
                 unbiased_std: bool, singleton: str) -> Tensor: ...


ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("estimator", group="masrl.estimators")


def register_advantage(name: str, *, overwrite: bool = False) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Decorator: register an estimator under ``name`` (see :class:`AdvantageEstimator`); the config's
    ``algorithm.estimator`` picks it. A name that is taken is an error unless ``overwrite``. A package
    registers its own through the ``masrl.estimators`` entry-point group (:mod:`masrl.registry`)."""
    return ADVANTAGE_ESTIMATORS.register(name, overwrite=overwrite)


# --------------------------------------------------------------------------- estimators


@register_advantage("grpo")
def grpo(scores, groups, *, eps, unbiased_std, singleton):
    """Vanilla GRPO, global baseline: A_i = (s_e - μ_g) / (σ_g + ε), s_e = episode mean."""
    values, episode_group = episode_values(scores, groups), groups.episode_group()
    stats = group_stats(values, episode_group, unbiased_std=unbiased_std)
    per_episode = _standardise(values, stats, episode_group, stats, episode_group,
                               eps=eps, singleton=singleton)
    return per_episode[groups.episode]


@register_advantage("drmas")
def drmas(scores, groups, *, eps, unbiased_std, singleton):
    """Dr. MAS agent-wise: A_i = (r_i - μ_{g,k}) / (σ_{g,k} + ε) over agent k's turns in g."""
    key = groups.group_agent
    stats = group_stats(scores, key, unbiased_std=unbiased_std)
    return _standardise(scores, stats, key, stats, key, eps=eps, singleton=singleton)


@register_advantage("grpo_per_turn")
def grpo_per_turn(scores, groups, *, eps, unbiased_std, singleton):
    """Global baseline over turns: A_i = (r_i - μ_g^turn) / (σ_g^turn + ε), statistics over every turn of group g
    (all agents pooled, each turn counts). The control for ``drmas`` when turns score their own rewards
    (``algorithm.reward: per_turn``): both credit each turn with its own score, only the grouping differs."""
    key = groups.group
    stats = group_stats(scores, key, unbiased_std=unbiased_std)
    return _standardise(scores, stats, key, stats, key, eps=eps, singleton=singleton)


@register_advantage("drmas_mean_only")
def drmas_mean_only(scores, groups, *, eps, unbiased_std, singleton):
    """Ablation: agent-wise mean, group std: A_i = (r_i - μ_{g,k}) / (σ_g + ε)."""
    key = groups.group_agent
    agent_stats = group_stats(scores, key, unbiased_std=unbiased_std)
    group_wide = group_stats(episode_values(scores, groups), groups.episode_group(),
                             unbiased_std=unbiased_std)
    return _standardise(scores, agent_stats, key, group_wide, groups.group,
                        eps=eps, singleton=singleton)


@register_advantage("drmas_std_only")
def drmas_std_only(scores, groups, *, eps, unbiased_std, singleton):
    """Ablation: group mean, agent-wise std: A_i = (r_i - μ_g) / (σ_{g,k} + ε)."""
    key = groups.group_agent
    agent_stats = group_stats(scores, key, unbiased_std=unbiased_std)
    group_wide = group_stats(episode_values(scores, groups), groups.episode_group(),
                             unbiased_std=unbiased_std)
    return _standardise(scores, group_wide, groups.group, agent_stats, key,
                        eps=eps, singleton=singleton)


@register_advantage("drmas_turnwise")
def drmas_turnwise(scores, groups, *, eps, unbiased_std, singleton):
    """AT-GRPO turn-wise grouping: statistics over the turns with key (g, turn index, k)."""
    if groups.turn is None:
        raise ValueError("estimator 'drmas_turnwise' needs turn_index (one per turn)")
    key = groups.combine(groups.group, groups.turn, groups.agent)
    stats = group_stats(scores, key, unbiased_std=unbiased_std)
    return _standardise(scores, stats, key, stats, key, eps=eps, singleton=singleton)


@register_advantage("dr_grpo")
def dr_grpo(scores, groups, *, eps, unbiased_std, singleton):
    """Dr. GRPO (no σ): A_i = s_e - μ_g."""
    values, episode_group = episode_values(scores, groups), groups.episode_group()
    stats = group_stats(values, episode_group)
    per_episode = _standardise(values, stats, episode_group, None, None, eps=eps, singleton=singleton)
    return per_episode[groups.episode]


@register_advantage("dr_grpo_agentwise")
def dr_grpo_agentwise(scores, groups, *, eps, unbiased_std, singleton):
    """Dr. GRPO agent-wise (no σ): A_i = r_i - μ_{g,k}."""
    key = groups.group_agent
    stats = group_stats(scores, key)
    return _standardise(scores, stats, key, None, None, eps=eps, singleton=singleton)


@register_advantage("rloo")
def rloo(scores, groups, *, eps, unbiased_std, singleton):
    """RLOO over episodes: A_i = s_e - mean of the other episode values of group g."""
    values = episode_values(scores, groups)
    per_episode = _leave_one_out(values, groups.episode_group(), singleton=singleton)
    return per_episode[groups.episode]


@register_advantage("rloo_agentwise")
def rloo_agentwise(scores, groups, *, eps, unbiased_std, singleton):
    """RLOO agent-wise: A_i = r_i - mean of the other turns of agent k in group g."""
    return _leave_one_out(scores, groups.group_agent, singleton=singleton)


@register_advantage("reinforce_pp_baseline")
def reinforce_pp_baseline(scores, groups, *, eps, unbiased_std, singleton):
    """REINFORCE++-baseline: c_e = s_e - μ_g, then A = c_e / (std of all c_e in the batch + ε)."""
    values, episode_group = episode_values(scores, groups), groups.episode_group()
    stats = group_stats(values, episode_group)
    centred = _standardise(values, stats, episode_group, None, None, eps=eps, singleton=singleton)
    included = torch.ones_like(centred, dtype=torch.bool)
    if singleton == "zero":
        included = stats.count[episode_group] > 1
    per_episode = _batch_whiten(centred, included, eps=eps, unbiased_std=unbiased_std)
    return per_episode[groups.episode]


@register_advantage("reinforce_pp_baseline_agentwise")
def reinforce_pp_baseline_agentwise(scores, groups, *, eps, unbiased_std, singleton):
    """REINFORCE++-baseline agent-wise: c_i = r_i - μ_{g,k}, A = c_i / (std of all c_i + ε)."""
    key = groups.group_agent
    stats = group_stats(scores, key)
    centred = _standardise(scores, stats, key, None, None, eps=eps, singleton=singleton)
    included = torch.ones_like(centred, dtype=torch.bool)
    if singleton == "zero":
        included = stats.count[key] > 1
    return _batch_whiten(centred, included, eps=eps, unbiased_std=unbiased_std)


# --------------------------------------------------------------------------- entry point


def compute_advantages(
    scores: Tensor | Sequence[float],
    *,
    group_ids: Sequence[Hashable],
    agent_ids: Sequence[Hashable],
    episode_ids: Sequence[Hashable],
    estimator: str,
    turn_index: Sequence[Hashable] | None = None,
    turn_ids: Sequence[Hashable] | None = None,
    eps: float = 1e-6,
    unbiased_std: bool = True,
    singleton: str = "zero",
) -> Tensor:
    """One advantage per turn from one score per turn.

    ``scores``: 1-D float tensor (team reward minus penalty per turn). The id arguments hold
    one hashable per turn. A turn's identity is (episode_id, turn_index) when ``turn_index``
    is given, and ``turn_ids`` when given; passing the same turn twice is a ValueError
    (without either, duplicates cannot be detected). Every episode must belong to one group.
    Returns a tensor with the scores' dtype and device (float32 for integer scores).
    """
    fn = _lookup(estimator)
    if singleton not in SINGLETON_MODES:
        raise ValueError(f"singleton must be one of {', '.join(SINGLETON_MODES)}; got {singleton!r}")
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite number >= 0; got {eps!r}")
    scores = check_scores(scores)
    groups = encode_ids(len(scores), scores.device, group_ids=group_ids, agent_ids=agent_ids,
                         episode_ids=episode_ids, turn_index=turn_index, turn_ids=turn_ids)
    work_dtype = torch.float32 if scores.device.type == "mps" else torch.float64
    advantages = fn(scores.detach().to(work_dtype), groups, eps=float(eps),
                    unbiased_std=bool(unbiased_std), singleton=singleton)
    if advantages.shape != scores.shape:
        raise ValueError(f"estimator {estimator!r} returned shape {tuple(advantages.shape)}, "
                         f"expected {tuple(scores.shape)}")
    return advantages.to(scores.dtype)


def _lookup(estimator: str) -> AdvantageEstimator:
    return ADVANTAGE_ESTIMATORS.get(estimator)


def check_scores(scores: Any) -> Tensor:
    if not isinstance(scores, Tensor):
        try:
            scores = torch.as_tensor(scores)
        except (TypeError, ValueError, RuntimeError) as err:
            raise ValueError(f"scores must be a 1-D float tensor: {err}") from None
    if scores.dim() != 1:
        raise ValueError(f"scores must be 1-D (one value per turn); got shape {tuple(scores.shape)}")
    if not (scores.is_floating_point() or scores.dtype in (torch.bool, torch.int32, torch.int64)):
        raise ValueError(f"scores must be a float tensor; got dtype {scores.dtype}")
    if not scores.is_floating_point():
        scores = scores.to(torch.get_default_dtype())
    bad = ~torch.isfinite(scores)
    if bool(bad.any()):
        where = bad.nonzero()[:5, 0].tolist()
        raise ValueError(f"scores contain NaN or infinite values at turns {where}")
    return scores


def _as_list(ids: Any, name: str, length: int) -> list:
    if isinstance(ids, (str, bytes)):
        raise ValueError(f"{name} must be a sequence with one id per turn, not a string")
    if isinstance(ids, Tensor):
        if ids.dim() != 1:
            raise ValueError(f"{name} must be 1-D; got shape {tuple(ids.shape)}")
        ids = ids.tolist()
    try:
        ids = list(ids)
    except TypeError:
        raise ValueError(f"{name} must be a sequence with one id per turn") from None
    if len(ids) != length:
        raise ValueError(f"{name} has {len(ids)} entries but scores has {length}")
    return ids


def _codes(ids: list, name: str, device: torch.device) -> Tensor:
    table: dict = {}
    try:
        codes = [table.setdefault(x, len(table)) for x in ids]
    except TypeError as err:
        raise ValueError(f"{name} must hold hashable ids: {err}") from None
    return torch.tensor(codes, dtype=torch.long, device=device)


def _first_duplicate(keys: list) -> tuple[int, Hashable] | None:
    seen: set = set()
    for i, key in enumerate(keys):
        if key in seen:
            return i, key
        seen.add(key)
    return None


def encode_ids(n: int, device: torch.device, *, group_ids, agent_ids, episode_ids,
                turn_index, turn_ids) -> AdvantageGroups:
    groups = _as_list(group_ids, "group_ids", n)
    agents = _as_list(agent_ids, "agent_ids", n)
    episodes = _as_list(episode_ids, "episode_ids", n)
    turns = None if turn_index is None else _as_list(turn_index, "turn_index", n)

    if turns is not None:
        dup = _first_duplicate(list(zip(episodes, turns)))
        if dup is not None:
            raise ValueError(f"turn {dup[0]} repeats (episode_id, turn_index) = {dup[1]!r}; "
                             "a turn may appear only once")
    if turn_ids is not None:
        dup = _first_duplicate(_as_list(turn_ids, "turn_ids", n))
        if dup is not None:
            raise ValueError(f"turn {dup[0]} repeats turn_ids value {dup[1]!r}; a turn may appear only once")

    group_of: dict = {}
    for episode, group in zip(episodes, groups):
        if group_of.setdefault(episode, group) != group:
            raise ValueError(f"episode_id {episode!r} appears in group_ids {group_of[episode]!r} "
                             f"and {group!r}; an episode belongs to one group")

    return AdvantageGroups(
        group=_codes(groups, "group_ids", device),
        agent=_codes(agents, "agent_ids", device),
        episode=_codes(episodes, "episode_ids", device),
        turn=None if turns is None else _codes(turns, "turn_index", device),
    )
