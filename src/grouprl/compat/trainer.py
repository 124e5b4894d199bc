"""GRPOTrainer: TRL's constructor, train() and evaluate(), assembling grouprl's components around `loop.train`.

The constructor composes the builders of trainer_parts.py: it checks its arguments, then builds the policy,
adapters and reference, the reward functions, the optimization parts (steps, optimizer, scheduler, state) and
the sampler. Order of construction matters for error messages: the config, batch plan and feature combinations
(combinations.py) are checked, then the dataset and reward functions, and only then is any model loaded; and for
the random draws: the seed is set right before the policy is loaded.
The rest of TRL's surface comes from two mixins: TrainerSurface (trainer_surface.py: attributes, dataloaders,
logging, saving) and OverridePoints (override_points.py).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch
from accelerate.utils import set_seed
from transformers import PreTrainedModel
from transformers.trainer_utils import TrainOutput
from transformers.utils import logging

from grouprl.agents import AgentSpec
from grouprl.compat.accelerator_setup import make_accelerator, zero3_reference
from grouprl.compat.gloo_exit import stop_gloo_at_exit
from grouprl.compat.override_points import OverridePoints
from grouprl.compat.trainer_parts import (
    active_features,
    build_entropy_controller,
    build_optimizer,
    build_reference,
    build_rollouts,
    collect_reward_sources,
    default_args,
    init_trackers,
    keep_vision_towers_in_step,
    load_policy,
    load_rewards,
    make_trainer_state,
    plan_steps,
    prepare_for_training,
    prepare_train_dataset,
)
from grouprl.compat.trainer_surface import TrainerSurface, trl_setting_copies
from grouprl.config.combinations import check_combinations
from grouprl.config.grpo_config import GRPOConfig, plan_batches
from grouprl.core.cpu_capabilities import native_bf16, summary
from grouprl.core.distributed import run_on_main
from grouprl.data.multimodal_prompts import check_multimodal_setup
from grouprl.generation.factory import build_backend
from grouprl.generation.protocol import GenerationBackend
from grouprl.model.loading import eos_token_ids, load_tokenizer
from grouprl.model.multimodal import text_tokenizer
from grouprl.model.patches import grouprl_patches
from grouprl.train import evaluation, loop, stages
from grouprl.train.async_generation import async_generation
from grouprl.train.callbacks import CallbackHandler
from grouprl.train.checkpoint import resolve_resume_path
from grouprl.train.log_level import apply_log_level
from grouprl.train.micro_step import Objective
from grouprl.train.output_dir import RunLock, set_earlier_run_aside
from grouprl.train.training_run import TrainingRun

logger = logging.get_logger("grouprl")


class GRPOTrainer(TrainerSurface, OverridePoints):
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
            (see ``grouprl.train.callbacks``); ``add_callback`` / ``pop_callback`` / ``remove_callback`` change them
            later.
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
    _get_per_token_logps_and_entropies, get_high_entropy_mask, get_off_policy_mask, log, evaluate; see
    train/stages.py), and a
    subclass overriding a TRL method grouprl never calls is refused when it is defined.
    """

    _grouprl_surface = True  # TRL's methods defined here are grouprl's own (subclasses are checked: override_points.py)

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
        # Checked before any model loads: the config, the feature combinations, the dataset and the reward sources.
        self.args = args = default_args(model, args)
        self.accelerator = make_accelerator(args)
        apply_log_level(args)
        self.plan = plan_batches(args, self.accelerator.num_processes)
        features = active_features(
            args,
            model=model,
            train_dataset=train_dataset,
            tools=tools,
            environment_factory=environment_factory,
            rollout_func=rollout_func,
            peft_config=peft_config,
            quantization_config=quantization_config,
            generation_backend=generation_backend,
        )
        check_combinations(features)
        # tool schemas checked, environments probed
        agents = AgentSpec.from_arguments(tools, environment_factory, rollout_func)
        train_dataset, environments_own_prompts = prepare_train_dataset(
            args, train_dataset, eval_dataset, agents, self.plan, self.accelerator.num_processes
        )
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        reward_funcs, reward_processing_classes, weights = collect_reward_sources(
            args, reward_funcs, reward_processing_classes, agents, train_dataset
        )
        for message in args.dubious_combinations():
            logger.warning(message)
        if not args.ds3_gather_for_generation and "sharded" not in features:
            logger.warning(
                "ds3_gather_for_generation=False changes nothing in this run: no weights are sharded over processes "
                "(it applies to DeepSpeed ZeRO-3 or FSDP on several processes), so each process samples from the "
                "whole model it holds."
            )

        # The models: policy (and reference), tokenizer, reward functions.
        use_peft = "lora" in features
        self.model, reference_model = load_policy(
            args,
            model,
            use_peft=use_peft,
            peft_config=peft_config,
            quantization_config=quantization_config,
            generation_backend=generation_backend,
            features=features,
        )
        gguf_file = (args.model_init_kwargs or {}).get("gguf_file") if isinstance(model, str) else None
        self.processing_class = load_tokenizer(processing_class, self.model, args.trust_remote_code, gguf_file)
        check_multimodal_setup(train_dataset, self.processing_class)
        self._tokenizer = tokenizer = text_tokenizer(self.processing_class)
        # whether this trainer's record (metrics.jsonl) and checkpoints started in output_dir, and where an earlier
        # run's went (output_dir.py)
        self._record_started = self._checkpoints_started = False
        self._set_aside: Optional[str] = None
        if tokenizer is not self.processing_class and self.overrides("_get_per_token_logps_and_entropies"):
            raise NotImplementedError(
                f"{type(self).__name__} overrides _get_per_token_logps_and_entropies, which grouprl can call only "
                "for text models: it passes images to a vision-language model its own way, not as TRL's "
                "pixel_values keyword arguments. Remove the override, or override _compute_loss instead."
            )
        self.eos_token_ids = eos_token_ids(tokenizer, self.model)
        rewards = load_rewards(args, reward_funcs, reward_processing_classes, weights, self.accelerator.device)
        self.reward_functions, self.reward_funcs = rewards.reward_functions, rewards.reward_funcs  # TRL's names
        self.reward_func_names, self.reward_weights = rewards.reward_func_names, rewards.reward_weights
        self.reward_processing_classes = rewards.reward_processing_classes
        self.model, reference_adapter, aux_loss_coef = prepare_for_training(
            args,
            self.model,
            reference_model,
            peft_config=peft_config,
            use_peft=use_peft,
            bf16_capable=self.accelerator.device.type != "cpu" or native_bf16(),
        )

        # Training: steps, optimizer, sampling, state.
        total_steps, steps_per_epoch, micro_steps_per_epoch = plan_steps(args, self.plan, train_dataset)
        optimizer, scheduler = build_optimizer(self.model, args, optimizers, total_steps)
        prepared_model, optimizer = self.accelerator.prepare(self.model, optimizer)
        stop_gloo_at_exit(prepared_model)
        self.generation_backend = generation_backend or build_backend(
            self.accelerator.unwrap_model(prepared_model),
            tokenizer,
            self.eos_token_ids,
            args,
            max_num_seqs=self.plan.completions_per_process,
        )
        if args.async_generation and self.overrides("_generate"):
            raise NotImplementedError(
                f"{type(self).__name__} overrides _generate, which async_generation=True cannot call: the worker "
                "process samples the completions. Override _generate_and_score_completions or _calculate_rewards "
                "instead, or train with async_generation=False."
            )
        # TRL's attribute: what _generate and the agent call (reassigning it swaps the rollout function, as in TRL)
        self.rollout_func = agents.rollout_func if agents else None
        rollouts = build_rollouts(
            args,
            self.plan,
            accelerator=self.accelerator,
            backend=self.generation_backend,
            model_config=self.model.config,
            processing_class=self.processing_class,
            tokenizer=tokenizer,
            eos_token_ids=self.eos_token_ids,
            rewards=rewards,
            train_dataset=train_dataset,
            agents=agents,
            environments_own_prompts=environments_own_prompts,
            rollout_func_trainer=self,
        )
        self.state = make_trainer_state(args, total_steps, self.accelerator)
        if reference_model is not None:
            reference_model = zero3_reference(reference_model, self.accelerator)
        reference, self.ref_model = build_reference(args, reference_model, reference_adapter, self.accelerator.device)
        keep_vision_towers_in_step(rollouts.tokenize, [prepared_model, reference_model])
        entropy_controller = build_entropy_controller(args)
        self.run = TrainingRun(
            config=args,
            plan=self.plan,
            accelerator=self.accelerator,
            model=prepared_model,
            tokenizer=self.processing_class,
            optimizer=optimizer,
            scheduler=scheduler,
            rollouts=rollouts,
            state=self.state,
            total_steps=total_steps,
            steps_per_epoch=steps_per_epoch,
            micro_steps_per_epoch=micro_steps_per_epoch,
            objective=Objective.from_config(args, self.plan, aux_loss_coef),
            reference=reference,
            entropy_controller=entropy_controller,
            callbacks=CallbackHandler(
                callbacks,
                model=self.model,
                processing_class=self.processing_class,
                optimizer=optimizer,
                lr_scheduler=scheduler,
            ),
        )
        for name, value in trl_setting_copies(args, aux_loss_coef).items():  # TRL's attribute copies of the settings
            setattr(self, name, value)
        # scheduled, or asked for by a callback (control.should_evaluate)
        self.run.evaluates = args.eval_strategy != "no" or eval_dataset is not None
        if self.accelerator.num_processes > 1:
            set_seed(args.seed, device_specific=True)  # seed + process index: each process samples its own completions
        if self.accelerator.is_main_process:
            # INFO, as transformers' Trainer logs its run summary: shown with log_level="info" (log_level.py).
            logger.info(
                self.plan.describe(None if steps_per_epoch is None else len(train_dataset))
                + f"\n  total: {total_steps} optimizer steps"
            )
            if self.accelerator.device.type == "cpu":  # what chooses the CPU paths (docs/troubleshooting.md)
                logger.info(f"grouprl: {summary()}")
        self.run.fire("on_init_end")
        self._send_telemetry()

    def train(self, resume_from_checkpoint: Union[bool, str, None] = None) -> TrainOutput:
        """Run training; `resume_from_checkpoint` = True (latest in output_dir) or a checkpoint path.

        Returns transformers' ``TrainOutput(global_step, training_loss, metrics)``; metrics as Trainer's:
        train_runtime, train_samples_per_second, train_steps_per_second, total_flos, train_loss, epoch (plus, as
        TRL's GRPO, the metrics of steps after the last log entry). The report_to trackers stay open for later
        logs; ``end()`` closes them.
        """
        if resume_from_checkpoint is None:
            resume_from_checkpoint = self.args.resume_from_checkpoint
        lock = RunLock(self.args.output_dir)
        run_on_main(lock.acquire)  # one live run per output_dir (output_dir.py); refused on every process
        own_backend = self.generation_backend
        try:
            path = resolve_resume_path(resume_from_checkpoint, self.args.output_dir)
            if path is not None:
                self._load_checkpoint(path)
                self._record_started = self._checkpoints_started = True  # the resumed run's record goes on
            self._start_record(training=True)
            self._record_overrides()
            init_trackers(self.accelerator, self.args)
            # grouprl's attention functions, for this call only (patches.py); an asynchronous generation worker
            with grouprl_patches(self.model, self.args), async_generation(self.run, self._tokenizer) as worker:
                # a rollout_func samples through trainer.generation_backend: the worker, while there is one
                self.generation_backend = worker or own_backend
                metrics = loop.train(self.run)
        finally:
            self.generation_backend = own_backend
            self.run.rollouts.sampler.release()  # no prompt-reading worker processes left running after training
            if self.accelerator.is_main_process:
                lock.release()
        return TrainOutput(self.state.global_step, metrics["train_loss"], metrics)

    def _record_overrides(self) -> None:
        """What the stages consult (stages.py): this trainer's TRL overrides, as they are now, and the eval set."""
        run = self.run
        run.overrides, run.eval_dataset = self._recorded_overrides(), self.eval_dataset
        overridden = run.overrides.get
        run.rollouts.generate_hook = self._generate_through_override if overridden("_generate") else None
        run.rollouts.reward_hook = self._rewards_through_override if overridden("_calculate_rewards") else None

    def _start_record(self, training: bool = False) -> None:
        """The first train() / evaluate() sets an earlier run's record aside, and the first train() its checkpoints,
        unless resuming (output_dir.py)."""
        record, checkpoints = not self._record_started, training and not self._checkpoints_started
        if (record or checkpoints) and self.accelerator.is_main_process:
            self._set_aside = set_earlier_run_aside(
                self.args.output_dir, record=record, checkpoints=checkpoints, into=self._set_aside
            )
        self._record_started = True
        self._checkpoints_started = self._checkpoints_started or training

    def evaluate(
        self, eval_dataset: Any = None, ignore_keys: Optional[list[str]] = None, metric_key_prefix: str = "eval"
    ) -> dict[str, float]:
        """Sample and score every eval prompt (num_generations_eval each); return and log eval_* metrics.

        Works before, during (eval_strategy) and without train(); `eval_dataset` overrides the
        trainer's (a Dataset or a dict name -> Dataset, reported as eval_<name>_*). `ignore_keys`
        is accepted for compatibility: it names model outputs, which evaluation does not collect.
        """
        self._start_record()
        self._record_overrides()
        with grouprl_patches(self.model, self.args):  # grouprl's attention functions, for this call only (patches.py)
            return evaluation.evaluate(
                stages.evaluation_parts(self.run),
                eval_dataset if eval_dataset is not None else self.eval_dataset,
                metric_key_prefix,
            )
