"""GRPOConfig's checks: every field that can be checked without the model or the process count.

A setting that is invalid raises ValueError naming the field and what to do; a field whose feature is not
built yet raises NotImplementedError when set (``NOT_YET_BUILT``); settings that run but probably do not
do what was meant are returned as warnings (``dubious_combinations``). Combinations of features that need
the model, the dataset or the trainer's arguments are checked by ``combinations.py`` at construction.
"""

from __future__ import annotations

import difflib
from dataclasses import fields
from typing import Any, Optional

import torch

from grouprl.config.async_checks import check_async_fields
from grouprl.config.grpo_fields import GRPOFields
from grouprl.core.advantages import ADVANTAGE_ESTIMATORS
from grouprl.core.losses import LOSSES

SCALE_REWARDS = ("group", "batch", "none")
SAVE_STRATEGIES = ("no", "steps", "epoch", "best")
EVAL_STRATEGIES = ("no", "steps", "epoch")

# field -> (the value that means "off", what the feature is). Setting any other value raises
# NotImplementedError until the feature lands; the entry is then removed.
NOT_YET_BUILT: dict[str, tuple[Any, str]] = {}


def validate_config(config: GRPOFields) -> None:
    """Check every field that can be checked without knowing the model or the process count."""
    for check in (
        _check_registered_names,
        _check_choices,
        _check_sizes_and_sampling,
        _check_schedule_and_logging,
        _check_objective,
        _check_batching,
        check_not_yet_built,
        check_async_fields,
    ):
        check(config)


def _check_registered_names(config: GRPOFields) -> None:
    """The loss and the advantage estimator are looked up in their registries (register_loss / register_advantage)."""
    if config.loss_type not in LOSSES:
        raise ValueError(
            f"GRPOConfig.loss_type={config.loss_type!r} is not one of {', '.join(map(repr, LOSSES))}; "
            "add your own with grouprl.register_loss(name, objective, aggregate) before building the config."
        )
    spec = LOSSES[config.loss_type]
    own = sorted(set(spec.params) - set(spec.config_fields))  # the others come from their config fields
    for name in sorted(config.loss_kwargs or {}):
        if name in spec.config_fields:  # effective_epsilon_high: the epsilon_high field
            field_name = spec.config_fields[name].removeprefix("effective_")
            raise ValueError(
                f"GRPOConfig.loss_kwargs: {name!r} of loss_type={config.loss_type!r} comes from GRPOConfig.{field_name}"
                "; set that field instead."
            )
        if name not in own:
            raise ValueError(
                f"GRPOConfig.loss_kwargs: loss_type={config.loss_type!r} has no hyper-parameter {name!r}; its "
                f"hyper-parameters are {own or 'none'} (register_loss(..., params=...))."
            )
    if config.advantage_estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"GRPOConfig.advantage_estimator={config.advantage_estimator!r} is not one of "
            f"{', '.join(map(repr, ADVANTAGE_ESTIMATORS))}; add your own with grouprl.register_advantage(name, fn)."
        )


def _check_choices(config: GRPOFields) -> None:
    check_choice("importance_sampling_level", config.importance_sampling_level, ("token", "sequence"))
    check_choice(
        "multi_objective_aggregation", config.multi_objective_aggregation, ("sum_then_normalize", "normalize_then_sum")
    )
    check_choice("save_strategy", config.save_strategy, SAVE_STRATEGIES)
    check_choice("eval_strategy", config.eval_strategy, EVAL_STRATEGIES)
    check_choice("vllm_mode", config.vllm_mode, ("colocate", "server"))
    check_choice(
        "generation_engine", config.generation_engine, ("auto", "engine", "captured", "transformers", "server")
    )
    if config.compile_decode_step and (config.use_vllm or config.generation_engine not in ("auto", "captured")):
        engine = "use_vllm=True" if config.use_vllm else f"generation_engine={config.generation_engine!r}"
        raise ValueError(
            f"GRPOConfig.compile_decode_step=True compiles the captured decode loop's step, which {engine} does not "
            "run; set generation_engine='captured' (or 'auto' on CUDA), or leave compile_decode_step unset."
        )
    check_choice("generation_server_weight_transfer", config.generation_server_weight_transfer, ("http", "broadcast"))
    if config.generation_server_retries < 0 or config.vllm_server_timeout <= 0:
        raise ValueError("GRPOConfig: generation_server_retries must be >= 0 and vllm_server_timeout > 0 (seconds).")
    check_choice(
        "vllm_importance_sampling_mode",
        config.vllm_importance_sampling_mode,
        ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"),
    )


def _check_sizes_and_sampling(config: GRPOFields) -> None:
    if config.num_generations < 2:
        raise ValueError(
            f"GRPOConfig.num_generations={config.num_generations}: GRPO needs at least 2 completions per prompt "
            "to compare them (advantages are relative to the group). Use num_generations >= 2, e.g. 8."
        )
    for name in (
        "per_device_train_batch_size",
        "per_device_eval_batch_size",
        "gradient_accumulation_steps",
        "num_iterations",
        "max_completion_length",
    ):
        if getattr(config, name) < 1:
            raise ValueError(f"GRPOConfig.{name}={getattr(config, name)} must be >= 1.")
    if config.max_tool_calling_iterations is not None and config.max_tool_calling_iterations < 0:
        raise ValueError(
            f"GRPOConfig.max_tool_calling_iterations={config.max_tool_calling_iterations} must be >= 0 (None = no "
            "limit)."
        )
    if config.steps_per_generation is not None and config.steps_per_generation < 1:
        raise ValueError(f"GRPOConfig.steps_per_generation={config.steps_per_generation} must be >= 1.")
    if config.temperature <= 0:
        raise ValueError(
            f"GRPOConfig.temperature={config.temperature} must be > 0 (training logprobs are divided by it)."
        )
    if not 0.0 < config.top_p <= 1.0:
        raise ValueError(f"GRPOConfig.top_p={config.top_p} must be in (0, 1].")
    if config.top_k < 0:
        raise ValueError(f"GRPOConfig.top_k={config.top_k} must be >= 0 (0 disables top-k).")
    if config.epsilon < 0 or (config.epsilon_high is not None and config.epsilon_high < 0):
        raise ValueError("GRPOConfig.epsilon and epsilon_high must be >= 0.")


def _check_schedule_and_logging(config: GRPOFields) -> None:
    if config.num_train_epochs <= 0 and config.max_steps <= 0:
        raise ValueError("GRPOConfig: set num_train_epochs > 0 or max_steps > 0; as given, training would run 0 steps.")
    if config.bf16 and config.fp16:
        raise ValueError("GRPOConfig: bf16 and fp16 are both True; pick one mixed-precision mode.")
    if config.save_total_limit is not None and config.save_total_limit < 1:
        raise ValueError(f"GRPOConfig.save_total_limit={config.save_total_limit} must be >= 1 or None.")
    if config.logging_steps <= 0:
        raise ValueError(f"GRPOConfig.logging_steps={config.logging_steps} must be > 0.")
    if config.save_strategy == "steps" and config.save_steps <= 0:
        raise ValueError(f"GRPOConfig.save_steps={config.save_steps} must be > 0 with save_strategy='steps'.")
    if config.log_completions_hub_repo is not None and not config.log_completions:
        raise ValueError("GRPOConfig.log_completions_hub_repo requires log_completions=True.")


def _check_objective(config: GRPOFields) -> None:
    lo, hi = config.vllm_importance_sampling_clip_min, config.vllm_importance_sampling_clip_max
    if lo is not None and hi is not None and lo >= hi:
        raise ValueError(
            f"GRPOConfig: vllm_importance_sampling_clip_min ({lo}) must be < vllm_importance_sampling_clip_max ({hi})."
        )
    if config.vllm_importance_sampling_mode.endswith("truncate") and lo is None and hi is None:
        raise ValueError(
            f"GRPOConfig.vllm_importance_sampling_mode={config.vllm_importance_sampling_mode!r} clips the importance "
            "weights: set vllm_importance_sampling_clip_min and/or vllm_importance_sampling_clip_max."
        )
    if not 0.0 <= config.top_entropy_quantile <= 1.0:
        raise ValueError(
            f"GRPOConfig.top_entropy_quantile={config.top_entropy_quantile} must be in [0, 1] (1 keeps every token)."
        )
    if config.entropy_coef_min > config.entropy_coef_max:
        raise ValueError(
            f"GRPOConfig.entropy_coef_min ({config.entropy_coef_min}) must be <= entropy_coef_max "
            f"({config.entropy_coef_max})."
        )
    if config.sapo_temperature_pos <= 0 or config.sapo_temperature_neg <= 0:
        raise ValueError("GRPOConfig.sapo_temperature_pos and sapo_temperature_neg must be > 0.")
    if config.delta is not None and config.delta <= 0:
        raise ValueError(f"GRPOConfig.delta={config.delta} must be > 0 (it caps the ratio; suggested > 1 + epsilon).")
    if config.off_policy_mask_threshold is not None and config.off_policy_mask_threshold < 0:
        raise ValueError(f"GRPOConfig.off_policy_mask_threshold={config.off_policy_mask_threshold} must be >= 0.")
    if config.sync_ref_model and config.beta == 0.0:
        raise ValueError(
            "GRPOConfig.sync_ref_model=True needs a reference model, but beta=0.0 means none is used. Set beta > 0 "
            "(e.g. 0.04) or sync_ref_model=False."
        )
    if config.ref_model_sync_steps < 1 or not 0.0 <= config.ref_model_mixup_alpha <= 1.0:
        raise ValueError("GRPOConfig: ref_model_sync_steps must be >= 1 and ref_model_mixup_alpha in [0, 1].")


def _check_batching(config: GRPOFields) -> None:
    check_choice("save_failure", config.save_failure, ("stop", "continue"))
    if config.reward_timeout is not None and not config.reward_timeout > 0:
        raise ValueError(
            f"GRPOConfig.reward_timeout={config.reward_timeout} must be a number of seconds > 0, or None for no limit."
        )
    if config.max_dynamic_sampling_rounds < 0:
        raise ValueError(f"GRPOConfig.max_dynamic_sampling_rounds={config.max_dynamic_sampling_rounds} must be >= 0.")
    if config.reward_weights is not None and not all(isinstance(w, (int, float)) for w in config.reward_weights):
        raise ValueError(f"GRPOConfig.reward_weights must be a list of numbers, got {config.reward_weights!r}.")
    if config.accelerator_config is not None and getattr(config.accelerator_config, "split_batches", False):
        raise ValueError(
            "GRPOConfig.accelerator_config.split_batches=True would split each process's batch across processes and "
            "break num_generations groups; leave split_batches=False and set per_device_train_batch_size instead."
        )


def check_not_yet_built(config: GRPOFields) -> None:
    """A field whose feature is not built is refused when set to anything but its "off" value."""
    for name, (off_value, feature) in NOT_YET_BUILT.items():
        if getattr(config, name) != off_value:
            raise NotImplementedError(
                f"GRPOConfig.{name}={getattr(config, name)!r}: {feature} is not available in this version of grouprl "
                f"yet. Leave {name} at its default ({config.__dataclass_fields__[name].default!r})."
            )


def dubious_combinations(config: GRPOFields) -> list[str]:
    """Warnings for settings that run but probably do not do what was meant (TRL's, plus a few)."""
    found = []
    sequence = config.importance_sampling_level == "sequence"
    if config.loss_type == "luspo" and not sequence:
        found.append(
            "loss_type='luspo' is meant for importance_sampling_level='sequence'; with 'token' each token's loss "
            "is multiplied by its sequence length."
        )
    if config.loss_type == "vespo" and sequence:
        found.append(
            "loss_type='vespo' computes its own sequence-level weight from token log-ratios; "
            "importance_sampling_level='sequence' only changes the logged ratios. Use 'token'."
        )
    if sequence and config.loss_type in ("bnpo", "dr_grpo", "dapo", "cispo"):
        found.append(
            f"importance_sampling_level='sequence' with loss_type={config.loss_type!r}: this loss sums per-token "
            "terms, which weights each sequence by its completion length instead of optimising the per-sequence "
            "objective. GSPO uses loss_type='grpo'."
        )
    if config.loss_type == "cispo" and config.epsilon_high is None:
        found.append(
            f"loss_type='cispo' caps the importance weight at epsilon_high (an absolute value), which is unset and "
            f"falls back to epsilon={config.epsilon}, so every weight is capped below 1. MiniMax-M1 suggests "
            "epsilon_high=5.0."
        )
    if config.delta is not None and config.delta <= 1.0 + config.effective_epsilon_high:
        found.append(
            f"delta={config.delta} is not above 1 + epsilon_high ({1.0 + config.effective_epsilon_high}): it caps "
            "ratios inside the trust region too. INTELLECT-2 suggests a delta above 1 + epsilon_high."
        )
    if config.use_adaptive_entropy and not config.entropy_coef_min <= config.entropy_coef <= config.entropy_coef_max:
        found.append(
            f"entropy_coef={config.entropy_coef} is outside [entropy_coef_min, entropy_coef_max]; the adaptive "
            "controller will move it back inside."
        )
    return found


def check_choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(
            f"GRPOConfig.{name}={getattr(value, 'value', value)!r} is not one of {', '.join(map(repr, choices))}."
        )


def normalize_scale_rewards(value: Any) -> str:
    aliases = {True: "group", False: "none", "true": "group", "false": "none", "True": "group", "False": "none"}
    value = aliases.get(value, value) if isinstance(value, (bool, str)) else value
    if value not in SCALE_REWARDS:
        raise ValueError(
            f"GRPOConfig.scale_rewards={value!r} must be one of 'group' (or True), 'batch', 'none' (or False)."
        )
    return value


def normalize_pad_to_multiple_of(value: Any) -> Optional[int]:
    # "auto" means 128 on AWS Neuron in TRL, which grouprl does not target: no padding. An integer pads the training
    # batch (rollout/train_batch.py) and every training forward's widths (model/logprobs.py), as TRL pads its batch.
    if value is None or (isinstance(value, str) and value.lower() in ("auto", "none", "null")):
        return None
    try:
        multiple = int(value)
    except (TypeError, ValueError):
        raise ValueError(
            f"GRPOConfig.pad_to_multiple_of={value!r} must be a positive integer, 'auto' or 'none'."
        ) from None
    if multiple < 1:
        raise ValueError(f"GRPOConfig.pad_to_multiple_of={value!r} must be a positive integer.")
    return multiple


# Fields of older TRL releases that scripts still pass: what replaced each (docs/troubleshooting.md says the same).
REMOVED_FIELDS = {
    "max_prompt_length": (
        "TRL 1.16's GRPOConfig has no max_prompt_length, nor grouprl's: prompts are never truncated. Drop the field; "
        "shorten or drop long prompts in the dataset instead (dataset.filter on their token count). A prompt that "
        "leaves no room for max_completion_length in the model's context is named before training."
    ),
}


def unknown_field_message(cls: type, name: str) -> str:
    """`name` is not a field of `cls`: the message names the closest real field(s), or what replaced a field of an
    older TRL."""
    if name in REMOVED_FIELDS:
        return f"{cls.__name__} has no field {name!r}: {REMOVED_FIELDS[name]}"
    candidates = [f.name for f in fields(cls) if f.init]
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.75)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return (
        f"{cls.__name__} has no field {name!r}.{hint} Every field is listed by `grouprl train --help` and in "
        "docs/trl-compat.md."
    )


def no_accelerator() -> bool:
    """True when torch sees no accelerator (CUDA, XPU, MPS, ...): training runs on the CPU."""
    current = getattr(torch, "accelerator", None)
    return current.current_accelerator() is None if current is not None else not torch.cuda.is_available()
