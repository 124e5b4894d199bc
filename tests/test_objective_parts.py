"""The pure functions around the loss, against hand-computed values on tiny examples (and slow loops):
sampler-mismatch importance weights (4 modes), off-policy sequence masking, high-entropy tokens, the
adaptive entropy controller, tied groups and the sequence-level log-weight."""

import math

import pytest
import torch

from grouprl.core.entropy import EntropyController
from grouprl.core.kl import k3_kl
from grouprl.core.losses import log_importance_weights, sampler_importance_weights
from grouprl.core.masks import off_policy_mask, tied_groups

NAN = float("nan")
MASK = torch.tensor([[True, True, True], [True, True, False]])
# trainer (old) and sampler logprobs; the sampler could not score row 1 token 0 (NaN); row 1 token 2 is padding
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -3.0]])
SAMPLER = torch.tensor([[-1.5, -2.0, -0.2], [NAN, -0.2, -1.0]])
# d = old - sampler on valid tokens: row 0 (0.5, 0, -0.3), row 1 (0 [NaN], -0.8, 0 [padding])
E = math.exp


def weights(mode, clip_min=None, clip_max=None):
    return sampler_importance_weights(OLD, SAMPLER, MASK, mode=mode, clip_min=clip_min, clip_max=clip_max)


def test_token_truncate_by_hand():
    rho, stats = weights("token_truncate", clip_max=1.5)
    expected = torch.tensor([[1.5, 1.0, E(-0.3)], [1.0, E(-0.8), 1.0]])  # e^0.5 = 1.65 truncated to 1.5
    assert torch.allclose(rho, expected, atol=1e-6)
    assert stats["sampling/sampling_logp_difference/mean"] == pytest.approx(
        (0.5 + 0 + 0.3 + 0.8) / 4
    )  # NaN token left out
    assert stats["sampling/sampling_logp_difference/max"] == pytest.approx(0.8)
    valid = [1.5, 1.0, E(-0.3), 1.0, E(-0.8)]  # the loss tokens
    assert stats["sampling/importance_sampling_ratio/min"] == pytest.approx(E(-0.8))
    assert stats["sampling/importance_sampling_ratio/mean"] == pytest.approx(sum(valid) / 5)
    assert stats["sampling/importance_sampling_ratio/max"] == pytest.approx(1.5)
    assert stats["sampling/importance_sampling_masked_fraction"] == 0.0  # truncation never zeroes a weight


def test_token_truncate_lower_bound_only():
    rho, _ = weights("token_truncate", clip_min=0.5)
    assert torch.allclose(rho, torch.tensor([[E(0.5), 1.0, E(-0.3)], [1.0, 0.5, 1.0]]), atol=1e-6)


def test_token_mask_by_hand():
    rho, stats = weights("token_mask", clip_min=0.5, clip_max=1.5)  # IcePop: outside [0.5, 1.5] -> 0
    assert torch.allclose(rho, torch.tensor([[0.0, 1.0, E(-0.3)], [1.0, 0.0, 1.0]]), atol=1e-6)
    assert stats["sampling/importance_sampling_masked_fraction"] == pytest.approx(2 / 5)  # 2 of the 5 loss tokens


def test_sequence_modes_use_the_product_of_token_ratios():
    rho, stats = weights("sequence_truncate", clip_min=0.5, clip_max=3.0)  # sums of d: 0.2 and -0.8
    assert rho.shape == (2, 1)
    assert torch.allclose(rho, torch.tensor([[E(0.2)], [0.5]]), atol=1e-6)
    assert stats["sampling/importance_sampling_ratio/mean"] == pytest.approx((E(0.2) + 0.5) / 2)  # over sequences
    rho, stats = weights("sequence_mask", clip_min=0.5, clip_max=3.0)
    assert torch.allclose(rho, torch.tensor([[E(0.2)], [0.0]]), atol=1e-6)
    assert stats["sampling/importance_sampling_masked_fraction"] == pytest.approx(1 / 2)  # 1 of 2 sequences
    rho, _ = weights("sequence_mask", clip_max=1.1)  # TRL default mode with only C_max
    assert torch.allclose(rho, torch.tensor([[0.0], [E(-0.8)]]), atol=1e-6)


def test_unknown_mode():
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode"):
        weights("token_nope", clip_max=2.0)


def test_sampler_weights_against_a_loop():
    g = torch.Generator().manual_seed(0)
    old, sampler = -torch.rand(4, 5, generator=g) * 3, -torch.rand(4, 5, generator=g) * 3
    mask = torch.arange(5)[None] < torch.tensor([5, 2, 0, 4])[:, None]
    for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"):
        rho, _ = sampler_importance_weights(old, sampler, mask, mode=mode, clip_min=0.4, clip_max=2.0)
        for i in range(4):
            ds = [float(old[i, t] - sampler[i, t]) if mask[i, t] else 0.0 for t in range(5)]
            values = [math.exp(sum(ds))] if mode.startswith("sequence") else [math.exp(d) for d in ds]
            for t, value in enumerate(values):
                if mode.endswith("truncate"):
                    value = min(max(value, 0.4), 2.0)
                elif not 0.4 <= value <= 2.0:
                    value = 0.0
                assert rho[i, t].item() == pytest.approx(value, rel=1e-5), (mode, i, t)


def test_off_policy_mask_keeps_positive_or_close_and_drops_negative_and_far():
    current = torch.zeros(3, 2)
    behaviour = torch.tensor([[2.0, 2.0], [2.0, 2.0], [0.1, 0.1]])  # mean drift 2, 2, 0.1
    advantages = torch.tensor([1.0, -1.0, -1.0])
    keep = off_policy_mask(current, behaviour, advantages, torch.ones(3, 2, dtype=torch.bool), threshold=0.5)
    assert keep.squeeze(1).tolist() == [1.0, 0.0, 1.0]


def test_off_policy_mask_ignores_padding_and_nan():
    current = torch.zeros(1, 3)
    behaviour = torch.tensor([[1.0, NAN, 50.0]])  # NaN counts as 0 drift; 50 is padding
    mask = torch.tensor([[True, True, False]])
    assert off_policy_mask(current, behaviour, torch.tensor([-1.0]), mask, threshold=0.6).item() == 1.0  # drift 0.5
    assert off_policy_mask(current, behaviour, torch.tensor([-1.0]), mask, threshold=0.4).item() == 0.0


def test_static_entropy_coefficient_never_moves():
    controller = EntropyController(coef=0.1)
    assert controller.applied_coef() == 0.1
    assert controller.end_step(10.0, 1.0) == 0.1 and controller.applied_coef() == 0.1


def test_adaptive_entropy_controller():
    c = EntropyController(coef=0.01, adaptive=True, target=0.2, delta=0.005, coef_min=0.0, coef_max=0.02)
    assert c.applied_coef() == 0.0  # no measurement yet: previous entropy is +inf
    assert c.end_step(1.5, 15.0) == pytest.approx(0.015)  # entropy 0.1 <= 0.2: coef up
    assert c.applied_coef() == pytest.approx(0.015)
    assert c.end_step(1.0, 10.0) == pytest.approx(0.02)  # 0.1 again, capped at coef_max 0.02
    assert c.end_step(1.0, 10.0) == pytest.approx(0.02)
    assert c.end_step(3.0, 10.0) == pytest.approx(0.015)  # 0.3 > target: coef down, and no bonus next step
    assert c.applied_coef() == 0.0
    for _ in range(5):
        c.end_step(3.0, 10.0)
    assert c.coef == 0.0  # floored at coef_min
    restored = EntropyController(coef=0.5, adaptive=True)
    restored.load_state_dict(c.state_dict())
    assert (restored.coef, restored.last_entropy) == (c.coef, c.last_entropy)


def test_tied_groups():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, NAN, NAN, 1.0, 2.0, 2.0, NAN])
    assert tied_groups(rewards, 3).tolist() == [True, False, True, True]  # all equal; differ; 1 valid; 2 equal valid


def test_sequence_log_weights_skip_padding():
    log_ratio = torch.tensor([[0.3, -0.6, 9.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [False, False, False]])
    assert torch.allclose(log_importance_weights(log_ratio, mask, "sequence"), torch.tensor([[-0.15], [0.0]]))
    assert log_importance_weights(log_ratio, mask, "token") is log_ratio


def test_k3_is_non_negative_and_zero_at_equality():
    logps = torch.tensor([-1.0, -2.0, -0.1])
    assert torch.all(k3_kl(logps, logps) == 0)
    assert torch.all(k3_kl(logps, logps + torch.tensor([0.5, -0.5, 3.0])) > 0)
