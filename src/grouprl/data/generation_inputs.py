"""The generation batch as TRL's override points see it: a list of dataset rows.

TRL's dataloader hands ``training_step`` / ``_prepare_inputs`` / ``_generate_and_score_completions``
this process's slice of a generation batch: one dataset row (a dict) per completion to sample, each
prompt's row repeated for its completions, consecutively. grouprl draws prompts with its own
``PromptSampler``; ``GenerationInputs`` is that same list of rows, carrying the tokenized
``PromptBatch`` the rows came from so that generation does not tokenize them again (and, with asynchronous
generation, the ``Rollout`` a worker already sampled for them).

``TrainPromptBatches`` is what ``GRPOTrainer.get_train_dataloader()`` returns: the sequence of
those lists for one epoch, in TRL's layout (each generation batch once per micro-step that trains
on it, i.e. ``steps_per_generation x num_iterations`` times in a row).
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

from grouprl.core.group_layout import GroupLayout
from grouprl.core.types import PromptBatch, Rollout
from grouprl.data.dataset_checks import KEPT_WHEN_REMOVING
from grouprl.data.prompt_sampler import PromptSampler
from grouprl.data.prompts import local_prompt_batch


class GenerationInputs(list):
    """This process's generation batch: a list of dataset rows, one per completion (TRL's ``inputs``).

    ``prompt_batch`` is the tokenized form the rows were drawn with (None for a plain list, e.g. one
    built by hand). A ``GenerationInputs`` compares equal to the plain list of the same rows.
    """

    def __init__(self, rows: list[dict], prompt_batch: Optional[PromptBatch] = None):
        super().__init__(rows)
        self.prompt_batch = prompt_batch
        # asynchronous generation: the completions a worker already sampled for these rows (not checkpointed:
        # the micro-batches made from them are)
        self.sampled: Optional[Rollout] = None

    @classmethod
    def of(
        cls, prompts: PromptBatch, rows_by_index: dict[int, dict], remove_unused_columns: bool
    ) -> "GenerationInputs":
        """The rows of `prompts` (each repeated for its completions on this process), as TRL's dataloader yields them:
        with remove_unused_columns only the prompt and image columns are kept."""
        rows = []
        for index, count in zip(prompts.dataset_indices, prompts.num_samples):
            row = rows_by_index[index]
            if remove_unused_columns:
                row = {name: value for name, value in row.items() if name in KEPT_WHEN_REMOVING}
            rows.extend(row for _ in range(count))
        return cls(rows, prompts)

    def __reduce__(self) -> Any:  # pickled into checkpoints (the loop state) with its prompt batch
        return (GenerationInputs, (list(self), self.prompt_batch))


class TrainPromptBatches:
    """One epoch of training generation batches, as ``GenerationInputs``, in TRL's dataloader layout.

    Iterating walks the trainer's prompt order (``shuffle_dataset``, ``data_seed``) from the start of an epoch with a
    sampler of its own, so training's position does not move, and tokenizes the prompts as training does.
    ``len()`` is the number of micro-steps in an epoch (a dataset with a length only). ``loader`` and
    ``num_workers`` are those of the DataLoader that fetches training's rows.
    """

    def __init__(
        self,
        sampler: PromptSampler,
        *,
        tokenize: Any,
        num_generations: int,
        repeats: int,
        process_index: int,
        num_processes: int,
        remove_unused_columns: bool,
        default_prompt: Optional[list[dict]] = None,
    ):
        self.sampler = sampler
        self.tokenize = tokenize
        self.num_generations = num_generations
        self.repeats = repeats  # steps_per_generation x num_iterations
        self.process_index, self.num_processes = process_index, num_processes
        self.remove_unused_columns = remove_unused_columns
        self.default_prompt = default_prompt

    @property
    def loader(self) -> Any:
        return self.sampler.loader

    @property
    def num_workers(self) -> int:
        return self.sampler.loader.num_workers

    def __len__(self) -> int:
        generations = self.sampler.generations_per_epoch
        if generations is None:
            raise TypeError(
                "get_train_dataloader(): the train_dataset is an IterableDataset, which has no length; iterate it "
                "instead."
            )
        return generations * self.repeats

    def __iter__(self) -> Iterator[GenerationInputs]:
        # the same order as training's sampler, read in this process (the rows are the same with or without workers)
        sampler = PromptSampler(
            self.sampler.dataset,
            self.sampler.prompts_per_generation,
            shuffle=self.sampler.shuffle,
            seed=self.sampler.seed,
        )
        generations = sampler.generations_per_epoch
        number = 0
        while generations is None or number < generations:
            indices, rows = sampler.next_generation()
            if generations is None and sampler.state.epoch > 0:  # a stream: one pass
                return
            layout = GroupLayout.for_generation(
                number, len(rows), self.num_generations, self.num_processes, self.process_index
            )
            prompts = local_prompt_batch(
                indices,
                rows,
                layout,
                tokenize=self.tokenize,
                remove_unused_columns=self.remove_unused_columns,
                default_prompt=self.default_prompt,
            )
            inputs = GenerationInputs.of(prompts, dict(zip(indices, rows)), self.remove_unused_columns)
            for _ in range(self.repeats):
                yield inputs
            number += 1
