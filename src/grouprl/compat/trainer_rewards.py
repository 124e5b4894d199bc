"""The reward functions GRPOTrainer scores with, loaded (reward models too) and prepared, under TRL's attribute
names (their sources were checked before any model loaded: trainer_inputs.collect_reward_sources)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from grouprl.config.grpo_config import GRPOConfig
from grouprl.rewards.models import load_reward_functions
from grouprl.rewards.scoring import prepare_reward_functions

if TYPE_CHECKING:
    from grouprl.compat.trainer import GRPOTrainer


def load_rewards(
    trainer: "GRPOTrainer", args: GRPOConfig, reward_funcs: list, reward_processing_classes: Any, weights: list[float]
) -> None:
    """Set the trainer's ``reward_functions`` (grouprl's, what scoring calls) and TRL's ``reward_funcs``,
    ``reward_func_names``, ``reward_weights`` and ``reward_processing_classes``."""
    trainer.reward_functions = prepare_reward_functions(
        load_reward_functions(
            reward_funcs,
            reward_processing_classes,
            model_init_kwargs=args.model_init_kwargs,
            trust_remote_code=args.trust_remote_code,
            chat_template_kwargs=args.chat_template_kwargs,
            batch_size=args.per_device_train_batch_size,
            device=trainer.accelerator.device,
        )
    )
    trainer.reward_funcs = [f.fn for f in trainer.reward_functions]
    trainer.reward_func_names = [f.name for f in trainer.reward_functions]
    # TRL's attributes: the weights as a tensor, and each reward model's tokenizer (None for a function)
    trainer.reward_weights = torch.tensor(weights, dtype=torch.float32)
    trainer.reward_processing_classes = [
        getattr(f, "tokenizer", None) if hasattr(f, "model") else None for f in trainer.reward_funcs
    ]
