"""Running the model up to its LM head: the one forward the plain and the packed logprob passes share.

Both passes (`logprobs.py`, `prompt_packing.py`) need the same three things, kept here so neither
imports the other's private helpers:

- `forward_keeping`: a forward that asks for the logits of the last positions only
  (`logits_to_keep`), or every position for a model whose forward does not take that keyword;
- `capture_head_input`: within a block, the LM head records its input (the final hidden states)
  and returns an empty logits tensor, so the head can be applied in chunks afterwards;
- `separable_head`: whether that is exact for a model (checked once per model, and logged).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import weakref
from collections.abc import Iterator

import torch
from transformers.utils import logging

logger = logging.get_logger("grouprl")

# Exceptions by which a model says "I cannot run this": a probe that meets one keeps the plain path
# (and logs why). Anything else (an out-of-memory error, a bug in a reward or user hook, an
# interrupt) is a genuine error and propagates.
UNSUPPORTED_BY_MODEL = (NotImplementedError, TypeError, ValueError, IndexError, RuntimeError)


def is_unsupported(err: BaseException) -> bool:
    """Whether `err`, raised by a probe's model call, means the model does not support the fast path."""
    return isinstance(err, UNSUPPORTED_BY_MODEL) and not isinstance(err, torch.OutOfMemoryError)


def describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


# --- logits of the last positions only ------------------------------------------------------------

_NO_LOGITS_TO_KEEP: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()  # models whose forward refused the keyword


def _refuses_logits_to_keep(err: TypeError) -> bool:
    """True for exactly Python's "got an unexpected keyword argument 'logits_to_keep'" error."""
    text = str(err)
    return "unexpected keyword argument" in text and "'logits_to_keep'" in text


def forward_keeping(model: torch.nn.Module, kwargs: dict, keep: int):
    """`model(**kwargs, logits_to_keep=keep)`; a model whose forward has no such keyword computes every position.

    Only the TypeError that names `logits_to_keep` as an unexpected keyword means that (remembered per
    model, logged once); any other TypeError is the model's own and propagates.
    """
    if model in _NO_LOGITS_TO_KEEP:
        return model(**kwargs)
    try:
        return model(**kwargs, logits_to_keep=keep)
    except TypeError as err:
        if not _refuses_logits_to_keep(err):
            raise
    _NO_LOGITS_TO_KEEP.add(model)
    logger.info(
        f"grouprl: {type(model).__name__}.forward takes no logits_to_keep; its logits are computed at every position."
    )
    return model(**kwargs)


# --- the LM head's input ---------------------------------------------------------------------------


@contextlib.contextmanager
def capture_head_input(head: torch.nn.Module | None) -> Iterator[list]:
    """Within the block, the model's head records its input and returns an empty (…, 0) logits tensor.

    A per-call change to one module, undone in `finally`: an instance-level forward already there
    (e.g. the fp32 head of cast_lm_head_to_fp32) is put back as it was.
    """
    captured: list[torch.Tensor] = []
    if head is None:
        yield captured
        return

    def record(hidden: torch.Tensor) -> torch.Tensor:
        captured.append(hidden)
        return hidden[..., :0]

    own = head.__dict__.get("forward")
    head.forward = record
    try:
        yield captured
    finally:
        if own is None:
            del head.forward
        else:
            head.forward = own


# --- is the head separable? ------------------------------------------------------------------------

_SEPARABLE: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()


def separable_head(model: torch.nn.Module) -> torch.nn.Module | None:
    """The model's LM head if logits == head(final hidden state) exactly, else None.

    Checked once per model by comparing both paths on a short input, so models that post-process
    logits (soft-capping, scaling) are recognised without a list of architectures; the verdict is
    logged once. Sharded models (FSDP, DeepSpeed ZeRO-3) gather the head's weight only inside their
    own forward: not separable.
    """
    inner = getattr(model, "module", model)  # DDP / accelerate wrappers
    get_head = getattr(inner, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if head is None or type(model).__name__ in ("FullyShardedDataParallel", "DeepSpeedEngine"):
        return None
    weight = getattr(head, "weight", None)
    if weight is None or hasattr(weight, "ds_id") or type(weight).__name__ == "DTensor" or weight.dim() != 2:
        return None
    if model not in _SEPARABLE:
        reason = _head_mismatch(model, head)
        _SEPARABLE[model] = reason is None
        if reason is None:
            logger.info(
                f"grouprl: {type(inner).__name__}'s LM head is applied in chunks by grouprl (no full logits held)."
            )
        else:
            logger.info(
                f"grouprl: {type(inner).__name__}'s LM head is not separable ({reason}); its logits come from its own "
                "forward, reduced in chunks."
            )
    return head if _SEPARABLE[model] else None


@torch.no_grad()
def _head_mismatch(model: torch.nn.Module, head: torch.nn.Module) -> str | None:
    """None if head(captured hidden states) reproduces the model's logits on a 4-token probe, else why not."""
    probe = torch.arange(1, 5, device=head.weight.device).unsqueeze(0) % head.weight.shape[0]
    kwargs = {"input_ids": probe, "attention_mask": torch.ones_like(probe), "use_cache": False}
    try:
        with capture_head_input(head) as captured:
            forward_keeping(model, kwargs, 2)
        expected = forward_keeping(model, kwargs, 2).logits.float()
        got = head(captured[0]).float()
    except Exception as err:
        if not is_unsupported(err):
            raise
        return f"the probe forward failed: {describe(err)}"
    if got.shape != expected.shape:
        return f"head(hidden) has shape {tuple(got.shape)}, the model's logits {tuple(expected.shape)}"
    if not torch.allclose(got, expected, rtol=1e-4, atol=1e-4):
        return f"the model post-processes the head's logits (max difference {float((got - expected).abs().max()):.3g})"
    return None


def cache_keyword(target: object) -> str:
    """The keyword the forward of `target` (a model, a peft wrapper, or `functools.partial(cls.forward, model)`)
    takes its KV cache by: transformers 5.24 renamed `past_key_values` to `cache` (the old name warns, and goes in
    5.40); models it has not migrated, and older transformers, take `past_key_values`."""
    model = target.args[0] if isinstance(target, functools.partial) and target.args else target
    if callable(getattr(model, "get_base_model", None)):
        model = model.get_base_model()
    try:
        parameters = inspect.signature(type(model).forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in parameters else "past_key_values"
