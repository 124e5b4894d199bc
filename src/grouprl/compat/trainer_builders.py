"""The parts GRPOTrainer's constructor assembles, each built by one function (the checks of its arguments,
which come first, are in trainer_inputs.py).

``GRPOTrainer.__init__`` calls them in order; the order is the order of its error messages (the
config, the feature combinations, the dataset and the rewards are checked before any model is
loaded) and of the random draws (the seed is set right before the policy is loaded).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import datasets
import torch
from accelerate.utils import set_seed
from transformers import PreTrainedModel, Trainer, TrainerState, enable_full_determinism, get_scheduler
from transformers.utils import logging

from grouprl.agents import AgentSpec
from grouprl.agents.environments import EMPTY_PROMPT
from grouprl.agents.multiturn import TurnSettings
from grouprl.config.combinations import check_combinations
from grouprl.config.grpo_config import BatchPlan, GRPOConfig, resolve_steps
from grouprl.core.entropy import EntropyController
from grouprl.core.types import SamplingParams
from grouprl.data.multimodal_prompts import make_prompt_tokenizer
from grouprl.data.prompt_sampler import PromptSampler
from grouprl.generation.vllm import require_vllm
from grouprl.model import quantization
from grouprl.model.adapters import add_reference_adapter, head_has_adapter, is_peft_model, require_peft, wrap_with_lora
from grouprl.model.loading import (
    cast_lm_head_to_fp32,
    disable_dropout,
    enable_checkpointing,
    load_model,
    router_aux_loss_coef,
)
from grouprl.model.reference import Reference, separate_reference_model
from grouprl.rollout.completion_log import CompletionLog, RecentCompletions
from grouprl.rollout.sampler import RolloutMaker, RolloutSettings

if TYPE_CHECKING:
    from grouprl.compat.trainer import GRPOTrainer

logger = logging.get_logger("grouprl")


def load_policy(
    args: GRPOConfig,
    model: Any,
    *,
    use_peft: bool,
    peft_config: Any,
    quantization_config: Any,
    generation_backend: Any,
    features: set[str],
) -> tuple[PreTrainedModel, Optional[PreTrainedModel]]:
    """The policy (seeded, loaded, quantized as asked) and, with beta != 0 and no LoRA, a separate reference model."""
    if use_peft:
        require_peft()
    if args.use_vllm and args.vllm_mode == "colocate" and generation_backend is None:
        require_vllm("GRPOConfig.use_vllm=True (vllm_mode='colocate')")  # before any model is loaded
    policy_init_kwargs = quantization.with_quantization_config(args.model_init_kwargs, quantization_config)
    quantization.check_request(model, policy_init_kwargs, use_peft)
    enable_full_determinism(args.seed) if args.full_determinism else set_seed(args.seed)
    policy = load_model(model, policy_init_kwargs, args.trust_remote_code)
    if quantization.is_quantized(policy) and "quantized" not in features:  # quantized by its own checkpoint's config
        check_combinations(features | {"quantized"})
    quantization.check_setup(policy, use_peft)
    if peft_config is not None and is_peft_model(policy):
        raise ValueError("model is already a PeftModel; pass either a PeftModel or peft_config, not both.")
    reference_model = None
    if args.beta != 0.0 and not use_peft:  # before any change to the policy
        reference_model = separate_reference_model(
            model, policy, lambda m: load_model(m, args.model_init_kwargs, args.trust_remote_code)
        )
    return policy, reference_model


def prepare_for_training(
    args: GRPOConfig,
    policy: PreTrainedModel,
    reference_model: Optional[PreTrainedModel],
    *,
    peft_config: Any,
    use_peft: bool,
    bf16_capable: bool,
) -> tuple[PreTrainedModel, Any, float]:
    """Dropout, fp32 head, checkpointing, LoRA adapters (and a frozen reference adapter), quantized-layer dtypes.

    Returns the policy (wrapped in its adapters with peft_config), the reference adapter (or None) and the
    MoE router's auxiliary-loss coefficient."""
    for prepared in (m for m in (policy, reference_model) if m is not None):
        if args.disable_dropout:
            disable_dropout(prepared)
        if args.cast_lm_head_to_fp32:
            if is_peft_model(prepared) and head_has_adapter(prepared):
                raise ValueError(
                    "cast_lm_head_to_fp32=True, but the LM head carries a LoRA adapter; take lm_head out of the "
                    "adapter's target_modules / modules_to_save, or leave cast_lm_head_to_fp32=False."
                )
            cast_lm_head_to_fp32(prepared)
    aux_loss_coef = router_aux_loss_coef(args.router_aux_loss_coef, policy)
    if args.gradient_checkpointing:
        enable_checkpointing(policy, args.gradient_checkpointing_kwargs or {"use_reentrant": False})
    policy.config.use_cache = False
    reference_adapter = None
    if peft_config is not None:
        policy = wrap_with_lora(policy, peft_config)
        if args.cast_lm_head_to_fp32 and head_has_adapter(policy):
            raise ValueError(
                "cast_lm_head_to_fp32=True, but peft_config puts an adapter on the LM head; take lm_head out of "
                "target_modules / modules_to_save, or leave cast_lm_head_to_fp32=False."
            )
    elif use_peft and args.beta != 0.0:  # a pre-wrapped adapter may be trained already: keep a frozen copy as pi_ref
        reference_adapter = add_reference_adapter(policy)
    quantization.prepare_policy(policy, bf16_capable=bf16_capable)
    return policy, reference_adapter, aux_loss_coef


def plan_steps(args: GRPOConfig, plan: BatchPlan, train_dataset: Any) -> tuple[int, Optional[int]]:
    """(total optimizer steps, steps per epoch or None for a stream)."""
    steps_per_epoch = None
    if not isinstance(train_dataset, datasets.IterableDataset):
        steps_per_epoch = plan.optimizer_steps_per_epoch(len(train_dataset))
    total_steps = (
        args.max_steps if args.max_steps > 0 else max(1, int(args.num_train_epochs * steps_per_epoch + 0.999999))
    )
    return total_steps, steps_per_epoch


def build_optimizer(
    model: torch.nn.Module, args: GRPOConfig, optimizers: tuple, total_steps: int
) -> tuple[torch.optim.Optimizer, Any]:
    """The user's (optimizer, scheduler), each defaulting to the one `args` names."""
    optimizer, scheduler = optimizers
    optimizer = optimizer or make_optimizer(model, args)
    scheduler = scheduler or get_scheduler(
        args.lr_scheduler_type,
        optimizer,
        num_warmup_steps=resolve_steps(args.warmup_steps, total_steps) if args.warmup_steps else 0,
        num_training_steps=total_steps,
        scheduler_specific_kwargs=args.lr_scheduler_kwargs or {},
    )
    return optimizer, scheduler


def make_optimizer(model: torch.nn.Module, args: GRPOConfig) -> torch.optim.Optimizer:
    """The optimizer `args.optim` names (any transformers name: adamw_torch, adafactor, adamw_8bit, sgd, ...),
    with transformers' own resolution of the name, `optim_args` and the Adam hyper-parameters."""
    optimizer_cls, optimizer_kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    # As transformers: no weight decay on biases and normalisation weights (the 1-D parameters).
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for _, p in trainable if p.ndim >= 2], "weight_decay": args.weight_decay},
        {"params": [p for _, p in trainable if p.ndim < 2], "weight_decay": 0.0},
    ]
    return optimizer_cls([g for g in groups if g["params"]], **optimizer_kwargs)


def build_rollouts(
    trainer: "GRPOTrainer",
    args: GRPOConfig,
    *,
    backend: Any,
    train_dataset: Any,
    tokenizer: Any,
    agents: Optional[AgentSpec],
    environments_own_prompts: bool,
) -> RolloutMaker:
    """The sampler of prompts, the prompt tokenizer, the agent (tools / environments / rollout_func) and the RolloutMaker."""
    plan = trainer.plan
    sampler = PromptSampler(
        train_dataset,
        plan.prompts_per_generation,
        shuffle=args.shuffle_dataset,
        seed=args.seed if args.data_seed is None else args.data_seed,
        num_workers=args.dataloader_num_workers,
    )
    max_context = getattr(trainer.model.config.get_text_config(), "max_position_embeddings", None)
    tokenize = make_prompt_tokenizer(
        trainer.processing_class,
        max_context=max_context,
        max_completion_length=args.max_completion_length,
        chat_template_kwargs=args.chat_template_kwargs,
        tools=[t.schema for t in agents.tools] if agents else None,
    )
    agent = (
        agents.build(
            tokenize,
            TurnSettings(
                tokenizer=tokenizer,
                stop_ids=set(trainer.eos_token_ids),
                max_completion_length=args.max_completion_length,
                max_tool_calling_iterations=args.max_tool_calling_iterations,
                chat_template_kwargs=args.chat_template_kwargs or {},
            ),
            trainer=trainer,
        )
        if agents
        else None
    )
    return RolloutMaker(
        accelerator=trainer.accelerator,
        backend=backend,
        sampler=sampler,
        tokenize=tokenize,
        reward_functions=trainer.reward_functions,
        reward_weights=trainer.reward_weights,
        sampling=SamplingParams(
            max_new_tokens=args.max_completion_length,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            extra=dict(args.generation_kwargs or {}),
        ),
        settings=RolloutSettings(
            num_generations=args.num_generations,
            scale_rewards=args.scale_rewards,
            advantage_estimator=args.advantage_estimator,
            multi_objective_aggregation=args.multi_objective_aggregation,
            mask_truncated_completions=args.mask_truncated_completions,
            remove_unused_columns=args.remove_unused_columns,
            pad_token_id=tokenizer.pad_token_id,
            default_prompt=EMPTY_PROMPT if environments_own_prompts else None,
        ),
        completion_log=CompletionLog(
            args.output_dir, args.num_completions_to_print, args.log_unique_prompts, args.log_multimodal
        )
        if args.log_completions
        else None,
        agent=agent,
        recent=RecentCompletions(plan.completions_per_generation, args.log_multimodal),
        generate_hook=trainer._generate_through_override,
        reward_hook=trainer._rewards_through_override,
    )


def make_trainer_state(args: GRPOConfig, total_steps: int, accelerator: Any) -> TrainerState:
    state = TrainerState(
        max_steps=total_steps,
        logging_steps=args.logging_steps,
        save_steps=args.save_steps,
        num_train_epochs=args.num_train_epochs,
        train_batch_size=args.per_device_train_batch_size,
    )
    state.is_local_process_zero = accelerator.is_local_main_process
    state.is_world_process_zero = accelerator.is_main_process
    return state


def build_reference(
    args: GRPOConfig, reference_model: Optional[PreTrainedModel], reference_adapter: Any, device: torch.device
) -> tuple[Optional[Reference], Optional[PreTrainedModel]]:
    """(the Reference the objective reads, TRL's `ref_model` attribute); both None with beta=0."""
    if args.beta == 0.0:
        return None, None
    ref_model = reference_model.to(device) if reference_model is not None else None
    return Reference(model=ref_model, adapter=reference_adapter), ref_model


def build_entropy_controller(args: GRPOConfig) -> Optional[EntropyController]:
    if not args.entropy_bonus_enabled:
        return None
    return EntropyController(
        coef=args.entropy_coef,
        adaptive=args.use_adaptive_entropy,
        target=args.entropy_target,
        delta=args.entropy_coef_delta,
        coef_min=args.entropy_coef_min,
        coef_max=args.entropy_coef_max,
    )


def tracker_init_kwargs(args: GRPOConfig) -> dict[str, Any]:
    """Run name (and trackio's Space) for the trackers that take them; args.project names the project."""
    kwargs: dict[str, Any] = {}
    if args.run_name:
        kwargs = {"wandb": {"name": args.run_name}, "trackio": {"name": args.run_name}}
    if args.trackio_space_id:
        kwargs.setdefault("trackio", {})["space_id"] = args.trackio_space_id
    return kwargs


def tracker_config(args: GRPOConfig) -> dict[str, Any]:
    return {k: v for k, v in args.to_dict().items() if isinstance(v, (int, float, str, bool))}


def mirror_trl_settings(trainer: "GRPOTrainer", args: GRPOConfig, aux_loss_coef: float) -> None:
    """The settings TRL's GRPOTrainer copies onto itself, under its names (read-only copies; the run uses args)."""
    for name in (
        "max_completion_length",
        "num_generations",
        "max_tool_calling_iterations",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "use_transformers_continuous_batching",
        "pad_to_multiple_of",
        "use_vllm",
        "vllm_mode",
        "vllm_gpu_memory_utilization",
        "vllm_tensor_parallel_size",
        "vllm_importance_sampling_correction",
        "vllm_importance_sampling_mode",
        "vllm_importance_sampling_clip_max",
        "vllm_importance_sampling_clip_min",
        "loss_type",
        "multi_objective_aggregation",
        "scale_rewards",
        "importance_sampling_level",
        "off_policy_mask_threshold",
        "mask_truncated_completions",
        "top_entropy_quantile",
        "use_adaptive_entropy",
        "shuffle_dataset",
        "num_iterations",
        "beta",
        "log_completions",
        "log_multimodal",
        "log_unique_prompts",
        "num_completions_to_print",
    ):
        setattr(trainer, name, getattr(args, name))
    trainer.num_generations_eval = args.num_generations_eval or args.num_generations
    trainer.chat_template_kwargs = args.chat_template_kwargs or {}
    trainer.epsilon_low = args.epsilon
    trainer.epsilon_high = args.effective_epsilon_high
    trainer.router_aux_loss_coef = aux_loss_coef
    trainer.aux_loss_enabled = aux_loss_coef != 0.0  # the MoE load-balancing loss is added to the objective
    trainer._entropy_bonus_enabled = args.entropy_bonus_enabled
