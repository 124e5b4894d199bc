"""Group-relative advantages against values computed by hand (TRL 1.16 conventions)."""

import math

import pytest
import torch

from grouprl.core.advantages import group_advantages, nanmean, nanstd

NAN = float("nan")
EPS = 1e-4


def adv(rows, weights=None, group_size=3, **kwargs):
    rewards = torch.tensor(rows, dtype=torch.float32)
    if rewards.ndim == 1:
        rewards = rewards[:, None]
    w = torch.tensor(weights or [1.0] * rewards.shape[1])
    return group_advantages(rewards, w, group_size=group_size, **kwargs)


def test_group_scaling_unbiased_std_plus_eps():
    a, stats = adv([1, 2, 3, 0, 0, 0])
    # group 1: mean 2, unbiased std 1; group 2: std 0 -> 0 / eps = 0
    expected = [-1 / (1 + EPS), 0.0, 1 / (1 + EPS), 0.0, 0.0, 0.0]
    assert a.tolist() == pytest.approx(expected, abs=1e-6)
    assert stats["group_std"].tolist() == pytest.approx([1, 1, 1, 0, 0, 0])


def test_batch_scaling_uses_batch_std_but_group_mean():
    a, _ = adv([1, 2, 3, 0, 0, 0], scale_rewards="batch")
    batch_std = math.sqrt(((1 - 1) ** 2 + (2 - 1) ** 2 + (3 - 1) ** 2 + 3 * (0 - 1) ** 2) / 5)
    expected = [-1 / (batch_std + EPS), 0.0, 1 / (batch_std + EPS), 0.0, 0.0, 0.0]
    assert a.tolist() == pytest.approx(expected, abs=1e-6)


def test_no_scaling_only_centers():
    a, _ = adv([1, 2, 3, 0, 0, 0], scale_rewards="none")
    assert a.tolist() == pytest.approx([-1, 0, 1, 0, 0, 0], abs=1e-6)


def test_weights_and_none_rewards():
    # rows: f1 only, f2 only, neither (unscorable); weights 1 and 0.5
    a, stats = adv([[1, NAN], [NAN, 4], [NAN, NAN]], weights=[1.0, 0.5])
    totals = [1.0, 2.0]
    mean = 1.5
    std = math.sqrt(((1 - mean) ** 2 + (2 - mean) ** 2) / 1)
    expected = [(1 - mean) / (std + EPS), (2 - mean) / (std + EPS), 0.0]
    assert a.tolist() == pytest.approx(expected, abs=1e-6)
    assert stats["unscorable"].tolist() == [False, False, True]
    assert stats["total"][:2].tolist() == pytest.approx(totals)
    assert math.isnan(stats["total"][2])


def test_group_with_single_valid_reward_gets_zero_advantage():
    a, _ = adv([[5.0], [NAN], [NAN]])
    assert a.tolist() == [0.0, 0.0, 0.0]


def test_all_none_batch_is_all_zero_and_finite():
    a, _ = adv([[NAN]] * 6)
    assert a.tolist() == [0.0] * 6


def test_normalize_then_sum_gdpo():
    rows = [[0, 1], [1, 1], [1, 0], [1, 2]]  # two groups of 2, two functions
    a, _ = adv(rows, weights=[1.0, 1.0], group_size=2, aggregation="normalize_then_sum")
    s = 1 / math.sqrt(2)  # unbiased std of (0, 1) is 1/sqrt(2); of (0, 2) is sqrt(2)
    z_g1 = [-0.5 / (s + EPS), 0.5 / (s + EPS)]  # f1 in group 1; f2 in group 1 has std 0 -> 0
    z_g2 = [-1 / (math.sqrt(2) + EPS), 1 / (math.sqrt(2) + EPS)]  # f2 in group 2; f1 in group 2 -> 0
    summed = z_g1 + z_g2
    mean = sum(summed) / 4
    std = math.sqrt(sum((x - mean) ** 2 for x in summed) / 3)
    expected = [(x - mean) / (std + EPS) for x in summed]
    assert a.tolist() == pytest.approx(expected, abs=1e-5)


def test_nan_helpers():
    x = torch.tensor([[1.0, NAN, 3.0], [NAN, NAN, NAN]])
    assert nanmean(x, 1)[0].item() == 2.0 and math.isnan(nanmean(x, 1)[1])
    assert nanstd(x, 1)[0].item() == pytest.approx(math.sqrt(2.0))
    assert math.isnan(nanstd(torch.tensor([1.0, NAN]), 0))


def test_rejects_rows_not_divisible_by_group():
    with pytest.raises(ValueError, match="groups of 3"):
        adv([1, 2, 3, 4])
