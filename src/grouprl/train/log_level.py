"""TrainingArguments' ``log_level`` / ``log_level_replica`` / ``log_on_each_node``, applied as the Trainer does.

transformers' Trainer sets its library's verbosity from them; grouprl also logs under "grouprl", which
that does not reach, so the same level goes there too, and a run with ``log_level="info"`` shows
grouprl's INFO lines (the batch plan at start, for one). ``"passive"`` (the default) leaves both
loggers as the script configured them.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from transformers.utils import logging as transformers_logging


def apply_log_level(args: Any) -> None:
    """Set transformers' and the "grouprl" logger's level for this process (``args.get_process_log_level()``)."""
    level = args.get_process_log_level()  # log_level on the main process (of each node), log_level_replica elsewhere
    transformers_logging.set_verbosity(level)
    if args.log_level == "passive" and args.log_level_replica == "warning":
        return
    logger = logging.getLogger("grouprl")
    logger.setLevel(level)
    if not logger.handlers and not logging.getLogger().handlers:
        # Nothing configured: Python's last-resort handler would drop everything below WARNING.
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[%(levelname)s|%(name)s] %(message)s"))
        logger.addHandler(handler)
