"""The whole state of a policy whose parameters FSDP2 shards over the processes (DTensors).

A checkpoint and `save_model` hold full tensors, `from_pretrained`-loadable and independent of how the
weights were sharded; torch's distributed state-dict API gathers them (a collective: every process calls)
and hands a full state back to each process's shards. The optimizer's state is keyed by parameter name
there (`optimizer_keys="names"` in the checkpoint), not by position as `optimizer.state_dict()` keys it.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

OPTIMIZER_KEYED_BY_NAME = "names"


def fsdp_sharded(model: torch.nn.Module) -> bool:
    """True when the model's parameters are FSDP2 shards (DTensors)."""
    return any(isinstance(param, DTensor) for param in model.parameters())


def gather_full_state(
    model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None
) -> tuple[dict[str, torch.Tensor], Optional[dict[str, Any]]]:
    """(full model state, full optimizer state or None) on the main process, in host memory; empty dicts on the
    others. Every process must call it."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=options)
    optimizer_state = None if optimizer is None else get_optimizer_state_dict(model, optimizer, options=options)
    return weights, optimizer_state


def load_full_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Every process hands the full weights to its shards."""
    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True))


def load_full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """An optimizer state keyed by parameter name (gather_full_state's) into the optimizer of a model, sharded
    or not."""
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))
