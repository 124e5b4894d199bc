"""transformers continuous batching as a generation backend (use_transformers_continuous_batching, TRL's field).

`model.generate_batch` schedules the rows into a paged KV cache and runs them on a thread of its own; each call
builds its cache and frees it at the end. Two things differ from TRL's use of it, both on purpose:

- the cache is sized for the call's rows (each row's prompt plus max_new_tokens, in pages), unless
  transformers_continuous_batching_config sizes it (num_blocks or max_memory_percent): TRL sizes it at half of the
  device's free memory, which on a CPU allocates and clears gigabytes of host memory at every generation;
- a setting continuous batching would not apply is refused when the trainer is built: transformers drops the
  repetition penalty's processor (and min_new_tokens'), and keeps no beam search; `generate_batch` also logs a failed
  request and returns without it, which here stops the run with the request's error.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Optional

import torch

from grouprl.core.types import Completion, SamplingParams
from grouprl.generation.protocol import cut_at_eos

# generation_kwargs that continuous batching applies (its processors for these run per row, or need no state)
APPLIED_KWARGS = ("temperature", "top_k", "top_p", "min_p", "do_sample", "suppress_tokens")
SIZING = ("num_blocks", "max_memory_percent")
# generation_kwargs at values that change nothing: nothing for continuous batching to apply
NEUTRAL_KWARGS = {"repetition_penalty": 1.0, "num_beams": 1, "min_new_tokens": 0, "no_repeat_ngram_size": 0}


def continuous_batching_refusal(params: SamplingParams) -> Optional[str]:
    """Why continuous batching cannot sample with `params` (None when it can)."""
    if params.extra.get("repetition_penalty", params.repetition_penalty) != 1.0:
        return "transformers continuous batching drops the repetition penalty's logits processor (repetition_penalty)"
    ignored = sorted(
        key
        for key, value in params.extra.items()
        if key not in APPLIED_KWARGS and NEUTRAL_KWARGS.get(key, ...) != value
    )
    if ignored:
        return (
            f"transformers continuous batching does not apply generation_kwargs {ignored} (it applies {APPLIED_KWARGS})"
        )
    if params.extra.get("do_sample", True) is not True:
        return "GRPO samples: generation_kwargs do_sample must stay True"
    return None


@contextmanager
def in_the_weights_dtype(model: torch.nn.Module) -> Iterator[None]:
    """The model's forward without accelerate's mixed-precision wrapper, for the length of the block.

    transformers allocates the paged cache in `model.dtype` (the weights'), while the wrapper computes keys and
    values in bf16 autocast: with fp32 weights and bf16=True (TRL's defaults) the first cache write fails ("self and
    source expected to have the same dtype"). Without the wrapper the rows are sampled in the weights' dtype.
    """
    original = getattr(model, "_original_forward", None)  # set by accelerate's prepare under mixed precision
    if original is None:
        yield
        return
    wrapped = model.forward
    model.forward = original
    try:
        yield
    finally:
        model.forward = wrapped


class ContinuousBatchingGenerator:
    """Samples with transformers' continuous batching (`generate_batch`) on the training model itself."""

    needs_importance_correction = False  # samples come from the trained weights themselves

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        eos_token_ids: list[int],
        pad_token_id: int,
        settings: Optional[dict[str, Any]] = None,
        suppress_token_ids: Sequence[int] = (),
    ):
        from transformers.generation import ContinuousBatchingConfig

        self.model, self.tokenizer = model, tokenizer
        self.eos_token_ids, self.pad_token_id = list(eos_token_ids), pad_token_id
        self.settings = dict(settings or {})
        self.suppress_token_ids = list(suppress_token_ids)
        try:
            ContinuousBatchingConfig(**self.settings)
        except TypeError as err:
            raise ValueError(
                f"GRPOConfig.transformers_continuous_batching_config={self.settings!r} is not a set of "
                f"transformers.generation.ContinuousBatchingConfig arguments: {err}"
            ) from None

    def sync_weights(self, model: torch.nn.Module) -> None:
        self.model = model

    def batching_config(self, rows: list[list[int]], max_new_tokens: int) -> Any:
        """The user's settings; a cache of exactly the pages the rows need unless they size it."""
        from transformers.generation import ContinuousBatchingConfig

        settings = dict(self.settings)
        if not any(settings.get(name) is not None for name in SIZING):
            page = settings.get("page_size", ContinuousBatchingConfig().page_size)
            settings["num_blocks"] = sum(math.ceil((len(row) + max_new_tokens) / page) for row in rows)
        return ContinuousBatchingConfig(**settings)

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], num_samples: int, params: SamplingParams) -> list[Completion]:
        from transformers import GenerationConfig

        if not prompt_ids:
            return []
        refusal = continuous_batching_refusal(params)
        if refusal:
            raise ValueError(f"{refusal}; use generation_engine='auto' or 'transformers' instead.")
        rows = [list(ids) for ids in prompt_ids for _ in range(num_samples)]
        sampling = {
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,  # 0 disables
            "min_p": params.min_p,
            **({"suppress_tokens": self.suppress_token_ids} if self.suppress_token_ids else {}),
            **params.extra,
        }
        config = GenerationConfig(
            max_new_tokens=params.max_new_tokens,
            do_sample=True,
            eos_token_id=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            disable_compile=True,
            **{name: value for name, value in sampling.items() if name != "do_sample"},
        )
        was_training = self.model.training
        self.model.eval()  # the KV cache, which gradient checkpointing turns off in train mode
        try:
            with in_the_weights_dtype(self.model):
                results = self.model.generate_batch(
                    rows,
                    generation_config=config,
                    continuous_batching_config=self.batching_config(rows, params.max_new_tokens),
                    progress_bar=False,
                )
        except MemoryError as err:
            raise RuntimeError(
                f"transformers continuous batching could not size its cache for {len(rows)} rows: {err}. Give it a "
                "smaller one in GRPOConfig.transformers_continuous_batching_config (page_size, max_batch_tokens, "
                "num_blocks or max_memory_percent)."
            ) from err
        finally:
            self.model.train(was_training)
        outputs = list(results.values())
        failed = [output for output in outputs if output.error is not None]
        if len(outputs) != len(rows) or failed:
            reason = failed[0].error if failed else "no result came back for them (transformers logged why)"
            raise RuntimeError(
                f"transformers continuous batching (generate_batch) sampled {len(outputs) - len(failed)} of "
                f"{len(rows)} rows: {reason}"
            )
        eos = set(self.eos_token_ids)
        completions = []
        for row, output in enumerate(outputs):
            kept, reason = cut_at_eos(list(output.generated_tokens)[: params.max_new_tokens], eos)
            text = self.tokenizer.decode(kept, skip_special_tokens=True)
            completions.append(Completion(row // num_samples, kept, text, reason))
        return completions
