"""GRPOTrainer's arguments, checked before any model is loaded: the config (or TRL's default one), the features the run
combines (combinations.py), the training prompts and the reward sources."""

from __future__ import annotations

import os
from typing import Any, Optional

import datasets
import torch
from transformers.utils import logging

from grouprl.agents import AgentSpec
from grouprl.agents.environments import environment_dataset
from grouprl.config.grpo_config import BatchPlan, GRPOConfig
from grouprl.config.training_arguments import refusal
from grouprl.data.dataset_checks import KEPT_WHEN_REMOVING, PROMPT_COLUMN, check_dataset
from grouprl.data.row_loading import workers_for
from grouprl.generation.factory import sharded_weights
from grouprl.model import quantization
from grouprl.model.adapters import config_targets_head, head_has_adapter, is_peft_model
from grouprl.rewards.models import check_reward_funcs, is_reward_model
from grouprl.rewards.signatures import REWARD_KEYWORDS, check_keywords, reward_name
from grouprl.train.eval_data import check_eval_setup
from grouprl.train.output_dir import check_output_dir

logger = logging.get_logger("grouprl")


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
    on = {
        "tools": bool(tools),
        "environment_factory": environment_factory is not None,
        "rollout_func": rollout_func is not None,
        "images": any(c in columns for c in ("image", "images")),
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
        "sharded": sharded_weights(),
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
        # Written back as TRL does (its tests read it): workers would interleave shards of the stream (row_loading.py).
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
