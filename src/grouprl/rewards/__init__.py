"""Reward functions: the call contract (`scoring`), reward models (`models`), ready-made rewards (`builtins`).

``BUILTIN_REWARDS`` holds the names ``grouprl train --reward_funcs NAME`` accepts, TRL's names
with TRL's settings: ``accuracy_reward``, ``reasoning_accuracy_reward``, ``think_format_reward``,
``get_soft_overlong_punishment`` (built with max_completion_len=1280, soft_punish_cache=256, as
``trl grpo`` does). ``CONFIGURED_REWARDS`` adds the two factories TRL's CLI cannot name, built
from the run's config: ``get_cosine_scaled_reward`` (max_len = max_completion_length) and
``get_repetition_penalty_reward`` (its defaults: 3-grams, max_penalty -1).
"""

from typing import Any, Callable

from grouprl.rewards.arithmetic import arithmetic_reward
from grouprl.rewards.builtins import (
    accuracy_reward,
    get_cosine_scaled_reward,
    get_repetition_penalty_reward,
    get_soft_overlong_punishment,
    reasoning_accuracy_reward,
    think_format_reward,
)
from grouprl.rewards.scoring import (
    RewardFunction,
    RewardFunctionError,
    prepare_reward_functions,
    reward_name,
    score_completions,
)

BUILTIN_REWARDS: dict[str, Callable] = {
    "accuracy_reward": accuracy_reward,
    "reasoning_accuracy_reward": reasoning_accuracy_reward,
    "think_format_reward": think_format_reward,
    "get_soft_overlong_punishment": get_soft_overlong_punishment(max_completion_len=1280, soft_punish_cache=256),
    "arithmetic_reward": arithmetic_reward,
}

CONFIGURED_REWARDS: dict[str, Callable[[Any], Callable]] = {
    "get_cosine_scaled_reward": lambda config: get_cosine_scaled_reward(max_len=config.max_completion_length),
    "get_repetition_penalty_reward": lambda config: get_repetition_penalty_reward(),
}

__all__ = [
    "BUILTIN_REWARDS",
    "CONFIGURED_REWARDS",
    "RewardFunction",
    "RewardFunctionError",
    "accuracy_reward",
    "arithmetic_reward",
    "get_cosine_scaled_reward",
    "get_repetition_penalty_reward",
    "get_soft_overlong_punishment",
    "prepare_reward_functions",
    "reasoning_accuracy_reward",
    "reward_name",
    "score_completions",
    "think_format_reward",
]
