"""TRL 1.16's override points on GRPOTrainer, and the record of which ones a subclass replaces.

A TRL user subclasses ``GRPOTrainer`` and overrides methods of TRL's trainer. When a run starts, the trainer
records which of these are not its own (``_recorded_overrides``, core/overrides.py); the step's stages
(train/stages.py) call those with TRL's arguments at the same points of a step and use what they return, and
run grouprl's own stages everywhere else:

    training_step(model, inputs, num_items_in_batch)        every micro-step; `inputs` = the generation batch (rows)
      _prepare_inputs(generation_batch) -> micro-batch      buffers a generation's micro-batches (eval: one batch)
        _generate_and_score_completions(inputs) -> batch    one generation batch: completions, rewards, advantages
          _generate(prompts) -> TRL's 8-tuple               (called when overridden)
          _calculate_rewards(inputs, prompts, completions, completion_ids_list) -> (N_global, F)  (when overridden)
      compute_loss(model, inputs) -> _compute_loss(model, inputs) -> loss
        _get_per_token_logps_and_entropies(...)             (called when overridden; text models)
        get_high_entropy_mask(entropies, mask, threshold)   (top_entropy_quantile < 1)
        get_off_policy_mask(advantages, logps, behaviour_logps, mask, threshold)  (off_policy_mask_threshold set)
    log(logs, start_time)                                   every log entry (training, evaluation, end of training)
    evaluate()                                              scheduled evaluations during training

They are grouped by where they act: one micro-step (trainer_step_hooks.py), inside the loss
(trainer_loss_hooks.py), generation and rewards (trainer_generation_hooks.py); ``log`` is in
trainer_reporting.py, ``evaluate`` in trainer.py. `OverridePoints` combines them.

Batches are grouprl ``TrainBatch`` objects, which also answer TRL's dict keys (``batch["advantages"]``,
``batch["old_per_token_logps"] = ...``; see ``types.TRL_KEYS``). The three "when overridden" methods have
working defaults too (callable from an override through ``super()``), but grouprl's own path skips the
conversion to and from TRL's lists when nobody overrides them.

Methods of TRL's trainer (and of transformers.Trainer under it) that grouprl cannot honour are refused when a
subclass defines them (``__init_subclass__``; the list is trainer_refused_hooks.py), with the grouprl extension
point to use instead: an override is never silently skipped.
"""

from __future__ import annotations

from typing import Any

from grouprl.compat.trainer_generation_hooks import GenerationOverridePoints
from grouprl.compat.trainer_loss_hooks import LossOverridePoints
from grouprl.compat.trainer_refused_hooks import refuse_unsupported_overrides
from grouprl.compat.trainer_step_hooks import StepOverridePoints
from grouprl.core.overrides import OVERRIDE_POINTS, Overrides


class OverridePoints(StepOverridePoints, LossOverridePoints, GenerationOverridePoints):
    """GRPOTrainer's TRL override points (see the module docstring). Expects ``self.run`` (training_run.TrainingRun),
    ``self.accelerator``, ``self.args``, ``self.model``, ``self.state``, ``self.eos_token_ids``,
    ``self.processing_class``."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if vars(cls).get("_grouprl_surface"):  # GRPOTrainer itself: its versions are grouprl's own stages
            cls._grouprl_own = {name: getattr(cls, name) for name in OVERRIDE_POINTS}
            return
        refuse_unsupported_overrides(cls)

    def overrides(self, name: str) -> bool:
        """Whether `name` is not grouprl's own here: defined by a subclass, or patched onto the class or the
        instance."""
        surface = next(c for c in type(self).__mro__ if vars(c).get("_grouprl_surface"))  # GRPOTrainer
        own = surface.__dict__.get("_grouprl_own", {}).get(name)
        return name in vars(self) or getattr(type(self), name) is not own

    def _recorded_overrides(self) -> Overrides:
        """Which of TRL's override points this trainer replaces, bound to it (taken when train() or evaluate()
        starts, so a method patched onto the trainer after construction counts)."""
        methods = {name: getattr(self, name) for name in OVERRIDE_POINTS if self.overrides(name)}
        return Overrides(methods, owner=type(self).__name__)

    def _send_telemetry(self) -> None:
        """grouprl sends no telemetry (TRL pings the Hub from here); kept so an override that silences it runs."""
