"""Metrics under TRL's names: accumulation over a logging window, completion statistics, output.

Values are collected as lists during the window (per generation, per micro-step, per optimizer
step) and averaged with NaN entries dropped when a log entry is written, as TRL does. Each entry
goes to `trainer.state.log_history`, the console, every tracker in `report_to` and
`output_dir/metrics.jsonl`.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Any, Iterator

import torch


class MetricWindow:
    """Named lists of floats since the last log entry."""

    def __init__(self) -> None:
        self.values: dict[str, list[float]] = defaultdict(list)

    def add(self, name: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            value = value.detach().float().mean().item() if value.numel() else float("nan")
        self.values[name].append(float(value))

    def add_all(self, stats: dict[str, Any], prefix: str = "") -> None:
        for name, value in stats.items():
            self.add(prefix + name, value)

    def summary(self) -> dict[str, float | None]:
        """Mean of each metric over the window, NaN entries dropped (None if none was valid)."""
        out: dict[str, float | None] = {}
        for name, values in self.values.items():
            valid = [v for v in values if not math.isnan(v)]
            out[name] = sum(valid) / len(valid) if valid else None
        return out

    def clear(self) -> None:
        self.values.clear()


class PhaseTimer:
    """Seconds spent per phase (generate, reward, logprobs, backward, optimizer) in the window."""

    def __init__(self, window: MetricWindow):
        self.window = window

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.window.add(f"time/{name}", time.perf_counter() - start)


def completion_length_stats(lengths: torch.Tensor, terminated: torch.Tensor) -> dict[str, float]:
    """TRL's completions/* metrics from (N,) lengths and (N,) bool 'ended with EOS' of the global batch."""
    lengths = lengths.float()
    finished = lengths[terminated]
    nan = float("nan")
    return {
        "completions/mean_length": lengths.mean().item(),
        "completions/min_length": lengths.min().item(),
        "completions/max_length": lengths.max().item(),
        "completions/clipped_ratio": 1.0 - terminated.float().mean().item(),
        "completions/mean_terminated_length": finished.mean().item() if len(finished) else nan,
        "completions/min_terminated_length": finished.min().item() if len(finished) else nan,
        "completions/max_terminated_length": finished.max().item() if len(finished) else nan,
    }


def reward_stats(per_function: torch.Tensor, names: list[str], total: torch.Tensor, group_std: torch.Tensor) -> dict[str, float]:
    """rewards/{name}/mean|std (NaN-aware), reward, reward_std, frac_reward_zero_std for the global batch."""
    from .algorithms.advantages import nanmean, nanstd

    stats: dict[str, float] = {}
    for k, name in enumerate(names):
        stats[f"rewards/{name}/mean"] = nanmean(per_function[:, k], dim=0).item()
        stats[f"rewards/{name}/std"] = nanstd(per_function[:, k], dim=0).item()
    stats["reward"] = nanmean(total, dim=0).item()
    stats["reward_std"] = nanmean(group_std, dim=0).item()
    stats["frac_reward_zero_std"] = torch.isclose(group_std, torch.zeros_like(group_std)).float().mean().item()
    return stats


def format_log_line(entry: dict[str, Any], max_steps: int) -> str:
    keys = ("loss", "reward", "reward_std", "completions/mean_length", "entropy", "grad_norm", "learning_rate", "step_time")
    parts = [f"step {entry.get('step')}/{max_steps}"]
    for key in keys:
        value = entry.get(key)
        if isinstance(value, float):
            parts.append(f"{key.split('/')[-1]} {value:.4g}")
    return " | ".join(parts)


class JsonlWriter:
    """Appends one JSON object per line; used for output_dir/metrics.jsonl."""

    def __init__(self, path: str):
        self.path = path
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)

    def write(self, entry: dict[str, Any]) -> None:
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(entry) + "\n")
