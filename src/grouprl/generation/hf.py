"""Reference generation backend: `transformers` `generate` with sampling."""

from __future__ import annotations

from typing import Any

import torch

from ..types import Completion, SamplingParams
from .protocol import cut_at_eos, left_pad


class TransformersGenerator:
    """Samples with `model.generate` on the training model itself (no weight copy, no sync)."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, eos_token_ids: list[int], pad_token_id: int, cache_implementation: str | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.eos_token_ids = list(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.cache_implementation = cache_implementation

    def sync_weights(self, model: torch.nn.Module) -> None:
        self.model = model

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], num_samples: int, params: SamplingParams) -> list[Completion]:
        if not prompt_ids:
            return []
        device = next(self.model.parameters()).device
        input_ids, attention_mask = left_pad(prompt_ids, self.pad_token_id)
        width = input_ids.shape[1]
        kwargs: dict[str, Any] = dict(
            do_sample=True,
            max_new_tokens=params.max_new_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,  # 0 disables; None would fall back to generation_config's 50
            min_p=params.min_p,
            repetition_penalty=params.repetition_penalty,
            num_return_sequences=num_samples,
            eos_token_id=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            use_cache=True,
        )
        if self.cache_implementation is not None:
            kwargs["cache_implementation"] = self.cache_implementation
        kwargs.update(params.extra)
        was_training = self.model.training
        self.model.eval()  # generation needs the KV cache, which gradient checkpointing turns off in train mode
        try:
            output = self.model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), **kwargs)
        finally:
            self.model.train(was_training)
        sequences = output.sequences if hasattr(output, "sequences") else output
        new_tokens = sequences[:, width:].tolist()
        if len(new_tokens) != len(prompt_ids) * num_samples:
            raise RuntimeError(
                f"transformers generate returned {len(new_tokens)} sequences for {len(prompt_ids)} prompts x {num_samples} samples; "
                "check generation_kwargs (num_return_sequences / num_beams)."
            )
        eos = set(self.eos_token_ids)
        completions = []
        for row, tokens in enumerate(new_tokens):
            kept, reason = cut_at_eos(tokens, eos)
            if reason == "length":  # generate pads finished rows; a row without EOS has no padding to strip
                kept = kept[: params.max_new_tokens]
            text = self.tokenizer.decode(kept, skip_special_tokens=True)
            completions.append(Completion(prompt_index=row // num_samples, token_ids=kept, text=text, finish_reason=reason))
        return completions
