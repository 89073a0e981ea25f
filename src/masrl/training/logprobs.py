"""Response-token log-probs without full-vocabulary logits (``trainer.logprob_chunk_tokens``).

The plain path (``masrl.training.update.response_logits``) materialises float32 logits
``[rows, R, V]`` for a micro-batch (0.8 GB for 4096 tokens of SmolLM2's 49k vocabulary) and
autograd keeps several tensors of that size for backward. Here the decoder's last hidden states
are gathered at the response positions (the loss mask) only, and the LM head, log-softmax,
gather and entropy run on ``chunk_size`` tokens at a time; backward recomputes each chunk's
logits instead of storing them. Peak extra memory is a few ``[chunk_size, V]`` float32 tensors.

The same idea as Liger's fused linear cross-entropy and verl's fused kernels, written for our
outputs (per-token log-prob and entropy, per-token temperature) in plain PyTorch so that it runs
on CPU. Equal to the plain path up to float rounding (matmul summation order):
``tests/test_logprobs.py`` pins 1e-5 of the largest entry in float32, gradients included.
"""
from __future__ import annotations

import torch
from torch import Tensor

# config attributes of architectures whose logits are not ``lm_head(hidden)``: those use the plain path
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def _compute_dtype(hidden: Tensor) -> torch.dtype:
    """The LM head matmul's dtype: the autocast dtype on ``hidden``'s device, else ``hidden``'s own."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return hidden.dtype


def _chunk_logits(h: Tensor, weight: Tensor, bias: Tensor | None, dtype: torch.dtype) -> Tensor:
    """float32 ``h @ weight.T + bias`` with the matmul in ``dtype`` (as the plain path under autocast)."""
    bias = bias.to(dtype) if bias is not None else None
    return torch.nn.functional.linear(h.to(dtype), weight.to(dtype), bias).float()


def _chunk_stats(z: Tensor, targets: Tensor, with_entropy: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """Log-prob of ``targets``, the logsumexp and (optionally) the entropy of ``softmax(z)``."""
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, targets[:, None]).squeeze(-1) - lse
    entropy = None
    if with_entropy:  # H = lse - sum_v p_v z_v (as masrl.algorithms.losses.entropy_from_logsumexp)
        entropy = lse - (torch.exp(z - lse[:, None]) * z).sum(-1)
    return logp, lse, entropy


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temp, chunk_size, with_entropy):
        dtype = _compute_dtype(hidden)
        n = hidden.shape[0]
        logp = hidden.new_empty(n, dtype=torch.float32)
        lse = hidden.new_empty(n, dtype=torch.float32)
        entropy = hidden.new_empty(n, dtype=torch.float32) if with_entropy else None
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)  # cast once for every chunk (a 49k-token head: ~40 ms per cast)
            for start in range(0, n, chunk_size):
                sl = slice(start, start + chunk_size)
                z = _chunk_logits(hidden[sl], w, bias, dtype).div_(temp[sl, None])
                logp[sl], lse[sl], h = _chunk_stats(z, targets[sl], with_entropy)
                if with_entropy:
                    entropy[sl] = h
        ctx.save_for_backward(hidden, weight, bias, targets, temp, lse, entropy)
        ctx.chunk_size, ctx.dtype = chunk_size, dtype
        ctx.set_materialize_grads(False)
        if with_entropy:
            return logp, entropy
        return logp, None

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, targets, temp, lse, entropy = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.zeros_like(hidden) if need_h else None
        grad_w = None  # the first chunk's gradient, then a sum (no [V, d] zeros to fill and add)
        grad_b = torch.zeros_like(bias, dtype=torch.float32) if need_b else None
        if grad_logp is None and grad_entropy is None:
            grad_w = torch.zeros_like(weight) if need_w else None
            return grad_h, grad_w, grad_b, None, None, None, None
        dtype = ctx.dtype
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)  # cast once, for the logits and grad_h of every chunk
            for start in range(0, hidden.shape[0], ctx.chunk_size):
                sl = slice(start, start + ctx.chunk_size)
                h = hidden[sl]
                z = _chunk_logits(h, w, bias, dtype).div_(temp[sl, None])
                # d/dz: logp -> onehot(target) - p ; entropy -> -p * (log p + H); log p = z - lse
                grad_z = z.sub_(lse[sl, None])  # log p, in place (z is not needed again)
                probs = torch.exp(grad_z)
                if grad_entropy is not None:
                    grad_z.add_(entropy[sl, None]).mul_(probs).mul_(-grad_entropy[sl, None])
                else:
                    grad_z.zero_()
                if grad_logp is not None:
                    g = grad_logp[sl, None]
                    grad_z.sub_(probs.mul_(g))
                    grad_z.scatter_add_(-1, targets[sl, None], g.contiguous())
                grad_z.div_(temp[sl, None])  # dz/dlogits = 1/T
                gz = grad_z.to(dtype)
                if need_h:
                    grad_h[sl] = (gz @ w).to(hidden.dtype)
                if need_w:
                    chunk_w = gz.t() @ h.to(dtype)
                    if grad_w is None:
                        grad_w = chunk_w.float()
                    else:
                        grad_w.add_(chunk_w)
                if need_b:
                    grad_b.add_(grad_z.sum(0))
        grad_w = grad_w.to(weight.dtype) if grad_w is not None else None
        grad_b = grad_b.to(bias.dtype) if grad_b is not None else None
        return grad_h, grad_w, grad_b, None, None, None, None


def chunked_token_logprobs(hidden: Tensor, weight: Tensor, bias: Tensor | None, target_ids: Tensor,
                           chunk_size: int, temperature: float | Tensor = 1.0,
                           with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """Per-token ``log softmax(lm_head(hidden) / T)[target]`` and entropy, ``chunk_size`` tokens at a time.

    ``hidden`` [N, d] (the tokens to score, already gathered), ``weight`` [V, d] and ``bias`` [V] or
    None (the LM head), ``target_ids`` [N], ``temperature`` a number or [N] (one per token). Returns
    float32 ``(logprobs [N], entropy [N] or None)``; both are differentiable w.r.t. ``hidden``,
    ``weight`` and ``bias``; backward recomputes each chunk's logits. Under ``torch.autocast`` the
    matmul runs in the autocast dtype and the softmax math in float32, as in the plain path.
    """
    if hidden.dim() != 2 or target_ids.shape != hidden.shape[:1]:
        raise ValueError(f"chunked_token_logprobs: hidden must be [N, d] and target_ids [N]; got "
                         f"{tuple(hidden.shape)} and {tuple(target_ids.shape)}")
    if chunk_size <= 0:
        raise ValueError(f"chunked_token_logprobs: chunk_size must be > 0, got {chunk_size}")
    temp = torch.as_tensor(temperature, dtype=torch.float32, device=hidden.device).expand(hidden.shape[0])
    logp, entropy = _ChunkedLogprobs.apply(hidden, weight, bias, target_ids.long(), temp.contiguous(),
                                           int(chunk_size), bool(with_entropy))
    return logp, entropy


# --------------------------------------------------------------------------------------------
# models: the decoder's hidden states at the response positions, then the LM head in chunks


def lm_head_params(model: torch.nn.Module) -> tuple[Tensor, Tensor | None] | None:
    """``(weight, bias)`` such that the model's logits are ``hidden @ weight.T + bias``, or None when
    they are not (an architecture that rescales or soft-caps logits, an LM head that is neither a
    Linear nor a PEFT LoRA Linear, LoRA on the LM head with dropout or routed per row): the caller then
    takes the plain path. Tied embeddings need nothing special: the weight is the embedding matrix and
    its gradient accumulates both uses. LoRA on the LM head gives the merged weight ``W + s B A``,
    differentiable w.r.t. the adapter."""
    config = getattr(model, "config", None)
    if any(getattr(config, name, None) not in (None, 1, 1.0) for name in _LOGIT_TRANSFORMS):
        return None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is torch.nn.Linear:
        return head.weight, head.bias
    try:
        from peft.tuners.lora.layer import LoraLayer
    except ImportError:  # no PEFT installed: no LoRA head either
        return None

    if not isinstance(head, LoraLayer) or type(head.get_base_layer()) is not torch.nn.Linear:
        return None
    base = head.get_base_layer()
    if head.disable_adapters or head.merged:
        return base.weight, base.bias
    if "forward" in head.__dict__ or getattr(head, "fan_in_fan_out", False):  # routed per row (mixed_adapters)
        return None
    weight = base.weight
    for name in head.active_adapters:
        if name not in head.lora_A:
            continue
        drop = head.lora_dropout[name]
        if not isinstance(drop, torch.nn.Identity) and head.training and drop.p > 0:
            return None
        if getattr(head, "lora_variant", {}).get(name) is not None:
            return None
        delta = head.lora_B[name].weight @ head.lora_A[name].weight * head.scaling[name]
        weight = weight + delta.to(weight.dtype)
    return weight, base.bias


def response_logprobs(model: torch.nn.Module, batch, chunk_tokens: int,
                      with_entropy: bool = False) -> tuple[Tensor, Tensor | None] | None:
    """Log-probs (and entropy) of ``batch.targets`` under ``model``, ``[rows, R]`` float32, zero outside
    ``batch.response_mask``; computed from the decoder's last hidden states at the response positions
    only (``chunked_token_logprobs``). None when ``chunk_tokens`` is 0 or the model's logits are not
    a plain LM head (``lm_head_params``): use ``masrl.training.update.response_logits``."""
    if chunk_tokens <= 0:
        return None
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    head = lm_head_params(model)
    if head is None or decoder is None or decoder is model:
        return None
    resp = batch.targets.shape[1]
    out = decoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                  position_ids=batch.position_ids, use_cache=False)
    mask = batch.response_mask > 0
    hidden = out.last_hidden_state[:, -(resp + 1):-1, :][mask]  # [N, d]: the positions predicting the response
    temp = batch.temperature[:, None].expand_as(mask)[mask]
    logp, entropy = chunked_token_logprobs(hidden, head[0], head[1], batch.targets[mask], chunk_tokens, temp,
                                           with_entropy)
    zeros = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    return zeros.masked_scatter(mask, logp), (zeros.masked_scatter(mask, entropy) if with_entropy else None)
