"""The policy's per-token logprobs (and entropies) of completions, temperature-scaled, or a user's TRL override.

`policy_logprobs` is what every forward pass of the policy (old logprobs, reference logprobs, the loss, evaluation)
calls: a subclass that overrides TRL's ``_get_per_token_logps_and_entropies`` gets its version called with TRL's
arguments (text models), otherwise grouprl's `completion_logprobs` runs.

GRPO's importance ratio compares the policy's probability of each *sampled* token with the
probability it had when sampled; sampling used logits / temperature, so training must too
(TRL PR #3029). Three things keep this pass lean:

- **No (rows, tokens, vocab) logits.** The model runs up to its final hidden states; the LM head is
  applied in checkpointed chunks of positions, each chunk reduced at once to the selected
  token's logprob (and the entropy); the forward up to the head and the chunked head are
  `forward.py`. Models whose head cannot be applied separately
  (sharded by FSDP / ZeRO-3, or logits post-processed after the head) fall back to asking the model
  for the completion logits, still reduced in checkpointed chunks.
- **Only completion positions** are projected (`logits_to_keep`).
- **Length buckets.** Rows are sorted by length and run in buckets, each trimmed to its own
  longest prompt and completion, so a short completion does not pay for the longest one
  (`forward.length_buckets`).
- **A shared prompt once** (`prompt_packing.py`), unless `pack_prompts=False`
  (GRPOConfig.pack_shared_prompts).

Positions are derived from the attention mask (left-padded prompts), the same way `generate`
derives them, so a sequence's logprobs do not depend on its batch's padding or bucket.
Vision-language rows add their image inputs, collated per bucket (`multimodal.forward_inputs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Optional

import torch
import torch.nn.functional as F

from grouprl.core.overrides import NO_OVERRIDES, Overrides
from grouprl.core.types import padded_width
from grouprl.model.forward import (
    capture_head_input,
    forward_keeping,
    head_logprobs,
    head_weight_and_inputs,
    in_row_order,
    length_buckets,
    logits_logprobs,
    separable_head,
    sharded_parameters,
)
from grouprl.model.multimodal import PROBE_ATTRIBUTE, VisionProbe, forward_inputs
from grouprl.model.prompt_packing import shared_prompt_logprobs

# The chunked head reductions, the buckets and the head check live in forward.py (so prompt_packing
# uses them without importing this one); callers and tests keep importing them from here.
__all__ = [
    "TokenLogprobs",
    "completion_logprobs",
    "head_logprobs",
    "in_row_order",
    "length_buckets",
    "logits_logprobs",
    "policy_logprobs",
    "position_ids_from_mask",
    "separable_head",
]


class TokenLogprobs(NamedTuple):
    logprobs: torch.Tensor  # (n, T) logprob of each completion token, with gradient if enabled
    entropy: torch.Tensor | None  # (n, T) entropy of the next-token distribution, or None
    aux_loss: torch.Tensor | None  # scalar MoE router load-balancing loss, or None


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


def completion_logprobs(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,  # (n, P) left-padded
    prompt_mask: torch.Tensor,  # (n, P) bool
    completion_ids: torch.Tensor,  # (n, T) right-padded
    completion_mask: torch.Tensor,  # (n, T) bool
    *,
    temperature: float,
    rows_per_chunk: int | None = None,
    with_entropy: bool = True,
    entropy_grad: bool = False,
    with_aux_loss: bool = False,
    bucket_by_length: bool = True,
    multimodal: Sequence[Any] | None = None,  # (n,) each row's multimodal.PromptImages or None (VLMs)
    pack_prompts: bool = True,  # GRPOConfig.pack_shared_prompts
    pad_to_multiple_of: int | None = None,  # GRPOConfig's: every forward's prompt and completion widths are multiples
) -> TokenLogprobs:
    """Logprobs (n, T) of the completion tokens, their entropies (n, T) or None, the MoE aux loss or None.

    Runs the model on length buckets of at most `rows_per_chunk` rows (one bucket of all rows when
    `bucket_by_length` is False). Positions beyond a row's completion hold 0. The entropy is detached
    unless `entropy_grad`. With `with_aux_loss` the model returns its router load-balancing loss
    (averaged over buckets). With `pack_prompts`, rows sharing a prompt run it once (`prompt_packing`).
    With `pad_to_multiple_of`, each bucket keeps its prompt and completion widths at multiples of it (within the
    tensors' own widths) and prompts are not packed, so the model sees those shapes only (TRL's padding).
    """
    n, completion_len = completion_ids.shape
    if completion_len == 0 or n == 0:
        empty = completion_ids.new_zeros((n, completion_len), dtype=torch.float32)
        return TokenLogprobs(empty, empty if with_entropy else None, None)
    entropy_mode = "grad" if entropy_grad else ("value" if with_entropy else "none")
    if sharded_parameters(model):  # forwards cut by row count alone, the same on every process: not by the rows'
        pack_prompts, bucket_by_length = False, False  # lengths nor by shared prompts, which differ between processes
    # where processes run in step, each forward runs the vision tower (multimodal.py); an attribute read, so a text
    # run's step enters no multimodal code
    probe: VisionProbe | None = getattr(model, PROBE_ATTRIBUTE, None)
    if pack_prompts and multimodal is None and not with_aux_loss and not pad_to_multiple_of:
        packed = shared_prompt_logprobs(
            model,
            prompt_ids,
            prompt_mask,
            completion_ids,
            completion_mask,
            temperature,
            rows_per_chunk=rows_per_chunk,
            entropy=entropy_mode,
            plain=_plain_logprobs,
        )
        if packed is not None:
            return TokenLogprobs(packed[0], packed[1] if with_entropy else None, None)
    prompt_lens = prompt_mask.sum(dim=1).tolist()
    completion_lens = completion_mask.sum(dim=1).tolist()
    if bucket_by_length:
        buckets = length_buckets([p + c for p, c in zip(prompt_lens, completion_lens)], rows_per_chunk)
    else:
        chunk = rows_per_chunk or n
        buckets = [list(range(s, min(s + chunk, n))) for s in range(0, n, chunk)]
    forwards = []  # (rows, their index, completion width, the model's keyword arguments) of each bucket
    for rows in buckets:
        p = max(max(prompt_lens[r] for r in rows), 1)
        t = max(max(completion_lens[r] for r in rows), 1)
        if pad_to_multiple_of:
            p = min(padded_width(p, pad_to_multiple_of), prompt_ids.shape[1])
            t = min(padded_width(t, pad_to_multiple_of), completion_len)
        index = torch.tensor(rows, device=prompt_ids.device)
        row_images = [None] * len(rows) if multimodal is None else [multimodal[r] for r in rows]
        probed = probe is not None and all(m is None for m in row_images)
        if probed:
            p = max(p, len(probe.prompt_ids))
        bucket = [
            _left_padded(prompt_ids[index], p),
            _left_padded(prompt_mask[index], p),
            completion_ids[index, :t],
            completion_mask[index, :t],
        ]
        if probed:  # one more row: the probe's prompt, an empty completion
            probe_prompt = torch.tensor([probe.prompt_ids], dtype=prompt_ids.dtype, device=prompt_ids.device)
            extra = [_left_padded(probe_prompt, p), _left_padded(torch.ones_like(probe_prompt), p)]
            extra += [torch.zeros_like(bucket[2][:1]), torch.zeros_like(bucket[3][:1])]
            bucket = [torch.cat([part, more]) for part, more in zip(bucket, extra)]
            row_images = row_images + [probe.images]
        kwargs = _bucket_inputs(*bucket)
        if any(m is not None for m in row_images):
            kwargs.update(forward_inputs(model, row_images, p, p + t, prompt_ids.device))
        if with_aux_loss:
            kwargs["output_router_logits"] = True
        forwards.append((rows, index, t, kwargs, probed))
    head = separable_head(model)
    weight, inputs = head_weight_and_inputs(model, head, [forward[3] for forward in forwards])  # before the bodies
    logps_parts, entropy_parts, aux_parts, order = [], [], [], []
    for (rows, index, t, _, probed), kwargs in zip(forwards, inputs):
        targets = completion_ids[index, :t]
        if probed:
            targets = torch.cat([targets, torch.zeros_like(targets[:1])])
        logps, entropy, aux = _bucket_logprobs(
            model, head, weight, kwargs, targets, temperature, entropy_mode, with_aux_loss
        )
        if probed:  # the probe's row dropped; times zero in the graph, so its backward runs the vision tower's too
            logps = logps[:-1] + 0.0 * logps[-1].sum()
            entropy = None if entropy is None else entropy[:-1]
        logps_parts.append(F.pad(logps, (0, completion_len - t)))
        if entropy is not None:
            entropy_parts.append(F.pad(entropy, (0, completion_len - t)))
        if aux is not None:
            aux_parts.append(aux)
        order.extend(rows)
    logps, entropy = in_row_order(logps_parts, order), (in_row_order(entropy_parts, order) if with_entropy else None)
    aux_loss = torch.stack(aux_parts).mean() if aux_parts else None
    return TokenLogprobs(logps, entropy, aux_loss)


def _left_padded(rows: torch.Tensor, width: int) -> torch.Tensor:
    """The last `width` columns of left-padded rows, zeros (padding) added on the left where they are narrower."""
    return rows[:, -width:] if rows.shape[1] >= width else F.pad(rows, (width - rows.shape[1], 0))


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(n, L) positions counting only real tokens; padding gets position 0."""
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


def _plain_logprobs(model: torch.nn.Module, *rows: torch.Tensor) -> torch.Tensor:
    return completion_logprobs(model, *rows, temperature=1.0, with_entropy=False, pack_prompts=False).logprobs


def _bucket_inputs(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor, completion_mask: torch.Tensor
) -> dict[str, Any]:
    """The model's keyword arguments for one bucket's forward over its prompts and completions."""
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # (n, P + T)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1).long()
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids_from_mask(attention_mask),
        "use_cache": False,
    }


def _bucket_logprobs(
    model: torch.nn.Module,
    head: torch.nn.Module | None,
    weight: torch.Tensor | None,
    kwargs: dict[str, Any],
    completion_ids: torch.Tensor,
    temperature: float,
    entropy: str,
    with_aux_loss: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One bucket's forward and head, with the head's `weight` and the model's `kwargs` as
    forward.head_weight_and_inputs gave them."""
    completion_len = completion_ids.shape[1]
    with capture_head_input(head) as captured:
        output = forward_keeping(model, kwargs, completion_len + 1)
    aux = getattr(output, "aux_loss", None) if with_aux_loss else None
    # Position t predicts token t + 1: drop the last one, keep the T before it.
    if head is not None:
        hidden = captured[0][:, -(completion_len + 1) : -1, :]
        logps, entropies = head_logprobs(
            hidden, head.forward, completion_ids, temperature, entropy=entropy, weight=weight
        )
    else:
        logits = output.logits[:, -(completion_len + 1) : -1, :]
        logps, entropies = logits_logprobs(logits, completion_ids, temperature, entropy=entropy)
    return logps, entropies, aux
