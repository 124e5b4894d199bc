"""GRPOConfig: a ``transformers.TrainingArguments`` with TRL 1.16's GRPO fields.

Same names, same meanings, same defaults as ``trl.GRPOConfig`` (including TRL's overrides of the
TrainingArguments defaults: learning_rate=1e-6, logging_steps=10, gradient_checkpointing=True,
bf16=True unless fp16, remove_unused_columns=False), so ``HfArgumentParser``, TRL's ``TrlParser``,
YAML files and ``to_dict()`` / ``to_json_string()`` work as with TRL's.

Nothing is silently ignored: an inherited field grouprl does not honour is refused by name when set
(``training_arguments.py``), and a GRPO field whose feature is not built yet raises
NotImplementedError when set (``NOT_YET_BUILT``). As TRL, ``generation_batch_size`` and
``steps_per_generation`` are resolved for this launch's process count; ``BatchPlan`` holds every
derived size. The fields themselves, with their help texts, are declared in ``grpo_fields.py``; this module
adds what happens when a config is built.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, fields
from typing import Any

from transformers import TrainingArguments

# The checks and the batch plan live in their own modules; re-exported here, where the rest of grouprl imports them.
from grouprl.config.batch_plan import BatchPlan, plan_batches, resolve_steps
from grouprl.config.checks import (
    EVAL_STRATEGIES,
    NOT_YET_BUILT,
    SAVE_STRATEGIES,
    SCALE_REWARDS,
    dubious_combinations,
    no_accelerator,
    normalize_pad_to_multiple_of,
    normalize_scale_rewards,
    unknown_field_message,
    validate_config,
)
from grouprl.config.field_types import coerce_field_types
from grouprl.config.grpo_fields import GRPOFields
from grouprl.config.training_arguments import refused_settings

__all__ = [
    "BatchPlan",
    "DICT_FIELDS",
    "EVAL_STRATEGIES",
    "GRPOConfig",
    "NOT_YET_BUILT",
    "SAVE_STRATEGIES",
    "SCALE_REWARDS",
    "no_accelerator",
    "plan_batches",
    "resolve_steps",
    "unknown_field_message",
]

DICT_FIELDS = (
    "model_init_kwargs",
    "generation_kwargs",
    "chat_template_kwargs",
    "lr_scheduler_kwargs",
    "gradient_checkpointing_kwargs",
    "transformers_continuous_batching_config",
    "loss_kwargs",
)


@dataclass
class GRPOConfig(GRPOFields):
    """Configuration of a GRPO run: ``transformers.TrainingArguments`` plus TRL 1.16's GRPO fields.

    Field names, meanings and defaults follow TRL 1.16 (its overrides of TrainingArguments included).
    What grouprl does with each inherited TrainingArguments field is in ``grouprl.config.training_arguments``
    and docs/trl-compat.md: honoured, accepted without effect, or refused by name when set.
    """

    _VALID_DICT_FIELDS = TrainingArguments._VALID_DICT_FIELDS + [
        f for f in DICT_FIELDS if f not in TrainingArguments._VALID_DICT_FIELDS
    ]

    def __new__(cls, *args: Any, **kwargs: Any) -> "GRPOConfig":
        # Runs before the dataclass __init__, so a misspelt field gets a "did you mean" instead of
        # Python's bare "unexpected keyword argument" (the HF course writes num_generation=...).
        unknown = set(kwargs) - {f.name for f in fields(cls) if f.init}
        if unknown:
            raise TypeError(unknown_field_message(cls, sorted(unknown)[0]))
        return super().__new__(cls)

    def __post_init__(self) -> None:
        coerce_field_types(self)  # learning_rate="fast" refused here, not in the optimizer (field_types.py)
        if self.output_dir is None:
            self.output_dir = "trainer_output"
        # TRL's default; the trainer may decline it on CPUs without bf16 units. A copy (dataclasses.replace, a
        # to_dict round trip) passes the resolved bf16 with the original's flag, which holds while bf16 still has
        # the default's value.
        if self.bf16 is None:
            self.bf16_from_default = True
        else:
            self.bf16_from_default = bool(self.bf16_from_default) and self.bf16 == (not self.fp16)
        if self.bf16 is None:
            self.bf16 = not self.fp16
        if self.report_to is None:
            self.report_to = "none"
        if isinstance(self.report_to, str) and "," in self.report_to:  # the CLI's comma-separated form
            self.report_to = [t.strip() for t in self.report_to.split(",") if t.strip()]
        for name in DICT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, str):
                try:
                    setattr(self, name, json.loads(value))
                except json.JSONDecodeError as err:
                    raise ValueError(
                        f"GRPOConfig.{name} must be a dict or a JSON object string, got {value!r}: {err}"
                    ) from None
        if self.use_transformers_paged:  # TRL's deprecated name, turned into the new one as TRL does
            warnings.warn(
                "GRPOConfig.use_transformers_paged is deprecated (TRL 1.16); use use_transformers_continuous_batching.",
                FutureWarning,
                stacklevel=3,
            )
            self.use_transformers_continuous_batching = True
        refused = refused_settings(self)  # on the values as given, before transformers derives others from them
        if refused:
            raise ValueError("\n".join(refused))
        for old, new in (
            ("gradient_checkpointing", "activation_checkpointing"),
            ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"),
        ):
            if (
                getattr(self, new, "absent") is None
            ):  # TRL's name stays the primary one: no deprecation warning for its default
                setattr(self, new, getattr(self, old))
        super().__post_init__()
        if self.report_to == ["none"]:
            self.report_to = []
        self.scale_rewards = normalize_scale_rewards(self.scale_rewards)
        self.pad_to_multiple_of = normalize_pad_to_multiple_of(self.pad_to_multiple_of)
        if self.warmup_ratio is not None:
            self.warmup_steps = self.warmup_ratio
        if self.vllm_importance_sampling_cap is not None:
            self.vllm_importance_sampling_clip_max = self.vllm_importance_sampling_cap
        self.validate()
        # TRL resolves the generation batch here, for the process count of this launch; what the user
        # set is kept so that plan_batches can derive it again for any process count.
        self.batch_spec = (self.generation_batch_size, self.steps_per_generation)
        # accelerate's launcher sets WORLD_SIZE; on CPUs transformers' own count says 1 unless use_cpu=True.
        plan = plan_batches(self, max(self.world_size, int(os.environ.get("WORLD_SIZE", "1"))))
        self.generation_batch_size, self.steps_per_generation = (
            plan.completions_per_generation,
            plan.steps_per_generation,
        )

    def _validate_args(self) -> None:
        # transformers refuses bf16 without a bf16-capable accelerator unless use_cpu=True. grouprl trains on the
        # CPU when there is no accelerator and decides there whether bf16 pays (accelerator_setup.make_accelerator).
        wanted = self.bf16
        if wanted and not self.use_cpu and no_accelerator():
            self.bf16 = False
        try:
            super()._validate_args()
        finally:
            self.bf16 = wanted

    def validate(self) -> None:
        """Check every field that can be checked without knowing the model or the process count (config_checks.py)."""
        validate_config(self)

    @property
    def effective_epsilon_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def entropy_bonus_enabled(self) -> bool:
        return self.entropy_coef != 0.0 or self.use_adaptive_entropy

    def dubious_combinations(self) -> list[str]:
        """Warnings for settings that run but probably do not do what was meant (TRL's, plus a few)."""
        return dubious_combinations(self)
