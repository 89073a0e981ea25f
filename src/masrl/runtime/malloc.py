"""glibc malloc settings for a training process on CPU: keep freed memory for the next tensor.

PyTorch's CPU allocator asks ``malloc`` for every tensor. With glibc's defaults, a block above the mmap
threshold (128 KiB at start, raised as mapped blocks are freed, never above 32 MiB) is a fresh ``mmap`` and goes
back to the kernel on ``free``; the next tensor of that size is faulted in again, one zero-filled 4 KiB page at a
time. A training step makes and drops thousands of such tensors (activations, autocast's casts, the LM head's
logits and gradients), so it pays a page fault for much of the memory it touches. Measured on the 2-core
development machine (``python benchmarks/malloc_faults.py --update``, benchmarks/RESULTS.md "Allocator settings", AMD EPYC Zen 4):

* one SmolLM2-135M update (8 rows x 132 tokens, bf16 autocast): ~360k minor faults and 8.1 CPU s (7.5-8.7) with
  glibc's defaults, ~3.5k faults and 5.6 CPU s with these settings;
* a float32 ``[49152, 576]`` clone (SmolLM2's LM head, 113 MB): 57 ms and 27,649 faults, 12 ms and none.

``tune_malloc`` sets, through ``mallopt``:

* ``M_MMAP_MAX = 0``: no block is served by ``mmap``; every block comes from the heap and is reused after
  ``free``;
* ``M_TRIM_THRESHOLD`` = ``TRIM_THRESHOLD`` (2 GiB, the largest ``mallopt`` takes): free memory at the top of the
  heap is handed back to the kernel only above that (each hand-back is faulted in again by the next peak);
* ``M_TOP_PAD`` = ``TOP_PAD`` (64 MiB): the heap grows in steps of at least that much.

Results are bitwise unchanged (only where memory comes from changes). The cost: the process keeps up to 2 GiB of
freed memory instead of handing it back (its resident set stays near its peak after one), as PyTorch's CUDA
caching allocator does on a GPU; peaks measured +2-3 % (vs_trl SmolLM2: 4.43 vs 4.33 GB) and +7 % (the
SmolLM2 team example: 9.14 vs 8.56 GB). So the trainer calls ``trim()`` (glibc's ``malloc_trim(0)``) at its phase
boundaries (after SFT, before and after each evaluation, between each rollout and its update): the free memory of
the heap, at its top and in its middle, goes back to the kernel, so that the next phase's peak does not sit on the
previous phase's leftovers; inside a phase freed blocks are still reused without page faults. The update's own
leftovers are not trimmed before the next rollout, which reuses them (a rollout needs less than an update; each
trim costs the next phase one page fault per 4 KiB it touches again). Under ``trainer.memory_defaults`` the
in-process engine also trims after each batch it decodes (``TransformersEngine.after_batch``): a call's
keys/values and activations leave holes the next call's, sized otherwise, do not fill, and a 200-episode evaluation of
the SmolLM2 team peaked ~250 MiB higher without it, in the same time (benchmarks/RESULTS.md).
``trainer.tune_malloc: false`` leaves glibc's defaults.

``tune_malloc("lean")`` (``trainer.tune_malloc: lean``) does the opposite, for memory: ``M_MMAP_THRESHOLD`` =
``LEAN_MMAP_THRESHOLD`` (128 KiB, fixed: glibc no longer raises it) and ``M_TRIM_THRESHOLD`` = 128 KiB, the same
as ``MALLOC_MMAP_THRESHOLD_=131072`` in the environment: every block above 128 KiB is its own mapping, handed back
to the kernel on ``free``, so the resident set follows the live tensors instead of the heap's high-water mark and its
fragments. A SmolLM2 Voting team run: 2.0-2.3 GB at every step's end against 8.3-10.6 GB with the defaults, the same
values bitwise, ~1.5x the step time (every large tensor is faulted in afresh; docs/performance.md).
The settings are process-wide, applied once by the ``masrl.trainer.Trainer`` (and each Ray policy worker)
before the models are built. Linux with glibc only; elsewhere (macOS, musl, Windows) nothing changes.

``cap_primitive_caches(n)`` (``trainer.primitive_cache``) bounds the two caches of oneDNN products that bf16 matmuls
on a CPU fill: oneDNN's primitive cache (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``) and PyTorch's ideep cache in front of
it (``LRU_CACHE_CAPACITY``), 1024 entries each by default. Each new matmul shape (every new row count of a prefill,
a decode step or a micro-batch) adds an entry of ~0.6-0.85 MiB (JIT-compiled AMX kernels): measured on the Intel Xeon
with AMX, the SmolLM2 team's live heap after each step grew 486 -> 849 MiB over five steps with the defaults and
stayed at 291 MiB with 64 entries each (250 with 16), in the same step time (benchmarks/RESULTS.md). Too small a
cache for shapes that recur costs a kernel compile (~4.4 ms) per eviction. Results are unchanged.
"""
from __future__ import annotations

import ctypes
import os
import sys
import threading

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -2, -3, -4  # glibc's malloc.h
TRIM_THRESHOLD = 2**31 - 1  # the largest value mallopt takes (an int): 2 GiB
TOP_PAD = 64 << 20
LEAN_MMAP_THRESHOLD = 128 << 10  # glibc's initial mmap threshold, here fixed
MODES = ("fast", "lean")
# where oneDNN (ONEDNN_, or its older DNNL_ name) and PyTorch's ideep read their kernel caches' capacity
PRIMITIVE_CACHE_VARS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")

_lock = threading.Lock()
_applied: dict | None = None


def _glibc():
    """glibc's handle, or None (not Linux, or another C library)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        version = libc.gnu_get_libc_version
        libc.mallopt  # noqa: B018 - present in glibc only (musl has no mallopt)
    except (OSError, AttributeError):
        return None
    version.restype = ctypes.c_char_p
    return libc


def tune_malloc(mode: str = "fast") -> dict | None:
    """Apply the settings above to this process: ``fast`` (the heap keeps freed memory) or ``lean`` (large blocks
    go back to the kernel). Once per process: a second call returns what the first set, whatever its mode (the
    settings are process-wide; the first mode stays). Returns what was set (``{"glibc": version, "mode": "fast",
    "M_MMAP_MAX": 0, ...}``) or None where there is no glibc. A setting glibc refuses is left at its default and
    reported as ``False``."""
    global _applied
    if mode not in MODES:
        raise ValueError(f"tune_malloc: mode {mode!r} is not one of {', '.join(MODES)}")
    with _lock:
        if _applied is not None:
            return dict(_applied)
        libc = _glibc()
        if libc is None:
            return None
        if mode == "fast":
            settings = {"M_MMAP_MAX": (M_MMAP_MAX, 0), "M_TRIM_THRESHOLD": (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
                        "M_TOP_PAD": (M_TOP_PAD, TOP_PAD)}
        else:
            settings = {"M_MMAP_THRESHOLD": (M_MMAP_THRESHOLD, LEAN_MMAP_THRESHOLD),
                        "M_TRIM_THRESHOLD": (M_TRIM_THRESHOLD, LEAN_MMAP_THRESHOLD)}
        done: dict = {"glibc": libc.gnu_get_libc_version().decode(), "mode": mode}
        for name, (param, value) in settings.items():
            done[name] = value if libc.mallopt(ctypes.c_int(param), ctypes.c_int(value)) == 1 else False
        _applied = done
        return dict(done)


def trim() -> bool:
    """Hand the heap's free memory back to the kernel (``malloc_trim(0)``) where ``tune_malloc`` set the fast
    mode in this process (in the other modes, or without glibc, nothing to do). Returns whether it trimmed.
    Results are unchanged: only free pages go."""
    if _applied is None or _applied.get("mode") != "fast":
        return False
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(ctypes.c_size_t(0))
    return True


def applied() -> dict | None:
    """What ``tune_malloc`` set in this process (None: not called, or no glibc)."""
    return None if _applied is None else dict(_applied)


def cap_primitive_caches(capacity: int) -> dict[str, str]:
    """Bound oneDNN's primitive cache and PyTorch's ideep cache to ``capacity`` entries each (the module's
    docstring), through the environment variables the libraries read when they first use the cache: this must
    run before the process's first oneDNN product (the runtimes call it before they build a model; in a process
    that has already run one, the libraries keep the capacity they read). A capacity the environment already sets
    (``ONEDNN_`` or ``DNNL_PRIMITIVE_CACHE_CAPACITY``, ``LRU_CACHE_CAPACITY``) is kept: the user's. Returns the
    values in effect."""
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"cap_primitive_caches: capacity {capacity!r} is not a positive int")
    if "DNNL_PRIMITIVE_CACHE_CAPACITY" not in os.environ:
        os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(capacity))
    os.environ.setdefault("LRU_CACHE_CAPACITY", str(capacity))
    onednn = os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY", os.environ.get("DNNL_PRIMITIVE_CACHE_CAPACITY"))
    return {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": onednn, "LRU_CACHE_CAPACITY": os.environ["LRU_CACHE_CAPACITY"]}
