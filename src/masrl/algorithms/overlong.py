"""Overlong reward shaping (DAPO, Yu et al. 2025, eq. 13 "soft overlong punishment").

With L_max the generation limit and L_cache = ``buffer_tokens``, a response of |y| tokens gets

    0                                     if |y| <= L_max - L_cache
    ((L_max - L_cache) - |y|) / L_cache   if L_max - L_cache < |y| <= L_max
    -1                                    if |y| > L_max

times ``factor``, added to its reward (verl's ``overlong_buffer``: min(-(|y| - (L_max - L_cache)) / L_cache
* factor, 0), the same on |y| <= L_max). A response cut at the limit (|y| = L_max) gets -factor.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor


def soft_overlong_penalty(lengths: Sequence[int] | Tensor, max_lengths: Sequence[int] | Tensor, *,
                          buffer_tokens: int, factor: float = 1.0) -> Tensor:
    """The DAPO length penalty (<= 0, float64) of each response: ``lengths[i]`` tokens generated under the
    limit ``max_lengths[i]`` (one per response: agents have their own ``max_new_tokens``). ``buffer_tokens`` is
    clamped to each limit (a buffer as long as the limit penalises from the first token)."""
    if buffer_tokens <= 0:
        raise ValueError(f"buffer_tokens must be > 0; got {buffer_tokens}")
    lengths = torch.as_tensor(lengths, dtype=torch.float64)
    limits = torch.as_tensor(max_lengths, dtype=torch.float64)
    if lengths.shape != limits.shape:
        raise ValueError(f"lengths {tuple(lengths.shape)} and max_lengths {tuple(limits.shape)} differ in shape")
    cache = torch.clamp(limits, max=float(buffer_tokens))
    expected = limits - cache
    linear = (expected - lengths) / cache
    penalty = torch.where(lengths <= expected, torch.zeros_like(lengths), linear)
    return torch.where(lengths > limits, torch.full_like(lengths, -1.0), penalty) * factor
