"""GRPOTrainer: TRL's constructor and methods, assembling grouprl's components around `loop.train`.

Order of construction matters for error messages: the config and batch plan are checked, then
the dataset and reward functions, and only then is any model loaded.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional, Union

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import set_seed
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, TrainerState, get_scheduler
from transformers.utils import logging

from . import evaluation, loop
from .checkpoint import load_training_state, resolve_resume_path, restore_rng_state
from .completion_log import CompletionLog
from .config import GRPOConfig, plan_batches
from .data import PromptSampler, PromptTokenizer, check_dataset
from .evaluation import check_eval_setup
from .generation.engine import FastGenerator, engine_supports
from .generation.hf import TransformersGenerator
from .generation.protocol import GenerationBackend
from .rewards.models import check_reward_funcs, load_reward_functions
from .rewards.scoring import prepare_reward_functions, reward_name
from .rollout import RolloutMaker, RolloutSettings
from .types import SamplingParams

logger = logging.get_logger("grouprl")


class GRPOTrainer:
    """Train a causal LM with GRPO. Drop-in for ``trl.GRPOTrainer`` (same arguments, same config).

    Args:
        model: a model id / local path (loaded with AutoModelForCausalLM and ``args.model_init_kwargs``)
            or a ``PreTrainedModel``.
        reward_funcs: one reward function or a list; each is called as
            ``f(prompts=..., completions=..., completion_ids=..., trainer_state=..., **dataset_columns)``
            and returns one float (or None) per completion. An entry may also be a reward model: a model
            id / path (AutoModelForSequenceClassification, num_labels=1) or a ``PreTrainedModel``.
        args: a ``GRPOConfig`` (default: ``GRPOConfig(output_dir="<model name>-GRPO")``).
        train_dataset: ``datasets.Dataset`` or ``IterableDataset`` with a ``prompt`` column.
        eval_dataset: a ``Dataset`` or a dict of name -> ``Dataset`` for ``evaluate()`` / ``eval_strategy``.
        processing_class: the tokenizer (default: loaded from the model; pad token falls back to EOS).
        reward_processing_classes: tokenizer(s) of the reward models: one, or a list with one entry per
            reward function (None = load the reward model's own tokenizer).
        optimizers: ``(optimizer, lr_scheduler)``; either may be None to use AdamW / ``lr_scheduler_type``.
        generation_backend: grouprl extension: any object with the ``GenerationBackend`` protocol
            (default: transformers ``generate`` on the policy).
    """

    def __init__(
        self,
        model: Union[str, PreTrainedModel],
        reward_funcs: Union[Callable, list[Callable]],
        args: Optional[GRPOConfig] = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        reward_processing_classes: Any = None,
        callbacks: Optional[list] = None,
        optimizers: tuple[Optional[torch.optim.Optimizer], Any] = (None, None),
        peft_config: Any = None,
        tools: Optional[list] = None,
        rollout_func: Optional[Callable] = None,
        environment_factory: Any = None,
        generation_backend: Optional[GenerationBackend] = None,
    ):
        for name, value, feature in (
            ("peft_config", peft_config, "LoRA training"),
            ("tools", tools, "tool calling"),
            ("rollout_func", rollout_func, "custom rollout functions"),
            ("environment_factory", environment_factory, "environments"),
            ("callbacks", callbacks, "trainer callbacks"),
        ):
            if value:
                raise NotImplementedError(f"GRPOTrainer({name}=...): {feature} is not available in this version of grouprl yet.")
        if args is None:
            model_name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "model")
            args = GRPOConfig(output_dir=f"{os.path.basename(str(model_name).rstrip('/')) or 'model'}-GRPO")
        if not isinstance(args, GRPOConfig):
            raise TypeError(f"args must be a grouprl.GRPOConfig, got {type(args).__name__}.")
        self.args = args
        self.accelerator = _make_accelerator(args)
        self.plan = plan_batches(args, self.accelerator.num_processes)
        check_dataset(train_dataset, "train_dataset")
        if isinstance(train_dataset, __import__("datasets").IterableDataset) and args.max_steps <= 0:
            raise ValueError("train_dataset is an IterableDataset (no length), so GRPOConfig.max_steps must be set (> 0).")
        if args.eval_strategy != "no":
            check_eval_setup(args, eval_dataset, self.accelerator.num_processes)
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        reward_funcs, reward_processing_classes = check_reward_funcs(reward_funcs, reward_processing_classes)
        weights = args.reward_weights or [1.0] * len(reward_funcs)
        if len(weights) != len(reward_funcs):
            raise ValueError(
                f"GRPOConfig.reward_weights has {len(weights)} weights but there are {len(reward_funcs)} reward functions "
                f"({', '.join(map(_describe_reward, reward_funcs))}); give one weight per function."
            )

        set_seed(args.seed)
        self.model = _load_model(model, args)
        self.processing_class = _load_tokenizer(processing_class, self.model, args)
        self.eos_token_ids = _eos_token_ids(self.processing_class, self.model)
        self.reward_functions = prepare_reward_functions(load_reward_functions(
            reward_funcs, reward_processing_classes, model_init_kwargs=args.model_init_kwargs, trust_remote_code=args.trust_remote_code,
            chat_template_kwargs=args.chat_template_kwargs, batch_size=args.per_device_train_batch_size, device=self.accelerator.device,
        ))
        self.reward_funcs = [f.fn for f in self.reward_functions]
        self.reward_func_names = [f.name for f in self.reward_functions]
        if args.disable_dropout:
            for module in self.model.modules():
                if isinstance(module, torch.nn.Dropout):
                    module.p = 0.0
        if args.gradient_checkpointing:
            _enable_checkpointing(self.model, args.gradient_checkpointing_kwargs or {"use_reentrant": False})
        self.model.config.use_cache = False

        steps_per_epoch = None
        if not isinstance(train_dataset, __import__("datasets").IterableDataset):
            steps_per_epoch = self.plan.optimizer_steps_per_epoch(len(train_dataset))
        total_steps = args.max_steps if args.max_steps > 0 else max(1, int(args.num_train_epochs * steps_per_epoch + 0.999999))
        optimizer, scheduler = optimizers
        optimizer = optimizer or _make_optimizer(self.model, args)
        scheduler = scheduler or get_scheduler(
            args.lr_scheduler_type, optimizer,
            num_warmup_steps=loop.resolve_steps(args.warmup_steps, total_steps) if args.warmup_steps else 0,
            num_training_steps=total_steps, scheduler_specific_kwargs=args.lr_scheduler_kwargs or {},
        )
        prepared_model, optimizer = self.accelerator.prepare(self.model, optimizer)

        backend = generation_backend or _default_backend(self.accelerator.unwrap_model(prepared_model), self.processing_class, self.eos_token_ids, args)
        self.generation_backend = backend
        sampler = PromptSampler(train_dataset, self.plan.prompts_per_generation, shuffle=args.shuffle_dataset, seed=args.data_seed)
        max_context = getattr(self.model.config, "max_position_embeddings", None)
        rollouts = RolloutMaker(
            accelerator=self.accelerator,
            backend=backend,
            sampler=sampler,
            tokenize=PromptTokenizer(self.processing_class, max_context=max_context, max_completion_length=args.max_completion_length,
                                     chat_template_kwargs=args.chat_template_kwargs),
            reward_functions=self.reward_functions,
            reward_weights=torch.tensor(weights, dtype=torch.float32),
            sampling=SamplingParams(
                max_new_tokens=args.max_completion_length, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                min_p=args.min_p, repetition_penalty=args.repetition_penalty, extra=dict(args.generation_kwargs or {}),
            ),
            settings=RolloutSettings(
                num_generations=args.num_generations, scale_rewards=args.scale_rewards,
                multi_objective_aggregation=args.multi_objective_aggregation,
                mask_truncated_completions=args.mask_truncated_completions,
                remove_unused_columns=args.remove_unused_columns, pad_token_id=self.processing_class.pad_token_id,
            ),
            completion_log=CompletionLog(args.output_dir, args.num_completions_to_print, args.log_unique_prompts) if args.log_completions else None,
        )
        self.state = TrainerState(max_steps=total_steps, logging_steps=args.logging_steps, save_steps=args.save_steps)
        self.run = loop.TrainingRun(
            config=args, plan=self.plan, accelerator=self.accelerator, model=prepared_model, tokenizer=self.processing_class,
            optimizer=optimizer, scheduler=scheduler, rollouts=rollouts, state=self.state, total_steps=total_steps,
            steps_per_epoch=steps_per_epoch,
        )
        if args.eval_strategy != "no":
            self.run.evaluate = self.evaluate
        if self.accelerator.is_main_process:
            logger.warning(self.plan.describe(None if steps_per_epoch is None else len(train_dataset)) + f"\n  total: {total_steps} optimizer steps")

    # ---- TRL-compatible surface ----------------------------------------------------------

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.run.optimizer

    @property
    def lr_scheduler(self) -> Any:
        return self.run.scheduler

    def train(self, resume_from_checkpoint: Union[bool, str, None] = None) -> dict[str, float]:
        """Run training; `resume_from_checkpoint` = True (latest in output_dir) or a checkpoint path."""
        if resume_from_checkpoint is None:
            resume_from_checkpoint = self.args.resume_from_checkpoint
        path = resolve_resume_path(resume_from_checkpoint, self.args.output_dir)
        if path is not None:
            self._load_checkpoint(path)
        if self.args.report_to:
            self.accelerator.init_trackers(self.args.run_name or "grouprl", config=_tracker_config(self.args))
        try:
            return loop.train(self.run)
        finally:
            if self.args.report_to:
                self.accelerator.end_training()

    def save_model(self, output_dir: Optional[str] = None) -> None:
        """Write the model and tokenizer (`from_pretrained`-loadable) to output_dir (default: args.output_dir)."""
        output_dir = output_dir or self.args.output_dir
        self.accelerator.wait_for_everyone()
        if self.accelerator.is_main_process:
            self.accelerator.unwrap_model(self.run.model).save_pretrained(output_dir, safe_serialization=True)
            self.processing_class.save_pretrained(output_dir)

    def push_to_hub(self, commit_message: str = "End of training", **kwargs: Any) -> Any:
        repo_id = self.args.hub_model_id or os.path.basename(os.path.abspath(self.args.output_dir))
        self.save_model()
        if not self.accelerator.is_main_process:
            return None
        model = self.accelerator.unwrap_model(self.run.model)
        self.processing_class.push_to_hub(repo_id, commit_message=commit_message, **kwargs)
        return model.push_to_hub(repo_id, commit_message=commit_message, **kwargs)

    def evaluate(self, eval_dataset: Any = None, ignore_keys: Optional[list[str]] = None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Sample and score every eval prompt (num_generations_eval each); return and log eval_* metrics.

        Works before, during (eval_strategy) and without train(); `eval_dataset` overrides the
        trainer's (a Dataset or a dict name -> Dataset, reported as eval_<name>_*). `ignore_keys`
        is accepted for compatibility: it names model outputs, which evaluation does not collect.
        """
        return evaluation.evaluate(self.run, eval_dataset if eval_dataset is not None else self.eval_dataset, metric_key_prefix)

    def _load_checkpoint(self, path: str) -> None:
        from safetensors.torch import load_file

        model = self.accelerator.unwrap_model(self.run.model)
        weights = {}
        for name in sorted(os.listdir(path)):
            if name.endswith(".safetensors"):
                weights.update(load_file(os.path.join(path, name)))
        missing, unexpected = model.load_state_dict(weights, strict=False)
        missing = [k for k in missing if not _is_tied(model, k)]
        if missing or unexpected:
            raise ValueError(f"Checkpoint {path} does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}.")
        training, loop_state = load_training_state(path)
        self.run.optimizer.load_state_dict(training["optimizer"])
        self.run.scheduler.load_state_dict(training["scheduler"])
        restore_rng_state(training["rng"])
        self.run.load_loop_state(loop_state)
        restored = TrainerState.load_from_json(os.path.join(path, "trainer_state.json"))
        self.state.global_step, self.state.epoch, self.state.log_history = restored.global_step, restored.epoch, restored.log_history
        logger.warning(f"Resumed from {path} at step {self.state.global_step}.")


def _make_accelerator(args: GRPOConfig) -> Accelerator:
    mixed_precision = "bf16" if args.bf16 else ("fp16" if args.fp16 else "no")
    if AcceleratorState._shared_state and PartialState().num_processes == 1:
        # A previous trainer in this process fixed the precision; one process may change it.
        AcceleratorState._reset_state(reset_partial_state=True)
    return Accelerator(
        mixed_precision=mixed_precision,
        cpu=args.use_cpu,
        log_with=args.report_to or None,
        project_dir=args.logging_dir or os.path.join(args.output_dir, "runs"),
    )


def _default_backend(model: PreTrainedModel, tokenizer: Any, eos_token_ids: list[int], args: GRPOConfig) -> GenerationBackend:
    """The fast engine where it applies (generation_engine='auto' or 'engine'), else transformers generate."""
    reason = engine_supports(model, args.generation_kwargs or {}, args.cache_implementation)
    if args.generation_engine == "engine" and reason:
        raise ValueError(f"GRPOConfig.generation_engine='engine' cannot be used: {reason}. Use 'auto' or 'transformers'.")
    if args.generation_engine == "transformers" or reason:
        return TransformersGenerator(model, tokenizer, eos_token_ids, tokenizer.pad_token_id, cache_implementation=args.cache_implementation)
    return FastGenerator(model, tokenizer, eos_token_ids, tokenizer.pad_token_id)


def _enable_checkpointing(model: PreTrainedModel, kwargs: dict) -> None:
    # transformers >= 5.x renamed gradient checkpointing to activation checkpointing.
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _load_model(model: Any, args: GRPOConfig) -> PreTrainedModel:
    if isinstance(model, PreTrainedModel):
        return model
    if not isinstance(model, str):
        raise TypeError(f"model must be a model id / path (str) or a transformers PreTrainedModel, got {type(model).__name__}.")
    kwargs = dict(args.model_init_kwargs or {})
    dtype = kwargs.pop("dtype", kwargs.pop("torch_dtype", "float32"))
    if isinstance(dtype, str) and dtype != "auto":
        dtype = getattr(torch, dtype)
    kwargs.setdefault("trust_remote_code", args.trust_remote_code)
    try:
        return AutoModelForCausalLM.from_pretrained(model, dtype=dtype, **kwargs)
    except OSError as err:
        raise OSError(f"Could not load the model {model!r}: {err}") from err


def _load_tokenizer(processing_class: Any, model: PreTrainedModel, args: GRPOConfig) -> Any:
    tokenizer = processing_class
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(model.config._name_or_path, trust_remote_code=args.trust_remote_code)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError("The tokenizer has neither a pad token nor an EOS token; set tokenizer.pad_token before training.")
        tokenizer.pad_token = tokenizer.eos_token  # as TRL: padding is masked out, so reusing EOS is safe
    return tokenizer


def _eos_token_ids(tokenizer: Any, model: PreTrainedModel) -> list[int]:
    """EOS ids of the tokenizer and the model's generation config (TRL: the union)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if configured is not None:
        ids.update(configured if isinstance(configured, (list, tuple)) else [configured])
    if not ids:
        raise ValueError("Neither the tokenizer nor the model's generation_config defines an EOS token; completions could never end.")
    return sorted(ids)


def _make_optimizer(model: torch.nn.Module, args: GRPOConfig) -> torch.optim.Optimizer:
    # As transformers: no weight decay on biases and normalisation weights (the 1-D parameters).
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for _, p in trainable if p.ndim >= 2], "weight_decay": args.weight_decay},
        {"params": [p for _, p in trainable if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
        fused=args.optim == "adamw_torch_fused",
    )


def _describe_reward(entry: Any) -> str:
    return entry if isinstance(entry, str) else (type(entry).__name__ if isinstance(entry, torch.nn.Module) else reward_name(entry))


def _is_tied(model: PreTrainedModel, key: str) -> bool:
    tied = getattr(model, "_tied_weights_keys", None) or {}
    return key in tied


def _tracker_config(args: GRPOConfig) -> dict[str, Any]:
    return {k: v for k, v in args.to_dict().items() if isinstance(v, (int, float, str, bool))}
