"""An output_dir belongs to one run: checked when the trainer is built, locked while it trains, and an earlier run's
files set aside when a new (not resumed) run starts there.

- `check_output_dir`: before any model loads, not at the first save. Checkpoints, metrics.jsonl, the completion
  tables and the final model are written there, so it must be a writable directory, or one that can be created (its
  nearest existing parent is a writable directory). Nothing is created by the check.
- `RunLock`: a second live run into the same directory would interleave its metrics.jsonl with the first's and
  overwrite its checkpoints. While `train()` runs, the main process holds `.grouprl-run.lock` (host, pid, start time)
  and touches it every `REFRESH_S`; another run refuses to start while the holder lives (same host: its pid exists;
  another host: the file was touched within `STALE_AFTER_S`), and takes over, with a warning, the lock of one that
  is gone.
- `set_earlier_run_aside`: the record of a run is `metrics.jsonl` (every log entry) and `completions/` (the logged
  completion tables), which `grouprl report` reads, and its checkpoints. A new run appending to or overwriting an
  earlier one's would mix the two (a report taking one number from each; a later `resume_from_checkpoint=True`
  resuming the earlier run's latest checkpoint). So the first `train()` or `evaluate()` of a trainer that does not
  resume moves them to `previous_runs/run-K/` (K = 1, 2, ...), with a warning saying where; nothing is deleted. A
  resumed run continues its record: the log history in the checkpoint replaces the file (trainer_surface.py).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from typing import Optional

from transformers.utils import logging

from grouprl.train.checkpoint import CHECKPOINT_PATTERN, DELETING_PREFIX, STAGING_PREFIX

logger = logging.get_logger("grouprl")

RECORD = ("metrics.jsonl", "completions")
PREVIOUS_RUNS = "previous_runs"
LOCK = ".grouprl-run.lock"
REFRESH_S = 30.0  # the holder touches its lock this often
STALE_AFTER_S = 300.0  # a lock from another host untouched this long is a dead run's


def check_output_dir(output_dir: str) -> None:
    """Raise ValueError naming output_dir and why nothing could be written into it."""
    path = os.path.abspath(output_dir)
    where = f"GRPOConfig.output_dir={output_dir!r}"
    if os.path.isdir(path):
        if not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(
                f"{where}: the directory {path} is not writable (permission denied or a read-only file system); "
                "checkpoints, metrics.jsonl and the model are written there. Choose an output_dir you can write to, "
                "or fix its permissions."
            )
        return
    if os.path.exists(path):
        raise ValueError(
            f"{where} is a file, not a directory: checkpoints, metrics.jsonl and the model are written into a "
            f"directory at that path. Choose another output_dir, or move the file {path} away."
        )
    parent = os.path.dirname(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ValueError(
            f"{where} cannot be created: {parent} is a file, not a directory. Choose another output_dir, or move the "
            "file away."
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(
            f"{where} cannot be created: its parent directory {parent} is not writable (permission denied or a "
            "read-only file system). Choose an output_dir you can write to, or fix the permissions."
        )


class OutputDirInUse(RuntimeError):
    """Another live run holds the output_dir's lock."""


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class RunLock:
    """The output_dir's lock, held by the main process for one `train()` call (module docstring)."""

    def __init__(self, output_dir: str):
        self.output_dir = output_dir
        self.path = os.path.join(output_dir, LOCK)
        self.owner = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        self._stop = threading.Event()
        self._toucher: Optional[threading.Thread] = None

    def holder(self) -> Optional[dict]:
        """The lock's holder if it is a live run other than this process; None when free, stale or ours."""
        try:
            with open(self.path, encoding="utf-8") as f:
                held = json.load(f)
            touched = os.path.getmtime(self.path)
        except FileNotFoundError:
            return None
        except (OSError, ValueError):  # half-written by a run that died while writing it
            return None
        host, pid = held.get("host"), held.get("pid")
        if host == self.owner["host"]:
            alive = isinstance(pid, int) and pid != os.getpid() and _process_exists(pid)
        else:
            alive = time.time() - touched < STALE_AFTER_S
        if alive:
            return held
        if not (host == self.owner["host"] and pid == os.getpid()):
            logger.warning(
                f"grouprl: {self.output_dir} was locked by a run that is gone (process {pid} on {host}, started "
                f"{held.get('started')}); this run takes the lock over."
            )
        return None

    def acquire(self) -> None:
        os.makedirs(self.output_dir, exist_ok=True)
        held = self.holder()
        if held is not None:
            raise OutputDirInUse(
                f"GRPOConfig.output_dir={self.output_dir!r} is in use by a run still going: process {held.get('pid')} "
                f"on {held.get('host')}, started {held.get('started')} (lock file {self.path}). Two runs in one "
                "output_dir would mix their metrics.jsonl and overwrite each other's checkpoints: choose another "
                "output_dir, or wait for that run to end (or stop it)."
            )
        staging = f"{self.path}.{os.getpid()}"
        with open(staging, "w", encoding="utf-8") as f:
            json.dump(self.owner, f)
        os.replace(staging, self.path)
        self._stop.clear()
        self._toucher = threading.Thread(target=self._touch, name="grouprl-run-lock", daemon=True)
        self._toucher.start()

    def _touch(self) -> None:
        while not self._stop.wait(REFRESH_S):
            try:
                os.utime(self.path)
            except OSError:  # removed or unreachable: the next acquire by anyone decides
                pass

    def release(self) -> None:
        self._stop.set()
        if self._toucher is not None:
            self._toucher.join(timeout=5)
            self._toucher = None
        try:
            with open(self.path, encoding="utf-8") as f:
                ours = json.load(f) == self.owner
        except (OSError, ValueError):
            return
        if ours:
            try:
                os.remove(self.path)
            except OSError:  # a read-only file system now: the lock reads as a dead run's to whoever comes next
                pass


def set_earlier_run_aside(
    output_dir: str, *, record: bool, checkpoints: bool, into: Optional[str] = None
) -> Optional[str]:
    """Move an earlier run's record (`record`) and checkpoints (`checkpoints`) out of `output_dir` into
    previous_runs/run-K/, or into `into` (where its record went already); return that directory (None if there was
    nothing). Call on the main process only."""
    names = sorted(os.listdir(output_dir)) if os.path.isdir(output_dir) else []
    present = [n for n in RECORD if record and n in names] + [
        n
        for n in names
        if checkpoints and (CHECKPOINT_PATTERN.match(n) or n.startswith((STAGING_PREFIX, DELETING_PREFIX)))
    ]
    if not present:
        return into
    target = into
    if target is None:
        archive, number = os.path.join(output_dir, PREVIOUS_RUNS), 1
        while os.path.exists(os.path.join(archive, f"run-{number}")):
            number += 1
        target = os.path.join(archive, f"run-{number}")
    os.makedirs(target, exist_ok=True)
    for name in present:
        os.rename(os.path.join(output_dir, name), os.path.join(target, name))
    logger.warning(
        f"grouprl: {output_dir} held an earlier run's files ({', '.join(present)}); they are moved to {target} and "
        "this run starts its own, so the two never mix (grouprl report reads one run; resume_from_checkpoint=True "
        f"finds this run's checkpoints). To continue the earlier run instead, resume from its checkpoint in {target}."
    )
    return target
