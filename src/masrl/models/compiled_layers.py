"""``trainer.compile``: the update's decoder layers as compiled graphs (torch.compile, inductor, C++/OpenMP on CPU).

Each decoder layer's forward and backward run as one graph: inductor compiles the layer's forward, and
AOTAutograd its backward. The first micro-batch shape compiles a static graph; the first other shape compiles one
shape-generic graph (torch's automatic dynamic shapes), so micro-batches of every length reuse it instead of
compiling each length anew (a training step's micro-batches rarely repeat a length). All layers of a model
share the code and the compiled graph (their weights are graph
inputs), so a 30-layer model compiles once per shape, not 30 times. Only the trainer's forwards go through it
(``compiled_layers`` around them); the engine's decode step is compiled by its own option,
``rollout.compile_decode`` (``masrl.models.compiled_decode``; off by default: not measured faster than eager).

Compiled graphs persist across runs in inductor's FX graph cache under masrl's cache folder
(``$MASRL_CACHE_DIR/inductor``, ``masrl.paths.cache_dir``) unless ``TORCHINDUCTOR_CACHE_DIR`` is set.

``auto`` compiles when every condition holds: the model is on a CPU with native bf16 (where a compiled update was
measured faster than eager: an Intel Xeon with AMX at SmolLM2's width, 0.69x eager's CPU under bf16 autocast, 0.87x
in float32; no CPU without native bf16 has been measured, so ``auto`` stays eager there), a C++ compiler is present
(``$CXX``, else ``g++``, ``clang++`` or ``c++`` on ``PATH``, as inductor looks for one) and builds inductor's
kernels (``inductor_failure``: one small function compiled once per process), the policy trains without
LoRA adapters and without gradient checkpointing, and the run has at least ``AUTO_MIN_STEPS`` RL steps
(docs/performance.md, "Compiled decoder layers"). ``on`` compiles wherever the compiler and the policy allow;
otherwise, and for ``off``, eager, with one line saying why.
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
from typing import Iterator

import torch

log = logging.getLogger(__name__)

# RL steps from which `auto` compiles: the break-even of a cold inductor cache measured for the compiled tiny
# quickstart update on a Zen 4 (0.92x steady, 70 warm - 170 cold steps; benchmarks/RESULTS.md, "torch.compile")
AUTO_MIN_STEPS = 170
_COMPILED: dict[type, object] = {}  # decoder layer class -> its compiled forward (shared by every instance)


def cxx_compiler() -> str | None:
    """The C++ compiler inductor would use: ``$CXX`` when set (even a missing one: inductor would fail on it),
    else the first of g++, clang++, c++ on ``PATH``; None when there is none."""
    given = os.environ.get("CXX")
    if given:
        return shutil.which(given)
    return next((found for name in ("g++", "clang++", "c++") if (found := shutil.which(name))), None)


def _probe(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(x) * 2 + 1  # a pointwise kernel: inductor writes and builds C++ for it


_BUILDS: dict[str, str | None] = {}  # inductor cache folder -> why inductor cannot build there (None: it can)


def inductor_failure() -> str | None:
    """Why inductor cannot build a CPU kernel in this process (None: it can), found by compiling a one-line
    function once per process and cache folder: ~13 s with a cold cache, ~4 s with a warm one on an AMX Xeon,
    mostly inductor's own imports, which the compiled layers need anyway. A C++ compiler can be on ``PATH`` and
    still fail: inductor's kernels include ``Python.h`` (a distribution's Python without its development package
    has none), OpenMP's header, torch's own headers."""
    folder = inductor_cache()
    if folder not in _BUILDS:
        try:
            torch.compile(_probe, backend="inductor", fullgraph=True, dynamic=False)(torch.ones(4))
            _BUILDS[folder] = None
        except Exception as e:  # noqa: BLE001 - any failure to build means eager layers
            _BUILDS[folder] = f"{type(e).__name__}: {_compiler_error(str(e))[:200]}"
    return _BUILDS[folder]


NO_COMPILER = "no C++ compiler found ($CXX, g++, clang++, c++)"


def toolchain_failure() -> str | None:
    """Why inductor cannot compile here (None: it can): no C++ compiler (``cxx_compiler``), or one that cannot
    build inductor's kernels (``inductor_failure``); the update's ``compile_decision`` and the engine's compiled
    decode step (``masrl.models.compiled_decode``) say it in these words."""
    if cxx_compiler() is None:
        return NO_COMPILER
    failure = inductor_failure()
    return None if failure is None else f"the C++ compiler cannot build inductor's kernels here ({failure})"


def _compiler_error(text: str) -> str:
    """The compiler's first error in inductor's message (after its ``Output:`` line when there is one)."""
    lines = [line.strip() for line in text.splitlines()]
    after = lines[lines.index("Output:") + 1:] if "Output:" in lines else lines
    for line in after:
        low = line.lower()
        for mark in ("fatal error:", "error:"):
            if mark in low:
                return line[low.index(mark):]
    return next((line for line in after if line), "")


def compile_decision(setting: str, *, device: str, total_steps: int, lora: bool,
                     checkpointing: bool, native_bf16: bool | None = None,
                     sharded: bool = False) -> tuple[bool, str]:
    """(compile?, the one line that says what runs and why). ``native_bf16``: the CPU's (None: read it)."""
    if setting == "off":
        return False, "trainer.compile: off, eager decoder layers"
    if native_bf16 is None:
        from masrl.models.precision import cpu_has_native_bf16

        native_bf16 = cpu_has_native_bf16()
    blockers = []
    if device != "cpu":
        blockers.append(f"the model is on {device} (compiled layers are a CPU lever)")
    if cxx_compiler() is None:
        blockers.append(NO_COMPILER)
    if lora:
        blockers.append("LoRA adapters are routed per row (eager PEFT layers)")
    if checkpointing:
        blockers.append("gradient checkpointing recomputes layers eagerly")
    if sharded:
        blockers.append("FSDP2 shards the layers (not compiled with them)")
    if setting == "auto" and device == "cpu" and not native_bf16:
        blockers.append("on a CPU without native bf16 compiled layers are not measured faster than eager")
    if setting == "auto" and total_steps < AUTO_MIN_STEPS:
        blockers.append(f"{total_steps} RL steps do not repay the compile time (auto compiles from "
                        f"{AUTO_MIN_STEPS})")
    if not blockers and (failure := toolchain_failure()) is not None:
        blockers.append(failure)
    if blockers:
        return False, f"trainer.compile: {setting}, eager decoder layers: " + "; ".join(blockers)
    return True, f"trainer.compile: {setting}, decoder layers compiled with inductor (cache {inductor_cache()})"


def inductor_cache() -> str:
    """Inductor's cache folder: ``$TORCHINDUCTOR_CACHE_DIR``, else set to masrl's cache folder / inductor."""
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        from masrl.paths import cache_dir

        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir() / "inductor")
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a transformers causal LM (``model.model.layers``), or [] when it has none."""
    inner = getattr(getattr(model, "model", None), "layers", None)
    return list(inner) if isinstance(inner, torch.nn.ModuleList) else []


def _compiled_forward(layer: torch.nn.Module):
    cls = type(layer)
    if cls not in _COMPILED:
        inductor_cache()
        _COMPILED[cls] = torch.compile(cls.forward)
    return _COMPILED[cls]


@contextlib.contextmanager
def compiled_layers(model: torch.nn.Module, enabled: bool = True) -> Iterator[None]:
    """Within: each decoder layer of ``model`` runs its compiled forward (and so its compiled backward)."""
    layers = decoder_layers(model) if enabled else []
    for layer in layers:
        fn = _compiled_forward(layer)
        layer.forward = fn.__get__(layer)  # an instance attribute: nn.Module.__call__ finds it first
    try:
        yield
    finally:
        for layer in layers:
            layer.__dict__.pop("forward", None)
