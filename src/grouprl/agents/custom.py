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
``trainer.processing_class`` is the tokenizer.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

from grouprl.core.types import Completion, PromptBatch

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
    completions = []
    for r, b in enumerate(rows):
        ids = [int(t) for t in output["completion_ids"][r]]
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
                prompt_ids=[int(t) for t in output["prompt_ids"][r]],
                reward_kwargs={key: output[key][r] for key in extras},
            )
        )
    return completions
