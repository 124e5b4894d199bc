"""Per-token logprobs (and entropies) of completion tokens under the temperature-scaled policy.

GRPO's importance ratio compares the policy's probability of each *sampled* token with the
probability it had when sampled; sampling used logits / temperature, so training must too
(TRL PR #3029). Only completion positions are scored: the model is asked for the last T+1 logits
(`logits_to_keep`), and the log-softmax runs over checkpointed chunks of positions, so autograd
keeps the logits alone rather than several fp32 (rows, T, vocab) tensors.

Positions are derived from the attention mask (left-padded prompts), the same way `generate`
derives them, so a sequence's logprobs do not depend on how much padding its batch needed.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.utils.checkpoint


class TokenLogprobs(NamedTuple):
    logprobs: torch.Tensor  # (n, T) logprob of each completion token, with gradient if enabled
    entropy: Optional[torch.Tensor]  # (n, T) entropy of the next-token distribution, or None
    aux_loss: Optional[torch.Tensor]  # scalar MoE router load-balancing loss, or None


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(n, L) positions counting only real tokens; padding gets position 0."""
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


CHUNK_ELEMENTS = 1 << 25  # fp32 logits per chunk of positions (128 MiB), bounds the temporaries below


def _chunk_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """(m, V) logits, (m,) tokens -> (m,) fp32 logprob of each token (no (m, V) log-softmax kept)."""
    scaled = logits.float() / temperature
    return scaled.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(scaled, dim=-1)


def _chunk_entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """(m, V) logits -> (m,) fp32 entropy of softmax(logits / temperature)."""
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    return -(logp_all.exp() * logp_all).sum(dim=-1)


def selected_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float, *, entropy_grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """logprob of `tokens` (n, T) under softmax(logits / temperature), and the entropy, in fp32.

    Works through the (n * T) positions in chunks of about CHUNK_ELEMENTS logits. With gradient
    enabled each chunk is checkpointed: autograd keeps only the logits themselves and recomputes the
    chunk's fp32 copy and softmax in backward, instead of holding several fp32 (n, T, V) tensors
    (measured on W3, docs/benchmarks.md). The entropy is computed without gradient unless
    `entropy_grad` (entropy bonus). Values and gradients are those of the unchunked computation.
    """
    n, t, vocab = logits.shape
    flat_logits, flat_tokens = logits.reshape(n * t, vocab), tokens.reshape(n * t)
    step = max(1, CHUNK_ELEMENTS // max(vocab, 1))
    checkpointed = torch.is_grad_enabled() and logits.requires_grad
    logps, entropies = [], []
    # torch.split, not slicing: one SplitBackward concatenates the chunk gradients once, where each
    # slice's backward would write a zero-filled full-size gradient (40 s of W3's backward).
    for chunk, chunk_tokens in zip(flat_logits.split(step), flat_tokens.split(step)):
        if checkpointed:
            logps.append(torch.utils.checkpoint.checkpoint(_chunk_logprobs, chunk, chunk_tokens, temperature, use_reentrant=False))
        else:
            logps.append(_chunk_logprobs(chunk, chunk_tokens, temperature))
        if entropy_grad and checkpointed:
            entropies.append(torch.utils.checkpoint.checkpoint(_chunk_entropy, chunk, temperature, use_reentrant=False))
        else:
            with torch.no_grad():
                entropies.append(_chunk_entropy(chunk, temperature))
    return torch.cat(logps).view(n, t), torch.cat(entropies).view(n, t)


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
    entropy_grad: bool = False,
    with_aux_loss: bool = False,
) -> TokenLogprobs:
    """Logprobs (n, T) of the completion tokens, their entropies (n, T) or None, the MoE aux loss or None.

    Runs the model on `rows_per_chunk` rows at a time (all rows when None). The entropy is detached
    unless `entropy_grad` (it is part of the objective only when the entropy bonus is on). With
    `with_aux_loss` the model is asked for its router logits and returns its load-balancing loss
    (averaged over chunks).
    """
    n, completion_len = completion_ids.shape
    if completion_len == 0:
        empty = completion_ids.new_zeros((n, 0), dtype=torch.float32)
        return TokenLogprobs(empty, empty if with_entropy else None, None)
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # (n, P + T)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1).long()
    positions = position_ids_from_mask(attention_mask)
    chunk = rows_per_chunk or n
    logps_parts, entropy_parts, aux_parts = [], [], []
    for start in range(0, n, chunk):
        rows = slice(start, start + chunk)
        logits, aux = _completion_logits(model, input_ids[rows], attention_mask[rows], positions[rows], completion_len, with_aux_loss)
        logps, entropy = selected_logprobs(logits, completion_ids[rows], temperature, entropy_grad=entropy_grad)
        logps_parts.append(logps)
        if with_entropy:
            entropy_parts.append(entropy if entropy_grad else entropy.detach())
        if aux is not None:
            aux_parts.append(aux)
        del logits
    logps = torch.cat(logps_parts)
    entropy = torch.cat(entropy_parts) if with_entropy else None
    aux_loss = torch.stack(aux_parts).mean() if aux_parts else None
    return TokenLogprobs(logps, entropy, aux_loss)


def _completion_logits(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor, completion_len: int,
    with_aux_loss: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Logits predicting each completion token (n, T, V), and the router aux loss if asked for."""
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False)
    if with_aux_loss:
        kwargs["output_router_logits"] = True
    try:
        output = model(**kwargs, logits_to_keep=completion_len + 1)
    except TypeError:  # models without `logits_to_keep` return logits for every position
        output = model(**kwargs)
    aux = getattr(output, "aux_loss", None) if with_aux_loss else None
    # The logit at position t predicts token t + 1: drop the last one, keep the T before it.
    return output.logits[:, -(completion_len + 1) : -1, :], aux
