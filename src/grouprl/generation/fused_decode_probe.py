"""Whether a model may decode with FusedDecoder: checked once per model, the verdict logged once.

The structure check (fused_decode.structure_reason) finds what the fused step cannot run by name and
type; the probe finds what it would compute differently (Gemma has Llama's module names but scales
its embeddings and norms): it decodes two left-padded prompts, 2 samples each, for 3 steps, through
the model's forward and through FusedDecoder over the same shared-prefix cache, in fp32, and
compares the logits (tolerance: shared_prefix_probe.logit_tolerance with no noise, i.e. 1e-3 of the
logits' scale). Both run the model's class forward: `accelerator.prepare` replaces a bf16 model's
forward on the instance with one under autocast, which would make the fp32 reference a bf16 one. Only
fp32 weights take the fused path (bf16 autocast on them included): in lower-precision weights the
comparison cannot tell a different rounding order from a different computation. An error other than
"this model cannot run it" propagates.
"""

from __future__ import annotations

import functools
import weakref

import torch
from transformers.utils import logging

from grouprl.generation.fused_decode import FusedDecoder, structure_reason
from grouprl.generation.shared_prefix_probe import SAMPLES, logit_tolerance, shared_decode, shared_prefill
from grouprl.model.forward import describe, is_unsupported

logger = logging.get_logger("grouprl")

_VERDICTS: weakref.WeakKeyDictionary[torch.nn.Module, str | None] = weakref.WeakKeyDictionary()


def _base(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a peft wrapper (its LoRA layers stay in place), or `model` itself."""
    return model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model


def fuses(model: torch.nn.Module) -> bool:
    """Whether FusedDecoder may run `model`'s decode steps: decided once per model, the verdict logged once."""
    target = _base(model)
    if target not in _VERDICTS:
        reason = structure_reason(target) or probe(target)
        _VERDICTS[target] = reason
        name = type(target).__name__
        if reason is None:
            logger.info(f"grouprl: fused decode steps are on for {name}.")
        else:
            logger.info(f"grouprl: fused decode steps are off for {name}: {reason}. Decode steps run its forward.")
    return _VERDICTS[target] is None


def fused_decoder(model: torch.nn.Module) -> FusedDecoder:
    """A FusedDecoder with `model`'s weights as they are now (call `fuses` first)."""
    return FusedDecoder(_base(model))


@torch.no_grad()
def probe(model: torch.nn.Module) -> str | None:
    """None if FusedDecoder's steps give the model's own logits (fp32, through the same shared-prefix cache)."""
    vocab = model.get_input_embeddings().weight.shape[0]
    device = model.get_input_embeddings().weight.device
    prompts = torch.tensor([[0, 3, 5, 7], [2, 4, 6, 8]], device=device) % vocab
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]], device=device)
    steps = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]], device=device) % vocab
    forward = functools.partial(type(model).forward, model)  # the class forward (module doc)
    with torch.autocast(device.type, enabled=False):
        try:
            expected = shared_decode(model, prompts, mask, steps, forward=forward)
            got = _fused_decode(model, prompts, mask, steps)
        except Exception as err:
            if not is_unsupported(err):
                raise
            return f"the probe's fused step failed: {describe(err)}"
    for want, have in zip(expected, got):
        gap, allowed = float((have - want.reshape(have.shape)).abs().max()), logit_tolerance(want, noise=0.0)
        if gap > allowed:
            return f"the probe's fused logits differ from its forward by up to {gap:.3g} (allowed {allowed:.3g})"
    return None


def _fused_decode(
    model: torch.nn.Module, prompts: torch.Tensor, mask: torch.Tensor, steps: torch.Tensor
) -> list[torch.Tensor]:
    """Each step's fp32 logits (rows, vocab) from FusedDecoder, `SAMPLES` per prompt over one shared-prefix cache
    prefilled by the model's class forward (module doc)."""
    forward = functools.partial(type(model).forward, model)
    cache = shared_prefill(forward, model.config, prompts, mask, SAMPLES, steps.shape[0])
    decoder = FusedDecoder(model)
    positions = mask.repeat_interleave(SAMPLES, 0).sum(dim=1)
    logits = []
    for step in steps:
        logits.append(decoder.step(step, positions, cache))
        positions = positions + 1
    return logits
