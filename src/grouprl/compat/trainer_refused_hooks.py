"""The methods of TRL's GRPOTrainer (and of transformers.Trainer under it) that grouprl never calls.

A subclass that defines one is refused when the class is defined (OverridePoints.__init_subclass__, in
trainer_hooks.py), with the grouprl extension point to use instead: an override is never silently skipped.
"""

from __future__ import annotations

_GENERATION = (
    "grouprl samples through a GenerationBackend: pass generation_backend=... (grouprl.generation.protocol), "
    "a rollout_func, or override _generate (honoured)"
)
_TOOLS = (
    "tool calls run in grouprl.agents (tools=, environment_factory=); for your own multi-turn loop pass a "
    "rollout_func or override _generate (honoured)"
)
_DATA = (
    "grouprl draws the prompts with grouprl.data.prompts.PromptSampler (shuffle_dataset, data_seed): order, "
    "filter or repeat the rows of the dataset you pass instead"
)
_EVAL = (
    "evaluation (grouprl.train.evaluation) runs through _prepare_inputs and compute_loss, which are honoured: "
    "override those, evaluate(), or use TrainerCallback.on_evaluate"
)
_CHECKPOINT = (
    "checkpoints are written and restored by grouprl.train.checkpoint (model, optimizer, scheduler, sampler "
    "position, buffered batches, RNG); add your own files from a TrainerCallback.on_save"
)
_OPTIMIZER = "pass optimizers=(optimizer, lr_scheduler) to GRPOTrainer (either may be None for the default)"
_LOOP = (
    "the loop is grouprl.train.loop.train: use TrainerCallback events, or override training_step / log / "
    "compute_loss (honoured)"
)
_LOSS = (
    "losses are grouprl.core.losses (loss_type and its settings): override _compute_loss (honoured) to change "
    "the objective"
)
_REWARD_LOGGING = (
    "reward functions' log_extra / log_metric write to grouprl's completion table and metric window: override log "
    "(honoured) to change what gets logged"
)
_PRECISION = (
    "mixed precision is accelerate's autocast (bf16 / fp16 in GRPOConfig); wrap your own code in "
    "trainer.accelerator.autocast()"
)

# Methods of TRL's GRPOTrainer / transformers.Trainer that grouprl does not call -> what to use instead.
UNSUPPORTED_OVERRIDES: dict[str, str] = {
    "_generate_single_turn": _GENERATION,
    "_move_model_to_vllm": _GENERATION,
    "_sync_fsdp_params_to_vllm": _GENERATION,
    "_tokenize_prompts": "prompts are tokenized by grouprl (chat template, chat_template_kwargs): pre-render them in "
    "the dataset or override _generate (honoured), which receives the raw prompts",
    "_tool_call_loop": _TOOLS,
    "_get_tool_suffix_ids": _TOOLS,
    "get_train_dataloader": _DATA,
    "_get_train_sampler": _DATA,
    "get_eval_dataloader": _DATA,
    "_get_eval_sampler": _DATA,
    "get_test_dataloader": _DATA,
    "_set_signature_columns_if_needed": _DATA,
    "_remove_unused_columns": _DATA,
    "prediction_step": _EVAL,
    "evaluation_loop": _EVAL,
    "prediction_loop": _EVAL,
    "_save_checkpoint": _CHECKPOINT,
    "_save_optimizer_and_scheduler": _CHECKPOINT,
    "_save_rng_state": _CHECKPOINT,
    "_load_from_checkpoint": _CHECKPOINT,
    "_load_optimizer_and_scheduler": _CHECKPOINT,
    "_load_rng_state": _CHECKPOINT,
    "_rotate_checkpoints": _CHECKPOINT,
    "create_optimizer": _OPTIMIZER,
    "create_scheduler": _OPTIMIZER,
    "create_optimizer_and_scheduler": _OPTIMIZER,
    "get_decay_parameter_names": _OPTIMIZER,
    "_inner_training_loop": _LOOP,
    "_maybe_log_save_evaluate": _LOOP,
    "optimizer_step": _LOOP,
    "floating_point_ops": "grouprl counts 6 x trained tokens x non-embedding parameters into state.total_flos",
    "get_gamma_weights": _LOSS,
    "_log_completion_extra": _REWARD_LOGGING,
    "_log_metric": _REWARD_LOGGING,
    "compute_loss_context_manager": _PRECISION,
    "autocast_smart_context_manager": _PRECISION,
    "_wrap_model": "accelerate prepares the model (DDP / FSDP / DeepSpeed from the accelerate config and GRPOConfig)",
}


def refuse_unsupported_overrides(cls: type) -> None:
    """Raise TypeError if `cls` itself defines a method grouprl never calls, naming what to use instead."""
    refused = [name for name in UNSUPPORTED_OVERRIDES if name in vars(cls)]
    if refused:
        reasons = "\n".join(f"  - {name}: {UNSUPPORTED_OVERRIDES[name]}." for name in refused)
        raise TypeError(
            f"{cls.__name__} overrides {', '.join(refused)}, which grouprl's GRPOTrainer never calls, so the "
            f"override would be silently skipped. Use instead:\n{reasons}"
        )
