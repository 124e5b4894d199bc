"""GRPOConfig's last fields: the loss, logging, tools, and grouprl's own extensions.

TRL 1.16's names, defaults and help texts (sections 1.5 to 1.7 of its GRPOConfig), in its declaration
order, which ``--help`` and docs/trl-compat.md follow, then the fields grouprl adds. ``GRPOConfig``
inherits them as a mixin.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union


def _meta(help_text: str, **extra: Any) -> dict[str, Any]:
    return {"help": help_text, **extra}


@dataclass
class LossAndLoggingFields:
    """The loss, logging and tool fields of TRL, then grouprl's extensions."""

    # ---- loss (TRL §1.5) ----
    num_iterations: int = field(default=1, metadata=_meta("mu: optimization passes over each generation batch."))
    epsilon: float = field(default=0.2, metadata=_meta("Lower clip range: ratio >= 1 - epsilon."))
    epsilon_high: Optional[float] = field(
        default=None, metadata=_meta("Upper clip range (default: epsilon); DAPO suggests 0.28.")
    )
    delta: Optional[float] = field(default=None, metadata=_meta("Two-sided clipping cap on the unclipped ratio."))
    loss_type: str = field(default="dapo", metadata=_meta("grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo or vespo."))
    importance_sampling_level: str = field(default="token", metadata=_meta("token or sequence (GSPO)."))
    sapo_temperature_pos: float = field(default=1.0, metadata=_meta("SAPO gate temperature for positive advantages."))
    sapo_temperature_neg: float = field(
        default=1.05, metadata=_meta("SAPO gate temperature for non-positive advantages.")
    )
    vespo_k_pos: float = field(default=2.0, metadata=_meta("VESPO k for A >= 0."))
    vespo_lambda_pos: float = field(default=3.0, metadata=_meta("VESPO lambda for A >= 0."))
    vespo_k_neg: float = field(default=3.0, metadata=_meta("VESPO k for A < 0."))
    vespo_lambda_neg: float = field(default=2.0, metadata=_meta("VESPO lambda for A < 0."))
    reward_weights: Optional[list[float]] = field(
        default=None, metadata=_meta("One weight per reward function (default: all 1).")
    )
    multi_objective_aggregation: str = field(
        default="sum_then_normalize", metadata=_meta("sum_then_normalize or normalize_then_sum (GDPO).")
    )
    scale_rewards: str = field(default="group", metadata=_meta("group (or true), batch, none (or false)."))
    mask_truncated_completions: bool = field(
        default=False, metadata=_meta("Exclude completions that hit max_completion_length from the loss.")
    )
    top_entropy_quantile: float = field(
        default=1.0, metadata=_meta("Train only on the top-rho highest-entropy tokens.")
    )
    entropy_coef: float = field(default=0.0, metadata=_meta("Entropy bonus coefficient."))
    use_adaptive_entropy: bool = field(default=False, metadata=_meta("Adaptive entropy controller."))
    entropy_coef_min: float = field(default=0.0, metadata=_meta("Controller lower bound."))
    entropy_coef_max: float = field(default=1.0, metadata=_meta("Controller upper bound."))
    entropy_coef_delta: float = field(default=0.005, metadata=_meta("Controller step."))
    entropy_target: float = field(default=0.2, metadata=_meta("Controller target entropy (nats)."))
    off_policy_mask_threshold: Optional[float] = field(
        default=None, metadata=_meta("Drop negative-advantage sequences that drifted more than this.")
    )
    use_bias_correction_kl: bool = field(
        default=True, metadata=_meta("Multiply the per-token KL by the importance ratio.")
    )

    # ---- logging (TRL §1.6) ----
    log_completions: bool = field(default=False, metadata=_meta("Log a table of completions."))
    log_multimodal: bool = field(default=True, metadata=_meta("Include images in completion logs."))
    num_completions_to_print: Optional[int] = field(
        default=None, metadata=_meta("Rows of the completion table to print.")
    )
    log_unique_prompts: bool = field(default=False, metadata=_meta("Deduplicate prompts in tracker tables."))
    log_completions_hub_repo: Optional[str] = field(
        default=None, metadata=_meta("Hub dataset repo for completion logs.")
    )

    # ---- tools (TRL §1.7) ----
    max_tool_calling_iterations: Optional[int] = field(
        default=None,
        metadata=_meta(
            "Maximum tool-calling rounds per rollout (None = until the model stops calling tools or "
            "max_completion_length is used up)."
        ),
    )

    # ---- grouprl extensions (not in TRL) ----
    loss_kwargs: Optional[Union[dict, str]] = field(
        default=None,
        metadata=_meta(
            "Hyper-parameters of the loss_type's own objective (a loss added with grouprl.register_loss(..., "
            "params=...)); JSON on the CLI."
        ),
    )
    advantage_estimator: str = field(
        default="grpo",
        metadata=_meta(
            "How rewards become advantages: 'grpo' (group-relative, scale_rewards / multi_objective_aggregation) or a "
            "name added with "
            "grouprl.register_advantage."
        ),
    )
    dynamic_sampling: bool = field(
        default=False,
        metadata=_meta(
            "DAPO dynamic sampling: drop groups whose rewards all tie and refill the generation batch from further "
            "generations."
        ),
    )
    max_dynamic_sampling_rounds: int = field(
        default=4,
        metadata=_meta(
            "With dynamic_sampling: at most this many extra generations per batch; if the batch is still not full, "
            "train on the groups found."
        ),
    )
    # Derived, but a field so that dataclasses.replace / to_dict round trips keep it (replace passes the resolved bf16).
    bf16_from_default: Optional[bool] = field(
        default=None,
        repr=False,
        metadata=_meta(
            "Set by the config, not meant to be passed: True when bf16 was left at TRL's default, which grouprl "
            "declines on a CPU "
            "without bf16 units (fp32 instead); an explicit bf16=True is kept."
        ),
    )
