"""TrainingArguments' ``log_level`` / ``log_level_replica`` applied to grouprl's own logger.

transformers' Trainer sets its library's verbosity from them; grouprl logs under "grouprl", which
that does not reach. So a run with ``log_level="info"`` shows grouprl's INFO lines too (the batch
plan at start, for one). ``"passive"`` (the default) leaves the logger as the script configured it.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR, "critical": logging.CRITICAL}


def apply_log_level(args: Any, is_main_process: bool) -> None:
    """Set the "grouprl" logger's level from args (log_level on the main process, log_level_replica elsewhere)."""
    chosen = getattr(args, "log_level" if is_main_process else "log_level_replica", "passive")
    if chosen in (None, "passive"):
        return
    if chosen not in LEVELS:
        raise ValueError(f"GRPOConfig.{'log_level' if is_main_process else 'log_level_replica'}={chosen!r} is not one of "
                         f"{', '.join(map(repr, ['passive', *LEVELS]))}.")
    logger = logging.getLogger("grouprl")
    logger.setLevel(LEVELS[chosen])
    if not logger.handlers and not logging.getLogger().handlers:
        # Nothing configured: Python's last-resort handler would drop everything below WARNING.
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[%(levelname)s|%(name)s] %(message)s"))
        logger.addHandler(handler)
