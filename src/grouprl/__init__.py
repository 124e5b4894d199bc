"""grouprl: GRPO-family reinforcement learning for language models, drop-in compatible with TRL.

from grouprl import GRPOConfig, GRPOTrainer   # instead of: from trl import ...

The names below are imported on first use (PEP 562): importing a part of grouprl (`grouprl serve`'s server, the
command line, `grouprl report`) does not import the trainer, transformers' Trainer and peft with it. On a 2-core
AVX2 CPU, `grouprl --help` took 11.7 s before and 0.04 s after, and a `grouprl serve` worker's imports 10.8 s and 7.3 s.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from grouprl._version import __version__

_HOMES = {
    "AsyncGRPOConfig": "grouprl.compat.async_grpo",
    "AsyncGRPOTrainer": "grouprl.compat.async_grpo",
    "BatchPlan": "grouprl.config.grpo_config",
    "DataRowError": "grouprl.data.prompts",
    "GFPOConfig": "grouprl.compat.gfpo",
    "GFPOTrainer": "grouprl.compat.gfpo",
    "GRPOConfig": "grouprl.config.grpo_config",
    "GRPOTrainer": "grouprl.compat.trainer",
    "NonFiniteError": "grouprl.train.non_finite",
    "OutputDirInUse": "grouprl.train.output_dir",
    "RemoteGenerator": "grouprl.generation",
    "RewardFunctionError": "grouprl.rewards.scoring",
    "SaveFailed": "grouprl.train.checkpoint",
    "ServerError": "grouprl.generation",
    "plan_batches": "grouprl.config.grpo_config",
    "register_advantage": "grouprl.core.advantages",
    "register_loss": "grouprl.core.losses",
    "write_report": "grouprl.report.writer",
}

__all__ = [
    "AsyncGRPOConfig",
    "AsyncGRPOTrainer",
    "BatchPlan",
    "DataRowError",
    "GFPOConfig",
    "GFPOTrainer",
    "GRPOConfig",
    "GRPOTrainer",
    "NonFiniteError",
    "OutputDirInUse",
    "RemoteGenerator",
    "RewardFunctionError",
    "SaveFailed",
    "ServerError",
    "plan_batches",
    "register_advantage",
    "register_loss",
    "write_report",
    "__version__",
]

if TYPE_CHECKING:
    from grouprl.compat.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from grouprl.compat.gfpo import GFPOConfig, GFPOTrainer
    from grouprl.compat.trainer import GRPOTrainer
    from grouprl.config.grpo_config import BatchPlan, GRPOConfig, plan_batches
    from grouprl.core.advantages import register_advantage
    from grouprl.core.losses import register_loss
    from grouprl.data.prompts import DataRowError
    from grouprl.generation import RemoteGenerator, ServerError
    from grouprl.report.writer import write_report
    from grouprl.rewards.scoring import RewardFunctionError
    from grouprl.train.checkpoint import SaveFailed
    from grouprl.train.non_finite import NonFiniteError
    from grouprl.train.output_dir import OutputDirInUse


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'grouprl' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # the next lookup finds it without this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
