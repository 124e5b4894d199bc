"""Turning next-token logits into a sampled token, the way transformers' sampling does.

Order (as transformers `generate`): repetition penalty, temperature, top-k, top-p, min-p, then
softmax and a draw. The logprob returned for each sampled token is taken under this *processed*
distribution (what vLLM calls ``processed_logprobs``), which is what importance correction between
sampler and trainer needs.

The draw is by inverse CDF: one uniform number per row against the row's cumulative distribution
(accumulated in float64, so tokens with tiny probabilities keep their share), in two levels: the uniform
number first picks a block of about a thousand tokens (`cdf_block`) by the blocks' masses, then a token
inside that block, so only one block per row is ever accumulated. `torch.multinomial`,
which transformers uses, draws an exponential variate per vocabulary entry: measured 2.8 ms per decode
step for 32 rows x 4,096 tokens and 30 ms for 8 x 151,936 (Qwen's vocabulary), against 1.6 ms and
4.3 ms here. Both sample the same distribution; `method="multinomial"` consumes the random stream as
transformers does, for token-for-token comparisons.

One deliberate difference: the repetition penalty looks only at real tokens. transformers also
penalises the pad tokens of left-padded prompts, which (with pad = EOS, a common fallback)
silently makes stopping less likely for short prompts in a padded batch.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from grouprl.core.types import SamplingParams


def apply_repetition_penalty(
    logits: torch.Tensor, history: torch.Tensor, history_mask: torch.Tensor, penalty: float
) -> torch.Tensor:
    """CTRL penalty (Keskar et al. 2019): logits of seen tokens are divided (if > 0) or multiplied (if < 0)
    by `penalty`.

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


def filter_logits(
    logits: torch.Tensor, *, top_k: int = 0, top_p: float = 1.0, min_p: Optional[float] = None
) -> torch.Tensor:
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
    if temperature != 1.0:
        logits = logits / temperature
    return filter_logits(logits, top_k=top_k, top_p=top_p, min_p=min_p)


SAMPLING_METHODS = ("inverse_cdf", "multinomial")


def cumulative_distribution(probs: torch.Tensor) -> torch.Tensor:
    """(R, V) float64 CDF of each row. In float32, once the running sum passes 0.5 every token below half an
    ulp (3e-8) adds nothing, so after a dominant token a long tail of rare tokens could never be drawn."""
    if torch.compiler.is_compiling():
        return _float64_cumsum(probs)
    return probs.cumsum(dim=-1, dtype=torch.float64)


# Tokens per block of the two-level draw, where no divisor of the vocabulary near it serves (`cdf_block`). A scan over
# a whole vocabulary runs one row per thread block on a GPU (64 rows of 151,936: 288 us of a 2.9 ms decode step on an
# H200, profile_step.py) and holds a float64 copy of it; the blocks' masses are one reduction, and the scans left are
# (R, V / block) and (R, block).
CDF_BLOCK = 1024


@functools.cache
def cdf_block(vocab: int) -> int:
    """Tokens per block for a `vocab`-token distribution: all of them up to 2,048; else the divisor of `vocab` in
    [512, 2048] nearest 1,024 (Qwen's 151,936: 1,187), so no shorter last block costs operators; else CDF_BLOCK."""
    if vocab <= 2048:
        return vocab
    divisors = [size for size in range(512, 2049) if vocab % size == 0]
    return min(divisors, key=lambda size: abs(size - CDF_BLOCK)) if divisors else CDF_BLOCK


def _below(x: torch.Tensor) -> torch.Tensor:
    """A number strictly below each positive, normal float64 `x`: x - x * 2**-52 lies at least one ulp below x
    (2**-52 x is one to two ulps), so it rounds below x; one operator where nextafter takes two."""
    return x * (1 - 2**-52)


def _inverse_cdf_draw(
    probs: torch.Tensor, generator: Optional[torch.Generator], uniforms: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """(R,) tokens: one uniform number per row (`uniforms`, (R, 1) float64 in [0, 1), if given; else drawn here),
    located first among the blocks' cumulative masses, then inside its block's cumulative distribution; both
    cumulative sums in float64. A token of probability 0 is never drawn."""
    rows, vocab = probs.shape
    size = cdf_block(vocab)
    whole = vocab - vocab % size
    # The blocks' masses in the probabilities' fp32: a sum of ~1,000 has an error of ~1e-7 of the block's mass (a
    # cascade or tree sum), which is the whole error of a block's chance; a float64 sum converted the whole
    # (R, V) first on CPUs, 24 of a 25 ms draw for 64 x 151,936 on a 2-core CPU, against 0.7 ms.
    mass = probs[:, :whole].view(rows, -1, size).sum(dim=-1)  # (R, B)
    if whole < vocab:  # the last, shorter block
        mass = torch.cat([mass, probs[:, whole:].sum(dim=-1, keepdim=True)], dim=1)
    ends = cumulative_distribution(mass)  # (R, B), contiguous: searchsorted copies a strided boundary first
    starts = torch.nn.functional.pad(ends, (1, 0))  # (R, B + 1): 0, then each block's end
    total = ends[:, -1:]
    # rand_like: the same draws as torch.rand(rows, 1), and a symbolic row count traces (a compiled step)
    if uniforms is not None:
        u = uniforms * total
    elif generator is None:
        u = torch.rand_like(total) * total
    else:
        u = torch.rand(total.shape, dtype=total.dtype, device=total.device, generator=generator) * total
    u = torch.minimum(u, _below(total))  # strictly below the total after rounding
    # right=True: the first block whose cumulative mass exceeds u, so a block of mass 0 is never picked
    block = torch.searchsorted(ends, u, right=True)  # (R, 1)
    rest = u - starts.gather(1, block)  # u's place inside its block: >= 0, as the blocks below end at or under u
    first = block * size  # (R, 1): the block's first token
    positions = first + torch.arange(size, device=probs.device)  # (R, size)
    if whole < vocab:  # the last block's places past the vocabulary hold 0
        inside = torch.where(positions < vocab, probs.gather(1, positions.clamp(max=vocab - 1)), 0.0)
    else:
        inside = probs.gather(1, positions)
    inside_cdf = cumulative_distribution(inside)
    # The block's mass was summed in another order than this scan: keep u strictly inside the scan's own total,
    # so the token found has a positive probability whatever the rounding.
    rest = torch.minimum(rest, _below(inside_cdf[:, -1:]))
    return (first + torch.searchsorted(inside_cdf, rest, right=True)).squeeze(1)


@torch.library.custom_op("grouprl::float64_cumsum", mutates_args=())
def _float64_cumsum(probs: torch.Tensor) -> torch.Tensor:
    """The CDF through ATen's own kernel inside a compiled step, the eager draw's very numbers. Inductor would
    write the scan itself, and on CUDA its split scan of a float64 row as long as a vocabulary fails to generate
    (torch 2.11, measured on an H200 with Qwen's 151,936 tokens)."""
    return probs.cumsum(dim=-1, dtype=torch.float64)


@_float64_cumsum.register_fake
def _(probs: torch.Tensor) -> torch.Tensor:
    return probs.new_empty(probs.shape, dtype=torch.float64)


def sample_tokens(
    processed: torch.Tensor,
    generator: Optional[torch.Generator] = None,
    method: str = "inverse_cdf",
    uniforms: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row from softmax(processed); return (tokens (R,), their logprobs (R,)). `uniforms` (R, 1):
    the inverse-CDF draw's numbers, drawn by the caller (so a row's draw does not depend on the rows beside it)."""
    probs = processed.softmax(dim=-1)
    if method == "inverse_cdf":
        tokens = _inverse_cdf_draw(probs, generator, uniforms)
    elif uniforms is not None:
        raise ValueError("sample_tokens: uniforms are the inverse_cdf draw's; multinomial draws its own.")
    elif method == "multinomial":
        tokens = torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)
    else:
        raise ValueError(f"sample_tokens: unknown method {method!r}; choose one of {SAMPLING_METHODS}.")
    # log of the drawn token's softmax probability: a gather of the probabilities already at hand, where
    # logits - logsumexp would take another pass over the vocabulary (several kernels on a GPU)
    logprobs = probs.gather(1, tokens[:, None]).squeeze(1).log()
    return tokens, logprobs


def sample_next(
    logits: torch.Tensor,
    params: "SamplingParams",
    history: Optional[torch.Tensor] = None,
    history_mask: Optional[torch.Tensor] = None,
    method: str = "inverse_cdf",
    uniforms: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One draw per row from `logits` (R, V) processed with a call's SamplingParams: (tokens (R,), logprobs (R,));
    `uniforms` as `sample_tokens`'."""
    processed = process_logits(
        logits,
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        history=history,
        history_mask=history_mask,
    )
    return sample_tokens(processed, method=method, uniforms=uniforms)
