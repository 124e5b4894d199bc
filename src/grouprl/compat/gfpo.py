"""GFPO: Group Filtered Policy Optimization (arXiv 2508.09726), TRL's experimental API (spec §4).

    trainer = GFPOTrainer(model, reward_funcs, args=GFPOConfig(num_generations=8, num_remains_in_group=4),
                          train_dataset=data, group_filter_func=shortest_k_filter)

Each generation samples G completions per prompt and scores them; ``group_filter_func`` scores the
completions of every group; the ``num_remains_in_group`` (k) highest-scoring ones of each group
are kept, advantages are computed over those k only (with ``scale_rewards`` and
``multi_objective_aggregation`` as in GRPO), and the other G - k rows leave the batch: they add no
tokens, no loss and no reward metrics. A generation therefore trains on k/G of its completions,
still split into ``steps_per_generation`` micro-batches. Evaluation does not filter. With several
processes a group may be cut by a process boundary: the filter sees it whole, and the kept rows are
dealt out evenly again (``distributed.keep_rows``), so groups x k must split into equal micro-batches.

Differences from TRL's last version, on purpose: the filter gets each group's own completions
(TRL sliced a wrong, overlapping window for every group but the first); rows where every reward
function returned None are handled as in GRPO; ``normalize_then_sum`` works; k must be >= 2
(with k = 1 every advantage is 0).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from transformers.utils import logging

from grouprl.compat.trainer import GRPOTrainer
from grouprl.config.grpo_config import GRPOConfig, plan_batches
from grouprl.core.distributed import gather_objects, layout_of
from grouprl.core.filters import group_filter_scores, reward_per_token_filter, shortest_k_filter, top_k_in_groups
from grouprl.core.types import Rewards, Rollout
from grouprl.data.prompts import is_conversational

logger = logging.get_logger("grouprl")

__all__ = ["GFPOConfig", "GFPOTrainer", "reward_per_token_filter", "shortest_k_filter"]


@dataclass
class GFPOConfig(GRPOConfig):
    """GRPOConfig plus ``num_remains_in_group`` (k): completions kept per group after filtering."""

    num_remains_in_group: Optional[int] = field(
        default=None,
        metadata={"help": "k: completions kept per group by group_filter_func (2 <= k < num_generations)."},
    )

    def validate(self) -> None:
        super().validate()
        k = self.num_remains_in_group
        if k is not None and not 2 <= k < self.num_generations:
            raise ValueError(
                f"GFPOConfig.num_remains_in_group={k} must be at least 2 (advantages need two completions to compare) "
                f"and smaller than num_generations={self.num_generations} (otherwise nothing is filtered)."
            )


@dataclass(frozen=True)
class TopKInGroups:
    """GFPO's row filter (RolloutMaker.row_filter): keep the k completions of each group that the filter scores highest.

    Gets this process's rollout and the global rewards; returns the (N_global,) keep mask. The filter sees each
    group's own completions, gathered from every process (a group may be cut by a process boundary).
    """

    group_filter_func: Callable[..., Any]
    num_remains_in_group: int

    def __call__(self, rollout: Rollout, rewards: Rewards) -> torch.Tensor:
        layout = layout_of(rollout.prompts)
        conversational = is_conversational(rollout.prompts.prompts[0])
        completions = [
            [{"role": "assistant", "content": c.text}] if conversational else c.text for c in rollout.completions
        ]
        completion_ids = [list(c.token_ids) for c in rollout.completions]
        if layout.num_processes > 1:  # global row order: every process's share, in process order
            completions = [c for part in gather_objects(completions) for c in part]
            completion_ids = [ids for part in gather_objects(completion_ids) for ids in part]
        totals = torch.nansum(rewards.per_function * rewards.weights.unsqueeze(0), dim=1)  # (N,) None counts as 0
        spans = [
            range(start, start + size) for start, size in zip(layout.group_starts(), layout.group_sizes)
        ]  # each group's own rows
        scores = group_filter_scores(
            self.group_filter_func,
            group_completions=[[completions[i] for i in span] for span in spans],
            group_rewards=[[float(totals[i]) for i in span] for span in spans],
            group_completion_ids=[[completion_ids[i] for i in span] for span in spans],
        )
        return top_k_in_groups(scores, self.num_remains_in_group)


class GFPOTrainer(GRPOTrainer):
    """GRPOTrainer that trains on the ``num_remains_in_group`` completions per group that
    ``group_filter_func`` scores highest (see the module docstring)."""

    def __init__(
        self,
        model: Any,
        reward_funcs: Any,
        args: Optional[GRPOConfig] = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        reward_processing_classes: Any = None,
        group_filter_func: Optional[Callable[..., Any]] = None,
        callbacks: Optional[list] = None,
        optimizers: tuple = (None, None),
        peft_config: Any = None,
        generation_backend: Any = None,
    ):
        k = getattr(args, "num_remains_in_group", None)
        if k is not None and group_filter_func is None:
            raise ValueError(
                f"GFPOConfig.num_remains_in_group={k} needs a group_filter_func, e.g. "
                "grouprl.compat.gfpo.shortest_k_filter."
            )
        if group_filter_func is not None and k is None:
            logger.warning(
                "GFPOTrainer got a group_filter_func but num_remains_in_group is None: no filtering, this is plain "
                "GRPO."
            )
        if k is not None:
            if not callable(group_filter_func):
                raise TypeError(f"group_filter_func must be callable, got {type(group_filter_func).__name__}.")
            _check_kept_rows_split(args, k)
        super().__init__(
            model,
            reward_funcs,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            reward_processing_classes=reward_processing_classes,
            callbacks=callbacks,
            optimizers=optimizers,
            peft_config=peft_config,
            generation_backend=generation_backend,
        )
        self.group_filter_func = group_filter_func
        if k is not None:
            self.run.rollouts.row_filter = TopKInGroups(group_filter_func, k)


def _check_kept_rows_split(args: GRPOConfig, k: int) -> None:
    """The kept rows (k per group) are dealt out again over the processes (GroupLayout); every process must get
    the same number of them, in steps_per_generation equal micro-batches."""
    # the launcher's process count, read as GRPOConfig reads it (no accelerate
    # state is created before the trainer's own)
    plan = plan_batches(args, max(args.world_size, int(os.environ.get("WORLD_SIZE", "1"))))
    groups = plan.prompts_per_generation
    kept, parts = groups * k, plan.num_processes * plan.steps_per_generation
    if kept % parts != 0:
        raise ValueError(
            f"GFPO keeps {kept} completions per generation ({groups} groups x num_remains_in_group={k}), which cannot "
            f"be split into steps_per_generation={plan.steps_per_generation} equal micro-batches on each of "
            f"{plan.num_processes} process(es). Choose num_remains_in_group or the batch so that groups x k is a "
            f"multiple of {parts}."
        )
