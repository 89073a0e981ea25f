"""Where a judge's replies come from: a frozen local model on the in-process rollout engine (one batched
greedy generate per call), or an OpenAI-compatible endpoint (``masrl.judges.remote``).

``complete(prompts)`` returns one ``Reply`` per prompt, in order; a reply that could not be had
carries ``error`` instead of ``text``. ``yes_probabilities(prompts)`` (verdict ``yes_prob``) reads the
probability of yes and of no at the reply's first token instead of generating: ``p_yes`` and ``p_no``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from masrl.config import PolicyConfig
from masrl.judges.config import JudgeOptions
from masrl.judges.verdicts import verdict_token_ids
from masrl.models.hub import ModelLoadError
from masrl.models.loading import load_model_and_tokenizer
from masrl.rollout.base import GenRequest
from masrl.rollout.factory import make_engine

NO_REPLY = "no reply within"  # the start of a timed-out call's error (counted in usercode/judge/timeouts)


@dataclass
class Reply:
    text: str | None
    error: str | None = None
    p_yes: float | None = None  # yes_prob: the first reply token's probability mass on yes and on no
    p_no: float | None = None


def frozen_policy_config(model: str, *, tiny: dict, dtype: str, trust_remote_code: bool, init_seed: int):
    return PolicyConfig(model=model, tiny=tiny, dtype=dtype, trust_remote_code=trust_remote_code,
                        trainable=False, init_seed=init_seed)


class LocalJudge:
    """A frozen model (no gradients, never trained) generating greedily on a ``TransformersEngine``."""

    def __init__(self, opts: JudgeOptions):
        pcfg = frozen_policy_config(opts.model, tiny=opts.tiny, dtype=opts.dtype,
                                    trust_remote_code=opts.trust_remote_code, init_seed=opts.init_seed)
        try:
            self.model, self.tokenizer = load_model_and_tokenizer(pcfg)
        except ModelLoadError as e:
            raise ModelLoadError(f"task.params.reward.judge.model: {e}") from None
        self.model.eval()
        self.model.requires_grad_(False)
        self.engine = make_engine(None, self.model, self.tokenizer, name="judge", policy=pcfg, seed=0,
                                  max_batch_size=opts.max_batch_size, label="the judge")
        self.system_prompt, self.max_new_tokens = opts.system_prompt, opts.max_new_tokens
        self.endpoint = f"local judge {opts.model!r}"
        self.room = max(int(getattr(self.model.config, "max_position_embeddings", 4096)) - opts.max_new_tokens, 1)
        self.max_batch_size = opts.max_batch_size
        self.verdict_ids = None
        if opts.verdict == "yes_prob":
            try:
                self.verdict_ids = verdict_token_ids(self.tokenizer)
            except ValueError as e:
                raise ModelLoadError(f"task.params.reward.judge.verdict: {e}") from None

    def encode(self, prompt: str) -> list[int]:
        """The prompt as one user message through the judge's chat template; an over-long prompt keeps its end
        (where the answer is)."""
        messages = ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else []) + \
            [{"role": "user", "content": prompt}]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids[-self.room:]

    def new_step(self) -> None:
        """Nothing to reset (a remote judge restarts its call budget here)."""

    def complete(self, prompts: Sequence[str]) -> list[Reply]:
        if not prompts:
            return []
        requests = [GenRequest(self.encode(p), temperature=0.0, max_new_tokens=self.max_new_tokens) for p in prompts]
        with torch.no_grad():
            results = self.engine.generate(requests)
        self.engine.clear_prefix_cache()
        return [Reply(self.tokenizer.decode(r.response_ids, skip_special_tokens=True)) for r in results]

    def yes_probabilities(self, prompts: Sequence[str]) -> list[Reply]:
        """One forward pass per batch (left-padded, positions counted from each row's first token, only the last
        position's logits): each prompt's next-token distribution summed over the yes and the no tokens
        (``masrl.judges.verdicts.verdict_token_ids``), in float32; ``text`` is the most likely token."""
        if not prompts:
            return []
        yes_ids, no_ids = (torch.tensor(ids) for ids in self.verdict_ids)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        out: list[Reply] = []
        device = next(self.model.parameters()).device
        for start in range(0, len(prompts), self.max_batch_size):
            rows = [self.encode(p) for p in prompts[start:start + self.max_batch_size]]
            width = max(len(r) for r in rows)
            ids = torch.full((len(rows), width), pad, dtype=torch.long)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            for i, row in enumerate(rows):
                ids[i, width - len(row):] = torch.tensor(row)
                mask[i, width - len(row):] = 1
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            with torch.no_grad():
                logits = self.model(input_ids=ids.to(device), attention_mask=mask.to(device),
                                    position_ids=positions.to(device), logits_to_keep=1, use_cache=False).logits
            probs = torch.softmax(logits[:, -1].float(), dim=-1).cpu()
            p_yes, p_no, top = probs[:, yes_ids].sum(-1), probs[:, no_ids].sum(-1), probs.argmax(-1)
            out += [Reply(self.tokenizer.decode([int(t)]), p_yes=float(y), p_no=float(n))
                    for t, y, n in zip(top, p_yes, p_no)]
        return out
