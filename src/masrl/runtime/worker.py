"""One rank of a policy's worker group: a full replica that generates and trains.

A plain class (no Ray import): ``masrl.runtime.ray_runtime`` wraps it with ``ray.remote``.
Everything that crosses the process boundary is plain data — lists, dicts, numbers and
tensors — never pickled instances of masrl classes: requests and rows are dicts, configs are
their JSON dumps, checkpoints are name→tensor maps.
"""
from __future__ import annotations

import dataclasses
import hashlib
import socket
from typing import Any

import torch

from masrl.config import AlgorithmConfig, PolicyConfig, RolloutConfig, SFTConfig, TrainerConfig
from masrl.monitoring.spike import SpikeDetector
from masrl.runtime import malloc
from masrl.rollout.base import GenRequest
from masrl.rollout.versioned import versioned
from masrl.training.distributed import DataParallel, init_process_group
from masrl.training.policy import after_update, before_update, build_policy
from masrl.training.sft import run_sft
from masrl.training.update import Row, update_policy_raw


def _move_optimizer_state(opt: torch.optim.Optimizer, device: str | torch.device) -> None:
    for state in opt.state.values():
        for key, value in state.items():
            if torch.is_tensor(value) and key != "step":
                state[key] = value.to(device, non_blocking=True)


class PolicyWorker:
    def __init__(self, name: str, policy_cfg: dict, build: dict, *, rank: int, world: int, threads: int,
                 device: str, base_trained: bool, spike: dict, offload: bool, fsdp: dict | None = None,
                 tune_malloc: bool | str = True, primitive_cache: int | None = None):
        torch.set_num_threads(max(1, threads))
        if tune_malloc:  # before the model is built (masrl.runtime.malloc)
            malloc.tune_malloc("lean" if tune_malloc == "lean" else "fast")
        if primitive_cache:
            malloc.cap_primitive_caches(primitive_cache)
        torch.manual_seed(build["seed"])
        self.name, self.rank, self.world = name, rank, world
        self.rollout = RolloutConfig.model_validate(build["rollout"])
        self.policy = build_policy(name, PolicyConfig.model_validate(policy_cfg), **{**build, "rollout": self.rollout})
        self.policy.base_trained = base_trained
        self.device = torch.device(device)
        self.fsdp = fsdp  # runtime.fsdp when runtime.strategy = fsdp (sharded at join_group)
        self.agent_optim = build.get("agent_optim") or {}  # per-agent param groups, rebuilt on the shards
        self.offload_enabled = offload and self.device.type != "cpu" and fsdp is None  # fsdp: cpu_offload
        self.on_device = False
        self.onload()
        self.dp = DataParallel(rank, world)
        self.spikes = SpikeDetector(**spike)

    # -------------------------------------------------------------- group
    def rendezvous(self) -> tuple[str, int]:
        """(address, free port) of this worker's node, for rank 0 to host the process group."""
        host = socket.gethostbyname(socket.gethostname())
        with socket.socket() as s:
            s.bind(("", 0))
            return host, s.getsockname()[1]

    def join_group(self, address: str, port: int, backend: str) -> None:
        self.dp = init_process_group(self.rank, self.world, address, port, backend)
        self.dp.broadcast_parameters(self.policy.model)
        if self.fsdp is not None:
            from masrl.training.fsdp import FSDPOptions, ShardedDataParallel, shard_policy

            shard_policy(self.policy, FSDPOptions(**self.fsdp), self.device, backend, self.agent_optim)
            self.dp = ShardedDataParallel(self.rank, self.world)

    def info(self) -> dict[str, Any]:
        return {"max_positions": self.policy.max_positions, "adapter_of": dict(self.policy.adapter_of),
                "parameters": sum(p.numel() for p in self.policy.model.parameters())}

    # -------------------------------------------------------------- placement
    def onload(self) -> None:
        if self.on_device:
            return
        self.policy.model.to(self.device)
        if self.policy.ref_model is not None:
            self.policy.ref_model.to(self.device)
        if self.policy.optimizer is not None:
            _move_optimizer_state(self.policy.optimizer, self.device)
        self.on_device = True

    def end_rollout(self) -> None:
        """The rollout phase is over: weights and optimizer state to CPU, and a vLLM engine with sleep mode
        sleeps, so that no colocated engine holds its pool while another policy updates (``masrl plan``
        counts on it; after this policy's own update the synced weights are back on the device)."""
        if self.offload_enabled:
            before_update(self.policy, self.rollout)
        self.offload()

    def offload(self) -> None:
        """Weights and optimizer state to CPU (colocated policies take turns on the devices)."""
        if not self.offload_enabled or not self.on_device:
            return
        # kept keys/values would hold device memory (and belong to the old weights)
        self.policy.engine.clear_prefix_cache()
        self.policy.model.to("cpu")
        if self.policy.ref_model is not None:
            self.policy.ref_model.to("cpu")
        if self.policy.optimizer is not None:
            _move_optimizer_state(self.policy.optimizer, "cpu")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.on_device = False

    # -------------------------------------------------------------- rollout
    def reseed(self, seed: int) -> None:
        self.policy.engine.reseed(seed)

    def version_rollouts(self) -> None:
        """``rollout.max_staleness``: the engine behind a version counter, on weights of its own; it generates
        (in one of the actor's threads) while ``update`` runs in another (``masrl.rollout.versioned``)."""
        self.policy.engine = versioned(self.policy.engine, self.policy.model)

    def rollout_version(self) -> int:
        """The version of the weights the engine samples with (one per update since ``version_rollouts``)."""
        return self.policy.engine.version

    def generate(self, requests: list[dict]) -> list[dict]:
        if self.policy.engine.shares_training_model:  # it decodes with the training model
            self.onload()
        results = self.policy.engine.generate([GenRequest(**r) for r in requests])
        return [dataclasses.asdict(r) for r in results]

    # -------------------------------------------------------------- training
    def update(self, rows: list[dict], algo: dict, trainer: dict, step: int, seed: int,
               track_kl: bool) -> tuple[dict[str, list[float]], float]:
        """(per-micro-batch metric values, the optimizer's learning rate)."""
        self.onload()
        before_update(self.policy, self.rollout)
        raw = update_policy_raw(self.policy, [Row(**r) for r in rows], AlgorithmConfig.model_validate(algo),
                                TrainerConfig.model_validate(trainer), step=step, seed=seed,
                                guard=self.spikes.guard, track_kl=track_kl, dp=self.dp)
        after_update(self.policy)
        return raw, float(self.policy.optimizer.param_groups[0]["lr"])

    def sft(self, rows: list[dict], sft: dict, seed: int, micro_batch_tokens: int,
            logprob_chunk_tokens: int = 0, autocast: str | None = None) -> list[dict[str, float]]:
        self.onload()
        steps: list[dict[str, float]] = []
        run_sft({self.name: self.policy}, [Row(**r) for r in rows], SFTConfig.model_validate(sft), seed=seed,
                micro_batch_tokens=micro_batch_tokens, on_step=lambda step, m: steps.append(dict(m)), dp=self.dp,
                logprob_chunk_tokens=logprob_chunk_tokens, autocast=autocast)
        after_update(self.policy)
        return steps

    # -------------------------------------------------------------- state
    def checkpoint_state(self):
        """Full weights and optimizer state (replica strategy; fsdp saves shards: ``save_sharded``)."""
        weights, tensors, meta = self.policy.checkpoint_state()
        return {k: v.cpu() for k, v in weights.items()}, {k: v.cpu() for k, v in tensors.items()}, meta

    def save_sharded(self, folder: str) -> dict:
        """fsdp: this rank's shards into ``folder`` (DCP; every rank must call); the optimizer metadata."""
        from masrl.training.fsdp import save_sharded

        return save_sharded(self.policy, folder)

    def load_sharded(self, folder: str, optimizer_meta: dict | None, where: str) -> None:
        """fsdp: this rank's part of a sharded checkpoint saved at any number of ranks (every rank must call)."""
        from masrl.training.fsdp import load_sharded

        load_sharded(self.policy, folder, optimizer_meta, where)
        after_update(self.policy)

    def restore_state(self, weights, opt_tensors, opt_meta, where: str) -> None:
        if self.fsdp is not None:
            from masrl.training.fsdp import restore_sharded

            restore_sharded(self.policy, weights, opt_tensors, opt_meta, where)
            after_update(self.policy)
            return
        self.policy.restore_state(weights, opt_tensors, opt_meta, where)
        self.on_device = False
        self.onload()

    def spike_state(self) -> dict:
        return self.spikes.state_dict()

    def load_spike_state(self, state: dict) -> None:
        self.spikes.load_state_dict(state)

    def parameter_digest(self) -> str:
        """sha256 of every parameter's bytes: equal digests = bitwise-identical replicas."""
        h = hashlib.sha256()
        for n, p in sorted(self.policy.model.named_parameters()):
            h.update(n.encode())
            h.update(p.detach().cpu().contiguous().numpy().tobytes())
        return h.hexdigest()

    def parameters(self) -> dict[str, torch.Tensor]:
        """Whole parameters on CPU (fsdp: gathered, so every rank must call)."""
        from masrl.training.fsdp import full_cpu

        return {n: full_cpu(p) for n, p in self.policy.model.named_parameters()}

    def memory_bytes(self) -> dict[str, int]:
        """This rank's bytes of parameters, gradients and optimizer state (fsdp: its shards)."""
        from masrl.training.fsdp import local_bytes

        return local_bytes(self.policy)
