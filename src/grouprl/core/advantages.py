"""Group-relative advantages (DeepSeekMath GRPO, with TRL 1.16's numerical conventions).

Rewards of the whole generation batch, gathered from every process, are turned into one scalar
advantage per completion: the completion's reward minus its group's mean, optionally divided by a
standard deviation. Conventions (TRL 1.16 defaults): unbiased (Bessel) std, ``eps=1e-4`` added to
the std, NaN rewards mean "not applicable" and are left out of sums and means, rows no function
could score get advantage 0, and so do groups whose std is undefined (fewer than 2 valid rewards).

- ``sum_then_normalize`` (GRPO): R = sum_k w_k r_k, then A = (R - mean_g R) / (std + eps), with std
  per group ("group", Dr. GRPO's critique aside), over the batch ("batch", PPO-Lite) or none ("none",
  Dr. GRPO).
- ``normalize_then_sum`` (GDPO, arXiv 2601.05242): each reward is normalised within its group
  first, the weighted sum is then normalised over the batch. ``scale_rewards`` does not apply.
"""

from __future__ import annotations

from typing import Callable

import torch

AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


def nanmean(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Mean over `dim` ignoring NaN; NaN where every entry is NaN."""
    valid = ~torch.isnan(x)
    count = valid.sum(dim)
    total = torch.where(valid, x, torch.zeros_like(x)).sum(dim)
    return torch.where(count > 0, total / count.clamp(min=1), torch.full_like(total, float("nan")))


def nanstd(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Unbiased (n - 1) standard deviation over `dim` ignoring NaN; NaN where fewer than 2 are valid."""
    valid = ~torch.isnan(x)
    count = valid.sum(dim)
    mean = nanmean(x, dim).unsqueeze(dim)
    squared = torch.where(valid, (x - mean) ** 2, torch.zeros_like(x)).sum(dim)
    variance = squared / (count - 1).clamp(min=1)
    return torch.where(count > 1, variance.sqrt(), torch.full_like(variance, float("nan")))


def group_advantages(
    rewards_per_function: torch.Tensor,  # (N, F), NaN = not applicable
    weights: torch.Tensor,  # (F,)
    *,
    group_size: int,
    scale_rewards: str = "group",
    aggregation: str = "sum_then_normalize",
    eps: float = 1e-4,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Return (advantages (N,), stats) for N = groups * group_size rows in group-major order.

    stats: "total" (N,) weighted reward (NaN if unscorable), "group_std" (N,) std of the row's
    group (for frac_reward_zero_std), "unscorable" (N,) bool.
    """
    n, num_functions = rewards_per_function.shape
    if n % group_size != 0:
        raise ValueError(f"group_advantages: {n} rows cannot be split into groups of {group_size}.")
    if weights.shape != (num_functions,):
        raise ValueError(f"group_advantages: {num_functions} reward functions but {weights.shape[0]} weights.")
    rewards = rewards_per_function.float()
    unscorable = torch.isnan(rewards).all(dim=1)  # (N,)
    total = torch.nansum(rewards * weights, dim=1).masked_fill(unscorable, float("nan"))  # (N,)
    grouped = total.view(-1, group_size)  # (groups, G)
    group_std = nanstd(grouped, dim=1).repeat_interleave(group_size)  # (N,)

    if aggregation == "sum_then_normalize":
        group_mean = nanmean(grouped, dim=1).repeat_interleave(group_size)  # (N,)
        advantages = total - group_mean
        if scale_rewards == "group":
            advantages = advantages / (group_std + eps)
        elif scale_rewards == "batch":
            advantages = advantages / (nanstd(total, dim=0) + eps)
        elif scale_rewards != "none":
            raise ValueError(f"group_advantages: scale_rewards={scale_rewards!r} is not 'group', 'batch' or 'none'.")
    elif aggregation == "normalize_then_sum":
        per_group = rewards.view(-1, group_size, num_functions)  # (groups, G, F)
        mean = nanmean(per_group, dim=1).unsqueeze(1)
        std = nanstd(per_group, dim=1).unsqueeze(1)
        normalized = ((per_group - mean) / (std + eps)).view(n, num_functions)  # (N, F)
        summed = torch.nansum(normalized * weights, dim=1).masked_fill(unscorable, float("nan"))
        advantages = (summed - nanmean(summed, dim=0)) / (nanstd(summed, dim=0) + eps)
    else:
        raise ValueError(f"group_advantages: aggregation={aggregation!r} is not one of {AGGREGATIONS}.")

    advantages = torch.nan_to_num(advantages, nan=0.0)
    return advantages, {"total": total, "group_std": group_std, "unscorable": unscorable}


def _grpo(rewards_per_function: torch.Tensor, weights: torch.Tensor, **settings: object) -> torch.Tensor:
    return group_advantages(rewards_per_function, weights, **settings)[0]  # type: ignore[arg-type]


# name -> fn(rewards_per_function (N, F), weights (F,), *, group_size, scale_rewards, aggregation, eps) -> (N,)
ADVANTAGE_ESTIMATORS: dict[str, Callable[..., torch.Tensor]] = {"grpo": _grpo}


def register_advantage(name: str, fn: Callable[..., torch.Tensor], *, replace: bool = False) -> None:
    """Make ``GRPOConfig(advantage_estimator=name)`` available, from any module (before building the config).

    ``fn(rewards_per_function, weights, *, group_size, scale_rewards, aggregation, eps) -> advantages`` gets the
    (N, F) rewards of the whole generation (rows group-major, G = group_size per prompt; NaN = a function did
    not apply) and returns one advantage per row (N,). Rows no function could score get advantage 0 whatever
    it returns; the logged reward statistics are the same as with "grpo".
    """
    if not callable(fn):
        raise TypeError(f"register_advantage({name!r}): fn must be callable.")
    if name in ADVANTAGE_ESTIMATORS and not replace:
        raise ValueError(
            f"register_advantage: advantage_estimator {name!r} exists already; pass replace=True to redefine it."
        )
    ADVANTAGE_ESTIMATORS[name] = fn


def estimate_advantages(
    estimator: str,
    rewards_per_function: torch.Tensor,
    weights: torch.Tensor,
    *,
    group_size: int,
    scale_rewards: str = "group",
    aggregation: str = "sum_then_normalize",
    eps: float = 1e-4,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(advantages (N,), group_advantages' statistics) with the registered `estimator`."""
    settings = {"group_size": group_size, "scale_rewards": scale_rewards, "aggregation": aggregation, "eps": eps}
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"Unknown advantage_estimator {estimator!r}; registered: {', '.join(ADVANTAGE_ESTIMATORS)}.")
    advantages, stats = group_advantages(rewards_per_function, weights, **settings)  # type: ignore[arg-type]
    if ADVANTAGE_ESTIMATORS[estimator] is _grpo:  # the built-in entry: its advantages are the ones just computed
        return advantages, stats
    custom = ADVANTAGE_ESTIMATORS[estimator](rewards_per_function, weights, **settings)
    if not isinstance(custom, torch.Tensor) or custom.shape != advantages.shape:
        raise ValueError(
            f"advantage_estimator {estimator!r} returned {getattr(custom, 'shape', type(custom).__name__)}; "
            f"it must return a tensor of shape {tuple(advantages.shape)} (one advantage per row)."
        )
    custom = torch.nan_to_num(custom.float(), nan=0.0).masked_fill(stats["unscorable"], 0.0)
    return custom, stats
