"""The policy's weights as a separate inference engine needs them: full tensors under the plain
transformers names.

- LoRA policies: adapters merged into the base weights for the copy, names without PEFT's
  prefixes, adapter tensors left out; the adapters are unmerged afterwards.
- Sharded training (FSDP2 DTensors, DeepSpeed ZeRO-3): each parameter is gathered whole. These
  are collectives, so every process must iterate the weights, even though only the main process
  sends them.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Iterator

import torch

from grouprl.model.adapters import active_adapter, is_peft_model

PEFT_PREFIX = "base_model.model."


def inference_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) for every weight of `model` an inference copy loads, one at a time."""
    peft = is_peft_model(model)
    trained_copy = f".modules_to_save.{active_adapter(model)}." if peft else ""
    with merged_adapters(model):
        for name, param in model.named_parameters():
            if peft:
                if (
                    "lora_" in name
                    or ".original_module." in name
                    or (".modules_to_save." in name and trained_copy not in name)
                ):
                    continue  # adapter factors (merged already), frozen originals, other adapters' copies
                name = name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".").replace(trained_copy, ".")
            with _gathered(param):
                tensor = param.full_tensor() if hasattr(param, "full_tensor") else param.detach()
                # merged LoRA values vanish at unmerge, a gathered ZeRO-3 parameter when its context
                # closes: hand out a copy that outlives them
                yield name, tensor.clone() if peft or hasattr(param, "ds_id") else tensor


@contextmanager
def merged_adapters(model: torch.nn.Module) -> Iterator[None]:
    if not is_peft_model(model):
        yield
        return
    model.merge_adapter()
    try:
        yield
    finally:
        model.unmerge_adapter()


def _gathered(param: torch.nn.Parameter):
    """DeepSpeed ZeRO-3 keeps a shard per process: gather the whole parameter for the copy."""
    if hasattr(param, "ds_id"):
        import deepspeed

        return deepspeed.zero.GatheredParameters([param])
    return nullcontext()


def chunks(weights: Iterator[tuple[str, torch.Tensor]], max_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
    """Group (name, tensor) pairs into CPU dicts of at most `max_bytes` (a bigger tensor goes alone)."""
    chunk: dict[str, torch.Tensor] = {}
    size = 0
    for name, tensor in weights:
        nbytes = tensor.numel() * tensor.element_size()
        if chunk and size + nbytes > max_bytes:
            yield chunk
            chunk, size = {}, 0
        chunk[name] = tensor.to("cpu", copy=True).contiguous()
        size += nbytes
    if chunk:
        yield chunk
