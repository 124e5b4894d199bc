"""Reference generation backend: `transformers` `generate` with sampling.

It also serves vision-language models: prompts with images come with their processed images
(`multimodal=`), and image placeholder tokens are never sampled (TRL suppresses them too: a
sampled placeholder has no image features behind it, and the training forward would fail).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from grouprl.core.types import Completion, SamplingParams
from grouprl.generation.protocol import cut_at_eos, left_pad
from grouprl.model.adapters import base_model
from grouprl.model.multimodal import collate


class TransformersGenerator:
    """Samples with `model.generate` on the training model itself (no weight copy, no sync).

    `synced_gpus=True` samples from a model whose weights are sharded over the processes (FSDP, DeepSpeed ZeRO-3,
    ds3_gather_for_generation=False): each forward gathers a layer's weights from every process, so generate runs
    the processes in step (transformers' synced_gpus: a process whose rows are done runs forwards until every
    process is) and the backend is `lockstep` (protocol.GenerationBackend): one call per generation on every process,
    a process without rows sampling one throw-away row.
    """

    needs_importance_correction = False  # samples come from the trained weights themselves

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        eos_token_ids: list[int],
        pad_token_id: int,
        cache_implementation: str | None = None,
        suppress_token_ids: Sequence[int] = (),
        synced_gpus: bool = False,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.eos_token_ids = list(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.cache_implementation = cache_implementation
        self.suppress_token_ids = list(suppress_token_ids)
        self.lockstep = synced_gpus

    def sync_weights(self, model: torch.nn.Module) -> None:
        self.model = model

    @torch.no_grad()
    def generate(
        self, prompt_ids: list[list[int]], num_samples: int, params: SamplingParams, multimodal: list[Any] | None = None
    ) -> list[Completion]:
        """`multimodal`: (prompts,) each prompt's `multimodal.PromptImages` or None."""
        if not prompt_ids and not self.lockstep:
            return []
        if params.extra.get("num_return_sequences", 1) != 1:
            raise ValueError(
                f"generation_kwargs num_return_sequences={params.extra['num_return_sequences']}: GRPO samples "
                "num_generations completions per prompt itself; set GRPOConfig.num_generations instead."
            )
        device = next(self.model.parameters()).device
        # One row per sample, as TRL: generate's num_return_sequences would have to stay <= num_beams under
        # beam search (generation_kwargs), and it repeats image tensors per image, which pairs some models'
        # multi-image prompts with the wrong images. Sampling is unchanged: generate repeats rows the same way.
        prompt_ids = [ids for ids in prompt_ids for _ in range(num_samples)]
        if multimodal is not None:
            multimodal = [m for m in multimodal for _ in range(num_samples)]
        # no rows here, but the other processes' forwards need this one's shards: one row, sampled and dropped
        rows = prompt_ids or [[self.pad_token_id]]
        input_ids, attention_mask = left_pad(rows, self.pad_token_id)
        width = input_ids.shape[1]
        images = (
            {k: v.to(device) for k, v in collate(multimodal, width, width).items()} if multimodal is not None else {}
        )
        kwargs: dict[str, Any] = dict(
            do_sample=True,
            max_new_tokens=params.max_new_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,  # 0 disables; None would fall back to generation_config's 50
            min_p=params.min_p,
            repetition_penalty=params.repetition_penalty,
            eos_token_id=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            use_cache=True,
        )
        if self.cache_implementation is not None:
            kwargs["cache_implementation"] = self.cache_implementation
        if self.suppress_token_ids:
            kwargs["suppress_tokens"] = self.suppress_token_ids
        if self.lockstep:
            kwargs["synced_gpus"] = True
        kwargs.update(params.extra)
        was_training = self.model.training
        self.model.eval()  # generation needs the KV cache, which gradient checkpointing turns off in train mode
        try:
            with forwards_through_fsdp_root(self.model) if self.lockstep else nullcontext():
                output = self.model.generate(
                    input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), **images, **kwargs
                )
        finally:
            self.model.train(was_training)
        sequences = output.sequences if hasattr(output, "sequences") else output
        new_tokens = sequences[:, width:].tolist() if prompt_ids else []
        if len(new_tokens) != len(prompt_ids):
            raise RuntimeError(
                f"model.generate returned {len(new_tokens)} sequences for {len(prompt_ids)} rows (prompts x samples); "
                "it must return one per input row (check generation_kwargs, or an overridden generate)."
            )
        eos = set(self.eos_token_ids)
        completions = []
        for row, tokens in enumerate(new_tokens):
            kept, reason = cut_at_eos(tokens, eos)
            if reason == "length":  # generate pads finished rows; a row without EOS has no padding to strip
                kept = kept[: params.max_new_tokens]
            text = self.tokenizer.decode(kept, skip_special_tokens=True)
            completions.append(
                Completion(prompt_index=row // num_samples, token_ids=kept, text=text, finish_reason=reason)
            )
        return completions


@contextmanager
def forwards_through_fsdp_root(model: torch.nn.Module) -> Iterator[None]:
    """FSDP2 expects every forward to enter through the outermost sharded module (the root): its forward gathers the
    weights the root holds itself and closes the pass's bookkeeping. A PEFT model's generate calls the inner model's
    forward and never the root's (PeftModel), which leaves FSDP's state half-done and the processes' next backward
    gathering in different orders; so while sampling, the inner model's forward is routed through the root."""
    from torch.distributed.fsdp import FSDPModule

    inner = base_model(model)
    if not isinstance(model, FSDPModule) or inner is model:
        yield
        return
    forward, entered = inner.forward, False

    def through_root(*args: Any, **kwargs: Any) -> Any:
        nonlocal entered
        if entered:  # the root's forward reached the inner model
            return forward(*args, **kwargs)
        entered = True
        try:
            return model(*args, **kwargs)
        finally:
            entered = False

    inner.forward = through_root
    try:
        yield
    finally:
        del inner.forward  # the class's forward again
