"""Dataset rows -> prompts: checking the rows' format, and tokenizing them into one process's share of a generation.

Checks: the dataset's type and columns, and each prompt's format. A `datasets.Dataset` has every prompt checked
once when the trainer is built (only the prompt column is read; a large dataset by worker processes); an
IterableDataset's rows, and a dataset with a custom transform, are checked as they are drawn (prompt_sampler.py).
The errors name the row, the column, what is wrong and the fix.

Formats (as in TRL): *standard* rows have a string ``prompt`` (tokenized as-is); *conversational*
rows have a list of ``{"role", "content"}`` messages, rendered once with the tokenizer's chat
template and a generation prompt. Every other column travels with the prompt to the reward
functions. Rows with an ``image`` / ``images`` column go through the model's processor instead
(``multimodal_prompts.py``). Which rows make a generation is ``prompt_sampler.py``'s job.
"""

from __future__ import annotations

import contextlib
import copy
import os
import threading
import time
from typing import Any, Iterator, Optional

import datasets
from transformers.utils import logging

from grouprl.core.types import GroupLayout, PromptBatch

logger = logging.get_logger("grouprl")

PROMPT_COLUMN = "prompt"
IMAGE_COLUMNS = ("image", "images")  # a row's images: one image, or a list (TRL)
KEPT_WHEN_REMOVING = (PROMPT_COLUMN, *IMAGE_COLUMNS)


class DataRowError(ValueError):
    """A row of the dataset cannot be used (its prompt's format, its chat template, its length): the message names
    the row, the column and the fix. Found mid-run, it stops the run with the last completed step saved (loop.py)."""


TOKEN_CHECK_SECONDS = 30.0  # the up-front tokenizing of every prompt stops after this; the rest are checked as drawn
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


def check_every_prompt_fits(
    tokenize: "PromptTokenizer", dataset: Any, name: str = "train_dataset", budget_s: float = TOKEN_CHECK_SECONDS
) -> int:
    """Tokenize every prompt of a Dataset once before training, through the chat template, so a prompt the template
    fails on or one that leaves no room for max_completion_length is an error before any step rather than a stop
    mid-run. Stops after `budget_s` seconds (the rows left are checked as they are drawn); not for a stream, a custom
    transform or rows with images (their processor's work is the expensive part). Returns the rows checked."""
    if (
        not isinstance(dataset, datasets.Dataset)
        or PROMPT_COLUMN not in dataset.column_names
        or any(c in dataset.column_names for c in IMAGE_COLUMNS)
        or (dataset.format or {}).get("type") == "custom"
    ):
        return 0
    deadline, checked = time.monotonic() + budget_s, 0
    for start in range(0, len(dataset), CHECK_BATCH):
        for offset, prompt in enumerate(dataset[start : start + CHECK_BATCH][PROMPT_COLUMN]):
            if time.monotonic() > deadline:
                logger.info(
                    f"grouprl: {name}: {checked} of {len(dataset)} prompts tokenized and checked against the context "
                    f"in {budget_s:.0f} s; the others are checked as they are drawn (a bad one then stops the run "
                    "with its last step saved)."
                )
                return checked
            try:
                tokenize(prompt, start + offset)
            except DataRowError as err:
                raise DataRowError(f"{name}: {err}") from None
            checked += 1
    return checked


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
    raise DataRowError(
        f"Row {row}: {problem}. Fix row {row} of {dataset}, or drop such rows before training, e.g. "
        f"{variable} = {variable}.filter(lambda row: {keep})."
    )


def is_conversational(prompt: Any) -> bool:
    return isinstance(prompt, list)


class PromptTokenizer:
    """Tokenizes prompts once: plain text as-is, conversations through the chat template."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        max_context: Optional[int],
        max_completion_length: int,
        chat_template_kwargs: Optional[dict] = None,
        tools: Optional[list[dict]] = None,
    ):
        self.tokenizer = tokenizer
        self.max_context = max_context
        self.max_completion_length = max_completion_length
        self.chat_template_kwargs = chat_template_kwargs or {}
        # JSON schemas rendered into conversational prompts (None, not [], as TRL: templates treat them differently)
        self.tools = tools or None
        # asynchronous generation tokenizes in its producer thread too; a fast tokenizer is not to be entered twice
        self.lock = threading.Lock()

    def __call__(self, prompt: Any, row: int, tools: Optional[list[dict]] = None) -> list[int]:
        """Token ids of one prompt; `tools` (schemas) replaces the default tools for this prompt."""
        self.check(prompt, row)
        with self.lock, template_errors_name(row, prompt):
            ids = self._encode(prompt, tools)
        self.check_fits(ids, prompt, row)
        return ids

    def _encode(self, prompt: Any, tools: Optional[list[dict]]) -> list[int]:
        if is_conversational(prompt):
            continue_final = prompt[-1]["role"] == "assistant"
            ids = self.tokenizer.apply_chat_template(
                prompt,
                tokenize=True,
                add_generation_prompt=not continue_final,
                continue_final_message=continue_final,
                tools=tools or self.tools,
                **self.chat_template_kwargs,
            )
            if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
                ids = ids["input_ids"]
            return list(ids)
        return self.tokenizer(prompt, add_special_tokens=False)["input_ids"]

    def encode_messages(self, messages: Any, row: int, tools: Optional[list[dict]] = None) -> tuple[list[int], Any]:
        """Token ids of a prompt, and its processed images: None here (a tokenizer encodes no images; a processor
        does, `MultimodalPromptTokenizer`)."""
        return self(messages, row, tools), None

    def encode_row(self, row: dict, index: int) -> tuple[Any, list[int], Any | None]:
        """The prompt as reward functions see it, its token ids, and its processed images (None: text only)."""
        if row_images(row, index):
            raise DataRowError(
                f"Row {index} has images but the prompts are tokenized by a tokenizer; images need the model's "
                "processor (processing_class=AutoProcessor.from_pretrained(model), the default for vision-language "
                "models)."
            )
        return row[PROMPT_COLUMN], self(row[PROMPT_COLUMN], index), None

    def check(self, prompt: Any, row: int) -> None:
        check_prompt(prompt, row)
        if is_conversational(prompt) and getattr(self.tokenizer, "chat_template", None) is None:
            raise DataRowError(
                f"Row {row} is conversational but the tokenizer has no chat_template; set tokenizer.chat_template "
                "or use plain-string prompts."
            )

    def check_fits(self, ids: list[int], prompt: Any, row: int) -> None:
        if not ids:
            raise DataRowError(
                f"Row {row}: the prompt {prompt!r} tokenizes to no tokens; generation needs at least one prompt token. "
                "Fix this row of the dataset, or drop such rows before training (dataset.filter)."
            )
        context, completion, length = self.max_context, self.max_completion_length, len(ids)
        if context is None or length + completion <= context:
            return
        # grouprl does not truncate prompts (it has no max_prompt_length): a prompt must fit as it is
        where = f"Row {row}: the prompt is {length} tokens"
        limit = f"the model's maximum length of {context} tokens (max_position_embeddings)"
        if completion >= context:
            raise DataRowError(
                f"{where}, but max_completion_length={completion} alone fills {limit}, so no prompt fits before a "
                f"completion. Lower max_completion_length below {context}"
                + (f" (to at most {context - length} for this prompt)." if length < context else ".")
            )
        shorten = (
            f"Shorten this prompt to at most {context - completion} tokens (grouprl does not truncate prompts), or "
            "drop such rows before training (e.g. dataset.filter on the prompt's token count)"
        )
        if length >= context:
            raise DataRowError(f"{where}, at least {limit}, so no completion fits after it. {shorten}.")
        raise DataRowError(
            f"{where}; with max_completion_length={completion} it needs {length + completion} positions, more than "
            f"{limit}. {shorten}, or lower max_completion_length to at most {context - length}."
        )

    def prompt_text(self, prompt: Any, prompt_ids: list[int]) -> str:
        """What the model was shown: the string itself, or the rendered chat template."""
        return self.tokenizer.decode(prompt_ids, skip_special_tokens=False) if is_conversational(prompt) else prompt


@contextlib.contextmanager
def template_errors_name(row: int, prompt: Any) -> Iterator[None]:
    """A chat template that fails on a row (a jinja2 error, a template's own raise_exception) names the row, and the
    message the usual cause points at: one whose content is None."""
    try:
        yield
    except (DataRowError, KeyboardInterrupt):
        raise
    except Exception as err:  # noqa: BLE001 - jinja2's and the templates' errors have no common type
        if not is_conversational(prompt):
            raise
        empty = [i for i, m in enumerate(prompt) if isinstance(m, dict) and m.get("content") is None]
        cause = f" Message {empty[0]} of 'prompt' has content None." if empty else ""
        raise DataRowError(
            f"Row {row}: the chat template failed on its 'prompt' ({type(err).__name__}: {err}).{cause} Fix row {row} "
            "of the dataset, or drop such rows before training (dataset.filter)."
        ) from err


def row_images(row: dict, index: int) -> list[Any]:
    """A row's images (TRL): its `images` list, else `[image]`; [] when it has none (missing column or None)."""
    if "images" in row:
        images = row["images"]
        if images is None:
            return []
        if not isinstance(images, (list, tuple)):
            raise DataRowError(
                f"Row {index}: 'images' must be a list of images, got {type(images).__name__}; "
                "use the 'image' column for a single image."
            )
        return list(images)
    image = row.get("image")
    return [] if image is None else [image]


def local_prompt_batch(
    indices: list[int],
    rows: list[dict],
    layout: GroupLayout,
    *,
    tokenize: PromptTokenizer,
    remove_unused_columns: bool,
    default_prompt: Optional[list[dict]] = None,
) -> PromptBatch:
    """This process's share of one generation: the prompts of the groups `layout` puts rows of here.

    `rows` are the generation's prompts, one per group of the layout, in its order; each prompt here is
    sampled as many times as the layout gives this process rows of its group.
    `default_prompt`: the prompt of rows without one (environments own the data); None: every row needs one.
    """
    if len(rows) != layout.num_groups:
        raise ValueError(f"local_prompt_batch: {len(rows)} prompt rows for a layout of {layout.num_groups} groups.")
    prompts, prompt_ids, multimodal, dataset_indices, group_ids, counts = [], [], [], [], [], []
    given = True
    columns: dict[str, list[Any]] = {}
    for u, count in layout.pieces():
        index, row = indices[u], rows[u]
        if PROMPT_COLUMN not in row:
            if default_prompt is None:
                raise ValueError(
                    f"Row {index} has no 'prompt' (columns: {sorted(row)}); every row needs one unless an "
                    "environment_factory supplies the prompts."
                )
            given = False
            row = {**row, PROMPT_COLUMN: copy.deepcopy(default_prompt)}
        prompt, ids, images = tokenize.encode_row(row, index)
        prompts.append(prompt)
        prompt_ids.append(ids)
        multimodal.append(images)
        dataset_indices.append(index)
        group_ids.append(layout.group_ids[u])
        counts.append(count)
        for name, value in row.items():
            if name == PROMPT_COLUMN or (remove_unused_columns and name not in KEPT_WHEN_REMOVING):
                continue
            columns.setdefault(name, []).append(value)
    has_images = any(m is not None for m in multimodal)
    return PromptBatch(
        prompts,
        prompt_ids,
        columns,
        dataset_indices,
        group_ids,
        counts,
        multimodal if has_images else None,
        prompts_given=given,
        layout=layout,
    )
