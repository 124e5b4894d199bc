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
from typing import Any, Callable, Optional

import numpy as np
import torch
from transformers.utils import logging

from grouprl.model.adapters import active_adapter, is_peft_model, load_adapter_weights, save_pretrained
from grouprl.model.full_state import (
    OPTIMIZER_KEYED_BY_NAME,
    fsdp_sharded,
    load_full_optimizer_state,
    load_full_weights,
)
from grouprl.train.checkpoint_files import UnreadableCheckpoint, check_readable, load_json, load_pickle, read_file

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
    if not model_only:
        if engine_state is not None:
            optimizer_state, keys = None, ENGINE_STATE
        elif optimizer_state is not None:
            keys = OPTIMIZER_KEYED_BY_NAME
        else:
            optimizer_state, keys = optimizer.state_dict(), "positions"
    training = lambda: {  # noqa: E731
        "optimizer": optimizer_state,
        "optimizer_keys": keys,
        "scheduler": scheduler.state_dict(),
        "rng": rng if rng is not None else rng_state(),
    }
    in_staging = lambda name: os.path.join(staging, name)  # noqa: E731
    # each file of the checkpoint and its writer, in order (the marker last)
    writes = [("the model's weights", lambda: save_pretrained(model, staging, weights))]  # a LoRA policy: its adapter
    if tokenizer is not None:
        writes.append(("the tokenizer", lambda: tokenizer.save_pretrained(staging)))
    if engine_state is not None:
        writes.append((ENGINE_STATE, lambda: os.rename(engine_state, in_staging(ENGINE_STATE))))
    if not model_only:
        writes.append((TRAINING_STATE, lambda: torch.save(training(), in_staging(TRAINING_STATE))))
        writes.append((LOOP_STATE, lambda: torch.save(loop_state, in_staging(LOOP_STATE))))
    writes.append((TRAINER_STATE, lambda: trainer_state.save_to_json(in_staging(TRAINER_STATE))))
    if training_args is not None:
        writes.append((TRAINING_ARGS, lambda: torch.save(training_args, in_staging(TRAINING_ARGS))))
    writes.append(("(syncing to disk)", lambda: _fsync_tree(staging)))  # on disk before the marker claims it whole
    writes.append((COMPLETE_MARKER, lambda: open(in_staging(COMPLETE_MARKER), "w").close()))
    needed = lambda: state_bytes(model, weights, optimizer_state)  # noqa: E731
    write_all(staging, writes, f"checkpoint-{step}", output_dir, needed)
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


class SaveFailed(OSError):
    """A checkpoint or the model could not be written (a full disk, a read-only file system, ...). Its partial files
    are removed; the message names the file, the space needed and free, and the last complete checkpoint."""


def write_all(
    staging: str, writes: list[tuple[str, Callable[[], Any]]], what: str, output_dir: str, needed: Callable[[], int]
) -> None:
    """Run each (file, write) into `staging` in order; when one fails, remove `staging` and raise SaveFailed."""
    for name, write in writes:
        try:
            write()
        except Exception as err:  # noqa: BLE001 - torch's zip writer, safetensors and the OS each raise their own
            shutil.rmtree(staging, ignore_errors=True)
            free = shutil.disk_usage(output_dir).free if os.path.isdir(output_dir) else 0
            latest = latest_checkpoint(output_dir) if os.path.isdir(output_dir) else None
            raise SaveFailed(
                f"Writing {what} failed at {name} ({type(err).__name__}: {err}). It needs about {_mb(needed())} and "
                f"{_mb(free)} is free on the file system of {output_dir}. Its partial files are removed; "
                + (f"the last complete checkpoint is {latest}." if latest else "no complete checkpoint exists yet.")
                + " Free space (or point output_dir at a larger disk), then resume with resume_from_checkpoint=True."
            ) from err


MODEL_STAGING = ".tmp-model"
CONFIG_FILES = ("config.json", "adapter_config.json")  # moved last: a directory with one of them looks like a model


def save_model_files(
    output_dir: str, writes: Callable[[str], list[tuple[str, Callable[[], Any]]]], needed: Callable[[], int]
) -> None:
    """save_model's files, written whole or not at all: into output_dir/.tmp-model first (`writes(staging)`: the
    (file, write) list), then moved into output_dir one by one, the weights first and config.json last, so a failed
    write (SaveFailed) leaves whatever model was there before intact."""
    staging = os.path.join(output_dir, MODEL_STAGING)
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    write_all(staging, writes(staging), "the model", output_dir, needed)
    for name in sorted(os.listdir(staging), key=lambda n: n in CONFIG_FILES):
        target = os.path.join(output_dir, name)
        if os.path.isdir(target) and not os.path.islink(target):
            shutil.rmtree(target)
        os.replace(os.path.join(staging, name), target)
    os.rmdir(staging)
    _fsync_dir(output_dir)


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def state_bytes(model: torch.nn.Module, weights: Optional[dict], optimizer_state: Optional[dict]) -> int:
    """What a checkpoint's weights and optimizer state take on disk, about (the saved tensors' bytes)."""
    if weights is not None:
        tensors = list(weights.values())
    elif is_peft_model(model):
        tensors = [p for p in model.parameters() if p.requires_grad]
    else:
        tensors = list(model.state_dict().values())
    state = (optimizer_state or {}).get("state", {})
    tensors += [t for entry in state.values() for t in entry.values() if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


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


# what a resumed checkpoint is compared on (check_resumable)
MODEL_SHAPE = "model_type vocab_size hidden_size num_hidden_layers num_attention_heads num_key_value_heads".split()
MODEL_SHAPE += ["intermediate_size"]
BATCH_PLAN = "per_device_train_batch_size num_generations gradient_accumulation_steps steps_per_generation".split()
BATCH_PLAN += ["num_iterations", "generation_batch_size"]
SCHEDULE = "max_steps num_train_epochs learning_rate lr_scheduler_type warmup_steps seed beta loss_type".split()


def check_resumable(model: torch.nn.Module, config: Any, path: str) -> None:
    """Before any state loads: the checkpoint's model (its config.json, or a LoRA adapter's rank and targets) must be
    this run's, and its batch plan (training_args.bin) too, since its sampler position and buffered micro-batches are
    the plan's; raise ValueError saying what differs. Changed schedule fields are logged, as they take effect."""
    differs = _model_differences(model, path)
    if differs:
        raise ValueError(
            f"Checkpoint {path} is of another model than this run's ({'; '.join(differs)}): resume it with the model "
            "it was trained from, or start a new run (resume_from_checkpoint=False)."
        )
    saved_path = os.path.join(path, TRAINING_ARGS)
    if not os.path.exists(saved_path):  # written before grouprl kept the config in its checkpoints
        return
    saved = read_file(path, TRAINING_ARGS, load_pickle)
    changed = lambda names: [  # noqa: E731
        f"{n} {getattr(saved, n)!r} -> {getattr(config, n)!r}"
        for n in names
        if hasattr(saved, n) and getattr(saved, n) != getattr(config, n)
    ]
    plan = changed(BATCH_PLAN)
    if plan:
        raise ValueError(
            f"Checkpoint {path} was written with another batch plan ({', '.join(plan)}); its sampler position and "
            "buffered micro-batches belong to that plan. Resume with the checkpoint's values, or start a new run from "
            "its weights (model=<the checkpoint's path>, no resume_from_checkpoint)."
        )
    schedule = changed(SCHEDULE)
    if schedule:
        logger.warning(f"grouprl: resuming {path} with changed settings: {', '.join(schedule)}.")


def _model_differences(model: torch.nn.Module, path: str) -> list[str]:
    if is_peft_model(model):
        adapter = os.path.join(path, "adapter_config.json")
        if not os.path.exists(adapter):
            return ["it holds a full model, and this run trains a LoRA adapter"]
        saved = read_file(path, "adapter_config.json", load_json)
        ours = model.peft_config[active_adapter(model)]
        differs = [
            f"LoRA {k} {saved.get(k)!r} here {_plain(getattr(ours, k, None))!r}"
            for k in ("r", "target_modules")
            if k in saved and _plain(saved[k]) != _plain(getattr(ours, k, None))
        ]
        return differs
    if not os.path.exists(os.path.join(path, "config.json")):
        adapter_only = os.path.exists(os.path.join(path, "adapter_config.json"))
        return ["it holds a LoRA adapter, and this run trains the whole model"] if adapter_only else []
    saved = read_file(path, "config.json", load_json)
    saved = saved.get("text_config") or saved  # a vision-language model's shape is its text model's
    ours = model.config.get_text_config().to_dict()
    return [
        f"{k} {saved[k]!r} in the checkpoint, {ours.get(k)!r} here"
        for k in MODEL_SHAPE
        if k in saved and k in ours and saved[k] != ours[k]
    ]


def _plain(value: Any) -> Any:
    return sorted(value) if isinstance(value, (set, list, tuple)) else value
