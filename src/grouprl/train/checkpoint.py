"""Checkpoints that survive a crash and resume exactly.

A checkpoint is ``output_dir/checkpoint-{step}/`` holding the model and tokenizer
(`from_pretrained`-loadable), optimizer and scheduler state, every RNG state, the trainer state
(global step, log history) and the loop state (sampler position, the not-yet-used micro-batches
of the current generation). It is written into a temporary directory, its files are flushed to
disk, and the directory is renamed into place, so a kill (or a power cut) at any moment leaves the
previous checkpoints intact; only directories holding the completion marker count as checkpoints.
Rotation (save_total_limit) runs only after the new checkpoint is complete, never deletes it (even
when checkpoints of higher steps exist, e.g. after resuming from an older one), and removes old
ones by renaming them away first, so a kill mid-delete leaves no half-deleted checkpoint behind.
Leftover staging directories of a killed save are removed by the next save.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from typing import Any, Optional

import numpy as np
import torch
from transformers.utils import logging

from grouprl.model.adapters import is_peft_model, load_adapter_weights, save_pretrained
from grouprl.model.full_state import (
    OPTIMIZER_KEYED_BY_NAME,
    fsdp_sharded,
    load_full_optimizer_state,
    load_full_weights,
)
from grouprl.train.checkpoint_files import UnreadableCheckpoint, check_readable, load_pickle, read_file

logger = logging.get_logger("grouprl")

CHECKPOINT_PATTERN = re.compile(r"^checkpoint-(\d+)$")
LOOP_STATE = "loop_state.pt"
TRAINING_STATE = "training_state.pt"
TRAINER_STATE = "trainer_state.json"
TRAINING_ARGS = "training_args.bin"  # the run's GRPOConfig, pickled, as transformers' Trainer writes it
COMPLETE_MARKER = "checkpoint_complete"
STAGING_PREFIX = ".tmp-checkpoint-"
DELETING_PREFIX = ".deleting-checkpoint-"
ENGINE_STATE = "deepspeed"  # DeepSpeed's own checkpoint of its shards, inside a grouprl checkpoint
ENGINE_STAGING_PREFIX = ".deepspeed-checkpoint-"


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def list_checkpoints(output_dir: str) -> list[str]:
    """Complete checkpoints in `output_dir`, oldest first."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        match = CHECKPOINT_PATTERN.match(name)
        path = os.path.join(output_dir, name)
        if match and os.path.exists(os.path.join(path, COMPLETE_MARKER)):
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def latest_checkpoint(output_dir: str) -> Optional[str]:
    checkpoints = list_checkpoints(output_dir)
    return checkpoints[-1] if checkpoints else None


def resolve_resume_path(resume_from_checkpoint: Any, output_dir: str) -> Optional[str]:
    """True / 'true' -> newest complete checkpoint in output_dir whose files can be read (an unreadable one is
    skipped with a warning); a path -> that path, checked (UnreadableCheckpoint names a damaged file)."""
    if resume_from_checkpoint in (None, False, "", "false", "False"):
        return None
    if resume_from_checkpoint in (True, "true", "True"):
        checkpoints = list_checkpoints(output_dir)
        if not checkpoints:
            raise ValueError(
                f"resume_from_checkpoint=True but {output_dir!r} holds no complete checkpoint-* directory."
            )
        skipped = []
        for path in reversed(checkpoints):
            try:
                check_readable(path, (TRAINING_STATE, LOOP_STATE), (TRAINER_STATE,))
                return path
            except UnreadableCheckpoint as err:
                skipped.append(f"{path} ({err.name}: {err.reason})")
                logger.warning(
                    f"resume_from_checkpoint=True: skipping {path}: its file {err.name} cannot be read "
                    f"({err.reason}); trying the checkpoint before it."
                )
        raise ValueError(
            f"resume_from_checkpoint=True but no checkpoint in {output_dir!r} can be read: {'; '.join(skipped)}. "
            "Restore the damaged files, or start a new run (resume_from_checkpoint=False)."
        )
    path = str(resume_from_checkpoint)
    if not os.path.exists(os.path.join(path, COMPLETE_MARKER)):
        raise ValueError(
            f"resume_from_checkpoint={path!r} is not a complete grouprl checkpoint (no {COMPLETE_MARKER} file in it)."
        )
    check_readable(path, (TRAINING_STATE, LOOP_STATE), (TRAINER_STATE,))
    return path


def save_checkpoint(
    output_dir: str,
    step: int,
    *,
    model: torch.nn.Module,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    trainer_state: Any,
    loop_state: dict[str, Any],
    save_total_limit: Optional[int] = None,
    rng: Optional[dict[str, Any]] = None,
    model_only: bool = False,
    keep: Optional[str] = None,
    full_state: Optional[tuple[dict[str, Any], Optional[dict[str, Any]]]] = None,
    engine_state: Optional[str] = None,
    training_args: Any = None,
) -> str:
    """Write checkpoint-{step} atomically and rotate old ones; return its path.

    `rng`: the RNG states to store (default: the current ones); the last-good-state save after a
    NaN passes those from the start of the failed step. `model_only` (save_only_model): the model,
    tokenizer and trainer state only, which cannot be resumed. `keep`: a checkpoint rotation spares
    (the best one, with load_best_model_at_end). `full_state`: the gathered (weights, optimizer state) of a
    sharded policy (full_state.gather_full_state), written instead of the model's and optimizer's shards.
    `engine_state`: a directory where DeepSpeed wrote its checkpoint (every process its shards of the optimizer
    state), moved into this one as `deepspeed/`; the optimizer's state is then only there.
    """
    final = os.path.join(output_dir, f"checkpoint-{step}")
    staging = os.path.join(output_dir, f"{STAGING_PREFIX}{step}")
    os.makedirs(output_dir, exist_ok=True)
    for name in os.listdir(output_dir):  # one writer: any staging / deleting directory is a killed save's leftover
        if name.startswith((STAGING_PREFIX, DELETING_PREFIX, ENGINE_STAGING_PREFIX)) and not (
            engine_state and os.path.samefile(os.path.join(output_dir, name), engine_state)
        ):
            shutil.rmtree(os.path.join(output_dir, name), ignore_errors=True)
    os.makedirs(staging)
    weights, optimizer_state = full_state or (None, None)
    save_pretrained(model, staging, weights)  # a LoRA policy writes its adapter only
    if tokenizer is not None:
        tokenizer.save_pretrained(staging)
    if engine_state is not None:
        os.rename(engine_state, os.path.join(staging, ENGINE_STATE))
    if not model_only:
        if engine_state is not None:
            optimizer_state, keys = None, ENGINE_STATE
        elif optimizer_state is not None:
            keys = OPTIMIZER_KEYED_BY_NAME
        else:
            optimizer_state, keys = optimizer.state_dict(), "positions"
        torch.save(
            {
                "optimizer": optimizer_state,
                "optimizer_keys": keys,
                "scheduler": scheduler.state_dict(),
                "rng": rng if rng is not None else rng_state(),
            },
            os.path.join(staging, TRAINING_STATE),
        )
        torch.save(loop_state, os.path.join(staging, LOOP_STATE))
    trainer_state.save_to_json(os.path.join(staging, TRAINER_STATE))
    if training_args is not None:
        torch.save(training_args, os.path.join(staging, TRAINING_ARGS))
    _fsync_tree(staging)  # on disk before the marker and the rename claim the checkpoint is complete
    open(os.path.join(staging, COMPLETE_MARKER), "w").close()
    _fsync_dir(staging)
    if os.path.exists(final):  # a re-save of the same step replaces it
        _remove(final)
    os.rename(staging, final)
    _fsync_dir(output_dir)
    later = [path for path in list_checkpoints(output_dir) if _step(path) > step]
    if later:
        logger.warning(
            "%s has a higher step than the checkpoint-%d just written (left by an earlier run?); "
            "resume_from_checkpoint=True resumes from the highest step.",
            os.path.basename(later[-1]),
            step,
        )
    if save_total_limit is not None:
        others = [path for path in list_checkpoints(output_dir) if path != final]  # oldest first
        spared = [path for path in others if keep is not None and os.path.abspath(path) == os.path.abspath(keep)]
        others = [path for path in others if path not in spared]
        for path in others[: max(len(others) - (save_total_limit - 1 - len(spared)), 0)]:
            _remove(path)
    return final


def load_model_weights(model: torch.nn.Module, path: str) -> None:
    """Load a checkpoint's (full) model weights into `model`.

    Through transformers' own loader, because `save_pretrained` writes some models' weights under
    their original checkpoint names (vision-language models among them: ``visual.*`` for
    ``model.visual.*``), which only `from_pretrained` maps back. Loaded in fp32, so every saved value,
    bf16 or fp32 (an fp32 LM head), is copied into the model exactly.
    """
    saved = type(model).from_pretrained(path, dtype=torch.float32)
    if fsdp_sharded(model):
        load_full_weights(model, saved.state_dict())
        return
    missing, unexpected = model.load_state_dict(saved.state_dict(), strict=False)
    if missing or unexpected:
        raise ValueError(
            f"Checkpoint {path} does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}."
        )


def load_policy_weights(model: torch.nn.Module, path: str) -> None:
    """A checkpoint's weights into the policy: the adapter of a LoRA policy, else the whole model."""
    check_readable(path, (), ())  # a damaged weights file is named (UnreadableCheckpoint), before any is loaded
    if is_peft_model(model):
        load_adapter_weights(model, path)
    else:
        load_model_weights(model, path)


def load_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, training: dict[str, Any]) -> None:
    """A checkpoint's optimizer state: keyed by parameter position (`optimizer.state_dict()`), or by name when a
    sharded policy's was gathered. (DeepSpeed's is in its own checkpoint: trainer_surface loads it.)"""
    if training.get("optimizer_keys") == ENGINE_STATE:
        raise ValueError(
            "This checkpoint was written under DeepSpeed: its optimizer state is in DeepSpeed's shards (deepspeed/); "
            "resume it under DeepSpeed with the same number of processes."
        )
    if training.get("optimizer_keys") == OPTIMIZER_KEYED_BY_NAME:
        load_full_optimizer_state(model, optimizer, training["optimizer"])
    else:
        optimizer.load_state_dict(training["optimizer"])


def load_training_state(path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(optimizer/scheduler/rng state, loop state) of a checkpoint."""
    if not os.path.exists(os.path.join(path, TRAINING_STATE)):
        raise ValueError(
            f"Checkpoint {path} holds the model only (written with save_only_model=True): no optimizer, scheduler, "
            "sampler or RNG state, so training cannot resume from it. Load its weights with from_pretrained and "
            "start a new run, or train with save_only_model=False to write resumable checkpoints."
        )
    return read_file(path, TRAINING_STATE, load_pickle), read_file(path, LOOP_STATE, load_pickle)


def _step(path: str) -> int:
    return int(CHECKPOINT_PATTERN.match(os.path.basename(path)).group(1))


def _remove(path: str) -> None:
    """Delete a checkpoint: rename it away first, so it is either whole or gone."""
    parent, name = os.path.split(path)
    doomed = os.path.join(parent, DELETING_PREFIX + name[len("checkpoint-") :])
    os.rename(path, doomed)
    _fsync_dir(parent)
    shutil.rmtree(doomed, ignore_errors=True)


def _fsync_tree(path: str) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as handle:
                os.fsync(handle.fileno())


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
