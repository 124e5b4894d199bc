"""Cross-process helpers. Every process holds the same number of rows of a generation batch, in
process order, so concatenating along dim 0 restores the global group-major order."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

import torch
from accelerate import Accelerator, PartialState

from .types import PromptBatch, Rollout


def gather_rows(accelerator: Accelerator, tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate equally-sized per-process tensors along dim 0 (no-op on one process)."""
    if accelerator.num_processes == 1:
        return tensor
    return accelerator.gather(tensor.to(accelerator.device)).cpu()


def global_sum(accelerator: Accelerator, value: float) -> float:
    if accelerator.num_processes == 1:
        return float(value)
    total = accelerator.reduce(torch.tensor([float(value)], device=accelerator.device), reduction="sum")
    return float(total.item())


def global_mean(accelerator: Accelerator, value: float) -> float:
    return global_sum(accelerator, value) / accelerator.num_processes


def local_rows(accelerator: Accelerator, rows_per_process: int) -> slice:
    """This process's slice of a gathered (global) batch."""
    start = accelerator.process_index * rows_per_process
    return slice(start, start + rows_per_process)


def gather_varlen(accelerator: Accelerator, values: torch.Tensor) -> torch.Tensor:
    """Concatenate 1-D tensors of different lengths from every process (padding removed).

    Values must be >= 0 (entropies): the padding is a negative sentinel that is filtered out.
    """
    if accelerator.num_processes == 1:
        return values
    padded = accelerator.pad_across_processes(values.float(), dim=0, pad_index=-1.0)
    gathered = accelerator.gather(padded)
    return gathered[gathered >= 0]


def gather_objects(value: Any) -> list[Any]:
    """[value of process 0, value of process 1, ...] on every process (pickled; for small Python objects)."""
    state = PartialState()
    if state.num_processes == 1:
        return [value]
    gathered = [None] * state.num_processes
    torch.distributed.all_gather_object(gathered, value)
    return gathered


def broadcast_from_main(value: Any) -> Any:
    """The main process's `value` on every process (pickled; other processes pass None)."""
    state = PartialState()
    if state.num_processes == 1:
        return value
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def run_on_main(fn: Callable[[], Any]) -> Any:
    """Run `fn` on the main process only and hand its result to every process.

    An exception on the main process is re-raised on every process (as RuntimeError on the
    others), so a failure there (an unreachable server, say) stops the whole job instead of
    leaving the other processes waiting forever in the next collective.
    """
    state = PartialState()
    result, error = None, None
    if state.is_main_process:
        try:
            result = fn()
        except Exception as err:  # handed to the other processes, then raised here too
            error = err
    if state.num_processes > 1:
        result, message = broadcast_from_main((result, None if error is None else f"{type(error).__name__}: {error}"))
        if message is not None and error is None:
            raise RuntimeError(f"the main process failed: {message}")
    if error is not None:
        raise error
    return result


def whole_groups(rollout: Rollout) -> Rollout:
    """The global generation batch on every process: each process's slice gathered, cut groups joined."""
    parts = gather_objects(rollout)
    if len(parts) == 1:
        return rollout
    prompts = PromptBatch([], [], {name: [] for name in rollout.prompts.columns}, [], [], [])
    with_images = any(part.prompts.multimodal is not None for part in parts)
    prompts.multimodal = [] if with_images else None
    completions = []
    for part in parts:
        rows_of = [[] for _ in range(len(part.prompts))]
        for completion, b in zip(part.completions, part.row_prompt):
            rows_of[b].append(completion)
        for b, rows in enumerate(rows_of):
            if not (prompts.group_ids and prompts.group_ids[-1] == part.prompts.group_ids[b]):  # a new group
                for name in ("prompts", "prompt_ids", "dataset_indices", "group_ids"):
                    getattr(prompts, name).append(getattr(part.prompts, name)[b])
                for name, values in part.prompts.columns.items():
                    prompts.columns[name].append(values[b])
                prompts.num_samples.append(0)
                if with_images:
                    prompts.multimodal.append(None if part.prompts.multimodal is None else part.prompts.multimodal[b])
            prompts.num_samples[-1] += len(rows)  # the tail of a group cut by the process boundary joins its head
            completions.extend(replace(c, prompt_index=len(prompts) - 1) for c in rows)
    return Rollout(prompts, completions)


def own_rows(rollout: Rollout, advantages: torch.Tensor) -> tuple[Rollout, torch.Tensor]:
    """This process's contiguous share of a global rollout's rows (groups may be cut), with their advantages."""
    state = PartialState()
    if state.num_processes == 1:
        return rollout, advantages
    n = len(rollout.completions)
    start, end = n * state.process_index // state.num_processes, n * (state.process_index + 1) // state.num_processes
    row_prompt = rollout.row_prompt[start:end]
    chosen = list(dict.fromkeys(row_prompt))  # prompts with rows here, in order
    prompts = rollout.select_prompts(chosen).prompts
    prompts.num_samples = [row_prompt.count(b) for b in chosen]
    completions = [replace(c, prompt_index=chosen.index(b)) for c, b in zip(rollout.completions[start:end], row_prompt)]
    return Rollout(prompts, completions), advantages[start:end]
