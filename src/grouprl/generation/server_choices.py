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
    min_new_tokens = params.extra.get("min_new_tokens", 0)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        scored = []
        for c in completions:
            prompt = prompts[c.prompt_index]
            if not c.token_ids:
                scored.append(c)
                continue
            ids = torch.tensor([prompt + c.token_ids], device=device)
            mask = torch.ones_like(ids)
            inputs = {"position_ids": position_ids_from_mask(mask)}
            row_images = [None if images is None else images[c.prompt_index]]
            inputs.update(forward_inputs(model, row_images, len(prompt), ids.shape[1], device))
            steps = len(c.token_ids)
            logits = model(input_ids=ids, attention_mask=mask, **inputs).logits[0, len(prompt) - 1 : -1].float()
            if suppress_token_ids:
                logits[:, list(suppress_token_ids)] = -float("inf")
            if min_new_tokens and eos_token_ids:
                logits[: min(min_new_tokens, steps), list(eos_token_ids)] = -float("inf")
            # position t's history: the prompt and the t tokens sampled before it
            visible = (
                torch.arange(ids.shape[1], device=device)[None]
                < len(prompt) + torch.arange(steps, device=device)[:, None]
            )
            processed = process_logits(logits, history=ids.expand(steps, -1), history_mask=visible, **settings)
            tokens = ids[0, len(prompt) :, None]
            scored.append(replace(c, sampler_logprobs=processed.log_softmax(-1).gather(1, tokens)[:, 0].tolist()))
    finally:
        model.train(was_training)
    return scored


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
