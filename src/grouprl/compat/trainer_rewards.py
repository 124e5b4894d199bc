"""The reward functions GRPOTrainer scores with, loaded (reward models too) and prepared, under TRL's attribute
names (their sources were checked before any model loaded: trainer_inputs.collect_reward_sources)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from grouprl.config.grpo_config import GRPOConfig
from grouprl.rewards.models import load_reward_functions
from grouprl.rewards.scoring import RewardFunction, prepare_reward_functions


@dataclass(frozen=True)
class RewardParts:
    """The loaded reward functions: grouprl's (what scoring calls) and TRL's attributes of them."""

    reward_functions: list[RewardFunction]  # grouprl's, what scoring calls
    reward_funcs: list[Any]  # TRL's: each function, or reward model
    reward_func_names: list[str]
    reward_weights: torch.Tensor  # (F,) float32
    reward_processing_classes: list[Any]  # each reward model's tokenizer, None for a function


def load_rewards(
    args: GRPOConfig, reward_funcs: list, reward_processing_classes: Any, weights: list[float], device: torch.device
) -> RewardParts:
    """Load the reward functions (reward models too, on `device`) and prepare them for scoring."""
    functions = prepare_reward_functions(
        load_reward_functions(
            reward_funcs,
            reward_processing_classes,
            model_init_kwargs=args.model_init_kwargs,
            trust_remote_code=args.trust_remote_code,
            chat_template_kwargs=args.chat_template_kwargs,
            batch_size=args.per_device_train_batch_size,
            device=device,
        )
    )
    funcs = [f.fn for f in functions]
    return RewardParts(
        reward_functions=functions,
        reward_funcs=funcs,
        reward_func_names=[f.name for f in functions],
        reward_weights=torch.tensor(weights, dtype=torch.float32),
        reward_processing_classes=[getattr(f, "tokenizer", None) if hasattr(f, "model") else None for f in funcs],
    )
