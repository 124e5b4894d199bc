"""The eval datasets: checked when an evaluation will use them, picked by name, read in dataset order."""

from __future__ import annotations

import weakref
from typing import Any

from torch.utils.data import DataLoader

from grouprl.config.grpo_config import GRPOConfig
from grouprl.data.prompt_sampler import RowReaders, sequential_loader
from grouprl.data.prompts import check_dataset


def check_eval_setup(
    config: GRPOConfig, eval_dataset: Any, num_processes: int, *, prompt_required: bool = True
) -> None:
    """Check an eval setup that will be used: by the trainer when eval_strategy != "no" (before any
    model is loaded), and by every evaluate() call. As in TRL, an eval_dataset that is only stored
    is not checked at construction."""
    if config.eval_strategy != "no" and eval_dataset is None:
        strategy = getattr(config.eval_strategy, "value", config.eval_strategy)
        raise ValueError(
            f"GRPOConfig.eval_strategy='{strategy}' needs an eval_dataset; pass one or set eval_strategy='no'."
        )
    if eval_dataset is None:
        return
    named = eval_dataset if isinstance(eval_dataset, dict) else {"": eval_dataset}
    for name, dataset in named.items():
        check_dataset(dataset, f"eval_dataset[{name!r}]" if name else "eval_dataset", prompt_required=prompt_required)
    size = config.num_generations_eval or config.num_generations
    if size < 1:
        raise ValueError(f"GRPOConfig.num_generations_eval={config.num_generations_eval} must be >= 1.")
    batch = config.per_device_eval_batch_size * num_processes
    if batch % size != 0:
        fits = [b for b in range(1, 4 * size + 1) if (b * num_processes) % size == 0][:4]
        raise ValueError(
            f"The eval batch (per_device_eval_batch_size={config.per_device_eval_batch_size} x {num_processes} "
            f"processes = {batch} completions) must be divisible by num_generations_eval={size} (default: "
            f"num_generations), so each prompt's completions are scored together. Use "
            f"per_device_eval_batch_size in {fits} or change num_generations_eval."
        )


def pick_eval_dataset(default: Any, chosen: Any) -> Any:
    """The eval dataset meant: `chosen` (a dataset, or a key of a dict default), else the trainer's own."""
    if isinstance(chosen, str):
        if not isinstance(default, dict) or chosen not in default:
            raise ValueError(
                f"eval_dataset={chosen!r} names no eval dataset; the trainer's are "
                f"{sorted(default) if isinstance(default, dict) else 'not a dict'}."
            )
        return default[chosen]
    dataset = default if chosen is None else chosen
    if dataset is None:
        raise ValueError("No eval_dataset: pass one to GRPOTrainer(eval_dataset=...) or to this call.")
    if isinstance(dataset, dict):
        raise ValueError(
            f"eval_dataset is a dict ({sorted(dataset)}); name the one meant, e.g. "
            f"get_eval_dataloader({next(iter(dataset))!r})."
        )
    return dataset


# id(config) -> {(eval dataset's id, prompts per batch, readers): loader}, for persistent workers: kept while the
# run's config lives (a loader holds its dataset, so the id stays that dataset's; a GRPOConfig is not hashable)
_persistent_loaders: dict[int, dict[tuple, DataLoader]] = {}


def _persistent_loaders_of(config: GRPOConfig) -> dict[tuple, DataLoader]:
    if id(config) not in _persistent_loaders:
        _persistent_loaders[id(config)] = {}
        weakref.finalize(config, _persistent_loaders.pop, id(config), None)
    return _persistent_loaders[id(config)]


def eval_loader(dataset: Any, config: GRPOConfig, num_processes: int) -> DataLoader:
    """The eval prompts' rows in dataset order, one eval batch of prompts at a time, as lists of (index, row).

    Map-style data is read by dataloader_num_workers worker processes; a stream in this process (prompt_sampler.py).
    With dataloader_persistent_workers every evaluation of a dataset reads it through one loader, whose workers
    stay up between evaluations (transformers keeps its eval loaders so, too).
    """
    prompts_per_batch = (
        config.per_device_eval_batch_size * num_processes // (config.num_generations_eval or config.num_generations)
    )
    readers = RowReaders.of(config, dataset)
    if not readers.persistent:
        return sequential_loader(dataset, prompts_per_batch, readers)
    loaders = _persistent_loaders_of(config)
    key = (id(dataset), prompts_per_batch, readers)
    if key not in loaders:
        loaders[key] = sequential_loader(dataset, prompts_per_batch, readers)
    return loaders[key]
