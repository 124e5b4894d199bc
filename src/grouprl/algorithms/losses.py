"""Policy-gradient losses of the GRPO family, as pure functions plus one registry.

A loss is two pieces:

1. a *per-token objective* turning logprobs, old logprobs and advantages into a (n, T) loss, e.g.
   the PPO clipped surrogate (Schulman et al. 2017) used by GRPO (Shao et al. 2024);
2. an *aggregation* turning the (n, T) loss into the scalar of one micro-step. This is where the
   GRPO variants differ (TRL 1.16 semantics, already divided for gradient accumulation so that
   summing micro-step gradients gives the optimizer step's gradient):

   ===========  =======================================================================
   grpo         mean over sequences of the sequence's token mean, / GA  (DeepSeekMath)
   bnpo         token mean over the micro-batch, / GA
   dr_grpo      token sum / (rows * max_completion_length), / GA  (Dr. GRPO, Liu et al.)
   dapo         token sum / D, D = loss tokens of the generation batch per process * GA / spg
                (DAPO, Yu et al. 2025): the token mean over the whole optimizer step
   ===========  =======================================================================

``LOSSES[loss_type]`` holds both pieces. Adding a variant is one function and one entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` where `mask` is True (0 if nothing is masked in)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def clipped_surrogate(
    logprobs: torch.Tensor,  # (n, T) current policy, with gradient
    old_logprobs: Optional[torch.Tensor],  # (n, T) or None: on-policy, the ratio is 1 with gradient
    advantages: torch.Tensor,  # (n,)
    mask: torch.Tensor,  # (n, T) bool
    *,
    epsilon_low: float,
    epsilon_high: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped objective -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) per token.

    Returns the (n, T) loss and the clip statistics TRL logs: the fraction of tokens clipped low
    (r < 1 - eps_low with A < 0), high (r > 1 + eps_high with A > 0) and either, as a token mean
    (`*_mean`) and as the min/max over sequences of the per-sequence fraction.
    """
    old = logprobs.detach() if old_logprobs is None else old_logprobs
    ratio = torch.exp(logprobs - old)  # (n, T)
    adv = advantages.unsqueeze(1)  # (n, 1)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high) * adv
    per_token = -torch.minimum(unclipped, clipped)

    with torch.no_grad():
        low = (ratio < 1.0 - epsilon_low) & (adv < 0) & mask
        high = (ratio > 1.0 + epsilon_high) & (adv > 0) & mask
        tokens_per_row = mask.sum(dim=1)
        has_tokens = tokens_per_row > 0
        row_low = low.sum(dim=1)[has_tokens] / tokens_per_row[has_tokens]
        row_high = high.sum(dim=1)[has_tokens] / tokens_per_row[has_tokens]
        empty = torch.tensor(float("nan"))
        stats = {
            "clip_ratio/low_mean": masked_mean(low.float(), mask),
            "clip_ratio/high_mean": masked_mean(high.float(), mask),
            "clip_ratio/region_mean": masked_mean((low | high).float(), mask),
            "clip_ratio/low_min": row_low.min() if len(row_low) else empty,
            "clip_ratio/high_max": row_high.max() if len(row_high) else empty,
        }
    return per_token, stats


# ---- aggregations: (n, T) per-token loss -> scalar for one micro-step -------------------------


def sequence_mean_aggregation(per_token: torch.Tensor, mask: torch.Tensor, *, grad_accum_steps: int, **_: float) -> torch.Tensor:
    """grpo: each sequence's token mean, averaged over sequences."""
    m = mask.to(per_token.dtype)
    per_sequence = (per_token * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)
    return per_sequence.mean() / grad_accum_steps


def micro_batch_token_mean_aggregation(per_token: torch.Tensor, mask: torch.Tensor, *, grad_accum_steps: int, **_: float) -> torch.Tensor:
    """bnpo: token mean over the local micro-batch."""
    return masked_mean(per_token, mask) / grad_accum_steps


def constant_length_aggregation(
    per_token: torch.Tensor, mask: torch.Tensor, *, grad_accum_steps: int, max_completion_length: int, **_: float
) -> torch.Tensor:
    """dr_grpo: token sum divided by a constant (rows x max_completion_length), free of length bias."""
    m = mask.to(per_token.dtype)
    return (per_token * m).sum() / (per_token.shape[0] * max_completion_length) / grad_accum_steps


def global_token_mean_aggregation(per_token: torch.Tensor, mask: torch.Tensor, *, token_denominator: float, **_: float) -> torch.Tensor:
    """dapo: token sum over the global token count of the optimizer step (see `dapo_denominator`)."""
    m = mask.to(per_token.dtype)
    return (per_token * m).sum() / max(token_denominator, 1.0)


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


LOSSES: dict[str, LossSpec] = {
    "grpo": LossSpec(clipped_surrogate, sequence_mean_aggregation),
    "bnpo": LossSpec(clipped_surrogate, micro_batch_token_mean_aggregation),
    "dr_grpo": LossSpec(clipped_surrogate, constant_length_aggregation),
    "dapo": LossSpec(clipped_surrogate, global_token_mean_aggregation),
}


def policy_loss(
    loss_type: str,
    logprobs: torch.Tensor,  # (n, T)
    old_logprobs: Optional[torch.Tensor],  # (n, T) | None
    advantages: torch.Tensor,  # (n,)
    mask: torch.Tensor,  # (n, T) bool
    *,
    epsilon_low: float,
    epsilon_high: float,
    grad_accum_steps: int,
    max_completion_length: int,
    token_denominator: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Scalar loss of one micro-step for `loss_type`, and its statistics."""
    if loss_type not in LOSSES:
        raise ValueError(f"Unknown loss_type {loss_type!r}; available: {', '.join(LOSSES)}.")
    spec = LOSSES[loss_type]
    per_token, stats = spec.objective(
        logprobs, old_logprobs, advantages, mask, epsilon_low=epsilon_low, epsilon_high=epsilon_high
    )
    loss = spec.aggregate(
        per_token,
        mask,
        grad_accum_steps=grad_accum_steps,
        max_completion_length=max_completion_length,
        token_denominator=token_denominator,
    )
    return loss, stats
