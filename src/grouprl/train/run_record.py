"""One run, one record: a new run into an output_dir that holds an earlier run's record starts its own.

The record of a run is `metrics.jsonl` (every log entry) and `completions/` (the logged completion tables);
`grouprl report` reads them. Appending a new run to an earlier one's would mix the two (a report's "first -> last"
taking one number from each). So the first `train()` or `evaluate()` of a trainer that does not resume moves an
earlier record to `previous_runs/run-K/` (K = 1, 2, ...), with a warning saying where; nothing is deleted. A run
resumed from a checkpoint continues its record: the log history in the checkpoint replaces the file
(trainer_surface.py), so entries the interrupted run logged after its checkpoint do not appear twice.
Checkpoints stay where they are: each is complete on its own, and one of a higher step than the new run's is
named when the new run writes its own (checkpoint.py).
"""

from __future__ import annotations

import os
from typing import Optional

from transformers.utils import logging

logger = logging.get_logger("grouprl")

RECORD = ("metrics.jsonl", "completions")
PREVIOUS_RUNS = "previous_runs"


def set_earlier_record_aside(output_dir: str) -> Optional[str]:
    """Move an earlier run's record out of `output_dir` into previous_runs/run-K/; return that directory (None if
    there was no record). Call on the main process only."""
    present = [name for name in RECORD if os.path.exists(os.path.join(output_dir, name))]
    if not present:
        return None
    archive = os.path.join(output_dir, PREVIOUS_RUNS)
    number = 1
    while os.path.exists(os.path.join(archive, f"run-{number}")):
        number += 1
    target = os.path.join(archive, f"run-{number}")
    os.makedirs(target)
    for name in present:
        os.rename(os.path.join(output_dir, name), os.path.join(target, name))
    logger.warning(
        f"grouprl: {output_dir} held an earlier run's record ({', '.join(present)}); it is moved to {target} and "
        "this run starts its own, so the two never mix (grouprl report reads one run). To continue the earlier run "
        "instead, resume it: resume_from_checkpoint=True (or a checkpoint's path)."
    )
    return target
