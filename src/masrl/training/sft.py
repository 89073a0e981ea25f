"""Cold-start SFT: teacher demonstrations collected through the workflow itself, so every
prompt a policy is trained on is exactly a prompt the workflow will show it."""
from __future__ import annotations

import asyncio
import logging
import math
import random
from collections import defaultdict
from typing import Callable, Mapping, Sequence

import torch

from masrl.config import AgentConfig, SFTConfig
from masrl.errors import ConfigError, UserInputError
from masrl.rollout.runner import EpisodeError, check_continuation, check_programs, error_share, failed_episode
from masrl.tasks.source import Teacher
from masrl.tools.chat_format import ChatPrompt
from masrl.tools.text import safe_str, valid_text
from masrl.training.distributed import DataParallel
from masrl.training.policy import Policy, use_fused_adamw
from masrl.training.update import Row, autocast_context, micro_batches, model_logprobs, pack_rows, trainer_forward
from masrl.types import Episode, Task, Turn
from masrl.workflows.base import Continuation, ScoreFn, Team, WorkflowSpec
from masrl.workflows.batch_score import scores_in_batches

log = logging.getLogger(__name__)


def from_program(prompt) -> bool:
    """A call an external program made through the gateway (``workflow: external``) without tools: its teacher
    reads the rendered prompt, as a built-in workflow's string prompt (a conversation with tools stays a
    ``ChatPrompt``: the teacher writes its tool calls)."""
    return isinstance(prompt, ChatPrompt) and prompt.meta.get("source") == "gateway" and not prompt.tools


def collect_demonstrations(spec: WorkflowSpec, tasks: Sequence[Task], teacher: Teacher, *,
                           policies: Mapping[str, Policy], agents: Mapping[str, AgentConfig],
                           score: ScoreFn, prompts: Mapping[str, str], params: Mapping,
                           filter_agents: Sequence[str] = (), concurrency: int = 1, need: int | None = None,
                           on_task: Callable[[int, int, int], None] | None = None) -> list[Row]:
    """Run the workflow with the teacher answering every agent call; one row per call.

    Calls of ``filter_agents`` whose own text scores incorrect are left out of the rows
    (rejection-sampled SFT); they still shaped the prompts of the calls after them.
    ``workflow: external``: the program runs with the teacher answering its gateway calls; a call without tools
    shows the teacher the prompt as rendered for the model (``from_program``), so a program that sends a
    built-in workflow's prompts gets that workflow's demonstrations.

    ``concurrency``: tasks run at once (programs behind the gateway wait on their calls); above 1 each task draws
    the teacher's noise from a stream of its own (`TaskStreams`), so the rows do not depend on the order in
    which calls arrive. ``need``: stop after the shortest prefix of ``tasks`` that gives every policy of
    ``agents`` that many rows (SFT draws ``steps x batch_size`` per policy: more are never used; not with
    ``filter_agents``, whose rows are known only once scored); None: every task. ``on_task(tasks_done, turns,
    tasks_expected)`` after each task (progress: the tasks the need is expected to take at the rate so far).

    An episode whose workflow raises gives no rows and the others go on, as in a rollout
    (``masrl.rollout.runner``), under the same budget (``DemonstrationFailures``): the collection stops with one
    line when the failed calls of an agent program or environment reach ``workflow.params.max_error_share`` of
    those made, or when every episode failed. A ``UserInputError`` (a config problem) stops it as it is.
    """
    streams = TaskStreams(teacher) if concurrency > 1 else None
    failures = DemonstrationFailures(spec, params, first_check=min(max(concurrency, 1), len(tasks)))

    async def one(index: int, task: Task) -> list[Turn]:
        async def call(agent: str, prompt) -> Turn:  # a string, a Continuation or a ChatPrompt
            policy = policies[agents[agent].policy]
            system_prompt = valid_text(agents[agent].system_prompt or "") or None  # lone surrogates -> U+FFFD
            shown = prompt
            if isinstance(prompt, Continuation):  # the teacher reads the transcript as the model will see it
                check_continuation(policies, agent, agents[agent].policy, prompt)
                shown = policy.render_prompt(prompt, system_prompt)
            elif from_program(prompt):  # an external program's call: the prompt text the model will see
                shown = policy.render_prompt(prompt, system_prompt)
            if streams is not None:
                streams.use(index)
            text = teacher(agent, shown, task)
            try:
                prompt_ids = policy.encode_prompt(prompt, system_prompt)
            except ConfigError as e:  # a continuation in a chat format: say which agent
                raise ConfigError(f"agent {agent!r}: {e}") from None
            return Turn(agent=agent, policy=policy.name, prompt_ids=prompt_ids, response_ids=policy.encode_response(text),
                        logprobs=[], text=text, prompt_text=shown if isinstance(shown, str) else prompt)

        # the rows carry no reward: a score that judges in batches (an LLM judge) is not called on the final answers
        team = Team(task, spec, call, score, prompts=prompts, params=params, defer_score=scores_in_batches(score))
        try:
            episode = await spec.fn(task, team)
        except UserInputError:
            raise
        except Exception as e:  # noqa: BLE001 - this episode's failure: no rows from it, counted
            failures.add(failed_episode(task, team, e), index, e)
            return []
        failures.add(episode, index)
        return episode.turns

    prefix = _Prefix(len(tasks), None if filter_agents else need, {a.policy for a in agents.values()}, on_task)

    async def all_tasks():
        if concurrency <= 1:  # one task after another: a teacher that draws from one random stream sees the
            for i, task in enumerate(tasks):  # same call order in every process, also when the workflow awaits
                prefix.add(i, await one(i, task))  # threads (a retriever) that finish in any order
                if prefix.enough:
                    break
            return
        queue = iter(enumerate(tasks))

        async def worker():
            for i, task in queue:
                if prefix.enough:
                    return
                prefix.add(i, await one(i, task))

        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(tasks)))))

    try:
        asyncio.run(all_tasks())
    finally:
        if streams is not None:
            streams.restore()
    failures.check(final=True)
    rows = []
    for task, turns in zip(tasks, prefix.results()):
        for t in turns:
            if t.agent in filter_agents and not score(task, t.text)["correct"]:
                continue
            rows.append(Row(t.agent, t.prompt_ids, t.response_ids, [0.0] * len(t.response_ids), 0.0,
                            policy=t.policy))
    return rows


class DemonstrationFailures:
    """The failed episodes of a demonstrations collection, under a rollout's budget (``report_failures`` of
    ``masrl.rollout.runner``): the first is logged with its traceback, and ``check`` (after each episode once
    ``first_check`` have ended, and at the end) stops the collection (``EpisodeError``, one line) when the failed
    calls of an agent program or environment reach ``workflow.params.max_error_share`` of those made
    (``check_programs``), or when every episode has failed."""

    def __init__(self, spec: WorkflowSpec, params: Mapping, first_check: int):
        self.max_share = error_share(params)
        self.spec, self.first_check = spec, first_check
        self.episodes: list[Episode] = []
        self.failed: list[Episode] = []

    def add(self, episode: Episode, index: int, error: BaseException | None = None) -> None:
        episode.episode_id = index
        self.episodes.append(episode)
        if error is not None:
            self.failed.append(episode)
            if len(self.failed) == 1:
                log.error("%s raised; it gives no demonstrations, the other episodes go on; later failures are "
                          "counted without a traceback", self.where(episode), exc_info=error)
        self.check()

    def where(self, episode: Episode) -> str:
        return (f"demonstration episode {episode.episode_id} (task {safe_str(episode.task.id, 100)!r}) of workflow "
                f"{self.spec.name!r}")

    def check(self, final: bool = False) -> None:
        if not self.failed or (not final and len(self.episodes) < self.first_check):
            return
        first = self.failed[0]
        check_programs(self.episodes, self.spec, self.max_share, "the SFT demonstrations", "demonstration episode")
        if len(self.failed) == len(self.episodes):
            raise EpisodeError(f"every demonstration episode failed ({len(self.failed)} of {len(self.episodes)}), "
                               f"so there is nothing to imitate; the first: {first.error} in {self.where(first)}; "
                               "fix the workflow (the traceback of the first failure is logged above)")
        if final:
            log.warning("%d of %d demonstration episodes failed and gave no demonstrations; the first: %s in %s",
                        len(self.failed), len(self.episodes), first.error, self.where(first))


class _Prefix:
    """The turns of the tasks done, kept by task index; ``enough`` once the tasks ``0..k`` (all done) give every
    policy ``need`` turns, and then ``results()`` are those of exactly that prefix, whatever finished after."""

    def __init__(self, total: int, need: int | None, trained: set[str], on_task):
        self.by_task: dict[int, list[Turn]] = {}
        self.total, self.need, self.trained, self.on_task = total, need, trained, on_task
        self.done = 0  # tasks 0..done-1 are all done
        self.counts: dict[str, int] = defaultdict(int)  # turns per policy in that prefix
        self.enough = False
        self.turns = 0

    def add(self, index: int, turns: list[Turn]) -> None:
        self.by_task[index] = turns
        while not self.enough and self.done in self.by_task:
            for t in self.by_task[self.done]:
                self.counts[t.policy] += 1
            self.done += 1
            self.enough = self.need is not None and all(self.counts[p] >= self.need for p in self.trained)
        self.turns += len(turns)
        if self.on_task is not None:
            self.on_task(len(self.by_task), self.turns, self.expected())

    def expected(self) -> int:
        """The tasks the need will take, at the rate of turns per task of the prefix so far (all: no need)."""
        if self.need is None or not self.done:
            return self.total
        rates = [self.counts[p] / self.done for p in self.trained]
        if not all(rates):
            return self.total
        return min(self.total, max(self.done, max(math.ceil(self.need / r) for r in rates)))

    def results(self) -> list[list[Turn]]:
        """The turns of each task of the prefix (every task when the need was never met), in task order."""
        return [self.by_task.get(i, []) for i in range(self.done if self.enough else self.total)]


class TaskStreams:
    """A teacher's random stream per task, for demonstrations collected concurrently: a teacher whose noise
    comes from a ``random.Random`` in its ``rng`` attribute (the built-in ones; ``teacher`` may be its bound
    ``reply``) draws the calls of task ``i`` from a stream seeded by its own first draw and ``i``. A teacher
    without one is left as it is (its draws then follow the order in which calls arrive)."""

    def __init__(self, teacher: Teacher):
        owner = getattr(teacher, "__self__", teacher)
        self.owner = owner if isinstance(getattr(owner, "rng", None), random.Random) else None
        self.original = self.owner.rng if self.owner is not None else None
        self.base = self.original.getrandbits(64) if self.original is not None else 0
        self.streams: dict[int, random.Random] = {}

    def use(self, index: int) -> None:
        """Task ``index``'s stream for the next teacher call (calls are synchronous: nothing interleaves)."""
        if self.owner is not None:
            if index not in self.streams:
                self.streams[index] = random.Random(f"{self.base}:{index}")
            self.owner.rng = self.streams[index]

    def restore(self) -> None:
        if self.owner is not None:
            self.owner.rng = self.original


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
        if policies[r.policy].cfg.trainable:  # a frozen policy's demonstrations (an environment's fixed judge) stay out
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
