"""Policy losses against hand-computed values on a 2 x 3 token example, and a slow per-token reference.

The example: row 0 has ratios (1, 1.5, 0.5) over 3 tokens, row 1 has ratios (1.5, 0.5) over 2 tokens
(its third token is padding). Old logprobs are 0, so logprobs = log ratio. Every expected number below
is worked out from the formula with plain arithmetic, never by calling the implementation.
"""

import itertools
import math

import pytest
import torch
from loss_reference import reference_policy_loss

from grouprl.core.losses import (
    LOSSES,
    KLPenalty,
    LossScale,
    TokenTerms,
    clipped_surrogate,
    dapo_denominator,
    gamma_weights,
    policy_loss,
)

OLD = torch.zeros(2, 3)
LOGPS = torch.log(torch.tensor([[1.0, 1.5, 0.5], [1.5, 0.5, 2.0]]))
ADV = torch.tensor([1.0, -1.0])
ADV_B = torch.tensor([1.0, -0.5])  # asymmetric advantages for the REINFORCE-style losses
MASK = torch.tensor([[True, True, True], [True, True, False]])
L15, L05 = math.log(1.5), math.log(0.5)
# per-token loss -min(rA, clip(r, 0.8, 1.2)A): row 0 -> (-1, -1.2, -0.5); row 1 -> (1.5, 0.8, masked)
ROW0, ROW1 = [-1.0, -1.2, -0.5], [1.5, 0.8]
TOKEN_SUM = sum(ROW0) + sum(ROW1)  # -0.4

EXPECTED = {
    "grpo": (sum(ROW0) / 3 + sum(ROW1) / 2) / 2,  # mean of sequence means = 0.125
    "bnpo": TOKEN_SUM / 5,  # -0.08
    "dr_grpo": TOKEN_SUM / (2 * 4),  # rows x max_completion_length (4) = -0.05
    "dapo": TOKEN_SUM / 10,  # token denominator 10 given = -0.04
    "luspo": (sum(ROW0) + sum(ROW1)) / 2,  # mean over sequences of token sums = -0.2
}


# The reference's flat keywords (GRPOConfig-style names) -> each loss's own hyper-parameter names.
SETTING_NAMES = {
    "epsilon_low": "epsilon_low",
    "epsilon_high": "epsilon_high",
    "delta": "delta",
    "sapo_temperature_pos": "tau_pos",
    "sapo_temperature_neg": "tau_neg",
    "vespo_k_pos": "k_pos",
    "vespo_lambda_pos": "lambda_pos",
    "vespo_k_neg": "k_neg",
    "vespo_lambda_neg": "lambda_neg",
}


def flat_policy_loss(
    loss_type,
    logprobs,
    old,
    advantages,
    mask,
    *,
    grad_accum_steps,
    max_completion_length,
    token_denominator,
    importance_sampling_level="token",
    beta=0.0,
    ref_logprobs=None,
    use_bias_correction_kl=True,
    sequence_keep=None,
    token_keep=None,
    sampler_weights=None,
    entropy=None,
    entropy_coef=0.0,
    **hyper_parameters,
):
    """`policy_loss` called with the flat keywords of `reference_policy_loss`: each loss gets its own settings."""
    own = LOSSES[loss_type].params if loss_type in LOSSES else {}
    settings = {SETTING_NAMES[k]: v for k, v in hyper_parameters.items() if SETTING_NAMES[k] in own}
    return policy_loss(
        loss_type,
        logprobs,
        old,
        advantages,
        mask,
        scale=LossScale(grad_accum_steps, max_completion_length, token_denominator),
        settings=settings,
        importance_sampling_level=importance_sampling_level,
        kl=KLPenalty(beta, ref_logprobs, use_bias_correction_kl),
        terms=TokenTerms(sequence_keep, token_keep, sampler_weights, entropy, entropy_coef),
    )


def run(loss_type, logps=LOGPS, old=OLD, adv=ADV, grad_accum_steps=1, **options):
    settings = dict(
        epsilon_low=0.2,
        epsilon_high=0.2,
        grad_accum_steps=grad_accum_steps,
        max_completion_length=4,
        token_denominator=10.0,
    )
    settings.update(options)
    return flat_policy_loss(loss_type, logps, old, adv, MASK, **settings)


def grad_of(loss_type, old=OLD, adv=ADV, **options):
    logps = LOGPS.clone().requires_grad_(True)
    loss, stats = run(loss_type, logps=logps, old=old, adv=adv, **options)
    loss.backward()
    return loss.item(), logps.grad, stats


# ---- the clip family: grpo, bnpo, dr_grpo, dapo, luspo ------------------------------------------------


@pytest.mark.parametrize("loss_type", sorted(EXPECTED))
def test_loss_value_by_hand(loss_type):
    loss, _ = run(loss_type)
    assert loss.item() == pytest.approx(EXPECTED[loss_type], abs=1e-6)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "luspo", "sapo"])
def test_gradient_accumulation_divides(loss_type):
    whole, _ = run(loss_type, adv=ADV_B)
    divided, _ = run(loss_type, adv=ADV_B, grad_accum_steps=4)
    assert divided.item() == pytest.approx(whole.item() / 4, abs=1e-7)


@pytest.mark.parametrize("loss_type", ["dapo", "cispo", "vespo"])
def test_token_mean_losses_do_not_divide_by_grad_accum(loss_type):
    """Their denominator D already carries GA / spg (see dapo_denominator)."""
    whole, _ = run(loss_type, adv=ADV_B, epsilon_high=1.2)
    same, _ = run(loss_type, adv=ADV_B, epsilon_high=1.2, grad_accum_steps=4)
    assert same.item() == pytest.approx(whole.item(), abs=1e-7)


def test_clip_statistics_by_hand():
    _, stats = clipped_surrogate(LOGPS, LOGPS - OLD, LOGPS - OLD, ADV[:, None], MASK, epsilon_low=0.2, epsilon_high=0.2)
    assert stats["clip_ratio/low_mean"].item() == pytest.approx(1 / 5)  # row 1 token 1 (0.5 < 0.8, A < 0)
    assert stats["clip_ratio/high_mean"].item() == pytest.approx(1 / 5)  # row 0 token 1 (1.5 > 1.2, A > 0)
    assert stats["clip_ratio/region_mean"].item() == pytest.approx(2 / 5)
    assert stats["clip_ratio/low_min"].item() == pytest.approx(0.0)  # per-sequence fractions (0, 1/2)
    assert stats["clip_ratio/high_max"].item() == pytest.approx(1 / 3)  # per-sequence fractions (1/3, 0)
    assert stats["policy_ratio/max"].item() == pytest.approx(1.5)  # 2.0 is padding
    assert stats["policy_ratio/mean"].item() == pytest.approx((1 + 1.5 + 0.5 + 1.5 + 0.5) / 5)


def test_asymmetric_clip_epsilon_high():
    per_token, _ = clipped_surrogate(
        LOGPS, LOGPS - OLD, LOGPS - OLD, ADV[:, None], MASK, epsilon_low=0.2, epsilon_high=0.28
    )
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


def test_luspo_gradient_weights_every_token_equally():
    logps = torch.zeros(2, 3, requires_grad=True)
    loss, _ = run("luspo", logps=logps, old=None)
    loss.backward()
    assert torch.allclose(logps.grad, torch.tensor([[-1.0, -1.0, -1.0], [1.0, 1.0, 0.0]]) / 2)


def test_delta_caps_only_the_unclipped_branch():
    """delta = 1.4: row 1 token 0 (r = 1.5, A = -1): -min(min(1.5, 1.4) * -1, 1.2 * -1) = 1.4 (1.5 without delta);
    its gradient vanishes (the cap is a constant). Row 0 token 1 (r = 1.5, A = +1) stays clipped at 1.2."""
    value, grad, stats = grad_of("dapo", delta=1.4)
    assert value == pytest.approx((sum(ROW0) + 1.4 + 0.8) / 10, abs=1e-6)  # -0.05
    _, plain_grad, _ = grad_of("dapo")
    assert plain_grad[1, 0].item() == pytest.approx(1.5 / 10)  # -A r / D without the cap
    assert grad[1, 0].item() == 0.0
    assert grad[0, 2].item() == pytest.approx(-0.5 / 10)  # r = 0.5 < delta, A > 0: unclipped, uncapped
    assert stats["policy_ratio/max"].item() == pytest.approx(1.4)  # clip metrics use the capped ratio


# ---- cispo, sapo, vespo ---------------------------------------------------------------------------


def test_cispo_by_hand():
    """-sg(min(r, 1.2)) A log pi, summed / D: weights (1, 1.2, 0.5 | 1.2, 0.5), A = (1, -0.5)."""
    value, grad, stats = grad_of("cispo", adv=ADV_B, epsilon_high=1.2)
    per_token = [-1.0 * 1 * 0.0, -1.2 * 1 * L15, -0.5 * 1 * L05, -1.2 * -0.5 * L15, -0.5 * -0.5 * L05]
    assert value == pytest.approx(sum(per_token) / 10, abs=1e-6)
    expected_grad = torch.tensor([[-1.0, -1.2, -0.5], [0.6, 0.25, 0.0]]) / 10  # -sg(w) A / D: the weight is detached
    assert torch.allclose(grad, expected_grad, atol=1e-6)
    assert stats["cispo_clip_ratio"].item() == pytest.approx(1 / 5)  # r = 1.5 > 1.2 with A > 0


def test_cispo_without_epsilon_high_caps_at_epsilon():
    """TRL's pitfall: eps_high falls back to eps = 0.2, an absolute cap, so every weight is 0.2."""
    _, grad, _ = grad_of("cispo", adv=ADV_B, epsilon_high=0.2)
    assert torch.allclose(grad, torch.tensor([[-0.2, -0.2, -0.2], [0.1, 0.1, 0.0]]) / 10, atol=1e-6)


def test_sapo_by_hand():
    """-(4/tau) sigmoid(tau (r - 1)) A, sequence means; tau = 1 for A > 0, 1.05 otherwise."""
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    row0 = [-4 * sig(r - 1) * 1.0 for r in (1.0, 1.5, 0.5)]  # mean -2: sigmoid(x) + sigmoid(-x) = 1
    row1 = [-(4 / 1.05) * sig(1.05 * (r - 1)) * -0.5 for r in (1.5, 0.5)]
    loss, _ = run("sapo", adv=ADV_B)
    assert loss.item() == pytest.approx((sum(row0) / 3 + sum(row1) / 2) / 2, abs=1e-6)
    assert loss.item() == pytest.approx((-2.0 + (2 / 1.05) / 2) / 2, abs=1e-6)


def test_sapo_gradient_at_ratio_one_equals_unclipped():
    """sigma'(0) = 1/4, so at w = 1 the gate's gradient is the plain policy gradient, as grpo's."""
    _, sapo_grad, _ = grad_of("sapo", old=None, adv=ADV_B)
    _, grpo_grad, _ = grad_of("grpo", old=None, adv=ADV_B)
    assert torch.allclose(sapo_grad, grpo_grad, atol=1e-7)


def test_sapo_zero_advantage_uses_negative_temperature():
    logps = torch.log(torch.tensor([[2.0, 1.0, 1.0], [1.0, 1.0, 1.0]]))
    loss, _ = run("sapo", logps=logps, adv=torch.tensor([0.0, 0.0]))
    assert loss.item() == 0.0  # A = 0 contributes nothing whatever the temperature


def test_vespo_by_hand():
    """Sequence log-ratios are sums: both rows have W = 0.75. phi = e^{lam(1-W)} W^k:
    row 0 (A >= 0: k 2, lam 3) = e^0.75 * 0.5625; row 1 (A < 0: k 3, lam 2) = e^0.5 * 0.421875."""
    phi0, phi1 = math.exp(0.75) * 0.75**2, math.exp(0.5) * 0.75**3
    value, grad, stats = grad_of("vespo", adv=ADV_B)
    per_token = [-phi0 * 1 * 0.0, -phi0 * 1 * L15, -phi0 * 1 * L05, -phi1 * -0.5 * L15, -phi1 * -0.5 * L05]
    assert value == pytest.approx(sum(per_token) / 10, abs=1e-6)
    assert torch.allclose(grad, torch.tensor([[-phi0, -phi0, -phi0], [0.5 * phi1, 0.5 * phi1, 0.0]]) / 10, atol=1e-6)
    assert stats["vespo/phi_seq_mean"].item() == pytest.approx((phi0 + phi1) / 2, abs=1e-6)


def test_vespo_phi_is_one_on_policy_and_zero_when_not_finite():
    phi = gamma_weights(torch.zeros(2, 3), ADV_B[:, None], MASK, k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0)
    assert torch.allclose(phi, torch.ones(2, 1))
    phi = gamma_weights(
        torch.zeros(2, 3), ADV_B[:, None], MASK, k_pos=float("inf"), lambda_pos=0.0, k_neg=3.0, lambda_neg=2.0
    )
    assert phi[0, 0].item() == 0.0  # inf * 0 -> NaN -> 0; lambda floored at 1e-4


def test_vespo_folds_sampler_weights_into_phi_instead_of_the_loss():
    """rho = (2, 1, 1) on row 0 adds log 2 to its sequence log-weight: W = 1.5, phi = e^{3 (1 - 1.5)} 1.5^2."""
    rho = torch.tensor([[2.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    phi0, phi1 = math.exp(-1.5) * 1.5**2, math.exp(0.5) * 0.75**3
    loss, stats = run("vespo", adv=ADV_B, sampler_weights=rho)
    per_token = [0.0, -phi0 * L15, -phi0 * L05, -phi1 * -0.5 * L15, -phi1 * -0.5 * L05]  # not multiplied by rho
    assert loss.item() == pytest.approx(sum(per_token) / 10, abs=1e-6)


# ---- importance-sampling level (GSPO) -------------------------------------------------------------


def test_sequence_level_ratio_is_the_geometric_mean():
    """Row 0: w = 0.75^(1/3); row 1: w = 0.75^(1/2) (padding excluded). Both inside the clip range."""
    w0, w1 = 0.75 ** (1 / 3), 0.75 ** (1 / 2)
    grpo, _ = run("grpo", importance_sampling_level="sequence")
    assert grpo.item() == pytest.approx((-w0 + w1) / 2, abs=1e-6)  # each row's loss is -w A on all its tokens
    dapo, _ = run("dapo", importance_sampling_level="sequence")
    assert dapo.item() == pytest.approx((3 * -w0 + 2 * w1) / 10, abs=1e-6)  # token sum weighs long rows more


def test_sequence_level_gradient_spreads_over_tokens():
    """d(-w0 A / 2)/d logpi_t = -w0 / (3 * 2) for each of row 0's tokens; the padding gets nothing."""
    _, grad, _ = grad_of("grpo", importance_sampling_level="sequence")
    w0, w1 = 0.75 ** (1 / 3), 0.75 ** (1 / 2)
    assert torch.allclose(grad, torch.tensor([[-w0 / 6] * 3, [w1 / 4, w1 / 4, 0.0]]), atol=1e-6)


def test_sequence_level_clipping_and_statistics_per_sequence():
    logps = torch.log(torch.tensor([[1.5, 1.5, 1.5], [0.5, 0.5, 9.0]]))  # w = 1.5 (A > 0), 0.5 (A < 0)
    loss, stats = run("grpo", logps=logps, importance_sampling_level="sequence")
    assert loss.item() == pytest.approx((-1.2 + 0.8) / 2, abs=1e-6)  # both clipped
    assert stats["clip_ratio/high_mean"].item() == pytest.approx(0.5)  # one of two sequences
    assert stats["clip_ratio/low_mean"].item() == pytest.approx(0.5)
    assert stats["clip_ratio/region_mean"].item() == pytest.approx(1.0)
    assert stats["clip_ratio/low_min"].item() == 0.0 and stats["clip_ratio/high_max"].item() == 1.0


# ---- KL penalty ---------------------------------------------------------------------------------


REF = torch.zeros(2, 3)  # d = ref - logpi = -log r
K3 = {1.0: 0.0, 1.5: 1 / 1.5 + L15 - 1, 0.5: 2.0 + L05 - 1}  # exp(d) - d - 1 at each ratio


def test_k3_kl_by_hand():
    kl_tokens = [K3[1.0], K3[1.5], K3[0.5], K3[1.5], K3[0.5]]
    loss, stats = run("dapo", beta=0.1, ref_logprobs=REF, use_bias_correction_kl=False)
    assert loss.item() == pytest.approx((TOKEN_SUM + 0.1 * sum(kl_tokens)) / 10, abs=1e-6)
    assert stats["kl"].item() == pytest.approx(sum(kl_tokens) / 5, abs=1e-6)


def test_bias_corrected_kl_is_weighted_by_the_ratio():
    weighted = [K3[1.0] * 1.0, K3[1.5] * 1.5, K3[0.5] * 0.5, K3[1.5] * 1.5, K3[0.5] * 0.5]
    loss, stats = run("dapo", beta=0.1, ref_logprobs=REF)  # use_bias_correction_kl defaults to True
    assert loss.item() == pytest.approx((TOKEN_SUM + 0.1 * sum(weighted)) / 10, abs=1e-6)
    assert stats["kl"].item() == pytest.approx(sum(weighted) / 5, abs=1e-6)


def test_kl_gradient_is_one_minus_ref_over_policy():
    """d k3 / d logpi = 1 - exp(ref - logpi) = 1 - 1/r, on top of the clipped surrogate's gradient."""
    _, grad, _ = grad_of("dapo", beta=0.1, ref_logprobs=REF, use_bias_correction_kl=False)
    _, plain, _ = grad_of("dapo")
    ratios = torch.tensor([[1.0, 1.5, 0.5], [1.5, 0.5, 2.0]])
    assert torch.allclose(grad - plain, 0.1 * (1 - 1 / ratios) * MASK / 10, atol=1e-6)


def test_kl_log_ratio_is_clamped():
    ref = torch.tensor([[200.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    loss, stats = run("dapo", beta=0.1, ref_logprobs=ref, use_bias_correction_kl=False)
    assert math.isfinite(loss.item())
    assert stats["kl"].item() == pytest.approx((math.exp(20) - 21 + K3[1.5] * 2 + K3[0.5] * 2) / 5, rel=1e-5)


def test_kl_is_neither_masked_by_the_off_policy_mask_nor_weighted_by_sampler_weights():
    loss, _ = run(
        "dapo",
        beta=0.1,
        ref_logprobs=REF,
        use_bias_correction_kl=False,
        sequence_keep=torch.zeros(2, 1),
        sampler_weights=torch.zeros(2, 3),
    )
    assert loss.item() == pytest.approx(0.1 * (K3[1.5] * 2 + K3[0.5] * 2) / 10, abs=1e-6)


# ---- masks, sampler weights and the entropy bonus inside policy_loss ------------------------------


def test_off_policy_sequence_mask_drops_the_row():
    loss, _ = run("dapo", sequence_keep=torch.tensor([[1.0], [0.0]]))
    assert loss.item() == pytest.approx(sum(ROW0) / 10, abs=1e-6)  # the denominator is unchanged


ENTROPY = torch.tensor([[0.1, 0.5, 0.9], [0.3, 0.7, 5.0]])  # 5.0 is padding
TOP_40 = torch.tensor([[False, False, True], [False, True, False]])


def test_high_entropy_mask_keeps_the_policy_term_of_kept_tokens_only():
    dapo, _ = run("dapo", token_keep=TOP_40)
    assert dapo.item() == pytest.approx((-0.5 + 0.8) / 10, abs=1e-6)
    grpo, _ = run("grpo", token_keep=TOP_40)
    assert grpo.item() == pytest.approx((-0.5 / 3 + 0.8 / 2) / 2, abs=1e-6)  # sequence lengths still count every token


def test_sampler_weights_multiply_the_per_token_loss():
    rho = torch.tensor([[2.0, 1.0, 1.0], [1.0, 0.0, 1.0]])
    loss, _ = run("dapo", sampler_weights=rho)
    assert loss.item() == pytest.approx((-2.0 - 1.2 - 0.5 + 1.5 + 0.0) / 10, abs=1e-6)
    seq, _ = run("grpo", sampler_weights=torch.tensor([[0.5], [2.0]]))  # sequence modes give (n, 1)
    assert seq.item() == pytest.approx((0.5 * sum(ROW0) / 3 + 2.0 * sum(ROW1) / 2) / 2, abs=1e-6)


@pytest.mark.parametrize("loss_type,ga", [("dapo", 1), ("grpo", 2), ("luspo", 2), ("dr_grpo", 1)])
def test_entropy_bonus_is_the_mean_entropy_for_every_loss_type(loss_type, ga):
    """loss = policy_loss / GA - c * mean(H) / GA; mean over loss tokens = (0.1+0.5+0.9+0.3+0.7)/5 = 0.5."""
    entropy = ENTROPY.clone().requires_grad_(True)
    loss, stats = run(loss_type, grad_accum_steps=ga, entropy=entropy, entropy_coef=0.1)
    base = EXPECTED[loss_type] / (ga if loss_type != "dapo" else 1)
    assert loss.item() == pytest.approx(base - 0.1 * 0.5 / ga, abs=1e-6)
    assert stats["policy_loss"].item() == pytest.approx(EXPECTED[loss_type], abs=1e-6)  # before the bonus and / GA
    loss.backward()
    assert torch.allclose(entropy.grad, -0.1 / 5 / ga * MASK)


def test_entropy_bonus_uses_the_high_entropy_mask():
    loss, _ = run("dapo", token_keep=TOP_40, entropy=ENTROPY, entropy_coef=0.1)
    assert loss.item() == pytest.approx((-0.5 + 0.8) / 10 - 0.1 * (0.9 + 0.7) / 2, abs=1e-6)


def test_dapo_denominator_formula():
    # 1000 tokens over 2 processes, GA 4, spg 8 -> 1000 / 2 * 4 / 8
    assert dapo_denominator(1000, num_processes=2, grad_accum_steps=4, steps_per_generation=8) == 250.0
    assert dapo_denominator(600, num_processes=1, grad_accum_steps=2, steps_per_generation=2) == 600.0


def test_registry_names_and_unknown():
    assert set(LOSSES) == {"grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"}
    with pytest.raises(ValueError, match="Unknown loss_type"):
        run("nope")


def test_masked_rows_contribute_nothing():
    mask = torch.tensor([[True, True, True], [False, False, False]])
    for loss_type in LOSSES:
        loss, _ = policy_loss(loss_type, LOGPS, OLD, ADV, mask, scale=LossScale(1, 4, 3.0))
        assert math.isfinite(loss.item())


# ---- fast batched implementation == slow per-token reference, value and gradient -----------------

OPTIONS = {
    "plain": {},
    "on_policy": {"on_policy": True},
    "delta": {"delta": 1.25},
    "kl": {"beta": 0.05, "use_bias_correction_kl": False},
    "kl_bias_corrected": {"beta": 0.05, "use_bias_correction_kl": True},
    "masks": {"sequence_keep": True, "token_keep": True},
    "sampler_weights": {"sampler_weights": True},
    "entropy_bonus": {"entropy": True, "entropy_coef": 0.02, "token_keep": True},
    "everything": {
        "delta": 1.3,
        "beta": 0.02,
        "sequence_keep": True,
        "token_keep": True,
        "sampler_weights": True,
        "entropy": True,
        "entropy_coef": 0.01,
    },
}


def random_case(seed, options):
    g = torch.Generator().manual_seed(seed)
    n, width = 5, 6
    lengths = torch.tensor([6, 3, 1, 0, 4])  # right padding, one row with no loss token
    mask = torch.arange(width)[None, :] < lengths[:, None]
    logprobs = -torch.rand(n, width, generator=g, dtype=torch.float64) * 3 - 0.05
    old = None if options.get("on_policy") else logprobs + 0.4 * torch.randn(n, width, generator=g, dtype=torch.float64)
    advantages = torch.randn(n, generator=g, dtype=torch.float64)
    advantages[1] = 0.0
    case = dict(logprobs=logprobs, old=old, advantages=advantages, mask=mask, kwargs={})
    kw = case["kwargs"]
    for name in ("delta", "beta", "use_bias_correction_kl", "entropy_coef"):
        if name in options:
            kw[name] = options[name]
    if "beta" in options:
        kw["ref_logprobs"] = logprobs + 0.5 * torch.randn(n, width, generator=g, dtype=torch.float64)
    if options.get("sequence_keep"):
        kw["sequence_keep"] = torch.tensor([[1.0], [0.0], [1.0], [1.0], [0.0]], dtype=torch.float64)
    if options.get("token_keep"):
        kw["token_keep"] = (torch.rand(n, width, generator=g) > 0.4) & mask
    if options.get("sampler_weights"):
        kw["sampler_weights"] = torch.rand(n, width, generator=g, dtype=torch.float64) * 2
    if options.get("entropy"):
        kw["entropy"] = torch.rand(n, width, generator=g, dtype=torch.float64) * 2
    return case


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("loss_type", sorted(LOSSES))
def test_batched_equals_per_token_reference(loss_type, option, level):
    for seed in range(3):
        case = random_case(seed, OPTIONS[option])
        settings = dict(
            epsilon_low=0.2,
            epsilon_high=0.28 if loss_type != "cispo" else 1.5,
            grad_accum_steps=2,
            max_completion_length=6,
            token_denominator=13.0,
            importance_sampling_level=level,
            sapo_temperature_pos=0.9,
            sapo_temperature_neg=1.1,
            vespo_k_pos=1.5,
            vespo_lambda_pos=2.5,
            vespo_k_neg=2.5,
            vespo_lambda_neg=1.5,
            **case["kwargs"],
        )
        results = []
        for implementation in (flat_policy_loss, reference_policy_loss):
            logprobs = case["logprobs"].clone().requires_grad_(True)
            inputs = dict(settings)
            if "entropy" in inputs:
                inputs["entropy"] = inputs["entropy"].clone().requires_grad_(True)
            out = implementation(loss_type, logprobs, case["old"], case["advantages"], case["mask"], **inputs)
            loss = out[0] if isinstance(out, tuple) else out
            loss.backward()
            entropy_grad = inputs["entropy"].grad if "entropy" in inputs else None
            results.append((loss.detach(), logprobs.grad, entropy_grad))
        (fast, fast_grad, fast_h), (slow, slow_grad, slow_h) = results
        assert torch.allclose(fast, slow, atol=1e-10), (seed, fast.item(), slow.item())
        assert torch.allclose(fast_grad, slow_grad, atol=1e-10), seed
        if fast_h is not None:
            assert torch.allclose(fast_h, slow_h, atol=1e-10)


def test_reference_covers_every_registered_loss():
    assert set(LOSSES) <= {"grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo"}
    assert len(list(itertools.product(LOSSES, OPTIONS, ["token", "sequence"]))) == 8 * len(OPTIONS) * 2
