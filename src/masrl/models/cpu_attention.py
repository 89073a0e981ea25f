"""masrl's attention on CPU: 1-token decode queries as two batched matmuls in float32 that read the cache in
place, and short sequences under bf16/fp16 autocast in float32.

**Decode steps.** transformers' ``sdpa`` attention runs a decode step (one query token per row) through the CPU
flash kernel of ``scaled_dot_product_attention``: under ``torch.autocast`` in bfloat16 (and with
``enable_gqa=True`` when there is no padding mask), and on the preallocated cache's strided views of the filled
positions, which it reads at about half the speed of contiguous keys. ``attention_forward`` computes a 1-token
query on a CPU itself, in float32 (autocast off): the query on the grouped view ``[batch * kv_heads, groups,
head_dim]`` (no ``repeat_kv`` copy), scores by one batched matmul over the cache's views (the batch and head dims
fold into one: no copy), the mask, a softmax, and a second batched matmul with the values; the output in the
query's dtype. A decode step is a matrix-vector product per row and head, bound by reading the keys and values.
Under autocast the engine keeps the cache itself in float32 (``TransformersEngine._cache_dtype``: the bf16 keys
exactly), so nothing is converted per step.

**Prompts and training sequences** (several query tokens) go to transformers' ``sdpa_attention_forward``; on a
CPU, when the inputs are bf16/fp16 or autocast is on and there are at most ``FLOAT32_MAX_KEYS`` keys, with
float32 inputs and autocast off, the output cast back to what ``sdpa`` returns there. The CPU flash kernel is
2-4x slower in bf16 than in float32 at these lengths (forward + backward, `benchmarks/profile_step.py --section
levers --levers train_attention`; from ~512 keys on bf16 is as fast or faster), and float32 is the more precise.
Gradients flow through the casts (autograd), so the update, the trainer's log-prob passes and SFT use it
(``cpu_attention`` around their forward and backward, for gradient checkpointing's recomputation).

Everything else goes to ``sdpa_attention_forward`` unchanged: other devices, float32 without autocast,
soft-capping, position biases, attention sinks, per-head masks, masks that do not match the keys (decode).

Exactness: float32 arithmetic from the same inputs. Decode: equal to float32 ``sdpa`` within 2e-6 (more precise
than ``sdpa``'s bfloat16 under autocast, off by > 1e-4); in the engine the greedy tokens of tiny configs are
identical to ``sdpa``'s, log-probs within 1e-5 in float32 and 0.004 of bf16 ``sdpa``'s. Short sequences under
autocast: bitwise float32 ``sdpa`` of the bf16 inputs (``tests/test_cpu_attention.py``). Float32 runs without
autocast are bitwise what they were, except decode steps (a different summation order than ``sdpa``).

The in-process engine switches a model to it while it decodes, the trainer while it computes log-probs and
gradients (``cpu_attention``, a context manager that switches a model whose attention is ``sdpa`` to this
function and back).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

NAME = "masrl_cpu_sdpa"
FLOAT32_MAX_KEYS = 256  # short sequences under autocast: float32 sdpa up to this many keys
_UNSUPPORTED_KWARGS = ("softcap", "position_bias", "s_aux", "sinks")
_registered = False


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
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
        return sdpa_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    with torch.autocast("cpu", enabled=False):
        out = grouped_decode_attention(query.float(), key.float(), value.float(), attention_mask,
                                       dim ** -0.5 if scaling is None else scaling)
    return out.to(query.dtype), None


def sdpa_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                 **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' ``sdpa_attention_forward``; on a CPU in float32 (autocast off) when the inputs are bf16/fp16
    or autocast is on and there are at most ``FLOAT32_MAX_KEYS`` keys. The output has the dtype ``sdpa``
    gives there (autocast's, else the query's)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    on_cpu = query.device.type == "cpu"
    low = torch.get_autocast_dtype("cpu") if on_cpu and torch.is_autocast_enabled("cpu") else query.dtype
    if (not on_cpu or key.shape[2] > FLOAT32_MAX_KEYS
            or low not in (torch.bfloat16, torch.float16)
            or any(kwargs.get(k) is not None for k in _UNSUPPORTED_KWARGS)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.float()
    with torch.autocast("cpu", enabled=False):
        out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask,
                                              dropout=dropout, scaling=scaling, **kwargs)
    return out.to(low), weights


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
    """Make ``NAME`` a transformers attention implementation (with ``sdpa``'s mask format). Idempotent."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    _registered = True


@contextlib.contextmanager
def cpu_attention(model: torch.nn.Module) -> Iterator[bool]:
    """Inside, ``model`` (a transformers model whose attention is ``sdpa``, on a CPU) uses
    ``attention_forward``; yields whether it switched. Other models, and a model already switched by an
    enclosing call, are left as they are."""
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
