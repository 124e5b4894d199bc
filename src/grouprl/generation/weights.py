"""The policy's weights as a separate inference engine needs them: full tensors under the plain
transformers names.

- LoRA policies: adapters merged into the base weights for the copy, names without PEFT's
  prefixes, adapter tensors left out; the adapters are unmerged afterwards.
- Quantized policies (bitsandbytes 4-bit / 8-bit, QLoRA): each quantized weight dequantized (peft's
  `dequantize_bnb_weight`) in the dtype of the model's embeddings, with its adapters' update added to that copy:
  the engine serves full weights, and the policy is never merged (PEFT's merge into a quantized layer quantizes the
  sum again, which loses the update's small values).
- Sharded training (FSDP2 DTensors, DeepSpeed ZeRO-3): each parameter is gathered whole. These
  are collectives, so every process must iterate the weights, even though only the main process
  sends them.

In-process sampling under sharding samples from a `replica`: the policy's architecture, unsharded, on each process,
its weights loaded from the gathered ones before a generation (`load_weights`) and freed after it
(`release_storage`), so that a decode step runs no collective and each process may decode as many steps as its own
rows need.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Iterator

import torch
from torch.distributed.fsdp import FSDPModule

from grouprl.model.adapters import active_adapter, base_model, is_peft_model
from grouprl.model.full_state import gathered
from grouprl.model.quantization import is_quantized

PEFT_PREFIX = "base_model.model."


def inference_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) for every weight of `model` an inference copy loads, one at a time."""
    peft = is_peft_model(model)
    trained_copy = f".modules_to_save.{active_adapter(model)}." if peft else ""
    # ZeRO-3 holds a LoRA layer's base weight as an empty shard, and a quantized layer packed values, which PEFT's
    # in-place merge cannot add to: there the adapters' updates are added to each copy handed out instead
    zero3 = any(hasattr(param, "ds_id") for param in model.parameters())
    if is_quantized(model) and (zero3 or any(hasattr(param, "full_tensor") for param in model.parameters())):
        raise NotImplementedError(
            "Sending a quantized policy's weights to an inference engine under FSDP / DeepSpeed ZeRO-3 would gather "
            "its packed shards and dequantize them, which is not built. Sample from the sharded policy itself "
            "(use_vllm=False, no generation server or asynchronous generation, ds3_gather_for_generation=False), or "
            "train the quantized policy on one process per model copy (DDP)."
        )
    quantized = quantized_layers(model)
    updates = (
        _lora_layers(model, "under DeepSpeed ZeRO-3" if zero3 else "of a quantized policy")
        if peft and (zero3 or quantized)
        else {}
    )
    dtype = base_model(model).get_input_embeddings().weight.dtype
    with nullcontext() if updates or quantized else merged_adapters(model):
        for name, param in model.named_parameters():
            if peft:
                if (
                    "lora_" in name
                    or ".original_module." in name
                    or (".modules_to_save." in name and trained_copy not in name)
                ):
                    continue  # adapter factors (merged already), frozen originals, other adapters' copies
                name = name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".").replace(trained_copy, ".")
            with gathered([param]):
                tensor = param.full_tensor() if hasattr(param, "full_tensor") else param.detach()
                if id(param) in quantized:
                    tensor = dequantized(quantized[id(param)]).to(dtype)
                if id(param) in updates:
                    tensor = tensor + _lora_update(updates[id(param)]).to(tensor.dtype)
                # merged LoRA values vanish at unmerge, a gathered ZeRO-3 parameter when its context
                # closes: hand out a copy that outlives them
                yield name, tensor.clone() if peft or hasattr(param, "ds_id") else tensor


def quantized_layers(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """id(packed weight) -> its bitsandbytes layer (Linear4bit / Linear8bitLt), for every quantized layer."""
    return {
        id(module.weight): module
        for module in model.modules()
        if type(getattr(module, "weight", None)).__name__ in ("Params4bit", "Int8Params")
    }


def dequantized(layer: torch.nn.Module) -> torch.Tensor:
    from peft.utils.integrations import dequantize_bnb_weight

    return dequantize_bnb_weight(layer.weight, getattr(layer, "state", None))


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


def _lora_layers(model: torch.nn.Module, where: str) -> dict[int, torch.nn.Module]:
    """id(base weight) -> its LoRA layer, for every layer with an active adapter (`where`: for the error)."""
    from peft.tuners.lora import LoraLayer

    layers = {}
    for module in model.modules():
        if isinstance(module, LoraLayer) and any(a in module.lora_A for a in module.active_adapters):
            unsupported = [
                what
                for a in module.active_adapters
                for what, used in (("DoRA", module.use_dora.get(a)), ("lora_bias", module.lora_bias.get(a)))
                if used
            ]
            if unsupported:
                raise NotImplementedError(
                    f"Sending the weights of a LoRA policy {where}: its adapters use {unsupported[0]}, whose merge "
                    "into a copy of the base weight is not built. Train plain LoRA adapters, or sample in the "
                    "training process."
                )
            layers[id(module.get_base_layer().weight)] = module
    return layers


def _lora_update(layer: torch.nn.Module) -> torch.Tensor:
    """The active adapters' update to `layer`'s base weight (what PEFT's merge adds), their factors gathered."""
    adapters = [a for a in layer.active_adapters if a in layer.lora_A]
    factors = [p for a in adapters for p in (layer.lora_A[a].weight, layer.lora_B[a].weight)]
    with gathered(factors):
        return sum(layer.get_delta_weight(a) for a in adapters)


def replica_of(model: torch.nn.Module) -> torch.nn.Module:
    """A module tree of `model`'s architecture (the base model of a PEFT one), unsharded, on the device of its
    weights, with `model`'s buffers and uninitialised weights (`load_weights` fills them): built on the meta device,
    then `materialize`d."""
    base = base_model(model)
    # fully_shard gives a module a class of its own, FSDP<name>, over the model's: the replica takes the model's
    plain = next(cls for cls in type(base).__mro__ if not issubclass(cls, FSDPModule))
    with torch.device("meta"):
        replica = plain(base.config)
    materialize(replica, model)
    return replica.eval().requires_grad_(False)


def materialize(replica: torch.nn.Module, model: torch.nn.Module) -> None:
    """Give a replica whose tensors are on the meta device (new, or freed by `release_storage`) storage on the device
    of `model`'s weights, and `model`'s buffers (never sharded: RoPE's frequencies); its weights are left
    uninitialised."""
    base = base_model(model)
    replica.to_empty(device=next(base.parameters()).device)
    replica.tie_weights()  # to_empty gives a tied weight's two names storage each
    buffers = dict(base.named_buffers())
    for name, buffer in replica.named_buffers():
        if name not in buffers:
            raise RuntimeError(
                f"In-process sampling under sharding: the policy has no buffer {name!r} to copy into its unsharded "
                f"replica ({type(replica).__name__} built from its config has it). Sample on a generation server "
                "(generation_engine='server', `grouprl serve`) instead."
            )
        buffer.copy_(buffers[name])


def release_storage(replica: torch.nn.Module) -> None:
    """Free a replica's storage (its tensors back on the meta device, their dtypes kept) until `materialize`."""
    replica.to_empty(device="meta")


@torch.no_grad()
def load_weights(replica: torch.nn.Module, model: torch.nn.Module) -> None:
    """`model`'s weights as an inference copy takes them (`inference_weights`: gathered, adapters merged) into
    `replica`, in place; a collective under sharding, which every process calls. A parameter takes the dtype of the
    weight it receives (the replica is built in torch's default dtype)."""
    params = dict(replica.named_parameters())
    loaded = set()
    for name, tensor in inference_weights(model):
        target = params.get(name)
        if target is None or target.shape != tensor.shape:
            found = "no such parameter" if target is None else f"shape {tuple(target.shape)}"
            raise RuntimeError(
                f"In-process sampling under sharding: the policy's weight {name!r} {tuple(tensor.shape)} does not fit "
                f"its unsharded replica ({found}). Sample on a generation server (generation_engine='server') instead."
            )
        if target.dtype != tensor.dtype:
            target.data = torch.empty_like(target, dtype=tensor.dtype)  # a tied weight's other name shares it
        target.copy_(tensor)
        loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise RuntimeError(
            f"In-process sampling under sharding: the policy gave no weights for {missing[:5]} of its unsharded "
            "replica. Sample on a generation server (generation_engine='server') instead."
        )


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
