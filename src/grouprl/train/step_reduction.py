"""One reduction per optimizer step: every statistic of every micro-batch on every process, packed.

The stages return stats dataclasses (stats.py); the loop records them in a `StepLedger` and, once
per optimizer step, `reduce_step` reduces them all across processes with at most two collectives
(an all-reduce SUM of one packed tensor for means, sums and non-finite flags, and an all-reduce MAX
of another for maxima and negated minima) and two host syncs (reading each packed tensor back).

Each recorded entry stays a separate value (a micro-batch's entropy is the global mean of that
micro-batch), as TRL appends one value per micro-step and averages the logging window.

Every process records the same kinds of entries in the same order (the micro-step schedule and the
config decide them), so the packed tensors line up across processes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from grouprl.core.stats import FINITE, MAX, MEAN, MIN, SUM, items, with_values


class Collectives:
    """All-reduce SUM / MAX over the training processes (identity on one process), counted.

    `collectives` and `host_syncs` count the calls made through it (tests and measurements read them).
    """

    def __init__(self, num_processes: int = 1, process_index: int = 0, device: Any = "cpu") -> None:
        self.num_processes, self.process_index, self.device = num_processes, process_index, torch.device(device)
        self.collectives = 0
        self.host_syncs = 0

    @classmethod
    def of(cls, accelerator: Any) -> "Collectives":
        return cls(accelerator.num_processes, accelerator.process_index, accelerator.device)

    def all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        if self.num_processes == 1:
            return tensor
        self.collectives += 1
        kind = torch.distributed.ReduceOp.SUM if op == SUM else torch.distributed.ReduceOp.MAX
        torch.distributed.all_reduce(tensor, op=kind)
        return tensor

    def read(self, tensor: torch.Tensor) -> list[float]:
        self.host_syncs += 1
        return tensor.tolist()


@dataclass(frozen=True)
class Failure:
    """A finite() check that failed on some process: which check, which processes, this process's entry."""

    check: str
    processes: tuple[int, ...]
    entry: Any  # this process's stats entry (its tensors describe what went wrong here)


@dataclass
class StepLedger:
    """The stats entries recorded during one optimizer step, in recording order."""

    entries: list[Any] = field(default_factory=list)

    def record(self, stats: Any) -> None:
        self.entries.append(stats)

    def take(self) -> list[Any]:
        entries, self.entries = self.entries, []
        return entries


def _scalar(value: Any, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().to(device=device, dtype=torch.float32).reshape(())
    return torch.tensor(float(value), dtype=torch.float32, device=device)


def reduce_step(entries: list[Any], collectives: Collectives) -> tuple[list[Any], list[Failure]]:
    """Every entry with its statistics reduced over all processes (plain floats), and the failed finite checks."""
    device, processes = collectives.device, collectives.num_processes
    sums: list[torch.Tensor] = []
    maxes: list[torch.Tensor] = []
    layout: list[tuple[int, Any, int]] = []  # (entry index, item, position in its packed tensor)
    own = torch.zeros(processes, dtype=torch.float32, device=device)
    own[collectives.process_index] = 1.0
    for index, stats in enumerate(entries):
        for item in items(stats):
            if item.reduce == FINITE:
                bad = (~torch.isfinite(item.value.detach())).any().to(device=device, dtype=torch.float32)
                layout.append((index, item, len(sums)))
                sums.extend((own * bad).unbind())  # a (processes,) block: each process sets its own slot
                continue
            value = _scalar(item.value, device)
            if item.reduce == MEAN:
                weight = _scalar(item.weight, device)
                counted = ~torch.isnan(value)
                layout.append((index, item, len(sums)))
                sums.extend((torch.where(counted, value * weight, 0.0), torch.where(counted, weight, 0.0)))
            elif item.reduce == SUM:
                layout.append((index, item, len(sums)))
                sums.append(value)
            else:  # min is the max of the negated values; NaN never wins (TRL's nanmin / nanmax)
                signed = -value if item.reduce == MIN else value
                layout.append((index, item, len(maxes)))
                maxes.append(torch.where(torch.isnan(signed), -math.inf, signed))
    summed = collectives.read(collectives.all_reduce(torch.stack(sums), SUM)) if sums else []
    maxed = collectives.read(collectives.all_reduce(torch.stack(maxes), MAX)) if maxes else []
    values: list[dict[str, float]] = [{} for _ in entries]
    failures: list[Failure] = []
    for index, item, at in layout:
        if item.reduce == FINITE:
            flagged = tuple(p for p in range(processes) if summed[at + p] > 0)
            if flagged:
                failures.append(Failure(item.name, flagged, entries[index]))
        elif item.reduce == MEAN:
            weight = summed[at + 1]
            values[index][item.key] = summed[at] / weight if weight > 0 else math.nan
        elif item.reduce == SUM:
            values[index][item.key] = summed[at]
        else:
            best = maxed[at]
            values[index][item.key] = math.nan if best == -math.inf else (-best if item.reduce == MIN else best)
    return [with_values(stats, v) for stats, v in zip(entries, values)], failures


def first_failure_of(failures: list[Failure], process: int) -> Optional[Failure]:
    """The earliest failed check of `process` (the cause; later ones usually follow from it)."""
    return next((f for f in failures if process in f.processes), None)
