"""GRPOTrainer's attributes as TRL's GRPOTrainer and transformers.Trainer have them.

`mirror_trl_settings` copies the settings TRL keeps on the trainer; `TrainerAttributes` gives the run's
parts (optimizer, lr_scheduler, model_wrapped, control, callback_handler, the entropy coefficient) under
Trainer's names, and its add / pop / remove_callback.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from transformers import TrainerControl

from grouprl.config.grpo_config import GRPOConfig
from grouprl.train.callbacks import CallbackHandler

if TYPE_CHECKING:
    from grouprl.compat.trainer import GRPOTrainer


class TrainerAttributes:
    """Expects ``self.run`` (training_run.TrainingRun) and ``self.args``."""

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

    def add_callback(self, callback: Any) -> None:
        """Add a ``transformers.TrainerCallback`` (an instance or a class), as ``Trainer.add_callback``."""
        self.run.callbacks.add(callback)

    def pop_callback(self, callback: Any) -> Any:
        """Remove and return a callback (an instance, or the first instance of a class); None if it is not there."""
        return self.run.callbacks.pop(callback)

    def remove_callback(self, callback: Any) -> None:
        """Remove a callback (an instance, or the first instance of a class)."""
        self.run.callbacks.pop(callback)


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
