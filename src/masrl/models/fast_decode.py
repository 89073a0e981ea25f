"""A lean decode step for Llama, Qwen2 and Qwen3 causal LMs on a CPU in float32: the same arithmetic as
transformers' forward, in a little over half the operator calls.

A decode step feeds one token per row. For a small model its cost is mostly per-operator overhead, not
arithmetic: transformers' ``LlamaForCausalLM`` makes 352 top-level ATen calls per decode step of the 4-layer tiny
model (986 counting the calls inside them; module calls, the attention-mask builder, output dataclasses, a
``q``/``k``/``v`` projection each, an RMSNorm of eight element-wise ops); this step makes 196 (683). A team pays this more often than a single agent at equal generated tokens: its three dependent
agent turns run ~2.3x the decode steps of one wider batch (``benchmarks/multiagent_overhead.py``).

:class:`FastDecode` computes a decode step of ``LlamaForCausalLM`` (``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``)
directly from the weights:

* ``q``/``k``/``v`` in one matrix product with the three weights stacked (``gate``/``up`` likewise), the stacked
  weights (and biases: Qwen2's q/k/v, Llama's ``attention_bias`` / ``mlp_bias``) made once per weight version and
  reused across engine calls while the weights do not change;
* RMSNorm as ``torch.nn.functional.rms_norm`` (Qwen3's on the query and key heads too, before RoPE);
* rotary embeddings applied to the query and key heads together (the model's own rotary module computes
  ``cos``/``sin``, so every RoPE type works);
* the 1-token attention of :func:`masrl.models.cpu_attention.grouped_decode_attention` (two batched matmuls over
  the preallocated cache's views), the keys/values written by the cache layer's own ``update``.

**Exactness.** Bitwise the logits of transformers' forward with masrl's CPU decode attention, in float32
(``tests/test_fast_decode.py``: MHA and GQA Llama configs, biases, Qwen2 and Qwen3, padding masks, compaction, the
engine's tokens and log-probs). Two of the rewrites reorder nothing but rely on the BLAS: a matrix product's columns do not depend
on which other weight rows share the call (stacked ``q``/``k``/``v``), and ``rms_norm`` computes the mean of
squares as transformers' formula does; both are checked by the tests on the machine that runs them.
``TransformersEngine(fast_decode=False)`` keeps transformers' forward.

It applies only where that equality is meant to hold; everything else goes through ``model(...)``:
one of those three classes as transformers builds it (not wrapped by PEFT other than for LoRA, no hooks, no FSDP2
shards), float32 CPU weights, SiLU MLP, full attention in every layer (no sliding window), decoding with masrl's CPU
attention (:mod:`masrl.models.cpu_attention`) into the preallocated KV cache (:mod:`masrl.rollout.kv_cache`),
autocast off. bf16 decoding (SmolLM2 under ``autocast: auto``), merged adapters, LoRA variants (DoRA) and other
architectures keep transformers' forward.

**LoRA adapters.** A PEFT LoRA model over such a Llama runs here too, each row of the batch with its own adapter
(``step(..., routes)``) in one pass: :mod:`masrl.models.lora_decode`. That part is not bitwise PEFT's forward
(within 1e-6, ``tests/test_multi_adapter_decode.py``); the base model's part stays bitwise.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from masrl.models.cpu_attention import NAME as CPU_ATTENTION, grouped_decode_attention
from masrl.models.lora_decode import LoraGroup, base_linear, is_lora, row_scales, unsupported_lora

# stacked q/k/v and gate/up weights are a copy of most of the model: above this many bytes the projections run
# one by one instead (still lean, no copy)
STACK_MAX_BYTES = 256 * 2**20


def _plain_linear(module) -> bool:
    w, b = getattr(module, "weight", None), getattr(module, "bias", None)
    return (type(module) is torch.nn.Linear and type(w) is torch.nn.Parameter and w.dtype == torch.float32
            and w.device.type == "cpu" and w.layout == torch.strided
            and (b is None or (b.dtype == torch.float32 and b.device.type == "cpu")))


def _architectures() -> dict:
    """``{causal LM class: (its inner model class, its RMSNorm class)}`` for the architectures the step computes:
    Llama, Qwen2 (biased q/k/v) and Qwen3 (RMSNorm on the query and key heads)."""
    import importlib

    table = {}
    for module, prefix in (("llama", "Llama"), ("qwen2", "Qwen2"), ("qwen3", "Qwen3")):
        try:
            mod = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
            table[getattr(mod, f"{prefix}ForCausalLM")] = (getattr(mod, f"{prefix}Model"), getattr(mod, f"{prefix}RMSNorm"))
        except (ImportError, AttributeError):  # pragma: no cover - a transformers without it
            continue
    return table


def _projection_unsupported(module) -> str | None:
    """Why a projection (plain, or PEFT LoRA over a plain one) cannot run in the fast step (None: it can)."""
    if is_lora(module):
        reason = unsupported_lora(module)
        if reason is not None:
            return reason
    if not _plain_linear(base_linear(module)):
        return "a projection is not a plain float32 nn.Linear (quantized, sharded)"
    return None


def _no_hooks(model: torch.nn.Module) -> bool:
    from torch.nn.modules import module as nn_module

    if any(getattr(nn_module, name, None) for name in ("_global_forward_hooks", "_global_forward_pre_hooks",
                                                         "_global_forward_hooks_with_kwargs")):
        return False
    return not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def _causal_lm(model: torch.nn.Module) -> tuple[torch.nn.Module | None, str | None]:
    """(the causal LM the decode step computes, None), or (None, why there is none): ``model`` itself or the one a
    PEFT LoRA model wraps."""
    try:
        from peft import PeftModel
        from peft.tuners.lora import LoraModel
    except ImportError:  # pragma: no cover - without PEFT no model is wrapped
        PeftModel = LoraModel = None
    if PeftModel is not None and isinstance(model, PeftModel):
        if type(model.base_model) is not LoraModel:
            return None, f"a PEFT {type(model.base_model).__name__} model (only LoRA adapters run in the fast step)"
        model = model.base_model.model
    return model, None


def unsupported(model: torch.nn.Module) -> str | None:
    """Why :class:`FastDecode` does not apply to ``model`` (None: it does). Autocast is checked per call."""
    llama, reason = _causal_lm(model)
    if reason is not None:
        return reason
    inner_type, norm_type = _architectures().get(type(llama), (None, None))
    if inner_type is None or type(getattr(llama, "model", None)) is not inner_type:
        return f"{type(llama).__name__} is not a plain Llama, Qwen2 or Qwen3 causal LM"
    config = llama.config
    if any(t != "full_attention" for t in (getattr(config, "layer_types", None) or ())):
        return "sliding-window attention layers"
    if getattr(config, "_attn_implementation", None) != CPU_ATTENTION:
        return "attention is not masrl's CPU decode attention"
    if model.training or llama.training:
        return "model in training mode"
    if getattr(config, "hidden_act", None) != "silu":
        return f"activation {getattr(config, 'hidden_act', None)!r} is not silu"
    inner = llama.model
    if len(inner.layers) != config.num_hidden_layers:
        return "layer count differs from the config"
    embed = inner.embed_tokens
    if type(embed) is not torch.nn.Embedding or embed.max_norm is not None or embed.weight.dtype != torch.float32:
        return "embeddings are not a plain float32 nn.Embedding"
    if _projection_unsupported(llama.lm_head) is not None:
        return f"LM head: {_projection_unsupported(llama.lm_head)}"
    norms = [inner.norm] + [n for layer in inner.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)
                            + tuple(getattr(layer.self_attn, k) for k in ("q_norm", "k_norm")
                                    if hasattr(layer.self_attn, k))]
    if any(type(n) is not norm_type or n.weight.dtype != torch.float32 for n in norms):
        return f"a norm is not a float32 {norm_type.__name__}"
    for layer in inner.layers:
        a, m = layer.self_attn, layer.mlp
        for proj in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj):
            reason = _projection_unsupported(proj)
            if reason is not None:
                return reason
        if a.head_dim % 2 or any(base_linear(p).out_features % a.head_dim for p in (a.q_proj, a.k_proj)):
            return "head sizes do not divide the projections"
    if not _no_hooks(model):
        return "the model has forward hooks"
    return None


class FastDecode:
    """Decode steps of one ``LlamaForCausalLM`` (or a PEFT LoRA model over one) from its current weights (see the
    module docstring).

    Build it with :meth:`for_model` at the start of an engine call: the stacked base weights are remade only when
    a base weight changed (its version counter or storage), the stacked adapters when an adapter weight or the
    active adapters changed."""

    def __init__(self, model: torch.nn.Module, previous: "FastDecode | None" = None):
        self.model = model
        self.llama = _causal_lm(model)[0]
        self.base_key, self.lora_key = self._weights_key(model)
        inner = self.llama.model
        if previous is not None and previous.model is model and previous.base_key == self.base_key:
            self.stacked, self.layers = previous.stacked, previous.layers  # only the adapters changed
        else:
            self.stacked, self.layers = self._base_layers(inner.layers)
        self.norm = (inner.norm.weight.detach(), inner.norm.variance_epsilon)
        self.embed = inner.embed_tokens.weight.detach()
        head = base_linear(self.llama.lm_head)
        self.head = (head.weight.detach(), None if head.bias is None else head.bias.detach())
        self.hidden = inner.embed_tokens.embedding_dim
        self._lora_groups(inner.layers)

    @staticmethod
    def _base_layers(layers) -> tuple[bool, list[dict]]:
        """(stacked, per layer: the base weights the step reads): every projection group as (weight, bias) pairs,
        q/k/v and gate/up stacked into one pair each when ``stacked``."""
        def pair(module):
            linear = base_linear(module)
            return linear.weight.detach(), None if linear.bias is None else linear.bias.detach()

        def group(modules):
            pairs = [pair(m) for m in modules]
            if not stacked:
                return pairs
            biases = None if all(b is None for _, b in pairs) else torch.cat(
                [torch.zeros(w.shape[0]) if b is None else b for w, b in pairs])
            return [(torch.cat([w for w, _ in pairs]), biases)]  # one matrix product

        def norm(module):
            return None if module is None else (module.weight.detach(), module.variance_epsilon)

        size = sum(base_linear(p).weight.numel() for layer in layers for p in (
            layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.mlp.gate_proj,
            layer.mlp.up_proj)) * 4
        stacked, out = size <= STACK_MAX_BYTES, []
        with torch.no_grad():
            for layer in layers:
                a, m = layer.self_attn, layer.mlp
                out.append(dict(
                    norm1=norm(layer.input_layernorm), qkv=group([a.q_proj, a.k_proj, a.v_proj]),
                    n_q=base_linear(a.q_proj).out_features, n_kv=base_linear(a.k_proj).out_features,
                    q_norm=norm(getattr(a, "q_norm", None)), k_norm=norm(getattr(a, "k_norm", None)),
                    head_dim=a.head_dim, scaling=a.scaling, o=pair(a.o_proj), norm2=norm(layer.post_attention_layernorm),
                    gate_up=group([m.gate_proj, m.up_proj]), n_inner=base_linear(m.gate_proj).out_features,
                    down=pair(m.down_proj)))
        return stacked, out

    def _lora_groups(self, layers) -> None:
        """Per layer the stacked adapters of q/k/v, o, gate/up and down (None where no projection carries one),
        those of the LM head, and the distinct block layouts (their per-row scales are made once per routing)."""
        self.loras = [dict(qkv=LoraGroup.of([a.q_proj, a.k_proj, a.v_proj]), o=LoraGroup.of([a.o_proj]),
                           gate_up=LoraGroup.of([m.gate_proj, m.up_proj]), down=LoraGroup.of([m.down_proj]))
                      for a, m in ((layer.self_attn, layer.mlp) for layer in layers)]
        self.head_lora = LoraGroup.of([self.llama.lm_head])
        slots: dict[tuple, int] = {}
        for group in [g for groups in self.loras for g in groups.values()] + [self.head_lora]:
            if group is not None:
                group.slot = slots.setdefault(group.layout, len(slots))
        self.layouts = list(slots)
        self._routes: tuple | None = None
        self._scales = [row_scales(layout, None) for layout in self.layouts]

    @staticmethod
    def _weights_key(model: torch.nn.Module) -> tuple[tuple, tuple]:
        """(base weights' key, adapters' key): storage and version of every weight, and which adapters are on."""
        base, lora = [], []
        for name, p in model.named_parameters():
            (lora if ".lora_" in name else base).append((p.data_ptr(), p._version))
        lora.extend((m.disable_adapters, tuple(m.active_adapters)) for m in model.modules() if is_lora(m))
        return tuple(base), tuple(lora)

    @classmethod
    def for_model(cls, model: torch.nn.Module, previous: "FastDecode | None" = None) -> "FastDecode | None":
        """A :class:`FastDecode` for ``model`` (``previous`` reused when its weights are unchanged, its stacked base
        weights when only adapters changed), or None when it does not apply (:func:`unsupported`) or autocast is on."""
        if torch.is_autocast_enabled("cpu") or unsupported(model) is not None:
            return None
        if previous is not None and previous.model is model and (previous.base_key, previous.lora_key) == \
                cls._weights_key(model):
            return previous
        return cls(model, previous)

    @staticmethod
    def _project(x: torch.Tensor, pairs: list[tuple[torch.Tensor, torch.Tensor | None]]) -> torch.Tensor:
        if len(pairs) == 1:
            return F.linear(x, *pairs[0])
        return torch.cat([F.linear(x, *pair) for pair in pairs], -1)

    def _row_scales(self, routes: Sequence[str | None] | None) -> list:
        """Per block layout, the per-row adapter scales for ``routes`` (made when the routing changes)."""
        key = None if routes is None else tuple(routes)
        if key != self._routes:
            self._routes, self._scales = key, [row_scales(layout, key) for layout in self.layouts]
        return self._scales

    @staticmethod
    def _lora(y: torch.Tensor, x: torch.Tensor, group: LoraGroup | None, scales: list) -> torch.Tensor:
        """``y`` (a projection group's base output for ``x``) plus each row's adapter delta, as PEFT adds it."""
        if group is None or scales[group.slot] is None:
            return y
        return y + group.delta(x, scales[group.slot])

    def step(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache,
             routes: Sequence[str | None] | None = None) -> torch.Tensor:
        """One decode step: ``ids`` ``[batch]`` (the tokens fed), ``mask`` ``[batch, length]`` (1 = attend; the
        cache's filled positions + this one), ``positions`` ``[batch]``; writes this step's keys/values into
        ``cache`` and returns the next-token logits ``[batch, vocab]``. ``routes``: row ``i`` decodes with LoRA
        adapter ``routes[i]`` (None: the base model), as inside ``masrl.models.lora.mixed_adapters``; without it
        every row gets PEFT's own forward (the active adapters)."""
        batch, hidden = ids.shape[0], self.hidden
        scales, lora = self._row_scales(routes), self._lora
        h = F.embedding(ids, self.embed)
        cos, sin = self.llama.model.rotary_emb(h, positions[:, None])  # [batch, 1, head_dim]
        # padding as an additive mask, made once per step: adding 0 / -inf is what masked_fill does, bitwise
        padded = mask == 0
        additive = (torch.zeros(padded.shape, dtype=h.dtype).masked_fill_(padded, float("-inf"))[:, None, None, :]
                    if bool(padded.any()) else None)
        for layer, groups, cache_layer in zip(self.layers, self.loras, cache.layers):
            dim, n_q, n_kv = layer["head_dim"], layer["n_q"], layer["n_kv"]
            q_heads, kv_heads = n_q // dim, n_kv // dim
            x = F.rms_norm(h, (hidden,), *layer["norm1"])
            qkv = lora(self._project(x, layer["qkv"]), x, groups["qkv"], scales)
            qk = qkv[:, :n_q + n_kv].view(batch, q_heads + kv_heads, dim)
            if layer["q_norm"] is not None:  # Qwen3: RMSNorm on every query and key head
                qk = torch.cat((F.rms_norm(qk[:, :q_heads], (dim,), *layer["q_norm"]),
                                F.rms_norm(qk[:, q_heads:], (dim,), *layer["k_norm"])), 1)
            half = dim // 2
            qk = qk * cos + torch.cat((-qk[..., half:], qk[..., :half]), -1) * sin  # rotate_half
            keys, values = cache_layer.update(qk[:, q_heads:, None, :], qkv[:, n_q + n_kv:].view(batch, kv_heads, 1, dim))
            attn = grouped_decode_attention(qk[:, :q_heads, None, :], keys, values, additive, layer["scaling"])
            attn = attn.view(batch, n_q)
            h = h + lora(F.linear(attn, *layer["o"]), attn, groups["o"], scales)
            x = F.rms_norm(h, (hidden,), *layer["norm2"])
            gate_up = lora(self._project(x, layer["gate_up"]), x, groups["gate_up"], scales)
            n = layer["n_inner"]
            inner = F.silu(gate_up[:, :n]) * gate_up[:, n:]
            h = h + lora(F.linear(inner, *layer["down"]), inner, groups["down"], scales)
        x = F.rms_norm(h, (hidden,), *self.norm)
        return lora(F.linear(x, *self.head), x, self.head_lora, scales)
