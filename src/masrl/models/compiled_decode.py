"""``rollout.compile_decode``: the engine's whole decode step as one compiled graph (torch.compile, inductor, C++).

``FastDecode`` (``masrl.models.fast_decode``) runs a decode step as eager operators. With ``compile_decode`` on,
its base-model step runs through ``decode_step`` compiled with inductor instead: every layer of the model in one
graph (the weights are graph inputs, so a new weight version reuses the graph), the norms, rotary embeddings,
SiLU, residual sums and casts as inductor's fused C++, the matrix products as ATen's (plain weights) or
oneDNN's inner product on the prepacked bf16 weights (``masrl::packed_linear``, a custom operator: inductor
lowers ``mkldnn._linear_pointwise`` only for weights frozen into the graph as constants, which a policy whose
weights change at every RL step cannot use), the cache write and the 1-token attention as the engine's
(``masrl::cache_attention``, around ``masrl.models.cpu_attention.grouped_decode_attention``). Sizes are symbolic
(``dynamic=True``) and the filled length travels as a 0-d tensor, so one graph serves every row count as rows
finish and every length as the cache grows; a batch with a padding mask and one without, and a batch of one row,
compile graphs of their own (at most four; the quickstart's 3-step run with the option on: three). Graphs
persist across runs in inductor's cache (``masrl.models.compiled_layers.inductor_cache``).

**Exactness.** Run uncompiled, ``decode_step`` is bitwise ``FastDecode``'s eager step
(``tests/test_compiled_decode.py``); compiled, inductor's fused kernels keep float32 inside where eager rounds
to bf16 between operators, so bf16 log-probs differ by bf16 rounding (within 0.08 on SmolLM2, greedy tokens
equal) and float32 ones by float rounding; greedy tokens agree unless two candidates tie within that.

**Where it runs.** Steps of the base model only: a batch whose rows decode with LoRA adapters (per-row routes or
PEFT's active adapters), unstacked projections (models above ``fast_decode.STACK_MAX_BYTES``), or a cache whose
layers are not all at the same filled length over all rows run the eager step. A C++ compiler that builds
inductor's kernels is checked for once per process (``compiled_layers.cxx_compiler``, ``inductor_failure``);
without one every step stays eager, with one warning. A compiled step that
fails (a graph inductor cannot build for a new shape, a kernel that fails) is run eager instead, and so is every
later step of the process, with one warning: the cache's filled length moves only after a compiled step
succeeds, so the eager step rewrites the same positions and nothing is lost.

**Speed.** Not faster than the eager step where measured, so off by default: on an Intel Xeon with AMX, one
thread, 1.03-1.06x eager's CPU per decode step for SmolLM2-135M under bf16 autocast at 8 and 32 rows, 0.99-1.10x
for the float32 tiny model at 16 and 64 (``benchmarks/compile_decode.py --modes whole``; benchmarks/RESULTS.md,
"Compiled decode step"); SmolLM2's first call compiles for up to about a minute with a cold cache.
"""
from __future__ import annotations

import logging
from typing import Sequence

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


@torch.library.custom_op("masrl::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, n_out: int) -> torch.Tensor:
    """``x @ W.T + bias`` on a weight prepacked by ``masrl.models.packed_linear.pack`` (``n_out`` rows of W)."""
    from masrl.models.packed_linear import linear

    return linear(x, weight, bias)


@packed_linear.register_fake
def _(x, weight, bias, n_out):
    return x.new_empty((x.shape[0], n_out))


@torch.library.custom_op("masrl::cache_attention", mutates_args=("key_buffer", "value_buffer"))
def cache_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_buffer: torch.Tensor,
                    value_buffer: torch.Tensor, filled: torch.Tensor, mask: torch.Tensor | None,
                    scale: float) -> torch.Tensor:
    """Write this step's keys/values (``[batch, kv_heads, dim]``) at position ``filled`` of the preallocated
    buffers and attend over positions 0..filled in float32, as the cache layer's ``update`` and
    ``grouped_decode_attention`` do; ``query`` ``[batch, heads, dim]``, the result ``[batch, 1, heads, dim]``."""
    from masrl.models.cpu_attention import grouped_decode_attention

    at = int(filled)
    key_buffer[:, :, at].copy_(key)
    value_buffer[:, :, at].copy_(value)
    return grouped_decode_attention(query[:, :, None, :].float(), key_buffer[:, :, :at + 1].float(),
                                    value_buffer[:, :, :at + 1].float(), mask, scale)


@cache_attention.register_fake
def _(query, key, value, key_buffer, value_buffer, filled, mask, scale):
    return query.new_empty((query.shape[0], 1, query.shape[1], query.shape[2]), dtype=torch.float32)


def projection(pair: tuple[torch.Tensor, torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
    """A ``FastDecode`` (weight, bias) pair as ``decode_step`` takes it: with whether the weight is prepacked,
    known before tracing (a traced opaque tensor does not say it is one)."""
    return (*pair, pair[0].is_mkldnn)


def _linear(x: torch.Tensor, projection: tuple[torch.Tensor, torch.Tensor | None, bool], n_out: int) -> torch.Tensor:
    weight, bias, packed = projection
    if packed:
        return packed_linear(x, weight, bias, n_out)
    return F.linear(x, weight, bias)


def _rms_norm(x: torch.Tensor, norm: tuple[torch.Tensor, float]) -> torch.Tensor:
    """``masrl.models.fast_decode.rms_norm`` restated: fast_decode imports this module, so it cannot import that
    one (no import cycles); ``tests/test_compiled_decode.py`` pins the two steps bitwise equal."""
    weight, eps = norm
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def decode_step(h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layers: Sequence[tuple], caches: Sequence[tuple],
                filled: torch.Tensor, mask: torch.Tensor | None, final_norm: tuple, head: tuple, shapes: tuple,
                low: torch.dtype) -> torch.Tensor:
    """Every decoder layer and the LM head of one decode step, the arithmetic of ``FastDecode._step`` for the
    base model with stacked weights. ``h``: the embedded tokens ``[batch, hidden]``; ``layers``: per layer
    ``(norm1, qkv, q_norm, k_norm, o, norm2, gate_up, down)`` (norms as ``(weight, eps)``, projections as
    ``projection`` makes them, q/k norms None but for Qwen3); ``caches``: per layer its ``(keys, values)`` buffers;
    ``filled``: the cached length (0-d); ``shapes``: ``(n_q, n_kv, head_dim, n_inner, scaling, hidden, vocab)``;
    ``low``: the matrix products' dtype. Returns the next-token logits."""
    n_q, n_kv, dim, n_inner, scaling, hidden, vocab = shapes
    batch = h.shape[0]
    q_heads, kv_heads, half = n_q // dim, n_kv // dim, dim // 2
    for layer, (key_buffer, value_buffer) in zip(layers, caches):
        norm1, qkv_w, q_norm, k_norm, o_w, norm2, gate_up_w, down_w = layer
        x = _rms_norm(h, norm1).to(low)
        qkv = _linear(x, qkv_w, n_q + 2 * n_kv)
        qk = qkv[:, :n_q + n_kv].view(batch, q_heads + kv_heads, dim)
        if q_norm is not None:
            qk = torch.cat((_rms_norm(qk[:, :q_heads], q_norm), _rms_norm(qk[:, q_heads:], k_norm)), 1)
        qk = qk * cos + torch.cat((-qk[..., half:], qk[..., :half]), -1) * sin
        query = qk[:, :q_heads]
        attn = cache_attention(query, qk[:, q_heads:], qkv[:, n_q + n_kv:].view(batch, kv_heads, dim),
                               key_buffer, value_buffer, filled, mask, scaling)
        attn = attn.reshape(batch, n_q).to(query.dtype).to(low)
        h = h + _linear(attn, o_w, hidden)
        x = _rms_norm(h, norm2).to(low)
        gate_up = _linear(x, gate_up_w, 2 * n_inner)
        inner = F.silu(gate_up[:, :n_inner]) * gate_up[:, n_inner:]
        h = h + _linear(inner, down_w, hidden)
    x = _rms_norm(h, final_norm).to(low)
    return _linear(x, head, vocab)


_COMPILED = []  # the compiled decode_step, made on first use (one per process: every model shares it)


def compiled_decode_step():
    """``decode_step`` compiled with inductor (symbolic sizes), made once per process."""
    if not _COMPILED:
        from masrl.models.compiled_layers import inductor_cache

        inductor_cache()
        _COMPILED.append(torch.compile(decode_step, dynamic=True))
    return _COMPILED[0]


_REFUSED: dict[str, str | None] = {}  # why the compiled step cannot run in this process (None: it can)


def compiler_failure() -> str | None:
    """Why the step does not run compiled here (None: it does): no C++ compiler or one that cannot build
    inductor's kernels (``compiled_layers.toolchain_failure``), or a compiled step that failed (``refuse``).
    The compiler is checked once per process; a refusal is logged once, as a warning."""
    from masrl.models.compiled_layers import inductor_cache, toolchain_failure

    folder = inductor_cache()
    if folder not in _REFUSED:
        _REFUSED[folder] = None
        if (reason := toolchain_failure()) is not None:
            refuse(reason)
    return _REFUSED[folder]


def refuse(reason: str) -> None:
    """From now on, in this process, every decode step runs eager; says why once (a warning)."""
    from masrl.models.compiled_layers import inductor_cache

    folder = inductor_cache()
    if _REFUSED.get(folder) is None:
        _REFUSED[folder] = reason
        log.warning("rollout.compile_decode: true, eager decode steps: %s", reason)
