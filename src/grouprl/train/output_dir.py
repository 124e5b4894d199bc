"""output_dir, checked when the trainer is built: before any model loads, not at the first save.

Checkpoints, metrics.jsonl, the completion tables and the final model are written there, so it must be a directory
that exists and is writable, or one that can be created (its nearest existing parent is a writable directory).
Nothing is created by the check.
"""

from __future__ import annotations

import os


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
