"""Which sequences and groups the objective learns from.

- *Off-policy sequence masking* (DeepSeek-V3.2, eq. 9): a sequence with a negative advantage whose
  behaviour policy drifted from the current one by more than delta (mean per-token log-ratio
  log pi_behaviour - log pi_theta over its loss tokens) is dropped from the policy term; sequences
  with A >= 0 are always kept. The behaviour logprobs are the sampler's when the generation
  backend returns them, else the old policy's.
- *Tied groups* (DAPO dynamic sampling, Yu et al. 2025): a group whose rewards all tie (zero
  standard deviation, or fewer than two scorable completions) has zero advantage everywhere and
  teaches nothing; dynamic sampling replaces it with freshly generated groups.
"""

from __future__ import annotations

import torch

from grouprl.core.advantages import nanstd


def off_policy_mask(
    logprobs: torch.Tensor,  # (n, T) current policy (its gradient is not used)
    behaviour_logprobs: torch.Tensor,  # (n, T) policy the samples came from; NaN = unknown
    advantages: torch.Tensor,  # (n,)
    mask: torch.Tensor,  # (n, T) bool
    *,
    threshold: float,
) -> torch.Tensor:
    """(n, 1) float: 1 = keep the sequence in the policy term, 0 = drop it."""
    m = mask.to(logprobs.dtype)
    diff = torch.nan_to_num(behaviour_logprobs - logprobs.detach(), nan=0.0)  # (n, T)
    drift = (diff * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)  # (n,)
    keep = (advantages >= 0) | (drift <= threshold)  # (n,)
    return keep.to(logprobs.dtype).unsqueeze(1)


def tied_groups(total_rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(groups,) bool: groups of `group_size` consecutive rows whose rewards (N,) carry no signal."""
    std = nanstd(total_rewards.float().view(-1, group_size), dim=1)  # (groups,) NaN if < 2 valid
    return torch.isnan(std) | torch.isclose(std, torch.zeros_like(std))


def off_policy_sequence_mask(
    advantages: torch.Tensor,
    per_token_logps: torch.Tensor,
    sampling_per_token_logps: torch.Tensor,
    mask: torch.Tensor,
    off_policy_threshold: float,
) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask with TRL's arguments (get_off_policy_mask), (B, 1) in mask's dtype:
    1 keeps a sequence, 0 drops it (negative advantage and a mean log-ratio log pi_behaviour - log pi_theta over
    its valid tokens above the threshold; tokens the sampler did not score (NaN) count as 0). `advantages`: (B,) or
    (B, 1)."""
    if advantages.dim() == 2 and advantages.shape[1] == 1:
        advantages = advantages.squeeze(1)
    if advantages.dim() != 1:
        raise ValueError(f"get_off_policy_mask: advantages must be (B,) or (B, 1), got {tuple(advantages.shape)}.")
    keep = off_policy_mask(per_token_logps, sampling_per_token_logps, advantages, mask, threshold=off_policy_threshold)
    return keep.to(mask.dtype)
