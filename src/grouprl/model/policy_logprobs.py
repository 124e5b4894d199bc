"""The policy's per-token log-probabilities of a batch's completions, or a user's TRL override of them.

`policy_logprobs` is what every forward pass of the policy (old logprobs, reference logprobs, the loss, evaluation)
calls: a subclass that overrides TRL's ``_get_per_token_logps_and_entropies`` gets its version called with TRL's
arguments (text models), otherwise grouprl's ``completion_logprobs`` runs.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from grouprl.core.overrides import NO_OVERRIDES, Overrides
from grouprl.model.logprobs import TokenLogprobs, completion_logprobs


def policy_logprobs(
    model: torch.nn.Module,
    b: Any,
    *,
    temperature: float,
    rows_per_chunk: Optional[int] = None,
    with_entropy: bool = True,
    entropy_grad: bool = False,
    with_aux_loss: bool = False,
    pack_prompts: bool = True,
    overrides: Overrides = NO_OVERRIDES,
) -> TokenLogprobs:
    """Logprobs (and entropy, aux loss) of a batch's completions under `model`: through the user's
    _get_per_token_logps_and_entropies when a subclass overrides it, else grouprl's `completion_logprobs`."""
    override = overrides.get("_get_per_token_logps_and_entropies")
    if override is None:
        return completion_logprobs(
            model,
            b.prompt_ids,
            b.prompt_mask,
            b.completion_ids,
            b.completion_mask,
            temperature=temperature,
            rows_per_chunk=rows_per_chunk,
            with_entropy=with_entropy,
            entropy_grad=entropy_grad,
            with_aux_loss=with_aux_loss,
            multimodal=b.multimodal,
            pack_prompts=pack_prompts,
            pad_to_multiple_of=getattr(b, "pad_to_multiple_of", None),
        )
    name = overrides.qualified("_get_per_token_logps_and_entropies")
    if b.multimodal is not None:
        raise NotImplementedError(
            f"{name} is overridden, but this batch has images, which grouprl passes to the model its own way "
            "(not as TRL's pixel_values keyword arguments); remove the override for vision-language training."
        )
    width = b.completion_ids.shape[1]
    input_ids = torch.cat([b.prompt_ids, b.completion_ids], dim=1)
    attention_mask = torch.cat([b.prompt_mask, b.completion_mask], dim=1).long()
    result = override(
        model,
        input_ids,
        attention_mask,
        width,
        batch_size=rows_per_chunk,
        compute_entropy=with_entropy,
        compute_aux_loss=with_aux_loss,
    )
    if not isinstance(result, tuple) or len(result) != 3:
        raise TypeError(
            f"{name} must return (per_token_logps, entropies, aux_loss) as TRL's does, got {type(result).__name__}."
        )
    logps, entropy, aux = result
    for label, value in (("per_token_logps", logps), ("entropies", entropy)):
        if value is not None and tuple(value.shape) != tuple(b.completion_ids.shape):
            raise ValueError(
                f"{name} returned {label} of shape {tuple(value.shape)}; expected {tuple(b.completion_ids.shape)} "
                "(one value per completion position, logits_to_keep columns)."
            )
    if with_entropy and entropy is None:
        raise ValueError(f"{name} returned no entropies although compute_entropy=True.")
    if entropy is not None and not entropy_grad:
        entropy = entropy.detach()
    return TokenLogprobs(logps, entropy if with_entropy else None, aux if with_aux_loss else None)
