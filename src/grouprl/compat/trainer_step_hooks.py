"""TRL's override points of one micro-step, the chain the loop runs through (loop.py):

    training_step(model, inputs, num_items_in_batch)        every micro-step; `inputs` = the generation batch (rows)
      _prepare_inputs(generation_batch) -> micro-batch      buffers a generation's micro-batches (eval: one batch)
        _generate_and_score_completions(inputs) -> batch    one generation batch: completions, rewards, advantages
      compute_loss(model, inputs) -> _compute_loss(model, inputs) -> loss

Each default is a grouprl stage: experience.py (generation), micro_step.py (the loss), eval_mode.py (both in
eval mode), optimizer_step.py (backward).
"""

from __future__ import annotations

from typing import Any

import torch

from grouprl.core.types import TrainBatch
from grouprl.data.generation_inputs import GenerationInputs
from grouprl.rollout import experience
from grouprl.train import eval_mode, optimizer_step
from grouprl.train import micro_step as objective


class StepOverridePoints:
    """Expects ``self.run`` (training_run.TrainingRun), ``self.accelerator``, ``self.args``, ``self.model``,
    ``self.state``."""

    def training_step(self, model: torch.nn.Module, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        """One micro-step, as TRL: ``_prepare_inputs(inputs)`` -> ``compute_loss`` -> backward; returns the detached
        (gradient-accumulation-scaled) loss. `inputs` is this process's generation batch (``GenerationInputs``, a
        list of dataset rows), the same for every micro-step trained on that generation."""
        micro = self._prepare_inputs(inputs)
        return optimizer_step.train_micro_batch(self.run, micro)

    def _prepare_inputs(self, generation_batch: Any) -> TrainBatch:
        """Training: the next buffered micro-batch, generating (``_generate_and_score_completions``) when the buffer
        is empty; the batch is shuffled and cut into steps_per_generation micro-batches, replayed num_iterations
        times. Evaluation (model in eval mode): ``_generate_and_score_completions(generation_batch)`` itself."""
        if not self.model.training:
            return self._generate_and_score_completions(generation_batch)
        run = self.run
        if not run.pending:
            batch = self._generate_and_score_completions(generation_batch)
            if not isinstance(batch, TrainBatch):
                raise TypeError(
                    f"{type(self).__name__}._generate_and_score_completions must return the grouprl TrainBatch its "
                    f"super() returned (it takes TRL's keys: batch['advantages'] = ...), got {type(batch).__name__}."
                )
            run.pending.extend(
                experience.split_generation(
                    batch, run.plan, loss_type=self.args.loss_type, top_entropy_quantile=self.args.top_entropy_quantile
                )
            )
            self.state.num_input_tokens_seen = run.rollouts.tokens_seen
        return run.pending.popleft().to(self.accelerator.device)

    def _generate_and_score_completions(self, inputs: Any) -> TrainBatch:
        """One generation batch made ready to train on: completions for `inputs` (each row a completion to sample),
        rewards, advantages, and (training) the old / reference logprobs and sampler weights it needs. Returns a
        ``TrainBatch`` (TRL's dict keys work on it)."""
        if not isinstance(inputs, GenerationInputs) or inputs.prompt_batch is None:
            raise TypeError(
                f"_generate_and_score_completions needs the generation batch grouprl passed to training_step / "
                f"_prepare_inputs (a grouprl GenerationInputs), got {type(inputs).__name__}; pass it on unchanged."
            )
        run = self.run
        if not self.model.training:
            return eval_mode.eval_batch(
                run.evaluation_pass, inputs, accelerator=self.accelerator, trainer_state=self.state
            )
        batch, stats = experience.score_generation(
            run.sampling(), run.model, inputs, hooks=self, reference=run.reference
        )
        run.ledger.record(stats)  # reduced with the rest of the optimizer step's statistics (optimizer_step.py)
        return batch

    def compute_loss(
        self, model: torch.nn.Module, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> torch.Tensor:
        """The loss of a micro-batch (``_compute_loss``); as TRL, outputs cannot be returned."""
        if return_outputs:
            raise ValueError("The GRPOTrainer does not support returning outputs")
        return self._compute_loss(model, inputs)

    def _compute_loss(self, model: torch.nn.Module, inputs: Any) -> torch.Tensor:
        """Training: the GRPO loss of the micro-batch, scaled for gradient accumulation, metrics logged
        (objective.micro_batch_loss). Evaluation: the policy loss at ratio 1, without KL (eval_mode.eval_loss)."""
        run = self.run
        if not self.model.training:
            return eval_mode.eval_loss(
                run.model,
                inputs,
                run.objective,
                evaluation_pass=run.evaluation_pass,
                hooks=self,
                accelerator=self.accelerator,
                rows_per_chunk=self.args.per_device_eval_batch_size,
            )
        controller = run.entropy_controller
        loss, stats = objective.micro_batch_loss(
            run.model,
            inputs,
            run.objective,
            hooks=self,
            device=self.accelerator.device,
            autocast=self.accelerator.autocast(),
            timer=run.timer,
            entropy_coef=controller.applied_coef() if controller is not None else None,
        )
        run.ledger.record(stats)  # reduced with the rest of the optimizer step's statistics (optimizer_step.py)
        return loss
