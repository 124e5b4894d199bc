"""Cross-process helpers. Every process holds the same number of rows of a generation batch, in
process order, so concatenating along dim 0 restores the global group-major order."""

from __future__ import annotations

import torch
from accelerate import Accelerator


def gather_rows(accelerator: Accelerator, tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate equally-sized per-process tensors along dim 0 (no-op on one process)."""
    if accelerator.num_processes == 1:
        return tensor
    return accelerator.gather(tensor.to(accelerator.device)).cpu()


def global_sum(accelerator: Accelerator, value: float) -> float:
    if accelerator.num_processes == 1:
        return float(value)
    total = accelerator.reduce(torch.tensor([float(value)], device=accelerator.device), reduction="sum")
    return float(total.item())


def global_mean(accelerator: Accelerator, value: float) -> float:
    return global_sum(accelerator, value) / accelerator.num_processes


def local_rows(accelerator: Accelerator, rows_per_process: int) -> slice:
    """This process's slice of a gathered (global) batch."""
    start = accelerator.process_index * rows_per_process
    return slice(start, start + rows_per_process)


def gather_varlen(accelerator: Accelerator, values: torch.Tensor) -> torch.Tensor:
    """Concatenate 1-D tensors of different lengths from every process (padding removed).

    Values must be >= 0 (entropies): the padding is a negative sentinel that is filtered out.
    """
    if accelerator.num_processes == 1:
        return values
    padded = accelerator.pad_across_processes(values.float(), dim=0, pad_index=-1.0)
    gathered = accelerator.gather(padded)
    return gathered[gathered >= 0]
