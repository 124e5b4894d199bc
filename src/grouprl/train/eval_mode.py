"""What the trainer's override points do in eval mode (model.training False, inside evaluate()).

``_generate_and_score_completions`` samples and scores one eval batch (`eval_batch`: no old or reference
logprobs, nothing buffered) and ``_compute_loss`` gives its policy loss at ratio 1 without KL
(`eval_loss`), both writing to the metric window of the evaluation running (`EvaluationPass`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from grouprl.core.losses import masked_mean, policy_loss
from grouprl.core.metrics import MetricWindow
from grouprl.core.overrides import NO_OVERRIDES, Overrides
from grouprl.core.stats import metrics
from grouprl.core.types import Rollout
from grouprl.data.prompt_sampler import GenerationInputs
from grouprl.model.logprobs import policy_logprobs
from grouprl.rollout.sampler import RolloutMaker
from grouprl.train.micro_step import LossStats, Objective, objective_stats
from grouprl.train.step_reduction import Collectives, reduce_step


@dataclass
class EvaluationPass:
    """What the trainer's eval-mode defaults use while an evaluation runs (the run's evaluation_pass)."""

    rollouts: RolloutMaker  # G_eval completions per prompt, its own counters
    window: MetricWindow  # the eval metrics


def current_pass(evaluation_pass: Optional[EvaluationPass]) -> EvaluationPass:
    if evaluation_pass is None:
        raise RuntimeError(
            "The trainer's model is in eval mode outside of evaluate(): its eval-mode steps "
            "(_generate_and_score_completions, _compute_loss) run inside trainer.evaluate(); call model.train() "
            "before training steps."
        )
    return evaluation_pass


def eval_batch(
    evaluation_pass: Optional[EvaluationPass], inputs: GenerationInputs, *, accelerator: Any, trainer_state: Any
) -> Any:
    """One eval batch sampled and scored (GRPOTrainer._generate_and_score_completions in eval mode): no old or
    reference logprobs, nothing buffered."""
    current = current_pass(evaluation_pass)
    prompts = inputs.prompt_batch
    with accelerator.autocast():
        rollout = Rollout(prompts, current.rollouts.generate(prompts))
    rollout, _, advantages = current.rollouts.score(rollout, trainer_state, current.window)
    return current.rollouts.make_train_batch(rollout, advantages)


def eval_loss(
    model: torch.nn.Module,
    batch: Any,
    objective: Objective,
    *,
    evaluation_pass: Optional[EvaluationPass],
    accelerator: Any,
    rows_per_chunk: int,
    overrides: Overrides = NO_OVERRIDES,
) -> torch.Tensor:
    """The policy loss at ratio 1 on eval samples (GRPOTrainer._compute_loss in eval mode); eval_entropy and
    the loss's statistics, reduced over the processes in one reduction, go to the eval window."""
    window = current_pass(evaluation_pass).window
    b = batch.to(accelerator.device)
    with torch.no_grad(), accelerator.autocast():
        out = policy_logprobs(
            model,
            b,
            temperature=objective.temperature,
            rows_per_chunk=rows_per_chunk,
            pack_prompts=objective.pack_shared_prompts,
            overrides=overrides,
        )
        loss, values = policy_loss(  # no reference pass in evaluation: no kl=, the KL term is left out
            objective.loss_type,
            out.logprobs,
            None,
            b.advantages,
            b.loss_mask,
            scale=objective.loss_scale(1, max(batch.num_loss_tokens, 1.0) / accelerator.num_processes),
            settings=objective.loss_settings,
            importance_sampling_level=objective.importance_sampling_level,
        )
    tokens = b.loss_mask.sum()
    stats = LossStats(
        tokens=tokens,
        rows=float(len(b)),
        entropy=masked_mean(out.entropy, b.loss_mask),  # model tokens only
        objective=objective_stats(values, tokens, float(len(b)), objective.sequence_level),
    )
    (reduced,), _ = reduce_step([stats], Collectives.of(accelerator))
    window.add_all(metrics(reduced))
    return loss
