"""The engine's inverse-CDF sampler (large vocabularies) draws from exactly the model's distribution.

A chi-square bound that the sampler meets and a sampler one bucket off fails; zero-probability tokens
never drawn, also at the uniform's extremes; greedy rows, log-probs and seeded reproducibility as before.
"""
import pytest
import torch

from masrl.rollout import engine as engine_module
from masrl.rollout.engine import INVERSE_CDF_MIN_VOCAB, _sample, _SamplePlan, inverse_cdf_sample

PROBS = torch.tensor([0.0, 0.05, 0.3, 0.0, 0.15, 0.001, 0.099, 0.4, 0.0, 0.0])  # zeros first, inside, last
DRAWS = 200_000
# chi-square critical value for 6 degrees of freedom (7 non-zero buckets) at p = 1e-6
CHI2_BOUND = 35.9


def _chi2(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    p = probs.double() / probs.double().sum()
    nz = p > 0
    expected = p[nz] * tokens.numel()
    return float(((counts[nz] - expected) ** 2 / expected).sum())


def _one_bucket_off(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A classic off-by-one: searching the exclusive cumulative sum (each bucket shifted one token right)."""
    cum = torch.cumsum(probs, -1, dtype=torch.float64)
    u = (1.0 - torch.rand((probs.shape[0], 1), dtype=torch.float64, generator=generator)) * cum[:, -1:]
    return torch.searchsorted(cum - probs, u, right=True).clamp(max=probs.shape[1] - 1).squeeze(-1)


def test_inverse_cdf_matches_the_distribution_and_a_one_off_sampler_does_not():
    rows = PROBS.expand(DRAWS, -1)
    tokens = inverse_cdf_sample(rows, torch.Generator().manual_seed(0))
    assert _chi2(tokens, PROBS) < CHI2_BOUND
    assert not bool((PROBS[tokens] == 0).any())
    wrong = _one_bucket_off(rows, torch.Generator().manual_seed(0))
    assert _chi2(wrong, PROBS) > 100 * CHI2_BOUND
    # unnormalised rows: the same distribution
    scaled = inverse_cdf_sample(rows * 7.5, torch.Generator().manual_seed(0))
    assert torch.equal(scaled, tokens)


@pytest.mark.parametrize("uniform", [0.0, 1.0 - 2.0 ** -53])
def test_zero_probability_tokens_are_never_drawn_at_the_uniforms_extremes(monkeypatch, uniform):
    probs = torch.stack([PROBS, torch.tensor([0.0] * 9 + [1.0]), torch.tensor([1.0] + [0.0] * 9),
                         torch.tensor([0.0, 0.0, 0.25, 0.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.25])])
    real_rand = torch.rand
    monkeypatch.setattr(engine_module.torch, "rand",
                        lambda size, **kw: real_rand(size, **kw).fill_(uniform))
    tokens = inverse_cdf_sample(probs, None)
    # U = 0: u is each row's total, the last non-zero token; U -> 1: u -> 0+, the first non-zero token
    expected = [7, 9, 0, 9] if uniform == 0.0 else [1, 9, 0, 2]
    assert tokens.tolist() == expected


def _large_logits(rows: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, INVERSE_CDF_MIN_VOCAB + 100, generator=g) * 4
    logits[:, ::7] = float("-inf")  # tokens the model never emits
    return logits


def test_sample_on_a_large_vocabulary_uses_the_inverse_cdf_and_keeps_greedy_logprobs_and_seeds():
    logits = _large_logits(6)
    temperature = torch.tensor([1.0, 0.0, 0.7, 1.3, 0.0, 1.0])
    top_p = torch.tensor([1.0, 1.0, 0.9, 1.0, 0.5, 0.3])
    plan = _SamplePlan(temperature, top_p)
    assert plan.inverse_cdf(logits)
    runs = [_sample(logits, temperature, top_p, torch.Generator().manual_seed(5), plan=plan) for _ in range(2)]
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])  # seeded
    tokens, logps = runs[0]
    greedy = temperature <= 0
    assert torch.equal(tokens[greedy], logits[greedy].argmax(-1))
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    assert torch.equal(logps, torch.log_softmax(scaled, -1).gather(-1, tokens[:, None]).squeeze(-1))
    assert torch.isfinite(logps).all()  # never a -inf (never-emitted) token
    other = _sample(logits, temperature, top_p, torch.Generator().manual_seed(6))
    assert not torch.equal(other[0][~greedy], tokens[~greedy])  # the seed matters


def test_sample_top_p_on_a_large_vocabulary_draws_the_renormalised_nucleus():
    base = torch.full((INVERSE_CDF_MIN_VOCAB + 10,), -30.0)
    base[[3, 500, 4000, 4100]] = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.1]))
    logits = base.expand(1_000, -1).contiguous()
    top_p = torch.full((1_000,), 0.85)  # keeps 0.5 + 0.25 + 0.15; 4100 and the tail are dropped
    tokens, _ = _sample(logits, torch.ones(1_000), top_p, torch.Generator().manual_seed(1))
    assert set(tokens.tolist()) == {3, 500, 4000}
    nucleus = torch.zeros(logits.shape[1])
    nucleus[[3, 500, 4000]] = torch.tensor([0.5, 0.25, 0.15])
    assert _chi2(tokens, nucleus) < 27.6  # 2 degrees of freedom, p = 1e-6


def test_small_vocabularies_keep_multinomial_draws():
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    tokens, _ = _sample(logits, torch.ones(4), torch.ones(4), torch.Generator().manual_seed(3))
    expected = torch.multinomial(torch.log_softmax(logits, -1).exp(), 1,
                                 generator=torch.Generator().manual_seed(3)).squeeze(-1)
    assert torch.equal(tokens, expected)
