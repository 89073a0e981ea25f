"""Policy losses, KL penalties and entropy pinned by hand-computed numbers."""
from __future__ import annotations

import math

import pytest
import torch

from masrl.algorithms import agg_loss, entropy_from_logits, kl_penalty, policy_loss

E = math.exp

# 2 x 4 example. Row 0: A = +1, valid tokens 0-2; row 1: A = -1, valid tokens 0-1.
# d = logp - old on valid tokens: row 0 [0, .4, -.4], row 1 [.3, -.3].
OLD = torch.tensor([[-1.0, -0.9, -1.6, -0.1], [-0.6, -0.9, -0.7, -0.9]])
DELTA = torch.tensor([[0.0, 0.4, -0.4, 0.0], [0.3, -0.3, 0.0, 0.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
ADV = torch.tensor([1.0, -1.0])
# clip_low 0.2, clip_high 0.28: ratio clipped to [0.8, 1.28]; L = max(-A r, -A clip(r))
#   row 0 (A=+1): r = 1 -> -1; r = e^.4 = 1.4918 -> clipped -1.28; r = e^-.4 = 0.6703 -> -0.6703
#   row 1 (A=-1): r = e^.3 = 1.3499 -> 1.3499 (unclipped); r = e^-.3 = 0.7408 -> clipped 0.8
ROW0 = [-1.0, -1.28, -E(-0.4)]
ROW1 = [E(0.3), 0.8]
EXPECTED = {
    "token-mean": (sum(ROW0) + sum(ROW1)) / 5,                    # -0.160092
    "seq-mean-token-mean": (sum(ROW0) / 3 + sum(ROW1) / 2) / 2,   # 0.045745
    "seq-mean-token-sum-norm": (sum(ROW0) / 4 + sum(ROW1) / 4) / 2,  # -0.100058
}


def inputs(requires_grad: bool = True):
    logprobs = (OLD + DELTA).clone().requires_grad_(requires_grad)
    return logprobs, OLD.clone(), ADV.clone(), MASK.clone()


@pytest.mark.parametrize("agg", list(EXPECTED))
def test_ppo_loss_by_hand_with_clip_higher(agg):
    logprobs, old, adv, mask = inputs()
    loss, _ = policy_loss(logprobs, old, adv, mask, clip_low=0.2, clip_high=0.28, agg=agg)
    assert abs(loss.item() - EXPECTED[agg]) < 1e-6
    assert abs(EXPECTED["token-mean"] - (-0.160092)) < 1e-6


def test_clip_high_is_asymmetric():
    logprobs, old, adv, mask = inputs()
    symmetric, _ = policy_loss(logprobs, old, adv, mask, clip_low=0.2, clip_high=0.2)
    # only row 0 token 1 changes: clipped at 1.2 instead of 1.28
    assert abs(symmetric.item() - (EXPECTED["token-mean"] + 0.08 / 5)) < 1e-6


def test_ppo_stats_by_hand():
    logprobs, old, adv, mask = inputs()
    _, stats = policy_loss(logprobs, old, adv, mask, clip_low=0.2, clip_high=0.28)
    assert stats["clipfrac"] == pytest.approx(2 / 5)
    assert stats["clipfrac_high"] == pytest.approx(1 / 5)
    assert stats["clipfrac_low"] == pytest.approx(1 / 5)
    assert stats["approx_kl"] == pytest.approx(0.5 * (0.16 + 0.16 + 0.09 + 0.09) / 5)
    assert stats["ratio_min"] == pytest.approx(E(-0.4))
    assert stats["ratio_max"] == pytest.approx(E(0.4))
    assert stats["valid_tokens"] == 5
    assert "dual_clipfrac" not in stats
    assert all(isinstance(v, float) for v in stats.values())


def test_ppo_gradient_by_hand_and_only_through_logprobs():
    logprobs, old, adv, mask = inputs()
    old.requires_grad_(True)
    adv.requires_grad_(True)
    loss, _ = policy_loss(logprobs, old, adv, mask, clip_low=0.2, clip_high=0.28)
    loss.backward()
    # dL/dlogp = -A r / 5 on unclipped tokens, 0 on clipped and padded ones
    expected = torch.tensor([[-1 / 5, 0.0, -E(-0.4) / 5, 0.0], [E(0.3) / 5, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(logprobs.grad, expected)
    assert old.grad is None and adv.grad is None


def test_dual_clip_by_hand():
    # row 0: A = -1, d = [1.5, 0.1] -> r = 4.4817 -> max(4.48, 1.28) = 4.48 -> min(4.48, 3) = 3
    #                                  r = 1.1052 -> 1.1052 (< 3, untouched)
    # row 1: A = +1, d = [1.5, 0.1] -> clipped at -1.28; r = 1.1052 -> -1.1052 (dual clip ignores A > 0)
    old = torch.zeros(2, 2)
    logprobs = torch.tensor([[1.5, 0.1], [1.5, 0.1]], requires_grad=True)
    mask = torch.ones(2, 2)
    adv = torch.tensor([-1.0, 1.0])
    loss, stats = policy_loss(logprobs, old, adv, mask, clip_high=0.28, dual_clip=3.0)
    assert abs(loss.item() - (3 + E(0.1) - 1.28 - E(0.1)) / 4) < 1e-6
    assert stats["dual_clipfrac"] == pytest.approx(1 / 4)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, E(0.1) / 4], [0.0, -E(0.1) / 4]]))
    no_dual, _ = policy_loss(logprobs, old, adv, mask, clip_high=0.28)
    assert abs(no_dual.item() - (E(1.5) + E(0.1) - 1.28 - E(0.1)) / 4) < 1e-5


def test_gspo_by_hand():
    # row 0: A = +1, d = [.6, .3, 0] -> s = e^.3 = 1.3499 > 1.28 -> every token -1.28 (clipped)
    # row 1: A = -1, d = [.3, .5]   -> s = e^.4 = 1.4918 -> every token 1.4918 (unclipped)
    old = torch.zeros(2, 4)
    logprobs = torch.tensor([[0.6, 0.3, 0.0, 9.0], [0.3, 0.5, 9.0, 9.0]], requires_grad=True)
    loss, stats = policy_loss(logprobs, old, ADV, MASK, loss="gspo", clip_high=0.28)
    assert abs(loss.item() - (3 * -1.28 + 2 * E(0.4)) / 5) < 1e-6
    assert stats["ratio_min"] == pytest.approx(E(0.3)) and stats["ratio_max"] == pytest.approx(E(0.4))
    assert stats["clipfrac"] == pytest.approx(3 / 5)
    loss.backward()
    # the token ratio sg[s] * exp(logp - sg[logp]) has gradient s per token
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0] * 4, [E(0.4) / 5] * 2 + [0.0] * 2]))


def test_gspo_gradient_equals_sequence_ratio_gradient():
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(3, 5, generator=gen)
    start = old + 0.05 * torch.randn(3, 5, generator=gen)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    adv = torch.tensor([0.7, -1.2, 0.4])
    logprobs = start.clone().requires_grad_(True)
    loss, _ = policy_loss(logprobs, old, adv, mask, loss="gspo", clip_low=0.5, clip_high=0.5,
                          agg="seq-mean-token-mean")
    loss.backward()
    # reference: the GSPO objective written with an explicit, differentiable sequence ratio
    reference = start.clone().requires_grad_(True)
    seq_ratio = torch.exp(((reference - old) * mask).sum(-1) / mask.sum(-1))
    (-(adv * seq_ratio)).mean().backward()  # no clipping is active with ratios near 1
    torch.testing.assert_close(logprobs.grad, reference.grad)


@pytest.mark.parametrize("agg", list(EXPECTED))
@pytest.mark.parametrize("loss_type", ["ppo", "gspo"])
def test_fully_masked_rows_contribute_nothing(agg, loss_type):
    logprobs, old, adv, mask = inputs()
    base, _ = policy_loss(logprobs, old, adv, mask, loss=loss_type, clip_high=0.28, agg=agg, norm_length=4)
    padded_logprobs = torch.cat([logprobs.detach(), torch.tensor([[float("nan"), -float("inf"), 5.0, 0.0]])])
    padded_logprobs.requires_grad_(True)
    padded_old = torch.cat([old, torch.tensor([[float("-inf"), 0.0, -3.0, float("nan")]])])
    padded_adv = torch.cat([adv, torch.tensor([1e6])])
    padded_mask = torch.cat([mask, torch.zeros(1, 4, dtype=mask.dtype)])
    loss, stats = policy_loss(padded_logprobs, padded_old, padded_adv, padded_mask, loss=loss_type,
                              clip_high=0.28, agg=agg, norm_length=4)
    assert abs(loss.item() - base.item()) < 1e-6
    loss.backward()
    assert torch.isfinite(padded_logprobs.grad).all() and (padded_logprobs.grad[2] == 0).all()
    assert all(math.isfinite(v) for v in stats.values())


def test_token_level_advantages_and_masked_padding():
    logprobs, old, adv, mask = inputs()
    per_token = adv.unsqueeze(-1).expand(2, 4).clone()
    per_token[0, 3] = float("nan")  # padding may hold anything
    loss, _ = policy_loss(logprobs, old, per_token, mask, clip_high=0.28)
    assert abs(loss.item() - EXPECTED["token-mean"]) < 1e-6


def test_nothing_valid_gives_zero_loss():
    logprobs, old, adv, _ = inputs()
    loss, stats = policy_loss(logprobs, old, adv, torch.zeros(2, 4))
    assert loss.item() == 0.0 and stats["clipfrac"] == 0.0 and stats["ratio_max"] == 1.0
    loss.backward()
    assert (logprobs.grad == 0).all()


def test_bad_arguments_are_named():
    logprobs, old, adv, mask = inputs()
    with pytest.raises(ValueError, match="unknown loss 'ppo2'; known: gspo, ppo"):
        policy_loss(logprobs, old, adv, mask, loss="ppo2")
    with pytest.raises(ValueError, match="unknown agg 'mean'; known: token-mean, seq-mean-token-mean"):
        policy_loss(logprobs, old, adv, mask, agg="mean")
    with pytest.raises(ValueError, match="old_logprobs"):
        policy_loss(logprobs, old[:, :3], adv, mask)
    with pytest.raises(ValueError, match="response_mask"):
        policy_loss(logprobs, old, adv, mask[:1])
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(logprobs, old, torch.ones(3), mask)
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(logprobs, old, adv, mask, dual_clip=0.5)
    with pytest.raises(ValueError, match="clip_low"):
        policy_loss(logprobs, old, adv, mask, clip_low=1.0)


def test_register_loss_adds_a_named_log_ratio():
    from masrl.algorithms import LOSSES, POLICY_LOSSES, register_loss

    assert list(LOSSES) == ["ppo", "gspo"] and POLICY_LOSSES is LOSSES

    @register_loss("test_half_ratio")
    def half(logprobs, old_logprobs, valid):
        return 0.5 * (logprobs - old_logprobs)

    try:
        logprobs, old, adv, mask = inputs()
        # no clipping at these ratios (e^{±0.2}): the loss is the plain surrogate -A ρ, token-mean
        loss, stats = policy_loss(logprobs, old, adv, mask, loss="test_half_ratio", clip_low=0.99, clip_high=10.0)
        ratio = (0.5 * (logprobs - old)).exp().detach()
        expected = (-(adv.unsqueeze(-1) * ratio) * mask).sum() / mask.sum()
        assert abs(loss.item() - expected.item()) < 1e-6
        assert stats["ratio_max"] == pytest.approx(float(ratio[mask.bool()].max()))
        with pytest.raises(ValueError, match="already registered"):
            register_loss("test_half_ratio")(half)
        register_loss("test_half_ratio", overwrite=True)(half)
    finally:
        LOSSES.pop("test_half_ratio")


# --------------------------------------------------------------------------- agg_loss


def test_agg_loss_by_hand():
    values = torch.tensor([[1.0, 2.0, 3.0, 99.0], [4.0, 99.0, 99.0, 99.0], [99.0] * 4])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    assert float(agg_loss(values, mask, "token-mean")) == pytest.approx(10 / 4)
    assert float(agg_loss(values, mask, "seq-mean-token-mean")) == pytest.approx((2 + 4) / 2)
    assert float(agg_loss(values, mask, "seq-mean-token-sum-norm")) == pytest.approx((6 / 4 + 4 / 4) / 2)
    assert float(agg_loss(values, mask, "seq-mean-token-sum-norm", norm_length=8)) == pytest.approx((6 / 8 + 4 / 8) / 2)
    with pytest.raises(ValueError, match="unknown agg"):
        agg_loss(values, mask, "sum")


# --------------------------------------------------------------------------- KL and entropy


def test_kl_penalty_by_hand():
    logprobs = torch.tensor([[-1.0, 0.0, 0.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -30.0, 30.0]], requires_grad=True)
    torch.testing.assert_close(kl_penalty(logprobs, ref, "k1"), torch.tensor([[0.5, 30.0, -30.0]]))
    torch.testing.assert_close(kl_penalty(logprobs, ref, "k2"), torch.tensor([[0.125, 450.0, 450.0]]))
    # k3 = exp(ref - logp) - (ref - logp) - 1, ref - logp clamped to [-20, 20], result to [-10, 10]
    k3 = kl_penalty(logprobs, ref, "k3")
    torch.testing.assert_close(k3, torch.tensor([[E(-0.5) + 0.5 - 1, 10.0, 10.0]]))
    k3.sum().backward()
    assert ref.grad is None
    assert logprobs.grad[0, 0] == pytest.approx(1 - E(-0.5))  # d/dlogp: -exp(ref - logp) + 1
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_penalty(logprobs, ref, "k4")


def test_entropy_from_logits():
    assert float(entropy_from_logits(torch.zeros(4))) == pytest.approx(math.log(4))
    assert float(entropy_from_logits(torch.tensor([1000.0, 1000.0]))) == pytest.approx(math.log(2))
    logits = torch.tensor([0.0, 0.0, -float("inf"), -float("inf")], requires_grad=True)
    h = entropy_from_logits(logits)
    assert h.item() == pytest.approx(math.log(2))
    h.backward()
    assert torch.isfinite(logits.grad).all()
    gen = torch.Generator().manual_seed(0)
    random_logits = 3 * torch.randn(2, 5, 11, generator=gen)
    torch.testing.assert_close(entropy_from_logits(random_logits),
                               torch.distributions.Categorical(logits=random_logits).entropy())
