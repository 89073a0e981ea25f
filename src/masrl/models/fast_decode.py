"""A lean decode step for Llama-architecture causal LMs on a CPU in float32: the same arithmetic as
transformers' forward, in a little over half the operator calls.

A decode step feeds one token per row. For a small model its cost is mostly per-operator overhead, not
arithmetic: transformers' ``LlamaForCausalLM`` makes 352 top-level ATen calls per decode step of the 4-layer tiny
model (986 counting the calls inside them; module calls, the attention-mask builder, output dataclasses, a
``q``/``k``/``v`` projection each, an RMSNorm of eight element-wise ops); this step makes 196 (683). A team pays this more often than a single agent at equal generated tokens: its three dependent
agent turns run ~2.3x the decode steps of one wider batch (``benchmarks/multiagent_overhead.py``).

:class:`FastDecode` computes a decode step of ``LlamaForCausalLM`` directly from the weights:

* ``q``/``k``/``v`` in one matrix product with the three weights stacked (``gate``/``up`` likewise), the stacked
  weights made once per weight version and reused across engine calls while the weights do not change;
* RMSNorm as ``torch.nn.functional.rms_norm``;
* rotary embeddings applied to the query and key heads together (the model's own rotary module computes
  ``cos``/``sin``, so every RoPE type works);
* the 1-token attention of :func:`masrl.models.cpu_attention.grouped_decode_attention` (two batched matmuls over
  the preallocated cache's views), the keys/values written by the cache layer's own ``update``.

**Exactness.** Bitwise the logits of transformers' forward with masrl's CPU decode attention, in float32
(``tests/test_fast_decode.py``: MHA and GQA configs, padding masks, compaction, the engine's tokens and
log-probs). Two of the rewrites reorder nothing but rely on the BLAS: a matrix product's columns do not depend
on which other weight rows share the call (stacked ``q``/``k``/``v``), and ``rms_norm`` computes the mean of
squares as transformers' formula does; both are checked by the tests on the machine that runs them.
``TransformersEngine(fast_decode=False)`` keeps transformers' forward.

It applies only where that equality is meant to hold; everything else goes through ``model(...)``:
a plain ``LlamaForCausalLM`` (not wrapped by PEFT, no hooks, no FSDP2 shards), float32 CPU weights with no
biases, SiLU MLP, decoding with masrl's CPU attention (:mod:`masrl.models.cpu_attention`) into the preallocated
KV cache (:mod:`masrl.rollout.kv_cache`), autocast off. bf16 decoding (SmolLM2 under ``autocast: auto``), LoRA
adapters and other architectures keep transformers' forward.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from masrl.models.cpu_attention import NAME as CPU_ATTENTION, grouped_decode_attention

# stacked q/k/v and gate/up weights are a copy of most of the model: above this many bytes the projections run
# one by one instead (still lean, no copy)
STACK_MAX_BYTES = 256 * 2**20


def _plain_linear(module) -> bool:
    w = getattr(module, "weight", None)
    return (type(module) is torch.nn.Linear and module.bias is None and type(w) is torch.nn.Parameter
            and w.dtype == torch.float32 and w.device.type == "cpu" and w.layout == torch.strided)


def _no_hooks(model: torch.nn.Module) -> bool:
    from torch.nn.modules import module as nn_module

    if any(getattr(nn_module, name, None) for name in ("_global_forward_hooks", "_global_forward_pre_hooks",
                                                         "_global_forward_hooks_with_kwargs")):
        return False
    return not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def unsupported(model: torch.nn.Module) -> str | None:
    """Why :class:`FastDecode` does not apply to ``model`` (None: it does). Autocast is checked per call."""
    try:
        from transformers.models.llama.modeling_llama import LlamaForCausalLM, LlamaModel, LlamaRMSNorm
    except ImportError:  # pragma: no cover - transformers without Llama
        return "transformers has no Llama"
    if type(model) is not LlamaForCausalLM or type(getattr(model, "model", None)) is not LlamaModel:
        return f"{type(model).__name__} is not a plain LlamaForCausalLM"
    config = model.config
    if getattr(config, "_attn_implementation", None) != CPU_ATTENTION:
        return "attention is not masrl's CPU decode attention"
    if model.training:
        return "model in training mode"
    if getattr(config, "hidden_act", None) != "silu":
        return f"activation {getattr(config, 'hidden_act', None)!r} is not silu"
    inner = model.model
    if len(inner.layers) != config.num_hidden_layers:
        return "layer count differs from the config"
    embed = inner.embed_tokens
    if type(embed) is not torch.nn.Embedding or embed.max_norm is not None or embed.weight.dtype != torch.float32:
        return "embeddings are not a plain float32 nn.Embedding"
    if not _plain_linear(model.lm_head):
        return "LM head is not a plain float32 nn.Linear without bias"
    norms = [inner.norm] + [n for layer in inner.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    if any(type(n) is not LlamaRMSNorm or n.weight.dtype != torch.float32 for n in norms):
        return "a norm is not a float32 LlamaRMSNorm"
    for layer in inner.layers:
        a, m = layer.self_attn, layer.mlp
        if not all(_plain_linear(x) for x in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj,
                                              m.down_proj)):
            return "a projection is not a plain float32 nn.Linear without bias (LoRA, quantized, sharded, bias)"
        if a.q_proj.out_features % a.head_dim or a.k_proj.out_features % a.head_dim or a.head_dim % 2:
            return "head sizes do not divide the projections"
    if not _no_hooks(model):
        return "the model has forward hooks"
    return None


class FastDecode:
    """Decode steps of one ``LlamaForCausalLM`` from its current weights (see the module docstring).

    Build it with :meth:`for_model` at the start of an engine call: the stacked weights are remade only when a
    weight changed (its version counter or storage)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.key = self._weights_key(model)
        inner = model.model
        stacked = sum(layer.self_attn.q_proj.weight.numel() + layer.self_attn.k_proj.weight.numel()
                      + layer.self_attn.v_proj.weight.numel() + layer.mlp.gate_proj.weight.numel()
                      + layer.mlp.up_proj.weight.numel() for layer in inner.layers) * 4
        self.stacked = stacked <= STACK_MAX_BYTES
        self.layers = []
        with torch.no_grad():
            for layer in inner.layers:
                a, m = layer.self_attn, layer.mlp
                qkv = tuple(w.detach() for w in (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight))
                gate_up = tuple(w.detach() for w in (m.gate_proj.weight, m.up_proj.weight))
                if self.stacked:  # one matrix product each (a stacked tensor instead of a tuple)
                    qkv, gate_up = torch.cat(qkv), torch.cat(gate_up)
                self.layers.append(dict(
                    norm1=(layer.input_layernorm.weight.detach(), layer.input_layernorm.variance_epsilon),
                    qkv=qkv, n_q=a.q_proj.out_features, n_kv=a.k_proj.out_features, head_dim=a.head_dim,
                    scaling=a.scaling, o=a.o_proj.weight.detach(),
                    norm2=(layer.post_attention_layernorm.weight.detach(),
                           layer.post_attention_layernorm.variance_epsilon),
                    gate_up=gate_up, n_inner=m.gate_proj.out_features, down=m.down_proj.weight.detach()))
        self.norm = (inner.norm.weight.detach(), inner.norm.variance_epsilon)
        self.embed = inner.embed_tokens.weight.detach()
        self.head = model.lm_head.weight.detach()
        self.hidden = inner.embed_tokens.embedding_dim

    @staticmethod
    def _weights_key(model: torch.nn.Module) -> tuple:
        return tuple((p.data_ptr(), p._version) for p in model.parameters())

    @classmethod
    def for_model(cls, model: torch.nn.Module, previous: "FastDecode | None" = None) -> "FastDecode | None":
        """A :class:`FastDecode` for ``model`` (``previous`` reused when its weights are unchanged), or None when
        it does not apply (:func:`unsupported`) or autocast is on."""
        if torch.is_autocast_enabled("cpu") or unsupported(model) is not None:
            return None
        if previous is not None and previous.model is model and previous.key == cls._weights_key(model):
            return previous
        return cls(model)

    @staticmethod
    def _project(x: torch.Tensor, weights: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
        if isinstance(weights, torch.Tensor):
            return F.linear(x, weights)
        return torch.cat([F.linear(x, w) for w in weights], -1)

    def step(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        """One decode step: ``ids`` ``[batch]`` (the tokens fed), ``mask`` ``[batch, length]`` (1 = attend; the
        cache's filled positions + this one), ``positions`` ``[batch]``; writes this step's keys/values into
        ``cache`` and returns the next-token logits ``[batch, vocab]``."""
        batch, hidden = ids.shape[0], self.hidden
        h = F.embedding(ids, self.embed)
        cos, sin = self.model.model.rotary_emb(h, positions[:, None])  # [batch, 1, head_dim]
        # padding as an additive mask, made once per step: adding 0 / -inf is what masked_fill does, bitwise
        padded = mask == 0
        additive = (torch.zeros(padded.shape, dtype=h.dtype).masked_fill_(padded, float("-inf"))[:, None, None, :]
                    if bool(padded.any()) else None)
        for layer, cache_layer in zip(self.layers, cache.layers):
            dim, n_q, n_kv = layer["head_dim"], layer["n_q"], layer["n_kv"]
            q_heads, kv_heads = n_q // dim, n_kv // dim
            x = F.rms_norm(h, (hidden,), *layer["norm1"])
            qkv = self._project(x, layer["qkv"])
            qk = qkv[:, :n_q + n_kv].view(batch, q_heads + kv_heads, dim)
            half = dim // 2
            qk = qk * cos + torch.cat((-qk[..., half:], qk[..., :half]), -1) * sin  # rotate_half
            keys, values = cache_layer.update(qk[:, q_heads:, None, :], qkv[:, n_q + n_kv:].view(batch, kv_heads, 1, dim))
            attn = grouped_decode_attention(qk[:, :q_heads, None, :], keys, values, additive, layer["scaling"])
            h = h + F.linear(attn.view(batch, n_q), layer["o"])
            x = F.rms_norm(h, (hidden,), *layer["norm2"])
            gate_up = self._project(x, layer["gate_up"])
            n = layer["n_inner"]
            h = h + F.linear(F.silu(gate_up[:, :n]) * gate_up[:, n:], layer["down"])
        return F.linear(F.rms_norm(h, (hidden,), *self.norm), self.head)
