"""Reading a checkpoint's files, with the checkpoint and the file named when one cannot be read.

A file cut short (a full disk, a copy interrupted) or changed after saving makes torch answer "PytorchStreamReader
failed reading zip archive", naming neither the file nor the checkpoint. Here every file is read through
``read_file``, which raises ``UnreadableCheckpoint`` naming both. ``check_readable`` reads what a resume needs
before anything is loaded into the model (the pickles memory-mapped, safetensors files by their header), so
``resume_from_checkpoint=True`` can skip a damaged newest checkpoint for the previous one (checkpoint.py) instead of
stopping half-way through restoring it.
"""

from __future__ import annotations

import json
import os
import pickle
import types
from typing import Any, Callable, Union

import torch


class UnreadableCheckpoint(ValueError):
    """A checkpoint file exists (or should) but cannot be read."""

    def __init__(self, path: str, name: str, cause: Union[BaseException, str]):
        self.path, self.name = path, name
        if isinstance(cause, BaseException):
            first_line = (str(cause).strip().splitlines() or [""])[0][:300]
            cause = f"{type(cause).__name__}: {first_line}" if first_line else type(cause).__name__
        self.reason = cause
        super().__init__(
            f"Checkpoint {path} cannot be loaded: its file {name} cannot be read ({self.reason}). The file is damaged "
            "or incomplete (a full disk, a copy cut short, a change after saving). Resume from an earlier checkpoint "
            "(resume_from_checkpoint=<its checkpoint-N directory>, or True, which skips unreadable checkpoints), or "
            "restore the file."
        )

    def __reduce__(self) -> tuple:  # survives pickling (a message between processes)
        return type(self), (self.path, self.name, self.reason)


def read_file(path: str, name: str, read: Callable[[str], Any]) -> Any:
    """`read(path/name)`, any failure raised as UnreadableCheckpoint naming the checkpoint and the file."""
    try:
        return read(os.path.join(path, name))
    except Exception as err:
        raise UnreadableCheckpoint(path, name, err) from err


# The modules a class pickled in loop_state.pt lived in before it moved (modules merged by job), and where it lives
# now: a checkpoint written by an earlier grouprl still resumes.
MOVED_MODULES = {
    "grouprl.data.generation_inputs": "grouprl.data.prompt_sampler",  # GenerationInputs: the buffered inputs
    "grouprl.core.group_layout": "grouprl.core.types",  # GroupLayout: in the asynchronous book's prompt batches
}


class _MovedClassesUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        return super().find_class(MOVED_MODULES.get(module, module), name)


_pickle_with_moves = types.ModuleType("grouprl_checkpoint_pickle")  # pickle, with the moved classes found
_pickle_with_moves.__dict__.update({**vars(pickle), "Unpickler": _MovedClassesUnpickler})


def load_pickle(file: str, mmap: bool = False) -> Any:
    return torch.load(file, map_location="cpu", weights_only=False, mmap=mmap, pickle_module=_pickle_with_moves)


def load_json(file: str) -> Any:
    with open(file, encoding="utf-8") as handle:
        return json.load(handle)


def _pickle_opens(file: str) -> None:
    try:
        load_pickle(file, mmap=True)  # the archive and the pickle are read, the tensors' bytes are not
    except Exception:
        load_pickle(file)  # a file system without mmap: read it all; a damaged file fails here too


def _safetensors_header(file: str) -> None:
    from safetensors import safe_open

    with safe_open(file, framework="pt") as handle:  # checks that the header's tensors cover the file exactly
        handle.keys()


def check_readable(path: str, pickles: tuple[str, ...], json_files: tuple[str, ...]) -> None:
    """Read the checkpoint's files that exist, cheaply: pickles memory-mapped (their tensors are not read), JSON
    parsed, safetensors headers checked against the file sizes. Raises UnreadableCheckpoint."""
    for name in pickles:
        if os.path.exists(os.path.join(path, name)):
            read_file(path, name, _pickle_opens)
    for name in json_files:
        if os.path.exists(os.path.join(path, name)):
            read_file(path, name, load_json)
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            read_file(path, name, _safetensors_header)
