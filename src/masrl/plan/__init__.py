"""``masrl plan``: the memory each policy needs per device, and whether the run fits.

Formulas (docs/scaling.md, "Memory plan"), per policy and per device, in bytes:
  weights   = P·b                      (b: bytes of the policy dtype; fsdp: /N + working set)
  grads     = P_t·b                    (P_t: trainable parameters: all, or the LoRA adapters)
  optimizer = 2·P_t·b                  (AdamW's two moments, in the parameter dtype)
  activations (one micro-batch of T = trainer.micro_batch_tokens tokens, a = activation bytes):
      without checkpointing: T·L·(8h + 2k + 3.5i)·a + L·attention + logits
      (LoRA, frozen base: -2h, -h without an adapter on gate/up, -i without one on down: layer_elements)
      with checkpointing:    T·L·h·a + T·(8h + 2k + 3.5i)·a + attention + logits
      attention = T·S·H·4 (the CPU math kernel keeps the probabilities; 0 for flash kernels on CUDA)
      logits    = 3·min(T_r, C)·V·4    (T_r: response tokens in the micro-batch; C =
                                        trainer.logprob_chunk_tokens, the head's tokens at a time; 0: T_r)
  kv cache  = 2·L·k·rows·S·b           (rows = min(max_rollout_batch, batch_size·group_size))
  vllm      = rollout.gpu_memory_utilization · device memory (a separate engine's pool)
  fsdp: persistent terms (weights, grads, optimizer) /N, plus the unsharded root and two layers
  (one computing, one prefetched) in the compute dtype.
Colocated policies with ``offload`` take turns: the device holds the larger of two phases,
  rollout = every colocated vLLM engine's pool (the trainers' state waits in CPU memory), and
  update  = one policy's weights + grads + optimizer + activations, plus the weights of the other
            policies' engines (asleep during updates with rollout.enable_sleep_mode, their weights
            back on the device once synced); without sleep mode their whole pools.
with h hidden size, k = kv heads·head dim, i intermediate size, L layers, V vocabulary,
H attention heads, S = prompt_tokens + the longest max_new_tokens of the policy's agents.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from masrl.argtypes import MAX_COUNT, MAX_TOKENS, shown
from masrl.errors import ConfigError
from masrl.models.precision import resolve_autocast
from masrl.plan.shapes import ModelShape, model_shape, read_model_config

GiB = 2 ** 30
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class PolicyPlan:
    name: str
    shape: ModelShape
    world: int
    strategy: str
    terms: dict[str, float] = field(default_factory=dict)  # bytes per device
    checkpointing: bool = False


def _lora_trainable(shape: ModelShape, lora, adapters: int) -> int:
    dims = {"q_proj": (shape.hidden, shape.heads * shape.head_dim),
            "k_proj": (shape.hidden, shape.kv_dim), "v_proj": (shape.hidden, shape.kv_dim),
            "o_proj": (shape.heads * shape.head_dim, shape.hidden),
            "gate_proj": (shape.hidden, shape.intermediate), "up_proj": (shape.hidden, shape.intermediate),
            "down_proj": (shape.intermediate, shape.hidden)}
    per_layer = sum(lora.r * (a + b) for name, (a, b) in dims.items() if name in lora.target_modules)
    return per_layer * shape.layers * adapters


def layer_elements(shape: ModelShape, lora_targets: list[str] | None = None) -> float:
    """Values one decoder layer keeps for backward per token: 8h + 2k + 3.5i when every weight trains. With
    a frozen base (LoRA; ``lora_targets``) autograd keeps a projection's input only for an adapter's
    gradient: the two norms' outputs go (-2h), the MLP input when neither gate nor up has an adapter (-h),
    the down projection's input when it has none (-i). Fitted to saved-tensor bytes measured on CPU
    (tests/test_plan.py): full -5%, LoRA on q/k/v/o -5%, on all seven -3%, on q/k/v/o + down -1%."""
    h, k, i = shape.hidden, shape.kv_dim, shape.intermediate
    elements = 8 * h + 2 * k + 3.5 * i
    if lora_targets is not None:
        targets = set(lora_targets)
        elements -= 2 * h + (h if not targets & {"gate_proj", "up_proj"} else 0) + \
            (i if "down_proj" not in targets else 0)
    return elements


def activation_bytes(shape: ModelShape, tokens: int, seq: int, response_tokens: int, act_bytes: int,
                     checkpointing: bool, attention_probs: bool = True,
                     lora_targets: list[str] | None = None, logit_chunk: int = 0) -> float:
    """Saved activations of one micro-batch's forward (what backward keeps), in bytes. ``logit_chunk``:
    ``trainer.logprob_chunk_tokens`` (the LM head runs on that many response tokens at a time; 0: all)."""
    per_token_layer = layer_elements(shape, lora_targets) * act_bytes
    attention = tokens * seq * shape.heads * 4 if attention_probs else 0
    logits = 3 * (min(response_tokens, logit_chunk) if logit_chunk else response_tokens) * shape.vocab * 4
    if checkpointing:
        return tokens * shape.layers * shape.hidden * act_bytes + tokens * per_token_layer + attention + logits
    return tokens * shape.layers * per_token_layer + shape.layers * attention + logits


def plan_policy(cfg, name: str, prompt_tokens: int = 512, cuda: bool = True,
                model_config: str | None = None) -> PolicyPlan:
    pcfg = cfg.policies[name]
    shape = model_shape(pcfg, model_config, policy=name)
    place = cfg.runtime.for_policy(name) if cfg.runtime.kind == "ray" else None
    world = place.workers if place is not None else 1
    fsdp = cfg.runtime.strategy == "fsdp"
    b = _BYTES[pcfg.dtype]
    agents = [a for a, acfg in cfg.agents.items() if acfg.policy == name]
    max_new = max((cfg.agents[a].max_new_tokens for a in agents), default=256)
    seq = prompt_tokens + max_new
    lora = pcfg.lora
    trainable = 0 if not pcfg.trainable else (
        _lora_trainable(shape, lora, len(agents) if lora.per_agent else 1) if lora else shape.params)
    shard = world if fsdp else 1
    terms = {"weights": (shape.params + (trainable if lora else 0)) * b / shard,
             "grads": trainable * b / shard, "optimizer": 2 * trainable * b / shard}
    if fsdp:
        compute = 2 if (cfg.runtime.fsdp.param_dtype == "auto" and cuda) else _BYTES.get(cfg.runtime.fsdp.param_dtype, b)
        terms["fsdp_unsharded"] = (shape.root_params + 2 * shape.layer_params) * compute
    # auto: bfloat16 on the (recent) GPUs planned for; on CPU as this machine's CPU resolves it
    precision = "bfloat16" if cfg.trainer.autocast == "auto" and cuda else resolve_autocast(cfg.trainer.autocast)
    act_b = _BYTES[precision] if precision else b
    tokens = cfg.trainer.micro_batch_tokens
    response_tokens = tokens * max_new // seq
    ckpt = bool(pcfg.gradient_checkpointing)
    if pcfg.trainable:
        targets = list(lora.target_modules) if lora else None
        chunk = cfg.trainer.logprob_chunk_tokens
        terms["activations"] = activation_bytes(shape, tokens, seq, response_tokens, act_b, ckpt, not cuda, targets,
                                                chunk)
        terms["activations_no_ckpt" if ckpt else "activations_ckpt"] = activation_bytes(
            shape, tokens, seq, response_tokens, act_b, not ckpt, not cuda, targets, chunk)
    rows = min(cfg.trainer.max_rollout_batch, cfg.trainer.batch_size * cfg.trainer.group_size)
    if cfg.rollout.engine == "vllm":
        terms["vllm"] = 0.0  # filled in by plan() (a fraction of the device)
    else:
        terms["kv_cache"] = 2 * shape.layers * shape.kv_dim * rows * seq * b / (1 if fsdp else world)
    plan = PolicyPlan(name, shape, world, cfg.runtime.strategy if cfg.runtime.kind == "ray" else "replica", terms)
    plan.checkpointing = ckpt
    return plan


def counted(plan: PolicyPlan) -> dict[str, float]:
    """The terms that add up to the policy's peak (the other activation variant is shown, not added)."""
    return {k: v for k, v in plan.terms.items() if k not in ("activations_ckpt", "activations_no_ckpt")}


def model_config_paths(cfg, given: Sequence[str]) -> dict[str, str]:
    """``--model-config [POLICY=]PATH`` items -> policy: path. Without ``POLICY=`` a path applies to every
    policy with a pretrained model (not ``tiny``); a later item for the same policy wins."""
    out: dict[str, str] = {}
    for item in given:
        policy, sep, path = item.partition("=")
        if sep and policy in cfg.policies:
            targets = [policy]
        elif sep and not Path(item).exists() and "/" not in policy:
            raise ConfigError(f"--model-config {shown(item)}: no policy {shown(policy)} in the config; give "
                              f"POLICY=PATH with one of {', '.join(cfg.policies)}, or a path alone")
        else:
            path, targets = item, [n for n, p in cfg.policies.items() if p.model != "tiny"]
        read_model_config(path)  # a path given is read even where no policy uses it: a typo is not ignored
        if not targets:
            raise ConfigError(f"--model-config {shown(item)}: every policy of the config is a tiny model; give "
                              "POLICY=PATH to plan one with that shape")
        out.update({n: path for n in targets})
    return out


def check_plan_inputs(cfg, prompt_tokens: int, device_gib: float) -> None:
    """Bounds on the numbers the plan multiplies (one error line naming the key), so that every figure is finite."""
    values = {"--prompt-tokens": (prompt_tokens, MAX_TOKENS), "--gpu-gib": (device_gib, 1e5),
              "trainer.micro_batch_tokens": (cfg.trainer.micro_batch_tokens, MAX_TOKENS),
              "trainer.max_rollout_batch": (cfg.trainer.max_rollout_batch, MAX_COUNT)}
    values.update({f"agents.{a}.max_new_tokens": (acfg.max_new_tokens, MAX_TOKENS) for a, acfg in cfg.agents.items()})
    for key, (value, high) in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= high:  # nan fails too
            raise ConfigError(f"masrl plan: {key} = {shown(value)} is out of range; give a number in 0..{high:,}")


def _turn_taking_peak(cfg, policies: dict[str, PolicyPlan], colocated: list[str]) -> dict[str, float]:
    """Per-device terms of the binding phase when colocated policies offload between phases."""
    rollout = {f"{n}/vllm": policies[n].terms["vllm"] for n in colocated if "vllm" in policies[n].terms}
    sleeps = cfg.rollout.enable_sleep_mode and cfg.rollout.sleep_level > 0
    phases = [rollout] if rollout else []
    for n in colocated:
        phase = {f"{n}/{k}": v for k, v in counted(policies[n]).items() if k != "vllm"}
        for other in colocated:
            if other != n and "vllm" in policies[other].terms:  # its engine: asleep (weights synced) or awake
                p = policies[other]
                phase[f"{other}/vllm_{'weights' if sleeps else 'awake'}"] = (
                    p.shape.params * _BYTES[cfg.policies[other].dtype] if sleeps else p.terms["vllm"])
        if "vllm" in policies[n].terms and not sleeps:
            phase[f"{n}/vllm"] = policies[n].terms["vllm"]
        phases.append(phase)
    return max(phases, key=lambda ph: sum(ph.values()))


def plan(cfg, devices: int | None = None, device_gib: float = 80.0, prompt_tokens: int = 512,
         model_configs: Sequence[str] = ()) -> dict:
    """Per policy its terms, per device the sum under the placement, and the verdict."""
    check_plan_inputs(cfg, prompt_tokens, device_gib)
    shapes = model_config_paths(cfg, model_configs)
    policies = {n: plan_policy(cfg, n, prompt_tokens, cuda=cfg.trainer.device != "cpu" or
                               cfg.runtime.gpus_per_worker > 0, model_config=shapes.get(n)) for n in cfg.policies}
    for p in policies.values():
        if "vllm" in p.terms:
            p.terms["vllm"] = cfg.rollout.gpu_memory_utilization * device_gib * GiB
    colocated = [n for n in policies if cfg.runtime.kind != "ray" or
                 cfg.runtime.for_policy(n).placement == "colocated"]
    dedicated = [n for n in policies if n not in colocated]
    if devices is None:
        devices = max([cfg.runtime.for_policy(n).workers for n in colocated] or [0]) + \
            sum(cfg.runtime.for_policy(n).workers for n in dedicated) if cfg.runtime.kind == "ray" else 1
    per_device: dict[str, float] = {}
    offload = cfg.runtime.kind == "ray" and cfg.runtime.offload and len(colocated) > 1
    for n in colocated:  # sharing devices: persistent state adds up unless idle policies are offloaded
        for key, value in counted(policies[n]).items():
            label = f"{n}/{key}"
            per_device[label] = value
    if offload:  # colocated policies take turns: the larger of the rollout and the update phases
        per_device = _turn_taking_peak(cfg, policies, colocated)
    need = sum(per_device.values())
    for n in dedicated:
        need = max(need, sum(counted(policies[n]).values()))
    largest = max(per_device.items(), key=lambda kv: kv[1]) if per_device else ("-", 0.0)
    fits = need <= device_gib * GiB
    return {"policies": policies, "per_device": per_device, "need": need, "devices": devices,
            "device_gib": device_gib, "fits": fits, "largest": largest}


def format_plan(report: dict) -> str:
    lines = []
    for p in report["policies"].values():
        s = p.shape
        lines.append(f"policy {p.name}: {s.name} {s.params / 1e9:.3g}B params, {p.strategy} over {p.world} "
                     f"rank(s){', gradient checkpointing' if p.checkpointing else ''}")
        for key, value in p.terms.items():
            note = " (not counted)" if key in ("activations_ckpt", "activations_no_ckpt") else ""
            lines.append(f"  {key:<22}{value / GiB:10.2f} GiB{note}")
    verdict = "fits" if report["fits"] else "does not fit"
    name, value = report["largest"]
    lines.append(f"per device: {report['need'] / GiB:.2f} GiB -> {verdict} on {report['devices']} x "
                 f"{report['device_gib']:g} GiB (largest term: {name} {value / GiB:.2f} GiB)")
    return "\n".join(lines)
