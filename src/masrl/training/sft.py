"""Cold-start SFT: teacher demonstrations collected through the workflow itself, so every
prompt a policy is trained on is exactly a prompt the workflow will show it."""
from __future__ import annotations

import asyncio
import math
import random
from collections import defaultdict
from typing import Callable, Mapping, Sequence

import torch

from masrl.config import AgentConfig, SFTConfig
from masrl.errors import ConfigError
from masrl.rollout.runner import check_continuation
from masrl.tasks.source import Teacher
from masrl.tools.chat_format import ChatPrompt
from masrl.tools.text import valid_text
from masrl.training.distributed import DataParallel
from masrl.training.policy import Policy, use_fused_adamw
from masrl.training.update import Row, autocast_context, micro_batches, model_logprobs, pack_rows, trainer_forward
from masrl.types import Task, Turn
from masrl.workflows.base import Continuation, ScoreFn, Team, WorkflowSpec
from masrl.workflows.batch_score import scores_in_batches


def from_program(prompt) -> bool:
    """A call an external program made through the gateway (``workflow: external``) without tools: its teacher
    reads the rendered prompt, as a built-in workflow's string prompt (a conversation with tools stays a
    ``ChatPrompt``: the teacher writes its tool calls)."""
    return isinstance(prompt, ChatPrompt) and prompt.meta.get("source") == "gateway" and not prompt.tools


def collect_demonstrations(spec: WorkflowSpec, tasks: Sequence[Task], teacher: Teacher, *,
                           policies: Mapping[str, Policy], agents: Mapping[str, AgentConfig],
                           score: ScoreFn, prompts: Mapping[str, str], params: Mapping,
                           filter_agents: Sequence[str] = ()) -> list[Row]:
    """Run the workflow with the teacher answering every agent call; one row per call.

    Calls of ``filter_agents`` whose own text scores incorrect are left out of the rows
    (rejection-sampled SFT); they still shaped the prompts of the calls after them.
    ``workflow: external``: the program runs with the teacher answering its gateway calls; a call without tools
    shows the teacher the prompt as rendered for the model (:func:`from_program`), so a program that sends a
    built-in workflow's prompts gets that workflow's demonstrations.
    """

    async def one(task: Task) -> list[Turn]:
        async def call(agent: str, prompt) -> Turn:  # a string, a Continuation or a ChatPrompt
            policy = policies[agents[agent].policy]
            system_prompt = valid_text(agents[agent].system_prompt or "") or None  # lone surrogates -> U+FFFD
            shown = prompt
            if isinstance(prompt, Continuation):  # the teacher reads the transcript as the model will see it
                check_continuation(policies, agent, agents[agent].policy, prompt)
                shown = policy.render_prompt(prompt, system_prompt)
            elif from_program(prompt):  # an external program's call: the prompt text the model will see
                shown = policy.render_prompt(prompt, system_prompt)
            text = teacher(agent, shown, task)
            try:
                prompt_ids = policy.encode_prompt(prompt, system_prompt)
            except ConfigError as e:  # a continuation in a chat format: say which agent
                raise ConfigError(f"agent {agent!r}: {e}") from None
            return Turn(agent=agent, policy=policy.name, prompt_ids=prompt_ids, response_ids=policy.encode_response(text),
                        logprobs=[], text=text, prompt_text=shown if isinstance(shown, str) else prompt)

        # the rows carry no reward: a score that judges in batches (an LLM judge) is not called on the final answers
        team = Team(task, spec, call, score, prompts=prompts, params=params, defer_score=scores_in_batches(score))
        return (await spec.fn(task, team)).turns

    async def all_tasks():  # one task after another: a teacher that draws from one random stream
        # (noise, wrong answers) must see the same call order in every process, also when the
        # workflow awaits threads (a retriever) that finish in any order
        return [await one(t) for t in tasks]

    rows = []
    for task, turns in zip(tasks, asyncio.run(all_tasks())):
        for t in turns:
            if t.agent in filter_agents and not score(task, t.text)["correct"]:
                continue
            rows.append(Row(t.agent, t.prompt_ids, t.response_ids, [0.0] * len(t.response_ids), 0.0,
                            policy=t.policy))
    return rows


def run_sft(policies: Mapping[str, Policy], rows: Sequence[Row], cfg: SFTConfig, *, seed: int,
            micro_batch_tokens: int, on_step: Callable[[int, dict], None] | None = None,
            dp: DataParallel | None = None, logprob_chunk_tokens: int = 0,
            autocast: str | None = None) -> dict[str, float]:
    """Token-mean cross-entropy on response tokens, per policy, AdamW + warmup/cosine.

    ``dp``: one rank of a data-parallel group: every rank draws the same batch, trains on its
    share and the gradients are all-reduced before clipping (masrl.training.distributed).
    ``logprob_chunk_tokens``: as ``trainer.logprob_chunk_tokens`` (0: full logits); ``autocast``: as
    ``trainer.autocast`` (the forward under ``torch.autocast``; ``auto`` resolved for the model's device; None:
    float32). The optimizer is AdamW with the policy's ``optim.fused`` setting.
    """
    by_policy: dict[str, list[Row]] = defaultdict(list)
    for r in rows:
        by_policy[r.policy].append(r)
    rngs = {name: random.Random(seed) for name in by_policy}  # per policy: same batches in any runtime
    optims, unfrozen = {}, {}
    for name in by_policy:
        policy = policies[name]
        if cfg.train_base and policy.cfg.lora is not None:  # cold start of the base under the adapters
            unfrozen[name] = [p for p in policy.model.parameters() if not p.requires_grad]
            for p in unfrozen[name]:
                p.requires_grad_(True)
            policy.base_trained = True
        params = list(policy.trainable_parameters())
        optims[name] = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0,
                                         **({"fused": True} if use_fused_adamw(policy.cfg.optim.fused, params) else {}))
    last: dict[str, float] = {}
    for step in range(cfg.steps):
        warm = min(1.0, (step + 1) / max(cfg.warmup_steps, 1))
        decay = 0.5 * (1 + math.cos(math.pi * step / max(cfg.steps, 1)))
        for name, prows in by_policy.items():
            policy = policies[name]
            policy.model.train()
            opt = optims[name]
            for group in opt.param_groups:
                group["lr"] = cfg.lr * warm * (0.1 + 0.9 * decay)
            batch_rows = [prows[rngs[name].randrange(len(prows))] for _ in range(cfg.batch_size)]
            total = sum(len(r.response_ids) for r in batch_rows)
            opt.zero_grad(set_to_none=True)
            loss_sum = 0.0
            for chunk in micro_batches(dp.shard(batch_rows) if dp else batch_rows, micro_batch_tokens):
                if policy.adapter_of:  # per-agent LoRA: contiguous rows per adapter (others keep their order,
                    chunk.sort(key=lambda r: r.agent)  # so their SFT sums stay bitwise what they were)
                batch = pack_rows(chunk, int(policy.tokenizer.pad_token_id), next(policy.model.parameters()).device)
                # per-agent LoRA: each demonstration trains its own agent's adapter (outside the routing only the
                # first adapter is active); backward inside it, for gradient checkpointing's recomputation
                with trainer_forward(policy, chunk, backward_inside=True):
                    with autocast_context(autocast, batch.input_ids.device):
                        logp = model_logprobs(policy.model, batch, logprob_chunk_tokens)
                    nll = -(logp * batch.response_mask).sum() / total
                    nll.backward()
                loss_sum += float(nll.detach())
            if dp is not None:
                params = policy.trainable_parameters()
                grads = [q.grad if q.grad is not None else torch.zeros_like(q) for q in params]
                loss = torch.tensor([loss_sum])
                dp.all_reduce_([*grads, loss])
                for q, g in zip(params, grads):
                    q.grad = g
                loss_sum = float(loss)
            torch.nn.utils.clip_grad_norm_(policy.trainable_parameters(), 1.0)
            opt.step()
            last[f"sft/{name}/loss"] = loss_sum
        if on_step is not None:
            on_step(step, last)
    for params in unfrozen.values():
        for p in params:
            p.requires_grad_(False)
    return last
