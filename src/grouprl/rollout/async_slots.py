"""The book of asynchronous generations: which prompt batches are drawn, requested, finished and taken, which
are too stale to train on, which may be requested now, and what a checkpoint keeps of them.

Prompt batches ("slots") are numbered in the prompt sampler's order and taken by the trainer in that order.
A slot's samples carry the weight version that drew them; the trainer's version is its optimizer step count,
and a slot taken at version p that was sampled at version v has staleness p - v. A slot staler than
`max_staleness` is dropped (its groups counted) and requested again, ahead of later slots: never trained on,
never skipped.

The worker is asked for a slot only while it could still be trained on: its expected version at the take
(the trainer's version if the trainer is waiting for it, else the version of the last take plus the optimizer
steps per generation for each slot in between) may exceed the worker's weights by at most `max_staleness`.
With max_staleness=0 the worker therefore waits for the weights the slot will be trained with.

Plain data under the producer's lock (async_producer.py); no threads or I/O here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

from grouprl.core.types import Completion


@dataclass(frozen=True)
class Slot:
    """One generation batch of prompts: its place in the prompt order and its dataset rows (one per group)."""

    number: int  # also the generation index its GroupLayout is built with
    indices: list[int]
    rows: list[dict]


@dataclass(frozen=True)
class Finished:
    """A slot's completions: every group whole, group-major (the rows of every process), and their weights."""

    slot: Slot
    completions: list[Completion]
    version: int  # the oldest weight version that sampled any of them


@dataclass
class SlotBook:
    max_staleness: int
    steps_per_generation: float  # optimizer steps trained on one slot (fewer with dynamic sampling's extra rounds)
    next_number: int = 0  # the number the next slot drawn from the sampler gets
    next_take: int = 0  # the slot the trainer takes next
    trainer_version: int = 0
    trainer_waiting: bool = False  # the trainer is blocked on slot next_take
    last_take_version: float = 0.0  # the trainer's version when it took the previous slot (or the start, less one)
    waiting: list[Slot] = field(default_factory=list)  # drawn (or dropped) and not requested, in order
    requested: dict[int, Slot] = field(default_factory=dict)
    finished: dict[int, Finished] = field(default_factory=dict)
    dropped_groups: int = 0  # since the last take

    def start(self, version: int) -> None:
        """Training starts (or resumes) at `version`: the next slot is expected to be taken at it."""
        self.trainer_version = version
        self.last_take_version = version - self.steps_per_generation

    def add(self, slot: Slot) -> None:
        """A slot to request: drawn from the sampler, or dropped as stale (it goes back to its place)."""
        self.waiting.append(slot)
        self.waiting.sort(key=lambda s: s.number)

    def expected_version(self, number: int) -> int:
        """The trainer's version when it will take slot `number` (exact while it waits for it; an estimate ahead)."""
        if self.trainer_waiting and number == self.next_take:
            return self.trainer_version
        ahead = self.last_take_version + (number - self.next_take + 1) * self.steps_per_generation
        return max(self.trainer_version, math.floor(ahead + 1e-9))

    def may_request(self, number: int, worker_version: int) -> bool:
        return self.expected_version(number) - worker_version <= self.max_staleness

    def finish(self, finished: Finished) -> None:
        self.requested.pop(finished.slot.number, None)
        self.finished[finished.slot.number] = finished

    def fail(self, slot: Slot) -> None:
        """A request that got no answer (the worker died): the slot is requested again."""
        self.requested.pop(slot.number, None)
        self.add(slot)

    def drop_stale(self) -> int:
        """Drop finished slots already too old for the trainer's current version (it only grows); their count."""
        stale = [f for f in self.finished.values() if self.trainer_version - f.version > self.max_staleness]
        for finished in stale:
            self._drop(finished)
        return len(stale)

    def take(self) -> Optional[tuple[Finished, int]]:
        """The next slot in order and its staleness, if it has finished and is fresh enough; a stale one is dropped."""
        finished = self.finished.get(self.next_take)
        if finished is None:
            return None
        staleness = self.trainer_version - finished.version
        if staleness > self.max_staleness:
            self._drop(finished)
            return None
        del self.finished[self.next_take]
        self.next_take += 1
        self.last_take_version = self.trainer_version
        return finished, staleness

    def _drop(self, finished: Finished) -> None:
        del self.finished[finished.slot.number]
        self.dropped_groups += len(finished.slot.rows)
        self.add(finished.slot)

    def completions_waiting(self) -> int:
        return sum(len(f.completions) for f in self.finished.values())

    def state_dict(self) -> dict[str, Any]:
        """What resuming needs: every slot drawn but not taken (regenerated first, in order) and the counters."""
        pending = sorted(
            [*self.waiting, *self.requested.values(), *(f.slot for f in self.finished.values())],
            key=lambda s: s.number,
        )
        return {
            "next_take": self.next_take,
            "next_number": self.next_number,
            "slots": [(s.number, list(s.indices), list(s.rows)) for s in pending],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_take, self.next_number = int(state["next_take"]), int(state["next_number"])
        self.waiting = [Slot(number, indices, rows) for number, indices, rows in state["slots"]]
        self.requested, self.finished = {}, {}
