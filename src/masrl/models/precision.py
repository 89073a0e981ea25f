"""What ``trainer.autocast`` means on a device: the ``auto`` rule (docs/performance.md#precision).

``auto`` (the default) is bfloat16 autocast where bfloat16 matmuls run natively: a CUDA device that
supports bfloat16 without emulation (Ampere and newer), or a CPU whose flags (``/proc/cpuinfo``) include
``avx512_bf16`` or ``amx_bf16`` (AMD Zen 4+, Intel Cooper Lake / Sapphire Rapids+); float32 elsewhere
(older x86, Apple silicon, MPS). ``bfloat16`` / ``float16`` are used as given; ``float32`` or None is off.
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch

AUTOCAST_CHOICES = ("auto", "bfloat16", "float16", "float32")
_NATIVE_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.lru_cache(maxsize=1)
def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU computes bfloat16 dot products in hardware (AVX512-BF16 or AMX-BF16 flags)."""
    try:
        text = Path(cpuinfo).read_text(errors="replace")
    except OSError:  # not Linux (macOS, Windows): no flags to read, float32
        return False
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[-1].split())
            return any(flag in flags for flag in _NATIVE_BF16_CPU_FLAGS)
    return False


def _cuda_has_native_bf16(device: torch.device) -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))
    except TypeError:  # older torch without the keyword
        return bool(torch.cuda.is_bf16_supported())


def resolve_autocast(setting: str | None, device: str | torch.device = "cpu") -> str | None:
    """The autocast dtype name for ``setting`` (``trainer.autocast``) on ``device``, None for float32 (off)."""
    if setting is None or setting == "float32":
        return None
    if setting != "auto":
        return setting
    device = torch.device(device)
    if device.type == "cuda":
        return "bfloat16" if _cuda_has_native_bf16(device) else None
    if device.type == "cpu":
        return "bfloat16" if cpu_has_native_bf16() else None
    return None
