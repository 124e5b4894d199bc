"""Aggregations of the GRPO family: the (n, T) per-token loss -> the scalar of one micro-step.

TRL 1.16 semantics, already divided for gradient accumulation so that summing micro-step gradients
gives the optimizer step's gradient (the table in `losses.py` says which loss_type uses which).
"""

from __future__ import annotations

import torch


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` where `mask` is True (0 if nothing is masked in)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


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
