"""The OpenAI completion choices `grouprl serve` returns: sampled completions, and scored prompts (echo)."""

from dataclasses import replace
from typing import Any

import torch

from grouprl.core.types import Completion
from grouprl.generation.protocol import left_pad
from grouprl.model.logprobs import completion_logprobs, position_ids_from_mask


def token_prompts(prompt: Any, tokenizer: Any) -> list[list[int]]:
    """A request's prompt (token ids or text, one or a list) as lists of token ids; 400 if one is empty."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if prompt and isinstance(prompt[0], int):
        prompt = [prompt]
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] if isinstance(p, str) else list(p) for p in prompt]
    if not prompts or any(len(p) == 0 for p in prompts):
        from fastapi import HTTPException

        raise HTTPException(status_code=400, detail="every prompt needs at least one token.")
    return prompts


def sample_choice(index: int, completion: Any, prompt_ids: list[int], with_logprobs: bool) -> dict:
    """A sampled completion as a choice, with vLLM's token_ids / prompt_token_ids extensions."""
    logprobs = None
    if with_logprobs:
        logprobs = {
            "tokens": [f"token_id:{t}" for t in completion.token_ids],
            "token_logprobs": completion.sampler_logprobs,
            "top_logprobs": None,
            "text_offset": [],
        }
    return {
        "index": index,
        "text": completion.text,
        "logprobs": logprobs,
        "finish_reason": completion.finish_reason,
        "token_ids": completion.token_ids,
        "prompt_token_ids": prompt_ids,
    }


@torch.no_grad()
def with_logprobs(
    model: torch.nn.Module,
    prompts: list[list[int]],
    completions: list[Completion],
    temperature: float,
    images: list[Any] | None,
) -> list[Completion]:
    """The completions with their tokens' logprobs under the temperature-scaled model (a forward with each prompt's
    images), for a sampler that gives none (transformers generate). The sampling filters (top-k, top-p, min-p) are
    not applied to these, unlike the fast engine's."""
    rows = [c for c in completions if c.token_ids]
    if not rows:
        return completions
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = left_pad([prompts[c.prompt_index] for c in rows], 0)
    completion_ids, completion_mask = left_pad([c.token_ids[::-1] for c in rows], 0)  # reversed: right-padded
    completion_ids, completion_mask = completion_ids.flip(1), completion_mask.flip(1)
    was_training = model.training
    model.eval()
    try:
        scored = completion_logprobs(
            model,
            prompt_ids.to(device),
            prompt_mask.bool().to(device),
            completion_ids.to(device),
            completion_mask.bool().to(device),
            temperature=temperature,
            with_entropy=False,
            multimodal=None if images is None else [images[c.prompt_index] for c in rows],
        ).logprobs.tolist()
    finally:
        model.train(was_training)
    logprobs = {id(c): values[: len(c.token_ids)] for c, values in zip(rows, scored)}
    return [replace(c, sampler_logprobs=logprobs.get(id(c), [])) for c in completions]


@torch.no_grad()
def score_choice(index: int, prompt_ids: list[int], model: torch.nn.Module, tokenizer: Any, temperature: float) -> dict:
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids], device=device)
    mask = torch.ones_like(ids)
    was_training = model.training
    model.eval()
    try:
        logits = (
            model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits[0, :-1].float()
        )
    finally:
        model.train(was_training)
    logprobs = torch.log_softmax(logits / temperature, dim=-1).gather(1, ids[0, 1:, None]).squeeze(1)
    return {
        "index": index,
        "text": tokenizer.decode(prompt_ids),
        "finish_reason": "length",
        "token_ids": [],
        "prompt_token_ids": prompt_ids,
        "logprobs": {
            "tokens": [f"token_id:{t}" for t in prompt_ids],
            "token_logprobs": [None, *logprobs.tolist()],
            "top_logprobs": None,
            "text_offset": [],
        },
    }
