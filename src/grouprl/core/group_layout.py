"""Where the rows of a generation live: which completions of which group each process holds.

A generation batch is a list of groups (one prompt and its completions) in global, group-major row
order, dealt to the processes in contiguous shares of near-equal size. A share boundary may cut a
group: its head is sampled on one process and its tail on the next, and the group keeps one global
id, so its advantages are still computed over all of its rows.

`GroupLayout` is that placement, built once per generation. Every step that moves rows between
"this process's share" and "whole groups" asks it instead of redoing the arithmetic: the prompt
sampler (which prompts, how many samples each, on this process), the main-process dispatcher (whole
groups sampled once, cut back into shares), dynamic sampling and GFPO's row filter (keep some
groups or rows, deal the kept rows out again).

Pure bookkeeping, no collectives: the caller gathers (distributed.py) and the layout says how the
gathered pieces fit together. Rows are counted in global order; "group position" is a group's index
in the layout (0..num_groups-1), "group id" its global id (stable across processes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class GroupLayout:
    group_ids: tuple[int, ...]  # (groups,) global id of each group, in row order
    group_sizes: tuple[int, ...]  # (groups,) rows (completions) of each group
    bounds: tuple[int, ...]  # (processes + 1,) process p holds the global rows bounds[p]:bounds[p + 1]
    process_index: int = 0  # the process this layout is read from (its "own" rows)

    def __post_init__(self) -> None:
        if len(self.group_ids) != len(self.group_sizes):
            raise ValueError(f"GroupLayout: {len(self.group_ids)} group ids for {len(self.group_sizes)} group sizes.")
        if any(size < 1 for size in self.group_sizes):
            raise ValueError(f"GroupLayout: every group needs at least one row, got sizes {list(self.group_sizes)}.")
        if len(self.bounds) < 2 or self.bounds[0] != 0 or self.bounds[-1] != sum(self.group_sizes):
            raise ValueError(
                f"GroupLayout: bounds {list(self.bounds)} must run from 0 to the {sum(self.group_sizes)} rows."
            )
        if any(a > b for a, b in zip(self.bounds, self.bounds[1:])):
            raise ValueError(f"GroupLayout: bounds {list(self.bounds)} must not decrease.")
        if not 0 <= self.process_index < self.num_processes:
            raise ValueError(f"GroupLayout: process_index {self.process_index} outside 0..{self.num_processes - 1}.")

    # ---- construction ------------------------------------------------------------------------

    @classmethod
    def dealt(
        cls, group_ids: Sequence[int], group_sizes: Sequence[int], num_processes: int, process_index: int = 0
    ) -> GroupLayout:
        """Groups in this order, their rows dealt in contiguous shares: process p gets rows n*p//P .. n*(p+1)//P."""
        n = sum(group_sizes)
        bounds = tuple(n * p // num_processes for p in range(num_processes + 1))
        return cls(tuple(group_ids), tuple(group_sizes), bounds, process_index)

    @classmethod
    def for_generation(
        cls, generation_index: int, num_prompts: int, group_size: int, num_processes: int, process_index: int = 0
    ) -> GroupLayout:
        """The sampler's layout: `num_prompts` groups of `group_size`, ids numbered on from earlier generations."""
        first = generation_index * num_prompts
        return cls.dealt(range(first, first + num_prompts), [group_size] * num_prompts, num_processes, process_index)

    @classmethod
    def uncut(cls, sizes_per_process: Sequence[Sequence[int]], process_index: int = 0) -> GroupLayout:
        """Each process holds its own whole groups (sizes listed per process); ids 0.. in process order.

        For prompt batches built without a layout (by hand, or from TRL-style per-completion prompts):
        nothing says a group continues on the next process, so none is taken to.
        """
        sizes = [size for shares in sizes_per_process for size in shares]
        bounds = (0, *accumulate(sum(shares) for shares in sizes_per_process))
        return cls(tuple(range(len(sizes))), tuple(sizes), bounds, process_index)

    def redealt(self, group_ids: Sequence[int], group_sizes: Sequence[int]) -> GroupLayout:
        """Other groups dealt over the same processes, read from the same process."""
        return GroupLayout.dealt(group_ids, group_sizes, self.num_processes, self.process_index)

    # ---- reading the placement ---------------------------------------------------------------

    @property
    def num_processes(self) -> int:
        return len(self.bounds) - 1

    @property
    def num_groups(self) -> int:
        return len(self.group_sizes)

    @property
    def num_rows(self) -> int:
        return self.bounds[-1]

    @property
    def local_rows(self) -> slice:
        """This process's rows of a global (gathered) row list."""
        return slice(self.bounds[self.process_index], self.bounds[self.process_index + 1])

    def rows(self, process: int) -> range:
        return range(self.bounds[process], self.bounds[process + 1])

    def group_starts(self) -> list[int]:
        return [0, *accumulate(self.group_sizes)][:-1]

    def row_groups(self) -> list[int]:
        """(rows,) group position of every global row."""
        return [g for g, size in enumerate(self.group_sizes) for _ in range(size)]

    def pieces(self, process: int | None = None) -> list[tuple[int, int]]:
        """(group position, rows there) of every group with rows on `process` (default: this one), in row order."""
        rows = self.rows(self.process_index if process is None else process)
        out = []
        for g, (start, size) in enumerate(zip(self.group_starts(), self.group_sizes)):
            here = min(start + size, rows.stop) - max(start, rows.start)
            if here > 0:
                out.append((g, here))
        return out

    def uniform_group_size(self) -> int:
        """The one size every group has (group-normalised advantages need it)."""
        sizes = set(self.group_sizes)
        if len(sizes) != 1:
            raise ValueError(
                f"the groups have different sizes {sorted(sizes)}; advantages are normalised over groups of one size."
            )
        return sizes.pop()

    # ---- moving values between shares and whole groups ---------------------------------------

    def deal(self, rows: Sequence[T]) -> list[list[T]]:
        """A global row list cut into the processes' shares."""
        if len(rows) != self.num_rows:
            raise ValueError(f"GroupLayout.deal: {len(rows)} rows for a layout of {self.num_rows}.")
        return [list(rows[self.bounds[p] : self.bounds[p + 1]]) for p in range(self.num_processes)]

    def join(self, per_process: Sequence[Sequence[T]]) -> list[T]:
        """One value per group from each process's per-piece values (the process holding a group's head gives it)."""
        if len(per_process) != self.num_processes:
            raise ValueError(
                f"GroupLayout.join: values from {len(per_process)} processes for a layout of {self.num_processes}."
            )
        found: dict[int, T] = {}
        for p, values in enumerate(per_process):
            pieces = self.pieces(p)
            if len(values) != len(pieces):
                raise ValueError(
                    f"GroupLayout.join: process {p} gave {len(values)} values for its {len(pieces)} groups."
                )
            for (g, _), value in zip(pieces, values):
                found.setdefault(g, value)
        return [found[g] for g in range(self.num_groups)]

    # ---- choosing rows -----------------------------------------------------------------------

    def select_groups(self, positions: Sequence[int]) -> GroupLayout:
        """The chosen groups (whole), their rows dealt out again over the processes."""
        return self.redealt([self.group_ids[g] for g in positions], [self.group_sizes[g] for g in positions])

    def select_rows(self, keep: Sequence[bool]) -> GroupLayout:
        """The kept rows (a (rows,) mask): groups shrink to their kept rows (empty ones go), dealt out again."""
        if len(keep) != self.num_rows:
            raise ValueError(f"GroupLayout.select_rows: a mask of {len(keep)} rows for a layout of {self.num_rows}.")
        kept = [0] * self.num_groups
        for g, k in zip(self.row_groups(), keep):
            kept[g] += bool(k)
        chosen = [g for g in range(self.num_groups) if kept[g]]
        return self.redealt([self.group_ids[g] for g in chosen], [kept[g] for g in chosen])

    def keeps_rows_in_place(self, keep: Sequence[bool]) -> bool:
        """Whether, after select_rows(keep), every process holds exactly its own kept rows (no row changes process)."""
        after = self.select_rows(keep)
        return all(sum(bool(keep[r]) for r in self.rows(p)) == len(after.rows(p)) for p in range(self.num_processes))
