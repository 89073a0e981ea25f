"""The preallocated KV cache of the in-process engine: keys/values written in place, not grown by ``torch.cat``."""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=1)
def cache_keyword() -> str:
    """The keyword transformers' causal LMs take the KV cache by (and the output field that returns it).

    transformers 5.24 renamed ``past_key_values`` to ``cache`` (the old keyword warns and goes in 5.40);
    earlier 5.x releases only know ``past_key_values``. The output dataclass carries the same name."""
    import dataclasses

    from transformers.modeling_outputs import CausalLMOutputWithPast

    return "cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} else "past_key_values"


def with_cache(cache) -> dict:
    """``model(..., **with_cache(cache))``: pass a KV cache under this transformers' keyword."""
    return {cache_keyword(): cache}


def output_cache(out):
    """The KV cache a causal LM's forward returned."""
    return getattr(out, cache_keyword())


class _PreallocatedLayer:
    """Factory of the preallocated cache layer class (built lazily: transformers is imported on use)."""

    cls = None

    @classmethod
    def get(cls):
        if cls.cls is None:
            from transformers.cache_utils import DynamicLayer

            class PreallocatedLayer(DynamicLayer):
                """Keys/values written in place into ``[batch, heads, capacity, head_dim]`` buffers.

                ``prefill(keys, values, filled)`` starts the layer from buffers whose first ``filled``
                positions are already set (reused prefixes); otherwise the first update allocates them.
                """

                def __init__(self, capacity: int, dtype: torch.dtype | None = None):
                    super().__init__()
                    self.capacity = capacity
                    self.buffer_dtype = dtype  # None: the dtype of the first keys written
                    self._filled = 0
                    self._rows = slice(None)  # the batch rows the next forward covers (prefill chunks)
                    self._total_rows: int | None = None

                def prefill(self, keys: torch.Tensor, values: torch.Tensor, filled: int) -> None:
                    self._k, self._v, self._filled = keys, values, filled
                    self.dtype, self.device = keys.dtype, keys.device
                    self.keys, self.values = keys[:, :, :filled], values[:, :, :filled]
                    self.is_initialized = True

                def focus(self, rows: slice, filled: int, total_rows: int) -> None:
                    """The next forward covers batch ``rows`` only, after ``filled`` positions."""
                    self._rows, self._filled, self._total_rows = rows, filled, total_rows
                    if self.is_initialized:
                        self.keys, self.values = self._k[rows, :, :filled], self._v[rows, :, :filled]

                def update(self, key_states, value_states, *args, **kwargs):
                    if not self.is_initialized:
                        dtype = self.buffer_dtype or key_states.dtype
                        self.dtype, self.device = dtype, key_states.device
                        b, h, _, d = key_states.shape
                        b = self._total_rows or b
                        self._k = key_states.new_zeros((b, h, self.capacity, d), dtype=dtype)
                        self._v = value_states.new_zeros((b, h, self.capacity, value_states.shape[-1]), dtype=dtype)
                        self.is_initialized = True
                    start, end = self._filled, self._filled + key_states.shape[-2]
                    if end > self._k.shape[-2]:  # longer than planned: grow (never happens in _decode)
                        grow = max(end, 2 * self._k.shape[-2]) - self._k.shape[-2]
                        self._k = torch.cat([self._k, self._k.new_empty((*self._k.shape[:2], grow, self._k.shape[-1]))], -2)
                        self._v = torch.cat([self._v, self._v.new_empty((*self._v.shape[:2], grow, self._v.shape[-1]))], -2)
                    rows = self._rows
                    self._k[rows, :, start:end].copy_(key_states)
                    self._v[rows, :, start:end].copy_(value_states)
                    self._filled = end
                    self.keys, self.values = self._k[rows, :, :end], self._v[rows, :, :end]
                    return self.keys, self.values

                def select_rows(self, index: torch.Tensor) -> None:
                    """Keep/duplicate batch rows (``index`` into the current rows)."""
                    self._k, self._v = self._k.index_select(0, index), self._v.index_select(0, index)
                    self.keys, self.values = self._k[:, :, :self._filled], self._v[:, :, :self._filled]

            cls.cls = PreallocatedLayer
        return cls.cls


def preallocated_cache(model: torch.nn.Module, capacity: int, dtype: torch.dtype | None = None):
    """A transformers ``DynamicCache`` whose layers write into buffers of ``capacity`` positions.

    The default dynamic cache grows every layer's keys and values by ``torch.cat`` at every decode
    step (a copy of the whole cache per step: O(length^2) traffic, the largest rollout op on small
    models). Here each layer allocates ``[batch, heads, capacity, head_dim]`` once, writes new
    positions in place and hands attention the view of the filled prefix: the same values, so the
    same logits. ``dtype``: the buffers' dtype (None: the first keys'); a float32 cache under bf16
    autocast holds the bf16 keys exactly and spares the float32 decode attention a conversion of the whole
    cache per step. Returns None (the model builds its default cache) unless every layer of the
    model's default cache is a plain full-attention ``DynamicLayer``.
    """
    try:
        from transformers.cache_utils import DynamicCache, DynamicLayer
    except ImportError:  # pragma: no cover - other transformers versions
        return None
    config = getattr(model, "config", None)
    if config is None:
        return None
    try:
        cache = DynamicCache(config=config)
    except Exception:  # noqa: BLE001 - unusual configs: keep the model's own cache
        return None
    if not cache.layers or any(type(layer) is not DynamicLayer for layer in cache.layers):
        return None
    layer_cls = _PreallocatedLayer.get()
    cache.layers = [layer_cls(capacity, dtype) for _ in cache.layers]
    return cache
