"""Sampling for the in-process engine: one token per row with its log-prob, and the per-batch decode state.

Logprobs are ``log_softmax(logits / temperature)`` at the sampled token (top-p does not change them), which is
what the trainer recomputes, so they can serve as the PPO "old" logprobs. Each row has its own temperature,
top-p and token budget.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from masrl.rollout.base import GenRequest, GenResult

__all__ = ["INVERSE_CDF_MIN_VOCAB", "DecodeState", "SamplePlan", "inverse_cdf_sample", "run_decode", "sample"]


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
           generator: torch.Generator | None, *,
           plan: "SamplePlan | None" = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; returns (tokens, logprob of each token under logits/T).

    ``plan``: the batch's sampling settings digested once per batch (see ``SamplePlan``); the
    result is identical with and without it.
    """
    if plan is None:
        plan = SamplePlan(temperature, top_p)
    logits = logits.float()
    if plan.temp_col is not None:  # dividing by 1.0 is exact, so an all-1 batch skips it
        logits = logits / plan.temp_col
    logp = torch.log_softmax(logits, dim=-1)
    probs = logp.exp()
    if plan.any_top_p:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        cum = sorted_p.cumsum(-1)
        drop = (cum - sorted_p) >= top_p[:, None]  # keep the smallest prefix with mass >= top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        if plan.inverse_cdf(sorted_p):  # draw in sorted order, then map back to token ids
            tokens = order.gather(-1, plan.draw(sorted_p, generator)[:, None]).squeeze(-1)
        else:
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
            tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    elif plan.inverse_cdf(probs):
        tokens = plan.draw(probs, generator)
    else:
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    if plan.any_greedy:
        tokens = torch.where(plan.greedy, logp.argmax(-1), tokens)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


# From this vocabulary size on, a row's token is drawn by inverse CDF (one uniform per row) instead of
# ``torch.multinomial`` (one exponential per vocabulary entry: 8.7 ms per step for 8 rows x 49,152 tokens on
# one Zen 4 core, vs 0.5 ms). Below it multinomial costs little and keeps the small models' (the quickstart's,
# the study's) sampled tokens, and so their published results, as they were.
INVERSE_CDF_MIN_VOCAB = 4096


def inverse_cdf_sample(probs: torch.Tensor, generator: torch.Generator | None,
                       cum: torch.Tensor | None = None) -> torch.Tensor:
    """One draw per row of ``probs`` (``[rows, V]``, non-negative, each row with a positive sum; need not sum
    to 1), with probability ``probs[i, j] / probs[i].sum()`` exactly up to float64 rounding.

    The float64 cumulative sum ``c`` (written into ``cum`` when given) and one uniform ``U`` in [0, 1) per
    row give ``u = (1 - U) * c[-1]`` in (0, c[-1]]; the token is the first ``j`` with ``c[j] >= u``.
    A zero-probability token ``j`` has ``c[j] == c[j - 1]`` (or ``c[0] == 0 < u``), so it is never drawn,
    and ``u <= c[-1]`` always finds a token (no out-of-range last bucket).
    """
    cum = torch.cumsum(probs, -1, dtype=torch.float64, out=cum)
    uniform = torch.rand((probs.shape[0], 1), dtype=torch.float64, device=probs.device, generator=generator)
    return torch.searchsorted(cum, (1.0 - uniform) * cum[:, -1:]).squeeze(-1)


class SamplePlan:
    """Per-batch constants of ``sample`` (computed once, not once per decode step)."""

    def __init__(self, temperature: torch.Tensor, top_p: torch.Tensor):
        self.greedy = temperature <= 0
        self.any_greedy = bool(self.greedy.any())
        temp = torch.where(self.greedy, torch.ones_like(temperature), temperature)
        self.temp_col = None if bool((temp == 1.0).all()) else temp[:, None]
        self.any_top_p = bool((top_p < 1.0).any())
        self._cum: torch.Tensor | None = None  # the inverse-CDF sampler's float64 buffer, reused every step

    @staticmethod
    def inverse_cdf(probs: torch.Tensor) -> bool:
        """Whether ``inverse_cdf_sample`` draws from ``probs`` (large vocabularies, float64-capable devices)."""
        return probs.shape[-1] >= INVERSE_CDF_MIN_VOCAB and probs.device.type != "mps"

    def draw(self, probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        if self._cum is None or self._cum.shape != probs.shape or self._cum.device != probs.device:
            # a fresh [rows, V] float64 tensor every step costs page faults (3.8 vs 0.5 ms for 8 x 49,152)
            self._cum = torch.empty(probs.shape, dtype=torch.float64, device=probs.device)
        return inverse_cdf_sample(probs, generator, self._cum)


class DecodeState:
    """What every decode step of one batch reads and writes: per-row sampling settings, the tokens and
    log-probs emitted so far, and which rows are done (a stop token or the row's token budget)."""

    def __init__(self, requests: Sequence[GenRequest], *, eos: torch.Tensor, pad_token_id: int, device,
                 generator: torch.Generator):
        batch = len(requests)
        temperature = torch.tensor([r.temperature for r in requests], dtype=torch.float32)
        top_p = torch.tensor([r.top_p for r in requests], dtype=torch.float32)
        self.budget = torch.tensor([r.max_new_tokens for r in requests], dtype=torch.long)
        self.max_new = int(self.budget.max())
        self.is_eos = torch.zeros(int(eos.max()) + 2, dtype=torch.bool)  # token id -> stop token? (CPU lookup)
        self.is_eos[eos] = True
        self.eos_limit = self.is_eos.numel() - 1  # ids past the table (never stop tokens) are clamped onto a False entry
        self.temperature, self.top_p = temperature.to(device), top_p.to(device)  # sampling runs where the logits are
        self.plan = SamplePlan(self.temperature, self.top_p)
        self.generator = generator
        self.tokens_out = torch.full((batch, self.max_new), pad_token_id, dtype=torch.long)
        self.logps_out = torch.zeros((batch, self.max_new), dtype=torch.float32)
        self.n_emitted = torch.zeros(batch, dtype=torch.long)
        self.stopped = torch.zeros(batch, dtype=torch.bool)   # emitted a stop token
        self.done = self.budget <= 0
        self.pad = torch.full((batch,), pad_token_id, dtype=torch.long)
        self.zero = torch.zeros((), dtype=torch.float32)
        self.last: torch.Tensor | None = None  # the tokens sampled at the last step (every row)

    def sample(self, step: int, logits: torch.Tensor) -> bool:
        """Sample token ``step`` of every row from ``logits`` and record it for the rows still going;
        True when every row is done."""
        tok, lp = sample(logits, self.temperature, self.top_p, self.generator, plan=self.plan)
        tok, lp = tok.cpu(), lp.cpu()
        active = ~self.done
        self.tokens_out[:, step] = torch.where(active, tok, self.pad)
        self.logps_out[:, step] = torch.where(active, lp, self.zero)
        self.n_emitted += active
        hit_eos = self.is_eos[tok.clamp(max=self.eos_limit)] & active
        self.stopped |= hit_eos
        self.done |= hit_eos | (self.n_emitted >= self.budget)
        self.last = tok
        return bool(self.done.all())

    def feed(self) -> torch.Tensor:
        """The tokens the next forward reads (every row, on the CPU): the last sample, padding once done."""
        return torch.where(self.done, self.pad, self.last)

    def results(self) -> list[GenResult]:
        results = []
        for i in range(self.done.numel()):
            n = int(self.n_emitted[i])
            results.append(GenResult(self.tokens_out[i, :n].tolist(), self.logps_out[i, :n].tolist(),
                                     truncated=not bool(self.stopped[i])))
        return results


def run_decode(state: DecodeState, logits: torch.Tensor,
               forward: Callable[[int, torch.Tensor], torch.Tensor]) -> None:
    """The decode loop: sample every row from ``logits``; until every row is done, ``forward(step, logits)``
    runs the model on ``DecodeState.feed`` and returns the next logits of every row."""
    for step in range(state.max_new):
        if state.sample(step, logits):
            break
        logits = forward(step, logits)
