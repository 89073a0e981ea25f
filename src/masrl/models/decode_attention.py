"""Attention for 1-token decode queries on CPU: two batched matmuls in float32 that read the cache in place.

transformers' ``sdpa`` attention runs a decode step (one query token per row) through the CPU flash kernel of
``scaled_dot_product_attention``: under ``torch.autocast`` in bfloat16 (and with ``enable_gqa=True`` when there
is no padding mask), and on the preallocated cache's strided views of the filled positions, which it reads at
about half the speed of contiguous keys. :func:`decode_attention_forward` computes a 1-token query on a CPU
itself, in float32 (autocast off): the query on the grouped view ``[batch * kv_heads, groups, head_dim]`` (no
``repeat_kv`` copy), scores by one batched matmul over the cache's views (the batch and head dims fold into
one: no copy), the mask, a softmax, and a second batched matmul with the values; the output in the query's
dtype. A decode step is a matrix-vector product per row and head, bound by reading the keys and values.
Under autocast the engine keeps the cache itself in float32 (``TransformersEngine._cache_dtype``: the bf16 keys
exactly), so nothing is converted per step. Everything else goes to transformers' ``sdpa_attention_forward``
unchanged: prompts (several query tokens), other devices, soft-capping, position biases, attention sinks,
per-head masks, masks that do not match the keys.

Exactness: float32 arithmetic from the same inputs; equal to float32 ``sdpa`` within 2e-6 (more precise than
``sdpa``'s bfloat16 under autocast, off by > 1e-4); in the engine the greedy tokens of tiny configs are identical
to ``sdpa``'s, log-probs within 1e-5 in float32 and 0.004 of bf16 ``sdpa``'s (``tests/test_decode_attention.py``).
Not bitwise ``sdpa`` in float32 (a different summation order). Measured in
``benchmarks/profile_step.py --section levers --levers decode_attention`` (docs/performance.md).

The in-process engine uses it only while it decodes (:func:`decode_attention`, a context manager that
switches a model whose attention is ``sdpa`` to this function and back); training keeps ``sdpa``.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

NAME = "masrl_decode_sdpa"
_UNSUPPORTED_KWARGS = ("softcap", "position_bias", "s_aux", "sinks")
_registered = False


def decode_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention-interface function: ``query`` ``[batch, heads, q_len, dim]``, ``key``/``value``
    ``[batch, kv_heads, kv_len, dim]``; returns ``([batch, q_len, heads, dim], None)`` as ``sdpa`` does."""
    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    if (q_len != 1 or query.device.type != "cpu" or dropout or heads % kv_heads
            or value.shape[-1] != dim
            or any(kwargs.get(k) is not None for k in _UNSUPPORTED_KWARGS)
            or (attention_mask is not None and (attention_mask.dim() != 4
                                                or tuple(attention_mask.shape[1:]) != (1, 1, key.shape[2])
                                                or attention_mask.shape[0] not in (1, batch)))):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    with torch.autocast("cpu", enabled=False):
        out = grouped_decode_attention(query.float(), key.float(), value.float(), attention_mask,
                                       dim ** -0.5 if scaling is None else scaling)
    return out.to(query.dtype), None


def _fold(x: torch.Tensor) -> torch.Tensor:
    """``[batch, kv_heads, length, dim]`` as ``[batch * kv_heads, length, dim]`` without a copy when the two
    leading dims fold (a view of the preallocated cache: row stride = kv_heads x head stride)."""
    b, h, n, d = x.shape
    if x.stride(0) == h * x.stride(1) and x.stride(3) == 1:
        return x.as_strided((b * h, n, d), (x.stride(1), x.stride(2), 1))
    return x.reshape(b * h, n, d)


def grouped_decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Attention of one query token per row, in the dtype of its inputs (float32 here): ``query``
    ``[batch, heads, 1, dim]``, ``key``/``value`` ``[batch, kv_heads, length, dim]`` (any strides: the cache's
    views are read in place), ``mask`` ``[batch, 1, 1, length]`` (bool: True attends; or additive) or None.
    Returns ``[batch, 1, heads, dim]``, heads in ``repeat_kv`` order (head h reads kv head h // groups).

    Two batched matmuls over ``batch x kv_heads`` (scores ``[groups, length]``, then probabilities x values)
    and a softmax between them; a decode step is a matrix-vector product per row and head, bound by reading
    the keys and values, which the CPU flash kernel reads at about half this speed from strided views."""
    batch, heads, _, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    q = query.reshape(batch * kv_heads, groups, dim)
    scores = torch.bmm(q, _fold(key).transpose(1, 2)).view(batch, heads, length)
    scores.mul_(scale)
    if mask is not None:
        mask = mask.reshape(mask.shape[0], 1, length)  # [batch or 1, 1, length]
        if mask.dtype == torch.bool:
            scores.masked_fill_(~mask, float("-inf"))
        else:
            scores.add_(mask)
    probs = torch.softmax(scores, -1).view(batch * kv_heads, groups, length)
    return torch.bmm(probs, _fold(value)).view(batch, 1, heads, dim)


def register() -> None:
    """Make :data:`NAME` a transformers attention implementation (with ``sdpa``'s mask format). Idempotent."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, decode_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    _registered = True


@contextlib.contextmanager
def decode_attention(model: torch.nn.Module) -> Iterator[bool]:
    """Inside, ``model`` (a transformers model whose attention is ``sdpa``, on a CPU) uses
    :func:`decode_attention_forward`; yields whether it switched. Other models are left as they are."""
    config = getattr(model, "config", None)
    try:
        device = next(model.parameters()).device
    except StopIteration:
        device = torch.device("meta")
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa" or device.type != "cpu":
        yield False
        return
    register()
    config._attn_implementation = NAME
    try:
        yield True
    finally:
        config._attn_implementation = "sdpa"
