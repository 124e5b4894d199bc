"""TRL's asynchronous GRPO API (``trl.experimental.async_grpo``): ``AsyncGRPOConfig`` and ``AsyncGRPOTrainer``.

    from grouprl import AsyncGRPOConfig, AsyncGRPOTrainer   # was: from trl.experimental.async_grpo import ...

``AsyncGRPOConfig`` is a ``GRPOConfig`` with ``async_generation=True`` and TRL's async field names and defaults:
max_staleness=4, max_inflight_tasks=-1 (auto), queue_maxsize=1024, weight_sync_steps=1, request_timeout=600,
weight_sync_timeout=1800, heartbeat_stale_after_s=300, vllm_server_base_url="http://localhost:8000",
max_completion_length=2048, logging_steps=1, lr_scheduler_type="constant", dtype="float32",
ignore_data_skip=True. As in TRL, the worker is the server at vllm_server_base_url (`vllm serve`, or
`grouprl serve`); set async_worker="local" (or vllm_server_base_url=None) to let the trainer start a
`grouprl serve` worker itself. TRL fields grouprl cannot honour are accepted at their defaults only:
token_budget (grouprl cuts micro-batches by rows, TRL's token_budget <= 0 behaviour) and
fork_threshold_tokens (grouprl's multi-turn rollouts never re-tokenize, so nothing forks).
``AsyncGRPOTrainer`` takes TRL's arguments, in TRL's order; custom ``rollout_worker`` / ``weight_transfer``
objects are refused by name (the worker is a generation server).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

from grouprl.compat.trainer import GRPOTrainer
from grouprl.config.grpo_config import GRPOConfig


@dataclass
class AsyncGRPOConfig(GRPOConfig):
    """GRPOConfig preset for asynchronous generation, with trl.experimental.async_grpo's names and defaults."""

    async_generation: bool = field(
        default=True, metadata={"help": "AsyncGRPOConfig: always True (set on GRPOConfig to choose)."}
    )
    max_completion_length: int = field(default=2048, metadata={"help": "Maximum new tokens per completion."})
    logging_steps: float = field(default=1, metadata={"help": "Log every N optimizer steps (TRL async default 1)."})
    lr_scheduler_type: Union[str, Any] = field(
        default="constant",
        metadata={"help": "Learning-rate schedule (TRL async default: constant; set max_steps for a decay)."},
    )
    ignore_data_skip: bool = field(
        default=True,
        metadata={
            "help": "TRL async default True; either value: grouprl restores the prompt order exactly on resume "
            "(the batches drawn ahead of training are regenerated first), nothing is skipped or replayed."
        },
    )
    vllm_server_base_url: Optional[str] = field(
        default="http://localhost:8000",
        metadata={"help": "The generation worker's URL (`vllm serve` or `grouprl serve`); None: a local worker."},
    )
    dtype: str = field(
        default="float32",
        metadata={
            "help": "dtype the model is loaded in (auto, bfloat16, float16, float32); a dtype in model_init_kwargs "
            "wins."
        },
    )
    token_budget: Optional[int] = field(
        default=None,
        metadata={
            "help": "Accepted at None only: grouprl micro-batches hold per_device_train_batch_size rows (TRL's "
            "token_budget <= 0), token-budgeted micro-batches are not built."
        },
    )
    fork_threshold_tokens: int = field(
        default=1024,
        metadata={
            "help": "Accepted at 1024 only: grouprl's multi-turn rollouts keep the sampled tokens and never "
            "re-tokenize the conversation, so there is no drift to fork on."
        },
    )

    def __post_init__(self) -> None:
        skip = self.ignore_data_skip
        self.ignore_data_skip = False  # grouprl's resume is exact either way (the TrainingArguments check)
        super().__post_init__()
        self.ignore_data_skip = skip
        if not self.async_generation:
            raise ValueError("AsyncGRPOConfig.async_generation must stay True; use GRPOConfig for synchronous GRPO.")
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError(f"AsyncGRPOConfig.dtype={self.dtype!r}: use auto, bfloat16, float16 or float32.")
        if self.token_budget is not None:
            raise NotImplementedError(
                f"AsyncGRPOConfig.token_budget={self.token_budget!r}: token-budgeted micro-batches are not built in "
                "grouprl (micro-batches hold per_device_train_batch_size rows). Leave token_budget at None."
            )
        if self.fork_threshold_tokens != 1024:
            raise NotImplementedError(
                f"AsyncGRPOConfig.fork_threshold_tokens={self.fork_threshold_tokens}: grouprl's multi-turn rollouts "
                "never re-tokenize a conversation, so there is nothing to fork. Leave it at 1024."
            )
        kwargs = dict(self.model_init_kwargs or {})
        if "dtype" not in kwargs and "torch_dtype" not in kwargs:
            self.model_init_kwargs = {**kwargs, "dtype": self.dtype}


class AsyncGRPOTrainer(GRPOTrainer):
    """Drop-in for ``trl.experimental.async_grpo.AsyncGRPOTrainer``: GRPOTrainer with asynchronous generation."""

    def __init__(
        self,
        model: Any,
        reward_funcs: Union[Callable, list[Callable], None] = None,
        args: Optional[GRPOConfig] = None,
        train_dataset: Any = None,
        processing_class: Any = None,
        callbacks: Optional[list] = None,
        optimizers: tuple = (None, None),
        peft_config: Any = None,
        tools: Optional[list] = None,
        environment_factory: Any = None,
        rollout_worker: Any = None,
        weight_transfer: Any = None,
        **grouprl_arguments: Any,
    ):
        for name, value in (("rollout_worker", rollout_worker), ("weight_transfer", weight_transfer)):
            if value is not None:
                raise NotImplementedError(
                    f"AsyncGRPOTrainer({name}=...): custom rollout workers and weight transfers are not built in "
                    "grouprl; the worker is a generation server (vllm_server_base_url) or a local `grouprl serve` "
                    "(async_worker='local')."
                )
        if args is None:
            name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "model")
            args = AsyncGRPOConfig(output_dir=f"{str(name).rstrip('/').split('/')[-1] or 'model'}-AsyncGRPO")
        if not args.async_generation:
            raise ValueError("AsyncGRPOTrainer needs async_generation=True (an AsyncGRPOConfig).")
        super().__init__(
            model,
            reward_funcs,
            args=args,
            train_dataset=train_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            peft_config=peft_config,
            tools=tools,
            environment_factory=environment_factory,
            **grouprl_arguments,
        )
