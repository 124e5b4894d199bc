"""What a run leaves in its output directory: the metrics.jsonl log entries and the logged completions."""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from typing import Any, Optional

COMPLETION_ROWS = 4  # rows shown per logged completion table


@dataclass
class RunLog:
    train: list[dict[str, Any]]  # training log entries, one per logged step
    evals: list[dict[str, Any]]
    final: Optional[dict[str, Any]]  # train_runtime, train_loss, ... (absent while training runs or after a crash)
    unreadable: int  # lines that are not JSON (a line cut short by a kill)
    earlier_runs: int = 0  # runs appended before this one, left out (a new run now starts its own file: run_record.py)


def read_metrics(output_dir: str) -> RunLog:
    path = os.path.join(output_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path} does not exist: point grouprl report at the output_dir of a grouprl training run "
            "(it writes metrics.jsonl at every logging step)."
        )
    by_step: dict[int, dict[str, Any]] = {}
    log = RunLog([], [], None, 0)
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                log.unreadable += 1
                continue
            step = entry.get("step")
            if isinstance(step, int) and by_step and step <= min(by_step) < max(by_step):
                # back to the first step: a new run appended to an earlier one's record (a resume goes back to a
                # later step, whose entries replace the repeated ones below); only the last run is read
                log.earlier_runs += 1
                by_step, log.evals, log.final = {}, [], None
            if "train_runtime" in entry:
                log.final = entry
            elif any(key.startswith("eval_") for key in entry):
                log.evals.append(entry)
            else:
                by_step[entry.get("step", len(by_step))] = entry  # a repeated step (older resumes): the last one counts
    log.train = [by_step[step] for step in sorted(by_step)]
    return log


def read_completions(output_dir: str, rows: int = COMPLETION_ROWS) -> list[dict[str, Any]]:
    """The first `rows` rows of the first, middle and last completion tables (log_completions=True)."""
    files = sorted(glob.glob(os.path.join(output_dir, "completions", "completions_*.parquet")))
    if not files:
        return []
    import pyarrow.parquet as pq

    picked = list(dict.fromkeys([files[0], files[len(files) // 2], files[-1]]))
    return [row for path in picked for row in pq.read_table(path).slice(0, rows).to_pylist()]
