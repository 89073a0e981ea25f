"""A policy: one trainable model with its tokenizer, optimizer and rollout engine.

``PolicyProtocol`` is what the trainer and checkpoints ask of any policy: the local ``Policy`` here,
and the Ray runtime's ``RayPolicy`` (its model in a worker group).
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Protocol, runtime_checkable

import torch

from masrl.config import PolicyConfig, RolloutConfig
from masrl.errors import ConfigError
from masrl.models.loading import load_model_and_tokenizer
from masrl.rollout.base import Engine
from masrl.rollout.factory import make_engine
from masrl.training.checkpoint import consolidated_state, restore_consolidated
from masrl.tools.chat_format import ChatPrompt, extend_chat_ids, extend_ids, render_chat
from masrl.workflows.base import Continuation


class PolicyText:
    """Prompt/response encoding shared by local policies and remote ones (Ray worker groups).

    Needs ``tokenizer``, ``adapter_of`` and ``max_positions``.
    """

    tokenizer: object
    adapter_of: dict
    cfg: PolicyConfig

    def adapter(self, agent: str) -> str | None:
        return self.adapter_of.get(agent)

    def render_prompt(self, prompt, system_prompt: str | None = None) -> str:
        """The prompt text: a string is one user message; a ``ChatPrompt`` (from ``team.chat``) is the
        agent's conversation with its tools. Both go through the tokenizer's chat template. A
        ``Continuation`` (``team.extend``) is the earlier turn's prompt text, its reply as generated (special
        tokens spelled out, the end-of-turn token included) and the new text."""
        if isinstance(prompt, Continuation):
            reply = self.tokenizer.decode(self._reply_ids(prompt.turn), skip_special_tokens=False,
                                          clean_up_tokenization_spaces=False)
            return prompt.turn.prompt_text + reply + prompt.text
        if isinstance(prompt, ChatPrompt):
            return render_chat(self.tokenizer, self._chat_messages(prompt, system_prompt), prompt.tools,
                               **self.cfg.chat_template_kwargs)
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + \
                   [{"role": "user", "content": prompt}]
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                  **self.cfg.chat_template_kwargs)

    @staticmethod
    def _chat_messages(prompt: ChatPrompt, system_prompt: str | None) -> list[dict]:
        messages = list(prompt.messages)
        if system_prompt and not (messages and messages[0].get("role") == "system"):
            return [{"role": "system", "content": system_prompt}] + messages
        return messages

    def encode_prompt(self, prompt, system_prompt: str | None = None) -> list[int]:
        """The prompt's token ids. A conversation's later turn extends the ids of its previous turn
        (prompt + the reply's ids as generated + the template's delta; see ``extend_chat_ids``)."""
        if isinstance(prompt, Continuation):
            self._check_plain_format(prompt.text, system_prompt)
            return extend_ids(self.tokenizer, prompt.turn.prompt_ids, self._reply_ids(prompt.turn), prompt.text)
        if isinstance(prompt, ChatPrompt) and prompt.prefix is not None:
            messages = self._chat_messages(prompt, system_prompt)
            shift = len(messages) - len(prompt.messages)  # the system message added here
            prefix = dataclasses.replace(prompt.prefix, n_messages=prompt.prefix.n_messages + shift)
            ids = extend_chat_ids(self.tokenizer, messages, prompt.tools, prefix, **self.cfg.chat_template_kwargs)
            if ids is not None:
                return ids
        return self.tokenizer(self.render_prompt(prompt, system_prompt), add_special_tokens=False)["input_ids"]

    def _reply_ids(self, turn) -> list[int]:
        """An earlier reply as continued: its ids as generated, closed by end-of-sequence when it was cut."""
        return list(turn.response_ids) + ([self.eos_token_id] if turn.truncated else [])

    def _check_plain_format(self, text: str, system_prompt: str | None) -> None:
        """A continuation appends plain text to earlier ids: the agent's string prompts must render as themselves."""
        if not system_prompt and self.render_prompt(text) == text:
            return
        why = "the agent has a system_prompt" if system_prompt else \
            f"the chat template of policy {getattr(self, 'name', '?')!r} wraps a string prompt in chat markers"
        raise ConfigError(f"a prompt that continues an earlier turn (team.extend; workflow.params.transcript: true) "
                          f"needs a plain-text prompt format, but {why}; use transcript: false (re-rendered "
                          "prompts) for instruct models, or drop the agent's system_prompt")

    def encode_response(self, text: str) -> list[int]:
        """Token ids of an assistant reply followed by the end-of-turn token (for SFT targets)."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.eos_token_id]

    @property
    def eos_token_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


@runtime_checkable
class PolicyProtocol(Protocol):
    """A policy as the trainer and checkpoints see it, local (``Policy``) or remote (``RayPolicy``).

    Checkpoints make these calls and ask nothing else (``masrl.training.checkpoint``): a consolidated
    checkpoint holds ``checkpoint_state`` and goes back through ``restore_state``; a sharded one
    (``sharded_checkpoint``: ``runtime.strategy: fsdp``) is written and read by every rank
    (``save_sharded``, ``load_sharded``).
    """

    name: str
    cfg: PolicyConfig
    tokenizer: Any
    engine: Engine
    agents: list[str]
    adapter_of: dict[str, str]

    @property
    def optimizer(self) -> Any:
        """The optimizer (remote: any non-None value), or None when the policy is frozen."""
        ...

    @property
    def max_positions(self) -> int: ...

    @property
    def sharded_checkpoint(self) -> bool:
        """Checkpoints are saved and loaded shard by shard by every rank (``save_sharded``)."""
        ...

    def checkpoint_state(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict]:
        """(weights, optimizer tensors, optimizer metadata): the consolidated format's contents."""
        ...

    def restore_state(self, weights: Mapping[str, torch.Tensor], opt_tensors: Mapping[str, torch.Tensor] | None,
                      opt_meta: dict | None, where: str) -> None:
        """Copy saved weights (and optimizer state: ``opt_tensors`` None: weights only) into the policy, then
        serve them from its rollout engine; a ``CheckpointError`` naming ``where`` when they do not fit."""
        ...

    def save_sharded(self, folder: str) -> dict:
        """Every rank writes its shards into ``folder``; returns the optimizer metadata."""
        ...

    def load_sharded(self, folder: str, optimizer_meta: dict | None, where: str) -> None:
        """Every rank reads its part of a sharded checkpoint (``optimizer_meta`` None: weights only)."""
        ...

    def adapter(self, agent: str) -> str | None: ...

    def encode_prompt(self, prompt, system_prompt: str | None = None) -> list[int]: ...

    def encode_response(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass
class Policy(PolicyText):
    name: str
    cfg: PolicyConfig
    model: torch.nn.Module
    tokenizer: object
    engine: Engine
    optimizer: torch.optim.Optimizer | None = None
    ref_model: torch.nn.Module | None = None
    agents: list[str] = field(default_factory=list)
    adapter_of: dict[str, str] = field(default_factory=dict)  # agent -> LoRA adapter (per-agent adapters)
    base_trained: bool = False  # SFT trained the base under the adapters: checkpoints keep it too
    compile_layers: bool | None = None  # trainer.compile resolved at the first update (None: not yet)

    @property
    def max_positions(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 4096))

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    # --- checkpoints (PolicyProtocol): always the consolidated format (a sharded model lives in a Ray worker
    # group, whose ranks save and load their shards: runtime.worker, masrl.training.fsdp)
    @property
    def sharded_checkpoint(self) -> bool:
        return False

    def checkpoint_state(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict]:
        return consolidated_state(self)

    def restore_state(self, weights: Mapping[str, torch.Tensor], opt_tensors: Mapping[str, torch.Tensor] | None,
                      opt_meta: dict | None, where: str) -> None:
        restore_consolidated(self, weights, opt_tensors, opt_meta, where)
        after_update(self)  # a separate rollout engine (vLLM) serves the restored weights

    def save_sharded(self, folder: str) -> dict:
        raise RuntimeError(f"policy {self.name!r} is a local policy: its checkpoints are consolidated "
                           "(checkpoint_state); sharded checkpoints are written by the ranks of a Ray worker group")

    def load_sharded(self, folder: str, optimizer_meta: dict | None, where: str) -> None:
        raise RuntimeError(f"policy {self.name!r} is a local policy: {where} is read by restore_state "
                           "(masrl.training.checkpoint consolidates a sharded checkpoint for it)")


def build_policy(name: str, cfg: PolicyConfig, *, seed: int, max_rollout_batch: int,
                 kl: bool = False, agents: list[str] | None = None, device: str = "cpu",
                 rollout: RolloutConfig | dict | None = None, workdir: str | Path | None = None,
                 autocast: str | None = None, agent_optim: Mapping[str, Mapping[str, Any]] | None = None) -> Policy:
    """A policy on ``device`` with its optimizer and rollout engine (``rollout.engine``: transformers or vllm;
    a model built in memory is written under ``workdir`` for vLLM to load; ``autocast``: the in-process
    engine decodes in that mixed precision, as ``trainer.autocast`` trains; ``agent_optim``: per-agent AdamW
    overrides for agents with their own LoRA adapter, see ``param_groups``)."""
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
    rollout = RolloutConfig.model_validate(rollout) if isinstance(rollout, dict) else rollout
    engine = make_engine(rollout, model, tokenizer, name=name, policy=cfg, seed=seed,
                         max_batch_size=max_rollout_batch, autocast=autocast, workdir=workdir)
    policy = Policy(name=name, cfg=cfg, model=model, tokenizer=tokenizer, engine=engine, agents=agents,
                    adapter_of=adapter_of)
    if cfg.trainable:
        policy.optimizer = make_optimizer(policy, agent_optim or {})
    if kl and cfg.lora is None:
        policy.ref_model = copy.deepcopy(model).eval().requires_grad_(False)
    return policy


def make_optimizer(policy: Policy, agent_optim: Mapping[str, Mapping[str, Any]]) -> torch.optim.Optimizer:
    """The policy's AdamW over ``param_groups`` (also used again on FSDP2's sharded parameters)."""
    o = policy.cfg.optim
    groups = param_groups(policy, agent_optim)
    fused = use_fused_adamw(o.fused, [p for g in groups for p in g["params"]])
    return torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas),
                             weight_decay=o.weight_decay, eps=o.eps, **({"fused": True} if fused else {}))


#: ``optim.fused: auto`` uses the fused kernel from this many trainable parameters (on CPU or CUDA)
FUSED_ADAMW_MIN_PARAMS = 10_000_000


def use_fused_adamw(setting: bool | str, params: list[torch.Tensor]) -> bool:
    """``optim.fused`` resolved: ``auto`` is the fused kernel when every parameter is a floating tensor on CPU
    or CUDA and there are at least ``FUSED_ADAMW_MIN_PARAMS`` of them (global sizes under FSDP2, so
    every rank decides alike); explicit ``true`` / ``false`` win."""
    if setting != "auto":
        return bool(setting)
    devices_ok = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
    return devices_ok and sum(p.numel() for p in params) >= FUSED_ADAMW_MIN_PARAMS


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


def before_update(policy: Policy, rollout: RolloutConfig | None) -> None:
    """A separate rollout engine (vLLM) releases its accelerator memory while the trainer updates, the in-process
    engine its decode-only weight copies under ``rollout.keep_decode_weights: false`` (neither with
    ``rollout.max_staleness``: it generates the next batches meanwhile)."""
    if rollout is not None and rollout.sleep_level and not rollout.max_staleness and policy.engine.can_sleep:
        policy.engine.sleep(rollout.sleep_level)
    # rollout.keep_decode_weights: false: the in-process engine's decode-only weight copies make room for the update
    # (not with rollout.max_staleness: it decodes meanwhile)
    if rollout is not None and not rollout.keep_decode_weights and not rollout.max_staleness:
        policy.engine.release_decode_weights()


def after_update(policy: Policy) -> None:
    """The rollout engine serves the new weights from now on (vLLM gets them in place, no reload from disk;
    the in-process engine drops the keys/values it kept for prefix reuse)."""
    policy.engine.weights_changed(policy.model, base_changed=policy.cfg.lora is None or policy.base_trained)
