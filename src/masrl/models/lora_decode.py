"""Per-row LoRA adapters in masrl's fast decode step: the rows of one batch use different adapters in one pass.

For a LoRA-wrapped projection PEFT computes ``base(x) + scaling_a * B_a(A_a(dropout_a(x)))`` for its active
adapter ``a`` (dropout is off while decoding: the engine decodes in eval mode). Here every adapter of a projection
group (``q``/``k``/``v``, ``gate``/``up``, or one projection) is stacked into two matrices, and a per-row scale
picks each row's adapter::

    delta = ((x @ A.T) * scales) @ B.T

* ``A`` ``[sum of ranks, in]``: the ``lora_A`` weight of every (adapter, projection) block, one under the other;
* ``B`` ``[sum of outputs, sum of ranks]``: each block's ``lora_B`` weight in its projection's output rows and its
  block's columns, zeros elsewhere;
* ``scales`` ``[rows, sum of ranks]``: ``scaling_a`` (``lora_alpha / r``, or PEFT's rsLoRA value) in the columns of
  the blocks of the row's adapter, 0 elsewhere. A row with no adapter has all zeros (the base model), an adapter
  that does not target a projection has no block there (that projection is the base one for its rows).

One matrix product gives every adapter's low-rank activations for every row, the scales keep the row's own, a second
product maps them back: two products per group whatever the number of adapters. On one CPU thread this beats
gathering each row's ``A``/``B`` for ``torch.bmm`` and running each adapter's rows apart (``index_select``, two
products, ``index_add_``) for 2-4 adapters and 8-64 rows (``benchmarks/lora_delta_kernels.py``).

**Exactness.** Not bitwise PEFT's forward: the scale multiplies the rank-wide activations instead of ``B``'s output,
and ``B``'s zero blocks may change how the BLAS groups the sum; in float32 the logits are within 1e-6 of PEFT's
forward with the row's adapter active (``tests/test_multi_adapter_decode.py``). In bf16 (bf16 weights with PEFT's
float32 adapters: the input cast to float32 as PEFT does, the sum cast back; under autocast: the adapter's products
in bf16, as autocast runs PEFT's) within 2e-2 of the largest logit (``tests/test_fast_decode_bf16.py``).

Without a routing (``routes=None``: no row names an adapter, as for a policy with one shared adapter) every row gets
what PEFT's own forward gives: the sum of the layer's active adapters, none while adapters are disabled.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

def _lora_linear_type():
    try:
        from peft.tuners.lora.layer import Linear
    except ImportError:  # pragma: no cover - PEFT not installed: no LoRA layers either
        return None
    return Linear


def is_lora(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a PEFT LoRA ``Linear`` (a base ``nn.Linear`` plus adapters)."""
    lora_type = _lora_linear_type()
    return lora_type is not None and type(module) is lora_type


def base_linear(module: torch.nn.Module) -> torch.nn.Module:
    """The layer whose weight the base model uses: the PEFT layer's ``base_layer``, or ``module`` itself."""
    return module.base_layer if is_lora(module) else module


def _cpu_weight(linear) -> bool:
    w = getattr(linear, "weight", None)
    return (type(linear) is torch.nn.Linear and linear.bias is None and type(w) is torch.nn.Parameter
            and w.dtype in (torch.float32, torch.bfloat16) and w.device.type == "cpu" and w.layout == torch.strided)


def adapter_dtypes(model: torch.nn.Module) -> set:
    """The dtypes of every LoRA ``lora_A`` / ``lora_B`` weight of ``model``."""
    return {p.dtype for name, p in model.named_parameters() if ".lora_A." in name or ".lora_B." in name}


def unsupported_lora(module: torch.nn.Module) -> str | None:
    """Why the adapters of this PEFT LoRA ``Linear`` cannot run in the fast step (None: they can)."""
    if module.merged:
        return "LoRA adapters are merged into the base weights"
    if getattr(module, "lora_variant", None) or any(getattr(module, "use_dora", {}).values()):
        return "a LoRA variant (DoRA, aLoRA, ...)"
    if getattr(module, "fan_in_fan_out", False) or len(getattr(module, "lora_magnitude_vector", {})):
        return "a LoRA layer with fan_in_fan_out or a magnitude vector"
    for name in module.lora_A.keys():
        if not (_cpu_weight(module.lora_A[name]) and _cpu_weight(module.lora_B[name])):
            return f"adapter {name!r}: lora_A/lora_B are not float32/bfloat16 CPU nn.Linear without bias"
    return None


class LoraGroup:
    """The stacked adapters of one projection group (the projections whose outputs the fast step concatenates)."""

    def __init__(self, modules: Sequence[torch.nn.Module], dtype: torch.dtype = torch.float32):
        blocks, offset = [], 0  # (adapter, rank, scaling, active without routing, output offset, outputs)
        for module in modules:
            outputs = base_linear(module).out_features
            if is_lora(module):
                active = set() if module.disable_adapters else set(module.active_adapters)
                for name in module.lora_A.keys():
                    rank = module.lora_A[name].out_features
                    blocks.append((name, rank, float(module.scaling[name]), name in active, offset, outputs,
                                   module.lora_A[name].weight.detach(), module.lora_B[name].weight.detach()))
            offset += outputs
        self.layout = tuple(b[:4] for b in blocks)  # what the per-row scales depend on
        with torch.no_grad():
            self.A = torch.cat([b[6] for b in blocks]).to(dtype) if blocks else None
            self.B = torch.zeros(offset, sum(b[1] for b in blocks), dtype=dtype)
            column = 0
            for _, rank, _, _, start, outputs, _, lora_B in blocks:
                self.B[start:start + outputs, column:column + rank] = lora_B
                column += rank

    @classmethod
    def of(cls, modules: Sequence[torch.nn.Module], dtype: torch.dtype = torch.float32) -> "LoraGroup | None":
        """The group of ``modules`` with its adapters in ``dtype``, or None when none of them carries an adapter."""
        group = cls(modules, dtype)
        return group if group.layout else None

    def delta(self, x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """Every row's adapter delta for input ``x`` ``[rows, in]`` (``scales`` from ``row_scales``)."""
        return F.linear(F.linear(x, self.A) * scales, self.B)


def row_scales(layout: tuple, routes: Sequence[str | None] | None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
    """The ``scales`` of a group with this ``layout``: ``[rows, sum of ranks]`` for ``routes`` (row ``i`` uses adapter
    ``routes[i]``; None or ``masrl.models.lora.BASE``: the base model), ``[1, sum of ranks]`` for every row without a routing (the
    layer's active adapters). None when every scale is 0 (the group adds nothing)."""
    if routes is None:
        columns = [torch.full((1, rank), scaling if active else 0.0) for _, rank, scaling, active in layout]
        if not any(active for *_, active in layout):
            return None
    else:
        names = list(routes)
        if not any(name in names for name, *_ in layout):
            return None
        columns = [torch.tensor([scaling if n == name else 0.0 for n in names])[:, None].expand(-1, rank)
                   for name, rank, scaling, _ in layout]
    return torch.cat(columns, 1).to(dtype).contiguous()
