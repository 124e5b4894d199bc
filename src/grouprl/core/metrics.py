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
import shutil
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch

# Logged by transformers' Trainer itself at each scheduled log entry; TRL's GRPOTrainer.log merges the others
# (its own metrics since the last entry) into every entry, the end-of-training summary included.
TRAINER_METRICS = ("loss", "grad_norm", "learning_rate")


class MetricWindow:
    """Named lists of floats since the last log entry.

    Phase times are summed over an optimizer step and added once per step (`close_step`), so
    `time/<phase>` is seconds per optimizer step (0 on a step that skipped the phase, e.g. no
    generation) and the phases add up to about `step_time`.
    """

    def __init__(self) -> None:
        self.values: dict[str, list[float]] = defaultdict(list)
        self.phase_seconds: dict[str, float] = {}  # this optimizer step's seconds per phase, not yet added
        self.phases_seen: list[str] = []  # every phase timed so far in the run, in first-seen order

    def add(self, name: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            value = value.detach().float().mean().item() if value.numel() else float("nan")
        self.values[name].append(float(value))

    def add_all(self, stats: dict[str, Any], prefix: str = "") -> None:
        for name, value in stats.items():
            self.add(prefix + name, value)

    def add_phase_time(self, name: str, seconds: float) -> None:
        if name not in self.phases_seen:
            self.phases_seen.append(name)
        self.phase_seconds[name] = self.phase_seconds.get(name, 0.0) + seconds

    def close_step(self) -> None:
        """Add this optimizer step's seconds per phase as one value each."""
        for name in self.phases_seen:
            self.add(f"time/{name}", self.phase_seconds.get(name, 0.0))
        self.phase_seconds = {}

    def mark(self) -> dict[str, int]:
        """A position in the window, for `summary(since=...)`."""
        return {name: len(values) for name, values in self.values.items()}

    def summary(self, since: Optional[dict[str, int]] = None) -> dict[str, float | None]:
        """Mean of each metric over the window (or over the values added after the `since` mark),
        NaN entries dropped (None if none was valid)."""
        out: dict[str, float | None] = {}
        for name, values in self.values.items():
            if since is not None:
                values = values[since.get(name, 0) :]
                if not values:
                    continue
            valid = [v for v in values if not math.isnan(v)]
            out[name] = sum(valid) / len(valid) if valid else None
        return out

    def clear(self) -> None:
        self.values.clear()
        self.phase_seconds = {}


class PhaseTimer:
    """Seconds spent per phase (generate, reward, old/ref logprobs, forward, backward, optimizer)."""

    def __init__(self, window: MetricWindow):
        self.window = window

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.window.add_phase_time(name, time.perf_counter() - start)


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


def reward_stats(
    per_function: torch.Tensor, names: list[str], total: torch.Tensor, group_std: torch.Tensor
) -> dict[str, float]:
    """rewards/{name}/mean|std (NaN-aware), reward, reward_std, frac_reward_zero_std for the global batch."""
    from grouprl.core.advantages import nanmean, nanstd

    stats: dict[str, float] = {}
    for k, name in enumerate(names):
        stats[f"rewards/{name}/mean"] = nanmean(per_function[:, k], dim=0).item()
        stats[f"rewards/{name}/std"] = nanstd(per_function[:, k], dim=0).item()
    stats["reward"] = nanmean(total, dim=0).item()
    stats["reward_std"] = nanmean(group_std, dim=0).item()
    stats["frac_reward_zero_std"] = torch.isclose(group_std, torch.zeros_like(group_std)).float().mean().item()
    return stats


def format_log_line(entry: dict[str, Any], max_steps: int) -> str:
    keys = (
        "loss",
        "reward",
        "reward_std",
        "completions/mean_length",
        "entropy",
        "grad_norm",
        "learning_rate",
        "step_time",
    )
    parts = [f"step {entry.get('step')}/{max_steps}"]
    for key in keys:
        value = entry.get(key)
        if isinstance(value, float):
            parts.append(f"{key.split('/')[-1]} {value:.4g}")
    return " | ".join(parts)


def progress_postfix(step_stats: dict[str, Any]) -> dict[str, str]:
    """Reward and mean completion length of one step for the progress bar (empty if it drew no samples)."""
    shown = {"reward": step_stats.get("reward"), "len": step_stats.get("completions/mean_length")}
    return {name: f"{value:.3g}" for name, value in shown.items() if isinstance(value, float)}


class JsonlWriter:
    """Appends one JSON object per line; used for output_dir/metrics.jsonl."""

    def __init__(self, path: str):
        self.path = path
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)

    def write(self, entry: dict[str, Any]) -> None:
        """Append the entry whole: a write that fails (a full disk, a read-only file system) is cut back off, so
        the file never ends in half a line, and raises OSError naming the file and the free space."""
        line = json.dumps(entry) + "\n"
        size = os.path.getsize(self.path) if os.path.exists(self.path) else 0
        try:
            with open(self.path, "a", encoding="utf-8") as handle:
                handle.write(line)
                handle.flush()
        except OSError as err:
            try:
                os.truncate(self.path, size)
            except OSError:
                pass
            free = shutil.disk_usage(os.path.dirname(self.path) or ".").free
            raise OSError(
                err.errno,
                f"Writing a log entry to {self.path} failed ({err.strerror or err}); {free / 2**20:.1f} MiB is free "
                "there. The run stops; its checkpoints up to now are complete: free space (or make the directory "
                "writable), then resume with resume_from_checkpoint=True.",
            ) from err

    def rewrite(self, entries: list[dict[str, Any]]) -> None:
        """Replace the file by `entries` (on resume: the restored log history, so entries logged
        after the checkpoint by the interrupted run do not appear twice)."""
        temporary = self.path + ".tmp"
        with open(temporary, "w", encoding="utf-8") as handle:
            handle.writelines(json.dumps(entry) + "\n" for entry in entries)
        os.replace(temporary, self.path)
