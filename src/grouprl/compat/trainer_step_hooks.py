"""TRL's override points of one micro-step, as methods of GRPOTrainer:

    training_step(model, inputs, num_items_in_batch)        every micro-step; `inputs` = the generation batch (rows)
      _prepare_inputs(generation_batch) -> micro-batch      buffers a generation's micro-batches (eval: one batch)
        _generate_and_score_completions(inputs) -> batch    one generation batch: completions, rewards, advantages
      compute_loss(model, inputs) -> _compute_loss(model, inputs) -> loss

The loop does not call these: it runs train/stages.py, which calls a subclass's override at the same point TRL
would. Each method here is grouprl's own stage with TRL's signature, what an override reaches through
``super()``; from there the chain goes on through the subclass's other overrides (stages.py).
"""

from __future__ import annotations

from typing import Any

import torch

from grouprl.core.types import TrainBatch
from grouprl.train import stages


class StepOverridePoints:
    """Expects ``self.run`` (training_run.TrainingRun)."""

    def training_step(self, model: torch.nn.Module, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        """One micro-step, as TRL: ``_prepare_inputs(inputs)`` -> ``compute_loss`` -> backward; returns the detached
        (gradient-accumulation-scaled) loss. `inputs` is this process's generation batch (``GenerationInputs``, a
        list of dataset rows), the same for every micro-step trained on that generation."""
        return stages.own_training_step(self.run, inputs)

    def _prepare_inputs(self, generation_batch: Any) -> TrainBatch:
        """Training: the next buffered micro-batch, generating (``_generate_and_score_completions``) when the buffer
        is empty; the batch is shuffled and cut into steps_per_generation micro-batches, replayed num_iterations
        times. Evaluation (model in eval mode): ``_generate_and_score_completions(generation_batch)`` itself."""
        return stages.own_prepare_inputs(self.run, generation_batch)

    def _generate_and_score_completions(self, inputs: Any) -> TrainBatch:
        """One generation batch made ready to train on: completions for `inputs` (each row a completion to sample),
        rewards, advantages, and (training) the old / reference logprobs and sampler weights it needs. Returns a
        ``TrainBatch`` (TRL's dict keys work on it)."""
        return stages.own_generate_and_score(self.run, inputs)

    def compute_loss(
        self, model: torch.nn.Module, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> torch.Tensor:
        """The loss of a micro-batch (``_compute_loss``); as TRL, outputs cannot be returned."""
        if return_outputs:
            raise ValueError("The GRPOTrainer does not support returning outputs")
        return stages.own_compute_loss(self.run, model, inputs)

    def _compute_loss(self, model: torch.nn.Module, inputs: Any) -> torch.Tensor:
        """Training: the GRPO loss of the micro-batch, scaled for gradient accumulation, metrics logged. Evaluation:
        the policy loss at ratio 1, without KL."""
        return stages.own_policy_loss(self.run, inputs)
