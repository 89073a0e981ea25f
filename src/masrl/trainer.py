"""The training loop. One RL step reads like the data path (docs/training.md):

1. sample B tasks, each repeated G times (a group);
2. run every episode's workflow concurrently, agent calls batched per policy;
3. score turns: team reward to every turn, minus the format penalty on invalid turns;
4. advantages once over all turns of the step;
5. per policy, one update on the turns of every agent mapped to it;
6. metrics, checkpoints, periodic evaluation.
"""
from __future__ import annotations

import contextlib
import functools
import json
import random
import statistics
import sys
import time
import warnings
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path
from typing import Sequence

import torch

from masrl.algorithms import compute_advantages
from masrl.config import RunConfig, dump_config
from masrl.errors import ConfigError
from masrl.io.atomic import write_text_atomic
from masrl.paths import check_output_dir
from masrl.evaluation.metrics import stage_name
from masrl.evaluation.summary import agent_facts
from masrl.judges import judge_metrics
from masrl.monitoring.drift import RoleDriftTracker
from masrl.monitoring.logger import MetricsLogger
from masrl.monitoring.progress import Progress
from masrl.monitoring.trackers import make_trackers
from masrl.monitoring.collapse import CollapseMonitor
from masrl.monitoring.signal import NoSignalError, NoSignalWarning, SignalMonitor
from masrl.monitoring.spike import RoleCaptureMonitor, SpikeDetector
from masrl.rollout.engine import TransformersEngine
from masrl.rollout.runner import repeat_tasks, rollout_metrics
from masrl.rollout.versioned import RolloutsAhead
from masrl.team_runner import TeamRunner
from masrl.training import checkpoint as ckpt
from masrl.runtime import WorkerGroupError
from masrl.runtime.malloc import trim, tune_malloc
from masrl.training.batch_select import BatchSelector, agent_ids, shape_scores
from masrl.training.conversation import merge_extending_rows
from masrl.training.sft import collect_demonstrations
from masrl.training.update import Row
from masrl.types import Episode, Turn
from masrl.usercode.guard import GuardedScore, RewardError, check_failures
from masrl.versions import library_versions, versions_comment


def _step_seed(seed: int, step: int, salt: int = 0) -> int:
    return (seed * 1_000_003 + step * 7919 + salt * 104_729) % (2**63 - 1)


class _OfTeam:
    """``trainer.<name>``: the attribute of that name of the trainer's ``TeamRunner``, read and set."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, trainer, owner=None):
        return self if trainer is None else getattr(trainer.team, self.name)

    def __set__(self, trainer, value) -> None:
        setattr(trainer.team, self.name, value)


def role_stage(algo, step: int) -> int | None:
    """The index in ``algo.role_stages`` of the group RL step ``step`` (1-based) trains (None: no stages)."""
    return None if algo.role_stages is None else (step - 1) // algo.role_stage_steps % len(algo.role_stages)


def training_agents(algo, step: int) -> set[str] | None:
    """The agents RL step ``step`` (1-based) trains under ``algo.role_stages`` (None: every agent)."""
    stage = role_stage(algo, step)
    return None if stage is None else set(algo.role_stages[stage])


class Trainer:
    """RL for the team of a config: one ``TeamRunner`` (the team, its rollout and
    evaluation) plus the update, the monitors (spikes, role capture, drift, collapse), checkpoints and the
    allocator's tuning."""

    def __init__(self, cfg: RunConfig, *, run_dir: Path | None = None, progress: bool | None = None):
        self.cfg = cfg
        if cfg.trainer.tune_malloc:  # before any model is built (masrl.runtime.malloc)
            tune_malloc("lean" if cfg.trainer.tune_malloc == "lean" else "fast")
        self.team = TeamRunner(cfg, run_dir=run_dir, progress=progress)
        if cfg.trainer.memory_defaults:  # each batch an in-process engine decodes ends at a phase boundary too
            for policy in self.team.policies.values():
                if isinstance(getattr(policy, "engine", None), TransformersEngine):
                    policy.engine.after_batch = functools.partial(phase_trim, cfg)
        self.run_dir, self.show_progress = self.team.run_dir, self.team.show_progress
        mon = cfg.monitoring
        self.drift = RoleDriftTracker() if mon.drift else None
        self.spikes = SpikeDetector(window=mon.spike.window, threshold=mon.spike.threshold,
                                    min_history=mon.spike.min_history, action=mon.spike.action)
        self.capture = RoleCaptureMonitor(mon.capture_threshold, mon.capture_patience)
        self.collapse = CollapseMonitor(list(cfg.agents), **mon.collapse.model_dump())
        self.signal = SignalMonitor(**mon.no_signal.model_dump())  # steps where every advantage is 0
        self.selector = BatchSelector(cfg)  # algorithm.dynamic_sampling, algorithm.overlong
        self.ahead: RolloutsAhead | None = None  # rollout.max_staleness > 0: batches generated beside the update
        self.rolled_back_to: int | None = None  # monitoring.collapse.action: rollback
        self.step = 0
        self.versions = library_versions()  # masrl (git sha) and key libraries, recorded in the run folder
        self.history: dict[str, dict] = {}  # evaluation results by label ("sft", "final", ...)
        self.logger: MetricsLogger | None = None

    # the team's parts, by their names on the trainer too (read and set: a spy on trainer.rollout sees every rollout)
    spec, source, params, runtime = _OfTeam(), _OfTeam(), _OfTeam(), _OfTeam()
    policies, scheduler, rollout = _OfTeam(), _OfTeam(), _OfTeam()

    # ------------------------------------------------------------------ stages
    def score_turns(self, episodes: Sequence[Episode]) -> tuple[list[Turn], list[tuple[int, int]], torch.Tensor]:
        """Every turn gets the team reward (``algorithm.reward: per_turn``: its own reward when the reward
        function set one, weighted by ``class_weights`` where the workflow labelled its class), minus the
        format penalty if it is invalid."""
        turns, keys, team_rewards, scores = [], [], [], []
        penalty = self.cfg.algorithm.format_penalty
        per_turn = self.cfg.algorithm.reward == "per_turn"
        for e in episodes:
            for t in e.turns:
                turns.append(t)
                keys.append((e.group_id, e.episode_id))
                team_rewards.append(e.reward)
        weights = class_weights(turns) if per_turn else {}
        for t, team_reward in zip(turns, team_rewards):
            base = t.reward * weights.get(id(t), 1.0) if per_turn and t.reward is not None else team_reward
            scores.append(base - (0.0 if t.valid else penalty))
        return turns, keys, shape_scores(self.cfg, turns, torch.tensor(scores, dtype=torch.float32))

    def advantages(self, turns, keys, scores) -> torch.Tensor:
        a = self.cfg.algorithm
        return compute_advantages(scores, group_ids=[k[0] for k in keys], agent_ids=agent_ids(turns, a.group_by),
                                  episode_ids=[k[1] for k in keys], estimator=a.estimator,
                                  turn_index=[t.turn_index for t in turns], eps=a.eps,
                                  unbiased_std=a.unbiased_std, singleton=a.singleton)

    def update(self, turns, advantages) -> dict[str, float]:
        rows: dict[str, list[Row]] = defaultdict(list)
        training = training_agents(self.cfg.algorithm, self.step + 1)  # the step metrics.jsonl gives this update
        for t, adv in zip(turns, advantages.tolist()):
            if t.response_ids and (training is None or t.agent in training):
                rows[t.policy].append(Row(t.agent, t.prompt_ids, t.response_ids, t.logprobs, adv,
                                          t.info.get("temperature", 1.0), policy=t.policy))
        rows = {name: rows[name] for name, policy in self.policies.items() if policy.cfg.trainable and rows.get(name)}
        if self.cfg.trainer.merge_conversations:  # an agent's extending turns as one sequence (tool output masked)
            rows = {name: merge_extending_rows(r) for name, r in rows.items()}
        phase_trim(self.cfg)  # a phase boundary: the rollout's free heap back to the kernel (masrl.runtime.malloc)
        return self.runtime.update(self.policies, rows, step=self.step, guard=self.spikes.guard,
                                   track_kl=self.cfg.monitoring.kl_to_base)

    def monitor(self, episodes, turns, metrics: dict[str, float]) -> None:
        """Per-role instruments: drift vs step 0, verdict accuracy, role grad spikes, role capture."""
        if self.drift is not None:
            metrics.update(self.drift.update(turns, self.step))
        metrics.update({k: v for k, v in agent_facts(episodes).items() if k.endswith(("accuracy", "precision",
                                                                                       "recall"))})
        for agent in self.cfg.agents:
            norm = metrics.get(f"agent/{agent}/grad_norm")
            if norm is not None and self.spikes.check(f"agent/{agent}", norm, self.step).is_spike:
                metrics[f"agent/{agent}/grad_spike"] = 1.0
        for policy in self.policies.values():
            if len(policy.agents) > 1:
                norms = {a: metrics[f"agent/{a}/grad_norm"] for a in policy.agents
                         if f"agent/{a}/grad_norm" in metrics}
                for event in self.capture.update(self.step, norms):
                    metrics[f"agent/{event.role}/role_capture"] = 1.0
        for collapse in self.collapse.update(self.step + 1, metrics):  # the step number metrics.jsonl gives it
            metrics[f"collapse/{collapse.signal}"] = 1.0

    def evaluate(self, label: str) -> dict[str, float]:
        """The held-out split and every ``eval.benches`` benchmark (``TeamRunner.evaluate``, as ``masrl
        eval``). Returns flat ``eval/<bench>/<metric>`` values; ``history[label]`` keeps the held-out split's."""
        ecfg = self.cfg.eval
        phase_trim(self.cfg)  # phase boundaries, before and after (masrl.runtime.malloc)
        with self.ahead.pause() if self.ahead else contextlib.nullcontext():  # no batch generated meanwhile
            results = self.team.evaluate(["test", *ecfg.benches], ks=ecfg.k, n=ecfg.n, limit=ecfg.limit,
                                         seed=_step_seed(self.cfg.seed, 0, 99))
        phase_trim(self.cfg)
        self.history[label] = results["test"]
        return {f"eval/{bench}/{k}": v for bench, summary in results.items() for k, v in summary.items()}

    # ------------------------------------------------------------------ loop
    def sft(self) -> None:
        cfg = self.cfg
        if cfg.sft.steps == 0:
            return
        if self.source.teacher is None:
            raise ConfigError(f"sft.steps > 0 but task {cfg.task.name!r} has no teacher for demonstrations")
        unknown = sorted(set(cfg.sft.filter_agents) - set(cfg.agents))
        if unknown:
            raise ConfigError(f"sft.filter_agents: unknown agents {unknown}; agents: {sorted(cfg.agents)}")
        try:
            rows = demonstrations(self)
        finally:
            counts = self.team.rewards.take()
        check_failures(counts, cfg.task.reward_max_error_share, "the SFT demonstrations")
        progress = Progress(self.show_progress, "SFT", cfg.sft.steps)

        def on_step(step: int, m: dict):
            progress.advance(", ".join(f"{k.split('/')[1]} loss {v:.3f}" for k, v in m.items()))
            if step % 10 == 0 or step == cfg.sft.steps - 1:
                self.logger.log(step, m, phase="sft")

        self.runtime.sft(self.policies, rows, on_step=on_step)
        progress.close()
        phase_trim(self.cfg)

    def collect(self, step: int) -> tuple[list[Episode], object]:
        """Stages 1-2 of RL step ``step`` (0-based): sample the tasks and roll out their groups (refilled under
        dynamic sampling); with the reward calls' counts."""
        cfg = self.cfg
        rng = random.Random(_step_seed(cfg.seed, step, 1))
        batch = rng.sample(self.source.train, min(cfg.trainer.batch_size, len(self.source.train)))
        tasks, groups = repeat_tasks(batch, cfg.trainer.group_size)
        episodes = self.rollout(tasks, groups, seed=_step_seed(cfg.seed, step, 2), where=f"step {step + 1}")
        episodes = self.selector.refill(self, episodes, batch, rng, seed=_step_seed(cfg.seed, step, 2), step=step)
        return episodes, self.team.last_reward_counts

    def train_step(self) -> dict[str, float]:
        cfg, t0 = self.cfg, time.perf_counter()
        self.runtime.step = self.step
        tokens_before = self.scheduler.stats.generated_tokens
        failures_before = self.scheduler.stats.engine_failures
        judge_metrics(self.source.score)  # the judge's counters start afresh (an evaluation may have used it)
        try:  # rollout.max_staleness: this step's batch was generated while earlier steps trained
            episodes, reward_counts = self.ahead.take(self.step) if self.ahead else self.collect(self.step)
        except RewardError as e:  # the failing step's counts are kept in metrics.jsonl too
            if self.logger is not None:
                self.logger.log(self.step + 1, e.counts.metrics())
            raise
        self.runtime.phase_end()
        t_rollout = time.perf_counter() - t0
        judged = judge_metrics(self.source.score)  # judge/* metrics; stops the run when every judge call failed
        turns, keys, scores = self.score_turns(episodes)
        advantages = self.advantages(turns, keys, scores)
        t1 = time.perf_counter()
        stale = self.ahead.check(turns) if self.ahead else {}  # the staleness bound, before the update
        loss_turns, loss_advantages, selected = self.selector.select(turns, keys, scores, advantages)
        metrics = {**self.update(loss_turns, loss_advantages), **selected, **stale}
        if self.ahead:
            self.ahead.finished_update(self.step)
        t_update = time.perf_counter() - t1
        if cfg.algorithm.role_stages is not None:  # which group of agents this step trained
            metrics["train/role_stage"] = float(role_stage(cfg.algorithm, self.step + 1))
        metrics.update(step_metrics(episodes, turns, scores, advantages))
        metrics.update(self.signal.update(self.step + 1, episodes, advantages))
        metrics.update(reward_counts.metrics())
        metrics.update(rollout_metrics(episodes))  # failed episodes, tool calls and their errors / timeouts
        # batches an engine raised on (their requests failed; the episodes that waited on them are in episode_errors)
        metrics["rollout/engine_failures"] = float(self.scheduler.stats.engine_failures - failures_before)
        self.monitor(episodes, turns, metrics)
        generated = self.scheduler.stats.generated_tokens - tokens_before
        trained = sum(len(t.response_ids) + len(t.prompt_ids) for t in turns)
        metrics.update({"perf/rollout_seconds": t_rollout, "perf/update_seconds": t_update,
                        "perf/step_seconds": time.perf_counter() - t0,
                        "perf/rollout_tokens_per_s": generated / max(t_rollout, 1e-9),
                        "perf/train_tokens_per_s": trained / max(t_update, 1e-9),
                        "perf/rss_mib": _rss_mib(), "perf/peak_rss_mib": _peak_rss_mib()})
        if judged:  # the judge scores inside the rollout: its share of the step
            metrics.update(judged)
            metrics["perf/judge_share"] = judged["perf/judge_seconds"] / max(metrics["perf/step_seconds"], 1e-9)
        return metrics

    def fit(self, resume: bool = False, overwrite: bool = False) -> dict:
        cfg = self.cfg
        check_output_dir(self.run_dir, "run folder")
        if resume and not ckpt.list_checkpoints(self.run_dir):  # it stopped before its first checkpoint
            print(f"[masrl] --resume: {self.run_dir} holds no checkpoint (the run stopped before its first one); "
                  "starting it from the beginning", file=sys.stderr)
            resume, overwrite = False, True
        if not resume:
            prepare_run_dir(self.run_dir, overwrite)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        start_step = 0
        if resume:
            start_step = resume_from_checkpoint(self)
        else:
            write_text_atomic(self.run_dir / "config.yaml", versions_comment(self.versions) + dump_config(cfg))
        record_versions(self.run_dir, self.versions, resumed_at=start_step if resume else None)
        trackers = make_trackers(cfg.logging, name=cfg.name, run_dir=self.run_dir, resume=resume,
                                 config=cfg.model_dump(mode="json"))
        # a finished run resumed: its final evaluation is done again only when its checkpoint lacks it (saved
        # before it), and then its record is replaced, not repeated
        finished = resume and start_step >= cfg.trainer.total_steps
        final_done = finished and "final" in self.history
        if finished:
            print(f"[masrl] the run is complete (step {start_step} of {cfg.trainer.total_steps}); raise "
                  "trainer.total_steps to train on", file=sys.stderr)
        self.logger = MetricsLogger(self.run_dir, "tensorboard" in cfg.logging.sinks,
                                    resume_from_step=start_step if resume else None, trackers=trackers,
                                    redo_eval_at_resume_step=finished and not final_done)
        try:
            if not resume:
                self.sft()
                if cfg.eval.before_after and self.source.test:
                    self.logger.log(0, self.evaluate("sft"), phase="eval")
                self.save(0)
            self.step = start_step
            self.ahead = rollouts_ahead(self)
            progress = Progress(self.show_progress, "RL", cfg.trainer.total_steps, completed=start_step)
            while self.step < cfg.trainer.total_steps:
                metrics = self.train_step()
                self.step += 1
                self.logger.log(self.step, metrics)
                progress.advance(_progress_text(metrics, self.cfg.agents))
                if self.signal.stop_message:  # monitoring.no_signal.action: stop (the step is logged)
                    raise NoSignalError(self.signal.stop_message)
                if cfg.eval.every and self.step % cfg.eval.every == 0 and self.step < cfg.trainer.total_steps:
                    self.logger.log(self.step, self.evaluate(f"step_{self.step}"), phase="eval")
                if cfg.trainer.save_every and self.step % cfg.trainer.save_every == 0:
                    self.save(self.step)
                if self.collapse.stop_requested:
                    if self.ahead:  # no batch generated for a step that will not train, none beside the restore
                        self.ahead.close()
                    end_on_collapse(self)
                    break
            progress.close()
            if cfg.eval.before_after and self.source.test and not final_done:
                if self.step == 0 and "sft" in self.history:  # no RL step: the same weights and evaluation seed
                    self.history["final"] = self.history["sft"]
                else:
                    self.logger.log(self.step, self.evaluate("final"), phase="eval")
            if self.rolled_back_to is None and (not cfg.trainer.save_every or self.step % cfg.trainer.save_every):
                self.save(self.step)
        except WorkerGroupError as e:
            raise WorkerGroupError(f"{e}; the run can go on from its last checkpoint: "
                                   f"masrl train --resume {self.run_dir}") from e
        finally:
            if self.ahead:
                self.ahead.close()
            self.logger.close()
        report = write_report(self)
        never_rewarded = self.signal.final_warning()  # such a run does not end quietly
        if never_rewarded:
            warnings.warn(never_rewarded, NoSignalWarning, stacklevel=2)
        if cfg.trainer.export:  # the end-of-run hook: the one place the driver reaches the export package
            from masrl.export import ExportError, export_run

            try:
                report["export"] = str(export_run(self.run_dir, self.run_dir / "export", step=self.rolled_back_to,
                                                  overwrite=True))
            except Exception as e:  # the run itself is complete: say so, and how to export it again
                raise ExportError(f"the run finished and is saved in {self.run_dir}, but trainer.export failed "
                                  f"({type(e).__name__}: {e}); retry with `masrl export {self.run_dir} "
                                  f"--out {self.run_dir / 'export'} --overwrite`") from e
        return report

    def close(self) -> None:
        """Release the runtime's workers (Ray actors, placement groups); a no-op for the local runtime."""
        self.team.close()

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def save(self, step: int) -> Path:
        state = {"history": self.history, "spikes": self.runtime.spike_state(self.spikes.state_dict()),
                 "collapse": self.collapse.state_dict(), "signal": self.signal.state_dict(),
                 **({"drift": self.drift.state_dict()} if self.drift is not None else {})}
        return ckpt.save_checkpoint(self.run_dir, step, self.policies, state, keep=self._keep_checkpoints())

    def _keep_checkpoints(self) -> int:
        """``trainer.keep_checkpoints``; under collapse rollback also enough to keep one saved before a run of
        breaches (at most ``patience // save_every + 1`` checkpoints are saved during one)."""
        keep, collapse = self.cfg.trainer.keep_checkpoints, self.cfg.monitoring.collapse
        if collapse.action == "rollback":
            keep = max(keep, collapse.patience // max(self.cfg.trainer.save_every, 1) + 2)
        return keep


def demonstrations(trainer: Trainer) -> list[Row]:
    """The cold start's rows: the workflow run with the task's teacher answering. ``workflow: external`` (programs
    behind the gateway, slow per task): ``sft.concurrency`` programs at once, with progress and ETA, and only the
    tasks that give every policy the ``sft.steps x sft.batch_size`` rows SFT draws."""
    cfg = trainer.cfg
    external = cfg.workflow.name in ("external", "environment")  # episodes of programs behind the gateway
    progress = Progress(trainer.show_progress and external, "demonstrations", len(trainer.source.train))

    def on_task(done: int, turns: int, expected: int) -> None:
        progress.set_total(expected)
        progress.advance(f"{turns} agent calls answered by the teacher")

    rows = collect_demonstrations(trainer.spec, trainer.source.train, trainer.source.teacher,
                                  policies=trainer.policies, agents=cfg.agents,
                                  score=GuardedScore(trainer.source.score, trainer.team.rewards),
                                  prompts=cfg.workflow.prompts, params=trainer.params,
                                  filter_agents=cfg.sft.filter_agents,
                                  concurrency=cfg.sft.concurrency if external else 1,
                                  need=cfg.sft.steps * cfg.sft.batch_size if external else None, on_task=on_task)
    progress.close()
    if external:
        print(f"[masrl] {len(rows)} demonstrations in {progress.elapsed():.0f}s, {progress.done} of the "
              f"{len(trainer.source.train)} training tasks run (SFT draws {cfg.sft.steps} x {cfg.sft.batch_size} "
              "per policy; sft.concurrency programs at once)", flush=True)
    return rows


def resume_from_checkpoint(trainer: Trainer) -> int:
    """Load the newest valid checkpoint of the trainer's run folder (weights, optimizer, RNG, evaluation
    history, monitors' states) into it; returns its step."""
    found = ckpt.load_latest_checkpoint(trainer.run_dir, trainer.policies)  # falls back past broken ones
    if found is None:
        raise ckpt.CheckpointError(f"--resume: no valid checkpoint under {trainer.run_dir / 'checkpoints'}")
    path, state = found
    ckpt.set_rng_state(state["rng"])
    trainer.history = state.get("history", {})
    if trainer.drift is not None and "drift" in state:
        trainer.drift.load_state_dict(state["drift"])
    if "spikes" in state:
        trainer.spikes.load_state_dict(state["spikes"])
        trainer.runtime.load_spike_state(state["spikes"])
    if "collapse" in state:
        trainer.collapse.load_state_dict(state["collapse"])
    trainer.signal.load_state_dict(state.get("signal", {}))
    print(f"[masrl] resumed from {path} (step {state['step']})")
    return int(state["step"])


def phase_trim(cfg) -> None:
    """``trainer.memory_defaults``: the heap's free memory back to the kernel at a phase boundary (under the fast
    allocator; bitwise the same results, each trim costs the next phase its page faults again)."""
    if cfg.trainer.memory_defaults:
        trim()


def end_on_collapse(trainer: Trainer) -> None:
    """``monitoring.collapse.action`` stop / rollback: RL ends after this step; rollback restores the
    newest checkpoint saved before the first breach (its weights only: RL does not go on)."""
    event, action = trainer.collapse.stop_event, trainer.cfg.monitoring.collapse.action
    print(f"[masrl] RL ends at step {trainer.step} of {trainer.cfg.trainer.total_steps}: {event.describe()} "
          f"(monitoring.collapse.action: {action})", file=sys.stderr)
    if action != "rollback":
        return
    first = trainer.collapse.first_breach()
    for path in reversed([p for p in ckpt.list_checkpoints(trainer.run_dir) if int(p.name[5:]) < first]):
        try:
            ckpt.load_checkpoint(path, trainer.policies, load_optimizer=False)
        except ckpt.CheckpointError as e:
            print(f"[masrl] rollback: skipping checkpoint: {e}", file=sys.stderr)
            continue
        trainer.rolled_back_to = int(path.name[5:])
        print(f"[masrl] rolled back to the weights of step {trainer.rolled_back_to} ({path}); the final "
              "evaluation, report and export are of those weights", file=sys.stderr)
        return
    print(f"[masrl] rollback: no loadable checkpoint before step {first}; keeping the weights of step "
          f"{trainer.step}", file=sys.stderr)


def rollouts_ahead(trainer: Trainer) -> RolloutsAhead | None:
    """``rollout.max_staleness`` > 0: every policy's engine behind a version counter, on its own weights (replaced
    at each version boundary; in the worker groups with the Ray runtime), and the producer of the coming steps'
    batches (``masrl.rollout.versioned``)."""
    cfg = trainer.cfg
    if cfg.rollout.max_staleness == 0:
        return None
    if cfg.runtime.kind == "ray" and cfg.runtime.strategy == "fsdp":
        raise ConfigError(f"rollout.max_staleness: {cfg.rollout.max_staleness} needs runtime.strategy: replica "
                          "(under fsdp every forward is a collective of the group, which generation beside the "
                          "update would interleave with the update's); set rollout.max_staleness: 0 for fsdp")
    trainer.runtime.version_rollouts(trainer.policies)
    for name, policy in trainer.policies.items():
        trainer.scheduler.engines[name] = policy.engine
    return RolloutsAhead(trainer.collect, first_step=trainer.step, last_step=cfg.trainer.total_steps,
                         max_staleness=cfg.rollout.max_staleness, stale=cfg.rollout.stale,
                         versions=lambda: {n: p.engine.version for n, p in trainer.policies.items()})


RUN_OUTPUTS = ("metrics.jsonl", "checkpoints", "tensorboard", "plots", "report.md", "report.json", "config.yaml",
               "trackers.json", "wandb", "mlruns", "versions.json")


def prepare_run_dir(run_dir: Path, overwrite: bool) -> None:
    """A new run never mixes with an old one: refuse a used folder unless ``overwrite``. A run that stopped
    before its first checkpoint (a missing extra, a bad program: nothing to continue) does not block its retry:
    its outputs are replaced."""
    used = [name for name in RUN_OUTPUTS[:2] if (run_dir / name).exists()]
    if not used:
        return
    if not overwrite and not ckpt.list_checkpoints(run_dir):
        print(f"[masrl] {run_dir}: the run there stopped before its first checkpoint; starting it again",
              file=sys.stderr)
    elif not overwrite:
        raise ConfigError(f"run folder {run_dir} already holds a run ({', '.join(used)}); continue it with "
                          f"`masrl train --resume {run_dir}`, choose another folder (--output-dir, seed, name), "
                          "or start over with --overwrite")
    import shutil

    for name in RUN_OUTPUTS:
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


# ---------------------------------------------------------------------- metrics

def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    if not values:
        return float("nan"), float("nan")
    return statistics.fmean(values), (statistics.pstdev(values) if len(values) > 1 else 0.0)


def step_metrics(episodes: Sequence[Episode], turns: Sequence[Turn], scores: torch.Tensor,
                 advantages: torch.Tensor) -> dict[str, float]:
    out = {"team/reward": statistics.fmean(e.reward for e in episodes),
           "team/accuracy": statistics.fmean(float(e.correct) for e in episodes),
           "team/turns_per_episode": statistics.fmean(len(e.turns) for e in episodes)}
    env_scores: dict[str, list[float]] = defaultdict(list)  # an environment task's named scores (rubric functions)
    for e in episodes:
        for name, value in (e.info.get("env_metrics") or {}).items():
            env_scores[name].append(float(value))
    out.update({f"env/{name}": statistics.fmean(values) for name, values in env_scores.items()})
    by_agent: dict[str, list[int]] = defaultdict(list)
    for i, t in enumerate(turns):
        by_agent[t.agent].append(i)
    s, a = scores.tolist(), advantages.tolist()
    for agent, idx in by_agent.items():
        p = f"agent/{agent}"
        out[f"{p}/reward_mean"], out[f"{p}/reward_std"] = _mean_std([s[i] for i in idx])
        out[f"{p}/adv_mean"], out[f"{p}/adv_std"] = _mean_std([a[i] for i in idx])
        out[f"{p}/response_length"] = statistics.fmean(len(turns[i].response_ids) for i in idx)
        out[f"{p}/invalid_rate"] = statistics.fmean(float(not turns[i].valid) for i in idx)
        out[f"{p}/truncation_rate"] = statistics.fmean(float(turns[i].truncated) for i in idx)
        out[f"{p}/turns"] = float(len(idx))
    return out


def _progress_text(m: dict, agents) -> str:
    parts = [f"reward {m.get('team/reward', float('nan')):.3f}", f"acc {m.get('team/accuracy', float('nan')):.2f}"]
    if m.get("reward/errors") or m.get("reward/timeouts"):
        parts.append(f"reward failed {m['reward/errors'] + m['reward/timeouts']:.0f}/{m['reward/calls']:.0f}")
    for agent in agents:
        parts.append(f"{agent}: r {m.get(f'agent/{agent}/reward_mean', float('nan')):.2f} "
                     f"len {m.get(f'agent/{agent}/response_length', float('nan')):.0f} "
                     f"|g| {m.get(f'agent/{agent}/grad_norm', float('nan')):.2f}")
    return " | ".join(parts)


def _rss_mib() -> float:
    """Resident memory of this process now (MiB), to watch for growth over long runs."""
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def class_weights(turns: Sequence[Turn]) -> dict[int, float]:
    """Class-balanced per-turn rewards: among one step's turns of an agent that carry their own reward and a
    ``info["reward_class"]`` label (e.g. the Verifier's, by the class of the answer it judged), a turn of class
    ``c`` is weighted ``n / (K * n_c)`` (``n`` such turns, ``K`` classes present, ``n_c`` of class ``c``), so the
    agent's mean reward over the step is the mean of its per-class mean rewards (balanced accuracy for a 0/1
    verdict reward). Keyed by ``id(turn)``; turns without a label are not weighted."""
    counts: dict[str, dict[object, int]] = defaultdict(lambda: defaultdict(int))
    for t in turns:
        if t.reward is not None and t.info.get("reward_class") is not None:
            counts[t.agent][t.info["reward_class"]] += 1
    weights = {}
    for t in turns:
        if t.reward is not None and t.info.get("reward_class") is not None:
            by_class = counts[t.agent]
            weights[id(t)] = sum(by_class.values()) / (len(by_class) * by_class[t.info["reward_class"]])
    return weights


def _peak_rss_mib() -> float:
    """The most this process has held resident so far (MiB): ``VmHWM`` on Linux (this process alone: reset at
    exec), else ``ru_maxrss``."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**10
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**20 if sys.platform == "darwin" else 2**10)


def record_versions(run_dir: Path, versions: dict, resumed_at: int | None = None) -> None:
    """``versions.json``: the versions a run started with, plus those of each resume (``resumed_at_step_N``)."""
    path = run_dir / "versions.json"
    record = json.loads(path.read_text()) if resumed_at is not None and path.is_file() else {}
    record["run" if resumed_at is None else f"resumed_at_step_{resumed_at}"] = versions
    write_text_atomic(path, json.dumps(record, indent=1))


def write_report(trainer: Trainer) -> dict:
    """report.json + report.md (before/after table) and PNG curves in the run folder."""
    from masrl.judges.report import judge_report_lines, judge_summary
    from masrl.monitoring.logger import read_metrics
    from masrl.monitoring.plots import plot_training_curves

    cfg, run_dir = trainer.cfg, trainer.run_dir
    rows = []
    for label in ("sft", "final"):
        if label in trainer.history:
            rows.append((label, trainer.history[label]))
    report = {"name": cfg.name, "seed": cfg.seed, "estimator": cfg.algorithm.estimator,
              "workflow": cfg.workflow.name, "steps": trainer.step, "eval": trainer.history,
              "versions": trainer.versions,
              "collapse": {"action": cfg.monitoring.collapse.action, "rolled_back_to": trainer.rolled_back_to,
                           "events": [asdict(e) for e in trainer.collapse.events]},
              "no_signal": trainer.signal.summary()}
    lines = [f"# masrl run report: {cfg.name} (seed {cfg.seed})", "",
             f"workflow `{cfg.workflow.name}`, estimator `{cfg.algorithm.estimator}`, "
             f"{trainer.step} RL steps, {_eval_size(rows, cfg)}", ""]
    for event in trainer.collapse.events:
        lines.append(f"- step {event.step}: {event.describe()}")
    if trainer.rolled_back_to is not None:
        lines.append(f"- RL stopped at step {trainer.step}; the weights are those of step {trainer.rolled_back_to} "
                     "(monitoring.collapse.action: rollback)")
    final = trainer.signal.final_warning()
    if trainer.signal.no_signal_steps:
        lines.append(f"- no learning signal (every advantage 0) in {trainer.signal.no_signal_steps} of "
                     f"{trainer.signal.steps} RL steps" + (f"; {final}" if final else ""))
    if trainer.collapse.events or trainer.signal.no_signal_steps:
        lines.append("")
    if rows:
        keys = [k for k in rows[0][1] if k.startswith(("avg@", "pass@", "maj@"))]
        lines.append("| stage | " + " | ".join(keys) + " |")
        lines.append("|---|" + "---|" * len(keys))
        for label, summary in rows:
            stage = stage_name(label, cfg.sft.steps)
            lines.append(f"| {stage} | " + " | ".join(f"{100 * summary.get(k, float('nan')):.1f}%" for k in keys) + " |")
    judge = judge_summary(read_metrics(run_dir), trainer.history)  # None without a judge
    if judge is not None:
        report["judge"] = judge
        lines += judge_report_lines(judge, cfg.sft.steps)
    write_text_atomic(run_dir / "report.json", json.dumps(report, indent=1, default=float))
    write_text_atomic(run_dir / "report.md", "\n".join(lines) + "\n")
    if cfg.logging.plots:
        try:
            report["plots"] = [str(p) for p in plot_training_curves(run_dir)]
        except Exception as e:  # a plot must never lose a finished run
            print(f"[masrl] plotting failed: {e}")
    return report


def _eval_size(rows: list, cfg: RunConfig) -> str:
    """What the held-out evaluation measured, from its own summary (tasks evaluated, samples per task)."""
    if not rows:
        return "no held-out evaluation"
    summary = rows[-1][1]
    n_tasks, n = summary.get("n_tasks"), summary.get("n", cfg.eval.n)
    return f"eval n={n} on {n_tasks} held-out tasks" if n_tasks is not None else f"eval n={n}"


def format_before_after(history: dict, cfg: RunConfig) -> str:
    if "sft" not in history or "final" not in history:
        return ""
    keys = [k for k in history["final"] if k.startswith(("avg@", "pass@"))]
    out = ["held-out team accuracy:", f"{'stage':<10}" + "".join(f"{k:>10}" for k in keys)]
    for label, name in (("sft", stage_name("sft", cfg.sft.steps)), ("final", stage_name("final", cfg.sft.steps))):
        out.append(f"{name:<10}" + "".join(f"{100 * history[label][k]:>9.1f}%" for k in keys))
    return "\n".join(out)

