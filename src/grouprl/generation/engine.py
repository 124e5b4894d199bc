"""Fast in-process sampler for GRPO: one prefill per prompt, shared by its G samples, and a decode
batch that shrinks as sequences finish; it gives way to a `model.generate` the user replaced.

transformers `generate` with ``num_return_sequences=G`` copies each prompt G times before the
prefill, so the prompt is processed G times; it also keeps finished rows in the batch (padding
them) until the longest sequence ends. GRPO's batches are exactly the case where both hurt: G
samples of the same prompt, with lengths that vary widely. This engine:

1. prefills the B distinct prompts once (left-padded, positions from the attention mask) and
   decodes all B * G rows against that one prompt cache (`share_prefix=True`, shared_prefix.py;
   models whose attention it cannot reproduce get the prompt cache repeated G times instead);
2. samples with the same processing as transformers (`sampling.py`, inverse-CDF draw) and records
   each sampled token's logprob under the processed distribution;
3. drops rows from the KV cache and the decode batch as soon as they emit an EOS;
4. writes each step's keys and values into buffers allocated once (kv_buffers.py) instead of
   growing the cache by concatenation;
5. on CPU, computes the few-row products of a decode step with the weight as the left-hand
   operand, which the CPU BLAS runs faster (cpu_products.py);
6. runs the decode steps of the model types whose row of fused_step.FAMILIES keeps them on the CPU from
   their weights with fewer, larger operators than their forward, once a probe shows both compute alike.

It works with any transformers causal LM whose cache supports `batch_repeat_interleave` and
`batch_select_indices` (DynamicCache: Llama, Qwen2/3, Mistral, Gemma, ...). It samples the same
distribution as `generate`. With ``sampling_method="multinomial"``, the same seed and no row dropped
it draws exactly the tokens `generate` draws (the tests use this); the default inverse-CDF draw is
faster and consumes the random stream differently.

Honouring a `model.generate` the user replaced (`EngineUnlessGenerateOverridden`): the engine samples
with forward passes and never calls `model.generate`, but TRL always samples through it, so TRL scripts
that override or patch `generate` (a subclass with its own `generate`, `model.generate = ...`,
`unittest.mock.patch` of `GenerationMixin.generate` to script completions) expect their version to run.
Skipping it silently would train on different completions than the script asked for, so:

* generation_engine='auto' samples with the engine while `generate` is transformers' own and
  with transformers `generate` (hf.py) whenever it is not; this is checked at every generation,
  because a patch may be applied after the trainer is built;
* generation_engine='engine' or 'captured' refuses, naming what replaced `generate`.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Optional

import torch
from transformers import DynamicCache
from transformers.generation.utils import GenerationMixin
from transformers.utils import logging

from grouprl.core.types import Completion, SamplingParams
from grouprl.generation.cpu_products import weight_major_decode
from grouprl.generation.fused_step import FusedDecoder, fuses
from grouprl.generation.hf import TransformersGenerator
from grouprl.generation.kv_buffers import preallocate
from grouprl.generation.protocol import backend_report, left_pad
from grouprl.generation.sampling import SAMPLING_METHODS, sample_next
from grouprl.generation.shared_prefix import SharedPrefixCache, decoding, matches_standard_attention
from grouprl.model.adapters import base_model
from grouprl.model.forward import cache_keyword
from grouprl.model.logprobs import position_ids_from_mask
from grouprl.model.patches import grouprl_patches

logger = logging.get_logger("grouprl")

SUPPORTED_EXTRA = {"min_new_tokens"}
# Decoding through the model's forward (no fused steps), below this mean prompt length the regular cache is
# as fast (measured: equal at 13 tokens, shared 7% faster at 29, 25% at 333; W1's model, 4 prompts x 8
# samples, docs/benchmarks.md).
SHARED_PREFIX_MIN_TOKENS = 16

# Captured when grouprl is imported, before a test or script patches the class attribute.
STOCK_GENERATE = inspect.getattr_static(GenerationMixin, "generate")


def engine_supports(
    model: torch.nn.Module, generation_kwargs: dict, cache_implementation: Optional[str]
) -> Optional[str]:
    """None if FastGenerator can serve this model and options, else the reason it cannot."""
    reason = in_process_sampler_reason(model, generation_kwargs, cache_implementation)
    if reason:
        return reason
    kinds = getattr(model.config.get_text_config(), "layer_types", None) or []
    if any(t not in (None, "full_attention", "sliding_attention") for t in kinds):
        return "the model has non-attention layers (its cache cannot drop rows)"
    return None


def in_process_sampler_reason(
    model: torch.nn.Module,
    generation_kwargs: dict,
    cache_implementation: Optional[str],
    text_of_vision_language: bool = False,
) -> Optional[str]:
    """None if this model and options suit a sampler of grouprl's own (the engine, the captured loop), else the reason
    they do not. `text_of_vision_language`: a vision-language model passes too, for its text-only prompts (the caller
    sends prompts with images elsewhere)."""
    unsupported = set(generation_kwargs) - SUPPORTED_EXTRA
    if unsupported:
        return f"generation_kwargs {sorted(unsupported)} need transformers generate"
    if cache_implementation is not None:
        return "cache_implementation is a transformers generate option"
    config = getattr(model, "config", None)
    vision = hasattr(config, "vision_config")
    if config is None or getattr(config, "is_encoder_decoder", False) or (vision and not text_of_vision_language):
        return "the model is not a decoder-only text model"
    return None


class FastGenerator:
    """A `GenerationBackend` that samples from the training model in the same process."""

    needs_importance_correction = False  # samples come from the trained weights themselves

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        eos_token_ids: list[int],
        pad_token_id: int,
        *,
        share_prefix: bool = True,
        fuse_decode: bool = True,
        sampling_method: str = "inverse_cdf",
    ):
        if sampling_method not in SAMPLING_METHODS:
            raise ValueError(
                f"FastGenerator: sampling_method must be one of {SAMPLING_METHODS}, got {sampling_method!r}."
            )
        self.model = model
        self.sampling_method = sampling_method
        self.tokenizer = tokenizer
        self.eos_token_ids = list(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.share_prefix = share_prefix
        self.fuse_decode = fuse_decode
        self.decode_batch_sizes: list[int] = []  # rows in the decode batch at each step of the last call

    def sync_weights(self, model: torch.nn.Module) -> None:
        self.model = model

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], num_samples: int, params: SamplingParams) -> list[Completion]:
        unsupported = set(params.extra) - SUPPORTED_EXTRA
        if unsupported:
            raise ValueError(
                f"FastGenerator does not support generation_kwargs {sorted(unsupported)}; use "
                "generation_backend='transformers'."
            )
        if not prompt_ids:
            return []
        device = next(self.model.parameters()).device
        fuses_steps = self.fuse_decode and fuses(self.model)  # asked before the decode products replace forwards
        was_training = self.model.training
        self.model.eval()
        try:  # grouprl's attention functions registered, and the decode products, for this call only
            with grouprl_patches(self.model), weight_major_decode(self.model):
                tokens, logprobs = self._sample(prompt_ids, num_samples, params, device, fuses_steps)
        finally:
            self.model.train(was_training)
        completions = []
        eos = set(self.eos_token_ids)
        for row, (ids, lps) in enumerate(zip(tokens, logprobs)):
            finish = "stop" if ids and ids[-1] in eos else "length"
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            completions.append(Completion(row // num_samples, ids, text, finish, lps))
        return completions

    def _sample(
        self, prompt_ids: list[list[int]], g: int, params: SamplingParams, device: torch.device, fuses_steps: bool
    ) -> tuple[list[list[int]], list[list[float]]]:
        ids, mask = left_pad(prompt_ids, self.pad_token_id)
        ids, mask = ids.to(device), mask.to(device)
        standard = self.share_prefix and matches_standard_attention(self.model)
        fused = standard and fuses_steps
        # the fused step reads the shared-prefix cache, and with it the shared cache pays off at any prompt length
        shared = standard and (fused or mask.sum(dim=1).float().mean() >= SHARED_PREFIX_MIN_TOKENS)
        if not self.share_prefix:
            ids, mask = ids.repeat_interleave(g, 0), mask.repeat_interleave(g, 0)
        prefill = DynamicCache(config=self.model.config)
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=position_ids_from_mask(mask),
            **{cache_keyword(self.model): prefill},
            use_cache=True,
            logits_to_keep=1,
        )
        logits = out.logits[:, -1]  # (B or B*G, V)
        if shared:  # the prompt's keys/values stay once per prompt (shared_prefix.py)
            cache = SharedPrefixCache(prefill, mask, g, params.max_new_tokens)
        else:
            cache = prefill
        if self.share_prefix:
            if not shared:
                cache.batch_repeat_interleave(g)
            logits, ids, mask = (
                logits.repeat_interleave(g, 0),
                ids.repeat_interleave(g, 0),
                mask.repeat_interleave(g, 0),
            )
        if not shared:  # decode steps write into buffers instead of concatenating (kv_buffers.py)
            cache = preallocate(cache, params.max_new_tokens)
        decoder = FusedDecoder(base_model(self.model)) if fused else None  # the weights as they are for this call

        rows = ids.shape[0]
        history, history_mask = ids, mask.bool()  # (R, L) for the repetition penalty
        positions = mask.sum(dim=1)  # (R,) position of the next token
        active = torch.arange(rows, device=device)  # original row of each decode-batch row
        out_tokens: list[list[int]] = [[] for _ in range(rows)]
        out_logprobs: list[list[float]] = [[] for _ in range(rows)]
        eos = torch.tensor(self.eos_token_ids, device=device)
        min_new = int(params.extra.get("min_new_tokens", 0))
        track_history = params.repetition_penalty != 1.0
        self.decode_batch_sizes = []
        # the shared-prefix attention serves every decode step; the model's own attention is back after the loop
        with decoding(self.model, cache) if shared else contextlib.nullcontext():
            for step in range(params.max_new_tokens):
                self.decode_batch_sizes.append(len(active))
                if step < min_new:
                    logits[:, eos] = -float("inf")
                next_tokens, next_logprobs = sample_next(
                    logits, params, history, history_mask, method=self.sampling_method
                )
                for r, t, lp in zip(active.tolist(), next_tokens.tolist(), next_logprobs.tolist()):
                    out_tokens[r].append(t)
                    out_logprobs[r].append(lp)
                if step == params.max_new_tokens - 1:
                    break
                alive = ~torch.isin(next_tokens, eos)
                if not bool(alive.any()):
                    break
                if not bool(alive.all()):  # drop finished rows from the cache and every per-row tensor
                    keep = alive.nonzero().squeeze(1)
                    cache.batch_select_indices(keep)
                    active, next_tokens, mask, positions = active[keep], next_tokens[keep], mask[keep], positions[keep]
                    history, history_mask = history[keep], history_mask[keep]
                if track_history:
                    history = torch.cat([history, next_tokens[:, None]], dim=1)
                    history_mask = torch.cat([history_mask, history_mask.new_ones((len(active), 1))], dim=1)
                if not shared:
                    mask = torch.cat([mask, mask.new_ones((len(active), 1))], dim=1)
                if decoder is not None:
                    logits = decoder.step(next_tokens, positions, cache)
                else:
                    logits = self.model(
                        input_ids=next_tokens[:, None],
                        attention_mask=None if shared else mask,  # the shared-prefix cache masks the prompts itself
                        position_ids=positions[:, None],
                        **{cache_keyword(self.model): cache},
                        use_cache=True,
                    ).logits[:, -1]
                positions = positions + 1
        return out_tokens, out_logprobs


def generate_override(model: torch.nn.Module) -> Optional[str]:
    """None if `model.generate` runs transformers' GenerationMixin.generate; else what replaced it, in words."""
    if "generate" in vars(model):
        return f"generate is set on the {type(model).__name__} instance"
    owner = next((c for c in type(model).__mro__ if "generate" in vars(c)), None)
    if owner is None:
        return None  # no generate at all: nothing the engine could bypass
    if owner is GenerationMixin:
        current = vars(GenerationMixin)["generate"]
        if current is STOCK_GENERATE and getattr(current, "__module__", "").startswith("transformers."):
            return None
        return "transformers' GenerationMixin.generate is patched"
    if owner.__module__.startswith("peft.") and callable(getattr(model, "get_base_model", None)):
        return generate_override(model.get_base_model())  # a PeftModel's generate calls its base model's
    return f"{owner.__qualname__} overrides generate"


class EngineUnlessGenerateOverridden:
    """The fast engine, or, while `model.generate` is not transformers' own, transformers `generate`.

    With `fallback=None` (generation_engine='engine') an overridden `generate` is an error instead.
    """

    needs_importance_correction = False  # both sample from the training weights in this process

    def __init__(self, engine: FastGenerator, fallback: Optional[TransformersGenerator], name: str = "engine"):
        self.engine, self.name = engine, name  # name: the generation_engine value that chose it
        self.fallback = fallback
        self._announced: Optional[str] = None

    @property
    def model(self) -> torch.nn.Module:
        return self.engine.model

    def sync_weights(self, model: torch.nn.Module) -> None:
        self.engine.sync_weights(model)
        if self.fallback is not None:
            self.fallback.sync_weights(model)

    def report(self) -> dict[str, float]:
        return backend_report(self.engine)

    def check(self) -> Optional[str]:
        """What replaced `generate` (None: nothing); raises under generation_engine='engine'."""
        reason = generate_override(self.engine.model)
        if reason is not None and self.fallback is None:
            raise ValueError(
                f"GRPOConfig.generation_engine={self.name!r} samples without calling model.generate, but {reason}, so "
                "that code would never run. Use generation_engine='auto' (it then samples with model.generate) or "
                "'transformers'."
            )
        return reason

    def generate(
        self, prompt_ids: list[list[int]], num_samples: int, params: SamplingParams, **images: Any
    ) -> list[Completion]:
        """`images`: `multimodal=`, for an engine that serves a vision-language model (protocol.sample_groups)."""
        reason = self.check()
        if reason is None:
            return self.engine.generate(prompt_ids, num_samples, params, **images)
        if reason != self._announced:
            logger.warning(
                f"grouprl: {reason}; sampling calls model.generate (transformers) instead of grouprl's engine, "
                "which would bypass it."
            )
            self._announced = reason
        return self.fallback.generate(prompt_ids, num_samples, params, **images)
