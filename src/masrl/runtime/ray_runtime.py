"""The Ray runtime: each policy is a worker group of Ray actors placed by a resource pool.

The driver stays the single controller (as in verl): it runs the workflows, sends each flush
of generation requests to the policy's worker group (sharded over its ranks), gathers the
turns, computes advantages, and sends each policy its training rows. Ranks of one group form
a torch.distributed process group (gloo on CPU, nccl on GPU) and all-reduce gradients
(``masrl.training.distributed``).

Placement (``runtime`` config): ``colocated`` policies share one placement group of
``workers`` bundles — rank ``r`` of every colocated policy sits in bundle ``r`` with an equal
fraction of its CPUs/GPUs, and they take turns (weights and optimizer state offloaded to CPU
between phases when ``offload``); a ``dedicated`` policy gets a placement group of its own and
trains concurrently with the others.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

from masrl.errors import missing_extra
from masrl.rollout.base import Engine, GenRequest, GenResult
from masrl.runtime.local import WorkerGroupError, base_trained, policy_build_args
from masrl.training.policy import PolicyText
from masrl.training.update import GLOBAL_METRICS, Row, summarize_update

RANK_SEED_STRIDE = 1_000_003
# rollout.max_staleness: an actor's calls run in threads (the producer's generation, the trainer's update, the
# driver's small queries); the engine's lock keeps one batch on one version
STALE_CONCURRENCY = 4


def _import_ray():
    try:
        import ray
    except ImportError:
        raise missing_extra("runtime.kind = ray needs Ray", "ray") from None
    return ray


class _Group:
    """Handles of one policy's actors, with error reporting that names the policy, rank and step."""

    def __init__(self, runtime: "RayRuntime", name: str, actors: list, placement):
        self.runtime, self.name, self.actors, self.placement = runtime, name, actors, placement

    def get(self, refs: list, what: str) -> list:
        ray = _import_ray()
        from ray.exceptions import RayActorError, RayTaskError

        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        results: dict[int, Any] = {}
        pending = list(refs)
        while pending:  # the first failure surfaces at once (its peers may be blocked in a collective)
            ready, pending = ray.wait(pending, num_returns=1)
            rank = rank_of[ready[0]]
            try:
                results[rank] = ray.get(ready[0])
            except RayTaskError as e:
                cause = getattr(e, "cause", None)
                if isinstance(cause, (ValueError, KeyError, FileNotFoundError)) or \
                        type(cause).__name__ == "CheckpointError":
                    raise cause from None  # a user error raised inside the worker: its own message
                raise WorkerGroupError(f"policy {self.name!r}: worker {rank} failed during {what} at step "
                                       f"{self.runtime.step}: {type(cause).__name__ if cause else 'error'}: "
                                       f"{(str(cause or e).strip().splitlines() or [''])[-1]}") from e
            except RayActorError as e:
                raise WorkerGroupError(f"policy {self.name!r}: worker {rank} died during {what} at step "
                                       f"{self.runtime.step} ({type(e).__name__})") from e
        return [results[rank] for rank in range(len(refs))]

    def all(self, method: str, *args, what: str | None = None, **kwargs) -> list:
        return self.get([getattr(a, method).remote(*args, **kwargs) for a in self.actors], what or method)


class RemoteEngine(Engine):
    """The rollout engine of a worker group: requests are split over the ranks and generated in parallel."""

    def __init__(self, group: _Group, sharded: bool = False):
        self.group = group
        # fsdp: every forward is a collective, so every rank decodes every request with the same seed
        # (identical samples; rank 0's results are returned)
        self.sharded = sharded

    def reseed(self, seed: int) -> None:  # rank 0 gets the seed the local engine would get
        stride = 0 if self.sharded else RANK_SEED_STRIDE
        self.group.get([a.reseed.remote(seed + r * stride) for r, a in enumerate(self.group.actors)], "reseed")

    def submit(self, requests: Sequence[GenRequest]):
        if self.sharded:
            payload = [dataclasses.asdict(r) for r in requests]
            return [a.generate.remote(payload) if requests else None for a in self.group.actors]
        n, world = len(requests), len(self.group.actors)
        size = -(-n // world)
        shards = [requests[i * size:(i + 1) * size] for i in range(world)]
        return [(a.generate.remote([dataclasses.asdict(r) for r in shard]) if shard else None)
                for a, shard in zip(self.group.actors, shards)]

    def collect(self, handle) -> list[GenResult]:
        refs = [r for r in handle if r is not None]
        out: list[GenResult] = []
        parts = self.group.get(refs, "generation")
        for part in parts[:1] if self.sharded else parts:
            out.extend(GenResult(**d) for d in part)
        return out

    def generate(self, requests: Sequence[GenRequest]) -> list[GenResult]:
        return self.collect(self.submit(requests))

    @property
    def version(self) -> int:
        """``rollout.max_staleness``: the version of the weights the group samples with (every rank has it)."""
        return self.group.get([self.group.actors[0].rollout_version.remote()], "version")[0]


@dataclasses.dataclass
class RayPolicy(PolicyText):
    """The driver's view of a policy whose model lives in a Ray worker group (a
    ``masrl.training.policy.PolicyProtocol``: checkpoints call its methods, which run on the ranks)."""

    name: str
    cfg: Any
    tokenizer: Any
    engine: RemoteEngine
    group: _Group
    max_positions: int
    agents: list[str] = dataclasses.field(default_factory=list)
    adapter_of: dict[str, str] = dataclasses.field(default_factory=dict)
    colocated: bool = True

    @property
    def optimizer(self):  # the optimizer lives in the workers; checkpoints go through checkpoint_state
        return True if self.cfg.trainable else None

    @property
    def sharded_checkpoint(self) -> bool:
        """fsdp: checkpoints are saved and loaded by every rank, shard by shard (masrl.training.checkpoint)."""
        return self.group.runtime.cfg.runtime.strategy == "fsdp"

    def checkpoint_state(self):
        return self.group.get([self.group.actors[0].checkpoint_state.remote()], "checkpoint save")[0]

    def save_sharded(self, folder: str) -> dict:
        return self.group.all("save_sharded", folder, what="checkpoint save")[0]

    def load_sharded(self, folder: str, optimizer_meta: dict | None, where: str) -> None:
        self.group.all("load_sharded", folder, optimizer_meta, where, what="checkpoint load")

    def restore_state(self, weights, opt_tensors, opt_meta, where: str) -> None:
        ray = _import_ray()
        refs = ray.put(weights), ray.put(opt_tensors), ray.put(opt_meta)
        self.group.all("restore_state", *refs, where, what="checkpoint load")


class RayRuntime:
    kind = "ray"

    def __init__(self, cfg, run_dir=None):
        ray = _import_ray()
        self.cfg, self.step = cfg, 0
        self.run_dir = run_dir if run_dir is not None else cfg.run_dir
        rc = cfg.runtime
        self.started_ray = False
        if not ray.is_initialized():
            kwargs: dict[str, Any] = {"include_dashboard": rc.dashboard, "namespace": "masrl",
                                      "log_to_driver": True}
            if rc.address:
                kwargs["address"] = rc.address
            else:
                kwargs.update({k: v for k, v in (("num_cpus", rc.num_cpus), ("num_gpus", rc.num_gpus))
                               if v is not None})
            ray.init(**kwargs)
            self.started_ray = True
        self.groups: dict[str, _Group] = {}
        self._pools: list = []

    # ------------------------------------------------------------------ placement
    def _pool(self, workers: int, cpus: float, gpus: float):
        ray = _import_ray()
        from ray.util.placement_group import placement_group

        bundle = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
        pg = placement_group([dict(bundle) for _ in range(workers)], strategy="PACK")
        ready, _ = ray.wait([pg.ready()], timeout=120)
        if not ready:
            ray.util.remove_placement_group(pg)
            raise WorkerGroupError(f"runtime: the Ray cluster cannot place {workers} bundle(s) of {bundle} "
                                   f"(cluster resources: {ray.cluster_resources()}); lower runtime.workers / "
                                   "cpus_per_worker / gpus_per_worker or add nodes")
        self._pools.append(pg)
        return pg

    def build_policies(self) -> dict[str, RayPolicy]:
        ray = _import_ray()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from masrl.models.loading import load_tokenizer
        from masrl.runtime.worker import PolicyWorker

        cfg, rc = self.cfg, self.cfg.runtime
        placements = {name: rc.for_policy(name) for name in cfg.policies}
        colocated = [n for n, p in placements.items() if p.placement == "colocated"]
        shared_pool = None
        if colocated:
            first = placements[colocated[0]]
            shared_pool = self._pool(first.workers, first.cpus_per_worker, first.gpus_per_worker)
        remote_cls = ray.remote(PolicyWorker)
        mon = cfg.monitoring.spike
        spike = {"window": mon.window, "threshold": mon.threshold, "min_history": mon.min_history,
                 "action": mon.action}
        policies: dict[str, RayPolicy] = {}
        for name, build in policy_build_args(cfg, self.run_dir).items():
            place = placements[name]
            share = len(colocated) if name in colocated else 1
            pool = shared_pool if name in colocated else self._pool(place.workers, place.cpus_per_worker,
                                                                     place.gpus_per_worker)
            cpus, gpus = place.cpus_per_worker / share, place.gpus_per_worker / share
            device = "cuda" if gpus > 0 else cfg.trainer.device
            build["device"] = "cpu"  # the worker moves it to `device` (and off it when offloading)
            build["rollout"] = build["rollout"].model_dump(mode="json")  # plain data across the process boundary
            threads = cfg.trainer.threads or max(1, int(cpus))
            ahead = cfg.rollout.max_staleness > 0  # rollouts beside the update: calls in threads, no offload
            actors = [remote_cls.options(
                num_cpus=cpus, num_gpus=gpus, name=None, max_concurrency=STALE_CONCURRENCY if ahead else 1,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pool, placement_group_bundle_index=rank),
            ).remote(name, cfg.policies[name].model_dump(mode="json"), build, rank=rank, world=place.workers,
                     threads=threads, device=device, base_trained=base_trained(cfg, name), spike=spike,
                     offload=bool(place.offload and name in colocated and len(colocated) > 1 and not ahead),
                     fsdp=rc.fsdp.model_dump(mode="json") if rc.strategy == "fsdp" else None,
                     tune_malloc=cfg.trainer.tune_malloc, primitive_cache=cfg.trainer.primitive_cache)
                for rank in range(place.workers)]
            group = _Group(self, name, actors, place)
            info = group.get([actors[0].info.remote()], "start-up")[0]
            if place.workers > 1 or rc.strategy == "fsdp":
                address, port = group.get([actors[0].rendezvous.remote()], "start-up")[0]
                backend = rc.backend if rc.backend != "auto" else ("nccl" if gpus > 0 else "gloo")
                group.all("join_group", address, port, backend, what="process-group start-up")
            self.groups[name] = group
            policies[name] = RayPolicy(name=name, cfg=cfg.policies[name], tokenizer=load_tokenizer(cfg.policies[name]),
                                       engine=RemoteEngine(group, rc.strategy == "fsdp"), group=group, max_positions=info["max_positions"],
                                       agents=build["agents"], adapter_of=info["adapter_of"],
                                       colocated=name in colocated)
        return policies

    # ------------------------------------------------------------------ stages
    def update(self, policies: Mapping[str, RayPolicy], rows: Mapping[str, Sequence[Row]], *, step: int,
               guard=None, track_kl: bool = False) -> dict[str, float]:
        """Colocated policies train one after another; dedicated ones concurrently with them."""
        ray = _import_ray()
        algo = self.cfg.algorithm.model_dump(mode="json")
        trainer = self.cfg.trainer.model_dump(mode="json")
        metrics: dict[str, float] = {}

        def launch(name):
            group = self.groups[name]
            ref = ray.put([dataclasses.asdict(r) for r in rows[name]])  # one copy, read by every rank
            return [a.update.remote(ref, algo, trainer, step, self.cfg.seed, track_kl) for a in group.actors]

        dedicated = {n: launch(n) for n in rows if not policies[n].colocated}
        for name in [n for n in rows if policies[n].colocated]:
            metrics.update(self._finish_update(policies[name], rows[name], launch(name)))
            self.groups[name].all("offload")
        for name, refs in dedicated.items():
            metrics.update(self._finish_update(policies[name], rows[name], refs))
        return metrics

    def _finish_update(self, policy: RayPolicy, rows: Sequence[Row], refs) -> dict[str, float]:
        group = self.groups[policy.name]
        parts = group.get(refs, "update")
        merged: dict[str, list[float]] = {}
        for rank, (raw, _) in enumerate(parts):
            for key, values in raw.items():
                if rank and key.endswith(GLOBAL_METRICS):
                    continue  # identical on every rank (computed from the all-reduced gradient)
                merged.setdefault(key, []).extend(values)
        return summarize_update(merged, _LrView(policy.name, parts[0][1]), rows)

    def sft(self, policies: Mapping[str, RayPolicy], rows: Sequence[Row],
            on_step: Callable[[int, dict], None] | None = None) -> dict[str, float]:
        sft = self.cfg.sft.model_dump(mode="json")
        by_policy: dict[str, list[dict]] = {}
        for r in rows:
            by_policy.setdefault(r.policy, []).append(dataclasses.asdict(r))
        ray = _import_ray()
        launched = {}
        for name, prows in by_policy.items():
            ref = ray.put(prows)
            launched[name] = [a.sft.remote(ref, sft, self.cfg.seed, self.cfg.trainer.micro_batch_tokens,
                                          self.cfg.trainer.logprob_chunk_tokens, self.cfg.trainer.autocast)
                              for a in self.groups[name].actors]
        per_policy = {name: self.groups[name].get(refs, "SFT")[0] for name, refs in launched.items()}
        last: dict[str, float] = {}
        for step in range(self.cfg.sft.steps):
            for steps in per_policy.values():
                last.update(steps[step])
            if on_step is not None:
                on_step(step, dict(last))
        return last

    def version_rollouts(self, policies: Mapping[str, RayPolicy]) -> None:
        """``rollout.max_staleness``: every rank's engine behind a version counter, on weights of its own; the
        actors run the driver's calls in threads, so a batch is generated while an update runs."""
        for group in self.groups.values():
            group.all("version_rollouts")

    def phase_end(self) -> None:
        for group in self.groups.values():
            if group.placement.offload:
                group.all("end_rollout")

    # ------------------------------------------------------------------ state
    def spike_state(self, driver_state: dict) -> dict:
        """The driver's detector (role keys) merged with each group's (its policy key)."""
        state = {k: dict(v) for k, v in driver_state.items()}
        for name, group in self.groups.items():
            own = group.get([group.actors[0].spike_state.remote()], "checkpoint save")[0]
            for part in ("history", "pending", "counts"):
                state.setdefault(part, {}).update({k: v for k, v in own.get(part, {}).items() if k == name})
        return state

    def load_spike_state(self, state: dict) -> None:
        for group in self.groups.values():
            group.all("load_spike_state", state, what="resume")

    def close(self) -> None:
        ray = _import_ray()
        for group in self.groups.values():
            for a in group.actors:
                ray.kill(a)
        self.groups.clear()
        for pg in self._pools:
            ray.util.remove_placement_group(pg)
        self._pools.clear()
        if self.started_ray:
            ray.shutdown()
            self.started_ray = False


@dataclasses.dataclass
class _LrView:
    """What ``summarize_update`` reads from a policy: its name and optimizer's learning rate."""

    name: str
    lr: float

    @property
    def optimizer(self):
        return self

    @property
    def param_groups(self):
        return [{"lr": self.lr}]
