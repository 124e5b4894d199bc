"""Importance weights: policy / old-policy ratios, and the sampler-mismatch correction.

Two different ratios appear in GRPO and both live here:

1. The *policy ratio* w = pi_theta / pi_old of the clipped surrogate. At token level (PPO, GRPO)
   it is one ratio per token; at sequence level (GSPO, Zheng et al. 2025) it is the geometric mean
   over the sequence's loss tokens, exp(mean_t log r_t), one value per row broadcast over tokens.
2. The *sampler correction* rho = pi_old(trainer) / pi_sampler: the generation engine (vLLM, a
   server, ...) and the training forward never compute exactly the same probabilities, so samples
   are slightly off-policy even before any update. Truncated importance sampling (TIS, Yao et al.
   2025) clips rho; masked importance sampling (MIS / IcePop) zeroes tokens or sequences whose rho
   leaves [C_min, C_max]. Sequence modes use the *product* of token ratios (a sum of log
   differences, not a mean), as TRL 1.16 does.
"""

from __future__ import annotations

from typing import Optional

import torch

IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def log_importance_weights(log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """log w from per-token log ratios (n, T): (n, T) for "token", (n, 1) for "sequence" (GSPO).

    The sequence weight is the length-normalised sum over loss tokens, so it keeps the gradient of
    every token (each gets 1 / length of it); a row without loss tokens gets log w = 0.
    """
    if level == "token":
        return log_ratio
    if level == "sequence":
        m = mask.to(log_ratio.dtype)
        return (log_ratio * m).sum(dim=1, keepdim=True) / m.sum(dim=1, keepdim=True).clamp(min=1.0)  # (n, 1)
    raise ValueError(f"importance_sampling_level={level!r} is not 'token' or 'sequence'.")


def sampler_importance_weights(
    old_logprobs: torch.Tensor,  # (n, T) logprobs of the sampled tokens under the trainer, at sampling time
    sampler_logprobs: torch.Tensor,  # (n, T) the same under the generation engine; NaN = not scored
    mask: torch.Tensor,  # (n, T) bool loss mask
    *,
    mode: str,
    clip_min: Optional[float],
    clip_max: Optional[float],
) -> tuple[torch.Tensor, dict[str, float]]:
    """Sampler-mismatch weights rho: (n, T) for token_* modes, (n, 1) for sequence_* modes.

    d = (old - sampler) on loss tokens (0 elsewhere and where the sampler gave no logprob);
    rho = exp(d) per token, or exp(sum_t d) per sequence; *_truncate clamps rho into
    [clip_min, clip_max] (a missing bound is open); *_mask sets rho to 0 outside that range.
    Returns rho and the sampling/* statistics TRL logs, plus grouprl's
    sampling/importance_sampling_masked_fraction: the share of loss tokens (token modes) or of
    sequences with loss tokens (sequence modes) whose weight is 0, i.e. that train nothing.
    """
    if mode not in IS_MODES:
        raise ValueError(f"vllm_importance_sampling_mode={mode!r} is not one of {IS_MODES}.")
    valid = mask & torch.isfinite(sampler_logprobs)  # (n, T)
    diff = torch.where(valid, old_logprobs - sampler_logprobs, torch.zeros_like(old_logprobs))  # (n, T)
    sequence_level = mode.startswith("sequence")
    log_rho = diff.sum(dim=1, keepdim=True) if sequence_level else diff  # (n, 1) | (n, T)
    rho = torch.exp(log_rho)
    if mode.endswith("truncate"):
        rho = torch.clamp(rho, min=clip_min, max=clip_max)
    else:
        outside = torch.zeros_like(rho, dtype=torch.bool)
        if clip_min is not None:
            outside |= rho < clip_min
        if clip_max is not None:
            outside |= rho > clip_max
        rho = rho.masked_fill(outside, 0.0)

    nan = float("nan")
    gaps = diff.abs()[valid]
    counted = rho[mask.any(dim=1)] if sequence_level else rho[mask]  # sequences with loss tokens | loss tokens
    stats = {
        "sampling/sampling_logp_difference/mean": gaps.mean().item() if gaps.numel() else nan,
        "sampling/sampling_logp_difference/max": gaps.max().item() if gaps.numel() else nan,
        "sampling/importance_sampling_ratio/min": counted.min().item() if counted.numel() else nan,
        "sampling/importance_sampling_ratio/mean": counted.mean().item() if counted.numel() else nan,
        "sampling/importance_sampling_ratio/max": counted.max().item() if counted.numel() else nan,
        "sampling/importance_sampling_masked_fraction": (counted == 0).float().mean().item()
        if counted.numel()
        else nan,
    }
    return rho, stats
