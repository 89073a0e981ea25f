"""Pure tensor functions for RL on multi-agent turns: advantage estimators, policy losses and
rollout correction (importance weights between the rollout engine and the trainer).

No model code lives here. Estimators are registered by name in ``ADVANTAGE_ESTIMATORS``
(add your own with ``@register_advantage("name")``), policy losses in ``LOSSES``
(``@register_loss("name")``); see docs/algorithms.md.
"""
from masrl.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    SINGLETON_MODES,
    AdvantageEstimator,
    AdvantageGroups,
    SetStats,
    compute_advantages,
    group_stats,
    register_advantage,
)
from masrl.algorithms.losses import (
    AGG_MODES,
    KL_KINDS,
    LOSSES,
    POLICY_LOSSES,
    agg_loss,
    entropy_from_logits,
    kl_penalty,
    policy_loss,
    register_loss,
    role_balanced_weights,
)
from masrl.algorithms.dynamic_sampling import FILTERS, SIGNAL_GROUPING, register_signal_grouping, signal_mask
from masrl.algorithms.overlong import soft_overlong_penalty
from masrl.algorithms.rollout_correction import IS_LEVELS, IS_MODES, truncated_is_weights

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGG_MODES",
    "AdvantageEstimator",
    "AdvantageGroups",
    "FILTERS",
    "IS_LEVELS",
    "IS_MODES",
    "KL_KINDS",
    "LOSSES",
    "POLICY_LOSSES",
    "SIGNAL_GROUPING",
    "SINGLETON_MODES",
    "SetStats",
    "agg_loss",
    "compute_advantages",
    "entropy_from_logits",
    "group_stats",
    "kl_penalty",
    "policy_loss",
    "register_advantage",
    "register_loss",
    "register_signal_grouping",
    "role_balanced_weights",
    "signal_mask",
    "soft_overlong_penalty",
    "truncated_is_weights",
]
