"""grouprl: GRPO-family reinforcement learning for language models, drop-in compatible with TRL.

    from grouprl import GRPOConfig, GRPOTrainer   # instead of: from trl import ...
"""

from .algorithms.advantages import register_advantage
from .algorithms.losses import register_loss
from .config import BatchPlan, GRPOConfig, plan_batches
from .generation import RemoteGenerator, ServerError
from .gfpo import GFPOConfig, GFPOTrainer
from .health import NonFiniteError
from .report import write_report
from .rewards.scoring import RewardFunctionError
from .trainer import GRPOTrainer

__version__ = "0.1.0"

__all__ = [
    "BatchPlan", "GFPOConfig", "GFPOTrainer", "GRPOConfig", "GRPOTrainer", "NonFiniteError", "RemoteGenerator", "RewardFunctionError",
    "ServerError", "plan_batches", "register_advantage", "register_loss", "write_report", "__version__",
]
