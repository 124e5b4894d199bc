"""grouprl: GRPO-family reinforcement learning for language models, drop-in compatible with TRL.

from grouprl import GRPOConfig, GRPOTrainer   # instead of: from trl import ...
"""

from grouprl._version import __version__
from grouprl.compat.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
from grouprl.compat.gfpo import GFPOConfig, GFPOTrainer
from grouprl.compat.trainer import GRPOTrainer
from grouprl.config.grpo_config import BatchPlan, GRPOConfig, plan_batches
from grouprl.core.advantages import register_advantage
from grouprl.core.losses import register_loss
from grouprl.generation import RemoteGenerator, ServerError
from grouprl.report.writer import write_report
from grouprl.rewards.scoring import RewardFunctionError
from grouprl.train.non_finite import NonFiniteError

__all__ = [
    "AsyncGRPOConfig",
    "AsyncGRPOTrainer",
    "BatchPlan",
    "GFPOConfig",
    "GFPOTrainer",
    "GRPOConfig",
    "GRPOTrainer",
    "NonFiniteError",
    "RemoteGenerator",
    "RewardFunctionError",
    "ServerError",
    "plan_batches",
    "register_advantage",
    "register_loss",
    "write_report",
    "__version__",
]
