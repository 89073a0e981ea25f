"""Per-policy update: one batch of the turns of every agent mapped to the policy.

Rows are packed left-padded so that every response ends at the last position; the LM head
then runs only on the last ``R + 1`` positions (``logits_to_keep``). Micro-batches hold the
rows of one agent, so the agent's part of the gradient (its term of the policy loss) is
measured exactly by differencing the accumulated gradient: ``g_k = G_after_k - G_before_k``.
With one LoRA adapter per agent (Isolated-Policy), micro-batches mix agents instead: every row
is routed to its agent's adapter in the same forward pass, all adapters step together, and an
agent's gradient is its adapter's gradient.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import random
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from masrl.algorithms import (agg_loss, entropy_from_logits, kl_penalty, policy_loss, role_balanced_weights,
                              truncated_is_weights)
from masrl.algorithms.losses import entropy_from_logsumexp
from masrl.config import AlgorithmConfig, TrainerConfig
from masrl.models.compiled_layers import compile_decision, compiled_layers
from masrl.models.cpu_attention import cpu_attention
from masrl.models.precision import resolve_autocast
from masrl.training.distributed import DataParallel
from masrl.training.logprobs import response_logprobs
from masrl.training.policy import Policy

log = logging.getLogger(__name__)


@dataclass
class Row:
    """One training row: a turn's prompt + response with its advantage."""

    agent: str
    prompt_ids: list[int]
    response_ids: list[int]
    old_logprobs: list[float]
    advantage: float
    temperature: float = 1.0
    policy: str = ""
    rollout_logprobs: list[float] | None = None  # the engine's, when old_logprobs were recomputed by the trainer
    # per response token, 0 = context only (tool output inside a merged conversation, see
    # training/conversation.py): never in the loss nor in the token count; None = all trained
    loss_mask: list[int] | None = None

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def num_loss_tokens(self) -> int:
        return len(self.response_ids) if self.loss_mask is None else sum(1 for m in self.loss_mask if m)


@dataclass
class PackedBatch:
    input_ids: torch.Tensor       # [n, L] left-padded prompt+response
    attention_mask: torch.Tensor  # [n, L]
    position_ids: torch.Tensor    # [n, L]
    targets: torch.Tensor         # [n, R] response tokens aligned to the end
    response_mask: torch.Tensor   # [n, R] float
    old_logprobs: torch.Tensor    # [n, R]
    advantages: torch.Tensor      # [n]
    temperature: torch.Tensor     # [n]
    rollout_logprobs: torch.Tensor | None = None  # [n, R] when the rows carry them

    @property
    def num_tokens(self) -> int:
        return int(self.response_mask.sum())


def pack_rows(rows: Sequence[Row], pad_token_id: int, device: str | torch.device = "cpu") -> PackedBatch:
    n = len(rows)
    width = max(r.length for r in rows)
    resp = max(max(len(r.response_ids) for r in rows), 1)
    input_ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    targets = torch.full((n, resp), pad_token_id, dtype=torch.long)
    mask = torch.zeros((n, resp), dtype=torch.float32)
    old = torch.zeros((n, resp), dtype=torch.float32)
    for i, r in enumerate(rows):
        seq = r.prompt_ids + r.response_ids
        input_ids[i, width - len(seq):] = torch.tensor(seq, dtype=torch.long)
        attention[i, width - len(seq):] = 1
        k = len(r.response_ids)
        if k:
            targets[i, resp - k:] = torch.tensor(r.response_ids, dtype=torch.long)
            mask[i, resp - k:] = 1.0 if r.loss_mask is None else torch.tensor(r.loss_mask, dtype=torch.float32)
            old[i, resp - k:] = torch.tensor(r.old_logprobs, dtype=torch.float32)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    adv = torch.tensor([r.advantage for r in rows], dtype=torch.float32)
    temp = torch.tensor([r.temperature if r.temperature > 0 else 1.0 for r in rows], dtype=torch.float32)
    rollout = None
    if any(r.rollout_logprobs is not None for r in rows):
        rollout = torch.zeros((n, resp), dtype=torch.float32)
        for i, r in enumerate(rows):
            if r.rollout_logprobs:
                rollout[i, resp - len(r.rollout_logprobs):] = torch.tensor(r.rollout_logprobs, dtype=torch.float32)
    to = lambda t: t.to(device) if t is not None else None  # noqa: E731
    return PackedBatch(to(input_ids), to(attention), to(positions), to(targets), to(mask), to(old), to(adv), to(temp),
                       to(rollout))


def response_logits(model: torch.nn.Module, batch: PackedBatch) -> torch.Tensor:
    """Temperature-scaled float32 logits predicting each response token: [n, R, V]."""
    resp = batch.targets.shape[1]
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                position_ids=batch.position_ids, logits_to_keep=resp + 1, use_cache=False)
    logits = out.logits[:, -(resp + 1):-1, :].float()
    if bool((batch.temperature == 1.0).all()):  # x / 1.0 == x exactly: skip a logits-sized copy
        return logits
    return logits / batch.temperature[:, None, None]


def autocast(trainer: TrainerConfig, device: str | torch.device | None = None):
    """``trainer.autocast``: a ``torch.autocast`` context for the model forward (float32 master weights,
    gradients and optimizer; the loss math stays float32), else a no-op context. ``device``: where the
    model is (default ``trainer.device``); ``auto`` is resolved for it (masrl.models.precision)."""
    return autocast_context(getattr(trainer, "autocast", None), device if device is not None else trainer.device)


def autocast_context(setting: str | None, device: str | torch.device):
    """A ``torch.autocast`` context for ``setting`` (a ``trainer.autocast`` value) on ``device``, or a no-op."""
    device = torch.device(device)
    dtype = resolve_autocast(setting, device)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=getattr(torch, dtype))


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return logits.gather(-1, targets[..., None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def token_logprobs_lse(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``token_logprobs`` and the ``logsumexp`` it used (reused by the entropy metric)."""
    lse = torch.logsumexp(logits, dim=-1)
    return logits.gather(-1, targets[..., None]).squeeze(-1) - lse, lse


def micro_batches(rows: Sequence[Row], token_budget: int) -> list[list[Row]]:
    """Length-bucketed chunks of rows whose padded size (rows x longest) fits ``token_budget``."""
    ordered = sorted(rows, key=lambda r: r.length)
    chunks, current = [], []
    for r in ordered:
        if current and (len(current) + 1) * r.length > token_budget:
            chunks.append(current)
            current = []
        current.append(r)
    if current:
        chunks.append(current)
    return chunks


def _grad_list(params: Sequence[torch.nn.Parameter]) -> list[torch.Tensor]:
    return [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]


def _norm(tensors: Sequence[torch.Tensor]) -> float:
    if not tensors:
        return 0.0
    if type(tensors[0]).__name__ == "DTensor":  # fsdp shards: local squared norms, all-reduced
        from masrl.training.fsdp import sharded_norm

        return sharded_norm(tensors)
    return float(_total_norm(tensors))


def _total_norm(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of all ``tensors`` as ``clip_grad_norm_`` computes it (foreach kernels; float32 and wider
    as they are, narrower dtypes upcast first), so that a clip with this norm equals ``clip_grad_norm_``."""
    if all(t.dtype in (torch.float32, torch.float64) and type(t).__name__ != "DTensor" for t in tensors):
        return torch.nn.utils.get_total_norm(tensors, 2.0)  # (foreach kernels need one tensor type)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t.float()) for t in tensors]))


# A guard sees (key, grad_norm, step) and returns None (go on) or ("skip"|"scale", scale).
GradGuard = Callable[[str, float, int], "tuple[str, float] | None"]


def update_policy(policy: Policy, rows: Sequence[Row], algo: AlgorithmConfig, trainer: TrainerConfig,
                  *, step: int, seed: int, guard: GradGuard | None = None,
                  track_kl: bool = False, dp: DataParallel | None = None) -> dict[str, float]:
    """Train ``policy`` on ``rows``; returns ``policy/<name>/...`` and ``agent/<a>/...`` metrics.

    ``dp``: this process is one rank of a data-parallel group (masrl.training.distributed); every
    rank passes all ``rows`` and trains on its share of each minibatch.
    """
    raw = update_policy_raw(policy, rows, algo, trainer, step=step, seed=seed, guard=guard, track_kl=track_kl,
                            dp=dp)
    return summarize_update(raw, policy, rows)


# metrics every rank of a data-parallel group computes identically (from the all-reduced gradient)
GLOBAL_METRICS = ("grad_norm", "grad_share", "_skipped", "grad_spike")


# the companion key of a per-token mean (``agent/<a>/entropy`` + TOKENS): each micro-batch's token count, so that
# the step's value is the mean over its tokens whatever the micro-batch size (not a mean of micro-batch means)
TOKENS = "#tokens"


def summarize_update(raw: dict[str, list[float]], policy: Policy, rows: Sequence[Row]) -> dict[str, float]:
    """Average the per-micro-batch (or per-minibatch) values of ``update_policy_raw``; per-token means are
    weighted by their micro-batches' token counts."""
    out = {}
    for key, values in raw.items():
        if not values:
            continue
        if key.endswith(TOKENS):
            continue
        name = key if key.startswith(("agent/", "policy/")) else f"policy/{policy.name}/{key}"
        weights = raw.get(key + TOKENS)
        if key.endswith(("_skipped", "grad_spike")):
            out[name] = float(sum(values))
        elif weights and len(weights) == len(values) and sum(weights) > 0:  # a mean over tokens, not micro-batches
            out[name] = sum(v * w for v, w in zip(values, weights)) / sum(weights)
        else:
            out[name] = sum(values) / len(values)
    out[f"policy/{policy.name}/lr"] = policy.optimizer.param_groups[0]["lr"]
    out[f"policy/{policy.name}/rows"] = float(len(rows))
    out[f"policy/{policy.name}/tokens"] = float(sum(r.num_loss_tokens for r in rows))  # trained tokens
    return out


def update_policy_raw(policy: Policy, rows: Sequence[Row], algo: AlgorithmConfig, trainer: TrainerConfig,
                      *, step: int, seed: int, guard: GradGuard | None = None, track_kl: bool = False,
                      dp: DataParallel | None = None) -> dict[str, list[float]]:
    """``update_policy`` before averaging: every metric's list of values (mergeable across ranks).

    Stages: per minibatch, ``_accumulate_gradients`` (micro-batches by ``_backward_chunk``), then
    ``_optimizer_step`` (finite check, spike guard, clipping, the step and the gradient metrics)."""
    assert policy.optimizer is not None, f"policy {policy.name} is not trainable"
    resolve_compile(policy, trainer)
    u = _UpdateRun.start(policy, rows, algo, trainer, step=step, guard=guard, track_kl=track_kl, dp=dp)
    rng = random.Random(seed * 1_000_003 + step)
    if u.recompute and not u.single_pass:  # the pre-update policy's log-probs, before the first step
        rows = with_trainer_logprobs(policy, rows, trainer)
    for epoch in range(trainer.epochs):
        order = list(rows)
        rng.shuffle(order)
        n_mb = min(trainer.minibatches, len(order))
        for mb_index in range(n_mb):
            minibatch = order[mb_index::n_mb]
            if sum(r.num_loss_tokens for r in minibatch) == 0:
                continue
            policy.optimizer.zero_grad(set_to_none=True)
            finite, agent_norms = _accumulate_gradients(u, minibatch)
            _optimizer_step(u, finite, agent_norms)
    return dict(u.metrics)


@dataclass
class _UpdateRun:
    """What the stages of one ``update_policy_raw`` call share, and the metrics they append to."""

    policy: Policy
    algo: AlgorithmConfig
    trainer: TrainerConfig
    step: int
    guard: GradGuard | None
    track_kl: bool
    dp: DataParallel | None
    params: list[torch.nn.Parameter]
    pad: int
    device: torch.device
    agents: list[str]
    per_agent_norms: bool
    norm_length: int
    routed: bool      # per-agent LoRA adapters: mixed batches, rows routed by agent
    recompute: bool   # the trainer's own log-probs are the PPO "old" ones
    single_pass: bool
    metrics: dict[str, list[float]]

    @classmethod
    def start(cls, policy: Policy, rows: Sequence[Row], algo: AlgorithmConfig, trainer: TrainerConfig, *,
              step: int, guard: GradGuard | None, track_kl: bool, dp: DataParallel | None) -> "_UpdateRun":
        params = policy.trainable_parameters()
        model = policy.model
        model.train()
        agents = sorted({r.agent for r in rows})
        # A separate rollout engine (vLLM) computes other log-probs than the trainer: the PPO "old" log-probs
        # are the trainer's, and with rollout_is the engine's give the importance weights (docs/scaling.md).
        # Under trainer.autocast the trainer's low-precision log-probs differ from any engine's (even a bf16
        # engine's: other kernels, other rounding; ~0.02 mean |diff| on SmolLM2), so they are recomputed
        # too: free with one epoch and one minibatch (the ratio is then exactly 1 at the first step).
        recompute = (algo.rollout_is.enabled or not policy.engine.shares_training_model
                     or resolve_autocast(getattr(trainer, "autocast", None), next(model.parameters()).device)
                     is not None)
        return cls(policy=policy, algo=algo, trainer=trainer, step=step, guard=guard, track_kl=track_kl, dp=dp,
                   params=params, pad=int(policy.tokenizer.pad_token_id),
                   # where the runtime put the model (a Ray worker's GPU, or trainer.device)
                   device=next(model.parameters()).device, agents=agents,
                   per_agent_norms=trainer.per_agent_grad_norm and len(agents) > 1,
                   norm_length=max(len(r.response_ids) for r in rows), routed=bool(policy.adapter_of),
                   recompute=recompute, single_pass=trainer.epochs == 1 and min(trainer.minibatches, len(rows)) == 1,
                   metrics=defaultdict(list))


def _accumulate_gradients(u: _UpdateRun, minibatch: Sequence[Row]) -> tuple[bool, dict[str, float]]:
    """Backward every micro-batch of ``minibatch`` (this rank's share); returns (finite, per-agent grad norms).

    One unit per agent (its part of the gradient is measured by differencing), or one mixed unit when
    rows are routed to per-agent adapters (an agent's gradient is then its adapter's)."""
    params, dp, trainer = u.params, u.dp, u.trainer
    total_tokens = sum(r.num_loss_tokens for r in minibatch)  # trained tokens (a loss mask may hide some)
    total_rows = sum(1 for r in minibatch if r.response_ids)
    # role-balanced: per-agent token weights over this whole minibatch (one optimizer step), not per chunk
    role_w = role_balanced_weights([r.agent for r in minibatch], [r.num_loss_tokens for r in minibatch]) \
        if u.algo.loss.agg == "role-balanced" else None
    before = [torch.zeros_like(p) for p in params] if u.per_agent_norms and not u.routed else None
    summed = [torch.zeros_like(p) for p in params] if before is not None and dp else None
    agent_norms: dict[str, float] = {}
    finite = True
    units = [(None, minibatch)] if u.routed else [(a, [r for r in minibatch if r.agent == a]) for a in u.agents]
    for unit_agent, unit in units:
        unit = [r for r in unit if r.response_ids]
        mine = dp.shard(unit) if dp else unit
        chunks = micro_batches(mine, trainer.micro_batch_tokens) if finite else []
        for chunk, padding in (dp.pad_chunks(chunks, unit) if dp else [(c, False) for c in chunks]):
            finite = _backward_chunk(u, chunk, total_tokens, total_rows, role_w, padding=padding, finite=finite)
            if not finite and not (dp is not None and dp.sharded):
                break
        if not finite and dp is None:
            break
        if before is not None and unit:  # ranks agree on `unit` (the whole minibatch's), so on collectives
            now = _grad_list(params)
            delta = [a - b for a, b in zip(now, before)]
            if dp is not None:  # the agent's all-reduced gradient, summed into the step's gradient
                dp.all_reduce_(delta)
                for acc, d in zip(summed, delta):
                    acc.add_(d)
            agent_norms[unit_agent] = _norm(delta)
            before = [g.detach().clone() for g in now]
    if dp is not None:
        finite = dp.all_true(finite)
        grads = summed if summed is not None else _grad_list(params)
        if summed is None:
            dp.all_reduce_(grads)
        for p, g in zip(params, grads):
            p.grad = g
    if finite and u.routed and trainer.per_agent_grad_norm:
        from masrl.models.lora import adapter_parameters

        for agent in u.agents:
            agent_norms[agent] = _norm(_grad_list(adapter_parameters(u.policy.model, u.policy.adapter_of[agent])))
    return finite, agent_norms


def _backward_chunk(u: _UpdateRun, chunk: list[Row], total_tokens: int, total_rows: int,
                    role_w: dict[str, float] | None, *, padding: bool = False, finite: bool = True) -> bool:
    """Loss of one micro-batch (policy loss, entropy bonus, KL), backward with its share of the minibatch;
    returns whether the minibatch is still finite (nothing backwarded once it is not). Under FSDP2 every rank
    runs as many backwards as the others: a padding chunk, or any chunk once the loss was not finite, is
    backwarded with weight 0 and logs nothing. Rows stay routed to their adapters until backward is done
    (gradient checkpointing recomputes the layers there)."""
    chunk.sort(key=lambda r: r.agent)  # contiguous rows per adapter route by slicing
    with trainer_forward(u.policy, chunk, backward_inside=True):
        return _routed_backward_chunk(u, chunk, total_tokens, total_rows, role_w, padding=padding, finite=finite)


def _routed_backward_chunk(u: _UpdateRun, chunk: list[Row], total_tokens: int, total_rows: int,
                           role_w: dict[str, float] | None, *, padding: bool, finite: bool) -> bool:
    lc, trainer, norm_length = u.algo.loss, u.trainer, u.norm_length
    metrics = defaultdict(list) if padding else u.metrics  # padding (fsdp) chunks: no metrics
    batch = pack_rows(chunk, u.pad, u.device)
    logprobs, entropy = policy_logprobs(u.policy, batch, trainer, entropy_grad=bool(lc.entropy_coef))
    old, engine_logprobs = batch.old_logprobs, batch.rollout_logprobs
    if u.recompute and u.single_pass:  # nothing has changed the policy yet: its own log-probs are old
        old, engine_logprobs = logprobs.detach(), batch.old_logprobs
    is_weights = None
    row_w = torch.tensor([role_w[r.agent] for r in chunk], device=u.device) if role_w else None
    ris = u.algo.rollout_is
    if ris.enabled:
        is_weights, is_stats = truncated_is_weights(old, engine_logprobs, batch.response_mask,
                                                    cap=ris.cap, level=ris.level, mode=ris.mode)
        for key, value in is_stats.items():
            metrics[f"rollout_is/{key}"].append(float(value))
    loss, stats = policy_loss(logprobs, old, batch.advantages, batch.response_mask,
                              loss=lc.loss, clip_low=lc.clip_low, clip_high=lc.clip_high,
                              dual_clip=lc.dual_clip, agg=lc.agg, norm_length=norm_length,
                              is_weights=is_weights, row_weights=row_w)
    if lc.entropy_coef:
        loss = loss - lc.entropy_coef * agg_loss(entropy, batch.response_mask, lc.agg, norm_length=norm_length,
                                                 row_weights=row_w)
    if lc.kl_coef or u.track_kl:
        with autocast(trainer, u.device):
            ref = reference_logprobs(u.policy, batch, trainer.logprob_chunk_tokens)
        kl = kl_penalty(logprobs, ref, lc.kl_kind if lc.kl_coef else "k3")
        if lc.kl_coef:
            loss = loss + lc.kl_coef * agg_loss(kl, batch.response_mask, lc.agg, norm_length=norm_length,
                                                row_weights=row_w)
        _per_agent_token_mean(kl, batch.response_mask, chunk, "kl_ref", metrics)
    weight = (batch.num_tokens / total_tokens if lc.agg == "token-mean"
              else 1.0 if role_w else len(chunk) / max(total_rows, 1))  # role-balanced: weights are global
    finite = finite and bool(torch.isfinite(loss))
    if padding or not finite:
        if u.dp is not None and u.dp.sharded:  # FSDP2: as many backwards as the other ranks
            (loss * 0.0).backward()
        return finite
    (loss * weight).backward()
    _per_agent_token_mean(entropy, batch.response_mask, chunk, "entropy", metrics)
    metrics["pg_loss"].append(float(loss.detach()))
    for key, value in stats.items():
        metrics[key].append(float(value))
    return True


def _step_norm(params: Sequence[torch.nn.Parameter]) -> torch.Tensor | float:
    """The step's gradient norm: a tensor where ``clip_grads_with_norm_`` can reuse it, else a float (shards)."""
    grads = [p.grad for p in params if p.grad is not None]  # the gradients clip_grad_norm_ would measure
    if any(type(g).__name__ == "DTensor" for g in grads):  # fsdp shards (possibly beside plain tensors)
        return _norm(_grad_list(params))
    return _total_norm(grads) if grads else 0.0


def _optimizer_step(u: _UpdateRun, finite: bool, agent_norms: dict[str, float]) -> None:
    """Step on the accumulated gradient unless it is not finite or the spike guard skips it; gradient metrics."""
    policy, params, metrics = u.policy, u.params, u.metrics
    norm_t = _step_norm(params) if finite else None
    grad_norm = float(norm_t) if norm_t is not None else float("nan")
    prefix = f"policy/{policy.name}"
    if not finite or not math.isfinite(grad_norm):
        metrics[f"{prefix}/nonfinite_skipped"].append(1.0)
        policy.optimizer.zero_grad(set_to_none=True)
        if not u.trainer.skip_nonfinite:
            raise FloatingPointError(f"non-finite loss or gradient in policy {policy.name} at step {u.step}")
        return
    if u.guard is not None:
        decision = u.guard(policy.name, grad_norm, u.step)
        if decision is not None:
            action, scale = decision
            metrics[f"{prefix}/grad_spike"].append(1.0)
            if action == "skip":
                metrics[f"{prefix}/spike_skipped"].append(1.0)
                policy.optimizer.zero_grad(set_to_none=True)
                return
            if action == "scale":
                for p in params:
                    if p.grad is not None:
                        p.grad.mul_(scale)
                norm_t = None  # the gradient changed: the clip measures it again
    clip = policy.cfg.optim.grad_clip
    if clip is not None and u.dp is not None and u.dp.sharded:
        from masrl.training.fsdp import clip_sharded_

        clip_sharded_(params, clip)
    elif clip is not None and isinstance(norm_t, torch.Tensor):  # the norm measured above: one pass, not two
        torch.nn.utils.clip_grads_with_norm_([p for p in params if p.grad is not None], clip, norm_t)
    elif clip is not None:
        torch.nn.utils.clip_grad_norm_(params, clip)
    policy.optimizer.step()
    metrics[f"{prefix}/grad_norm"].append(grad_norm)
    total = sum(agent_norms.values())
    for agent, value in agent_norms.items():
        metrics[f"agent/{agent}/grad_norm"].append(value)
        metrics[f"agent/{agent}/grad_share"].append(value / total if total > 0 else 0.0)
    if not agent_norms:
        for agent in u.agents:
            metrics[f"agent/{agent}/grad_norm"].append(grad_norm)


@torch.no_grad()
def with_trainer_logprobs(policy: Policy, rows: Sequence[Row], trainer: TrainerConfig) -> list[Row]:
    """Copies of ``rows`` whose ``old_logprobs`` are the trainer's (the engine's move to ``rollout_logprobs``)."""
    model = policy.model
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    out = {id(r): r for r in rows}
    try:
        for chunk in micro_batches([r for r in rows if r.response_ids], trainer.micro_batch_tokens):
            chunk.sort(key=lambda r: r.agent)
            batch = pack_rows(chunk, int(policy.tokenizer.pad_token_id), device)
            with trainer_forward(policy, chunk), autocast(trainer, device):
                logp = model_logprobs(model, batch, trainer.logprob_chunk_tokens).float().cpu()
            width = batch.targets.shape[1]
            for i, r in enumerate(chunk):
                out[id(r)] = dataclasses.replace(r, old_logprobs=logp[i, width - len(r.response_ids):].tolist(),
                                                 rollout_logprobs=list(r.old_logprobs))
    finally:
        model.train(was_training)
    return [out[id(r)] for r in rows]


@contextlib.contextmanager
def trainer_forward(policy: Policy, chunk: Sequence[Row], backward_inside: bool = False):
    """What every trainer forward of ``chunk`` runs under: masrl's CPU attention (float32 for short sequences under
    autocast, masrl.models.cpu_attention) and the rows' adapter routing. ``backward_inside``: the caller also runs
    backward inside (gradient checkpointing recomputes with the same attention and routing)."""
    with cpu_attention(policy.model), adapter_routing(policy, chunk, backward_inside=backward_inside), \
            compiled_layers(policy.model, bool(policy.compile_layers)):
        yield


def resolve_compile(policy: Policy, trainer: TrainerConfig) -> None:
    """``trainer.compile`` for this policy, decided once (at its first update) and said in one line."""
    if policy.compile_layers is not None:
        return
    device = next(policy.model.parameters()).device.type
    policy.compile_layers, line = compile_decision(
        trainer.compile, device=device, total_steps=trainer.total_steps, lora=policy.cfg.lora is not None,
        checkpointing=bool(policy.cfg.gradient_checkpointing),
        sharded=any(hasattr(p, "full_tensor") for p in policy.model.parameters()))  # FSDP2's DTensors
    loud = not policy.compile_layers and (trainer.compile == "on" or "C++" in line)  # asked for, or no compiler
    log.log(logging.WARNING if loud else logging.INFO, "policy %s: %s", policy.name, line)


def adapter_routing(policy: Policy, chunk: Sequence[Row], backward_inside: bool = False):
    """Route each row to its agent's adapter (per-agent LoRA), else do nothing. ``backward_inside``: the
    caller also runs backward inside the context (allowed with gradient checkpointing)."""
    if not policy.adapter_of:
        return contextlib.nullcontext()
    from masrl.models.lora import mixed_adapters

    return mixed_adapters(policy.model, [policy.adapter_of[r.agent] for r in chunk], backward_inside=backward_inside)


def _per_agent_token_mean(values: torch.Tensor, mask: torch.Tensor, chunk: Sequence[Row], name: str,
                          metrics: dict[str, list[float]]) -> None:
    with torch.no_grad():
        sums, counts = (values.detach() * mask).sum(-1), mask.sum(-1)
        for agent in {r.agent for r in chunk}:
            idx = torch.tensor([i for i, r in enumerate(chunk) if r.agent == agent])
            tokens = counts[idx].sum()
            metrics[f"agent/{agent}/{name}"].append(float(sums[idx].sum() / tokens.clamp(min=1)))
            metrics[f"agent/{agent}/{name}{TOKENS}"].append(float(tokens))


def policy_logprobs(policy: Policy, batch: PackedBatch, trainer: TrainerConfig,
                    *, entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The update's ``(logprobs, entropy)`` [n, R] of ``batch`` under the policy (autocast; the caller routes
    rows to per-agent adapters): in chunks from the hidden states (``trainer.logprob_chunk_tokens``,
    masrl.training.logprobs), else from full logits. The entropy is differentiable only when ``entropy_grad``
    (the plain path then skips its graph)."""
    device = batch.input_ids.device
    with autocast(trainer, device):
        fused = response_logprobs(policy.model, batch, trainer.logprob_chunk_tokens, with_entropy=True)
        logits = response_logits(policy.model, batch) if fused is None else None
    if fused is not None:
        return fused
    logprobs, lse = token_logprobs_lse(logits, batch.targets)
    if entropy_grad:
        return logprobs, entropy_from_logits(logits)
    with torch.no_grad():  # a metric only: no graph, and the log-probs' logsumexp reused
        return logprobs, entropy_from_logsumexp(logits.detach(), lse.detach())


def model_logprobs(model: torch.nn.Module, batch: PackedBatch, chunk_tokens: int = 0) -> torch.Tensor:
    """Log-probs [n, R] of ``batch.targets`` under ``model``: chunked (``chunk_tokens`` > 0) or plain."""
    fused = response_logprobs(model, batch, chunk_tokens)
    return fused[0] if fused is not None else token_logprobs(response_logits(model, batch), batch.targets)


@torch.no_grad()
def reference_logprobs(policy: Policy, batch: PackedBatch, chunk_tokens: int = 0) -> torch.Tensor:
    """Log-probs under the reference: the frozen initial copy, or the base with adapters disabled."""
    if policy.ref_model is not None:
        with cpu_attention(policy.ref_model):
            return model_logprobs(policy.ref_model, batch, chunk_tokens)
    if policy.cfg.lora is not None:
        from masrl.models.lora import base_only

        with base_only(policy.model):
            return model_logprobs(policy.model, batch, chunk_tokens)
    raise RuntimeError(f"policy {policy.name}: kl_coef > 0 needs a reference model")
