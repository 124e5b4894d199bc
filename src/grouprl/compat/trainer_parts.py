"""Building a GRPOTrainer's parts: plain functions that take what they need and return what they build, composed
in order by GRPOTrainer.__init__.

- the arguments, checked before any model is loaded: the config (or TRL's default one), the features the run
  combines (combinations.py), the training prompts and the reward sources;
- the policy and the reference model: loaded, adapted (LoRA, quantized layers) and made ready to train. The seed
  is set right before the policy is loaded, so the random draws of a run do not depend on what the constructor
  checked before;
- the reward functions scoring calls, loaded (reward models too) and prepared, under TRL's attribute names;
- the optimization parts: how many optimizer steps, the optimizer and LR schedule that take them, the
  TrainerState that counts them, and the entropy-bonus coefficient that adapts once per step;
- the RolloutMaker the trainer samples with: the prompt sampler, the prompt tokenizer, the agent (tools /
  environments / rollout_func), the sampling settings and the completion log;
- the report_to trackers (wandb, trackio, tensorboard, ...), started by GRPOTrainer.train() through accelerate.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

import datasets
import torch
from accelerate.utils import set_seed
from transformers import PreTrainedModel, Trainer, TrainerState, enable_full_determinism, get_scheduler
from transformers.utils import logging

from grouprl.agents import AgentSpec
from grouprl.agents.environments import EMPTY_PROMPT, environment_dataset
from grouprl.agents.multiturn import TurnSettings
from grouprl.config.combinations import check_combinations
from grouprl.config.grpo_config import BatchPlan, GRPOConfig, resolve_steps
from grouprl.config.training_arguments import refusal
from grouprl.core.entropy import EntropyController
from grouprl.data.multimodal_prompts import MultimodalPromptTokenizer, make_prompt_tokenizer
from grouprl.data.prompt_sampler import PromptSampler, RowReaders, workers_for
from grouprl.data.prompts import (
    IMAGE_COLUMNS,
    KEPT_WHEN_REMOVING,
    PROMPT_COLUMN,
    check_dataset,
    check_every_prompt_fits,
)
from grouprl.generation.factory import sampling_params, sharded_weights
from grouprl.generation.vllm import require_vllm
from grouprl.model import quantization
from grouprl.model.adapters import (
    add_reference_adapter,
    config_targets_head,
    head_has_adapter,
    is_peft_model,
    require_peft,
    wrap_with_lora,
)
from grouprl.model.forward import sharded_parameters
from grouprl.model.loading import (
    cast_lm_head_to_fp32,
    disable_dropout,
    enable_checkpointing,
    load_model,
    router_aux_loss_coef,
)
from grouprl.model.multimodal import VisionProbe, is_processor, is_vision_language_config, set_vision_probe
from grouprl.model.reference import Reference, separate_reference_model
from grouprl.rewards.models import check_reward_funcs, is_reward_model, load_reward_functions
from grouprl.rewards.scoring import RewardFunction, prepare_reward_functions
from grouprl.rewards.signatures import REWARD_KEYWORDS, check_keywords, reward_name
from grouprl.rollout.completion_log import CompletionLog, RecentCompletions
from grouprl.rollout.completion_upload import CompletionUpload
from grouprl.rollout.sampler import RolloutMaker, RolloutSettings
from grouprl.train.eval_data import check_eval_setup
from grouprl.train.output_dir import check_output_dir

logger = logging.get_logger("grouprl")


# ---- the arguments, checked before any model loads ---------------------------------------------------------
def default_args(model: Any, args: Optional[GRPOConfig]) -> GRPOConfig:
    """`args`, or TRL's default GRPOConfig(output_dir="<model name>-GRPO")."""
    if args is None:
        model_name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "model")
        args = GRPOConfig(output_dir=f"{os.path.basename(str(model_name).rstrip('/')) or 'model'}-GRPO")
    if not isinstance(args, GRPOConfig):
        raise TypeError(f"args must be a grouprl.GRPOConfig, got {type(args).__name__}.")
    check_output_dir(args.output_dir)  # a file there, or a read-only parent: said now, not at the first save
    return args


def active_features(
    args: GRPOConfig,
    *,
    model: Any,
    train_dataset: Any,
    tools: Any,
    environment_factory: Any,
    rollout_func: Any,
    peft_config: Any,
    quantization_config: Any,
    generation_backend: Any,
) -> set[str]:
    """The features of combinations.FEATURES this run uses, from the arguments as given (nothing is loaded)."""
    check_liger_kernel(args, model, peft_config)
    columns = getattr(train_dataset, "column_names", None) or []
    own_backend = generation_backend is not None
    vllm_server = args.use_vllm and args.vllm_mode == "server"
    server = not own_backend and (vllm_server or (not args.use_vllm and args.generation_engine == "server"))
    if args.async_generation:
        if own_backend:
            raise ValueError(
                "async_generation=True samples in a worker process (a local `grouprl serve`, or the server the config "
                "names); a generation_backend object lives in the training process. Drop generation_backend, or train "
                "with async_generation=False."
            )
        server = True  # the worker is a generation server, local or not
    sharded = sharded_weights()
    on = {
        "tools": bool(tools),
        "environment_factory": environment_factory is not None,
        "rollout_func": rollout_func is not None,
        "images": any(c in columns for c in IMAGE_COLUMNS),
        "in_process_sampling": not own_backend and not server and not args.use_vllm,
        "async_generation": args.async_generation,
        "generation_server": server,
        "vllm_colocate": not own_backend and args.use_vllm and args.vllm_mode == "colocate",
        "gfpo": getattr(args, "num_remains_in_group", None) is not None,
        "dynamic_sampling": args.dynamic_sampling,
        "lora": peft_config is not None or is_peft_model(model),
        "sync_ref_model": args.sync_ref_model,
        # loaded quantized from an id / path, or given quantized (a checkpoint quantized by
        # its own config is found after loading)
        "quantized": quantization.is_quantized(model)
        if not isinstance(model, str)
        else quantization_config is not None or quantization.requested(args.model_init_kwargs) is not None,
        "sharded": sharded,
        "lockstep_sampling": sharded and not args.ds3_gather_for_generation,
        "continuous_batching": args.use_transformers_continuous_batching,
    }
    return {name for name, used in on.items() if used}


def check_liger_kernel(args: GRPOConfig, model: Any, peft_config: Any) -> None:
    """use_liger_kernel=True, accepted by GRPOConfig, is refused here, before any model loads: TRL raises about it
    when its trainer is built (a PEFT adapter on lm_head, which its loss would never train), not in its config."""
    if not args.use_liger_kernel:
        return
    message = refusal("use_liger_kernel", args.use_liger_kernel, False)
    if config_targets_head(peft_config) or (is_peft_model(model) and head_has_adapter(model)):
        message += (
            " TRL refuses this run too, for its PEFT adapter on `lm_head`: TRL's loss multiplies by `lm_head.weight` "
            "directly, so that adapter would never train."
        )
    raise ValueError(message)


def prepare_train_dataset(
    args: GRPOConfig,
    train_dataset: Any,
    eval_dataset: Any,
    agents: Optional[AgentSpec],
    plan: BatchPlan,
    num_processes: int,
) -> tuple[Any, bool]:
    """The training prompts (an environment may supply them), checked; and whether environments own the prompts."""
    train_dataset = environment_dataset(
        train_dataset,
        agents and agents.environments,
        max_steps=args.max_steps,
        prompts_per_generation=plan.prompts_per_generation,
    )
    environments_own_prompts = bool(agents and agents.environments)  # rows may lack a prompt: reset() supplies it (TRL)
    check_dataset(train_dataset, "train_dataset", prompt_required=not environments_own_prompts)
    if isinstance(train_dataset, datasets.IterableDataset):
        check_stream_dispatch(args)  # first, as TRL: its message is the one a TRL user expects
        if args.max_steps <= 0:
            raise ValueError(
                "train_dataset is an IterableDataset (no length), so GRPOConfig.max_steps must be set (> 0)."
            )
    if workers_for(train_dataset, args.dataloader_num_workers) != args.dataloader_num_workers:
        # Written back as TRL does (its tests read it): workers would interleave shards of the stream
        # (prompt_sampler.py).
        logger.warning(
            f"train_dataset is an IterableDataset, whose prompts one reader must stream in order: "
            f"dataloader_num_workers={args.dataloader_num_workers} is set to 0."
        )
        args.dataloader_num_workers = 0
    if args.eval_strategy != "no":
        check_eval_setup(args, eval_dataset, num_processes, prompt_required=not environments_own_prompts)
    return train_dataset, environments_own_prompts


def check_stream_dispatch(args: GRPOConfig) -> None:
    # As TRL: a stream cannot be read by the main process and dispatched; each process reads its own part.
    config = args.accelerator_config
    if config is not None and config.dispatch_batches:
        raise ValueError(
            "Iterable datasets require `dispatch_batches=False`: GRPOConfig.accelerator_config.dispatch_batches=True "
            "asks the main process to read every batch and send it out, which a stream of prompts does not allow. "
            "Leave dispatch_batches unset (or False)."
        )
    if config is not None:
        config.dispatch_batches = False


def collect_reward_sources(
    args: GRPOConfig,
    reward_funcs: Any,
    reward_processing_classes: Any,
    agents: Optional[AgentSpec],
    train_dataset: Any = None,
) -> tuple[list, list, list[float]]:
    """The reward functions / models, their tokenizers and weights, an environment's
    get_reward() included (weight 1, as TRL). Each function must take the keyword arguments it will be called with
    (those known now: TRL's, `train_dataset`'s columns, an environment's instances)."""
    environment_rewards = agents.reward_functions if agents else []
    if reward_funcs is None or (isinstance(reward_funcs, (list, tuple)) and not reward_funcs):
        if not environment_rewards:
            raise ValueError(
                "No reward source provided. Pass reward_funcs, or an environment_factory whose environment defines "
                "a get_reward() method."
            )
        reward_funcs, reward_processing_classes = [], []
    else:
        reward_funcs, reward_processing_classes = check_reward_funcs(reward_funcs, reward_processing_classes)
        keywords = reward_keywords(args, train_dataset, agents)
        for i, entry in enumerate(reward_funcs):
            if not is_reward_model(entry):
                check_keywords(entry, keywords, where=f"reward_funcs[{i}]")
    weights = args.reward_weights or [1.0] * len(reward_funcs)
    if len(weights) != len(reward_funcs):
        raise ValueError(
            f"GRPOConfig.reward_weights has {len(weights)} weights but there are {len(reward_funcs)} reward functions "
            f"({', '.join(map(describe_reward, reward_funcs))}); give one weight per function."
        )
    return (
        reward_funcs + environment_rewards,
        reward_processing_classes + [None] * len(environment_rewards),
        list(weights) + [1.0] * len(environment_rewards),
    )


def reward_keywords(args: GRPOConfig, train_dataset: Any, agents: Optional[AgentSpec]) -> list[str]:
    """The keyword arguments every reward function will get that are known before training: TRL's, the dataset's
    columns (those remove_unused_columns keeps) and `environments` with an environment_factory. A rollout_func's
    extra fields are known only once it ran."""
    columns = getattr(train_dataset, "column_names", None) or []
    kept = [c for c in columns if c != PROMPT_COLUMN and (not args.remove_unused_columns or c in KEPT_WHEN_REMOVING)]
    return list(REWARD_KEYWORDS) + kept + (["environments"] if agents and agents.environments else [])


def describe_reward(entry: Any) -> str:
    return (
        entry
        if isinstance(entry, str)
        else (type(entry).__name__ if isinstance(entry, torch.nn.Module) else reward_name(entry))
    )


# ---- the policy and the reference model --------------------------------------------------------------------
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


def keep_vision_towers_in_step(tokenize: Any, models: list[Optional[torch.nn.Module]]) -> None:
    """Give each vision-language model whose processes must run the same modules (sharded weights, or DDP's gradient
    reduction) its VisionProbe (model/multimodal.py): a blank image through the processor, which a forward without
    images carries so that every process runs the vision tower."""
    in_step = [  # (a DeepSpeed engine's own `config` is DeepSpeed's: the model's is its module's)
        model
        for model in models
        if model is not None
        and is_vision_language_config(getattr(getattr(model, "module", model), "config", None))
        and (sharded_parameters(model) or isinstance(model, torch.nn.parallel.DistributedDataParallel))
    ]
    if not in_step or not isinstance(tokenize, MultimodalPromptTokenizer):
        return
    from PIL import Image

    row = {PROMPT_COLUMN: [{"role": "user", "content": ""}], "images": [Image.new("RGB", (64, 64), (128, 128, 128))]}
    try:
        _, prompt_ids, images = tokenize.encode_row(row, 0)
    except Exception as err:
        raise ValueError(
            "On several processes grouprl runs the vision tower in every forward, on a blank 64x64 image where a "
            f"forward has none, but the processor could not encode one: {err}"
        ) from err
    for model in in_step:
        set_vision_probe(model, VisionProbe(prompt_ids, images))


def build_reference(
    args: GRPOConfig, reference_model: Optional[PreTrainedModel], reference_adapter: Any, device: torch.device
) -> tuple[Optional[Reference], Optional[PreTrainedModel]]:
    """(the Reference the objective reads, TRL's `ref_model` attribute); both None with beta=0."""
    if args.beta == 0.0:
        return None, None
    ref_model = reference_model.to(device) if reference_model is not None else None
    return Reference(model=ref_model, adapter=reference_adapter), ref_model


# ---- the reward functions (their sources were checked before any model loaded: collect_reward_sources) -----
@dataclass(frozen=True)
class RewardParts:
    """The loaded reward functions: grouprl's (what scoring calls) and TRL's attributes of them."""

    reward_functions: list[RewardFunction]  # grouprl's, what scoring calls
    reward_funcs: list[Any]  # TRL's: each function, or reward model
    reward_func_names: list[str]
    reward_weights: torch.Tensor  # (F,) float32
    reward_processing_classes: list[Any]  # each reward model's tokenizer, None for a function


def load_rewards(
    args: GRPOConfig, reward_funcs: list, reward_processing_classes: Any, weights: list[float], device: torch.device
) -> RewardParts:
    """Load the reward functions (reward models too, on `device`) and prepare them for scoring."""
    functions = prepare_reward_functions(
        load_reward_functions(
            reward_funcs,
            reward_processing_classes,
            model_init_kwargs=args.model_init_kwargs,
            trust_remote_code=args.trust_remote_code,
            chat_template_kwargs=args.chat_template_kwargs,
            batch_size=args.per_device_train_batch_size,
            device=device,
        ),
        timeout=args.reward_timeout,
    )
    funcs = [f.fn for f in functions]
    return RewardParts(
        reward_functions=functions,
        reward_funcs=funcs,
        reward_func_names=[f.name for f in functions],
        reward_weights=torch.tensor(weights, dtype=torch.float32),
        reward_processing_classes=[getattr(f, "tokenizer", None) if hasattr(f, "model") else None for f in funcs],
    )


# ---- optimization: steps, optimizer, LR schedule, state, entropy coefficient -------------------------------
def plan_steps(args: GRPOConfig, plan: BatchPlan, train_dataset: Any) -> tuple[int, Optional[int], Optional[int]]:
    """(total optimizer steps, optimizer steps per epoch, micro-batches per epoch); the last two None for a
    stream."""
    steps_per_epoch = micro_steps_per_epoch = None
    if not isinstance(train_dataset, datasets.IterableDataset):
        steps_per_epoch = plan.optimizer_steps_per_epoch(len(train_dataset))
        micro_steps_per_epoch = plan.micro_steps_per_epoch(len(train_dataset))
    total_steps = (
        args.max_steps if args.max_steps > 0 else max(1, int(args.num_train_epochs * steps_per_epoch + 0.999999))
    )
    return total_steps, steps_per_epoch, micro_steps_per_epoch


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


# ---- sampling: the RolloutMaker ----------------------------------------------------------------------------
def build_rollouts(
    args: GRPOConfig,
    plan: BatchPlan,
    *,
    accelerator: Any,
    backend: Any,
    model_config: Any,
    processing_class: Any,
    tokenizer: Any,
    eos_token_ids: list[int],
    rewards: RewardParts,
    train_dataset: Any,
    agents: Optional[AgentSpec],
    environments_own_prompts: bool,
    rollout_func_trainer: Any,
) -> RolloutMaker:
    """The sampler of prompts, the prompt tokenizer, the agent (tools / environments / rollout_func) and the
    RolloutMaker. `rollout_func_trainer` is what a rollout_func receives as its trainer argument (TRL's API)."""
    sampler = PromptSampler(
        train_dataset,
        plan.prompts_per_generation,
        shuffle=args.shuffle_dataset,
        seed=args.seed if args.data_seed is None else args.data_seed,
        readers=RowReaders.of(args, train_dataset),
    )
    max_context = getattr(model_config.get_text_config(), "max_position_embeddings", None)
    tokenize = make_prompt_tokenizer(
        processing_class,
        max_context=max_context,
        max_completion_length=args.max_completion_length,
        chat_template_kwargs=args.chat_template_kwargs,
        tools=[t.schema for t in agents.tools] if agents else None,
    )
    if not environments_own_prompts:
        check_every_prompt_fits(tokenize, train_dataset)
    agent = (
        agents.build(
            tokenize,
            TurnSettings(
                tokenizer=tokenizer,
                stop_ids=set(eos_token_ids),
                max_completion_length=args.max_completion_length,
                max_tool_calling_iterations=args.max_tool_calling_iterations,
                chat_template_kwargs=args.chat_template_kwargs or {},
                processor=processing_class if is_processor(processing_class) else None,
            ),
            trainer=rollout_func_trainer,
        )
        if agents
        else None
    )
    return RolloutMaker(
        accelerator=accelerator,
        backend=backend,
        sampler=sampler,
        tokenize=tokenize,
        reward_functions=rewards.reward_functions,
        reward_weights=rewards.reward_weights,
        sampling=sampling_params(args),
        settings=RolloutSettings(
            num_generations=args.num_generations,
            scale_rewards=args.scale_rewards,
            advantage_estimator=args.advantage_estimator,
            multi_objective_aggregation=args.multi_objective_aggregation,
            mask_truncated_completions=args.mask_truncated_completions,
            remove_unused_columns=args.remove_unused_columns,
            pad_token_id=tokenizer.pad_token_id,
            pad_to_multiple_of=args.pad_to_multiple_of,
            default_prompt=EMPTY_PROMPT if environments_own_prompts else None,
        ),
        completion_log=completion_log(args, accelerator) if args.log_completions else None,
        agent=agent,
        recent=RecentCompletions(plan.completions_per_generation, args.log_multimodal),
    )  # a TRL subclass's _generate / _calculate_rewards are set as its hooks when a run starts


def completion_log(args: GRPOConfig, accelerator: Any) -> CompletionLog:
    """log_completions' table, uploaded to log_completions_hub_repo by the main process when one is named."""
    upload = None
    if args.log_completions_hub_repo is not None and accelerator.is_main_process:
        upload = CompletionUpload(
            args.log_completions_hub_repo,
            os.path.join(args.output_dir, "completions"),
            private=args.hub_private_repo,
            token=args.hub_token,
            model=args.hub_model_id,
        )
    return CompletionLog(
        args.output_dir, args.num_completions_to_print, args.log_unique_prompts, args.log_multimodal, upload=upload
    )


# ---- the report_to trackers --------------------------------------------------------------------------------
def init_trackers(accelerator: Any, args: GRPOConfig) -> None:
    """Start the report_to trackers unless they are open already (from an earlier train() call)."""
    if args.report_to and not accelerator.trackers:
        accelerator.init_trackers(args.project, config=tracker_config(args), init_kwargs=tracker_init_kwargs(args))


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
