"""A team built from a config, and what runs it: ``TeamRunner``.

``TeamRunner(cfg)`` checks the config's names (``check_team``), loads the task's data (``load_tasks``),
builds the policies with their engines on the configured runtime (this process, or Ray worker groups) and
the rollout scheduler. It then rolls out a batch of tasks (``TeamRunner.rollout``) and evaluates the
team on benchmarks (``TeamRunner.benches``, the one loop over benchmarks; ``TeamRunner.evaluate``
gives their summaries). ``masrl eval``, ``masrl ensemble collect`` and ``masrl serve`` use one directly;
the trainer (``masrl.trainer.Trainer``) owns one and adds updates, monitors and checkpoints.
"""
from __future__ import annotations

import dataclasses
import os
import random
import sys
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch

from masrl.config import RunConfig
from masrl.errors import ConfigError
from masrl.evaluation.summary import summarize_episodes
from masrl.monitoring.progress import Progress
from masrl.registry_names import check_names
from masrl.rollout.runner import make_call, max_token_chars, repeat_tasks, run_episodes
from masrl.rollout.scheduler import RolloutScheduler
from masrl.runtime import make_runtime
from masrl.tasks.registry import TaskSource, load_bench_tasks, load_task_source, task_supplies
from masrl.usercode.guard import GuardedScore, RewardCounts, RewardLedger, check_failures
from masrl.training.checkpoint import load_eval_checkpoint
from masrl.training.policy import Policy
from masrl.types import Episode, ScoreFn, Task, Turn

__all__ = ["BenchRun", "TeamRunner", "check_team", "fit_context", "load_tasks"]


def check_team(cfg: RunConfig):
    """The run-start check of a config, before anything is loaded or built: its registry names (workflow, task,
    reward), the workflow's agents and prompt templates against the config's. Returns the workflow spec (a
    workflow open to any agents gets the config's). Loads no data: ``load_tasks`` does."""
    from masrl.workflows.base import check_workflow_params, get_workflow

    check_names(cfg)
    spec = get_workflow(cfg.workflow.name)
    if not spec.agents:  # a workflow open to any agents (external): the config's agents are its roles
        if not cfg.agents:
            raise ConfigError(f"workflow {spec.name!r} takes its agents from the config: name at least one "
                              "under agents (the names the program puts in `model`)")
        spec = dataclasses.replace(spec, agents=tuple(cfg.agents))
    missing = [a for a in spec.agents if a not in cfg.agents]
    extra = [a for a in cfg.agents if a not in spec.agents]
    if missing or extra:
        raise ConfigError(f"workflow {spec.name!r} has agents {list(spec.agents)}; the config's "
                          f"agents section is missing {missing} and has unknown {extra}")
    unknown_prompts = sorted(set(cfg.workflow.prompts) - set(spec.prompts))
    if unknown_prompts:
        raise ConfigError(f"workflow.prompts: unknown template(s) {unknown_prompts}; "
                          f"{spec.name} uses {sorted(spec.prompts)}")
    check_workflow_params(spec, cfg.workflow.params, cfg.workflow.prompts, task_supplies(cfg.task.name))
    return spec


def load_tasks(cfg: RunConfig) -> TaskSource:
    """The task's data (train and held-out splits), its score function and teacher: the task source. An
    environment that names its agents (``source.agents``) is checked against the config's: the same names, and an
    agent it never trains served by a policy with ``trainable: false``."""
    source = load_task_source(cfg.task, cfg.sft.teacher)
    if source.agents is not None:
        if set(source.agents) != set(cfg.agents):
            raise ConfigError(f"task {cfg.task.name}: the environment's agents are {sorted(source.agents)} and the "
                              f"config's {sorted(cfg.agents)}; name the same agents (task.params.agents renames)")
        trained = [a for a, ok in source.agents.items() if not ok and cfg.policies[cfg.agents[a].policy].trainable]
        if trained:
            raise ConfigError(f"task {cfg.task.name}: the environment marks agent(s) {trained} frozen "
                              f"(trainable = False) but their policy is trainable; serve them by a policy with "
                              f"trainable: false")
    return source


def fit_context(tasks, policies, agents) -> tuple[list, list[str]]:
    """``(tasks that fit, one reason per task skipped)``: a task is skipped when its question alone is longer
    than some agent's context (the policy's max positions less the agent's max_new_tokens). A question is
    first measured in characters against ``room * max_token_chars`` (never tokenizing a huge one), then in
    tokens when it could be close."""
    budgets = {}
    for agent, acfg in agents.items():
        policy = policies[acfg.policy]
        room = max(policy.max_positions - acfg.max_new_tokens, 0)
        budgets.setdefault((acfg.policy, room), (policy, agent))
    kept, skipped = [], []
    for task in tasks:
        question = task.question if isinstance(task.question, str) else str(task.question)
        for (name, room), (policy, agent) in budgets.items():
            chars = room * max_token_chars(policy.tokenizer)
            if len(question) > chars or (len(question.encode("utf-8", "surrogatepass")) + 8 > room and
                                         len(policy.tokenizer(question, add_special_tokens=False)["input_ids"]) > room):
                skipped.append(f"{task.id}: question of {len(question):,} characters is longer than the context of "
                               f"agent {agent!r} ({room} tokens of policy {name!r} after max_new_tokens)")
                break
        else:
            kept.append(task)
    return kept, skipped


@dataclasses.dataclass
class BenchRun:
    """One benchmark run by ``TeamRunner.benches``: its tasks (those that fit the context), their score
    function, the episodes (``n`` consecutive ones per task), the reward calls' counts, and the tasks skipped."""
    bench: str
    tasks: list[Task]
    score: ScoreFn
    episodes: list[Episode]
    reward_counts: RewardCounts
    skipped: list[str]

    def summary(self, ks: Sequence[int]) -> dict:
        """avg@n, pass@k, maj@k (``k`` in ``ks``), task and episode counts, and the reward calls' counts."""
        out = summarize_episodes(self.episodes, list(ks), bench=self.bench)
        out.update(self.reward_counts.summary())
        return out


def _load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):  # not on this platform
        return None


def busy_cores_note(threads: int, load: float | None, cores: int) -> str:
    """One line when ``trainer.threads`` is unset and torch's threads (one per core) would share busy cores: an
    OpenMP thread that waits on a core another process holds spins, and every parallel op waits for the slowest
    (a SmolLM2 update step once took 35.7 s with 2 threads beside another job, 5.1-6.2 s with 1). Else ''."""
    if load is None or threads <= 1:
        return ""
    idle = max(1, int(cores - load + 0.5))
    if idle >= threads:
        return ""
    return (f"[masrl] trainer.threads is unset, so torch runs {threads} threads while the load average is "
            f"{load:.1f} on {cores} cores: threads that wait on a busy core can slow each step several times over "
            f"(docs/performance.md, \"threads\"); set trainer.threads={idle} (the idle cores) or stop the other work")


class TeamRunner:
    """The team of a config: workflow spec, task source, policies (with their engines) on a runtime, scheduler.

    ``progress``: show progress bars (default ``cfg.logging.progress``). Sets ``trainer.threads`` and seeds
    ``random`` and torch with ``cfg.seed`` before any model is built. ``close`` (or ``with``) releases the
    runtime's workers."""

    def __init__(self, cfg: RunConfig, *, run_dir: Path | None = None, progress: bool | None = None):
        self.cfg = cfg
        self.run_dir = Path(run_dir) if run_dir else cfg.run_dir
        self.show_progress = cfg.logging.progress if progress is None else progress
        if cfg.trainer.threads:
            torch.set_num_threads(cfg.trainer.threads)
        elif cfg.trainer.device == "cpu":
            note = busy_cores_note(torch.get_num_threads(), _load_average(), os.cpu_count() or 1)
            if note:
                print(note, file=sys.stderr)
        random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        self.spec = check_team(cfg)  # names, agents, prompt templates: before anything is loaded or built
        self.source: TaskSource = load_tasks(cfg)
        self.params = {**self.spec.params, **cfg.workflow.params, **self.source.workflow_params}
        self.runtime = make_runtime(cfg, self.run_dir)  # local (this process) or Ray worker groups
        self.policies: dict[str, Policy] = self.runtime.build_policies()
        self.scheduler = RolloutScheduler({n: p.engine for n, p in self.policies.items()},
                                          continuous=cfg.rollout.continuous_batching)
        self.rewards = RewardLedger()  # reward calls, errors and timeouts, taken after each rollout
        self.last_reward_counts = RewardCounts()
        self._eval_seconds: dict[tuple[str, int], float] = {}  # an evaluation's duration: the next one's ETA

    def load_checkpoint(self, path: str | Path) -> Path:
        """The weights of ``RUN_DIR/checkpoints/step_N`` or of ``RUN_DIR``'s newest checkpoint that loads, into
        the policies (``masrl.training.checkpoint.load_eval_checkpoint``); returns the step folder loaded."""
        return load_eval_checkpoint(path, self.policies)

    def call(self, scheduler=None, temperature: float | None = None):
        """``call(agent, prompt) -> Turn`` of this team, generating through ``scheduler`` (default its own)."""
        return make_call(self.policies, self.cfg.agents, scheduler or self.scheduler, temperature)

    def rollout(self, tasks, group_ids, *, temperature: float | None = None, seed: int = 0,
                score=None, on_episode=None, on_turn=None, where: str = "a rollout") -> list[Episode]:
        """The episodes of ``tasks``; their reward calls' counts are left in ``last_reward_counts``, and a rollout
        whose reward calls fail too often stops the run (``RewardError``, naming ``where``)."""
        for i, policy in enumerate(self.policies.values()):
            policy.engine.reseed(seed + i)
        try:
            episodes = run_episodes(self.spec, tasks, group_ids, call=self.call(temperature=temperature),
                                    scheduler=self.scheduler,
                                    score=GuardedScore(score or self.source.score, self.rewards),
                                    prompts=self.cfg.workflow.prompts, params=self.params,
                                    format_penalty=self.cfg.algorithm.format_penalty, on_episode=on_episode,
                                    on_turn=on_turn, tool_timeout_s=self.cfg.tools.timeout_s)
        finally:
            self.last_reward_counts = self.rewards.take()
        check_failures(self.last_reward_counts, self.cfg.task.reward_max_error_share, where)
        return episodes

    def eval_rollout(self, bench: str, tasks, group_ids, *, temperature: float, seed: int, score,
                     show: bool | None = None) -> list[Episode]:
        """``rollout`` of an evaluation, with progress: episodes done, accuracy so far, ETA, and the agent
        turns generated (a workflow's episodes finish together in its last round; its turns once per round)."""
        progress = Progress(self.show_progress if show is None else show, f"eval {bench}", len(tasks),
                            expected_s=self._eval_seconds.get((bench, len(tasks))))
        count = {"correct": 0, "turns": 0}

        def on_episode(episode: Episode) -> None:
            count["correct"] += bool(episode.correct)
            progress.advance(f"correct {count['correct']}/{progress.done + 1}")

        def on_turn(turn: Turn) -> None:
            count["turns"] += 1
            n = count["turns"]
            progress.note(f"{n} agent turn{'' if n == 1 else 's'} generated")

        try:
            return self.rollout(tasks, group_ids, temperature=temperature, seed=seed, score=score,
                                on_episode=on_episode, on_turn=on_turn, where=f"evaluation {bench}")
        finally:
            progress.close()
            self._eval_seconds[(bench, len(tasks))] = progress.elapsed()

    def benches(self, names: Sequence[str], *, n: int, seed: int, limit: int | None = None,
                temperature: float | None = None, strict: bool = False, fit: bool = False,
                show: bool | None = None, error: Callable[[str], Exception] = ConfigError) -> Iterator[BenchRun]:
        """Each benchmark of ``names`` ('test' = the task's held-out split, a math or QA benchmark, a QA file),
        at most ``limit`` tasks, ``n`` samples per task at ``temperature`` (default ``eval.temperature``), the
        sampling streams restarted from ``seed``: one ``BenchRun`` each, as it finishes.

        ``fit``: skip the tasks whose question cannot fit an agent's context (``fit_context``); a benchmark
        with no task (left) is refused with ``error(message)``; ``show``: progress bars (default the runner's)."""
        temperature = self.cfg.eval.temperature if temperature is None else temperature
        for bench in names:
            tasks, score = load_bench_tasks(bench, self.source, self.cfg.task, limit, strict)
            skipped: list[str] = []
            if fit:
                tasks, skipped = fit_context(tasks, self.policies, self.cfg.agents)
            if not tasks:
                raise error(f"--bench {bench}: no tasks loaded" + (f" ({len(skipped)} skipped: {skipped[0]})"
                                                                   if skipped else ""))
            rep, groups = repeat_tasks(tasks, n)
            episodes = self.eval_rollout(bench, rep, groups, temperature=temperature, seed=seed, score=score,
                                         show=show)
            yield BenchRun(bench, tasks, score, episodes, self.last_reward_counts, skipped)

    def evaluate(self, names: Sequence[str], *, ks: Sequence[int], n: int, seed: int, **kw) -> dict[str, dict]:
        """``{bench: summary}`` of ``benches`` (``ks``: the pass@k / maj@k to give, those up to ``n``)."""
        ks = [k for k in ks if k <= n]
        return {run.bench: run.summary(ks) for run in self.benches(names, n=n, seed=seed, **kw)}

    def close(self) -> None:
        """Release the runtime's workers (Ray actors, placement groups); a no-op for the local runtime."""
        self.runtime.close()

    def __enter__(self) -> "TeamRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
