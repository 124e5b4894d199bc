"""Per-token objectives of the GRPO family: logprobs, importance weights and advantages -> per-token loss.

Shared signature: (logprobs (n, T), log_ratio (n, T) token-level log pi - log pi_old, log_weights (n, T) | (n, 1)
at the chosen level, advantages (n, 1), mask (n, T), *, sampler_weights, **its own hyper-parameters) -> (per-token
loss (n, T) | (n, 1), stats). Each objective also returns its clip and ratio statistics under TRL's metric names.
`losses.py` registers each with an aggregation (`loss_aggregations.py`) and its hyper-parameters' defaults and
GRPOConfig fields as a loss_type.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from grouprl.core.loss_aggregations import masked_mean

VESPO_LOG_CLAMP = 20.0  # per-token and per-sequence log-ratio clamp of VESPO
VESPO_LOG_FLOOR = math.log(1e-8)  # lower clamp of the sequence log-weight and of log rho
VESPO_LAMBDA_FLOOR = 1e-4


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
    tau_pos: float,
    tau_neg: float,
    **_: object,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO: a smooth sigmoid gate instead of a hard clip; at w = 1 its gradient equals the unclipped one."""
    weights = torch.exp(log_weights)
    tau = torch.where(advantages > 0, tau_pos, tau_neg)  # A = 0 uses tau_neg
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
    k_pos: float,
    lambda_pos: float,
    k_neg: float,
    lambda_neg: float,
    sampler_weights: Optional[torch.Tensor] = None,
    **_: object,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """VESPO: REINFORCE on log pi weighted by the detached sequence-level Gamma kernel phi."""
    phi = gamma_weights(
        log_ratio,
        advantages,
        mask,
        k_pos=k_pos,
        lambda_pos=lambda_pos,
        k_neg=k_neg,
        lambda_neg=lambda_neg,
        sampler_weights=sampler_weights,
    )  # (n, 1)
    per_token = -phi * advantages * logprobs
    return per_token, {"vespo/phi_seq_mean": phi.mean(), **_ratio_stats(torch.exp(log_weights), mask)}
