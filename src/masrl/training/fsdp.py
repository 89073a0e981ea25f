"""The ``fsdp`` strategy: a policy's ranks shard its model with PyTorch FSDP2 (``fully_shard``).

Every decoder layer is its own FSDP unit and the root holds the rest (embeddings, final norm,
LM head), so a forward or backward unshards one layer at a time: no rank ever holds the whole
model (rollout included: the in-process engine decodes through the same sharded module).
Parameters, gradients and AdamW state live as ``DTensor`` shards (dim 0 split over the ranks).

Arithmetic is the replica strategy's (masrl.training.distributed): every rank trains on its
round-robin share of each minibatch with losses normalised by the whole minibatch's counts,
and FSDP2 reduce-scatters gradients as a SUM (divide factor 1), so the sharded gradient is a
shard of exactly the single-process gradient. FSDP2 runs collectives inside every forward and
backward, so ranks must make the same number of calls: a rank with fewer micro-batches runs
zero-weight padding ones (``ShardedDataParallel.pad_chunks``). Norms are exact: local
squared norms of the shards, all-reduced (``sharded_norm``).
"""
from __future__ import annotations

import datetime
import math
import socket
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping, Sequence

import torch

from masrl.training.distributed import DataParallel


@dataclass
class FSDPOptions:
    """``runtime.fsdp`` as plain data (it crosses into Ray workers)."""

    param_dtype: str = "auto"     # compute dtype of unsharded params: auto = bfloat16 on CUDA, float32 on CPU
    reduce_dtype: str = "float32"  # gradient reduce-scatter dtype (master weights stay float32)
    cpu_offload: bool = False      # CPUOffloadPolicy: shards, grads and optimizer state in CPU memory

    def mixed_precision(self, device_type: str):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        name = self.param_dtype
        if name == "auto":
            name = "bfloat16" if device_type == "cuda" else "float32"
        return MixedPrecisionPolicy(param_dtype=getattr(torch, name), reduce_dtype=getattr(torch, self.reduce_dtype))


class ShardedDataParallel(DataParallel):
    """A ``DataParallel`` whose gradients FSDP2 already reduced (and sharded) in backward."""

    sharded = True

    def all_reduce_(self, tensors: Sequence[torch.Tensor]) -> None:
        """Nothing to do: FSDP2 reduce-scattered every gradient (SUM) in backward."""

    def pad_chunks(self, chunks: list[list[Any]], unit: Sequence[Any]) -> list[tuple[list[Any], bool]]:
        """``chunks`` plus zero-weight padding chunks up to the most any rank has: (chunk, is_padding)."""
        out = [(c, False) for c in chunks]
        if self.world == 1:
            return out
        import torch.distributed as dist

        most = torch.tensor([len(chunks)])
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        filler = [chunks[0][0]] if chunks else [unit[0]] if unit else []
        if not filler and int(most):
            raise RuntimeError("fsdp: a rank must run a forward but its unit has no rows")
        return out + [(list(filler), True)] * (int(most) - len(chunks))


def is_sharded(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def sharded_norm(tensors: Sequence[torch.Tensor]) -> float:
    """Exact L2 norm over DTensor shards: local squared sums all-reduced (float64 accumulation)."""
    import torch.distributed as dist

    local = torch.zeros((), dtype=torch.float64)
    for t in tensors:
        part = t.to_local() if is_sharded(t) else t
        local += part.detach().double().pow(2).sum().cpu()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(local, op=dist.ReduceOp.SUM)
    return math.sqrt(float(local))


def clip_sharded_(params: Sequence[torch.nn.Parameter], max_norm: float) -> float:
    """``torch.nn.utils.clip_grad_norm_`` on sharded gradients (same formula); returns the norm."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = sharded_norm(grads)
    coef = min(max_norm / (norm + 1e-6), 1.0)
    for g in grads:
        g.mul_(coef)
    return norm


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of a HF causal LM (its ``_no_split_modules`` classes), PEFT-wrapped or not."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"fsdp: cannot find the decoder layers of {type(base).__name__} "
                         "(its _no_split_modules is empty); use runtime.strategy=replica for this model")
    return layers


def ensure_process_group(world: int, backend: str = "gloo") -> None:
    """A one-rank process group when none exists (FSDP2 with one rank, e.g. the local runtime)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if world != 1:
        raise RuntimeError(f"fsdp: {world} ranks need a process group (the Ray runtime starts one)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=600))


def shard_module(model: torch.nn.Module, options: FSDPOptions, device: torch.device) -> torch.nn.Module:
    """``fully_shard`` every decoder layer, then the root; gradients reduced as a SUM."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    kwargs: dict[str, Any] = {"mesh": mesh, "mp_policy": options.mixed_precision(device.type)}
    if options.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    layers = decoder_layers(model)
    for layer in layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    for unit in [model, *layers]:
        unit.set_gradient_divide_factor(1.0)  # SUM: losses are normalised by the global counts
        unit.set_force_sum_reduction_for_comms(True)  # plain SUM collectives (gloo has no PREMUL_SUM)
    return model


def shard_policy(policy, options: FSDPOptions, device: torch.device, backend: str = "gloo",
                 agent_optim: Mapping[str, Mapping[str, Any]] | None = None) -> None:
    """Shard ``policy.model`` (and its KL reference) in place and rebuild the optimizer on the shards, with
    the same parameter groups as the replica's (``agent_optim``: per-agent adapter groups)."""
    import torch.distributed as dist

    from masrl.training.policy import make_optimizer

    ensure_process_group(1 if not dist.is_initialized() else dist.get_world_size(), backend)
    policy.model.to(device)
    shard_module(policy.model, options, device)
    policy.engine.model_sharded()  # the in-process engine decodes through the sharded module
    if policy.ref_model is not None:
        policy.ref_model.to(device)
        shard_module(policy.ref_model, options, device)
    if policy.optimizer is not None:  # fully_shard replaced the parameters by DTensor ones
        policy.optimizer = make_optimizer(policy, agent_optim or {})


def gather_full(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, whole tensor)`` for each ``(name, tensor)`` of a sharded model, gathered one at a time.

    For an engine that needs full weights (vLLM's ``load_weights``):
    ``engine.sync_weights(gather_full(hf_named_tensors(policy.model)))``. Each DTensor shard is all-gathered
    (``full_tensor``) only when the consumer asks for it and the helper keeps no reference, so the extra
    memory is one tensor (at most a layer's largest weight), never the whole model; tensors are yielded in
    the model's order, so unit by unit. Every rank must iterate to the end in the same order (each gather
    is a collective), even if only rank 0 uses the tensors. One all-gather per tensor rather than one per
    FSDP unit (``unshard()``): more, smaller collectives for a lower peak."""
    for name, tensor in named:
        yield name, (tensor.full_tensor() if is_sharded(tensor) else tensor)


def local_bytes(policy) -> dict[str, int]:
    """This rank's bytes of parameters, gradients and optimizer state (shards only)."""
    def nbytes(t: torch.Tensor) -> int:
        local = t.to_local() if is_sharded(t) else t
        return local.numel() * local.element_size()

    params = sum(nbytes(p) for p in policy.model.parameters())
    grads = sum(nbytes(p.grad) for p in policy.model.parameters() if p.grad is not None)
    opt = 0
    if policy.optimizer is not None:
        for state in policy.optimizer.state.values():
            opt += sum(nbytes(v) for k, v in state.items() if torch.is_tensor(v) and k != "step")
    return {"params": params, "grads": grads, "optimizer": opt, "total": params + grads + opt}


def full_cpu(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on CPU (an all-gather of one tensor when sharded: every rank must call)."""
    return (t.full_tensor() if is_sharded(t) else t).detach().cpu().contiguous().clone()


def save_sharded(policy, folder: str) -> dict:
    """Save the policy's weights and optimizer state with ``torch.distributed.checkpoint`` into ``folder``:
    every rank writes its own shards (no rank gathers a whole tensor); every rank must call. Returns the
    optimizer metadata for ``optimizer.json`` (param groups with parameters by name; which state entries
    are tensors). Format: masrl.training.checkpoint's module docstring."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    from masrl.training.checkpoint import dcp_model_key, dcp_optim_key, saved_parameter_names

    names = saved_parameter_names(policy)
    flat = {dcp_model_key(n): t for n, t in get_model_state_dict(policy.model).items() if n in names}
    meta: dict[str, Any] = {"param_groups": [], "state": {}}
    # an optimizer that has not stepped yet saves no state: get_optimizer_state_dict would initialise it
    # (a zero-lr step), and the next real step would then differ from an uninterrupted run's
    if policy.optimizer is not None and policy.optimizer.state:
        osd = get_optimizer_state_dict(policy.model, policy.optimizer)
        meta["param_groups"] = osd["param_groups"]
        for param, entries in osd["state"].items():
            meta["state"][param] = {k: ("tensor" if torch.is_tensor(v) else v) for k, v in entries.items()}
            flat.update({dcp_optim_key(param, k): v for k, v in entries.items() if torch.is_tensor(v)})
    dcp.save(flat, storage_writer=HuggingFaceStorageWriter(folder, save_distributed=True))
    return meta


def load_sharded(policy, folder: str, optimizer_meta: dict | None, where: str) -> None:
    """Load a ``save_sharded`` checkpoint saved at any number of ranks: each rank reads the parts of the
    shards that fall into its own (DCP reshards); ``optimizer_meta`` None: weights only. Every rank must call."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict)

    from masrl.training.checkpoint import CheckpointError, dcp_keys, dcp_model_key, dcp_optim_key, \
        saved_parameter_names

    expected, saved = saved_parameter_names(policy), dcp_keys(folder)
    prefix = dcp_model_key("")
    saved_weights = {k[len(prefix):] for k in saved if k.startswith(prefix)}
    if saved_weights != expected:
        missing, extra = sorted(expected - saved_weights)[:3], sorted(saved_weights - expected)[:3]
        raise CheckpointError(f"{where} weights do not fit the model (missing {missing}, unexpected {extra})")
    model_sd = {n: t for n, t in get_model_state_dict(policy.model).items() if n in expected}
    flat = {dcp_model_key(n): t for n, t in model_sd.items()}
    optim_sd = None
    if optimizer_meta and optimizer_meta["state"] and policy.optimizer is not None:
        template = get_optimizer_state_dict(policy.model, policy.optimizer)["state"]  # initialises fresh state
        try:
            state = {p: {k: (template[p][k] if v == "tensor" else v) for k, v in entries.items()}
                     for p, entries in optimizer_meta["state"].items()}
        except (KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{where}: optimizer state does not fit ({type(e).__name__}: {e})") from None
        groups = [{**g, **({"betas": tuple(g["betas"])} if "betas" in g else {})}
                  for g in optimizer_meta["param_groups"]]
        optim_sd = {"state": state, "param_groups": groups}
        flat.update({dcp_optim_key(p, k): t for p, entries in state.items() for k, t in entries.items()
                     if torch.is_tensor(t)})
    missing = sorted(set(flat) - saved)
    if missing:
        raise CheckpointError(f"{where}: the sharded checkpoint lacks {missing[:3]}")
    dcp.load(flat, storage_reader=HuggingFaceStorageReader(folder))
    set_model_state_dict(policy.model, model_sd, options=StateDictOptions(strict=False))
    if optim_sd is not None:
        try:
            set_optimizer_state_dict(policy.model, policy.optimizer, optim_sd)
        except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as e:
            raise CheckpointError(f"{where}: optimizer state does not fit ({type(e).__name__}: {e})") from None


def _shard_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``full`` laid out as ``like`` (this rank's DTensor shard when ``like`` is sharded)."""
    if not is_sharded(like):
        return full.to(like.device, like.dtype)
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full.to(like.device, like.dtype), like.device_mesh, like.placements)


def restore_sharded(policy, weights, opt_tensors, opt_meta, where: str) -> None:
    """Load a consolidated checkpoint (a replica run's) into a sharded policy (each rank keeps its shards)."""
    from masrl.training.checkpoint import CheckpointError, optimizer_from_tensors, saved_parameter_names

    expected = saved_parameter_names(policy)
    if set(weights) != expected:
        missing, extra = sorted(expected - set(weights))[:3], sorted(set(weights) - expected)[:3]
        raise CheckpointError(f"{where} weights do not fit the model (missing {missing}, unexpected {extra})")
    params = dict(policy.model.named_parameters())
    with torch.no_grad():
        for n in sorted(weights):
            p = params[n]
            shard = _shard_like(weights[n], p)
            (p.to_local() if is_sharded(p) else p).copy_(shard.to_local() if is_sharded(shard) else shard)
    if opt_tensors is not None and policy.optimizer is not None:
        ordered = [p for g in policy.optimizer.param_groups for p in g["params"]]
        laid_out = {}
        for key, t in opt_tensors.items():
            idx, name = key.split(".", 1)
            laid_out[key] = t if name == "step" else _shard_like(t, ordered[int(idx)])
        optimizer_from_tensors(policy.optimizer, laid_out, opt_meta)
