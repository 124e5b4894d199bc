"""The whole state of a model whose parameters are sharded over the processes: FSDP2's DTensors, DeepSpeed ZeRO-3's
partitioned parameters (`gathered`, `whole`).

A checkpoint and `save_model` hold full tensors, `from_pretrained`-loadable and independent of how the
weights were sharded; torch's distributed state-dict API gathers them (a collective: every process calls)
and hands a full state back to each process's shards. The optimizer's state is keyed by parameter name
there (`optimizer_keys="names"` in the checkpoint), not by position as `optimizer.state_dict()` keys it.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional

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


@contextmanager
def gathered(params: list[torch.nn.Parameter], modifier_rank: Optional[int] = None) -> Iterator[None]:
    """DeepSpeed ZeRO-3 keeps a shard of each parameter on each process: inside, the parameters are whole (a
    collective: every process enters it); with `modifier_rank`, what that process wrote into them is sharded again on
    the way out. Other parameters are left as they are."""
    if any(hasattr(param, "ds_id") for param in params):
        import deepspeed

        with deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank):
            yield
    else:
        yield


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """An FSDP2 DTensor gathered whole (a collective), any other tensor as it is (a ZeRO-3 one inside `gathered`)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach()


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
    if not any(torch.is_tensor(value) for entry in state["state"].values() for value in entry.values()):
        # an optimizer that keeps nothing per parameter (SGD without momentum) has only its groups' settings to
        # restore; torch's loader takes the device from a state tensor and refuses without one ("Expected device to
        # be set")
        for group, saved in zip(optimizer.param_groups, state["param_groups"], strict=True):
            group.update({key: value for key, value in saved.items() if key != "params"})
        return
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))
