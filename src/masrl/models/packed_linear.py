"""bf16 decoding on a CPU with oneDNN-prepacked Linear weights.

Under ``torch.autocast("cpu", bfloat16)`` every ``nn.Linear`` casts its float32 weight to bf16 (once per engine
call: autocast's cast cache) and hands it to oneDNN in the plain ``[out, in]`` layout, which oneDNN reorders
into its blocked layout on every call. A decode step multiplies a few rows by every weight of the model, so it is
bound by reading the weights, and that per-call reorder costs: on SmolLM2-135M, 8 rows, a 576 x 1536 projection
takes 322 us plain and 262 us prepacked, 576 x 576 126 -> 73 us, the 49k-token LM head 9.7 -> 5.7 ms
(``benchmarks/profile_step.py --section levers --levers packed_linear``).

``PackedLinears`` keeps, per model, a bf16 copy of each large ``nn.Linear`` weight in oneDNN's layout
(``torch.ops.mkldnn._reorder_linear_weight``, what ``torch.compile``'s CPU backend does), made once and reused
while the weight is unchanged (its version counter and storage), and ``PackedLinears.active`` runs those
modules through ``torch.ops.mkldnn._linear_pointwise`` while autocast is on in bf16. Results are bitwise those
of autocast's ``F.linear`` (the same oneDNN inner product; ``tests/test_packed_linear.py``).

Only plain ``nn.Linear`` modules on a CPU with float32 or bf16 weights of at least ``MIN_WEIGHT`` entries and
no bias (LoRA's small A/B matrices, quantized or sharded layers keep their own forward; PEFT's LoRA layers call
their base ``nn.Linear``, which is packed); a bf16 copy of those weights stays in memory between engine calls
(SmolLM2-135M: 256 MiB) until the weights change or ``PackedLinears.clear``.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import torch

MIN_WEIGHT = 1 << 16  # smaller weights (LoRA adapters, tiny models) gain nothing from packing


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """Whether this torch build has oneDNN's prepacked linear (x86 and Arm CPU builds do) and this CPU runs its bf16
    path: oneDNN packs bf16 weights only with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT and raises on an AVX2-only
    CPU, so a tiny weight is packed and used once to find out (cached for the process)."""
    mkldnn = getattr(torch.ops, "mkldnn", None)
    if not (torch.backends.mkldnn.is_available() and mkldnn is not None
            and hasattr(mkldnn, "_reorder_linear_weight") and hasattr(mkldnn, "_linear_pointwise")):
        return False
    try:
        with torch.no_grad():
            packed = mkldnn._reorder_linear_weight(torch.ones(16, 16, dtype=torch.bfloat16), 1)
            mkldnn._linear_pointwise(torch.ones(1, 16, dtype=torch.bfloat16), packed, None, "none", [], "")
    except RuntimeError:  # "bf16 path needs the cpu support avx_ne_convert or avx512bw, avx512vl and avx512dq"
        return False
    return True


BATCH_HINT = 8  # oneDNN picks the blocked layout for this many rows (any row count works, with the same results)


def pack(weight: torch.Tensor, batch_hint: int = BATCH_HINT) -> torch.Tensor:
    """A bf16 copy of ``weight`` (``[out, in]``, float32 or bf16) in oneDNN's blocked layout, for ``linear``."""
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(torch.bfloat16).contiguous(), batch_hint)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` in bf16 for a weight packed by ``pack`` (``x`` bf16): bitwise ``F.linear``'s bf16
    product (the same oneDNN inner product, without reordering the weight at every call)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _packable(module: torch.nn.Module) -> bool:
    w = getattr(module, "weight", None)
    return (type(module) is torch.nn.Linear and module.bias is None and isinstance(w, torch.Tensor)
            and type(w.data) is torch.Tensor and w.device.type == "cpu" and w.layout == torch.strided
            and w.dtype in (torch.float32, torch.bfloat16) and w.numel() >= MIN_WEIGHT and w.dim() == 2
            and not module._forward_hooks and not module._forward_pre_hooks)


class PackedLinears:
    """Packed bf16 copies of a model's large Linear weights, reused while the weights do not change."""

    def __init__(self, batch_hint: int = BATCH_HINT):
        self.batch_hint = batch_hint
        self._packed: dict[int, tuple[tuple[int, int], torch.Tensor]] = {}
        self.packs = 0  # weights packed so far (a repack after each weight change)

    def clear(self) -> None:
        self._packed.clear()

    def _weight(self, module: torch.nn.Linear) -> torch.Tensor:
        w = module.weight
        key = (w._version, w.data_ptr())
        hit = self._packed.get(id(module))
        if hit is None or hit[0] != key:
            hit = (key, pack(w, self.batch_hint))
            self._packed[id(module)] = hit
            self.packs += 1
        return hit[1]

    def packed_weight(self, module: torch.nn.Module) -> torch.Tensor | None:
        """The packed bf16 copy of ``module``'s weight, reused or made now, or None for a module this class does not
        pack: the fast decode step takes its unstacked projections from here, so the prefill's Linear layers and
        the decode step share one copy (``masrl.models.fast_decode.FastDecode``)."""
        return self._weight(module) if _packable(module) else None

    @contextlib.contextmanager
    def active(self, model: torch.nn.Module) -> Iterator[int]:
        """Inside, the packable Linear modules of ``model`` compute with their packed weight whenever bf16 autocast
        is on for the CPU (else as before); yields how many modules were switched."""
        modules = [m for m in model.modules() if _packable(m)]
        live = {id(m) for m in modules}
        for key in [k for k in self._packed if k not in live]:  # modules that are gone
            del self._packed[key]
        for m in modules:
            m.forward = _packed_forward(self, m)
        try:
            yield len(modules)
        finally:
            for m in modules:
                m.__dict__.pop("forward", None)


def _packed_forward(owner: PackedLinears, module: torch.nn.Linear):
    plain = type(module).forward.__get__(module)

    def forward(x: torch.Tensor) -> torch.Tensor:
        if (x.device.type != "cpu" or not torch.is_autocast_enabled("cpu")
                or torch.get_autocast_dtype("cpu") != torch.bfloat16 or torch.is_grad_enabled()):
            return plain(x)
        return linear(x.to(torch.bfloat16), owner._weight(module))

    return forward
