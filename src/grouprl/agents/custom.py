"""`rollout_func`: a fully custom rollout (TRL §5).

``rollout_func(prompts, trainer) -> dict`` replaces generation. It receives this process's
prompts, one entry per completion to produce (each prompt repeated for its num_generations
samples, consecutively, as TRL hands them over), and returns per-completion lists:

* ``prompt_ids``: the token ids the completion was sampled from;
* ``completion_ids``: the sampled token ids (EOS kept);
* ``logprobs``: the sampler's logprob of each completion token, or None;
* optionally ``env_mask``: 1 / True where a token was produced by the model (trained on), 0 / False
  where it came from outside (environment feedback): it becomes the tool mask;
* any other key: a per-completion list forwarded to the reward functions as a keyword argument.

Inside it, ``trainer.generation_backend.generate(...)`` samples from the current policy and
``trainer.processing_class`` is the tokenizer (the processor, for a vision-language model).

Image prompts: each prompt comes with its image blocks holding the images (TRL's form), and ``encode_prompts``
encodes prompts as the trainer does, giving the ids and the processed images a backend's ``multimodal=`` takes.
Training matches each prompt's image inputs to the image tokens of its ids, so a completion of an image prompt
must come with the processor's ids of that prompt (each image expanded), or with their placeholder form (one
placeholder per image, as an engine that expands images itself takes them, vLLM's); anything else is named.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Optional

from grouprl.core.types import Completion, PromptBatch
from grouprl.model.multimodal import PromptImages, image_token_ids

REQUIRED_KEYS = ("prompt_ids", "completion_ids", "logprobs")


def rollout_output(rollout_func: Callable[..., Any], prompts: list, trainer: Any) -> dict[str, Any]:
    """`rollout_func(prompts, trainer)`, checked: a dict with REQUIRED_KEYS and one entry per prompt in each list."""
    output = rollout_func(prompts, trainer)
    name = getattr(rollout_func, "__name__", "rollout_func")
    if not isinstance(output, dict):
        raise TypeError(
            f"rollout_func {name} returned a {type(output).__name__}; it must return a dict with keys "
            f"{list(REQUIRED_KEYS)}."
        )
    missing = [key for key in REQUIRED_KEYS if key not in output]
    if missing:
        raise ValueError(
            f"rollout_func must return keys {missing} in its output dict (rollout_func {name} returned "
            f"{sorted(output)})."
        )
    for key, values in output.items():
        if key == "logprobs" and values is None:
            continue
        if not isinstance(values, (list, tuple)) or len(values) != len(prompts):
            got = f"{len(values)} entries" if isinstance(values, (list, tuple)) else type(values).__name__
            raise ValueError(
                f"rollout_func {name}: '{key}' must be a list with one entry per prompt it was given "
                f"({len(prompts)}), got {got}."
            )
    return output


def custom_rollouts(
    rollout_func: Callable[..., Any], prompts: PromptBatch, trainer: Any, *, tokenizer: Any, stop_ids: set[int]
) -> list[Completion]:
    rows = prompts.row_index()
    output = rollout_output(rollout_func, [copy.deepcopy(prompts.prompts[b]) for b in rows], trainer)
    name = getattr(rollout_func, "__name__", "rollout_func")
    extras = [key for key in output if key not in (*REQUIRED_KEYS, "env_mask")]
    images = prompts.multimodal or [None] * len(prompts)
    placeholders = set(image_token_ids(getattr(getattr(trainer, "model", None), "config", None))) if any(images) else ()
    completions = []
    for r, b in enumerate(rows):
        ids = [int(t) for t in output["completion_ids"][r]]
        prompt_ids = [int(t) for t in output["prompt_ids"][r]]
        if images[b] is not None:
            where = f"rollout_func {name}: completion {r} (row {prompts.dataset_indices[b]}, an image prompt)"
            prompt_ids = image_prompt_ids(prompt_ids, prompts.prompt_ids[b], images[b], where)
            if placeholders.intersection(ids):
                raise ValueError(
                    f"{where} has image tokens in its completion_ids; images inside a rollout_func's completion are "
                    "not built (their pixel inputs would not reach training). Keep images in the prompt."
                )
        logprobs = (
            None
            if output["logprobs"] is None or output["logprobs"][r] is None
            else [float(x) for x in output["logprobs"][r]]
        )
        mask = [bool(m) for m in output["env_mask"][r]] if "env_mask" in output else None
        for field_name, values in (("logprobs", logprobs), ("env_mask", mask)):
            if values is not None and len(values) != len(ids):
                raise ValueError(
                    f"rollout_func {name}: '{field_name}' of completion {r} has {len(values)} entries for {len(ids)} "
                    "completion tokens."
                )
        completions.append(
            Completion(
                prompt_index=b,
                token_ids=ids,
                text=tokenizer.decode(ids, skip_special_tokens=True),
                finish_reason="stop" if ids and ids[-1] in stop_ids else "length",
                sampler_logprobs=logprobs,
                tool_mask=mask,
                prompt_ids=prompt_ids,
                reward_kwargs={key: output[key][r] for key in extras},
            )
        )
    return completions


def image_prompt_ids(returned: list[int], expanded: list[int], images: PromptImages, where: str) -> list[int]:
    """The ids an image prompt's completion trains with: the processor's (`expanded`), given by a rollout_func either
    so or in their placeholder form."""
    if returned in (expanded, images.placeholder_ids):
        return expanded
    differs = next((i for i, (a, b) in enumerate(zip(returned, expanded)) if a != b), min(len(returned), len(expanded)))
    raise ValueError(
        f"{where}: its prompt_ids ({len(returned)} tokens) are not the processor's encoding of the prompt with its "
        f"{len(images.images)} image(s) ({len(expanded)} tokens, each image expanded; they first differ at token "
        f"{differs}), nor their placeholder form ({len(images.placeholder_ids)} tokens). Training matches the images' "
        "inputs to the image tokens of those ids: return the ids grouprl.agents.encode_prompts(trainer, prompts) "
        "gives (the trainer's chat template, chat_template_kwargs and tools)."
    )


def encode_prompts(trainer: Any, prompts: list) -> tuple[list[list[int]], Optional[list[Optional[PromptImages]]]]:
    """The prompts a rollout_func receives, encoded as the trainer encodes them: each one's token ids, and each
    one's processed images (None for one without) or None when none has images, as `generate(..., multimodal=)`
    takes them:

        ids, images = encode_prompts(trainer, prompts)
        options = {"multimodal": images} if images else {}
        completions = trainer.generation_backend.generate(ids, 1, params, **options)
    """
    tokenize = trainer.run.rollouts.tokenize
    encoded: list = []
    for row, prompt in enumerate(prompts):  # a prompt comes once per sample, consecutively: encoded once
        same = row > 0 and prompt == prompts[row - 1]
        encoded.append(encoded[-1] if same else tokenize.encode_messages(prompt, row))
    images = [processed for _, processed in encoded]
    return [ids for ids, _ in encoded], (images if any(m is not None for m in images) else None)
