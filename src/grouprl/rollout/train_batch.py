"""A rollout as training micro-batches: the tensors a training step takes, and which rows share a micro-batch.

`pack_rollout` left-pads prompts and right-pads completions into tensors and builds the masks.

Length-aware micro-batches: rows of similar length share a micro-batch, with the same update.
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
from typing import Optional

import torch

from grouprl.core.losses import LOSSES
from grouprl.core.types import Rollout, TrainBatch, padded_width


def row_prompt_ids(rollout: Rollout) -> list[list[int]]:
    """(N,) prompt token ids of each completion: its own (environment observation, rollout_func) or its prompt's."""
    return [
        c.prompt_ids if c.prompt_ids is not None else rollout.prompts.prompt_ids[b]
        for c, b in zip(rollout.completions, rollout.row_prompt)
    ]


def row_images(rollout: Rollout, rows: list[int]) -> Optional[list]:
    """(N,) each row's image inputs: its completion's own (a multi-turn rollout with images), else its prompt's; None
    when no row has any."""
    prompts = rollout.prompts.multimodal
    images = [
        c.images if c.images is not None else (None if prompts is None else prompts[b])
        for c, b in zip(rollout.completions, rows)
    ]
    return images if any(m is not None for m in images) else None


def pack_rollout(
    rollout: Rollout,
    advantages: torch.Tensor,
    pad_token_id: int,
    mask_truncated: bool,
    pad_to_multiple_of: Optional[int] = None,
) -> TrainBatch:
    """Left-pad prompts and right-pad completions into tensors; build the masks.

    completion_mask covers every completion token (the attention context); loss_mask drops tool
    output (Completion.tool_mask False) and, with mask_truncated, truncated completions. With
    `pad_to_multiple_of` (GRPOConfig's, as TRL) both widths are rounded up to a multiple of it, and
    the batch keeps them so through micro-batching and every forward pass (TrainBatch.trimmed).
    """
    rows = rollout.row_prompt
    prompt_ids = row_prompt_ids(rollout)
    completion_ids = [c.token_ids for c in rollout.completions]
    n = len(rows)
    width_p = padded_width(max(len(p) for p in prompt_ids), pad_to_multiple_of)
    width_c = padded_width(max(1, max(len(c) for c in completion_ids)), pad_to_multiple_of)
    prompt_tensor = torch.full((n, width_p), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros((n, width_p), dtype=torch.bool)
    completion_tensor = torch.full((n, width_c), pad_token_id, dtype=torch.long)
    completion_mask = torch.zeros((n, width_c), dtype=torch.bool)
    has_sampler_logprobs = all(c.sampler_logprobs is not None for c in rollout.completions)
    sampler_logprobs = torch.zeros((n, width_c)) if has_sampler_logprobs else None
    for r, (p, completion) in enumerate(zip(prompt_ids, rollout.completions)):
        prompt_tensor[r, width_p - len(p) :] = torch.tensor(p, dtype=torch.long)
        prompt_mask[r, width_p - len(p) :] = True
        length = len(completion.token_ids)
        completion_tensor[r, :length] = torch.tensor(completion.token_ids, dtype=torch.long)
        completion_mask[r, :length] = True
        if sampler_logprobs is not None:
            sampler_logprobs[r, :length] = torch.tensor(completion.sampler_logprobs, dtype=torch.float32)
    loss_mask = completion_mask.clone()
    for r, completion in enumerate(rollout.completions):
        if completion.tool_mask is not None:
            loss_mask[r, : len(completion.tool_mask)] = torch.tensor(completion.tool_mask, dtype=torch.bool)
    if mask_truncated:  # truncated completions keep their rewards in the group statistics but train nothing
        truncated = torch.tensor([c.finish_reason != "stop" for c in rollout.completions])
        loss_mask[truncated] = False
    return TrainBatch(
        prompt_ids=prompt_tensor,
        prompt_mask=prompt_mask,
        completion_ids=completion_tensor,
        completion_mask=completion_mask,
        loss_mask=loss_mask,
        advantages=advantages.float(),
        sampler_logprobs=sampler_logprobs,
        multimodal=row_images(rollout, rows),
        pad_to_multiple_of=pad_to_multiple_of,
    )


def regrouping_is_exact(loss_type: str, top_entropy_quantile: float, part_sizes: list[int]) -> bool:
    """Whether moving rows between the micro-batches of one optimizer step leaves the update unchanged."""
    if not LOSSES[loss_type].regroupable or top_entropy_quantile < 1.0:
        return False
    global_token_mean = not LOSSES[loss_type].divides_by_grad_accum  # dapo, cispo, vespo: weight = 1 / global tokens
    return global_token_mean or len(set(part_sizes)) <= 1


def row_order_key(batch: TrainBatch) -> torch.Tensor:
    """(n,) sort key for `length_grouped`: rows with a high key go first.

    Mostly-completion rows are ordered by total length (less padding). Where prompts are at least as
    long as completions, rows sharing a prompt are kept together (prompts longest first, then by
    completion length), so a micro-batch holds whole groups and the training pass runs each shared
    prompt once (model/prompt_packing.py) instead of padding completions more tightly.
    """
    prompt_lengths, completion_lengths = batch.prompt_mask.sum(dim=1), batch.completion_mask.sum(dim=1)
    span = int(completion_lengths.max()) + 1 if len(batch) else 1
    if prompt_lengths.float().mean() < completion_lengths.float().mean():
        return prompt_lengths + completion_lengths
    _, prompt_id = torch.unique(batch.prompt_ids * batch.prompt_mask, dim=0, return_inverse=True)
    groups = int(prompt_id.max()) + 1
    return (prompt_lengths * groups + prompt_id) * span + completion_lengths


def length_grouped(parts: list[torch.Tensor], lengths: torch.Tensor, *, grad_accum_steps: int) -> list[torch.Tensor]:
    """Re-cut each optimizer step's micro-batch row indices so that rows of similar length go together.

    `lengths` is any per-row sort key (`row_order_key`).

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
