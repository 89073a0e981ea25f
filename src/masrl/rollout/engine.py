"""Rollout engines: generate token ids and per-token logprobs for a batch of prompts.

``TransformersEngine`` runs batched KV-cache decoding with any transformers causal LM.
Each row has its own temperature, top-p and token budget, so agents that share a policy
(and have different sampling settings) are generated in one batch. Logprobs are
``log_softmax(logits / temperature)`` at the sampled token (top-p does not change them),
which is what the trainer recomputes, so they can serve as the PPO "old" logprobs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch


@dataclass
class GenRequest:
    prompt_ids: list[int]
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    adapter: str | None = None  # LoRA adapter this row decodes with (per-agent adapters)


@dataclass
class GenResult:
    response_ids: list[int]
    logprobs: list[float]
    truncated: bool  # hit max_new_tokens without emitting a stop token


class Engine(Protocol):
    def generate(self, requests: Sequence[GenRequest]) -> list[GenResult]: ...


def _sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
            generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; returns (tokens, logprob of each token under logits/T)."""
    greedy = temperature <= 0
    temp = torch.where(greedy, torch.ones_like(temperature), temperature)
    logp = torch.log_softmax(logits.float() / temp[:, None], dim=-1)
    probs = logp.exp()
    if bool((top_p < 1.0).any()):
        sorted_p, order = probs.sort(dim=-1, descending=True)
        cum = sorted_p.cumsum(-1)
        drop = (cum - sorted_p) >= top_p[:, None]  # keep the smallest prefix with mass >= top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    if bool(greedy.any()):
        tokens = torch.where(greedy, logp.argmax(-1), tokens)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


class TransformersEngine:
    """Batched sampling with a KV cache; the model is shared with the trainer (no weight copies)."""

    def __init__(self, model: torch.nn.Module, *, eos_token_ids: Sequence[int], pad_token_id: int,
                 max_batch_size: int = 256, seed: int = 0):
        self.model = model
        self.eos = torch.tensor(sorted(set(eos_token_ids)), dtype=torch.long)
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self.generator = torch.Generator().manual_seed(seed)
        self.tokens_generated = 0

    def reseed(self, seed: int) -> None:
        self.generator.manual_seed(seed)

    def generate(self, requests: Sequence[GenRequest]) -> list[GenResult]:
        out: list[GenResult] = []
        for start in range(0, len(requests), self.max_batch_size):
            out.extend(self._generate_batch(requests[start:start + self.max_batch_size]))
        return out

    @torch.inference_mode()
    def _generate_batch(self, requests: Sequence[GenRequest]) -> list[GenResult]:
        model = self.model
        was_training = model.training
        model.eval()
        try:
            if any(r.adapter is not None for r in requests):
                from masrl.models.lora import mixed_adapters

                with mixed_adapters(model, [r.adapter for r in requests]):
                    return self._decode(model, requests)
            return self._decode(model, requests)
        finally:
            model.train(was_training)

    def _decode(self, model, requests: Sequence[GenRequest]) -> list[GenResult]:
        device = next(model.parameters()).device
        batch = len(requests)
        lengths = [len(r.prompt_ids) for r in requests]
        width = max(lengths)
        input_ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((batch, width), dtype=torch.long)
        for i, r in enumerate(requests):  # left padding
            input_ids[i, width - lengths[i]:] = torch.tensor(r.prompt_ids, dtype=torch.long)
            attention[i, width - lengths[i]:] = 1
        temperature = torch.tensor([r.temperature for r in requests], dtype=torch.float32)
        top_p = torch.tensor([r.top_p for r in requests], dtype=torch.float32)
        budget = torch.tensor([r.max_new_tokens for r in requests], dtype=torch.long)
        max_new = int(budget.max())
        # the mask for prompt + every decode step, allocated once (sliced per step)
        full_mask = torch.cat([attention, torch.ones((batch, max_new), dtype=attention.dtype)], 1).to(device)
        input_ids = input_ids.to(device)
        attention = full_mask[:, :width]
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        eos = self.eos  # tokens are compared on the CPU

        out = model(input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=True,
                    logits_to_keep=1)  # the prompt's last position only: no vocabulary-sized prefill logits
        cache, logits = out.past_key_values, out.logits[:, -1, :]
        next_pos = positions[:, -1] + 1
        tokens_out = torch.full((batch, max_new), self.pad_token_id, dtype=torch.long)
        logps_out = torch.zeros((batch, max_new), dtype=torch.float32)
        n_emitted = torch.zeros(batch, dtype=torch.long)
        stopped = torch.zeros(batch, dtype=torch.bool)   # emitted a stop token
        done = budget <= 0
        for step in range(max_new):
            tok, lp = _sample(logits, temperature, top_p, self.generator)
            tok, lp = tok.cpu(), lp.cpu()
            active = ~done
            tokens_out[active, step] = tok[active]
            logps_out[active, step] = lp[active]
            n_emitted += active.long()
            hit_eos = torch.isin(tok, eos) & active
            stopped |= hit_eos
            done |= hit_eos | (n_emitted >= budget)
            if bool(done.all()):
                break
            feed = torch.where(done, torch.full_like(tok, self.pad_token_id), tok).to(device)
            attention = full_mask[:, :width + step + 1]
            out = model(input_ids=feed[:, None], attention_mask=attention, position_ids=next_pos[:, None],
                        past_key_values=cache, use_cache=True)
            cache, logits = out.past_key_values, out.logits[:, -1, :]
            next_pos = next_pos + 1
        results = []
        for i in range(batch):
            n = int(n_emitted[i])
            self.tokens_generated += n
            results.append(GenResult(tokens_out[i, :n].tolist(), logps_out[i, :n].tolist(),
                                     truncated=not bool(stopped[i])))
        return results
