"""GRPOTrainer's attributes as TRL's GRPOTrainer and transformers.Trainer have them.

`trl_setting_copies` lists the settings TRL keeps on the trainer; `TrainerAttributes` gives the run's
parts (optimizer, lr_scheduler, model_wrapped, control, callback_handler, the entropy coefficient) under
Trainer's names, and its add / pop / remove_callback.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from transformers import TrainerControl

from grouprl.config.grpo_config import GRPOConfig
from grouprl.train.callbacks import CallbackHandler


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
