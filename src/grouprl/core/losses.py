"""Policy-gradient losses of the GRPO family, as pure functions plus one registry.

A loss is two pieces:

1. a *per-token objective* turning the policy's logprobs, importance weights w (token level, or
   sequence level for GSPO) and advantages A into a per-token loss:

   ==========  ==================================================================================
   clip        -min(w' A, clip(w, 1 - eps_low, 1 + eps_high) A), w' = min(w, delta) if delta is
               set (PPO, Schulman et al. 2017; GRPO; INTELLECT-2 two-sided clipping)
   cispo       -sg(min(w, eps_high)) A log pi  (MiniMax-M1; eps_high is an absolute cap here)
   sapo        -(4 / tau) sigmoid(tau (w - 1)) A, tau = tau_pos if A > 0 else tau_neg (SAPO, Qwen)
   vespo       -sg(phi) A log pi, phi = exp(lam + k log W - lam W) of the sequence ratio W
               (VESPO: a normalised Gamma kernel, phi(1) = 1)
   ==========  ==================================================================================

2. an *aggregation* turning the (n, T) loss into the scalar of one micro-step (TRL 1.16 semantics,
   already divided for gradient accumulation so that summing micro-step gradients gives the
   optimizer step's gradient):

   ===============  ===================================================================
   grpo, sapo       mean over sequences of the sequence's token mean, / GA (DeepSeekMath)
   bnpo             token mean over the micro-batch, / GA
   dr_grpo          token sum / (rows * max_completion_length), / GA (Dr. GRPO, Liu et al.)
   dapo, cispo,     token sum / D, D = loss tokens of the generation batch per process * GA
   vespo            / spg (DAPO, Yu et al. 2025): the token mean over the optimizer step
   luspo            mean over sequences of the sequence's token *sum*, / GA (LUSPO)
   ===============  ===================================================================

`policy_loss` composes them with everything else that acts per token, in TRL's order: the
objective, x the off-policy sequence mask, x the high-entropy token mask, x the sampler-mismatch
weights (not for vespo, which folds them into phi), + beta x k3 KL (x w when bias-corrected), then
the aggregation, then the entropy bonus. ``LOSSES[loss_type]`` holds the per-loss pieces; adding a
variant is one function and one entry.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from grouprl.core.importance import log_importance_weights
from grouprl.core.kl import k3_kl

VESPO_LOG_CLAMP = 20.0  # per-token and per-sequence log-ratio clamp of VESPO
VESPO_LOG_FLOOR = math.log(1e-8)  # lower clamp of the sequence log-weight and of log rho
VESPO_LAMBDA_FLOOR = 1e-4


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` where `mask` is True (0 if nothing is masked in)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def _fraction(flags: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(overall fraction, per-row fractions) of `flags`: over loss tokens for (n, T) flags; over
    rows for sequence-level (n, 1) flags (TRL counts every row then)."""
    flags = flags.float()
    if flags.shape[1] == 1:
        return flags.mean(), flags.squeeze(1)
    tokens = mask.sum(dim=1)
    rows = tokens > 0
    return masked_mean(flags, mask), (flags * mask).sum(dim=1)[rows] / tokens[rows]


def _ratio_stats(weights: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """grouprl's policy_ratio/* metrics: w over loss tokens (token level) or rows (sequence level)."""
    values = weights.detach().squeeze(1) if weights.shape[1] == 1 else weights.detach()[mask]
    nan = torch.tensor(float("nan"))
    if values.numel() == 0:
        return {"policy_ratio/mean": nan, "policy_ratio/min": nan, "policy_ratio/max": nan}
    return {"policy_ratio/mean": values.mean(), "policy_ratio/min": values.min(), "policy_ratio/max": values.max()}


# ---- per-token objectives -------------------------------------------------------------------
# Shared signature: (logprobs (n, T), log_ratio (n, T) token-level log pi - log pi_old,
# log_weights (n, T) | (n, 1) at the chosen level, advantages (n, 1), mask (n, T), **scalars)
# -> (per-token loss (n, T) | (n, 1), stats).


def clipped_surrogate(
    logprobs: torch.Tensor,
    log_ratio: torch.Tensor,
    log_weights: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    epsilon_low: float,
    epsilon_high: float,
    delta: Optional[float] = None,
    **_: object,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped objective -min(w' A, clip(w, 1 - eps_low, 1 + eps_high) A), w' = min(w, delta).

    The clipped branch uses the uncapped w; delta caps only the unclipped branch (INTELLECT-2).
    Clip statistics (with the capped w, as TRL): fraction clipped low (w < 1 - eps_low, A < 0), high
    (w > 1 + eps_high, A > 0) and either, as a mean and as the min/max over sequences.
    """
    weights = torch.exp(log_weights)
    clipped = torch.clamp(weights, 1.0 - epsilon_low, 1.0 + epsilon_high) * advantages
    capped = weights if delta is None else torch.clamp(weights, max=delta)
    per_token = -torch.minimum(capped * advantages, clipped)
    with torch.no_grad():
        low = (capped < 1.0 - epsilon_low) & (advantages < 0)
        high = (capped > 1.0 + epsilon_high) & (advantages > 0)
        low_mean, low_rows = _fraction(low, mask)
        high_mean, high_rows = _fraction(high, mask)
        region_mean, _ = _fraction(low | high, mask)
        nan = torch.tensor(float("nan"))
        stats = {
            "clip_ratio/low_mean": low_mean,
            "clip_ratio/high_mean": high_mean,
            "clip_ratio/region_mean": region_mean,
            "clip_ratio/low_min": low_rows.min() if low_rows.numel() else nan,
            "clip_ratio/high_max": high_rows.max() if high_rows.numel() else nan,
            **_ratio_stats(capped, mask),
        }
    return per_token, stats


def cispo_objective(
    logprobs: torch.Tensor,
    log_ratio: torch.Tensor,
    log_weights: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    epsilon_high: float,
    **_: object,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO: REINFORCE on log pi weighted by the detached ratio capped at eps_high (no lower clip)."""
    weights = torch.exp(log_weights)
    capped = torch.clamp(weights, max=epsilon_high).detach()
    per_token = -capped * advantages * logprobs
    with torch.no_grad():
        fraction, _ = _fraction((weights > epsilon_high) & (advantages > 0), mask)
        stats = {"cispo_clip_ratio": fraction, **_ratio_stats(weights, mask)}
    return per_token, stats


def sapo_objective(
    logprobs: torch.Tensor,
    log_ratio: torch.Tensor,
    log_weights: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    sapo_temperature_pos: float,
    sapo_temperature_neg: float,
    **_: object,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO: a smooth sigmoid gate instead of a hard clip; at w = 1 its gradient equals the unclipped one."""
    weights = torch.exp(log_weights)
    tau = torch.where(advantages > 0, sapo_temperature_pos, sapo_temperature_neg)  # A = 0 uses tau_neg
    per_token = -(4.0 / tau) * torch.sigmoid(tau * (weights - 1.0)) * advantages
    return per_token, _ratio_stats(weights, mask)


def gamma_weights(
    log_ratio: torch.Tensor,  # (n, T) token-level log pi - log pi_old
    advantages: torch.Tensor,  # (n, 1)
    mask: torch.Tensor,  # (n, T) bool
    *,
    k_pos: float,
    lambda_pos: float,
    k_neg: float,
    lambda_neg: float,
    sampler_weights: Optional[torch.Tensor] = None,  # (n, T) token-level sampler-mismatch rho
) -> torch.Tensor:
    """VESPO's detached per-sequence weight phi (n, 1) = exp(lam + k log W - lam W), phi(1) = 1.

    log W = clamp(sum_t clamp(log r_t, +-20) [+ sum_t clamp(log rho_t, ln 1e-8, 20)], ln 1e-8, 20):
    a *sum* over the sequence's loss tokens (not a mean). (k, lam) are the positive-advantage pair
    for A >= 0, else the negative one; lam is floored at 1e-4; non-finite phi becomes 0.
    """
    with torch.no_grad():
        m = mask.to(log_ratio.dtype)
        log_w = (torch.clamp(log_ratio, -VESPO_LOG_CLAMP, VESPO_LOG_CLAMP) * m).sum(dim=1, keepdim=True)  # (n, 1)
        if sampler_weights is not None:
            log_rho = torch.clamp(torch.log(sampler_weights), VESPO_LOG_FLOOR, VESPO_LOG_CLAMP)
            log_w = log_w + (log_rho * m).sum(dim=1, keepdim=True)
        log_w = torch.clamp(log_w, VESPO_LOG_FLOOR, VESPO_LOG_CLAMP)
        positive = advantages >= 0
        k = torch.where(positive, k_pos, k_neg)
        lam = torch.where(positive, lambda_pos, lambda_neg).clamp(min=VESPO_LAMBDA_FLOOR)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
        return torch.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0)


def vespo_objective(
    logprobs: torch.Tensor,
    log_ratio: torch.Tensor,
    log_weights: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    vespo_k_pos: float,
    vespo_lambda_pos: float,
    vespo_k_neg: float,
    vespo_lambda_neg: float,
    sampler_weights: Optional[torch.Tensor] = None,
    **_: object,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """VESPO: REINFORCE on log pi weighted by the detached sequence-level Gamma kernel phi."""
    phi = gamma_weights(
        log_ratio,
        advantages,
        mask,
        k_pos=vespo_k_pos,
        lambda_pos=vespo_lambda_pos,
        k_neg=vespo_k_neg,
        lambda_neg=vespo_lambda_neg,
        sampler_weights=sampler_weights,
    )  # (n, 1)
    per_token = -phi * advantages * logprobs
    return per_token, {"vespo/phi_seq_mean": phi.mean(), **_ratio_stats(torch.exp(log_weights), mask)}


# ---- aggregations: (n, T) per-token loss -> scalar for one micro-step -------------------------


def sequence_mean_aggregation(
    per_token: torch.Tensor, mask: torch.Tensor, *, grad_accum_steps: int, **_: object
) -> torch.Tensor:
    """grpo, sapo: each sequence's token mean, averaged over sequences."""
    m = mask.to(per_token.dtype)
    per_sequence = (per_token * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)
    return per_sequence.mean() / grad_accum_steps


def micro_batch_token_mean_aggregation(
    per_token: torch.Tensor, mask: torch.Tensor, *, grad_accum_steps: int, **_: object
) -> torch.Tensor:
    """bnpo: token mean over the local micro-batch."""
    return masked_mean(per_token, mask) / grad_accum_steps


def constant_length_aggregation(
    per_token: torch.Tensor, mask: torch.Tensor, *, grad_accum_steps: int, max_completion_length: int, **_: object
) -> torch.Tensor:
    """dr_grpo: token sum divided by a constant (rows x max_completion_length), free of length bias."""
    m = mask.to(per_token.dtype)
    return (per_token * m).sum() / (per_token.shape[0] * max_completion_length) / grad_accum_steps


def global_token_mean_aggregation(
    per_token: torch.Tensor, mask: torch.Tensor, *, token_denominator: float, **_: object
) -> torch.Tensor:
    """dapo, cispo, vespo: token sum over the global token count of the optimizer step (`dapo_denominator`)."""
    m = mask.to(per_token.dtype)
    return (per_token * m).sum() / max(token_denominator, 1.0)


def sequence_sum_aggregation(
    per_token: torch.Tensor, mask: torch.Tensor, *, grad_accum_steps: int, **_: object
) -> torch.Tensor:
    """luspo: each sequence's token sum (its mean loss times its length), averaged over sequences."""
    m = mask.to(per_token.dtype)
    return (per_token * m).sum(dim=1).mean() / grad_accum_steps


def dapo_denominator(
    loss_tokens_in_generation: float, *, num_processes: int, grad_accum_steps: int, steps_per_generation: int
) -> float:
    """D of TRL 1.16: loss tokens of the generation batch (all processes) / P * GA / spg.

    With spg == GA one generation feeds one optimizer step and D is the per-process share of its
    tokens, so after DDP averages gradients over processes the loss is the global token mean. The
    GA / spg factor keeps that true when one generation feeds several optimizer steps (spg > GA) or
    one optimizer step takes several generations (spg < GA).
    """
    return loss_tokens_in_generation / num_processes * grad_accum_steps / steps_per_generation


@dataclass(frozen=True)
class LossSpec:
    objective: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
    aggregate: Callable[..., torch.Tensor]
    divides_by_grad_accum: bool = True  # False: normalised by the global token count instead
    sampler_weights_in_loss: bool = True  # False: the objective uses the sampler weights itself (vespo)
    regroupable: bool = True  # False: a row's weight depends on its micro-batch's other rows (bnpo), so rows stay put
    params: dict = field(default_factory=dict)  # the loss's own hyper-parameters and defaults (GRPOConfig.loss_kwargs)


LOSSES: dict[str, LossSpec] = {
    "grpo": LossSpec(clipped_surrogate, sequence_mean_aggregation),
    "bnpo": LossSpec(clipped_surrogate, micro_batch_token_mean_aggregation, regroupable=False),
    "dr_grpo": LossSpec(clipped_surrogate, constant_length_aggregation),
    "dapo": LossSpec(clipped_surrogate, global_token_mean_aggregation, divides_by_grad_accum=False),
    "cispo": LossSpec(cispo_objective, global_token_mean_aggregation, divides_by_grad_accum=False),
    "sapo": LossSpec(sapo_objective, sequence_mean_aggregation),
    "luspo": LossSpec(clipped_surrogate, sequence_sum_aggregation),
    "vespo": LossSpec(
        vespo_objective, global_token_mean_aggregation, divides_by_grad_accum=False, sampler_weights_in_loss=False
    ),
}


def register_loss(
    name: str,
    objective: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]],
    aggregate: Callable[..., torch.Tensor],
    *,
    params: Optional[dict] = None,
    divides_by_grad_accum: bool = True,
    sampler_weights_in_loss: bool = True,
    regroupable: bool = True,
    replace: bool = False,
) -> LossSpec:
    """Make ``GRPOConfig(loss_type=name)`` available, from any module (call it before building the config).

    ``objective(logprobs, log_ratio, log_weights, advantages, mask, **settings) -> (per_token (n, T) or (n, 1),
    stats)`` receives the built-in settings (epsilon_low, epsilon_high, delta, sampler_weights, ...) and the
    loss's own ``params`` (defaults here, overridden by ``GRPOConfig.loss_kwargs``); it should accept ``**_``.
    ``aggregate(per_token, mask, *, grad_accum_steps, max_completion_length, token_denominator) -> scalar``:
    one of this module's ``*_aggregation`` functions or your own. ``divides_by_grad_accum=False`` when the
    aggregation normalises by the global token count; ``regroupable=False`` when a row's weight depends on
    the other rows of its micro-batch.
    """
    if not callable(objective) or not callable(aggregate):
        raise TypeError(f"register_loss({name!r}): objective and aggregate must be callables.")
    if name in LOSSES and not replace:
        raise ValueError(f"register_loss: loss_type {name!r} exists already; pass replace=True to redefine it.")
    spec = LossSpec(
        objective,
        aggregate,
        divides_by_grad_accum=divides_by_grad_accum,
        sampler_weights_in_loss=sampler_weights_in_loss,
        regroupable=regroupable,
        params=dict(params or {}),
    )
    LOSSES[name] = spec
    return spec


def policy_loss(
    loss_type: str,
    logprobs: torch.Tensor,  # (n, T) current policy, with gradient
    old_logprobs: Optional[torch.Tensor],  # (n, T) | None: on-policy, the ratio is 1 with gradient
    advantages: torch.Tensor,  # (n,)
    mask: torch.Tensor,  # (n, T) bool loss mask
    *,
    epsilon_low: float,
    epsilon_high: float,
    grad_accum_steps: int,
    max_completion_length: int,
    token_denominator: float,
    importance_sampling_level: str = "token",
    delta: Optional[float] = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
    beta: float = 0.0,
    ref_logprobs: Optional[torch.Tensor] = None,  # (n, T), needed when beta != 0
    use_bias_correction_kl: bool = True,
    sequence_keep: Optional[torch.Tensor] = None,  # (n, 1) off-policy mask (1 keep, 0 drop)
    token_keep: Optional[torch.Tensor] = None,  # (n, T) bool high-entropy mask
    sampler_weights: Optional[torch.Tensor] = None,  # (n, T) | (n, 1) sampler-mismatch rho
    entropy: Optional[torch.Tensor] = None,  # (n, T): given = the entropy bonus is on
    entropy_coef: float = 0.0,
    loss_params: Optional[dict] = None,  # the loss's own hyper-parameters (GRPOConfig.loss_kwargs) over its defaults
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Scalar loss of one micro-step for `loss_type`, and its statistics (TRL metric names)."""
    if loss_type not in LOSSES:
        raise ValueError(f"Unknown loss_type {loss_type!r}; available: {', '.join(LOSSES)}.")
    spec = LOSSES[loss_type]
    old = logprobs.detach() if old_logprobs is None else old_logprobs
    log_ratio = logprobs - old  # (n, T)
    log_weights = log_importance_weights(log_ratio, mask, importance_sampling_level)  # (n, T) | (n, 1)
    adv = advantages.unsqueeze(1)  # (n, 1)
    per_token, stats = spec.objective(
        logprobs,
        log_ratio,
        log_weights,
        adv,
        mask,
        epsilon_low=epsilon_low,
        epsilon_high=epsilon_high,
        delta=delta,
        sapo_temperature_pos=sapo_temperature_pos,
        sapo_temperature_neg=sapo_temperature_neg,
        vespo_k_pos=vespo_k_pos,
        vespo_lambda_pos=vespo_lambda_pos,
        vespo_k_neg=vespo_k_neg,
        vespo_lambda_neg=vespo_lambda_neg,
        sampler_weights=sampler_weights,
        **{**spec.params, **(loss_params or {})},
    )
    per_token = per_token.expand_as(logprobs)  # (n, T); sequence-level terms broadcast over tokens
    if sequence_keep is not None:
        per_token = per_token * sequence_keep
    if token_keep is not None:
        per_token = per_token * token_keep.to(per_token.dtype)
    if sampler_weights is not None and spec.sampler_weights_in_loss:
        per_token = per_token * sampler_weights
    if beta != 0.0:
        if ref_logprobs is None:
            raise ValueError("policy_loss: beta != 0 needs ref_logprobs.")
        kl = k3_kl(logprobs, ref_logprobs)  # (n, T)
        if use_bias_correction_kl:
            kl = kl * torch.exp(log_weights)  # the uncapped w, with its gradient
        per_token = per_token + beta * kl
        stats["kl"] = masked_mean(kl.detach(), mask)
    loss = spec.aggregate(
        per_token,
        mask,
        grad_accum_steps=grad_accum_steps,
        max_completion_length=max_completion_length,
        token_denominator=token_denominator,
    )
    if entropy is not None:
        stats["policy_loss"] = loss.detach() * (grad_accum_steps if spec.divides_by_grad_accum else 1)
        effective = mask if token_keep is None else mask & token_keep
        loss = loss - entropy_coef * masked_mean(entropy, effective) / grad_accum_steps
    return loss, stats
