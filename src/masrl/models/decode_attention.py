"""Attention for 1-token decode queries on CPU in low precision: float32 SDPA on the grouped (GQA) view.

transformers' ``sdpa`` attention runs a decode step (one query token per row) through
``scaled_dot_product_attention`` under ``torch.autocast``, i.e. in bfloat16, and with ``enable_gqa=True``
when there is no padding mask. On CPU the bfloat16 flash kernel is slow for a 1-token query: 0.83 ms per
call for 8 rows x 9 heads x 92 keys with ``enable_gqa``, 0.25 ms on the grouped view
``[batch, kv_heads, groups, head_dim]``, 0.10 ms on that view in float32 (one Zen 4 core).
:func:`decode_attention_forward` takes the last path for a 1-token query on a CPU under autocast or with
low-precision inputs: autocast off, query/keys/values in float32, the query reshaped to the grouped view
(no ``repeat_kv`` copy, no ``enable_gqa``), the same SDPA kernel, the output in the query's dtype.
Everything else goes to transformers' ``sdpa_attention_forward`` unchanged: float32 without autocast (the
float32 kernels gain nothing measurable here, and float32 results stay bitwise as they were), prompts
(several query tokens), other devices, soft-capping, position biases, attention sinks, per-head masks.

Exactness: the attention is computed in float32 from the same inputs, i.e. more precisely than ``sdpa``'s
bfloat16 (equal to float32 ``sdpa`` within 2e-6; the engine's greedy tokens on tiny configs identical, its
log-probs within 0.004 of bf16 ``sdpa``'s: ``tests/test_decode_attention.py``). Measured in
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
    full_precision = (query.dtype == key.dtype == value.dtype == torch.float32
                      and not torch.is_autocast_enabled("cpu"))
    if (q_len != 1 or query.device.type != "cpu" or full_precision or dropout or heads % kv_heads
            or value.shape[-1] != dim
            or any(kwargs.get(k) is not None for k in _UNSUPPORTED_KWARGS)
            or (attention_mask is not None and (attention_mask.dim() != 4 or attention_mask.shape[1] != 1))):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    with torch.autocast("cpu", enabled=False):
        grouped = query.float().reshape(batch, kv_heads, heads // kv_heads, dim)
        mask = attention_mask if attention_mask is None or attention_mask.dtype == torch.bool else attention_mask.float()
        out = torch.nn.functional.scaled_dot_product_attention(grouped, key.float(), value.float(), attn_mask=mask,
                                                               scale=scaling)
    # [batch, kv_heads, groups, dim] -> [batch, 1, heads, dim]; head h = kv head h // groups, as repeat_kv orders them
    return out.reshape(batch, 1, heads, dim).to(query.dtype), None


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
