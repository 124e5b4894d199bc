"""Per-token logprobs (and entropies) of completion tokens under the temperature-scaled policy.

GRPO's importance ratio compares the policy's probability of each *sampled* token with the
probability it had when sampled; sampling used logits / temperature, so training must too
(TRL PR #3029). Only completion positions are scored: the model is asked for the last T+1 logits
(`logits_to_keep`), and the log-softmax is taken one row chunk at a time so the fp32 copy of the
logits never covers the whole batch.

Positions are derived from the attention mask (left-padded prompts), the same way `generate`
derives them, so a sequence's logprobs do not depend on how much padding its batch needed.
"""

from __future__ import annotations

from typing import Optional

import torch


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(n, L) positions counting only real tokens; padding gets position 0."""
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


def selected_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """logprob of `tokens` (n, T) under softmax(logits / temperature), and the entropy, in fp32."""
    scaled = logits.float() / temperature  # (n, T, V)
    logp_all = torch.log_softmax(scaled, dim=-1)
    logps = logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # (n, T)
    entropy = -(logp_all.exp() * logp_all).sum(dim=-1)  # (n, T)
    return logps, entropy


def completion_logprobs(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,  # (n, P) left-padded
    prompt_mask: torch.Tensor,  # (n, P) bool
    completion_ids: torch.Tensor,  # (n, T) right-padded
    completion_mask: torch.Tensor,  # (n, T) bool
    *,
    temperature: float,
    rows_per_chunk: Optional[int] = None,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Return logprobs (n, T) of the completion tokens and their entropies (n, T) or None.

    Runs the model on `rows_per_chunk` rows at a time (all rows when None). Entropy is computed
    without gradient: it is a metric here, not part of the objective.
    """
    n, completion_len = completion_ids.shape
    if completion_len == 0:
        empty = completion_ids.new_zeros((n, 0), dtype=torch.float32)
        return empty, (empty if with_entropy else None)
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # (n, P + T)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1).long()
    positions = position_ids_from_mask(attention_mask)
    chunk = rows_per_chunk or n
    logps_parts, entropy_parts = [], []
    for start in range(0, n, chunk):
        rows = slice(start, start + chunk)
        logits = _completion_logits(model, input_ids[rows], attention_mask[rows], positions[rows], completion_len)
        logps, entropy = selected_logprobs(logits, completion_ids[rows], temperature)
        logps_parts.append(logps)
        if with_entropy:
            entropy_parts.append(entropy.detach())
        del logits
    logps = torch.cat(logps_parts)
    return logps, (torch.cat(entropy_parts) if with_entropy else None)


def _completion_logits(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor, completion_len: int
) -> torch.Tensor:
    """Logits predicting each completion token: (n, T, V)."""
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False)
    try:
        logits = model(**kwargs, logits_to_keep=completion_len + 1).logits
    except TypeError:  # models without `logits_to_keep` return logits for every position
        logits = model(**kwargs).logits
    # The logit at position t predicts token t + 1: drop the last one, keep the T before it.
    return logits[:, -(completion_len + 1) : -1, :]
