"""Fetching dataset rows through torch DataLoaders, so ``dataloader_num_workers`` processes can read them.

grouprl decides which rows come next itself (data.PromptSampler: a seeded order resumable from two
integers; evaluation: dataset order); a loader only fetches those rows, in that order, in worker
processes and ahead of time when asked to. Collation is the identity: rows stay Python dicts and
are tokenized in the main process, as TRL's GRPO collator leaves them too (so pinning memory has
nothing to pin). A stream (``datasets.IterableDataset``) is read in-process: workers would each
read a shard of it and interleave them, which breaks the order (TRL forces 0 workers as well).

Every loader gets a private generator: a DataLoader iterator otherwise draws its workers' base seed
from the global torch RNG, which would shift training's sampling by whether, and when, a loader
was (re)started.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

import datasets
import torch
from torch.utils.data import DataLoader


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


def batches_loader(dataset: Any, batch_sampler: Iterable[list[int]], *, num_workers: int) -> DataLoader:
    """Lists of (index, row) of a map-style dataset, one list per batch of indices `batch_sampler` yields.

    Workers live as long as an iterator over the loader (not persistent): dropping the iterator stops them.
    """
    workers = check_num_workers(num_workers)
    return DataLoader(
        IndexedRows(dataset),
        batch_sampler=batch_sampler,
        num_workers=workers,
        collate_fn=as_is,
        generator=private_generator(),
    )


def stream_loader(open_stream: Callable[[], Iterable[Any]]) -> DataLoader:
    """The rows of a stream one at a time, in the main process."""
    return DataLoader(
        StreamRows(open_stream), batch_size=None, num_workers=0, collate_fn=as_is, generator=private_generator()
    )


def sequential_loader(dataset: Any, rows_per_batch: int, *, num_workers: int) -> DataLoader:
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
        num_workers=check_num_workers(num_workers),
        collate_fn=as_is,
        generator=private_generator(),
    )
