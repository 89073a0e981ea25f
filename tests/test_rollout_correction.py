"""Rollout correction (truncated importance sampling) pinned by hand-computed numbers."""
from __future__ import annotations

import math

import pytest
import torch

from masrl.algorithms import policy_loss, truncated_is_weights

E = math.exp
NAN, INF = float("nan"), float("inf")

# 2 x 3 example; row 1's last position is padding and holds garbage (NaN, -inf).
# log rho = train - rollout on valid tokens: row 0 [0, .5, -.3], row 1 [1.0, -.2]
TRAIN = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, NAN]])
ROLLOUT = torch.tensor([[-1.0, -2.5, -0.2], [-1.3, -1.0, -INF]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
K3 = [0.0, E(0.5) - 1.5, E(-0.3) - 0.7, E(1.0) - 2.0, E(-0.2) - 0.8]  # rho - log rho - 1


def _close(tensor, expected):
    assert torch.allclose(tensor, torch.tensor(expected, dtype=tensor.dtype), atol=1e-5), tensor


def test_token_truncate_hand_computed():
    w, stats = truncated_is_weights(TRAIN, ROLLOUT, MASK, cap=2.0, level="token", mode="truncate")
    _close(w, [[1.0, E(0.5), E(-0.3)], [2.0, E(-0.2), 0.0]])  # e^1 = 2.718 truncated to the cap
    assert stats["is_weight_mean"] == pytest.approx((1 + E(0.5) + E(-0.3) + 2 + E(-0.2)) / 5)  # 1.241654
    assert stats["is_capped_frac"] == pytest.approx(1 / 5)
    assert stats["is_weight_max"] == pytest.approx(E(1.0)) and stats["is_weight_min"] == pytest.approx(E(-0.3))
    assert stats["mismatch_kl"] == pytest.approx(-(0 + 0.5 - 0.3 + 1.0 - 0.2) / 5)  # -0.2
    assert stats["mismatch_k3"] == pytest.approx(sum(K3) / 5)  # 0.185310
    assert stats["valid_tokens"] == 5.0


def test_token_mask_drops_tokens_over_the_cap():
    w, stats = truncated_is_weights(TRAIN, ROLLOUT, MASK, cap=2.0, level="token", mode="mask")
    _close(w, [[1.0, E(0.5), E(-0.3)], [0.0, E(-0.2), 0.0]])
    assert stats["is_weight_mean"] == pytest.approx((1 + E(0.5) + E(-0.3) + E(-0.2)) / 5)  # 0.841654
    assert stats["is_capped_frac"] == pytest.approx(1 / 5)


def test_sequence_level_is_the_product_of_token_ratios():
    # row 0: exp(0 + .5 - .3) = e^.2 = 1.2214; row 1: exp(1 - .2) = e^.8 = 2.2255 -> cap 2
    w, stats = truncated_is_weights(TRAIN, ROLLOUT, MASK, cap=2.0, level="sequence", mode="truncate")
    _close(w, [[E(0.2)] * 3, [2.0, 2.0, 0.0]])
    assert stats["is_capped_frac"] == pytest.approx(1 / 2)  # one of two rows
    assert stats["is_weight_max"] == pytest.approx(E(0.8))
    assert stats["is_weight_mean"] == pytest.approx((3 * E(0.2) + 2 * 2.0) / 5)  # 1.532842
    masked, _ = truncated_is_weights(TRAIN, ROLLOUT, MASK, cap=2.0, level="sequence", mode="mask")
    _close(masked, [[E(0.2)] * 3, [0.0, 0.0, 0.0]])  # the whole row is dropped


def test_geometric_level_is_the_mean_log_ratio():
    # row 0: exp(.2 / 3) = 1.0689; row 1: exp(.8 / 2) = 1.4918; both under the cap
    w, stats = truncated_is_weights(TRAIN, ROLLOUT, MASK, cap=2.0, level="geometric")
    _close(w, [[E(0.2 / 3)] * 3, [E(0.4), E(0.4), 0.0]])
    assert stats["is_capped_frac"] == 0.0
    # a smaller cap truncates row 1 only
    w, stats = truncated_is_weights(TRAIN, ROLLOUT, MASK, cap=1.2, level="geometric")
    _close(w, [[E(0.2 / 3)] * 3, [1.2, 1.2, 0.0]])
    assert stats["is_capped_frac"] == pytest.approx(1 / 2)


def test_matching_logprobs_give_unit_weights_and_zero_kl():
    w, stats = truncated_is_weights(ROLLOUT.clone(), ROLLOUT, MASK, level="sequence")
    _close(w, [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    assert stats["mismatch_kl"] == 0.0 and stats["mismatch_k3"] == 0.0 and stats["is_capped_frac"] == 0.0


def test_weights_carry_no_gradient():
    train = TRAIN.clone().requires_grad_(True)
    w, _ = truncated_is_weights(train, ROLLOUT, MASK, cap=2.0)
    assert not w.requires_grad and w.grad_fn is None
    # a loss that uses the weights as coefficients: d/d train = w only (no term through w)
    (w * torch.nan_to_num(train, nan=0.0)).sum().backward()
    assert torch.allclose(train.grad, w)


def test_padding_and_extremes_stay_finite():
    train = torch.tensor([[0.0, -200.0], [5.0, 0.0]])
    rollout = torch.tensor([[-200.0, 0.0], [0.0, 0.0]])
    mask = torch.ones(2, 2)
    for level in ("token", "sequence", "geometric"):
        for mode in ("truncate", "mask"):
            w, stats = truncated_is_weights(train, rollout, mask, cap=3.0, level=level, mode=mode)
            assert torch.isfinite(w).all() and float(w.max()) <= 3.0
            assert all(math.isfinite(v) for v in stats.values())
    w, stats = truncated_is_weights(train, rollout, mask, cap=3.0, level="token", mode="truncate")
    _close(w, [[3.0, E(-20.0)], [3.0, 1.0]])  # log-ratios clamped to [-20, 20] before exp
    assert stats["is_weight_max"] == pytest.approx(E(20.0))


def test_nan_at_a_valid_position_raises():
    bad = TRAIN.clone()
    bad[0, 1] = NAN
    with pytest.raises(ValueError, match=r"train_logprobs .*non-finite.*\[0, 1\]"):
        truncated_is_weights(bad, ROLLOUT, MASK)
    bad_rollout = ROLLOUT.clone()
    bad_rollout[1, 0] = -INF
    with pytest.raises(ValueError, match="rollout_logprobs"):
        truncated_is_weights(TRAIN, bad_rollout, MASK)


def test_empty_mask_gives_zero_weights():
    w, stats = truncated_is_weights(TRAIN, ROLLOUT, torch.zeros(2, 3), level="sequence")
    assert torch.equal(w, torch.zeros(2, 3))
    assert stats["is_weight_mean"] == 1.0 and stats["is_capped_frac"] == 0.0 and stats["valid_tokens"] == 0.0


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="level"):
        truncated_is_weights(TRAIN, ROLLOUT, MASK, level="row")
    with pytest.raises(ValueError, match="mode"):
        truncated_is_weights(TRAIN, ROLLOUT, MASK, mode="clip")
    with pytest.raises(ValueError, match="cap"):
        truncated_is_weights(TRAIN, ROLLOUT, MASK, cap=0.0)
    with pytest.raises(ValueError, match="rollout_logprobs shape"):
        truncated_is_weights(TRAIN, ROLLOUT[:, :2], MASK)
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        truncated_is_weights(TRAIN[0], ROLLOUT[0], MASK[0])


def test_policy_loss_multiplies_token_losses_by_the_weights():
    logprobs = torch.tensor([[-1.0, -1.5, -0.5], [-0.2, -1.1, 0.0]], requires_grad=True)
    old = torch.tensor([[-1.0, -1.5, -0.5], [-0.2, -1.1, 0.0]])  # ratio 1: L = -A per token
    adv = torch.tensor([1.0, -1.0])
    w, _ = truncated_is_weights(TRAIN, ROLLOUT, MASK, cap=2.0)
    plain, _ = policy_loss(logprobs, old, adv, MASK)
    ones, _ = policy_loss(logprobs, old, adv, MASK, is_weights=torch.ones(2, 3))
    assert torch.allclose(plain, ones)
    weighted, _ = policy_loss(logprobs, old, adv, MASK, is_weights=w)
    # token-mean of -A_i * w_t: (-(1 + e^.5 + e^-.3) + (2 + e^-.2)) / 5
    expected = (-(1 + E(0.5) + E(-0.3)) + (2.0 + E(-0.2))) / 5
    assert float(weighted.detach()) == pytest.approx(expected, abs=1e-6)
    weighted.backward()
    # d loss / d logp_t = -A w_t / 5 at ratio 1 (unclipped); padding gets no gradient
    grad = -adv[:, None] * w / 5
    assert torch.allclose(logprobs.grad, grad, atol=1e-6)
    with pytest.raises(ValueError, match="is_weights shape"):
        policy_loss(logprobs, old, adv, MASK, is_weights=torch.ones(2, 2))
