"""The local runtime: every policy in this process (the default)."""
from __future__ import annotations

from typing import Callable, Mapping, Sequence

from masrl.errors import EngineLost
from masrl.rollout.versioned import versioned
from masrl.runtime.malloc import cap_primitive_caches
from masrl.training.policy import Policy, after_update, before_update, build_policy
from masrl.training.sft import run_sft
from masrl.training.update import Row, update_policy


class WorkerGroupError(EngineLost):
    """A policy's worker failed; the message names the policy, the worker and the step. Its peers may be blocked in
    a collective, so the group serves nothing more: during a rollout this stops the rollout, not one batch."""


def policy_build_args(cfg, run_dir) -> dict[str, dict]:
    """Per policy: the keyword arguments of ``build_policy`` (shared by both runtimes). Plain data except
    ``rollout``, the config's ``RolloutConfig`` itself (the Ray runtime sends its JSON dump to the workers)."""
    kl = cfg.algorithm.loss.kl_coef > 0 or cfg.monitoring.kl_to_base
    return {name: dict(seed=cfg.seed, max_rollout_batch=cfg.trainer.max_rollout_batch, kl=kl,
                       agents=[a for a, acfg in cfg.agents.items() if acfg.policy == name],
                       device=cfg.trainer.device, rollout=cfg.rollout,
                       workdir=str(run_dir / "vllm"), autocast=cfg.trainer.autocast,
                       agent_optim={a: acfg.optim.model_dump(exclude_none=True) for a, acfg in cfg.agents.items()
                                    if acfg.policy == name and acfg.optim is not None})
            for name in cfg.policies}


def base_trained(cfg, name: str) -> bool:
    """SFT trains the base under LoRA adapters (sft.train_base): checkpoints then keep the base too."""
    pcfg = cfg.policies[name]
    return bool(cfg.sft.train_base and cfg.sft.steps and pcfg.lora is not None)


class LocalRuntime:
    kind = "local"

    def __init__(self, cfg, run_dir=None):
        self.cfg, self.run_dir = cfg, run_dir if run_dir is not None else cfg.run_dir
        self.step = 0

    def build_policies(self) -> dict[str, Policy]:
        if self.cfg.trainer.primitive_cache:  # before any model is built or run (masrl.runtime.malloc)
            cap_primitive_caches(self.cfg.trainer.primitive_cache)
        policies = {}
        for name, kwargs in policy_build_args(self.cfg, self.run_dir).items():
            policies[name] = build_policy(name, self.cfg.policies[name], **kwargs)
            policies[name].base_trained = base_trained(self.cfg, name)
        return policies

    def update(self, policies: Mapping[str, Policy], rows: Mapping[str, Sequence[Row]], *, step: int,
               guard=None, track_kl: bool = False) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for name, prows in rows.items():
            before_update(policies[name], self.cfg.rollout)
            metrics.update(update_policy(policies[name], prows, self.cfg.algorithm, self.cfg.trainer, step=step,
                                         seed=self.cfg.seed, guard=guard, track_kl=track_kl))
            after_update(policies[name])
        return metrics

    def sft(self, policies: Mapping[str, Policy], rows: Sequence[Row],
            on_step: Callable[[int, dict], None] | None = None) -> dict[str, float]:
        last = run_sft(policies, rows, self.cfg.sft, seed=self.cfg.seed,
                       micro_batch_tokens=self.cfg.trainer.micro_batch_tokens, on_step=on_step,
                       logprob_chunk_tokens=self.cfg.trainer.logprob_chunk_tokens, autocast=self.cfg.trainer.autocast)
        for policy in policies.values():
            after_update(policy)
        return last

    def phase_end(self) -> None:
        """Between rollout and training (colocated offload in the Ray runtime)."""

    def version_rollouts(self, policies: Mapping[str, Policy]) -> None:
        """``rollout.max_staleness``: each policy's engine behind a version counter, on weights of its own
        (``masrl.rollout.versioned``)."""
        for policy in policies.values():
            policy.engine = versioned(policy.engine, policy.model)

    def spike_state(self, driver_state: dict) -> dict:
        return driver_state

    def load_spike_state(self, state: dict) -> None:
        pass

    def close(self) -> None:
        pass
