"""Rollout correction: truncated importance sampling between the rollout engine and the trainer.

A fast rollout engine (vLLM: bf16, fused kernels, a different sampler) and the trainer
(transformers, float32 log-softmax) do not assign identical log-probs to the same tokens, so
rows sampled by the engine are slightly off-policy for the trainer. Each valid token's loss
is multiplied by a detached weight built from

    log ρ_t = log π_train_old(y_t) - log π_rollout(y_t)

where ``train_logprobs`` are the trainer's log-probs of the *old* policy (before this step's
update; recomputed by the trainer) and ``rollout_logprobs`` are the engine's.

``level``:
  * ``token``:     w_t = ρ_t (one weight per token; biased, low variance)
  * ``sequence``:  w_t = Π_s ρ_s = exp(Σ_s log ρ_s) over the row's valid tokens (unbiased, high
    variance), every token of the row gets it
  * ``geometric``: w_t = exp(mean_s log ρ_s), the per-token geometric mean (length-independent)
``mode``:
  * ``truncate``: w = min(w, cap) (TIS)
  * ``mask``:     w = 0 where w > cap (the token, or the whole row at sequence levels, is dropped)

Log-ratios are clamped to [-20, 20] before ``exp``. Weights are 0 on padding and carry no
gradient. Sources: verl ``rollout_corr_helper.compute_rollout_correction_weights``
(``rollout_is="token"|"sequence"``, ``rollout_is_threshold=2.0``; the geometric mean is its
``rollout_rs="geometric"`` statistic) and TRL ``GRPOTrainer`` (``vllm_importance_sampling_mode``
``token_truncate | token_mask | sequence_truncate | sequence_mask`` with
``vllm_importance_sampling_cap=2.0``: ``ratio = exp(Σ diff)`` clamped, or zeroed above the cap).
Background: "When Speed Kills Stability: Demystifying RL Collapse from the Training-Inference
Mismatch" (Liu, Li et al., 2025) and Yao et al., "Your efficient RL framework secretly brings
you off-policy RL training" (2025).
"""
from __future__ import annotations

import torch
from torch import Tensor

IS_LEVELS = ("token", "sequence", "geometric")
IS_MODES = ("truncate", "mask")
LOG_RATIO_BOUND = 20.0  # exp(20) ~ 4.9e8: no overflow, as verl's SAFETY_BOUND


def truncated_is_weights(
    train_logprobs: Tensor,
    rollout_logprobs: Tensor,
    mask: Tensor,
    *,
    cap: float = 2.0,
    level: str = "token",
    mode: str = "truncate",
) -> tuple[Tensor, dict[str, float]]:
    """Detached importance weights [B, T] correcting rollout-vs-trainer log-prob mismatch.

    ``train_logprobs``, ``rollout_logprobs`` and ``mask`` are [B, T]; positions where ``mask`` is
    0 may hold anything (NaN, -inf) and get weight 0. A non-finite value at a valid position
    raises ``ValueError`` (a broken rollout should not be silently weighted).

    Stats (python floats; a *unit* is a valid token at ``token`` level, a row with at least one
    valid token otherwise):

    * ``is_weight_mean``: mean returned weight over valid tokens (1.0 when nothing is valid)
    * ``is_capped_frac``: fraction of units whose untruncated weight exceeds ``cap``
      (truncated in ``truncate`` mode, zeroed in ``mask`` mode)
    * ``is_weight_max`` / ``is_weight_min``: extremes of the untruncated unit weights
    * ``mismatch_kl``: k1 estimate of KL(π_rollout ‖ π_train) = mean(rollout - train) over
      valid tokens (tokens are sampled from the rollout policy)
    * ``mismatch_k3``: k3 estimate of the same KL, mean(ρ - log ρ - 1) (>= 0, lower variance)
    * ``valid_tokens``
    """
    if level not in IS_LEVELS:
        raise ValueError(f"unknown level {level!r}; known: {', '.join(IS_LEVELS)}")
    if mode not in IS_MODES:
        raise ValueError(f"unknown mode {mode!r}; known: {', '.join(IS_MODES)}")
    if not cap > 0:
        raise ValueError(f"cap must be > 0; got {cap!r}")
    if train_logprobs.dim() != 2:
        raise ValueError(f"train_logprobs must be [B, T]; got shape {tuple(train_logprobs.shape)}")
    shape = tuple(train_logprobs.shape)
    for name, tensor in (("rollout_logprobs", rollout_logprobs), ("mask", mask)):
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name} shape {tuple(tensor.shape)} differs from train_logprobs shape {shape}")

    with torch.no_grad():
        valid = mask.bool()
        train = train_logprobs.detach().float()
        rollout = rollout_logprobs.detach().float()
        for name, tensor in (("train_logprobs", train), ("rollout_logprobs", rollout)):
            bad = valid & ~torch.isfinite(tensor)
            if bool(bad.any()):
                row, col = (int(i) for i in bad.nonzero()[0])
                raise ValueError(f"{name} has a non-finite value ({float(tensor[row, col])}) at a valid "
                                 f"position [{row}, {col}] ({int(bad.sum())} in all)")
        zero = torch.zeros((), dtype=torch.float32, device=train.device)
        log_ratio = torch.where(valid, train - rollout, zero)
        row_tokens = valid.sum(-1)
        row_valid = row_tokens > 0

        if level == "token":
            unit_log = log_ratio
        else:  # one value per row, broadcast to its tokens
            row_sum = log_ratio.sum(-1)
            unit_log = row_sum if level == "sequence" else row_sum / row_tokens.clamp(min=1)
            unit_log = unit_log.unsqueeze(-1).expand(shape)
        raw = unit_log.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp()
        over = raw > cap
        weights = raw.clamp(max=cap) if mode == "truncate" else raw.masked_fill(over, 0.0)
        weights = torch.where(valid, weights, zero)

        n_valid = int(valid.sum())
        # the untruncated weight of each unit: a valid token, or a row with a valid token
        unit_raw = raw[valid] if level == "token" or not shape[1] else raw[row_valid, 0]
        unit_over = unit_raw > cap
        bounded = log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        stats = {
            "is_weight_mean": float(weights[valid].mean()) if n_valid else 1.0,
            "is_capped_frac": float(unit_over.float().mean()) if unit_over.numel() else 0.0,
            "is_weight_max": float(unit_raw.max()) if unit_raw.numel() else 1.0,
            "is_weight_min": float(unit_raw.min()) if unit_raw.numel() else 1.0,
            "mismatch_kl": float((-log_ratio)[valid].mean()) if n_valid else 0.0,
            "mismatch_k3": float((bounded.exp() - bounded - 1.0)[valid].mean()) if n_valid else 0.0,
            "valid_tokens": float(n_valid),
        }
    return weights.to(train_logprobs.dtype).detach(), stats
