"""GRPOTrainer: TRL's constructor and methods, assembling grouprl's components around `loop.train`.

Order of construction matters for error messages: the config and batch plan are checked, then
the dataset and reward functions, and only then is any model loaded.
"""

from __future__ import annotations

import os
from collections import deque
from datetime import timedelta
from typing import Any, Callable, Optional, Union

import datasets
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedDataParallelKwargs, FullyShardedDataParallelPlugin, InitProcessGroupKwargs, set_seed
from transformers import PreTrainedModel, Trainer, TrainerControl, TrainerState, enable_full_determinism, get_scheduler
from huggingface_hub import HfApi
from transformers.trainer_utils import TrainOutput
from transformers.utils import logging

from . import evaluation, loop, quantization
from .adapters import add_reference_adapter, head_has_adapter, is_peft_model, require_peft, save_pretrained, wrap_with_lora
from .agents import AgentSpec
from .agents.environments import EMPTY_PROMPT, environment_dataset
from .agents.multiturn import TurnSettings
from .algorithms.entropy import EntropyController
from .callbacks import CallbackHandler
from .completion_log import CompletionLog, RecentCompletions
from .checkpoint import load_policy_weights, load_training_state, resolve_resume_path, restore_rng_state
from .config import GRPOConfig, no_accelerator, plan_batches
from .data import PromptSampler, check_dataset
from .evaluation import check_eval_setup
from .generation.factory import build_backend
from .generation.protocol import GenerationBackend
from .generation.vllm import require_vllm
from .host_memory import reuse_freed_host_memory
from .log_level import apply_log_level
from .metrics import JsonlWriter
from .models import (
    cast_lm_head_to_fp32, disable_dropout, enable_checkpointing, eos_token_ids, load_model, load_tokenizer, router_aux_loss_coef,
)
from .multimodal import check_multimodal_setup, make_prompt_tokenizer, text_tokenizer
from .reference import Reference, separate_reference_model
from .row_loading import workers_for
from .rewards.models import check_reward_funcs, load_reward_functions
from .rewards.scoring import prepare_reward_functions, reward_name
from .generation_inputs import TrainPromptBatches
from .rollout import RolloutMaker, RolloutSettings
from .trainer_hooks import OverridePoints
from .trainer_reporting import TrainerReporting
from .types import SamplingParams

logger = logging.get_logger("grouprl")


class GRPOTrainer(TrainerReporting, OverridePoints):
    """Train a causal LM with GRPO. Drop-in for ``trl.GRPOTrainer`` (same arguments, same config).

    Args:
        model: a model id / local path (loaded with AutoModelForCausalLM, or AutoModelForImageTextToText for a
            vision-language checkpoint, and ``args.model_init_kwargs``) or a ``PreTrainedModel``.
        reward_funcs: one reward function or a list; each is called as
            ``f(prompts=..., completions=..., completion_ids=..., trainer_state=..., **dataset_columns)``
            and returns one float (or None) per completion. An entry may also be a reward model: a model
            id / path (AutoModelForSequenceClassification, num_labels=1) or a ``PreTrainedModel``.
            May be None when an environment owns the reward (``get_reward``).
        args: a ``GRPOConfig`` (default: ``GRPOConfig(output_dir="<model name>-GRPO")``).
        train_dataset: ``datasets.Dataset`` or ``IterableDataset`` with a ``prompt`` column (and, for
            vision-language models, an ``image`` or ``images`` column).
        eval_dataset: a ``Dataset`` or a dict of name -> ``Dataset`` for ``evaluate()`` / ``eval_strategy``.
        processing_class: the tokenizer, or for a vision-language model its processor (default: loaded from the
            model with AutoTokenizer / AutoProcessor; pad token falls back to EOS).
        reward_processing_classes: tokenizer(s) of the reward models: one, or a list with one entry per
            reward function (None = load the reward model's own tokenizer).
        callbacks: ``transformers.TrainerCallback`` instances or classes, called at the Trainer's events
            (see ``grouprl.callbacks``); ``add_callback`` / ``pop_callback`` / ``remove_callback`` change them later.
        optimizers: ``(optimizer, lr_scheduler)``; either may be None to use AdamW / ``lr_scheduler_type``.
        quantization_config: a ``transformers.BitsAndBytesConfig`` applied when ``model`` is loaded from an id / path
            (QLoRA; needs ``peft_config``). The same may be given as ``args.model_init_kwargs["quantization_config"]``.
        peft_config: a ``peft.PeftConfig`` (e.g. ``LoraConfig``): train adapters only, the base model frozen.
        tools: sync or async functions (type hints + Google-style docstrings) the model may call in
            multi-turn rollouts; needs conversational prompts and a chat template that renders tools.
        environment_factory: a callable making an environment (``reset(**row)``, public methods as tools,
            optional ``get_reward()``), or a dict name -> callable routed by an ``environment`` column.
        rollout_func: ``f(prompts, trainer) -> {"prompt_ids", "completion_ids", "logprobs", ...}``, a custom
            rollout replacing generation. See ``grouprl.agents`` and the README's "Tools and agents".
        generation_backend: grouprl extension: any object with the ``GenerationBackend`` protocol
            (default: transformers ``generate`` on the policy).

    Subclass it as TRL's: the loop runs through TRL's override points (training_step, _prepare_inputs,
    _generate_and_score_completions, _generate, _calculate_rewards, compute_loss, _compute_loss,
    _get_per_token_logps_and_entropies, get_high_entropy_mask, get_off_policy_mask, log; see trainer_hooks.py), and a
    subclass overriding a TRL method grouprl never calls is refused when it is defined.
    """

    _grouprl_surface = True  # TRL's methods defined here are grouprl's own (subclasses are checked: trainer_hooks.py)

    def __init__(
        self,
        model: Union[str, PreTrainedModel],
        reward_funcs: Union[Callable, list[Callable], None] = None,
        args: Optional[GRPOConfig] = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        reward_processing_classes: Any = None,
        callbacks: Optional[list] = None,
        optimizers: tuple[Optional[torch.optim.Optimizer], Any] = (None, None),
        quantization_config: Any = None,
        peft_config: Any = None,
        tools: Optional[list] = None,
        rollout_func: Optional[Callable] = None,
        environment_factory: Any = None,
        generation_backend: Optional[GenerationBackend] = None,
    ):
        if args is None:
            model_name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "model")
            args = GRPOConfig(output_dir=f"{os.path.basename(str(model_name).rstrip('/')) or 'model'}-GRPO")
        if not isinstance(args, GRPOConfig):
            raise TypeError(f"args must be a grouprl.GRPOConfig, got {type(args).__name__}.")
        self.args = args
        self.accelerator = _make_accelerator(args)
        apply_log_level(args)
        if self.accelerator.device.type == "cpu":
            reuse_freed_host_memory()  # freed tensors are reused, not page-faulted in again (host_memory.py)
        self.plan = plan_batches(args, self.accelerator.num_processes)
        agents = AgentSpec.from_arguments(tools, environment_factory, rollout_func)  # tool schemas checked, environments probed
        train_dataset = environment_dataset(train_dataset, agents and agents.environments, max_steps=args.max_steps,
                                            prompts_per_generation=self.plan.prompts_per_generation)
        environments_own_prompts = bool(agents and agents.environments)  # rows may lack a prompt: reset() supplies it (TRL)
        check_dataset(train_dataset, "train_dataset", prompt_required=not environments_own_prompts)
        if isinstance(train_dataset, datasets.IterableDataset):
            if args.max_steps <= 0:
                raise ValueError("train_dataset is an IterableDataset (no length), so GRPOConfig.max_steps must be set (> 0).")
            _check_stream_dispatch(args)
        if workers_for(train_dataset, args.dataloader_num_workers) != args.dataloader_num_workers:
            # Written back as TRL does (its tests read it): workers would interleave shards of the stream (row_loading.py).
            logger.warning(f"train_dataset is an IterableDataset, whose prompts one reader must stream in order: "
                           f"dataloader_num_workers={args.dataloader_num_workers} is set to 0.")
            args.dataloader_num_workers = 0
        if args.eval_strategy != "no":
            check_eval_setup(args, eval_dataset, self.accelerator.num_processes, prompt_required=not environments_own_prompts)
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        environment_rewards = agents.reward_functions if agents else []
        if reward_funcs is None or (isinstance(reward_funcs, (list, tuple)) and not reward_funcs):
            if not environment_rewards:
                raise ValueError("No reward source provided. Pass reward_funcs, or an environment_factory whose environment defines "
                                 "a get_reward() method.")
            reward_funcs, reward_processing_classes = [], []
        else:
            reward_funcs, reward_processing_classes = check_reward_funcs(reward_funcs, reward_processing_classes)
        weights = args.reward_weights or [1.0] * len(reward_funcs)
        if len(weights) != len(reward_funcs):
            raise ValueError(
                f"GRPOConfig.reward_weights has {len(weights)} weights but there are {len(reward_funcs)} reward functions "
                f"({', '.join(map(_describe_reward, reward_funcs))}); give one weight per function."
            )
        # An environment's get_reward() is one more reward function, weight 1 (TRL).
        reward_funcs, reward_processing_classes = reward_funcs + environment_rewards, reward_processing_classes + [None] * len(environment_rewards)
        weights = list(weights) + [1.0] * len(environment_rewards)
        for message in args.dubious_combinations():
            logger.warning(message)
        use_peft = peft_config is not None or is_peft_model(model)
        if use_peft:
            require_peft()
            if args.sync_ref_model:
                raise NotImplementedError("GRPOConfig.sync_ref_model=True with LoRA: the reference is the frozen base model "
                                          "(adapters off), which syncing would overwrite. Use sync_ref_model=False.")
        if args.use_vllm and args.vllm_mode == "colocate" and generation_backend is None:
            require_vllm("GRPOConfig.use_vllm=True (vllm_mode='colocate')")  # before any model is loaded

        policy_init_kwargs = quantization.with_quantization_config(args.model_init_kwargs, quantization_config)
        quantization.check_request(model, policy_init_kwargs, use_peft)
        enable_full_determinism(args.seed) if args.full_determinism else set_seed(args.seed)
        self.model = load_model(model, policy_init_kwargs, args.trust_remote_code)
        quantization.check_setup(self.model, use_peft, args, generation_backend)
        if peft_config is not None and is_peft_model(self.model):
            raise ValueError("model is already a PeftModel; pass either a PeftModel or peft_config, not both.")
        reference_model = None
        if args.beta != 0.0 and not use_peft:  # before any change to the policy
            reference_model = separate_reference_model(model, self.model, lambda m: load_model(m, args.model_init_kwargs, args.trust_remote_code))
        gguf_file = (args.model_init_kwargs or {}).get("gguf_file") if isinstance(model, str) else None
        self.processing_class = load_tokenizer(processing_class, self.model, args.trust_remote_code, gguf_file)
        check_multimodal_setup(train_dataset, self.processing_class)
        tokenizer = text_tokenizer(self.processing_class)
        self._tokenizer = tokenizer
        if tokenizer is not self.processing_class and self.overrides("_get_per_token_logps_and_entropies"):
            raise NotImplementedError(f"{type(self).__name__} overrides _get_per_token_logps_and_entropies, which grouprl can call only "
                                      "for text models: it passes images to a vision-language model its own way, not as TRL's "
                                      "pixel_values keyword arguments. Remove the override, or override _compute_loss instead.")
        self.eos_token_ids = eos_token_ids(tokenizer, self.model)
        self.reward_functions = prepare_reward_functions(load_reward_functions(
            reward_funcs, reward_processing_classes, model_init_kwargs=args.model_init_kwargs, trust_remote_code=args.trust_remote_code,
            chat_template_kwargs=args.chat_template_kwargs, batch_size=args.per_device_train_batch_size, device=self.accelerator.device,
        ))
        self.reward_funcs = [f.fn for f in self.reward_functions]
        self.reward_func_names = [f.name for f in self.reward_functions]
        # TRL's attributes: the weights as a tensor, and each reward model's tokenizer (None for a function)
        self.reward_weights = torch.tensor(weights, dtype=torch.float32)
        self.reward_processing_classes = [getattr(f, "tokenizer", None) if hasattr(f, "model") else None for f in self.reward_funcs]
        for prepared in (m for m in (self.model, reference_model) if m is not None):
            if args.disable_dropout:
                disable_dropout(prepared)
            if args.cast_lm_head_to_fp32:
                if is_peft_model(prepared) and head_has_adapter(prepared):
                    raise ValueError("cast_lm_head_to_fp32=True, but the LM head carries a LoRA adapter; take lm_head out of the "
                                     "adapter's target_modules / modules_to_save, or leave cast_lm_head_to_fp32=False.")
                cast_lm_head_to_fp32(prepared)
        aux_loss_coef = router_aux_loss_coef(args.router_aux_loss_coef, self.model)
        if args.gradient_checkpointing:
            enable_checkpointing(self.model, args.gradient_checkpointing_kwargs or {"use_reentrant": False})
        self.model.config.use_cache = False
        reference_adapter = None
        if peft_config is not None:
            self.model = wrap_with_lora(self.model, peft_config)
            if args.cast_lm_head_to_fp32 and head_has_adapter(self.model):
                raise ValueError("cast_lm_head_to_fp32=True, but peft_config puts an adapter on the LM head; take lm_head out of "
                                 "target_modules / modules_to_save, or leave cast_lm_head_to_fp32=False.")
        elif use_peft and args.beta != 0.0:  # a pre-wrapped adapter may be trained already: keep a frozen copy as pi_ref
            reference_adapter = add_reference_adapter(self.model)
        quantization.prepare_policy(self.model, bf16_capable=self.accelerator.device.type != "cpu" or cpu_has_fast_bf16())

        steps_per_epoch = None
        if not isinstance(train_dataset, datasets.IterableDataset):
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

        backend = generation_backend or build_backend(self.accelerator.unwrap_model(prepared_model), tokenizer, self.eos_token_ids,
                                                      args, max_num_seqs=self.plan.completions_per_process)
        self.generation_backend = backend
        sampler = PromptSampler(train_dataset, self.plan.prompts_per_generation, shuffle=args.shuffle_dataset,
                                seed=args.seed if args.data_seed is None else args.data_seed, num_workers=args.dataloader_num_workers)
        max_context = getattr(self.model.config.get_text_config(), "max_position_embeddings", None)
        tokenize = make_prompt_tokenizer(self.processing_class, max_context=max_context, max_completion_length=args.max_completion_length,
                                         chat_template_kwargs=args.chat_template_kwargs, tools=[t.schema for t in agents.tools] if agents else None)
        agent = agents.build(tokenize, TurnSettings(
            tokenizer=tokenizer, stop_ids=set(self.eos_token_ids), max_completion_length=args.max_completion_length,
            max_tool_calling_iterations=args.max_tool_calling_iterations, chat_template_kwargs=args.chat_template_kwargs or {},
        ), trainer=self) if agents else None
        rollouts = RolloutMaker(
            accelerator=self.accelerator,
            backend=backend,
            sampler=sampler,
            tokenize=tokenize,
            reward_functions=self.reward_functions,
            reward_weights=self.reward_weights,
            sampling=SamplingParams(
                max_new_tokens=args.max_completion_length, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                min_p=args.min_p, repetition_penalty=args.repetition_penalty, extra=dict(args.generation_kwargs or {}),
            ),
            settings=RolloutSettings(
                num_generations=args.num_generations, scale_rewards=args.scale_rewards, advantage_estimator=args.advantage_estimator,
                multi_objective_aggregation=args.multi_objective_aggregation,
                mask_truncated_completions=args.mask_truncated_completions,
                remove_unused_columns=args.remove_unused_columns, pad_token_id=tokenizer.pad_token_id,
                default_prompt=EMPTY_PROMPT if environments_own_prompts else None,
            ),
            completion_log=CompletionLog(args.output_dir, args.num_completions_to_print, args.log_unique_prompts, args.log_multimodal)
            if args.log_completions else None,
            agent=agent,
            recent=RecentCompletions(self.plan.completions_per_generation, args.log_multimodal),
            generate_hook=self._generate_through_override,
            reward_hook=self._rewards_through_override,
        )
        self.state = TrainerState(max_steps=total_steps, logging_steps=args.logging_steps, save_steps=args.save_steps,
                                  num_train_epochs=args.num_train_epochs, train_batch_size=args.per_device_train_batch_size)
        self.state.is_local_process_zero = self.accelerator.is_local_main_process
        self.state.is_world_process_zero = self.accelerator.is_main_process
        reference, self.ref_model = None, None
        if args.beta != 0.0:
            self.ref_model = reference_model.to(self.accelerator.device) if reference_model is not None else None
            reference = Reference(model=self.ref_model, adapter=reference_adapter)
        entropy_controller = None
        if args.entropy_bonus_enabled:
            entropy_controller = EntropyController(
                coef=args.entropy_coef, adaptive=args.use_adaptive_entropy, target=args.entropy_target, delta=args.entropy_coef_delta,
                coef_min=args.entropy_coef_min, coef_max=args.entropy_coef_max,
            )
        self.run = loop.TrainingRun(
            config=args, plan=self.plan, accelerator=self.accelerator, model=prepared_model, tokenizer=self.processing_class,
            optimizer=optimizer, scheduler=scheduler, rollouts=rollouts, state=self.state, total_steps=total_steps,
            steps_per_epoch=steps_per_epoch, reference=reference, entropy_controller=entropy_controller, aux_loss_coef=aux_loss_coef,
            callbacks=CallbackHandler(callbacks, model=self.model, processing_class=self.processing_class, optimizer=optimizer,
                                      lr_scheduler=scheduler),
            trainer=self,
        )
        self._mirror_settings(args, aux_loss_coef)
        if args.eval_strategy != "no" or eval_dataset is not None:  # scheduled, or asked for by a callback (control.should_evaluate)
            self.run.evaluate = self.evaluate
        if self.accelerator.num_processes > 1:
            set_seed(args.seed, device_specific=True)  # seed + process index: each process samples its own completions
        if self.accelerator.is_main_process:
            # INFO, as transformers' Trainer logs its run summary: shown with log_level="info" (log_level.py).
            logger.info(self.plan.describe(None if steps_per_epoch is None else len(train_dataset)) + f"\n  total: {total_steps} optimizer steps")
        self.run.fire("on_init_end")
        self._send_telemetry()

    def _mirror_settings(self, args: GRPOConfig, aux_loss_coef: float) -> None:
        """The settings TRL's GRPOTrainer copies onto itself, under its names (read-only copies; the run uses args)."""
        for name in (
            "max_completion_length", "num_generations", "max_tool_calling_iterations", "temperature", "top_p", "top_k", "min_p",
            "repetition_penalty", "use_transformers_continuous_batching", "pad_to_multiple_of", "use_vllm", "vllm_mode",
            "vllm_gpu_memory_utilization", "vllm_tensor_parallel_size", "vllm_importance_sampling_correction",
            "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min", "loss_type",
            "multi_objective_aggregation", "scale_rewards", "importance_sampling_level", "off_policy_mask_threshold",
            "mask_truncated_completions", "top_entropy_quantile", "use_adaptive_entropy", "shuffle_dataset", "num_iterations", "beta",
            "log_completions", "log_multimodal", "log_unique_prompts", "num_completions_to_print",
        ):
            setattr(self, name, getattr(args, name))
        self.num_generations_eval = args.num_generations_eval or args.num_generations
        self.chat_template_kwargs = args.chat_template_kwargs or {}
        self.epsilon_low = args.epsilon
        self.epsilon_high = args.effective_epsilon_high
        self.router_aux_loss_coef = aux_loss_coef
        self.aux_loss_enabled = aux_loss_coef != 0.0  # the MoE load-balancing loss is added to the objective
        self._entropy_bonus_enabled = args.entropy_bonus_enabled

    @property
    def entropy_coef(self) -> float:
        """The entropy-bonus coefficient now: the adaptive controller's current value with use_adaptive_entropy."""
        controller = self.run.entropy_controller
        return controller.coef if controller is not None else self.args.entropy_coef

    @entropy_coef.setter
    def entropy_coef(self, value: float) -> None:
        if self.run.entropy_controller is None:
            raise ValueError("entropy_coef can change only on a run with the entropy bonus on (GRPOConfig.entropy_coef != 0 or "
                             "use_adaptive_entropy=True): with it off, the bonus term is not computed at all.")
        self.run.entropy_controller.coef = float(value)

    @property
    def _last_world_entropy(self) -> float:
        """The global mean entropy of the last optimizer step, as the adaptive controller saw it (inf before the first)."""
        controller = self.run.entropy_controller
        return controller.last_entropy if controller is not None else float("inf")

    @property
    def model_wrapped(self) -> torch.nn.Module:
        """The model as accelerate prepared it (DDP / FSDP wrapper, or the model itself), as Trainer.model_wrapped."""
        return self.run.model

    @property
    def control(self) -> TrainerControl:
        """The TrainerControl the callbacks share."""
        return self.run.callbacks.control

    @control.setter
    def control(self, value: TrainerControl) -> None:
        self.run.callbacks.control = value

    def get_train_dataloader(self) -> TrainPromptBatches:
        """One epoch of this process's generation batches, as TRL's dataloader yields them: lists of dataset rows
        (one per completion, each prompt repeated for its completions), each repeated steps_per_generation x
        num_iterations times; the same lists training_step receives. Iterating walks the prompt order from the start
        of an epoch without moving training's position; ``num_workers`` / ``loader`` are those of the DataLoader that
        fetches training's rows (dataloader_num_workers)."""
        rollouts = self.run.rollouts
        return TrainPromptBatches(
            rollouts.sampler, tokenize=rollouts.tokenize, num_generations=self.args.num_generations,
            repeats=self.plan.steps_per_generation * self.plan.num_iterations, process_index=self.accelerator.process_index,
            num_processes=self.accelerator.num_processes, remove_unused_columns=self.args.remove_unused_columns,
            default_prompt=rollouts.settings.default_prompt,
        )

    # ---- TRL-compatible surface ----------------------------------------------------------

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.run.optimizer

    @property
    def lr_scheduler(self) -> Any:
        return self.run.scheduler

    @property
    def callback_handler(self) -> CallbackHandler:
        return self.run.callbacks

    def add_callback(self, callback: Any) -> None:
        """Add a ``transformers.TrainerCallback`` (an instance or a class), as ``Trainer.add_callback``."""
        self.run.callbacks.add(callback)

    def pop_callback(self, callback: Any) -> Any:
        """Remove and return a callback (an instance, or the first instance of a class); None if it is not there."""
        return self.run.callbacks.pop(callback)

    def remove_callback(self, callback: Any) -> None:
        """Remove a callback (an instance, or the first instance of a class)."""
        self.run.callbacks.pop(callback)

    def train(self, resume_from_checkpoint: Union[bool, str, None] = None) -> TrainOutput:
        """Run training; `resume_from_checkpoint` = True (latest in output_dir) or a checkpoint path.

        Returns transformers' ``TrainOutput(global_step, training_loss, metrics)``; metrics as Trainer's: train_runtime,
        train_samples_per_second, train_steps_per_second, total_flos, train_loss, epoch (plus, as TRL's GRPO, the
        metrics of steps after the last log entry). The report_to trackers stay open for later logs; ``end()`` closes them.
        """
        if resume_from_checkpoint is None:
            resume_from_checkpoint = self.args.resume_from_checkpoint
        path = resolve_resume_path(resume_from_checkpoint, self.args.output_dir)
        if path is not None:
            self._load_checkpoint(path)
        if self.args.report_to and not self.accelerator.trackers:
            self.accelerator.init_trackers(self.args.project, config=_tracker_config(self.args), init_kwargs=_tracker_init_kwargs(self.args))
        try:
            metrics = loop.train(self.run)
        finally:
            self.run.rollouts.sampler.release()  # no prompt-reading worker processes left running after training
        return TrainOutput(self.state.global_step, metrics["train_loss"], metrics)

    def get_eval_dataloader(self, eval_dataset: Any = None) -> torch.utils.data.DataLoader:
        """The DataLoader evaluation reads (a name of a dict eval_dataset, a dataset, or None: the trainer's); a stream gets 0 workers."""
        return evaluation.eval_loader(self.run, evaluation.pick_eval_dataset(self.eval_dataset, eval_dataset))

    def save_model(self, output_dir: Optional[str] = None) -> None:
        """Write the model and tokenizer (`from_pretrained`-loadable) to output_dir (default: args.output_dir)."""
        output_dir = output_dir or self.args.output_dir
        self.accelerator.wait_for_everyone()
        if self.accelerator.is_main_process:
            save_pretrained(self.accelerator.unwrap_model(self.run.model), output_dir)  # a LoRA policy: the adapter only
            self.processing_class.save_pretrained(output_dir)

    def push_to_hub(self, commit_message: str = "End of training", **kwargs: Any) -> Any:
        """Save, write the model card, then push the model, tokenizer and card (README.md) to args.hub_model_id
        (default: output_dir's name), with args.hub_token / hub_private_repo / hub_revision unless given here.
        As Trainer's, `model_name`, `dataset_name` and `tags` go to create_model_card (TRL's script passes
        dataset_name); other keyword arguments go to the model's and tokenizer's push_to_hub."""
        card = {name: kwargs.pop(name) for name in ("model_name", "dataset_name", "tags") if name in kwargs}
        repo_id = self.args.hub_model_id or os.path.basename(os.path.abspath(self.args.output_dir))
        self.save_model()
        if not self.accelerator.is_main_process:
            return None
        card.setdefault("model_name", repo_id.split("/")[-1])
        self.create_model_card(**card)
        hub = {"token": self.args.hub_token, "private": self.args.hub_private_repo, "revision": self.args.hub_revision}
        kwargs = {**{k: v for k, v in hub.items() if v is not None}, **kwargs}
        model = self.accelerator.unwrap_model(self.run.model)
        self.processing_class.push_to_hub(repo_id, commit_message=commit_message, **kwargs)
        result = model.push_to_hub(repo_id, commit_message=commit_message, **kwargs)
        pushed = getattr(getattr(result, "repo_url", None), "repo_id", None)  # owner/name as the Hub resolved it
        self._pushed_repo_id = pushed or repo_id
        # after the model: its push writes a bare README.md, which the card replaces
        HfApi(token=kwargs.get("token")).upload_file(
            path_or_fileobj=os.path.join(self.args.output_dir, "README.md"), path_in_repo="README.md", repo_id=self._pushed_repo_id,
            revision=kwargs.get("revision"), commit_message=commit_message)
        return result

    def evaluate(self, eval_dataset: Any = None, ignore_keys: Optional[list[str]] = None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Sample and score every eval prompt (num_generations_eval each); return and log eval_* metrics.

        Works before, during (eval_strategy) and without train(); `eval_dataset` overrides the
        trainer's (a Dataset or a dict name -> Dataset, reported as eval_<name>_*). `ignore_keys`
        is accepted for compatibility: it names model outputs, which evaluation does not collect.
        """
        return evaluation.evaluate(self.run, eval_dataset if eval_dataset is not None else self.eval_dataset, metric_key_prefix)

    def _load_checkpoint(self, path: str) -> None:
        training, loop_state = load_training_state(path)
        load_policy_weights(self.accelerator.unwrap_model(self.run.model), path)
        self.run.optimizer.load_state_dict(training["optimizer"])
        self.run.scheduler.load_state_dict(training["scheduler"])
        restore_rng_state(training["rng"])
        self.run.load_loop_state(loop_state)
        processes = loop_state.get("processes")  # several processes: each one's RNG and buffered micro-batches
        if processes is not None:
            if len(processes) != self.accelerator.num_processes:
                raise ValueError(f"Checkpoint {path} was written by {len(processes)} processes; resume it with the same number "
                                 f"of processes (this run has {self.accelerator.num_processes}).")
            own = processes[self.accelerator.process_index]
            restore_rng_state(own["rng"])
            self.run.pending = deque(own["pending"])
            self.run.inputs = own.get("inputs")
        elif self.accelerator.num_processes > 1:  # written by one process (or a last-good save): its buffer is not ours
            logger.warning(f"{path} holds one process's buffered micro-batches; each of the {self.accelerator.num_processes} processes "
                           "starts with a fresh generation instead.")
            self.run.pending.clear()
            self.run.inputs = None
        restored = TrainerState.load_from_json(os.path.join(path, "trainer_state.json"))
        self.state.global_step, self.state.epoch, self.state.log_history = restored.global_step, restored.epoch, restored.log_history
        self.state.total_flos, self.state.num_input_tokens_seen = restored.total_flos, restored.num_input_tokens_seen
        if self.accelerator.is_main_process:  # drop what the interrupted run logged after this checkpoint
            JsonlWriter(os.path.join(self.args.output_dir, "metrics.jsonl")).rewrite(self.state.log_history)
        logger.warning(f"Resumed from {path} at step {self.state.global_step}.")


def cpu_has_fast_bf16() -> bool:
    """True if this x86/ARM CPU has native bf16 matrix instructions (AVX512-BF16, AMX, ARM BF16).

    Without them PyTorch emulates bf16 matmuls: measured 0.95 GFLOP/s vs 175 GFLOP/s in fp32 on
    an AVX2 machine, i.e. bf16 autocast makes a CPU step ~100x slower instead of faster.
    """
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            flags = handle.read()
    except OSError:
        return True  # cannot tell (not Linux): trust the configuration
    return any(flag in flags for flag in ("avx512_bf16", "amx_bf16", " bf16"))


def _make_accelerator(args: GRPOConfig) -> Accelerator:
    on_cpu = args.use_cpu or not torch.cuda.is_available()
    bf16 = args.bf16
    if bf16 and on_cpu and not cpu_has_fast_bf16():
        if args.bf16_from_default:
            logger.warning("grouprl: this CPU has no native bf16 units (no AVX512-BF16/AMX), where bf16 autocast runs ~100x slower "
                           "than fp32; training in fp32 instead of TRL's default bf16=True. Pass bf16=True explicitly to force it.")
            bf16 = False
        else:
            logger.warning("grouprl: bf16=True on a CPU without native bf16 units (no AVX512-BF16/AMX): expect steps ~100x slower "
                           "than fp32. Set bf16=False unless you are measuring exactly this.")
    mixed_precision = "bf16" if bf16 else ("fp16" if args.fp16 else "no")
    if (AcceleratorState._shared_state or PartialState._shared_state) and PartialState().num_processes == 1:
        # A previous trainer (or an early PartialState()) in this process fixed the precision or the
        # device; one process may change them.
        AcceleratorState._reset_state(reset_partial_state=True)
    # accelerate joins a multi-process launch on a machine without an accelerator only when told
    # cpu=True; otherwise every process would silently train alone.
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    ddp = {"find_unused_parameters": args.ddp_find_unused_parameters, "bucket_cap_mb": args.ddp_bucket_cap_mb,
           "broadcast_buffers": args.ddp_broadcast_buffers, "static_graph": args.ddp_static_graph}
    handlers = [InitProcessGroupKwargs(timeout=timedelta(seconds=args.ddp_timeout), **({"backend": args.ddp_backend} if args.ddp_backend else {}))]
    if any(value is not None for value in ddp.values()):
        handlers.append(DistributedDataParallelKwargs(**{k: v for k, v in ddp.items() if v is not None}))
    return Accelerator(
        mixed_precision=mixed_precision,
        cpu=args.use_cpu or (launched and no_accelerator()),
        log_with=args.report_to or None,
        project_dir=args.logging_dir or os.path.join(args.output_dir, "runs"),
        kwargs_handlers=handlers,
        deepspeed_plugin=args.deepspeed_plugin,  # built by TrainingArguments from args.deepspeed
        fsdp_plugin=FullyShardedDataParallelPlugin(**args.fsdp_plugin_args) if args.fsdp_plugin_args else None,
    )


def _check_stream_dispatch(args: GRPOConfig) -> None:
    # As TRL: a stream cannot be read by the main process and dispatched; each process reads its own part.
    config = args.accelerator_config
    if config is not None and config.dispatch_batches:
        raise ValueError("Iterable datasets require `dispatch_batches=False`: GRPOConfig.accelerator_config.dispatch_batches=True "
                         "asks the main process to read every batch and send it out, which a stream of prompts does not allow. "
                         "Leave dispatch_batches unset (or False).")
    if config is not None:
        config.dispatch_batches = False


def _make_optimizer(model: torch.nn.Module, args: GRPOConfig) -> torch.optim.Optimizer:
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


def _tracker_init_kwargs(args: GRPOConfig) -> dict[str, Any]:
    """Run name (and trackio's Space) for the trackers that take them; args.project names the project."""
    kwargs: dict[str, Any] = {}
    if args.run_name:
        kwargs = {"wandb": {"name": args.run_name}, "trackio": {"name": args.run_name}}
    if args.trackio_space_id:
        kwargs.setdefault("trackio", {})["space_id"] = args.trackio_space_id
    return kwargs


def _tracker_config(args: GRPOConfig) -> dict[str, Any]:
    return {k: v for k, v in args.to_dict().items() if isinstance(v, (int, float, str, bool))}


def _describe_reward(entry: Any) -> str:
    return entry if isinstance(entry, str) else (type(entry).__name__ if isinstance(entry, torch.nn.Module) else reward_name(entry))
