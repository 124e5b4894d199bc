"""Policy losses against hand-computed values on a 2 x 3 token example, and their gradients."""

import math

import pytest
import torch

from grouprl.algorithms.losses import LOSSES, clipped_surrogate, dapo_denominator, policy_loss

# row 0: ratios (1, 1.5, 0.5), advantage +1, 3 tokens; row 1: ratios (1.5, 0.5, [2.0 masked]), advantage -1
OLD = torch.zeros(2, 3)
LOGPS = torch.log(torch.tensor([[1.0, 1.5, 0.5], [1.5, 0.5, 2.0]]))
ADV = torch.tensor([1.0, -1.0])
MASK = torch.tensor([[True, True, True], [True, True, False]])
# per-token loss -min(rA, clip(r, 0.8, 1.2)A): row 0 -> (-1, -1.2, -0.5); row 1 -> (1.5, 0.8, masked)
ROW0, ROW1 = [-1.0, -1.2, -0.5], [1.5, 0.8]
TOKEN_SUM = sum(ROW0) + sum(ROW1)  # -0.4

EXPECTED = {
    "grpo": (sum(ROW0) / 3 + sum(ROW1) / 2) / 2,  # mean of sequence means = 0.125
    "bnpo": TOKEN_SUM / 5,  # -0.08
    "dr_grpo": TOKEN_SUM / (2 * 4),  # rows x max_completion_length (4) = -0.05
    "dapo": TOKEN_SUM / 10,  # token denominator 10 given = -0.04
}


def run(loss_type, logps=LOGPS, old=OLD, grad_accum_steps=1):
    return policy_loss(
        loss_type, logps, old, ADV, MASK, epsilon_low=0.2, epsilon_high=0.2,
        grad_accum_steps=grad_accum_steps, max_completion_length=4, token_denominator=10.0,
    )


@pytest.mark.parametrize("loss_type", sorted(EXPECTED))
def test_loss_value_by_hand(loss_type):
    loss, _ = run(loss_type)
    assert loss.item() == pytest.approx(EXPECTED[loss_type], abs=1e-6)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo"])
def test_gradient_accumulation_divides(loss_type):
    loss, _ = run(loss_type, grad_accum_steps=4)
    assert loss.item() == pytest.approx(EXPECTED[loss_type] / 4, abs=1e-7)


def test_clip_statistics_by_hand():
    _, stats = clipped_surrogate(LOGPS, LOGPS - OLD, LOGPS - OLD, ADV[:, None], MASK, epsilon_low=0.2, epsilon_high=0.2)
    assert stats["clip_ratio/low_mean"].item() == pytest.approx(1 / 5)  # row 1 token 1 (0.5 < 0.8, A < 0)
    assert stats["clip_ratio/high_mean"].item() == pytest.approx(1 / 5)  # row 0 token 1 (1.5 > 1.2, A > 0)
    assert stats["clip_ratio/region_mean"].item() == pytest.approx(2 / 5)
    assert stats["clip_ratio/low_min"].item() == pytest.approx(0.0)  # per-sequence fractions (0, 1/2)
    assert stats["clip_ratio/high_max"].item() == pytest.approx(1 / 3)  # per-sequence fractions (1/3, 0)


def test_asymmetric_clip_epsilon_high():
    per_token, _ = clipped_surrogate(LOGPS, LOGPS - OLD, LOGPS - OLD, ADV[:, None], MASK, epsilon_low=0.2, epsilon_high=0.28)
    assert per_token[0, 1].item() == pytest.approx(-1.28)  # 1.5 clipped at 1 + 0.28
    assert per_token[1, 1].item() == pytest.approx(0.8)  # lower bound unchanged


def test_on_policy_ratio_is_one_with_policy_gradient():
    """old_logprobs=None: value as if ratio 1, gradient of dapo is -A / D per loss token."""
    logps = torch.randn(2, 3, requires_grad=True)
    loss, stats = run("dapo", logps=logps, old=None)
    expected_value = -(ADV[0] * 3 + ADV[1] * 2) / 10
    assert loss.item() == pytest.approx(expected_value.item(), abs=1e-6)
    loss.backward()
    expected_grad = (-ADV[:, None] / 10) * MASK
    assert torch.allclose(logps.grad, expected_grad)
    assert stats["clip_ratio/region_mean"].item() == 0.0


def test_grpo_gradient_weights_tokens_by_inverse_length():
    logps = torch.zeros(2, 3, requires_grad=True)
    loss, _ = run("grpo", logps=logps, old=None)
    loss.backward()
    expected = torch.tensor([[-1 / 3, -1 / 3, -1 / 3], [1 / 2, 1 / 2, 0.0]]) / 2
    assert torch.allclose(logps.grad, expected)


def test_dapo_denominator_formula():
    # 1000 tokens over 2 processes, GA 4, spg 8 -> 1000 / 2 * 4 / 8
    assert dapo_denominator(1000, num_processes=2, grad_accum_steps=4, steps_per_generation=8) == 250.0
    assert dapo_denominator(600, num_processes=1, grad_accum_steps=2, steps_per_generation=2) == 600.0


def test_registry_names_and_unknown():
    assert {"grpo", "bnpo", "dr_grpo", "dapo"} <= set(LOSSES)
    with pytest.raises(ValueError, match="Unknown loss_type"):
        run("nope")


def test_masked_rows_contribute_nothing():
    mask = torch.tensor([[True, True, True], [False, False, False]])
    for loss_type in EXPECTED:
        loss, _ = policy_loss(loss_type, LOGPS, OLD, ADV, mask, epsilon_low=0.2, epsilon_high=0.2,
                              grad_accum_steps=1, max_completion_length=4, token_denominator=3.0)
        assert math.isfinite(loss.item())
