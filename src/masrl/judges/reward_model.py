"""A reward model as a task's score function: ``reward: {model: {path: ..., kind: sequence_classification}}``.

A Hugging Face ``AutoModelForSequenceClassification`` with one output: each (question, answer) goes
through its tokenizer, as a user + assistant conversation when the tokenizer has a chat template (else
as a text pair), and the logit is the score. ``normalize``: ``sigmoid`` (default) maps the logit to
(0, 1) without overflow (a logit of -1000 scores ~0); ``none`` keeps it; ``minmax`` maps the answers scored
together (one step's batch) to [0, 1] by (logit - min) / (max - min), 0.5 when they are all equal. Frozen: no
gradients, never trained. Scored in batches of ``batch_size`` (right-padded, with an attention mask: a batch scores as one by one).
"""
from __future__ import annotations

import math
import time
from typing import Callable, Sequence

import torch

from masrl.errors import ConfigError
from masrl.judges.config import RewardModelOptions, check_template
from masrl.judges.stats import JudgeStats, judged, unjudged
from masrl.models.hub import ModelLoadError
from masrl.models.loading import DTYPES
from masrl.types import Task
from masrl.usercode.numbers import sigmoid
from masrl.workflows.base import render


def load_reward_model(opts: RewardModelOptions):
    """``(model, tokenizer)``, or one ModelLoadError naming the path."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from masrl.models.hub import resolve_model_source

    try:
        source = resolve_model_source(opts.path)
        model = AutoModelForSequenceClassification.from_pretrained(source, dtype=DTYPES[opts.dtype],
                                                                   trust_remote_code=opts.trust_remote_code)
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=opts.trust_remote_code)
    except Exception as e:  # noqa: BLE001 - missing folder, not a classifier, offline hub: one line
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ModelLoadError(f"task.params.reward.model.path {opts.path!r}: cannot load a sequence-classification "
                             f"model ({type(e).__name__}: {first})") from None
    if model.config.num_labels != 1:
        raise ConfigError(f"task.params.reward.model.path {opts.path!r}: the model has {model.config.num_labels} "
                          "outputs; a reward model has one (num_labels: 1)")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    model.eval()
    model.requires_grad_(False)
    return model, tokenizer


class RewardModelReward:
    """Scores answers with a frozen sequence-classification model (see the module docstring)."""

    def __init__(self, opts: RewardModelOptions, model, tokenizer, check: Callable | None = None):
        self.opts, self.model, self.tokenizer, self.check = opts, model, tokenizer, check
        self.template = check_template(opts.template, "reward_model", "model") if opts.template else None
        self.stats = JudgeStats(f"reward model {opts.path!r}", kind="reward_model", max_share=opts.max_error_share)
        self.__name__ = "reward_model"

    def __call__(self, task: Task, answer: str | None) -> dict:
        return self.score_batch([(task, answer)])[0]

    def encode(self, task: Task, answer: str) -> list[int]:
        question = render(self.template, question=task.question) if self.template else task.question
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": question},
                                                       {"role": "assistant", "content": answer}], tokenize=False)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = self.tokenizer(question, answer)["input_ids"]
        return ids[-self.opts.max_length:]

    @torch.no_grad()
    def logits(self, rows: Sequence[list[int]]) -> list[float]:
        """One logit per row of token ids, ``batch_size`` rows per forward pass (right-padded)."""
        out: list[float] = []
        pad = int(self.tokenizer.pad_token_id)
        device = next(self.model.parameters()).device
        for i in range(0, len(rows), self.opts.batch_size):
            chunk = rows[i:i + self.opts.batch_size]
            width = max(len(r) for r in chunk)
            ids = torch.tensor([r + [pad] * (width - len(r)) for r in chunk], device=device)
            mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in chunk], device=device)
            logits = self.model(input_ids=ids, attention_mask=mask).logits
            out.extend(logits[:, 0].float().tolist())
        return out

    def normalize(self, logits: list[float]) -> list[float]:
        if self.opts.normalize == "sigmoid":
            return [sigmoid(x) if math.isfinite(x) else x for x in logits]  # -1000 -> ~0; NaN stays an error
        if self.opts.normalize == "minmax" and logits:
            lo, hi = min(logits), max(logits)
            return [0.5 if hi == lo else (x - lo) / (hi - lo) for x in logits]
        return list(logits)

    def score_batch(self, pairs: Sequence[tuple[Task, str | None]]) -> list[dict]:
        start = time.perf_counter()
        answered = [i for i, (_, answer) in enumerate(pairs) if answer is not None]
        logits = self.logits([self.encode(*pairs[i]) for i in answered])
        results = [unjudged(self.stats, self.check, task, None, "no_answer") if answer is None else None
                   for task, answer in pairs]
        for i, logit, value in zip(answered, logits, self.normalize(logits)):
            task, answer = pairs[i]
            results[i] = {**judged(self.stats, self.check, task, answer, value, self.opts.correct_threshold),
                          "rm_logit": logit}
        self.stats.calls += len(answered)
        self.stats.seconds += time.perf_counter() - start
        return results

    def step_metrics(self) -> dict[str, float]:
        return self.stats.pop()
