"""Memory defaults: the settings a config leaves unset, chosen from the models' shapes and the machine's memory.

``masrl train`` applies them before it builds a model (``apply_memory_defaults``) and prints one line saying
what it chose; a setting the config or the command line gives is never changed, and ``trainer.memory_defaults:
false`` keeps every fixed default (the same run on every machine). With ``M`` the machine's memory
(``MemTotal``, or the cgroup's limit when lower), on a CPU run with the in-process engine:

* ``trainer.micro_batch_tokens``: the largest power of two from 256 to 4096 whose update activations
  (``masrl.plan.activation_bytes``, the largest trainable policy, without checkpointing) fit ``M/12`` (then
  perhaps halved: below). The update's activations grow with the micro-batch, its speed hardly does past a few
  hundred tokens.
* ``trainer.max_rollout_batch`` (rows decoded together per policy): the largest power of two from 16 to 512
  whose keys/values at ``PROMPT_TOKENS`` + the longest ``max_new_tokens`` fit ``M/8`` (then perhaps halved:
  below). An evaluation of 200 episodes decodes them in several calls instead of one.
* ``policies.<p>.gradient_checkpointing``: on for a trainable policy whose update (weights, gradients, AdamW
  state, activations of the chosen micro-batch) passes ``M/4`` (it costs ~+50 % of a LoRA update's compute).
* the whole predicted peak within ``M/6``: every policy's weights, gradients and AdamW state, its decode-only
  weight copies (bf16 autocast on a CPU: ``DECODE_COPIES``), the largest update's activations (under CPU autocast
  1.1x the float32 formula: ``AUTOCAST_CPU_ACTIVATIONS``), the keys/values of the rows above and the prefix cache
  at its resident size (``PREFIX_RESIDENT`` x its bytes). When even the smallest cache (64 MiB) does not fit, the
  unset micro-batch and rows above halve in turn (down to 256 tokens and 16 rows) until it does.
* ``rollout.prefix_cache_mib``: the largest power of two from 64 to 1024 MiB that fits what is left.
* ``rollout.keep_decode_weights``: false where decoding keeps weight copies (bf16 on a CPU): released before
  each update, rebuilt by the next decode (~0.4 s for SmolLM2-135M).
* ``trainer.primitive_cache``: ``PRIMITIVE_CACHE`` entries (oneDNN's and ideep's caches of bf16 matmul kernels,
  ~0.6-0.85 MiB per matmul shape, 1024 entries each by default: ``masrl.runtime.malloc.cap_primitive_caches``).
* ``trainer.tune_malloc``: ``lean`` (freed memory goes back to the kernel, ~1.5-1.8x the step time) when that
  predicted peak still passes ``M/4``; else ``true`` (the heap keeps freed memory, and ``malloc_trim`` at phase
  boundaries and after each decoded batch hands it back).

The cheap settings are sized to a sixth of the machine (room for the system, the data and another run), the
expensive ones come on only past a quarter. The predictions are those of ``masrl plan`` (keys/values sized for
``PROMPT_TOKENS``-token prompts: an upper bound for short-prompt teams). On GPUs, under Ray or with vLLM the
fixed defaults stay (sized for the accelerator: ``masrl plan``), as they do for a model whose config.json is not at
hand (a warning says so).
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any

from masrl.errors import UserInputError
from masrl.models.precision import resolve_autocast
from masrl.plan import _BYTES, activation_bytes, model_shape, plan_policy
from masrl.plan.shapes import ModelShape

PROMPT_TOKENS = 512  # prompt length the keys/values are sized for (as ``masrl plan --prompt-tokens``)
MiB = 2 ** 20
# Under bf16/fp16 autocast on a CPU a float32 model's saved activations are no smaller than in float32: the norms
# and the residual stream stay float32 and each Linear saves a low-precision copy of its input beside them.
# Measured: the SmolLM2 team example's SFT phase peaks 1.60 MiB higher per micro-batch token under bf16 autocast
# (2,586 MiB at 512 tokens, 3,406 at 1024), against 1.47 MiB the float32 formula counts and 1.06 the bf16 one.
AUTOCAST_CPU_ACTIVATIONS = 1.1  # x the float32 formula's activations
# Decoding under bf16 autocast on a CPU keeps copies of the weights only decoding uses: the prepacked bf16 Linear
# weights and the fast decoder's stacked ones. Measured for SmolLM2-135M: ~0.41 GiB, 1.5x its parameters in bf16.
DECODE_COPIES = 1.5 * 2  # bytes per parameter
# The prefix cache keeps whole decode calls' keys/values between calls: long-lived blocks between the heap's
# short-lived ones, so the heap around them is not reused. Measured (a held-out evaluation of the SmolLM2 team, bf16
# autocast): a 512 MiB cache raised the peak resident set by 942 MiB and the live bytes by 524 MiB.
PREFIX_RESIDENT = 1.8  # resident bytes per byte of the cache
# oneDNN's and ideep's caches of matmul kernels, entries each: ~0.85 MiB per bf16 matmul shape on an AMX Xeon. With
# the libraries' 1024 the SmolLM2 team's live heap after a step grew 486 -> 849 MiB in five steps; with 64 it stayed
# at 291 (16: 250; 256: 405-414), in the same step time. Shapes that recur past the capacity pay a kernel compile.
PRIMITIVE_CACHE = 64
KERNEL_ENTRY_MIB = 0.85  # the largest measured entry, for the one line's bound


@dataclass(frozen=True)
class MemoryChoice:
    key: str  # dotted config key
    value: Any
    why: str


def machine_memory() -> int:
    """Bytes of memory this process may use: ``MemTotal``, or the cgroup's ``memory.max`` when lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < total:
            total = int(text)
    return total


def _pow2_at_most(limit: float, low: int, high: int) -> int:
    """The largest power of two in ``low..high`` that is <= ``limit`` (``low`` when none is)."""
    value = high
    while value > low and value > limit:
        value //= 2
    return value


def _unset(section, key: str) -> bool:
    return key not in section.model_fields_set


def choose_memory_defaults(cfg, memory: int) -> list[MemoryChoice]:
    """The settings ``cfg`` leaves unset, chosen for a machine of ``memory`` bytes (the rules above). Does not
    change ``cfg``."""
    trainer, rollout = cfg.trainer, cfg.rollout
    local_cpu = trainer.device == "cpu" and cfg.runtime.kind != "ray" and rollout.engine == "transformers"
    if not local_cpu:
        return []
    trainable = [n for n, p in cfg.policies.items() if p.trainable]
    try:
        shapes = {n: model_shape(p, policy=n) for n, p in cfg.policies.items()}
    except UserInputError as e:  # a model whose config.json is not at hand: the fixed defaults (its load says why)
        warnings.warn(f"memory defaults: not chosen, the fixed defaults stay ({e})", stacklevel=2)
        return []
    precision = resolve_autocast(trainer.autocast)
    choices: list[MemoryChoice] = []
    tokens, rows = trainer.micro_batch_tokens, trainer.max_rollout_batch
    per_token = max((_activations(cfg, n, shapes[n], 1024, precision, False) / 1024 for n in trainable), default=0.0)
    if trainable and _unset(trainer, "micro_batch_tokens"):
        tokens = _pow2_at_most(memory / 12 / per_token, 256, 4096)
    per_row = max(_kv_per_row(cfg, n, shapes[n]) for n in cfg.policies)
    if _unset(trainer, "max_rollout_batch"):
        rows = _pow2_at_most(memory / 8 / per_row, 16, 512)
    checkpointing = {n: bool(cfg.policies[n].gradient_checkpointing) for n in cfg.policies}
    checkpoint_choices: list[MemoryChoice] = []
    for n in trainable:
        if _unset(cfg.policies[n], "gradient_checkpointing"):
            update = _persistent(cfg, n) + _activations(cfg, n, shapes[n], tokens, precision, False)
            checkpointing[n] = update > memory / 4
            checkpoint_choices.append(MemoryChoice(
                f"policies.{n}.gradient_checkpointing", checkpointing[n],
                f"update {update / 2**30:.2f} GiB {'>' if checkpointing[n] else '<='} M/4"))
    copies = {n: _decode_copies(cfg, n, shapes[n]) for n in cfg.policies}
    fixed = sum(_persistent(cfg, n) + copies[n] for n in cfg.policies)

    def without_prefix(tokens: int, rows: int) -> float:
        acts = max((_activations(cfg, n, shapes[n], tokens, precision, checkpointing[n]) for n in trainable),
                   default=0.0)
        return fixed + acts + per_row * rows

    # the whole predicted peak within M/6: halve the unset micro-batch and rows, in turn, down to their floors
    floor = (64 if _unset(rollout, "prefix_cache_mib") else rollout.prefix_cache_mib) * MiB * PREFIX_RESIDENT
    turn = 0
    while without_prefix(tokens, rows) + floor > memory / 6:
        can_tokens = trainable and _unset(trainer, "micro_batch_tokens") and tokens > 256
        can_rows = _unset(trainer, "max_rollout_batch") and rows > 16
        if not (can_tokens or can_rows):
            break
        if can_tokens and (turn % 2 == 0 or not can_rows):
            tokens //= 2
        else:
            rows //= 2
        turn += 1
    if trainable and _unset(trainer, "micro_batch_tokens"):
        choices.append(MemoryChoice("trainer.micro_batch_tokens", tokens,
                                    f"update activations {per_token * tokens / 2**30:.2f} GiB"))
    if _unset(trainer, "max_rollout_batch"):
        choices.append(MemoryChoice("trainer.max_rollout_batch", rows, f"keys/values {per_row * rows / 2**30:.2f} GiB"))
    choices += checkpoint_choices
    base = without_prefix(tokens, rows)
    prefix = rollout.prefix_cache_mib
    if _unset(rollout, "prefix_cache_mib"):
        prefix = _pow2_at_most((memory / 6 - base) / MiB / PREFIX_RESIDENT, 64, 1024)
        choices.append(MemoryChoice("rollout.prefix_cache_mib", prefix,
                                    f"predicted peak {(base + prefix * MiB * PREFIX_RESIDENT) / 2**30:.2f} GiB with "
                                    f"it, M/6 {memory / 6 / 2**30:.2f}"))
    peak = base + prefix * MiB * PREFIX_RESIDENT
    if any(copies.values()) and _unset(rollout, "keep_decode_weights"):
        choices.append(MemoryChoice("rollout.keep_decode_weights", False,
                                    f"decode copies {sum(copies.values()) / 2**30:.2f} GiB released during updates"))
    if _unset(trainer, "primitive_cache"):
        choices.append(MemoryChoice("trainer.primitive_cache", PRIMITIVE_CACHE,
                                    f"~{PRIMITIVE_CACHE * KERNEL_ENTRY_MIB:.0f} MiB of matmul kernels at most"))
    if _unset(trainer, "tune_malloc"):
        lean = peak > memory / 4
        choices.append(MemoryChoice("trainer.tune_malloc", "lean" if lean else True,
                                    f"predicted peak {peak / 2**30:.2f} GiB {'>' if lean else '<='} M/4"))
    return choices


def _persistent(cfg, name: str) -> float:
    terms = plan_policy(cfg, name, PROMPT_TOKENS, cuda=False).terms
    return terms["weights"] + terms["grads"] + terms["optimizer"]


def _activations(cfg, name: str, shape: ModelShape, tokens: int, precision: str | None, ckpt: bool) -> float:
    pcfg = cfg.policies[name]
    act_b = _BYTES[precision] if precision else _BYTES[pcfg.dtype]
    factor = 1.0
    if precision and _BYTES[precision] < _BYTES[pcfg.dtype]:  # autocast on a CPU: AUTOCAST_CPU_ACTIVATIONS
        act_b, factor = _BYTES[pcfg.dtype], AUTOCAST_CPU_ACTIVATIONS
    seq = PROMPT_TOKENS + _max_new(cfg, name)
    targets = list(pcfg.lora.target_modules) if pcfg.lora else None
    return factor * activation_bytes(shape, tokens, seq, tokens * _max_new(cfg, name) // seq, act_b, ckpt, True,
                                     targets, cfg.trainer.logprob_chunk_tokens)


def _decode_copies(cfg, name: str, shape: ModelShape) -> float:
    """Bytes of the decode-only weight copies of the in-process engine (bf16 autocast on a CPU, float32 weights;
    ``DECODE_COPIES``): 0 where it decodes without them."""
    from masrl.rollout.engine import decode_autocast

    if (cfg.policies[name].dtype != "float32"
            or decode_autocast(cfg.trainer.autocast, "cpu", shape.hidden) != "bfloat16"):
        return 0.0
    return DECODE_COPIES * shape.params


def _max_new(cfg, name: str) -> int:
    return max((a.max_new_tokens for a in cfg.agents.values() if a.policy == name), default=256)


def _kv_per_row(cfg, name: str, shape: ModelShape) -> float:
    return 2 * shape.layers * shape.kv_dim * (PROMPT_TOKENS + _max_new(cfg, name)) * _BYTES[cfg.policies[name].dtype]


def apply_memory_defaults(cfg, memory: int | None = None) -> list[MemoryChoice]:
    """Set the choices of ``choose_memory_defaults`` on ``cfg`` (for this machine's memory unless given)."""
    if not cfg.trainer.memory_defaults:
        return []
    memory = machine_memory() if memory is None else memory
    choices = choose_memory_defaults(cfg, memory)
    for c in choices:
        *path, key = c.key.split(".")
        section = cfg
        for part in path:
            section = section[part] if isinstance(section, dict) else getattr(section, part)
        setattr(section, key, c.value)
    return choices


def format_memory_defaults(choices: list[MemoryChoice], memory: int) -> str:
    """One line: ``[masrl] memory defaults for M = 23.4 GiB: key value (why), ...``."""
    if not choices:
        return ""
    items = ", ".join(f"{c.key}={str(c.value).lower()} ({c.why})" for c in choices)
    return f"[masrl] memory defaults for M = {memory / 2**30:.1f} GiB (unset settings; set one to override): {items}"


def announce_memory_defaults(cfg) -> None:
    """``apply_memory_defaults`` for this machine, then its one line on stderr (``masrl train`` and ``masrl eval``,
    before they build a model)."""
    import sys

    memory = machine_memory()
    line = format_memory_defaults(apply_memory_defaults(cfg, memory), memory)
    if line:
        print(line, file=sys.stderr)
