"""A lean decode step for Llama, Qwen2 and Qwen3 causal LMs on a CPU in float32 or bfloat16: the same arithmetic as
transformers' forward, in a little over half the operator calls.

A decode step feeds one token per row. For a small model its cost is mostly per-operator overhead, not
arithmetic: transformers' ``LlamaForCausalLM`` makes 352 top-level ATen calls per decode step of the 4-layer tiny
model (986 counting the calls inside them; module calls, the attention-mask builder, output dataclasses, a
``q``/``k``/``v`` projection each, an RMSNorm of eight element-wise ops); this step makes 196 (683). A team pays this more often than a single agent at equal generated tokens: its three dependent
agent turns run ~2.3x the decode steps of one wider batch (``benchmarks/multiagent_overhead.py``).

``FastDecode`` computes a decode step of ``LlamaForCausalLM`` (``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``)
directly from the weights:

* ``q``/``k``/``v`` in one matrix product with the three weights stacked (``gate``/``up`` likewise), the stacked
  weights (and biases: Qwen2's q/k/v, Llama's ``attention_bias`` / ``mlp_bias``) made once per weight version and
  reused across engine calls while the weights do not change;
* RMSNorm as ``torch.nn.functional.rms_norm`` (Qwen3's on the query and key heads too, before RoPE);
* rotary embeddings applied to the query and key heads together (the model's own rotary module computes
  ``cos``/``sin``, so every RoPE type works);
* the 1-token attention of ``masrl.models.cpu_attention.grouped_decode_attention`` (two batched matmuls over
  the preallocated cache's views), the keys/values written by the cache layer's own ``update``.

**Exactness.** Bitwise the logits of transformers' forward with masrl's CPU decode attention, in float32
(``tests/test_fast_decode.py``: MHA and GQA Llama configs, biases, Qwen2 and Qwen3, padding masks, compaction, the
engine's tokens and log-probs). Two of the rewrites reorder nothing but rely on the BLAS: a matrix product's columns do not depend
on which other weight rows share the call (stacked ``q``/``k``/``v``), and ``rms_norm`` computes the mean of
squares as transformers' formula does; both are checked by the tests on the machine that runs them.
``TransformersEngine(fast_decode=False)`` keeps transformers' forward; ``TransformersEngine(compile_decode=True)``
(``rollout.compile_decode``) runs the base model's step as one compiled graph (``masrl.models.compiled_decode``).

**bfloat16.** The step computes in the precision transformers' forward would use (``precision``): bf16 weights
(with or without autocast) run every op in bf16 as transformers does (RMSNorm in float32, cast back, times the
weight; the attention in float32 over the cache); float32 weights under CPU bf16 autocast (``trainer.autocast``,
SmolLM2 under ``auto`` on a CPU with native bf16) make autocast's casts explicitly: every matrix product's input
and weights in bf16 (the weights cast once per weight version and kept with the stacked ones, instead of autocast
casting a stacked copy at every step), norms, residual sums and rotary embeddings in float32 by the same type
promotion, the keys/values in the engine's float32 cache. Measured bitwise transformers' forward in bf16 and
under autocast on the tiny configs (``tests/test_fast_decode_bf16.py``, which allows 1e-3 of the largest entry
for another BLAS's summation order of the stacked products). With ``packed=True`` (the engine's default where
``masrl.models.packed_linear.available``) the bf16 products run on weights prepacked once for oneDNN
(``masrl.models.packed_linear.pack``), the same inner product as ``F.linear``'s bf16 path without its
per-call reorder of the weight: bitwise the same logits (``tests/test_fast_decode_bf16.py``); decode tokens per
CPU second in benchmarks/RESULTS.md "Decode roofline". Given the engine's
``masrl.models.packed_linear.PackedLinears`` (``shared_packs``), the unstacked o, down and LM-head projections
decode on the copies the prefill packed, so each of those weights is packed and held once.

It applies only where that equality is meant to hold; everything else goes through ``model(...)``:
one of those three classes as transformers builds it (not wrapped by PEFT other than for LoRA, no hooks, no FSDP2
shards), CPU weights all float32 or all bf16, SiLU MLP, full attention in every layer (no sliding window), decoding
with masrl's CPU attention (``masrl.models.cpu_attention``) into the preallocated KV cache
(``masrl.rollout.kv_cache``), autocast off or bf16. fp16 autocast, merged adapters, LoRA variants (DoRA) and
other architectures keep transformers' forward.

**LoRA adapters.** A PEFT LoRA model over such a Llama runs here too, each row of the batch with its own adapter
(``step(..., routes)``) in one pass: ``masrl.models.lora_decode``. That part is not bitwise PEFT's forward
(within 1e-6 in float32, ``tests/test_multi_adapter_decode.py``; within 2e-2 of the largest logit in bf16, a
flipped last bf16 bit carried through the layers); the base model's part stays bitwise.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from masrl.models.cpu_attention import NAME as CPU_ATTENTION, grouped_decode_attention
from masrl.models.lora_decode import LoraGroup, adapter_dtypes, base_linear, is_lora, row_scales, unsupported_lora
from masrl.models.packed_linear import (MIN_WEIGHT, PackedLinears, available as packing_available,
                                       linear as packed_linear, pack)

# stacked q/k/v and gate/up weights are a copy of most of the model: above this many bytes the projections run
# one by one instead (still lean, no copy)
STACK_MAX_BYTES = 256 * 2**20


# the weight dtypes the step computes from (every weight of the model in one of them)
DTYPES = (torch.float32, torch.bfloat16)


def _plain_linear(module, dtype: torch.dtype) -> bool:
    w, b = getattr(module, "weight", None), getattr(module, "bias", None)
    return (type(module) is torch.nn.Linear and type(w) is torch.nn.Parameter and w.dtype == dtype
            and w.device.type == "cpu" and w.layout == torch.strided
            and (b is None or (b.dtype == dtype and b.device.type == "cpu")))


def precision(model: torch.nn.Module) -> tuple[torch.dtype, torch.dtype] | None:
    """(residual-stream dtype, matrix-product dtype) of a decode step of ``model`` as transformers computes it
    now: (float32, float32) for float32 weights, (bfloat16, bfloat16) for bfloat16 weights, with or without bf16
    autocast, (float32, bfloat16) for float32 weights under CPU bf16 autocast (autocast casts every ``Linear``'s
    input and weights to bf16; norms, residual sums and rotary embeddings stay in float32 by type promotion).
    None: another autocast dtype or weight dtype."""
    weight = getattr(getattr(_causal_lm(model)[0], "lm_head", None), "weight", None)
    dtype = getattr(model, "dtype", None) if weight is None else weight.dtype
    if dtype not in DTYPES:
        return None
    if torch.is_autocast_enabled("cpu"):
        if torch.get_autocast_dtype("cpu") != torch.bfloat16:
            return None
        return dtype, torch.bfloat16
    return dtype, dtype


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


def _projection_unsupported(module, dtype: torch.dtype = torch.float32) -> str | None:
    """Why a projection (plain, or PEFT LoRA over a plain one) cannot run in the fast step (None: it can)."""
    if is_lora(module):
        reason = unsupported_lora(module)
        if reason is not None:
            return reason
    if not _plain_linear(base_linear(module), dtype):
        return f"a projection is not a plain {str(dtype)[6:]} nn.Linear (quantized, sharded, mixed dtypes)"
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
    """Why ``FastDecode`` does not apply to ``model`` (None: it does). Autocast is checked per call."""
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
    dtype = getattr(getattr(embed, "weight", None), "dtype", None)
    if type(embed) is not torch.nn.Embedding or embed.max_norm is not None or dtype not in DTYPES:
        return "embeddings are not a plain float32 or bfloat16 nn.Embedding"
    name = str(dtype)[6:]
    if _projection_unsupported(llama.lm_head, dtype) is not None:
        return f"LM head: {_projection_unsupported(llama.lm_head, dtype)}"
    norms = [inner.norm] + [n for layer in inner.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)
                            + tuple(getattr(layer.self_attn, k) for k in ("q_norm", "k_norm")
                                    if hasattr(layer.self_attn, k))]
    if any(type(n) is not norm_type or n.weight.dtype != dtype for n in norms):
        return f"a norm is not a {name} {norm_type.__name__}"
    for layer in inner.layers:
        a, m = layer.self_attn, layer.mlp
        for proj in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj):
            reason = _projection_unsupported(proj, dtype)
            if reason is not None:
                return reason
        if a.head_dim % 2 or any(base_linear(p).out_features % a.head_dim for p in (a.q_proj, a.k_proj)):
            return "head sizes do not divide the projections"
    if len(adapter_dtypes(model)) > 1:
        return "LoRA adapters of different dtypes"
    if not _no_hooks(model):
        return "the model has forward hooks"
    return None


def rms_norm(x: torch.Tensor, norm: tuple[torch.Tensor, float]) -> torch.Tensor:
    """transformers' RMSNorm: in float32, cast back to the input's dtype, times the weight (type promotion:
    a float32 weight on a bf16 input gives float32, as under autocast); ``norm``: (weight, eps)."""
    weight, eps = norm
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


class FastDecode:
    """Decode steps of one ``LlamaForCausalLM`` (or a PEFT LoRA model over one) from its current weights (see the
    module docstring).

    Build it with ``for_model`` at the start of an engine call: the stacked base weights are remade only when
    a base weight changed (its version counter or storage) or the precision changed, the stacked adapters when an
    adapter weight or the active adapters changed."""

    def __init__(self, model: torch.nn.Module, previous: "FastDecode | None" = None,
                 dtypes: tuple[torch.dtype, torch.dtype] = (torch.float32, torch.float32), packed: bool = False,
                 shared_packs: "PackedLinears | None" = None):
        self.model = model
        self.llama = _causal_lm(model)[0]
        self.dtypes = dtypes  # (residual stream, matrix products): see precision()
        self.packed = self._packs(packed, dtypes)
        self.base_key, self.lora_key = self._weights_key(model)
        inner = self.llama.model
        if (previous is not None and previous.model is model and previous.base_key == self.base_key
                and previous.dtypes == dtypes and previous.packed == self.packed):
            self.stacked, self.layers = previous.stacked, previous.layers  # only the adapters changed
            self.head = previous.head
        else:
            self.stacked, self.layers = self._base_layers(inner.layers, dtypes[1])
            self.head = self._pair(self.llama.lm_head, dtypes[1])
            if self.packed:
                self._pack_base(shared_packs)
        self.norm = (inner.norm.weight.detach(), inner.norm.variance_epsilon)
        self.embed = inner.embed_tokens.weight.detach()
        self.hidden = inner.embed_tokens.embedding_dim
        self.lora_dtype = self._adapter_dtype(model, dtypes)
        self._lora_groups(inner.layers)
        # the base model's steps through masrl.models.compiled_decode (rollout.compile_decode; set by the engine)
        self.compiled = False
        self._compiled_inputs = None  # the compiled step's weights (per layer, LM head), made on its first use

    @staticmethod
    def _adapter_dtype(model: torch.nn.Module, dtypes: tuple[torch.dtype, torch.dtype]) -> torch.dtype:
        """The dtype of the adapters' products: PEFT casts a projection's input to its adapter weights' dtype
        (float32 adapters on bf16 weights compute in float32), and under autocast they run in bf16."""
        found = adapter_dtypes(model)
        return dtypes[1] if torch.is_autocast_enabled("cpu") or not found else found.pop()

    @staticmethod
    def _pair(module, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight, bias) of a projection's base layer in ``dtype`` (the tensors themselves when already in it)."""
        linear = base_linear(module)
        with torch.no_grad():
            return (linear.weight.detach().to(dtype),
                    None if linear.bias is None else linear.bias.detach().to(dtype))

    @classmethod
    def _base_layers(cls, layers, dtype: torch.dtype = torch.float32) -> tuple[bool, list[dict]]:
        """(stacked, per layer: the base weights the step reads, in ``dtype``): every projection group as (weight,
        bias) pairs, q/k/v and gate/up stacked into one pair each when ``stacked``."""
        def group(modules):
            pairs = [cls._pair(m, dtype) for m in modules]
            if not stacked:
                return pairs
            biases = None if all(b is None for _, b in pairs) else torch.cat(
                [torch.zeros(w.shape[0], dtype=dtype) if b is None else b for w, b in pairs])
            return [(torch.cat([w for w, _ in pairs]), biases)]  # one matrix product

        def norm(module):
            return None if module is None else (module.weight.detach(), module.variance_epsilon)

        size = sum(base_linear(p).weight.numel() for layer in layers for p in (
            layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.mlp.gate_proj,
            layer.mlp.up_proj)) * torch.empty((), dtype=dtype).element_size()
        stacked, out = size <= STACK_MAX_BYTES, []
        with torch.no_grad():
            for layer in layers:
                a, m = layer.self_attn, layer.mlp
                out.append(dict(
                    norm1=norm(layer.input_layernorm), qkv=group([a.q_proj, a.k_proj, a.v_proj]),
                    n_q=base_linear(a.q_proj).out_features, n_kv=base_linear(a.k_proj).out_features,
                    q_norm=norm(getattr(a, "q_norm", None)), k_norm=norm(getattr(a, "k_norm", None)),
                    head_dim=a.head_dim, scaling=a.scaling, o=cls._pair(a.o_proj, dtype),
                    norm2=norm(layer.post_attention_layernorm),
                    gate_up=group([m.gate_proj, m.up_proj]), n_inner=base_linear(m.gate_proj).out_features,
                    down=cls._pair(m.down_proj, dtype)))
        return stacked, out

    @staticmethod
    def _packs(packed: bool, dtypes: tuple[torch.dtype, torch.dtype]) -> bool:
        """Whether the step's products run on prepacked weights: asked for, bf16 products, a CPU that packs them."""
        return packed and dtypes[1] == torch.bfloat16 and packing_available()

    def _pack_base(self, shared: "PackedLinears | None" = None) -> None:
        """Every base weight pair of at least ``masrl.models.packed_linear.MIN_WEIGHT`` entries with its weight
        in oneDNN's layout: for float32 weights under autocast it replaces their bf16 copy; bf16 weights (read in
        place unpacked) gain one packed copy. The unstacked projections (o, down, the LM head) take the copy the
        engine's ``shared`` packs hold for the prefill where it packs that module (the same bytes: one copy, one
        packing per weight version); stacked q/k/v and gate/up are this step's own."""
        def packed(pair, module=None):
            weight, bias = pair
            if weight.numel() < MIN_WEIGHT:
                return pair
            common = shared.packed_weight(module) if shared is not None and module is not None else None
            return (pack(weight) if common is None else common, bias)

        for layer, block in zip(self.layers, self.llama.model.layers):
            for name in ("qkv", "gate_up"):
                layer[name] = [packed(pair) for pair in layer[name]]
            layer["o"] = packed(layer["o"], base_linear(block.self_attn.o_proj))
            layer["down"] = packed(layer["down"], base_linear(block.mlp.down_proj))
        self.head = packed(self.head, base_linear(self.llama.lm_head))

    def _lora_groups(self, layers) -> None:
        """Per layer the stacked adapters of q/k/v, o, gate/up and down (None where no projection carries one),
        those of the LM head, and the distinct block layouts (their per-row scales are made once per routing)."""
        dtype = self.lora_dtype
        self.loras = [dict(qkv=LoraGroup.of([a.q_proj, a.k_proj, a.v_proj], dtype), o=LoraGroup.of([a.o_proj], dtype),
                           gate_up=LoraGroup.of([m.gate_proj, m.up_proj], dtype), down=LoraGroup.of([m.down_proj], dtype))
                      for a, m in ((layer.self_attn, layer.mlp) for layer in layers)]
        self.head_lora = LoraGroup.of([self.llama.lm_head], dtype)
        slots: dict[tuple, int] = {}
        for group in [g for groups in self.loras for g in groups.values()] + [self.head_lora]:
            if group is not None:
                group.slot = slots.setdefault(group.layout, len(slots))
        self.layouts = list(slots)
        self._routes: tuple | None = None
        self._scales = [row_scales(layout, None, dtype) for layout in self.layouts]

    @staticmethod
    def _weights_key(model: torch.nn.Module) -> tuple[tuple, tuple]:
        """(base weights' key, adapters' key): storage and version of every weight, and which adapters are on."""
        base, lora = [], []
        for name, p in model.named_parameters():
            (lora if ".lora_" in name else base).append((p.data_ptr(), p._version))
        lora.extend((m.disable_adapters, tuple(m.active_adapters)) for m in model.modules() if is_lora(m))
        return tuple(base), tuple(lora)

    @classmethod
    def for_model(cls, model: torch.nn.Module, previous: "FastDecode | None" = None,
                  packed: bool = False, shared_packs: "PackedLinears | None" = None) -> "FastDecode | None":
        """A ``FastDecode`` for ``model`` in the precision transformers would decode it in now (float32,
        bfloat16 weights, float32 weights under bf16 autocast: ``precision``), ``previous`` reused when its
        weights and precision are unchanged, its stacked base weights when only adapters changed; None when it
        does not apply (``unsupported``, another autocast dtype). ``packed``: bf16 products on prepacked
        weights where this CPU packs them; ``shared_packs``: the engine's packed Linear weights, whose copies of the
        unstacked projections the step reuses (``_pack_base``)."""
        if unsupported(model) is not None:
            return None
        dtypes = precision(model)
        if dtypes is None:
            return None
        if (previous is not None and previous.model is model and previous.dtypes == dtypes
                and previous.lora_dtype == cls._adapter_dtype(model, dtypes)
                and previous.packed == cls._packs(packed, dtypes)
                and (previous.base_key, previous.lora_key) == cls._weights_key(model)):
            return previous
        return cls(model, previous, dtypes, packed, shared_packs)

    @staticmethod
    def _linear(x: torch.Tensor, pair: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
        """``x @ weight.T + bias``; a prepacked weight (an mkldnn tensor) through oneDNN's inner product."""
        weight, bias = pair
        if weight.is_mkldnn:
            return packed_linear(x, weight, bias)
        return F.linear(x, weight, bias)

    @classmethod
    def _project(cls, x: torch.Tensor, pairs: list[tuple[torch.Tensor, torch.Tensor | None]]) -> torch.Tensor:
        if len(pairs) == 1:
            return cls._linear(x, pairs[0])
        return torch.cat([cls._linear(x, pair) for pair in pairs], -1)

    _rms_norm = staticmethod(rms_norm)

    def _row_scales(self, routes: Sequence[str | None] | None) -> list:
        """Per block layout, the per-row adapter scales for ``routes`` (made when the routing changes)."""
        key = None if routes is None else tuple(routes)
        if key != self._routes:
            self._routes = key
            self._scales = [row_scales(layout, key, self.lora_dtype) for layout in self.layouts]
        return self._scales

    def _lora(self, y: torch.Tensor, x: torch.Tensor, group: LoraGroup | None, scales: list) -> torch.Tensor:
        """``y`` (a projection group's base output for ``x``) plus each row's adapter delta, as PEFT adds it (the
        input in the adapter's dtype, the sum back in ``y``'s)."""
        if group is None or scales[group.slot] is None:
            return y
        delta = group.delta(x.to(self.lora_dtype), scales[group.slot])
        return y + delta if delta.dtype == y.dtype else (y + delta).to(y.dtype)

    def step(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache,
             routes: Sequence[str | None] | None = None) -> torch.Tensor:
        """One decode step: ``ids`` ``[batch]`` (the tokens fed), ``mask`` ``[batch, length]`` (1 = attend; the
        cache's filled positions + this one), ``positions`` ``[batch]``; writes this step's keys/values into
        ``cache`` and returns the next-token logits ``[batch, vocab]``. ``routes``: row ``i`` decodes with LoRA
        adapter ``routes[i]`` (None: the base model), as inside ``masrl.models.lora.mixed_adapters``; without it
        every row gets PEFT's own forward (the active adapters)."""
        if torch.is_autocast_enabled("cpu"):  # the casts autocast would make are explicit below
            with torch.autocast("cpu", enabled=False):
                return self._step(ids, mask, positions, cache, routes)
        return self._step(ids, mask, positions, cache, routes)

    def _step(self, ids, mask, positions, cache, routes) -> torch.Tensor:
        batch, hidden = ids.shape[0], self.hidden
        scales, lora, norm, linear = self._row_scales(routes), self._lora, self._rms_norm, self._linear
        low = self.dtypes[1]  # every matrix product's inputs (autocast's cast, or the weights' own dtype)
        h = F.embedding(ids, self.embed)
        cos, sin = self.llama.model.rotary_emb(h, positions[:, None])  # [batch, 1, head_dim], in h's dtype
        # padding as an additive mask, made once per step: adding 0 / -inf is what masked_fill does, bitwise
        padded = mask == 0
        additive = (torch.zeros(padded.shape, dtype=torch.float32).masked_fill_(padded, float("-inf"))[:, None, None, :]
                    if bool(padded.any()) else None)
        if self.compiled and self._compilable(cache, batch, scales):
            try:
                return self._compiled_step(h, cos, sin, cache, additive)
            except Exception as e:  # noqa: BLE001 - a graph inductor cannot build or run: this step and the rest eager
                from masrl.models.compiled_decode import refuse

                # nothing is lost: the cache's filled length has not moved, so the eager step rewrites the same
                # position of every layer
                refuse(f"the compiled step failed ({type(e).__name__}: {str(e).strip().splitlines()[0][:200]})")
        for layer, groups, cache_layer in zip(self.layers, self.loras, cache.layers):
            dim, n_q, n_kv = layer["head_dim"], layer["n_q"], layer["n_kv"]
            q_heads, kv_heads = n_q // dim, n_kv // dim
            x = norm(h, layer["norm1"]).to(low)
            qkv = lora(self._project(x, layer["qkv"]), x, groups["qkv"], scales)
            qk = qkv[:, :n_q + n_kv].view(batch, q_heads + kv_heads, dim)
            if layer["q_norm"] is not None:  # Qwen3: RMSNorm on every query and key head
                qk = torch.cat((norm(qk[:, :q_heads], layer["q_norm"]), norm(qk[:, q_heads:], layer["k_norm"])), 1)
            half = dim // 2
            qk = qk * cos + torch.cat((-qk[..., half:], qk[..., :half]), -1) * sin  # rotate_half
            keys, values = cache_layer.update(qk[:, q_heads:, None, :], qkv[:, n_q + n_kv:].view(batch, kv_heads, 1, dim))
            # masrl's CPU decode attention attends in float32 and returns the query's dtype
            query = qk[:, :q_heads, None, :]
            attn = grouped_decode_attention(query.float(), keys.float(), values.float(), additive, layer["scaling"])
            attn = attn.view(batch, n_q).to(query.dtype).to(low)
            h = h + lora(linear(attn, layer["o"]), attn, groups["o"], scales)
            x = norm(h, layer["norm2"]).to(low)
            gate_up = lora(self._project(x, layer["gate_up"]), x, groups["gate_up"], scales)
            n = layer["n_inner"]
            inner = F.silu(gate_up[:, :n]) * gate_up[:, n:]
            h = h + lora(linear(inner, layer["down"]), inner, groups["down"], scales)
        x = norm(h, self.norm).to(low)
        return lora(linear(x, self.head), x, self.head_lora, scales)

    def _compilable(self, cache, batch: int, scales: list) -> bool:
        """Whether this step can run compiled (``masrl.models.compiled_decode``): no row decodes with an adapter,
        stacked projections, every cache layer written in place over all its rows at one filled length with room
        for this position, and a compiler that builds inductor's kernels."""
        if not self.stacked or any(s is not None for s in scales):
            return False
        layers = cache.layers
        filled = getattr(layers[0], "_filled", None)
        for layer in layers:
            buffer = getattr(layer, "_k", None)
            if (buffer is None or not layer.is_initialized or layer._rows != slice(None) or layer._filled != filled
                    or buffer.shape[0] != batch or filled >= buffer.shape[-2]):
                return False
        from masrl.models.compiled_decode import compiler_failure

        return compiler_failure() is None

    def _compiled_step(self, h, cos, sin, cache, additive) -> torch.Tensor:
        """The layers and LM head of ``_step`` as ``masrl.models.compiled_decode.decode_step`` compiled; the
        cache layers then stand where their own ``update`` would leave them."""
        from masrl.models.compiled_decode import compiled_decode_step, projection

        if self._compiled_inputs is None:
            first = self.layers[0]
            layers = [(spec["norm1"], projection(spec["qkv"][0]), spec["q_norm"], spec["k_norm"], projection(spec["o"]),
                       spec["norm2"], projection(spec["gate_up"][0]), projection(spec["down"])) for spec in self.layers]
            shapes = (first["n_q"], first["n_kv"], first["head_dim"], first["n_inner"], first["scaling"], self.hidden,
                      base_linear(self.llama.lm_head).out_features)
            self._compiled_inputs = (layers, projection(self.head), shapes)
        layers, head, shapes = self._compiled_inputs
        filled = cache.layers[0]._filled
        logits = compiled_decode_step()(h, cos, sin, layers, [(c._k, c._v) for c in cache.layers],
                                        torch.tensor(filled), additive, self.norm, head, shapes, self.dtypes[1])
        for layer in cache.layers:
            layer._filled = filled + 1
            layer.keys, layer.values = layer._k[:, :, :filled + 1], layer._v[:, :, :filled + 1]
        return logits
