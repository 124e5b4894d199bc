"""Whether a model may decode with the shared-prefix cache: checked once per model, the verdict logged once.

The probe decodes two left-padded prompts, 2 samples each, for 3 steps, with the shared-prefix cache and
with a regular cache, and compares the logits. What counts as equal depends on the model's own rounding
noise, which the probe measures as well: the same regular decode with transformers' eager attention
instead of the model's own. In fp32 the two agree to ~3e-5 of the logits' scale, in bf16 only to ~10%
(SmolLM2-135M, logits of scale 30: bf16 sdpa, bf16 eager and the bf16 shared-prefix cache are each 1 to 6
away from the fp32 logits), so a fixed tolerance either rejects every bf16 model or accepts a wrong
attention in fp32. Architectures whose attention layers do something the shared
cache does not (sliding windows, sinks, soft-capping) fail the check and keep the regular cache; an error
other than "this model cannot run it" propagates.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers import DynamicCache
from transformers.utils import logging

from grouprl.generation.shared_prefix import SharedPrefixCache, decoding
from grouprl.model.forward import cache_keyword, describe, is_unsupported
from grouprl.model.logprobs import position_ids_from_mask

logger = logging.get_logger("grouprl")

_VERIFIED: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()

SAMPLES = 2


def matches_standard_attention(model: torch.nn.Module) -> bool:
    """Whether decoding with SharedPrefixCache reproduces the model's own attention (checked once per model)."""
    if model not in _VERIFIED:
        reason = probe(model)
        _VERIFIED[model] = reason is None
        name = type(model).__name__
        if reason is None:
            logger.info(
                f"grouprl: shared-prefix decoding is on for {name}: each prompt's KV cache is read once for its "
                "samples."
            )
        else:
            logger.log(
                logging.WARNING if reason.startswith("the probe") else logging.INFO,
                f"grouprl: shared-prefix decoding is off for {name}: {reason}. Each sample keeps its own copy of the "
                "prompt's cache.",
            )
    return _VERIFIED[model]


def logit_tolerance(expected: torch.Tensor, noise: float) -> float:
    """How far the shared-prefix logits may be from a regular cache's: twice the model's own noise (eager vs
    its attention), and at least 1e-3 of the logits' scale, since the two attentions sum in another order (a
    tolerance per element, as allclose, flagged fp32 SmolLM2-135M's 4.6e-4 on near-zero logits)."""
    return 1e-4 + max(2.0 * noise, 1e-3 * float(expected.abs().max()))


@torch.no_grad()
def probe(model: torch.nn.Module) -> str | None:
    """None if the shared-prefix cache decodes as a regular one, within the model's own noise; else why not."""
    if not callable(getattr(model, "set_attn_implementation", None)):
        return f"{type(model).__name__} has no set_attn_implementation"
    vocab = model.get_input_embeddings().weight.shape[0]
    device = next(model.parameters()).device
    prompts = torch.tensor([[0, 3, 5, 7], [2, 4, 6, 8]], device=device) % vocab
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]], device=device)
    steps = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]], device=device) % vocab  # tokens fed per step
    try:
        expected = regular_decode(model, prompts, mask, steps)
        with attention_implementation(model, "eager"):
            eager = regular_decode(model, prompts, mask, steps)
        got = shared_decode(model, prompts, mask, steps)
    except Exception as err:
        if not is_unsupported(err):
            raise
        return f"the probe's decode step failed: {describe(err)}"
    # The noise of the whole probe: in bf16 it moves from step to step (SmolLM2-135M: 0.75 to 3.25).
    noise = max(float((other - want).abs().max()) for want, other in zip(expected, eager))
    for want, have in zip(expected, got):
        largest_gap, allowed = float((have - want).abs().max()), logit_tolerance(want, noise=noise)
        if largest_gap > allowed:
            return (
                f"the probe's decode logits differ from a regular cache's by up to {largest_gap:.3g} "
                f"(allowed: {allowed:.3g}, from the model's own eager-vs-{model.config._attn_implementation} noise)"
            )
    return None


def regular_decode(
    model: torch.nn.Module, prompts: torch.Tensor, mask: torch.Tensor, steps: torch.Tensor
) -> list[torch.Tensor]:
    """Each step's logits (fp32) with a regular cache holding every sample's copy of its prompt."""
    cache = DynamicCache(config=model.config)
    full_mask = mask.repeat_interleave(SAMPLES, 0)
    model(
        input_ids=prompts.repeat_interleave(SAMPLES, 0),
        attention_mask=full_mask,
        position_ids=position_ids_from_mask(full_mask),
        **{cache_keyword(model): cache},
        use_cache=True,
    )
    positions, logits = full_mask.sum(dim=1), []
    for step in steps:
        full_mask = torch.cat([full_mask, full_mask.new_ones(len(full_mask), 1)], dim=1)
        out = model(
            input_ids=step[:, None],
            position_ids=positions[:, None],
            attention_mask=full_mask,
            **{cache_keyword(model): cache},
            use_cache=True,
        )
        logits.append(out.logits.float())
        positions = positions + 1
    return logits


def shared_decode(
    model: torch.nn.Module,
    prompts: torch.Tensor,
    mask: torch.Tensor,
    steps: torch.Tensor,
    forward: Callable[..., Any] | None = None,
) -> list[torch.Tensor]:
    """Each step's logits (fp32) with the shared-prefix cache: one prefill per prompt for its samples; the model
    runs as `forward` (default: `model` itself)."""
    forward = forward or model
    shared = shared_prefill(forward, model.config, prompts, mask, SAMPLES, steps.shape[0])
    positions, logits = mask.repeat_interleave(SAMPLES, 0).sum(dim=1), []
    for step in steps:
        with decoding(model, shared):
            out = forward(
                input_ids=step[:, None],
                position_ids=positions[:, None],
                **{cache_keyword(forward): shared},
                use_cache=True,
            )
        logits.append(out.logits.float())
        positions = positions + 1
    return logits


def shared_prefill(
    forward: Callable[..., Any], config: Any, prompts: torch.Tensor, mask: torch.Tensor, samples: int, new_tokens: int
) -> SharedPrefixCache:
    """`forward` (a model, or its class forward) prefills `prompts` once; their cache, shared by `samples` rows each."""
    prefill = DynamicCache(config=config)
    forward(
        input_ids=prompts,
        attention_mask=mask,
        position_ids=position_ids_from_mask(mask),
        **{cache_keyword(forward): prefill},
        use_cache=True,
    )
    return SharedPrefixCache(prefill, mask, samples, new_tokens)


@contextlib.contextmanager
def attention_implementation(model: torch.nn.Module, name: str) -> Iterator[None]:
    """`model` runs with transformers' attention `name` inside the block, its own one after."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)
