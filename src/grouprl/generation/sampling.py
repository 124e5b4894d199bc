"""Turning next-token logits into a sampled token, the way transformers' sampling does.

Order (as transformers `generate`): repetition penalty, temperature, top-k, top-p, min-p, then
softmax and `torch.multinomial`. The logprob returned for each sampled token is taken under this
*processed* distribution (what vLLM calls ``processed_logprobs``), which is what importance
correction between sampler and trainer needs.

One deliberate difference: the repetition penalty looks only at real tokens. transformers also
penalises the pad tokens of left-padded prompts, which (with pad = EOS, a common fallback)
silently makes stopping less likely for short prompts in a padded batch.
"""

from __future__ import annotations

from typing import Optional

import torch


def apply_repetition_penalty(logits: torch.Tensor, history: torch.Tensor, history_mask: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL penalty (Keskar et al. 2019): logits of seen tokens are divided (if > 0) or multiplied (if < 0) by `penalty`.

    logits (R, V); history (R, L) token ids; history_mask (R, L) bool, True = a real token.
    """
    if penalty == 1.0 or history.shape[1] == 0:
        return logits
    seen = _seen_tokens(logits, history, history_mask)
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalized, logits)


def _seen_tokens(logits: torch.Tensor, history: torch.Tensor, history_mask: torch.Tensor) -> torch.Tensor:
    """(R, V) bool: token appeared among the real tokens of the row's history (counts, so padding cannot unset it)."""
    counts = torch.zeros(logits.shape, dtype=torch.int32, device=logits.device)
    counts.scatter_add_(1, history, history_mask.to(torch.int32))
    return counts > 0


def filter_logits(logits: torch.Tensor, *, top_k: int = 0, top_p: float = 1.0, min_p: Optional[float] = None) -> torch.Tensor:
    """Set to -inf the tokens removed by top-k, then top-p (nucleus), then min-p; at least one token stays."""
    neg_inf = -float("inf")
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, neg_inf)
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= (1 - top_p)
        remove_sorted[..., -1:] = False  # keep the most likely token
        remove = remove_sorted.scatter(-1, order, remove_sorted)
        logits = logits.masked_fill(remove, neg_inf)
    if min_p is not None and min_p > 0:
        probs = logits.softmax(dim=-1)
        remove = probs < min_p * probs.amax(dim=-1, keepdim=True)
        remove.scatter_(-1, probs.argmax(dim=-1, keepdim=True), False)
        logits = logits.masked_fill(remove, neg_inf)
    return logits


def process_logits(
    logits: torch.Tensor,  # (R, V) raw next-token logits
    *,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: Optional[float] = None,
    repetition_penalty: float = 1.0,
    history: Optional[torch.Tensor] = None,  # (R, L)
    history_mask: Optional[torch.Tensor] = None,  # (R, L)
) -> torch.Tensor:
    """The processed logits (R, V), in fp32, that sampling draws from."""
    logits = logits.float()
    if repetition_penalty != 1.0 and history is not None:
        logits = apply_repetition_penalty(logits, history, history_mask, repetition_penalty)
    logits = logits / temperature
    return filter_logits(logits, top_k=top_k, top_p=top_p, min_p=min_p)


def sample_tokens(processed: torch.Tensor, generator: Optional[torch.Generator] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row from softmax(processed); return (tokens (R,), their logprobs (R,))."""
    probs = processed.softmax(dim=-1)
    tokens = torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)
    logprobs = torch.log_softmax(processed, dim=-1).gather(1, tokens[:, None]).squeeze(1)
    return tokens, logprobs
