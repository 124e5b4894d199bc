"""Which prompt rows come next, and fetching them: a seeded, resumable order of rows, one generation at a time
(TRL's RepeatSampler, §2.13), the generation batches it makes as TRL's override points see them, and the torch
DataLoaders that fetch the rows.

Prompts are shuffled with a seeded generator (a new permutation each epoch) and cut into
generations of U = generation_batch_size / G unique prompts (the incomplete last one is dropped);
each prompt is later repeated G times (`prompts.local_prompt_batch`). Processes take contiguous
slices of the G*U completions, so a group may straddle two processes; its global group id keeps it
whole for the advantages. The sampler position is two integers, saved in checkpoints.

TRL's dataloader hands ``training_step`` / ``_prepare_inputs`` / ``_generate_and_score_completions``
this process's slice of a generation batch: one dataset row (a dict) per completion to sample, each
prompt's row repeated for its completions, consecutively. ``GenerationInputs`` is that same list of rows,
carrying the tokenized ``PromptBatch`` the rows came from so that generation does not tokenize them again
(and, with asynchronous generation, the ``Rollout`` a worker already sampled for them).
``TrainPromptBatches`` is what ``GRPOTrainer.get_train_dataloader()`` returns: the sequence of
those lists for one epoch, in TRL's layout (each generation batch once per micro-step that trains
on it, i.e. ``steps_per_generation x num_iterations`` times in a row).

Rows are fetched through torch DataLoaders, so ``dataloader_num_workers`` processes can read them (``RowReaders``:
with ``dataloader_prefetch_factor``, ``dataloader_persistent_workers`` and ``dataloader_multiprocessing_context``
as transformers passes them to its loaders). grouprl
decides which rows come next itself (PromptSampler; evaluation: dataset order); a loader only fetches those
rows, in that order, in worker processes and ahead of time when asked to. Collation is the identity: rows stay
Python dicts and are tokenized in the main process, as TRL's GRPO collator leaves them too (so pinning memory
has nothing to pin). A stream (``datasets.IterableDataset``) is read in-process: workers would each read a
shard of it and interleave them, which breaks the order (TRL forces 0 workers as well). Every loader gets a
private generator: a DataLoader iterator otherwise draws its workers' base seed from the global torch RNG,
which would shift training's sampling by whether, and when, a loader was (re)started.
"""

from __future__ import annotations

import multiprocessing
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional

import datasets
import torch
from torch.utils.data import DataLoader

from grouprl.core.types import GroupLayout, PromptBatch, Rollout
from grouprl.data.prompts import KEPT_WHEN_REMOVING, PROMPT_COLUMN, check_prompt, local_prompt_batch


@dataclass
class SamplerState:
    epoch: int = 0
    position: int = 0  # generations already drawn in this epoch (map-style) / rows consumed (iterable)


class PromptSampler:
    """Seeded, resumable order of prompt rows, one generation (U unique prompts) at a time.

    The rows are fetched by `self.loader`, a torch DataLoader (`batches_loader`): with `readers`' worker processes
    (map-style data only) they read the next generations' rows ahead of time, in the same order. The order and the
    resumable position stay the sampler's own.
    """

    def __init__(
        self,
        dataset: Any,
        prompts_per_generation: int,
        *,
        shuffle: bool,
        seed: int,
        readers: Optional[RowReaders] = None,
    ):
        self.dataset = dataset
        self.prompts_per_generation = prompts_per_generation
        self.shuffle = shuffle
        self.seed = seed
        self.state = SamplerState()
        self.iterable = isinstance(dataset, datasets.IterableDataset)
        self._stream: Optional[Iterator[Any]] = None  # the loader's iterator over the rest of this epoch
        if not self.iterable and len(dataset) < prompts_per_generation:
            raise ValueError(
                f"train_dataset has {len(dataset)} prompts but one generation needs {prompts_per_generation} "
                "unique prompts (generation_batch_size / num_generations). Use a larger dataset or a smaller "
                "per_device_train_batch_size / steps_per_generation."
            )
        if self.iterable:
            self.loader = stream_loader(self._open_stream)
        else:
            self.loader = batches_loader(dataset, RestOfEpoch(self), readers or RowReaders())

    @property
    def generations_per_epoch(self) -> Optional[int]:
        return None if self.iterable else len(self.dataset) // self.prompts_per_generation

    def _order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.dataset)))
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(len(self.dataset), generator=generator).tolist()

    def next_generation(self) -> tuple[list[int], list[dict]]:
        """Dataset indices and rows of the next U prompts."""
        if self.iterable:
            return self._next_from_stream()
        if self.state.position >= self.generations_per_epoch:
            self.state = SamplerState(epoch=self.state.epoch + 1, position=0)
            self._stream = None
        if self._stream is None:
            # RestOfEpoch reads the position now: the loader starts where the sampler is
            self._stream = iter(self.loader)
        pairs = next(self._stream)
        for index, row in pairs:  # checked before training too (check_dataset), unless a transform makes the rows
            self._check(row, index)
        self.state.position += 1
        return [index for index, _ in pairs], [row for _, row in pairs]

    def _check(self, row: dict, index: int) -> None:
        """A drawn row's prompt, before it is used (rows without one are for environments: local_prompt_batch)."""
        if PROMPT_COLUMN not in row:
            return
        try:
            check_prompt(row[PROMPT_COLUMN], index, "train_dataset")
        except ValueError as err:
            if not self.iterable:
                raise
            order = ", after its seeded shuffle" if self.shuffle else ""
            raise ValueError(
                f"{err} (train_dataset is an IterableDataset, checked row by row as drawn: rows are numbered in the "
                f"order read in epoch {self.state.epoch}{order}, from 0. Training stopped before using this row.)"
            ) from None

    def _next_from_stream(self) -> tuple[list[int], list[dict]]:
        indices, rows = [], []
        while len(rows) < self.prompts_per_generation:
            if self._stream is None:
                self._stream = iter(self.loader)  # opens the stream at the current epoch and position
            try:
                row = next(self._stream)
            except StopIteration:
                if self.state.position == 0:
                    raise ValueError("train_dataset (an IterableDataset) yielded no rows.") from None
                self.state = SamplerState(epoch=self.state.epoch + 1, position=0)
                self._stream, indices, rows = None, [], []  # drop the incomplete generation, as for map-style data
                continue
            self._check(row, self.state.position)
            indices.append(self.state.position)
            rows.append(row)
            self.state.position += 1
        return indices, rows

    def _open_stream(self) -> Iterator[dict]:
        """The stream from the current position: reshuffled per epoch (seeded), consumed rows skipped."""
        stream = self.dataset
        if self.shuffle:
            stream = stream.shuffle(seed=self.seed + self.state.epoch, buffer_size=1000)
        return iter(stream.skip(self.state.position))

    def release(self) -> None:
        """Stop the loader (and its worker processes) now; the next generation starts it again where the sampler is."""
        self._stream = None
        stop_persistent_workers(self.loader)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.state.epoch, "position": self.state.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.state = SamplerState(epoch=int(state["epoch"]), position=int(state["position"]))
        self._stream = None  # the next generation restarts the loader at the restored position


class RestOfEpoch:
    """The loader's batch sampler: the index lists of the generations left in the sampler's current epoch.

    Read when the loader starts (`iter`), not when each batch is fetched: workers prefetch ahead,
    while the sampler's position only counts the generations actually handed out.
    """

    def __init__(self, sampler: PromptSampler):
        self.sampler = sampler

    def __iter__(self) -> Iterator[list[int]]:
        sampler, size = self.sampler, self.sampler.prompts_per_generation
        order = sampler._order(sampler.state.epoch)
        return iter(
            [order[g * size : (g + 1) * size] for g in range(sampler.state.position, sampler.generations_per_epoch)]
        )

    def __len__(self) -> int:
        return self.sampler.generations_per_epoch - self.sampler.state.position


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


@dataclass(frozen=True)
class RowReaders:
    """Who reads a map-style dataset's rows for a loader: `num_workers` worker processes (0: this process), each
    fetching `prefetch_factor` batches ahead (None: torch's 2), alive from one pass over the loader to the next when
    `persistent` (else started for each pass: an epoch of training prompts, an evaluation), started by
    `start_method` (None: the platform's default)."""

    num_workers: int = 0
    prefetch_factor: Optional[int] = None
    persistent: bool = False
    start_method: Optional[str] = None

    @classmethod
    def of(cls, config: Any, dataset: Any) -> "RowReaders":
        """The GRPOConfig's dataloader_* settings for `dataset`, checked; a stream is read in this process."""
        workers = workers_for(dataset, config.dataloader_num_workers)
        prefetch, start_method = config.dataloader_prefetch_factor, config.dataloader_multiprocessing_context
        if prefetch is not None and (isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1):
            raise ValueError(
                f"GRPOConfig.dataloader_prefetch_factor={prefetch!r} must be an integer >= 1 (batches each worker "
                "reads ahead), or None for torch's default (2)."
            )
        if start_method is not None and start_method not in multiprocessing.get_all_start_methods():
            raise ValueError(
                f"GRPOConfig.dataloader_multiprocessing_context={start_method!r} is not a start method of this "
                f"platform; use one of {multiprocessing.get_all_start_methods()}, or None for its default."
            )
        if workers == 0:
            return cls()
        return cls(workers, prefetch, bool(config.dataloader_persistent_workers), start_method)

    def loader_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {"num_workers": check_num_workers(self.num_workers)}
        if self.num_workers:  # torch refuses the others without workers
            options.update(
                prefetch_factor=self.prefetch_factor,
                persistent_workers=self.persistent,
                multiprocessing_context=self.start_method,
            )
        return options


def stop_persistent_workers(loader: DataLoader) -> None:
    """Shut down the worker processes a persistent loader keeps between passes (a later pass starts new ones).

    torch keeps them in the loader's private `_iterator` and offers no public way to stop them; dropping the
    reference alone waits for the garbage collector, as the loader and its batch sampler may form a cycle."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None:
        loader._iterator = None
        iterator._shutdown_workers()


def check_num_workers(num_workers: Any) -> int:
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
        raise ValueError(
            f"GRPOConfig.dataloader_num_workers={num_workers!r} must be an integer >= 0 (0: load rows in the main "
            "process)."
        )
    return num_workers


def workers_for(dataset: Any, num_workers: int) -> int:
    """The worker processes that may read `dataset`: as asked for map-style data, none for a stream."""
    return 0 if isinstance(dataset, datasets.IterableDataset) else check_num_workers(num_workers)


class IndexedRows(torch.utils.data.Dataset):
    """A map-style dataset's rows as (index, row) pairs, so a batch says which rows it holds."""

    def __init__(self, dataset: Any):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[int, dict]:
        return index, self.dataset[index]


class StreamRows(torch.utils.data.IterableDataset):
    """The rows of `open_stream()`, opened anew (at the caller's current position) each time the loader starts."""

    def __init__(self, open_stream: Callable[[], Iterable[Any]]):
        self.open_stream = open_stream

    def __iter__(self) -> Iterator[Any]:
        return iter(self.open_stream())


def as_is(batch: Any) -> Any:
    """Identity collation (a module-level function: worker processes receive it pickled)."""
    return batch


def private_generator() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def batches_loader(dataset: Any, batch_sampler: Iterable[list[int]], readers: RowReaders) -> DataLoader:
    """Lists of (index, row) of a map-style dataset, one list per batch of indices `batch_sampler` yields.

    Workers live as long as an iterator over the loader unless `readers` are persistent: dropping the iterator
    stops them.
    """
    return DataLoader(
        IndexedRows(dataset),
        batch_sampler=batch_sampler,
        collate_fn=as_is,
        generator=private_generator(),
        **readers.loader_options(),
    )


def stream_loader(open_stream: Callable[[], Iterable[Any]]) -> DataLoader:
    """The rows of a stream one at a time, in the main process."""
    return DataLoader(
        StreamRows(open_stream), batch_size=None, num_workers=0, collate_fn=as_is, generator=private_generator()
    )


def sequential_loader(dataset: Any, rows_per_batch: int, readers: RowReaders) -> DataLoader:
    """Lists of (index, row) in dataset order, `rows_per_batch` at a time (the last list may be shorter)."""
    if isinstance(dataset, datasets.IterableDataset):
        return DataLoader(
            StreamRows(lambda: enumerate(dataset)),
            batch_size=rows_per_batch,
            num_workers=0,
            collate_fn=as_is,
            generator=private_generator(),
        )
    return DataLoader(
        IndexedRows(dataset),
        batch_size=rows_per_batch,
        shuffle=False,
        collate_fn=as_is,
        generator=private_generator(),
        **readers.loader_options(),
    )
