"""A policy: one trainable model with its tokenizer, optimizer and rollout engine."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch

from masrl.config import PolicyConfig, RolloutConfig
from masrl.errors import ConfigError
from masrl.models.loading import load_model_and_tokenizer
from masrl.rollout.engine import TransformersEngine


class PolicyText:
    """Prompt/response encoding shared by local policies and remote ones (Ray worker groups).

    Needs ``tokenizer``, ``adapter_of`` and ``max_positions``.
    """

    tokenizer: object
    adapter_of: dict
    cfg: PolicyConfig

    def adapter(self, agent: str) -> str | None:
        return self.adapter_of.get(agent)

    def encode_prompt(self, text: str, system_prompt: str | None = None) -> list[int]:
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + \
                   [{"role": "user", "content": text}]
        rendered = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                      **self.cfg.chat_template_kwargs)
        return self.tokenizer(rendered, add_special_tokens=False)["input_ids"]

    def encode_response(self, text: str) -> list[int]:
        """Token ids of an assistant reply followed by the end-of-turn token (for SFT targets)."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.eos_token_id]

    @property
    def eos_token_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


@dataclass
class Policy(PolicyText):
    name: str
    cfg: PolicyConfig
    model: torch.nn.Module
    tokenizer: object
    engine: TransformersEngine
    optimizer: torch.optim.Optimizer | None = None
    ref_model: torch.nn.Module | None = None
    agents: list[str] = field(default_factory=list)
    adapter_of: dict[str, str] = field(default_factory=dict)  # agent -> LoRA adapter (per-agent adapters)
    base_trained: bool = False  # SFT trained the base under the adapters: checkpoints keep it too

    @property
    def max_positions(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 4096))

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]


def build_policy(name: str, cfg: PolicyConfig, *, seed: int, max_rollout_batch: int,
                 kl: bool = False, agents: list[str] | None = None, device: str = "cpu",
                 rollout: RolloutConfig | dict | None = None, workdir: str | Path | None = None,
                 autocast: str | None = None, agent_optim: Mapping[str, Mapping[str, Any]] | None = None) -> Policy:
    """A policy on ``device`` with its optimizer and rollout engine (``rollout.engine``: transformers or vllm;
    a model built in memory is written under ``workdir`` for vLLM to load; ``autocast``: the in-process
    engine decodes in that mixed precision, as ``trainer.autocast`` trains; ``agent_optim``: per-agent AdamW
    overrides for agents with their own LoRA adapter, see :func:`param_groups`)."""
    model, tokenizer = load_model_and_tokenizer(cfg, seed=seed)
    if cfg.gradient_checkpointing:
        enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.x name
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.to(device)
    agents = list(agents or [])
    adapter_of: dict[str, str] = {}
    if cfg.lora is not None:
        from masrl.models.lora import attach_adapters

        names = agents if cfg.lora.per_agent else [name]
        model = attach_adapters(model, names, r=cfg.lora.r, alpha=cfg.lora.alpha, dropout=cfg.lora.dropout,
                                target_modules=cfg.lora.target_modules)
        if cfg.lora.init_from:
            from masrl.models.lora import load_adapter_folders

            load_adapter_folders(model, cfg.lora.init_from)
        if cfg.lora.per_agent:
            adapter_of = {a: a for a in agents}
    if not cfg.trainable:
        for p in model.parameters():
            p.requires_grad_(False)
    eos_ids = {int(tokenizer.eos_token_id)}
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(gen_eos, int):
        eos_ids.add(gen_eos)
    elif isinstance(gen_eos, (list, tuple)):
        eos_ids.update(int(e) for e in gen_eos)
    rollout = RolloutConfig.model_validate(rollout) if isinstance(rollout, dict) else rollout
    if rollout is not None and rollout.engine == "vllm":
        engine = _vllm_engine(name, cfg, rollout, model, tokenizer, sorted(eos_ids), seed, workdir)
    else:
        prefix = {} if rollout is None else {"prefix_cache": rollout.prefix_cache,
                                             "prefix_cache_mib": rollout.prefix_cache_mib}
        engine = TransformersEngine(model, eos_token_ids=sorted(eos_ids), pad_token_id=int(tokenizer.pad_token_id),
                                    max_batch_size=max_rollout_batch, seed=seed, autocast=autocast, **prefix)
    policy = Policy(name=name, cfg=cfg, model=model, tokenizer=tokenizer, engine=engine, agents=agents,
                    adapter_of=adapter_of)
    if cfg.trainable:
        o = cfg.optim
        policy.optimizer = torch.optim.AdamW(param_groups(policy, agent_optim or {}), lr=o.lr, betas=tuple(o.betas),
                                             weight_decay=o.weight_decay, eps=o.eps,
                                             **({"fused": True} if o.fused else {}))
    if kl and cfg.lora is None:
        policy.ref_model = copy.deepcopy(model).eval().requires_grad_(False)
    return policy


def param_groups(policy: Policy, agent_optim: Mapping[str, Mapping[str, Any]]) -> list[dict]:
    """AdamW parameter groups: every trainable parameter under the policy's ``optim`` (first), except the
    LoRA adapters of agents with ``agents.<A>.optim`` overrides, which get one group each."""
    own: dict[str, list] = {}
    if agent_optim:
        from masrl.models.lora import adapter_parameters

        own = {a: [p for p in adapter_parameters(policy.model, policy.adapter_of[a]) if p.requires_grad]
               for a in agent_optim}
    taken = {id(p) for ps in own.values() for p in ps}
    rest = [p for p in policy.trainable_parameters() if id(p) not in taken]
    groups = [{"params": rest, "name": "policy"}] if rest or not own else []
    for agent, overrides in agent_optim.items():
        groups.append({"params": own[agent], "name": f"agent/{agent}",
                       **{k: (tuple(v) if k == "betas" else v) for k, v in overrides.items()}})
    return groups


def _vllm_engine(name: str, cfg: PolicyConfig, rollout: RolloutConfig, model, tokenizer, eos_ids: list[int],
                 seed: int, workdir: str | Path | None):
    from masrl.rollout.vllm_engine import VLLMEngine, save_for_vllm

    if cfg.model == "tiny":  # built in memory: vLLM loads it from a folder
        if workdir is None:
            raise ConfigError(f"policy {name}: a tiny model with rollout.engine=vllm needs a work folder")
        source = save_for_vllm(model, tokenizer, Path(workdir) / name)
    else:
        from masrl.models.hub import resolve_model_source

        source = resolve_model_source(cfg.model)
    lora = cfg.lora
    rank = next((r for r in (8, 16, 32, 64, 128, 256, 512) if lora is not None and r >= lora.r), 16)
    engine = VLLMEngine(source, dtype=rollout.dtype or cfg.dtype, gpu_memory_utilization=rollout.gpu_memory_utilization,
                        enable_sleep_mode=rollout.enable_sleep_mode and rollout.sleep_level > 0,
                        eos_token_ids=eos_ids, seed=seed, max_model_len=rollout.max_model_len,
                        enable_lora=lora is not None, max_loras=rollout.max_loras, max_lora_rank=rank,
                        enforce_eager=rollout.enforce_eager, tokenizer=str(Path(workdir) / name) if cfg.model == "tiny"
                        else (cfg.tokenizer and str(cfg.tokenizer)), trust_remote_code=cfg.trust_remote_code,
                        **rollout.kwargs)
    if lora is not None:
        engine.sync_adapters(model)
        if not lora.per_agent:
            engine.default_adapter = name
    return engine


def before_update(policy: Policy, rollout: RolloutConfig | None) -> None:
    """A separate rollout engine (vLLM) releases its GPU memory while the trainer updates."""
    engine = policy.engine
    if rollout is not None and rollout.sleep_level and getattr(engine, "enable_sleep_mode", False):
        engine.sleep(rollout.sleep_level)


def after_update(policy: Policy) -> None:
    """A separate rollout engine (vLLM) gets the new weights in place (no reload from disk); the
    in-process engine drops the keys/values it kept for prefix reuse."""
    engine = policy.engine
    clear = getattr(engine, "clear_prefix_cache", None)
    if clear is not None:
        clear()
    if not hasattr(engine, "sync_weights"):
        return  # TransformersEngine shares the trainer's model
    from masrl.rollout.vllm_engine import hf_named_tensors

    if policy.cfg.lora is None or policy.base_trained or getattr(engine, "weights_stale", False):
        engine.sync_weights(hf_named_tensors(policy.model))
    if policy.cfg.lora is not None:
        engine.sync_adapters(policy.model)
