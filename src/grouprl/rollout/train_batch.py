"""A rollout as the tensors a training step takes: left-padded prompts, right-padded completions, masks."""

from __future__ import annotations

from typing import Optional

import torch

from grouprl.core.types import Rollout, TrainBatch, padded_width


def row_prompt_ids(rollout: Rollout) -> list[list[int]]:
    """(N,) prompt token ids of each completion: its own (environment observation, rollout_func) or its prompt's."""
    return [
        c.prompt_ids if c.prompt_ids is not None else rollout.prompts.prompt_ids[b]
        for c, b in zip(rollout.completions, rollout.row_prompt)
    ]


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
        multimodal=None if rollout.prompts.multimodal is None else [rollout.prompts.multimodal[b] for b in rows],
        pad_to_multiple_of=pad_to_multiple_of,
    )
