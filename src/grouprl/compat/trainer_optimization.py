"""GRPOTrainer's optimization parts: how many optimizer steps, the optimizer and LR schedule that take them,
the TrainerState that counts them, and the entropy-bonus coefficient that adapts once per step."""

from __future__ import annotations

from typing import Any, Optional

import datasets
import torch
from transformers import Trainer, TrainerState, get_scheduler

from grouprl.config.grpo_config import BatchPlan, GRPOConfig, resolve_steps
from grouprl.core.entropy import EntropyController


def plan_steps(args: GRPOConfig, plan: BatchPlan, train_dataset: Any) -> tuple[int, Optional[int]]:
    """(total optimizer steps, steps per epoch or None for a stream)."""
    steps_per_epoch = None
    if not isinstance(train_dataset, datasets.IterableDataset):
        steps_per_epoch = plan.optimizer_steps_per_epoch(len(train_dataset))
    total_steps = (
        args.max_steps if args.max_steps > 0 else max(1, int(args.num_train_epochs * steps_per_epoch + 0.999999))
    )
    return total_steps, steps_per_epoch


def build_optimizer(
    model: torch.nn.Module, args: GRPOConfig, optimizers: tuple, total_steps: int
) -> tuple[torch.optim.Optimizer, Any]:
    """The user's (optimizer, scheduler), each defaulting to the one `args` names."""
    optimizer, scheduler = optimizers
    optimizer = optimizer or make_optimizer(model, args)
    scheduler = scheduler or get_scheduler(
        args.lr_scheduler_type,
        optimizer,
        num_warmup_steps=resolve_steps(args.warmup_steps, total_steps) if args.warmup_steps else 0,
        num_training_steps=total_steps,
        scheduler_specific_kwargs=args.lr_scheduler_kwargs or {},
    )
    return optimizer, scheduler


def make_optimizer(model: torch.nn.Module, args: GRPOConfig) -> torch.optim.Optimizer:
    """The optimizer `args.optim` names (any transformers name: adamw_torch, adafactor, adamw_8bit, sgd, ...),
    with transformers' own resolution of the name, `optim_args` and the Adam hyper-parameters."""
    optimizer_cls, optimizer_kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    # As transformers: no weight decay on biases and normalisation weights (the 1-D parameters).
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for _, p in trainable if p.ndim >= 2], "weight_decay": args.weight_decay},
        {"params": [p for _, p in trainable if p.ndim < 2], "weight_decay": 0.0},
    ]
    return optimizer_cls([g for g in groups if g["params"]], **optimizer_kwargs)


def make_trainer_state(args: GRPOConfig, total_steps: int, accelerator: Any) -> TrainerState:
    state = TrainerState(
        max_steps=total_steps,
        logging_steps=args.logging_steps,
        save_steps=args.save_steps,
        num_train_epochs=args.num_train_epochs,
        train_batch_size=args.per_device_train_batch_size,
    )
    state.is_local_process_zero = accelerator.is_local_main_process
    state.is_world_process_zero = accelerator.is_main_process
    return state


def build_entropy_controller(args: GRPOConfig) -> Optional[EntropyController]:
    if not args.entropy_bonus_enabled:
        return None
    return EntropyController(
        coef=args.entropy_coef,
        adaptive=args.use_adaptive_entropy,
        target=args.entropy_target,
        delta=args.entropy_coef_delta,
        coef_min=args.entropy_coef_min,
        coef_max=args.entropy_coef_max,
    )
