"""The OpenAI completion choices `grouprl serve` returns: sampled completions, and scored prompts (echo)."""

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from grouprl.core.types import Completion, SamplingParams
from grouprl.generation.sampling import process_logits
from grouprl.model.logprobs import position_ids_from_mask
from grouprl.model.multimodal import forward_inputs


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
    params: SamplingParams,
    images: list[Any] | None,
    *,
    suppress_token_ids: Sequence[int] = (),
    eos_token_ids: Sequence[int] = (),
) -> list[Completion]:
    """The completions with their tokens' logprobs under the distribution transformers `generate` sampled them from
    (it gives none): one forward per completion with its prompt's images, whose logits go through generate's
    processing in its order (repetition penalty over the tokens before each position, suppressed tokens, EOS held
    back until `min_new_tokens`, temperature, top-k, top-p, min-p: `sampling.process_logits`, as the fast engine's)."""
    named = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
    settings = {name: params.extra.get(name, getattr(params, name)) for name in named}  # extra overrides, as in hf.py
    held_back = {token: params.extra.get("min_new_tokens", 0) for token in eos_token_ids}
    held_back.update({token: None for token in suppress_token_ids})  # None: at every position
    was_training = model.training
    model.eval()
    try:
        return [
            replace(
                c,
                sampler_logprobs=processed_logprobs(
                    model,
                    prompts[c.prompt_index],
                    c.token_ids,
                    None if images is None else images[c.prompt_index],
                    held_back,
                    settings,
                )
                if c.token_ids
                else [],
            )
            for c in completions
        ]
    finally:
        model.train(was_training)


def processed_logprobs(
    model: torch.nn.Module, prompt: list[int], tokens: list[int], images: Any, held_back: dict, settings: dict
) -> list[float]:
    """Each token's logprob under the processed distribution it was drawn from, from one forward over prompt + tokens
    (with the prompt's images): tokens in `held_back` are impossible before the position it names (None: always),
    then `process_logits` with the tokens before each position as its repetition-penalty history."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt + tokens], device=device)
    mask = torch.ones_like(ids)
    inputs = {
        "position_ids": position_ids_from_mask(mask),
        **forward_inputs(model, [images], len(prompt), ids.shape[1], device),
    }
    logits = model(input_ids=ids, attention_mask=mask, **inputs).logits[0, len(prompt) - 1 : -1].float()
    for token, until in held_back.items():
        logits[:until, token] = -float("inf")
    steps = torch.arange(len(tokens), device=device)[:, None]
    before = torch.arange(ids.shape[1], device=device)[None] < len(prompt) + steps  # (T, L) each position's history
    processed = process_logits(logits, history=ids.expand(len(tokens), -1), history_mask=before, **settings)
    return processed.log_softmax(-1).gather(1, ids[0, len(prompt) :, None])[:, 0].tolist()


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
