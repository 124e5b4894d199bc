"""Length buckets: rows sorted by length and run in groups, each trimmed to its own longest row.

A short completion then does not pay for the longest one of its micro-batch; each extra bucket
costs one more forward (`BUCKET_OVERHEAD_TOKENS`).
"""

from __future__ import annotations

import torch

BUCKET_OVERHEAD_TOKENS = 64  # what one extra forward costs, in padded tokens (measured: small on CPU)


def length_buckets(
    lengths: list[int],
    max_rows: int | None,
    overhead: int = BUCKET_OVERHEAD_TOKENS,
    rows: list[int] | None = None,
) -> list[list[int]]:
    """Partition items into buckets of similar length minimising padded tokens + overhead per bucket.

    Items are sorted longest first; an exact dynamic programme over contiguous runs of that order
    picks the cut points (n is a micro-batch, so O(n^2) is nothing). No bucket holds more than
    `max_rows` rows, an item counting `rows[i]` rows (1 each by default; a packed sequence of
    several completions counts them all).
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    n = len(order)
    sizes = rows or [1] * n
    cap = max_rows or sum(sizes)
    best = [0.0] + [float("inf")] * n  # best[j]: cost of bucketing the first j items of `order`
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        held = 0
        for i in range(j - 1, -1, -1):  # bucket = order[i:j], its longest item is order[i]
            held += sizes[order[i]]
            if held > cap:
                break
            cost = best[i] + (j - i) * lengths[order[i]] + overhead
            if cost < best[j]:
                best[j], cut[j] = cost, i
    buckets, j = [], n
    while j > 0:
        buckets.append(order[cut[j] : j])
        j = cut[j]
    return buckets[::-1]


def in_row_order(parts: list[torch.Tensor], order: list[int]) -> torch.Tensor:
    """Concatenate per-bucket results whose rows are `order` (original row indices) back into row order."""
    inverse = torch.empty(len(order), dtype=torch.long)
    inverse[torch.tensor(order)] = torch.arange(len(order))
    return torch.cat(parts)[inverse.to(parts[0].device)]
