"""Length-aware micro-batches: rows of similar length share a micro-batch, with the same update.

Within one optimizer step the gradient is a sum over micro-batches, so which of the step's rows go
into which micro-batch does not change it, provided every row's weight in the loss is independent of
its micro-batch's other rows. That holds for every loss except bnpo (its denominator is the
micro-batch's token count) and whenever the top-entropy mask is on (its quantile is taken per
micro-batch); the sequence-mean losses also need equal micro-batch sizes (their weight is 1/rows).
Where it holds, sorting a step's rows by length before cutting them means each micro-batch is padded
to a length close to its rows' own, instead of to the step's longest.
"""

from __future__ import annotations

import math

import torch

from .algorithms.losses import LOSSES


def regrouping_is_exact(loss_type: str, top_entropy_quantile: float, part_sizes: list[int]) -> bool:
    """Whether moving rows between the micro-batches of one optimizer step leaves the update unchanged."""
    if loss_type == "bnpo" or top_entropy_quantile < 1.0:
        return False
    global_token_mean = not LOSSES[loss_type].divides_by_grad_accum  # dapo, cispo, vespo: weight = 1 / global tokens
    return global_token_mean or len(set(part_sizes)) <= 1


def length_grouped(parts: list[torch.Tensor], lengths: torch.Tensor, *, grad_accum_steps: int) -> list[torch.Tensor]:
    """Re-cut each optimizer step's micro-batch row indices so that rows of similar length go together.

    `parts` are the micro-batches of one generation, in training order; micro-batch i belongs to
    optimizer step i // grad_accum_steps, so runs of gcd(len(parts), GA) consecutive parts always
    share one step (also when a step spans several generations). Each run's rows are sorted longest
    first (stable) and cut back into the same sizes, in the same order.
    """
    run = math.gcd(len(parts), grad_accum_steps)
    if run == 1:  # every micro-batch is alone in its optimizer step: nothing to regroup
        return parts
    regrouped: list[torch.Tensor] = []
    for start in range(0, len(parts), run):
        group = parts[start : start + run]
        rows = torch.cat(group)
        rows = rows[torch.sort(lengths[rows], descending=True, stable=True).indices]
        regrouped.extend(rows.split([len(p) for p in group]))
    return regrouped
