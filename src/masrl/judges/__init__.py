"""Rewards from an LLM judge or a reward model (docs/training.md, "Rewards from a judge or a reward model").

    task: {name: dataset, params: {train: ..., reward: {judge: {model: smollm2-135m-instruct, verdict: yes_no}}}}
    task: {name: dataset, params: {train: ..., reward: {model: {path: ./my_rm, normalize: sigmoid}}}}

Importing this package registers the ``judge`` and ``model`` rewards (given with options, as a mapping) with
``masrl.tasks.rewards.register_reward`` (``masrl.registry_names`` does, before a config's
reward is resolved). A judge is built once per process for the same options (the config check and
the run share it). ``judge_metrics`` gives the trainer a step's ``judge/*`` metrics.
"""
from __future__ import annotations

import json
from typing import Any, Mapping

from masrl.judges.config import DEFAULT_TEMPLATES, JudgeOptions, check_template, RewardModelOptions, parse_options
from masrl.judges.judge import JudgeReward
from masrl.judges.reward_model import RewardModelReward
from masrl.judges.stats import JudgeFailedError
from masrl.tasks.rewards import register_reward, resolve_reward

__all__ = ["JudgeFailedError", "JudgeReward", "RewardModelReward", "build_judge", "build_reward_model",
           "judge_metrics"]
_BUILT: dict[str, Any] = {}


def _key(kind: str, options: Mapping[str, Any]) -> str:
    return kind + json.dumps(options, sort_keys=True, default=str)


def _check(name: str | None, params: Mapping[str, Any]):
    return resolve_reward(name, params) if name else None


def build_judge(options: Mapping[str, Any], params: Mapping[str, Any]) -> JudgeReward:
    """``reward: {judge: options}``: the model is loaded (or the endpoint's key read) here, at load."""
    key = _key("judge", options)
    if key not in _BUILT:
        opts = parse_options(JudgeOptions, options, "judge")
        check_template(opts.template or DEFAULT_TEMPLATES[opts.verdict], opts.verdict, "judge")  # before loading
        if opts.remote is not None:
            from masrl.judges.remote import RemoteJudge

            backend = RemoteJudge(opts.remote, system_prompt=opts.system_prompt, max_new_tokens=opts.max_new_tokens)
        else:
            from masrl.judges.backends import LocalJudge

            backend = LocalJudge(opts)
        _BUILT[key] = JudgeReward(opts, backend, _check(opts.check, params))
    return _BUILT[key]


def build_reward_model(options: Mapping[str, Any], params: Mapping[str, Any]) -> RewardModelReward:
    """``reward: {model: options}``: a sequence-classification reward model, loaded here."""
    key = _key("model", options)
    if key not in _BUILT:
        from masrl.judges.reward_model import load_reward_model

        opts = parse_options(RewardModelOptions, options, "model")
        model, tokenizer = load_reward_model(opts)
        _BUILT[key] = RewardModelReward(opts, model, tokenizer, _check(opts.check, params))
    return _BUILT[key]


def judge_metrics(score) -> dict[str, float]:
    """The step's judge metrics of a task's score function (empty for rule-based rewards); raises
    ``JudgeFailedError`` when every judge call of the step failed."""
    if isinstance(score, (JudgeReward, RewardModelReward)):
        return score.step_metrics()
    return {}


register_reward("judge", build_judge, options=True)
register_reward("model", build_reward_model, options=True)
