"""The parts of one optimizer step, in the order the loop (loop.py) runs them.

    train_micro_batch       per micro-batch: trainer.compute_loss -> backward (called by trainer.training_step)
    clip_gradients          max_grad_norm; the norm before clipping
    reduce_statistics       every statistic of the step over every process, once; NaN / inf anywhere stops all
    apply_update            optimizer step, then the LR schedule
    end_of_step_updates     the controllers that act once per step: entropy coefficient, TR-DPO reference sync

Nothing here reads the host value of a tensor before `reduce_statistics`: one sync per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from grouprl.core.distributed import gather_objects
from grouprl.core.stats import finite, mean
from grouprl.model.reference import mix_into_reference
from grouprl.train.non_finite import non_finite_error
from grouprl.train.step_reduction import reduce_step
from grouprl.train.training_run import TrainingRun


@dataclass(frozen=True)
class StepStats:
    """The loop's own statistics of an optimizer step."""

    loss: Any = mean("loss")  # this process's summed micro-batch losses; logged as the mean over processes
    # the clipped-over norm: NaN / inf stops every process (None under fp16 scaling)
    grad_norm: Any = finite("gradients")


def train_micro_batch(run: TrainingRun, micro: Any) -> torch.Tensor:
    """Loss (trainer.compute_loss) and backward of one micro-batch; returns the (GA-scaled) loss, detached
    (no host sync)."""
    if len(micro) == 0:  # dynamic sampling kept fewer rows than micro-steps
        return torch.zeros((), device=run.accelerator.device)
    loss = run.trainer.compute_loss(run.model, micro)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(
            f"{type(run.trainer).__name__}.compute_loss must return the loss as a one-element tensor, got "
            f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}."
        )
    run.before_backward()
    with run.timer.phase("backward"):
        run.accelerator.backward(loss)
    run.count_flos(micro)
    return loss.detach().reshape(())


def as_loss(value: Any, device: torch.device) -> torch.Tensor:
    """training_step's result (TRL: a detached tensor; an override may return a number) as a 0-dim tensor."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(device=device, dtype=torch.float32).reshape(())
    return torch.tensor(float(value), device=device)


def clip_gradients(run: TrainingRun) -> torch.Tensor:
    """Clip to max_grad_norm; returns the norm before clipping (a tensor: read once the step is reduced)."""
    params = [p for p in run.model.parameters() if p.requires_grad]
    max_norm = run.config.max_grad_norm if run.config.max_grad_norm > 0 else float("inf")
    norm = run.accelerator.clip_grad_norm_(params, max_norm)
    if hasattr(norm, "full_tensor"):  # FSDP2: the norm of sharded gradients is a replicated DTensor
        norm = norm.full_tensor()
    return norm if isinstance(norm, torch.Tensor) else torch.tensor(float(norm))


def reduce_statistics(run: TrainingRun, step_stats: StepStats) -> list[Any]:
    """Every statistic of this optimizer step, over every process, in one reduction; raises the same
    NonFiniteError on every process if any process saw a NaN / inf (before the update). Returns the reduced
    entries, step_stats last."""
    run.ledger.record(step_stats)
    reduced, failures = reduce_step(run.ledger.take(), run.collectives)
    if failures:
        raise non_finite_error(
            failures,
            step=run.state.global_step + 1,
            process_index=run.accelerator.process_index,
            num_processes=run.accelerator.num_processes,
            gather=gather_objects,
        )
    return reduced


def apply_update(run: TrainingRun) -> float:
    """Optimizer step, then schedule; returns the learning rate used."""
    learning_rate = run.scheduler.get_last_lr()[0]
    run.fire("on_pre_optimizer_step")
    run.optimizer.step()
    run.fire("on_optimizer_step")
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    return learning_rate


def end_of_step_updates(run: TrainingRun, reduced: list[Any]) -> None:
    """Controllers that act once per optimizer step: the entropy coefficient (from the step's reduced entropy
    sums), the TR-DPO reference sync, the weights of an asynchronous generation worker."""
    controller, accelerator = run.entropy_controller, run.accelerator
    source, step = run.rollouts.source, run.state.global_step
    if source is not None and step % run.config.weight_sync_steps == 0:
        source.publish(accelerator.unwrap_model(run.model), step)
    if controller is not None:
        total = sum(getattr(entry, "entropy_sum", None) or 0.0 for entry in reduced)
        count = sum(getattr(entry, "entropy_count", None) or 0.0 for entry in reduced)
        run.window.add("entropy_coef", controller.end_step(total, count))
    if run.config.sync_ref_model and run.state.global_step % run.config.ref_model_sync_steps == 0:
        mix_into_reference(run.reference.model, accelerator.unwrap_model(run.model), run.config.ref_model_mixup_alpha)
