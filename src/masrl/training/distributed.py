"""Data parallelism inside a policy's worker group (torch.distributed).

Every rank holds a full replica and receives the whole batch of rows; each minibatch is
split round-robin (``rows[rank::world]``) and the loss of every rank is normalised by the
*global* counts (tokens or rows of the whole minibatch), so the all-reduced SUM of the ranks'
gradients is exactly the single-process gradient (up to summation order). Gradients are
all-reduced once per minibatch, after all micro-batches, in flat per-dtype buckets.

Why not ``DistributedDataParallel``'s module wrapper: length bucketing gives ranks different
numbers of micro-batches (DDP's per-backward hooks would then wait on each other), and the
per-agent gradient telemetry needs the all-reduced gradient of each agent's part. The result
is DDP's arithmetic (replicas broadcast from rank 0 at start, gradients summed and identical
on every rank, so every replica takes the same optimizer step) with one collective per
agent per minibatch.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Sequence, TypeVar

import torch

T = TypeVar("T")


@dataclass
class DataParallel:
    rank: int
    world: int
    sharded = False  # the fsdp strategy's subclass (masrl.training.fsdp) reduces gradients in backward

    def shard(self, items: Sequence[T]) -> list[T]:
        return list(items[self.rank::self.world])

    def pad_chunks(self, chunks: list[list[T]], unit: Sequence[T]) -> list[tuple[list[T], bool]]:
        """(chunk, is_padding) pairs; replicas need no padding (one collective per minibatch)."""
        return [(c, False) for c in chunks]

    def all_reduce_(self, tensors: Sequence[torch.Tensor]) -> None:
        """In-place SUM over ranks, one flat buffer per dtype."""
        if self.world == 1 or not tensors:
            return
        import torch.distributed as dist

        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for group in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in group])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            offset = 0
            for t in group:
                n = t.numel()
                t.copy_(flat[offset:offset + n].view_as(t))
                offset += n

    def all_true(self, flag: bool) -> bool:
        """True only if ``flag`` is true on every rank."""
        if self.world == 1:
            return flag
        import torch.distributed as dist

        t = torch.tensor([0.0 if flag else 1.0])
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return float(t) == 0.0

    def broadcast_parameters(self, module: torch.nn.Module) -> None:
        """Every replica starts from rank 0's weights (as DDP does at construction)."""
        if self.world == 1:
            return
        import torch.distributed as dist

        with torch.no_grad():
            for p in module.parameters():
                dist.broadcast(p.data, src=0)


def init_process_group(rank: int, world: int, address: str, port: int, backend: str = "gloo",
                       timeout_s: float = 600.0) -> DataParallel:
    """Join the worker group's process group (TCP rendezvous at ``address:port``)."""
    import torch.distributed as dist

    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend, init_method=f"tcp://{address}:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
    return DataParallel(rank, world)
