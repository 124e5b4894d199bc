"""config: the settings every stage may read (GRPOConfig, its checks, the batch plan, the combination table).

``from grouprl.config import GRPOConfig`` keeps working; the class lives in ``grouprl.config.grpo_config``.
"""

from grouprl.config.batch_plan import BatchPlan, plan_batches, resolve_steps
from grouprl.config.checks import NOT_YET_BUILT, no_accelerator
from grouprl.config.grpo_config import GRPOConfig

__all__ = [
    "NOT_YET_BUILT",
    "BatchPlan",
    "GRPOConfig",
    "no_accelerator",
    "plan_batches",
    "resolve_steps",
]
