"""What grouprl does with each ``transformers.TrainingArguments`` field that ``GRPOConfig`` inherits.

``GRPOConfig`` subclasses ``TrainingArguments`` (as TRL's does), so every field exists with
transformers' default, and scripts, ``HfArgumentParser``, ``TrlParser`` and YAML configs accept it.
Each field is in exactly one of three groups:

- ``HONOURED``: the setting takes effect (the text says where);
- ``INERT``: accepted at any value because it does not change a GRPO run, under TRL either (flags
  for the user's own script, values set by launchers);
- ``REFUSED``: accepted at its default; any other value stops at construction with the reason and
  what to use instead, because grouprl does not do what it asks and ignoring it silently would
  train something other than what the user wrote.

A field that a newer transformers adds and this table does not know is refused when set (see
``refused_settings``). docs/trl-compat.md is written from these tables (``compat_table``, rendered
by ``compat_doc.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

HONOURED: dict[str, str] = {
    "output_dir": "checkpoints, metrics.jsonl, the final model",
    "per_device_train_batch_size": "completions per micro-batch per process (batch plan)",
    "per_device_eval_batch_size": "completions per evaluation batch per process",
    "gradient_accumulation_steps": "micro-batches per optimizer step",
    "num_train_epochs": "passes over the prompts (when max_steps <= 0)",
    "max_steps": "total optimizer steps",
    "learning_rate": "peak learning rate (TRL's default 1e-6)",
    "lr_scheduler_type": "transformers.get_scheduler",
    "lr_scheduler_kwargs": "transformers.get_scheduler",
    "warmup_steps": "scheduler warmup (a value < 1 is a fraction of the total)",
    "optim": "any transformers optimizer name, resolved by Trainer.get_optimizer_cls_and_kwargs",
    "optim_args": "passed to the optimizer, as transformers parses it",
    "optim_target_modules": "GaLore/APOLLO-style optimizers, through transformers' resolution",
    "weight_decay": "optimizer (not on biases and norm weights)",
    "adam_beta1": "optimizer",
    "adam_beta2": "optimizer",
    "adam_epsilon": "optimizer",
    "max_grad_norm": "gradient clipping (0 disables)",
    "bf16": "mixed precision (TRL's default True; declined on CPUs without native bf16, with a warning)",
    "fp16": "mixed precision",
    "tf32": "transformers enables/disables TF32 matmuls (needs an Ampere+ GPU when True)",
    "gradient_checkpointing": "activation checkpointing of the policy (TRL's default True)",
    "gradient_checkpointing_kwargs": "passed to gradient_checkpointing_enable",
    "activation_checkpointing": "transformers' new name of gradient_checkpointing",
    "activation_checkpointing_kwargs": "transformers' new name of gradient_checkpointing_kwargs",
    "torch_empty_cache_steps": "the accelerator's cache is emptied every N optimizer steps",
    "logging_strategy": "steps / epoch / no",
    "logging_steps": "log every N optimizer steps (TRL's default 10)",
    "logging_first_step": "also log after step 1",
    "log_level": "verbosity of transformers' and grouprl's loggers on the main process",
    "log_level_replica": "verbosity on the other processes",
    "log_on_each_node": "with log_level_replica, as transformers' get_process_log_level",
    "disable_tqdm": "progress bar",
    "report_to": "trackers through accelerate (tensorboard, wandb, trackio, mlflow, ...)",
    "run_name": "tracker run name",
    "project": "tracker project name (wandb, trackio)",
    "trackio_space_id": "passed to trackio.init",
    "eval_strategy": "no / steps / epoch; also where training ends, as Trainer's default flow (train/default_flow.py)",
    "eval_steps": "evaluate every N optimizer steps, and at the last step when it is not one of them",
    "eval_delay": "no scheduled evaluation before this many optimizer steps",
    "eval_on_start": "evaluate once before the first optimizer step",
    "save_strategy": (
        "no / steps / epoch / best; 'steps' also saves the last step, 'epoch' also where max_steps or a callback "
        "stops training inside an epoch, as Trainer's default flow"
    ),
    "save_steps": (
        "checkpoint every N optimizer steps (and the last step); each checkpoint holds training_args.bin, as Trainer's"
    ),
    "save_total_limit": "keep at most N checkpoints (the best one is kept when load_best_model_at_end)",
    "save_only_model": "checkpoints hold the model and trainer state only; such a checkpoint cannot be resumed",
    "load_best_model_at_end": "the checkpoint with the best metric_for_best_model is loaded after training",
    "metric_for_best_model": "state.best_metric / best_model_checkpoint; EarlyStoppingCallback reads it",
    "greater_is_better": "direction of metric_for_best_model",
    "restore_callback_states_from_checkpoint": (
        "a resume rebuilds the exportable callbacks (EarlyStoppingCallback's patience counter) and the control from "
        "the checkpoint's trainer_state.json, which always holds them"
    ),
    "push_to_hub": "the final model is pushed by push_to_hub() (the CLI calls it after training)",
    "hub_model_id": "repository of push_to_hub()",
    "hub_token": "token of push_to_hub()",
    "hub_private_repo": "push_to_hub() creates a private repository",
    "hub_revision": "branch push_to_hub() writes to",
    "seed": "model init, sampling, shuffling",
    "data_seed": "the prompt sampler's shuffling",
    "full_determinism": "transformers.enable_full_determinism(seed) at construction",
    "use_cpu": "train on the CPU even when an accelerator is present",
    "accelerator_config": (
        "dispatch_batches must not be True with an IterableDataset (it is set to False for one, as TRL)"
    ),
    "dataloader_num_workers": "worker processes of the prompt loader",
    "include_num_input_tokens_seen": (
        "every log entry gets num_input_tokens_seen (prompt + completion tokens, TRL's GRPO count: 'all' and "
        "'non_padding' alike, no padding counted), a training step's also train_tokens_per_second since train() began"
    ),
    "dataloader_prefetch_factor": "batches each prompt-loader worker reads ahead",
    "dataloader_persistent_workers": (
        "the prompt loaders' workers stay up from one epoch (training) or evaluation (each eval dataset) to the next"
    ),
    "dataloader_multiprocessing_context": "how the prompt loaders' workers are started (fork, spawn, forkserver)",
    "remove_unused_columns": "drop dataset columns the reward functions do not need (TRL's default False)",
    "resume_from_checkpoint": "read by `grouprl train`; pass it to train() from a script",
    "ddp_find_unused_parameters": "accelerate's DistributedDataParallelKwargs",
    "ddp_bucket_cap_mb": "accelerate's DistributedDataParallelKwargs",
    "ddp_broadcast_buffers": "accelerate's DistributedDataParallelKwargs",
    "ddp_static_graph": "accelerate's DistributedDataParallelKwargs",
    "ddp_backend": "accelerate's InitProcessGroupKwargs",
    "ddp_timeout": "accelerate's InitProcessGroupKwargs",
    "deepspeed": "a DeepSpeed JSON/dict: transformers builds the plugin, grouprl hands it to accelerate",
    "fsdp": "FSDP options: transformers builds the plugin arguments, grouprl hands them to accelerate",
    "fsdp_config": "with fsdp",
}

INERT: dict[str, str] = {
    "do_train": "a flag for your own script; the Trainer does not read it either",
    "do_eval": "a flag for your own script (set True by transformers when eval_strategy != 'no')",
    "do_predict": "a flag for your own script; the Trainer does not read it either",
    "local_rank": "set by launchers; accelerate reads the process rank from the environment",
    "dataloader_pin_memory": "prompts are token lists, not tensors: there is nothing to pin",
    "logging_nan_inf_filter": (
        "a non-finite loss stops the run with a clear error (and the last good state saved), "
        "so there is nothing to filter"
    ),
    "skip_memory_metrics": "transformers' default (True) skips them too; grouprl's run report records peak memory",
    "enable_jit_checkpoint": (
        "grouprl always checkpoints when SIGTERM or Ctrl-C (SIGINT) stops a run, at the end of the step in flight, "
        "and exits with 143 / 130 (docs/trustworthy_runs.md)"
    ),
}

REFUSED: dict[str, str] = {
    "average_tokens_across_devices": (
        "the loss normalisation is set by loss_type, as in TRL's GRPO; pick the loss_type that normalises as you want"
    ),
    "label_smoothing_factor": "GRPO has no labels to smooth",
    "bf16_full_eval": (
        "evaluation samples with the training model in its own precision; load the model in bf16 "
        "(model_init_kwargs={'dtype': 'bfloat16'}) instead"
    ),
    "fp16_full_eval": "evaluation samples with the training model in its own precision; load the model in fp16 instead",
    "torch_compile": (
        "grouprl's training pass swaps the LM head's and the attention's forward at run time (chunked LM-head "
        "logprobs, packed shared-prompt attention), which a compiled graph would not follow; leave it False"
    ),
    "torch_compile_backend": "see torch_compile",
    "torch_compile_mode": "see torch_compile",
    "use_liger_kernel": (
        "grouprl's chunked LM-head logprobs already keep the full logits out of memory (what Liger's fused GRPO loss "
        "is for), and Liger's Triton kernels need a GPU; leave it False"
    ),
    "liger_kernel_config": "see use_liger_kernel",
    "use_cache": "training runs without a KV cache; generation uses its own",
    "neftune_noise_alpha": "NEFTune adds embedding noise for supervised fine-tuning; it does not apply to GRPO",
    "auto_find_batch_size": (
        "halving the batch on out-of-memory would split num_generations groups (TRL refuses it too); lower "
        "per_device_train_batch_size instead"
    ),
    "trackio_bucket_id": "not passed to trackio by grouprl yet; set it in trackio's own environment variables",
    "trackio_static_space_id": "not passed to trackio by grouprl yet; set it in trackio's own environment variables",
    "prediction_loss_only": "GRPO evaluation samples and scores completions; it runs no prediction loop",
    "eval_do_concat_batches": "GRPO evaluation runs no prediction loop",
    "eval_use_gather_object": "GRPO evaluation runs no prediction loop",
    "eval_accumulation_steps": "GRPO evaluation runs no prediction loop",
    "include_for_metrics": (
        "GRPO evaluation has no compute_metrics; use reward functions (log_metric) for extra metrics"
    ),
    "batch_eval_metrics": "GRPO evaluation has no compute_metrics",
    "save_on_each_node": "checkpoints are written by the main process to one shared output_dir",
    "hub_strategy": (
        "grouprl pushes the final model only (push_to_hub() after training, hub_strategy='end'); checkpoints are not "
        "pushed during training"
    ),
    "hub_always_push": "see hub_strategy",
    "ignore_data_skip": (
        "resume restores the prompt sampler's exact position; starting the data again would repeat prompts"
    ),
    "parallelism_config": (
        "tensor/context/sequence parallelism is not supported (TRL refuses context and sequence parallelism too); use "
        "fsdp or deepspeed"
    ),
    "dataloader_drop_last": (
        "prompts are drawn a whole generation at a time; an incomplete last generation is never drawn"
    ),
    "dataloader_in_order": "the prompt loader always keeps the sampler's order (resume depends on it)",
    "label_names": "GRPO has no labels",
    "train_sampling_strategy": "prompts are shuffled or not by shuffle_dataset",
    "length_column_name": "prompts are not grouped by length",
    "debug": "transformers' debug options (underflow/overflow detection, TPU metrics) are not wired",
}

# Refused fields GRPOConfig accepts and GRPOTrainer refuses when it is built (`refusal`): where TRL raises about them,
# so that a script (or TRL's own tests) building such a config first gets the error from the trainer, as with TRL.
REFUSED_BY_TRAINER = frozenset({"use_liger_kernel"})

# grouprl fields that stand in for TrainingArguments fields older transformers versions have.
COMPAT_ALIASES = {
    "logging_dir": "tracker log directory (transformers < 5 field; default output_dir/runs)",
    "warmup_ratio": "warmup as a fraction of total steps (transformers < 5 field; sets warmup_steps)",
}


def refused_settings(config: Any) -> list[str]:
    """Messages for every TrainingArguments field set away from its default that grouprl refuses.

    A field that transformers has and no table here names is refused too: nobody has checked what
    grouprl would do with it.
    """
    from transformers import TrainingArguments

    messages = []
    for spec in dataclasses.fields(TrainingArguments):
        name = spec.name
        if name in HONOURED or name in INERT or name in REFUSED_BY_TRAINER or not spec.init:
            continue
        value, default = getattr(config, name), _default(spec)
        if not _same(value, default):
            messages.append(refusal(name, value, default))
    return messages


def refusal(name: str, value: Any, default: Any) -> str:
    """The error for TrainingArguments field `name` set to `value`: the reason, and the default to leave it at."""
    reason = REFUSED.get(
        name, "grouprl does not know this TrainingArguments field (newer transformers?), so it cannot honour it"
    )
    return (
        f"GRPOConfig.{name}={value!r} is not supported by grouprl: {reason}. Leave {name} at its default ({default!r})."
    )


def _default(spec: dataclasses.Field) -> Any:
    if spec.default is not dataclasses.MISSING:
        return spec.default
    if spec.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return spec.default_factory()  # type: ignore[misc]
    return None


def _same(value: Any, default: Any) -> bool:
    # transformers turns strings into enums and "" into [] in __post_init__; compare what they mean.
    # HfArgumentParser hands Union[str, bool] fields over as False, and debug as None.
    if value == default:
        return True
    nothing = (None, False, "", "no")
    return default in nothing and (value in nothing or (isinstance(value, (list, tuple)) and not value))


def compat_table(config_cls: Any) -> list[tuple[str, str, str]]:
    """(field, status, note) for every field of `config_cls`, in declaration order."""
    rows = []
    for spec in dataclasses.fields(config_cls):
        if not spec.init:
            continue
        name = spec.name
        if name in HONOURED:
            rows.append((name, "honoured", HONOURED[name]))
        elif name in INERT:
            rows.append((name, "accepted, no effect", INERT[name]))
        elif name in REFUSED:
            when = " (refused when GRPOTrainer is built, as TRL checks it there)" if name in REFUSED_BY_TRAINER else ""
            rows.append((name, "refused unless default", REFUSED[name] + when))
        elif name in COMPAT_ALIASES:
            rows.append((name, "honoured", COMPAT_ALIASES[name]))
        else:
            rows.append((name, "GRPO field", (spec.metadata or {}).get("help", "")))
    return rows
