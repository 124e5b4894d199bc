"""Statistics that say how they combine.

A stage returns a small frozen dataclass of statistics. Each field declares, in its metadata, how
its values combine across micro-batches and processes:

    mean(name, weight=...)   weighted mean; NaN values are left out (TRL's nanmean). `weight` names
                             another field (a token or row count) or is 1 (a mean of per-process means)
    total(name)              sum
    smallest(name)           min, NaN left out (TRL's nanmin)
    largest(name)            max, NaN left out (TRL's nanmax)
    finite(check)            not a statistic: a tensor that must be finite. Every process learns which
                             processes saw a NaN / inf in it (the loop then stops all of them together)
    local()                  kept on this process only (never reduced, never logged)

`name` is the metric name TRL logs it under (None: reduced but not logged). Open sets of statistics
(a loss function's, which user-registered losses may extend) are a field holding `{name: Stat}`.

This module only declares and flattens; `step_reduction.py` packs every process's values into one
tensor per reduction kind and reduces them once per optimizer step. Tensors in, tensors out: no
model code and no collectives here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Union

import torch

MEAN, SUM, MIN, MAX, FINITE, LOCAL = "mean", "sum", "min", "max", "finite", "local"
REDUCTIONS = (MEAN, SUM, MIN, MAX)

Number = Union[torch.Tensor, float, int]


@dataclass(frozen=True)
class Stat:
    """One value of an open set of statistics, with its reduction (and, for a mean, its weight)."""

    value: Number
    reduce: str
    weight: Number = 1.0

    def __post_init__(self) -> None:
        if self.reduce not in REDUCTIONS:
            raise ValueError(f"Stat.reduce must be one of {', '.join(REDUCTIONS)}, got {self.reduce!r}.")


def mean(name: Optional[str], weight: Optional[str] = None) -> Any:
    """A field reduced as a mean weighted by the field `weight` (None: every process and micro-batch counts 1)."""
    return field(default=None, metadata={"reduce": MEAN, "name": name, "weight": weight})


def total(name: Optional[str]) -> Any:
    return field(default=None, metadata={"reduce": SUM, "name": name})


def smallest(name: Optional[str]) -> Any:
    return field(default=None, metadata={"reduce": MIN, "name": name})


def largest(name: Optional[str]) -> Any:
    return field(default=None, metadata={"reduce": MAX, "name": name})


def finite(check: str) -> Any:
    """A tensor that must hold no NaN / inf; `check` names it in the error (and picks its message)."""
    return field(default=None, metadata={"reduce": FINITE, "name": check})


def local() -> Any:
    return field(default=None, metadata={"reduce": LOCAL, "name": None})


def open_set() -> Any:
    """A field holding `{metric name: Stat}` (statistics whose names are not known in advance)."""
    return field(default_factory=dict, metadata={"reduce": "open", "name": None})


@dataclass(frozen=True)
class Item:
    """One flattened statistic: where it came from (field / key), its metric name, reduction, value and weight."""

    key: str
    name: Optional[str]
    reduce: str
    value: Number
    weight: Number = 1.0


def items(stats: Any) -> Iterator[Item]:
    """The statistics of a stats dataclass in declaration order (open sets by key order); None values are absent."""
    for f in dataclasses.fields(stats):
        reduce = f.metadata.get("reduce")
        value = getattr(stats, f.name)
        if reduce is None or reduce == LOCAL or value is None:
            continue
        if reduce == "open":
            for key in sorted(value):
                stat = value[key]
                yield Item(f"{f.name}.{key}", key, stat.reduce, stat.value, stat.weight)
            continue
        weight_field = f.metadata.get("weight")
        weight = getattr(stats, weight_field) if weight_field else 1.0
        yield Item(f.name, f.metadata["name"], reduce, value, 1.0 if weight is None else weight)


def with_values(stats: Any, reduced: dict[str, float]) -> Any:
    """A copy of `stats` whose statistics are the reduced numbers in `reduced` (by Item.key)."""
    changes: dict[str, Any] = {}
    for f in dataclasses.fields(stats):
        reduce = f.metadata.get("reduce")
        value = getattr(stats, f.name)
        if reduce is None or reduce in (LOCAL, FINITE) or value is None:
            continue
        if reduce == "open":
            changes[f.name] = {key: replace_value(stat, reduced[f"{f.name}.{key}"]) for key, stat in value.items()}
        else:
            changes[f.name] = reduced[f.name]
    return dataclasses.replace(stats, **changes)


def replace_value(stat: Stat, value: float) -> Stat:
    return dataclasses.replace(stat, value=value)


def metrics(stats: Any) -> dict[str, float]:
    """{metric name: value} of a (reduced) stats dataclass: the named statistics, as floats."""
    out: dict[str, float] = {}
    for item in items(stats):
        if item.name is None or item.reduce == FINITE:
            continue
        value = item.value
        out[item.name] = float(value.detach().float().mean()) if isinstance(value, torch.Tensor) else float(value)
    return out
