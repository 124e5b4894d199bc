"""Public import path kept for users: the code lives in grouprl.compat.trainer."""

from grouprl.compat.trainer import GRPOTrainer  # noqa: F401
