"""Every dataset row checked before training: the dataset's type and columns, and each prompt's format.

A `datasets.Dataset` has every prompt checked once when the trainer is built (only the prompt column is read;
a large dataset by worker processes); an IterableDataset's rows, and a dataset with a custom transform, are
checked as they are drawn (prompt_sampler.py). The errors name the row, the column, what is wrong and the fix.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import datasets

PROMPT_COLUMN = "prompt"
KEPT_WHEN_REMOVING = ("prompt", "image", "images")
LARGE_DATASET = 100_000  # rows: a larger dataset's prompts are checked by worker processes (datasets' map)
CHECK_BATCH = 10_000  # rows read at a time by the up-front check
_checked_fingerprints: set[str] = set()  # datasets whose every prompt passed: not read again (evaluate() re-checks)


def check_dataset(dataset: Any, name: str = "train_dataset", *, prompt_required: bool = True) -> None:
    """Fail early, with the field named, on a dataset the trainer cannot use.

    `prompt_required=False` (an environment_factory is given): rows may lack a prompt, as in TRL; each
    such row's prompt is then an empty user message that the environment's reset() completes.
    """
    if dataset is None:
        raise ValueError(
            f"`{name}` is required unless an `environment_factory` is provided (its reset() then supplies the "
            "prompts): pass a datasets.Dataset or IterableDataset with a 'prompt' column, e.g. "
            "datasets.Dataset.from_list([{'prompt': ...}, ...])."
        )
    if not isinstance(dataset, (datasets.Dataset, datasets.IterableDataset)):
        raise TypeError(
            f"{name} must be a datasets.Dataset or datasets.IterableDataset, got {type(dataset).__name__}. "
            "Build one with datasets.Dataset.from_list([{'prompt': ...}, ...])."
        )
    columns = dataset.column_names
    if prompt_required and columns is not None and PROMPT_COLUMN not in columns:
        raise ValueError(
            f"{name} has no 'prompt' column (columns: {columns}). Rename the column that holds the prompts, "
            "e.g. dataset.rename_column('question', 'prompt')."
        )
    if isinstance(dataset, datasets.Dataset):
        if len(dataset) == 0:
            raise ValueError(f"{name} is empty: it has no rows to sample prompts from.")
        if PROMPT_COLUMN in dataset.column_names:
            check_every_prompt(dataset, name)
    # an IterableDataset's rows are checked as they are drawn (PromptSampler, PromptTokenizer.check)


def check_every_prompt(dataset: datasets.Dataset, name: str) -> None:
    """Every row's prompt, before training: only the 'prompt' column is read (images and the other columns are not
    decoded), by worker processes (datasets' map) for a dataset of more than LARGE_DATASET rows. A dataset that
    passed is not read again. A dataset with a transform (set_transform / with_transform) is checked row by row as
    its rows are drawn instead: the transform decides what a row holds."""
    fingerprint = getattr(dataset, "_fingerprint", None)
    if fingerprint in _checked_fingerprints or (dataset.format or {}).get("type") == "custom":
        return
    prompts = dataset.select_columns([PROMPT_COLUMN])
    workers = min(os.cpu_count() or 1, 8)
    if len(prompts) > LARGE_DATASET and workers > 1:
        bad = _first_bad_row_parallel(prompts, name, workers)
    else:
        bad = _first_bad_row(prompts)
    if bad is not None:
        check_prompt(prompts[bad][PROMPT_COLUMN], bad, name)  # raises, naming the row
    if fingerprint is not None:
        _checked_fingerprints.add(fingerprint)


def _first_bad_row(prompts: datasets.Dataset) -> Optional[int]:
    for start in range(0, len(prompts), CHECK_BATCH):
        for offset, prompt in enumerate(prompts[start : start + CHECK_BATCH][PROMPT_COLUMN]):
            if prompt_problem(prompt) is not None:
                return start + offset
    return None


def _bad_rows_of_batch(batch: dict[str, list], indices: list[int]) -> dict[str, list[int]]:
    """datasets' map function: the batch's first bad row, if any (module-level: worker processes receive it)."""
    bad = [index for index, prompt in zip(indices, batch[PROMPT_COLUMN]) if prompt_problem(prompt) is not None]
    return {"bad_row": bad[:1]}


def _first_bad_row_parallel(prompts: datasets.Dataset, name: str, workers: int) -> Optional[int]:
    found = prompts.map(
        _bad_rows_of_batch,
        batched=True,
        batch_size=CHECK_BATCH,
        with_indices=True,
        remove_columns=[PROMPT_COLUMN],
        num_proc=workers,
        features=datasets.Features({"bad_row": datasets.Value("int64")}),  # the same (empty or not) in every worker
        keep_in_memory=True,  # no cache files: the result is a few row numbers
        load_from_cache_file=False,
        desc=f"Checking the prompts of {name}",
    )
    rows = list(found["bad_row"]) if "bad_row" in found.column_names else []
    return min(rows) if rows else None


def prompt_problem(prompt: Any) -> Optional[tuple[str, str]]:
    """What is wrong with a prompt and a `dataset.filter` condition that drops such rows; None for a usable prompt.

    A prompt is a non-empty string or a non-empty list of {'role': str, 'content': ...} messages.
    """
    if isinstance(prompt, str):
        if prompt:
            return None
        return (
            "'prompt' is an empty string, which tokenizes to no tokens; generation needs at least one prompt token",
            "len(row['prompt']) > 0",
        )
    if not isinstance(prompt, list) or not prompt:
        return (
            "'prompt' must be a string or a non-empty list of messages [{'role': ..., 'content': ...}], "
            f"got {type(prompt).__name__}: {repr(prompt)[:80]}",
            "row['prompt'] is not None"
            if prompt is None
            else "isinstance(row['prompt'], (str, list)) and len(row['prompt']) > 0",
        )
    for i, message in enumerate(prompt):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            return (
                f"message {i} of 'prompt' must be a dict with 'role' and 'content' keys, got {str(message)[:80]!r}",
                "all('role' in m and 'content' in m for m in row['prompt'])",
            )
        if not isinstance(message["role"], str):
            return (
                f"message {i} of 'prompt' has role {message['role']!r}; roles are strings like 'user'",
                "all(isinstance(m['role'], str) for m in row['prompt'])",
            )
    return None


def check_prompt(prompt: Any, row: int, dataset: str = "the dataset") -> None:
    """Raise, naming the row, the column, what is wrong and what to do, unless `prompt` is usable (prompt_problem)."""
    found = prompt_problem(prompt)
    if found is None:
        return
    problem, keep = found
    variable = dataset if dataset.isidentifier() else "dataset"
    raise ValueError(
        f"Row {row}: {problem}. Fix row {row} of {dataset}, or drop such rows before training, e.g. "
        f"{variable} = {variable}.filter(lambda row: {keep})."
    )
