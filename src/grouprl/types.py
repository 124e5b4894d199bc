"""Public import path kept for users: the code lives in grouprl.core.types."""

from grouprl.core.types import *  # noqa: F401,F403
