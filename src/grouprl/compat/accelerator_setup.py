"""The process's accelerate.Accelerator for a GRPOConfig: precision (TRL's default bf16 declined on CPUs that emulate
it), DDP and process-group settings, DeepSpeed / FSDP plugins, trackers."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import (
    DistributedDataParallelKwargs,
    DistributedType,
    FullyShardedDataParallelPlugin,
    InitProcessGroupKwargs,
)
from transformers.integrations.deepspeed import propagate_args_to_deepspeed
from transformers.utils import logging

from grouprl.config.grpo_config import no_accelerator
from grouprl.core.cpu_capabilities import bf16_emulation_reason

if TYPE_CHECKING:
    from grouprl.config.grpo_config import GRPOConfig

logger = logging.get_logger("grouprl")


def make_accelerator(args: "GRPOConfig") -> Accelerator:
    on_cpu = args.use_cpu or not torch.cuda.is_available()
    bf16 = args.bf16
    emulated = on_cpu and bf16 and bf16_emulation_reason()
    if emulated:
        # Without native bf16 units, PyTorch emulates bf16 matmuls: measured 0.95 GFLOP/s vs 175 GFLOP/s in fp32 on
        # an AVX2 machine, i.e. bf16 autocast makes a CPU step ~100x slower instead of faster.
        if args.bf16_from_default:
            logger.warning(
                f"grouprl: bf16 products are emulated here ({emulated}), ~100x slower than fp32; training in fp32 "
                "instead of TRL's default bf16=True. Pass bf16=True explicitly to force it."
            )
            bf16 = False
        else:
            logger.warning(
                f"grouprl: bf16=True where bf16 products are emulated ({emulated}): expect steps ~100x slower than "
                "fp32. Set bf16=False unless you are measuring exactly this."
            )
    mixed_precision = "bf16" if bf16 else ("fp16" if args.fp16 else "no")
    if (AcceleratorState._shared_state or PartialState._shared_state) and PartialState().num_processes == 1:
        forget_single_process_accelerator_state()
    # accelerate joins a multi-process launch on a machine without an accelerator only when told
    # cpu=True; otherwise every process would silently train alone. DeepSpeed is the exception: told cpu=True,
    # accelerate drops it for DDP, so a DeepSpeed launch there joins over gloo with DeepSpeed's CPU accelerator.
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    deepspeed_on_cpu = launched and no_accelerator() and not args.use_cpu and deepspeed_asked(args)
    if deepspeed_on_cpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is first imported
    ddp = {
        "find_unused_parameters": args.ddp_find_unused_parameters,
        "bucket_cap_mb": args.ddp_bucket_cap_mb,
        "broadcast_buffers": args.ddp_broadcast_buffers,
        "static_graph": args.ddp_static_graph,
    }
    backend = args.ddp_backend or ("gloo" if deepspeed_on_cpu else None)
    handlers = [
        InitProcessGroupKwargs(timeout=timedelta(seconds=args.ddp_timeout), **({"backend": backend} if backend else {}))
    ]
    if any(value is not None for value in ddp.values()):
        handlers.append(DistributedDataParallelKwargs(**{k: v for k, v in ddp.items() if v is not None}))
    accelerator = Accelerator(
        mixed_precision=mixed_precision,
        cpu=args.use_cpu or (launched and no_accelerator() and not deepspeed_on_cpu),
        log_with=args.report_to or None,
        project_dir=args.logging_dir or os.path.join(args.output_dir, "runs"),
        kwargs_handlers=handlers,
        # built by TrainingArguments from args.deepspeed or the launch's; a later trainer in the process keeps the
        # first one's (accelerate refuses a second plugin)
        deepspeed_plugin=None if deepspeed_state_exists() else args.deepspeed_plugin,
        fsdp_plugin=FullyShardedDataParallelPlugin(**args.fsdp_plugin_args) if args.fsdp_plugin_args else None,
    )
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        # the config's "auto" values from the arguments (batch sizes, accumulation steps, clipping, precision,
        # optimizer settings), as transformers' Trainer fills them
        propagate_args_to_deepspeed(accelerator, args)
    if fsdp2_asked_on_cpu(accelerator, args):
        shard_with_fsdp2(accelerator, args)
    asked = sharding_asked_but_not_run(accelerator, args)
    if asked and accelerator.is_main_process:
        logger.warning(
            f"grouprl: {asked} was asked for, but on a machine without an accelerator accelerate runs it as DDP over "
            "gloo: every process holds the whole model and optimizer state. The updates are DDP's; nothing is sharded."
        )
    return accelerator


def deepspeed_state_exists() -> bool:
    return bool(AcceleratorState._shared_state) and AcceleratorState().distributed_type == DistributedType.DEEPSPEED


def deepspeed_asked(args: "GRPOConfig") -> bool:
    """GRPOConfig.deepspeed, or an accelerate DeepSpeed config (accelerate launch sets ACCELERATE_USE_DEEPSPEED)."""
    return args.deepspeed_plugin is not None or os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def fsdp_asked(args: "GRPOConfig") -> bool:
    """GRPOConfig.fsdp, or an accelerate FSDP config (accelerate launch sets ACCELERATE_USE_FSDP)."""
    return bool(args.fsdp_plugin_args) or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def fsdp_plugin_of(args: "GRPOConfig") -> FullyShardedDataParallelPlugin:
    """The FSDP plugin asked for: GRPOConfig's FSDP options, else the launch's (the plugin reads accelerate's
    FSDP_* variables)."""
    return FullyShardedDataParallelPlugin(**(args.fsdp_plugin_args or {}))


def fsdp2_asked_on_cpu(accelerator: Accelerator, args: "GRPOConfig") -> bool:
    return (
        accelerator.distributed_type == DistributedType.MULTI_CPU
        and fsdp_asked(args)
        and (fsdp_plugin_of(args).fsdp_version == 2)
    )


def shard_with_fsdp2(accelerator: Accelerator, args: "GRPOConfig") -> None:
    """Run accelerate's FSDP2 (fully_shard) over gloo on a CPU launch that asked for it.

    accelerate turns a launch into FSDP only on accelerators: on CPUs its type stays MULTI_CPU (DDP) with the
    plugin dropped (accelerate 1.15). FSDP2 itself runs on CPU over gloo, and accelerate's FSDP2 preparation,
    gradient clipping and state-dict gathering do too; switching the shared accelerator state to FSDP with the
    plugin is all it takes, so a CPU launch runs the same code as a GPU one. Both shared states: every
    AcceleratorState() copies the process state's type over its own.
    """
    plugin = fsdp_plugin_of(args)
    if accelerator.mixed_precision != "no":
        plugin.set_mixed_precision(accelerator.mixed_precision)
    PartialState().distributed_type = DistributedType.FSDP
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin


def sharding_asked_but_not_run(accelerator: Accelerator, args: "GRPOConfig") -> str | None:
    """The sharding ("FSDP version 1" or "DeepSpeed") a multi-process CPU launch asked for when accelerate chose DDP
    instead (its MULTI_CPU type never becomes FSDP; measured with accelerate 1.15 and the bundled configs; FSDP2 is
    switched on by shard_with_fsdp2, DeepSpeed by not telling accelerate cpu=True), else None."""
    if accelerator.distributed_type != DistributedType.MULTI_CPU:
        return None
    if fsdp_asked(args):
        return "FSDP version 1"
    if deepspeed_asked(args):  # e.g. use_cpu=True with a DeepSpeed config
        return "DeepSpeed"
    return None


def forget_single_process_accelerator_state() -> None:
    """Let this trainer choose its own precision and device after an earlier
    trainer (or PartialState()) in this process.

    accelerate keeps them in a process-wide shared state that refuses a different mixed_precision later, and
    offers no public way to reset it: `_reset_state` is the one private call grouprl makes into accelerate (no
    attribute is written by grouprl itself), made only in a single process, where nothing else shares that state.
    """
    AcceleratorState._reset_state(reset_partial_state=True)


def zero3_reference(model: torch.nn.Module, accelerator: Accelerator) -> torch.nn.Module:
    """The reference model under DeepSpeed ZeRO-3: in an inference engine of its own with the policy's ZeRO-3
    config, so that its weights are sharded like the policy's and gathered layer by layer in its forward (loaded
    under ZeRO-3, its parameters are empty shells outside an engine). Any other setup: the model as it is."""
    state = accelerator.state
    if state.distributed_type != DistributedType.DEEPSPEED or state.deepspeed_plugin.zero_stage != 3:
        return model
    import deepspeed

    config = {
        key: value
        for key, value in state.deepspeed_plugin.deepspeed_config.items()
        if key not in ("optimizer", "scheduler")  # never trained
    }
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()
    return engine
