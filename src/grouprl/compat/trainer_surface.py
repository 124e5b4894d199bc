"""TRL's surface on GRPOTrainer, as TRL's GRPOTrainer and transformers.Trainer have it, apart from the override points.

- attributes: the run's parts (optimizer, lr_scheduler, model_wrapped, control, callback_handler, the entropy
  coefficient, tools and environments) under Trainer's names, and add / pop / remove_callback;
  `trl_setting_copies` lists the settings TRL keeps on the trainer;
- dataloaders: what a user iterates to see the batches the loop uses; they read the same data as training and
  evaluation without moving their position;
- reporting: ``log`` (one log entry: TRL's GRPO version merges the metrics gathered since the last entry),
  ``log_metrics`` / ``save_metrics`` / ``save_state`` (transformers' own helpers), ``create_model_card`` (README.md
  in output_dir, written offline with huggingface_hub's ModelCard), ``end`` (what ``trl grpo`` calls last),
  ``hub_model_id``, ``is_world_process_zero`` / ``is_local_process_zero`` and ``_logs`` (TRL's buffer of the
  latest completions);
- saving: ``save_model``, ``push_to_hub`` and resuming from a checkpoint (``_load_checkpoint``).
"""

from __future__ import annotations

import os
from collections import deque
from pathlib import Path
from typing import Any, Callable, Optional, Union

import huggingface_hub
import torch
import transformers
from huggingface_hub import HfApi, ModelCard, ModelCardData
from transformers import TrainerControl, TrainerState
from transformers.trainer_pt_utils import log_metrics, metrics_format, save_metrics, save_state
from transformers.utils import logging

from grouprl._version import __version__
from grouprl.config.grpo_config import GRPOConfig
from grouprl.core.metrics import JsonlWriter
from grouprl.data.prompt_sampler import TrainPromptBatches
from grouprl.model import quantization
from grouprl.model.adapters import save_pretrained
from grouprl.model.full_state import fsdp_sharded, gather_full_state
from grouprl.train import stages
from grouprl.train.callbacks import CallbackHandler
from grouprl.train.checkpoint import (
    ENGINE_STATE,
    TRAINER_STATE,
    TRAINING_ARGS,
    check_resumable,
    load_optimizer_state,
    load_policy_weights,
    load_training_state,
    restore_rng_state,
    save_model_files,
    state_bytes,
)
from grouprl.train.checkpoint_files import read_file
from grouprl.train.eval_data import eval_loader, pick_eval_dataset
from grouprl.train.training_run import deepspeed_engine

logger = logging.get_logger("grouprl")


GRPO_PAPER = ("DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models", "2402.03300")


class TrainerSurface:
    """Expects ``self.run`` (training_run.TrainingRun), ``self.args``, ``self.plan``, ``self.model``, ``self.state``,
    ``self.accelerator``, ``self.processing_class`` and ``self.eval_dataset``."""

    # ---- attributes, under Trainer's names -----------------------------------------------------------------

    @property
    def entropy_coef(self) -> float:
        """The entropy-bonus coefficient now: the adaptive controller's current value with use_adaptive_entropy."""
        controller = self.run.entropy_controller
        return controller.coef if controller is not None else self.args.entropy_coef

    @entropy_coef.setter
    def entropy_coef(self, value: float) -> None:
        if self.run.entropy_controller is None:
            raise ValueError(
                "entropy_coef can change only on a run with the entropy bonus on (GRPOConfig.entropy_coef != 0 or "
                "use_adaptive_entropy=True): with it off, the bonus term is not computed at all."
            )
        self.run.entropy_controller.coef = float(value)

    @property
    def _last_world_entropy(self) -> float:
        """The global mean entropy of the last optimizer step, as the adaptive controller saw it (inf before the
        first)."""
        controller = self.run.entropy_controller
        return controller.last_entropy if controller is not None else float("inf")

    @property
    def current_gradient_accumulation_steps(self) -> int:
        """The micro-batches of the current optimizer step, as Trainer's: gradient_accumulation_steps, fewer in an
        epoch's last step when the epoch's micro-batches are not a multiple of it (the loss divides by it). Set
        from the start, so an override reading it before the first step (eval_on_start) gets a value."""
        return self.run.accumulation_steps

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

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer (``optim`` / ``optimizers=``), as ``Trainer.optimizer``."""
        return self.run.optimizer

    @property
    def lr_scheduler(self) -> Any:
        """The learning-rate scheduler (``lr_scheduler_type``), as ``Trainer.lr_scheduler``."""
        return self.run.scheduler

    @property
    def callback_handler(self) -> CallbackHandler:
        """The ``transformers.CallbackHandler`` that calls every callback's events, as ``Trainer.callback_handler``."""
        return self.run.callbacks

    # TRL's tool and environment attributes, as read-only views of the agent (agents/agent.py, environments.py).
    @property
    def tools(self) -> list[Callable[..., Any]]:
        """The functions passed in tools=, then each environment's tool methods (bound to the instance probed at
        start-up) not listed yet: TRL's trainer.tools."""
        if getattr(self, "run", None) is None:  # made with object.__new__, as TRL's unit tests do: what was assigned
            return self.__dict__.get("_assigned_tools") or []
        agent = self.run.rollouts.agent
        functions = [t.fn for t in agent.spec.tools] if agent is not None else []
        environments = agent.spec.environments if agent is not None else None
        for tools in environments.tools.values() if environments is not None else ():
            functions += [t.fn for t in tools if t.fn not in functions]
        return functions

    @tools.setter
    def tools(self, value: Any) -> None:
        if getattr(self, "run", None) is not None:
            raise AttributeError(
                "GRPOTrainer.tools is read-only: the tools come from the tools= and environment_factory arguments, "
                "fixed when the trainer is built; build a new trainer to change them."
            )
        self.__dict__["_assigned_tools"] = value

    @property
    def environment_factories(self) -> Optional[dict[Optional[str], Callable[[], Any]]]:
        """{name: factory} ({None: factory} for a single one), or None without environment_factory."""
        environments = self._environments()
        return dict(environments.factories) if environments is not None else None

    @property
    def environments(self) -> Optional[list[Any]]:
        """The environment instances of the latest generation's rollouts, in row order (None before the first)."""
        environments = self._environments()
        return None if environments is None or environments.latest is None else list(environments.latest)

    @property
    def _env_tools(self) -> dict[Optional[str], list[Callable[..., Any]]]:
        """{environment name: the tool functions its rollouts are offered} (TRL's private attribute)."""
        return {name: [t.fn for t in tools] for name, tools in self._environments(required=True).tools.items()}

    @property
    def _environment_pool(self) -> dict[Optional[str], list[Any]]:
        """{environment name: its reusable instances, the probed one first} (TRL's private attribute)."""
        return {name: list(pool) for name, pool in self._environments(required=True).pools.items()}

    def _environments(self, required: bool = False) -> Any:
        agent = self.run.rollouts.agent
        environments = agent.spec.environments if agent is not None else None
        if environments is None and required:
            raise AttributeError("This trainer has no environment_factory, so no environment attributes (as in TRL).")
        return environments

    def add_callback(self, callback: Any) -> None:
        """Add a ``transformers.TrainerCallback`` (an instance or a class), as ``Trainer.add_callback``."""
        self.run.callbacks.add(callback)

    def pop_callback(self, callback: Any) -> Any:
        """Remove and return a callback (an instance, or the first instance of a class); None if it is not there."""
        return self.run.callbacks.pop(callback)

    def remove_callback(self, callback: Any) -> None:
        """Remove a callback (an instance, or the first instance of a class)."""
        self.run.callbacks.pop(callback)

    # ---- dataloaders ---------------------------------------------------------------------------------------

    def get_train_dataloader(self) -> TrainPromptBatches:
        """One epoch of this process's generation batches, as TRL's dataloader yields them: lists of dataset rows
        (one per completion, each prompt repeated for its completions), each repeated steps_per_generation x
        num_iterations times; the same lists training_step receives. Iterating walks the prompt order from the start
        of an epoch without moving training's position; ``num_workers`` / ``loader`` are those of the DataLoader that
        fetches training's rows (dataloader_num_workers)."""
        rollouts = self.run.rollouts
        return TrainPromptBatches(
            rollouts.sampler,
            tokenize=rollouts.tokenize,
            num_generations=self.args.num_generations,
            repeats=self.plan.steps_per_generation * self.plan.num_iterations,
            process_index=self.accelerator.process_index,
            num_processes=self.accelerator.num_processes,
            remove_unused_columns=self.args.remove_unused_columns,
            default_prompt=rollouts.settings.default_prompt,
        )

    def get_eval_dataloader(self, eval_dataset: Any = None) -> torch.utils.data.DataLoader:
        """The DataLoader evaluation reads (a name of a dict eval_dataset, a dataset, or None: the trainer's); a
        stream gets 0 workers."""
        return eval_loader(
            pick_eval_dataset(self.eval_dataset, eval_dataset), self.args, self.accelerator.num_processes
        )

    # ---- reporting -----------------------------------------------------------------------------------------

    # transformers' helpers take the trainer as `self`: identical files and console output.
    log_metrics = log_metrics
    save_metrics = save_metrics
    save_state = save_state
    metrics_format = staticmethod(metrics_format)

    def log(self, logs: dict[str, Any], start_time: Optional[float] = None) -> None:
        """Log `logs`: log_history (with epoch and step), the report_to trackers, the callbacks' on_log, metrics.jsonl
        and a console line; in training mode the metrics gathered since the last entry are merged in first
        (stages.own_log)."""
        stages.own_log(self.run, logs, start_time)

    def is_world_process_zero(self) -> bool:
        """Whether this is the main process of the whole launch."""
        return self.accelerator.is_main_process

    def is_local_process_zero(self) -> bool:
        """Whether this is the main process of its machine."""
        return self.accelerator.is_local_main_process

    @property
    def hub_model_id(self) -> str:
        """The Hub repository the model goes to: the one push_to_hub created (``owner/name``), else
        ``args.hub_model_id``, else output_dir's name (what Trainer creates the repository from)."""
        return (
            getattr(self, "_pushed_repo_id", None)
            or self.args.hub_model_id
            or Path(self.args.output_dir).absolute().name
        )

    @property
    def _logs(self) -> dict[str, Any]:
        """TRL's buffer of the latest generation batch (all processes): ``prompt``, ``completion``, ``advantages``,
        ``images`` (with log_multimodal), ``rewards[name]``, ``extra[column]``; see completion_log.RecentCompletions."""
        return self.run.rollouts.recent.logs

    @_logs.setter
    def _logs(self, logs: dict[str, Any]) -> None:  # a script may swap the whole dict, as with TRL's attribute
        self.run.rollouts.recent.logs = logs

    def create_model_card(
        self,
        model_name: Optional[str] = None,
        dataset_name: Optional[str] = None,
        tags: Union[str, list[str], None] = None,
    ) -> None:
        """Write a model card (README.md) to output_dir, as TRL's: front matter (base model, library, tags, datasets)
        and a description of the GRPO run. Main process only; no network access."""
        if not self.is_world_process_zero():
            return
        name_or_path = getattr(self.accelerator.unwrap_model(self.model).config, "_name_or_path", None) or None
        base_model = (
            name_or_path if name_or_path and not os.path.isdir(name_or_path) else None
        )  # a Hub id, not a local folder
        tags = {tags} if isinstance(tags, str) else set(tags or [])
        tags.update({"grouprl", "grpo"})
        if "JOB_ID" in os.environ:
            tags.add("hf_jobs")
        data = ModelCardData(
            base_model=base_model,
            library_name="transformers",
            model_name=model_name,
            tags=sorted(tags),
            datasets=[dataset_name] if dataset_name else None,
        )
        card = ModelCard(f"---\n{data.to_yaml()}\n---\n\n{self._model_card_body(model_name, base_model, dataset_name)}")
        os.makedirs(self.args.output_dir, exist_ok=True)
        card.save(os.path.join(self.args.output_dir, "README.md"))

    def _model_card_body(
        self, model_name: Optional[str], base_model: Optional[str], dataset_name: Optional[str]
    ) -> str:

        args, state = self.args, self.state
        title = model_name or Path(args.output_dir).absolute().name
        origin = (
            f"a fine-tuned version of [{base_model}](https://huggingface.co/{base_model})"
            if base_model
            else "a fine-tuned model"
        )
        data = f" on [{dataset_name}](https://huggingface.co/datasets/{dataset_name})" if dataset_name else ""
        settings = {
            "loss_type": args.loss_type,
            "num_generations": args.num_generations,
            "beta": args.beta,
            "learning_rate": args.learning_rate,
            "max_completion_length": args.max_completion_length,
            "optimizer steps": state.global_step,
        }
        title_paper, paper_id = GRPO_PAPER
        return "\n".join(
            [
                f"# Model card for {title}",
                "",
                f"This model is {origin}{data}, trained with reinforcement learning by GRPO (group relative policy "
                "optimization) with grouprl, a drop-in replacement for TRL's GRPOTrainer.",
                "",
                "## Quick start",
                "",
                "```python",
                "from transformers import pipeline",
                "",
                f'generator = pipeline("text-generation", model="{self.hub_model_id}")',
                'print(generator([{"role": "user", "content": "Hello!"}], max_new_tokens=128, '
                'return_full_text=False)[0]["generated_text"])',
                "```",
                "",
                "## Training procedure",
                "",
                f"GRPO, introduced in [{title_paper}](https://huggingface.co/papers/{paper_id}), samples a group of "
                "completions per prompt, scores them with reward functions and raises the likelihood of the "
                "completions that beat their group's mean.",
                "",
                *[f"- {key}: {value}" for key, value in settings.items()],
                "",
                "### Framework versions",
                "",
                f"- grouprl: {__version__}",
                f"- Transformers: {transformers.__version__}",
                f"- PyTorch: {torch.__version__}",
                f"- huggingface_hub: {huggingface_hub.__version__}",
                "",
                "## Citation",
                "",
                "```bibtex",
                "@article{shao2024deepseekmath,",
                f"  title   = {{{title_paper}}},",
                "  author  = {Shao, Zhihong and Wang, Peiyi and Zhu, Qihao and Xu, Runxin and Song, Junxiao and Zhang, "
                "Mingchuan and Li, Y. K. and Wu, Y. and Guo, Daya},",
                "  year    = {2024},",
                f"  eprint  = {{arXiv:{paper_id}}}",
                "}",
                "```",
                "",
            ]
        )

    def end(self) -> None:
        """Finish the report_to trackers and end the distributed process group (transformers' Trainer.end, which
        ``trl grpo`` calls last). Call it once, after everything that needs the
        other processes (save_model, push_to_hub)."""
        self.accelerator.end_training()

    # ---- saving --------------------------------------------------------------------------------------------

    def save_model(self, output_dir: Optional[str] = None) -> None:
        """Write the model and tokenizer (`from_pretrained`-loadable) to output_dir (default: args.output_dir)."""
        output_dir = output_dir or self.args.output_dir
        self.accelerator.wait_for_everyone()
        model = self.accelerator.unwrap_model(self.run.model)
        if deepspeed_engine(self.accelerator) is not None:  # ZeRO-3 gathers: every process takes part
            weights = self.accelerator.get_state_dict(self.run.model)
        else:
            weights = gather_full_state(model)[0] if fsdp_sharded(model) else None  # a collective: every process
        if self.accelerator.is_main_process:
            os.makedirs(output_dir, exist_ok=True)
            save_model_files(
                output_dir,
                lambda staging: [
                    ("the model's weights", lambda: save_pretrained(model, staging, weights)),  # LoRA: the adapter
                    ("the tokenizer", lambda: self.processing_class.save_pretrained(staging)),
                    (TRAINING_ARGS, lambda: torch.save(self.args, os.path.join(staging, TRAINING_ARGS))),  # as Trainer
                ],
                needed=lambda: state_bytes(model, weights, None),
            )

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
            path_or_fileobj=os.path.join(self.args.output_dir, "README.md"),
            path_in_repo="README.md",
            repo_id=self._pushed_repo_id,
            revision=kwargs.get("revision"),
            commit_message=commit_message,
        )
        return result

    def _load_checkpoint(self, path: str) -> None:
        training, loop_state = load_training_state(path)
        model = self.accelerator.unwrap_model(self.run.model)
        check_resumable(model, self.args, path)  # another model's or plan's checkpoint, named before anything loads
        engine = deepspeed_engine(self.accelerator)
        if engine is not None and training.get("optimizer_keys") == ENGINE_STATE:
            # each process its shards of the weights and the optimizer state (the schedule is grouprl's)
            # a 4-bit policy's module state holds bitsandbytes' quantization entries (weight.absmax, ...), which
            # DeepSpeed's strict load refuses as unexpected keys; the trained adapters load either way
            engine.load_checkpoint(
                os.path.join(path, ENGINE_STATE),
                tag=ENGINE_STATE,
                load_lr_scheduler_states=False,
                load_module_strict=not quantization.is_quantized(model),
            )
        else:
            load_policy_weights(model, path)
            load_optimizer_state(model, self.run.optimizer, training)
        self.run.scheduler.load_state_dict(training["scheduler"])
        restore_rng_state(training["rng"])
        self.run.load_loop_state(loop_state)
        processes = loop_state.get("processes")  # several processes: each one's RNG and buffered micro-batches
        if processes is not None:
            if len(processes) != self.accelerator.num_processes:
                raise ValueError(
                    f"Checkpoint {path} was written by {len(processes)} processes; resume it with the same number "
                    f"of processes (this run has {self.accelerator.num_processes})."
                )
            own = processes[self.accelerator.process_index]
            restore_rng_state(own["rng"])
            self.run.pending = deque(own["pending"])
            self.run.inputs = own.get("inputs")
        elif self.accelerator.num_processes > 1:  # written by one process (or a last-good save): its buffer is not ours
            logger.warning(
                f"{path} holds one process's buffered micro-batches; each of the {self.accelerator.num_processes} "
                "processes starts with a fresh generation instead."
            )
            self.run.pending.clear()
            self.run.inputs = None
        restored = read_file(path, TRAINER_STATE, TrainerState.load_from_json)  # a damaged file is named
        self.state.global_step, self.state.epoch, self.state.log_history = (
            restored.global_step,
            restored.epoch,
            restored.log_history,
        )
        self.state.total_flos, self.state.num_input_tokens_seen = restored.total_flos, restored.num_input_tokens_seen
        # the best so far, so that the run's later evaluations compare with it and rotation spares its checkpoint
        self.state.best_metric, self.state.best_global_step = restored.best_metric, restored.best_global_step
        self.state.best_model_checkpoint = restored.best_model_checkpoint
        if restored.best_model_checkpoint is not None and not os.path.isdir(restored.best_model_checkpoint):
            logger.warning(
                f"The best checkpoint {restored.best_model_checkpoint} recorded in {path} is gone; "
                "load_best_model_at_end and save_total_limit no longer know it."
            )
            self.state.best_model_checkpoint = None
        if self.args.restore_callback_states_from_checkpoint:
            self.run.callbacks.restore(restored.stateful_callbacks)
        if self.accelerator.is_main_process:  # drop what the interrupted run logged after this checkpoint
            JsonlWriter(os.path.join(self.args.output_dir, "metrics.jsonl")).rewrite(self.state.log_history)
        logger.warning(f"Resumed from {path} at step {self.state.global_step}.")


def trl_setting_copies(args: GRPOConfig, aux_loss_coef: float) -> dict[str, Any]:
    """The settings TRL's GRPOTrainer copies onto itself, under its names (read-only copies; the run uses args)."""
    names = (
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
    )
    return {
        **{name: getattr(args, name) for name in names},
        "num_generations_eval": args.num_generations_eval or args.num_generations,
        "chat_template_kwargs": args.chat_template_kwargs or {},
        "epsilon_low": args.epsilon,
        "epsilon_high": args.effective_epsilon_high,
        "router_aux_loss_coef": aux_loss_coef,
        "aux_loss_enabled": aux_loss_coef != 0.0,  # the MoE load-balancing loss is added to the objective
        "_entropy_bonus_enabled": args.entropy_bonus_enabled,
    }
