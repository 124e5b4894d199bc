"""The OpenAI completion choices `grouprl serve` returns: sampled completions, and scored prompts (echo)."""

from typing import Any

import torch

from grouprl.model.logprobs import position_ids_from_mask


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
