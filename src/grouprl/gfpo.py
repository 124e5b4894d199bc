"""Public import path kept for users: the code lives in grouprl.compat.gfpo."""

from grouprl.compat.gfpo import GFPOConfig, GFPOTrainer  # noqa: F401
