"""Which of TRL's override points a GRPOTrainer subclass replaced: the one record the stages consult.

A TRL user changes a step by overriding methods of TRL's trainer (`training_step`, `_prepare_inputs`,
`compute_loss`, ...). grouprl records, when train() or evaluate() starts, which of them are not grouprl's own
(defined by a subclass, or patched onto the class or the instance) and hands that record down. At each point a
stage calls the user's version, with TRL's arguments, if there is one, and otherwise runs its own next stage
directly: without overrides no stage calls back up into the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

# TRL's order: training_step -> _prepare_inputs -> _generate_and_score_completions (-> _generate,
# _calculate_rewards) ; compute_loss -> _compute_loss (-> _get_per_token_logps_and_entropies,
# get_high_entropy_mask, get_off_policy_mask) ; log ; evaluate
OVERRIDE_POINTS = (
    "training_step",
    "_prepare_inputs",
    "_generate_and_score_completions",
    "_generate",
    "_calculate_rewards",
    "compute_loss",
    "_compute_loss",
    "_get_per_token_logps_and_entropies",
    "get_high_entropy_mask",
    "get_off_policy_mask",
    "log",
    "evaluate",
)


@dataclass(frozen=True)
class Overrides:
    """The user's versions of TRL's override points, bound to their trainer, by name (OVERRIDE_POINTS); a point
    that is not overridden is absent."""

    methods: Mapping[str, Callable[..., Any]] = field(default_factory=dict)
    owner: str = "GRPOTrainer"  # the subclass's name, for error messages

    def __post_init__(self) -> None:
        unknown = sorted(set(self.methods) - set(OVERRIDE_POINTS))
        if unknown:
            raise ValueError(f"Overrides: {unknown} are not TRL override points grouprl calls ({OVERRIDE_POINTS}).")

    def get(self, name: str) -> Optional[Callable[..., Any]]:
        """The user's `name`, or None where grouprl's own stage runs."""
        return self.methods.get(name)

    def qualified(self, name: str) -> str:
        return f"{self.owner}.{name}"


NO_OVERRIDES = Overrides()
