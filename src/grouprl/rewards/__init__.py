"""Reward functions: the call contract (`scoring`) and ready-made rewards, by name for the CLI."""

from ..demo.task import arithmetic_reward
from .scoring import RewardFunction, RewardFunctionError, prepare_reward_functions, reward_name, score_completions

# Names accepted by `grouprl train --reward_funcs NAME`.
BUILTIN_REWARDS = {"arithmetic_reward": arithmetic_reward}

__all__ = [
    "BUILTIN_REWARDS",
    "RewardFunction",
    "RewardFunctionError",
    "arithmetic_reward",
    "prepare_reward_functions",
    "reward_name",
    "score_completions",
]
