"""A seeded, resumable order of prompt rows, one generation at a time (TRL's RepeatSampler, §2.13).

Prompts are shuffled with a seeded generator (a new permutation each epoch) and cut into
generations of U = generation_batch_size / G unique prompts (the incomplete last one is dropped);
each prompt is later repeated G times (`prompts.local_prompt_batch`). Processes take contiguous
slices of the G*U completions, so a group may straddle two processes; its global group id keeps it
whole for the advantages. The sampler position is two integers, saved in checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Optional

import datasets
import torch

from grouprl.data.dataset_checks import PROMPT_COLUMN, check_prompt
from grouprl.data.row_loading import batches_loader, stream_loader


@dataclass
class SamplerState:
    epoch: int = 0
    position: int = 0  # generations already drawn in this epoch (map-style) / rows consumed (iterable)


class PromptSampler:
    """Seeded, resumable order of prompt rows, one generation (U unique prompts) at a time.

    The rows are fetched by `self.loader`, a torch DataLoader (row_loading.py): with `num_workers` > 0
    (map-style data only) worker processes read the next generations' rows ahead of time, in the
    same order. The order and the resumable position stay the sampler's own.
    """

    def __init__(self, dataset: Any, prompts_per_generation: int, *, shuffle: bool, seed: int, num_workers: int = 0):
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
            self.loader = batches_loader(dataset, RestOfEpoch(self), num_workers=num_workers)

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
