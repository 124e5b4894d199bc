"""Group filtering for GFPO: sample G completions per prompt, train on the k the filter scores highest.

GFPO ("Sample More to Think Less: Group Filtered Policy Optimization for Concise Reasoning",
arXiv 2508.09726) samples a larger group and keeps, in each group, the k completions with the
highest filter score; advantages are then computed over the kept k only and the others leave the
batch. The paper's two main filters are shipped here:

- `shortest_k_filter`: score = -length, so the k shortest completions are kept ("Shortest k/G").
- `reward_per_token_filter`: score = reward / length ("Token Efficiency"): the k completions that
  earn the most reward per token.

A filter is called once per generation as ``f(group_completions=..., group_rewards=...)`` (TRL's
contract): lists over groups, each holding that group's G completions and their weighted rewards
(None counted as 0), and returns one list of G float scores per group. Filters that also accept
``group_completion_ids`` (or ``**kwargs``) get each completion's token ids, for lengths in tokens.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

import torch


def top_k_in_groups(scores: torch.Tensor, k: int) -> torch.Tensor:
    """(groups, G) scores -> (groups * G,) bool, True for the k highest scores of each group."""
    groups, size = scores.shape
    if not 1 <= k <= size:
        raise ValueError(f"top_k_in_groups: k={k} must be in [1, {size}]")
    keep = torch.zeros((groups, size), dtype=torch.bool)
    # stable sort: among equal scores the earlier completion wins, so the choice is reproducible
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k]  # (groups, k)
    keep.scatter_(1, order, True)
    return keep.view(-1)


def group_filter_scores(
    filter_func: Callable[..., Any],
    group_completions: list[list[Any]],
    group_rewards: list[list[float]],
    group_completion_ids: list[list[list[int]]],
) -> torch.Tensor:
    """Call the user's filter once with every group; check and return its scores as (groups, G)."""
    kwargs: dict[str, Any] = {"group_completions": group_completions, "group_rewards": group_rewards}
    if _accepts(filter_func, "group_completion_ids"):
        kwargs["group_completion_ids"] = group_completion_ids
    name = getattr(filter_func, "__name__", type(filter_func).__name__)
    scores = filter_func(**kwargs)
    groups, size = len(group_completions), len(group_completions[0])
    if isinstance(scores, torch.Tensor):
        scores = scores.tolist()
    if not isinstance(scores, (list, tuple)) or len(scores) != groups:
        raise ValueError(
            f"group_filter_func '{name}' must return one list of scores per group ({groups} groups), got "
            f"{type(scores).__name__} of length {len(scores) if hasattr(scores, '__len__') else '?'}."
        )
    for g, row in enumerate(scores):
        if len(row) != size:
            raise ValueError(
                f"group_filter_func '{name}' returned {len(row)} scores for group {g}, which has {size} completions."
            )
    table = torch.tensor([[float(v) for v in row] for row in scores], dtype=torch.float64)
    if torch.isnan(table).any():
        g = int(torch.isnan(table).any(dim=1).nonzero()[0])
        raise ValueError(f"group_filter_func '{name}' returned NaN scores for group {g}; scores must be numbers.")
    return table


def _accepts(fn: Callable[..., Any], name: str) -> bool:
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name or p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters)


def _lengths(
    group_completions: list[list[Any]], group_completion_ids: Optional[list[list[list[int]]]]
) -> list[list[int]]:
    if group_completion_ids is not None:
        return [[len(ids) for ids in group] for group in group_completion_ids]
    return [
        [len(c if isinstance(c, str) else "".join(m["content"] for m in c)) for c in group]
        for group in group_completions
    ]


def shortest_k_filter(
    group_completions: list[list[Any]],
    group_rewards: list[list[float]],
    group_completion_ids: Optional[list[list[list[int]]]] = None,
    **kwargs: Any,
) -> list[list[float]]:
    """Score = -length (tokens when given, else characters): keeps the k shortest of each group."""
    return [[-float(n) for n in group] for group in _lengths(group_completions, group_completion_ids)]


def reward_per_token_filter(
    group_completions: list[list[Any]],
    group_rewards: list[list[float]],
    group_completion_ids: Optional[list[list[list[int]]]] = None,
    **kwargs: Any,
) -> list[list[float]]:
    """Score = reward / length (tokens when given, else characters): keeps the most token-efficient k."""
    lengths = _lengths(group_completions, group_completion_ids)
    return [[float(r) / max(1, n) for r, n in zip(rewards, group)] for rewards, group in zip(group_rewards, lengths)]
